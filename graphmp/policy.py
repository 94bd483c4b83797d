"""Precision policy: which ONNX ops run in FP16, which stay FP32, and what the
ONNX schemas allow.

Op classes:
  fp16    compute Tensor Cores accelerate
  fp32    reductions and range-sensitive math
  follow  runs in the precision of its neighbourhood
  clear   data movement; never forces a Cast
  fixed   output type fixed by an attribute or a subgraph (Cast, ConstantOfShape,
          Random*, EyeLike, If/Loop/Scan, ...): never retyped, consumers get Casts
Ops in none of these lists, and custom-domain ops other than ONNX Runtime's fused
com.microsoft ops of MS_OP_CLASS (below), are 'unknown' and stay FP32.
"""
from __future__ import annotations

import functools

from onnx import TensorProto, defs

from .errors import GraphmpError

FP16_OPS = frozenset({
    "Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "LSTM", "GRU", "RNN", "Attention",
})
FP32_OPS = frozenset({
    "Softmax", "LogSoftmax", "LayerNormalization", "GroupNormalization", "InstanceNormalization",
    "ReduceSum", "ReduceMean", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
    "ReduceSumSquare", "ReduceProd", "Exp", "Log", "Pow", "Reciprocal", "CumSum", "Range",
    "NonMaxSuppression", "RoiAlign", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
    "LpNormalization", "MeanVarianceNormalization", "LRN", "Hardmax",
})
# FP32-class ops that may read and write the low type where they sit between low-precision
# work (classify's "norm" class, --norm-io): their kernels accumulate in FP32 and round
# once (ONNX Runtime CPU and CUDA, TensorRT; LayerNormalization's stash_type=1 says so in
# the spec), so an FP32 island around them buys only the rounding of an output the next
# FP16 op rounds anyway, at the price of two Casts of the full tensor. Measured when
# --norm-io was added (no script in benchmarks/ repeats it): Softmax islands buy nothing;
# LayerNormalization islands keep a post-LN encoder's residual stream FP32 (BERT: 2.5x
# lower error), so LayerNormalization goes low only with --norm-io all.
NORM_IO = {"softmax": frozenset({"Softmax", "LogSoftmax"}),
           "all": frozenset({"Softmax", "LogSoftmax", "LayerNormalization"}),
           "fp32": frozenset()}
FOLLOW_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Sqrt", "Erf", "Gelu", "Sigmoid", "Tanh", "AveragePool",
    "GlobalAveragePool", "BatchNormalization", "Resize", "Upsample", "Where", "Clip",
    "Neg", "Abs", "Max", "Min", "Sum", "Mean", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu",
    "HardSigmoid", "HardSwish", "Softplus", "Softsign", "Mish", "ThresholdedRelu",
    "Sin", "Cos", "Floor", "Ceil", "Round", "Sign", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "IsNaN", "IsInf", "LpPool", "GlobalLpPool",
})
CLEAR_OPS = frozenset({
    "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Split", "Slice",
    "Gather", "GatherElements", "GatherND", "ScatterND", "ScatterElements", "Pad", "Identity",
    "Relu", "MaxPool", "GlobalMaxPool", "TopK", "Shape", "Size", "Expand", "Tile",
    "DepthToSpace", "SpaceToDepth", "Dropout", "ReduceMax", "ReduceMin", "ArgMax", "ArgMin",
    "Trilu", "ReverseSequence", "Compress", "NonZero",
})
FIXED_OPS = frozenset({
    "Cast", "CastLike", "Constant", "ConstantOfShape", "RandomNormal", "RandomUniform",
    "RandomNormalLike", "RandomUniformLike", "EyeLike", "Bernoulli", "Multinomial",
    "If", "Loop", "Scan", "SequenceConstruct", "SequenceAt", "SequenceInsert", "SplitToSequence",
    "ConcatFromSequence", "Optional", "OptionalGetElement",
    # quantization boundaries: their float side is the quantizer's choice, never retyped
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear",
})

# Inputs that stay in their original type even when the node runs in FP16
# (a spec-allowed separate type variable that should keep FP32 range/precision).
KEEP_INPUTS = {
    "BatchNormalization": {1, 2, 3, 4},  # BN-15: scale/bias T1, mean/var T2
    "Resize": {1, 2},                    # roi, scales
    "Upsample": {1},
}

LOW_TYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
# Channel/GEMM padding multiples graphmp accepts (8: FP16 Tensor Cores; 64: A100/H100 tiles).
PAD_MULTIPLES = (2, 4, 8, 16, 32, 64, 128)
# integer types whose every value FP16 and BF16 hold exactly (|x| <= 255): a Cast to FLOAT
# from them (a one-hot, a mask) may cast to the low type directly
EXACT_IN_LOW = frozenset({TensorProto.BOOL, TensorProto.INT8, TensorProto.UINT8})
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
TYPE_STR = {v: f"tensor({k.lower()})" for k, v in TensorProto.DataType.items() if v}
STR_TYPE = {s: v for v, s in TYPE_STR.items()}


# ONNX Runtime's fused contrib ops (graphmp convert --fuse ort). Their CUDA kernels read
# and write T and keep statistics/softmax in FP32 inside, as graphmp.fused_ops does for
# the oracle. Attention is Tensor Core work; the Gelus follow their neighbours. The
# fused normalisations keep graphmp's LayerNormalization policy, FP32: they carry the
# residual stream, and in FP16 (ORT's float16 plan) every layer re-rounds it, which
# costs tiny BERT 2-3x the error of graphmp's plan (benchmarks/fuse.py); --fp16-nodes
# on their names lowers them for speed. Inputs typed M/T1 (int32 masks, ids) and
# outputs typed U (tensor(float) mean/inv_std_var) keep their types (the schema's).
MS_DOMAIN = "com.microsoft"
MS_OP_CLASS = {
    "Attention": "fp16", "MultiHeadAttention": "fp16",
    "SkipLayerNormalization": "fp32", "SkipSimplifiedLayerNormalization": "fp32", "EmbedLayerNormalization": "fp32",
    "BiasGelu": "follow", "FastGelu": "follow", "Gelu": "follow", "QuickGelu": "follow",
}  # each has a reference in graphmp.fused_ops (the oracle); ops without an ORT CPU kernel (BiasAdd,
#    GemmFastGelu, ...) have none and stay FP32


def norm_io(node, mode: str) -> bool:
    """Under --norm-io `mode`, the node may read and write the low type between
    low-precision work (a LayerNormalization only with stash_type 1: FP32 statistics)."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in NORM_IO[mode]:
        return False
    return node.op_type != "LayerNormalization" or node.attr("stash_type") in (None, 1)


def op_class(op_type: str, domain: str) -> str:
    """Class of an op: 'fp16', 'fp32', 'follow', 'clear', 'fixed' or 'unknown'."""
    if domain == MS_DOMAIN:
        return MS_OP_CLASS.get(op_type, "unknown")
    if domain not in ("", "ai.onnx"):
        return "unknown"
    for cls, table in (("fp16", FP16_OPS), ("fp32", FP32_OPS), ("follow", FOLLOW_OPS),
                       ("clear", CLEAR_OPS), ("fixed", FIXED_OPS)):
        if op_type in table:
            return cls
    return "unknown"


@functools.lru_cache(maxsize=None)
def get_schema(op_type: str, domain: str, version: int):
    """The schema in force at `version`, or None for custom/unknown ops (com.microsoft
    ops of MS_OP_CLASS: ONNX Runtime's own schema, see _ms_schema)."""
    if domain == MS_DOMAIN:
        return _ms_schema(op_type) if op_type in MS_OP_CLASS else None
    try:
        return defs.get_schema(op_type, version, "" if domain == "ai.onnx" else domain)
    except Exception:  # onnx raises SchemaError (a RuntimeError subclass) for unknown ops
        return None


class _Formal:
    def __init__(self, p):
        self.type_str = p.typeStr
        self.option = defs.OpSchema.FormalParameterOption.__members__[p.option.name]


class _TypeConstraint:
    def __init__(self, c):
        self.type_param_str, self.allowed_type_strs = c.type_param_str, tuple(c.allowed_type_strs)


class _MsSchema:
    """ONNX Runtime's schema of a contrib op, with the attributes of onnx's OpSchema that
    graphmp reads (inputs/outputs .type_str/.option, type_constraints, since_version)."""

    def __init__(self, s):
        self.name, self.domain, self.since_version = s.name, s.domain, s.since_version
        self.inputs = [_Formal(p) for p in s.inputs]
        self.outputs = [_Formal(p) for p in s.outputs]
        self.type_constraints = [_TypeConstraint(c) for c in s.type_constraints]


@functools.lru_cache(maxsize=None)
def _ms_schemas() -> dict:
    """{op_type: newest com.microsoft schema} of MS_OP_CLASS's ops in this onnxruntime.
    (onnx.defs does not know contrib ops; onnxruntime is a dependency anyway.)"""
    try:
        from onnxruntime.capi import _pybind_state as C
        found = [s for s in C.get_all_operator_schema() if s.domain == MS_DOMAIN and s.name in MS_OP_CLASS]
    except (ImportError, AttributeError):  # a minimal onnxruntime build without schemas
        return {}
    out = {}
    for s in sorted(found, key=lambda s: s.since_version):
        out[s.name] = _MsSchema(s)
    return out


def _ms_schema(op_type: str):
    return _ms_schemas().get(op_type)


@functools.lru_cache(maxsize=None)
def _constraints(schema) -> dict:
    return {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}


def _formal(params, i):
    """Formal parameter for actual position i (handles a trailing variadic)."""
    if i < len(params):
        return params[i]
    if params and params[-1].option == defs.OpSchema.FormalParameterOption.Variadic:
        return params[-1]
    return None


def bindings(schema, n_inputs: int, n_outputs: int):
    """Type string (a type variable like 'T' or a concrete 'tensor(float)') for every
    actual input and output position."""
    ins = [getattr(_formal(schema.inputs, i), "type_str", None) for i in range(n_inputs)]
    outs = [getattr(_formal(schema.outputs, i), "type_str", None) for i in range(n_outputs)]
    return ins, outs


def allows(schema, type_str: str | None, elem_type: int) -> bool:
    if type_str is None:
        return False
    want = TYPE_STR.get(elem_type)
    allowed = _constraints(schema).get(type_str)
    if allowed is None:
        return type_str == want
    return want in allowed


# --fuse / --model-type: checked by Options.from_kwargs (graphmp.context) before any work
FUSERS = ("ort",)


def ort_model_types() -> list:
    """Model types ONNX Runtime's transformer optimizer knows (its MODEL_TYPES)."""
    from onnxruntime.transformers.optimizer import MODEL_TYPES
    return sorted(MODEL_TYPES)


def check_fuse_options(fuse, model_type):
    """GraphmpError for a --fuse / --model-type the pass cannot honour."""
    if fuse is not None and fuse not in FUSERS:
        raise GraphmpError(f"--fuse must be one of {', '.join(FUSERS)} (ONNX Runtime's transformer fusions), "
                           f"not '{fuse}'")
    if model_type is not None:
        if fuse is None:
            raise GraphmpError("--model-type only chooses the fusions of --fuse ort; add --fuse ort")
        known = ort_model_types()
        if model_type not in known:
            raise GraphmpError(f"--model-type '{model_type}' is not a model type of ONNX Runtime's transformer "
                               f"optimizer; known: {', '.join(known)}")

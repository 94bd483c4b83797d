"""Precision policy: which ONNX ops run in FP16, which stay FP32, and what the
ONNX schemas allow.

Op classes (the precision policy of the project's design notes):
  fp16    compute Tensor Cores accelerate
  fp32    reductions and range-sensitive math
  follow  runs in the precision of its neighbourhood
  clear   data movement; never forces a Cast
  fixed   output type fixed by an attribute or a subgraph (Cast, ConstantOfShape,
          Random*, EyeLike, If/Loop/Scan, ...): never retyped, consumers get Casts
Ops in none of these lists (and every custom-domain op) stay FP32.
"""
from __future__ import annotations

import functools

from onnx import TensorProto, defs

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
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
TYPE_STR = {v: f"tensor({k.lower()})" for k, v in TensorProto.DataType.items() if v}
STR_TYPE = {s: v for v, s in TYPE_STR.items()}


def op_class(op_type: str, domain: str) -> str:
    """Class of an op: 'fp16', 'fp32', 'follow', 'clear', 'fixed' or 'unknown'."""
    if domain not in ("", "ai.onnx"):
        return "unknown"
    for cls, table in (("fp16", FP16_OPS), ("fp32", FP32_OPS), ("follow", FOLLOW_OPS),
                       ("clear", CLEAR_OPS), ("fixed", FIXED_OPS)):
        if op_type in table:
            return cls
    return "unknown"


@functools.lru_cache(maxsize=None)
def get_schema(op_type: str, domain: str, version: int):
    """The schema in force at `version`, or None for custom/unknown ops."""
    try:
        return defs.get_schema(op_type, version, "" if domain == "ai.onnx" else domain)
    except Exception:  # onnx raises SchemaError (a RuntimeError subclass) for unknown ops
        return None


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

"""Which (op, opset version, element type) ONNX Runtime's CUDA provider has a kernel for, for
the ops graphmp's training step graphs use.

A node without a CUDA kernel still runs under CUDAExecutionProvider: ONNX Runtime places it on
the CPU and copies its inputs to the host and its outputs back, with a stream sync, every step
(and such a graph cannot be captured as a CUDA graph). The step graphs should need none.

Source: ONNX Runtime's docs/OperatorKernels.md (generated from the registered kernels),
"Operators implemented by CUDAExecutionProvider", ai.onnx domain, at microsoft/onnxruntime
commit 001d12d2623f (it lists ops up to opset 25). Transcribed for the ops below only, the rows
that reach opset 13 or later (graphmp's step graphs are opset >= 13). Each row: the since-version
range of ONNX's schema the kernel is registered for, and the element types of the op's main
type constraint (CHECKED_TENSOR says which tensor carries it). ONNX Runtime picks a kernel by
the node's since-version (the schema version the model's opset resolves to), so a range
[first, last] matches a node whose since-version lies in it. Ops not listed here have no CUDA
kernel in onnxruntime-gpu's ai.onnx domain as far as graphmp knows: SoftmaxCrossEntropyLoss and
NegativeLogLikelihoodLoss, for one, are registered only in ORT's training builds.

    python -m graphmp.train.cuda_kernels --table > docs/cuda_kernels.md
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, shape_inference

SOURCE = "microsoft/onnxruntime docs/OperatorKernels.md at commit 001d12d2623f (CUDAExecutionProvider, ai.onnx)"
LATEST = None  # an open range: "N+" in OperatorKernels.md


def _types(*names: str) -> frozenset:
    return frozenset(getattr(TensorProto, n.upper()) for n in names)


_F = ("double", "float", "float16")
_FB = _F + ("bfloat16",)
_INT = ("int16", "int32", "int64", "int8", "uint16", "uint32", "uint64", "uint8")
ALL = _types(*_FB, "bool", *_INT)
FLOATS, FLOATS_BF16 = _types(*_F), _types(*_FB)
ARITH = _types(*_FB, *_INT)                                     # Add/Sub/Mul/Div 14+
ARITH13 = _types(*_FB, "int32", "int64", "uint32", "uint64")    # Add/Sub/Mul/Div 13
COMPARE = _types(*_F, "int32", "int64", "uint32", "uint64")     # Less, Greater, ...
MINMAX = _types(*_FB, "int32", "int64", "uint32", "uint64")     # Max, Min, Mod 13+
BOOL = _types("bool")

#: op -> ((first since-version, last or LATEST, element types), ...)
KERNELS: dict[str, tuple] = {
    "Abs": ((13, LATEST, ARITH),),
    "Add": ((14, LATEST, ARITH), (13, 13, ARITH13)),
    "And": ((7, LATEST, BOOL),),
    "AveragePool": ((22, LATEST, FLOATS_BF16), (19, 21, FLOATS), (11, 18, FLOATS)),
    "BatchNormalization": ((15, LATEST, FLOATS), (14, 14, FLOATS), (9, 13, FLOATS)),
    "Cast": ((23, LATEST, ALL), (21, 22, ALL), (19, 20, ALL), (13, 18, ALL)),
    "Clip": ((13, LATEST, _types(*_F, "int64", "int8", "uint64", "uint8")),),
    "Concat": ((13, LATEST, ALL),),
    "ConstantOfShape": ((9, LATEST, ALL),),
    "Conv": ((22, LATEST, FLOATS_BF16), (11, 21, FLOATS)),
    "ConvTranspose": ((11, LATEST, FLOATS),),
    "CumSum": ((14, LATEST, _types(*_F, "int32", "int64", "uint32", "uint64")),
               (11, 13, _types("double", "float", "int32", "int64", "uint32", "uint64"))),
    "Div": ((14, LATEST, ARITH), (13, 13, ARITH13)),
    "Dropout": ((13, LATEST, FLOATS_BF16),),
    "Equal": ((13, LATEST, COMPARE | BOOL),),
    "Erf": ((13, LATEST, FLOATS_BF16),),
    "Exp": ((13, LATEST, FLOATS_BF16),),
    "Expand": ((13, LATEST, ALL),),
    "Flatten": ((13, LATEST, ALL),),
    "Gather": ((13, LATEST, ALL),),
    "GatherElements": ((13, LATEST, ALL),),
    "GatherND": ((13, LATEST, _types(*_FB, "bool", "int64")),),
    "Gemm": ((13, LATEST, FLOATS_BF16),),
    "GlobalAveragePool": ((1, LATEST, FLOATS),),
    "GlobalMaxPool": ((1, LATEST, FLOATS),),
    "Greater": ((13, LATEST, COMPARE),),
    "GreaterOrEqual": ((16, LATEST, COMPARE), (12, 15, COMPARE)),
    "Identity": ((19, LATEST, ALL), (14, 18, ALL), (13, 13, ALL)),
    "IsInf": ((20, LATEST, FLOATS_BF16), (10, 19, _types("double", "float"))),
    "IsNaN": ((20, LATEST, FLOATS_BF16), (13, 19, FLOATS_BF16)),
    "LayerNormalization": ((17, LATEST, FLOATS_BF16),),
    "LeakyRelu": ((16, LATEST, FLOATS), (6, 15, FLOATS)),
    "Less": ((13, LATEST, COMPARE),),
    "LessOrEqual": ((16, LATEST, COMPARE), (12, 15, COMPARE)),
    "Log": ((13, LATEST, FLOATS),),
    "LogSoftmax": ((13, LATEST, FLOATS),),
    "MatMul": ((13, LATEST, FLOATS_BF16),),
    "Max": ((13, LATEST, MINMAX),),
    "MaxPool": ((12, LATEST, _types(*_F, "int8", "uint8")),),
    "Min": ((13, LATEST, MINMAX),),
    "Mod": ((13, LATEST, MINMAX),),
    "Mul": ((14, LATEST, ARITH), (13, 13, ARITH13)),
    "Neg": ((13, LATEST, _types(*_FB, "int16", "int32", "int64", "int8")),),
    "NonZero": ((13, LATEST, _types("bool", "float", "float16", "int32", "int64", "uint8")),),
    "Not": ((1, LATEST, BOOL),),
    "Or": ((7, LATEST, BOOL),),
    "Pad": ((18, LATEST, FLOATS | BOOL), (13, 17, FLOATS | BOOL)),
    "Pow": ((15, LATEST, _types(*_FB, "int32", "int64")), (13, 14, _types(*_FB, "int32", "int64"))),
    "Range": ((11, LATEST, _types("double", "float", "int16", "int32", "int64")),),
    "Reciprocal": ((13, LATEST, FLOATS),),
    "ReduceMax": ((18, LATEST, _types(*_F, "int32", "int64")), (1, 17, _types(*_F, "int32", "int64"))),
    "ReduceMean": ((18, LATEST, _types(*_F, "int32")), (1, 17, _types(*_F, "int32"))),
    "ReduceSum": ((13, LATEST, _types(*_FB, "int32", "int64")),),
    "ReduceSumSquare": ((18, LATEST, FLOATS), (1, 17, FLOATS)),
    "Relu": ((14, LATEST, FLOATS_BF16), (13, 13, FLOATS_BF16)),
    "Reshape": ((23, LATEST, ALL), (21, 22, ALL), (19, 20, ALL), (14, 18, ALL), (13, 13, ALL)),
    "ScatterElements": ((18, LATEST, ALL), (16, 17, ALL), (13, 15, ALL)),
    "ScatterND": ((18, LATEST, ALL), (16, 17, ALL), (13, 15, ALL)),
    "Shape": ((23, LATEST, ALL), (21, 22, ALL), (19, 20, ALL), (15, 18, ALL), (13, 14, ALL)),
    "Sigmoid": ((13, LATEST, FLOATS_BF16),),
    "Sign": ((13, LATEST, ARITH),),
    "Size": ((13, LATEST, ALL),),
    "Slice": ((13, LATEST, ALL),),
    "Softmax": ((13, LATEST, FLOATS_BF16),),
    "Split": ((18, LATEST, ALL), (13, 17, ALL)),
    "Sqrt": ((13, LATEST, FLOATS_BF16),),
    "Squeeze": ((23, LATEST, ALL), (21, 22, ALL), (13, 20, ALL)),
    "Sub": ((14, LATEST, ARITH), (13, 13, ARITH13)),
    "Sum": ((13, LATEST, FLOATS_BF16),),
    "Tanh": ((13, LATEST, FLOATS_BF16),),
    "Tile": ((13, LATEST, _types(*_FB, "int32", "int64")),),
    "TopK": ((11, LATEST, _types(*_F, "int32", "int64")),),
    "Transpose": ((23, LATEST, ALL), (21, 22, ALL), (13, 20, ALL)),
    "Unsqueeze": ((23, LATEST, ALL), (21, 22, ALL), (13, 20, ALL)),
    "Where": ((16, LATEST, _types(*_FB, "int32", "int64", "uint8")), (9, 15, _types(*_F, "int32", "int64", "uint8"))),
}

#: the tensor whose element type the kernel's listed types constrain, when not input 0:
#: ("input", i) or ("output", i)
CHECKED_TENSOR = {"Where": ("input", 1), "ConstantOfShape": ("output", 0)}


def has_kernel(op: str, since_version: int, elem_type: int) -> bool:
    """Whether the CUDA provider registers `op` for that since-version and element type."""
    return any(first <= since_version and (last is None or since_version <= last) and elem_type in types
               for first, last, types in KERNELS.get(op, ()))


def _elem_types(model: onnx.ModelProto) -> dict:
    """{tensor name: element type} after ONNX shape inference (0 where unknown)."""
    inferred = shape_inference.infer_shapes(model)
    g = inferred.graph
    types = {t.name: t.data_type for t in g.initializer}
    for v in list(g.input) + list(g.value_info) + list(g.output):
        types[v.name] = v.type.tensor_type.elem_type
    for n in g.node:
        if n.op_type == "Constant":
            types[n.output[0]] = next((a.t.data_type for a in n.attribute if a.name == "value"), 0)
    return types


def checked_types(node, types: dict) -> list[int]:
    """The element types of `node` the kernel table decides on: its main tensor's (see
    CHECKED_TENSOR), and for a Cast also its target type."""
    side, i = CHECKED_TENSOR.get(node.op_type, ("input", 0))
    names = node.input if side == "input" else node.output
    out = [types.get(names[i], 0) if len(names) > i and names[i] else 0]
    if node.op_type == "Cast":
        out.append(next(a.i for a in node.attribute if a.name == "to"))
    return out


def nodes_without_kernel(model: onnx.ModelProto) -> list[tuple[str, str, int, str]]:
    """(node name, op, since-version, element type name) for every main-graph node of a
    default-domain model that has no CUDA kernel in KERNELS; Constant nodes are folded by ONNX
    Runtime and not checked. Needs the tensors' element types to be inferable by ONNX shape
    inference (an unknown type counts as missing)."""
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    types = _elem_types(model)
    missing = []
    for n in model.graph.node:
        if n.op_type == "Constant":
            continue
        version = onnx.defs.get_schema(n.op_type, opset, n.domain).since_version
        for t in checked_types(n, types):
            if not has_kernel(n.op_type, version, t):
                missing.append((n.name, n.op_type, version, TensorProto.DataType.Name(t)))
    return missing


def render() -> str:
    """docs/cuda_kernels.md: the table as Markdown."""
    name = TensorProto.DataType.Name
    lines = ["# ONNX Runtime CUDA kernels for graphmp's step graphs", "",
             "Generated by `python -m graphmp.train.cuda_kernels --table` from graphmp/train/cuda_kernels.py",
             f"(source: {SOURCE}). tests/test_cuda_kernels.py builds the step graphs of a CNN with",
             "BatchNorm and MaxPool, a transformer block and an embedding model (FP32 and mixed) and checks",
             "that every node has a kernel here: no node of theirs falls back to the CPU under CUDA.", "",
             "| op | since-versions | element types |", "|---|---|---|"]
    for op in sorted(KERNELS):
        for first, last, types in KERNELS[op]:
            span = f"{first}+" if last is None else (str(first) if first == last else f"{first}-{last}")
            lines.append(f"| {op} | {span} | {', '.join(sorted(name(t).lower() for t in types))} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--table"]:
        sys.exit("usage: python -m graphmp.train.cuda_kernels --table > docs/cuda_kernels.md")
    sys.stdout.write(render())

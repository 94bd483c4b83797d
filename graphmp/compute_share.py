"""How a model's Tensor Core compute splits over precisions: FLOPs (multiply-adds x 2) of
Conv/ConvTranspose/MatMul/Gemm/Einsum and of the integer ops MatMulInteger, ConvInteger,
QLinearConv and QLinearMatMul, each counted as

  int8  an integer op, or a float op whose two operands are DequantizeLinear outputs (a Q/DQ
        unit: TensorRT and ONNX Runtime run DQ -> op -> Q as one INT8 kernel);
  fp16  a float op whose output is FLOAT16 (bf16: BFLOAT16);
  fp32  the rest.

    shares = precision_shares(model, shapes)   # shapes: {tensor: dims}, unknown dims as 1
    shares["share"]   # {"fp16": 0.6, "int8": 0.3, "fp32": 0.1} (None without FLOPs)

`graphmp inspect` labels nodes with node_precision too (FP8, INT4, FP64 as such).
cast_cost (convert's summary) and any report that states a compute share use it, so an
INT8 model whose MatMulIntegers the float conversion leaves alone is not read as FP16.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .model_io import iter_graphs

FLOAT_COMPUTE = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum")
# integer op -> (activation input, weight input) positions
INTEGER_COMPUTE = {"MatMulInteger": (0, 1), "ConvInteger": (0, 1), "QLinearMatMul": (0, 3), "QLinearConv": (0, 3)}
COMPUTE_OPS = FLOAT_COMPUTE + tuple(INTEGER_COMPUTE)
PRECISIONS = ("fp16", "bf16", "int8", "fp32")


def _einsum_flops(n, shapes: dict, out_elems: float) -> float | None:
    eq = next((a.s.decode() for a in n.attribute if a.name == "equation"), "").replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    sizes: dict = {}
    counts: dict = {}
    for term, x in zip(lhs.split(","), n.input):
        dims = shapes.get(x)
        if dims is None:
            return None
        letters = term.replace("...", "")
        offset = len(dims) - len(letters) if "..." in term else 0
        for i, c in enumerate(letters):
            pos = i + (offset if "..." in term and i >= term.index("...") else 0)
            if pos < len(dims):
                sizes[c] = max(sizes.get(c, 1), dims[pos])
            counts[c] = counts.get(c, 0) + 1
    out_letters = set(rhs) if "->" in eq else {c for c, k in counts.items() if k == 1}
    contracted = [sizes.get(c, 1) for c in counts if c not in out_letters and c != "."]
    return 2 * out_elems * float(np.prod(contracted)) if contracted else out_elems


def compute_flops(n, shapes: dict) -> float | None:
    """Multiply-adds x 2 of a node of COMPUTE_OPS at these (filled) shapes; None without
    shapes or for another op."""
    out = shapes.get(n.output[0]) if n.output else None
    if out is None or n.op_type not in COMPUTE_OPS:
        return None
    elems = float(np.prod(out)) if out else 1.0
    ai, wi = INTEGER_COMPUTE.get(n.op_type, (0, 1))
    a = shapes.get(n.input[ai]) if len(n.input) > ai else None
    w = shapes.get(n.input[wi]) if len(n.input) > wi else None
    if n.op_type in ("Conv", "ConvInteger", "QLinearConv"):
        return 2 * elems * float(np.prod(w[1:])) if w else None
    if n.op_type == "ConvTranspose":
        return 2 * float(np.prod(a)) * float(np.prod(w[1:])) if w and a else None
    if n.op_type in ("MatMul", "MatMulInteger", "QLinearMatMul"):
        return 2 * elems * float(a[-1]) if a else None
    if n.op_type == "Gemm":
        trans_a = next((x.i for x in n.attribute if x.name == "transA"), 0)
        return 2 * elems * float(a[0] if trans_a else a[-1]) if a and len(a) == 2 else None
    return _einsum_flops(n, shapes, elems)


LABELS = {TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.BFLOAT16: "BF16",
          TensorProto.DOUBLE: "FP64", TensorProto.INT8: "INT8", TensorProto.UINT8: "INT8"}
SHARE_KEYS = {"FP16": "fp16", "BF16": "bf16", "INT8": "int8"}  # a share's keys; any other label counts as fp32


def precision_label(elem_type) -> str:
    """FP16/BF16/FP32/FP64/INT8 (uint8 too)/FP8/INT4 for an ONNX element type; 'unknown' for none."""
    if not elem_type:
        return "unknown"
    if elem_type in LABELS:
        return LABELS[elem_type]
    name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else str(elem_type)
    return "FP8" if name.startswith("FLOAT8") else "INT4" if name in ("INT4", "UINT4") else name


def node_precision(n, types: dict, producers: dict) -> str:
    """The precision label a node of COMPUTE_OPS computes in; types: {tensor: elem type};
    producers: {tensor: node}.
    - MatMulInteger, ConvInteger, QLinearConv, QLinearMatMul: the type of their quantized
      weight (INT8 for int8/uint8);
    - a float op whose first two inputs both come straight from DequantizeLinear (a Q/DQ
      unit; a weight-only DequantizeLinear computes in float): the type it dequantizes;
    - else the element type of its output, or of its operands where inference stopped
      before it (a Conv's weight is an initializer of the type it computes in)."""
    if n.op_type in INTEGER_COMPUTE:
        wi = INTEGER_COMPUTE[n.op_type][1]
        return precision_label(types.get(n.input[wi]) if len(n.input) > wi else None)
    if len(n.input) >= 2:
        dq = [producers.get(x) for x in n.input[:2]]
        if all(p is not None and p.op_type == "DequantizeLinear" for p in dq):
            return precision_label(types.get(dq[0].input[0]))
    out = next((x for x in n.output if x), None)
    return precision_label(next((types[x] for x in [out, *n.input[:2]] if x in types), None))


def model_types(model) -> dict:
    """{tensor: elem type} from the declared inputs, outputs, value_info and initializers of
    every graph of the model."""
    types = {}
    for g in iter_graphs(model.graph):
        for v in list(g.input) + list(g.value_info) + list(g.output):
            if v.type.tensor_type.elem_type:
                types.setdefault(v.name, v.type.tensor_type.elem_type)
        for t in g.initializer:
            types[t.name] = t.data_type
    return types


def compute_nodes(graphs: list, shapes: dict, types: dict) -> list:
    """[(graph index, node, precision, FLOPs or None where `shapes` do not give them)] for
    every node of COMPUTE_OPS in `graphs` (the model's graphs, main graph first)."""
    producers = {x: n for g in graphs for n in g.node for x in n.output}
    return [(gi, n, SHARE_KEYS.get(node_precision(n, types, producers), "fp32"), compute_flops(n, shapes))
            for gi, g in enumerate(graphs) for n in g.node
            if n.op_type in COMPUTE_OPS and n.domain in ("", "ai.onnx")]


def precision_shares(model, shapes: dict, types: dict | None = None) -> dict:
    """FLOPs per precision of the model's compute nodes (every graph) at `shapes` ({tensor:
    dims}, unknown dims as 1; a node whose FLOPs these shapes do not give is counted in
    "unknown_nodes"). types defaults to model_types(model). Returns {"flops": {precision:
    FLOPs}, "total", "share": {precision: fraction} or None when total is 0, "int8_ops":
    {op type: count} of the INT8 nodes, "unknown_nodes"}."""
    types = model_types(model) if types is None else types
    flops = dict.fromkeys(PRECISIONS, 0.0)
    int8_ops: dict = {}
    unknown = 0
    for _, n, p, fl in compute_nodes(list(iter_graphs(model.graph)), shapes, types):
        if fl is None:
            unknown += 1
            continue
        flops[p] += fl
        if p == "int8":
            int8_ops[n.op_type] = int8_ops.get(n.op_type, 0) + 1
    total = sum(flops.values())
    return {"flops": flops, "total": total, "share": {p: f / total for p, f in flops.items()} if total else None,
            "int8_ops": int8_ops, "unknown_nodes": unknown}

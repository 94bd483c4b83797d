"""What a built step graph does with its precision, at one batch shape (train.json
"precision_cost", the train-graph summary line).

`precision_cost(model, shapes)` gives the FLOPs of its GEMM-like nodes (Conv, ConvTranspose,
MatMul, Gemm: the forward's and the backward's alike) and the share of them whose inputs are
FP16/BF16 (the Tensor Core work of a mixed build), and the bytes its Cast nodes read and
write per step (a mixed build's price for that share). Shapes come from onnx shape inference
with the graph's data inputs pinned to `shapes`; nodes whose shapes it cannot tell are
counted, not guessed.
"""
from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto, helper

from .builder import cone
from . import shape_values

GEMM_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
LOW = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _shapes_at(model: onnx.ModelProto, shapes: dict) -> dict:
    """{tensor: (elem_type, dims or None)} with the inputs named in `shapes` pinned."""
    m = copy.deepcopy(model)
    for v in m.graph.input:
        if v.name in shapes:
            dims = v.type.tensor_type.shape.dim
            for d, n in zip(dims, shapes[v.name]):
                d.Clear()
                d.dim_value = int(n)
    del m.graph.value_info[:]
    # no data_prop on the whole graph: it materialises the int64 tensors the backward computes
    # (index math over whole activations): 11 s and 13 GB on a ResNet-50 step, and then it
    # failed. The Reshape lengths that matter here (Reshape(x, Shape(y)), a gradient shaped
    # like its tensor; a head length computed from a Shape) come from
    # shape_values.declare_reshapes instead, a few rounds until nothing is new. Where lengths
    # stay unknown even so, data propagation runs after all on what computes them (cone), and
    # only on a graph without Range, whose outputs it materialises.
    pinned = m
    try:
        m = shape_values.infer(m)
    except Exception:  # noqa: BLE001 - best effort: what inference gives is counted
        pass
    info = _info(m)
    unknown = _unknown_tensors(model, info)
    if unknown and not any(n.op_type == "Range" for n in model.graph.node):
        try:
            found = _info(onnx.shape_inference.infer_shapes(cone(pinned, unknown), data_prop=True))
        except Exception:  # noqa: BLE001 - keep what plain inference gave
            found = {}
        info.update({t: found[t] for t in unknown if _known(found, t)})
    return info


def _unknown_tensors(model: onnx.ModelProto, info: dict) -> set:
    """The inputs and outputs of GEMM-like and Cast nodes whose shapes `info` does not know."""
    return {t for n in model.graph.node if n.op_type in GEMM_OPS + ("Cast",)
            for t in list(n.input[:2]) + list(n.output[:1]) if t and _known(info, t) is None}


def _info(m: onnx.ModelProto) -> dict:
    """{tensor: (elem_type, dims or None)} of what m declares (inputs, value_info, outputs,
    initializers, Constant nodes)."""
    info = {t.name: (t.data_type, list(t.dims)) for t in m.graph.initializer}
    for v in list(m.graph.input) + list(m.graph.value_info) + list(m.graph.output):
        tt = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] if tt.HasField("shape") \
            else None
        info.setdefault(v.name, (tt.elem_type, dims))
    for n in m.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            info.setdefault(n.output[0], (n.attribute[0].t.data_type, list(n.attribute[0].t.dims)))
    return info


def _known(info: dict, t: str):
    et, dims = info.get(t, (0, None))
    return None if dims is None or any(d is None for d in dims) else (et, dims)


def _gemm_flops(node, info: dict) -> int | None:
    """2 x multiply-adds of one Conv/ConvTranspose/MatMul/Gemm as written; None when a shape
    is unknown."""
    a, b, y = (_known(info, t) for t in (node.input[0], node.input[1], node.output[0]))
    if a is None or b is None or y is None:
        return None
    if node.op_type == "Conv":  # each output element: Cin/group x kernel products
        return 2 * int(np.prod(y[1])) * int(np.prod(b[1][1:]))
    if node.op_type == "ConvTranspose":  # each input element: Cout/group x kernel products
        return 2 * int(np.prod(a[1])) * int(np.prod(b[1][1:]))
    trans_a = next((helper.get_attribute_value(x) for x in node.attribute if x.name == "transA"), 0)
    k = a[1][-2] if node.op_type == "Gemm" and trans_a else a[1][-1]
    return 2 * int(np.prod(y[1])) * int(k)


def _nbytes(info: dict, t: str) -> int | None:
    k = _known(info, t)
    if k is None:
        return None
    return int(np.prod(k[1])) * np.dtype(helper.tensor_dtype_to_np_dtype(k[0])).itemsize


def precision_cost(model: onnx.ModelProto, shapes: dict) -> dict:
    """Needs a step graph and {data input: dims} (the batch it is measured at). Gives
    {"shapes", "gemm_gflop", "gemm_low_share" (FP16/BF16 FLOPs / all GEMM FLOPs, None without
    GEMMs), "casts", "cast_mb" (input + output bytes of every Cast, per run),
    "unknown_shapes" (GEMM and Cast nodes left out for want of a shape)}."""
    info = _shapes_at(model, shapes)
    total = low = cast_bytes = casts = unknown = 0
    for n in model.graph.node:
        if n.op_type in GEMM_OPS and n.domain in ("", "ai.onnx"):
            f = _gemm_flops(n, info)
            if f is None:
                unknown += 1
                continue
            total += f
            low += f if info[n.input[0]][0] in LOW else 0
        elif n.op_type == "Cast":
            casts += 1
            sizes = [_nbytes(info, n.input[0]), _nbytes(info, n.output[0])]
            if None in sizes:
                unknown += 1
            else:
                cast_bytes += sum(sizes)
    return {"shapes": {k: [int(d) for d in v] for k, v in shapes.items()},
            "gemm_gflop": _sig(total / 1e9), "gemm_low_share": round(low / total, 4) if total else None,
            "casts": casts, "cast_mb": _sig(cast_bytes / 1e6), "unknown_shapes": unknown}


def _sig(v: float) -> float:
    """v to 4 significant digits (tiny test models and ResNet-50 alike)."""
    return float(f"{v:.4g}")


def precision_cost_of_build(model: onnx.ModelProto, generated: dict | None) -> dict | None:
    """train.json "precision_cost": precision_cost at the shapes of the build's generated batch
    ({input: array}; its arrays that are not inputs of `model` are ignored); None without one."""
    if generated is None:
        return None
    inputs = {v.name for v in model.graph.input}
    return precision_cost(model, {k: list(np.shape(v)) for k, v in generated.items() if k in inputs})

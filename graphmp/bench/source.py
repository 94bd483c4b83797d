"""What precision a bench source already is: FP32, FP16 / BF16, mixed, or INT8 (Q/DQ,
dynamic, QOperator), so bench runs it as it is and labels its rows for what they are.

source_precision(model) -> {"precision", "float_nodes", "quantization", "quant_ops"}:
  precision     "fp32", "fp16", "bf16", "mixed fp16/fp32" (any mix of float types, e.g.
                "mixed bf16/fp16/fp32"), or with INT8 ops "int8 qdq", "int8 dynamic",
                "int8 qoperator" (+ " + fp16" etc. when low-precision float compute is there
                too); "no float" when the model computes no float at all
  float_nodes   {"fp32"|"fp16"|"bf16"|"fp64": nodes whose float outputs have that type}
                (Cast, CastLike, Constant and Identity nodes, and Q/DQ nodes, are not
                counted: they compute nothing)
  quantization  "dynamic" | "qoperator" | "qdq" | None (the first that applies: a dynamically
                quantized model may also hold DequantizeLinear for its quantized embeddings)
  quant_ops     {op_type: count} of the quantization ops found
The types come from ONNX shape inference on a copy without large weights; a model
inference cannot type is judged by what it declares (inputs, outputs, initializers).
"""
from __future__ import annotations

import collections

import onnx
from onnx import TensorProto

from ..ir import iter_graphs

FLOATS = {TensorProto.FLOAT: "fp32", TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16",
          TensorProto.DOUBLE: "fp64"}
QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
DYNAMIC_OPS = {"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul",
               "DynamicQuantizeLSTM", "MatMulIntegerToFloat"}
QOPERATOR_OPS = {"QLinearConv", "QLinearMatMul", "QGemm", "QAttention", "QLinearAdd", "QLinearMul",
                 "QLinearSigmoid", "QLinearLeakyRelu", "QLinearConcat", "QLinearGlobalAveragePool",
                 "QLinearAveragePool", "QLinearSoftmax", "QEmbedLayerNormalization", "QOrderedMatMul"}
NOT_COMPUTE = {"Cast", "CastLike", "Constant", "Identity"}


def _typed(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with value_info from shape inference, computed on a copy whose large
    weights carry no data (dims and types kept); `model` itself where inference fails."""
    skel = onnx.ModelProto()
    skel.CopyFrom(model)
    for g in iter_graphs(skel.graph):
        for t in g.initializer:
            if len(t.raw_data) > 4096 or t.data_location == TensorProto.EXTERNAL:
                t.ClearField("raw_data")
                del t.external_data[:]
                t.data_location = TensorProto.DEFAULT
    try:
        return onnx.shape_inference.infer_shapes(skel, strict_mode=False)
    except Exception:  # noqa: BLE001 - an op inference does not know, a >2 GB graph: declared types only
        return skel


def _elem_types(g) -> dict:
    """{tensor name: element type} of one graph, from what it declares and infers."""
    types = {t.name: t.data_type for t in g.initializer}
    for v in list(g.input) + list(g.output) + list(g.value_info):
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            types[v.name] = v.type.tensor_type.elem_type
    for n in g.node:
        if n.op_type == "Constant" and n.output:
            for a in n.attribute:
                if a.name == "value" and a.HasField("t"):
                    types[n.output[0]] = a.t.data_type
    return types


def _node_type(n, types) -> str | None:
    """The float type a node computes in: of its first float output, else of its first
    float input (a node writing integers from floats, as DynamicQuantizeLinear)."""
    for names in (n.output, n.input):
        for x in names:
            t = FLOATS.get(types.get(x)) if x else None
            if t is not None:
                return t
    return None


def source_precision(model: onnx.ModelProto) -> dict:
    """The source's precision (see the module docstring)."""
    typed = _typed(model)
    nodes, quant = collections.Counter(), collections.Counter()
    outer: dict = {}
    for g in iter_graphs(typed.graph):
        types = {**outer, **_elem_types(g)}
        outer.update(types)  # subgraphs read outer-scope names
        for n in g.node:
            if n.op_type in QDQ_OPS | DYNAMIC_OPS | QOPERATOR_OPS:
                quant[n.op_type] += 1
            if n.op_type in NOT_COMPUTE or n.op_type in QDQ_OPS:
                continue
            t = _node_type(n, types)
            if t is not None:
                nodes[t] += 1
    kind = next((k for k, ops in (("dynamic", DYNAMIC_OPS), ("qoperator", QOPERATOR_OPS), ("qdq", QDQ_OPS))
                 if any(quant[o] for o in ops)), None)
    low = [t for t in ("fp16", "bf16") if nodes[t]]
    floats = [t for t in ("bf16", "fp16", "fp32", "fp64") if nodes[t]]
    if kind:
        precision = f"int8 {kind}" + "".join(f" + {t}" for t in low)
    elif len(floats) > 1:
        precision = "mixed " + "/".join(floats)
    else:
        precision = floats[0] if floats else "no float"
    return {"precision": precision, "float_nodes": dict(nodes), "quantization": kind, "quant_ops": dict(quant)}


def is_fp32(info: dict) -> bool:
    """True for a plain FP32 source (what bench's labels and reference were made for)."""
    return info["precision"] in ("fp32", "mixed fp32/fp64", "fp64")

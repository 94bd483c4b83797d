"""types: the element type of every tensor in every graph of the FP32 source.

Needs: the prepared model and IR (prepare). Guarantees: ctx.types[graph key][tensor]
is the proven element type, or the tensor is absent (unknown).

ONNX shape inference does most of it, run on a skeleton of the model whose large
float initializers carry no data (so a 3 GB model costs megabytes). Where it cannot
finish (custom ops, broken annotations), types are propagated from the op schemas;
what cannot be proven stays unknown (None), and the classify pass keeps nodes that
touch unknown-typed tensors in FP32.
"""
from __future__ import annotations

import itertools

import onnx

from .. import policy
from . import PassResult
from ..model_io import attr_graphs, skeleton


def _declared(g_proto) -> dict:
    out = {}
    for v in itertools.chain(g_proto.input, g_proto.output, g_proto.value_info):
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            out[v.name] = v.type.tensor_type.elem_type
    return out


def _collect(ctx, g_ir, g_proto):
    types = _declared(g_proto)
    types.update({t.name: t.data_type for t in g_ir.proto.initializer})
    for v in itertools.chain(g_ir.proto.input, g_ir.proto.output):  # declared I/O types win
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            types[v.name] = v.type.tensor_type.elem_type
    ctx.types[g_ir.key] = types
    for node, pnode in zip(g_ir.nodes, g_proto.node):
        subs = [g for a in pnode.attribute for g in attr_graphs(a)]
        for sub_ir, sub_proto in zip(node.subgraphs, subs):
            _collect(ctx, sub_ir, sub_proto)


def _propagate(ctx, g):
    """Schema-based types for outputs shape inference left untyped."""
    types = ctx.types[g.key]
    version = ctx.opsets
    for n in g.nodes:
        if all(not o or o in types for o in n.outputs):
            continue
        if n.op_type == "Cast":
            types[n.outputs[0]] = n.attr("to")
            continue
        if n.op_type == "CastLike":
            t = ctx.type_of(g, n.inputs[1])
            if t:
                types[n.outputs[0]] = t
            continue
        schema = policy.get_schema(n.op_type, n.domain, version.get(n.domain or "", 1))
        if schema is None:
            continue
        ins, outs = policy.bindings(schema, len(n.inputs), len(n.outputs))
        bound = {}
        for ts, name in zip(ins, n.inputs):
            if name and ts:
                t = ctx.type_of(g, name)
                if t:
                    bound.setdefault(ts, t)
        for ts, name in zip(outs, n.outputs):
            if not name or name in types or not ts:
                continue
            if ts in policy.STR_TYPE:
                types[name] = policy.STR_TYPE[ts]
            elif ts in bound:
                types[name] = bound[ts]
    for c in g.children:
        _propagate(ctx, c)


def infer_types(ctx):
    ctx.opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in ctx.model.opset_import}
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton(ctx.model), check_type=False,
                                                     strict_mode=False, data_prop=False)
    except Exception as e:
        ctx.warn(f"ONNX shape inference failed ({str(e)[:120]}); types come from op schemas")
        inferred = ctx.model
    _collect(ctx, ctx.root, inferred.graph)
    _propagate(ctx, ctx.root)


def run(ctx) -> PassResult:
    infer_types(ctx)
    known = sum(len(t) for t in ctx.types.values())
    return PassResult(changed=False, details={"tensors_typed": known})

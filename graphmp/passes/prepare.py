"""prepare: put the FP32 source in a canonical form the other passes can rely on.

Needs: ctx.model (as loaded), ctx.path for messages.
Guarantees afterwards (ctx.model, ctx.names and the IR ctx.root):
- the default-domain opset is >= 7, the oldest ONNX Runtime runs (older models are
  upgraded step by step to 9, or a GraphmpError names the op that stops the upgrade);
- initializers are not also graph inputs (IR < 4 style); they are constants;
- float Constant nodes are initializers (so weights are converted offline);
- every node in every graph has a unique name;
- every graph is topologically sorted.
`drop_redundant_casts` (run after the types pass, whose types it needs) removes no-op
Casts and the second Cast of FP16->FP32->FP16 round trips.
Nothing here changes what the model computes.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..model_io import iter_graphs, model_weight_bytes
from ..ir import Graph, Names, name_nodes
from . import PassResult
from ..opset import default_opset, initializers_out_of_inputs, upgrade  # noqa: F401  (re-exported)

MIN_OPSET = 7  # ONNX Runtime guarantees opset 7 and above
# Older models go to 9, not 7: onnx's Reshape-1 -> 5 adapter writes the shape as an int64
# Constant, which Constant only accepts from opset 9.
UPGRADE_TO = 9


def constants_to_initializers(model) -> int:
    moved = 0
    for g in iter_graphs(model.graph):
        outputs = {v.name for v in g.output}
        keep = []
        for n in g.node:
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.attribute) == 1 \
                    and n.output[0] not in outputs:
                a = n.attribute[0]
                t = None
                if a.name == "value" and a.t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16,
                                                          TensorProto.DOUBLE, TensorProto.BFLOAT16):
                    t = TensorProto()
                    t.CopyFrom(a.t)
                elif a.name == "value_float":
                    t = numpy_helper.from_array(np.array(a.f, dtype=np.float32))
                elif a.name == "value_floats":
                    t = numpy_helper.from_array(np.array(list(a.floats), dtype=np.float32))
                if t is not None:
                    t.name = n.output[0]
                    g.initializer.append(t)
                    moved += 1
                    continue
            keep.append(n)
        if moved:
            kept = [onnx.NodeProto() for _ in keep]
            for dst, src in zip(kept, keep):
                dst.CopyFrom(src)
            del g.node[:]
            g.node.extend(kept)
    if moved and model.ir_version < 4:  # IR 3 wants every initializer listed as a graph input
        model.ir_version = 4
    return moved


def _rename_input(graph: Graph, old: str, new: str):
    for g in graph.walk():
        for n in g.nodes:
            for i, x in enumerate(n.inputs):
                if x == old:
                    n.proto.input[i] = new


def drop_redundant_casts(ctx, types_of) -> int:
    """Remove Casts that do nothing (to == input type) and the second Cast of an
    FP16->FP32->FP16 round trip, where the output is not a graph output."""
    removed = 0
    for g in ctx.root.walk():
        outs = set(g.output_names)
        prod = g.producers()
        keep = []
        for n in g.nodes:
            if n.op_type == "Cast" and n.domain in ("", "ai.onnx") and n.outputs[0] not in outs:
                src = n.inputs[0]
                to = n.attr("to")
                src_t = types_of(g, src)
                target = None
                if src_t == to:
                    target = src
                else:
                    p = prod.get(src)
                    if p is not None and p.op_type == "Cast" and p.attr("to") == TensorProto.FLOAT:
                        inner = p.inputs[0]
                        if types_of(g, inner) == to and to in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
                            target = inner
                if target is not None:
                    _rename_input(g, n.outputs[0], target)
                    removed += 1
                    continue
            keep.append(n)
        g.nodes = keep
        g.invalidate()
    return removed


def run(ctx) -> PassResult:
    """Canonicalise ctx.model and build the IR (ctx.root, ctx.names)."""
    details = {}
    v = default_opset(ctx.model)
    if 0 < v < MIN_OPSET:
        ctx.model = upgrade(ctx.model, UPGRADE_TO, ctx.path)
        details["opset_upgraded"] = [v, UPGRADE_TO]
        ctx.warn(f"upgraded opset {v} -> {UPGRADE_TO} (ONNX Runtime runs opset >= {MIN_OPSET})")
    details["initializers_removed_from_inputs"] = initializers_out_of_inputs(ctx.model)
    if details["initializers_removed_from_inputs"]:
        ctx.warn(f"{details['initializers_removed_from_inputs']} initializers were also graph inputs; "
                 "they are now constants (ONNX Runtime recommends the same)")
    details["constants_to_initializers"] = constants_to_initializers(ctx.model)
    details["weight_bytes"] = model_weight_bytes(ctx.model)
    ctx.names = Names(ctx.model)
    details["nodes_named"] = name_nodes(ctx.model, ctx.names)
    ctx.root = Graph(ctx.model.graph, None, "main")
    for g in ctx.root.walk():
        g.toposort(ctx.path)
    ctx.root.write_back()
    return PassResult(changed=any(v for k, v in details.items() if k != "weight_bytes"), details=details)


def run_drop_redundant_casts(ctx) -> PassResult:
    """Needs ctx.types. Removes no-op Casts and FP16->FP32->FP16 second Casts."""
    n = drop_redundant_casts(ctx, ctx.type_of)
    return PassResult(changed=bool(n), details={"redundant_casts_removed": n})

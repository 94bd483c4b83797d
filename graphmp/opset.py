"""The model's opset, and upgrading it with onnx's version converter.

`upgrade(model, target)` returns an upgraded copy or raises a GraphmpError that names
what stops it. Below opset 7 (older than anything ONNX Runtime guarantees to run) it
upgrades one version at a time with shape inference in between, because the
converter's adapters need shapes; before the 6 -> 7 step it aligns legacy
`broadcast=1, axis=k` operands itself (onnx's adapter unsqueezes them to the wrong rank:
B[4] against A[1,4,H,W] at axis 1 became [4,1,1,1] instead of [4,1,1]).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import defs, helper, numpy_helper, version_converter

from .errors import GraphmpError
from .model_io import attr_graphs, iter_graphs

# ops whose legacy (opset < 7) form broadcast B against A from `axis` when broadcast=1
_LEGACY_BROADCAST = {"Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal", "Greater", "Less"}


def default_opset(model: onnx.ModelProto) -> int:
    """The ai.onnx opset the model imports (0 when it imports none)."""
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return 0


def _last_opset(op: str, below: int) -> int | None:
    """The last opset below `below` at which `op` has a schema (None: never had one)."""
    for v in range(below - 1, 0, -1):
        try:
            defs.get_schema(op, v, "")
            return v
        except Exception:  # noqa: BLE001 - onnx raises SchemaError for unknown/removed ops
            continue
    return None


def blockers(model: onnx.ModelProto, target: int) -> list[str]:
    """Default-domain ops of the model that have no schema at `target` (the upgrade
    cannot carry them), as 'Op (no schema after opset N)'."""
    out = {}
    for g in iter_graphs(model.graph):
        for n in g.node:
            if n.domain not in ("", "ai.onnx") or n.op_type in out:
                continue
            try:
                defs.get_schema(n.op_type, target, "")
            except Exception:  # noqa: BLE001
                last = _last_opset(n.op_type, target)
                out[n.op_type] = (f"{n.op_type} (no schema after opset {last})" if last else
                                  f"{n.op_type} (an experimental or removed op: onnx {onnx.__version__} has no "
                                  "schema for it)")
    return list(out.values())


def _ranks(model) -> dict:
    inferred = onnx.shape_inference.infer_shapes(model)
    ranks = {}
    for v in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        if v.type.tensor_type.HasField("shape"):
            ranks[v.name] = len(v.type.tensor_type.shape.dim)
    for t in inferred.graph.initializer:
        ranks[t.name] = len(t.dims)
    return ranks


def _align_legacy_broadcast(model, where: str) -> None:
    """Opset < 7: `Op(A, B, broadcast=1, axis=k)` -> B reshaped to line up with A from
    axis k under numpy rules, `axis` dropped (the converter handles the rest)."""
    g = model.graph
    ranks = _ranks(model)
    inits = {t.name: t for t in g.initializer}
    uses: dict = {}
    for n in g.node:
        for x in n.input:
            uses[x] = uses.get(x, 0) + 1
    for n in list(g.node):
        axis = next((a for a in n.attribute if a.name == "axis"), None)
        if n.op_type not in _LEGACY_BROADCAST or axis is None or len(n.input) < 2:
            continue
        a_rank, b_rank = ranks.get(n.input[0]), ranks.get(n.input[1])
        if a_rank is None or b_rank is None:
            raise GraphmpError(f"{where}: cannot upgrade the legacy broadcast of {n.op_type} '{n.name}' "
                               "(the rank of its inputs is unknown); re-export the model with opset >= 7")
        trailing = a_rank - axis.i - b_rank
        n.attribute.remove(axis)
        if trailing <= 0:
            continue
        b = n.input[1]
        t = inits.get(b)
        if t is not None and uses.get(b) == 1:
            shape = tuple(t.dims) + (1,) * trailing  # a reshape: the stored bytes (inline or external) stay
            del t.dims[:]
            t.dims.extend(shape)
            for v in g.input:  # IR 3 lists initializers as inputs too
                if v.name == b:
                    v.type.tensor_type.ClearField("shape")
                    for d in shape:
                        v.type.tensor_type.shape.dim.add().dim_value = d
        else:
            new = f"{b}__legacy_aligned_{n.name or n.op_type}"
            shape = numpy_helper.from_array(np.array([0] * b_rank + [1] * trailing, np.int64), f"{new}_shape")
            g.initializer.append(shape)
            g.input.append(helper.make_tensor_value_info(shape.name, onnx.TensorProto.INT64, [b_rank + trailing]))
            reshape = helper.make_node("Reshape", [b, shape.name], [new], name=f"{new}_reshape")
            g.node.insert(list(g.node).index(n), reshape)
            n.input[1] = new


def _has_subgraphs(model) -> bool:
    return any(attr_graphs(a) for n in model.graph.node for a in n.attribute)


def upgrade(model: onnx.ModelProto, target: int, where: str = "<model>") -> onnx.ModelProto:
    """A copy of `model` at opset `target` (the same model when it is not below it)."""
    v = default_opset(model)
    if v >= target or v == 0:
        return model
    stop = blockers(model, target)
    if stop:
        raise GraphmpError(f"{where}: cannot upgrade opset {v} to {target}: {', '.join(stop)}. Re-export the "
                           f"model with opset >= {target}, or replace those ops")
    try:
        if v >= 7:
            out = version_converter.convert_version(model, target)
        else:
            if _has_subgraphs(model):
                raise GraphmpError(f"{where}: opset {v} with If/Loop/Scan: upgrading such old control flow is not "
                                   f"supported; re-export with opset >= 7")
            out = model
            for step in range(v + 1, target + 1):
                out = onnx.shape_inference.infer_shapes(out)
                if step == 7:
                    _align_legacy_broadcast(out, where)
                out = version_converter.convert_version(out, step)
    except GraphmpError:
        raise
    except Exception as e:  # noqa: BLE001 - the converter raises RuntimeError/ValidationError/...
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GraphmpError(f"{where}: onnx's version converter cannot upgrade opset {v} to {target} "
                           f"({msg[:200]}); re-export the model with opset >= {target}") from None
    for g in iter_graphs(out.graph):  # inferred/adapter shapes: the types pass re-derives them
        del g.value_info[:]
    # the converter keeps the IR version; an IR-3 model (every initializer also a graph input)
    # would forbid the initializers later passes add, and the new opset needs a newer IR anyway.
    # From IR 4 an initializer listed as an input is an overridable default, not a constant
    # (ONNX Runtime then folds nothing with it): IR 3's listing goes, as its meaning was.
    need = onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", target)])
    if out.ir_version < 4 <= need:
        initializers_out_of_inputs(out)
    out.ir_version = max(out.ir_version, need)
    return out


def initializers_out_of_inputs(model) -> int:
    """Drop initializers from the main graph's inputs (IR 3 listed every one there; from IR 4
    a listed initializer is an overridable default that ONNX Runtime folds nothing with),
    raising IR 3 to 4; returns how many were dropped."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    keep = [v for v in g.input if v.name not in inits]
    removed = len(g.input) - len(keep)
    if removed:
        del g.input[:]
        g.input.extend(keep)
        if model.ir_version < 4:
            model.ir_version = 4
    return removed

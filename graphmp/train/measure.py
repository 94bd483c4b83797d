"""Tensor shapes that onnx shape inference loses, measured with ONNX Runtime.

onnx inference loses a tensor's rank after a Reshape whose shape is computed at run time
(paddle2onnx writes Reshape(x, Concat(Slice(Shape(x)), Constant)), tf2onnx and TorchScript
exports similar chains), and with it the rank of everything downstream. Gradient rules need
ranks (which axes to reduce, transpose, unsqueeze), so `declare_measured` runs the forward
model in ONNX Runtime and declares what it sees as value_info:

- element type and rank: from one run at the shapes the build uses (--shapes, else the shapes
  graphmp.inputs.find_shapes finds, as the mixed calibration batch does);
- a dim as a number only where it cannot depend on the free dims of the graph inputs (the
  dims the step graph leaves dynamic: batch, lengths): one more run per free dim (named dims
  move together) at another size, and a dim is kept only if it is the same in every run. When
  one of those runs fails (the model runs only at some sizes), every measured dim stays
  unknown: rank only. The trial sizes are never baked into the step graph.

Then onnx inference runs again from the declared tensors, so the dims it can derive (a
MatMul's output features, a Conv's channels) come back by themselves.
"""
from __future__ import annotations

import onnx
from onnx import helper

from ..errors import GraphmpError, first_line
from .emitter import tensor_info

__all__ = ["declare_measured", "declared_dims", "measured_dims", "redeclare", "unknown_rank_tensors",
           "with_measure_note"]


def unknown_rank_tensors(model: onnx.ModelProto, info: dict | None = None) -> list[str]:
    """Outputs of the main graph's nodes whose rank onnx inference (tensor_info) leaves unknown."""
    info = tensor_info(model) if info is None else info
    return list(dict.fromkeys(o for n in model.graph.node for o in n.output
                              if o and (o not in info or info[o][1] is None)))


def _measuring_model(model: onnx.ModelProto, tensors, info: dict) -> onnx.ModelProto:
    """A copy of `model` whose outputs are `tensors` (typed where the element type is known:
    ONNX Runtime accepts an untyped output and types it itself)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[:]
    for t in dict.fromkeys(tensors):
        elem = info.get(t, (0, None))[0]
        m.graph.output.append(helper.make_tensor_value_info(t, elem, None) if elem
                              else helper.make_value_info(t, onnx.TypeProto()))
    return m


def _run(run, feeds) -> dict:
    """{tensor: (elem type, shape)} of the tensor-valued outputs of one run (sequences skipped)."""
    out = {}
    for t, v in run(feeds).items():
        if hasattr(v, "shape") and hasattr(v, "dtype"):
            out[t] = (helper.np_dtype_to_tensor_dtype(v.dtype), tuple(v.shape))
    return out


def measured_dims(model: onnx.ModelProto, specs, given: dict, tensors) -> dict:
    """{tensor: shape} from one ONNX Runtime run with generated inputs at the shapes `given`
    (name -> dims; the declared dims of the inputs not in it); {} when some input shape is
    still open or the run fails (the caller then refuses with its own message)."""
    from ..inputs import generate, value_hints
    from ..model_runs import runner
    shapes = {}
    for s in specs:
        shape = given.get(s.name, s.dims)
        if not all(isinstance(d, int) for d in shape):
            return {}
        shapes[s.name] = tuple(shape)
    try:
        got = _run(runner(_measuring_model(model, tensors, {})), generate(specs, shapes, 0, value_hints(model)))
    except Exception:  # noqa: BLE001 - no measurement; the caller refuses with the open shape
        return {}
    return {t: list(shape) for t, (_, shape) in got.items()}


def _free_groups(specs, plan_shapes: dict) -> list[tuple[str, list, int]]:
    """(key, [(input, axis)], trial size) per free dim of the graph inputs: a named dim once for
    every input naming it, an unnamed dim on its own. The trial size differs from the planned
    one: batch + 1 (a batch of 1 or 2 runs wherever the model's batch is free), other dims x2
    (strided CNNs want multiples of their total stride)."""
    from ..inputs import batch_positions
    batch = set(batch_positions(specs))
    groups: dict = {}
    for s in specs:
        for axis, d in enumerate(s.dims):
            if isinstance(d, int):
                continue
            key = d if isinstance(d, str) else f"{s.name}[{axis}]"
            groups.setdefault(key, []).append((s.name, axis))
    out = []
    for key, where in groups.items():
        size = plan_shapes[where[0][0]][where[0][1]]
        out.append((key, where, size + 1 if where[0] in batch else max(2 * size, 2)))
    return out


def declare_measured(model: onnx.ModelProto, shapes=None, *, where: str = "<model>", base_dir=None,
                     need_static=()) -> dict:
    """Declare value_info (in place) for the main-graph tensors whose rank onnx inference loses,
    and for the tensors in `need_static` whose dims it leaves open (a Resize to sizes computed
    at run time: its gradient needs the lengths; given when the inputs are pinned, so every
    measured dim is a number).

    Needs: a model ONNX Runtime can run (its initializers inline or under base_dir); `shapes`:
    --shapes syntax or {name: dims}, required for the input dims find_shapes cannot guess.
    Guarantees: each such tensor that ONNX Runtime computes gets its element type and rank;
    a dim is a number only when it did not change while every free input dim changed (see the
    module docstring), else unknown, so the model still runs at any free size. Nothing is
    declared when nothing is missing, or when the measuring run is impossible; the report then
    says why (the gradient rule that needs a rank refuses with its own one-line error).
    Returns {"tensors": declared count, "static_dims": whether dims were compared across free
    sizes, "shapes": the input shapes of the measuring run, "note": why not (or None)}."""
    from ..inputs import find_shapes, generate, input_specs
    from ..model_runs import runner
    info = tensor_info(model)
    wanted = unknown_rank_tensors(model, info)
    wanted += [t for t in dict.fromkeys(need_static) if t and t not in wanted and t in info
               and not all(isinstance(d, int) for d in (info[t][1] or [None]))]
    report = {"tensors": 0, "static_dims": False, "shapes": None, "note": None}
    if not wanted:
        return report
    try:
        run = runner(_measuring_model(model, wanted, info), base_dir=base_dir)
        plan = find_shapes(model, run, shapes, where=where)
        base = _run(run, plan.feeds(0))
    except GraphmpError as e:  # find_shapes: no input shapes that run
        report["note"] = str(e)
        return report
    except Exception as e:  # noqa: BLE001 - the session or the run failed: nothing measured
        report["note"] = f"ONNX Runtime could not run the model: {first_line(e)}"
        return report
    report["shapes"] = {n: list(s) for n, s in plan.shapes.items()}
    specs = input_specs(model)
    variants, static, moved = [], True, []
    for key, positions, size in _free_groups(specs, plan.shapes):
        shp = {n: list(s) for n, s in plan.shapes.items()}
        for name, axis in positions:
            shp[name][axis] = size
        try:
            variants.append(_run(run, generate(specs, shp, 0, plan.hints)))
            moved.append((key, plan.shapes[positions[0][0]][positions[0][1]], size))
        except Exception as e:  # noqa: BLE001 - the model does not run at that size: rank only
            static = False
            report["note"] = f"dims left unknown: no run with free dim '{key}' = {size} ({first_line(e, 120)})"
            break
    report["static_dims"] = static
    declared = _declare(model, base, variants if static else None, moved)
    report["tensors"] = declared
    return report


def _tracked(base: int, values: list, moved: list):
    """The name of the free input dim a measured dim equals in every run (it was that dim's
    planned size in the base run, its trial size in that dim's run, unchanged in the others),
    or None. Unnamed input dims ('x[0]') give None."""
    for k, (key, planned, trial) in enumerate(moved):
        if base == planned and values[k] == trial and all(v == base for j, v in enumerate(values) if j != k):
            return key if "[" not in key else None
    return None


def _declare(model: onnx.ModelProto, base: dict, variants: list | None, moved=()) -> int:
    """value_info for every measured tensor (a graph output's own type where it is one);
    dims kept where equal in `base` and every variant, named after the free input dim they
    follow when they follow one (the batch of a Resize output: the gradient sees that it is
    not resized), else unknown (variants None: rank only). Returns the count."""
    outputs = {v.name: v for v in model.graph.output}
    n = 0
    kept = {}
    for t, (elem, shape) in base.items():
        if variants is None:
            dims = [None] * len(shape)
        else:
            others = [v.get(t, (None, None))[1] for v in variants]
            if any(o is None or len(o) != len(shape) for o in others):
                dims = [None] * len(shape)
            else:
                dims = [d if all(o[i] == d for o in others) else _tracked(d, [o[i] for o in others], list(moved))
                        for i, d in enumerate(shape)]
        _set_type(model, outputs, t, elem, dims)
        kept[t] = dims
        n += 1
    # onnx inference from the declared tensors derives dims of its own (a MatMul's features, a
    # Conv's channels, the input's symbolic batch): taken where the measurement left a dim open
    info = tensor_info(model)
    for t, (elem, shape) in base.items():
        got = info.get(t, (None, None))[1]
        if got is not None and len(got) == len(shape):  # onnx's own 'unk__N' names mean nothing
            _set_type(model, outputs, t, elem, [m if m is not None else
                                                None if isinstance(d, str) and d.startswith("unk__") else d
                                                for m, d in zip(kept[t], got)])
    return n


def _set_type(model, outputs: dict, t: str, elem: int, dims) -> None:
    """Declare tensor t (a graph output's own type where it is one, else value_info)."""
    vi = helper.make_tensor_value_info(t, elem, dims)
    if t in outputs:
        outputs[t].type.CopyFrom(vi.type)
        return
    for v in model.graph.value_info:
        if v.name == t:
            v.type.CopyFrom(vi.type)
            return
    model.graph.value_info.append(vi)


def declared_dims(model: onnx.ModelProto) -> dict:
    """{tensor: dims} of the main graph's value_info (what declare_measured wrote), to carry
    over a rewrite that drops value_info (graphmp.convert re-derives its own)."""
    out = {}
    for v in model.graph.value_info:
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            out[v.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                           for d in v.type.tensor_type.shape.dim]
    return out


def redeclare(model: onnx.ModelProto, dims: dict) -> int:
    """Declare `dims` (declared_dims of the model before a rewrite) again for the tensors the
    rewritten model still has, with their element type now (FP16 after a conversion);
    returns how many."""
    info = tensor_info(model)
    outputs = {v.name: v for v in model.graph.output}
    n = 0
    for t, d in dims.items():
        if t in info and info[t][0]:
            _set_type(model, outputs, t, info[t][0], d)
            n += 1
    return n


def with_measure_note(e: GraphmpError, report: dict, path: str) -> GraphmpError:
    """`e` (a gradient rule's unknown-rank error) with the reason declare_measured's `report`
    gives for measuring nothing; any other error as it is."""
    note = report.get("note")
    if "unknown rank" not in str(e) or not note or report.get("tensors"):
        return e
    note = note[len(path) + 2:] if note.startswith(path + ": ") else note
    return GraphmpError(f"{path}: {e}; measuring it failed: {note}")

"""graphmp.pad: Tensor Core channel padding as a command of its own (FP32 stays FP32).

    load -> canonical constants -> pad_channels (passes/pad_channels.py) -> save (atomic)
         -> optional validation: ONNX Runtime outputs before vs after on the same inputs

`graphmp.convert(..., pad_channels=8)` runs the same pass before converting.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
import onnx

from .version import __version__
from .errors import GraphmpError
from .io import is_external, iter_graphs, load_model, materialize, model_weight_bytes, open_model, save_model
from .ir import Names, name_nodes
from .ops import PAD_MULTIPLES as MULTIPLES
from .passes.pad_channels import pad_channels
from .passes.prepare import constants_to_initializers, initializers_out_of_inputs

PAD_KEY = "graphmp.pad"


class PadReport:
    def __init__(self, data: dict, model=None):
        self.data, self.model = data, model

    def to_dict(self) -> dict:
        return self.data

    def __getitem__(self, k):
        return self.data[k]

    def summary(self) -> str:
        return summarize(self.data)


def summarize(d: dict) -> str:
    """Text for a padding report (also used by convert --pad-channels)."""
    lines = [f"  padding to multiples of {d['multiple']}: {len(d['padded'])} layer dims padded, "
             f"{len(d['unaligned'])} left unaligned, {d['slice_nodes']} Slice/Gather nodes where padded "
             "channels become observable"]
    for p in d["padded"]:
        lines.append(f"    {p['node']} ({p['op_type']}) {p['dim']}: {p['old']} -> {p['new']}")
    for s in d["stem"]:
        lines.append(f"    stem {s['node']}: {s['choice']}")
    if d["flops_model_before"]:
        added = d["flops_padded_layers_after"] - d["flops_padded_layers_before"]
        lines.append(f"  added FLOPs: {added / 1e6:.2f} M ({100 * added / d['flops_model_before']:.2f}% of the "
                     "Conv/Gemm/MatMul FLOPs; symbolic dims counted as 1)")
    lines.append(f"  added weight bytes: {d['weight_bytes_added'] / 1e6:.3f} MB"
                 + (f" ({100 * d['weight_bytes_added'] / d['weight_bytes_before']:.2f}%)" if d.get("weight_bytes_before") else ""))
    for u in d["unaligned"]:
        lines.append(f"    unaligned {u['node']} ({u['op_type']}) {u['dim']}={u['value']}: {u['reason']}")
    for w in d.get("warnings", []):
        lines.append(f"  warning: {w}")
    return "\n".join(lines)


def pad_model(model: onnx.ModelProto, base_dir: str | None, multiple: int, stem: str = "auto",
              max_overhead: float = 0.5) -> dict:
    """Pad an in-memory model (modified in place) and return the report."""
    if multiple not in MULTIPLES:
        raise GraphmpError(f"--multiple must be one of {', '.join(map(str, MULTIPLES))}, not {multiple}")
    if stem not in ("auto", "off"):
        raise GraphmpError(f"stem must be 'auto' or 'off', not '{stem}'")
    warnings = []
    moved = initializers_out_of_inputs(model)
    if moved:
        warnings.append(f"{moved} initializers were also graph inputs; they are now constants (so their "
                        "weights can be padded; ONNX Runtime recommends the same)")
    constants_to_initializers(model)
    name_nodes(model, Names(model))
    before = model_weight_bytes(model)
    rep = pad_channels(model, base_dir, multiple, stem, max_overhead)
    rep["weight_bytes_before"] = before
    rep["weight_bytes_added"] = model_weight_bytes(model) - before
    rep["warnings"] = warnings
    meta = model.metadata_props.add()
    meta.key, meta.value = PAD_KEY, json.dumps({"version": __version__, "multiple": multiple})
    return rep


def pad(src, dst=None, *, multiple: int = 8, stem: str = "auto", max_overhead: float = 0.5,
        external_data: bool | None = None, validate: bool = False, shapes=None, seed: int = 0) -> PadReport:
    """Pad Conv channels and GEMM dimensions of `src` (path or ModelProto) to `multiple`.

    dst: output path (atomic; the input is never touched) or None to get the model in
    `report.model`. validate: check the padded model (full checker, ONNX Runtime load), then
    run ONNX Runtime on the original and the padded model with the same generated inputs
    (dynamic dims from `shapes` or a trial run) and record the max abs difference per output."""
    t0 = time.perf_counter()
    model, path, base_dir = open_model(src, dst)
    if validate and shapes is not None:  # a bad --shapes is an error before anything is written
        from .inputs import check_shapes, input_specs, parse_shapes
        shapes = parse_shapes(shapes)
        check_shapes(input_specs(model), shapes, path)
    rep = pad_model(model, base_dir, multiple, stem, max_overhead)
    rep.update(source=path, output=os.fspath(dst) if dst is not None else None)
    had_external = any(is_external(t) for g in iter_graphs(model.graph) for t in g.initializer)
    if dst is not None:
        save_model(model, os.fspath(dst), base_dir, None, had_external if external_data is None else external_data)
        out = os.fspath(dst)
    else:
        for g in iter_graphs(model.graph):
            for t in g.initializer:
                materialize(t, base_dir, None)
        out = model
    if validate:
        rep["validation"] = validate_padding(src, out, shapes, seed)
    rep["seconds"] = time.perf_counter() - t0
    return PadReport(rep, None if dst is not None else model)


def validate_padding(ref, padded, shapes=None, seed: int = 0) -> dict:
    """Validity of the padded model, then ONNX Runtime outputs of the original and the
    padded model on the same inputs (batch 2 where the model allows it)."""
    from .check import validity
    from .inputs import find_shapes
    from .oracle import runner
    valid = validity(padded, ref)
    if not valid["valid"]:
        return {"validity": valid, "outputs": {}, "shapes_unchanged": False, "max_abs": float("inf"), "inputs": None}
    ref_model = load_model(ref) if isinstance(ref, (str, os.PathLike)) else ref
    run_ref = runner(ref)
    plan = find_shapes(ref_model, run_ref, shapes, where="pad --validate")
    feeds = plan.feeds(seed, batch=2 if plan.batch_free else None)
    a = run_ref(feeds)
    b = runner(padded)(feeds)
    outs = {}
    for k, v in a.items():
        w = b[k]
        outs[k] = {"shape_before": list(v.shape), "shape_after": list(w.shape),
                   "max_abs": float(np.max(np.abs(v.astype(np.float64) - w.astype(np.float64)))) if v.size else 0.0,
                   "ref_max_abs": float(np.max(np.abs(v))) if v.size else 0.0}
    return {"validity": valid, "inputs": plan.describe(2 if plan.batch_free else None), "outputs": outs,
            "shapes_unchanged": all(o["shape_before"] == o["shape_after"] for o in outs.values()),
            "max_abs": max((o["max_abs"] for o in outs.values()), default=0.0)}

"""graphmp.convert: FP32 ONNX -> mixed precision, as a pipeline of passes.

    load -> prepare -> types -> drop redundant Casts -> calibrate -> classify -> paint
         -> apply -> sort -> save (atomic, streaming external data)

Each pass lives in graphmp/passes/ and documents what it guarantees.
"""
from __future__ import annotations

import collections
import json
import os
import time

from . import __version__
from .context import FLOAT, Ctx, Options
from .errors import GraphmpError
from .io import (CONVERT_MARK, TWO_GB, iter_graphs, is_external, materialize, model_weight_bytes, open_model,
                 save_model, tensor_nbytes)
from .ops import LOW_TYPES
from .passes import apply, calibrate, classify, paint, prepare, types
from .passes.apply import to_low

MARK_KEY = "graphmp"


class ConvertReport:
    """What a conversion did. `to_dict()` is the JSON report; `summary()` the short text."""

    def __init__(self, data: dict, model=None):
        self.data = data
        self.model = model

    def to_dict(self) -> dict:
        return self.data

    def __getitem__(self, k):
        return self.data[k]

    @property
    def fp32_nodes(self) -> dict:
        return {e["name"]: e["reason"] for e in self.data.get("fp32_nodes", [])}

    def summary(self) -> str:
        d = self.data
        if d.get("already_converted"):
            return f"{d['source']}: already converted by graphmp ({d['already_converted']}); nothing to do."
        n = d["nodes"]
        lines = [
            f"{d['source']} -> {d.get('output') or '(in memory)'}  [{d['target']}]",
            f"  nodes: {n['low']} {d['target']}, {n['fp32']} fp32, {n['other']} non-float; "
            f"{d['casts_added']} Casts added",
            f"  weights: {d['weight_bytes_before'] / 1e6:.2f} MB -> {d['weight_bytes_after'] / 1e6:.2f} MB",
            f"  calibration: {d['calibration']['source']}",
        ]
        if d["fp32_by_reason"]:
            lines.append("  kept FP32:")
            for reason, count in d["fp32_by_reason"].items():
                lines.append(f"    {count:5d}  {reason}")
        if "padding" in d:
            from .pad import summarize
            lines.append(summarize(d["padding"]))
        changed = [r for r in d["rounding"] if r.get("flushed_to_zero") or r.get("overflowed")]
        if changed:
            lines.append(f"  rounding: {len(changed)} initializer(s) lost values to zero/overflow "
                         "(see the JSON report 'rounding')")
        for w in d["warnings"]:
            lines.append(f"  warning: {w}")
        if "validation" in d:
            v = d["validation"]
            lines.append(f"  validation ({v['oracle']}): {'PASS' if v['passed'] else 'FAIL'}")
            for name, o in v["outputs"].items():
                lines.append(f"    {name}: max abs {o['max_abs']:.3g}, max rel {o['max_rel']:.3g}"
                             + (f", argmax agree {o['argmax_agree']:.4f}" if o.get("argmax_agree") is not None else "")
                             + (f", NON-FINITE {o['nonfinite']}" if o["nonfinite"] else ""))
        lines.append(f"  time: {d['seconds']:.2f} s")
        return "\n".join(lines)


def _reason_group(reason: str) -> str:
    if reason.startswith("range:"):
        return "range: values above the threshold in calibration"
    if reason.startswith("initializer"):
        return "initializer values out of the low-precision range"
    if reason.startswith("FP32 spread"):
        return "FP32 spread from an FP32 neighbour"
    if reason.endswith("(FP32 op class)"):
        return "range-sensitive op (FP32 op class)"
    if reason.startswith("no ") and " form of " in reason:
        return "no low-precision form at this opset"
    return reason


def _deferred_bytes(model) -> int:
    return sum(tensor_nbytes(t) // 2 for g in iter_graphs(model.graph) for t in g.initializer
               if t.doc_string.startswith(CONVERT_MARK))


def _convert_fn(arr, elem):
    return to_low(arr, elem)


def convert(src, dst=None, *, target: str = "fp16", keep_io_types: bool = True, fp32_ops=(),
            fp32_nodes: str | None = None, fp16_nodes: str | None = None, calibration=None,
            range_threshold: float = 512.0, external_data: bool | None = None, validate: bool = False,
            atol: float = 1e-2, rtol: float = 1e-2, verbose: bool = False,
            pad_channels: int | None = None) -> ConvertReport:
    """Convert an FP32 ONNX model (path or ModelProto) to mixed precision.

    dst: output path (written atomically; the input is never touched) or None to get
    the model back in `report.model`. See `graphmp convert --help` for the options.
    pad_channels: first pad channels/GEMM dims to multiples of this (graphmp.pad).
    """
    t0 = time.perf_counter()
    if target not in LOW_TYPES:
        raise GraphmpError(f"target must be one of {sorted(LOW_TYPES)}, not '{target}'")
    opts = Options(target=target, keep_io_types=keep_io_types, fp32_ops=tuple(fp32_ops or ()),
                   fp32_nodes=fp32_nodes, fp16_nodes=fp16_nodes, calibration=calibration,
                   range_threshold=float(range_threshold), external_data=external_data, verbose=verbose)
    for flag, rx in (("--fp32-nodes", fp32_nodes), ("--fp16-nodes", fp16_nodes)):
        if rx:
            try:
                __import__("re").compile(rx)
            except Exception as e:
                raise GraphmpError(f"{flag} '{rx}' is not a valid regular expression ({e})") from None
    model, path, base_dir = open_model(src, dst)
    had_external = any(is_external(t) for g in iter_graphs(model.graph) for t in g.initializer)
    ctx = Ctx(model=model, options=opts, path=path, base_dir=base_dir)
    report = {"graphmp_version": __version__, "source": path, "output": os.fspath(dst) if dst else None,
              "target": target, "keep_io_types": keep_io_types}
    ctx.report = report

    mark = {p.key: p.value for p in model.metadata_props}.get(MARK_KEY)
    if mark is not None:
        report.update(already_converted=mark, seconds=time.perf_counter() - t0)
        if dst is not None:
            save_model(model, os.fspath(dst), base_dir, _convert_fn,
                       external_data if external_data is not None else had_external)
            return ConvertReport(report)
        return ConvertReport(report, model)

    ctx.log(f"loaded {path}: {len(model.graph.node)} nodes")
    if pad_channels:
        from .pad import pad_model
        report["padding"] = pad_model(model, base_dir, pad_channels)
        ctx.log(f"padded {len(report['padding']['padded'])} layer dims to multiples of {pad_channels}")
    prepare.build(ctx)
    model = ctx.model
    report["weight_bytes_before"] = model_weight_bytes(model)  # Constant nodes counted as weights
    types.infer_types(ctx)
    if not any(t == FLOAT for d in ctx.types.values() for t in d.values()):
        raise GraphmpError(f"{path}: the model has no FP32 tensors, so there is nothing to convert.")
    report["prepare"]["redundant_casts_removed"] = prepare.drop_redundant_casts(ctx, ctx.type_of)
    ctx.log("calibrating")
    calibrate.calibrate(ctx)
    ctx.log("classifying and painting")
    classify.classify(ctx)
    paint.paint(ctx)
    ctx.log("placing Casts")
    original_nodes = [(g, n) for g, n in ctx.nodes()]
    apply.apply(ctx)
    for g in ctx.root.walk():
        g.toposort(path)
    ctx.root.write_back()

    # --- report -----------------------------------------------------------------
    counts = collections.Counter()
    fp32_nodes = []
    for g, n in original_nodes:
        info = ctx.info[id(n)]
        if info.cls == "none" or (info.cls == "fixed" and not info.reason):
            counts["other"] += 1
        elif id(n) in ctx.lowered:
            counts["low"] += 1
        else:
            counts["fp32"] += 1
            fp32_nodes.append({"name": n.name, "op_type": n.op_type, "graph": g.key,
                               "reason": info.reason or "stays in its FP32 region (an FP32 operand, or no fp16 neighbour)"})
    report["nodes"] = {"low": counts["low"], "fp32": counts["fp32"], "other": counts["other"],
                       "total": len(original_nodes)}
    report["fp32_nodes"] = fp32_nodes
    report["fp32_by_reason"] = dict(collections.Counter(_reason_group(e["reason"]) for e in fp32_nodes).most_common())
    report["weight_bytes_after"] = model_weight_bytes(model) - _deferred_bytes(model)
    report["warnings"] = ctx.warnings
    meta = model.metadata_props.add()
    meta.key, meta.value = MARK_KEY, json.dumps({"version": __version__, "target": target,
                                                 "keep_io_types": keep_io_types})

    if dst is None:
        for g in iter_graphs(model.graph):
            for t in g.initializer:
                materialize(t, base_dir, _convert_fn)
        report["seconds"] = time.perf_counter() - t0
        if validate:
            _validate(report, src, model, calibration, atol, rtol)
        return ConvertReport(report, model)

    ext = external_data
    if ext is None:
        ext = had_external or report["weight_bytes_after"] > int(TWO_GB * 0.9)
    report["external_data"] = bool(ext)
    ctx.log(f"writing {dst}{' with external data' if ext else ''}")
    save_model(model, os.fspath(dst), base_dir, _convert_fn, bool(ext),
               progress=(lambda i, n: ctx.log(f"  tensor {i}/{n}")) if verbose else None)
    report["seconds"] = time.perf_counter() - t0
    if validate:
        _validate(report, path, os.fspath(dst), calibration, atol, rtol)
    return ConvertReport(report)


def _validate(report, ref, converted, calibration, atol, rtol):
    from .check import check
    data = None
    if isinstance(calibration, (str, os.PathLike)):
        data = calibration
    elif isinstance(calibration, (list, tuple)) and calibration and calibration[0] != "auto":
        data = calibration[0] if isinstance(calibration[0], (str, os.PathLike, dict)) else None
    report["validation"] = check(ref, converted, data=data, atol=atol, rtol=rtol).to_dict()

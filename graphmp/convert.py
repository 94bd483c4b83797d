"""graphmp.convert: FP32 ONNX -> mixed precision, as a pipeline of passes.

The pipeline is PIPELINE below, one Step per pass; each pass lives in graphmp/passes/
and says in its docstring what it needs and what it guarantees, and its Step declares
the same as data (the Ctx fields it needs and gives), checked with GRAPHMP_DEBUG=1 and
in the tests. Around it: load (the input is never modified), the report, and an atomic,
streaming save.
"""
from __future__ import annotations

import collections
import json
import os
import time

from onnx import TensorProto

from .version import __version__
from .budget import DEFAULT
from .cast_cost import cast_traffic, summary_line as cast_summary_line
from .context import Ctx, Options
from .errors import GraphmpError
from .load_check import Gate, LoadCheckFailed
from .load_check import summary_line as load_check_line
from .model_io import (CONVERT_MARK, REASON_MARK, TWO_GB, iter_graphs, is_external, materialize, model_weight_bytes,
                       open_model, tensor_nbytes)
from .names import printable_lines
from .save import save_model
from .wire import is_self_reference
from .passes import (PassResult, Step, apply, calibrate, checking, classify, fuse, islands, kv_cache, legalize,
                     paint, plan_file, prepare, run_steps, search, types)
from .passes.apply import LowConverter, to_low
from .plan_read import load as load_plan

MARK_KEY = "graphmp"
LOW_ELEMS = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def sort(ctx) -> PassResult:
    """Every graph topologically sorted (outer-scope captures count as inputs) and
    written back into the model: the output always passes the checker's order rule."""
    for g in ctx.root.walk():
        g.toposort(ctx.path)
    ctx.root.write_back()
    return PassResult(changed=True)


def _searching(ctx) -> bool:   # --max-error without --plan
    return ctx.options.max_error is not None and ctx.options.plan is None


def _planning(ctx) -> bool:    # --plan or --save-plan
    return ctx.options.plan is not None or bool(ctx.options.save_plan)


def _trialing(ctx) -> bool:    # island trials wanted (islands.trial_limit), batches ran
    return islands.trials_wanted(ctx) and bool(ctx.batches) and bool(ctx.batch_outputs)


def _plan_given(ctx) -> bool:  # --plan
    return ctx.options.plan is not None


def _plan_saved(ctx) -> bool:  # --save-plan
    return bool(ctx.options.save_plan)


# The passes in order: Step(report key, pass, needs, gives, when). needs/gives are the
# pass's contract as names of Ctx fields (graphmp/passes/__init__.py; checked with
# GRAPHMP_DEBUG=1 and in the tests); `when`: the options under which the pass does its job.
# A pass's details go into the report under its key (None: top level).
PIPELINE = [
    # --fuse ort: ONNX Runtime's transformer fusions
    Step("fuse", fuse.run, needs=("model",), gives=("model",)),
    # ImageScaler/Crop/Affine/... (experimental ops removed in opset 10) as standard ops
    Step("legalize", legalize.run, needs=("model",), gives=("model",)),
    # opset >= 7, constants, names, sorted; the IR
    Step("prepare", prepare.run, needs=("model",), gives=("root", "names")),
    # element type of every tensor; the opsets
    Step("types", types.run, needs=("root",), gives=("types", "opsets")),
    # no-op and round-trip Casts of the source
    Step("prepare", prepare.run_drop_redundant_casts, needs=("root", "types")),
    # a decoder's KV cache (found by structure); the float I/O declared in the low type
    Step("kv_cache", kv_cache.run, needs=("root", "types"), gives=("low_io",)),
    # max |x| and dims of every float tensor (FP32 runs); the batches that ran and their outputs
    Step("calibration", calibrate.run, needs=("types",), gives=("ranges", "shapes", "batches", "batch_outputs")),
    # op class; why a node must stay FP32
    Step("classify", classify.run, needs=("root", "types", "opsets", "ranges"),
         gives=("info", "weight_rounding", "range_candidates", "wide_range")),
    # which nodes run in the low type
    Step("paint", paint.run, needs=("info",), gives=("lowered",)),
    # --max-error: fewest FP32 nodes within budget (not with --plan)
    Step("search", plan_file.unless_plan(search.run),
         needs=("info", "lowered", "batches", "batch_outputs", "range_candidates", "wide_range"),
         gives=("search_budget", "search_refs"), when=_searching),
    # FP32 islands whose Casts cost more than the accuracy they buy (measured), and FP16
    # groups whose Casts cost more than their Tensor Core work; after the search, so that
    # a --max-error plan is priced for its Casts too (yardstick: the budget)
    Step("islands", islands.run, needs=("info", "lowered", "batches", "batch_outputs", "shapes", "low_io"),
         gives=("lowered",), when=_trialing),
    # --plan: the saved precisions; --save-plan: node keys
    Step("plan", plan_file.run, needs=("info", "lowered", "batches"), gives=("plan",), when=_planning),
    # Casts, converted weights
    Step(None, apply.run, needs=("info", "lowered", "types", "low_io")),
    # topological order, written back
    Step("sort", sort, needs=("root",)),
    # --max-error: the written model's error
    Step("search", search.verify, needs=("search_budget", "search_refs", "batches"), when=_searching),
    # --plan: the written model's error
    Step("plan", plan_file.verify, needs=("plan",), when=_plan_given),
    # --save-plan: the plan file
    Step("plan", plan_file.save, needs=("plan",), when=_plan_saved),
]

# What a given field must hold beyond "not None" (the passes' prose guarantees, cheap to check).
FIELD_CHECKS = {
    "types": (lambda ctx: all(g.key in ctx.types for g in ctx.root.walk()), "an entry for every graph"),
    "info": (lambda ctx: len(ctx.info) >= sum(1 for _ in ctx.nodes()), "an entry for every node"),
}


def run_pipeline(ctx, steps=PIPELINE, check: bool | None = None) -> dict:
    """Run the passes in order; returns {pass name: seconds}. Each pass's details go into
    the report under its key; report["pipeline"] says which passes changed the model and
    whether the contracts were checked (check: None = GRAPHMP_DEBUG=1 or a test run)."""
    check = checking() if check is None else check
    timings, changed = {}, []
    for step, res, seconds in run_steps(ctx, steps, check, FIELD_CHECKS):
        timings[step.name] = round(seconds, 4)
        ctx.log(f"{step.name}: {seconds:.2f} s")
        if res is None:
            continue
        if res.changed:
            changed.append(step.name)
        if res.details:
            target = ctx.report if step.report_key is None else ctx.report.setdefault(step.report_key, {})
            target.update(res.details)
    ctx.report["pipeline"] = {"changed": changed, "contracts_checked": check}
    ctx.log(f"passes that changed the model: {', '.join(changed) or 'none'}")
    return timings


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
            f"{d['source']} -> {d.get('output') or '(in memory)'}"
            f"{' (NOT written: the load check failed)' if d.get('written') is False else ''}  [{d['target']}]",
            f"  nodes: {n['low']} {d['target']}, {n['fp32']} fp32, {n['other']} other"
            + (f" ({n['source_low']} already FP16/BF16 in the source)" if n.get("source_low") else " (non-float)")
            + "; "
            f"{d['casts_added']} Casts added",
            f"  weights: {d['weight_bytes_before'] / 1e6:.2f} MB -> {d['weight_bytes_after'] / 1e6:.2f} MB",
            f"  calibration: {_calibration_line(d['calibration'])}",
        ]
        if d.get("cast_traffic"):
            lines.append(cast_summary_line(d["cast_traffic"], d["target"]))
        if d.get("fuse"):
            f = d["fuse"]
            lines.append(f"  fused ({f['model_type']}, ONNX Runtime only): " + ", ".join(
                f"{v} {k}" for k, v in f["fused"].items()) if f["fused"] else f"  fuse: {f['note']}")
        if d.get("legalize"):
            lines.append(legalize.summary_line(d["legalize"]))
        if d.get("kv_cache"):
            lines.append(kv_cache.summary_line(d["kv_cache"]))
        if d.get("search", {}).get("budget"):
            lines += _search_line(d["search"]).split("\n")  # its given-back note is a line of its own
        if d.get("plan"):
            lines.append(plan_file.summary_line(d["plan"]))
        if d.get("plan_depends_on_machine"):
            lines.append(f"  plan: depends on this machine: {d['plan_depends_on_machine']}")
        if d["fp32_by_reason"]:
            lines.append("  kept FP32:")
            for reason, count in d["fp32_by_reason"].items():
                lines.append(f"    {count:5d}  {reason}")
        if d.get("range_rule", {}).get("note"):
            lines.append(f"  range rule: {d['range_rule']['note']}")
        if "padding" in d:
            from .pad import summarize
            lines.append(summarize(d["padding"]))
        changed = [r for r in d["rounding"] if r.get("flushed_to_zero") or r.get("overflowed")]
        if changed:
            lines.append(f"  rounding: {len(changed)} initializer(s) lost values to zero/overflow "
                         "(see the JSON report 'rounding')")
        for w in d["warnings"]:
            lines.append(f"  warning: {w}")
        if load_check_line(d.get("load_check")):
            lines.append(load_check_line(d.get("load_check")))
        if "validation" in d:  # the check report, as `graphmp check` prints it
            from .check import CheckReport
            first, *rest = CheckReport(d["validation"]).summary().splitlines()  # lines of their own, each printable
            lines += ["  validation: " + first] + ["  " + x for x in rest]
        lines.append(f"  time: {d['seconds']:.2f} s")
        return printable_lines(lines)


def _search_line(s: dict) -> str:
    b = s["budget"]
    floor = max(b["floor"].values(), default=0.0)
    head = f"  accuracy budget ({b['metric']} <= {b['spec']}): "
    if not s.get("evaluations"):
        return head + f"met by the static plan, error {s.get('error_static_plan', 0):.3g} x budget; floor {floor:.3g}"
    held = ""
    if "held_out_error" in s:
        margin = s.get("margin", 1.0)
        held = f", held-out batch {s['held_out_error']:.3g}" + (f", margin {margin:.3g}" if margin > 1 else "")
        if s["refit_on_all_batches"]:
            held += (f" (refit on every batch within {s['limit']:.3g} x budget, for unseen inputs)" if s.get("limit", 1) < 1
                     else " (above: refit on every batch)")
    def num(x):
        return "not measured" if x is None else f"{x:.3g}"
    met = {True: "met", False: "NOT met"}.get(s["reached"], "not measured")
    met += " (the written model, after the island trials)" if s.get("after_islands") else ""
    stopped = " (--search-time ran out: best plan so far)" if s.get("out_of_time") else ""
    return (head + f"{met}{stopped}, error {num(s['error'])} x budget{held} (static plan "
            f"{num(s.get('error_static_plan'))}); floor {floor:.3g}; {len(s['fp32_regions'])} regions kept FP32 "
            f"({100 * (1 - s['static_plan_compute_kept_fp16']):.1f}% of the static plan's FP16 compute); "
            + (f"{'~' if s.get('compute_share_approximate') else ''}{100 * s['model_compute_fp16']:.1f}% of the "
               "model's float Conv/MatMul compute in FP16; "
               if s.get("model_compute_fp16") is not None else "Conv/MatMul compute share unknown (no shapes); ")
            + f"{s['evaluations']} evaluations, {s['seconds']:.1f} s"
            + (f"\n  given back: {len(s['given_back'])} node(s) the range rule (|x| > --range-threshold) keeps FP32 "
               "run in FP16 within the budget (report: search.given_back)" if s.get("given_back") else ""))


def _calibration_line(c: dict) -> str:
    if not c.get("batches"):
        return c["source"]
    n = c["batches"]
    how = f"; shapes {c['shapes_found']}" if c.get("shapes_found") else ""
    return (f"{c['source']}, {n} batch{'es' if n > 1 else ''} ({_shapes_text(c['shapes'])}{how}), "
            f"{c['tensors_observed']} tensors observed")


# classify rules 11-13 (passes/value_rules.py); each node's own reason, in --report, names its range
VALUE_RULE_GROUPS = (
    ("mask sentinel:", "mask sentinel: carries a constant beyond FP16's max (finfo.min) into a Softmax"),
    ("periodic:", "periodic: a Sin/Cos argument where FP16's spacing is >= 2^-10 of the period, or its inputs"),
    ("rounded to an integer:", "rounded to an integer: computes a Round/Floor/Ceil or Cast-to-integer input"),
)


def _shapes_text(shapes: list, most: int = 3) -> str:
    """The calibration batches' input shapes in a few words: each distinct one once, with
    its count where it repeats (200 batches of one shape: "x:8x3 (x200)"), at most `most`
    of them and how many more (the report lists every batch's)."""
    counts: dict = {}
    for s in shapes:
        counts[s] = counts.get(s, 0) + 1
    parts = [s + (f" (x{k})" if k > 1 else "") for s, k in list(counts.items())[:most]]
    more = len(counts) - most
    return "; ".join(parts) + (f"; {more} more shape{'s' if more > 1 else ''}" if more > 0 else "")


def _reason_group(reason: str) -> str:
    if reason.startswith("range:"):
        return "range: values above the threshold in calibration"
    if reason.startswith("initializer"):
        return "initializer values out of the low-precision range"
    if reason.startswith("search:"):
        return "search: kept FP32 to meet --max-error"
    if reason.startswith("plan:"):
        return "plan: FP32 as the --plan file says"
    if reason.startswith("INT8 Q/DQ"):
        return "INT8 Q/DQ op (kept for the INT8 fusion)"
    if reason.startswith("islands: merged"):
        return "islands: merged with FP32 neighbours (its Casts cost more than its FP16 work)"
    if reason.startswith("FP32 spread"):
        return "FP32 spread from an FP32 neighbour"
    if "is range-sensitive (FP32 op class)" in reason:  # also a Softmax --norm-io left FP32 (paint.NORM_KEPT)
        return "range-sensitive op (FP32 op class)"
    for prefix, group in VALUE_RULE_GROUPS:
        if reason.startswith(prefix):
            return group
    if reason.startswith("no ") and " form of " in reason:
        return "no low-precision form at this opset"
    return reason


def _deferred_bytes(model) -> int:
    return sum(tensor_nbytes(t) // 2 for g in iter_graphs(model.graph) for t in g.initializer
               if t.doc_string.startswith(CONVERT_MARK))


def _check_op_names(ops, model, where, fused=False):
    """--fp32-ops must name ops of this model or of ONNX, or with --fuse the fused ops
    (a typo would silently do nothing)."""
    if not ops:
        return
    import difflib

    from onnx import defs

    from .policy import MS_OP_CLASS
    known = {n.op_type for g in iter_graphs(model.graph) for n in g.node} | {s.name for s in defs.get_all_schemas()}
    known |= set(MS_OP_CLASS) if fused else set()
    for op in ops:
        if op not in known:
            close = difflib.get_close_matches(op, sorted(known), n=1)
            raise GraphmpError(f"{where}: --fp32-ops '{op}' is not an op of this model or of ONNX"
                               + (f" (did you mean {close[0]}?)" if close else "") + "; op names are case-sensitive")


def convert(src, dst=None, **options) -> ConvertReport:
    """Convert an FP32 ONNX model (path or ModelProto) to mixed precision.

    dst: output path (written atomically; the input is never touched) or None to get
    the model back in `report.model`. Options (graphmp.context.Options; the flags of
    `graphmp convert --help`): target, keep_io_types, cache_io ("fp32" or the target:
    the type of a KV cache's inputs and outputs; None: as keep_io_types), fp32_ops,
    fp32_nodes, fp16_nodes, calibration (None: generated inputs; "off"; .npz path(s) or dicts of arrays),
    shapes (NAME:DIMS,... for generated inputs), range_threshold, external_data,
    pad_channels, validate, atol, rtol, verbose, fuse ("ort": ONNX Runtime's transformer
    fusions first; the output is then for ONNX Runtime only), model_type, plan (a file
    of save_plan: its precisions, no search; graphmp/passes/plan_file.py), save_plan,
    load_check (default True: dst is written only after ONNX Runtime opened and ran the
    output in a child process, graphmp/load_check.py; else LoadCheckFailed, with the
    report in its `.report`, and nothing is written).
    """
    t0 = time.perf_counter()
    ctx, had_external, t_load = _open(src, dst, options, t0)
    mark = {p.key: p.value for p in ctx.model.metadata_props}.get(MARK_KEY)
    if mark is not None:
        return _already_converted(ctx, dst, mark, had_external, t0)
    _run_passes(ctx, t_load)
    _finish_report(ctx)
    low = LowConverter(ctx.report.get("rounding", []))
    if dst is None:
        return _in_memory(ctx, src, low, t0)
    return _write(ctx, dst, low, had_external, t0)


def _open(src, dst, options: dict, t0: float):
    """(the Ctx of the run, with the report's head in ctx.report; whether the source has
    external data of its own; seconds the load took). Checks the options (a --plan file
    is loaded and checked before any work) and --fp32-ops' names."""
    opts = Options.from_kwargs(options)
    if opts.plan is not None:  # checked before any work (graphmp/plan_read.py)
        opts.plan = load_plan(opts.plan)
    model, path, base_dir = open_model(src, dst, by_reference=True)
    t_load = time.perf_counter() - t0
    _check_op_names(opts.fp32_ops, model, path, fused=opts.fuse is not None)
    had_external = any(is_external(t) and not is_self_reference(t, path)
                       for g in iter_graphs(model.graph) for t in g.initializer)
    ctx = Ctx(model=model, options=opts, path=path, base_dir=base_dir)
    ctx.report = {"graphmp_version": __version__, "source": path, "output": os.fspath(dst) if dst else None,
                  "target": opts.target, "keep_io_types": opts.keep_io_types}
    return ctx, had_external, t_load


def _already_converted(ctx, dst, mark: str, had_external: bool, t0: float) -> ConvertReport:
    """The report for a model graphmp already converted (its mark): nothing to do; with
    dst, the model is saved there as it is."""
    report, opts, model = ctx.report, ctx.options, ctx.model
    report.update(already_converted=mark, seconds=time.perf_counter() - t0)
    if opts.validate:
        report["validation_skipped"] = ("the input is already converted; compare it with its FP32 source: "
                                        f"graphmp check FP32_SOURCE.onnx {ctx.path}")
    if dst is not None:
        save_model(model, os.fspath(dst), ctx.base_dir, to_low,
                   opts.external_data if opts.external_data is not None else had_external)
        return ConvertReport(report)
    return ConvertReport(report, model)


def _run_passes(ctx, t_load: float):
    """--pad-channels (report["padding"]), then PIPELINE; report["timings"]: the load and
    each pass."""
    report, opts = ctx.report, ctx.options
    ctx.log(f"loaded {ctx.path}: {len(ctx.model.graph.node)} nodes")
    if opts.pad_channels:
        from .pad import pad_model
        report["padding"] = pad_model(ctx.model, ctx.base_dir, opts.pad_channels)
        ctx.log(f"padded {len(report['padding']['padded'])} layer dims to multiples of {opts.pad_channels}")
    report["timings"] = {"load": round(t_load, 4), **run_pipeline(ctx)}


def _finish_report(ctx):
    """After the passes: the weights before, the node counts (_report_nodes), the cast
    traffic, the weights after, the warnings; the model gets graphmp's mark (read by
    graphmp.session())."""
    report, opts, model = ctx.report, ctx.options, ctx.model
    report["weight_bytes_before"] = report["prepare"]["weight_bytes"]  # Constant nodes counted as weights
    _report_nodes(ctx)
    t_casts = time.perf_counter()  # what the Casts move per inference; FP16 share of the compute (cast_cost.py)
    # measure: the Casts whose sizes shape inference cannot follow (old experimental ops,
    # data-dependent shapes) are sized by one ONNX Runtime run; none such, no run
    report["cast_traffic"] = cast_traffic(model, ctx.batches[0] if ctx.batches else None, report.get("casts_added"),
                                          measure=True)
    report["timings"]["cast_traffic"] = round(time.perf_counter() - t_casts, 4)
    report["weight_bytes_after"] = model_weight_bytes(model) - _deferred_bytes(model)
    report["warnings"] = ctx.warnings
    if opts.search_time:  # the only limit in seconds: without it the same inputs and options give the same bytes
        report["plan_depends_on_machine"] = _clock_note(opts.search_time, report)
    meta = model.metadata_props.add()
    from .session import cuda_options
    meta.key, meta.value = MARK_KEY, json.dumps({"version": __version__, "target": opts.target,
                                                 "keep_io_types": opts.keep_io_types,
                                                 "cache_io": (ctx.report.get("kv_cache") or {}).get("io"),
                                                 "ort_cuda_options": cuda_options(ctx)})  # for graphmp.session()


def _clock_note(seconds: float, report: dict) -> str:
    """What --search-time did, in words: whether it stopped the search or the island trials
    here, and that a limit in seconds makes the plan depend on the machine's speed and load."""
    cut = [what for what, ran_out in (("the search", report.get("search", {}).get("out_of_time")),
                                      ("the island trials", any("--search-time" in t["decision"] for t in
                                                                report.get("islands", {}).get("trials", []))))
           if ran_out]
    return (f"--search-time {seconds:g} s " + (f"stopped {' and '.join(cut)}" if cut else
            "did not run out here, but may on a slower or busier machine")
            + "; a limit in seconds gives another plan on a slower or busier machine (without it, the same "
            "inputs and options write the same model anywhere)")


def _in_memory(ctx, src, low: LowConverter, t0: float) -> ConvertReport:
    """No dst: deferred conversions done in memory; --validate against src; the report
    with the model."""
    report, opts, model = ctx.report, ctx.options, ctx.model
    for g in iter_graphs(model.graph):
        for t in g.initializer:
            materialize(t, ctx.base_dir, low)
    report["seconds"] = time.perf_counter() - t0
    if opts.validate:
        _validate(report, src, model, opts)
    return ConvertReport(report, model)


def _write(ctx, dst, low: LowConverter, had_external: bool, t0: float) -> ConvertReport:
    """Save to dst (atomic, streaming; deferred conversions while writing), with external
    data when asked, when the source had some, or near 2 GB; --validate against the
    source path; the report."""
    report, opts = ctx.report, ctx.options
    ext = opts.external_data
    if ext is None:
        ext = had_external or report["weight_bytes_after"] > int(TWO_GB * 0.9)
    report["external_data"] = bool(ext)
    ctx.log(f"writing {dst}{' with external data' if ext else ''}")
    t_write = time.perf_counter()
    # the load check runs on the finished temporary file: a model ONNX Runtime cannot open never replaces dst
    gate = Gate(ctx.batches[0] if ctx.batches else None, opts.shapes, ctx.log,
                bf16=opts.target == "bf16", shown_as=os.fspath(dst)) if opts.load_check else None
    try:
        save_model(ctx.model, os.fspath(dst), ctx.base_dir, low, bool(ext),
                   progress=(lambda i, n: ctx.detail(f"  tensor {i}/{n}")) if opts.verbose else None, before_commit=gate)
    except LoadCheckFailed as e:
        report.update(load_check=e.result, written=False, seconds=time.perf_counter() - t0)
        e.report = ConvertReport(report)
        raise
    report["timings"]["write"] = round(time.perf_counter() - t_write, 4)  # includes deferred conversions and the check
    report["load_check"] = gate.result if gate is not None else {"skipped": "--no-load-check"}
    report["seconds"] = time.perf_counter() - t0
    if opts.validate:
        _validate(report, ctx.path, os.fspath(dst), opts)
    return ConvertReport(report)


def _report_nodes(ctx):
    """Counts of low/FP32/other nodes of the source and, for every FP32 node, why.
    (The source's nodes are those classify judged; Casts added later have no entry.)"""
    counts = collections.Counter()
    fp32_nodes = []
    for g, n in ctx.nodes():
        info = ctx.info.get(n)
        if info is None:
            continue
        if info.cls == "none" or (info.cls == "fixed" and not info.reason):
            counts["other"] += 1
            if any(o and ctx.type_of(g, o) in LOW_ELEMS for o in n.outputs):
                counts["source_low"] += 1  # low precision already in the source (a mixed or FP16 model)
        elif n in ctx.lowered:
            counts["low"] += 1
        else:
            counts["fp32"] += 1
            fp32_nodes.append({"name": n.name, "op_type": n.op_type, "graph": g.key,
                               "reason": info.reason or "stays in its FP32 region (an FP32 operand, or no fp16 neighbour)"})
            _record_reason(n.proto, fp32_nodes[-1]["reason"])
            ctx.detail(f"FP32 {n.op_type} '{n.name}': {fp32_nodes[-1]['reason']}")
    ctx.report["nodes"] = {"low": counts["low"], "fp32": counts["fp32"], "other": counts["other"],
                           "source_low": counts["source_low"],
                           "total": counts["low"] + counts["fp32"] + counts["other"]}
    ctx.report["fp32_nodes"] = fp32_nodes
    ctx.report["fp32_by_reason"] = dict(collections.Counter(_reason_group(e["reason"]) for e in fp32_nodes).most_common())
    ctx.report["range_rule"] = _range_rule(ctx, fp32_nodes)
    ctx.report["norm_io"] = {"policy": ctx.options.norm_io, "lowered": sorted(
        n.name for g, n in ctx.nodes() if ctx.info.get(n) is not None and ctx.info[n].cls == "norm"
        and n in ctx.lowered)}
    if not counts["low"] and counts["fp32"]:
        why = "; ".join(f"{n} {r}" for r, n in list(ctx.report["fp32_by_reason"].items())[:3])
        ctx.warn(f"nothing was converted: all {counts['fp32']} float nodes stay FP32 ({why}), so the output "
                 f"computes as the source does; --fp16-nodes REGEX forces nodes to {ctx.options.target.upper()} "
                 "where the op has a low-precision form")


def _record_reason(proto, reason: str) -> None:
    """Why the node stays FP32, as one REASON_MARK line of its doc_string in the output
    (`graphmp inspect` reads it back from any model graphmp wrote); the exporter's own
    doc text is kept, a previous graphmp line replaced."""
    kept = [line for line in proto.doc_string.splitlines() if not line.startswith(REASON_MARK)]
    proto.doc_string = "\n".join(kept + [REASON_MARK + " ".join(reason.split())])


def _range_rule(ctx, fp32_nodes) -> dict:
    """What decided rule 6 (classify): the nodes it kept FP32, the threshold, and the data
    the ranges came from; generated inputs are named, since real inputs may be wider or
    narrower (the decision is then a guess: --calibration with real inputs makes it)."""
    kept = [e["name"] for e in fp32_nodes if e["reason"].startswith("range:")]
    source = (ctx.report.get("calibration") or {}).get("source", "off")
    out = {"nodes": len(kept), "data": source,
           "threshold": ctx.options.range_threshold if ctx.options.range_threshold is not None else
           "auto: 512 on the way into a subtraction or normalisation, 4094 elsewhere (16x below FP16's max)"}
    if kept and source == "generated inputs":
        out["note"] = (f"{len(kept)} node(s) kept FP32 by ranges seen on generated inputs, not your data; "
                       "--calibration with real inputs decides it on the values the model will see")
    return out


def _validate(report, ref, converted, opts):
    """check() on the calibration data when the user gave some, else on generated
    inputs of the same shapes; judged by --max-error when given, else check's yardstick.
    A check that cannot run is a failed validation with 'not_run' (its one-line reason),
    not an exception: the converted model is written by then."""
    from .check import check
    cal = opts.calibration
    data = None
    if isinstance(cal, (str, os.PathLike, dict)):
        data = cal
    elif isinstance(cal, (list, tuple)) and cal and cal[0] not in ("auto", "off"):
        data = cal[0]
    try:
        report["validation"] = check(ref, converted, data=data, shapes=opts.shapes, atol=opts.atol, rtol=opts.rtol,
                                     max_error=opts.max_error if opts.max_error is not None else DEFAULT,
                                     metric=opts.metric, data_flag="--calibration").to_dict()
    except GraphmpError as e:  # the check could not run (the source refuses these inputs, ...): a failed
        # validation that says why, so the caller can still say what the conversion left on disk
        report["validation"] = {
            "passed": False, "not_run": str(e), "outputs": {}, "validity": None, "oracle": "not run",
            "converted": os.fspath(converted) if isinstance(converted, (str, os.PathLike)) else "<model>",
            "reference": os.fspath(ref) if isinstance(ref, (str, os.PathLike)) else "<model>", "metric": opts.metric,
            "max_error": str(opts.max_error if opts.max_error is not None else DEFAULT),
            "atol": opts.atol, "rtol": opts.rtol, "warnings": []}

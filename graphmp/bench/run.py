"""One bench run: settings -> models -> inputs -> planned rows opened, timed, judged -> result.

The pieces it composes are testable alone: settings.py (what was asked), plan.py (which
rows), rows.py (a row, speedups, notes), runners.py (prepare, run, time, outputs per
backend), judge.py (accuracy and the TF32 yardstick), oracle.py (the FP16-faithful check),
models.py (the compared models), report.py (table / JSON / PNG). An ONNX Runtime row's model
is opened first in a child process (graphmp/load_check.py): a crash fails that row only.

Untrusted models and users' files: outputs.py checks, before any work, that nothing the
run writes is a file it reads or a device; a model ONNX Runtime refuses is a one-line
error (no input shapes, no FP32 reference) or rows that say why, never a traceback.
"""
from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
import onnx

from ..budget import round_float_inputs, tf32_model
from ..convert import convert
from ..errors import GraphmpError, first_line
from ..load_check import LoadCheckFailed, failure_text, probe
from ..session import CPU, CUDA
from ..inputs import batch_positions, find_shapes, generate, input_specs, rebatch, user_batches
from ..model_io import load_model, load_with_weights, model_weight_bytes
from ..model_runs import run_ort
from ..model_runs import runner as ort_runner
from ..paths import check_target, refuse_clobber
from .outputs import kept_engine, kept_model, refuse_overwrites
from ..progress import Progress
from . import judge as J
from .env import environment, gpu_names
from .models import convert_occ, convert_ort_opt, fp32_baseline
from .plan import COMPARE, SOURCES, groups, plan_rows, static_shapes
from .source import is_fp32, source_precision
from .report import BenchResult, clean
from .oracle import fp16_oracle
from .rows import add_speedups, fastest_variants, noise_note
from .rows import kept as _kept, new_row as _new_row, row_name as _row_name, table_notes as _notes
from .runners import (TIMING, FellBack, OrtRunner, TrtRunner, device_memory_used, latency_stats, ort_cuda_options,
                      ort_cuda_status, time_interleaved, trt_status)
from .settings import Settings, csv_items

SCHEMA_VERSION = 2
ROW_PROGRESS_S = 2.0  # at most this often, a line on stderr about the row being warmed up or timed
NOTHING = "nothing to convert"  # graphmp.convert's word for a model with no FP32 work


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a bench run, after its rows began: `result` holds the rows that finished
    (a BenchResult with "partial": true and "interrupted" saying which row was cut). A
    KeyboardInterrupt, so a caller that does not catch it stops as on any Ctrl-C."""

    def __init__(self, result):
        super().__init__(result.data.get("interrupted"))
        self.result = result


def bench(model, *, converted=None, backends="trt,ort-cuda,ort-cpu", precisions=None, compare=None,
          compare_occ: bool = False, batches=(1,), keep=None, command: str | None = None, progress: bool = True,
          outputs=(), **options) -> BenchResult:
    """Time and check `model` (an FP32 .onnx, or one already converted by graphmp) per backend,
    precision, batch and session-option variant. See graphmp.bench's docstring for what is
    measured and the JSON schema.

    converted: a converted model to use for the fp16 rows instead of converting `model`.
    backends / precisions: names or 'a,b' strings (default: trt,ort-cuda,ort-cpu / fp32,tf32,fp16,
      plus the precisions of `compare`).
    compare: other converters as extra precisions: 'occ' (onnxconverter-common), 'ort-opt'
      (ONNX Runtime's transformers optimizer, float16; model type from the graph or
      `model_type`). compare_occ=True is compare='occ'.
    batches: sizes of the batch dims; a model whose batch cannot change runs its own batch.
    options: the fields of Settings (data, shapes, seed, warmup, iterations, min_time, rounds,
      cudnn_conv_algo_search, timing_cache, workspace_mb, max_error, tf32_factor, atol, rtol,
      oracle_max_mb, model_type).
    keep: a folder to keep the compared models and engines in (default: a temporary one).
    outputs: (label, path) of other files the caller will write (--json, --plot): refused,
      like the kept files, when one is an input file (see refuse_overwrites).
    """
    if command is None:
        command = f"graphmp.bench({os.fspath(model)!r}, backends={backends!r}, batches={batches!r}, ...)"
    compare = csv_items(compare or [], "comparison (--compare)", COMPARE)
    if compare_occ and "occ" not in compare:
        compare.append("occ")
    s = Settings.from_kwargs(backends, precisions, compare, batches, **options)
    path = os.fspath(model)
    graph = load_model(path)
    if converted is not None:
        load_model(os.fspath(converted))
    inputs = refuse_overwrites(s, path, graph, converted, keep, outputs)
    _refuse_bf16_inputs(path, graph)
    base_feeds = None
    if s.data is not None:
        ((_, base_feeds),) = user_batches(os.fspath(s.data), input_specs(graph), "--data")
    with tempfile.TemporaryDirectory(prefix="graphmp-bench-") as tmp:
        work = tmp if keep is None else os.fspath(keep)
        os.makedirs(work, exist_ok=True)
        run = _Run(s, path, graph, work, kept=keep is not None, progress=progress)
        run.inputs = inputs
        run.prepare_models(converted)
        run.prepare_inputs(base_feeds)
        run.run_rows()
        res = BenchResult(clean(run.result(command)))
    if res.data["partial"]:
        raise BenchInterrupted(res)
    return res


def _refuse_bf16_inputs(path, graph):
    """Before any work: ONNX Runtime's Python API takes no BF16 arrays, so a model with a
    BF16 input cannot be fed (the error would otherwise blame the input shapes)."""
    bf16 = [sp.name for sp in input_specs(graph) if sp.elem == onnx.TensorProto.BFLOAT16]
    if bf16:
        raise GraphmpError(f"{path}: input {', '.join(repr(n) for n in bf16)} is BF16, and ONNX Runtime's Python API "
                           "takes no BF16 arrays, so bench cannot feed the model; give it FP32 inputs that it casts "
                           "to BF16 (graphmp convert --target bf16 keeps FP32 inputs and outputs)")


class _Run:
    """The state of one run, filled step by step by bench()."""

    def __init__(self, s: Settings, path, graph, work, kept, progress):
        self.s, self.path, self.graph, self.work, self.kept, self.progress = s, path, graph, work, kept, progress
        self.notes, self.models, self.model_errors, self.model_info = [], {}, {}, {}
        self.rows, self.outputs, self.refs, self.emulated, self.floors = [], {}, {}, {}, {}
        self.conversion = None
        self.probed = {}  # _cannot_open's answers
        self.interrupted = None  # why the rows stopped early (Ctrl-C), else None
        self.bar = Progress(enabled=False)  # run_rows' progress line
        self.doing = None        # (row, what: "... {row} ..." or a function giving it) now: what a Ctrl-C cuts
        self.labels, self.reference_text = {}, J.REFERENCE  # precision -> (label, model) where not LABELS/SOURCES

    def log(self, msg):
        if self.progress:
            print(f"bench: {msg}", file=sys.stderr)

    # --- models
    def prepare_models(self, converted):
        path, s = self.path, self.s
        out = lambda p: kept_model(self.work, path, p)  # noqa: E731
        self.src_info = source_precision(self.graph)
        self.already = "graphmp" in {p.key for p in self.graph.metadata_props}
        self.source = None if self.already else path
        if self.already:
            self.models["fp16"] = path
            self.labels["fp16"] = (f"graphmp-converted source ({self.src_info['precision']})", "the source as it is")
            self.notes.append(f"{path} is already converted by graphmp: no FP32 source, so only the fp16 rows run "
                              "and accuracy and speedups are not available. Bench the FP32 model (with --converted) "
                              "for those.")
            return
        self._baseline(out("fp32"))
        if converted is not None:
            self.models["fp16"] = os.fspath(converted)
        else:
            self._convert(out("fp16"))
        makers = {"occ": lambda: {"path": convert_occ(path, out("occ"))},
                  "ort-opt": lambda: convert_ort_opt(path, out("ort-opt"), s.model_type)}
        for p in (p for p in COMPARE if p in s.precisions):
            self.log(f"{p}: converting {path} with {SOURCES[p]}")
            try:
                self.model_info[p] = makers[p]()
                self.models[p] = self.model_info[p]["path"]
            except Exception as e:  # noqa: BLE001 - a converter missing or failing: its rows say so
                self.model_errors[p] = f"{SOURCES[p]}: {type(e).__name__}: {str(e)[:300]}"

    def _baseline(self, dst):
        """The fp32/tf32 rows' model and the accuracy reference. An FP32 source: its FP32
        baseline, judged against the source. An FP16/BF16/mixed source: the baseline computes
        every node in FP32 (graphmp raises them), so it is the reference the source's own low
        precision is judged by. An INT8 source: the baseline, judged against the source as it
        is (there is no FP32 model). A source the pipeline has nothing to do with runs as it is."""
        path, prec = self.path, self.src_info["precision"]
        self.log(f"FP32 baseline of {path}: graphmp's graph cleanups, no precision change")
        try:
            info = fp32_baseline(path, dst)
        except GraphmpError as e:
            if NOTHING not in str(e):
                raise
            info = {"path": path, "how": f"the source as it is (graphmp: {first_line(e)})"}
        except Exception as e:  # noqa: BLE001 - a pipeline failure on an unusual source: one line, not a traceback
            raise GraphmpError(f"{path}: graphmp's FP32 baseline of this {prec} source failed "
                               f"({type(e).__name__}: {first_line(e)})") from None
        self.models["fp32"] = self.models["tf32"] = info["path"]
        self.model_info["fp32"] = info
        if is_fp32(self.src_info):
            return
        low = any(self.src_info["float_nodes"].get(t) for t in ("fp16", "bf16"))
        if low and info["path"] != path:
            self.source = info["path"]
            ref = f"the {prec} source with every node computed in FP32 (graphmp's FP32 baseline)"
            model = "the source, every node raised to FP32 by graphmp"
            labels = (f"FP32 strict: the {prec} source computed in FP32", f"TF32: the {prec} source computed in FP32")
        else:
            ref = (f"the {prec} source" if prec != "no float" else "the source") + \
                " as it is (there is no FP32 model: errors are what graphmp adds to it)"
            model = "the source as it is" if info["path"] == path else "the source through graphmp's cleanups " \
                "(no precision change)"
            labels = ((f"source ({prec})",) * 2 if prec == "no float" else
                      (f"source ({prec}), float ops FP32 strict", f"source ({prec}), float ops TF32"))
        self.labels["fp32"], self.labels["tf32"] = (labels[0], model), (labels[1], model)
        self.reference_text = f"ONNX Runtime CPU, {ref}, same inputs"
        quant = f", quantization ops {self.src_info['quant_ops']}" if self.src_info["quant_ops"] else ""
        is_what = "computes no float" if prec == "no float" else f"is {prec}"
        self.notes.append(f"the source {is_what} (float nodes {self.src_info['float_nodes'] or 'none'}{quant}): "
                          f"accuracy is against {ref}")

    def _convert(self, dst):
        """The fp16 rows' model: graphmp.convert of the source; where it converts nothing
        (no FP32 compute, or every float node must stay FP32) the fp16 rows run the source as it is."""
        path, s, prec = self.path, self.s, self.src_info["precision"]
        self.log(f"converting {path} with graphmp.convert")
        try:
            # --shapes reach the conversion too: its calibration runs where graphmp's own shape search may not
            d = convert(path, dst, calibration=[s.data] if s.data is not None else None, shapes=s.shapes).to_dict()
        except LoadCheckFailed as e:  # ONNX Runtime cannot open the conversion: its rows say why, the others run
            self.model_errors["fp16"] = f"graphmp.convert: load check failed: {first_line(e, 400)}"
            return
        except GraphmpError as e:
            if NOTHING not in str(e):
                raise
            why = first_line(e, 400)
            self.conversion = dict.fromkeys(("seconds", "casts_added", "weight_bytes_before", "weight_bytes_after"))
            self.conversion.update(nodes={"low": 0}, warnings=[why], nothing_converted=why)
        except Exception as e:  # noqa: BLE001 - a conversion failing on an unusual source: its rows say so
            self.model_errors["fp16"] = f"graphmp.convert: {type(e).__name__}: {first_line(e, 300)}"
            return
        else:
            self.conversion = {k: d.get(k) for k in ("seconds", "nodes", "casts_added", "weight_bytes_before",
                                                     "weight_bytes_after", "warnings")}
            if (d.get("nodes") or {}).get("low"):
                self.models["fp16"] = dst
                if not is_fp32(self.src_info):
                    self.labels["fp16"] = (f"mixed FP16 (graphmp) of the {prec} source", SOURCES["fp16"])
                return
            self.conversion["nothing_converted"] = next(
                (w for w in d.get("warnings") or [] if w.startswith(("nothing was converted", "the model has no FP32"))),
                "graphmp converted no node to FP16")
        self.models["fp16"] = path
        self.labels["fp16"] = (f"source ({prec})", "converted: nothing to convert, same as source")
        self.notes.append(f"fp16 rows: graphmp converted no node to FP16 ({self.conversion['nothing_converted']}), "
                          f"so they run the source as it is ({prec}), not graphmp's FP16 compute")

    # --- inputs and references
    def prepare_inputs(self, base_feeds):
        s, graph = self.s, self.graph
        specs = self.specs = input_specs(graph)
        if base_feeds is not None:
            positions = batch_positions(specs)
            own = {base_feeds[n].shape[a] for n, a in positions} or {1}
            self.inputs_text = (f"{os.fspath(s.data)} (batch dims: "
                                f"{', '.join(f'{n}[{a}]' for n, a in positions) or 'none'})")
        else:
            src = self.source or self.models["fp16"]
            if self.source is None:  # a converted source is opened here first: in a child process first
                res = probe(src, run=False)
                if not res["passed"]:
                    raise GraphmpError(f"{src}: ONNX Runtime cannot open the model ({failure_text(res)}); bench "
                                       "needs it to find the input shapes")
            try:
                run = ort_runner(src)
            except Exception as e:  # noqa: BLE001 - an op ORT lacks, a malformed node: one line, no traceback
                raise GraphmpError(f"{src}: ONNX Runtime cannot load the model ({first_line(e)}); bench needs it to "
                                   "find the input shapes and compute the FP32 reference") from None
            plan = find_shapes(graph, run, s.shapes, where=self.path)
            # --shapes pins every dim it names, the batch too; --batch still sets the symbolic batch dims
            positions, own = plan.batch_dims or batch_positions(specs), {1}
            self.inputs_text = f"generated: {plan.describe()} (shapes {plan.how}; batch dims from --batch: " \
                               f"{', '.join(f'{n}[{a}]' for n, a in positions) or 'none'})"
        if not positions:
            asked, s.batches = s.batches, sorted(own)[:1]
            if asked != s.batches:
                self.notes.append(f"the batch cannot change in this model (fixed batch dims, or a state input pins "
                                  f"it): batch {s.batches[0]} ran instead of {','.join(map(str, asked))}")
        self.positions = positions

        def feeds_for(batch):
            if base_feeds is not None:
                return rebatch({sp.name: base_feeds[sp.name] for sp in specs}, positions, batch)
            shapes = {n: list(v) for n, v in plan.shapes.items()}
            for name, axis in positions:
                shapes[name][axis] = batch
            return generate(specs, {n: tuple(v) for n, v in shapes.items()}, s.seed, plan.hints)
        self.feeds = {b: feeds_for(b) for b in s.batches}

    def reference(self, batch):
        if batch not in self.refs:
            self.refs[batch] = run_ort(self.source, self.feeds[batch])
        return self.refs[batch]

    def emulated_tf32(self, batch) -> dict:
        """{output: error} of TF32 emulated on ORT CPU at `batch` (the yardstick where no tf32 row ran)."""
        if batch not in self.emulated:
            if not hasattr(self, "_tf32_run"):
                base = os.path.dirname(os.path.abspath(self.source))
                self._tf32_run = ort_runner(tf32_model(load_with_weights(self.source)), base_dir=base, optimize=False)
            self.emulated[batch] = J.errors_of(self.reference(batch), self._tf32_run(self.feeds[batch]))
        return self.emulated[batch]

    def input_floor(self, batch) -> dict | None:
        """{output: error} of the FP32 source on ORT CPU with only its inputs rounded to FP16
        at `batch` (the yardstick's second part, as in graphmp check); None if it cannot run."""
        if batch not in self.floors:
            try:
                self.floors[batch] = J.errors_of(self.reference(batch),
                                                 run_ort(self.source, round_float_inputs(self.feeds[batch])))
            except Exception:  # noqa: BLE001 - ORT refuses the source: TF32 and max_error judge alone
                self.floors[batch] = None
        return self.floors[batch]

    # --- rows
    def backend_status(self) -> dict:
        status = {}
        for b in self.s.backends:
            reason = ort_cuda_status() if b == "ort-cuda" else trt_status() if b == "trt" else None
            status[b] = {"status": "skipped" if reason else "ok", "reason": reason}
        if not gpu_names() and not any(status[b]["status"] == "ok" for b in ("trt", "ort-cuda") if b in status):
            self.notes.append("no NVIDIA GPU was found: only CPU numbers are below; they say nothing about Tensor "
                              "Core speed")
        return status

    def run_rows(self):
        s = self.s
        self.status = self.backend_status()
        static, why = static_shapes(self.graph)
        if not static and "ort-cuda" in s.backends:
            self.notes.append(f"ORT CUDA: no cuda-graph rows: {why}")
        planned = plan_rows([b for b in s.backends if self.status[b]["status"] == "ok"],
                            [p for p in s.precisions if p in self.models or p in self.model_errors],
                            s.batches, static=static and self.source is not None)
        self.fell_back, self.fell_back_provider = {}, {}
        done = set()  # id() of the rows finished: timed, or failed
        with Progress(total=len(planned), desc="bench", enabled=self.progress,
                      status_interval=ROW_PROGRESS_S) as bar:
            self.bar = bar
            try:
                for backend, batch, specs in groups(planned):
                    self._run_group(backend, batch, specs, bar, done)
            except KeyboardInterrupt:
                self._cut(len(planned), done)
        for b, why in self.fell_back.items():
            self.status[b] = {"status": "fell-back", "reason": why}
        if self.interrupted is None:
            try:
                self._judge()
            except KeyboardInterrupt:
                self._cut(len(planned), done, "while judging accuracy (every row was timed)",
                          "accuracy is judged only where the table shows it")
        if self.interrupted is not None:
            self.outputs.clear()
            for row in self.rows:
                if row["status"] == "ok" and row["accuracy"] is None and not row.get("accuracy_note"):
                    row["accuracy_note"] = "not judged: the run was interrupted (Ctrl-C)"
        add_speedups(self.rows)
        self.fastest = fastest_variants(self.rows)

    def _run_group(self, backend, batch, specs, bar, done):
        """Open, warm up and time the rows of one backend and batch (interleaved rounds)."""
        s, live = self.s, []
        try:
            for spec in specs:
                row = _new_row(spec, self.labels)
                self.rows.append(row)
                bar.update(0, row=f"{backend} {spec.precision} {spec.variant} batch {batch}")
                runner = self._open(row, spec)
                if runner is None:
                    done.add(id(row))
                    bar.update(1)
                else:
                    live.append((row, runner))
            by_id = {id(r): r for r, _ in live}
            target = s.rounds * -(-s.iterations // s.rounds)  # runs per row when the count decides

            of_time = f"/{s.min_time:g}" if s.min_time else ""  # the seconds min_time asks for

            def runs_of(n):
                return f"{n}/{target}" if n <= target else str(n)  # past the count: min_time decides

            def tick(key, r, runs, seconds):  # between timed runs, outside their time
                row = by_id[key]
                self.doing = (row, lambda: f"timing {{row}} (run {runs_of(runs + 1)}, round {r + 1}/{s.rounds})")
                bar.status(lambda: f"  {_row_name(row)}: run {runs_of(runs)}, {seconds:.1f}{of_time} s timed, "
                                   f"round {r + 1}/{s.rounds}")
            times = time_interleaved([(id(r), rn) for r, rn in live], s.rounds, s.iterations, s.min_time, tick)
            for row, runner in live:
                self.doing = (row, "reading the outputs of {row}")
                self._finish(row, runner, times[id(row)])
                done.add(id(row))
                bar.update(1, row=f"{backend} {row['precision']} {row['variant']} batch {batch}")
            self.doing = None
        finally:
            for _, runner in live:
                runner.close()
            gc.collect()

    def _cut(self, planned: int, done: set, where: str | None = None, accuracy: str = "accuracy not judged"):
        """Ctrl-C: keep the finished rows only, and say which row was cut and how far it got."""
        if where is None:
            row, what = self.doing or (None, "")
            what = what() if callable(what) else what
            where = f"while {what.format(row=_row_name(row))}" if row is not None else "between rows"
        self.rows = [r for r in self.rows if id(r) in done]
        left = planned - len(self.rows)
        self.interrupted = (f"interrupted (Ctrl-C) {where}: {len(self.rows)} of {planned} planned rows finished"
                            + (f", {left} were cut or not run" if left else "") + f"; {accuracy}")

    def _open(self, row, spec):
        """The warmed-up runner of one row, or None (the row is marked failed, with why)."""
        s, b, p = self.s, spec.backend, spec.precision
        if p in self.model_errors:
            row.update(status="failed", error=self.model_errors[p])
            return None
        if b in self.fell_back:
            row.update(status="failed", error=self.fell_back[b], provider=self.fell_back_provider[b])
            return None
        feeds, src = self.feeds[spec.batch], self.models[p]
        gpu = b != "ort-cpu"
        self.doing = (row, "building the engine of {row}" if b == "trt" else "opening the session of {row}")
        mem0, how = device_memory_used() if gpu else (None, "")
        t0 = time.perf_counter()
        try:
            if b == "trt":
                engine = None if not self.kept else kept_engine(self.work, src, p, spec.batch)
                if engine is not None:  # the batch may differ from the one checked before the run
                    refuse_clobber([("--keep output", engine)], self.inputs)
                    check_target(engine, "--keep output")
                runner = TrtRunner(src, feeds, tf32=p != "fp32", workspace_mb=s.workspace_mb, engine_path=engine,
                                   timing_cache=s.timing_cache or os.path.join(self.work, "timing.cache"))
                row["build_s"], row["engine_bytes"] = runner.build_s, runner.engine_bytes
            else:
                out_shapes = ({k: v.shape for k, v in self.reference(spec.batch).items()}
                              if spec.variant == "cuda-graph" else None)
                options = ort_cuda_options(p, spec.variant, s.cudnn_conv_algo_search) if gpu else None
                why = self._cannot_open(src, spec, options)
                if why is not None:
                    row.update(status="failed", error=why)
                    return None
                runner = OrtRunner(src, feeds, "cuda" if b == "ort-cuda" else "cpu", options,
                                   output_shapes=out_shapes)
                row["build_s"] = time.perf_counter() - t0
            row["provider"] = runner.provider
            row["settings"] = dict(runner.settings, timing=TIMING, model_file=os.path.basename(src))
            self._warm_up(row, runner)
        except FellBack as e:
            self.fell_back[b], self.fell_back_provider[b] = str(e), e.provider
            row.update(status="failed", error=str(e), provider=e.provider)
            return None
        except Exception as e:  # noqa: BLE001 - any backend error fails this row only; the run goes on
            row.update(status="failed", error=f"{type(e).__name__}: {str(e)[:300]}")
            if "runner" in locals():
                runner.close()
            return None
        if gpu and mem0 is not None:
            mem1, _ = device_memory_used()
            row["peak_device_memory_bytes"] = max(0, mem1 - mem0)
            row["memory_note"] = f"{how}: in use after warm-up minus before the session/engine was created"
        elif gpu:
            row["memory_note"] = how
        return runner

    def _cannot_open(self, src: str, spec, options: dict | None) -> str | None:
        """Why ONNX Runtime cannot open and run `src` as this row would (its provider and
        options, its batch's inputs), found in a child process (graphmp/load_check.py) so that
        a crash fails this row only; None when it can. Once per model, backend, options and batch."""
        providers = [(CUDA, options or {}), CPU] if spec.backend == "ort-cuda" else [CPU]
        key = (src, repr(providers), spec.batch)
        if key not in self.probed:
            res = probe(src, self.feeds[spec.batch], providers=providers, options={"log_severity_level": 4})
            self.probed[key] = None if res["passed"] else f"ONNX Runtime cannot open or run this model: " \
                                                          f"{failure_text(res)}"
        return self.probed[key]

    def _warm_up(self, row, runner):
        """`warmup` untimed runs, with a progress line (at most every ROW_PROGRESS_S)."""
        n, bar, t0 = self.s.warmup, self.bar, time.perf_counter()
        try:
            for i in range(n):
                self.doing = (row, f"warming up {{row}} (run {i + 1}/{n})")
                runner.run()
                bar.status(lambda: f"  {_row_name(row)}: warm-up {i + 1}/{n}, {time.perf_counter() - t0:.1f} s")
        except KeyboardInterrupt:
            runner.close()
            raise

    def _finish(self, row, runner, times):
        if isinstance(times, Exception):
            row.update(status="failed", error=f"{type(times).__name__}: {str(times)[:300]}")
            return
        row["latency_ms"] = latency_stats(times)
        row["iterations"] = len(times)
        row["throughput_per_s"] = row["batch"] / (row["latency_ms"]["median"] / 1e3)
        try:
            outs = runner.outputs()
        except Exception as e:  # noqa: BLE001
            row.update(status="failed", error=f"{type(e).__name__}: {str(e)[:300]}")
            return
        row["output_shapes"] = {k: list(v.shape) for k, v in outs.items()}
        if self.source is not None:
            self.outputs[id(row)] = outs

    def _judge(self):
        """Accuracy of every finished row, against the TF32 yardstick of its backend, batch and
        variant: the tf32 row's own error where it finished, else TF32 emulated on ORT CPU."""
        s, self.yardsticks = self.s, []
        if self.source is None:
            return
        measured, failed = {}, {}
        for row in self.rows:
            if row["precision"] == "tf32" and id(row) in self.outputs:
                try:
                    measured[(row["backend"], row["batch"], row["variant"])] = J.errors_of(
                        self.reference(row["batch"]), self.outputs[id(row)])
                except Exception as e:  # noqa: BLE001 - said below, on every row of that batch
                    failed.setdefault(row["batch"], first_line(e))
        seen = set()
        for row in self.rows:
            outs = self.outputs.pop(id(row), None)
            if outs is None:
                continue
            if row["backend"] == "ort-cpu" and self.models.get(row["precision"]) == self.source:
                row["accuracy_note"] = ("not judged: this row runs the reference model itself on the reference's "
                                        "backend (ONNX Runtime CPU)")
                continue
            key = (row["backend"], row["batch"], row["variant"])
            try:
                if row["batch"] in failed:
                    raise GraphmpError(failed[row["batch"]])
                ref = self.reference(row["batch"])
            except Exception as e:  # noqa: BLE001 - ORT CPU refuses the FP32 source here: no accuracy
                why = failed.setdefault(row["batch"], first_line(e))
                note = (f"batch {row['batch']}: accuracy not judged: ONNX Runtime CPU cannot run the FP32 source "
                        f"({why})")
                if note not in self.notes:
                    self.notes.append(note)
                continue
            if key in measured:
                yard, src = measured[key], f"tf32 row ({row['backend']}, {row['variant']})"
            else:
                try:
                    yard, src = self.emulated_tf32(row["batch"]), J.EMULATED
                except Exception as e:  # noqa: BLE001 - no yardstick: max_error alone judges
                    yard, src = None, f"none: TF32 emulation on ORT CPU failed ({first_line(e)}); max_error alone"
            floor = self.input_floor(row["batch"])
            if (row["batch"], src) not in seen:
                seen.add((row["batch"], src))
                self.yardsticks.append({"batch": row["batch"], "source": src, "errors": yard, "input_floor": floor})
            row["accuracy"] = J.judge_outputs(ref, outs, yard, s.max_error, s.tf32_factor, s.atol, s.rtol, floor)
            row["accuracy"].update(yardstick=src, reference=self.reference_text)

    # --- oracle, notes, result
    def result(self, command) -> dict:
        s = self.s
        notes = self.notes + _notes(s, self.status) + [n for n in [noise_note(self.rows)] if n]
        if "ort-opt" in self.model_info:
            i = self.model_info["ort-opt"]
            notes.append(f"ort-opt: model_type {i['model_type']} ({'guessed from the graph' if i['guessed'] else 'given'}"
                         f"); {i['how']}; fused: {i['fused'] or 'nothing'}")
        try:
            oracle = fp16_oracle(self)
        except KeyboardInterrupt:  # the rows are timed and judged: keep them, say the oracle did not run
            self.interrupted = ("interrupted (Ctrl-C) while running the FP16-faithful oracle: every row was timed "
                                "and judged")
            oracle = []
        settings = s.to_dict()
        settings.update(data=os.fspath(s.data) if s.data is not None else None, inputs=self.inputs_text,
                        compare=[p for p in COMPARE if p in s.precisions],
                        compare_occ="occ" in s.precisions)
        return {
            "schema_version": SCHEMA_VERSION, "environment": environment(command), "settings": settings,
            "timing": TIMING,
            "model": {"path": self.path, "fp32_baseline": _kept(self.model_info.get("fp32"), self.kept),
                      "source_precision": self.src_info,
                      "converted_path": (None if self.models.get("fp16") == self.path and not self.already else
                                         self.models.get("fp16") if self.kept or self.conversion is None else None),
                      "conversion": self.conversion,
                      "compared": {p: self.model_info.get(p) or {"error": self.model_errors.get(p)}
                                   for p in COMPARE if p in s.precisions},
                      "kept_in": self.work if self.kept else None, "fp32_available": self.source is not None,
                      "weight_bytes": model_weight_bytes(self.graph),
                      "inputs": [{"name": sp.name, "dtype": sp.dtype.name if sp.elem else None, "shape": sp.dims}
                                 for sp in self.specs],
                      "fixed_batch": None if self.positions else s.batches[0]},
            "backends": self.status, "rows": self.rows, "fastest": self.fastest,
            "accuracy": {"reference": self.reference_text, "rule": settings["rule"], "max_error": s.max_error,
                         "tf32_factor": s.tf32_factor, "yardsticks": getattr(self, "yardsticks", [])},
            "oracle": oracle, "notes": notes,
            "partial": self.interrupted is not None, "interrupted": self.interrupted,
        }

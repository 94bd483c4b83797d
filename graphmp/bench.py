"""graphmp.bench: how much faster mixed FP16 is than FP32 and TF32, and what it costs in accuracy.

    res = graphmp.bench("model.onnx", backends="ort-cpu", batches=(1, 8))
    print(res.table()); res.write_json("bench.json"); res.plot("bench.png")

One run converts the FP32 model with graphmp.convert (or takes a converted one), then
times every (backend, precision, batch) on the same inputs:

- backends: `trt` (TensorRT engine, strongly typed, graphmp/trt.py), `ort-cuda` (ONNX
  Runtime CUDA EP, inputs and outputs bound on the device with I/O binding, so no copy
  is timed), `ort-cpu` (ONNX Runtime CPU EP).
- precisions: `fp32` = the FP32 source with TF32 off (strict FP32), `tf32` = the FP32
  source with TF32 on (the default of TensorRT and ORT CUDA, so the usual "FP32"
  baseline), `fp16` = the graphmp-converted model (TF32 on; it only touches the FP32
  islands), `occ` = the source converted by onnxconverter-common (`compare_occ=True`).
  On the CPU there is no TF32 (rows fp32, fp16, occ) and ORT computes almost every FP16
  op in FP32, so mixed is not faster there and its accuracy hides FP16 error: the
  FP16-faithful oracle (onnx.reference, every op in its declared dtype) is run on the
  mixed models at batch 1 when the FP32 weights are under `oracle_max_mb`.
- timing: the precisions of one backend and batch are opened together and each gets
  `warmup` untimed steps; then `rounds` interleaved rounds time each of them in turn,
  until every row has at least `iterations` steps and `min_time` seconds (so a change
  of machine load touches all precisions alike); median / p90 / p99 from the per-step
  times; throughput = batch / median. TensorRT steps are timed with CUDA events (CUDA graph replay where
  capture works); ONNX Runtime steps with a host clock around run_with_iobinding +
  synchronize_outputs.
- accuracy: each row's outputs against ONNX Runtime CPU FP32 on the same inputs
  (graphmp.check.compare: max abs/rel error, argmax agreement, new inf/NaN, pass at
  atol/rtol).
- memory: on GPU backends, device memory in use (cudaMemGetInfo via torch or
  cuda-python) after the row's warm-up minus before its session/engine was created; TensorRT
  and ORT's arena allocate on the first runs and keep their peak, so this is the row's peak. null (with the
  reason) where it cannot be measured; the CPU backend reports null.
A backend that cannot run here (TensorRT or onnxruntime-gpu missing, no GPU) is recorded
as skipped with the reason and how to install it; the others still run. A row that fails
is recorded as failed with the error; the others still run.

JSON schema (schema_version 1; `BenchResult.to_dict()`, `graphmp bench --json`):
    schema_version: 1
    environment: {device, gpus: [str], cpu, cpu_count, driver, cuda: {source: version},
                  cudnn: {source: version}, tensorrt, onnxruntime, onnxruntime_package,
                  onnx, numpy, torch, onnxconverter_common, graphmp, python, platform,
                  command, timestamp}                      (null where not available)
    settings: {backends, precisions, batches, data, shapes, inputs, seed, warmup, iterations,
               min_time_s, rounds, atol, rtol, cudnn_conv_algo_search, compare_occ, oracle_max_mb}
    model: {path, converted_path, conversion: {...}|null, occ_path, fp32_available,
            weight_bytes, inputs: [{name, dtype, shape}], fixed_batch: int|null}
    backends: {name: {status: "ok"|"skipped", reason: str|null}}
    rows: [{backend, precision, label, model, batch, tf32: bool|null, status: "ok"|"failed",
            error: str|null, settings: {...}, latency_ms: {median, p90, p99, mean, min, max}|null,
            iterations: int, throughput_per_s: float|null, speedup_vs_fp32: float|null,
            speedup_vs_tf32: float|null, peak_device_memory_bytes: int|null, memory_note: str,
            engine_bytes: int|null, build_s: float|null, output_shapes: {name: [int]}|null,
            accuracy: {reference, passed, max_abs, max_rel, argmax_agree, nonfinite,
                       outputs: {name: compare dict}}|null}]
    oracle: [{precision, batch, status: "ok"|"skipped"|"failed", reason, oracle, passed,
              max_abs, max_rel, argmax_agree, nonfinite}]
    notes: [str]
Non-finite numbers are written as null.
"""
from __future__ import annotations

import gc
import glob
import importlib
import importlib.metadata
import math
import os
import platform
import re
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone

import numpy as np
import onnx

from .version import __version__
from .check import check, compare
from .convert import convert
from .errors import GraphmpError
from .inputs import batch_positions, find_shapes, input_specs, rebatch, user_batches
from .io import atomic_write, load_model, model_weight_bytes, write_json
from .oracle import ort_session, run_ort
from .oracle import runner as ort_runner
from .progress import Progress

SCHEMA_VERSION = 1
BACKENDS = ("trt", "ort-cuda", "ort-cpu")
PRECISIONS = ("fp32", "tf32", "fp16", "occ")
LABELS = {"fp32": "FP32 strict", "tf32": "TF32", "fp16": "mixed FP16 (graphmp)",
          "occ": "FP16 (onnxconverter-common)"}
SOURCES = {"fp32": "fp32 source", "tf32": "fp32 source", "fp16": "graphmp", "occ": "onnxconverter-common"}
CUDNN_SEARCH = ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")
MAX_STEPS = 100_000
REFERENCE = "ONNX Runtime CPU, FP32 source, same inputs"
GPU_INSTALL = ("pip install 'graphmp[gpu]' (onnxruntime-gpu; uninstall the CPU onnxruntime first, both "
               "provide the same module) on a machine with an NVIDIA GPU and driver")


# --- timing -------------------------------------------------------------------------------------

def timed_loop(step, warmup: int, iterations: int, min_time: float) -> list:
    """Run `step` (returns its own duration in seconds) `warmup` times untimed, then until at
    least `iterations` steps and `min_time` seconds were measured. Returns the step times."""
    for _ in range(warmup):
        step()
    times, total = [], 0.0
    while (len(times) < iterations or total < min_time) and len(times) < MAX_STEPS:
        t = step()
        times.append(t)
        total += t
    return times


def latency_stats(times) -> dict:
    """Per-step times (s) -> {median, p90, p99, mean, min, max} in milliseconds."""
    ms = np.asarray(times, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"median": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(ms.mean()),
            "min": float(ms.min()), "max": float(ms.max())}


def device_memory_used():
    """(bytes of device memory in use on GPU 0, how it was measured) or (None, why not)."""
    try:
        import torch
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            return total - free, "torch.cuda.mem_get_info"
    except Exception:
        pass
    for mod in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            rt = importlib.import_module(mod)
            err, free, total = rt.cudaMemGetInfo()
            if err == rt.cudaError_t.cudaSuccess:
                return total - free, f"{mod}.cudaMemGetInfo"
        except Exception:
            continue
    return None, "not measured: install torch or cuda-python to read device memory (cudaMemGetInfo)"


# --- ONNX Runtime backends ------------------------------------------------------------------------

_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


class OrtRunner:
    """An ONNX Runtime session with its inputs bound once (I/O binding): on the device for
    CUDA, so `step()` times the run and nothing else."""

    def __init__(self, path: str, feeds: dict, device: str = "cpu", provider_options: dict | None = None):
        import onnxruntime as ort
        if device == "cuda":
            if hasattr(ort, "preload_dlls"):  # load CUDA/cuDNN from the nvidia-* wheels or torch, if present
                try:
                    ort.preload_dlls()
                except Exception:
                    pass
            providers = [("CUDAExecutionProvider", provider_options or {}), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        self.sess = ort_session(path, providers)
        self.device = device
        if device == "cuda" and self.sess.get_providers()[0] != "CUDAExecutionProvider":
            raise _BackendUnavailable("ONNX Runtime could not start its CUDA provider (no NVIDIA GPU or driver, "
                                      "or CUDA/cuDNN libraries missing); it fell back to the CPU")
        self.provider_options = self.sess.get_provider_options().get(
            "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider", {})
        self.binding = self.sess.io_binding()
        self._keep = []
        for i in self.sess.get_inputs():
            if i.name not in feeds:
                raise GraphmpError(f"no data for model input '{i.name}'")
            x = np.ascontiguousarray(feeds[i.name], dtype=_ORT_TYPES.get(i.type, feeds[i.name].dtype))
            if device == "cuda":
                v = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
                self._keep.append(v)
                self.binding.bind_ortvalue_input(i.name, v)
            else:
                self._keep.append(x)
                self.binding.bind_cpu_input(i.name, x)
        self.output_names = [o.name for o in self.sess.get_outputs()]
        for name in self.output_names:
            self.binding.bind_output(name, device)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.sess.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()
        return time.perf_counter() - t0

    def outputs(self) -> dict:
        return dict(zip(self.output_names, self.binding.copy_outputs_to_cpu()))

    def close(self):
        self.binding = self.sess = None
        self._keep.clear()


class _BackendUnavailable(GraphmpError):
    """The backend cannot run on this machine at all (skip it, not just this row)."""


def _ort_cuda_status():
    import onnxruntime as ort
    avail = ort.get_available_providers()
    if "CUDAExecutionProvider" not in avail:
        return (f"onnxruntime {ort.__version__} has no CUDA provider (providers: {', '.join(avail)}). "
                f"Install it with {GPU_INSTALL}.")
    return None


def _trt_status():
    from .trt import import_tensorrt, import_torch_cuda
    try:
        import_tensorrt()
        import_torch_cuda()
    except GraphmpError as e:
        return str(e)
    return None


# --- environment ----------------------------------------------------------------------------------

def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _dist_version(*names):
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def gpu_names() -> list:
    """NVIDIA GPU names from the driver's /proc files (no CUDA call, no nvidia-smi)."""
    names = []
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        m = re.search(r"^Model:\s*(.+)$", _read(info), re.M)
        if m:
            names.append(m.group(1).strip())
    if not names and "torch" in sys.modules:
        torch = sys.modules["torch"]
        try:
            if torch.cuda.is_available():
                names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        except Exception:
            pass
    return names


def environment(command: str) -> dict:
    """What two runs must share to be compared: device, driver and library versions, command."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), None) or platform.processor() or None
    gpus = gpu_names()
    m = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", _read("/proc/driver/nvidia/version"))
    cuda, cudnn = {}, {}
    try:
        from onnxruntime.capi import build_and_package_info as b
        if getattr(b, "cuda_version", None):
            cuda["onnxruntime build"] = b.cuda_version
        if getattr(b, "cudnn_version", None):
            cudnn["onnxruntime build"] = b.cudnn_version
    except Exception:
        pass
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if getattr(torch.version, "cuda", None):
            cuda["torch build"] = torch.version.cuda
            try:
                cudnn["torch"] = str(torch.backends.cudnn.version())
            except Exception:
                pass
    import onnxruntime as ort
    return {
        "device": gpus[0] if gpus else f"{cpu or 'unknown CPU'} (no NVIDIA GPU found)",
        "gpus": gpus, "cpu": cpu, "cpu_count": os.cpu_count(),
        "driver": m.group(1) if m else None, "cuda": cuda or None, "cudnn": cudnn or None,
        "tensorrt": _dist_version("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt-cu11"),
        "onnxruntime": ort.__version__,
        "onnxruntime_package": next((p for p in ("onnxruntime-gpu", "onnxruntime") if _dist_version(p)), None),
        "onnx": onnx.__version__, "numpy": np.__version__, "torch": _dist_version("torch"),
        "onnxconverter_common": _dist_version("onnxconverter-common"), "graphmp": __version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "command": command, "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


# --- inputs -------------------------------------------------------------------------------------

# --- models -------------------------------------------------------------------------------------

def _save(model: onnx.ModelProto, path: str):
    big = model_weight_bytes(model) > 1.8e9
    onnx.save(model, path, save_as_external_data=big, location=os.path.basename(path) + ".data")


def convert_occ(src: str, dst: str) -> str:
    """The source converted by onnxconverter-common (keep_io_types=True), written to `dst`."""
    try:
        from onnxconverter_common import float16
    except ImportError:
        raise GraphmpError("onnxconverter-common is not installed; pip install 'graphmp[bench]' "
                           "(or pip install onnxconverter-common) for --compare-occ") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = float16.convert_float_to_float16(onnx.load(src), keep_io_types=True)
    _save(conv, dst)
    return dst


# --- the result ---------------------------------------------------------------------------------

def _clean(x):
    """JSON-safe: non-finite floats -> None, numpy scalars -> Python."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def _fmt(v, spec=".3g", none="-"):
    return none if v is None else format(v, spec)


def _md(headers, rows) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(r) for r in rows])


class BenchResult:
    """The rows of one bench run. `to_dict()` is the JSON (schema in the module docstring)."""

    def __init__(self, data: dict):
        self.data = data

    def to_dict(self) -> dict:
        return self.data

    @property
    def rows(self) -> list:
        return self.data["rows"]

    def row(self, backend, precision, batch) -> dict | None:
        return next((r for r in self.rows if (r["backend"], r["precision"], r["batch"]) == (backend, precision, batch)),
                    None)

    def write_json(self, path) -> None:
        write_json(os.fspath(path), self.data)

    def table(self) -> str:
        d = self.data
        head = ["backend", "precision", "batch", "median ms", "p90 ms", "p99 ms", "items/s", "vs FP32", "vs TF32",
                "mem MB", "engine MB", "build s", "max abs", "max rel", "argmax", "in tol"]
        body, failed = [], []
        for r in d["rows"]:
            if r["status"] != "ok":
                failed.append(f"{r['backend']} {r['precision']} batch {r['batch']}: FAILED: {r['error']}")
                body.append([r["backend"], r["precision"], r["batch"]] + ["FAILED"] + ["-"] * 12)
                continue
            lat, acc = r["latency_ms"], r["accuracy"] or {}
            mb = lambda b: None if b is None else b / 1e6  # noqa: E731
            body.append([r["backend"], r["precision"], r["batch"], _fmt(lat["median"], ".3f"), _fmt(lat["p90"], ".3f"),
                         _fmt(lat["p99"], ".3f"), _fmt(r["throughput_per_s"], ".1f"),
                         _fmt(r["speedup_vs_fp32"], ".2f"), _fmt(r["speedup_vs_tf32"], ".2f"),
                         _fmt(mb(r["peak_device_memory_bytes"]), ".0f"), _fmt(mb(r["engine_bytes"]), ".1f"),
                         _fmt(r["build_s"], ".2f"), _fmt(acc.get("max_abs"), ".2e"), _fmt(acc.get("max_rel"), ".2e"),
                         _fmt(acc.get("argmax_agree"), ".4f"),
                         "-" if not acc else ("yes" if acc["passed"] else "NO")
                         + (f" ({acc['nonfinite']} inf/nan)" if acc.get("nonfinite") else "")])
        env = d["environment"]
        lines = [f"graphmp bench: {d['model']['path']} on {env['device']}", _md(head, body)]
        lines += [f"  {f}" for f in failed]
        for name, b in d["backends"].items():
            if b["status"] != "ok":
                lines.append(f"  {name}: skipped: {b['reason']}")
        for o in d["oracle"]:
            what = f"FP16-faithful oracle, {o['precision']} at batch {o['batch']}"
            if o["status"] != "ok":
                lines.append(f"  {what}: {o['status']}: {o['reason']}")
            else:
                lines.append(f"  {what} ({o['oracle']}): {'PASS' if o['passed'] else 'FAIL'}, max abs "
                             f"{_fmt(o['max_abs'], '.2e')}, max rel {_fmt(o['max_rel'], '.2e')}, argmax "
                             f"{_fmt(o['argmax_agree'], '.4f')}"
                             + (f", {o['nonfinite']} inf/nan" if o["nonfinite"] else ""))
        lines += [f"  note: {n}" for n in d["notes"]]
        versions = ", ".join(f"{k} {env[k]}" for k in ("onnxruntime", "tensorrt", "onnx", "numpy", "graphmp") if env[k])
        lines.append(f"  environment: {versions}; driver {env['driver'] or '-'}; CUDA {env['cuda'] or '-'}; "
                     f"cuDNN {env['cudnn'] or '-'}; {env['timestamp']}")
        lines.append(f"  command: {env['command']}")
        return "\n".join(lines)

    summary = table

    def plot(self, path) -> str:
        """A PNG bar chart: throughput per backend, batch and precision, labelled with the
        speedup vs FP32 (strict). Needs matplotlib (pip install 'graphmp[plot]')."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            raise GraphmpError("the plot needs matplotlib: pip install 'graphmp[plot]' "
                               "(or pip install matplotlib)") from None
        path = os.fspath(path)
        ok = [r for r in self.rows if r["status"] == "ok"]
        backends = [b for b in self.data["backends"] if any(r["backend"] == b for r in ok)]
        fig = Figure(figsize=(5.5 * max(1, len(backends)), 4.5))
        FigureCanvasAgg(fig)
        if not backends:
            fig.text(0.5, 0.5, "no backend produced a timing", ha="center")
        for k, b in enumerate(backends):
            ax = fig.add_subplot(1, len(backends), k + 1)
            rows = [r for r in ok if r["backend"] == b]
            batches = sorted({r["batch"] for r in rows})
            precs = [p for p in PRECISIONS if any(r["precision"] == p for r in rows)]
            width = 0.8 / len(precs)
            for j, p in enumerate(precs):
                xs, ys, labels = [], [], []
                for i, bt in enumerate(batches):
                    r = next((r for r in rows if r["precision"] == p and r["batch"] == bt), None)
                    if r:
                        xs.append(i + (j - (len(precs) - 1) / 2) * width)
                        ys.append(r["throughput_per_s"])
                        s = r["speedup_vs_fp32"]
                        labels.append(f"{s:.2f}x" if s else f"{r['latency_ms']['median']:.2f}ms")
                bars = ax.bar(xs, ys, width, label=LABELS[p])
                ax.bar_label(bars, labels, fontsize=7)
            ax.set_xticks(range(len(batches)), [f"batch {bt}" for bt in batches])
            ax.set_ylabel("items / s (batch / median latency)")
            ax.set_title(b)
            ax.legend(fontsize=7)
        fig.suptitle(f"{os.path.basename(self.data['model']['path'])} on {self.data['environment']['device']}\n"
                     "bar labels: speedup vs FP32 strict (latency where there is no FP32 row)", fontsize=9)
        fig.tight_layout()
        with atomic_write(path) as f:
            fig.savefig(f, format="png", dpi=100)
        return path


# --- the run ------------------------------------------------------------------------------------

def _csv(x, what, allowed=None):
    items = [s.strip() for s in x.split(",") if s.strip()] if isinstance(x, str) else list(x)
    if allowed is not None:
        bad = [s for s in items if s not in allowed]
        if bad:
            raise GraphmpError(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return items


def _batches(x) -> list:
    try:
        items = [int(b) for b in _csv(str(x) if isinstance(x, int) else x, "batch")]
    except (TypeError, ValueError):
        raise GraphmpError(f"batch sizes must be positive integers like 1,8,32, not {x!r}") from None
    if not items or any(b < 1 for b in items):
        raise GraphmpError(f"batch sizes must be positive integers like 1,8,32, not {x!r}")
    return sorted(set(items))


def _accuracy(ref: dict, got: dict, atol, rtol) -> dict:
    per = {}
    for k, v in ref.items():
        per[k] = compare(v, got[k], atol, rtol) if k in got else {
            "max_abs": None, "max_rel": None, "ref_max_abs": None, "nonfinite": 0, "argmax_agree": None,
            "passed": False, "error": "output missing"}
    agrees = [c["argmax_agree"] for c in per.values() if c["argmax_agree"] is not None]
    vals = lambda key: [c[key] for c in per.values() if c[key] is not None]  # noqa: E731
    return {"reference": REFERENCE, "passed": all(c["passed"] for c in per.values()),
            "max_abs": max(vals("max_abs"), default=None), "max_rel": max(vals("max_rel"), default=None),
            "argmax_agree": min(agrees) if agrees else None,
            "nonfinite": sum(c["nonfinite"] for c in per.values()), "outputs": per}


def bench(model, *, converted=None, backends="trt,ort-cuda,ort-cpu", precisions=None, batches=(1,), data=None,
          shapes=None, seed: int = 0, warmup: int = 10, iterations: int = 50, min_time: float = 1.0,
          rounds: int = 5,
          compare_occ: bool = False, cudnn_conv_algo_search: str = "EXHAUSTIVE", timing_cache=None,
          workspace_mb: int | None = None, atol: float = 1e-2, rtol: float = 1e-2, oracle_max_mb: float = 50.0,
          keep=None, command: str | None = None, progress: bool = True) -> BenchResult:
    """Time and check `model` (an FP32 .onnx, or one already converted by graphmp) per backend,
    precision and batch. See the module docstring for what is measured and the JSON schema.

    converted: a converted model to use for the fp16 rows instead of converting `model`.
    backends / precisions: names or 'a,b' strings (default: all; occ only with compare_occ).
    batches: sizes of the batch dims (graphmp.inputs.batch_positions); a model whose batch
      cannot change runs its own batch, with a note.
    data: an .npz of inputs (batch dims repeated/cut to each batch, other inputs as given);
      default: generated inputs (seed), dynamic dims from `shapes` ('x:1x3x640x640,...')
      or a trial run (graphmp.inputs.find_shapes).
    keep: a folder to keep the converted models and engines in (default: a temporary one).
    """
    if command is None:
        command = f"graphmp.bench({os.fspath(model)!r}, backends={backends!r}, batches={batches!r}, ...)"
    backends = _csv(backends, "backend", BACKENDS)
    precisions = _csv(precisions, "precision", PRECISIONS) if precisions else \
        [p for p in PRECISIONS if p != "occ" or compare_occ]
    if compare_occ and "occ" not in precisions:
        precisions.append("occ")
    batches = _batches(batches)
    if cudnn_conv_algo_search not in CUDNN_SEARCH:
        raise GraphmpError(f"cudnn_conv_algo_search must be one of {', '.join(CUDNN_SEARCH)}")
    if warmup < 0 or iterations < 1 or min_time < 0 or rounds < 1:
        raise GraphmpError("need warmup >= 0, iterations >= 1, min_time >= 0 and rounds >= 1")
    path = os.fspath(model)
    graph = load_model(path)
    if converted is not None:
        load_model(os.fspath(converted))
    if data is not None:
        ((_, base_feeds),) = user_batches(os.fspath(data), input_specs(graph), "--data")

    tmp = None
    if keep is None:
        tmp = tempfile.TemporaryDirectory(prefix="graphmp-bench-")
        work = tmp.name
    else:
        work = os.fspath(keep)
        os.makedirs(work, exist_ok=True)
    try:
        return _run(path, graph, converted, backends, precisions, batches, data,
                    base_feeds if data is not None else None, shapes, seed, warmup, iterations, min_time, rounds,
                    compare_occ, cudnn_conv_algo_search, timing_cache, workspace_mb, atol, rtol,
                    oracle_max_mb, work, keep is not None, command, progress)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(path, graph, converted, backends, precisions, batches, data, base_feeds, shapes, seed, warmup, iterations,
         min_time, rounds, compare_occ, cudnn_search, timing_cache, workspace_mb, atol, rtol, oracle_max_mb, work,
         kept, command, progress):
    notes = []
    stem = os.path.splitext(os.path.basename(path))[0]
    already = "graphmp" in {p.key for p in graph.metadata_props}
    models = {"fp32": None if already else path}
    conversion = None
    if already:
        models["fp16"] = path
        notes.append(f"{path} is already converted by graphmp: no FP32 source, so only the fp16 rows run and "
                     "accuracy and speedups are not available. Bench the FP32 model (with --converted) for those.")
    elif converted is not None:
        models["fp16"] = os.fspath(converted)
    else:
        if progress:
            print(f"bench: converting {path} with graphmp.convert", file=sys.stderr)
        dst = os.path.join(work, stem + ".mp.onnx")
        rep = convert(path, dst, calibration=[data] if data is not None else None)
        d = rep.to_dict()
        conversion = {k: d.get(k) for k in ("seconds", "nodes", "casts_added", "weight_bytes_before",
                                            "weight_bytes_after", "warnings")}
        models["fp16"] = dst
    occ_error = None
    if "occ" in precisions and models["fp32"]:
        if progress:
            print(f"bench: converting {path} with onnxconverter-common", file=sys.stderr)
        try:
            models["occ"] = convert_occ(path, os.path.join(work, stem + ".occ.onnx"))
        except Exception as e:  # onnxconverter-common missing or failing on this model: a row says so
            occ_error = f"onnxconverter-common: {type(e).__name__}: {str(e)[:200]}"

    specs = input_specs(graph)
    if base_feeds is not None:
        positions = batch_positions(specs)
        own = {base_feeds[n].shape[a] for n, a in positions} or {1}
        inputs_text = f"{os.fspath(data)} (batch dims: {', '.join(f'{n}[{a}]' for n, a in positions) or 'none'})"
    else:
        plan = find_shapes(graph, ort_runner(models["fp32"] or models["fp16"]), shapes, where=path)
        positions = plan.batch_dims
        own = {1}
        inputs_text = f"generated: {plan.describe()} (shapes {plan.how})"
    if not positions:
        asked = batches
        batches = sorted(own)[:1]
        if asked != batches:
            notes.append(f"the batch cannot change in this model (fixed batch dims, or a state input pins it): "
                         f"batch {batches[0]} ran instead of {','.join(map(str, asked))}")

    def feeds_for(batch):
        if base_feeds is not None:
            return rebatch({s.name: base_feeds[s.name] for s in specs}, positions, batch)
        return plan.feeds(seed, batch=batch if positions else None)

    feeds = {b: feeds_for(b) for b in batches}
    ref_cache = {}

    def reference(batch):
        if batch not in ref_cache:
            ref_cache[batch] = run_ort(models["fp32"], feeds[batch])
        return ref_cache[batch]

    # --- which backends can run here
    status = {}
    for b in backends:
        reason = None
        if b == "ort-cuda":
            reason = _ort_cuda_status()
        elif b == "trt":
            reason = _trt_status()
        status[b] = {"status": "skipped" if reason else "ok", "reason": reason}
    gpus = gpu_names()
    if not gpus and not any(status[b]["status"] == "ok" for b in ("trt", "ort-cuda") if b in status):
        notes.append("no NVIDIA GPU was found: only CPU numbers are below; they say nothing about Tensor Core speed")

    groups = [(b, batch, [p for p in precisions if not (b == "ort-cpu" and p == "tf32")])
              for b in backends if status[b]["status"] == "ok" for batch in batches]
    cache_path = os.fspath(timing_cache) if timing_cache else os.path.join(work, "timing.cache")
    rows = []
    with Progress(total=sum(len(g[2]) for g in groups), desc="bench", enabled=progress) as bar:
        for b, batch, group in groups:
            if status[b]["status"] != "ok":  # found unusable by an earlier group
                bar.update(len(group))
                continue
            live = []  # (row, runner) of this backend and batch, all open at once
            try:
                for p in group:
                    row = _new_row(b, p, batch)
                    src = models.get("fp32" if p in ("fp32", "tf32") else p)
                    if src is None:
                        if p == "occ" and occ_error:
                            row.update(status="failed", error=occ_error)
                            rows.append(row)
                        bar.update(1)
                        continue
                    bar.update(0, row=f"{b} {p} batch {batch}: {'building' if b == 'trt' else 'session'}")
                    try:
                        live.append((row, _open_row(row, b, p, src, feeds[batch], warmup, cudnn_search,
                                                    cache_path, workspace_mb, work if kept else None)))
                    except _BackendUnavailable:
                        raise
                    except Exception as e:  # any backend error fails this row only; the run goes on
                        row.update(status="failed", error=f"{type(e).__name__}: {str(e)[:300]}")
                        bar.update(1)
                    rows.append(row)
                _time_group(live, rounds, iterations, min_time, bar)
                for row, runner in live:
                    try:
                        outs = runner.outputs()
                    except Exception as e:
                        row.update(status="failed", error=f"{type(e).__name__}: {str(e)[:300]}")
                        continue
                    row["output_shapes"] = {k: list(v.shape) for k, v in outs.items()}
                    if models["fp32"]:
                        row["accuracy"] = _accuracy(reference(batch), outs, atol, rtol)
            except _BackendUnavailable as e:
                status[b] = {"status": "skipped", "reason": str(e)}
                rows = [r for r in rows if r["backend"] != b]
            finally:
                for _, runner in live:
                    runner.close()
                gc.collect()

    for r in rows:  # speedups within one backend and batch
        if r["status"] != "ok":
            continue
        for base, key in (("fp32", "speedup_vs_fp32"), ("tf32", "speedup_vs_tf32")):
            ref = next((x for x in rows if x["status"] == "ok" and x["backend"] == r["backend"]
                        and x["batch"] == r["batch"] and x["precision"] == base), None)
            if ref:
                r[key] = ref["latency_ms"]["median"] / r["latency_ms"]["median"]

    weight_bytes = model_weight_bytes(graph)  # from dims and dtypes: external weights are not read
    oracle = _oracle(models, precisions, rebatch(feeds[batches[0]], positions, 1), 1 if positions else batches[0],
                     weight_bytes / 1e6, oracle_max_mb, atol, rtol, occ_error)
    notes += _notes(backends, status, cudnn_search, atol, rtol)
    data_out = {
        "schema_version": SCHEMA_VERSION,
        "environment": environment(command),
        "settings": {"backends": backends, "precisions": precisions, "batches": batches,
                     "data": os.fspath(data) if data is not None else None, "shapes": shapes,
                     "inputs": inputs_text, "seed": seed,
                     "warmup": warmup, "iterations": iterations, "min_time_s": min_time, "rounds": rounds,
                     "atol": atol, "rtol": rtol,
                     "cudnn_conv_algo_search": cudnn_search, "compare_occ": compare_occ,
                     "oracle_max_mb": oracle_max_mb},
        "model": {"path": path,
                  "converted_path": models.get("fp16") if kept or converted is not None or already else None,
                  "conversion": conversion, "occ_path": models.get("occ") if kept else None,
                  "kept_in": work if kept else None, "fp32_available": models["fp32"] is not None,
                  "weight_bytes": weight_bytes,
                  "inputs": [{"name": s.name, "dtype": s.dtype.name if s.elem else None, "shape": s.dims}
                             for s in specs],
                  "fixed_batch": None if positions else batches[0]},
        "backends": status, "rows": rows, "oracle": oracle, "notes": notes,
    }
    return BenchResult(_clean(data_out))


def _new_row(backend, precision, batch) -> dict:
    return {"backend": backend, "precision": precision, "label": LABELS[precision], "model": SOURCES[precision],
            "batch": batch, "tf32": None if backend == "ort-cpu" else precision != "fp32", "status": "ok",
            "error": None, "settings": {}, "latency_ms": None, "iterations": 0, "throughput_per_s": None,
            "speedup_vs_fp32": None, "speedup_vs_tf32": None, "peak_device_memory_bytes": None,
            "memory_note": "host memory: not measured per row" if backend == "ort-cpu" else "",
            "engine_bytes": None, "build_s": None, "output_shapes": None, "accuracy": None}


def _open_row(row, backend, precision, src, feeds, warmup, cudnn_search, cache_path, workspace_mb, engine_dir):
    """Build the engine / create the session for one row and warm it up; returns the runner.
    Fills build_s, engine_bytes, settings and the device memory it took (measured after warm-up,
    when ORT's arena and TensorRT's context have made their allocations)."""
    gpu = backend != "ort-cpu"
    mem0, how = device_memory_used() if gpu else (None, "")
    t0 = time.perf_counter()
    if backend == "trt":
        from .trt import EngineRunner, build_engine
        shapes = {k: v.shape for k, v in feeds.items()}
        plan = None if engine_dir is None else os.path.join(
            engine_dir, f"{os.path.splitext(os.path.basename(src))[0]}.{precision}.b{row['batch']}.plan")
        built = build_engine(src, plan, shapes=shapes, tf32=precision != "fp32", timing_cache=cache_path,
                             workspace_mb=workspace_mb)
        row["build_s"], row["engine_bytes"] = built.seconds, len(built.engine)
        gc.collect()  # the builder and its scratch memory are gone; measure the engine alone
        mem0, how = device_memory_used()
        runner = EngineRunner(built.engine, feeds)
        row["settings"] = {"strongly_typed": True, "tf32_flag": precision != "fp32", "cuda_graph": runner.graph
                           is not None, "timing": f"CUDA events; {runner.cuda_graph_note}",
                           "timing_cache": cache_path, "profile": "min = opt = max = these shapes"}
    elif backend == "ort-cuda":
        opts = {"device_id": "0", "cudnn_conv_algo_search": cudnn_search,
                "use_tf32": "0" if precision == "fp32" else "1"}
        runner = OrtRunner(src, feeds, "cuda", opts)
        row["build_s"] = time.perf_counter() - t0
        row["settings"] = {"provider_options": {k: runner.provider_options.get(k) for k in
                                                ("device_id", "cudnn_conv_algo_search", "use_tf32",
                                                 "cudnn_conv_use_max_workspace")},
                           "timing": "host clock around run_with_iobinding + synchronize_outputs; inputs and "
                                     "outputs bound on the device (no copies timed)"}
    else:
        runner = OrtRunner(src, feeds, "cpu")
        row["build_s"] = time.perf_counter() - t0
        row["settings"] = {"provider": "CPUExecutionProvider", "timing": "host clock around run_with_iobinding"}
    try:
        timed_loop(runner.step, warmup, 0, 0.0)
    except BaseException:
        runner.close()
        raise
    if gpu and mem0 is not None:
        mem1, _ = device_memory_used()
        row["peak_device_memory_bytes"] = max(0, mem1 - mem0)
        row["memory_note"] = (f"{how}: in use after warm-up minus before the "
                              f"{'engine was loaded' if backend == 'trt' else 'session was created'}")
    elif gpu:
        row["memory_note"] = how
    return runner


def _time_group(live, rounds, iterations, min_time, bar):
    """Time the open runners of one backend and batch in `rounds` interleaved rounds (each runner
    gets iterations/rounds steps and min_time/rounds seconds per round), so a change in machine
    load during the run touches every precision alike instead of skewing the speedups."""
    times = {id(row): [] for row, _ in live}
    n, t = math.ceil(iterations / rounds), min_time / rounds
    for _ in range(rounds):
        for row, runner in live:
            if row["status"] != "ok":
                continue
            try:
                times[id(row)] += timed_loop(runner.step, 0, n, t)
            except Exception as e:
                row.update(status="failed", error=f"{type(e).__name__}: {str(e)[:300]}")
    for row, _ in live:
        if row["status"] == "ok":
            row["latency_ms"] = latency_stats(times[id(row)])
            row["iterations"] = len(times[id(row)])
            row["throughput_per_s"] = row["batch"] / (row["latency_ms"]["median"] / 1e3)
            bar.update(1, row=f"{row['backend']} {row['precision']} batch {row['batch']}: "
                       f"{row['latency_ms']['median']:.3f} ms")
        else:
            bar.update(1)


def _oracle(models, precisions, one, batch, size_mb, max_mb, atol, rtol, occ_error):
    """FP16-faithful check of each mixed model on `one` (one sample of the smallest batch,
    or the model's own batch where it cannot change)."""
    out = []
    for p in (p for p in ("fp16", "occ") if p in precisions):
        entry = {"precision": p, "batch": batch, "status": "ok", "reason": None, "oracle": None, "passed": None,
                 "max_abs": None, "max_rel": None, "argmax_agree": None, "nonfinite": None}
        src, mixed = models.get("fp32"), models.get(p)
        if src is None:
            entry.update(status="skipped", reason="no FP32 source to compare with")
        elif mixed is None:
            entry.update(status="skipped", reason=occ_error or "no converted model")
        elif size_mb > max_mb:
            entry.update(status="skipped", reason=f"FP32 weights {size_mb:.0f} MB > {max_mb:g} MB: the reference "
                         "evaluator is too slow for this model; run graphmp check on a GPU machine")
        else:
            try:
                rep = check(src, mixed, data=one, atol=atol, rtol=rtol).to_dict()
                acc = {k: v for k, v in rep["outputs"].items() if "[ORT CUDA]" not in k}
                agrees = [v["argmax_agree"] for v in acc.values() if v["argmax_agree"] is not None]
                entry.update(oracle=rep["oracle"], passed=all(v["passed"] for v in acc.values()),
                             max_abs=max(v["max_abs"] for v in acc.values()),
                             max_rel=max(v["max_rel"] for v in acc.values()),
                             argmax_agree=min(agrees) if agrees else None,
                             nonfinite=sum(v["nonfinite"] for v in acc.values()))
            except Exception as e:
                entry.update(status="failed", reason=f"{type(e).__name__}: {str(e)[:200]}")
        out.append(entry)
    return out


def _notes(backends, status, cudnn_search, atol, rtol):
    notes = [f"accuracy: each row's outputs vs {REFERENCE} (pass: |err| <= {atol} + {rtol}*|ref|; argmax over "
             "the last axis)"]
    gpu = [b for b in ("trt", "ort-cuda") if b in backends and status[b]["status"] == "ok"]
    if gpu:
        notes.append("GPU rows: fp32 = TF32 off (strict FP32); tf32 = TF32 on (the default of TensorRT and ORT "
                     "CUDA); fp16/occ = TF32 on, which only affects their FP32 islands")
    if "ort-cuda" in gpu:
        notes.append(f"ORT CUDA: cudnn_conv_algo_search={cudnn_search}; TF32 via the provider option use_tf32")
    if "trt" in gpu:
        notes.append("TensorRT: strongly typed (the graph's types and Casts set the precision), one engine per "
                     "precision and batch (profile min = opt = max); build_s uses a timing cache shared by the run")
    if "ort-cpu" in backends:
        notes.append("ORT CPU: no TF32 on the CPU (rows fp32 and mixed only); ORT CPU computes almost every FP16 "
                     "op in FP32 (it inserts casts), so the mixed rows are not faster there and their accuracy "
                     "hides FP16 rounding and overflow: see the FP16-faithful oracle line")
    return notes

"""Runners: one model on one backend behind one small interface, and how rows are timed.

A runner is made ready by its constructor (prepare: session / engine, inputs bound) and
then offers:
    run()      one synchronized inference: returns when the outputs are complete
    outputs()  {output name: numpy array} of the last run
    close()    free the session / engine
    provider   what actually ran ("CUDAExecutionProvider", "CPUExecutionProvider", "TensorRT")
    settings   the options in effect, as read back from the backend

Timing (the same for every backend, so speedups compare like with like): host wall
time (time.perf_counter) around `run()`, which for ONNX Runtime is run_with_iobinding +
synchronize_outputs and for TensorRT one enqueue (or CUDA graph replay) + stream
synchronize. This is TIMING = "host-sync" in the JSON.
"""
from __future__ import annotations

import importlib
import math
import os
import time

import numpy as np

from ..errors import GraphmpError
from ..model_runs import ort_session
from ..names import shown
from ..run_limits import RunLimits, guarded, model_bytes
from ..session import CPU, CUDA, ran_on

TIMING = "host-sync"
TIMING_TEXT = ("host wall time around one synchronized run (ORT: run_with_iobinding + synchronize_outputs; "
               "TensorRT: enqueue or CUDA graph replay + stream synchronize), the same for every row")
MAX_STEPS = 100_000
GPU_INSTALL = ("pip install 'graphmp[gpu]' (onnxruntime-gpu; uninstall the CPU onnxruntime first, both "
               "provide the same module) on a machine with an NVIDIA GPU and driver")
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


class FellBack(GraphmpError):
    """A GPU row's session came up on another provider: the row must not be timed under
    the GPU label. `provider` is what ran."""

    def __init__(self, msg: str, provider: str):
        super().__init__(msg)
        self.provider = provider


# --- timing -------------------------------------------------------------------------------------

def timed_loop(step, warmup: int, iterations: int, min_time: float, tick=None) -> list:
    """Run `step` (returns its own duration in seconds) `warmup` times untimed, then until at
    least `iterations` steps and `min_time` seconds were measured. Returns the step times.
    `tick(steps, seconds)`, if given, is called after each timed step (outside its time)."""
    for _ in range(warmup):
        step()
    times, total = [], 0.0
    while (len(times) < iterations or total < min_time) and len(times) < MAX_STEPS:
        t = step()
        times.append(t)
        total += t
        if tick is not None:
            tick(len(times), total)
    return times


def host_step(runner):
    """A step function for timed_loop: host wall time around one synchronized `run()`."""
    def step() -> float:
        t0 = time.perf_counter()
        runner.run()
        return time.perf_counter() - t0
    return step


def latency_stats(times) -> dict:
    """Per-step times (s) -> {median, p90, p99, mean, min, max} in milliseconds."""
    ms = np.asarray(times, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"median": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(ms.mean()),
            "min": float(ms.min()), "max": float(ms.max())}


def time_interleaved(live: list, rounds: int, iterations: int, min_time: float, tick=None) -> dict:
    """Time the open runners `live` ([(key, runner)]) in `rounds` interleaved rounds (each
    gets ceil(iterations/rounds) steps and min_time/rounds seconds per round), so a change of
    machine load touches every row alike. Returns {key: step times | the exception}.
    `tick(key, round, steps, seconds)` (round from 0; steps and seconds of that row so far), if
    given, is called when a row's round starts and after each of its timed steps: progress,
    and which row a Ctrl-C cuts. A KeyboardInterrupt is not caught: it stops every row."""
    out = {k: [] for k, _ in live}
    n, t = math.ceil(iterations / rounds), min_time / rounds
    for r in range(rounds):
        for k, runner in live:
            if isinstance(out[k], Exception):
                continue
            on_step = None if tick is None else _round_tick(tick, k, r, len(out[k]), sum(out[k]))
            try:
                out[k] += timed_loop(host_step(runner), 0, n, t, on_step)
            except Exception as e:  # noqa: BLE001 - one row fails, the others go on
                out[k] = e
    return out


def _round_tick(tick, key, r, before: int, spent: float):
    """time_interleaved's tick for one row's round: says the round starts, then counts on
    from the `before` steps and `spent` seconds of the earlier rounds."""
    tick(key, r, before, spent)
    return lambda steps, total: tick(key, r, before + steps, spent + total)


def device_memory_used():
    """(bytes of device memory in use on GPU 0, how it was measured) or (None, why not)."""
    try:
        import torch
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            return total - free, "torch.cuda.mem_get_info"
    except Exception:  # noqa: BLE001
        pass
    for mod in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            rt = importlib.import_module(mod)
            err, free, total = rt.cudaMemGetInfo()
            if err == rt.cudaError_t.cudaSuccess:
                return total - free, f"{mod}.cudaMemGetInfo"
        except Exception:  # noqa: BLE001
            continue
    return None, "not measured: install torch or cuda-python to read device memory (cudaMemGetInfo)"


# --- ONNX Runtime ---------------------------------------------------------------------------------

def ort_cuda_options(precision: str, variant: str, cudnn_search: str) -> dict:
    """CUDA provider options of one row: TF32 off only for strict fp32; prefer_nhwc for the
    nhwc variant; enable_cuda_graph for the cuda-graph variant."""
    opts = {"device_id": "0", "cudnn_conv_algo_search": cudnn_search,
            "use_tf32": "0" if precision == "fp32" else "1"}
    if variant == "nhwc":
        opts["prefer_nhwc"] = "1"
    elif variant == "cuda-graph":
        opts["enable_cuda_graph"] = "1"
    return opts


class OrtRunner:
    """An ONNX Runtime session with inputs (and, for CUDA graphs, outputs) bound once with
    I/O binding: on the device for CUDA, so `run()` times the run and no copy.

    device "cuda" asks for the CUDA provider with `provider_options`; when the session came
    up on another provider, FellBack is raised (with what ran) instead of a CPU runner
    hiding under a CUDA label. `output_shapes` ({name: shape}) is needed for CUDA graphs,
    whose outputs must be preallocated."""

    def __init__(self, path: str, feeds: dict, device: str = "cpu", provider_options: dict | None = None,
                 output_shapes: dict | None = None):
        import onnxruntime as ort
        if device == "cuda":
            if hasattr(ort, "preload_dlls"):  # CUDA/cuDNN from the nvidia-* wheels or torch, if present
                try:
                    ort.preload_dlls()
                except Exception:  # noqa: BLE001
                    pass
            providers = [(CUDA, provider_options or {}), CPU]
        else:
            providers = [CPU]
        self.sess = ort_session(path, providers)
        self.guard = guarded(shown(os.fspath(path), 300), limits=RunLimits.for_model(model_bytes(path)))
        ran = self.sess.get_providers()
        self.provider = ran_on(self.sess)
        wanted = CUDA if device == "cuda" else CPU
        if self.provider != wanted:
            self.sess = None
            raise FellBack(f"asked for {wanted} but ONNX Runtime ran {self.provider} (session providers: "
                           f"{', '.join(ran)}): onnxruntime-gpu missing, no NVIDIA GPU or driver, or CUDA/cuDNN "
                           f"libraries not found. Install with {GPU_INSTALL}", self.provider)
        self.provider_options = self.sess.get_provider_options().get(wanted, {})
        cuda_graph = device == "cuda" and self.provider_options.get("enable_cuda_graph") == "1"
        self.settings = {"provider": self.provider, "providers": ran,
                         "provider_options": {k: self.provider_options.get(k) for k in
                                              ("device_id", "cudnn_conv_algo_search", "use_tf32", "prefer_nhwc",
                                               "enable_cuda_graph") if k in self.provider_options},
                         "io_binding": "inputs and outputs on the device" if device == "cuda" else "CPU arrays",
                         # an option this build does not know is dropped silently: say so
                         "options_not_applied": sorted(k for k, v in (provider_options or {}).items()
                                                       if str(self.provider_options.get(k)) != str(v))}
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
        for o in self.sess.get_outputs():
            if cuda_graph:  # a CUDA graph replays into fixed addresses: preallocate every output
                if not output_shapes or o.name not in output_shapes:
                    raise GraphmpError(f"CUDA graph: the shape of output '{o.name}' is not known")
                v = ort.OrtValue.ortvalue_from_shape_and_type(list(output_shapes[o.name]),
                                                              _ORT_TYPES.get(o.type, np.float32), "cuda", 0)
                self._keep.append(v)
                self.binding.bind_ortvalue_output(o.name, v)
            else:
                self.binding.bind_output(o.name, device)

    def run(self) -> None:
        """One run, bounded and stoppable (graphmp.run_limits; the limits are taken once,
        so that a run costs the watchdog's registration, 4.5 us measured on a 2-core CPU, and no more)."""
        self.guard(lambda options: self.sess.run_with_iobinding(self.binding, options))
        self.binding.synchronize_outputs()

    def outputs(self) -> dict:
        return dict(zip(self.output_names, self.binding.copy_outputs_to_cpu()))

    def close(self):
        self.binding = self.sess = None
        self._keep.clear()


# --- TensorRT -------------------------------------------------------------------------------------

class TrtRunner:
    """A strongly typed TensorRT engine built from `path` at the feeds' shapes (graphmp.trt's
    public build_engine / EngineRunner). `tf32` False clears BuilderFlag.TF32."""
    provider = "TensorRT"

    def __init__(self, path: str, feeds: dict, tf32: bool, timing_cache: str | None,
                 workspace_mb: int | None, engine_path: str | None = None):
        from ..trt import EngineRunner, build_engine
        built = build_engine(path, engine_path, shapes={k: v.shape for k, v in feeds.items()}, tf32=tf32,
                             timing_cache=timing_cache, workspace_mb=workspace_mb)
        self.build_s, self.engine_bytes = built.seconds, len(built.engine)
        self._runner = EngineRunner(built.engine, feeds)
        self.settings = {"provider": self.provider, "strongly_typed": True, "tf32_flag": tf32,
                         "cuda_graph": getattr(self._runner, "graph", None) is not None,
                         "cuda_graph_note": getattr(self._runner, "cuda_graph_note", None),
                         "timing_cache": timing_cache, "profile": "min = opt = max = these shapes"}

    def run(self) -> None:
        self._runner.step()  # returns after the stream is synchronized; its device time is not used

    def outputs(self) -> dict:
        return self._runner.outputs()

    def close(self):
        self._runner.close()


# --- which backends can run here -------------------------------------------------------------------

def ort_cuda_status():
    """None when onnxruntime lists a CUDA provider, else why not (with how to install it).
    Listed is not running: each session is still checked (OrtRunner raises FellBack)."""
    import onnxruntime as ort
    avail = ort.get_available_providers()
    if CUDA not in avail:
        return (f"onnxruntime {ort.__version__} has no CUDA provider (providers: {', '.join(avail)}). "
                f"Install it with {GPU_INSTALL}.")
    return None


def trt_status():
    """None when TensorRT and torch with CUDA import, else why not."""
    from ..trt import import_tensorrt, import_torch_cuda
    try:
        import_tensorrt()
        import_torch_cuda()
    except GraphmpError as e:
        return str(e)
    return None

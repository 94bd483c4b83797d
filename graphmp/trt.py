"""graphmp.trt: TensorRT engines from ONNX models, and a timed run of one.

Written against the TensorRT 10.x / 11.x Python API and kept small so that it can be
read and trusted: it cannot run on the machines graphmp is developed on (no GPU, no
TensorRT wheel), so nothing here is exercised by the CPU test suite except the
missing-library path.

What it guarantees:
- `build_engine` builds a *strongly typed* network (TensorRT 10: the STRONGLY_TYPED
  creation flag; TensorRT 11: always, the flag is accepted and ignored). Every tensor's
  type comes from the ONNX graph, so the Casts graphmp placed are the engine's precision
  plan: an FP32 model gives an FP32 engine (TF32 Tensor Cores for FP32 convolutions and
  GEMMs unless `tf32=False` clears BuilderFlag.TF32), a graphmp-converted model gives a
  mixed FP16/FP32 engine. No precision builder flag (FP16, INT8, ...) is ever set.
- Dynamic input dims get one optimization profile from `shapes` (opt), `min_shapes`
  and `max_shapes` (both default to opt). A dynamic input without a shape is an error
  that names the input and its dims.
- The ONNX parser reads the file itself (`parse_from_file`), so external weights next
  to the model are found; parser failures are raised with the parser's own messages.
- A timing cache file is read when it exists and written back (atomically) after the
  build, so rebuilding with the same cache is fast.
- `EngineRunner` deserializes an engine, binds device buffers for the given inputs and
  times one `execute_async_v3` per step with CUDA events. It captures the enqueue into a
  CUDA graph where TensorRT allows it (replayed per step) and says when it could not.

Device buffers, the stream, CUDA events and graph capture use PyTorch (`torch.cuda`):
the simplest correct route, with no hand-written CUDA runtime calls. PyTorch is needed
only for timing (`graphmp bench --backends trt`), not for `build_engine`.
TensorRT and PyTorch are imported only when these functions are called.
"""
from __future__ import annotations

import os
import time

import numpy as np

from .errors import GraphmpError
from .inputs import parse_shapes
from .io import atomic_write, load_model

INSTALL_HINT = ("Install it with pip install 'graphmp[gpu]' (or pip install tensorrt); it needs an NVIDIA GPU "
                "and driver (without one, graphmp bench --backends ort-cpu still runs).")


def import_tensorrt():
    """The tensorrt module, or a GraphmpError that says how to install it."""
    try:
        import tensorrt as trt
    except Exception as e:  # ImportError, or OSError when libnvinfer cannot be loaded
        raise GraphmpError(f"TensorRT is not available (import tensorrt: {type(e).__name__}: "
                           f"{str(e)[:160]}). {INSTALL_HINT}") from None
    return trt


def import_torch_cuda():
    """torch with a working CUDA device (device buffers, stream, events for timing)."""
    try:
        import torch
    except Exception as e:
        raise GraphmpError(f"timing a TensorRT engine needs PyTorch with CUDA for device buffers and CUDA "
                           f"events (import torch: {type(e).__name__}: {str(e)[:120]}). Install it with "
                           "pip install torch.") from None
    if not torch.cuda.is_available():
        raise GraphmpError("PyTorch sees no CUDA device (torch.cuda.is_available() is False): no NVIDIA GPU, "
                           "no driver, or a CPU-only torch build. TensorRT engines run only on an NVIDIA GPU.")
    return torch


def _write_bytes(path: str, data: bytes) -> None:
    try:
        with atomic_write(path) as f:
            f.write(data)
    except OSError as e:
        raise GraphmpError(f"{path}: could not write ({e.strerror or e}). Check the folder and free space.") from None


class BuildResult:
    """A built engine: `engine` (the serialized bytes), `seconds`, `to_dict()`, `summary()`."""

    def __init__(self, engine: bytes, data: dict):
        self.engine = engine
        self.data = data

    @property
    def seconds(self) -> float:
        return self.data["build_s"]

    def to_dict(self) -> dict:
        return self.data

    def summary(self) -> str:
        d = self.data
        lines = [f"{d['model']} -> {d['output'] or '(in memory)'}: {d['engine_bytes'] / 1e6:.1f} MB engine "
                 f"in {d['build_s']:.1f} s (TensorRT {d['tensorrt']}, strongly typed, TF32 "
                 f"{'on' if d['tf32'] else 'off'})"]
        for name, p in d["profile"].items():
            lines.append(f"  profile {name}: min {p['min']} opt {p['opt']} max {p['max']}")
        if d["timing_cache"]:
            lines.append(f"  timing cache: {d['timing_cache']}")
        for n in d["notes"]:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


def _check_dims(name, dims, shape, what):
    if len(shape) != len(dims) or any(d >= 0 and d != s for d, s in zip(dims, shape)):
        raise GraphmpError(f"{what} shape {'x'.join(map(str, shape)) or '(scalar)'} for input '{name}' does not "
                           f"match its dims {list(dims)} (-1 = dynamic)")


def build_engine(model, output=None, *, shapes=None, min_shapes=None, max_shapes=None, tf32: bool = True,
                 timing_cache=None, workspace_mb: int | None = None, verbose: bool = False) -> BuildResult:
    """Build a strongly typed TensorRT engine from the ONNX file `model`.

    shapes / min_shapes / max_shapes: the optimization profile of dynamic inputs, as
      'name:1x3x224x224,...' or {name: shape}; min and max default to the opt shape.
    tf32: allow TF32 Tensor Cores for FP32 layers (TensorRT's default); False = strict FP32.
    timing_cache: a file read if present and written back after the build.
    output: write the engine there (atomically); it is also in `result.engine`.
    """
    path = os.fspath(model)
    graph = load_model(path)  # clear errors for missing / bad files before TensorRT is touched
    opt, mins, maxs = parse_shapes(shapes), parse_shapes(min_shapes), parse_shapes(max_shapes)
    if output is not None:
        output = os.fspath(output)
        if os.path.abspath(output) == os.path.abspath(path):
            raise GraphmpError(f"{output}: the engine path is the model path; choose another name with -o.")
        out_dir = os.path.dirname(os.path.abspath(output))
        if not os.path.isdir(out_dir):
            raise GraphmpError(f"{output}: output folder {out_dir} does not exist. Create it first.")
    notes = []
    if "graphmp" not in {p.key for p in graph.metadata_props}:
        notes.append("this model was not converted by graphmp: a strongly typed build of an FP32 graph is an FP32 "
                     "engine (TF32 where allowed). Convert it first (graphmp convert) for FP16 Tensor Core compute.")
    trt = import_tensorrt()

    logger = trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # TensorRT 10: opt in to strong typing; 11: always strongly typed, the flag is accepted and ignored.
    # EXPLICIT_BATCH is not set: ignored since 10.0 (networks are always explicit batch), gone in 11.
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)  # None: always, no flag
    network = builder.create_network(0 if strongly_typed is None else 1 << int(strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(os.path.abspath(path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise GraphmpError(f"{path}: TensorRT's ONNX parser failed:\n  " + "\n  ".join(errors or ["(no message)"]))

    config = builder.create_builder_config()
    if tf32:
        config.set_flag(trt.BuilderFlag.TF32)
    else:
        config.clear_flag(trt.BuilderFlag.TF32)
    if workspace_mb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_mb) << 20)

    inputs = {t.name: tuple(t.shape) for t in (network.get_input(i) for i in range(network.num_inputs))}
    for given in (opt, mins, maxs):
        unknown = sorted(set(given) - set(inputs))
        if unknown:
            raise GraphmpError(f"{path}: no network input named {unknown}; the inputs are "
                               + ", ".join(f"{n} {list(d)}" for n, d in inputs.items()))
    profile_info = {}
    dynamic = {n: d for n, d in inputs.items() if any(x < 0 for x in d)}
    if dynamic:
        missing = [f"{n} {list(d)}" for n, d in dynamic.items() if n not in opt]
        if missing:
            raise GraphmpError(f"{path}: inputs with dynamic dims need a shape: {', '.join(missing)}. "
                               "Give them with --shapes NAME:1x3x224x224 (and --min-shapes/--max-shapes for a range).")
        profile = builder.create_optimization_profile()
        for name, dims in dynamic.items():
            o = opt[name]
            lo, hi = mins.get(name, o), maxs.get(name, o)
            for what, s in (("opt", o), ("min", lo), ("max", hi)):
                _check_dims(name, dims, s, what)
            if any(a > b for a, b in zip(lo, o)) or any(a > b for a, b in zip(o, hi)):
                raise GraphmpError(f"input '{name}': need min <= opt <= max in every dim, got {lo}, {o}, {hi}")
            profile.set_shape(name, lo, o, hi)
            profile_info[name] = {"min": list(lo), "opt": list(o), "max": list(hi)}
        config.add_optimization_profile(profile)
    for name, s in opt.items():
        if name not in dynamic:
            _check_dims(name, inputs[name], s, "given")

    cache_path = os.fspath(timing_cache) if timing_cache else None
    blob = b""
    if cache_path and os.path.exists(cache_path):
        with open(cache_path, "rb") as f:
            blob = f.read()
    config.set_timing_cache(config.create_timing_cache(blob), False)  # False: a mismatched cache is an error

    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - t0
    if serialized is None:
        raise GraphmpError(f"{path}: TensorRT could not build the engine; its messages are above (stderr).")
    engine = bytes(serialized)
    if cache_path:
        _write_bytes(cache_path, bytes(config.get_timing_cache().serialize()))
    if output is not None:
        _write_bytes(output, engine)
    data = {"model": path, "output": output, "tensorrt": trt.__version__, "strongly_typed": True,
            "tf32": bool(tf32), "engine_bytes": len(engine), "build_s": seconds, "profile": profile_info,
            "timing_cache": cache_path, "notes": notes}
    return BuildResult(engine, data)


class EngineRunner:
    """One engine, its inputs on the device and a timed step.

        r = EngineRunner(engine_bytes, feeds)   # feeds: {input name: numpy array}
        seconds = r.step()                      # one inference, timed with CUDA events
        outs = r.outputs()                      # {output name: numpy array}
        r.close()
    """

    def __init__(self, engine: bytes, feeds: dict):
        trt = import_tensorrt()
        torch = self.torch = import_torch_cuda()
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(engine)
        if self.engine is None:
            raise GraphmpError("TensorRT could not deserialize the engine (built by another TensorRT version "
                               "or for another GPU?); its messages are above.")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        missing = [n for n in inputs if n not in feeds]
        if missing:
            raise GraphmpError(f"no data for engine inputs {missing}")
        self.buffers, self.output_names = {}, [n for n in names if n not in inputs]
        for n in inputs:  # inputs first: output shapes follow from the input shapes
            arr = np.ascontiguousarray(feeds[n], dtype=trt.nptype(self.engine.get_tensor_dtype(n)))
            self.buffers[n] = torch.from_numpy(arr).cuda()
            self.context.set_input_shape(n, arr.shape)
        for n in self.output_names:
            shape = tuple(self.context.get_tensor_shape(n))
            if any(d < 0 for d in shape):
                raise GraphmpError(f"output '{n}' has a data-dependent shape {shape}; timing such engines "
                                   "needs an output allocator, which graphmp does not implement")
            host = np.empty(shape, dtype=trt.nptype(self.engine.get_tensor_dtype(n)))
            self.buffers[n] = torch.from_numpy(host).cuda()
        for n, t in self.buffers.items():
            self.context.set_tensor_address(n, t.data_ptr())
        self._enqueue()  # one run after setting shapes, required before graph capture
        self.stream.synchronize()
        self.graph, self.cuda_graph_note = None, "CUDA graph: captured, one replay per step"
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=self.stream):
                self._enqueue()
            self.graph = g
        except Exception as e:  # some engines cannot be captured (e.g. data-dependent control flow)
            self.cuda_graph_note = f"CUDA graph: not captured ({str(e)[:100]}); one execute_async_v3 per step"
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def _enqueue(self):
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise GraphmpError("TensorRT execute_async_v3 failed; its messages are above.")

    def step(self) -> float:
        torch = self.torch
        self.start.record(self.stream)
        with torch.cuda.stream(self.stream):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._enqueue()
        self.end.record(self.stream)
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3  # ms -> s

    def outputs(self) -> dict:
        self.stream.synchronize()
        return {n: self.buffers[n].cpu().numpy() for n in self.output_names}

    def close(self):
        self.graph = self.context = self.engine = None
        self.buffers.clear()
        self.torch.cuda.empty_cache()

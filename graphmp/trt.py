"""graphmp.trt: TensorRT engines from ONNX models, and a timed run of one.

Written against the TensorRT 10.x / 11.x Python API and kept small so that it can be
read and trusted. It cannot run on the machines graphmp is developed on (no GPU, no
TensorRT wheel): tests/test_trt.py checks its call sequence and its handling of every
failure value against a recording stand-in of the `tensorrt` module (a test double, not
evidence that TensorRT works); benchmarks/gpu_check.sh is the real check on a GPU.

What it guarantees:
- `build_engine` builds a *strongly typed* network (TensorRT 10: the STRONGLY_TYPED
  creation flag; TensorRT 11: always, the flag is accepted and ignored). Every tensor's
  type comes from the ONNX graph, so the Casts graphmp placed are the engine's precision
  plan: an FP32 model gives an FP32 engine (TF32 Tensor Cores for FP32 convolutions and
  GEMMs unless `tf32=False` clears BuilderFlag.TF32), a graphmp-converted model gives a
  mixed FP16/FP32 engine. No precision builder flag (FP16, INT8, ...) is ever set.
- TensorRT's plugins are registered (`init_libnvinfer_plugins`) before parsing or
  deserializing, so ONNX ops that TensorRT implements as plugins parse.
- Dynamic input dims get one optimization profile from `shapes` (opt), `min_shapes`
  and `max_shapes` (both default to opt). A dynamic input without a shape is an error
  that names the input and its dims.
- The ONNX parser gets the model's bytes with its weights inline, read through the data
  files graphmp checked (under 2 GB; over, it reads the file itself, `parse_from_file`,
  after the same check); parser failures name the node, its op and TensorRT's message.
- A failed build is a GraphmpError carrying the errors TensorRT logged (a logger that
  keeps them), not "see above".
- Before any work (and before TensorRT is imported): the engine output and the timing
  cache may not be the model or an external data file it reads, nor one file together
  (paths.refuse_clobber); an engine output or timing cache that is a device, FIFO or
  directory is refused (paths.check_target), so reading a cache cannot block on a FIFO.
- A timing cache file is read when it exists and written back (atomically) after the
  build. A cache TensorRT rejects (another GPU or TensorRT version, or damaged) is
  reported as a warning and replaced by a fresh one: the build goes on.
- `EngineRunner` deserializes an engine, checks every `set_input_shape` and
  `set_tensor_address` (a shape outside the profile is a one-line error with the
  profile's min/opt/max), gives shape-tensor inputs host memory (TensorRT reads their
  values on the host), never binds a null address (zero-size tensors get a 1-byte
  buffer), converts BF16 inputs/outputs itself (float32 <-> bfloat16 bits; `trt.nptype`
  raises for BF16), and times each step with CUDA events. It captures the enqueue into a
  CUDA graph in thread-local capture mode (cudaStreamCaptureModeThreadLocal: other
  threads' CUDA calls cannot break or join the capture), so a step is one graph replay, or
  one `execute_async_v3` where capture failed (`cuda_graph_note` says which).

Device buffers, the stream, CUDA events and graph capture use PyTorch (`torch.cuda`):
the simplest correct route, with no hand-written CUDA runtime calls. PyTorch is needed
only for running (`graphmp bench --backends trt`), not for `build_engine`.
TensorRT and PyTorch are imported only when these functions are called.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from .errors import GraphmpError
from .inputs import dims_text, parse_shapes
from .model_io import (TWO_GB, is_external, iter_graphs, load_model, load_with_weights, model_inputs,
                       tensor_nbytes)
from .weight_rounding import from_bf16_bits, to_bf16_bits
from .save import atomic_write
from .paths import check_target, refuse_clobber

INSTALL_HINT = ("Install it with pip install 'graphmp[gpu]' (or pip install tensorrt); it needs an NVIDIA GPU "
                "and driver (without one, graphmp bench --backends ort-cpu still runs).")

# TensorRT DataType name -> numpy storage type. BF16 is stored as uint16 bits and converted
# here (trt.nptype raises for it); FP8 / INT4 / FP4 I/O has no numpy type and is refused.
_STORAGE = {"FLOAT": np.float32, "HALF": np.float16, "BF16": np.uint16, "INT8": np.int8, "INT32": np.int32,
            "INT64": np.int64, "BOOL": np.bool_, "UINT8": np.uint8}


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


# --- logger, plugins, dtypes ------------------------------------------------------------------------

def make_logger(trt, verbose: bool = False):
    """A trt.ILogger that prints warnings and errors (everything with `verbose`) to stderr
    and keeps the errors in `.errors`, so a failure can quote what TensorRT said."""

    class _Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)  # pybind11 needs the base initialised explicitly
            self.errors: list[str] = []
            self.limit = int(trt.ILogger.Severity.VERBOSE if verbose else trt.ILogger.Severity.WARNING)

        def log(self, severity, msg):
            level = int(severity)
            if level <= int(trt.ILogger.Severity.ERROR):
                self.errors.append(str(msg))
            if level <= self.limit:
                print(f"TensorRT: {msg}", file=sys.stderr)

        def said(self, n: int = 4) -> str:
            return " | ".join(self.errors[-n:]) if self.errors else "TensorRT logged no error"

    return _Logger()


def init_plugins(trt, logger) -> str | None:
    """Register TensorRT's plugin library; None when done, else a note (the build or load
    goes on: only models that use a plugin op need it)."""
    try:
        ok = trt.init_libnvinfer_plugins(logger, "")
    except Exception as e:
        return f"TensorRT plugins not registered ({type(e).__name__}: {str(e)[:100]})"
    return None if ok else "TensorRT plugins not registered (init_libnvinfer_plugins returned False)"


def dtype_name(dt) -> str:
    """'FLOAT', 'HALF', 'BF16', ... for a trt.DataType."""
    return getattr(dt, "name", None) or str(dt).rsplit(".", 1)[-1]


def storage_dtype(dt, tensor: str):
    """The numpy type that holds tensor data of TensorRT type `dt` (BF16 -> uint16 bits)."""
    name = dtype_name(dt)
    if name not in _STORAGE:
        raise GraphmpError(f"engine tensor '{tensor}' has type {name}, which graphmp cannot feed or read from "
                           f"numpy (supported: {', '.join(_STORAGE)}); keep this model's inputs and outputs "
                           "in one of those types")
    return _STORAGE[name]


def host_array(value, dt, tensor: str) -> np.ndarray:
    """`value` as a C-contiguous array in the storage type of TensorRT type `dt`."""
    storage = storage_dtype(dt, tensor)
    if storage is np.uint16 and dtype_name(dt) == "BF16":
        arr = np.asarray(value)
        if arr.dtype.name == "bfloat16":  # ml_dtypes / onnx arrays: already bfloat16 bits
            return np.ascontiguousarray(arr).view(np.uint16)
        return to_bf16_bits(arr)
    return np.ascontiguousarray(value, dtype=storage)


def _write_bytes(path: str, data: bytes) -> None:
    try:
        with atomic_write(path) as f:
            f.write(data)
    except OSError as e:
        raise GraphmpError(f"{path}: could not write ({e.strerror or e}). Check the folder and free space.") from None


def _parse(parser, path: str, graph) -> bool:
    """TensorRT's parser on the model at `path` (`graph`: load_model's, its external data
    checked). Under 2 GB the parser gets the model's bytes with every weight inline, read
    through the descriptors graphmp checked (load_with_weights), so TensorRT opens no file:
    a data file swapped after the check, or a link that leaves the model's folder, is never
    read. Over 2 GB protobuf cannot hold the model in one message: the parser reads the file
    and its external data itself (parse_from_file), after the same check."""
    external = sum(tensor_nbytes(t) for g in iter_graphs(graph.graph) for t in g.initializer if is_external(t))
    if graph.ByteSize() + external < TWO_GB:  # ByteSize counts the inline weights
        return parser.parse(load_with_weights(path).SerializeToString())
    return parser.parse_from_file(os.path.abspath(path))


def _parser_error_text(err) -> str:
    """One parser error as 'node NAME (OP, #i): message' (TensorRT 10 IParserError
    node_name/node_operator/node; older ones have only node() and desc())."""
    def get(attr):
        fn = getattr(err, attr, None)
        try:
            return fn() if callable(fn) else None
        except Exception:
            return None
    desc, name, op, index = get("desc"), get("node_name"), get("node_operator"), get("node")
    where = []
    if name:
        where.append(f"node '{name}'")
    if op:
        where.append(f"({op})")
    if index is not None and int(index) >= 0 and not name:
        where.append(f"node #{int(index)}")
    return (" ".join(where) + ": " if where else "") + str(desc if desc is not None else err).strip()


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
        raise GraphmpError(f"{what} shape {dims_text(shape)} for input '{name}' does not "
                           f"match its dims {list(dims)} (-1 = dynamic)")


def _profile(builder, config, path, inputs, opt, mins, maxs) -> dict:
    """One optimization profile for the dynamic inputs; {name: {min, opt, max}}."""
    for given in (opt, mins, maxs):
        unknown = sorted(set(given) - set(inputs))
        if unknown:
            raise GraphmpError(f"{path}: no network input named {unknown}; the inputs are "
                               + ", ".join(f"{n} {list(d)}" for n, d in inputs.items()))
    info = {}
    dynamic = {n: d for n, d in inputs.items() if any(x < 0 for x in d)}
    for name, s in opt.items():
        if name not in dynamic:
            _check_dims(name, inputs[name], s, "given")
    if not dynamic:
        return info
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
        info[name] = {"min": list(lo), "opt": list(o), "max": list(hi)}
    if config.add_optimization_profile(profile) < 0:  # returns the profile's index, -1 when invalid
        raise GraphmpError(f"{path}: TensorRT rejected the optimization profile {info}")
    return info


def _attach_timing_cache(config, cache_path, notes) -> bool:
    """Read `cache_path` (if it exists) into the config. A cache TensorRT will not take
    (another GPU or TensorRT version, damaged) becomes a warning and a fresh cache.
    Returns whether a cache is attached (then it is written back after the build)."""
    blob = b""
    if cache_path and os.path.exists(cache_path):
        with open(cache_path, "rb") as f:
            blob = f.read()
    cache = config.create_timing_cache(blob)
    # ignore_mismatch=False: a cache measured on another device must not steer tactic choice here
    if cache is not None and config.set_timing_cache(cache, False):
        return True
    if blob:
        msg = (f"timing cache {cache_path} was not accepted (made on another GPU or TensorRT version, or "
               "damaged): starting a fresh cache, which replaces it after this build")
        notes.append(msg)
        print(f"graphmp: warning: {msg}", file=sys.stderr)
        fresh = config.create_timing_cache(b"")
        if fresh is not None and config.set_timing_cache(fresh, False):
            return True
    notes.append("TensorRT would not take an empty timing cache: building without one, nothing written")
    return False


def build_engine(model, output=None, *, shapes=None, min_shapes=None, max_shapes=None, tf32: bool = True,
                 timing_cache=None, workspace_mb: int | None = None, verbose: bool = False) -> BuildResult:
    """Build a strongly typed TensorRT engine from the ONNX file `model`.

    shapes / min_shapes / max_shapes: the optimization profile of dynamic inputs, as
      'name:1x3x224x224,...' or {name: shape}; min and max default to the opt shape.
    tf32: allow TF32 Tensor Cores for FP32 layers (TensorRT's default); False = strict FP32.
    timing_cache: a file read if present and written back after the build.
    output: write the engine there (atomically); it is also in `result.engine`.
    Raises GraphmpError (never a TensorRT exception) for bad files, shapes, parser and build failures.
    """
    path = os.fspath(model)
    output = os.fspath(output) if output is not None else None
    cache_path = os.fspath(timing_cache) if timing_cache else None
    # before any work: neither file the build writes is the model or its data, one file, a
    # device or FIFO, or this process's stdout (a rename would replace /dev/stdout itself)
    for what, f in (("-o (the engine)", output), ("--timing-cache", cache_path)):
        if f is not None:
            check_target(f, what)
    refuse_clobber([("-o (the engine)", output), ("--timing-cache", cache_path)], model_inputs("the model", path))
    graph = load_model(path)  # clear errors for missing / bad files before TensorRT is touched
    opt, mins, maxs = parse_shapes(shapes), parse_shapes(min_shapes), parse_shapes(max_shapes)
    if output is not None:
        out_dir = os.path.dirname(os.path.abspath(output))
        if not os.path.isdir(out_dir):
            raise GraphmpError(f"{output}: output folder {out_dir} does not exist. Create it first.")
    notes = []
    if "graphmp" not in {p.key for p in graph.metadata_props}:
        notes.append("this model was not converted by graphmp: a strongly typed build of an FP32 graph is an FP32 "
                     "engine (TF32 where allowed). Convert it first (graphmp convert) for FP16 Tensor Core compute.")
    trt = import_tensorrt()

    logger = make_logger(trt, verbose)
    note = init_plugins(trt, logger)
    if note:
        notes.append(note)
    builder = trt.Builder(logger)
    # TensorRT 10: opt in to strong typing; 11: always strongly typed, the flag is accepted and ignored.
    # EXPLICIT_BATCH is not set: ignored since 10.0 (networks are always explicit batch), gone in 11.
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)  # None: always, no flag
    network = builder.create_network(0 if strongly_typed is None else 1 << int(strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not _parse(parser, path, graph):
        errors = [_parser_error_text(parser.get_error(i)) for i in range(parser.num_errors)]
        shown = "; ".join(errors[:4]) or f"no parser error recorded ({logger.said()})"
        more = f" (+{len(errors) - 4} more)" if len(errors) > 4 else ""
        raise GraphmpError(f"{path}: TensorRT's ONNX parser failed: {shown}{more}")

    config = builder.create_builder_config()
    if tf32:
        config.set_flag(trt.BuilderFlag.TF32)
    else:
        config.clear_flag(trt.BuilderFlag.TF32)
    if workspace_mb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_mb) << 20)

    inputs = {t.name: tuple(t.shape) for t in (network.get_input(i) for i in range(network.num_inputs))}
    profile_info = _profile(builder, config, path, inputs, opt, mins, maxs)

    cached = _attach_timing_cache(config, cache_path, notes)

    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - t0
    if serialized is None:
        raise GraphmpError(f"{path}: TensorRT could not build the engine: {logger.said()}")
    engine = bytes(serialized)
    if cache_path and cached:
        cache = config.get_timing_cache()
        if cache is None:
            notes.append(f"timing cache not written: TensorRT returned none after the build ({cache_path})")
        else:
            _write_bytes(cache_path, bytes(cache.serialize()))
    if output is not None:
        _write_bytes(output, engine)
    data = {"model": path, "output": output, "tensorrt": trt.__version__, "strongly_typed": True,
            "tf32": bool(tf32), "engine_bytes": len(engine), "build_s": seconds, "profile": profile_info,
            "timing_cache": cache_path if cached else None, "notes": notes}
    return BuildResult(engine, data)


class EngineRunner:
    """One engine, its inputs on the device and a timed step.

        r = EngineRunner(engine_bytes, feeds)   # feeds: {input name: numpy array}
        seconds = r.step()                      # one inference, timed with CUDA events
        outs = r.outputs()                      # {output name: numpy array}; BF16 comes back as float32
        r.close()

    Needs TensorRT and torch with CUDA; raises GraphmpError for an engine that does not
    load, a feed missing or outside the engine's profile, or an unsupported I/O type.
    """

    def __init__(self, engine: bytes, feeds: dict):
        trt = import_tensorrt()
        torch = self.torch = import_torch_cuda()
        self.logger = make_logger(trt)
        self.notes = [n for n in [init_plugins(trt, self.logger)] if n]
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(engine)
        if self.engine is None:
            raise GraphmpError("TensorRT could not deserialize the engine (built by another TensorRT version "
                               f"or for another GPU?): {self.logger.said()}")
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise GraphmpError(f"TensorRT could not create an execution context: {self.logger.said()}")
        self.stream = torch.cuda.Stream()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        missing = [n for n in inputs if n not in feeds]
        if missing:
            raise GraphmpError(f"no data for engine inputs {missing} (the engine's inputs: {inputs})")
        self.output_names = [n for n in names if n not in inputs]
        self.buffers = {}   # device tensors: name -> torch uint8 tensor of >= 1 byte
        self.host = {}      # shape-tensor I/O: name -> numpy array TensorRT reads/writes on the host
        self.layout = {}    # name -> (shape, numpy storage type, is BF16)
        for n in inputs:  # inputs first: output shapes follow from the input shapes (and shape-tensor values)
            dt = self.engine.get_tensor_dtype(n)
            arr = host_array(feeds[n], dt, n)
            self.layout[n] = (arr.shape, arr.dtype, dtype_name(dt) == "BF16")
            if not self.context.set_input_shape(n, arr.shape):
                raise GraphmpError(self._shape_error(n, arr.shape))
            if self.engine.is_shape_inference_io(n):
                # shape tensor: TensorRT reads its values on the host, and needs them (address set)
                # before it can infer output shapes
                self.host[n] = arr
                self._bind(n, arr.ctypes.data)
            else:
                self.buffers[n] = self._to_device(arr)
        unresolved = self.context.infer_shapes()
        if unresolved:
            raise GraphmpError(f"TensorRT cannot infer the shapes of {list(unresolved)} from the given inputs "
                               f"({', '.join(f'{n} {dims_text(self.layout[n][0])}' for n in inputs)})")
        for n in self.output_names:
            shape = tuple(self.context.get_tensor_shape(n))
            if any(d < 0 for d in shape):
                raise GraphmpError(f"output '{n}' has a data-dependent shape {shape}; timing such engines "
                                   "needs an output allocator, which graphmp does not implement")
            dt = self.engine.get_tensor_dtype(n)
            storage = storage_dtype(dt, n)
            self.layout[n] = (shape, np.dtype(storage), dtype_name(dt) == "BF16")
            if self.engine.is_shape_inference_io(n):
                self.host[n] = np.zeros(shape, storage)
            else:
                self.buffers[n] = torch.empty(max(int(np.prod(shape)) * np.dtype(storage).itemsize, 1),
                                              dtype=torch.uint8, device="cuda")
        for n, t in self.buffers.items():
            self._bind(n, t.data_ptr())
        for n in self.output_names:
            if n in self.host:
                self._bind(n, self.host[n].ctypes.data)
        torch.cuda.synchronize()  # the input copies are done before the engine's stream reads them
        self._enqueue()  # one run after setting shapes, required before graph capture
        self.stream.synchronize()
        self.graph, self.cuda_graph_note = None, "CUDA graph: captured (thread-local mode), one replay per step"
        try:
            g = torch.cuda.CUDAGraph()
            # thread_local = cudaStreamCaptureModeThreadLocal: only this thread's capture-unsafe
            # calls are refused while capturing; in global mode a cudaMalloc by another thread
            # (an ORT session, a data loader) would fail or invalidate this capture.
            with torch.cuda.graph(g, stream=self.stream, capture_error_mode="thread_local"):
                self._enqueue()
            self.graph = g
        except Exception as e:  # some engines cannot be captured (e.g. data-dependent control flow)
            self.cuda_graph_note = f"CUDA graph: not captured ({str(e)[:100]}); one execute_async_v3 per step"
            self._enqueue()  # the context still runs without a graph, or this raises
            self.stream.synchronize()
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def _to_device(self, arr: np.ndarray):
        """A device copy of `arr` in a byte buffer of at least 1 byte (a zero-size tensor still
        gets a real, non-null address, which TensorRT requires)."""
        torch = self.torch
        buf = torch.empty(max(arr.nbytes, 1), dtype=torch.uint8, device="cuda")
        if arr.nbytes:
            buf[:arr.nbytes].copy_(torch.from_numpy(arr.reshape(-1).view(np.uint8)))
        return buf

    def _bind(self, name, ptr):
        if not ptr or not self.context.set_tensor_address(name, ptr):
            raise GraphmpError(f"TensorRT refused the buffer address {ptr:#x} of '{name}': {self.logger.said()}")

    def _shape_error(self, name, shape) -> str:
        try:
            lo, opt, hi = (dims_text(tuple(s)) for s in self.engine.get_tensor_profile_shape(name, 0))
            allowed = f"the engine's profile allows min {lo}, opt {opt}, max {hi}"
        except Exception:
            allowed = f"the engine's dims are {list(self.engine.get_tensor_shape(name))}"
        return (f"input '{name}': TensorRT refused shape {dims_text(shape)}; {allowed}. Rebuild the engine "
                "with --shapes/--min-shapes/--max-shapes covering this shape.")

    def _enqueue(self):
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise GraphmpError(f"TensorRT execute_async_v3 failed: {self.logger.said()}")

    def step(self) -> float:
        """One inference; its device time in seconds (CUDA events around it on the stream)."""
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
        """{output name: numpy array} of the last step (BF16 outputs as float32)."""
        self.stream.synchronize()
        out = {}
        for n in self.output_names:
            shape, storage, bf16 = self.layout[n]
            if n in self.host:
                a = self.host[n].copy()
            else:
                nbytes = int(np.prod(shape)) * storage.itemsize
                raw = self.buffers[n][:nbytes].cpu().numpy() if nbytes else np.zeros(0, np.uint8)
                a = raw.view(storage).reshape(shape)
            out[n] = from_bf16_bits(a).reshape(shape) if bf16 else a
        return out

    def close(self):
        self.graph = self.context = self.engine = None
        self.buffers.clear()
        self.host.clear()
        self.torch.cuda.empty_cache()

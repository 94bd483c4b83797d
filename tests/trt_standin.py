"""A recording stand-in of the `tensorrt` module and of the slice of `torch.cuda` that
graphmp/trt.py uses, for tests on machines without a GPU or TensorRT.

This is a TEST DOUBLE for what cannot run here, not evidence that TensorRT works: it
checks that graphmp.trt calls the TensorRT 10.x / 11.x Python API in a valid order with
valid arguments and honours every return value. The real check is
benchmarks/gpu_check.sh on a GPU machine.

The API surface follows the real TensorRT Python API (names, arguments, return values:
`set_timing_cache` -> bool, `set_input_shape` -> bool, `build_serialized_network` ->
IHostMemory or None, `trt.nptype` raising for BF16, `ILogger` subclassed with
`ILogger.__init__(self)`, ...). Only what graphmp.trt calls is modelled.

    trt, torch = make_standins(io_types={"y": "BF16"}, build_fails=True, ...)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "torch", torch)
    ...; trt.calls   # [(name, args), ...] in call order

The engine really computes: its "serialized engine" names the ONNX file, and
`execute_async_v3` reads the inputs from the bound addresses (device buffers of the fake
torch, host memory for shape tensors), runs the model with ONNX Runtime on the CPU and
writes the outputs to the bound addresses. So wrong addresses, wrong dtypes (BF16 bits)
or unbound tensors give wrong outputs or failures, as on a GPU.

Switches (keyword arguments of make_standins):
  plugins_ok=True           init_libnvinfer_plugins' return value
  parse_errors=None         list of (node_name, op, desc): parse / parse_from_file returns False
  build_fails=False         build_serialized_network logs an error and returns None
  device="H100"             the GPU the timing cache belongs to (a cache blob made for
                            another device is rejected by set_timing_cache(cache, False))
  deserialize_fails=False   deserialize_cuda_engine returns None
  execute_fails=False       execute_async_v3 returns False
  capture_fails=False       the CUDA graph capture raises (as for uncapturable engines)
  io_types={}               engine tensor types that differ from the ONNX types, e.g. BF16
  shape_tensors=()          inputs the engine treats as shape tensors (host memory)
"""
from __future__ import annotations

import base64
import contextlib
import ctypes
import enum
import json
import types

import numpy as np

ONNX_TO_TRT = {1: "FLOAT", 10: "HALF", 16: "BF16", 3: "INT8", 6: "INT32", 7: "INT64", 9: "BOOL", 2: "UINT8"}
TRT_TO_NP = {"FLOAT": np.float32, "HALF": np.float16, "INT8": np.int8, "INT32": np.int32, "INT64": np.int64,
             "BOOL": np.bool_, "UINT8": np.uint8}


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class NetworkDefinitionCreationFlag(enum.IntEnum):
    EXPLICIT_BATCH = 0  # deprecated and ignored since TensorRT 10
    STRONGLY_TYPED = 1


class BuilderFlag(enum.IntEnum):
    FP16 = 0
    INT8 = 1
    TF32 = 6
    BF16 = 17


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0


class Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


def nptype(dt):
    """Like tensorrt.nptype: raises TypeError for types numpy has no dtype for (BF16, FP8, INT4)."""
    name = DataType(dt).name
    if name not in TRT_TO_NP:
        raise TypeError(f"Could not resolve TensorRT datatype to an equivalent numpy datatype: {name}")
    return TRT_TO_NP[name]


class Device:
    """The fake GPU's memory: allocations by address (host memory standing in for device memory)."""

    def __init__(self):
        self.allocs: dict[int, np.ndarray] = {}
        self.capturing = None  # the CUDAGraph being captured, if any

    def alloc(self, nbytes: int) -> np.ndarray:
        a = np.zeros(nbytes, np.uint8)
        if nbytes:
            self.allocs[a.ctypes.data] = a
        return a

    def find(self, ptr: int, nbytes: int):
        """The device bytes at ptr (nbytes long), or None when ptr is not device memory."""
        for base, a in self.allocs.items():
            if base <= ptr and ptr + nbytes <= base + a.nbytes:
                return a[ptr - base: ptr - base + nbytes]
        return None


def _host_bytes(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr))[:nbytes]


def make_standins(**switches):
    """(tensorrt stand-in module, torch stand-in module); both record into `trt.calls`."""
    sw = dict(plugins_ok=True, parse_errors=None, build_fails=False, device="H100", deserialize_fails=False,
              execute_fails=False, capture_fails=False, io_types={}, shape_tensors=())
    unknown = set(switches) - set(sw)
    assert not unknown, f"unknown switches {unknown}"
    sw.update(switches)
    calls: list = []
    dev = Device()

    def rec(name, *args):
        calls.append((name, args))

    # --- tensorrt -------------------------------------------------------------------------------
    class ILogger:
        Severity = Severity
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = list(Severity)

        def __init__(self):
            rec("ILogger.__init__")

        def log(self, severity, msg):  # the real base class is abstract here
            raise NotImplementedError

    class Logger(ILogger):
        def __init__(self, min_severity=Severity.WARNING):
            ILogger.__init__(self)
            self.min_severity = min_severity

        def log(self, severity, msg):
            pass

    def init_libnvinfer_plugins(logger, namespace):
        assert isinstance(logger, ILogger) and isinstance(namespace, str)
        rec("init_libnvinfer_plugins", namespace)
        return sw["plugins_ok"]

    class ITensor:
        def __init__(self, name, shape, dtype):
            self.name, self.shape, self.dtype = name, tuple(shape), dtype

    class INetworkDefinition:
        def __init__(self, flags):
            self.flags, self.inputs, self.outputs, self.path, self.model = flags, [], [], None, None

        @property
        def num_inputs(self):
            return len(self.inputs)

        def get_input(self, i):
            return self.inputs[i]

    class IParserError:
        def __init__(self, index, name, op, desc):
            self._i, self._name, self._op, self._desc = index, name, op, desc

        def code(self):
            return "UNSUPPORTED_NODE"

        def desc(self):
            return self._desc

        def node(self):
            return self._i

        def node_name(self):
            return self._name

        def node_operator(self):
            return self._op

    class OnnxParser:
        def __init__(self, network, logger):
            assert isinstance(logger, ILogger)
            self.network, self.errors = network, []

        @property
        def num_errors(self):
            return len(self.errors)

        def get_error(self, i):
            return self.errors[i]

        def parse_from_file(self, path):
            import onnx
            rec("OnnxParser.parse_from_file", path)
            return self._network_of(onnx.load(path, load_external_data=False), path=path)

        def parse(self, model, path=None):
            """TensorRT's parse(model: buffer, path: str = None): a serialized model; path only
            for a model whose weights are stored externally."""
            import onnx
            m = onnx.load_from_string(bytes(model))
            external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in m.graph.initializer)
            rec("OnnxParser.parse", path, external)
            return self._network_of(m, model=bytes(model))

        def _network_of(self, m, path=None, model=None):
            if sw["parse_errors"]:
                self.errors = [IParserError(i, *e) for i, e in enumerate(sw["parse_errors"])]
                return False
            init = {t.name for t in m.graph.initializer}
            for vi, dest in [(v, self.network.inputs) for v in m.graph.input if v.name not in init] + \
                            [(v, self.network.outputs) for v in m.graph.output]:
                tt = vi.type.tensor_type
                shape = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
                name = sw["io_types"].get(vi.name, ONNX_TO_TRT[tt.elem_type])
                dest.append(ITensor(vi.name, shape, DataType[name]))
            self.network.path, self.network.model = path, model
            return True

    class IOptimizationProfile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            rec("IOptimizationProfile.set_shape", name, tuple(lo), tuple(opt), tuple(hi))
            self.shapes[name] = [list(lo), list(opt), list(hi)]

    class IHostMemory:
        def __init__(self, data: bytes):
            self._data = data
            self.nbytes = len(data)

        def __bytes__(self):
            return self._data

    class ITimingCache:
        def __init__(self, device, entries):
            self.device, self.entries = device, entries

        def serialize(self):
            rec("ITimingCache.serialize")
            return IHostMemory(f"STANDIN-CACHE {self.device} {self.entries}".encode())

    class IBuilderConfig:
        def __init__(self):
            self.flags, self.profiles, self.cache, self.pool = set(), [], None, {}

        def set_flag(self, f):
            rec("IBuilderConfig.set_flag", BuilderFlag(f).name)
            self.flags.add(BuilderFlag(f))

        def clear_flag(self, f):
            rec("IBuilderConfig.clear_flag", BuilderFlag(f).name)
            self.flags.discard(BuilderFlag(f))

        def set_memory_pool_limit(self, pool, size):
            rec("IBuilderConfig.set_memory_pool_limit", MemoryPoolType(pool).name, size)
            self.pool[pool] = size

        def add_optimization_profile(self, profile):
            rec("IBuilderConfig.add_optimization_profile")
            self.profiles.append(profile)
            return len(self.profiles) - 1

        def create_timing_cache(self, blob):
            blob = bytes(blob)
            rec("IBuilderConfig.create_timing_cache", len(blob))
            if not blob:
                return ITimingCache(sw["device"], 0)
            parts = blob.decode("latin-1").split()
            if len(parts) != 3 or parts[0] != "STANDIN-CACHE":
                return None  # a damaged blob: TensorRT logs an error and gives no cache
            return ITimingCache(parts[1], int(parts[2]))

        def set_timing_cache(self, cache, ignore_mismatch):
            rec("IBuilderConfig.set_timing_cache", cache.device, bool(ignore_mismatch))
            if cache.device != sw["device"] and not ignore_mismatch:
                return False  # another GPU / TensorRT version: not attached
            self.cache = cache
            return True

        def get_timing_cache(self):
            rec("IBuilderConfig.get_timing_cache")
            return self.cache  # None when no cache was attached

    class Builder:
        def __init__(self, logger):
            assert isinstance(logger, ILogger)
            rec("Builder", type(logger).__name__)
            self.logger = logger

        def create_network(self, flags=0):
            rec("Builder.create_network", flags)
            return INetworkDefinition(flags)

        def create_builder_config(self):
            rec("Builder.create_builder_config")
            return IBuilderConfig()

        def create_optimization_profile(self):
            return IOptimizationProfile()

        def build_serialized_network(self, network, config):
            rec("Builder.build_serialized_network")
            assert network.path or network.model, "build before a successful parse"
            if sw["build_fails"]:
                self.logger.log(Severity.ERROR, "[standin] no implementation found for node 'conv1' (Conv)")
                return None
            if config.cache is not None:
                config.cache.entries += 1
            profile = config.profiles[0].shapes if config.profiles else {}
            model = base64.b64encode(network.model).decode() if network.model else None
            spec = {"path": network.path, "model": model, "strongly_typed": bool(network.flags & 2),
                    "tf32": BuilderFlag.TF32 in config.flags, "profile": profile,
                    "inputs": [[t.name, list(t.shape), t.dtype.name] for t in network.inputs],
                    "outputs": [[t.name, list(t.shape), t.dtype.name] for t in network.outputs]}
            return IHostMemory(json.dumps(spec).encode())

    class ICudaEngine:
        def __init__(self, spec):
            self.spec = spec
            self.io = {n: (TensorIOMode.INPUT, s, DataType[d]) for n, s, d in spec["inputs"]}
            self.io.update({n: (TensorIOMode.OUTPUT, s, DataType[d]) for n, s, d in spec["outputs"]})
            self.names = list(self.io)

        @property
        def num_io_tensors(self):
            return len(self.names)

        def get_tensor_name(self, i):
            return self.names[i]

        def get_tensor_mode(self, name):
            return self.io[name][0]

        def get_tensor_dtype(self, name):
            return self.io[name][2]

        def get_tensor_shape(self, name):
            return tuple(self.io[name][1])

        def get_tensor_profile_shape(self, name, profile_index):
            if name not in self.spec["profile"]:
                raise RuntimeError(f"{name} has no profile")
            return [tuple(s) for s in self.spec["profile"][name]]

        def is_shape_inference_io(self, name):
            return name in sw["shape_tensors"]

        def create_execution_context(self):
            rec("ICudaEngine.create_execution_context")
            return IExecutionContext(self)

    class IExecutionContext:
        def __init__(self, engine):
            self.engine, self.shapes, self.addresses = engine, {}, {}
            import onnxruntime as ort
            source = base64.b64decode(engine.spec["model"]) if engine.spec.get("model") else engine.spec["path"]
            self.sess = ort.InferenceSession(source, providers=["CPUExecutionProvider"])

        def set_input_shape(self, name, shape):
            shape = tuple(int(d) for d in shape)
            rec("IExecutionContext.set_input_shape", name, shape)
            mode, dims, _ = self.engine.io[name]
            assert mode == TensorIOMode.INPUT
            if len(dims) != len(shape) or any(d >= 0 and d != s for d, s in zip(dims, shape)):
                return False
            if name in self.engine.spec["profile"]:
                lo, _, hi = self.engine.spec["profile"][name]
                if any(s < a or s > b for s, a, b in zip(shape, lo, hi)):
                    return False
            self.shapes[name] = shape
            return True

        def set_tensor_address(self, name, ptr):
            rec("IExecutionContext.set_tensor_address", name, "host" if dev.find(ptr, 1) is None else "device")
            if not ptr:
                return False  # a null address is refused (TensorRT logs an error)
            self.addresses[name] = ptr
            return True

        def _feeds(self, zeros: bool):
            feeds = {}
            for n, (mode, _, dt) in self.engine.io.items():
                if mode != TensorIOMode.INPUT:
                    continue
                shape = self.shapes[n]
                storage = np.uint16 if dt.name == "BF16" else TRT_TO_NP[dt.name]
                nbytes = int(np.prod(shape)) * np.dtype(storage).itemsize
                if n in sw["shape_tensors"]:
                    raw = _host_bytes(self.addresses[n], nbytes)
                elif zeros:
                    raw = np.zeros(nbytes, np.uint8)
                else:
                    raw = dev.find(self.addresses[n], nbytes)
                    assert raw is not None, f"'{n}' is not bound to device memory of {nbytes} bytes"
                a = raw.view(storage).reshape(shape)
                feeds[n] = (a.astype(np.uint32) << 16).view(np.float32) if dt.name == "BF16" else a
            return feeds

        def infer_shapes(self):
            rec("IExecutionContext.infer_shapes")
            return [n for n in sw["shape_tensors"] if n not in self.addresses]

        def get_tensor_shape(self, name):
            mode, dims, _ = self.engine.io[name]
            if mode == TensorIOMode.INPUT:
                return self.shapes.get(name, tuple(dims))
            if self.infer_shapes():
                return tuple(-1 for _ in dims)
            out = self.sess.run([name], self._feeds(zeros=True))[0]
            return tuple(out.shape)

        def _run(self):
            outs = self.sess.run(None, self._feeds(zeros=False))
            for (name, _, dt), value in zip(self.engine.spec["outputs"], outs):
                if dt == "BF16":
                    value = (np.ascontiguousarray(value, np.float32).view(np.uint32) >> 16).astype(np.uint16)
                raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
                dst = dev.find(self.addresses[name], raw.nbytes) if raw.nbytes else np.zeros(0, np.uint8)
                assert dst is not None, f"output '{name}' is not bound to device memory of {raw.nbytes} bytes"
                dst[:] = raw

        def execute_async_v3(self, stream_handle):
            rec("IExecutionContext.execute_async_v3", "capture" if dev.capturing else "run")
            assert isinstance(stream_handle, int) and stream_handle, "execute_async_v3 needs a CUDA stream handle"
            missing = [n for n in self.engine.io if n not in self.addresses]
            if sw["execute_fails"] or missing:
                return False
            if dev.capturing is not None:
                dev.capturing.ops.append(self._run)
            else:
                self._run()
            return True

    class Runtime:
        def __init__(self, logger):
            assert isinstance(logger, ILogger)
            rec("Runtime")

        def deserialize_cuda_engine(self, blob):
            rec("Runtime.deserialize_cuda_engine")
            if sw["deserialize_fails"]:
                return None
            return ICudaEngine(json.loads(bytes(blob)))

    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.13.standin"
    trt.calls, trt.device = calls, dev
    for obj in (DataType, TensorIOMode, NetworkDefinitionCreationFlag, BuilderFlag, MemoryPoolType, ILogger, Logger,
                Builder, OnnxParser, Runtime, IBuilderConfig, ITimingCache, IHostMemory, ICudaEngine,
                IExecutionContext, IOptimizationProfile, nptype, init_libnvinfer_plugins):
        setattr(trt, obj.__name__, obj)
    return trt, _make_torch(rec, dev, sw)


def _make_torch(rec, dev, sw):
    """The slice of torch that graphmp.trt uses: byte tensors on a fake device, a stream,
    CUDA events, CUDA graph capture and replay."""
    uint8 = "uint8"

    class Tensor:
        def __init__(self, array: np.ndarray, device: str):
            self.a, self.device = array, device

        def __getitem__(self, sl):
            return Tensor(self.a[sl], self.device)

        def copy_(self, src):
            self.a[...] = src.a.reshape(self.a.shape)
            return self

        def data_ptr(self):
            return self.a.ctypes.data if self.a.size else 0  # like torch: an empty tensor has address 0

        def cpu(self):
            return Tensor(self.a.copy(), "cpu")

        def numpy(self):
            assert self.device == "cpu", "can't convert a cuda tensor to numpy: call .cpu() first"
            return self.a

    def empty(n, dtype=None, device="cpu"):
        assert dtype == uint8
        rec("torch.empty", int(n), device)
        return Tensor(dev.alloc(int(n)) if device == "cuda" else np.zeros(int(n), np.uint8), device)

    def from_numpy(a):
        return Tensor(a, "cpu")

    class Stream:
        _next = 0x1000

        def __init__(self):
            Stream._next += 0x10
            self.cuda_stream = Stream._next

        def synchronize(self):
            pass

    class CUDAGraph:
        def __init__(self):
            self.ops = []

        def replay(self):
            rec("CUDAGraph.replay")
            for op in self.ops:
                op()

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        rec("torch.cuda.graph", capture_error_mode)
        if sw["capture_fails"]:
            raise RuntimeError("operation not permitted when stream is capturing")
        dev.capturing = g
        try:
            yield
        finally:
            dev.capturing = None

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            import time
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    cuda = types.SimpleNamespace(
        is_available=lambda: True, Stream=Stream, CUDAGraph=CUDAGraph, graph=graph, Event=Event,
        stream=lambda s: contextlib.nullcontext(), synchronize=lambda: None, empty_cache=lambda: None)
    torch = types.ModuleType("torch")
    torch.uint8, torch.empty, torch.from_numpy, torch.cuda, torch.Tensor = uint8, empty, from_numpy, cuda, Tensor
    return torch

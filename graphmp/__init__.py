"""graphmp: FP32 ONNX models made fast on Tensor Cores without losing accuracy.

    graphmp.convert("model.onnx", "model.mp.onnx")   # mixed precision, with a report
    graphmp.check("model.onnx", "model.mp.onnx")     # FP16-faithful accuracy check
    graphmp.pad("model.onnx", "model.pad.onnx")      # channels and GEMM dims to multiples of 8
    graphmp.inspect("model.mp.onnx")                 # FLOPs by precision, Casts, FP32 nodes (any model)
    graphmp.bench("model.onnx").table()              # FP32 vs TF32 vs mixed FP16: speed and accuracy
    graphmp.session("model.mp.onnx")                 # ONNX Runtime session with the options that suit it
    graphmp.build_step("model.onnx", "run", loss="cross-entropy")   # one loss-scaled training step graph
    graphmp.train("run", "train.npz", epochs=2)      # run it on ONNX Runtime (graphmp.train is also the package)
    graphmp.export("run", "trained.onnx")            # the trained inference model

docs/api.md describes each. The public names are imported on first use (PEP 562), so
`import graphmp` and `graphmp --help` start without loading onnx, ONNX Runtime or the
benchmark code.
"""
from __future__ import annotations

import importlib
import sys
import types

from .version import __version__
from .errors import GraphmpError

_LAZY = {
    "convert": ".convert", "ConvertReport": ".convert",
    "check": ".check", "CheckReport": ".check",
    "bench": ".bench", "BenchResult": ".bench",      # TensorRT/torch are imported only when used
    "build_engine": ".trt", "BuildResult": ".trt",
    "session": ".session",
    "pad": ".pad", "PadReport": ".pad",
    "inspect": ".inspect", "InspectReport": ".inspect",
    "build_step": ".train.step", "export": ".train.loop",
    "train": None,          # the subpackage graphmp.train, callable as graphmp.train.loop.train
}

__all__ = ["convert", "check", "pad", "inspect", "bench", "build_engine", "session", "build_step", "train", "export",
           "ConvertReport", "CheckReport", "PadReport", "InspectReport", "BenchResult", "BuildResult", "GraphmpError",
           "__version__"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'graphmp' has no attribute '{name}'")
    mod = _LAZY[name]
    value = importlib.import_module(f".{name}", __name__) if mod is None else getattr(
        importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """Importing the submodule graphmp.check (or .convert, .pad, .inspect, ...) binds it to the
    package attribute of the same name; the public API there is the function, so keep that."""

    def __setattr__(self, name, value):
        if name in ("convert", "check", "bench", "session", "pad", "inspect") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

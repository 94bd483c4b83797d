"""graphmp: FP32 ONNX models made fast on Tensor Cores without losing accuracy.

    graphmp.convert("model.onnx", "model.mp.onnx")   # mixed precision, with a report
    graphmp.check("model.onnx", "model.mp.onnx")     # FP16-faithful accuracy check
    graphmp.bench("model.onnx").table()              # FP32 vs TF32 vs mixed FP16: speed and accuracy
    graphmp.session("model.mp.onnx")                  # ONNX Runtime session with the options that suit it

The public names are imported on first use (PEP 562), so `import graphmp` and
`graphmp --help` start without loading onnx, ONNX Runtime or the benchmark code.
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
}

__all__ = ["convert", "check", "bench", "build_engine", "session", "ConvertReport", "CheckReport", "BenchResult",
           "BuildResult", "GraphmpError", "__version__"]


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'graphmp' has no attribute '{name}'")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """Importing the submodule graphmp.check (or .convert, .bench) binds it to the package
    attribute of the same name; the public API there is the function, so keep that."""

    def __setattr__(self, name, value):
        if name in ("convert", "check", "bench", "session") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

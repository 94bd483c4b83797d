"""graphmp: FP32 ONNX models made fast on Tensor Cores without losing accuracy.

    graphmp.convert("model.onnx", "model.mp.onnx")   # mixed precision, with a report
    graphmp.check("model.onnx", "model.mp.onnx")     # FP16-faithful accuracy check
    graphmp.bench("model.onnx").table()              # FP32 vs TF32 vs mixed FP16: speed and accuracy

bench and build_engine are imported on first use (PEP 562), so `import graphmp` and the
CLI start without loading the benchmark and TensorRT code. convert and check are bound
eagerly: their submodules share their names, and importing a submodule would otherwise
rebind `graphmp.check` to the module.
"""
from __future__ import annotations

import importlib

from .version import __version__
from .errors import GraphmpError
from .convert import ConvertReport, convert
from .check import CheckReport, check

_LAZY = {
    "bench": ".bench", "BenchResult": ".bench",      # TensorRT/torch are imported only when used
    "build_engine": ".trt", "BuildResult": ".trt",
}

__all__ = ["convert", "check", "bench", "build_engine", "ConvertReport", "CheckReport", "BenchResult", "BuildResult",
           "GraphmpError", "__version__"]


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'graphmp' has no attribute '{name}'")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

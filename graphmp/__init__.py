"""graphmp: FP32 ONNX models made fast on Tensor Cores without losing accuracy.

    graphmp.convert("model.onnx", "model.mp.onnx")   # mixed precision, with a report
    graphmp.check("model.onnx", "model.mp.onnx")     # FP16-faithful accuracy check
    graphmp.bench("model.onnx").table()              # FP32 vs TF32 vs mixed FP16: speed and accuracy
"""
from .version import __version__  # noqa: E402

from .errors import GraphmpError  # noqa: E402
from .convert import ConvertReport, convert  # noqa: E402
from .check import CheckReport, check  # noqa: E402
from .bench import BenchResult, bench  # noqa: E402  (TensorRT/torch are imported only when used)
from .trt import BuildResult, build_engine  # noqa: E402

__all__ = ["convert", "check", "bench", "build_engine", "ConvertReport", "CheckReport", "BenchResult", "BuildResult",
           "GraphmpError", "__version__"]

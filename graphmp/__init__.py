"""graphmp: FP32 ONNX models made fast on Tensor Cores without losing accuracy.

    graphmp.convert("model.onnx", "model.mp.onnx")   # mixed precision, with a report
    graphmp.check("model.onnx", "model.mp.onnx")     # FP16-faithful accuracy check
"""
__version__ = "0.1.0"

from .errors import GraphmpError  # noqa: E402
from .convert import ConvertReport, convert  # noqa: E402
from .check import CheckReport, check  # noqa: E402

__all__ = ["convert", "check", "ConvertReport", "CheckReport", "GraphmpError", "__version__"]

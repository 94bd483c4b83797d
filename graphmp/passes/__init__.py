"""The conversion passes. Each module has `run(ctx) -> PassResult`; its docstring says
what the pass needs from the context and what it guarantees afterwards. The pipeline
(their order) is written out once, in graphmp/convert.py.

The shape follows onnx_ir's passes: a pass does one job and returns a result that says
whether it changed the model and what it found (that part goes into the report).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PassResult:
    changed: bool
    details: dict = field(default_factory=dict)

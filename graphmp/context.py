"""State shared by the passes of one conversion."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from onnx import TensorProto

from .ir import Graph, Names
from .ops import LOW_TYPES


@dataclass
class Options:
    target: str = "fp16"
    keep_io_types: bool = True
    fp32_ops: tuple = ()
    fp32_nodes: str | None = None
    fp16_nodes: str | None = None
    calibration: object = None          # None/"auto", "off", path(s) or list of feed dicts
    range_threshold: float = 512.0
    external_data: bool | None = None
    verbose: bool = False

    @property
    def low(self) -> int:
        return LOW_TYPES[self.target]


@dataclass
class NodeInfo:
    """What a node could do in low precision (from its schema and tensor types)."""
    cls: str                    # fp16 / fp32 / follow / clear / fixed / unknown / none
    low_inputs: tuple = ()      # input positions that become low precision when lowered
    low_outputs: tuple = ()
    reason: str | None = None   # why it must stay FP32 (None: free to be lowered)


@dataclass
class Ctx:
    model: object
    options: Options
    path: str = "<model>"
    base_dir: str | None = None
    root: Graph | None = None
    names: Names | None = None
    types: dict = field(default_factory=dict)      # graph key -> {tensor: elem_type}
    ranges: dict = field(default_factory=dict)     # tensor -> max |x| over calibration (main graph)
    info: dict = field(default_factory=dict)       # id(node) -> NodeInfo
    lowered: set = field(default_factory=set)      # id(node) of nodes running in low precision
    report: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    @property
    def low(self) -> int:
        return self.options.low

    def type_of(self, graph: Graph, name: str):
        g = graph
        while g is not None:
            t = self.types.get(g.key, {}).get(name)
            if t is not None:
                return t
            if name in g._defined():
                return None
            g = g.parent
        return None

    def warn(self, msg: str):
        self.warnings.append(msg)
        self.log(f"warning: {msg}")

    def log(self, msg: str):
        if self.options.verbose:
            print(f"[graphmp {time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def nodes(self):
        for g in self.root.walk():
            for n in g.nodes:
                yield g, n


FLOAT = TensorProto.FLOAT


def display_path(path) -> str:
    return os.fspath(path) if path is not None else "<model>"

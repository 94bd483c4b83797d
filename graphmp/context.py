"""State shared by the passes of one conversion."""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field

from onnx import TensorProto

from .errors import GraphmpError
from .ir import Graph, Names
from .policy import LOW_TYPES, NORM_IO, PAD_MULTIPLES
from .progress import PROGRESS_DELAY_S, Progress, shows_progress


@dataclass
class Options:
    """Everything `graphmp.convert` can be asked (the CLI flags of `graphmp convert`)."""
    target: str = "fp16"
    keep_io_types: bool = True
    cache_io: str | None = None         # --cache-io: a KV cache's inputs/outputs in fp32 or the target type
                                        # (None: as keep_io_types says; passes/kv_cache.py)
    fp32_ops: tuple = ()
    fp32_nodes: str | None = None
    fp16_nodes: str | None = None
    calibration: object = None          # None/"auto", "off", path(s) or list of feed dicts
    shapes: object = None               # --shapes for generated calibration/validation inputs
    range_threshold: float | None = None  # None: auto (classify.RANGE_NEAR_NORM / RANGE_HEADROOM)
    norm_io: str = "softmax"            # --norm-io: which FP32-class ops between FP16 work read/write FP16 (policy.NORM_IO)
    external_data: bool | None = None
    pad_channels: int | None = None
    max_error: object = None            # --max-error: a number, "tf32" or "floor[:K]"
    metric: str = "max-rel"             # --metric: max-rel, max-abs or argmax
    strict: bool = False                # --strict: a budget not met is a failure
    plan: object = None                 # --plan: a saved plan (path; convert() loads and checks it), no search
    save_plan: str | None = None        # --save-plan: write the precisions decided as a plan file
    search_time: float | None = None    # --search-time: seconds for the search and the island trials
                                        # (a limit in seconds: the plan then depends on the machine)
    validate: bool = False
    atol: float | None = None           # --validate: an element-wise criterion on top of the budget
    rtol: float | None = None
    verbose: bool | int = False         # True/1: the steps and their timings on stderr; 2: also per-node decisions
    island_trials: int | None = None    # --island-trials: FP32 islands / FP16 segments measured for their Casts
                                        # (0: off; None: passes/islands.py's size rule)
    fuse: str | None = None             # --fuse ort: ONNX Runtime's transformer fusions first (passes/fuse.py)
    model_type: str | None = None       # --model-type: the fusions' model type (None: found from the graph)
    load_check: bool = True             # open and run the written output in ONNX Runtime first (graphmp/load_check.py)

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "Options":
        """Options from keyword arguments, each checked: a bad value is a GraphmpError
        that names the flag and what it accepts."""
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"convert() got unknown option(s) {unknown}; options: {sorted(names)}")
        o = cls(**kwargs)
        o.fp32_ops = tuple(o.fp32_ops or ())
        if o.target not in LOW_TYPES:
            raise GraphmpError(f"--target must be one of {', '.join(sorted(LOW_TYPES))}, not '{o.target}'")
        if o.cache_io is not None and o.cache_io not in ("fp32", o.target):
            raise GraphmpError(f"--cache-io must be fp32 or the target type ({o.target}: the cache is stored in "
                               f"the conversion's low type), not '{o.cache_io}'")
        if o.range_threshold is not None and not (isinstance(o.range_threshold, (int, float))
                                                  and o.range_threshold > 0):
            raise GraphmpError(f"--range-threshold must be a positive number (the |x| above which a node "
                               f"stays FP32; default: 512 on the way into a subtraction or "
                               f"normalisation, 4094 elsewhere), not {o.range_threshold}")
        if o.norm_io not in NORM_IO:
            raise GraphmpError(f"--norm-io must be one of {', '.join(NORM_IO)} (softmax: Softmax and LogSoftmax between "
                               f"FP16 work read and write FP16; all: LayerNormalization too; fp32: none), "
                               f"not '{o.norm_io}'")
        for flag, v in (("--atol", o.atol), ("--rtol", o.rtol)):
            if v is not None and not (isinstance(v, (int, float)) and v >= 0):
                raise GraphmpError(f"{flag} must be a number >= 0, not {v}")
        if o.pad_channels is not None:
            if o.pad_channels not in PAD_MULTIPLES:
                raise GraphmpError(f"--pad-channels must be one of {', '.join(map(str, PAD_MULTIPLES))} "
                                   f"(8 for FP16 Tensor Cores, 64 for A100/H100 tiles), not {o.pad_channels}")
        for flag, rx in (("--fp32-nodes", o.fp32_nodes), ("--fp16-nodes", o.fp16_nodes)):
            if rx:
                try:
                    re.compile(rx)
                except re.error as e:
                    raise GraphmpError(f"{flag} '{rx}' is not a valid regular expression ({e})") from None
        if o.fuse is not None or o.model_type is not None:
            from .policy import check_fuse_options
            check_fuse_options(o.fuse, o.model_type)
        if o.shapes is not None:
            from .inputs import parse_shapes
            o.shapes = parse_shapes(o.shapes)
        if o.island_trials is not None and not (isinstance(o.island_trials, int)
                                                and not isinstance(o.island_trials, bool) and o.island_trials >= 0):
            raise GraphmpError(f"--island-trials must be a whole number >= 0 (0: no FP32 island is measured for its "
                               f"Casts), not {o.island_trials}")
        if o.island_trials and o.plan is not None:
            raise GraphmpError("--island-trials has nothing to measure with --plan: the plan file decides every "
                               "node's precision; leave one of them out")
        if o.search_time is not None and not (isinstance(o.search_time, (int, float)) and o.search_time > 0):
            raise GraphmpError(f"--search-time must be a number of seconds > 0, not {o.search_time}")
        if o.max_error is not None:
            from .budget import METRICS, parse
            parse(o.max_error)
            if o.metric not in METRICS:
                raise GraphmpError(f"--metric must be one of {', '.join(METRICS)}, not '{o.metric}'")
            if o.calibration == "off":
                raise GraphmpError("--max-error measures the error on calibration batches: it cannot run with "
                                   "--no-calibration (pass --calibration DATA, or nothing for generated inputs)")
        return o

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
    high_inputs: tuple = ()     # positions an FP16/BF16 source node computes in FP32 (--fp32-nodes)
    high_outputs: tuple = ()


@dataclass
class Ctx:
    model: object
    options: Options
    path: str = "<model>"
    base_dir: str | None = None
    root: Graph | None = None
    names: Names | None = None
    types: dict = field(default_factory=dict)      # graph key -> {tensor: elem_type}
    opsets: dict = field(default_factory=dict)     # domain -> opset version of the model (types pass)
    ranges: dict = field(default_factory=dict)     # (graph key, tensor) -> max |x| over calibration
    shapes: dict = field(default_factory=dict)     # main-graph float tensor -> dims in calibration (the largest)
    batches: list = field(default_factory=list)    # calibration feeds that ran (for the search)
    batch_outputs: list = field(default_factory=list)  # the model's outputs on the first batches (calibrate)
    range_candidates: dict = field(default_factory=dict)  # Node -> range reason the search may overrule
    wide_range: set = field(default_factory=set)   # those of them past classify.GIVE_BACK_RANGE: start FP32
    search_refs: list = field(default_factory=list)  # FP32 outputs on those batches (search, verify)
    search_budget: object = None                    # graphmp.budget.Budget of --max-error (search, verify)
    plan: object = None                             # node keys, budget, references (passes/plan_file.py)
    info: dict = field(default_factory=dict)       # Node -> NodeInfo (graphmp.ir.Node hashes by identity)
    weight_rounding: dict = field(default_factory=dict)  # (graph key, weight) -> FP16 rounding facts or None (classify)
    lowered: set = field(default_factory=set)      # the Nodes running in low precision
    low_io: dict | None = None                     # {"inputs", "outputs"}: main-graph float I/O declared in
                                                   # the low type (passes/kv_cache.py)
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
        """A warning for the report; the summary prints it (once), -v also as it happens."""
        self.warnings.append(msg)
        self.log(f"warning: {msg}")

    def log(self, msg: str):
        """A step of the conversion, on stderr with verbose (-v)."""
        if self.options.verbose:
            self._print(msg)

    def detail(self, msg: str):
        """A per-node decision, on stderr with verbose=2 (-vv)."""
        if self.options.verbose and self.options.verbose >= 2:
            self._print(msg)

    def shows_progress(self) -> bool:
        """Whether long phases draw progress lines: with verbose, or as the command's level says."""
        return bool(self.options.verbose) or shows_progress()

    def progress(self, desc: str, total: int | None = None) -> Progress:
        """A progress line for a phase that may take seconds: drawn only after PROGRESS_DELAY_S,
        and only where progress lines are shown (use it as a context manager)."""
        return Progress(total=total, desc=desc, enabled=self.shows_progress(), delay=PROGRESS_DELAY_S)

    def say_progress(self, msg: str):
        """A progress line of its own (the search's every few seconds), where progress is shown."""
        if self.shows_progress():
            self._print(msg)

    def _print(self, msg: str):
        # names from the model (nodes, tensors) may hold newlines or terminal escapes: escaped
        msg = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in msg)
        print(f"[graphmp {time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def nodes(self):
        for g in self.root.walk():
            for n in g.nodes:
                yield g, n


FLOAT = TensorProto.FLOAT

"""Model inputs: what the graph declares, the shapes graphmp runs it with, and the
values it feeds when the user gives no data. One mechanism for every command that
runs a model (convert's calibration, check, pad --validate, bench, train-graph); build only parses --shapes.

    specs = input_specs(model)                          # names, dtypes, dims
    given = parse_shapes("x:1x3x640x640,mask:1x640")    # --shapes (trtexec syntax)
    plan = find_shapes(model, run, given)               # trial runs where dims are dynamic
    feeds = plan.feeds(seed=0)                          # deterministic generated inputs
    check_feeds(specs, arrays, "data.npz")              # user data: names, dtypes, ranks, dims

How a dynamic dim gets its size:
  1. --shapes gives it (a named dim given for one input holds for every input that
     names it);
  2. otherwise a trial run (the caller's `run`, normally ONNX Runtime on the FP32 model)
     over plausible sizes for the dim's role (image sizes from the model's metadata first,
     such as an Ultralytics export's imgsz), read from its name (batch, height/width,
     sequence/time, past) or its place: axis 0 is the batch; the spatial axes of an
     NCHW/NHWC image; the middle axis of an RNN state [layers, batch, hidden] is the
     batch; other axes are token counts (integer inputs) or lengths (float inputs).
     The first assignment that runs wins. Then batch 2 is tried, so calibration can
     see two batch sizes where the model allows it (a fixed-batch state pins it).
  If nothing runs, a one-line error says what was tried and names --shapes.
Values: floats N(0,1), but uniform over pixel coordinates or timesteps, or position ids
0, 1, 2, ..., for an input that reaches a Sin/Cos and is named so (graphmp.input_roles);
masks (names with 'mask') all ones but the last quarter of the last row (padding); other
integers 0/1, or uniform over the rows
of the constant table they index (token ids into an embedding); booleans random;
an integer scalar that the graph compares with a constant (Equal(sr, 16000) choosing an
If branch) gets that constant, so the real branch runs; integer lengths (names like
'lens', 'lengths', 'seq_len') hold the full length of the other inputs.
"""
from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto

from .errors import GraphmpError, first_line
from .input_roles import INT_ELEMS, LENGTHS, padded_mask, positions, structural_hints
from .names import shown
from .model_io import load_npz
from .policy import FLOAT_TYPES


# Sizes tried per role, most plausible first (the first one is used when it runs).
CANDIDATES = {
    "batch": [1],
    "spatial": [224, 256, 320, 384, 448, 512, 640, 160, 128, 96, 64, 32],
    "tokens": [16, 32, 64, 128, 8, 1],
    "length": [512, 1024, 16000, 4096, 256, 128, 64, 16, 1],
    "past": [0, 1, 16],
    "other": [1, 16, 32, 64, 8, 4, 3, 2],
}
MAX_TRIALS = 40
TRIAL_SECONDS = 120.0

_ROLE_BY_NAME = [
    ("past", re.compile(r"past", re.I)),
    ("batch", re.compile(r"batch|^(n|b|bs|num_?samples)$", re.I)),
    ("spatial", re.compile(r"height|width|^(h|w|img_?[hw]|image_?(height|width))$", re.I)),
    ("length", re.compile(r"seq|len|time|frame|sample|step|token|^(t|s|l)$", re.I)),
]


_PLACEHOLDER_NAMES = {"", "?", "-1", "None", "none", "dynamic", "unk"}


@dataclass
class Spec:
    """One real graph input: name, ONNX element type, dims (int, dim name, or None)."""
    name: str
    elem: int
    dims: list

    @property
    def dtype(self):
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.elem))

    def show(self) -> str:
        return "[" + ",".join("?" if d is None else str(d) for d in self.dims) + "]"


def input_specs(model: onnx.ModelProto) -> list[Spec]:
    """The graph inputs that are not initializers, with their declared dims
    (0 is a real, empty dim; a negative dim_value counts as dynamic)."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for v in model.graph.input:
        if v.name in inits:
            continue
        tt = v.type.tensor_type
        dims = []
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value >= 0:
                dims.append(int(d.dim_value))
            elif d.dim_param in _PLACEHOLDER_NAMES:
                dims.append(None)   # '?' on every axis is "unknown", not one shared size
            else:
                dims.append(d.dim_param or None)
        specs.append(Spec(v.name, tt.elem_type, dims))
    return specs


_SHAPE = re.compile(r"^\d+(x\d+)*$")


def parse_shapes(spec) -> dict:
    """'input:1x3x224x224,mask:1x128' (trtexec syntax) -> {'input': (1, 3, 224, 224), ...}.
    Also takes a dict {name: shape} or a list of 'name:shape' strings. A scalar is 'name:'."""
    if spec is None:
        return {}
    if isinstance(spec, dict):
        return {str(k): tuple(int(d) for d in v) for k, v in spec.items()}
    items = spec.split(",") if isinstance(spec, str) else [p for s in spec for p in str(s).split(",")]
    if not any(i.strip() for i in items):  # --shapes '' or ',': a mistake, not "no shapes"
        raise GraphmpError("--shapes: no NAME:DIMS given; leave --shapes out, or give e.g. "
                           "input_ids:8x128,attention_mask:8x128")
    out = {}
    for item in (i.strip() for i in items):
        if not item:
            continue
        name, sep, dims = item.rpartition(":")
        if not sep or not name or (dims and not _SHAPE.match(dims)):
            raise GraphmpError(f"--shapes: '{item}' is not NAME:DIMS with DIMS like 1x3x224x224 "
                               "(several inputs separated by commas: input_ids:8x128,attention_mask:8x128)")
        out[name] = tuple(int(d) for d in dims.split("x")) if dims else ()
    return out


def dims_text(shape) -> str:
    return "x".join(map(str, shape)) or "(scalar)"


def check_shapes(specs: list[Spec], given: dict, where: str) -> None:
    """--shapes must name real inputs, with their rank and their fixed dims."""
    by_name = {s.name: s for s in specs}
    unknown = sorted(set(given) - set(by_name))
    if unknown:
        raise GraphmpError(f"{where}: --shapes names {', '.join(unknown)}, which is not an input of the model; "
                           f"its inputs are {', '.join(s.name + s.show() for s in specs)}")
    for name, shape in given.items():
        s = by_name[name]
        if len(shape) != len(s.dims) or any(isinstance(d, int) and d != v for d, v in zip(s.dims, shape)):
            raise GraphmpError(f"{where}: --shapes {name}:{dims_text(shape)} does not fit input '{name}' "
                               f"{s.show()} (same rank, and fixed dims as declared)")


def check_feeds(specs: list[Spec], arrays: dict, source: str) -> None:
    """User data must hold one array per model input with the input's dtype, rank and
    fixed dims. A one-line GraphmpError names the file, the array and the fix."""
    names = {s.name for s in specs}
    missing = [s.name for s in specs if s.name not in arrays]
    if missing:
        extra = sorted(set(arrays) - names)
        raise GraphmpError(f"{source}: no array for model input(s) {', '.join(missing)}"
                           + (f" (the file has {', '.join(extra)})" if extra else "")
                           + "; save one array per input, named after it: numpy.savez(path, "
                           + ", ".join(f"{m}=..." for m in missing) + ")")
    for s in specs:
        a = np.asarray(arrays[s.name])
        if a.dtype != s.dtype:
            raise GraphmpError(f"{source}: array '{s.name}' is {a.dtype}, the model input is {s.dtype}; "
                               f"save it as {s.dtype} (array.astype(numpy.{s.dtype.name}))")
        if a.ndim != len(s.dims):
            raise GraphmpError(f"{source}: array '{s.name}' has shape {dims_text(a.shape)} (rank {a.ndim}), "
                               f"the model input is {s.show()} (rank {len(s.dims)})")
        for axis, (d, v) in enumerate(zip(s.dims, a.shape)):
            if isinstance(d, int) and d != v:
                raise GraphmpError(f"{source}: array '{s.name}' has shape {dims_text(a.shape)}, but axis {axis} "
                                   f"of input {s.show()} is fixed at {d}")
        if a.dtype.kind == "f" and np.isnan(a).any():
            raise GraphmpError(f"{source}: array '{s.name}' holds {int(np.isnan(a).sum())} NaN value(s) (first at "
                               f"index {np.unravel_index(int(np.argmax(np.isnan(a))), a.shape)}); ranges and errors "
                               "measured on NaN mean nothing: remove or replace them")


def _refuse_empty(specs: list[Spec], arrays: dict, source: str, what: str) -> None:
    """A batch of 0 samples (every input empty, or every ranked input 0 long on its first
    axis) is an error: nothing would be measured, and the ranges or errors would say
    nothing. One empty input among others (an empty KV cache) is fine."""
    shapes = [np.shape(arrays[s.name]) for s in specs]
    ranked = [d for d in shapes if d]
    if shapes and (all(math.prod(d) == 0 for d in shapes) or (ranked and all(d[0] == 0 for d in ranked))):
        held = ", ".join(f"{shown(s.name)}:{dims_text(d)}" for s, d in zip(specs, shapes))
        raise GraphmpError(f"{source}: holds 0 samples ({held}); {what} needs at least one sample per batch")


def user_batches(data, specs: list[Spec], what: str = "data") -> list[tuple[str, dict]]:
    """[(source, feeds)] from .npz path(s) or dicts of arrays (one or a list), each checked
    against the model's inputs (check_feeds); feeds hold exactly the model's inputs."""
    items = [data] if isinstance(data, (str, os.PathLike, dict)) else list(data)
    if not items:
        raise GraphmpError(f"{what}: no batches given")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, (str, os.PathLike)):
            source = os.fspath(item)
            arrays = load_npz(source, ".npz of model inputs", " Save one with numpy.savez(path, **{input_name: array}).")
        else:
            source, arrays = f"{what} batch {i}", dict(item)
        check_feeds(specs, arrays, source)
        _refuse_empty(specs, arrays, source, what)
        out.append((source, {s.name: arrays[s.name] for s in specs}))
    return out


# --------------------------------------------------------------------------- values
def value_hints(model: onnx.ModelProto) -> dict:
    """What the graph says about the values of its inputs (graphmp.input_roles.value_hints):
    {input: value} for mode selectors compared with a constant, {input: {"below": rows}} for
    indices into a table, and the coordinates/timesteps/positions that reach a Sin/Cos."""
    return structural_hints(model, input_specs(model))




MAX_GENERATED_ELEMENTS = 1 << 28  # 1 GiB of float32 per input: a declared 10^12-element input is refused


def generate(specs: list[Spec], shapes: dict, seed: int = 0, hints: dict | None = None) -> dict:
    """Deterministic inputs of the given shapes (see the module docstring for values).
    An input of more than MAX_GENERATED_ELEMENTS elements is a GraphmpError naming it,
    before anything is allocated."""
    for s in specs:
        count = math.prod(int(d) for d in shapes[s.name])
        if count > MAX_GENERATED_ELEMENTS:
            raise GraphmpError(f"input {shown(s.name)} of shape {dims_text(shapes[s.name])} would be {count} elements, "
                               f"more than graphmp generates ({MAX_GENERATED_ELEMENTS}); give smaller --shapes or "
                               "real data (--data / --calibration)")
    rng = np.random.default_rng(seed)
    hints = hints or {}
    full = max((d for s in specs if s.elem not in INT_ELEMS for d in shapes[s.name][1:]), default=1)
    feeds = {}
    for s in specs:
        shape = tuple(shapes[s.name])
        hint = hints.get(s.name)
        if isinstance(hint, dict) and "periodic" in hint:  # reaches a Sin/Cos, nothing known: as without hints
            hint = None
        if isinstance(hint, dict) and "below" in hint:  # indices into a table of that many rows
            feeds[s.name] = rng.integers(0, hint["below"], shape).astype(s.dtype)
        elif isinstance(hint, dict) and "span" in hint:  # coordinates/timesteps of a Sin/Cos encoding
            feeds[s.name] = rng.uniform(*hint["span"], shape).astype(s.dtype)
        elif isinstance(hint, dict) and "positions" in hint:  # position ids of a rotary/sinusoidal encoding
            feeds[s.name] = positions(shape, s.dtype)
        elif "mask" in s.name.lower() and s.elem not in (TensorProto.BFLOAT16, TensorProto.BOOL):  # padding
            feeds[s.name] = padded_mask(shape, s.dtype)
        elif hint is not None:
            feeds[s.name] = np.full(shape, hints[s.name], dtype=s.dtype)
        elif s.elem in INT_ELEMS and LENGTHS.search(s.name):
            feeds[s.name] = np.full(shape, full, dtype=s.dtype)
        elif s.elem in FLOAT_TYPES and s.elem != TensorProto.BFLOAT16:
            feeds[s.name] = rng.standard_normal(shape).astype(s.dtype)
        elif s.elem == TensorProto.BOOL:
            feeds[s.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[s.name] = rng.integers(0, 2, shape).astype(s.dtype)
    return feeds


# --------------------------------------------------------------------------- shapes
@dataclass
class _Var:
    """One dynamic size: a named dim (shared by every input that names it) or one
    unnamed dim of one input."""
    key: str
    role: str
    where: list = field(default_factory=list)   # (input name, axis)
    preferred: tuple = ()                       # sizes the model's metadata names for this role

    @property
    def candidates(self) -> list:
        c = list(dict.fromkeys(list(self.preferred) + CANDIDATES[self.role]))
        return c + [1] if 1 not in c else c


_SIZE_KEYS = ("imgsz", "img_size", "image_size", "input_size")


def metadata_sizes(model: onnx.ModelProto) -> dict:
    """{role: sizes} from metadata_props: image sides from keys such as 'imgsz'
    ('[640, 640]', '640' or '640,480')."""
    for p in model.metadata_props:
        if p.key.lower() in _SIZE_KEYS:
            sizes = [int(x) for x in re.findall(r"\d+", p.value) if 8 <= int(x) <= 8192]
            if sizes:
                return {"spatial": tuple(dict.fromkeys(sizes))}
    return {}


def _image_axes(s: Spec) -> list:
    """Spatial axes of an NCHW/NCDHW (channels fixed at axis 1) or NHWC image input."""
    r = len(s.dims)
    if r not in (4, 5):
        return []
    if isinstance(s.dims[1], int) and s.dims[1] <= 4:
        return list(range(2, r))
    if isinstance(s.dims[-1], int) and s.dims[-1] <= 4 and not isinstance(s.dims[1], int):
        return list(range(1, r - 1))
    return []


def _role(s: Spec, axis: int) -> str:
    name = s.dims[axis] if isinstance(s.dims[axis], str) else ""
    for role, rx in _ROLE_BY_NAME:
        if name and rx.search(name):
            if role == "batch" and axis > 0 and "batch" not in name.lower():
                continue  # 'N', 'B', 'bs' name the batch on axis 0 only: waveforms [B, N] has N samples
            return "tokens" if role == "length" and s.elem in INT_ELEMS else role
    rank = len(s.dims)
    if axis == 0 and rank >= 2:
        return "batch"
    if rank == 3 and axis == 1 and isinstance(s.dims[0], int) and isinstance(s.dims[2], int):
        return "batch"  # RNN state [layers * directions, batch, hidden]
    if axis in _image_axes(s):
        return "spatial"
    if s.elem in INT_ELEMS:
        return "tokens" if rank >= 2 or axis > 0 else "batch"
    if s.elem in FLOAT_TYPES:
        return "length"
    return "other"


def batch_positions(specs: list[Spec]) -> tuple:
    """(input, axis) of every dynamic dim whose role is the batch: what changes when a
    batch of another size is fed (an RNN state's batch axis too; fixed dims never)."""
    return tuple((s.name, axis) for s in specs for axis, d in enumerate(s.dims)
                 if not isinstance(d, int) and _role(s, axis) == "batch")


def rebatch(feeds: dict, positions, batch: int) -> dict:
    """`feeds` with every batch position (input, axis) repeated or cut to `batch`;
    other inputs (a fixed-batch state, a scalar mode) stay as they are."""
    out = dict(feeds)
    for name, axis in positions:
        x = out[name]
        out[name] = np.take(x, np.arange(batch) % x.shape[axis], axis=axis)
    return out


@dataclass
class InputPlan:
    """Concrete shapes for every input, how they were found, and value hints."""
    specs: list
    shapes: dict
    how: str
    hints: dict = field(default_factory=dict)
    batch_dims: tuple = ()               # (input, axis) that may take another batch size
    trials: int = 0

    @property
    def batch_free(self) -> bool:
        return bool(self.batch_dims)

    def shapes_for_batch(self, batch: int | None) -> dict:
        shapes = {n: list(s) for n, s in self.shapes.items()}
        if batch is not None:
            for name, axis in self.batch_dims:
                shapes[name][axis] = batch
        return {n: tuple(s) for n, s in shapes.items()}

    def feeds(self, seed: int = 0, batch: int | None = None) -> dict:
        return generate(self.specs, self.shapes_for_batch(batch), seed, self.hints)

    def describe(self, batch: int | None = None) -> str:
        return ", ".join(f"{n}:{dims_text(s)}" for n, s in self.shapes_for_batch(batch).items())


# One size at a time is tried for cheap roles first: a wrong length or state size is a
# more common cause of failure than an image size, and image trials cost the most.
_TRY_ORDER = ("other", "past", "length", "tokens", "batch", "spatial")


def find_shapes(model: onnx.ModelProto, run, given=None, *, where: str = "<model>",
                max_trials: int = MAX_TRIALS, seconds: float = TRIAL_SECONDS) -> InputPlan:
    """Shapes that run. `run(feeds)` must raise when the model cannot run on `feeds`
    (ONNX Runtime does); `given` are --shapes. Raises a GraphmpError naming --shapes
    when no tried assignment runs. Every successful call of `run` is on a sensible
    batch (seed 0 at the found shapes, then seed 1 at batch 2), so a caller that
    calibrates can keep what those runs computed."""
    specs = input_specs(model)
    given = parse_shapes(given)
    check_shapes(specs, given, where)
    hints = value_hints(model)
    layout = _Layout(specs, given, _fixed_dims(specs, given, where))
    vars_ = _free_dims(layout, metadata_sizes(model))
    if not vars_:
        return InputPlan(specs, layout.shapes_for({}), "given by --shapes" if given else "fixed by the model", hints)
    trials = _Trials(layout, run, hints, max_trials, seconds)
    base = {v.key: v.candidates[0] for v in vars_}
    found = _first_that_runs(trials, vars_, base)
    if found is None:
        raise _no_shapes_error(where, trials, base)
    dims = _batch_dims(trials, vars_, found)
    n = len(trials.tried)
    return InputPlan(specs, layout.shapes_for(found), f"found by {n} trial run{'s' if n > 1 else ''}", hints, dims, n)


def first_guess(model: onnx.ModelProto, given=None, *, where: str = "<model>") -> tuple[dict, list]:
    """Shapes without a run: ({input: shape}, [(dim key, role, size)]): every dim that the
    model and --shapes (`given`) leave free at the first size find_shapes would try for its
    role (a named dim takes one size for every input that names it). For figures that need
    plausible sizes, not sizes that are known to run (graphmp inspect)."""
    specs = input_specs(model)
    given = parse_shapes(given)
    check_shapes(specs, given, where)
    layout = _Layout(specs, given, _fixed_dims(specs, given, where))
    vars_ = _free_dims(layout, metadata_sizes(model))
    base = {v.key: v.candidates[0] for v in vars_}
    return layout.shapes_for(base), [(v.key, v.role, base[v.key]) for v in vars_]


def _fixed_dims(specs: list[Spec], given: dict, where: str) -> dict:
    """{named dim: size} that --shapes (`given`, parsed) fixes by giving an input that
    names it; a GraphmpError when --shapes gives one named dim two sizes."""
    fixed: dict = {}
    for s in specs:
        if s.name in given:
            for d, v in zip(s.dims, given[s.name]):
                if isinstance(d, str):
                    if fixed.setdefault(d, v) != v:
                        raise GraphmpError(f"{where}: --shapes gives dim '{d}' two sizes ({fixed[d]} and {v})")
    return fixed


@dataclass
class _Layout:
    """Where each input's dims come from: --shapes for a whole input (`given`), a named
    dim those fix (`fixed`), the model's own sizes, or an assignment of the free dims."""
    specs: list
    given: dict
    fixed: dict

    @staticmethod
    def key(s: Spec, axis: int, d) -> str:
        """The free dim's key: its name, or 'input[axis]' for an unnamed dim."""
        return d if isinstance(d, str) else f"{s.name}[{axis}]"

    def is_free(self, d) -> bool:
        return not (isinstance(d, int) or (isinstance(d, str) and d in self.fixed))

    def shapes_for(self, assign: dict) -> dict:
        """{input: shape} with the free dims at `assign` ({key: size})."""
        out = {}
        for s in self.specs:
            if s.name in self.given:
                out[s.name] = tuple(self.given[s.name])
                continue
            shape = []
            for axis, d in enumerate(s.dims):
                if isinstance(d, int):
                    shape.append(d)
                elif isinstance(d, str) and d in self.fixed:
                    shape.append(self.fixed[d])
                else:
                    shape.append(assign[self.key(s, axis, d)])
            out[s.name] = tuple(shape)
        return out


def _free_dims(layout: _Layout, preferred: dict) -> list[_Var]:
    """The dims no one fixed, one _Var per key (in the order the inputs name them),
    each with its role and the sizes the metadata prefers (`preferred`, metadata_sizes)."""
    variables: dict = {}
    for s in layout.specs:
        if s.name in layout.given:
            continue
        for axis, d in enumerate(s.dims):
            if not layout.is_free(d):
                continue
            key = layout.key(s, axis, d)
            role = _role(s, axis)
            var = variables.setdefault(key, _Var(key, role, preferred=preferred.get(role, ())))
            var.where.append((s.name, axis))
    return list(variables.values())


class _Trials:
    """The trial runs of one find_shapes: `run` on generated inputs of an assignment's
    shapes, each assignment at most once, within max_trials runs and `seconds`."""

    def __init__(self, layout: _Layout, run, hints: dict, max_trials: int, seconds: float):
        self.layout, self.run, self.hints = layout, run, hints
        self.max_trials, self.seconds = max_trials, seconds
        self.tried: list = []
        self.errors: list = []       # the first line of each failed run's error
        self.t0 = time.perf_counter()

    def attempt(self, assign: dict, seed: int = 0) -> bool:
        """Whether the model runs at `assign` (False, without a run, when tried before)."""
        key = tuple(sorted(assign.items()))
        if key in self.tried:
            return False
        self.tried.append(key)
        try:
            self.run(generate(self.layout.specs, self.layout.shapes_for(assign), seed, self.hints))
            return True
        except Exception as e:  # noqa: BLE001 - any failure of a trial means "not these shapes"
            self.errors.append(first_line(e))
            return False

    def out_of_budget(self) -> bool:
        return len(self.tried) >= self.max_trials or time.perf_counter() - self.t0 > self.seconds


def _first_that_runs(trials: _Trials, vars_: list[_Var], base: dict) -> dict | None:
    """The first assignment that runs, or None: `base` (every dim at its first
    choice), then one size at a time, then all sizes moving together."""
    if trials.attempt(base):
        return base
    found = _one_at_a_time(trials, vars_, base)
    return found if found is not None else _all_together(trials, vars_)


def _one_at_a_time(trials: _Trials, vars_: list[_Var], base: dict) -> dict | None:
    """Each dim through its candidates (cheap roles first, _TRY_ORDER), the others at
    their first choice; the first assignment that runs, or None."""
    for v in sorted(vars_, key=lambda v: _TRY_ORDER.index(v.role)):
        for c in v.candidates[1:]:
            if trials.out_of_budget():
                break
            cand = dict(base, **{v.key: c})
            if trials.attempt(cand):
                return cand
        if trials.out_of_budget():
            break
    return None


def _all_together(trials: _Trials, vars_: list[_Var]) -> dict | None:
    """Every dim at its k-th candidate (its last where it has fewer), k = 1, 2, ...;
    the first assignment that runs, or None."""
    for k in range(1, max(len(v.candidates) for v in vars_)):
        if trials.out_of_budget():
            break
        cand = {v.key: v.candidates[min(k, len(v.candidates) - 1)] for v in vars_}
        if trials.attempt(cand):
            return cand
    return None


def _no_shapes_error(where: str, trials: _Trials, base: dict) -> GraphmpError:
    """The one-line error when no tried assignment runs: how many were tried, the first
    shapes, ONNX Runtime's first message, and the --shapes to give."""
    specs = trials.layout.specs
    dyn = ", ".join(s.name + s.show() for s in specs if any(not isinstance(d, int) for d in s.dims))
    errors = trials.errors
    return GraphmpError(f"{where}: could not find input shapes that run ({len(trials.tried)} tried, e.g. "
                        f"{trials.layout.shapes_for(base)}; ONNX Runtime said: {errors[0] if errors else '?'}). "
                        f"Give them with --shapes NAME:DIMS,... for {dyn}, or pass real data (--calibration/--data)")


def _batch_dims(trials: _Trials, vars_: list[_Var], found: dict) -> tuple:
    """(input, axis) of the batch dims when the model also runs at batch 2 (one more
    trial, seed 1, from the `found` assignment); () when it has none or does not."""
    batch_vars = [v for v in vars_ if v.role == "batch"]
    batch_free = bool(batch_vars) and trials.attempt(dict(found, **{v.key: 2 for v in batch_vars}), seed=1)
    return tuple(w for v in batch_vars for w in v.where) if batch_free else ()

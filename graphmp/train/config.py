"""StepConfig / TrainConfig: the options of build_step() and train(), checked once, at the boundary.

    StepConfig.from_kwargs(lr=0.1, optimizer="sgd")   # the options of the training-step graph builder
    TrainConfig.from_kwargs(epochs=3, batch_size=64)  # the options of the training driver

Each from_kwargs, in the style of graphmp.context.Options.from_kwargs: an unknown key is a
TypeError naming it (and listing the options); a value of the wrong type or out of range is a
GraphmpError that names the option and says what to pass. The dataclasses are frozen: the
value from_kwargs returns is the checked, normalized one (floats as floats, tuples for lists).
build_step / train take one of them, or the same keywords (they build it with from_kwargs).
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field, fields

import numpy as np

from ..errors import GraphmpError

PRECISIONS = ("mixed", "fp32", "bf16")
# train.json "config": its keys, in the order train.json has always listed them (num_classes
# is no option: the loss phase fills it in; build_step adds recurrent / pinned_shapes /
# measured_shapes when they apply)
STEP_JSON_KEYS = ("loss", "label_shape", "label_name", "optimizer", "lr", "momentum", "betas", "eps",
                  "weight_decay", "clip_norm", "loss_scale", "init_scale", "growth_interval", "backoff", "growth",
                  "min_scale", "max_scale", "precision", "output", "trainable", "expose_grads", "bn_momentum",
                  "class_axis", "ignore_index", "label_smoothing", "class_weights", "num_classes", "lr_schedule",
                  "warmup_steps", "total_steps", "grad_accum")


def _refuse_unknown(cls, kw: dict, caller: str) -> None:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(kw) - names)
    if unknown:
        raise TypeError(f"{caller} got unknown option(s) {unknown}; options: {sorted(names)}")


def _complainer(where: str | None):
    """bad(msg) raising GraphmpError("<where>: msg") (just msg without where)."""
    def bad(msg):
        raise GraphmpError(f"{where}: {msg}" if where else msg)
    return bad


def _number(bad, name: str, v, conv=float, none_ok: bool = False):
    """conv(v) (float or int, as build_step always converted them); a value that is no number
    is a GraphmpError naming the option."""
    if v is None and none_ok:
        return None
    try:
        return conv(v)
    except (TypeError, ValueError, OverflowError):
        what = "an integer" if conv is int else "a number"
        bad(f"{name} must be {what}{' or None' if none_ok else ''} (got {v!r})")


def _text(bad, name: str, v, none_ok: bool = True, what: str = "a string"):
    if v is None and none_ok:
        return None
    if not isinstance(v, str):
        bad(f"{name} must be {what}{' or None' if none_ok else ''} (got {v!r})")
    return v


@dataclass(frozen=True)
class StepConfig:
    """Everything build_step() can be asked (the flags of `graphmp train-graph`); see
    build_step's docstring for what each does. Build it with from_kwargs (checked)."""
    loss: str = "cross-entropy"
    label_shape: tuple | None = None        # e.g. ("N",); None: the output's shape (less the class axis: cross-entropy)
    label_name: str = "labels"
    optimizer: str = "adamw"
    lr: float = 1e-3
    momentum: float = 0.9
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float | None = None
    loss_scale: object = "dynamic"          # "dynamic" or a positive number (a float once checked)
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    backoff: float = 0.5
    growth: float = 2.0
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    precision: str = "mixed"
    output: str | None = None               # the tensor fed to the loss (None: the first graph output)
    trainable: str | None = None            # regex over initializer names
    expose_grads: bool = False
    bn_momentum: float | None = None
    class_axis: int = 1
    ignore_index: int | None = None
    label_smoothing: float = 0.0
    class_weights: tuple | None = None      # a .npy path, "w1,w2,..." or a sequence (a tuple once checked)
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    grad_accum: int = 1
    calibration: object = field(default=None, compare=False)  # as for graphmp.convert (None: a generated batch)
    shapes: object = None                   # --shapes string or {input: dims}
    force: bool = False                     # replace the run in a non-empty out_dir

    @classmethod
    def from_kwargs(cls, where: str | None = None, /, **kw) -> "StepConfig":
        """A StepConfig from keyword arguments, each converted and checked: an unknown key is a
        TypeError; a bad value a GraphmpError naming the option and what it accepts, starting
        with `where` (build_step passes the model path) when given."""
        if where is not None and not isinstance(where, str):
            raise TypeError(f"StepConfig.from_kwargs: the positional argument is the model path for messages, not "
                            f"{type(where).__name__}; pass the options as keywords (from_kwargs(**options))")
        _refuse_unknown(cls, kw, "build_step()")
        bad = _complainer(where)
        v = {f.name: kw.get(f.name, f.default) for f in fields(cls)}
        _convert_step_values(v, bad)
        _check_step_values(v, bad)
        return cls(**v)

    def as_kwargs(self) -> dict:
        """The options as keywords: StepConfig.from_kwargs(**c.as_kwargs()) == c."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json_dict(self) -> dict:
        """A fresh train.json "config" dict (lists, not tuples; num_classes None until the loss
        phase sets it); the build phases add to it."""
        d = {k: getattr(self, k, None) for k in STEP_JSON_KEYS}
        for k in ("label_shape", "betas", "class_weights"):
            d[k] = None if d[k] is None else list(d[k])
        return d


def _convert_step_values(v: dict, bad) -> None:
    """Numbers to float/int and sequences to tuples, in place (the order build_step always
    converted them in, so the first bad value is the one named)."""
    from .losses import parse_class_weights
    if v["label_shape"] is not None:
        if isinstance(v["label_shape"], (str, bytes)) or not hasattr(v["label_shape"], "__iter__"):
            bad(f"label_shape must be a list of dims, ints or names (e.g. ['N'] or ['N', 10]), "
                f"not {v['label_shape']!r}")
        v["label_shape"] = tuple(v["label_shape"])
    for k in ("lr", "momentum", "eps", "weight_decay", "init_scale", "backoff", "growth", "min_scale", "max_scale",
              "label_smoothing"):
        v[k] = _number(bad, k, v[k])
    try:
        betas = tuple(float(x) for x in v["betas"])
    except (TypeError, ValueError):
        betas = ()
    if len(betas) != 2:
        bad(f"betas must be two numbers (b1, b2), e.g. (0.9, 0.999) (got {v['betas']!r})")
    v["betas"] = betas
    v["clip_norm"] = _number(bad, "clip_norm", v["clip_norm"], none_ok=True)
    for k in ("growth_interval", "class_axis", "warmup_steps", "grad_accum"):
        v[k] = _number(bad, k, v[k], int)
    for k in ("ignore_index", "total_steps"):
        v[k] = _number(bad, k, v[k], int, none_ok=True)
    w = parse_class_weights(v["class_weights"])
    v["class_weights"] = None if w is None else tuple(w)
    v["expose_grads"], v["force"] = bool(v["expose_grads"]), bool(v["force"])
    for k in ("output", "trainable"):
        v[k] = _text(bad, k, v[k])
    v["label_name"] = _text(bad, "label_name", v["label_name"], none_ok=False)
    if v["shapes"] is not None and not isinstance(v["shapes"], (str, dict)):
        bad(f"shapes must be a string such as 'x:1x3x224x224' or a dict {{input: dims}} (got {v['shapes']!r})")
    if isinstance(v["shapes"], str):  # a malformed string is the build's error whether or not a phase reads it
        from ..inputs import parse_shapes
        try:
            parse_shapes(v["shapes"])
        except GraphmpError as e:
            bad(str(e))


def _check_step_values(v: dict, bad) -> None:
    """The ranges and choices (and bf16's loss scale: 1, no scaling), as build_step always
    checked them; v's loss_scale becomes a float unless 'dynamic'."""
    from .losses import check_loss_config
    from .optim import OPTIMIZERS, SCHEDULES
    check_loss_config(v, bad)
    if v["optimizer"] not in OPTIMIZERS:
        bad(f"optimizer must be one of {OPTIMIZERS}, not '{v['optimizer']}'")
    if v["precision"] not in PRECISIONS:
        bad(f"precision must be one of {PRECISIONS}, not '{v['precision']}'")
    for k in ("lr", "momentum", "eps", "weight_decay", "init_scale", "backoff", "growth", "min_scale", "max_scale",
              "label_smoothing", "clip_norm"):  # inf passes every > test below (1e400 parses as inf)
        if v[k] is not None and not math.isfinite(v[k]):
            bad(f"{k} must be a finite number (got {v[k]})")
    if not v["lr"] > 0:
        bad(f"lr must be > 0 (got {v['lr']})")
    if not all(0 <= b < 1 for b in v["betas"]):
        bad(f"betas must each be in [0, 1), e.g. (0.9, 0.999) (got {v['betas']})")
    if v["ignore_index"] is not None and not -2 ** 63 <= v["ignore_index"] < 2 ** 63:
        bad(f"ignore_index must fit a 64-bit label (got {v['ignore_index']})")
    if v["lr_schedule"] not in SCHEDULES:
        bad(f"lr_schedule must be one of {SCHEDULES}, not '{v['lr_schedule']}'")
    if v["warmup_steps"] < 0:
        bad(f"warmup_steps must be >= 0 (got {v['warmup_steps']})")
    if v["lr_schedule"] != "constant":
        if v["total_steps"] is None:
            bad(f"lr_schedule '{v['lr_schedule']}' needs total_steps (--total-steps N: the optimizer steps "
                "of the whole run, where the lr reaches its end)")
        if v["total_steps"] <= v["warmup_steps"]:
            bad(f"total_steps ({v['total_steps']}) must be larger than warmup_steps ({v['warmup_steps']})")
    if v["grad_accum"] < 1:
        bad(f"grad_accum must be >= 1 (got {v['grad_accum']})")
    _check_loss_scale(v, bad)
    if v["clip_norm"] is not None and not v["clip_norm"] > 0:
        bad(f"clip_norm must be > 0 (got {v['clip_norm']})")
    if v["trainable"]:
        try:
            re.compile(v["trainable"])
        except re.error as e:
            bad(f"trainable '{v['trainable']}' is not a valid regular expression ({e})")


def _check_loss_scale(v: dict, bad) -> None:
    """loss_scale 'dynamic' or a positive number (1.0 for bf16: FP32's exponent range, no
    scaling), and the dynamic scale's settings."""
    if v["precision"] == "bf16":
        v["loss_scale"] = 1.0
    if v["loss_scale"] != "dynamic":
        try:
            s = float(v["loss_scale"])
        except (TypeError, ValueError):
            s = -1.0
        if not (s > 0 and np.isfinite(s)):
            bad(f"loss_scale must be 'dynamic' or a positive number (got {v['loss_scale']!r})")
        v["loss_scale"] = s
    if not 0 < v["min_scale"] <= v["init_scale"] <= v["max_scale"]:
        bad(f"need 0 < min_scale <= init_scale <= max_scale (got {v['min_scale']}, {v['init_scale']}, "
            f"{v['max_scale']})")
    if not (0 < v["backoff"] < 1 and v["growth"] > 1 and v["growth_interval"] >= 1):
        bad("need 0 < backoff < 1, growth > 1 and growth_interval >= 1")


# --- the training driver --------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainConfig:
    """Everything train() can be asked besides the run folder and the data (the flags of
    `graphmp train`); see train's docstring for what each does. Build it with from_kwargs."""
    epochs: int = 1
    batch_size: int = 32
    checkpoint_every: int = 100         # steps between checkpoints (0: only at the end)
    resume: bool = True                 # continue from run_dir/checkpoint.json when present
    providers: list | None = None       # ONNX Runtime providers (device= picks them instead)
    progress: bool = True
    seed: int = 0
    drop_last: bool = True
    max_steps: int | None = None        # stop after this many steps in total (resumed ones count)
    device_state: bool | None = None    # keep the state in bound OrtValues (None: yes, CPU and CUDA)
    threads: int | None = None          # ONNX Runtime intra-op threads (None or 0: its default)
    skip_bad_samples: bool = False
    device: str | None = None           # "auto" | "cpu" | "cuda" (instead of providers)
    cuda_graph: bool = False            # replay the step as captured CUDA graphs (CUDA, static shapes)

    @classmethod
    def from_kwargs(cls, **kw) -> "TrainConfig":
        """A TrainConfig from keyword arguments, each checked: an unknown key is a TypeError; a
        bad value a GraphmpError naming the option and what it accepts."""
        _refuse_unknown(cls, kw, "train()")
        v = {f.name: kw.get(f.name, f.default) for f in fields(cls)}
        for k in ("epochs", "batch_size", "checkpoint_every", "seed", "max_steps", "threads"):
            none_ok = k in ("max_steps", "threads")
            if not (isinstance(v[k], numbers.Integral) or (none_ok and v[k] is None)):
                raise GraphmpError(f"{k} must be an integer{' or None' if none_ok else ''} (got {v[k]!r})")
            v[k] = None if v[k] is None else int(v[k])
        for k in ("resume", "progress", "drop_last", "skip_bad_samples", "device_state", "cuda_graph"):
            if not (_is_bool(v[k]) or (k == "device_state" and v[k] is None)):
                raise GraphmpError(f"{k} must be True or False{' or None' if k == 'device_state' else ''} "
                                   f"(got {v[k]!r})")
            v[k] = None if v[k] is None else bool(v[k])
        _check_train_values(v)
        return cls(**v)

    def as_kwargs(self) -> dict:
        """The options as keywords: TrainConfig.from_kwargs(**c.as_kwargs()) == c."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _is_bool(x) -> bool:
    """True/False (numpy's too; 0 and 1 as well, as Python reads them)."""
    return isinstance(x, (bool, np.bool_)) or (isinstance(x, numbers.Integral) and x in (0, 1))


def _check_train_values(v: dict) -> None:
    """The ranges and choices of TrainConfig's values (v: already of the right types)."""
    from .device import DEVICES
    if not 0 <= v["seed"] < 2 ** 63:  # numpy's default_rng takes seeds >= 0
        raise GraphmpError(f"seed must be >= 0 and below 2^63 (got {v['seed']})")
    if v["batch_size"] < 1 or v["epochs"] < 0:
        raise GraphmpError(f"batch_size must be >= 1 and epochs >= 0 (got {v['batch_size']}, {v['epochs']})")
    for k, what in (("checkpoint_every", "0: only at the end"), ("max_steps", "None: no limit"),
                    ("threads", "0 or None: ONNX Runtime's default")):
        if v[k] is not None and v[k] < 0:
            raise GraphmpError(f"{k} must be >= 0 ({what}), not {v[k]}")
    if v["device"] is not None and v["device"] not in DEVICES:
        raise GraphmpError(f"device must be one of {list(DEVICES)}, not '{v['device']}'")
    p = v["providers"]
    if p is not None:
        if isinstance(p, (str, bytes)) or not isinstance(p, (list, tuple)):
            raise GraphmpError(f"providers must be a list of ONNX Runtime providers, e.g. ['CPUExecutionProvider'] "
                               f"(got {p!r})")
        v["providers"] = list(p)

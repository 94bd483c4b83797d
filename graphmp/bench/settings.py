"""What one bench run was asked: Settings, validated from the keyword arguments of bench()."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..errors import GraphmpError
from ..inputs import parse_shapes
from . import judge as J
from .models import ORT_OPT_TYPES
from .plan import BACKENDS, COMPARE, PRECISIONS
from .runners import TIMING, TIMING_TEXT

CUDNN_SEARCH = ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")


@dataclass
class Settings:
    """What one run was asked (validated by `from_kwargs`); written to the JSON's settings."""
    backends: list = field(default_factory=lambda: list(BACKENDS))
    precisions: list = field(default_factory=lambda: ["fp32", "tf32", "fp16"])
    batches: list = field(default_factory=lambda: [1])
    data: str | None = None
    shapes: dict | None = None
    seed: int = 0
    warmup: int = 10
    iterations: int = 50
    min_time: float = 1.0
    rounds: int = 5
    cudnn_conv_algo_search: str = "EXHAUSTIVE"
    timing_cache: str | None = None
    workspace_mb: int | None = None
    max_error: float = J.DEFAULT_MAX_ERROR
    tf32_factor: float = J.DEFAULT_TF32_FACTOR
    atol: float | None = None
    rtol: float | None = None
    oracle_max_mb: float = 50.0
    model_type: str | None = None

    @classmethod
    def from_kwargs(cls, backends, precisions, compare, batches, **kw) -> "Settings":
        s = cls(**kw)
        s.backends = csv_items(backends, "backend", BACKENDS)
        compare = csv_items(compare or [], "comparison (--compare)", COMPARE)
        s.precisions = csv_items(precisions, "precision", PRECISIONS) if precisions else ["fp32", "tf32", "fp16"]
        s.precisions += [p for p in compare if p not in s.precisions]
        s.batches = _batches(batches)
        s.shapes = parse_shapes(s.shapes) or None
        if s.cudnn_conv_algo_search not in CUDNN_SEARCH:
            raise GraphmpError(f"cudnn_conv_algo_search must be one of {', '.join(CUDNN_SEARCH)}")
        if s.warmup < 0 or s.iterations < 1 or s.min_time < 0 or s.rounds < 1:
            raise GraphmpError("need warmup >= 0, iterations >= 1, min_time >= 0 and rounds >= 1")
        if not (s.max_error > 0 and s.tf32_factor >= 1):
            raise GraphmpError(f"need --max-error > 0 and --tf32-factor >= 1 (got {s.max_error}, {s.tf32_factor})")
        if s.model_type is not None and s.model_type not in ORT_OPT_TYPES:
            raise GraphmpError(f"--model-type '{s.model_type}' is not one of {', '.join(ORT_OPT_TYPES)}")
        return s

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["min_time_s"] = d.pop("min_time")
        d["rule"] = J.rule_text(self.max_error, self.tf32_factor, self.atol, self.rtol)
        d["timing"], d["timing_text"] = TIMING, TIMING_TEXT
        return d


def csv_items(x, what, allowed=None):
    items = [s.strip() for s in x.split(",") if s.strip()] if isinstance(x, str) else list(x)
    bad = [s for s in items if allowed is not None and s not in allowed]
    if bad:
        raise GraphmpError(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return items


def _batches(x) -> list:
    try:
        items = [int(b) for b in csv_items(str(x) if isinstance(x, int) else x, "batch")]
    except (TypeError, ValueError):
        raise GraphmpError(f"batch sizes must be positive integers like 1,8,32, not {x!r}") from None
    if not items or any(b < 1 for b in items):
        raise GraphmpError(f"batch sizes must be positive integers like 1,8,32, not {x!r}")
    return sorted(set(items))

"""The first applied step of a run with a dynamic loss scale: back off within the step.

A dynamic loss scale starts high (65536 by default, as PyTorch's GradScaler) and is halved
on every overflow, one skipped step at a time. A model whose scaled gradients overflow
FP16 at that scale spends its first steps doing nothing but backing off (a small CNN at
batch 32: 12 skipped steps, 65536 -> 16), so a short run (`--epochs 1` on a small data
set, `--max-steps 10`) can end with no step applied at all.

So, until the run has applied its first step, a skipped step is run again on the same
batch: the step graph has already lowered the scale, and the same batch at the lowered
scale is the step the run would have taken had it started there. This stops as soon as a
step is applied, when the loss itself is not finite (the data or the forward pass, which
no scale fixes), or after as many tries as it takes the scale to reach its floor. Once a
step has been applied the loss scale is managed by the step graph alone (GradScaler's
schedule), so a long run's behaviour is unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class FirstStepSearch:
    """Whether this call may still retry skipped steps (no step applied in the run yet, a
    dynamic scale), how many tries the scale allows, and what the search did."""
    open: bool
    max_tries: int
    backoff: float = 0.5
    tries: int = 0
    from_scale: float | None = None
    to_scale: float | None = None

    @classmethod
    def for_run(cls, cfg: dict, dynamic: bool, applied_before: int) -> "FirstStepSearch":
        """cfg: train.json "config" (init_scale, min_scale, backoff); applied_before: optimizer
        steps the run applied before this call (a resumed run that has trained does not search)."""
        backoff = float(cfg.get("backoff", 0.5))
        init, floor = float(cfg.get("init_scale", 2.0**16)), float(cfg.get("min_scale", 1.0))
        if not dynamic or applied_before > 0 or not 0 < backoff < 1 or init <= floor:
            return cls(open=False, max_tries=0)
        # tries to go from init_scale to min_scale, x backoff per try (+1: the floor itself)
        return cls(open=True, max_tries=int(math.ceil(math.log(init / floor) / -math.log(backoff))) + 1,
                   backoff=backoff)

    def run(self, run_step):
        """run_step() -> (loss, applied, scale after): one optimizer step on one batch. Runs it,
        then again while the search is open and the step was skipped with a finite loss.
        Returns the last (loss, applied, scale); closes the search once a step is applied."""
        loss, applied, scale = run_step()
        while self.open and not applied and math.isfinite(loss) and self.tries < self.max_tries:
            if self.from_scale is None:  # the scale the skipped step ran at
                self.from_scale = scale / self.backoff
            self.tries += 1
            loss, applied, scale = run_step()
        if applied and self.open:
            self.open = False
            self.to_scale = scale if self.tries else None
        return loss, applied, scale

    def as_dict(self) -> dict | None:
        """summary.json's "first_step_backoff" (None: no retry)."""
        if not self.tries:
            return None
        return {"tries": self.tries, "from_scale": self.from_scale, "to_scale": self.to_scale}

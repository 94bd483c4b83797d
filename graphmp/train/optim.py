"""The update half of the training step: finiteness check, clipping, learning-rate schedule,
gradient accumulation, SGD / AdamW, dynamic loss scale (all as ONNX nodes).

Learning-rate schedule (config lr_schedule, warmup_steps, total_steps), computed in the
graph from the optimizer_step state t (optimizer steps applied so far: a resumed run goes on
with the schedule; skipped steps do not advance it), the factor of the base lr:
    t < warmup:  t / warmup                                  (linear warmup from 0)
    constant:    1
    linear:      max(0, (total - t) / max(1, total - warmup))
    cosine:      0.5 * (1 + cos(pi * min(1, (t - warmup) / max(1, total - warmup))))
(HF transformers' get_*_schedule_with_warmup; torch LambdaLR with those lambdas.)

Gradient accumulation (grad_accum N > 1): state `<w>__accum` (the sum of this window's
unscaled gradients) and `accum_count` (runs summed so far). A run adds its gradient; the
N-th run of a window applies the optimizer to the mean (sum / N), then zeroes both. The
finiteness check (skip + loss-scale backoff) is made on that update run, on the summed
gradient, so one overflowing micro-batch skips the whole window; the loss scale only
changes on update runs, so every gradient of a window is unscaled by the same S.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .builder import Builder

SCHEDULES = ("constant", "linear", "cosine")
OPTIMIZERS = ("adamw", "sgd")
ACCUM = "__accum"
ACCUM_COUNT = "accum_count"


def finite_flag(b: Builder, tensors, out: str | None = None, row: int | None = None) -> str:
    """One bool scalar: True iff every element of every tensor is finite.

    Each tensor contributes ReduceSum(t * 0): exactly 0 when t is finite, NaN as soon as
    one element is inf or NaN (inf * 0 = NaN). Sum of those is NaN iff any is. Unlike a
    plain ReduceSum(t), this cannot report a false overflow when a large finite sum
    exceeds the FP32 range, and it needs only ops every runtime has (Mul, ReduceSum, Sum,
    IsNaN, Not) in any float type.

    With `row` (the first tensor a 1-D buffer of whole rows of that length: the flat
    gradient), that tensor is first summed per row, and the row sums times 0 are checked:
    one read of the buffer instead of a Mul writing one more (ResNet-18's 11.7M gradients:
    1.8 ms instead of 3.4). A row of gradients whose finite values sum past FP32's range
    (3.4e38, which takes values of ~3e35 on average) then counts as an overflow: the step
    is skipped, as it would be for an inf."""
    zero = b.const(0.0)
    if row is not None:
        first = b.op("ReduceSum", [b.op("Reshape", [tensors[0], b.const([-1, row], np.int64)]),
                                   b.const([1], np.int64)], keepdims=0)
        tensors = [first] + list(tensors[1:])
    parts = [b.op("ReduceSum", [b.op("Mul", [t, zero])], keepdims=0) for t in tensors]
    total = parts[0] if len(parts) == 1 else b.op("Sum", parts)
    return b.op("Not", [b.op("IsNaN", [total])], out=out)


def clip_coef(b: Builder, grads: dict, max_norm: float, grad_scale: str | None = None) -> str:
    """torch.nn.utils.clip_grad_norm_'s factor min(1, max_norm / (||g||_2 + 1e-6)), global norm,
    as a scalar: the caller folds it into the optimizer's grad_scale rather than making a pass
    over the gradients. The gradients are grad_scale * grads (grad_scale a scalar, None: 1).
    NaN when a gradient is not finite (optimizer() gates its grad_scale)."""
    sq = [b.op("ReduceSumSquare", [g], keepdims=0) for g in grads.values()]
    norm = b.op("Sqrt", [sq[0] if len(sq) == 1 else b.op("Sum", sq)])
    if grad_scale is not None:
        norm = b.op("Mul", [norm, grad_scale])
    coef = b.op("Div", [b.const(max_norm), b.op("Add", [norm, b.const(1e-6)])])
    return b.op("Min", [coef, b.const(1.0)])


def lr_factor(t: float, schedule: str, warmup: int, total: int | None) -> float:
    """The schedule's factor of the base lr at optimizer step t (numpy twin of lr_tensor)."""
    if t < warmup:
        return t / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, (total - t) / span)
    return 0.5 * (1.0 + np.cos(np.pi * min(1.0, (t - warmup) / span)))


def lr_tensor(b: Builder, cfg: dict, step: str) -> str:
    """The learning rate of this step as an FP32 scalar tensor (a constant without a schedule)."""
    lr, sched, warm, total = cfg["lr"], cfg["lr_schedule"], cfg["warmup_steps"], cfg["total_steps"]
    if sched == "constant" and not warm:
        return b.const(lr)
    t = b.op("Cast", [step], to=TensorProto.FLOAT)
    if sched == "constant":
        factor = b.const(1.0)
    else:
        span = b.const(float(max(1, total - warm)))
        if sched == "linear":
            factor = b.op("Max", [b.op("Div", [b.op("Sub", [b.const(float(total)), t]), span]), b.const(0.0)])
        else:
            prog = b.op("Min", [b.op("Div", [b.op("Sub", [t, b.const(float(warm))]), span]), b.const(1.0)])
            cos = b.op("Cos", [b.op("Mul", [prog, b.const(np.pi)])])
            factor = b.op("Mul", [b.op("Add", [cos, b.const(1.0)]), b.const(0.5)])
    if warm:
        ramp = b.op("Div", [t, b.const(float(warm))])
        factor = b.op("Where", [b.op("Less", [t, b.const(float(warm))]), ramp, factor])
    return b.op("Mul", [factor, b.const(lr)])


def _suffixed(w: str, suffix: str) -> str:
    return w + suffix


def optimizer(b: Builder, cfg: dict, grads: dict, lr: str, step_next_f: str, applied: str,
              state_name=_suffixed, out_name=None, grad_scale: str | None = None) -> tuple[dict, dict]:
    """Needs {weight tensor: its gradient} (any shapes: per-weight tensors, or one flat buffer),
    the lr tensor and the new step count as FP32; each gradient is grad_scale * grads[w]
    (grad_scale an FP32 scalar tensor, None: 1), so the loss scale's 1 / S and a clipping
    factor ride on the optimizer's scalar coefficients instead of a pass over the gradients
    each (ResNet-18's 11.7M weights: 4.3 ms of a 123 ms CPU step for the unscale alone).
    Returns ({state input: new value}, {moment state: the weight it belongs to}); a moment of
    weight w is named state_name(w, "__momentum" | "__exp_avg" | "__exp_avg_sq"), and a new
    value is written to out_name(state) when that gives a name (the graph's output, so no
    copy follows).

    The new values are gated by `applied` (a bool scalar) through their scalar coefficients,
    with no pass over the state: when it is False every coefficient that moves the state is 0
    and every one that keeps it is 1, so each new value equals its input (m * 1 + 0, w - 0).
    That needs gradients that are 0 where the step is not applied (gated_grads): a NaN
    gradient times 0 would still be NaN; grad_scale is gated here (a NaN clipping factor of a
    skipped step must not reach the coefficients).

    AdamW is torch's w - step_size * m / (sqrt(v) / sqrt(bc2) + eps) with sqrt(bc2) moved into
    the scalars: w - (step_size * sqrt(bc2)) * m / (sqrt(v) + eps * sqrt(bc2)), one pass over
    the buffer fewer (a difference of FP32 rounding only)."""
    new, moments = {}, {}
    wd = cfg["weight_decay"]
    out_name = out_name or (lambda _: None)
    on = b.op("Cast", [applied], to=TensorProto.FLOAT)  # 1.0 / 0.0
    scale = None if grad_scale is None else b.op("Where", [applied, grad_scale, b.const(0.0)])

    def moving(c, scaled=False):
        """A coefficient that moves the state: c, or 0 on a skipped step; times the gradients'
        grad_scale when `scaled` (c multiplies a gradient)."""
        c = b.op("Mul", [c if isinstance(c, str) else b.const(c), on])
        return b.op("Mul", [c, scale]) if scaled and scale is not None else c

    def keeping(c):
        """A coefficient that carries the state over: c, or 1 on a skipped step."""
        return b.op("Where", [applied, c if isinstance(c, str) else b.const(c), b.const(1.0)])

    if cfg["optimizer"] == "sgd":
        mom = cfg["momentum"]
        for w, g in grads.items():
            if scale is not None and (wd or mom):  # the decay and the momentum buffer add to g itself
                g = b.op("Mul", [g, scale])
            if wd:
                g = b.op("Add", [g, b.op("Mul", [w, moving(wd)])])
            if mom:
                buf = state_name(w, "__momentum")
                g = b.op("Add", [b.op("Mul", [buf, keeping(mom)]), g], out=out_name(buf))
                new[buf] = g
                moments[buf] = w
            new[w] = b.op("Sub", [w, b.op("Mul", [g, moving(lr, scaled=not (wd or mom))])], out=out_name(w))
        return new, moments
    b1, b2 = cfg["betas"]
    # bias corrections from the new step count t (as torch: step is incremented first)
    bc1 = b.op("Sub", [b.const(1.0), b.op("Pow", [b.const(b1), step_next_f])])
    bc2_sqrt = b.op("Sqrt", [b.op("Sub", [b.const(1.0), b.op("Pow", [b.const(b2), step_next_f])])])
    alpha = moving(b.op("Mul", [b.op("Div", [lr, bc1]), bc2_sqrt]))
    eps = b.op("Mul", [b.const(cfg["eps"]), bc2_sqrt])
    keep = keeping(b.op("Sub", [b.const(1.0), b.op("Mul", [lr, b.const(wd)])])) if wd else None
    for w, g in grads.items():
        m, v = state_name(w, "__exp_avg"), state_name(w, "__exp_avg_sq")
        decayed = b.op("Mul", [w, keep]) if wd else w
        m_new = b.op("Add", [b.op("Mul", [m, keeping(b1)]), b.op("Mul", [g, moving(1.0 - b1, scaled=True)])],
                     out=out_name(m))
        # (g * sqrt(1 - b2) * scale)^2, not g * g * ...: a loss-scaled g squared could overflow
        root = b.op("Mul", [g, moving(float(np.sqrt(1.0 - b2)), scaled=True)])
        v_new = b.op("Add", [b.op("Mul", [v, keeping(b2)]), b.op("Mul", [root, root])], out=out_name(v))
        denom = b.op("Add", [b.op("Sqrt", [v_new]), eps])
        new[w] = b.op("Sub", [decayed, b.op("Mul", [b.op("Div", [m_new, denom]), alpha])], out=out_name(w))
        new[m], new[v] = m_new, v_new
        moments[m] = moments[v] = w
    return new, moments


def gated_grads(b: Builder, grads: dict, applied: str) -> dict:
    """{weight: its gradient where `applied`, else 0} (one Where per gradient against a scalar
    0, the form ORT's CPU Where runs fastest: 5.0 ms for 11.7M floats, 1 thread, where a Where
    between two buffers takes 8.8 and a Mul 3.7), for optimizer(..., applied=...)."""
    zero = b.const(0.0)
    return {w: b.op("Where", [applied, g, zero]) for w, g in grads.items()}


def accumulate(b: Builder, grads: dict, n: int, state_name=_suffixed) -> tuple[dict, str, dict]:
    """Gradient accumulation over n runs (n > 1): returns (the window's mean gradients, the bool
    `update` flag of this run, {accum state: its next value}); zeroed after an update run. The
    window's sum for weight w is the state state_name(w, ACCUM)."""
    count1 = b.op("Add", [ACCUM_COUNT, b.const(1, np.int64)])
    update = b.op("GreaterOrEqual", [count1, b.const(n, np.int64)])
    mean, nxt = {}, {}
    for w, g in grads.items():
        total = b.op("Add", [state_name(w, ACCUM), g])
        mean[w] = b.op("Div", [total, b.const(float(n))])
        # zeros, not total * 0: that would keep a NaN of an overflowing window
        nxt[state_name(w, ACCUM)] = b.op("Where", [update, _zeros_like(b, w), total])
    nxt[ACCUM_COUNT] = b.op("Where", [update, b.const(0, np.int64), count1])
    return mean, update, nxt


def _zeros_like(b: Builder, t: str) -> str:
    return b.op("ConstantOfShape", [b.op("Shape", [t])])


def skipped_note(cfg: dict, dynamic: bool, steps: int, skipped: int, scale: float) -> str | None:
    """One line saying why a run skipped (nearly) every step (at least 90% of them, over 4 or more
    steps), or None when it did not. cfg: train.json "config" (precision, min_scale, loss_scale);
    dynamic: the loss scale is dynamic; scale: the loss scale after the last step.

    The cases differ in what helps: a dynamic scale still above its floor is still backing off
    (more steps, or a lower --init-scale, help); a fixed scale may be too large (a smaller
    --loss-scale or 'dynamic' may help); at the floor, or in FP32, a smaller scale cannot
    help: the gradients themselves are inf/NaN."""
    if steps < 4 or skipped * 10 < steps * 9:
        return None
    what = f"{'all' if skipped == steps else f'{skipped} of'} {steps} steps were skipped for inf/NaN gradients"
    if cfg.get("precision") == "fp32":
        return (f"{what}, in FP32: the loss or its gradients are not finite whatever the precision; check the "
                "data, lower --lr, or look for a NaN-producing op (log/sqrt/division of zero).")
    if dynamic and scale > cfg.get("min_scale", 1.0):
        return (f"{what}: the dynamic loss scale is still backing off (now {scale:g}, x{cfg.get('backoff', 0.5):g} "
                "per overflow); train more steps, or rebuild with a lower --init-scale.")
    kind = "BF16" if cfg.get("precision") == "bf16" else "FP16"
    if not dynamic:
        return (f"{what} at the fixed loss scale {scale:g}: the {kind} gradients overflow at that scale or are NaN; "
                "rebuild with a smaller --loss-scale or 'dynamic', or train with --precision fp32.")
    return (f"{what} at loss scale {scale:g}, its floor (--min-scale): the {kind} gradients are inf/NaN even so, "
            "which loss scaling cannot fix; train with --precision fp32, or, when they only overflow, a lower "
            "--min-scale (PyTorch's GradScaler has no floor).")


def scale_update(b: Builder, cfg: dict, finite: str, scale: str, clean: str) -> tuple[str, str]:
    """Dynamic loss scale (torch GradScaler semantics, plus floor and cap); returns the new
    (scale, clean-step counter):
    overflow -> S = max(S * backoff, min_scale), clean = 0;
    finite   -> clean += 1; if clean >= growth_interval: S = min(S * growth, max_scale), clean = 0."""
    clean1 = b.op("Add", [clean, b.const(1, np.int64)])
    grow = b.op("GreaterOrEqual", [clean1, b.const(cfg["growth_interval"], np.int64)])
    grown = b.op("Min", [b.op("Mul", [scale, b.const(cfg["growth"])]), b.const(cfg["max_scale"])])
    s_ok = b.op("Where", [grow, grown, scale])
    c_ok = b.op("Where", [grow, b.const(0, np.int64), clean1])
    s_bad = b.op("Max", [b.op("Mul", [scale, b.const(cfg["backoff"])]), b.const(cfg["min_scale"])])
    return b.op("Where", [finite, s_ok, s_bad]), b.op("Where", [finite, c_ok, b.const(0, np.int64)])

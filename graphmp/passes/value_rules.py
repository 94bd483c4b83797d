"""Rules for values whose meaning FP16 changes although their magnitude fits its range
(classify rules 11-13; graphmp/passes/classify.py runs them after the range rule).

  * periodic:  Sin/Cos whose argument calibration saw at |x| >= PERIODIC_MIN_ARG, and the
               float work that computes that argument: FP16's spacing there is a visible
               fraction of the period (at 8 rad it is 2^-7, 1/800 of 2*pi; at 512 rad, a
               pixel-scale Fourier feature or a diffusion timestep, 0.5 rad), so the Sin
               of an FP16 argument is off by up to half of that. Small arguments (a Snake
               activation on bounded inputs) stay FP16. Without a measured range the rule
               does not apply (like the range rule).
  * sentinel:  the mask arithmetic that carries a constant beyond FP16's max (the
               finfo(float32).min of `(1 - mask) * finfo.min` or `Where(mask, 0, min)`)
               into a Softmax. In FP16 the constant is -inf, and a fully masked row
               (padding, a left-padded batch) becomes NaN where FP32 gives a uniform row:
               score + min == min in FP32. The path stays FP32 up to the Softmax, which
               then reads FP32 (its output may still be FP16). A -inf mask is left alone:
               FP16 holds -inf exactly, so it computes as in FP32, NaN rows included.
  * rounded:   the float work that computes a value rounded to an integer (Round, Floor,
               Ceil, a Cast to an integer type: durations, lengths, indices). A rounding
               turns FP16's relative error 2^-11 into a whole unit wherever a value lies
               near a boundary (a TTS model's durations: 48000 vs 47400 samples).

The last two walk back from the node (producers of its float inputs) through elementwise,
data-movement and Tensor Core work, across at most MAX_COMPUTE_HOPS Tensor Core nodes
(each one's inputs' rounding reaches the result too) and MAX_WALK nodes in all, stopping
at graph inputs, initializers, fixed-type nodes (a Cast) and FP32-class ops (already FP32).
"""
from __future__ import annotations

import math

from .. import policy
from ..context import FLOAT
from ..input_roles import INT_ELEMS  # the integer element types

PERIODIC_OPS = frozenset({"Sin", "Cos"})
ROUNDING_OPS = frozenset({"Round", "Floor", "Ceil"})
# FP32 where FP16's spacing at the argument is >= 2^-10 of the period 2*pi: spacing(|x|) is
# 2^(floor(log2 |x|) - 10), so from |x| = 8 (8 = the power of two above 2*pi).
PERIODIC_FRACTION = 2.0 ** -10
PERIODIC_MIN_ARG = 8.0
MAX_COMPUTE_HOPS = 2
MAX_WALK = 32
SOFTMAX_OPS = frozenset({"Softmax", "LogSoftmax"})
SENTINEL_WALK = 16      # follow/clear steps from the sentinel to the Softmax


def fp16_spacing(x: float) -> float:
    """The distance between adjacent FP16 values at magnitude x (subnormal spacing below 2^-14)."""
    if x < 2.0 ** -14:
        return 2.0 ** -24
    return 2.0 ** (math.floor(math.log2(x)) - 10)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _walkable(n) -> bool:
    return policy.op_class(n.op_type, n.domain) in ("follow", "clear", "fp16")


def feeding_nodes(ctx, g, start_tensors, producers: dict) -> list:
    """The nodes of g whose float outputs flow into start_tensors through elementwise,
    data-movement and Tensor Core nodes (at most MAX_COMPUTE_HOPS Tensor Core nodes on a
    path, MAX_WALK nodes in all), nearest first. Needs ctx.types; producers: g.producers()."""
    todo = [(t, 0) for t in start_tensors]
    seen, out = set(), []
    while todo and len(out) < MAX_WALK:
        t, hops = todo.pop(0)
        p = producers.get(t)
        if p is None or p in seen or ctx.type_of(g, t) != FLOAT or not _walkable(p):
            continue
        hops += policy.op_class(p.op_type, p.domain) == "fp16"
        if hops > MAX_COMPUTE_HOPS:
            continue
        seen.add(p)
        out.append(p)
        todo.extend((x, hops) for x in p.inputs if x)
    return out


def _range(ctx, g, name):
    owner = g.owner_of(name)
    return (ctx.ranges or {}).get((owner.key if owner is not None else g.key, name))


def periodic_reasons(ctx, g) -> dict:
    """{node: reason} for g's Sin/Cos with a measured argument of |x| >= PERIODIC_MIN_ARG
    and the work feeding that argument."""
    out: dict = {}
    producers = g.producers()
    for n in g.nodes:
        if n.op_type not in PERIODIC_OPS or n.domain not in ("", "ai.onnx") or not n.inputs:
            continue
        r = _range(ctx, g, n.inputs[0])
        if r is None or not math.isfinite(r) or fp16_spacing(r) < PERIODIC_FRACTION * 2 * math.pi:
            continue
        sp = fp16_spacing(r)
        why = (f"{n.op_type} '{n.name}': its argument reached |x| {_fmt(r)} in calibration, where FP16's spacing "
               f"({_fmt(sp)}) is {sp / (2 * math.pi):.2%} of the period 2*pi")
        out.setdefault(n, f"periodic: {why}")
        for p in feeding_nodes(ctx, g, n.inputs[:1], producers):
            out.setdefault(p, f"periodic: computes the argument of {why}")
    return out


def rounded_reasons(ctx, g) -> dict:
    """{node: reason} for the float work that computes a value g rounds to an integer."""
    out: dict = {}
    producers = g.producers()
    for n in g.nodes:
        if n.domain not in ("", "ai.onnx") or not n.inputs or ctx.type_of(g, n.inputs[0]) != FLOAT:
            continue
        if n.op_type == "Cast" and n.attr("to") in INT_ELEMS:
            what = "Cast to an integer"
        elif n.op_type in ROUNDING_OPS:
            what = n.op_type
        else:
            continue
        r = _range(ctx, g, n.inputs[0])
        seen = f" (|x| up to {_fmt(r)} in calibration)" if r is not None else ""
        why = (f"rounded to an integer: feeds {what} '{n.name}'{seen}; FP16's relative error 2^-11 would move "
               "values near a rounding boundary by a whole unit")
        if n.op_type in ROUNDING_OPS:
            out.setdefault(n, why)
        for p in feeding_nodes(ctx, g, n.inputs[:1], producers):
            out.setdefault(p, why)
    return out


def sentinel_reasons(ctx, g, big_constant) -> dict:
    """{node: reason} for the follow/clear nodes of g that carry a constant beyond the low
    type's max into a Softmax. big_constant(g, name) -> that constant's max |x| when `name`
    is a float initializer beyond the low type's max but finite, else None."""
    users = g.consumers()
    out: dict = {}
    for n in g.nodes:
        if policy.op_class(n.op_type, n.domain) not in ("follow", "clear"):
            continue
        found = next(((x, v) for x in n.inputs if x for v in [big_constant(g, x)] if v is not None), None)
        if found is None:
            continue
        path = _path_to_softmax(n, users)
        why = (f"mask sentinel: carries initializer '{found[0]}' ({_fmt(found[1])}, beyond the "
               f"{ctx.options.target.upper()} max, where it would be -inf and a fully masked row NaN) into a Softmax")
        for m in path:
            out.setdefault(m, why)
    return out


def _path_to_softmax(start, users) -> list:
    """start and the follow/clear nodes after it (SENTINEL_WALK steps at most) on a path
    that ends in a Softmax/LogSoftmax's input; [] when no such path exists."""
    ahead, order, todo = {start: 0}, [start], [start]
    while todo:
        n = todo.pop(0)
        if ahead[n] >= SENTINEL_WALK:
            continue
        for o in n.outputs:
            for c in users.get(o, ()):
                if c not in ahead and policy.op_class(c.op_type, c.domain) in ("follow", "clear"):
                    ahead[c] = ahead[n] + 1
                    order.append(c)
                    todo.append(c)
    ends = {n for n in order for o in n.outputs for c in users.get(o, ()) if c.op_type in SOFTMAX_OPS}
    keep, changed = set(ends), True
    while changed:  # the nodes from which an end is reachable inside `ahead`
        changed = False
        for n in order:
            if n not in keep and any(c in keep for o in n.outputs for c in users.get(o, ())):
                keep.add(n)
                changed = True
    return [n for n in order if n in keep]

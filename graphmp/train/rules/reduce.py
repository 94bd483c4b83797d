"""Gradient rules of reductions (Reduce*) and scans (CumSum).

Every Reduce* rule first brings dY (and Y where it needs it) back to X's rank with the
reduced axes kept as size 1 (`_keepdims`), so that it broadcasts against X.
ReduceMax / ReduceMin split dY evenly among the elements that tie for the extreme (as
torch.amax / amin do): dX = dY * [X == Y] / count(X == Y).
"""
from __future__ import annotations

from ...errors import GraphmpError
from ..emitter import Emitter, attr, rule
from .common import _count_ratio, _is_extreme

_ALL = "all"


def _axes(em: Emitter, node):
    """The reduced axes: a list of ints, _ALL (every axis), [] (noop_with_empty_axes), or
    None when they are computed at run time."""
    axes = attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        v = em.const_value(node.input[1])
        if v is None:
            return None
        axes = [int(a) for a in v.reshape(-1)]
    if not axes:
        return [] if attr(node, "noop_with_empty_axes", 0) else _ALL
    return list(axes)


def _keepdims(em: Emitter, node, t: str) -> str:
    """t (dY or Y of the Reduce* node) with the reduced axes as size-1 dims, so that it
    broadcasts against X."""
    if attr(node, "keepdims", 1):
        return t
    axes = _axes(em, node)
    if axes is None:
        raise GraphmpError(f"node '{node.name}' ({node.op_type}): axes computed at run time with "
                           "keepdims=0 cannot be differentiated; use constant axes")
    if axes == _ALL or not axes:
        return t  # a scalar broadcasts; noop: same shape as X
    rank = em.rank(node.input[0])
    return em.unsqueeze(t, sorted(a % rank for a in axes))


def _reduce_grad(em: Emitter, node, g: str) -> str:
    """dY of a Reduce* brought back to X's rank and broadcast to X's shape."""
    if _axes(em, node) == []:
        return g
    return em.expand_like(_keepdims(em, node, g), node.input[0])


def _sum_like(em: Emitter, node, t: str, op_type: str = "ReduceSum") -> str:
    """ReduceSum (or op_type) of t (shaped like X) over the node's axes, keepdims=1."""
    axes = _axes(em, node)
    if axes == _ALL:
        return em.op(op_type, [t], keepdims=1)
    if axes is None:  # run-time axes: an input, as in the node itself
        return em.op(op_type, [t, node.input[1]], keepdims=1,
                     noop_with_empty_axes=attr(node, "noop_with_empty_axes", 0))
    return em.reduce(op_type, t, axes, keepdims=1)


@rule("ReduceSum")
def reduce_sum(em, node, g):
    """Y = sum of X over axes: dX = dY broadcast back over the reduced axes."""
    return [_reduce_grad(em, node, g[0])]


@rule("ReduceMean")
def reduce_mean(em, node, g):
    """Y = mean of X over axes: dX = dY / count broadcast back over the reduced axes."""
    x = node.input[0]
    back = _reduce_grad(em, node, g[0])
    if back == g[0]:
        return [back]
    return [em.op("Div", [back, _count_ratio(em, x, node.output[0], em.dtype(x))])]


@rule("ReduceMax", "ReduceMin")
def reduce_max_min(em, node, g):
    """Y = max/min of X over axes: dX = dY * [X == Y] / (number of ties), i.e. dY goes to the
    extreme element, split evenly among elements that tie (torch.amax/amin semantics).
    In FP16/BF16, [X == Y] tolerates the type's rounding (common._is_extreme)."""
    x = node.input[0]
    if _axes(em, node) == []:
        return [g[0]]
    mask = em.op("Cast", [_is_extreme(em, x, _keepdims(em, node, node.output[0]))], to=em.dtype(x))
    share = em.op("Div", [_keepdims(em, node, g[0]), _sum_like(em, node, mask)])
    return [em.op("Mul", [mask, share])]


@rule("ReduceSumSquare")
def reduce_sum_square(em, node, g):
    """Y = sum of X^2 over axes: dX = 2 X dY."""
    x = node.input[0]
    return [em.op("Mul", [_reduce_grad(em, node, g[0]), em.op("Mul", [x, em.like(2.0, x)])])]


@rule("ReduceL1")
def reduce_l1(em, node, g):
    """Y = sum of |X| over axes: dX = sign(X) dY."""
    x = node.input[0]
    return [em.op("Mul", [_reduce_grad(em, node, g[0]), em.op("Sign", [x])])]


@rule("ReduceL2")
def reduce_l2(em, node, g):
    """Y = sqrt(sum of X^2) over axes: dX = X / Y * dY (0 where Y = 0, as torch)."""
    x = node.input[0]
    if _axes(em, node) == []:  # noop: Y = |X|
        return [em.op("Mul", [g[0], em.op("Sign", [x])])]
    yk = _keepdims(em, node, node.output[0])
    zero = em.op("Equal", [yk, em.like(0.0, x)])
    safe = em.op("Where", [zero, em.like(1.0, x), yk])
    ratio = em.op("Where", [zero, em.like(0.0, x), em.op("Div", [_keepdims(em, node, g[0]), safe])])
    return [em.op("Mul", [x, ratio])]


@rule("ReduceLogSumExp")
def reduce_log_sum_exp(em, node, g):
    """Y = log(sum of exp(X)) over axes: dX = softmax(X) over the axes * dY = exp(X - Y) dY."""
    x = node.input[0]
    if _axes(em, node) == []:
        return [g[0]]
    soft = em.op("Exp", [em.op("Sub", [x, _keepdims(em, node, node.output[0])])])
    return [em.op("Mul", [soft, _keepdims(em, node, g[0])])]


@rule("ReduceLogSum")
def reduce_log_sum(em, node, g):
    """Y = log(sum of X) over axes: dX = dY / exp(Y) = dY / sum(X), broadcast."""
    if _axes(em, node) == []:
        return [em.op("Div", [g[0], node.input[0]])]
    back = em.op("Div", [_keepdims(em, node, g[0]), em.op("Exp", [_keepdims(em, node, node.output[0])])])
    return [em.expand_like(back, node.input[0])]


@rule("ReduceProd")
def reduce_prod(em, node, g):
    """Y = product of X over axes: dX_i = dY * (product of the other elements), computed
    without dividing by zero: with P = product of the non-zero elements and z = number of
    zeros, dX_i = dY P / X_i where z = 0; dY P at the single zero where z = 1; else 0."""
    x = node.input[0]
    if _axes(em, node) == []:
        return [g[0]]
    is_zero = em.op("Equal", [x, em.like(0.0, x)])
    zeros = _sum_like(em, node, em.op("Cast", [is_zero], to=em.dtype(x)))
    safe = em.op("Where", [is_zero, em.like(1.0, x), x])
    p = _sum_like(em, node, safe, "ReduceProd")
    nonzero = em.op("Where", [em.op("Equal", [zeros, em.like(0.0, x)]), em.op("Div", [p, safe]), em.like(0.0, x)])
    at_zero = em.op("Where", [em.op("Equal", [zeros, em.like(1.0, x)]), p, em.like(0.0, x)])
    return [em.op("Mul", [_keepdims(em, node, g[0]), em.op("Where", [is_zero, at_zero, nonzero])])]


# --- scans ---------------------------------------------------------------------------------------

@rule("CumSum")
def cumsum(em, node, g):
    """Y = cumulative sum of X along axis (exclusive: without the element itself; reverse:
    from the end): dX = the cumulative sum of dY in the opposite direction, same exclusive."""
    x, axis = node.input
    return [em.op("CumSum", [g[0], axis], exclusive=attr(node, "exclusive", 0),
                  reverse=1 - attr(node, "reverse", 0)), None]

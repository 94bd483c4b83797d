"""Helpers shared by the rule families (no rules registered here)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ..emitter import Emitter


def _inputs(node, n):
    """node.input padded with '' to length n."""
    return list(node.input) + [""] * (n - len(node.input))


def _zero_where(em: Emitter, cond: str, g: str, keep_when_true=True) -> str:
    zero = em.like(0.0, g)
    return em.op("Where", [cond, g, zero] if keep_when_true else [cond, zero, g])


# Half the relative spacing of FP16 / BF16 numbers (2^-11 = 2^-(10 mantissa bits + 1); 2^-8):
# any real x and its rounding r to that type differ by less than |r| * this much, except an x
# exactly halfway between a power of two r and the number above it (a measure-zero case).
_HALF_ULP = {TensorProto.FLOAT16: 2.0 ** -11, TensorProto.BFLOAT16: 2.0 ** -8}


def _is_extreme(em: Emitter, x: str, y: str) -> str:
    """Bool mask [x == y] for a rule that finds the elements a Max/Min picked (y: the forward
    output, broadcastable to x).

    FP32/FP64: exact Equal. FP16/BF16: x == y, or |x - y| < |y| * half an ulp of the type.
    Why: a runtime may compute an FP16 graph in FP32 and drop the Casts it inserts around
    some ops but not others (ONNX Runtime on the CPU: Relu -> Transpose -> ReduceMax left
    the ReduceMax input unrounded and its output rounded to FP16), so the two sides of the
    Equal differ by the FP16 rounding, no element matches, and dY * mask / count is 0/0 =
    NaN at every loss scale (every step skipped). The tolerance is below the gap between
    two distinct FP16 (BF16) numbers near y, so a runtime that really computes in that type
    gets exactly the Equal mask; values that round to y count as ties, as they would be in
    that type."""
    eq = em.op("Equal", [x, y])
    tol = _HALF_ULP.get(em.dtype(x))
    if tol is None:
        return eq
    near = em.op("Less", [em.op("Abs", [em.op("Sub", [x, y])]), em.op("Mul", [em.op("Abs", [y]), em.like(tol, x)])])
    return em.op("Or", [eq, near])


def _count_ratio(em: Emitter, x: str, y: str, dtype: int) -> str:
    """numel(x) / numel(y) as a scalar of `dtype` (static when shapes are)."""
    sx, sy = em.static_shape(x), em.static_shape(y)
    if sx is not None and sy is not None:
        return em.const(float(np.prod(sx)) / float(np.prod(sy)), dtype)
    return em.op("Cast", [em.op("Div", [em.op("Size", [x]), em.op("Size", [y])])], to=dtype)


def per_channel_count(em: Emitter, x: str, chan: list[int], dtype: int) -> str:
    """M, the elements of x per channel (the axes `chan`), as a scalar of `dtype`: a constant
    when those axes are static, else Size(x) / C at run time, made once per emitter for the
    tensors whose `chan` axes have the same (symbolic) dims, e.g. every BatchNorm of one
    feature-map size with the free batch N."""
    dims = em.dims(x)
    if dims is not None and all(isinstance(dims[a], int) for a in chan):
        return em.const(float(np.prod([dims[a] for a in chan])), dtype)
    key = ("per_channel_count", tuple(dims[a] for a in chan), dtype) if dims and all(dims[a] for a in chan) else None
    if key in em._cache:
        return em._cache[key]
    size = em.op("Div", [em.op("Size", [x]), em.op("Reshape", [em.dim(x, 1), em.ints([])])])
    count = em.op("Cast", [size], to=dtype)
    if key is not None:
        em._cache[key] = count
    return count


def _swap_last2(em: Emitter, x: str, rank: int) -> str:
    return em.transpose(x, list(range(rank - 2)) + [rank - 1, rank - 2])


def _cat(a, b):
    return None if a is None or b is None else list(a) + list(b)


def _acc_type(dt: int) -> int:
    """Scatter-add accumulates FP16/BF16 gradients in FP32 (ORT CPU has no FP16 scatter-add,
    and repeated indices sum more accurately)."""
    return dt if dt in (TensorProto.FLOAT, TensorProto.DOUBLE) else TensorProto.FLOAT


def _flat_scatter(em: Emitter, x: str, flat_idx: str, g: str, reduction: str | None) -> str:
    """Zeros shaped like x with g's elements added at flat positions flat_idx (same shape as g)."""
    dt = em.dtype(x)
    acc = _acc_type(dt)
    zeros = em.op("ConstantOfShape", [em.op("Reshape", [em.op("Size", [x]), em.ints([1])])],
                  value=helper.make_tensor("zero", acc, [1], [0]))
    kw = {"reduction": reduction} if reduction else {}
    flat = em.op("ScatterElements", [zeros, em.op("Reshape", [flat_idx, em.ints([-1])]),
                                     em.op("Reshape", [em.cast(g, acc, dt), em.ints([-1])])], axis=0, **kw)
    return em.cast(em.reshape_like(flat, x), dt, acc)

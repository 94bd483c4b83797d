"""Helpers shared by the rule families (no rules registered here)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ..emitter import Emitter


def _inputs(node, n):
    """node.input padded with '' to length n."""
    return list(node.input) + [""] * (n - len(node.input))


def _zero_where(em: Emitter, cond: str, g: str, keep_when_true=True) -> str:
    """g where the bool tensor `cond` holds (where it does not, with keep_when_true=False), else
    0, as g * Cast(cond): exact for finite g (g * 1 = g, g * 0 = 0), while an inf or NaN of g
    at a masked place gives NaN (the finite check then skips the step) where a select gives 0.
    ORT CPU's Where with a per-element condition is ~8x slower than Cast + Mul (a ReLU gradient
    of [4, 256, 28, 28]: 3.2 ms vs 0.39 ms, 1 thread; Where:backward was 32 ms of a 408 ms
    ResNet-50 step, benchmarks/train_profile.py)."""
    mask = cond if keep_when_true else em.op("Not", [cond])
    return em.op("Mul", [g, em.op("Cast", [mask], to=em.dtype(g))])


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
    """Zeros shaped like x with g's elements added (reduction 'add') or written (None) at flat
    positions flat_idx (same shape as g; repeated positions allowed with 'add').

    Exact and deterministic on ONNX Runtime's CPU: one 1-D ScatterElements over axis 0 is a
    single work unit there, applied in the order of the updates by one thread (measured
    bit-identical with 1, 2 and 4 intra-op threads). ORT CUDA adds with atomics: each sum is
    exact to FP32 rounding, its order (so its last bits) may change run to run where
    positions repeat (_flat_scatter_parts avoids that where the repeats have a pattern)."""
    return _flat_scatter_parts(em, x, [(flat_idx, g)], reduction)


def _flat_scatter_parts(em: Emitter, x: str, parts: list, reduction: str | None) -> str:
    """_flat_scatter of several (flat_idx, g) parts, one ScatterElements each, in order, each
    adding to (or writing over) what the ones before it left. Where no part repeats a position
    within itself, every part's adds land on distinct elements, so even ONNX Runtime's CUDA
    kernel, which adds with atomics, gives the same bits every run: the sums' order is the
    parts' order."""
    dt = em.dtype(x)
    acc = _acc_type(dt)
    flat = em.op("ConstantOfShape", [em.op("Reshape", [em.op("Size", [x]), em.ints([1])])],
                 value=helper.make_tensor("zero", acc, [1], [0]))
    kw = {"reduction": reduction} if reduction else {}
    for flat_idx, g in parts:
        flat = em.op("ScatterElements", [flat, em.op("Reshape", [flat_idx, em.ints([-1])]),
                                         em.op("Reshape", [em.cast(g, acc, dt), em.ints([-1])])], axis=0, **kw)
    return em.cast(em.reshape_like(flat, x), dt, acc)


def _dims_product(em: Emitter, x: str, start: int, stop: int) -> str:
    """The product of x's dims start..stop-1 as a 1-element int64 tensor (1 for an empty range;
    a constant when those dims are static)."""
    dims = em.dims(x)
    if dims is not None and all(isinstance(d, int) for d in dims[start:stop]):
        return em.ints([int(np.prod(dims[start:stop], dtype=np.int64))])
    out = em.ints([1])
    for axis in range(start, stop):
        out = em.op("Mul", [out, em.dim(x, axis)])
    return out


def _row_scatter_add(em: Emitter, x: str, rows: str, g: str, start: int, stop: int) -> str:
    """Zeros shaped like x with g added at `rows`: the gradient of gathering whole rows of x.

    Needs: x's axes start..stop-1 seen as one axis of n = their product (the row axis); `rows`
    int64 in [0, n), any shape, M elements; g shaped x[:start] + rows' shape + x[stop:] (the
    gathered rows, in rows' order). Guarantees: row r of the result is the sum of the g rows
    whose index is r (repeated indices accumulate; FP16/BF16 sums in FP32), in x's type.

    Why ScatterElements on [pre, n, post] (axis 1, the indices expanded over pre and post) and
    not ScatterND (reduction add): ORT's CPU ScatterND spreads the updates over its thread pool
    with no guard on repeated indices, so duplicate rows race (measured: 13-19% off and a new
    result every run with 2 or 4 intra-op threads; exact with 1). ORT's CPU ScatterElements
    gives each (pre, post) position to one thread and walks the M updates in order, so every
    row's sum is the same sequential FP32 sum on any thread count (older ORT runs the whole
    scatter on one thread: the same sum). ORT CUDA adds with atomics: each sum is exact to
    FP32 rounding, its order (so its last bits) may change run to run."""
    dt = em.dtype(x)
    acc = _acc_type(dt)
    pre, n, post = (_dims_product(em, x, 0, start), _dims_product(em, x, start, stop),
                    _dims_product(em, x, stop, em.rank(x)))
    zeros = em.op("ConstantOfShape", [em.op("Concat", [pre, n, post], axis=0)],
                  value=helper.make_tensor("zero", acc, [1], [0]))
    upd = em.op("Reshape", [em.cast(g, acc, dt), em.op("Concat", [pre, em.ints([-1]), post], axis=0)])
    idx = em.op("Expand", [em.op("Reshape", [rows, em.ints([1, -1, 1])]), em.op("Shape", [upd])])
    scat = em.op("ScatterElements", [zeros, idx, upd], axis=1, reduction="add")
    return em.cast(em.reshape_like(scat, x), dt, acc)

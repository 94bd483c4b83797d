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


def _count_ratio(em: Emitter, x: str, y: str, dtype: int) -> str:
    """numel(x) / numel(y) as a scalar of `dtype` (static when shapes are)."""
    sx, sy = em.static_shape(x), em.static_shape(y)
    if sx is not None and sy is not None:
        return em.const(float(np.prod(sx)) / float(np.prod(sy)), dtype)
    return em.op("Cast", [em.op("Div", [em.op("Size", [x]), em.op("Size", [y])])], to=dtype)


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

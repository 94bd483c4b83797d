"""Gradient rule of Resize: the transpose of the interpolation.

Resize in modes `nearest`, `linear` and `cubic` is separable: along every resized axis, each output
element is a fixed combination of input elements, Y = A_d X along axis d with A_d an
[out, in] matrix that depends only on the sizes and the attributes. `_axis_matrix` builds
A_d in numpy, with ONNX Runtime's arithmetic (coordinates in float32, linear weights from
the clamped coordinate, nearest indices clamped to the input, cubic: Keys weights with
cubic_coeff_a on 4 edge-padded taps, or renormalised over the taps inside with
exclude_outside); the gradient applies the
transposes: dX = dY contracted with A_d along every resized axis (a MatMul per axis, with a
Transpose moving that axis last and back).

Supported: 2-D to N-D inputs, any resized axes, scales or sizes given as constants
(initializer or Constant; sizes computed at run time also work when shape inference gives the
output's length along every resized axis), coordinate_transformation_mode half_pixel, pytorch_half_pixel,
align_corners, asymmetric, tf_half_pixel_for_nn, half_pixel_symmetric, every nearest_mode,
the `axes` attribute, keep_aspect_ratio_policy=stretch. The input's length along every
resized axis must be static. An axis with scale 1 is copied (as ONNX Runtime does, even
for tf_half_pixel_for_nn, whose formula would shift it). Not supported (GraphmpError naming the node):
tf_crop_and_resize, antialias=1 when downsampling, keep_aspect_ratio_policy other than
stretch, scales/sizes computed at run time when the output's length along a resized axis
is not known.
"""
from __future__ import annotations

import math

import numpy as np

from ...errors import GraphmpError
from ..emitter import Emitter, attr, rule
from .common import _inputs


def _text(node, name, default):
    v = attr(node, name, default)
    return v.decode() if isinstance(v, bytes) else v


def _original_coord(mode: str, out_len: int, in_len: int, scale: np.float32) -> np.ndarray:
    """x_original for x_resized = 0 .. out_len-1 (ONNX formulas, float32 like ORT)."""
    f = np.float32
    xr = np.arange(out_len, dtype=f)
    if mode == "half_pixel":
        return (xr + f(0.5)) / scale - f(0.5)
    if mode == "pytorch_half_pixel":
        return (xr + f(0.5)) / scale - f(0.5) if out_len > 1 else np.zeros(out_len, f)
    if mode == "align_corners":
        return xr * f(in_len - 1) / f(out_len - 1) if out_len > 1 else np.zeros(out_len, f)
    if mode == "asymmetric":
        return xr / scale
    if mode == "tf_half_pixel_for_nn":
        return (xr + f(0.5)) / scale
    if mode == "half_pixel_symmetric":
        adjustment = f(out_len) / (f(in_len) * scale)
        center = f(in_len) / f(2)
        offset = center * (f(1) - adjustment)
        return offset + (xr + f(0.5)) / scale - f(0.5)
    raise ValueError(mode)


def _nearest(x: np.ndarray, nearest_mode: str) -> np.ndarray:
    x = x.astype(np.float64)
    if nearest_mode == "floor":
        return np.floor(x)
    if nearest_mode == "ceil":
        return np.ceil(x)
    fl = np.floor(x)
    tie = x - fl == 0.5
    if nearest_mode == "round_prefer_ceil":
        return np.where(tie, fl + 1, np.round(x))
    return np.where(tie, fl, np.round(x))  # round_prefer_floor


def _cubic_weights(t: np.ndarray, a: float) -> np.ndarray:
    """[len(t), 4] Keys cubic convolution weights of the taps at floor(x)-1 .. floor(x)+2 for
    the fractional position t = x - floor(x) (ONNX Resize, cubic_coeff_a = a)."""
    t = t[:, None] + np.array([1.0, 0.0, -1.0, -2.0])  # distance of each tap
    d = np.abs(t)
    near = ((a + 2) * d - (a + 3)) * d * d + 1           # |d| <= 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a     # 1 < |d| < 2
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _axis_matrix(mode: str, coord: str, nearest_mode: str, in_len: int, out_len: int, scale,
                 cubic_a: float = -0.75, exclude_outside: bool = False) -> np.ndarray:
    """A [out_len, in_len]: Y = A @ X along one axis."""
    a = np.zeros((out_len, in_len))
    xo = _original_coord(coord, out_len, in_len, np.float32(scale))
    rows = np.arange(out_len)
    if mode == "cubic":  # 4 taps around x, edge-padded (or dropped and renormalised: exclude_outside)
        x = xo.astype(np.float64)
        base = np.floor(x)
        w = _cubic_weights(x - base, cubic_a)
        taps = base[:, None].astype(np.int64) + np.arange(-1, 3)
        if exclude_outside:
            w = np.where((taps < 0) | (taps >= in_len), 0.0, w)
            w = w / w.sum(axis=1, keepdims=True)
        np.add.at(a, (np.repeat(rows, 4), np.clip(taps, 0, in_len - 1).reshape(-1)), w.reshape(-1))
        return a
    if mode == "nearest":
        idx = np.clip(_nearest(xo, nearest_mode), 0, in_len - 1).astype(np.int64)
        a[rows, idx] = 1.0
        return a
    xc = np.clip(xo.astype(np.float64), 0, in_len - 1)
    lo = np.floor(xc).astype(np.int64)
    hi = np.minimum(lo + 1, in_len - 1)
    w = xc - lo
    np.add.at(a, (rows, lo), 1.0 - w)
    np.add.at(a, (rows, hi), w)
    return a


def _plan(em: Emitter, node) -> dict[int, np.ndarray]:
    """{axis: A_axis} for every axis whose interpolation is not the identity."""
    x, _roi, scales, sizes = _inputs(node, 4)
    where = f"node '{node.name}' (Resize)"
    mode = _text(node, "mode", "nearest")
    coord = _text(node, "coordinate_transformation_mode", "half_pixel")
    nearest_mode = _text(node, "nearest_mode", "round_prefer_floor")
    if mode not in ("nearest", "linear", "cubic"):
        raise GraphmpError(f"{where}: mode={mode} is not differentiated (nearest, linear and cubic are); "
                           "export the model with nearest, (bi)linear or (bi)cubic interpolation")
    if coord == "tf_crop_and_resize":
        raise GraphmpError(f"{where}: coordinate_transformation_mode=tf_crop_and_resize is not differentiated")
    if _text(node, "keep_aspect_ratio_policy", "stretch") != "stretch":
        raise GraphmpError(f"{where}: keep_aspect_ratio_policy other than 'stretch' is not differentiated")
    dims = em.dims(x)
    if dims is None:
        raise GraphmpError(f"{where}: the rank of '{x}' is unknown; pin the model's input sizes with --shapes "
                           "(e.g. x:1x3x256x256)")
    rank = len(dims)
    axes = [a % rank for a in attr(node, "axes", list(range(rank)))]
    sv = em.const_value(sizes) if sizes else None
    cv = em.const_value(scales) if scales else None
    if sv is not None and sv.size:
        outs = [int(v) for v in sv.reshape(-1)]
        factors = [None] * len(axes)
    elif cv is not None and cv.size:
        factors = [float(v) for v in cv.reshape(-1)]
        outs = [None] * len(axes)
    elif sizes and all(isinstance(o, int) or (o is not None and o == dims[a])
                       for a, o in zip(axes, [(em.dims(node.output[0]) or [None] * rank)[a] for a in axes])):
        # sizes computed at run time (torch: Concat(Shape(x)[:2], [H', W'])) but shape
        # inference (or train-graph's measurement) knows the output: each axis static, or the
        # same free dim as the input's (the batch: copied); ORT's scale is then out/in as well
        outs = [em.dims(node.output[0])[a] for a in axes]
        factors = [None] * len(axes)
    else:
        raise GraphmpError(f"{where}: its scales/sizes are computed at run time and the output shape is "
                           "not static; pin the model's input sizes with --shapes (e.g. x:1x3x256x256), which "
                           "makes them known, or export with a fixed output size or scale factor")
    plan = {}
    for ax, out, factor in zip(axes, outs, factors):
        n = dims[ax]
        if factor == 1.0 or (out is not None and out == n):
            continue  # ONNX Runtime copies an axis with scale 1 (whatever the coordinate mode)
        if not isinstance(n, int):
            raise GraphmpError(f"{where}: axis {ax} of '{x}' is resized but its length is not static; "
                               "pin the model's input sizes with --shapes (e.g. x:1x3x256x256): the step "
                               "graph is then built for those sizes (the batch stays free)")
        if out is None:
            out = int(math.floor(n * factor + 1e-9)) if factor is not None else n
            scale = np.float32(factor)
        else:
            scale = np.float32(out) / np.float32(n)
        if attr(node, "antialias", 0) and out < n:
            raise GraphmpError(f"{where}: antialias=1 with downsampling is not differentiated")
        plan[ax] = _axis_matrix(mode, coord, nearest_mode, n, out, scale, float(attr(node, "cubic_coeff_a", -0.75)),
                                bool(attr(node, "exclude_outside", 0)))
    return plan


@rule("Resize")
def resize(em, node, g):
    """Y = interpolation of X (nearest / linear), separable per axis: Y = A_d X along axis d.
    dX = dY with every A_d^T applied (MatMul with the constant [out, in] matrix A_d along
    that axis). See the module docstring for what is supported."""
    x = node.input[0]
    plan = _plan(em, node)
    rank = em.rank(x)
    gx = g[0]
    for ax, a in sorted(plan.items()):
        perm = [i for i in range(rank) if i != ax] + [ax]
        moved = em.transpose(gx, perm)
        back = em.op("MatMul", [moved, em.const(a, em.dtype(x))])
        gx = em.transpose(back, list(np.argsort(perm)))
    return [gx] + [None] * (len(node.input) - 1)

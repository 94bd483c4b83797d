"""Gradient rules: one small function per ONNX op, registered with `@rule("Op")`.

A rule gets the Emitter `em` (see autodiff.py), the forward node, and the gradients of the
node's outputs (tensor names, None where an output has none). It returns one gradient per
node input (None for inputs that need none; `em.needs(x)` says which do). A gradient has
the dtype and shape of its tensor. Rules read forward tensors (inputs, outputs) straight
from the forward graph rather than recomputing them, and build constants with
`em.like(value, tensor)` so they match the dtype they meet (FP16 regions stay FP16).
"""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper

from ..errors import GraphmpError
from ..ops import FLOAT_TYPES
from .autodiff import Emitter, _Rule, attr

RULES: dict[str, _Rule] = {}

#: ops whose gradient rule emits ops of a newer opset than 13 (train-graph upgrades to it)
NEEDS_OPSET = {"MaxPool": 16, "Gather": 16}  # ScatterElements / ScatterND with reduction='add'

#: ops whose float outputs have zero derivative (or no derivative): never on a gradient path
ZERO_GRAD = {
    "Shape", "Size", "Sign", "Floor", "Ceil", "Round", "IsNaN", "IsInf", "ArgMax", "ArgMin",
    "NonZero", "ConstantOfShape", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
    "EyeLike", "OneHot", "Hardmax", "Range", "Equal", "Less", "Greater", "LessOrEqual",
    "GreaterOrEqual", "Not", "And", "Or", "Xor",
}


def rule(*ops, outputs=(0,)):
    """Register fn as the gradient rule of `ops`; `outputs`: the outputs whose gradient it
    handles (None: all)."""
    def register(fn):
        for op in ops:
            RULES[op] = _Rule(fn, outputs)
        return fn
    return register


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


# --- elementwise arithmetic ----------------------------------------------------------------

@rule("Add")
def add(em, node, g):
    """Y = A + B: dA = dY, dB = dY (summed over broadcast axes)."""
    y = node.output[0]
    return [em.unbroadcast(g[0], x, y) if em.needs(x) else None for x in node.input]


@rule("Sub")
def sub(em, node, g):
    """Y = A - B: dA = dY, dB = -dY (summed over broadcast axes)."""
    a, b = node.input
    y = node.output[0]
    return [em.unbroadcast(g[0], a, y) if em.needs(a) else None,
            em.unbroadcast(em.op("Neg", [g[0]]), b, y) if em.needs(b) else None]


@rule("Mul")
def mul(em, node, g):
    """Y = A * B: dA = dY * B, dB = dY * A (summed over broadcast axes)."""
    a, b = node.input
    y = node.output[0]
    return [em.unbroadcast(em.op("Mul", [g[0], b]), a, y) if em.needs(a) else None,
            em.unbroadcast(em.op("Mul", [g[0], a]), b, y) if em.needs(b) else None]


@rule("Div")
def div(em, node, g):
    """Y = A / B: dA = dY / B, dB = -dY * Y / B (summed over broadcast axes)."""
    a, b = node.input
    y = node.output[0]
    return [em.unbroadcast(em.op("Div", [g[0], b]), a, y) if em.needs(a) else None,
            em.unbroadcast(em.op("Neg", [em.op("Div", [em.op("Mul", [g[0], y]), b])]), b, y)
            if em.needs(b) else None]


@rule("Pow")
def pow_(em, node, g):
    """Y = A ** B: dA = dY * B * A ** (B - 1), dB = dY * Y * log(A)."""
    a, b = node.input
    y = node.output[0]
    out = [None, None]
    if em.needs(a):
        bc = em.cast(b, em.dtype(a), em.dtype(b))
        da = em.op("Mul", [em.op("Mul", [g[0], bc]),
                           em.op("Pow", [a, em.op("Sub", [bc, em.const(1.0, em.dtype(a))])])])
        out[0] = em.unbroadcast(da, a, y)
    if em.needs(b):
        db = em.op("Mul", [em.op("Mul", [g[0], y]), em.op("Log", [a])])
        out[1] = em.unbroadcast(em.cast(db, em.dtype(b), em.dtype(a)), b, y)
    return out


@rule("Sum")
def sum_(em, node, g):
    """Y = sum(Xi): dXi = dY (summed over broadcast axes)."""
    return [em.unbroadcast(g[0], x, node.output[0]) if em.needs(x) else None for x in node.input]


@rule("Mean")
def mean_(em, node, g):
    """Y = mean(Xi): dXi = dY / n (summed over broadcast axes)."""
    d = em.op("Div", [g[0], em.like(float(len(node.input)), node.output[0])])
    return [em.unbroadcast(d, x, node.output[0]) if em.needs(x) else None for x in node.input]


@rule("Max", "Min")
def max_min(em, node, g):
    """Y = max/min(Xi): dXi = dY where Xi == Y (ties each get dY), summed over broadcast axes."""
    y = node.output[0]
    return [em.unbroadcast(_zero_where(em, em.op("Equal", [x, y]), g[0]), x, y) if em.needs(x) else None
            for x in node.input]


@rule("Where")
def where(em, node, g):
    """Y = C ? X : Z: dX = C ? dY : 0, dZ = C ? 0 : dY (summed over broadcast axes)."""
    c, x, z = node.input
    y = node.output[0]
    return [None,
            em.unbroadcast(_zero_where(em, c, g[0]), x, y) if em.needs(x) else None,
            em.unbroadcast(_zero_where(em, c, g[0], keep_when_true=False), z, y) if em.needs(z) else None]


@rule("Clip")
def clip(em, node, g):
    """Y = clip(X, lo, hi): dX = dY where lo <= X <= hi, else 0 (no gradient to lo/hi)."""
    x, lo, hi = _inputs(node, 3)
    conds = []
    if lo:
        conds.append(em.op("GreaterOrEqual", [x, lo]))
    if hi:
        conds.append(em.op("LessOrEqual", [x, hi]))
    if not conds:
        return [g[0]]
    cond = conds[0] if len(conds) == 1 else em.op("And", conds)
    return [_zero_where(em, cond, g[0])]


# --- unary elementwise ---------------------------------------------------------------------

@rule("Identity")
def identity(em, node, g):
    """Y = X: dX = dY."""
    return [g[0]]


@rule("Neg")
def neg(em, node, g):
    """Y = -X: dX = -dY."""
    return [em.op("Neg", [g[0]])]


@rule("Abs")
def abs_(em, node, g):
    """Y = |X|: dX = dY * sign(X)."""
    return [em.op("Mul", [g[0], em.op("Sign", [node.input[0]])])]


@rule("Relu")
def relu(em, node, g):
    """Y = max(X, 0): dX = dY where X > 0, else 0."""
    x = node.input[0]
    return [_zero_where(em, em.op("Greater", [x, em.like(0.0, x)]), g[0])]


@rule("LeakyRelu")
def leaky_relu(em, node, g):
    """Y = X if X > 0 else alpha*X: dX = dY if X > 0 else alpha*dY."""
    x = node.input[0]
    scaled = em.op("Mul", [g[0], em.like(attr(node, "alpha", 0.01), x)])
    return [em.op("Where", [em.op("Greater", [x, em.like(0.0, x)]), g[0], scaled])]


@rule("Sigmoid")
def sigmoid(em, node, g):
    """Y = 1/(1+exp(-X)): dX = dY * Y * (1 - Y)."""
    y = node.output[0]
    return [em.op("Mul", [g[0], em.op("Mul", [y, em.op("Sub", [em.like(1.0, y), y])])])]


@rule("Tanh")
def tanh(em, node, g):
    """Y = tanh(X): dX = dY * (1 - Y^2)."""
    y = node.output[0]
    return [em.op("Mul", [g[0], em.op("Sub", [em.like(1.0, y), em.op("Mul", [y, y])])])]


@rule("Exp")
def exp(em, node, g):
    """Y = exp(X): dX = dY * Y."""
    return [em.op("Mul", [g[0], node.output[0]])]


@rule("Log")
def log(em, node, g):
    """Y = log(X): dX = dY / X."""
    return [em.op("Div", [g[0], node.input[0]])]


@rule("Sqrt")
def sqrt(em, node, g):
    """Y = sqrt(X): dX = dY * 0.5 / Y."""
    y = node.output[0]
    return [em.op("Div", [em.op("Mul", [g[0], em.like(0.5, y)]), y])]


@rule("Reciprocal")
def reciprocal(em, node, g):
    """Y = 1/X: dX = -dY * Y^2."""
    y = node.output[0]
    return [em.op("Neg", [em.op("Mul", [g[0], em.op("Mul", [y, y])])])]


def _erf_slope(em, x):
    """d erf(x)/dx = 2/sqrt(pi) * exp(-x^2), in x's dtype."""
    return em.op("Mul", [em.like(2.0 / math.sqrt(math.pi), x),
                         em.op("Exp", [em.op("Neg", [em.op("Mul", [x, x])])])])


@rule("Erf")
def erf(em, node, g):
    """Y = erf(X): dX = dY * 2/sqrt(pi) * exp(-X^2)."""
    return [em.op("Mul", [g[0], _erf_slope(em, node.input[0])])]


@rule("Gelu")
def gelu(em, node, g):
    """Y = X*Phi(X): dX = dY*(Phi(X) + X*phi(X)); tanh form: Y = X/2*(1+tanh(u)),
    u = sqrt(2/pi)(X + 0.044715 X^3), dX = dY*(0.5(1+t) + 0.5 X (1-t^2) du/dX)."""
    x = node.input[0]
    c = lambda v: em.like(v, x)  # noqa: E731
    mul = lambda a, b: em.op("Mul", [a, b])  # noqa: E731
    if attr(node, "approximate", "none") in ("tanh", b"tanh"):
        k = math.sqrt(2.0 / math.pi)
        x2 = mul(x, x)
        u = mul(c(k), em.op("Add", [x, mul(c(0.044715), mul(x2, x))]))
        t = em.op("Tanh", [u])
        du = mul(c(k), em.op("Add", [c(1.0), mul(c(3 * 0.044715), x2)]))
        slope = em.op("Add", [mul(c(0.5), em.op("Add", [c(1.0), t])),
                              mul(mul(c(0.5), x), mul(em.op("Sub", [c(1.0), mul(t, t)]), du))])
    else:
        cdf = mul(c(0.5), em.op("Add", [c(1.0), em.op("Erf", [mul(x, c(1.0 / math.sqrt(2.0)))])]))
        pdf = mul(c(1.0 / math.sqrt(2.0 * math.pi)), em.op("Exp", [mul(mul(x, x), c(-0.5))]))
        slope = em.op("Add", [cdf, mul(x, pdf)])
    return [mul(g[0], slope)]


@rule("Cast", "CastLike")
def cast(em, node, g):
    """Y = cast(X): dX = cast(dY) back to X's float type; integer X gets none."""
    x = node.input[0]
    dt = em.dtype(x)
    if dt not in FLOAT_TYPES:
        return [None]
    return [em.cast(g[0], dt, em.dtype(node.output[0]))]


@rule("Dropout", outputs=(0,))
def dropout(em, node, g):
    """Y = X * mask / (1 - ratio) in training mode (else Y = X): dX = dY * mask / (1 - ratio)."""
    x, ratio, training = _inputs(node, 3)
    on = False
    if training:
        v = em.const_value(training)
        on = True if v is None else bool(v)
    if not on:
        return [g[0]]
    if len(node.output) < 2 or not node.output[1]:
        raise GraphmpError(f"node '{node.name}' (Dropout in training mode) has no mask output; run "
                           "graphmp.train.autodiff.training_forward(model) first, which adds it")
    r = em.const_value(ratio) if ratio else np.array(0.5)
    if r is not None:
        scale = em.like(1.0 / (1.0 - float(r)) if float(r) < 1 else 0.0, x)
    else:
        scale = em.op("Div", [em.like(1.0, x), em.op("Sub", [em.like(1.0, x), em.cast(ratio, em.dtype(x))])])
    mask = em.cast(node.output[1], em.dtype(x))
    return [em.op("Mul", [em.op("Mul", [g[0], mask]), scale])]


# --- linear algebra ----------------------------------------------------------------------------

@rule("MatMul")
def matmul(em, node, g):
    """Y = A @ B (numpy batching, 1-D operands promoted): dA = dY @ B^T, dB = A^T @ dY,
    summed over broadcast batch axes."""
    a, b = node.input
    gy = g[0]
    ra, rb = em.rank(a), em.rank(b)
    ad, bd, yd = em.dims(a), em.dims(b), em.dims(node.output[0])
    ga = gb = None
    if ra == 1 and rb == 1:
        ga = em.op("Mul", [gy, b]) if em.needs(a) else None
        gb = em.op("Mul", [gy, a]) if em.needs(b) else None
    elif ra == 1:  # a [K], b [..., K, N], y [..., N]
        g2 = em.unsqueeze(gy, [-2])
        if em.needs(a):
            ga = em.unbroadcast(em.op("MatMul", [g2, _swap_last2(em, b, rb)]), a,
                                _cat(yd[:-1] if yd else None, [1, ad[0]]))
        if em.needs(b):
            gb = em.unbroadcast(em.op("MatMul", [em.unsqueeze(a, [-1]), g2]), b,
                                _cat(yd[:-1] if yd else None, [ad[0], yd[-1] if yd else None]))
    elif rb == 1:  # a [..., M, K], b [K], y [..., M]
        g2 = em.unsqueeze(gy, [-1])
        if em.needs(a):
            ga = em.unbroadcast(em.op("MatMul", [g2, em.unsqueeze(b, [0])]), a, _cat(yd, [bd[0]]))
        if em.needs(b):
            gb = em.unbroadcast(em.squeeze(em.op("MatMul", [_swap_last2(em, a, ra), g2]), [-1]), b,
                                _cat(yd[:-1] if yd else None, [bd[0]]))
    else:
        if em.needs(a):
            ga = em.unbroadcast(em.op("MatMul", [gy, _swap_last2(em, b, rb)]), a,
                                _cat(yd[:-1] if yd else None, [ad[-1]]))
        if em.needs(b):
            gb = em.unbroadcast(em.op("MatMul", [_swap_last2(em, a, ra), gy]), b,
                                _cat(yd[:-2] if yd else None, [ad[-1], yd[-1] if yd else None]))
    return [ga, gb]


@rule("Gemm")
def gemm(em, node, g):
    """Y = alpha * A' @ B' + beta * C (A' = A^T if transA ...): dA' = alpha dY B'^T,
    dB' = alpha A'^T dY, dC = beta dY summed over broadcast axes."""
    a, b, c = _inputs(node, 3)
    gy = g[0]
    alpha, beta = attr(node, "alpha", 1.0), attr(node, "beta", 1.0)
    ta, tb = attr(node, "transA", 0), attr(node, "transB", 0)
    out = [None, None, None]
    if em.needs(a):
        out[0] = (em.op("Gemm", [gy, b], alpha=alpha, transB=1 - tb) if not ta
                  else em.op("Gemm", [b, gy], alpha=alpha, transA=tb, transB=1))
    if em.needs(b):
        out[1] = (em.op("Gemm", [a, gy], alpha=alpha, transA=1 - ta) if not tb
                  else em.op("Gemm", [gy, a], alpha=alpha, transA=1, transB=ta))
    if c and em.needs(c):
        gc = gy if beta == 1.0 else em.op("Mul", [gy, em.like(beta, c)])
        out[2] = em.unbroadcast(gc, c, node.output[0])
    return out


# --- convolution and pooling ------------------------------------------------------------------

def _spatial_attrs(em: Emitter, node, x: str, kernel: list[int]):
    """(strides, dilations, pads [begins..., ends...]) with auto_pad resolved (static shapes)."""
    sp = len(kernel)
    strides = list(attr(node, "strides", [1] * sp))
    dil = list(attr(node, "dilations", [1] * sp))
    auto = attr(node, "auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("NOTSET", ""):
        return strides, dil, list(attr(node, "pads", [0] * (2 * sp)))
    if auto == "VALID":
        return strides, dil, [0] * (2 * sp)
    shape = em.static_shape(x)
    if shape is None:
        raise GraphmpError(f"node '{node.name}' ({node.op_type}): auto_pad={auto} needs a static input "
                           "shape to differentiate; give explicit pads or fix the input shape")
    begins, ends = [], []
    for i in range(sp):
        size = shape[2 + i]
        out = -(-size // strides[i])
        total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - size)
        small, big = total // 2, total - total // 2
        begins.append(small if auto == "SAME_UPPER" else big)
        ends.append(big if auto == "SAME_UPPER" else small)
    return strides, dil, begins + ends


def _conv_input_grad(em: Emitter, gy: str, w: str, x: str, strides, dil, pads, group) -> str:
    """Adjoint of Conv(X, W) w.r.t. X: ConvTranspose of dY with W (no pads, so every
    position is produced), zero-extended and cropped to X's window [pad_begin, +size)."""
    sp = len(strides)
    full = em.op("ConvTranspose", [gy, w], strides=strides, dilations=dil, group=group)
    # full length s*(o-1)+d*(k-1)+1 >= pad_begin + size - (s-1): extending by s always suffices
    padded = em.op("Pad", [full, em.ints([0] * (2 + sp) + [0, 0] + list(strides))])
    starts = em.ints(pads[:sp])
    ends = em.op("Add", [starts, em.spatial_shape(x)])
    return em.op("Slice", [padded, starts, ends, em.ints(range(2, 2 + sp))])


def _conv_weight_grad(em: Emitter, inp: str, gout: str, group: int, per_group_in: int, gout_ch: int,
                      kernel: list[int], strides, dil, pads) -> str:
    """R[c, i, k] = sum_{n,o} gout[n, c, o] * inp_padded[n, g(c)*per_group_in + i, o*s + k*d]:
    one Conv with batch and channels swapped (strides <-> dilations), shaped
    [gout_ch, per_group_in, *kernel]. This is dW of Conv(inp) -> gout, and of ConvTranspose."""
    sp = len(kernel)
    rank = 2 + sp
    if group == 1:
        lhs = em.transpose(inp, [1, 0] + list(range(2, rank)))
        filt = em.transpose(gout, [1, 0] + list(range(2, rank)))
    else:
        per_out = gout_ch // group
        split_in = em.op("Reshape", [inp, em.op("Concat", [em.ints([0, group, per_group_in]),
                                                           em.spatial_shape(inp)], axis=0)])
        lhs = em.op("Reshape", [em.transpose(split_in, [2, 1, 0] + list(range(3, rank + 1))),
                                em.op("Concat", [em.ints([per_group_in, -1]), em.spatial_shape(inp)], axis=0)])
        split_out = em.op("Reshape", [gout, em.op("Concat", [em.ints([0, group, per_out]),
                                                             em.spatial_shape(gout)], axis=0)])
        filt = em.op("Reshape", [em.transpose(split_out, [1, 2, 0] + list(range(3, rank + 1))),
                                 em.op("Concat", [em.ints([gout_ch, -1]), em.spatial_shape(gout)], axis=0)])
    r = em.op("Conv", [lhs, filt], strides=list(dil), dilations=list(strides), pads=list(pads), group=group)
    r = em.op("Slice", [r, em.ints([0] * sp), em.ints(kernel), em.ints(range(2, rank))])
    return em.transpose(r, [1, 0] + list(range(2, rank)))


def _weight_shape(em, node, w):
    shape = em.static_shape(w)
    if shape is None:
        raise GraphmpError(f"node '{node.name}' ({node.op_type}): the weight '{w}' needs a static shape "
                           "to differentiate")
    return shape


@rule("Conv")
def conv(em, node, g):
    """Y = conv(X, W) + B: dX = ConvTranspose(dY, W) cropped to X, dW = Conv of X (batch as
    channels) with dY as filters, dB = sum of dY over N and spatial axes."""
    x, w, b = _inputs(node, 3)
    wshape = _weight_shape(em, node, w)
    kernel = list(attr(node, "kernel_shape", wshape[2:]))
    strides, dil, pads = _spatial_attrs(em, node, x, kernel)
    group = attr(node, "group", 1)
    gy = g[0]
    sp = len(kernel)
    return [_conv_input_grad(em, gy, w, x, strides, dil, pads, group) if em.needs(x) else None,
            _conv_weight_grad(em, x, gy, group, wshape[1], wshape[0], kernel, strides, dil, pads)
            if em.needs(w) else None,
            em.reduce("ReduceSum", gy, [0] + list(range(2, 2 + sp)), keepdims=0) if b and em.needs(b) else None]


@rule("ConvTranspose")
def conv_transpose(em, node, g):
    """Y = convT(X, W) + B: dX = Conv(dY, W) (same strides, pads, dilations, group),
    dW = Conv of dY (batch as channels) with X as filters, dB = sum of dY."""
    x, w, b = _inputs(node, 3)
    if attr(node, "output_shape") is not None or attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise GraphmpError(f"node '{node.name}' (ConvTranspose): output_shape / auto_pad are not "
                           "differentiated; export with explicit pads and output_padding")
    wshape = _weight_shape(em, node, w)
    kernel = list(attr(node, "kernel_shape", wshape[2:]))
    sp = len(kernel)
    strides = list(attr(node, "strides", [1] * sp))
    dil = list(attr(node, "dilations", [1] * sp))
    pads = list(attr(node, "pads", [0] * (2 * sp)))
    group = attr(node, "group", 1)
    gy = g[0]
    return [em.op("Conv", [gy, w], strides=strides, dilations=dil, pads=pads, group=group) if em.needs(x) else None,
            _conv_weight_grad(em, gy, x, group, wshape[1], wshape[0], kernel, strides, dil, pads)
            if em.needs(w) else None,
            em.reduce("ReduceSum", gy, [0] + list(range(2, 2 + sp)), keepdims=0) if b and em.needs(b) else None]


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


@rule("MaxPool", outputs=(0,))
def max_pool(em, node, g):
    """Y = window max: dX = dY added (ScatterElements, reduction add) at the argmax Indices,
    so overlapping windows accumulate."""
    x = node.input[0]
    if em.opset < 16:
        raise GraphmpError(f"node '{node.name}' (MaxPool): its gradient needs ScatterElements with "
                           f"reduction='add' (opset >= 16); the model has opset {em.opset}")
    if len(node.output) > 1 and node.output[1] and attr(node, "storage_order", 0) == 0:
        idx = node.output[1]
    else:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name != "storage_order"}
        idx = em.op("MaxPool", [x], outputs=2, **attrs)[1]
    # ONNX says Indices count over the whole tensor (ORT does); onnx.reference counts within
    # each (n, c) plane. Index = (Indices mod plane) + plane * (n*C + c) is right for both.
    rank = em.rank(x)
    nc = em.op("Mul", [em.dim(x, 0), em.dim(x, 1)])
    plane = em.op("Div", [em.op("Size", [x]), nc])
    base = em.op("Mul", [em.op("Range", [em.const(0, TensorProto.INT64), em.op("Reshape", [nc, em.ints([])]),
                                         em.const(1, TensorProto.INT64)]), plane])
    lead = em.op("Slice", [em.shape_tensor(x), em.ints([0]), em.ints([2])])
    base = em.op("Reshape", [base, em.op("Concat", [lead, em.ints([1] * (rank - 2))], axis=0)])
    flat = em.op("Add", [em.op("Mod", [idx, plane]), base])
    return [_flat_scatter(em, x, flat, g[0], "add")]


@rule("AveragePool")
def average_pool(em, node, g):
    """Y = window mean: dX = ConvTranspose of dY / count with a ones kernel per channel
    (group = C), cropped to X; count = window size, or the real elements without pads."""
    x = node.input[0]
    kernel = list(attr(node, "kernel_shape"))
    strides, dil, pads = _spatial_attrs(em, node, x, kernel)
    dims = em.dims(x)
    if attr(node, "ceil_mode", 0):
        raise GraphmpError(f"node '{node.name}' (AveragePool): ceil_mode=1 is not differentiated")
    if not dims or not isinstance(dims[1], int):
        raise GraphmpError(f"node '{node.name}' (AveragePool): the channel count of '{x}' must be static")
    dt, c = em.dtype(x), dims[1]
    if attr(node, "count_include_pad", 0) or not any(pads):
        gdiv = em.op("Div", [g[0], em.like(float(np.prod(kernel)), x)])
    else:
        ones = em.op("ConstantOfShape", [em.op("Concat", [em.ints([1, 1]), em.spatial_shape(x)], axis=0)],
                     value=helper.make_tensor("one", dt, [1], [1]))
        count = em.op("Conv", [ones, em.const(np.ones([1, 1] + kernel), dt)], strides=strides,
                      dilations=dil, pads=pads)
        gdiv = em.op("Div", [g[0], count])
    w = em.const(np.ones([c, 1] + kernel), dt)
    return [_conv_input_grad(em, gdiv, w, x, strides, dil, pads, c)]


@rule("GlobalAveragePool")
def global_average_pool(em, node, g):
    """Y = mean over spatial axes: dX = dY / (H*W...) broadcast to X."""
    x = node.input[0]
    return [em.expand_like(em.op("Div", [g[0], _count_ratio(em, x, node.output[0], em.dtype(x))]), x)]


# --- normalisation, softmax, losses -------------------------------------------------------------

@rule("Softmax")
def softmax(em, node, g):
    """Y = softmax(X, axis): dX = Y * (dY - sum(dY * Y, axis))."""
    y = node.output[0]
    axis = attr(node, "axis", -1)
    s = em.reduce("ReduceSum", em.op("Mul", [g[0], y]), [axis], keepdims=1)
    return [em.op("Mul", [y, em.op("Sub", [g[0], s])])]


@rule("LogSoftmax")
def log_softmax(em, node, g):
    """Y = log softmax(X, axis): dX = dY - exp(Y) * sum(dY, axis)."""
    y = node.output[0]
    axis = attr(node, "axis", -1)
    s = em.reduce("ReduceSum", g[0], [axis], keepdims=1)
    return [em.op("Sub", [g[0], em.op("Mul", [em.op("Exp", [y]), s])])]


@rule("LayerNormalization", outputs=(0,))
def layer_norm(em, node, g):
    """Y = xhat * scale + B, xhat = (X - mean) * invstd over axes [axis, rank): dB = sum dY,
    dscale = sum dY * xhat, dX = invstd * (d - mean(d) - xhat * mean(d * xhat)), d = dY * scale.
    Computed in stash_type (FP32) like the forward."""
    x, scale, b = _inputs(node, 3)
    rank = em.rank(x)
    axis = attr(node, "axis", -1) % rank
    axes = list(range(axis, rank))
    eps = attr(node, "epsilon", 1e-5)
    cdt = attr(node, "stash_type", TensorProto.FLOAT)
    xdt, sdt = em.dtype(x), em.dtype(scale)
    cdt = cdt if xdt != TensorProto.DOUBLE else TensorProto.DOUBLE
    xf = em.cast(x, cdt, xdt)
    outs = list(node.output) + ["", ""]
    mean = em.cast(outs[1], cdt, em.dtype(outs[1])) if outs[1] else em.reduce("ReduceMean", xf, axes, keepdims=1)
    centred = em.op("Sub", [xf, mean])
    if outs[2]:
        inv = em.cast(outs[2], cdt, em.dtype(outs[2]))
    else:
        var = em.reduce("ReduceMean", em.op("Mul", [centred, centred]), axes, keepdims=1)
        inv = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [var, em.const(eps, cdt)])])])
    xhat = em.op("Mul", [centred, inv])
    gf = em.cast(g[0], cdt, xdt)
    y = node.output[0]
    out = [None, None, None]
    if em.needs(scale):
        out[1] = em.cast(em.unbroadcast(em.op("Mul", [gf, xhat]), scale, y), sdt, cdt)
    if b and em.needs(b):
        out[2] = em.unbroadcast(g[0], b, y)
    if em.needs(x):
        d = em.op("Mul", [gf, em.cast(scale, cdt, sdt)])
        m1 = em.reduce("ReduceMean", d, axes, keepdims=1)
        m2 = em.reduce("ReduceMean", em.op("Mul", [d, xhat]), axes, keepdims=1)
        gx = em.op("Mul", [inv, em.op("Sub", [em.op("Sub", [d, m1]), em.op("Mul", [xhat, m2])])])
        out[0] = em.cast(gx, xdt, cdt)
    return out


@rule("BatchNormalization", outputs=(0,))
def batch_norm(em, node, g):
    """Y = scale * (X - mean) * invstd + B with fixed (running) statistics: dX = dY * scale *
    invstd, dscale = sum dY * (X - mean) * invstd, dB = sum dY (no gradient to the statistics;
    for batch statistics run training_forward first)."""
    x, scale, b, mean, var = node.input[:5]
    if attr(node, "training_mode", 0):
        raise GraphmpError(f"node '{node.name}' (BatchNormalization training_mode=1): run "
                           "graphmp.train.autodiff.training_forward(model) first, which decomposes it")
    rank = em.rank(x)
    chan = [0] + list(range(2, rank))
    xdt, pdt = em.dtype(x), em.dtype(scale)
    inv = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [em.cast(var, pdt, em.dtype(var)),
                                                            em.const(attr(node, "epsilon", 1e-5), pdt)])])])
    out = [None] * 5
    if em.needs(x):
        out[0] = em.op("Mul", [g[0], em.cast(em.unsqueeze(em.op("Mul", [scale, inv]), chan), xdt, pdt)])
    gf = em.cast(g[0], pdt, xdt)
    if em.needs(scale):
        xhat = em.op("Mul", [em.op("Sub", [em.cast(x, pdt, xdt),
                                           em.unsqueeze(em.cast(mean, pdt, em.dtype(mean)), chan)]),
                             em.unsqueeze(inv, chan)])
        out[1] = em.reduce("ReduceSum", em.op("Mul", [gf, xhat]), chan, keepdims=0)
    if em.needs(b):
        out[2] = em.cast(em.reduce("ReduceSum", gf, chan, keepdims=0), em.dtype(b), pdt)
    return out


def _nll_grad(em: Emitter, node, g: str, probs: str | None, logits_like: str) -> str:
    """Gradient of the weighted negative log-likelihood w.r.t. its log-probability input
    (probs None) or, for softmax cross-entropy, w.r.t. the scores (probs = softmax):
    (probs - onehot) * coeff, or -onehot * coeff; coeff = dY * w_i [/ sum w]."""
    labels, weights = _inputs(node, 3)[1:3]
    if weights and em.needs(weights):
        raise GraphmpError(f"node '{node.name}' ({node.op_type}): the class weights '{weights}' depend on "
                           "a differentiated tensor; they get no gradient (make them a constant)")
    dt = em.dtype(logits_like)
    rank = em.rank(logits_like)
    reduction = attr(node, "reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    ignore = attr(node, "ignore_index")
    lab = em.cast(labels, TensorProto.INT64, em.dtype(labels))
    valid = None
    if ignore is not None:
        valid = em.op("Not", [em.op("Equal", [lab, em.const(ignore, TensorProto.INT64)])])
        lab = em.op("Where", [valid, lab, em.const(0, TensorProto.INT64)])
    classes = em.op("Range", [em.const(0, TensorProto.INT64),
                              em.op("Reshape", [em.dim(logits_like, 1), em.ints([])]),
                              em.const(1, TensorProto.INT64)])
    classes = em.op("Reshape", [classes, em.ints([1, -1] + [1] * (rank - 2))])
    onehot = em.op("Cast", [em.op("Equal", [em.unsqueeze(lab, [1]), classes])], to=dt)
    w = em.op("Gather", [weights, lab], axis=0) if weights else None
    if valid is not None:
        vf = em.op("Cast", [valid], to=dt)
        w = vf if w is None else em.op("Mul", [w, vf])
    coeff = g
    if reduction == "mean":
        denom = (em.op("ReduceSum", [w], keepdims=0) if w is not None
                 else em.op("Cast", [em.op("Size", [lab])], to=dt))
        coeff = em.op("Div", [coeff, denom])
    elif reduction not in ("sum", "none"):
        raise GraphmpError(f"node '{node.name}' ({node.op_type}): unknown reduction '{reduction}'")
    if w is not None:
        coeff = em.op("Mul", [coeff, w])
    if w is not None or reduction == "none":
        coeff = em.unsqueeze(coeff, [1])
    base = em.op("Sub", [probs, onehot]) if probs else em.op("Neg", [onehot])
    return em.op("Mul", [base, coeff])


@rule("SoftmaxCrossEntropyLoss", outputs=(0,))
def softmax_cross_entropy(em, node, g):
    """L = -w_y log softmax(S, axis=1)_y (reduced mean/sum/none): dS = (softmax(S) - onehot(y))
    * dL * w_y [/ sum of w]; ignore_index rows get 0; no gradient to labels or weights."""
    scores = node.input[0]
    logp = node.output[1] if len(node.output) > 1 and node.output[1] else \
        em.op("LogSoftmax", [scores], axis=1)
    probs = em.op("Exp", [logp])
    return [_nll_grad(em, node, g[0], probs, scores), None, None]


@rule("NegativeLogLikelihoodLoss")
def nll_loss(em, node, g):
    """L = -w_y X_y (reduced mean/sum/none): dX = -onehot(y) * dL * w_y [/ sum of w]."""
    return [_nll_grad(em, node, g[0], None, node.input[0]), None, None]


# --- reductions ----------------------------------------------------------------------------------

def _reduce_grad(em: Emitter, node, g: str) -> str:
    """dY of a Reduce* brought back to X's rank (Unsqueeze when keepdims=0) and broadcast."""
    x = node.input[0]
    keep = attr(node, "keepdims", 1)
    axes = attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        v = em.const_value(node.input[1])
        if v is None:
            if keep:
                return em.expand_like(g, x)
            raise GraphmpError(f"node '{node.name}' ({node.op_type}): axes computed at run time with "
                               "keepdims=0 cannot be differentiated; use constant axes")
        axes = [int(a) for a in v.reshape(-1)]
    if not axes:
        if attr(node, "noop_with_empty_axes", 0):
            return g
        return em.expand_like(g, x)  # all axes: dY has one element
    if not keep:
        rank = em.rank(x)
        g = em.unsqueeze(g, sorted(a % rank for a in axes))
    return em.expand_like(g, x)


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


# --- data movement -------------------------------------------------------------------------------

@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape(em, node, g):
    """Y = X with another shape: dX = dY reshaped to X's shape."""
    return [em.reshape_like(g[0], node.input[0])]


@rule("Expand")
def expand(em, node, g):
    """Y = broadcast X to a shape: dX = dY summed over the broadcast axes."""
    return [em.unbroadcast(g[0], node.input[0], node.output[0]), None]


@rule("Transpose")
def transpose(em, node, g):
    """Y = transpose(X, perm): dX = transpose(dY, inverse perm)."""
    perm = attr(node, "perm")
    if perm is None:
        perm = list(range(em.rank(node.input[0])))[::-1]
    return [em.transpose(g[0], list(np.argsort(perm)))]


@rule("Concat")
def concat(em, node, g):
    """Y = concat(Xi, axis): dXi = the part of dY that Xi occupies (Split)."""
    axis = attr(node, "axis")
    sizes = em.op("Concat", [em.dim(x, axis) for x in node.input], axis=0)
    parts = em.op("Split", [g[0], sizes], outputs=len(node.input), axis=axis)
    parts = parts if isinstance(parts, list) else [parts]
    return [p if em.needs(x) else None for p, x in zip(parts, node.input)]


@rule("Split", outputs=None)
def split(em, node, g):
    """Yi = parts of X along axis: dX = concat(dYi) with zeros for parts without gradient."""
    parts = []
    for y, gy in zip(node.output, g):
        parts.append(gy if gy is not None else em.op(
            "ConstantOfShape", [em.shape(y)], value=helper.make_tensor("zero", em.dtype(y), [1], [0])))
    return [em.op("Concat", parts, axis=attr(node, "axis", 0)) if len(parts) > 1 else parts[0]]


@rule("Slice")
def slice_(em, node, g):
    """Y = X[starts:ends:steps]: dX = zeros with dY placed at the positions the slice selects
    (the same Slice applied to an iota of X gives those positions)."""
    x = node.input[0]
    iota = em.op("Reshape", [em.op("Range", [em.const(0, TensorProto.INT64), em.op("Size", [x]),
                                             em.const(1, TensorProto.INT64)]), em.shape_tensor(x)])
    picked = em.op("Slice", [iota] + list(node.input[1:]))
    return [_flat_scatter(em, x, picked, g[0], None)]


@rule("Gather")
def gather(em, node, g):
    """Y = take(X, idx, axis): dX = zeros with dY rows added at idx (ScatterND, reduction add;
    repeated indices accumulate), axis moved to the front and back."""
    x, ind = node.input
    if em.opset < 16:
        raise GraphmpError(f"node '{node.name}' (Gather): its gradient needs ScatterND with "
                           f"reduction='add' (opset >= 16); the model has opset {em.opset}")
    r, q = em.rank(x), em.rank(ind)
    axis = attr(node, "axis", 0) % r
    front = [axis] + [i for i in range(r) if i != axis]
    gperm = list(range(axis, axis + q)) + list(range(axis)) + list(range(axis + q, r - 1 + q))
    idx = em.cast(ind, TensorProto.INT64, em.dtype(ind))
    size = em.op("Reshape", [em.dim(x, axis), em.ints([])])
    idx = em.op("Where", [em.op("Less", [idx, em.const(0, TensorProto.INT64)]), em.op("Add", [idx, size]), idx])
    dt = em.dtype(x)
    acc = _acc_type(dt)
    zeros = em.op("ConstantOfShape", [em.op("Gather", [em.shape_tensor(x), em.ints(front)], axis=0)],
                  value=helper.make_tensor("zero", acc, [1], [0]))
    scat = em.op("ScatterND", [zeros, em.unsqueeze(idx, [-1]), em.transpose(em.cast(g[0], acc, dt), gperm)],
                 reduction="add")
    return [em.cast(em.transpose(scat, list(np.argsort(front))), dt, acc), None]

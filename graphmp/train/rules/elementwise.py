"""Gradient rules of elementwise ops: arithmetic, activations, casts, Dropout."""
from __future__ import annotations

import math

import numpy as np

from ...errors import GraphmpError
from ...policy import FLOAT_TYPES
from ..emitter import attr, rule, zero_grad
from .common import _inputs, _is_extreme, _zero_where


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
    """Y = max/min(Xi): dXi = dY where Xi == Y (ties each get dY), summed over broadcast axes.
    In FP16/BF16, Xi == Y tolerates the type's rounding (common._is_extreme)."""
    y = node.output[0]
    return [em.unbroadcast(_zero_where(em, _is_extreme(em, x, y), g[0]), x, y) if em.needs(x) else None
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



# --- activations ---------------------------------------------------------------------------------

def _positive(em, x):
    return em.op("Greater", [x, em.like(0.0, x)])


@rule("HardSigmoid")
def hard_sigmoid(em, node, g):
    """Y = max(0, min(1, alpha*X + beta)): dX = alpha*dY where 0 < alpha*X + beta < 1, else 0."""
    x = node.input[0]
    alpha, beta = attr(node, "alpha", 0.2), attr(node, "beta", 0.5)
    t = em.op("Add", [em.op("Mul", [x, em.like(alpha, x)]), em.like(beta, x)])
    inside = em.op("And", [em.op("Greater", [t, em.like(0.0, x)]), em.op("Less", [t, em.like(1.0, x)])])
    return [em.op("Mul", [_zero_where(em, inside, g[0]), em.like(alpha, x)])]


@rule("HardSwish")
def hard_swish(em, node, g):
    """Y = X * max(0, min(1, X/6 + 1/2)): dX = 0 for X < -3, dY for X > 3, else dY*(X/3 + 1/2)."""
    x = node.input[0]
    slope = em.op("Add", [em.op("Mul", [x, em.like(1.0 / 3.0, x)]), em.like(0.5, x)])
    slope = em.op("Where", [em.op("Greater", [x, em.like(3.0, x)]), em.like(1.0, x), slope])
    slope = em.op("Where", [em.op("Less", [x, em.like(-3.0, x)]), em.like(0.0, x), slope])
    return [em.op("Mul", [g[0], slope])]


@rule("Elu")
def elu(em, node, g):
    """Y = X if X > 0 else alpha*(exp(X) - 1): dX = dY if X > 0 else dY*(Y + alpha)."""
    x, y = node.input[0], node.output[0]
    neg = em.op("Mul", [g[0], em.op("Add", [y, em.like(attr(node, "alpha", 1.0), y)])])
    return [em.op("Where", [_positive(em, x), g[0], neg])]


@rule("Selu")
def selu(em, node, g):
    """Y = gamma*X if X > 0 else gamma*alpha*(exp(X) - 1): dX = gamma*dY if X > 0 else
    dY*(Y + gamma*alpha)."""
    x, y = node.input[0], node.output[0]
    alpha, gamma = attr(node, "alpha", 1.67326319217681884765625), attr(node, "gamma", 1.05070102214813232421875)
    neg = em.op("Mul", [g[0], em.op("Add", [y, em.like(alpha * gamma, y)])])
    return [em.op("Where", [_positive(em, x), em.op("Mul", [g[0], em.like(gamma, x)]), neg])]


@rule("Celu")
def celu(em, node, g):
    """Y = max(0, X) + min(0, alpha*(exp(X/alpha) - 1)): dX = dY if X > 0 else dY*exp(X/alpha)."""
    x = node.input[0]
    alpha = attr(node, "alpha", 1.0)
    neg = em.op("Mul", [g[0], em.op("Exp", [em.op("Div", [x, em.like(alpha, x)])])])
    return [em.op("Where", [_positive(em, x), g[0], neg])]


@rule("PRelu")
def prelu(em, node, g):
    """Y = X if X > 0 else slope*X (slope broadcast to X): dX = dY if X > 0 else slope*dY,
    dslope = dY*X where X <= 0, summed over the axes slope was broadcast along."""
    x, slope = node.input
    y = node.output[0]
    pos = _positive(em, x)
    out = [None, None]
    if em.needs(x):
        out[0] = em.op("Where", [pos, g[0], em.op("Mul", [g[0], slope])])
    if em.needs(slope):
        out[1] = em.unbroadcast(em.op("Mul", [_zero_where(em, pos, g[0], keep_when_true=False), x]), slope, y)
    return out


@rule("ThresholdedRelu")
def thresholded_relu(em, node, g):
    """Y = X if X > alpha else 0: dX = dY where X > alpha, else 0."""
    x = node.input[0]
    return [_zero_where(em, em.op("Greater", [x, em.like(attr(node, "alpha", 1.0), x)]), g[0])]


@rule("Softplus")
def softplus(em, node, g):
    """Y = log(1 + exp(X)): dX = dY * sigmoid(X)."""
    return [em.op("Mul", [g[0], em.op("Sigmoid", [node.input[0]])])]


@rule("Softsign")
def softsign(em, node, g):
    """Y = X / (1 + |X|): dX = dY / (1 + |X|)^2."""
    x = node.input[0]
    d = em.op("Add", [em.like(1.0, x), em.op("Abs", [x])])
    return [em.op("Div", [g[0], em.op("Mul", [d, d])])]


@rule("Mish")
def mish(em, node, g):
    """Y = X * tanh(softplus(X)): dX = dY * (t + X * sigmoid(X) * (1 - t^2)), t = tanh(softplus(X))."""
    x = node.input[0]
    t = em.op("Tanh", [em.op("Softplus", [x])])
    sech2 = em.op("Sub", [em.like(1.0, x), em.op("Mul", [t, t])])
    slope = em.op("Add", [t, em.op("Mul", [em.op("Mul", [x, em.op("Sigmoid", [x])]), sech2])])
    return [em.op("Mul", [g[0], slope])]



@rule("Shrink")
def shrink(em, node, g):
    """Y = X - bias if X > lambd, X + bias if X < -lambd, else 0: dX = dY where |X| > lambd."""
    x = node.input[0]
    return [_zero_where(em, em.op("Greater", [em.op("Abs", [x]), em.like(attr(node, "lambd", 0.5), x)]), g[0])]

# --- trigonometric and hyperbolic ------------------------------------------------------------------

@rule("Sin")
def sin(em, node, g):
    """Y = sin(X): dX = dY * cos(X)."""
    return [em.op("Mul", [g[0], em.op("Cos", [node.input[0]])])]


@rule("Cos")
def cos(em, node, g):
    """Y = cos(X): dX = -dY * sin(X)."""
    return [em.op("Neg", [em.op("Mul", [g[0], em.op("Sin", [node.input[0]])])])]


@rule("Tan")
def tan(em, node, g):
    """Y = tan(X): dX = dY * (1 + Y^2)."""
    y = node.output[0]
    return [em.op("Mul", [g[0], em.op("Add", [em.like(1.0, y), em.op("Mul", [y, y])])])]


@rule("Atan")
def atan(em, node, g):
    """Y = atan(X): dX = dY / (1 + X^2)."""
    x = node.input[0]
    return [em.op("Div", [g[0], em.op("Add", [em.like(1.0, x), em.op("Mul", [x, x])])])]


@rule("Sinh")
def sinh(em, node, g):
    """Y = sinh(X): dX = dY * cosh(X)."""
    return [em.op("Mul", [g[0], em.op("Cosh", [node.input[0]])])]


@rule("Cosh")
def cosh(em, node, g):
    """Y = cosh(X): dX = dY * sinh(X)."""
    return [em.op("Mul", [g[0], em.op("Sinh", [node.input[0]])])]



@rule("Swish")
def swish(em, node, g):
    """Y = X * sigmoid(alpha X): dX = dY * (s + alpha X s (1 - s)), s = sigmoid(alpha X)."""
    x = node.input[0]
    ax = em.op("Mul", [x, em.like(attr(node, "alpha", 1.0), x)])
    s = em.op("Sigmoid", [ax])
    slope = em.op("Add", [s, em.op("Mul", [em.op("Mul", [ax, s]), em.op("Sub", [em.like(1.0, x), s])])])
    return [em.op("Mul", [g[0], slope])]


def _inv_sqrt_slope(em, x, sign_x2: float, const: float):
    """1 / sqrt(sign_x2 * X^2 + const), in X's dtype."""
    inner = em.op("Add", [em.op("Mul", [em.op("Mul", [x, x]), em.like(sign_x2, x)]), em.like(const, x)])
    return em.op("Reciprocal", [em.op("Sqrt", [inner])])


@rule("Asin")
def asin(em, node, g):
    """Y = asin(X): dX = dY / sqrt(1 - X^2)."""
    return [em.op("Mul", [g[0], _inv_sqrt_slope(em, node.input[0], -1.0, 1.0)])]


@rule("Acos")
def acos(em, node, g):
    """Y = acos(X): dX = -dY / sqrt(1 - X^2)."""
    return [em.op("Neg", [em.op("Mul", [g[0], _inv_sqrt_slope(em, node.input[0], -1.0, 1.0)])])]


@rule("Asinh")
def asinh(em, node, g):
    """Y = asinh(X): dX = dY / sqrt(X^2 + 1)."""
    return [em.op("Mul", [g[0], _inv_sqrt_slope(em, node.input[0], 1.0, 1.0)])]


@rule("Acosh")
def acosh(em, node, g):
    """Y = acosh(X): dX = dY / sqrt(X^2 - 1)."""
    return [em.op("Mul", [g[0], _inv_sqrt_slope(em, node.input[0], 1.0, -1.0)])]


@rule("Atanh")
def atanh(em, node, g):
    """Y = atanh(X): dX = dY / (1 - X^2)."""
    x = node.input[0]
    return [em.op("Div", [g[0], em.op("Sub", [em.like(1.0, x), em.op("Mul", [x, x])])])]

# --- zero derivative -------------------------------------------------------------------------------

# float outputs that are piecewise constant (or not differentiable at all): no gradient flows
zero_grad(
    "Shape", "Size", "Sign", "Floor", "Ceil", "Round", "IsNaN", "IsInf", "ArgMax", "ArgMin",
    "NonZero", "ConstantOfShape", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
    "EyeLike", "OneHot", "Hardmax", "Range", "Equal", "Less", "Greater", "LessOrEqual",
    "GreaterOrEqual", "Not", "And", "Or", "Xor",
)

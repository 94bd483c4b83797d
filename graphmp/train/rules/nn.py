"""Gradient rules of convolution, pooling, softmax and normalisation layers."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ...errors import GraphmpError
from ..emitter import Emitter, attr, rule
from .common import _count_ratio, _flat_scatter_parts, _inputs, _is_extreme, per_channel_count
from .conv_gemm import WEIGHT_GRAD_FORMS, conv_shapes, input_grad_form, input_grad_gemm, weight_grad_form


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
    shape = em.dims(x)  # only the spatial lengths matter: the batch (and channels) may stay symbolic
    if shape is None or not all(isinstance(v, int) for v in shape[2:]):
        raise GraphmpError(f"node '{node.name}' ({node.op_type}): auto_pad={auto} needs static spatial input "
                           "lengths to differentiate; pin the model's input sizes with --shapes (the step graph "
                           "is then built for them, the batch stays free) or give explicit pads")
    begins, ends = [], []
    for i in range(sp):
        size = shape[2 + i]
        out = -(-size // strides[i])
        total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - size)
        small, big = total // 2, total - total // 2
        begins.append(small if auto == "SAME_UPPER" else big)
        ends.append(big if auto == "SAME_UPPER" else small)
    return strides, dil, begins + ends


def _conv_input_grad(em: Emitter, gy: str, w: str, x: str, kernel, strides, dil, pads, group) -> str:
    """Adjoint of Conv(X, W) w.r.t. X, shaped like X.

    With X's spatial lengths static: conv_gemm's MatMul + col2im where input_grad_form picks
    it (wide channels on a small map), else one ConvTranspose of dY with W carrying the conv's
    own pads and output_padding = (in + pads - dil * (k - 1) - 1) mod stride, the rows of X
    that no window reached (they get zeros), so its output is X's shape with no copy after it.
    Else (lengths known only at run time, so output_padding is not): ConvTranspose without
    pads (every position), zero-extended and cropped to X's window [pad_begin, +size)."""
    sp = len(strides)
    dims = em.dims(x)
    if dims is not None and len(dims) == 2 + sp and all(isinstance(v, int) for v in dims[2:]):
        shapes = conv_shapes(em, x, gy, group, kernel, strides, dil, pads)
        if shapes is not None and input_grad_form(shapes) == "gemm":
            return input_grad_gemm(em, gy, w, shapes)
        extra = [(n + pads[i] + pads[sp + i] - d * (k - 1) - 1) % s
                 for i, (n, s, d, k) in enumerate(zip(dims[2:], strides, dil, kernel))]
        return em.op("ConvTranspose", [gy, w], strides=strides, dilations=dil, group=group, pads=list(pads),
                     output_padding=extra)
    full = em.op("ConvTranspose", [gy, w], strides=strides, dilations=dil, group=group)
    # full length s*(o-1)+d*(k-1)+1 >= pad_begin + size - (s-1): extending by s always suffices
    padded = em.op("Pad", [full, em.ints([0] * (2 + sp) + [0, 0] + list(strides))])
    starts = em.ints(pads[:sp])
    ends = em.op("Add", [starts, em.spatial_shape(x)])
    return em.op("Slice", [padded, starts, ends, em.ints(range(2, 2 + sp))])


def _dw_as_conv(em: Emitter, inp: str, gout: str, group: int, per_group_in: int, gout_ch: int,
                kernel: list[int], strides, dil, pads) -> str:
    """R[c, i, k] = sum_{n,o} gout[n, c, o] * inp_padded[n, g(c)*per_group_in + i, o*s + k*d]:
    one Conv with batch and channels swapped (strides <-> dilations), shaped
    [gout_ch, per_group_in, *kernel]; its filter is the whole output map. Works for any
    shapes (symbolic ones included)."""
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


def _conv_weight_grad(em: Emitter, inp: str, gout: str, group: int, per_group_in: int, gout_ch: int,
                      kernel: list[int], strides, dil, pads) -> str:
    """dW of Conv(inp) -> gout (and of ConvTranspose, with its output gradient as `inp` and X
    as `gout`): [gout_ch, per_group_in, *kernel]. A GEMM form of conv_gemm.py where the shapes
    are static enough and conv_gemm.weight_grad_form picks one, else the convolution form."""
    shapes = conv_shapes(em, inp, gout, group, kernel, strides, dil, pads)
    form = weight_grad_form(shapes) if shapes is not None else None
    if form is None:
        return _dw_as_conv(em, inp, gout, group, per_group_in, gout_ch, kernel, strides, dil, pads)
    return WEIGHT_GRAD_FORMS[form](em, inp, gout, shapes)


def _weight_shape(em, node, w):
    shape = em.static_shape(w)
    if shape is None:
        raise GraphmpError(f"node '{node.name}' ({node.op_type}): the weight '{w}' needs a static shape "
                           "to differentiate; pin the model's input sizes with --shapes")
    return shape


@rule("Conv")
def conv(em, node, g):
    """Y = conv(X, W) + B: dX = ConvTranspose(dY, W) with the conv's pads (and output_padding)
    so it is X's shape, dW = GEMMs of dY with X's strided tap windows (conv_gemm.py; a Conv
    of X, batch as channels, with dY as filters where spatial sizes are symbolic), dB = sum
    of dY over N and spatial axes."""
    x, w, b = _inputs(node, 3)
    wshape = _weight_shape(em, node, w)
    kernel = list(attr(node, "kernel_shape", wshape[2:]))
    strides, dil, pads = _spatial_attrs(em, node, x, kernel)
    group = attr(node, "group", 1)
    gy = g[0]
    sp = len(kernel)
    return [_conv_input_grad(em, gy, w, x, kernel, strides, dil, pads, group) if em.needs(x) else None,
            _conv_weight_grad(em, x, gy, group, wshape[1], wshape[0], kernel, strides, dil, pads)
            if em.needs(w) else None,
            em.reduce("ReduceSum", gy, [0] + list(range(2, 2 + sp)), keepdims=0) if b and em.needs(b) else None]


def _transpose_pads(em: Emitter, node, x: str, kernel, strides, dil) -> list:
    """ConvTranspose's pads [begins..., ends...], with output_shape / auto_pad resolved as ONNX
    (and ONNX Runtime) do: total = stride*(in-1) + output_padding + (k-1)*d + 1 - out, clamped
    at 0, split by auto_pad (SAME_UPPER: the smaller half first). Rows of Y beyond the natural
    size (a negative total, or output_padding) depend on no element of X or W: the gradient
    convolutions below never read them (dX: floor division of the strided Conv; dW: sliced
    to the kernel)."""
    sp = len(kernel)
    auto = attr(node, "auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    out_shape = attr(node, "output_shape")
    if out_shape is None and auto in ("NOTSET", ""):
        return list(attr(node, "pads", [0] * (2 * sp)))
    if out_shape is None and auto == "VALID":
        return [0] * (2 * sp)
    dims = em.dims(x)
    if dims is None or not all(isinstance(v, int) for v in dims[2:]):
        raise GraphmpError(f"node '{node.name}' (ConvTranspose): output_shape / auto_pad={auto} need static "
                           "spatial input lengths to differentiate; pin the model's input sizes with --shapes")
    adj = list(attr(node, "output_padding", [0] * sp))
    outs = list(out_shape)[-sp:] if out_shape is not None else [n * s for n, s in zip(dims[2:], strides)]
    begins, ends = [], []
    for n, s, d, k, a, o in zip(dims[2:], strides, dil, kernel, adj, outs):
        total = max(0, s * (n - 1) + a + (k - 1) * d + 1 - o)
        small, big = total // 2, total - total // 2
        begins.append(small if auto == "SAME_UPPER" else big)
        ends.append(big if auto == "SAME_UPPER" else small)
    return begins + ends


@rule("ConvTranspose")
def conv_transpose(em, node, g):
    """Y = convT(X, W) + B: dX = Conv(dY, W) (same strides, pads, dilations, group),
    dW = Conv's weight gradient with dY as the input and X as the output gradient (GEMMs of
    X with dY's tap windows, conv_gemm.py), dB = sum of dY."""
    x, w, b = _inputs(node, 3)
    wshape = _weight_shape(em, node, w)
    kernel = list(attr(node, "kernel_shape", wshape[2:]))
    sp = len(kernel)
    strides = list(attr(node, "strides", [1] * sp))
    dil = list(attr(node, "dilations", [1] * sp))
    pads = _transpose_pads(em, node, x, kernel, strides, dil)
    group = attr(node, "group", 1)
    gy = g[0]
    return [em.op("Conv", [gy, w], strides=strides, dilations=dil, pads=pads, group=group) if em.needs(x) else None,
            _conv_weight_grad(em, gy, x, group, wshape[1], wshape[0], kernel, strides, dil, pads)
            if em.needs(w) else None,
            em.reduce("ReduceSum", gy, [0] + list(range(2, 2 + sp)), keepdims=0) if b and em.needs(b) else None]


def _disjoint_window_groups(kernel, strides, dil) -> list[int]:
    """Per spatial axis, how many output positions apart two pooling windows must be to share
    no input position: ceil(extent / stride), extent = (k - 1) * dilation + 1 (1: never)."""
    return [-(-((k - 1) * d + 1) // s) for k, s, d in zip(kernel, strides, dil)]


@rule("MaxPool", outputs=(0,), opset=16)
def max_pool(em, node, g):
    """Y = window max: dX = dY added (ScatterElements, reduction add) at the argmax Indices,
    so overlapping windows accumulate. Overlapping windows (ResNet's 3x3 stride-2 stem pool)
    are scattered in groups of windows that share no input position (every G-th window per
    axis, G = _disjoint_window_groups), one ScatterElements per group in a fixed order: no
    group repeats a position, so ORT CUDA's atomic adds give the same bits every run."""
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
    sp = rank - 2
    kernel = list(attr(node, "kernel_shape"))
    groups = _disjoint_window_groups(kernel, list(attr(node, "strides", [1] * sp)),
                                     list(attr(node, "dilations", [1] * sp)))
    if groups == [1] * sp:  # windows never overlap: no position repeats
        return [_flat_scatter_parts(em, x, [(flat, g[0])], "add")]
    end, axes, step = em.ints([np.iinfo(np.int64).max] * sp), em.ints(range(2, rank)), em.ints(groups)
    parts = []
    for first in np.ndindex(*groups):
        every = [em.ints(first), end, axes, step]
        parts.append((em.op("Slice", [flat] + every), em.op("Slice", [g[0]] + every)))
    return [_flat_scatter_parts(em, x, parts, "add")]


@rule("AveragePool")
def average_pool(em, node, g):
    """Y = window mean: dX = ConvTranspose of dY / count with a ones kernel per channel
    (group = C), shaped to X as Conv's dX is; count = window size, or the real elements
    without pads."""
    x = node.input[0]
    kernel = list(attr(node, "kernel_shape"))
    strides, dil, pads = _spatial_attrs(em, node, x, kernel)
    dims = em.dims(x)
    if attr(node, "ceil_mode", 0):
        raise GraphmpError(f"node '{node.name}' (AveragePool): ceil_mode=1 is not differentiated")
    if not dims or not isinstance(dims[1], int):
        raise GraphmpError(f"node '{node.name}' (AveragePool): the channel count of '{x}' must be static; pin the "
                           "model's input sizes with --shapes")
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
    return [_conv_input_grad(em, gdiv, w, x, kernel, strides, dil, pads, c)]


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


# the names training_forward (graphmp/train/autodiff.py) gives a training BatchNormalization's
# batch statistics, which it feeds to the node as its mean and var: <Y>__batch_mean(_N)
BATCH_MEAN = "__batch_mean"
BATCH_VAR = "__batch_var"


def _is_training_form(node) -> bool:
    """The BatchNormalization reads the batch statistics of its own X (training_forward)."""
    return len(node.input) >= 5 and BATCH_MEAN in node.input[3] and BATCH_VAR in node.input[4]


@rule("BatchNormalization", outputs=(0,), opset=15)
def batch_norm(em, node, g):
    """Y = scale * (X - mean) * invstd + B with fixed (running) statistics: dX = dY * scale *
    invstd, dscale = sum dY * (X - mean) * invstd, dB = sum dY (no gradient to the statistics).
    The training form (training_forward: mean and var are X's batch statistics) has its own
    rule, _batch_norm_training. Opset 15: BN-15 types the statistics and parameters apart from
    X, so a mixed step keeps them FP32 beside an FP16 X (at opset 13 convert would round the
    batch variance to FP16; train-graph upgrades a model with BatchNorm to 15)."""
    x, scale, b, mean, var = node.input[:5]
    if attr(node, "training_mode", 0):
        raise GraphmpError(f"node '{node.name}' (BatchNormalization training_mode=1): run "
                           "graphmp.train.autodiff.training_forward(model) first, which rewrites it")
    if _is_training_form(node):
        return _batch_norm_training(em, node, g[0])
    if em.needs(mean) or em.needs(var):
        raise GraphmpError(f"node '{node.name}' (BatchNormalization): its mean/var inputs depend on the trained "
                           "tensors; only running statistics (constants) or the batch statistics training_forward "
                           "computes are differentiated")
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


def _statistics_input(em: Emitter, x: str, mean: str, cdt: int) -> str:
    """X in the statistics' type: the tensor the forward's ReduceMean of the batch mean read
    (in a mixed build, the FP32 Cast of the FP16 X that convert put there) when it is X or a
    Cast of X, else a new Cast. Reading the forward's copy spares the backward a pass over X
    (the copy lives until the backward instead of the FP16 X: the FP32 build's memory)."""
    producers = em._cache.setdefault("producers", {})
    if not producers:
        producers.update({o: n for n in em.graph.node for o in n.output})
    stat = producers.get(mean)
    src = stat.input[0] if stat is not None and stat.op_type == "ReduceMean" else None
    if src == x or (src in producers and producers[src].op_type == "Cast" and producers[src].input[0] == x
                    and attr(producers[src], "to") == cdt):
        return src
    return em.cast(x, cdt, em.dtype(x))


def _batch_norm_training(em: Emitter, node, gy: str) -> list:
    """Gradient of the training form Y = (X - mean) * invstd * scale + B, mean and var the
    batch statistics of X over the M elements of each channel (the statistics' own nodes get
    no gradient: this is the whole derivative). With a = scale * invstd, s1 = sum dY and
    s2 = sum dY * X (two reductions, in the statistics' type, FP32 or FP64):
      dB = s1, dscale = sum dY * xhat = invstd * (s2 - mean * s1),
      dX = a * (dY - s1/M - xhat * dscale/M) = dY * a + (X - mean) * k2 + k3,
      k2 = -a * invstd * dscale / M, k3 = -a * s1 / M,
    every coefficient a [C] vector. dX is one Mul, one BatchNormalization used as the
    per-channel affine (X - mean) * k2 + k3 (var 0, epsilon 1: its divisor is exactly 1) and
    one Add, in the statistics' type, then one Cast to X's type (FP16 in a mixed build): the
    coefficients are never rounded to FP16, whose per-channel rounding errors would add up
    coherently in the sums of dX (a conv bias before the BatchNorm, whose true gradient is 0,
    got 6% of the floor of tests/test_train_torch.py that way; one rounding of dX: 6e-5).
    Guarantees: the gradients of X, scale and B of the batch-statistics BatchNormalization,
    in their tensors' types."""
    x, scale, b, mean, var = node.input[:5]
    xdt, sdt = em.dtype(x), em.dtype(scale)
    cdt = TensorProto.DOUBLE if em.dtype(mean) == TensorProto.DOUBLE else TensorProto.FLOAT
    mean, var = em.cast(mean, cdt, em.dtype(mean)), em.cast(var, cdt, em.dtype(var))
    chan = [0] + list(range(2, em.rank(x)))
    inv = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [var, em.const(attr(node, "epsilon", 1e-5), cdt)])])])
    gf, xf = em.cast(gy, cdt, xdt), _statistics_input(em, x, mean, cdt)
    s1 = em.reduce("ReduceSum", gf, chan, keepdims=0)
    s2 = em.reduce("ReduceSum", em.op("Mul", [gf, xf]), chan, keepdims=0)
    dscale = em.op("Mul", [inv, em.op("Sub", [s2, em.op("Mul", [mean, s1])])])
    out = [None] * 5
    if em.needs(scale):
        out[1] = em.cast(dscale, sdt, cdt)
    if b and em.needs(b):
        out[2] = em.cast(s1, em.dtype(b), cdt)
    if em.needs(x):
        a = em.op("Mul", [em.cast(scale, cdt, sdt), inv])
        count = per_channel_count(em, x, chan, cdt)
        key = ("neg_inv", count)  # -1/M, once per feature-map shape like M itself
        neg_inv_m = em._cache.get(key) or em._cache.setdefault(key, em.op("Div", [em.const(-1.0, cdt), count]))
        k2 = em.op("Mul", [em.op("Mul", [a, inv]), em.op("Mul", [dscale, neg_inv_m])])
        k3 = em.op("Mul", [a, em.op("Mul", [s1, neg_inv_m])])
        zeros = em.op("Mul", [mean, em.const(0.0, cdt)])
        affine = em.op("BatchNormalization", [xf, k2, k3, mean, zeros], epsilon=1.0)
        out[0] = em.cast(em.op("Add", [em.op("Mul", [gf, em.unsqueeze(a, chan)]), affine]), xdt, cdt)
    return out


@rule("InstanceNormalization")
def instance_norm(em, node, g):
    """Y = scale[c] * xhat + B[c], xhat = (X - mean) * invstd over the spatial axes of each
    (n, c): dB = sum dY, dscale = sum dY * xhat (over N and spatial axes),
    dX = invstd * (d - mean(d) - xhat * mean(d * xhat)), d = dY * scale. Computed in FP32
    (FP64 for a double X) whatever X's type, like the forward kernels."""
    x, scale, b = node.input
    rank = em.rank(x)
    axes, chan = list(range(2, rank)), [0] + list(range(2, rank))
    xdt, sdt = em.dtype(x), em.dtype(scale)
    cdt = TensorProto.DOUBLE if xdt == TensorProto.DOUBLE else TensorProto.FLOAT
    xf = em.cast(x, cdt, xdt)
    centred = em.op("Sub", [xf, em.reduce("ReduceMean", xf, axes, keepdims=1)])
    var = em.reduce("ReduceMean", em.op("Mul", [centred, centred]), axes, keepdims=1)
    inv = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [var, em.const(attr(node, "epsilon", 1e-5), cdt)])])])
    xhat = em.op("Mul", [centred, inv])
    gf = em.cast(g[0], cdt, xdt)
    out = [None, None, None]
    if em.needs(scale):
        out[1] = em.cast(em.reduce("ReduceSum", em.op("Mul", [gf, xhat]), chan, keepdims=0), sdt, cdt)
    if em.needs(b):
        out[2] = em.cast(em.reduce("ReduceSum", gf, chan, keepdims=0), em.dtype(b), cdt)
    if em.needs(x):
        d = em.op("Mul", [gf, em.unsqueeze(em.cast(scale, cdt, sdt), chan)])
        m1 = em.reduce("ReduceMean", d, axes, keepdims=1)
        m2 = em.reduce("ReduceMean", em.op("Mul", [d, xhat]), axes, keepdims=1)
        gx = em.op("Mul", [inv, em.op("Sub", [em.op("Sub", [d, m1]), em.op("Mul", [xhat, m2])])])
        out[0] = em.cast(gx, xdt, cdt)
    return out


@rule("GlobalMaxPool")
def global_max_pool(em, node, g):
    """Y = max over the spatial axes: dX = dY * [X == Y] / (number of ties), as ReduceMax."""
    x = node.input[0]
    mask = em.op("Cast", [_is_extreme(em, x, node.output[0])], to=em.dtype(x))
    count = em.reduce("ReduceSum", mask, range(2, em.rank(x)), keepdims=1)
    return [em.op("Mul", [mask, em.op("Div", [g[0], count])])]


@rule("GroupNormalization")
def group_norm(em, node, g):
    """Y = xhat * scale[c] + bias[c] (opset 21), xhat normalised over each (n, group of C/G
    channels, spatial). With X viewed as [N, G, M]: dX = invstd * (d - mean(d) - xhat *
    mean(d * xhat)), d = dY * scale; dscale = sum dY * xhat, dbias = sum dY (over N and the
    spatial axes). Computed in FP32 (FP64 for a double X)."""
    x, scale, b = node.input
    if em.opset < 21:
        raise GraphmpError(f"node '{node.name}' (GroupNormalization): the opset-18 form (scale and bias per "
                           "group) is deprecated and not differentiated; export at opset 21 or with "
                           "InstanceNormalization (torch's default below opset 18)")
    groups = attr(node, "num_groups")
    rank = em.rank(x)
    chan = [0] + list(range(2, rank))
    xdt, sdt = em.dtype(x), em.dtype(scale)
    cdt = TensorProto.DOUBLE if xdt == TensorProto.DOUBLE else TensorProto.FLOAT
    view = em.ints([0, groups, -1])
    xg = em.op("Reshape", [em.cast(x, cdt, xdt), view])
    centred = em.op("Sub", [xg, em.reduce("ReduceMean", xg, [2], keepdims=1)])
    var = em.reduce("ReduceMean", em.op("Mul", [centred, centred]), [2], keepdims=1)
    inv = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [var, em.const(attr(node, "epsilon", 1e-5), cdt)])])])
    xhat = em.op("Mul", [centred, inv])  # [N, G, M]
    gf = em.cast(g[0], cdt, xdt)
    out = [None, None, None]
    if em.needs(scale):
        out[1] = em.cast(em.reduce("ReduceSum", em.op("Mul", [gf, em.reshape_like(xhat, x)]), chan, keepdims=0),
                         sdt, cdt)
    if em.needs(b):
        out[2] = em.cast(em.reduce("ReduceSum", gf, chan, keepdims=0), em.dtype(b), cdt)
    if em.needs(x):
        d = em.op("Reshape", [em.op("Mul", [gf, em.unsqueeze(em.cast(scale, cdt, sdt), chan)]), view])
        m1 = em.reduce("ReduceMean", d, [2], keepdims=1)
        m2 = em.reduce("ReduceMean", em.op("Mul", [d, xhat]), [2], keepdims=1)
        gx = em.op("Mul", [inv, em.op("Sub", [em.op("Sub", [d, m1]), em.op("Mul", [xhat, m2])])])
        out[0] = em.cast(em.reshape_like(gx, x), xdt, cdt)
    return out


@rule("RMSNormalization")
def rms_norm(em, node, g):
    """Y = X * invrms * scale, invrms = 1/sqrt(mean(X^2) + eps) over axes [axis, rank):
    dscale = sum dY * xhat (xhat = X * invrms, over the broadcast axes),
    dX = invrms * (d - xhat * mean(d * xhat)), d = dY * scale. In FP32 (FP64 for double X)."""
    x, scale = node.input
    rank = em.rank(x)
    axes = list(range(attr(node, "axis", -1) % rank, rank))
    xdt, sdt = em.dtype(x), em.dtype(scale)
    cdt = TensorProto.DOUBLE if xdt == TensorProto.DOUBLE else TensorProto.FLOAT
    xf = em.cast(x, cdt, xdt)
    ms = em.reduce("ReduceMean", em.op("Mul", [xf, xf]), axes, keepdims=1)
    inv = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [ms, em.const(attr(node, "epsilon", 1e-5), cdt)])])])
    xhat = em.op("Mul", [xf, inv])
    gf = em.cast(g[0], cdt, xdt)
    out = [None, None]
    if em.needs(scale):
        out[1] = em.cast(em.unbroadcast(em.op("Mul", [gf, xhat]), scale, node.output[0]), sdt, cdt)
    if em.needs(x):
        d = em.op("Mul", [gf, em.cast(scale, cdt, sdt)])
        m = em.reduce("ReduceMean", em.op("Mul", [d, xhat]), axes, keepdims=1)
        out[0] = em.cast(em.op("Mul", [inv, em.op("Sub", [d, em.op("Mul", [xhat, m])])]), xdt, cdt)
    return out

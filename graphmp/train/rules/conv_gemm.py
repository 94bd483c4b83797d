"""Convolution gradients written for fast GEMM kernels (helpers of rules/nn.py; no rules here).

Weight gradient. For Conv(X, W) -> Y (and, with the roles of the tensors read off the same
formula, ConvTranspose), with X zero-padded by the conv's pads:

    dW[c, i, t] = sum_{n, o} dY[n, c, o] * Xpad[n, g(c) * Cin_g + i, o * stride + t * dilation]

for every kernel tap t. Gathering, for each tap, the strided window of Xpad that the tap
reads (a Slice with steps = strides) turns this into one matrix product with the reduction
over all N x out-positions (the "columns" of im2col). Three layouts are written here:

- channels-first (`_dw_channels_first`): X and dY transposed once to [C, N, ...], the tap
  windows concatenated into columns [Cin_g * taps, N * P] per group, then one Gemm (a
  MatMul batched over the groups): dW = dY' [Cout_g, N*P] @ cols^T. No per-sample partials;
  costs a transpose of X and of dY.
- per-sample (`_dw_per_sample`): columns [N, Cin_g * taps, P] from X as it is, a batched
  MatMul giving N partial dW's, then ReduceSum over N in FP32 (FP16 partials are widened
  first, so mixed precision sums in FP32). No activation transposes; costs N weight-sized
  partials.
- per-tap (`_dw_per_tap`, group 1): one Gemm per tap on the channels-first tap windows,
  concatenated along the taps; no column matrix, but dY' is read once per tap.

`weight_grad_form` picks one per shape (see its docstring for the CPU measurements and the
rule derived from them); shapes the GEMM forms do not fit (a spatial length or a channel
count known only at run time) keep the convolution form of rules/nn.py.

Input gradient. dX is a ConvTranspose of dY with W (rules/nn.py), except where
`input_grad_form` picks the GEMM form (`input_grad_gemm`): wide channels on a small map,
where ONNX Runtime's CPU ConvTranspose, one GEMM per image that re-reads the whole weight,
ran up to 5x slower than one MatMul over the batch followed by col2im:

    R[n, o, i, t] = sum_c dY[n, c, o] * W[c, i, t]     one MatMul, dY channels-last
    dX[n, i, o * stride + t * dilation - pad_begin] += R[n, o, i, t]   for every tap t
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ..emitter import Emitter


def _static_tail(dims) -> bool:
    """Whether every dim but the first (the batch) is a known int."""
    return dims is not None and len(dims) >= 3 and all(isinstance(v, int) for v in dims[1:])


def conv_shapes(em: Emitter, inp: str, gout: str, group: int, kernel, strides, dil, pads) -> dict | None:
    """The static facts the GEMM forms need, or None when they cannot be used: every dim of
    `inp` (the conv input) and `gout` (the output gradient) but the batch must be static,
    and the padded input must hold every window the taps read (true for any valid Conv)."""
    xd, yd = em.dims(inp), em.dims(gout)
    if not (_static_tail(xd) and _static_tail(yd)) or len(xd) != len(yd) or len(xd) != 2 + len(kernel):
        return None
    sp = len(kernel)
    cin, cout, outs = xd[1], yd[1], list(yd[2:])
    if cin % group or cout % group:
        return None
    for i in range(sp):
        padded = xd[2 + i] + pads[i] + pads[sp + i]
        if outs[i] < 1 or (kernel[i] - 1) * dil[i] + strides[i] * (outs[i] - 1) + 1 > padded:
            return None
    return dict(sp=sp, cin=cin, cout=cout, group=group, cin_g=cin // group, cout_g=cout // group,
                outs=outs, positions=int(np.prod(outs)), taps=int(np.prod(kernel)), kernel=list(kernel),
                strides=list(strides), dil=list(dil), pads=list(pads), in_spatial=list(xd[2:]))


def _taps(kernel):
    """Every kernel tap as a tuple of per-axis offsets, in the row-major order of W."""
    return [tuple(int(v) for v in t) for t in np.ndindex(*kernel)]


def _pad(em: Emitter, x: str, s: dict) -> str:
    """x with the conv's zero pads on its spatial axes (x itself when there are none)."""
    if not any(s["pads"]):
        return x
    sp = s["sp"]
    return em.op("Pad", [x, em.ints([0, 0] + s["pads"][:sp] + [0, 0] + s["pads"][sp:])])


def _tap_window(em: Emitter, xpad: str, s: dict, tap) -> str:
    """The strided window of the padded input that kernel tap `tap` reads: spatial lengths
    = the output's (Slice with steps = strides); xpad itself when that is all of it."""
    sp = s["sp"]
    starts = [t * d for t, d in zip(tap, s["dil"])]
    ends = [b + st * (o - 1) + 1 for b, st, o in zip(starts, s["strides"], s["outs"])]
    padded = [n + s["pads"][i] + s["pads"][sp + i] for i, n in enumerate(s["in_spatial"])]
    if starts == [0] * sp and s["strides"] == [1] * sp and ends == padded:
        return xpad
    return em.op("Slice", [xpad, em.ints(starts), em.ints(ends), em.ints(range(2, 2 + sp)), em.ints(s["strides"])])


def _columns(em: Emitter, x: str, s: dict, axis: int) -> str:
    """im2col of x [A, B, *spatial] on its axes 2.. : the tap windows [A, B, *outs] stacked
    on a new axis `axis` (1: [A, taps, B, *outs], 2: [A, B, taps, *outs])."""
    xpad = _pad(em, x, s)
    windows = [em.unsqueeze(_tap_window(em, xpad, s, t), [axis]) for t in _taps(s["kernel"])]
    return windows[0] if len(windows) == 1 else em.op("Concat", windows, axis=axis)


def _channels_first(em: Emitter, x: str, rank: int) -> str:
    return em.transpose(x, [1, 0] + list(range(2, rank)))


def _dw_channels_first(em: Emitter, inp: str, gout: str, s: dict) -> str:
    """dW [Cout, Cin_g, *kernel] as one GEMM per group over all N x out-positions.
    Needs conv_shapes' facts `s`; the GEMM runs in the tensors' dtype."""
    rank = 2 + s["sp"]
    g, k = s["group"], s["cin_g"] * s["taps"]
    if s["taps"] == 1 and not any(s["pads"]):
        # 1x1: slice the stride first, so only the positions used are transposed
        cols = _channels_first(em, _tap_window(em, inp, s, _taps(s["kernel"])[0]), rank)
    else:
        cols = _columns(em, _channels_first(em, inp, rank), s, 1)   # [Cin, taps, N, *outs]
    dy = _channels_first(em, gout, rank)                             # [Cout, N, *outs]
    if g == 1:
        r = em.op("Gemm", [em.op("Reshape", [dy, em.ints([s["cout"], -1])]),
                           em.op("Reshape", [cols, em.ints([k, -1])])], transB=1)
    else:
        dy_g = em.op("Reshape", [dy, em.ints([g, s["cout_g"], -1])])
        cols_g = em.op("Reshape", [cols, em.ints([g, k, -1])])
        r = em.op("MatMul", [dy_g, em.transpose(cols_g, [0, 2, 1])])  # [G, Cout_g, Cin_g * taps]
    return em.op("Reshape", [r, em.ints([s["cout"], s["cin_g"]] + s["kernel"])])


def _dw_per_sample(em: Emitter, inp: str, gout: str, s: dict) -> str:
    """dW [Cout, Cin_g, *kernel] as a batched GEMM per sample (and group) on inp's own
    layout, then a sum over the batch in FP32 (FP64 for double): FP16/BF16 partials are
    widened before the ReduceSum and the sum narrowed back to the tensors' dtype."""
    g, k, p = s["group"], s["cin_g"] * s["taps"], s["positions"]
    dt = em.dtype(gout)
    cols = _columns(em, inp, s, 2) if (s["taps"] > 1 or any(s["pads"])) else \
        _tap_window(em, inp, s, _taps(s["kernel"])[0])               # [N, Cin, (taps,) *outs]
    cols = em.op("Reshape", [cols, em.ints([0, g, k, p] if g > 1 else [0, k, p])])
    dy = em.op("Reshape", [gout, em.ints([0, g, s["cout_g"], p] if g > 1 else [0, s["cout"], p])])
    perm = [0, 1, 3, 2] if g > 1 else [0, 2, 1]
    partials = em.op("MatMul", [dy, em.transpose(cols, perm)])      # [N, (G,) Cout_g, Cin_g * taps]
    acc = dt if dt in (TensorProto.FLOAT, TensorProto.DOUBLE) else TensorProto.FLOAT
    total = em.cast(em.reduce("ReduceSum", em.cast(partials, acc, dt), [0], keepdims=0), dt, acc)
    return em.op("Reshape", [total, em.ints([s["cout"], s["cin_g"]] + s["kernel"])])


def _dw_per_tap(em: Emitter, inp: str, gout: str, s: dict) -> str:
    """dW [Cout, Cin, *kernel] (group 1) as one Gemm per kernel tap over all N x out-positions,
    the [Cout, Cin] results stacked along the taps (no column matrix)."""
    rank = 2 + s["sp"]
    xpad = _pad(em, _channels_first(em, inp, rank), s)
    dy = em.op("Reshape", [_channels_first(em, gout, rank), em.ints([s["cout"], -1])])
    per_tap = []
    for t in _taps(s["kernel"]):
        window = em.op("Reshape", [_tap_window(em, xpad, s, t), em.ints([s["cin"], -1])])
        per_tap.append(em.unsqueeze(em.op("Gemm", [dy, window], transB=1), [2]))
    stacked = per_tap[0] if len(per_tap) == 1 else em.op("Concat", per_tap, axis=2)
    return em.op("Reshape", [stacked, em.ints([s["cout"], s["cin"]] + s["kernel"])])


def _wide(s: dict) -> bool:
    """Group 1 and at least 128 input and output channels: where a kernel re-read per image
    costs ONNX Runtime's CPU convolutions most (input_grad_form, forward_form)."""
    return s["group"] == 1 and min(s["cin"], s["cout"]) >= 128


def input_grad_form(s: dict) -> str | None:
    """"gemm" where input_grad_gemm beats ConvTranspose for conv_shapes' facts `s`, else None:
    group 1, at least 128 input and output channels, and at most 16 output positions per
    image (49 at stride 1).

    Measured on ORT CPU (1.32, 1 thread, FP32, the weight a graph input as in a step), ms,
    the least of 15-40 runs; ResNet-18 at 64x64 (batch 8) and ResNet-50 at 112x112 (batch 4):

        N  Cin->Cout  map/stride  P    ConvTranspose  gemm
        8  512->512   2 /1        4    6.04           1.27
        8  256->512   4 /2        4    2.97           0.60
        8  256->256   4 /1        16   1.59           0.92
        8  128->256   8 /2        16   0.78           0.59
        8  128->128   4 /1        16   0.42           0.30
        8  64->128    8 /2        16   0.22           0.24
        8  64->64     4 /1        16   0.12           0.11
        8  32->64     8 /2        16   0.06           0.12
        4  512->512   4 /1        16   3.08           2.05
        8  256->256   7 /1        49   3.51           2.72
        8  128->128   7 /1        49   0.94           0.82
        8  64->64     7 /1        49   0.26           0.29
        4  256->256   14 /2       49   1.75           2.06
        8  128->128   8 /1        64   0.91           1.01
        8  64->64     16 /1       256  0.79           1.40

    ConvTranspose loses where each image's GEMM has few columns (P) and the weight it re-reads
    is large; the col2im's copies (a Pad per tap and their Sum) cost more than that saves on
    larger maps and narrow layers. On a GPU both are a GEMM and a few small copies."""
    small = s["positions"] <= 16 or (s["positions"] <= 49 and all(v == 1 for v in s["strides"]))
    return "gemm" if _wide(s) and small else None


def input_grad_gemm(em: Emitter, gout: str, w: str, s: dict) -> str:
    """dX [N, Cin, *in] of Conv(X, W) (group 1) from dY and W: one MatMul of dY channels-last
    [N, *outs, Cout] with W as [Cout, Cin * taps] (W read once for the whole batch), then
    col2im: each tap's [N, *outs, Cin] slice spread by the strides (zeros between), zero-padded
    to its offset in the padded input, the taps summed, cropped to X and made channels-first.
    Needs conv_shapes' facts `s`. FP16/BF16 products are summed over the taps in FP32."""
    sp, cin, outs = s["sp"], s["cin"], s["outs"]
    rank = 2 + sp
    dt = em.dtype(gout)
    acc = dt if dt in (TensorProto.FLOAT, TensorProto.DOUBLE) else TensorProto.FLOAT
    last = em.transpose(gout, [0] + list(range(2, rank)) + [1])
    prod = em.op("MatMul", [last, em.op("Reshape", [w, em.ints([s["cout"], cin * s["taps"]])])])
    prod = em.op("Reshape", [em.cast(prod, acc, dt), em.ints([0] + outs + [cin, s["taps"]])])
    spread = [o * st for o, st in zip(outs, s["strides"])]
    begins, ins = s["pads"][:sp], s["in_spatial"]
    canvas = [max(b + n, (k - 1) * d + L) for b, n, k, d, L in zip(begins, ins, s["kernel"], s["dil"], spread)]
    parts = []
    for i, tap in enumerate(_taps(s["kernel"])):
        part = prod if s["taps"] == 1 else em.op("Slice", [prod, em.ints([i]), em.ints([i + 1]), em.ints([rank])])
        part = _spread(em, part, s) if any(v > 1 for v in s["strides"]) else \
            em.op("Reshape", [part, em.ints([0] + outs + [cin])])
        at = [t * d for t, d in zip(tap, s["dil"])]
        after = [c - a - L for c, a, L in zip(canvas, at, spread)]
        if any(at) or any(after):
            part = em.op("Pad", [part, em.ints([0] + at + [0, 0] + after + [0])])
        parts.append(part)
    total = em.sum(parts)
    if any(begins) or canvas != ins:
        total = em.op("Slice", [total, em.ints(begins), em.ints([b + n for b, n in zip(begins, ins)]),
                                em.ints(range(1, 1 + sp))])
    return em.cast(em.transpose(total, [0, rank - 1] + list(range(1, rank - 1))), dt, acc)


def forward_form(s: dict) -> str | None:
    """"gemm" where forward_gemm beats ONNX Runtime's Conv with a run-time kernel (a step's
    forward) for conv_shapes' facts `s`, else None: group 1, at least 128 input and output
    channels, at most 9 output positions per image (a 3x3 map).

    Measured like input_grad_form (benchmarks/train_grads.py --only fwd), ms:

        N   Cin->Cout  map/stride  P    Conv    gemm
        8   512->512   2 /1        4    3.04    1.04
        8   256->512   4 /2        4    1.53    0.58
        8   128->128   2 /1        4    0.22    0.16
        8   64->64     2 /1        4    0.07    0.08
        8   512->512   3 /1        9    2.90    2.15
        8   256->256   3 /1        9    0.84    0.67
        8   256->256   4 /1        16   0.82    0.94
        32  256->256   4 /1        16   3.64    4.05
        4   512->512   4 /1        16   1.50    1.58
        4   256->256   7 /1        49   1.38    1.31
        8   128->128   8 /1        64   0.80    0.97

    From a 4x4 map on, the column matrix's copies cost what the one read of the kernel saves."""
    return "gemm" if _wide(s) and s["positions"] <= 9 else None


def forward_gemm(em: Emitter, x: str, w: str, bias: str | None, s: dict, out: str) -> str:
    """Y = Conv(X, W) + B (group 1) written to `out` as one Gemm over the batch: the columns of
    X channels-first [Cin * taps, N * P] (the ones _dw_channels_first builds), W as
    [Cout, Cin * taps] times them (+ B as [Cout, 1]), the [Cout, N, *outs] result made
    batch-first. Needs conv_shapes' facts `s` for (x, y)."""
    rank = 2 + s["sp"]
    k = s["cin"] * s["taps"]
    if s["taps"] == 1 and not any(s["pads"]):
        cols = _channels_first(em, _tap_window(em, x, s, _taps(s["kernel"])[0]), rank)
    else:
        cols = _columns(em, _channels_first(em, x, rank), s, 1)        # [Cin, taps, N, *outs]
    inputs = [em.op("Reshape", [w, em.ints([s["cout"], k])]), em.op("Reshape", [cols, em.ints([k, -1])])]
    if bias:
        inputs.append(em.op("Reshape", [bias, em.ints([s["cout"], 1])]))
    y = em.op("Reshape", [em.op("Gemm", inputs), em.ints([s["cout"], -1] + s["outs"])])
    return em.op("Transpose", [y], name=out, perm=[1, 0] + list(range(2, rank)))


def _spread(em: Emitter, part: str, s: dict) -> str:
    """A tap's [N, *outs, Cin, 1] slice as [N, *(outs * strides), Cin]: each value at o * stride,
    zeros between (each spatial axis gets a length-1 axis after it, zero-padded to the stride)."""
    sp, outs, strides = s["sp"], s["outs"], s["strides"]
    split = [v for o in outs for v in (o, 1)]
    part = em.op("Reshape", [part, em.ints([0] + split + [s["cin"]])])
    ends = [v for st in strides for v in (0, st - 1)]
    part = em.op("Pad", [part, em.ints([0] * (2 + 2 * sp) + [0] + ends + [0])])
    return em.op("Reshape", [part, em.ints([0] + [o * st for o, st in zip(outs, strides)] + [s["cin"]])])


WEIGHT_GRAD_FORMS = {"channels_first": _dw_channels_first, "per_sample": _dw_per_sample, "per_tap": _dw_per_tap}


def weight_grad_form(s: dict) -> str:
    """The dW form (a key of WEIGHT_GRAD_FORMS) for conv_shapes' facts `s`:

    1. group 1 with several taps, Cin >= 16 and more than 49 output positions per image:
       per_tap;
    2. else per_sample when its partials are small next to the transposes channels_first
       makes: 4 * Cout * Cin_g * taps < Cin * (input positions read) + Cout * P;
    3. else channels_first.

    Derived from ORT CPU (1.32, 1 thread, FP32), batch 4, ResNet-50 layers at a 112x112
    input: ms, the least of three runs' minimum over 11 / 25 / 21 interleaved runs
    (benchmarks/train_grads.py --only dw; medians on the shared 2-core machine were up to
    10x noisier); conv = the convolution form (its filter is the whole output map):

        layer                  conv   channels_first  per_sample  per_tap   picked
        stem 7x7/2 3->64       2.34   3.48            3.38        8.46      per_sample
        1x1 64->256 @28        2.99   0.54            0.46        0.53      per_sample
        3x3 64 @28             3.55   2.02            2.00        1.55      per_tap
        3x3/2 128 @28          3.36   2.25            2.55        2.10      per_tap
        1x1/2 256->512 @28     15.92  1.25            1.34        1.25      channels_first
        3x3 256 @7             2.89   1.52            3.54        1.68      per_tap
        1x1 512->2048 @4       3.26   0.81            3.29        0.90      channels_first
        1x1 2048->512 @4       3.90   0.94            3.37        0.95      channels_first
        3x3 g32 256 @14        2.18   1.47            1.62        -         per_sample
        3x3 depthwise 128 @28  3.49   2.31            2.23        -         per_sample
        3x3/2 depthwise 256@14 0.62   0.73            0.77        -         per_sample

    ResNet-18 at 64x64, batch 8 (the same tool with --net resnet18, 21 runs; map = the
    input's side, P = output positions per image):

        layer                  P    conv   channels_first  per_sample  per_tap   picked
        3x3 64 @16             256  2.71   1.53            1.64        1.23      per_tap
        3x3/2 64->128 @16      64   1.20   0.81            0.99        0.78      per_tap
        3x3 128 @8             64   2.00   1.25            1.75        1.14      per_tap
        3x3/2 128->256 @8      16   1.45   0.72            2.00        0.81      channels_first
        3x3 256 @4             16   2.25   1.23            5.46        1.60      channels_first
        3x3/2 256->512 @4      4    3.23   0.88            10.25       1.78      channels_first
        3x3 512 @2             4    4.56   1.71            12.13       3.02      channels_first

    On small maps the column matrix is small and one GEMM writes dW in W's layout, where the
    per-tap GEMMs' results must still be interleaved into it (a weight-sized Concat). Per-sample
    partials pay off only where they are small next to the activations (early,
    wide layers); per-tap GEMMs beat the column matrix once Cin is not tiny (the stem's 49
    GEMMs with 3 columns each are the worst form there; on a 7x7 map they lose 10% to it).
    The convolution form is never picked: on the CPU it wins only the stem (by ~1 ms of a
    ~2 s ResNet-50 step) and a small strided depthwise conv (by 0.15 ms), while on a GPU a
    convolution whose filter is the whole output map is the slow case this module exists to
    avoid (for the stem at batch 32 its reduction is 32x112x112 long). Grouped and
    depthwise convs use the same GEMMs batched over the groups (depthwise: per group a
    [1, N*P] x [N*P, taps] product): 1.6x faster than the convolution form at 28x28,
    1.2x slower at 14x14 stride 2."""
    if s["taps"] > 1 and s["group"] == 1 and s["cin"] >= 16 and s["positions"] > 49:
        return "per_tap"
    read = int(np.prod(s["in_spatial"])) if s["taps"] > 1 or any(s["pads"]) else s["positions"]
    partials = s["cout"] * s["cin_g"] * s["taps"]
    return "per_sample" if 4 * partials < s["cin"] * read + s["cout"] * s["positions"] else "channels_first"

"""The gradient rules that emit ops ONNX Runtime restricts, checked against ORT's kernels.

ORT runs Resize, Pad, ScatterND/ScatterElements, ConvTranspose, Conv and the pools only in
some modes, ranks and attribute combinations, and the gradient rules emit those ops (Conv's
dX is a ConvTranspose, MaxPool's a MaxPool with Indices and a ScatterElements add, Pad's a
Pad of an iota, Gather's a ScatterND add, ...). Each case below is a one-node FP32 model that
ORT runs forward, in a setting ORT supports (modes, ranks, scales vs sizes, coordinate
modes, auto_pad, output_padding, group, reductions, Pad axes). For each:

- `build_step` (fp32, SGD, loss scale 1, mse, expose_grads) either builds it, or refuses it
  with one line naming the node and the setting (`refuse=` regex) -- never an ORT error;
- built, one step of step.onnx runs in ORT: the loss is the forward's mse, the step is
  applied (all_finite), W__next = W - lr * W__grad, and W__grad equals central finite
  differences of that mse on the forward (the run's infer.onnx, ORT, FP32);
- the mixed-precision build of a subset (one case per rule family) builds and steps too
  (its own ORT run inside build_step) with finite gradients close to the FP32 ones;
- the whole model in FP16 (what a rule meets inside an FP16 region of a mixed step; the
  converter keeps most of these one-node models FP32): where ORT's CPU runs the FP16
  forward, it runs the FP16 gradient graph too, and that matches the FP32 one within FP16
  rounding.

Accuracy: every op here is linear in its float inputs, or piecewise linear with the pieces
>= 0.3 apart (MaxPool, TopK, Scatter max/min: distinct values, h = 0.05), so the mse is
(piecewise) quadratic in each weight element and the central difference is exact up to
rounding: y is FP32 (~6e-8 relative), the loss is summed in FP64, so the difference has
error ~1e-7 |y|^2 / h against gradients ~1e-2 (rtol 1e-3 of the largest gradient).
"""
from __future__ import annotations

import re
import zlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphmp.errors import GraphmpError
from graphmp.model_runs import ort_session
from graphmp.train import build_step
from graphmp.train.autodiff import add_backward
from graphmp.train.flat import next_state, pack

N = helper.make_node
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
LR = 0.25


def _rng(key):
    return np.random.default_rng(zlib.crc32(key.encode()))


def _distinct(key, *shape):
    """No two values within 0.3 of each other (max / top-k winners are unambiguous)."""
    n = int(np.prod(shape))
    return ((_rng(key).permutation(n) - n / 2) * 0.3 + 0.05).reshape(shape).astype(np.float32)


def _i64(*v):
    return np.array(v, np.int64)


def _f32(*v):
    return np.array(v, np.float32)


class Case:
    """x (data, batch 2) + W -> `a` (the restricted op's input, so dL/da is W's gradient),
    then `nodes` (reading `a`, writing `y`). `weights`: further trainable initializers
    (kernels, biases, scatter updates); `consts`: op parameters (scales, pads, indices).
    `refuse`: the build must fail with one line matching it (and naming the node)."""

    def __init__(self, id, nodes, x, weights=None, consts=None, opset=19, refuse=None, h=0.5, mixed=False):
        self.id, self.nodes, self.x = id, nodes, x
        self.weights, self.consts = weights or {}, consts or {}
        self.opset, self.refuse, self.h, self.mixed = opset, refuse, h, mixed

    def __repr__(self):
        return self.id

    def model(self) -> onnx.ModelProto:
        # small W beside distinct data (h < 0.5): a = x + W keeps its values >= 0.2 apart
        spread = 0.1 if self.h >= 0.5 else 0.01
        w = (_rng(self.id + "W").standard_normal((1,) + self.x.shape[1:]) * spread).astype(np.float32)
        inits = {"W": w, **self.weights, **self.consts}
        nodes = [N("Add", ["x", "W"], ["a"])] + [
            N(n.op_type, n.input, n.output, name=n.name or f"the_{n.op_type.lower()}",
              **{a.name: helper.get_attribute_value(a) for a in n.attribute}) for n in self.nodes]
        graph = helper.make_graph(nodes, self.id, [helper.make_tensor_value_info("x", F32, list(self.x.shape))],
                                  [helper.make_tensor_value_info("y", F32, None)],
                                  [numpy_helper.from_array(v, k) for k, v in inits.items()])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)], ir_version=9)
        y = ort_session(m).run(["y"], {"x": self.x})[0]  # ORT runs the forward: a setting it supports
        m.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", F32, list(y.shape)))
        return m


def _x(key, *shape):
    return _rng(key).standard_normal(shape).astype(np.float32)


def _resize_cases():
    x4, x3, x5, x2 = _x("r4", 2, 2, 4, 5), _x("r3", 2, 3, 5), _x("r5", 2, 2, 3, 4, 3), _x("r2", 2, 6)
    R = "Resize"

    def sc(*v):
        return {"sc": _f32(*v)}

    def sz(*v):
        return {"sz": _i64(*v)}
    up, down = sc(1, 1, 2, 1.5), sc(1, 1, 0.5, 0.6)
    cases = []
    for coord in ("half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel", "half_pixel_symmetric"):
        cases.append(Case(f"resize-linear-4d-{coord}-up", [N(R, ["a", "", "sc"], ["y"], mode="linear",
                          coordinate_transformation_mode=coord)], x4, consts=up, mixed=coord == "half_pixel"))
        cases.append(Case(f"resize-cubic-4d-{coord}-sizes", [N(R, ["a", "", "", "sz"], ["y"], mode="cubic",
                          coordinate_transformation_mode=coord)], x4, consts=sz(2, 2, 7, 3)))
    for coord, nm in (("asymmetric", "floor"), ("half_pixel", "round_prefer_ceil"), ("align_corners", "ceil"),
                      ("tf_half_pixel_for_nn", "round_prefer_floor")):
        cases.append(Case(f"resize-nearest-4d-{coord}-{nm}", [N(R, ["a", "", "sc"], ["y"], mode="nearest",
                          coordinate_transformation_mode=coord, nearest_mode=nm)], x4, consts=up,
                          mixed=nm == "floor"))
    cases += [
        Case("resize-linear-4d-down", [N(R, ["a", "", "sc"], ["y"], mode="linear")], x4, consts=down),
        Case("resize-linear-4d-to-one-pixel", [N(R, ["a", "", "", "sz"], ["y"], mode="linear",
             coordinate_transformation_mode="pytorch_half_pixel")], x4, consts=sz(2, 2, 1, 3)),
        Case("resize-cubic-4d-a-0.5-exclude-outside", [N(R, ["a", "", "sc"], ["y"], mode="cubic", cubic_coeff_a=-0.5,
             exclude_outside=1)], x4, consts=up, mixed=True),
        Case("resize-cubic-4d-down", [N(R, ["a", "", "sc"], ["y"], mode="cubic")], x4, consts=down),
        Case("resize-linear-antialias-up", [N(R, ["a", "", "sc"], ["y"], mode="linear", antialias=1)], x4, consts=up),
        Case("resize-cubic-antialias-up", [N(R, ["a", "", "sc"], ["y"], mode="cubic", antialias=1)], x4, consts=up),
        Case("resize-linear-antialias-down", [N(R, ["a", "", "sc"], ["y"], mode="linear", antialias=1)], x4,
             consts=down, refuse=r"antialias=1 with downsampling"),
        Case("resize-cubic-antialias-down", [N(R, ["a", "", "sc"], ["y"], mode="cubic", antialias=1)], x4,
             consts=down, refuse=r"antialias=1 with downsampling"),
        Case("resize-linear-axes-attr", [N(R, ["a", "", "sc"], ["y"], mode="linear", axes=[2, 3])], x4,
             consts=sc(2, 0.8)),
        Case("resize-nearest-3d", [N(R, ["a", "", "sc"], ["y"], mode="nearest")], x3, consts=sc(1, 1, 2.5)),
        Case("resize-linear-3d", [N(R, ["a", "", "sc"], ["y"], mode="linear")], x3, consts=sc(1, 1, 1.6)),
        Case("resize-nearest-5d", [N(R, ["a", "", "sc"], ["y"], mode="nearest")], x5, consts=sc(1, 1, 2, 1, 2)),
        Case("resize-linear-5d-sizes", [N(R, ["a", "", "", "sz"], ["y"], mode="linear",
             coordinate_transformation_mode="align_corners")], x5, consts=sz(2, 2, 5, 2, 4)),
        Case("resize-nearest-2d", [N(R, ["a", "", "sc"], ["y"], mode="nearest")], x2, consts=sc(1, 2)),
        Case("resize-linear-2d", [N(R, ["a", "", "sc"], ["y"], mode="linear")], x2, consts=sc(1, 1.5)),
        Case("resize-cubic-2d", [N(R, ["a", "", "sc"], ["y"], mode="cubic")], x2, consts=sc(1, 1.5)),
        Case("resize-sizes-axes-attr", [N(R, ["a", "", "", "sz"], ["y"], mode="cubic", axes=[-1, 2])], x4,
             consts=sz(9, 3), opset=18),
        Case("resize-opset13-roi-empty", [N(R, ["a", "", "sc"], ["y"], mode="linear")], x4, consts=up, opset=13),
        Case("resize-opset11-roi-given", [N(R, ["a", "roi", "sc"], ["y"], mode="nearest",
             coordinate_transformation_mode="asymmetric")], x4, consts={"roi": _f32(), **up}, opset=11),
        Case("resize-opset10", [N(R, ["a", "sc"], ["y"], mode="linear")], x4, consts=sc(1, 1, 2, 2), opset=10),
        Case("upsample-opset9", [N("Upsample", ["a", "sc"], ["y"], mode="nearest")], x4, consts=sc(1, 1, 2, 3),
             opset=9),
        Case("resize-tf-crop-and-resize", [N(R, ["a", "roi", "sc"], ["y"], mode="linear",
             coordinate_transformation_mode="tf_crop_and_resize")], x4,
             consts={"roi": _f32(0, 0, 0.1, 0.2, 1, 1, 0.9, 0.8), **up}, refuse=r"tf_crop_and_resize"),
        Case("resize-keep-aspect-not-larger", [N(R, ["a", "", "", "sz"], ["y"], mode="linear", axes=[2, 3],
             keep_aspect_ratio_policy="not_larger")], x4, consts=sz(8, 8), refuse=r"keep_aspect_ratio_policy"),
    ]
    return cases


def _pad_cases():
    x4, x3, x5 = _x("p4", 2, 2, 4, 5), _x("p3", 2, 3, 5), _x("p5", 2, 2, 3, 3, 4)
    pads4 = {"pads": _i64(0, 0, 1, 2, 0, 0, 2, 1)}
    cases = [Case("pad-constant-value", [N("Pad", ["a", "pads", "v"], ["y"], mode="constant")], x4,
                  consts={**pads4, "v": _f32(0.7)}, mixed=True),
             Case("pad-constant-negative", [N("Pad", ["a", "pads"], ["y"])], x4,
                  consts={"pads": _i64(0, 0, -1, 2, 0, 0, 1, -2)}),
             Case("pad-constant-axes", [N("Pad", ["a", "pads", "", "axes"], ["y"])], x4,
                  consts={"pads": _i64(1, -1, 2, 1), "axes": _i64(2, -1)}, opset=18)]
    for mode in ("reflect", "edge", "wrap"):
        opset = 19 if mode == "wrap" else 18
        cases += [Case(f"pad-{mode}-4d", [N("Pad", ["a", "pads"], ["y"], mode=mode)], x4, consts=pads4, opset=opset,
                       mixed=mode == "reflect"),
                  Case(f"pad-{mode}-axes", [N("Pad", ["a", "pads", "", "axes"], ["y"], mode=mode)], x4,
                       consts={"pads": _i64(2, 1, 1, 3), "axes": _i64(3, 2)}, opset=opset),
                  Case(f"pad-{mode}-3d", [N("Pad", ["a", "pads"], ["y"], mode=mode)], x3,
                       consts={"pads": _i64(0, 0, 2, 0, 0, 3)}, opset=opset),
                  Case(f"pad-{mode}-5d", [N("Pad", ["a", "pads"], ["y"], mode=mode)], x5,
                       consts={"pads": _i64(0, 0, 1, 0, 2, 0, 0, 2, 1, 1)}, opset=opset)]
    for mode in ("reflect", "edge", "wrap"):  # cropping on one side, padding on the other
        cases.append(Case(f"pad-{mode}-negative", [N("Pad", ["a", "pads"], ["y"], mode=mode)], x4,
                          consts={"pads": _i64(0, 0, -1, 2, 0, 0, 1, -2)}, opset=19))
    cases.append(Case("pad-reflect-opset13", [N("Pad", ["a", "pads"], ["y"], mode="reflect")], x4, consts=pads4,
                      opset=13))
    return cases


def _scatter_cases():
    x = _distinct("s", 2, 3, 4)
    upd_nd = _distinct("snd", 3, 4) + 0.15  # off the data's grid: max/min winners stay distinct
    upd_el = _distinct("sel", 2, 2, 4) + 0.15
    nd_unique, nd_dup = _i64(1, 0, 1, 2, 0, 1).reshape(3, 2), _i64(1, 0, -1, 0, 0, 2).reshape(3, 2)
    el_unique = _i64(2, 0, 1, 2, 0, 1, 2, 0, 1, 0, 2, 1, 0, 2, 0, 2).reshape(2, 2, 4)
    el_dup = _i64(2, 0, 1, -1, 2, 1, 1, 0, 1, 0, -1, 1, 0, 2, 2, 1).reshape(2, 2, 4)  # repeated, negative
    cases = []
    for red in ("none", "add", "mul", "max", "min"):
        refuse = None if red in ("none", "add") else rf"reduction={red}"
        idx, el_idx = (nd_dup, el_dup) if red == "add" else (nd_unique, el_unique)  # a plain write needs unique
        cases.append(Case(f"scatternd-{red}", [N("ScatterND", ["a", "idx", "U"], ["y"], reduction=red)], x,
                          weights={"U": upd_nd}, consts={"idx": idx}, opset=18, refuse=refuse, h=0.05,
                          mixed=red == "add"))
        cases.append(Case(f"scatterelements-{red}", [N("ScatterElements", ["a", "idx", "U"], ["y"], axis=1,
                                                      reduction=red)], x, weights={"U": upd_el},
                          consts={"idx": el_idx}, opset=18, refuse=refuse, h=0.05))
    return cases


def _conv_transpose_cases():
    x4, x3, x5 = _x("ct4", 2, 4, 3, 4), _x("ct3", 2, 4, 5), _x("ct5", 2, 2, 2, 3, 2)

    def k(key, *shape, group=1):
        return {"K": _x(key, *shape) * 0.5, "B": _x(key + "b", shape[1] * group)}
    ct = "ConvTranspose"
    return [
        Case("convtranspose-plain", [N(ct, ["a", "K", "B"], ["y"])], x4, weights=k("k1", 4, 3, 3, 3), opset=17,
             mixed=True),
        Case("convtranspose-strides-pads", [N(ct, ["a", "K", "B"], ["y"], strides=[2, 3], pads=[1, 0, 0, 2])], x4,
             weights=k("k2", 4, 3, 3, 3), opset=17),
        Case("convtranspose-dilations", [N(ct, ["a", "K", "B"], ["y"], dilations=[2, 1], strides=[1, 2])], x4,
             weights=k("k3", 4, 3, 2, 3), opset=17),
        Case("convtranspose-output-padding", [N(ct, ["a", "K", "B"], ["y"], strides=[2, 3], output_padding=[1, 2])],
             x4, weights=k("k4", 4, 3, 3, 3), opset=17),
        Case("convtranspose-group", [N(ct, ["a", "K", "B"], ["y"], group=2, strides=[2, 1])], x4,
             weights=k("k5", 4, 3, 3, 2, group=2), opset=17),
        Case("convtranspose-depthwise-dilated", [N(ct, ["a", "K", "B"], ["y"], group=4, dilations=[2, 2])], x4,
             weights=k("k6", 4, 1, 2, 2, group=4), opset=17),
        Case("convtranspose-same-upper", [N(ct, ["a", "K", "B"], ["y"], auto_pad="SAME_UPPER", strides=[2, 2])], x4,
             weights=k("k7", 4, 3, 3, 4), opset=17),
        Case("convtranspose-same-lower", [N(ct, ["a", "K", "B"], ["y"], auto_pad="SAME_LOWER", strides=[2, 3])], x4,
             weights=k("k8", 4, 3, 4, 3), opset=17),
        Case("convtranspose-valid", [N(ct, ["a", "K", "B"], ["y"], auto_pad="VALID", strides=[2, 2])], x4,
             weights=k("k9", 4, 3, 3, 3), opset=17),
        Case("convtranspose-output-shape", [N(ct, ["a", "K", "B"], ["y"], strides=[2, 2], output_shape=[8, 9])], x4,
             weights=k("k10", 4, 3, 3, 3), opset=17),
        Case("convtranspose-group-output-padding-dilated", [N(ct, ["a", "K", "B"], ["y"], group=2, strides=[3, 2],
             dilations=[1, 2], output_padding=[2, 1], pads=[1, 0, 0, 1])], x4, weights=k("k13", 4, 2, 2, 2, group=2),
             opset=17),
        Case("convtranspose-output-shape-same-upper", [N(ct, ["a", "K", "B"], ["y"], strides=[2, 2],
             output_shape=[7, 9], auto_pad="SAME_UPPER")], x4, weights=k("k14", 4, 3, 3, 3), opset=17),
        Case("convtranspose-1d", [N(ct, ["a", "K", "B"], ["y"], strides=[2], output_padding=[1], pads=[1, 0])], x3,
             weights=k("k11", 4, 2, 3), opset=17),
        Case("convtranspose-3d", [N(ct, ["a", "K", "B"], ["y"], strides=[1, 2, 1], pads=[0, 1, 0, 1, 0, 0])], x5,
             weights=k("k12", 2, 3, 2, 3, 2), opset=17),
    ]


def _conv_and_pool_cases():
    """Conv (dX: ConvTranspose + Pad), AveragePool (ConvTranspose, group = C), MaxPool
    (MaxPool with Indices + ScatterElements add)."""
    x4, x3, x5 = _x("c4", 2, 4, 7, 6), _x("c3", 2, 4, 9), _x("c5", 2, 2, 4, 5, 4)
    d4, d3, d5 = _distinct("m4", 2, 2, 6, 5), _distinct("m3", 2, 2, 9), _distinct("m5", 2, 1, 4, 4, 3)

    def k(key, *shape):
        return {"K": _x(key, *shape) * 0.5, "B": _x(key + "b", shape[0])}
    cv, ap, mp = "Conv", "AveragePool", "MaxPool"
    return [
        Case("conv-strides-pads", [N(cv, ["a", "K", "B"], ["y"], strides=[2, 3], pads=[1, 0, 2, 1])], x4,
             weights=k("c1", 3, 4, 3, 2), opset=17, mixed=True),
        Case("conv-dilations-group", [N(cv, ["a", "K", "B"], ["y"], dilations=[2, 1], group=2)], x4,
             weights=k("c2", 4, 2, 2, 3), opset=17),
        Case("conv-depthwise-same-upper", [N(cv, ["a", "K", "B"], ["y"], group=4, auto_pad="SAME_UPPER",
             strides=[2, 2])], x4, weights=k("c3", 4, 1, 3, 4), opset=17),
        Case("conv-same-lower", [N(cv, ["a", "K", "B"], ["y"], auto_pad="SAME_LOWER", strides=[3, 1])], x4,
             weights=k("c4", 2, 4, 2, 2), opset=17),
        Case("conv-same-upper-odd", [N(cv, ["a", "K", "B"], ["y"], auto_pad="SAME_UPPER", strides=[2, 4])], x4,
             weights=k("c7", 3, 4, 2, 3), opset=17),  # (ORT refuses dilations with SAME: no such case)
        Case("conv-1d", [N(cv, ["a", "K", "B"], ["y"], strides=[2], dilations=[2], pads=[1, 2])], x3,
             weights=k("c5", 3, 4, 3), opset=17),
        Case("conv-3d", [N(cv, ["a", "K", "B"], ["y"], strides=[1, 2, 1], pads=[1, 0, 1, 0, 1, 0])], x5,
             weights=k("c6", 2, 2, 2, 3, 2), opset=17),
        Case("averagepool-pads-exclude", [N(ap, ["a"], ["y"], kernel_shape=[3, 2], strides=[2, 1],
             pads=[1, 0, 1, 1])], x4, opset=17, mixed=True),
        Case("averagepool-pads-include", [N(ap, ["a"], ["y"], kernel_shape=[3, 3], strides=[2, 2],
             pads=[1, 1, 1, 1], count_include_pad=1)], x4, opset=17),
        Case("averagepool-dilations", [N(ap, ["a"], ["y"], kernel_shape=[2, 2], dilations=[2, 2])], x4, opset=19),
        Case("averagepool-1d-same-upper", [N(ap, ["a"], ["y"], kernel_shape=[4], strides=[2],
             auto_pad="SAME_UPPER")], x3, opset=17),
        Case("averagepool-3d", [N(ap, ["a"], ["y"], kernel_shape=[2, 2, 2], strides=[2, 1, 2])], x5, opset=17),
        Case("averagepool-ceil", [N(ap, ["a"], ["y"], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)], x4,
             opset=17, refuse=r"ceil_mode=1"),
        Case("maxpool-overlapping-pads", [N(mp, ["a"], ["y"], kernel_shape=[3, 2], pads=[1, 0, 1, 1])], d4,
             opset=17, h=0.05, mixed=True),
        Case("maxpool-dilations-strides", [N(mp, ["a"], ["y"], kernel_shape=[2, 2], dilations=[2, 1],
             strides=[1, 2])], d4, opset=17, h=0.05),
        Case("maxpool-ceil", [N(mp, ["a"], ["y"], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)], d4, opset=17,
             h=0.05),
        Case("maxpool-same-lower", [N(mp, ["a"], ["y"], kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_LOWER")],
             d4, opset=17, h=0.05),
        Case("maxpool-storage-order", [N(mp, ["a"], ["y", "yi"], kernel_shape=[2, 3], storage_order=1)], d4,
             opset=17, h=0.05),
        Case("maxpool-1d", [N(mp, ["a"], ["y"], kernel_shape=[3], strides=[2])], d3, opset=17, h=0.05),
        Case("maxpool-3d", [N(mp, ["a"], ["y"], kernel_shape=[2, 2, 2], strides=[1, 2, 1])], d5, opset=17, h=0.05),
    ]


def _gather_cases():
    """Gather / GatherND / GatherElements (ScatterND / ScatterElements add), Slice and TopK
    (ScatterElements), reading the trainable table E: a = x + W picks nothing, y = op(E) * a."""
    e = {"E": _x("E", 5, 4)}
    x = _x("g", 2, 3, 4)
    return [
        Case("gather-dup-negative", [N("Gather", ["E", "gi"], ["g"], axis=0), N("Mul", ["g", "a"], ["y"])], x,
             weights=e, consts={"gi": _i64(1, -1, 1).reshape(1, 3)},
             mixed=True),
        Case("gather-axis1", [N("Gather", ["E", "gi"], ["g"], axis=1), N("Mul", ["g", "a"], ["y"])],
             _x("g1", 2, 5, 3), weights=e, consts={"gi": _i64(3, 0, 3)}),
        Case("gathernd", [N("GatherND", ["E", "gi"], ["g"]), N("Mul", ["g", "a"], ["y"])], x, weights=e,
             consts={"gi": _i64(1, -1, 1).reshape(1, 3, 1)}),
        Case("gatherelements-dup", [N("GatherElements", ["E", "gi"], ["g"], axis=1), N("Mul", ["g", "a"], ["y"])],
             _x("ge", 2, 5, 3), weights=e, consts={"gi": _i64(*([0, 3, 3, 1, 0] * 3)).reshape(5, 3)}),
        Case("slice-steps", [N("Slice", ["a", "st", "en", "ax", "sp"], ["y"])], _x("sl", 2, 4, 7),
             consts={"st": _i64(-1, 1), "en": _i64(0, 7), "ax": _i64(1, 2), "sp": _i64(-2, 3)}),
        Case("topk", [N("TopK", ["a", "kk"], ["y", "yi"], axis=-1)], _distinct("tk", 2, 3, 6), consts={"kk": _i64(3)},
             h=0.05),
    ]


CASES = _resize_cases() + _pad_cases() + _scatter_cases() + _conv_transpose_cases() + _conv_and_pool_cases() \
    + _gather_cases()


def _labels(case, model):
    shape = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    return _rng(case.id + "L").standard_normal(shape).astype(np.float32)


def _build(case, tmp_path, precision):
    model = case.model()
    src = tmp_path / "model.onnx"
    onnx.save(model, src)
    run = tmp_path / f"run-{precision}"
    meta = build_step(str(src), str(run), loss="mse", optimizer="sgd", lr=LR, momentum=0, weight_decay=0,
                      precision=precision, loss_scale=1, expose_grads=True)
    return model, run, meta


def _step(run, meta, x, labels):
    """One step of step.onnx in ORT: {output name: value}, and the state it started from."""
    sess = ort_session(onnx.load(run / "step.onnx"))
    with np.load(run / "state.npz") as f:
        state = dict(f)
    feeds = {"x": x, meta["label"]["name"]: labels, **pack(meta, state)}
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    out.update({k + "__next": v for k, v in next_state(meta, out).items()})  # per tensor, as the test reads it
    return out, state


def _mse(sess, feeds, labels):
    y = sess.run(["y"], feeds)[0].astype(np.float64)
    return float(np.mean((y - labels) ** 2))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_emits_what_ort_runs(case, tmp_path):
    if case.refuse:
        with pytest.raises(GraphmpError) as e:
            _build(case, tmp_path, "fp32")
        msg = str(e.value)
        assert "\n" not in msg and f"the_{case.nodes[-1].op_type.lower()}" in msg, msg
        assert re.search(case.refuse, msg), msg
        return
    model, run, meta = _build(case, tmp_path, "fp32")
    labels = _labels(case, model)
    out, state = _step(run, meta, case.x, labels)
    weights = meta["weights"]
    assert set(weights) == {"W", *case.weights}, weights
    infer = ort_session(onnx.load(run / "infer.onnx"))
    base = {"x": case.x, **{w: state[w] for w in weights}}
    lab64 = labels.astype(np.float64)
    assert out["all_finite"]
    np.testing.assert_allclose(out["loss"], _mse(infer, base, lab64), rtol=1e-5)
    rng = _rng(case.id + "pick")
    for w in weights:
        g = out[w + "__grad"]
        np.testing.assert_allclose(out[w + "__next"], state[w] - LR * g, rtol=1e-6, atol=1e-7)
        idx = rng.choice(g.size, min(g.size, 6), replace=False)
        fd = []
        for i in idx:
            plus, minus = state[w].copy(), state[w].copy()
            plus.flat[i] += case.h
            minus.flat[i] -= case.h
            fd.append((_mse(infer, {**base, w: plus}, lab64) - _mse(infer, {**base, w: minus}, lab64)) / (2 * case.h))
        fd = np.array(fd)
        scale = max(np.abs(fd).max(), np.abs(g).max())
        assert scale > 1e-4, f"{case.id}: the loss does not depend on {w}; the check is vacuous"
        np.testing.assert_allclose(g.reshape(-1)[idx], fd, rtol=1e-3, atol=1e-3 * scale,
                                   err_msg=f"{case.id}: d loss / d {w}")
    if case.mixed:
        _, run16, meta16 = _build(case, tmp_path, "mixed")
        out16, _ = _step(run16, meta16, case.x, labels)
        assert out16["all_finite"]
        for w in weights:
            g, g16 = out[w + "__grad"], out16[w + "__grad"]
            np.testing.assert_allclose(g16, g, rtol=0.05, atol=0.02 * np.abs(g).max(), err_msg=f"{case.id} mixed: {w}")


def _in_dtype(case, model: onnx.ModelProto, elem: int) -> tuple[onnx.ModelProto, list]:
    """The one-node model in `elem` (x, the weights, y; op parameters such as Resize scales
    stay as they are), with loss = sum(y * R) as its output and its gradients w.r.t. the
    weights; (model, gradient names)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    np_t = helper.tensor_dtype_to_np_dtype(elem)
    floats = ["W", *case.weights]
    for t in m.graph.initializer:
        if t.name in floats or t.name == "v":  # v: Pad's constant value, of the data's type
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np_t), t.name))
    m.graph.input[0].type.tensor_type.elem_type = elem
    shape = [d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim]
    r = _rng("R").standard_normal(shape).astype(np_t)
    m.graph.initializer.append(numpy_helper.from_array(r, "R"))
    m.graph.node.extend([N("Mul", ["y", "R"], ["yr"]), N("ReduceSum", ["yr"], ["loss"], keepdims=0)])
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("loss", elem, []))
    grads = add_backward(m, "loss", floats)
    m.graph.output.extend(helper.make_tensor_value_info(grads[w], elem, None) for w in floats)
    return m, [grads[w] for w in floats]


FP16_CASES = [c for c in CASES if not c.refuse and c.opset >= 16]  # add_backward needs 16 (build_step upgrades)


@pytest.mark.parametrize("case", FP16_CASES, ids=[c.id for c in FP16_CASES])
def test_fp16_gradient_runs_where_the_fp16_forward_does(case):
    model = case.model()
    m16, names = _in_dtype(case, model, F16)
    m32, _ = _in_dtype(case, model, F32)
    try:  # ORT's CPU kernels lack FP16 for some ops (ConvTranspose, Conv): no FP16 region there
        sess16 = ort_session(m16)
        got = sess16.run(None, {"x": case.x.astype(np.float16)})
    except Exception as e:  # noqa: BLE001
        fwd = onnx.ModelProto()
        fwd.CopyFrom(m16)
        del fwd.graph.node[len(case.nodes) + 3:]  # the forward and the loss, no gradient nodes
        del fwd.graph.output[1:]
        with pytest.raises(Exception):
            ort_session(fwd).run(None, {"x": case.x.astype(np.float16)})
        pytest.skip(f"ORT CPU has no FP16 forward here: {str(e).splitlines()[0][:120]}")
    want = ort_session(m32).run(None, {"x": case.x})
    for name, g16, g32 in zip(names, got[1:], want[1:]):
        assert g16.dtype == np.float16 and np.isfinite(g16).all(), name
        np.testing.assert_allclose(g16.astype(np.float32), g32, rtol=2e-2, atol=2e-2 * np.abs(g32).max(),
                                   err_msg=f"{case.id}: {name} in FP16")

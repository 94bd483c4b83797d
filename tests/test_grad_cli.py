"""Gradient check through the command line only.

For each op: a tiny FP32 model x -> Mul(x, W) -> op -> y (plus the op's own weights),
`graphmp train-graph --loss mse --optimizer sgd --momentum 0 --weight-decay 0 --precision
fp32 --loss-scale 1` (no clipping), one full-batch `graphmp train` step, `graphmp export`.
The weight change is -lr * d(loss)/dW, so (W_before - W_after) / lr is compared with
central differences of the loss on the ORIGINAL model run by ONNX Runtime, the loss being
the driver's mse: mean((y - labels)^2) over every element (graphmp/train/step.py
`_add_loss`).

Accuracy: ORT runs the model in FP32 (y exact to ~6e-8 relative) and the loss is taken in
FP64 from y, so the central difference with h = 1e-2 has roundoff ~1e-7 / h = 1e-5 and
truncation ~h^2 |f'''| / 6 ~ 2e-5 (exact where the op is piecewise linear: the loss is
then quadratic in W). The SGD update is FP32: (W - W')/lr is exact to ~1e-7 |W| / lr.
Inputs stay >= 0.1 away from every kink and from ties (|x| >= 0.15 around 0, grids that
skip the kinks of HardSigmoid/HardSwish, maxima 0.3 apart; W = 1 +- 0.006, h |x| <= 0.07),
so the tolerance is 1e-3 of the largest gradient plus 1e-3 relative.
"""
from __future__ import annotations

import zlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphmp.cli import main
from graphmp.model_runs import ort_session

N = helper.make_node
F32 = TensorProto.FLOAT
LR = 0.5
H = 1e-2
BATCH = 2


def _rng(key):
    return np.random.default_rng(zlib.crc32(key.encode()))


def _away(key, *shape, lo=0.15, scale=1.0):
    """Normal samples with |v| >= lo (off the kink at 0), times scale."""
    v = _rng(key).standard_normal(shape)
    return (np.sign(v) * (np.abs(v) + lo) * scale).astype(np.float32)


def _grid(key, shape, values):
    """Values drawn from `values` (chosen >= 0.3 away from an op's kinks) plus +-0.02 jitter."""
    r = _rng(key)
    return (r.choice(values, shape) + r.uniform(-0.02, 0.02, shape)).astype(np.float32)


def _distinct(key, *shape):
    """No two values within 0.1 of each other (ReduceMax/MaxPool winners are unambiguous)."""
    n = int(np.prod(shape))
    return ((_rng(key).permutation(n) - n / 2) * 0.3 + 0.05).reshape(shape).astype(np.float32)


class Op:
    """One CLI check: nodes reading `t` (= x * W) and writing `y`; extra weights and constants."""

    def __init__(self, id, nodes, x, weights=None, consts=None, opset=17):
        self.id, self.nodes, self.x = id, nodes, x
        self.weights, self.consts, self.opset = weights or {}, consts or {}, opset

    def model(self) -> onnx.ModelProto:
        w = (1 + 0.002 * _rng(self.id + "W").standard_normal(self.x.shape[1:])).astype(np.float32)
        inits = {"W": w, **self.weights, **self.consts}
        graph = helper.make_graph(
            [N("Mul", ["x", "W"], ["t"], name="scale")] + self.nodes, self.id.replace("-", "_"),
            [helper.make_tensor_value_info("x", F32, list(self.x.shape))],
            [helper.make_tensor_value_info("y", F32, None)],
            [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        m.ir_version = 10
        m = onnx.shape_inference.infer_shapes(m, strict_mode=True)  # y gets its static shape
        if not m.graph.output[0].type.tensor_type.HasField("shape"):  # function ops (GroupNormalization)
            shape = ort_session(m).run(["y"], {"x": self.x})[0].shape
            m.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", F32, list(shape)))
        onnx.checker.check_model(m, full_check=True)
        return m


def _ops():
    x4 = lambda k, lo=0.15, scale=1.0: _away(k, BATCH, 2, 4, 4, lo=lo, scale=scale)  # noqa: E731
    i64 = lambda v: np.array(v, np.int64)  # noqa: E731
    f32 = lambda v: np.array(v, np.float32)  # noqa: E731
    return [
        *[Op(f"Pad-{m}", [N("Pad", ["t", "p"], ["y"], mode=m)], x4("pad" + m), consts={"p": i64([0, 0, 1, 2, 0, 1, 2, 0])},
             opset=13) for m in ("constant", "reflect", "edge")],
        Op("Pad-reflect-opset11", [N("Pad", ["t", "p"], ["y"], mode="reflect")], x4("pad11"),
           consts={"p": i64([0, 0, 2, 1, 0, 0, 1, 2])}, opset=11),
        Op("Resize-nearest-scales", [N("Resize", ["t", "", "s"], ["y"], mode="nearest")], x4("rn"),
           consts={"s": f32([1, 1, 2, 1.5])}, opset=13),
        Op("Resize-nearest-sizes-asym", [N("Resize", ["t", "", "", "s"], ["y"], mode="nearest",
                                           coordinate_transformation_mode="asymmetric", nearest_mode="floor")],
           x4("rna"), consts={"s": i64([BATCH, 2, 3, 7])}, opset=13),
        Op("Resize-linear-scales", [N("Resize", ["t", "", "s"], ["y"], mode="linear")], x4("rl"),
           consts={"s": f32([1, 1, 2, 2])}, opset=13),
        Op("Resize-linear-sizes-align", [N("Resize", ["t", "", "", "s"], ["y"], mode="linear",
                                           coordinate_transformation_mode="align_corners")],
           x4("rla"), consts={"s": i64([BATCH, 2, 7, 3])}, opset=13),
        Op("Resize-cubic-scales", [N("Resize", ["t", "", "s"], ["y"], mode="cubic")], x4("rc"),
           consts={"s": f32([1, 1, 2, 1.5])}, opset=13),  # DINOv2/YOLOS position-embedding interpolation
        Op("Resize-cubic-sizes-exclude-outside", [N("Resize", ["t", "", "", "s"], ["y"], mode="cubic",
                                                    exclude_outside=1, cubic_coeff_a=-0.5,
                                                    coordinate_transformation_mode="pytorch_half_pixel")],
           x4("rce"), consts={"s": i64([BATCH, 2, 3, 7])}, opset=13),
        *[Op(f"DepthToSpace-{m}", [N("DepthToSpace", ["t"], ["y"], blocksize=2, mode=m)],
             _away("d2s" + m, BATCH, 8, 2, 3)) for m in ("DCR", "CRD")],
        Op("SpaceToDepth", [N("SpaceToDepth", ["t"], ["y"], blocksize=2)], x4("s2d")),
        Op("HardSigmoid", [N("HardSigmoid", ["t"], ["y"], alpha=0.25, beta=0.5)],  # kinks at -2, 2
           _grid("hs", (BATCH, 2, 4, 4), [-3.0, -2.4, -1.5, -0.5, 0.5, 1.5, 2.4, 3.0])),
        Op("HardSwish", [N("HardSwish", ["t"], ["y"])],  # kinks at -3, 3
           _grid("hsw", (BATCH, 2, 4, 4), [-4.0, -3.5, -2.2, -1.0, 0.5, 1.4, 2.5, 3.6])),
        Op("InstanceNormalization", [N("InstanceNormalization", ["t", "in.scale", "in.bias"], ["y"])], x4("in"),
           weights={"in.scale": f32([1.2, 0.7]), "in.bias": f32([0.1, -0.3])}),
        Op("GroupNormalization", [N("GroupNormalization", ["t", "gn.scale", "gn.bias"], ["y"], num_groups=2)],
           _away("gn", BATCH, 4, 2, 3), weights={"gn.scale": f32([1.2, 0.7, 0.9, 1.1]), "gn.bias": f32([0.1, -0.3, 0, 0.2])},
           opset=21),
        Op("Elu", [N("Elu", ["t"], ["y"], alpha=0.7)], x4("elu")),
        Op("Selu", [N("Selu", ["t"], ["y"])], x4("selu")),
        Op("Celu", [N("Celu", ["t"], ["y"], alpha=1.5)], x4("celu")),
        Op("PRelu", [N("PRelu", ["t", "slope"], ["y"])], x4("prelu"), weights={"slope": f32([[[0.2]], [[0.4]]])}),
        Op("Softplus", [N("Softplus", ["t"], ["y"])], x4("sp")),
        Op("Softsign", [N("Softsign", ["t"], ["y"])], x4("ss")),
        Op("Mish", [N("Mish", ["t"], ["y"])], x4("mish"), opset=18),
        *[Op(op, [N(op, ["t", "ax"], ["y"], keepdims=0)], _distinct(op, BATCH, 2, 3, 4), consts={"ax": i64([2])},
             opset=18) for op in ("ReduceMax", "ReduceMin")],
        *[Op(f"CumSum-ex{e}-rev{r}", [N("CumSum", ["t", "ax"], ["y"], exclusive=e, reverse=r)], x4(f"cs{e}{r}"),
             consts={"ax": i64(2)}) for e, r in [(0, 0), (1, 1)]],
        Op("Sin", [N("Sin", ["t"], ["y"])], x4("sin", scale=2.0)),
        Op("Cos", [N("Cos", ["t"], ["y"])], x4("cos", scale=2.0)),
        Op("Tile", [N("Tile", ["t", "r"], ["y"])], x4("tile"), consts={"r": i64([1, 2, 1, 3])}),
        Op("Einsum", [N("Einsum", ["t", "e"], ["y"], equation="nchw,wk->nkh")], x4("ein"),
           weights={"e": _away("ein-e", 4, 3)}),
        Op("MaxPool-opset11", [N("MaxPool", ["t"], ["y"], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])],
           _distinct("mp11", BATCH, 2, 4, 4), opset=11),
    ]


OPS = _ops()


def _losses(model: onnx.ModelProto, x, labels, wrt: str):
    """loss(W) on the original model (ORT, FP32), W fed as an input; FP64 mse of y."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    init = next(t for t in m.graph.initializer if t.name == wrt)
    m.graph.input.append(helper.make_tensor_value_info(wrt, init.data_type, list(init.dims)))
    sess = ort_session(m)

    def loss(w):
        y = sess.run(["y"], {"x": x, wrt: w})[0].astype(np.float64)
        return float(np.mean((y - labels) ** 2))
    return loss


def check_step(model, x, labels, before: dict, after: dict, weights, what: str):
    """(before - after) / LR of every weight in `weights` (one SGD step of the CLI) equals
    central differences of the mse on the original model (tolerances: module docstring)."""
    for w in weights:
        step = (before[w].astype(np.float64) - after[w]) / LR
        loss = _losses(model, x, labels.astype(np.float64), w)
        fd = np.zeros(before[w].size)
        for i in range(before[w].size):
            plus, minus = before[w].copy(), before[w].copy()
            plus.flat[i] += H
            minus.flat[i] -= H
            fd[i] = (loss(plus) - loss(minus)) / (2 * H)
        assert np.abs(fd).max() > 1e-3, f"{what}: the loss does not depend on {w}; the check is vacuous"
        np.testing.assert_allclose(step.reshape(-1), fd, rtol=1e-3, atol=1e-3 * np.abs(fd).max(),
                                   err_msg=f"{what}: -lr * dloss/d{w} from the CLI step")


@pytest.mark.parametrize("op", OPS, ids=[o.id for o in OPS])
def test_cli_sgd_step_matches_finite_differences(op, tmp_path):
    model = op.model()
    src = str(tmp_path / "model.onnx")
    onnx.save(model, src)
    before = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    y = ort_session(model).run(["y"], {"x": op.x})[0]
    labels = (y + _rng(op.id + "L").standard_normal(y.shape)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=op.x, labels=labels)
    run = str(tmp_path / "run")
    assert main(["train-graph", src, "-o", run, "--loss", "mse", "--optimizer", "sgd", "--lr", str(LR),
                 "--momentum", "0", "--weight-decay", "0", "--precision", "fp32", "--loss-scale", "1"]) == 0
    assert main(["train", run, "--data", str(tmp_path / "data.npz"), "--epochs", "1", "--batch-size",
                 str(BATCH), "-q"]) == 0
    out = str(tmp_path / "trained.onnx")
    assert main(["export", run, "-o", out]) == 0
    after = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    weights = ["W", *op.weights]
    check_step(model, op.x, labels, before, after, weights, op.id)
    for name in set(before) - set(weights):  # constants (pads, scales, axes) are untouched
        assert np.array_equal(before[name], after[name]), name

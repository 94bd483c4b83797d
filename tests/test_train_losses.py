"""Cross-entropy options of the training step (graphmp/train/losses.py): class axis, ignore
index, label smoothing, class weights, checked numerically against a float64 numpy reference
of torch's F.cross_entropy (and torch itself when it is installed) through the real step
graph in ONNX Runtime: the loss output, and the exposed gradient against finite differences
of the reference loss.
"""
import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphmp.cli import main
from graphmp.errors import GraphmpError
from graphmp.train.flat import pack
from graphmp.train.loop import StepRunner, latest_state, load_run
from graphmp.train.losses import parse_class_weights
from graphmp.train.step import build_step

N, T, D, V = 3, 5, 4, 6


def cross_entropy_ref(logits, labels, axis=1, ignore_index=None, label_smoothing=0.0, weight=None):
    """torch.nn.functional.cross_entropy(reduction='mean') in float64 numpy (LossNLL.cpp's
    cross_entropy_loss_label_smoothing for eps > 0)."""
    z = np.moveaxis(np.asarray(logits, np.float64), axis, -1)  # [..., C]
    c = z.shape[-1]
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    y = np.asarray(labels)
    keep = np.ones(y.shape, bool) if ignore_index is None else y != ignore_index
    ys = np.where(keep, y, 0)
    w = np.ones(c) if weight is None else np.asarray(weight, np.float64)
    wy = w[ys] * keep
    nll = -(np.take_along_axis(logp, ys[..., None], -1)[..., 0] * wy).sum() / wy.sum()
    if not label_smoothing:
        return nll
    smooth = -(logp * w).sum(-1) * keep
    denom = wy.sum() if weight is not None else keep.sum()
    return (1 - label_smoothing) * nll + label_smoothing / c * smooth.sum() / denom


def _lm(tmp_path, shape_out=("N", T, V), transpose_to_nct=False):
    """x[N,T,D] -> MatMul W[D,V] -> Add b -> logits [N,T,V] (or Transposed to [N,V,T])."""
    r = np.random.default_rng(0)
    w = r.normal(0, 1, (D, V)).astype(np.float32)
    bias = r.normal(0, 0.1, (V,)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="proj"),
             helper.make_node("Add", ["h", "b"], ["z" if transpose_to_nct else "logits"], name="bias")]
    if transpose_to_nct:
        nodes.append(helper.make_node("Transpose", ["z"], ["logits"], name="t", perm=[0, 2, 1]))
        shape_out = ("N", V, T)
    g = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", T, D])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, list(shape_out))],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(bias, "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    p = str(tmp_path / ("lm_nct.onnx" if transpose_to_nct else "lm.onnx"))
    onnx.save(m, p)
    return p, w.astype(np.float64), bias.astype(np.float64)


def _data(seed=1, ignore=None):
    r = np.random.default_rng(seed)
    x = r.normal(0, 1, (N, T, D)).astype(np.float32)
    y = r.integers(0, V, (N, T)).astype(np.int64)
    if ignore is not None:
        y[0, :3] = ignore
        y[2, 4] = ignore
    return x, y


def _step_outputs(run, x, y):
    """(loss, {weight: exposed gradient}) of one step-graph run."""
    meta = load_run(run)
    state, _ = latest_state(run)
    r = StepRunner(run, meta, state)
    names = [o.name for o in r.sess.get_outputs()]
    feeds = dict(pack(meta, state), x=x, labels=y)
    out = dict(zip(names, r.sess.run(None, feeds)))
    return float(out["loss"]), {w: out[g] for w, g in meta["grads"].items()}, meta


def _fd_grad(f, w, eps=1e-6):
    g = np.zeros_like(w)
    for i in np.ndindex(w.shape):
        wp, wm = w.copy(), w.copy()
        wp[i] += eps
        wm[i] -= eps
        g[i] = (f(wp) - f(wm)) / (2 * eps)
    return g


CASES = [
    ("plain", {}),
    ("ignore", dict(ignore_index=-100)),
    ("smooth", dict(label_smoothing=0.1)),
    ("weights", dict(class_weights=[1.0, 2.0, 0.5, 1.5, 3.0, 1.0])),
    ("all", dict(ignore_index=-100, label_smoothing=0.2, class_weights=[1.0, 2.0, 0.5, 1.5, 3.0, 0.25])),
]


@pytest.mark.parametrize("name,opts", CASES, ids=[c[0] for c in CASES])
def test_lm_cross_entropy_matches_torch_semantics(tmp_path, name, opts):
    path, w, bias = _lm(tmp_path)
    run = str(tmp_path / "run")
    meta = build_step(path, run, precision="fp32", optimizer="sgd", lr=0.1, loss_scale=1.0, expose_grads=True,
                      class_axis=-1, **opts)
    assert meta["label"]["shape"] == ["N", T]  # [N,T,V] logits -> [N,T] labels, no label_shape given
    cfg = meta["config"]
    assert (cfg["class_axis"], cfg["num_classes"], cfg["ignore_index"]) == (-1, V, opts.get("ignore_index"))
    assert cfg["label_smoothing"] == opts.get("label_smoothing", 0.0)
    assert cfg["class_weights"] == opts.get("class_weights")
    x, y = _data(ignore=opts.get("ignore_index"))
    ref_kw = dict(axis=-1, ignore_index=opts.get("ignore_index"), label_smoothing=opts.get("label_smoothing", 0.0),
                  weight=opts.get("class_weights"))
    x64 = x.astype(np.float64)

    def loss_of(wm, bm):
        return cross_entropy_ref(x64 @ wm + bm, y, **ref_kw)
    loss, grads, _ = _step_outputs(run, x, y)
    np.testing.assert_allclose(loss, loss_of(w, bias), rtol=1e-5)
    np.testing.assert_allclose(grads["W"], _fd_grad(lambda wm: loss_of(wm, bias), w), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads["b"], _fd_grad(lambda bm: loss_of(w, bm), bias), rtol=1e-4, atol=1e-6)
    if opts.get("ignore_index") is not None:  # ignored positions: no loss, no gradient
        y2 = y.copy()
        x2 = x.copy()
        x2[0, :3] += 5.0  # change only the inputs of ignored positions
        loss2, grads2, _ = _step_outputs(run, x2, y2)
        assert loss2 == pytest.approx(loss, rel=1e-6)
        np.testing.assert_allclose(grads2["W"], grads["W"], rtol=1e-5, atol=1e-7)
    try:
        import torch
    except ImportError:
        return
    t = torch.nn.functional.cross_entropy(
        torch.tensor(x64 @ w + bias).permute(0, 2, 1), torch.tensor(y),
        weight=None if opts.get("class_weights") is None else torch.tensor(opts["class_weights"], dtype=torch.float64),
        ignore_index=opts.get("ignore_index", -100), label_smoothing=opts.get("label_smoothing", 0.0))
    np.testing.assert_allclose(loss, float(t), rtol=1e-5)


def test_class_axis_1_on_nct_logits_equals_axis_minus_1_on_ntv(tmp_path):
    """The same model written [N,V,T] (default class axis 1) and [N,T,V] (class axis -1):
    same loss, same gradient."""
    p_ntv, w, bias = _lm(tmp_path)
    p_nct, _, _ = _lm(tmp_path, transpose_to_nct=True)
    kw = dict(precision="fp32", optimizer="sgd", lr=0.1, loss_scale=1.0, expose_grads=True, ignore_index=-1,
              label_smoothing=0.05)
    m1 = build_step(p_ntv, str(tmp_path / "a"), class_axis=-1, **kw)
    m2 = build_step(p_nct, str(tmp_path / "b"), **kw)
    assert m1["label"]["shape"] == m2["label"]["shape"] == ["N", T]
    x, y = _data(ignore=-1)
    l1, g1, _ = _step_outputs(str(tmp_path / "a"), x, y)
    l2, g2, _ = _step_outputs(str(tmp_path / "b"), x, y)
    ref = cross_entropy_ref(x.astype(np.float64) @ w + bias, y, axis=-1, ignore_index=-1, label_smoothing=0.05)
    np.testing.assert_allclose([l1, l2], [ref, ref], rtol=1e-5)
    np.testing.assert_allclose(g1["W"], g2["W"], rtol=1e-5, atol=1e-7)


def test_mixed_precision_lm_loss_close_to_reference(tmp_path):
    path, w, bias = _lm(tmp_path)
    run = str(tmp_path / "mixed")
    build_step(path, run, precision="mixed", optimizer="sgd", lr=0.1, class_axis=-1, ignore_index=-100,
               label_smoothing=0.1)
    x, y = _data(ignore=-100)
    loss, _, _ = _step_outputs(run, x, y)
    ref = cross_entropy_ref(x.astype(np.float64) @ w + bias, y, axis=-1, ignore_index=-100, label_smoothing=0.1)
    np.testing.assert_allclose(loss, ref, rtol=2e-3)  # FP16 MatMul, FP32 loss


def test_cli_loss_flags_and_class_weight_file(tmp_path, capsys):
    path, w, bias = _lm(tmp_path)
    np.save(tmp_path / "cw.npy", np.array([1, 2, 3, 4, 5, 6], np.float32))
    run = str(tmp_path / "run")
    assert main(["train-graph", path, "-o", run, "--precision", "fp32", "--class-axis", "-1", "--ignore-index",
                 "-100", "--label-smoothing", "0.1", "--class-weights", str(tmp_path / "cw.npy")]) == 0
    cfg = json.load(open(os.path.join(run, "train.json")))["config"]
    assert cfg["class_weights"] == [1, 2, 3, 4, 5, 6] and cfg["ignore_index"] == -100
    assert cfg["num_classes"] == V and cfg["class_axis"] == -1 and cfg["label_smoothing"] == 0.1
    assert parse_class_weights("1, 2.5,0") == [1.0, 2.5, 0.0]


@pytest.mark.parametrize("args,msg", [
    (["--class-weights", "1,2,3"], "3 class weights for 6 classes"),
    (["--class-weights", "1,x"], "expected comma-separated numbers"),
    (["--class-weights=-1,1,1,1,1,1"], "must be finite, >= 0"),
    (["--class-weights", "missing.npy"], "no such file"),
    (["--label-smoothing", "1.0"], "label_smoothing must be in [0, 1)"),
    (["--class-axis", "0"], "is the batch axis"),
    (["--class-axis", "3"], "class_axis 3 is out of range"),
    (["--loss", "mse", "--ignore-index", "-100"], "only apply to the cross-entropy loss"),
])
def test_loss_errors_are_one_line(tmp_path, capsys, args, msg):
    path, _, _ = _lm(tmp_path)
    assert main(["train-graph", path, "-o", str(tmp_path / "run"), "--precision", "fp32", "--class-axis", "-1"]
                + args) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err


def test_all_positions_ignored_skips_the_step(tmp_path):
    """Every label ignored: the mean has no positions (torch gives NaN); the step is skipped."""
    path, _, _ = _lm(tmp_path)
    run = str(tmp_path / "run")
    build_step(path, run, precision="fp32", class_axis=-1, ignore_index=-100)
    meta = load_run(run)
    state, _ = latest_state(run)
    r = StepRunner(run, meta, state)
    x, _ = _data()
    loss, applied, _ = r.step({"x": x, "labels": np.full((N, T), -100, np.int64)})
    assert not applied and not np.isfinite(loss)
    assert np.array_equal(r.state_numpy()["W"], state["W"])
    with pytest.raises(GraphmpError, match="class_axis"):
        build_step(path, str(tmp_path / "r2"), precision="fp32", class_axis=-4)


def test_cli_only_gradient_check_for_a_sequence_lm(tmp_path):
    """train-graph (SGD) -> train one full batch -> export: the weight change equals -lr times
    the finite-difference gradient of torch's loss on the original model."""
    path, w, bias = _lm(tmp_path)
    x, y = _data(ignore=-100)
    np.savez(tmp_path / "d.npz", x=x, labels=y)
    run, out, lr = str(tmp_path / "run"), str(tmp_path / "trained.onnx"), 0.5
    assert main(["train-graph", path, "-o", run, "--precision", "fp32", "--optimizer", "sgd", "--momentum", "0",
                 "--lr", str(lr), "--loss-scale", "1", "--class-axis", "-1", "--ignore-index", "-100"]) == 0
    assert main(["train", run, "--data", str(tmp_path / "d.npz"), "--batch-size", str(N), "-q"]) == 0
    assert main(["export", run, "-o", out]) == 0
    got = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    x64 = x.astype(np.float64)

    def loss_of(wm, bm):
        return cross_entropy_ref(x64 @ wm + bm, y, axis=-1, ignore_index=-100)
    np.testing.assert_allclose(got["W"], w - lr * _fd_grad(lambda wm: loss_of(wm, bias), w), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["b"], bias - lr * _fd_grad(lambda bm: loss_of(w, bm), bias), rtol=1e-4, atol=1e-6)

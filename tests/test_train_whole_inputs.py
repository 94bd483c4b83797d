"""Inputs and labels with no batch axis (graphmp.train.data.whole_arrays), and mse targets that
must have the output's element count (losses.add_loss's Reshape).

An RNN's initial state [layers, batch, hidden] beside a batch-first input, a scalar input, or a
model whose output has no batch axis (models/real/aecmos_gru: output [4] at batch 1) cannot be
fed "samples on the first axis". The data gives such an array whole: once (fed with every
batch) or once per sample (then each step is one sample). Checked against the model itself run
in ONNX Runtime with the same feeds.
"""
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fixtures import tiny as tm
from graphmp.cli import main
from graphmp.errors import GraphmpError
from graphmp.train.data import _label_form, whole_arrays
from graphmp.train.loop import evaluate, load_run, train
from graphmp.train.step import build_step


def _with_state(tmp_path):
    """The MLP with x = x_in + sum(state, axis 0): state [2, 4] has no batch axis."""
    m = tm.mlp()
    m.graph.input[0].name = "x_in"
    m.graph.input.append(helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, 4]))
    m.graph.node.insert(0, helper.make_node("ReduceSum", ["state"], ["hs"], keepdims=0))
    m.graph.node.insert(1, helper.make_node("Add", ["x_in", "hs"], ["x"]))
    path = str(tmp_path / "m.onnx")
    onnx.save(m, path)
    return path


def _ce(logits, labels):
    z = logits - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return float(-logp[np.arange(len(labels)), labels].mean())


def test_which_arrays_are_whole():
    meta = {"inputs": {"x": ["N", 4], "h0": [4, 1, 64], "sr": []}, "label": {"name": "labels", "shape": ["N"]}}
    assert set(whole_arrays(meta)) == {"h0", "sr"}
    # exporters name the batch dim of each input freely: two free first axes are both batches
    assert whole_arrays({"inputs": {"a": ["unk__3", 4], "b": ["batch", 2]}, "label": {}}) == {}
    # every first axis fixed: it is the (fixed) batch axis of all, as for a batch-1 export
    assert whole_arrays({"inputs": {"x": [1, 4]}, "label": {"name": "labels", "shape": [1]}}) == {}
    # labels: the data's rank decides; one axis more than a label shape that starts fixed = per sample
    assert _label_form(np.zeros((8, 4)), [4]) == "stacked"          # output [4], no batch axis
    assert _label_form(np.zeros(8), []) == "stacked"                # a scalar output
    assert _label_form(np.zeros((8, 22, 5)), [2, 22, 5]) is None    # batch pinned at 2 by --shapes
    assert _label_form(np.zeros((8, 1)), ["N"]) is None             # a shape error, not a layout
    assert _label_form(np.zeros((8, 3)), [4]) is None


def test_a_state_given_once_is_fed_with_every_batch(tmp_path):
    path = _with_state(tmp_path)
    run = str(tmp_path / "run")
    build_step(path, run, precision="fp32", optimizer="sgd", lr=0.05)
    d = tm.blobs(32)
    state = np.random.default_rng(1).normal(0, 0.5, (2, 4)).astype(np.float32)
    data = {"x_in": d["x"], "state": state, "labels": d["labels"]}
    res = train(run, data, epochs=2, batch_size=8, progress=False)
    assert res.summary["steps"] == 8 and res.summary["skipped_steps"] == 0
    # eval feeds the same constant: its loss is the model's own, run in ORT with the trained weights
    ev = evaluate(run, data, state=res.state)
    m = onnx.load(path)
    for t in m.graph.initializer:
        t.CopyFrom(onnx.numpy_helper.from_array(np.asarray(res.state[t.name], np.float32), t.name))
    logits = ort.InferenceSession(m.SerializeToString()).run(None, {"x_in": d["x"], "state": state})[0]
    assert ev["samples"] == 32
    assert ev["loss"] == pytest.approx(_ce(logits.astype(np.float64), d["labels"]), rel=1e-5)
    # the state mattered: the same weights with a zero state give another loss
    assert evaluate(run, dict(data, state=np.zeros_like(state)), state=res.state)["loss"] != \
        pytest.approx(ev["loss"], rel=1e-3)


def test_a_state_given_per_sample_makes_one_sample_steps(tmp_path, capsys):
    path = _with_state(tmp_path)
    run = str(tmp_path / "run")
    build_step(path, run, precision="fp32", optimizer="sgd", lr=1e-3)
    d = tm.blobs(6)
    states = np.random.default_rng(2).normal(0, 1, (6, 2, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x_in=d["x"], state=states, labels=d["labels"])
    assert main(["train", run, "--data", str(tmp_path / "d.npz"), "--batch-size", "2", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'state' is given once per sample" in err and "batch size 1" in err
    res = train(run, str(tmp_path / "d.npz"), epochs=1, batch_size=1, progress=False, seed=3)
    assert res.summary["steps"] == 6
    # step 0 took sample order[0] with its own state: its loss is the model's on that sample
    first = int(np.random.default_rng(3).permutation(6)[0])
    sess = ort.InferenceSession(path)
    logits = sess.run(None, {"x_in": d["x"][first:first + 1], "state": states[first]})[0]
    assert res.history["loss"][0] == pytest.approx(_ce(logits.astype(np.float64), d["labels"][first:first + 1]),
                                                   rel=1e-5)


def test_a_whole_array_of_the_wrong_shape_is_one_line(tmp_path, capsys):
    path = _with_state(tmp_path)
    run = str(tmp_path / "run")
    build_step(path, run, precision="fp32", optimizer="sgd", lr=0.1)
    d = tm.blobs(16)
    np.savez(tmp_path / "d.npz", x_in=d["x"], state=np.zeros((16, 4), np.float32), labels=d["labels"])
    assert main(["train", run, "--data", str(tmp_path / "d.npz"), "--batch-size", "2", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "'state' has shape [16, 4]" in err and "no batch axis" in err and "shape [2, 4]" in err, err
    np.savez(tmp_path / "n.npz", x_in=d["x"], state=np.full((2, 4), np.nan, np.float32), labels=d["labels"])
    with pytest.raises(GraphmpError, match="'state' .*fed whole with every batch.* NaN"):
        train(run, str(tmp_path / "n.npz"), batch_size=2, progress=False)


def _unbatched_output(tmp_path):
    """x [N, 4] -> MatMul -> ReduceSum over the batch -> y [3], declared as y ['N'] (the lie of
    aecmos_gru's exporter: the output has no batch axis)."""
    w = np.random.default_rng(0).normal(0, 0.5, (4, 3)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("ReduceSum", ["h", "ax"], ["y"], keepdims=0)],
        "unbatched", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])],
        [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(np.array([0], np.int64), "ax")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    path = str(tmp_path / "u.onnx")
    onnx.save(m, path)
    return path, w


def test_mse_labels_that_do_not_fit_the_output_are_named_with_the_fix(tmp_path, capsys):
    path, w = _unbatched_output(tmp_path)
    # mixed: the calibration run finds it while building, and measures the real shape
    with pytest.raises(GraphmpError, match=r"labels \[3\] on a generated batch.*--label-shape 3"):
        build_step(path, str(tmp_path / "mixed"), loss="mse", precision="mixed")
    # fp32: found while the build proves its step on a generated batch, the same one line
    # (before the proof, only the first training step found it)
    assert main(["train-graph", path, "-o", str(tmp_path / "run"), "--loss", "mse", "--precision", "fp32",
                 "--optimizer", "sgd", "--lr", "0.1", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("graphmp: error:") and "labels [3] on a generated batch" in err and "--label-shape 3" in err
    assert not os.path.exists(tmp_path / "run" / "train.json")
    x = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)
    # with the real shape, the labels are whole per sample: one sample per step, and its loss is
    # the model's own mse on that sample
    run3 = str(tmp_path / "run3")
    build_step(path, run3, loss="mse", precision="fp32", optimizer="sgd", lr=1e-3, label_shape=[3])
    t = np.random.default_rng(2).normal(size=(8, 3)).astype(np.float32)
    res = train(run3, {"x": x, "labels": t}, epochs=1, batch_size=1, progress=False, seed=0)
    i = int(np.random.default_rng(0).permutation(8)[0])
    assert res.history["loss"][0] == pytest.approx(float(((x[i:i + 1] @ w).sum(0) - t[i]) ** 2 @ np.ones(3) / 3),
                                                   rel=1e-5)
    ev = evaluate(run3, {"x": x, "labels": t}, state=res.state)
    assert ev["samples"] == 8


def test_mse_targets_take_the_output_shape_not_a_broadcast(tmp_path):
    """Labels [N, 1] against an output [N]: one difference per sample, not N x N."""
    m = tm.mlp(classes=1)
    m.graph.node.append(helper.make_node("Squeeze", ["logits", "one"], ["y"]))
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "one"))
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"]))
    path = str(tmp_path / "sq.onnx")
    onnx.save(m, path)
    run = str(tmp_path / "run")
    build_step(path, run, loss="mse", precision="fp32", optimizer="sgd", lr=1e-3, label_shape=["N", 1])
    assert load_run(run)["label"]["shape"] == ["N", 1]
    d = tm.blobs(4)
    t = np.arange(4, dtype=np.float32).reshape(4, 1)
    res = train(run, {"x": d["x"], "labels": t}, epochs=1, batch_size=4, progress=False)
    y = ort.InferenceSession(path).run(None, {"x": d["x"]})[0]
    assert res.history["loss"][0] == pytest.approx(float(((y - t[:, 0]) ** 2).mean()), rel=1e-5)
    assert res.history["loss"][0] != pytest.approx(float(((y - t) ** 2).mean()), rel=1e-3)


@pytest.mark.parametrize("shapes", [None, "x:2x4"])
def test_labels_follow_the_output_whatever_its_dims_are_named(tmp_path, shapes):
    """The output's batch dim named unlike the input's ('unk__7' beside 'N', as exporters do),
    with and without --shapes: the mixed build's calibration labels take the output's real
    shape, and a batch of 2 trains (before, the labels were sized [1] and the build failed)."""
    m = tm.mlp()
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "unk__7"
    path = str(tmp_path / "m.onnx")
    onnx.save(m, path)
    run = str(tmp_path / "run")
    build_step(path, run, loss="mse", precision="mixed", optimizer="sgd", lr=0.01, shapes=shapes)
    assert load_run(run)["label"]["shape"][0] == "unk__7"
    d = tm.blobs(8)
    t = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    res = train(run, {"x": d["x"], "labels": t}, epochs=1, batch_size=2, progress=False)
    assert res.summary["steps"] == 4 and np.isfinite(res.history["loss"]).all()

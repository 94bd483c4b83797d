"""Weights stored as Constant nodes (paddle2onnx, TF exports) are trained and exported back
as Constant nodes; train-graph's reports about the source model (shared parameters, eval-mode
export look); run folder safety (--force). Everything through the real CLI / ONNX Runtime,
gradients against finite differences of a float64 numpy model.
"""
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphmp.cli import main
from graphmp.errors import GraphmpError
from graphmp.train.step import build_step
from graphmp.train.runlock import LOCK_NAME
from fixtures import tiny as tm
from test_train_losses import _fd_grad

N, C, K = 8, 3, 3  # batch, input channels, classes; image 2x2 upsampled to 4x4
FEAT = C * 16


def _const(name, arr):
    return helper.make_node("Constant", [], [name], name=name + "_node",
                            value=numpy_helper.from_array(np.asarray(arr), name))


def constant_model():
    """x[N,C,2,2] -> Resize(nearest x2, scales a float Constant) -> Reshape(int Constant) -> MatMul W
    -> Add b -> logits[N,K]; W and b are Constant nodes and the batch dim is -1, as paddle2onnx
    writes them."""
    r = np.random.default_rng(0)
    w = r.normal(0, 0.3, (FEAT, K)).astype(np.float32)
    b = r.normal(0, 0.1, (K,)).astype(np.float32)
    nodes = [_const("scales", np.array([1, 1, 2, 2], np.float32)),
             _const("shape", np.array([-1, FEAT], np.int64)),
             _const("W", w), _const("b", b),
             helper.make_node("Resize", ["x", "", "scales"], ["up"], name="resize", mode="nearest"),
             helper.make_node("Reshape", ["up", "shape"], ["flat"], name="reshape"),
             helper.make_node("MatMul", ["flat", "W"], ["h"], name="fc"),
             helper.make_node("Add", ["h", "b"], ["logits"], name="bias")]
    # batch dims written as -1, as paddle2onnx does
    g = helper.make_graph(nodes, "paddle_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, C, 2, 2])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [-1, K])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    return m, w.astype(np.float64), b.astype(np.float64)


def _loss_ref(x, y, w, b):
    up = np.repeat(np.repeat(x.astype(np.float64), 2, axis=2), 2, axis=3).reshape(len(x), -1)
    z = up @ w + b
    z = z - z.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return -logp[np.arange(len(y)), y].mean()


def test_constant_weights_train_and_export_back_as_constants(tmp_path, capsys):
    m, w, b = constant_model()
    src = str(tmp_path / "m.onnx")
    onnx.save(m, src)
    r = np.random.default_rng(1)
    x = r.normal(0, 1, (N, C, 2, 2)).astype(np.float32)
    y = r.integers(0, K, N).astype(np.int64)
    np.savez(tmp_path / "d.npz", x=x, labels=y)
    run, out, lr = str(tmp_path / "run"), str(tmp_path / "trained.onnx"), 0.5
    assert main(["train-graph", src, "-o", run, "--precision", "fp32", "--optimizer", "sgd", "--momentum", "0",
                 "--lr", str(lr), "--loss-scale", "1"]) == 0
    assert "2 trainable tensors were stored as Constant nodes" in capsys.readouterr().out
    meta = json.load(open(os.path.join(run, "train.json")))
    assert meta["constant_weights"] == {"W": "W_node", "b": "b_node"}  # scales (Resize) and shape (int) stay
    assert sorted(meta["weights"]) == ["W", "b"]
    assert main(["train", run, "--data", str(tmp_path / "d.npz"), "--batch-size", str(N), "-q"]) == 0
    assert main(["export", run, "-o", out]) == 0
    e = onnx.load(out)
    consts = {n.name: n for n in e.graph.node if n.op_type == "Constant"}
    assert set(consts) == {"scales_node", "shape_node", "W_node", "b_node"} and not e.graph.initializer
    got = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in consts.values()}
    # one full-batch SGD step: w' = w - lr * dL/dw, dL/dw by finite differences of the float64 model
    np.testing.assert_allclose(got["W"], w - lr * _fd_grad(lambda wm: _loss_ref(x, y, wm, b), w), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["b"], b - lr * _fd_grad(lambda bm: _loss_ref(x, y, w, bm), b), rtol=1e-4, atol=1e-6)
    assert not np.allclose(got["W"], w)
    np.testing.assert_array_equal(got["scales"], [1, 1, 2, 2])
    # the exported model runs and computes with the trained weights
    z = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    up = np.repeat(np.repeat(x, 2, axis=2), 2, axis=3).reshape(N, -1)
    np.testing.assert_allclose(z, up @ got["W"] + got["b"], rtol=1e-5, atol=1e-5)


def test_mixed_export_of_constant_weights_runs(tmp_path):
    """--mixed converts the written-back model as `graphmp convert` would the source (which
    may fold Constant nodes into FP16 initializers): same outputs as the FP32 export."""
    m, _, _ = constant_model()
    src = str(tmp_path / "m.onnx")
    onnx.save(m, src)
    run = str(tmp_path / "run")
    build_step(src, run, precision="mixed", optimizer="sgd", lr=0.1)
    assert main(["export", run, "-o", str(tmp_path / "fp32.onnx")]) == 0
    assert main(["export", run, "-o", str(tmp_path / "mp.onnx"), "--mixed"]) == 0
    x = np.random.default_rng(0).normal(0, 1, (2, C, 2, 2)).astype(np.float32)
    z32, zmp = (ort.InferenceSession(str(tmp_path / f), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
                for f in ("fp32.onnx", "mp.onnx"))
    np.testing.assert_allclose(zmp, z32, rtol=1e-2, atol=1e-2)


def _tied_model():
    """Two Gemms reading the same weight (tied), plus an untied head."""
    r = np.random.default_rng(0)
    inits = [numpy_helper.from_array(r.normal(0, 0.5, (4, 4)).astype(np.float32), "shared.weight"),
             numpy_helper.from_array(r.normal(0, 0.5, (3, 4)).astype(np.float32), "head.weight")]
    nodes = [helper.make_node("Gemm", ["x", "shared.weight"], ["h1"], name="l1", transB=1),
             helper.make_node("Relu", ["h1"], ["a1"], name="r1"),
             helper.make_node("Gemm", ["a1", "shared.weight"], ["h2"], name="l2", transB=1),
             helper.make_node("Gemm", ["h2", "head.weight"], ["logits"], name="head", transB=1)]
    g = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _cnn_without_norm(weight_names):
    """Two biased Convs + Relu, no norm, no Dropout, written by torch: with weights named
    `onnx::Conv_N` it is what an eval-mode export leaves of Conv+BN (BN folded); with module
    parameter names it is a CNN that truly has no norm (super-resolution style)."""
    r = np.random.default_rng(0)
    inits, nodes, x = [], [], "x"
    for i, wn in enumerate(weight_names):
        inits += [numpy_helper.from_array(r.normal(0, 0.3, (2, 2 if i else 1, 3, 3)).astype(np.float32), wn),
                  numpy_helper.from_array(np.full(2, 0.1, np.float32), wn + "_bias")]
        nodes += [helper.make_node("Conv", [x, wn, wn + "_bias"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    inits.append(numpy_helper.from_array(r.normal(0, 0.3, (3, 2 * 16)).astype(np.float32), "fc.weight"))
    nodes += [helper.make_node("Flatten", [x], ["f"], name="flat"),
              helper.make_node("Gemm", ["f", "fc.weight"], ["logits"], name="fc", transB=1)]
    g = helper.make_graph(nodes, "folded", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 4, 4])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="pytorch")
    return m


def test_reports_shared_parameters_and_eval_mode_export(tmp_path, capsys):
    tied, folded, cnn = str(tmp_path / "tied.onnx"), str(tmp_path / "folded.onnx"), str(tmp_path / "cnn.onnx")
    onnx.save(_tied_model(), tied)
    onnx.save(_cnn_without_norm(["onnx::Conv_16", "onnx::Conv_19"]), folded)
    onnx.save(tm.cnn(), cnn)
    assert main(["train-graph", tied, "-o", str(tmp_path / "a"), "--precision", "fp32"]) == 0
    out = capsys.readouterr()
    assert "1 trainable parameters are shared by several consumers" in out.out and "shared.weight" in out.out
    assert "warning" not in out.err
    assert json.load(open(tmp_path / "a" / "train.json"))["shared_weights"] == {"shared.weight": 2}
    assert main(["train-graph", folded, "-o", str(tmp_path / "b"), "--precision", "fp32"]) == 0
    err = capsys.readouterr().err
    assert "looks like an eval-mode torch export" in err and "dynamo=False, do_constant_folding=False" in err
    assert "training=torch.onnx.TrainingMode.TRAINING" in err
    assert json.load(open(tmp_path / "b" / "train.json"))["warnings"]
    assert main(["train-graph", cnn, "-o", str(tmp_path / "c"), "--precision", "fp32"]) == 0  # has BatchNorm
    out = capsys.readouterr()
    assert "warning" not in out.err and "shared by several consumers" not in out.out
    plain = str(tmp_path / "plain.onnx")  # no norm, but its parameters keep their module names
    onnx.save(_cnn_without_norm(["conv1.weight", "conv2.weight"]), plain)
    assert main(["train-graph", plain, "-o", str(tmp_path / "d"), "--precision", "fp32"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_non_empty_run_folder_is_refused_unless_force(tmp_path, capsys):
    src = str(tmp_path / "mlp.onnx")
    onnx.save(tm.mlp(), src)
    run = str(tmp_path / "run")
    np.savez(tmp_path / "d.npz", **tm.blobs(32))
    assert main(["train-graph", src, "-o", run, "--precision", "fp32", "--lr", "0.01"]) == 0
    assert main(["train", run, "--data", str(tmp_path / "d.npz"), "--batch-size", "8", "-q"]) == 0
    assert any(f.startswith("ckpt-") for f in os.listdir(run))
    trained = np.load(os.path.join(run, [f for f in os.listdir(run) if f.startswith("ckpt-")][0]))["fc1.weight"]
    capsys.readouterr()
    assert main(["train-graph", src, "-o", run, "--precision", "fp32", "--lr", "0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert run in err and "--force" in err and len(err.splitlines()) == 1
    assert json.load(open(os.path.join(run, "train.json")))["config"]["lr"] == 0.01  # untouched
    before = set(os.listdir(run))
    assert main(["train-graph", src, "-o", run, "--model-output", "nope", "--force"]) == 2  # a failed build...
    assert set(os.listdir(run)) == before  # ...leaves the old run whole
    assert main(["train-graph", src, "-o", run, "--precision", "fp32", "--lr", "0.5", "--force"]) == 0
    files = set(os.listdir(run)) - {LOCK_NAME}  # the lock file `train` held stays (graphmp.train.runlock)
    assert files == {"train.json", "step.onnx", "state.npz", "infer.onnx"}  # old checkpoints, summary, curve gone
    assert json.load(open(os.path.join(run, "train.json")))["config"]["lr"] == 0.5
    fresh = np.load(os.path.join(run, "state.npz"))["fc1.weight"]
    assert np.array_equal(fresh, numpy_helper.to_array(tm.mlp().graph.initializer[0]))
    assert not np.array_equal(fresh, trained)
    with pytest.raises(GraphmpError, match="not empty"):
        build_step(src, run, precision="fp32")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    build_step(src, str(other), precision="fp32", force=True)  # force keeps files that are not the run's
    assert (other / "notes.txt").read_text() == "mine"

"""Removed experimental ops (ImageScaler, Crop, Affine) in old exports: graphmp/train/removed_ops.py
(graphmp/passes/legalize.py's rewrite) rewrites them into standard ops so train-graph can upgrade the opset (issue 14: the WinML
style-transfer model stopped at "cannot upgrade opset 7"). Checked against ONNX Runtime's own
kernels for these ops, and end to end through the CLI."""
import copy
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphmp.cli import main
from graphmp.errors import GraphmpError
from graphmp.train.removed_ops import rewrite_experimental

F32 = TensorProto.FLOAT


def legacy_model(crop_attrs, ir=3):
    """x[N,3,10,12] -> ImageScaler -> Conv3x3(pad 1) -> Crop -> Affine -> y (opset 7, IR 3:
    initializers are also graph inputs, as old exporters wrote them)."""
    r = np.random.default_rng(0)
    w = numpy_helper.from_array((r.standard_normal((2, 3, 3, 3)) * 0.3).astype(np.float32), "conv.W")
    b = numpy_helper.from_array(np.array([0.1, -0.2], np.float32), "conv.B")
    nodes = [helper.make_node("ImageScaler", ["x"], ["s"], name="scaler", scale=0.5, bias=[-1.0, 0.5, 2.0]),
             helper.make_node("Conv", ["s", "conv.W", "conv.B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Crop", ["c"], ["k"], name="crop", **crop_attrs),
             helper.make_node("Affine", ["k"], ["y"], name="affine", alpha=3.0, beta=-0.5)]
    inputs = [helper.make_tensor_value_info("x", F32, ["N", 3, 10, 12])]
    if ir < 4:
        inputs += [helper.make_tensor_value_info(t.name, F32, list(t.dims)) for t in (w, b)]
    g = helper.make_graph(nodes, "legacy", inputs, [helper.make_tensor_value_info("y", F32, None)], [w, b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 7)])
    m.ir_version = ir
    return m


def _run(m, x):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


CROPS = [dict(border=[1, 2, 3, 1]), dict(border=[2, 1, 0, 0]), dict(border=[1, 2, 0, 0], scale=[5, 7])]


@pytest.mark.parametrize("crop", CROPS)
def test_rewrite_equals_onnxruntime_and_upgrades(crop):
    from graphmp.opset import upgrade
    m = legacy_model(crop)
    x = np.random.default_rng(1).standard_normal((2, 3, 10, 12)).astype(np.float32)
    want = _run(m, x)  # ONNX Runtime's ImageScaler / Crop / Affine kernels
    r = copy.deepcopy(m)
    added = rewrite_experimental(r, "m")
    assert {n.op_type for n in r.graph.node} == {"Mul", "Add", "Conv", "Slice"}
    assert sorted(added) == ["affine.alpha", "affine.beta", "scaler.bias", "scaler.scale"]  # the ops' attributes
    # to FP32 rounding: the constants are initializers now (IR 4), which ONNX Runtime folds into the Conv
    np.testing.assert_allclose(_run(r, x), want, rtol=1e-6, atol=1e-6)
    up = upgrade(r, 16, "m")  # the original cannot be upgraded at all
    np.testing.assert_allclose(_run(up, x), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(GraphmpError, match="cannot upgrade"):
        upgrade(m, 16, "m")


def test_model_without_experimental_ops_is_untouched():
    m = legacy_model(CROPS[0])
    del m.graph.node[-1]  # drop Affine... and the rest, to a plain Conv model
    m.graph.node.pop(0)
    m.graph.node.pop(-1)
    before = m.SerializeToString()
    assert rewrite_experimental(m) == [] and m.SerializeToString() == before


def test_malformed_crop_is_named():
    with pytest.raises(GraphmpError, match="Crop node 'crop'.*border"):
        rewrite_experimental(legacy_model(dict(border=[1, 2])), "m.onnx")


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_opset7_legacy_model_trains_through_the_cli(precision, tmp_path, capsys):
    """train-graph builds the step (it stopped at the opset upgrade before), the rewrite's
    constants (ImageScaler bias, Affine alpha/beta) are not trained, 20 steps lower the loss,
    and export writes a model that runs."""
    path = str(tmp_path / "legacy.onnx")
    onnx.save(legacy_model(CROPS[0]), path)
    r = np.random.default_rng(2)
    x = r.standard_normal((16, 3, 10, 12)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, labels=r.random((16, 2, 7, 8)).astype(np.float32))
    run = str(tmp_path / "run")
    assert main(["train-graph", path, "-o", run, "--loss", "mse", "--precision", precision, "--lr", "0.01",
                 "--shapes", "x:4x3x10x12"]) == 0
    meta = json.load(open(os.path.join(run, "train.json")))
    assert sorted(meta["weights"]) == ["conv.B", "conv.W"]
    assert main(["train", run, "--data", str(tmp_path / "d.npz"), "--batch-size", "4", "--epochs", "5", "-q"]) == 0
    ck = json.load(open(os.path.join(run, "checkpoint.json")))
    hist = np.load(os.path.join(run, ck["state_file"]))["__history__loss"]
    assert len(hist) == 20 and hist[-5:].mean() < 0.7 * hist[:5].mean(), hist
    assert main(["export", run, "-o", str(tmp_path / "out.onnx")]) == 0
    out = onnx.load(str(tmp_path / "out.onnx"))
    assert _run(out, x[:2]).shape == (2, 2, 7, 8)


def test_weights_only_inside_if_branches_are_reported_as_no_trainable_path(tmp_path, capsys):
    """silero_vad keeps every weight as a Constant inside If branches: train-graph says that
    the model has no trainable path and why, not just "no trainable initializer"."""
    def branch(name, value):
        w = helper.make_tensor(f"{name}.w", F32, [2], value)
        return helper.make_graph([helper.make_node("Constant", [], [f"{name}.c"], value=w),
                                  helper.make_node("Mul", ["x", f"{name}.c"], [f"{name}.y"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}.y", F32, ["N", 2])])
    g = helper.make_graph([helper.make_node("If", ["flag"], ["y"], then_branch=branch("then", [1.0, 2.0]),
                                            else_branch=branch("else", [3.0, 4.0]))], "iff",
                          [helper.make_tensor_value_info("x", F32, ["N", 2]),
                           helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", F32, ["N", 2])])
    path = str(tmp_path / "if.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert main(["train-graph", path, "-o", str(tmp_path / "run"), "--loss", "mse", "--precision", "fp32"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no trainable FP32 initializer" in err, err
    assert "its 2 FP32 weight tensors sit inside If branches" in err and "no trainable path" in err, err

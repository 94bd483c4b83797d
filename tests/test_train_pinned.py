"""--shapes pins the step graph's input sizes where a gradient rule needs static lengths
(Resize: one interpolation matrix per axis). Before, --shapes only fed the calibration batch
and a fully convolutional model with a Resize (e.g. PP-OCR's detector, dynamic H and W) was
refused with "length is not static" whatever the user passed."""
import json
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphmp.cli import main
from graphmp.train.flat import pack

F32 = TensorProto.FLOAT


def upsampling_net():
    """x[N,2,H,W] -> Conv3x3 -> Resize(nearest, x2 on H and W, constant scales) -> Conv1x1 -> y."""
    r = np.random.default_rng(0)
    inits = [numpy_helper.from_array((r.standard_normal((3, 2, 3, 3)) * 0.4).astype(np.float32), "c1.W"),
             numpy_helper.from_array((r.standard_normal((1, 3, 1, 1)) * 0.4).astype(np.float32), "c2.W"),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    nodes = [helper.make_node("Conv", ["x", "c1.W"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Resize", ["a", "", "scales"], ["u"], name="up", mode="nearest"),
             helper.make_node("Conv", ["u", "c2.W"], ["y"])]
    g = helper.make_graph(nodes, "up", [helper.make_tensor_value_info("x", F32, ["N", 2, "H", "W"])],
                          [helper.make_tensor_value_info("y", F32, ["N", 1, None, None])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_resize_model_builds_at_the_given_shapes_and_trains(tmp_path, capsys):
    path = str(tmp_path / "up.onnx")
    onnx.save(upsampling_net(), path)
    run = str(tmp_path / "run")
    # without --shapes: refused, and the message says what to pass
    assert main(["train-graph", path, "-o", run, "--loss", "mse", "--precision", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "node 'up' (Resize)" in err and "--shapes" in err and "Traceback" not in err
    assert main(["train-graph", path, "-o", run, "--loss", "mse", "--precision", "fp32", "--lr", "0.01",
                 "--shapes", "x:2x2x4x6"]) == 0
    out = capsys.readouterr().out
    assert "built for the input sizes x:2x2x4x6" in out and "accepts only those sizes" in out
    x = next(v for v in onnx.load(os.path.join(run, "step.onnx")).graph.input if v.name == "x")
    assert [d.dim_value or d.dim_param for d in x.type.tensor_type.shape.dim] == ["N", 2, 4, 6]
    assert json.load(open(os.path.join(run, "train.json")))["config"]["pinned_shapes"] == "x:2x2x4x6"
    r = np.random.default_rng(1)
    np.savez(tmp_path / "d.npz", x=r.standard_normal((8, 2, 4, 6)).astype(np.float32),
             labels=r.standard_normal((8, 1, 8, 12)).astype(np.float32))
    assert main(["train", run, "--data", str(tmp_path / "d.npz"), "--batch-size", "2", "--epochs", "5", "-q"]) == 0
    ck = json.load(open(os.path.join(run, "checkpoint.json")))
    hist = np.load(os.path.join(run, ck["state_file"]))["__history__loss"]
    assert len(hist) == 20 and hist[-5:].mean() < 0.9 * hist[:5].mean(), hist
    # another size passes the data checks (H, W are symbolic in the model) but not the step graph
    np.savez(tmp_path / "big.npz", x=r.standard_normal((8, 2, 8, 6)).astype(np.float32),
             labels=r.standard_normal((8, 1, 16, 12)).astype(np.float32))
    assert main(["train", run, "--data", str(tmp_path / "big.npz"), "--batch-size", "2", "-q", "--no-resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "big.npz" in err and "input 'x' has shape [2, 2, 8, 6]" in err, err
    assert "--shapes" in err


def same_pad_net():
    """x[N,2,H,W] -> Conv3x3 stride 2, auto_pad SAME_UPPER -> y (as TF/paddle exports write it)."""
    w = numpy_helper.from_array((np.random.default_rng(3).standard_normal((2, 2, 3, 3)) * 0.5).astype(np.float32),
                                "W")
    g = helper.make_graph([helper.make_node("Conv", ["x", "W"], ["y"], name="conv", auto_pad="SAME_UPPER",
                                            strides=[2, 2])], "same",
                          [helper.make_tensor_value_info("x", F32, ["N", 2, "H", "W_"])],
                          [helper.make_tensor_value_info("y", F32, ["N", 2, None, None])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_same_padding_with_dynamic_sizes_builds_at_the_given_shapes(tmp_path, capsys):
    """auto_pad=SAME_* with symbolic H/W: refused without --shapes (naming it), built with them
    for any batch, and the gradient equals finite differences of the loss at another batch."""
    from graphmp.model_runs import ort_session
    from graphmp.train.loop import latest_state
    from graphmp.train.step import build_step
    path = str(tmp_path / "same.onnx")
    model = same_pad_net()
    onnx.save(model, path)
    assert main(["train-graph", path, "-o", str(tmp_path / "r0"), "--loss", "mse", "--precision", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "auto_pad=SAME_UPPER" in err and "--shapes" in err and "Traceback" not in err
    run = str(tmp_path / "run")
    meta = build_step(path, run, loss="mse", precision="fp32", shapes="x:2x2x5x7", expose_grads=True,
                      loss_scale=1.0, optimizer="sgd", momentum=0.0)
    r = np.random.default_rng(4)
    x = r.standard_normal((3, 2, 5, 7)).astype(np.float32)  # batch 3: the batch stays free
    labels = r.standard_normal((3, 2, 3, 4)).astype(np.float32)
    state = latest_state(run)[0]
    sess = ort_session(onnx.load(os.path.join(run, "step.onnx")))
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, dict(pack(meta, state), x=x, labels=labels))))
    fwd = ort_session(model)
    w0 = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)

    def loss(w):
        m = onnx.ModelProto()
        m.CopyFrom(model)
        m.graph.initializer[0].CopyFrom(numpy_helper.from_array(w.astype(np.float32), "W"))
        y = ort_session(m).run(None, {"x": x})[0].astype(np.float64)
        return float(np.mean((y - labels) ** 2))

    assert abs(float(got["loss"]) - loss(w0)) < 1e-5
    assert fwd.run(None, {"x": x})[0].shape == (3, 2, 3, 4)
    h, fd = 1e-2, np.zeros(w0.size)
    for i in range(w0.size):
        p, q = w0.copy(), w0.copy()
        p.flat[i] += h
        q.flat[i] -= h
        fd[i] = (loss(p) - loss(q)) / (2 * h)  # exact for a loss quadratic in W, up to FP32 rounding
    np.testing.assert_allclose(got[meta["grads"]["W"]].reshape(-1), fd, rtol=2e-3, atol=2e-3 * np.abs(fd).max())


def _fd_grads(model, feeds, labels, names, h=0.5):
    """Central differences of mean((y - labels)^2) over each element of the initializers
    `names` (the loss is quadratic in one element, so a large step is exact up to FP32)."""
    from graphmp.model_runs import ort_session
    base = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}

    def loss(name, value):
        m = onnx.ModelProto()
        m.CopyFrom(model)
        for t in m.graph.initializer:
            if t.name == name:
                t.CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))
        y = ort_session(m).run(None, feeds)[0].astype(np.float64)
        return float(np.mean((y - labels) ** 2))

    out = {}
    for n in names:
        fd = np.zeros(base[n].size)
        for i in range(base[n].size):
            p, q = base[n].copy(), base[n].copy()
            p.flat[i] += h
            q.flat[i] -= h
            fd[i] = (loss(n, p) - loss(n, q)) / (2 * h)
        out[n] = fd.reshape(base[n].shape)
    return out


import pytest  # noqa: E402


@pytest.mark.parametrize("attrs", [
    dict(auto_pad="VALID", output_shape=[12, 10]),                  # style_mosaic: 1 row/col beyond the natural size
    dict(output_shape=[9, 7]),                                      # pads implied (total 2 each), NOTSET split
    dict(auto_pad="SAME_UPPER"),                                    # out = in * stride
    dict(auto_pad="SAME_LOWER", output_padding=[1, 1]),
], ids=["valid-output_shape", "output_shape", "same-upper", "same-lower-outpad"])
def test_conv_transpose_with_output_shape_or_auto_pad_matches_finite_differences(attrs, tmp_path):
    """ConvTranspose's pads follow from output_shape / auto_pad and the (pinned) input sizes,
    as ONNX Runtime computes them; dW and dB of the step graph equal finite differences of the
    loss on the source model run by ONNX Runtime, at a batch other than the pinned one."""
    from graphmp.model_runs import ort_session
    from graphmp.train.loop import latest_state
    from graphmp.train.step import build_step
    r = np.random.default_rng(5)
    w = numpy_helper.from_array((r.standard_normal((2, 3, 3, 3)) * 0.5).astype(np.float32), "W")
    b = numpy_helper.from_array(r.standard_normal(3).astype(np.float32), "B")
    g = helper.make_graph([helper.make_node("ConvTranspose", ["x", "W", "B"], ["y"], name="up", strides=[2, 2],
                                            **attrs)], "ct",
                          [helper.make_tensor_value_info("x", F32, ["N", 2, "H", "W_"])],
                          [helper.make_tensor_value_info("y", F32, ["N", 3, "Ho", "Wo"])], [w, b])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    path = str(tmp_path / "ct.onnx")
    onnx.save(model, path)
    run = str(tmp_path / "run")
    meta = build_step(path, run, loss="mse", precision="fp32", shapes="x:2x2x5x4", expose_grads=True,
                      loss_scale=1.0, optimizer="sgd", momentum=0.0)
    x = r.standard_normal((3, 2, 5, 4)).astype(np.float32)
    y = ort_session(model).run(None, {"x": x})[0]
    labels = r.standard_normal(y.shape).astype(np.float32)
    sess = ort_session(onnx.load(os.path.join(run, "step.onnx")))
    got = dict(zip([o.name for o in sess.get_outputs()],
                   sess.run(None, dict(pack(meta, latest_state(run)[0]), x=x, labels=labels))))
    fd = _fd_grads(model, {"x": x}, labels.astype(np.float64), ["W", "B"])
    for n in ("W", "B"):
        assert np.abs(fd[n]).max() > 1e-2, "the loss does not depend on " + n
        np.testing.assert_allclose(got[meta["grads"][n]], fd[n], rtol=1e-3, atol=1e-3 * np.abs(fd[n]).max(),
                                   err_msg=f"d loss / d {n} ({attrs})")

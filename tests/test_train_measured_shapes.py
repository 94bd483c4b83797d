"""train-graph on a model whose ranks onnx shape inference loses (graphmp/train/measure.py).

The model is paddle2onnx's pattern at opset 13: Conv -> Reshape(c1, Concat(Slice(Shape(c1),
0:2), [-1])) -> Conv1d -> Tanh (smooth: no kink for the central differences to cross) ->
GlobalAveragePool -> Flatten -> MatMul, with a symbolic batch and image size. onnx 1.23's inference leaves the rank of the Reshape output and of
everything after it unknown, and the Conv/GlobalAveragePool gradient rules need ranks. The
build measures them with ONNX Runtime; the checks: the gradient through the CLI matches
central differences of the loss on the ORIGINAL model (the pattern of tests/test_grad_cli.py:
SGD, lr 0.5, one full-batch step, export, (W - W') / lr), and a step graph built without
--shapes runs at two batch sizes and image sizes, its loss equal to the mse of the original
model's output there.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphmp.cli import main
from graphmp.errors import GraphmpError
from graphmp.model_runs import ort_session
from graphmp.train.autodiff import add_backward
from graphmp.train.flat import pack
from graphmp.train.measure import declare_measured, unknown_rank_tensors
from graphmp.train.step import build_step
from test_grad_cli import LR, check_step

N = helper.make_node
LOST = ["r", "c2", "a", "p", "f"]  # the tensors whose rank onnx inference loses


def _const(name, v):
    return N("Constant", [], [name], value=numpy_helper.from_array(np.array(v, np.int64), name + "_v"))


def lost_rank_model(reshape_rest=(-1,), x_dims=("N", 2, "H", "W")) -> onnx.ModelProto:
    r = np.random.default_rng(7)
    inits = {"W1": r.standard_normal([4, 2, 3, 3]) * 0.3, "B1": r.standard_normal([4]) * 0.1,
             "W2": r.standard_normal([3, 4, 3]) * 0.3, "W3": r.standard_normal([3, 5]) * 0.5}
    nodes = [N("Conv", ["x", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1]),
             N("Shape", ["c1"], ["s"]), _const("st", [0]), _const("en", [2]), _const("ax", [0]),
             N("Slice", ["s", "st", "en", "ax"], ["nc"]), _const("rest", list(reshape_rest)),
             N("Concat", ["nc", "rest"], ["shp"], axis=0),
             N("Reshape", ["c1", "shp"], ["r"]),
             N("Conv", ["r", "W2"], ["c2"], pads=[1, 1]),
             N("Tanh", ["c2"], ["a"]),
             N("GlobalAveragePool", ["a"], ["p"]), N("Flatten", ["p"], ["f"]),
             N("MatMul", ["f", "W3"], ["y"])]
    g = helper.make_graph(nodes, "lost_rank", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_dims))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [x_dims[0], 5])],
                          [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _x(batch, h=5, w=6, seed=0):
    return np.random.default_rng(seed).standard_normal([batch, 2, h, w]).astype(np.float32)


def test_precondition_onnx_inference_loses_the_ranks_and_the_rules_need_them():
    m = lost_rank_model()
    assert unknown_rank_tensors(m) == LOST
    with pytest.raises(GraphmpError, match=r"tensor '\w+': unknown rank.*--shapes NAME:DIMS"):
        add_backward(onnx.load_from_string(m.SerializeToString()), "y", ["W1", "W2", "W3"])


def test_declared_ranks_keep_only_dims_that_do_not_follow_the_free_dims():
    m = lost_rank_model()
    rep = declare_measured(m, "x:2x2x8x8")
    assert rep["tensors"] == len(LOST) and rep["static_dims"] and rep["note"] is None
    assert rep["shapes"] == {"x": [2, 2, 8, 8]}
    assert unknown_rank_tensors(m) == []
    vi = {v.name: v.type.tensor_type for v in list(m.graph.value_info) + list(m.graph.output)}
    got = {t: [d.dim_value if d.HasField("dim_value") else None for d in vi[t].shape.dim] for t in ("r", "c2", "f")}
    # r = [N, 4, H*W]: the channels are kept, batch and length (which move with N, H, W) are not
    assert got == {"r": [None, 4, None], "c2": [None, 3, None], "f": [None, 3]}
    assert all(vi[t].elem_type == TensorProto.FLOAT for t in LOST)


def test_cli_sgd_step_matches_finite_differences(tmp_path):
    model = lost_rank_model()
    src = str(tmp_path / "model.onnx")
    onnx.save(model, src)
    x = _x(3)
    before = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    y = ort_session(model).run(["y"], {"x": x})[0]
    labels = (y + np.random.default_rng(1).standard_normal(y.shape)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, labels=labels)
    run = str(tmp_path / "run")
    assert main(["train-graph", src, "-o", run, "--loss", "mse", "--optimizer", "sgd", "--lr", str(LR),
                 "--momentum", "0", "--weight-decay", "0", "--precision", "fp32", "--loss-scale", "1",
                 "--shapes", "x:3x2x5x6"]) == 0
    with open(tmp_path / "run" / "train.json") as f:
        assert json.load(f)["config"]["measured_shapes"]["tensors"] == len(LOST)
    assert main(["train", run, "--data", str(tmp_path / "data.npz"), "--epochs", "1", "--batch-size", "3",
                 "-q"]) == 0
    out = str(tmp_path / "trained.onnx")
    assert main(["export", run, "-o", out]) == 0
    after = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    check_step(model, x, labels, before, after, ("W1", "B1", "W2", "W3"), "lost-rank model")


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_step_built_without_shapes_runs_at_other_batch_and_image_sizes(tmp_path, precision):
    model = lost_rank_model()
    src = str(tmp_path / "model.onnx")
    onnx.save(model, src)
    meta = build_step(src, tmp_path / "run", loss="mse", optimizer="sgd", lr=LR, momentum=0.0,
                      precision=precision, loss_scale=1.0)
    assert meta["config"]["measured_shapes"]["tensors"] == len(LOST)
    step = onnx.load(str(tmp_path / "run" / "step.onnx"))
    sess = ort_session(step)
    state = pack(meta, dict(np.load(tmp_path / "run" / "state.npz")))
    ref = ort_session(model)
    for batch, h, w in [(2, 5, 6), (5, 9, 4)]:
        x = _x(batch, h, w, seed=batch)
        y = ref.run(["y"], {"x": x})[0]
        labels = np.random.default_rng(batch).standard_normal(y.shape).astype(np.float32)
        feeds = {i.name: state[i.name] for i in sess.get_inputs() if i.name in state}
        feeds.update(x=x, labels=labels)
        loss, finite = sess.run(["loss", "all_finite"], feeds)
        want = float(np.mean((y.astype(np.float64) - labels) ** 2))
        tol = 1e-5 if precision == "fp32" else 2e-2  # FP16 convs in the mixed step
        assert bool(finite)
        assert abs(float(loss) - want) <= tol * max(1.0, want), (batch, h, w, float(loss), want)


def test_measuring_run_impossible_is_one_line_naming_shapes(tmp_path):
    """A Reshape to [N, 11, -1] runs only where 4*H*W is a multiple of 11, which no size that
    graphmp.inputs tries for an image is: nothing is measured, and the one-line error says
    what to give; with --shapes at a size that runs, the step builds."""
    model = lost_rank_model()
    model.graph.node[3].attribute[0].t.CopyFrom(numpy_helper.from_array(np.array([1], np.int64), "en_v"))
    model.graph.node[6].attribute[0].t.CopyFrom(numpy_helper.from_array(np.array([11, -1], np.int64), "rest_v"))
    model.graph.node[9].input[1] = "W2b"
    model.graph.initializer.append(numpy_helper.from_array(
        np.random.default_rng(3).standard_normal([3, 11, 3]).astype(np.float32), "W2b"))
    src = str(tmp_path / "model.onnx")
    onnx.save(model, src)
    assert unknown_rank_tensors(model) == LOST
    run = str(tmp_path / "run")
    with pytest.raises(GraphmpError) as e:
        build_step(src, run, loss="mse", precision="fp32")
    msg = str(e.value)
    assert "\n" not in msg and "unknown rank" in msg and "--shapes NAME:DIMS" in msg, msg
    assert main(["train-graph", src, "-o", run, "--loss", "mse", "--precision", "fp32",
                 "--shapes", "x:2x2x11x11"]) == 0


def runtime_resize_model() -> onnx.ModelProto:
    """x [N, 2, 4, 4] -> Conv -> Resize (linear) to sizes Concat(Shape(c)[:2], [6, 7]): the
    sizes are computed at run time (torch's F.interpolate(size=...) export), so onnx inference
    leaves the output's dims open; SegFormer's decode head does this."""
    r = np.random.default_rng(3)
    inits = {"W1": r.standard_normal([3, 2, 3, 3]) * 0.3, "W2": r.standard_normal([7, 2]) * 0.5}
    nodes = [N("Conv", ["x", "W1"], ["c"], pads=[1, 1, 1, 1]),
             N("Shape", ["c"], ["s"]), _const("st", [0]), _const("en", [2]), _const("ax", [0]),
             N("Slice", ["s", "st", "en", "ax"], ["nc"]), _const("hw", [6, 7]),
             N("Concat", ["nc", "hw"], ["sizes"], axis=0),
             N("Resize", ["c", "", "", "sizes"], ["rs"], mode="linear"),
             N("MatMul", ["rs", "W2"], ["y"])]
    g = helper.make_graph(nodes, "runtime_resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                   ["N", 2, 4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, "h", 2])],
                          [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_resize_to_runtime_sizes_is_measured_and_its_gradient_is_right(tmp_path):
    """With --shapes, the Resize's output lengths are measured (its batch named after the
    input's, which it follows); the CLI SGD step equals finite differences, and the step runs
    at another batch size."""
    model = runtime_resize_model()
    src = str(tmp_path / "model.onnx")
    onnx.save(model, src)
    x = np.random.default_rng(4).standard_normal([2, 2, 4, 4]).astype(np.float32)
    y = ort_session(model).run(["y"], {"x": x})[0]
    labels = (y + np.random.default_rng(5).standard_normal(y.shape)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, labels=labels)
    run = str(tmp_path / "run")
    assert main(["train-graph", src, "-o", run, "--loss", "mse", "--optimizer", "sgd", "--lr", str(LR),
                 "--momentum", "0", "--weight-decay", "0", "--precision", "fp32", "--loss-scale", "1",
                 "--shapes", "x:2x2x4x4", "--label-shape", "N,3,6,2"]) == 0
    assert main(["train", run, "--data", str(tmp_path / "data.npz"), "--epochs", "1", "--batch-size", "2",
                 "-q"]) == 0
    out = str(tmp_path / "trained.onnx")
    assert main(["export", run, "-o", out]) == 0
    before = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    check_step(model, x, labels, before, after, ("W1", "W2"), "runtime-sized Resize")
    x3 = np.random.default_rng(6).standard_normal([3, 2, 4, 4]).astype(np.float32)
    y3 = ort_session(model).run(["y"], {"x": x3})[0]
    np.savez(tmp_path / "d3.npz", x=x3, labels=y3)
    assert main(["train", run, "--data", str(tmp_path / "d3.npz"), "--batch-size", "3", "--no-resume", "-q"]) == 0


def test_a_model_that_fails_onnxs_checker_is_one_line(tmp_path, capsys):
    """A graph output typed without a shape (the checker requires one): train-graph names the
    checker's complaint and writes nothing, instead of a traceback from the final save."""
    m = runtime_resize_model()
    m.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, None))
    onnx.save(m, str(tmp_path / "m.onnx"))
    run = str(tmp_path / "run")
    assert main(["train-graph", str(tmp_path / "m.onnx"), "-o", run, "--loss", "mse", "--precision", "fp32",
                 "--shapes", "x:2x2x4x4", "--label-shape", "N,3,6,2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fails onnx's checker" in err and "Field 'shape'" in err, err
    assert not (tmp_path / "run" / "train.json").exists()

"""Old opsets: convert accepts opset 1..current (upgrading what ONNX Runtime cannot run),
train-graph upgrades to the opset its gradient rules need, and an upgrade that cannot
work names the op that stops it."""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nph

import graphmp
from graphmp.errors import GraphmpError
from graphmp.opset import default_opset, upgrade
from graphmp.model_runs import run_ort, run_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _weights():
    rng = np.random.default_rng(0)
    return {"W": (rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32),
            "s": (1 + 0.1 * rng.standard_normal(4)).astype(np.float32),
            "bb": (0.1 * rng.standard_normal(4)).astype(np.float32),
            "mu": (0.1 * rng.standard_normal(4)).astype(np.float32),
            "var": (1 + 0.1 * rng.random(4)).astype(np.float32),
            "b4": (0.2 * rng.standard_normal(4)).astype(np.float32),
            "G": (rng.standard_normal((8, 4 * 8 * 8)) * 0.05).astype(np.float32),
            "gc": (0.1 * rng.standard_normal(8)).astype(np.float32)}


def legacy_model(opset: int) -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Add(bias, broadcast=1, axis=1) -> Relu -> flatten ->
    Gemm(broadcast=1), in the form an exporter of that era wrote: IR 3, initializers also
    graph inputs, consumed_inputs / is_test / broadcast attributes, Reshape-1's `shape`."""
    w = _weights()
    bn = {"is_test": 1}
    if opset < 6:
        bn["consumed_inputs"] = [0, 0, 0, 1, 1]
    nodes = [oh.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
             oh.make_node("BatchNormalization", ["c", "s", "bb", "mu", "var"], ["bn"], **bn),
             oh.make_node("Add", ["bn", "b4"], ["a"], broadcast=1, axis=1),
             oh.make_node("Relu", ["a"], ["r"])]
    if opset < 5:
        nodes.append(oh.make_node("Reshape", ["r"], ["f"], shape=[1, -1]))
    else:
        nodes.append(oh.make_node("Flatten", ["r"], ["f"]))
    nodes.append(oh.make_node("Gemm", ["f", "G", "gc"], ["y"], transB=1, broadcast=1))
    inits = [nph.from_array(v, k) for k, v in w.items()]
    inputs = [oh.make_tensor_value_info("x", TP.FLOAT, [1, 3, 8, 8])] + \
        [oh.make_tensor_value_info(t.name, TP.FLOAT, list(t.dims)) for t in inits]
    g = oh.make_graph(nodes, "legacy", inputs, [oh.make_tensor_value_info("y", TP.FLOAT, [1, 8])], inits)
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", opset)])
    m.ir_version = 3
    return m


def modern_model() -> onnx.ModelProto:
    """The same network written natively at opset 13 (the reference for the numbers)."""
    w = _weights()
    w["b4"] = w["b4"].reshape(4, 1, 1)
    nodes = [oh.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
             oh.make_node("BatchNormalization", ["c", "s", "bb", "mu", "var"], ["bn"]),
             oh.make_node("Add", ["bn", "b4"], ["a"]), oh.make_node("Relu", ["a"], ["r"]),
             oh.make_node("Flatten", ["r"], ["f"]), oh.make_node("Gemm", ["f", "G", "gc"], ["y"], transB=1)]
    g = oh.make_graph(nodes, "modern", [oh.make_tensor_value_info("x", TP.FLOAT, [1, 3, 8, 8])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, [1, 8])], [nph.from_array(v, k) for k, v in w.items()])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 13)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("opset", [1, 3, 5, 6])
def test_legacy_opsets_convert_and_match(opset):
    src = legacy_model(opset)
    onnx.checker.check_model(src)
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    want = run_ort(modern_model(), {"x": x})["y"]
    up = upgrade(src, 9)  # what prepare does; its numbers equal the modern network's
    assert default_opset(up) == 9
    np.testing.assert_allclose(run_ort(up, {"x": x})["y"], want, rtol=1e-5, atol=1e-5)
    rep = graphmp.convert(src, None)
    out = rep.model
    onnx.checker.check_model(out, full_check=True)
    assert rep["prepare"]["opset_upgraded"] == [opset, 9]
    got = run_reference(out, {"x": x})["y"]
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    assert run_ort(out, {"x": x})["y"].shape == (1, 8)


def test_opset_9_real_models_convert_without_upgrade():
    for name in ("aecmos_gru.onnx", "ultraface_rfb640.onnx"):
        rep = graphmp.convert(os.path.join(ROOT, "models", "real", name), None)
        assert default_opset(rep.model) == 9 and "opset_upgraded" not in rep["prepare"]


def test_upgrade_names_the_op_that_stops_it():
    m = onnx.load(os.path.join(ROOT, "models", "real", "style_mosaic.onnx"))
    with pytest.raises(GraphmpError, match=r"style_mosaic.onnx: cannot upgrade opset 7 to 13: ImageScaler") as e:
        upgrade(m, 13, "style_mosaic.onnx")
    assert "\n" not in str(e.value) and "%s" not in str(e.value)


def test_train_graph_upgrades_old_opsets(tmp_path):
    """mnist_cntk is opset 7 with MaxPool: train-graph upgrades it to 16 (the MaxPool
    gradient needs ScatterElements with reduction='add') and builds a step that runs."""
    from graphmp.train.loop import train
    from graphmp.train.step import build_step
    path = os.path.join(ROOT, "models", "real", "mnist_cntk.onnx")
    assert default_opset(onnx.load(path, load_external_data=False)) == 7
    meta = build_step(path, str(tmp_path / "run"), loss="cross-entropy", optimizer="sgd", lr=0.01, precision="fp32")
    step = onnx.load(str(tmp_path / "run" / "step.onnx"))
    assert default_opset(step) == 16 and meta["weights"]
    rng = np.random.default_rng(0)
    data = {"Input3": rng.standard_normal((4, 1, 28, 28)).astype(np.float32), "labels": rng.integers(0, 10, 4)}
    res = train(str(tmp_path / "run"), data, epochs=1, batch_size=1, progress=False)  # fixed batch 1
    assert np.isfinite(res.history["loss"]).all()


def test_ir3_model_whose_constants_become_initializers_stays_valid():
    """IR 3 wants every initializer listed as a graph input; prepare hoists Constant nodes to
    initializers, so the output says IR 4 (found on onnx's own pytorch-converted test
    models, e.g. test_Softsign: the checker refused the converted model)."""
    nodes = [oh.make_node("Constant", [], ["one"], value=nph.from_array(np.ones(4, np.float32), "v")),
             oh.make_node("Abs", ["x"], ["a"]), oh.make_node("Add", ["a", "one"], ["d"]),
             oh.make_node("Div", ["x", "d"], ["y"])]
    g = oh.make_graph(nodes, "softsign", [oh.make_tensor_value_info("x", TP.FLOAT, [2, 4])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, [2, 4])])
    src = oh.make_model(g, opset_imports=[oh.make_opsetid("", 6)])
    src.ir_version = 3
    onnx.checker.check_model(src, full_check=True)
    out = graphmp.convert(src, None).model
    assert "one" in {t.name for t in out.graph.initializer}
    onnx.checker.check_model(out, full_check=True)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(run_ort(out, {"x": x})["y"], x / (np.abs(x) + 1), rtol=1e-3, atol=1e-3)


def test_train_graph_on_an_ir3_model_without_initializers(tmp_path):
    """An IR-3 export whose only weight is a Constant node (no initializer, so nothing moves
    out of the inputs): the opset upgrade raises the IR version with the opset, so the
    step graph's own constants are valid (the checker refused it before: found on onnx's
    pytorch-converted test_PoissonNLLLLoss_no_reduce)."""
    from graphmp.train.loop import train
    from graphmp.train.step import build_step
    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    nodes = [oh.make_node("Constant", [], ["W"], value=nph.from_array(w, "W")),
             oh.make_node("MatMul", ["x", "W"], ["y"])]
    g = oh.make_graph(nodes, "ir3", [oh.make_tensor_value_info("x", TP.FLOAT, [2, 4])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, [2, 3])])
    src = oh.make_model(g, opset_imports=[oh.make_opsetid("", 6)])
    src.ir_version = 3
    onnx.checker.check_model(src, full_check=True)
    onnx.save(src, str(tmp_path / "m.onnx"))
    meta = build_step(str(tmp_path / "m.onnx"), str(tmp_path / "run"), loss="mse", precision="fp32",
                      optimizer="sgd", lr=0.1)
    step = onnx.load(str(tmp_path / "run" / "step.onnx"))
    onnx.checker.check_model(step, full_check=True)
    assert step.ir_version >= 7 and meta["weights"] == ["W"]
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    res = train(str(tmp_path / "run"), {"x": x, "labels": np.zeros((2, 3), np.float32)}, batch_size=2,
                progress=False)
    assert res.history["loss"][0] == pytest.approx(float(((x @ w) ** 2).mean()), rel=1e-5)


def test_a_step_graph_ort_cannot_load_is_refused_at_build(tmp_path, capsys):
    """A model ONNX Runtime cannot run (PRelu's slope [3] against x [2, 3, 4]: onnx's own
    pytorch-converted test_PReLU_1d_multiparam): train-graph says so in one line, in fp32
    (the step graph does not load) and mixed (the calibration run fails), instead of
    writing a run that `graphmp train` crashes on."""
    from graphmp.cli import main
    g = oh.make_graph([oh.make_node("PRelu", ["x", "slope"], ["y"])], "prelu",
                      [oh.make_tensor_value_info("x", TP.FLOAT, [2, 3, 4])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, [2, 3, 4])],
                      [nph.from_array(np.full(3, 0.25, np.float32), "slope")])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 6)])
    m.ir_version = 3
    m.graph.input.append(oh.make_tensor_value_info("slope", TP.FLOAT, [3]))
    onnx.save(m, str(tmp_path / "m.onnx"))
    for precision, says in (("fp32", "cannot load the training step graph"), ("mixed", "cannot run the model")):
        run = str(tmp_path / precision)
        assert main(["train-graph", str(tmp_path / "m.onnx"), "-o", run, "--loss", "mse",
                     "--precision", precision]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err
        assert not os.path.exists(os.path.join(run, "train.json"))

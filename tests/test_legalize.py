"""graphmp/passes/legalize.py: the experimental ops ONNX removed in opset 10 (ImageScaler,
Crop, Affine, Scale, ScaledTanh, ParametricSoftplus) become standard ops that compute the
same thing (ONNX Runtime still runs the old ops in opset 7-9 models: it is the yardstick),
in every graph, without breaking the model; what cannot be expressed stays as it was; in
a conversion they no longer stay FP32 "to be safe" behind Casts."""
from __future__ import annotations

import collections
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nph

import graphmp
from graphmp.errors import GraphmpError
from graphmp.model_io import iter_graphs
from graphmp.opset import upgrade
from graphmp.passes import legalize as legalize_pass
from graphmp.passes.legalize import EXPERIMENTAL, legalize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOSAIC = os.path.join(ROOT, "models", "real", "style_mosaic.onnx")
SHAPE = [2, 3, 7, 9]
FP16_LISTS = "op not in graphmp's FP16 lists"


def _model(nodes, opset, shape=SHAPE, inits=(), ir=3, extra_inputs=()):
    """x -> nodes -> y; IR 3 lists initializers as graph inputs, as IR 3 must."""
    inputs = [oh.make_tensor_value_info("x", TP.FLOAT, shape), *extra_inputs]
    if ir < 4:
        inputs += [oh.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    y = oh.make_tensor_value_info("y", TP.FLOAT, [None] * len(shape))  # the checker wants a rank
    g = oh.make_graph(nodes, "g", inputs, [y], initializer=list(inits))
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", opset)])
    m.ir_version = ir
    return m


def _run(model, feeds):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _ops(model) -> list:
    return [n.op_type for g in iter_graphs(model.graph) for n in g.node]


def _x(shape=SHAPE, seed=0, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _copy(m):
    c = onnx.ModelProto()
    c.CopyFrom(m)
    return c


# (op, attributes, opset, the ops it becomes)
CASES = [
    ("Affine", dict(alpha=2.5, beta=-0.75), 7, ["Mul", "Add"]),
    ("Affine", dict(alpha=1.0, beta=3.0), 9, ["Add"]),
    ("Affine", dict(alpha=-4.0), 8, ["Mul"]),
    ("Affine", {}, 7, ["Identity"]),
    ("Scale", dict(scale=0.37), 7, ["Mul"]),
    ("Scale", {}, 9, ["Identity"]),
    ("ImageScaler", dict(scale=0.017, bias=[-103.9, -116.7, -123.6]), 7, ["Mul", "Add"]),
    ("ImageScaler", dict(scale=1.0, bias=[1.5, -2.0, 0.25]), 9, ["Add"]),
    ("Crop", dict(border=[1, 2, 3, 0]), 7, ["Slice"]),            # asymmetric, a zero bottom border
    ("Crop", dict(border=[0, 2, 0, 1]), 9, ["Slice"]),            # rows only
    ("Crop", dict(border=[0, 0, 0, 0]), 7, ["Identity"]),
    ("Crop", dict(border=[2, 1, 0, 3], scale=[4, 5]), 7, ["Slice"]),
    ("Crop", dict(border=[0, 0, 5, 5], scale=[7, 3]), 9, ["Slice"]),  # scale wins over right/bottom
    ("ScaledTanh", dict(alpha=1.7, beta=0.66), 7, ["Mul", "Tanh", "Mul"]),
    ("ScaledTanh", dict(alpha=2.0, beta=1.0), 9, ["Tanh", "Mul"]),
    ("ParametricSoftplus", dict(alpha=0.8, beta=1.3), 7, ["Mul", "Softplus", "Mul"]),
    ("ParametricSoftplus", dict(alpha=1.0, beta=-9.0), 9, ["Mul", "Softplus"]),  # beta*x up to ~100: overflow-safe
]


@pytest.mark.parametrize("op,attrs,opset,becomes", CASES,
                         ids=[f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[1].items()) or 'defaults'}" for c in CASES])
def test_each_op_becomes_standard_ops_that_compute_the_same(op, attrs, opset, becomes):
    src = _model([oh.make_node(op, ["x"], ["y"], name="old", **attrs)], opset)
    m = _copy(src)
    rewritten, kept = legalize(m)
    assert rewritten == {op: 1} and kept == []
    assert _ops(m) == becomes and not set(_ops(m)) & set(EXPERIMENTAL)
    last = m.graph.node[-1]
    assert last.output == ["y"] and last.name == "old"  # consumers, outputs and the node's name kept
    onnx.checker.check_model(m, full_check=True)
    assert m.ir_version == (4 if set(becomes) - {"Slice", "Identity", "Tanh", "Softplus"} else 3)
    for seed in (0, 1):
        x = _x(seed=seed)
        want, got = _run(src, {"x": x})[0], _run(m, {"x": x})[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))


def test_constants_take_the_input_type_and_unique_names():
    """A double ImageScaler gets double constants; a name already used is not reused."""
    taken = nph.from_array(np.zeros(1, np.float64), "old.scale")
    n = oh.make_node("ImageScaler", ["x"], ["s"], name="old", scale=0.5, bias=[1.0, 2.0, 3.0])
    add = oh.make_node("Add", ["s", "old.scale"], ["y"], name="add")
    g = oh.make_graph([n, add], "g", [oh.make_tensor_value_info("x", TP.DOUBLE, SHAPE)],
                      [oh.make_tensor_value_info("y", TP.DOUBLE, [None] * 4)], initializer=[taken])
    src = oh.make_model(g, opset_imports=[oh.make_opsetid("", 9)])
    src.ir_version = 4
    m = _copy(src)
    assert legalize(m) == ({"ImageScaler": 1}, [])
    new = [t for t in m.graph.initializer if t.name != "old.scale"]
    assert len(new) == 2 and all(t.data_type == TP.DOUBLE for t in new)
    assert len({t.name for t in m.graph.initializer}) == 3
    onnx.checker.check_model(m, full_check=True)
    x = _x().astype(np.float64)  # ONNX Runtime has no double ImageScaler: numpy says what it computes
    want = 0.5 * x + np.array([1.0, 2.0, 3.0]).reshape(1, 3, 1, 1)
    np.testing.assert_allclose(_run(m, {"x": x})[0], want, rtol=1e-12)


def test_a_chain_of_old_ops_in_an_ir3_model_with_weights():
    """ImageScaler -> Conv -> Crop -> Affine, IR 3 (weights listed as inputs): the result
    passes the full checker (IR raised to 4) and computes the same."""
    w = nph.from_array(_x([4, 3, 3, 3], seed=5, scale=0.2), "w")
    nodes = [oh.make_node("ImageScaler", ["x"], ["a"], name="scaler", scale=0.5, bias=[0.1, -0.2, 0.3]),
             oh.make_node("Conv", ["a", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             oh.make_node("Crop", ["c"], ["d"], name="crop", border=[1, 0, 2, 1]),
             oh.make_node("Affine", ["d"], ["y"], name="affine", alpha=150.0, beta=0.5)]
    src = _model(nodes, 7, inits=[w])
    m = _copy(src)
    assert legalize(m) == ({"Affine": 1, "Crop": 1, "ImageScaler": 1}, [])
    assert m.ir_version == 4 and not set(_ops(m)) & set(EXPERIMENTAL)
    onnx.checker.check_model(m, full_check=True)
    x = _x()
    want = _run(src, {"x": x})[0]
    np.testing.assert_allclose(_run(m, {"x": x})[0], want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))


def test_opset6_model_becomes_upgradable(monkeypatch):
    """Below opset 7 the upgrade could not carry these ops (graphmp refused the model):
    rewritten in Mul/Add's legacy broadcast form, the upgrade to 9 goes through and
    computes what ONNX Runtime computes on the opset-6 original, and convert works."""
    nodes = [oh.make_node("ImageScaler", ["x"], ["a"], name="scaler", scale=2.0, bias=[1.0, -2.0, 3.0]),
             oh.make_node("Crop", ["a"], ["b"], name="crop", border=[1, 1, 2, 0]),
             oh.make_node("Affine", ["b"], ["y"], name="affine", alpha=0.5, beta=4.0)]
    src = _model(nodes, 6)
    m = _copy(src)
    assert legalize(m) == ({"Affine": 1, "Crop": 1, "ImageScaler": 1}, [])
    legacy = {(n.name, a.name): a.i for n in m.graph.node for a in n.attribute if a.name in ("broadcast", "axis")}
    # Mul-6/Add-6 broadcast only with broadcast=1: a scalar B, or the bias as [C] from axis 1
    assert legacy == {("scaler/Mul", "broadcast"): 1, ("scaler", "broadcast"): 1, ("scaler", "axis"): 1,
                      ("affine/Mul", "broadcast"): 1, ("affine", "broadcast"): 1}
    assert [list(t.dims) for t in m.graph.initializer] == [[], [3], [], []]
    onnx.checker.check_model(m, full_check=True)
    up = upgrade(m, 9)
    onnx.checker.check_model(up, full_check=True)
    x = _x()
    np.testing.assert_allclose(_run(up, {"x": x})[0], _run(src, {"x": x})[0], rtol=1e-6, atol=1e-5)
    rep = graphmp.convert(src, None)
    assert rep["prepare"]["opset_upgraded"] == [6, 9] and rep["legalize"]["rewritten"]["Crop"] == 1
    monkeypatch.setattr(legalize_pass, "_REWRITES", {})  # as before the pass
    with pytest.raises(GraphmpError, match="cannot upgrade opset 6 to 9: ImageScaler"):
        graphmp.convert(src, None)


def _branch(name, nodes):
    return oh.make_graph(nodes, name, [], [oh.make_tensor_value_info(nodes[-1].output[0], TP.FLOAT, [None] * 4)])


def test_if_branches_are_rewritten_too():
    then = _branch("then", [oh.make_node("Crop", ["x"], ["t"], name="crop_t", border=[1, 0, 0, 2])])
    els = _branch("else", [oh.make_node("ScaledTanh", ["x"], ["e0"], name="tanh_e", alpha=3.0, beta=0.5),
                           oh.make_node("Crop", ["e0"], ["e"], name="crop_e", border=[1, 0, 0, 2])])
    node = oh.make_node("If", ["cond"], ["y"], name="if", then_branch=then, else_branch=els)
    src = _model([node], 9, ir=4, extra_inputs=[oh.make_tensor_value_info("cond", TP.BOOL, [])])
    m = _copy(src)
    assert legalize(m) == ({"Crop": 2, "ScaledTanh": 1}, [])
    assert not set(_ops(m)) & set(EXPERIMENTAL)
    onnx.checker.check_model(m, full_check=True)
    x = _x()
    for cond in (True, False):
        feeds = {"x": x, "cond": np.array(cond)}
        np.testing.assert_allclose(_run(m, feeds)[0], _run(src, feeds)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("node,shape,why", [
    (oh.make_node("Crop", ["x"], ["y"], name="n", border=[1, 1, 1, 1]), [3, 7, 9], "3-D"),
    (oh.make_node("ImageScaler", ["x"], ["y"], name="n", bias=[1.0, 2.0]), SHAPE, "2 bias values for 3 channels"),
    (oh.make_node("Crop", ["x"], ["y"], name="n", border=[1, 1, 1]), SHAPE, "border [1, 1, 1]"),
    (oh.make_node("Crop", ["x"], ["y"], name="n", border=[1, 1, 1, 1], scale=[2]), SHAPE, "scale [2]"),
    (oh.make_node("ScaledTanh", ["x"], ["y"], name="n", alpha=2.0), SHAPE, "no default"),
    (oh.make_node("ParametricSoftplus", ["x"], ["y"], name="n", beta=2.0), SHAPE, "no default"),
], ids=["crop-3d", "bias-length", "border-3", "scale-1", "scaledtanh-no-beta", "softplus-no-alpha"])
def test_what_standard_ops_cannot_express_stays_as_it_was(node, shape, why):
    src = _model([node], 9, shape=shape)
    m = _copy(src)
    rewritten, kept = legalize(m)
    assert rewritten == {} and len(kept) == 1 and kept[0]["name"] == "n" and why in kept[0]["why"]
    assert m.SerializeToString() == src.SerializeToString()


def test_other_models_are_untouched():
    """No experimental op, ThresholdedRelu (standard from opset 10), or opset >= 10 (where
    these names are no ONNX ops): nothing changes."""
    for node, opset in [(oh.make_node("Relu", ["x"], ["y"]), 9),
                        (oh.make_node("ThresholdedRelu", ["x"], ["y"], alpha=0.5), 9),
                        (oh.make_node("Crop", ["x"], ["y"], border=[1, 1, 1, 1]), 10),
                        (oh.make_node("Crop", ["x"], ["y"], border=[1, 1, 1, 1], domain="custom"), 9)]:
        src = _model([node], opset)
        m = _copy(src)
        assert legalize(m) == ({}, [])
        assert m.SerializeToString() == src.SerializeToString()


# ------------------------------------------------------------------ in a conversion
def _style_block(seed=0):
    """A style-transfer residual block as onnxmltools wrote them (opset 7, IR 3):
    ImageScaler -> Conv -> InstanceNormalization -> Relu = h; Conv(h) (unpadded) + Crop(h)
    -> Conv -> Tanh -> Affine(alpha=150)."""
    rng = np.random.default_rng(seed)

    def w(name, shape):
        return nph.from_array((rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32), name)
    inits = [w("w1", [8, 3, 3, 3]), w("w2", [8, 8, 3, 3]), w("w3", [3, 8, 3, 3]),
             nph.from_array(np.ones(8, np.float32), "in_s"), nph.from_array(np.zeros(8, np.float32), "in_b")]
    nodes = [oh.make_node("ImageScaler", ["x"], ["xs"], name="scaler", scale=1.0, bias=[-0.5, 0.1, 0.2]),
             oh.make_node("Conv", ["xs", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             oh.make_node("InstanceNormalization", ["c1", "in_s", "in_b"], ["n1"], name="norm1"),
             oh.make_node("Relu", ["n1"], ["h"], name="relu1"),
             oh.make_node("Conv", ["h", "w2"], ["c2"], name="conv2"),
             oh.make_node("Crop", ["h"], ["hc"], name="crop", border=[1, 1, 1, 1]),
             oh.make_node("Add", ["c2", "hc"], ["r"], name="residual"),
             oh.make_node("Conv", ["r", "w3"], ["c3"], name="conv3", pads=[1, 1, 1, 1]),
             oh.make_node("Tanh", ["c3"], ["t"], name="tanh"),
             oh.make_node("Affine", ["t"], ["y"], name="deprocess", alpha=150.0)]
    return _model(nodes, 7, shape=[1, 3, 20, 20], inits=inits)


def _casts(model) -> list:
    return [n for g in iter_graphs(model.graph) for n in g.node if n.op_type == "Cast"]


def test_convert_lowers_the_rewritten_ops_and_saves_casts(tmp_path, monkeypatch):
    src = str(tmp_path / "style.onnx")
    onnx.save(_style_block(), src)
    dst = str(tmp_path / "style.mp.onnx")
    rep = graphmp.convert(src, dst)
    assert rep["legalize"]["rewritten"] == {"Affine": 1, "Crop": 1, "ImageScaler": 1}
    assert "legalize.run" in rep["pipeline"]["changed"] and "rewritten" in rep.summary()
    conv = onnx.load(dst)
    onnx.checker.check_model(conv, full_check=True)
    assert not set(_ops(conv)) & set(EXPERIMENTAL)
    fp32 = {e["name"]: e for e in rep["fp32_nodes"]}
    assert not any(FP16_LISTS in e["reason"] for e in fp32.values()), fp32
    assert "crop" not in fp32 and "residual" not in fp32  # the Slice and the residual Add run FP16
    slice_ = next(n for n in conv.graph.node if n.name == "crop")
    assert slice_.op_type == "Slice"
    ends = {n.output[0]: n for n in _casts(conv)}
    assert slice_.input[0] not in ends and not any(slice_.output[0] in c.input for c in _casts(conv))
    x = np.random.default_rng(1).uniform(0, 1, (1, 3, 20, 20)).astype(np.float32)
    got, want = _run(conv, {"x": x})[0], _run(onnx.load(src), {"x": x})[0]
    assert got.dtype == np.float32 and np.abs(got - want).max() < 0.01 * np.abs(want).max()

    # the same conversion without the rewrite: the old ops stay FP32 behind more Casts
    monkeypatch.setattr(legalize_pass, "_REWRITES", {})
    before = graphmp.convert(src, None)
    assert "legalize" not in before.to_dict()
    assert {e["name"] for e in before["fp32_nodes"] if FP16_LISTS in e["reason"]} >= {"crop", "deprocess"}
    assert len(_casts(conv)) < len(_casts(before.model))


def test_style_mosaic(tmp_path):
    """The real model (opset 7, IR 3, from onnxmltools): 7 Crops, an ImageScaler and an
    Affine become standard ops, none kept FP32 as unknown, and the output runs."""
    dst = str(tmp_path / "mosaic.mp.onnx")
    rep = graphmp.convert(MOSAIC, dst, island_trials=0)
    assert rep["legalize"] == {"rewritten": {"Affine": 1, "Crop": 7, "ImageScaler": 1}}
    assert not any(FP16_LISTS in e["reason"] for e in rep["fp32_nodes"])
    conv = onnx.load(dst)
    onnx.checker.check_model(conv, full_check=True)
    ops = collections.Counter(_ops(conv))
    assert ops["Slice"] == 7 and not set(ops) & set(EXPERIMENTAL)
    x = np.random.default_rng(0).uniform(0, 255, (1, 3, 720, 720)).astype(np.float32)
    y = _run(conv, {"inputImage": x})[0]
    assert y.shape == (1, 3, 720, 720) and np.isfinite(y).all()


def test_fp32_ops_keeps_the_op_it_names(tmp_path):
    """--fp32-ops Crop still finds the Crops (not Slices it never named) and keeps them FP32."""
    src = str(tmp_path / "style.onnx")
    onnx.save(_style_block(), src)
    rep = graphmp.convert(src, None, fp32_ops=["Crop"])
    assert rep["legalize"]["rewritten"] == {"Affine": 1, "ImageScaler": 1}
    assert rep["legalize"]["kept"] == [{"name": "crop", "op_type": "Crop", "why": "--fp32-ops names Crop"}]
    assert "Crop" in _ops(rep.model) and "crop" in rep.fp32_nodes
    assert not any("crop" in w for w in rep["warnings"])  # as asked: no warning

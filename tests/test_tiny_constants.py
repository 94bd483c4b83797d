"""Rule 5 (classify) for small constants FP16 flushes to 0: judged against the scale they
meet, not by an absolute threshold (issue 26). A flushed value keeps its node FP32 only
when it is at least 2^-11 (FP16's relative precision) of max(the constant's own max |x|,
the calibrated max |x| of what it is added to), or when the sum reaches an op that is
singular at 0 (the epsilon guard)."""
import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper

import graphmp
from graphmp.check import check


def _types(model):
    g = onnx.shape_inference.infer_shapes(model).graph
    return {vi.name: vi.type.tensor_type.elem_type for vi in list(g.value_info) + list(g.output) + list(g.input)}


def _reasons(rep):
    return {n["name"]: n["reason"] for n in rep.to_dict()["fp32_nodes"]}


def _model(nodes, inputs, outputs, inits):
    g = oh.make_graph(nodes, "tiny_consts", inputs, outputs, inits)
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(m)
    return m


def _conv_bias_relu():
    """Conv -> Add(bias-like constant of 8 values, one 2e-8 (flushed by FP16), the others ~0.1) -> Relu."""
    r = np.random.default_rng(0)
    w = (r.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    b = np.linspace(0.05, 0.15, 8).astype(np.float32).reshape(1, 8, 1, 1)
    b[0, 3] = 2e-8
    nodes = [oh.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             oh.make_node("Add", ["c", "bias"], ["a"], name="bias_add"),
             oh.make_node("Relu", ["a"], ["y"], name="relu")]
    m = _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [1, 3, 16, 16])],
               [oh.make_tensor_value_info("y", TP.FLOAT, [1, 8, 16, 16])],
               [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "bias")])
    feeds = {"x": r.standard_normal((1, 3, 16, 16)).astype(np.float32)}
    return m, feeds


def test_bias_element_below_fp16_beside_large_biases_stays_fp16():
    m, feeds = _conv_bias_relu()
    rep = graphmp.convert(m, None, calibration=[feeds])
    reasons = _reasons(rep)
    assert "bias_add" not in reasons and "relu" not in reasons and "conv" not in reasons, reasons
    t = _types(rep.model)
    assert t["c"] == TP.FLOAT16 and t["a"] == TP.FLOAT16, t


def test_bias_model_within_default_check():
    m, feeds = _conv_bias_relu()
    out = graphmp.convert(m, None, calibration=[feeds]).model
    assert _types(out)["a"] == TP.FLOAT16
    res = check(m, out)
    assert res.passed, res.summary()


def _add_const(value, x_scale, guard=None):
    """MatMul(x, W * x_scale) + const -> Relu (or `guard`: an op singular at 0 reading the
    sum) -> MatMul: the Add between FP16 work, with a calibrated range ~x_scale."""
    r = np.random.default_rng(2)
    w1 = (r.standard_normal((16, 16)) / 4 * x_scale).astype(np.float32)
    w2 = (r.standard_normal((16, 16)) / 4).astype(np.float32)
    nodes = [oh.make_node("MatMul", ["x", "w1"], ["xs"], name="mm1"),
             oh.make_node("Add", ["xs", "c"], ["a"], name="add_const"),
             oh.make_node(guard or "Relu", ["a"], ["h"], name="after"),
             oh.make_node("MatMul", ["h", "w2"], ["y"], name="mm2")]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [4, 16])],
                  [oh.make_tensor_value_info("y", TP.FLOAT, [4, 16])],
                  [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
                   numpy_helper.from_array(np.full(1, value, np.float32), "c")])


def _feeds():
    return {"x": np.random.default_rng(1).uniform(-2, 2, (4, 16)).astype(np.float32)}


def test_tiny_scalar_added_to_order_one_activations_stays_fp16():
    rep = graphmp.convert(_add_const(1e-9, 1.0), None, calibration=[_feeds()])
    reasons = _reasons(rep)
    assert "add_const" not in reasons and "after" not in reasons, reasons
    assert _types(rep.model)["a"] == TP.FLOAT16


def test_epsilon_beside_a_tiny_variance_stays_fp32():
    """A variance epsilon 1e-12 added to a tensor whose calibrated range is ~1e-10: the
    epsilon is 1% of it, far above FP16's rounding (and here it does not feed a guard op:
    the scale alone decides)."""
    rep = graphmp.convert(_add_const(1e-12, 1e-10), None, calibration=[_feeds()])
    reasons = _reasons(rep)
    assert "add_const" in reasons, reasons
    why = reasons["add_const"]
    assert "'c'" in why and "1e-12" in why and "'xs'" in why and "rounds to 0" in why, why
    assert _types(rep.model)["a"] == TP.FLOAT


def test_epsilon_guarding_a_sqrt_stays_fp32_at_any_scale():
    """1e-9 added to O(1) values that then reach Sqrt: a guard against 0, judged as before."""
    rep = graphmp.convert(_add_const(1e-9, 1.0, guard="Sqrt"), None, calibration=[_feeds()])
    reasons = _reasons(rep)
    assert "add_const" in reasons and "Sqrt 'after'" in reasons["add_const"], reasons


def test_multiplier_entirely_flushed_stays_fp32():
    """A Mul by 1e-9 (no other scale counts for a product): its own max |x| is the flush."""
    w = np.random.default_rng(3).standard_normal((16, 16)).astype(np.float32)
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             oh.make_node("Mul", ["h", "c"], ["y"], name="mul_tiny")]
    m = _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [4, 16])],
               [oh.make_tensor_value_info("y", TP.FLOAT, [4, 16])],
               [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.full(1, 1e-9, np.float32), "c")])
    reasons = _reasons(graphmp.convert(m, None, calibration=[_feeds()]))
    assert "mul_tiny" in reasons and "own max" in reasons["mul_tiny"], reasons

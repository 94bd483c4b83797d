"""The precision policy: painting, user overrides, targets, Cast sharing."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP, helper as oh, numpy_helper

import graphmp
from graphmp.model_runs import run_ort, run_reference


def _w(seed, shape, scale=0.1):
    return numpy_helper.from_array((np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32),
                                   f"w{seed}")


def block():
    """x -> LayerNorm -> MatMul -> Add(bias) -> Add(residual from LN input) -> LayerNorm -> y,
    with the MatMul output also read by two Relu consumers."""
    d = 16
    nodes = [
        oh.make_node("LayerNormalization", ["x", "g", "b"], ["ln1"], name="ln1", axis=-1),
        oh.make_node("MatMul", ["ln1", "w1"], ["mm"], name="mm"),
        oh.make_node("Add", ["mm", "w2"], ["bias"], name="bias_add"),
        oh.make_node("Add", ["bias", "x"], ["res"], name="residual_add"),
        oh.make_node("LayerNormalization", ["res", "g", "b"], ["ln2"], name="ln2", axis=-1),
        oh.make_node("Relu", ["mm"], ["r1"], name="relu1"),
        oh.make_node("Relu", ["mm"], ["r2"], name="relu2"),
        oh.make_node("MatMul", ["r1", "w3"], ["m3"], name="mm3"),
        oh.make_node("Add", ["m3", "r2"], ["y2"], name="add_out"),
    ]
    inits = [numpy_helper.from_array(np.ones(d, np.float32), "g"), numpy_helper.from_array(np.zeros(d, np.float32), "b"),
             _w(1, [d, d]), _w(2, [d]), _w(3, [d, d])]
    g = oh.make_graph(nodes, "block", [oh.make_tensor_value_info("x", TP.FLOAT, ["batch", d])],
                      [oh.make_tensor_value_info("ln2", TP.FLOAT, ["batch", d]),
                       oh.make_tensor_value_info("y2", TP.FLOAT, ["batch", d])], inits)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


def _types(model):
    inf = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    t = {v.name: v.type.tensor_type.elem_type for v in list(inf.graph.value_info) + list(inf.graph.output)
         + list(inf.graph.input)}
    t.update({i.name: i.data_type for i in inf.graph.initializer})
    return t


def _node(model, name):
    return next(n for n in model.graph.node if n.name == name)


def test_painting_follows_the_neighbourhood():
    m = graphmp.convert(block(), None).model
    onnx.checker.check_model(m, full_check=True)
    t = _types(m)
    out_of = lambda name: t[_node(m, name).output[0]]  # noqa: E731
    assert out_of("mm") == TP.FLOAT16 and out_of("mm3") == TP.FLOAT16
    assert out_of("bias_add") == TP.FLOAT16          # follows the MatMul
    assert out_of("residual_add") == TP.FLOAT         # an FP32 operand: widest wins
    assert out_of("relu1") == TP.FLOAT16 and out_of("add_out") == TP.FLOAT16
    assert out_of("ln1") == TP.FLOAT and out_of("ln2") == TP.FLOAT
    rep = graphmp.convert(block(), None).fp32_nodes
    assert rep["residual_add"].startswith("stays in its FP32 region") and "ln2" in rep


def test_one_cast_per_tensor_and_type():
    m = graphmp.convert(block(), None).model
    casts = [(n.input[0], n.attribute[0].i) for n in m.graph.node if n.op_type == "Cast"]
    assert len(casts) == len(set(casts)), casts
    # ln1 feeds one MatMul: exactly one Cast of it; x feeds LN (fp32) and the fp32 residual: no Cast
    assert sum(1 for src, _ in casts if src == "ln1") == 1
    assert not any(src == "x" for src, _ in casts)


def test_fp32_ops_and_fp32_nodes_override():
    rep = graphmp.convert(block(), None, fp32_ops=["MatMul"])
    assert rep.fp32_nodes["mm"] == "user: --fp32-ops" and rep.fp32_nodes["mm3"] == "user: --fp32-ops"
    rep = graphmp.convert(block(), None, fp32_nodes="^mm3$")
    assert rep.fp32_nodes["mm3"] == "user: --fp32-nodes" and "mm" not in rep.fp32_nodes


def test_fp16_nodes_wins_over_defaults():
    rep = graphmp.convert(block(), None, fp16_nodes="^ln2$")
    assert "ln2" not in rep.fp32_nodes
    t = _types(rep.model)
    assert t[_node(rep.model, "ln2").output[0]] == TP.FLOAT16 or _node(rep.model, "ln2").output[0] != "ln2"
    onnx.checker.check_model(rep.model, full_check=True)


def test_no_keep_io_types_retypes_inputs_and_fp16_outputs():
    m = graphmp.convert(block(), None, keep_io_types=False).model
    onnx.checker.check_model(m, full_check=True)
    assert m.graph.input[0].type.tensor_type.elem_type == TP.FLOAT16
    assert {o.name: o.type.tensor_type.elem_type for o in m.graph.output}["y2"] == TP.FLOAT16
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 16)).astype(np.float16)}
    out = run_reference(m, feeds)
    ref = run_ort(block(), {"x": feeds["x"].astype(np.float32)})
    np.testing.assert_allclose(out["y2"].astype(np.float32), ref["y2"], atol=2e-2, rtol=2e-2)


def test_bf16_target():
    m = graphmp.convert(block(), None, target="bf16").model
    onnx.checker.check_model(m, full_check=True)
    t = _types(m)
    assert t[_node(m, "mm").output[0]] == TP.BFLOAT16
    assert any(i.data_type == TP.BFLOAT16 for i in m.graph.initializer)
    assert not any(i.data_type == TP.FLOAT16 for i in m.graph.initializer)
    # bf16 keeps FP32's range: the -3.4e38-style constants need no FP32 island there
    w = next(i for i in m.graph.initializer if i.data_type == TP.BFLOAT16)
    raw = np.frombuffer(w.raw_data, np.uint16).astype(np.uint32) << 16
    orig = numpy_helper.to_array(next(i for i in block().graph.initializer if i.name == w.name))
    np.testing.assert_allclose(raw.view(np.float32).reshape(orig.shape), orig, rtol=2 ** -8)


def test_unknown_target_is_a_clear_error():
    with pytest.raises(graphmp.GraphmpError, match="target"):
        graphmp.convert(block(), None, target="fp8")


def test_input_model_object_is_not_modified():
    m = block()
    before = m.SerializeToString()
    graphmp.convert(m, None)
    assert m.SerializeToString() == before


def test_fp16_model_with_fp32_nodes_computes_them_in_fp32():
    """An FP16 end-to-end model (no FP32 tensor) converts to itself with a warning without
    --fp32-nodes (nothing to do) and, with it, gets the named node computed in FP32 behind
    Casts; I/O stay FP16."""
    nph = numpy_helper
    rng = np.random.default_rng(0)
    w = nph.from_array((rng.standard_normal((16, 16)) * 0.25).astype(np.float16), "W")
    g = oh.make_graph([oh.make_node("MatMul", ["x", "W"], ["a"], name="mm"),
                       oh.make_node("Softmax", ["a"], ["s"], name="sm", axis=-1),
                       oh.make_node("MatMul", ["s", "W"], ["y"], name="mm2")], "g",
                      [oh.make_tensor_value_info("x", TP.FLOAT16, ["N", 16])],
                      [oh.make_tensor_value_info("y", TP.FLOAT16, ["N", 16])], [w])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    m.ir_version = 8
    same = graphmp.convert(m, None)
    assert any("no FP32 tensors" in w and "--fp32-nodes" in w for w in same["warnings"])
    assert [n.op_type for n in same.model.graph.node] == ["MatMul", "Softmax", "MatMul"]  # no Cast added
    rep = graphmp.convert(m, None, fp32_nodes="^sm$")
    out = rep.model
    onnx.checker.check_model(out, full_check=True)
    prod = {o: n for n in out.graph.node for o in n.output}
    sm = next(n for n in out.graph.node if n.name == "sm")
    up, down = prod[sm.input[0]], next(n for n in out.graph.node if sm.output[0] in n.input)
    assert (up.op_type, up.attribute[0].i) == ("Cast", TP.FLOAT) and (down.op_type, down.attribute[0].i) == ("Cast", TP.FLOAT16)
    assert out.graph.input[0].type.tensor_type.elem_type == out.graph.output[0].type.tensor_type.elem_type == TP.FLOAT16
    assert rep.fp32_nodes == {"sm": "user: --fp32-nodes (computed in FP32 in an FP16 model)"}
    x = rng.standard_normal((2, 16)).astype(np.float16)
    assert np.abs(run_reference(out, {"x": x})["y"].astype(np.float32)
                  - run_reference(m, {"x": x})["y"].astype(np.float32)).max() < 2e-3


def test_a_weight_read_in_both_types_is_stored_twice_and_said(tmp_path):
    """W feeds an FP16 MatMul and an FP32 ReduceSumSquare: both copies are stored (each
    reader its type, no runtime Cast), and the report says what that costs."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "W")
    g = oh.make_graph([oh.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
                       oh.make_node("ReduceSumSquare", ["W"], ["n"], name="norm", keepdims=0)], "g",
                      [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 64])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["N", 64]), oh.make_tensor_value_info("n", TP.FLOAT, [])],
                      [w])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    m.ir_version = 8
    rep = graphmp.convert(m, None)
    types = sorted(t.data_type for t in rep.model.graph.initializer)
    assert types == [TP.FLOAT, TP.FLOAT16]
    assert any("read in FP32 by some nodes and in the low type by others" in w and "+0.01 MB" in w
               for w in rep["warnings"])


def _moments_layernorm(d=64, mean=1.0, std=0.01, seed=0):
    """Flax's LayerNorm as jax2tf exports it: var = E[h^2] - E[h]^2 (no centering before the
    square), on h = x @ w + 1 with a spread of 0.01 around its mean of 1."""
    w = (np.random.default_rng(seed).standard_normal((d, d)) * std / np.sqrt(d)).astype(np.float32)
    nodes = [oh.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
             oh.make_node("Add", ["mm", "shift"], ["h"], name="shift_add"),
             oh.make_node("Mul", ["h", "h"], ["sq"], name="sq"),
             oh.make_node("Reshape", ["sq", "shape"], ["sq2"], name="sq_reshape"),  # data movement between
             oh.make_node("ReduceMean", ["sq2"], ["m2"], name="mean_sq", axes=[-1]),
             oh.make_node("ReduceMean", ["h"], ["m"], name="mean", axes=[-1]),
             oh.make_node("Mul", ["m", "m"], ["msq"], name="sq_mean"),
             oh.make_node("Sub", ["m2", "msq"], ["var"], name="var"),
             oh.make_node("Max", ["var", "zero"], ["var0"], name="clamp"),
             oh.make_node("Add", ["var0", "eps"], ["ve"], name="eps_add"),
             oh.make_node("Sqrt", ["ve"], ["sd"], name="sd"),
             oh.make_node("Sub", ["h", "m"], ["c"], name="center"),
             oh.make_node("Div", ["c", "sd"], ["y"], name="norm"),
             oh.make_node("Mul", ["mm", "mm"], ["mm_sq"], name="square_not_summed"),
             oh.make_node("MatMul", ["mm_sq", "w"], ["z"], name="mm2")]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.full(d, mean, np.float32), "shift"),
             numpy_helper.from_array(np.array([-1, d], np.int64), "shape"),
             numpy_helper.from_array(np.zeros(1, np.float32), "zero"),
             numpy_helper.from_array(np.full(1, 1e-12, np.float32), "eps")]
    g = oh.make_graph(nodes, "flax_ln", [oh.make_tensor_value_info("x", TP.FLOAT, ["N", d])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["N", d]),
                       oh.make_tensor_value_info("z", TP.FLOAT, ["N", d])], inits)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 13)], ir_version=8)


def test_a_summed_square_stays_fp32():
    """A variance as E[h^2] - E[h]^2 cancels all but the FP16 rounding of the squares: the
    square is kept FP32 (as Pow is), which the FP16-faithful oracle shows is what keeps the
    normalised output right; a square that is not summed stays FP16."""
    m = _moments_layernorm()
    x = {"x": np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)}
    ref = run_ort(m, x)["y"]

    def err(model):
        return float(np.abs(run_reference(model, x)["y"].astype(np.float64) - ref).max() / np.abs(ref).max())

    rep = graphmp.convert(m, None)
    reasons = {n["name"]: n["reason"] for n in rep.to_dict()["fp32_nodes"]}
    assert "square summed" in reasons["sq"]
    assert "square_not_summed" not in reasons and _types(rep.model)["mm_sq"] == TP.FLOAT16
    forced = graphmp.convert(m, None, fp16_nodes="^sq$").model  # the square in FP16, as before the rule
    assert _types(forced)["sq"] == TP.FLOAT16
    assert err(rep.model) < 0.05 < 0.5 < err(forced)


def _recurrent_loop(d=32, steps=300, seed=0):
    """A Loop whose carried state h moves a little each iteration: h += 0.05 * (tanh(h @ w + x) - h)
    (a leaky recurrent cell), 300 iterations, then a MatMul head."""
    r = np.random.default_rng(seed)
    w = (r.standard_normal((d, d)) / np.sqrt(d) * 0.9).astype(np.float32)
    body = oh.make_graph(
        [oh.make_node("MatMul", ["h_in", "w"], ["hw"], name="body_mm"),
         oh.make_node("Add", ["hw", "x"], ["pre"], name="body_add"),
         oh.make_node("Tanh", ["pre"], ["t"], name="body_tanh"),
         oh.make_node("Sub", ["t", "h_in"], ["diff"], name="body_sub"),
         oh.make_node("Mul", ["diff", "rate"], ["step"], name="body_mul"),
         oh.make_node("Add", ["h_in", "step"], ["h_out"], name="body_update"),
         oh.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "body", [oh.make_tensor_value_info("i", TP.INT64, []), oh.make_tensor_value_info("cond_in", TP.BOOL, []),
                 oh.make_tensor_value_info("h_in", TP.FLOAT, [1, d])],
        [oh.make_tensor_value_info("cond_out", TP.BOOL, []), oh.make_tensor_value_info("h_out", TP.FLOAT, [1, d])])
    g = oh.make_graph(
        [oh.make_node("Loop", ["trips", "", "h0"], ["h_final"], name="loop", body=body),
         oh.make_node("MatMul", ["h_final", "w"], ["y"], name="head")],
        "rnn", [oh.make_tensor_value_info("h0", TP.FLOAT, [1, d]), oh.make_tensor_value_info("x", TP.FLOAT, [1, d])],
        [oh.make_tensor_value_info("y", TP.FLOAT, [1, d])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(steps, np.int64), "trips"),
         numpy_helper.from_array(np.array([0.05], np.float32), "rate")])
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


def test_a_loop_carried_state_is_updated_in_fp32():
    """The elementwise math from a Loop body's carried state to its next value stays FP32 (its
    MatMul stays FP16): in FP16 the small update is rounded away again at every one of 300
    iterations (24x the error on the FP16-faithful oracle)."""
    m = _recurrent_loop()
    onnx.checker.check_model(m, full_check=True)
    rng = np.random.default_rng(1)
    x = {"h0": rng.standard_normal((1, 32)).astype(np.float32) * 0.5,
         "x": rng.standard_normal((1, 32)).astype(np.float32) * 0.3}
    ref = run_ort(m, x)["y"]

    def err(model):
        return float(np.abs(run_reference(model, x)["y"].astype(np.float64) - ref).max() / np.abs(ref).max())

    rep = graphmp.convert(m, None)
    onnx.checker.check_model(rep.model, full_check=True)
    reasons = {n["name"]: n["reason"] for n in rep.to_dict()["fp32_nodes"]}
    assert {k for k, v in reasons.items() if v.startswith("recurrent state")} == \
        {"body_add", "body_tanh", "body_sub", "body_mul", "body_update"}
    body = next(n for n in rep.model.graph.node if n.op_type == "Loop").attribute[0].g
    mm = next(n for n in body.node if n.name == "body_mm")
    assert any(n.op_type == "Cast" and n.output[0] in mm.input for n in body.node)  # the MatMul reads FP16
    forced = graphmp.convert(m, None, fp16_nodes="^body_").model
    assert err(rep.model) < 2e-3 and err(forced) > 4e-3


def test_classify_rules_run_in_the_order_its_docstring_lists():
    """passes/classify.py's docstring is the rule list a reader trusts: its numbered [names]
    are RULES, in RULES' order."""
    import re as _re
    from graphmp.passes import classify
    listed = _re.findall(r"^\s+(\d+)\. \[([\w-]+)\]", classify.__doc__, _re.M)
    assert [int(i) for i, _ in listed] == list(range(1, len(classify.RULES) + 1))
    assert [name for _, name in listed] == [name for name, _ in classify.RULES]


def test_the_first_rule_with_a_reason_decides():
    """--fp32-nodes (rule 2) wins over the op class (rule 7); --fp16-nodes (rule 1) ends the
    rules for a LayerNormalization that rule 7 would keep FP32."""
    rep = graphmp.convert(block(), None, fp32_nodes="^ln1$")
    assert rep.fp32_nodes["ln1"] == "user: --fp32-nodes"
    rep = graphmp.convert(block(), None, fp16_nodes="^ln1$")
    assert "ln1" not in rep.fp32_nodes


def test_paint_steps_run_in_the_order_its_docstring_lists():
    import re as _re
    from graphmp.passes import paint
    listed = _re.findall(r"^\s+(\d+)\. (\w+):", paint.__doc__, _re.M)
    assert [int(i) for i, _ in listed] == list(range(1, len(paint.STEPS) + 1))
    assert [name for _, name in listed] == [name for name, _ in paint.STEPS]

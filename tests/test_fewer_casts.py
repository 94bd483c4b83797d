"""Fewer Casts where FP32 buys nothing (issue 26): a residual Add that joins an FP32
branch with FP16 work runs in FP16 (one Cast instead of two), the range rule is a
question about headroom and says when generated data decided it, and the cast traffic
falls while the measured error does not grow."""
import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nph

import graphmp
from fixtures import tiny
from graphmp.cast_cost import cast_traffic
from graphmp.check import check


def _model(nodes, inputs, outputs, inits, opset=17):
    return tiny.checked_model(nodes, inputs, outputs, inits, "fewer_casts", opset)


def _w(seed, shape, scale=0.2):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _x(shape=(1, 4, 8, 8), seed=7):
    return {"x": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def _out_type(model, node_name):
    g = onnx.shape_inference.infer_shapes(model).graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.value_info) + list(g.output)}
    node = next(n for n in model.graph.node if n.name == node_name)
    return types[node.output[0]]


def residual_join():
    """x -> convA (kept FP32 by --fp32-nodes) -> sig (Sigmoid, follows it) --+
       x -> convB (FP16) ------------------------------------------------------ Add -> convC -> y
    The Add joins an FP32 branch with FP16 work and feeds FP16 work."""
    nodes = [oh.make_node("Conv", ["x", "wa"], ["a"], name="convA", pads=[1, 1, 1, 1]),
             oh.make_node("Sigmoid", ["a"], ["s"], name="sig"),
             oh.make_node("Conv", ["x", "wb"], ["b"], name="convB", pads=[1, 1, 1, 1]),
             oh.make_node("Add", ["s", "b"], ["r"], name="join"),
             oh.make_node("Conv", ["r", "wc"], ["y"], name="convC")]
    inits = [nph.from_array(_w(1, (4, 4, 3, 3)), "wa"), nph.from_array(_w(2, (4, 4, 3, 3)), "wb"),
             nph.from_array(_w(3, (4, 4, 1, 1)), "wc")]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [1, 4, 8, 8])],
                  [oh.make_tensor_value_info("y", TP.FLOAT, [1, 4, 8, 8])], inits)


def test_residual_add_joining_fp16_work_adds_one_cast_not_two():
    m = residual_join()
    rep = graphmp.convert(m, None, fp32_nodes="^convA$", calibration=[_x()])
    out = rep.model
    assert _out_type(out, "join") == TP.FLOAT16
    assert _out_type(out, "sig") == TP.FLOAT          # the FP32 branch itself stays FP32
    casts = sorted(n.input[0] for n in out.graph.node if n.op_type == "Cast")
    # x -> FP16 for convB, the branch's Sigmoid -> FP16 for the Add, convC's output -> FP32;
    # an FP32 Add would also cast convB's output up and its own sum back down
    assert casts == ["s", "x", "y_fp16"], casts
    assert check(m, out, [_x(seed=s) for s in (1, 2)]).passed


def test_join_that_leads_into_fp32_work_stays_fp32():
    """The BERT residual stream: Add(FP32 branch, FP16 MatMul) -> LayerNorm keeps the Add FP32."""
    d = 16
    nodes = [oh.make_node("LayerNormalization", ["x", "g", "b"], ["ln1"], name="ln1", axis=-1),
             oh.make_node("MatMul", ["ln1", "w"], ["mm"], name="mm"),
             oh.make_node("Add", ["mm", "ln1"], ["res"], name="residual"),
             oh.make_node("LayerNormalization", ["res", "g", "b"], ["y"], name="ln2", axis=-1)]
    inits = [nph.from_array(np.ones(d, np.float32), "g"), nph.from_array(np.zeros(d, np.float32), "b"),
             nph.from_array(_w(4, (d, d)), "w")]
    m = _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [2, d])],
               [oh.make_tensor_value_info("y", TP.FLOAT, [2, d])], inits)
    out = graphmp.convert(m, None).model
    assert _out_type(out, "mm") == TP.FLOAT16 and _out_type(out, "residual") == TP.FLOAT


def test_join_lowers_cast_bytes_on_the_residual_model():
    m = residual_join()
    rep = graphmp.convert(m, None, fp32_nodes="^convA$", calibration=[_x()])
    traffic = cast_traffic(rep.model, _x())
    # boundary: x in (FP32 -> FP16) and y out; inside: one [1,4,8,8] Cast (256 elements x 6 bytes)
    assert traffic["inside_bytes"] == 256 * (4 + 2)


def _scaled_conv(tail):
    """x -> conv (weights x150: |values| ~2e3, 28x below FP16's max) -> tail -> y."""
    c = 4
    nodes = [oh.make_node("Conv", ["x", "w"], ["a"], name="conv", pads=[1, 1, 1, 1])] + tail
    inits = [nph.from_array(_w(5, (c, c, 3, 3), scale=150.0), "w"), nph.from_array(np.ones(c, np.float32), "s"),
             nph.from_array(np.zeros(c, np.float32), "b"), nph.from_array(_w(6, (c, c, 1, 1)), "w2")]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [1, c, 8, 8])],
                  [oh.make_tensor_value_info("y", TP.FLOAT, [1, c, 8, 8])], inits)


def test_range_rule_is_headroom_except_on_the_way_into_a_normalisation():
    # the conv's ~2e3 values go to another conv: 28x headroom, FP16 keeps them
    free = graphmp.convert(_scaled_conv([oh.make_node("Conv", ["a", "w2"], ["y"], name="conv2")]), None)
    assert "conv" not in free.fp32_nodes, free.fp32_nodes
    # ... into an InstanceNorm, which subtracts their mean: FP32, and the reason says why
    norm = graphmp.convert(_scaled_conv([oh.make_node("Relu", ["a"], ["r"], name="relu"),
                                         oh.make_node("InstanceNormalization", ["r", "s", "b"], ["y"], name="inorm")]),
                           None)
    assert "on the way into a subtraction" in norm.fp32_nodes["conv"], norm.fp32_nodes
    # an explicit --range-threshold is one threshold for every node, as before
    strict = graphmp.convert(_scaled_conv([oh.make_node("Conv", ["a", "w2"], ["y"], name="conv2")]), None,
                             range_threshold=512)
    assert strict.fp32_nodes["conv"].startswith("range:") and "threshold 512)" in strict.fp32_nodes["conv"]


def test_a_range_decided_on_generated_data_is_reported_as_such(tmp_path):
    m = _scaled_conv([oh.make_node("InstanceNormalization", ["a", "s", "b"], ["y"], name="inorm")])
    gen = graphmp.convert(m, None).to_dict()
    assert gen["range_rule"]["nodes"] == 1 and gen["range_rule"]["data"] == "generated inputs"
    assert "generated inputs" in gen["range_rule"]["note"] and "--calibration" in gen["range_rule"]["note"]
    assert "range rule: 1 node(s) kept FP32 by ranges seen on generated inputs" in graphmp.convert(m, None).summary()
    mine = graphmp.convert(m, None, calibration=[_x(seed=3)]).to_dict()
    assert mine["range_rule"]["nodes"] == 1 and mine["range_rule"]["data"] == "user data"
    assert "note" not in mine["range_rule"]


def attention(norm="Softmax"):
    """q -> MatMul(Wq) -> MatMul(k^T) -> Softmax -> MatMul(v) -> y  (norm: Softmax or LayerNormalization
    in place of the Softmax; both sit between FP16 MatMuls)."""
    d = 16
    if norm == "Softmax":
        mid = [oh.make_node("Softmax", ["s"], ["p"], name="norm", axis=-1)]
    else:
        mid = [oh.make_node("LayerNormalization", ["s", "g", "b"], ["p"], name="norm", axis=-1)]
    nodes = [oh.make_node("MatMul", ["x", "wq"], ["q"], name="mq"),
             oh.make_node("MatMul", ["q", "kt"], ["s"], name="scores")] + mid + [
             oh.make_node("MatMul", ["p", "v"], ["y"], name="mix")]
    inits = [nph.from_array(_w(7, (d, d), 0.5), "wq"), nph.from_array(_w(8, (d, d), 0.5), "kt"),
             nph.from_array(_w(9, (d, d)), "v"), nph.from_array(np.ones(d, np.float32), "g"),
             nph.from_array(np.zeros(d, np.float32), "b")]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [2, 8, d])],
                  [oh.make_tensor_value_info("y", TP.FLOAT, [2, 8, d])], inits)


def _att_x(seed):
    return {"x": np.random.default_rng(seed).standard_normal((2, 8, 16)).astype(np.float32)}


def test_softmax_between_fp16_matmuls_reads_and_writes_fp16_at_the_same_error():
    from graphmp.emulate import emulated_runner
    from graphmp.model_runs import runner
    m = attention()
    island = graphmp.convert(m, None, norm_io="fp32")
    low = graphmp.convert(m, None)
    assert island.fp32_nodes.get("norm", "").startswith("Softmax is range-sensitive")
    assert "norm" not in low.fp32_nodes and low.to_dict()["norm_io"] == {"policy": "softmax", "lowered": ["norm"]}
    assert _out_type(low.model, "norm") == TP.FLOAT16
    casts = lambda r: sum(n.op_type == "Cast" for n in r.model.graph.node)  # noqa: E731
    assert casts(island) == casts(low) + 2
    # the island bought nothing: the same error on several inputs (FP16-faithful emulation)
    ref, errs = runner(m), {}
    for name, rep in (("island", island), ("low", low)):
        emu = emulated_runner(rep.model)
        errs[name] = max(float(np.abs(emu(_att_x(s))["y"] - ref(_att_x(s))["y"]).max()
                               / np.abs(ref(_att_x(s))["y"]).max()) for s in (1, 2, 3))
    assert errs["low"] <= 1.25 * errs["island"] + 1e-4, errs


def test_layernorm_is_lowered_only_with_norm_io_all():
    """The policy keeps a LayerNormalization FP32 (island_trials=0: paint's plan); the islands
    pass then measures the island, and here, between two MatMuls, it buys nothing."""
    m = attention("LayerNormalization")
    assert graphmp.convert(m, None, island_trials=0).fp32_nodes["norm"].startswith(
        "LayerNormalization is range-sensitive")
    rep = graphmp.convert(m, None, norm_io="all")
    assert "norm" not in rep.fp32_nodes and _out_type(rep.model, "norm") == TP.FLOAT16
    measured = graphmp.convert(m, None)
    trial = measured.to_dict()["islands"]["trials"][0]
    assert trial["seeds"] == ["norm"] and trial["decision"].startswith("FP16"), trial
    assert _out_type(measured.model, "norm") == TP.FLOAT16
    assert graphmp.convert(m, None, norm_io="fp32").fp32_nodes["norm"].startswith("LayerNormalization is range")


def test_softmax_after_fp32_work_stays_an_fp32_island():
    """A Softmax whose input comes from FP32 work (here a node the user keeps FP32) stays FP32."""
    rep = graphmp.convert(attention(), None, fp32_nodes="^scores$")
    assert rep.fp32_nodes["norm"] == "FP32 spread from an FP32 neighbour (scores)"
    assert _out_type(rep.model, "norm") == TP.FLOAT


def test_one_hot_cast_goes_straight_to_fp16():
    """Equal -> Cast(BOOL -> FLOAT) -> MatMul: one Cast to FLOAT16 instead of two."""
    nodes = [oh.make_node("Equal", ["ids", "classes"], ["eq"], name="eq"),
             oh.make_node("Cast", ["eq"], ["onehot"], name="onehot", to=TP.FLOAT),
             oh.make_node("MatMul", ["onehot", "emb"], ["y"], name="mm")]
    inits = [nph.from_array(np.arange(8, dtype=np.int64), "classes"), nph.from_array(_w(10, (8, 4)), "emb")]
    m = _model(nodes, [oh.make_tensor_value_info("ids", TP.INT64, [5, 1])],
               [oh.make_tensor_value_info("y", TP.FLOAT, [5, 4])], inits)
    out = graphmp.convert(m, None).model
    casts = [(n.input[0], n.attribute[0].i) for n in out.graph.node if n.op_type == "Cast"]
    assert ("eq", TP.FLOAT16) in casts and len(casts) == 2, casts   # the one-hot, and y back to FP32
    ids = {"ids": np.array([[0], [3], [7], [9], [2]], np.int64)}
    assert check(m, out, [ids]).passed


def gelu_tanh_mlp(square_summed=False):
    """x -> MatMul -> GELU (tanh form, with Pow(h, 3)) -> MatMul -> y; square_summed adds
    Pow(h, 2) -> ReduceMean, a variance, as a second output."""
    d = 16
    c = lambda name, v: nph.from_array(np.array(v, np.float32), name)  # noqa: E731
    nodes = [oh.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             oh.make_node("Pow", ["h", "three"], ["h3"], name="cube"),
             oh.make_node("Mul", ["h3", "k"], ["a"], name="k_mul"),
             oh.make_node("Add", ["h", "a"], ["b"], name="inner_add"),
             oh.make_node("Mul", ["b", "s"], ["u"], name="scale"),
             oh.make_node("Tanh", ["u"], ["t"], name="tanh"),
             oh.make_node("Add", ["t", "one"], ["v"], name="one_add"),
             oh.make_node("Mul", ["h", "v"], ["hv"], name="gate"),
             oh.make_node("Mul", ["hv", "half"], ["g"], name="half_mul"),
             oh.make_node("MatMul", ["g", "w2"], ["y"], name="fc2")]
    outs = [oh.make_tensor_value_info("y", TP.FLOAT, [4, d])]
    if square_summed:
        nodes += [oh.make_node("Pow", ["h", "two"], ["h2"], name="square"),
                  oh.make_node("ReduceMean", ["h2"], ["var"], name="mean_sq", axes=[-1])]
        outs.append(oh.make_tensor_value_info("var", TP.FLOAT, [4, 1]))
    inits = [nph.from_array(_w(11, (d, d), 0.3), "w1"), nph.from_array(_w(12, (d, d), 0.3), "w2"),
             c("three", 3.0), c("two", 2.0), c("k", 0.044715), c("s", 0.7978845608), c("one", 1.0), c("half", 0.5)]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [4, d])], outs, inits)


def test_gelu_cube_between_matmuls_is_elementwise_math():
    m = gelu_tanh_mlp()
    rep = graphmp.convert(m, None)
    assert "cube" not in rep.fp32_nodes and _out_type(rep.model, "cube") == TP.FLOAT16, rep.fp32_nodes
    assert sum(n.op_type == "Cast" for n in rep.model.graph.node) == 2        # x in, y out: no island
    # without calibration nothing measured Pow's range: it stays FP32, as its class says
    blind = graphmp.convert(m, None, calibration="off")
    assert blind.fp32_nodes["cube"].startswith("Pow is range-sensitive")
    data = [{"x": np.random.default_rng(s).standard_normal((4, 16)).astype(np.float32)} for s in (1, 2)]
    assert check(m, rep.model, data).passed


def test_a_square_that_is_summed_stays_fp32():
    rep = graphmp.convert(gelu_tanh_mlp(square_summed=True), None)
    assert rep.fp32_nodes["square"].startswith("Pow is range-sensitive") and "cube" not in rep.fp32_nodes

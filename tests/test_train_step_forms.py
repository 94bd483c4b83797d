"""The forms the training step is written in for speed: the update selects once (on the flat
gradient, not per state buffer), a masked gradient is a product with the mask, and the build's
precision_cost still knows shapes that only data propagation gives."""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fixtures import tiny
from graphmp.train.flat import FLAT_BUFFERS, GRAD
from graphmp.train.loop import StepRunner, latest_state
from graphmp.train.step import build_step
from graphmp.train.step_cost import precision_cost
from graphmp.train.update import NEXT, PREFIX


def _producers(model) -> dict:
    return {o: n for n in model.graph.node for o in n.output}


@pytest.mark.parametrize("opts", [dict(optimizer="adamw", weight_decay=0.01),
                                  dict(optimizer="sgd", momentum=0.9, grad_accum=2)])
def test_no_state_buffer_is_selected_by_a_where(tmp_path, opts):
    """Weights and moments leave the update through arithmetic (their scalar coefficients are
    what `applied` gates): no Where reads or writes them; one Where reads the flat gradient."""
    p = str(tmp_path / "cnn.onnx")
    onnx.save(tiny.cnn(), p)
    run = str(tmp_path / "run")
    build_step(p, run, loss="cross-entropy", precision="fp32", **opts)
    m = onnx.load(os.path.join(run, "step.onnx"))
    prod = _producers(m)
    gated = [b for b in FLAT_BUFFERS if b + NEXT in prod and b not in ("flat__bn_stats", "flat__accum")]
    assert "flat__weights" in gated and len(gated) >= 2
    wheres = [n for n in m.graph.node if n.op_type == "Where" and n.name.startswith(PREFIX + "/")]
    for b in gated:
        assert prod[b + NEXT].op_type != "Where", b
        assert not [n for n in wheres if b in n.input], b
    if opts.get("grad_accum", 1) == 1:
        assert len([n for n in wheres if GRAD in n.input]) == 1


def test_relu_gradient_is_a_product_with_the_mask_and_exact(tmp_path):
    """ReLU's gradient: dY where X > 0, else 0, bit for bit, written without a Where."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])
    w = numpy_helper.from_array(np.linspace(-1, 1, 25, dtype=np.float32).reshape(5, 5), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["z"]), helper.make_node("Relu", ["z"], ["y"])],
                          "r", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])], [w])
    p = str(tmp_path / "relu.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), p)
    run = str(tmp_path / "run")
    meta = build_step(p, run, loss="mse", precision="fp32", expose_grads=True, init_scale=1.0)
    m = onnx.load(os.path.join(run, "step.onnx"))
    assert not [n for n in m.graph.node if n.op_type == "Where" and n.name.startswith("grad/")]
    r = StepRunner(run, meta, latest_state(run)[0], device_state=False)  # r.state: numpy
    names = [o.name for o in r.sess.get_outputs()]
    xv = np.array([[1, -2, 0.5, 3, -1], [-0.5, 2, -3, 1, 0.25]], np.float32)
    yv = np.zeros((2, 5), np.float32)
    out = dict(zip(names, r.sess.run(None, {"x": xv, meta["label"]["name"]: yv, **r.state})))
    wv = numpy_helper.to_array(w)
    z = xv @ wv
    dy = 2 * np.maximum(z, 0) / z.size  # d mean((relu(z) - 0)^2)
    want = xv.T @ (dy * (z > 0))
    np.testing.assert_allclose(out["w" + "__grad"], want, rtol=1e-6, atol=1e-7)


def test_precision_cost_knows_shapes_only_data_propagation_gives():
    """A MatMul after a Reshape whose target is computed (Shape -> Concat) has its FLOPs
    counted: plain inference leaves it unknown, so the data-propagating pass runs."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 3])
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "zero", "one"], ["n"]),
             helper.make_node("Concat", ["n", "twelve"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["flat"]),
             helper.make_node("MatMul", ["flat", "w"], ["y"])]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([12], np.int64), "twelve"),
             numpy_helper.from_array(np.ones((12, 5), np.float32), "w")]
    g = helper.make_graph(nodes, "dp", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    cost = precision_cost(m, {"x": [2, 4, 3]})
    assert cost["unknown_shapes"] == 0
    assert cost["gemm_gflop"] == pytest.approx(2 * 2 * 12 * 5 / 1e9)

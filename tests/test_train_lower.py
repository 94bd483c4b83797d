"""graphmp/train/lower.py: a step's forward Conv with a run-time kernel, wide channels and a
small map, rewritten as one Gemm over the batch, computing the same values under the same
output name; everything else left alone."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphmp.model_runs import ort_session
from graphmp.train.lower import lower_forward_convs

F32 = TensorProto.FLOAT
N = helper.make_node


def _model():
    """x [n, 128, 4, 4] -> a: wide 3x3/2 Conv with bias (kernel a graph input) -> [n, 128, 2, 2]
    -> b: wide 1x1 Conv (graph input) -> c: the same 1x1 with a constant kernel -> d: a
    64-channel 3x3 Conv (graph input); after them, outside the forward, e: another wide 1x1."""
    rng = np.random.default_rng(7)
    vi = helper.make_tensor_value_info
    nodes = [N("Conv", ["x", "w1", "b1"], ["a"], strides=[2, 2], pads=[1, 1, 1, 1], name="wide_strided"),
             N("Conv", ["a", "w2"], ["b"], name="wide_1x1"),
             N("Conv", ["b", "w2_const"], ["c"], name="constant_kernel"),
             N("Conv", ["c", "w3"], ["d"], pads=[1, 1, 1, 1], name="narrow_out"),
             N("Conv", ["b", "w2"], ["e"], name="after_forward")]
    inputs = {"x": ["n", 128, 4, 4], "w1": [128, 128, 3, 3], "b1": [128], "w2": [128, 128, 1, 1],
              "w3": [64, 128, 3, 3]}
    consts = [numpy_helper.from_array(rng.standard_normal((128, 128, 1, 1)).astype(np.float32), "w2_const")]
    g = helper.make_graph(nodes, "convs", [vi(k, F32, v) for k, v in inputs.items()],
                          [vi("d", F32, ["n", 64, 2, 2]), vi("e", F32, ["n", 128, 2, 2])], consts)
    feeds = {k: rng.standard_normal([2 if d == "n" else d for d in v]).astype(np.float32) for k, v in inputs.items()}
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), feeds


def test_wide_convs_on_small_maps_become_one_gemm_with_the_same_outputs():
    model, feeds = _model()
    before = ort_session(model).run(None, feeds)
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    added = lower_forward_convs(lowered, n_forward=4)
    onnx.checker.check_model(lowered, full_check=True)
    convs = [n.name for n in lowered.graph.node if n.op_type == "Conv"]
    assert convs == ["constant_kernel", "narrow_out", "after_forward"]
    gemms = [n for n in lowered.graph.node if n.op_type == "Gemm"]
    assert len(gemms) == 2 and len(gemms[0].input) == 3 and len(gemms[1].input) == 2  # the bias rides on the Gemm
    assert added == len(lowered.graph.node) - len(model.graph.node) > 0
    after = ort_session(lowered).run(None, feeds)
    for x, y in zip(before, after):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5 * np.abs(x).max())


def test_fp16_convs_are_lowered_only_without_a_bias():
    """In FP16 a Conv with a bias stays a Conv (ORT CPU's Gemm would round the product before
    adding the bias); one without a bias becomes a Gemm, within FP16 rounding of the Conv."""
    rng = np.random.default_rng(8)
    vi = helper.make_tensor_value_info
    f16 = TensorProto.FLOAT16
    nodes = [N("Conv", ["x", "w", "b"], ["a"], pads=[1, 1, 1, 1], name="with_bias"),
             N("Conv", ["a", "w"], ["y"], pads=[1, 1, 1, 1], name="no_bias")]
    inputs = {"x": ["n", 128, 2, 2], "w": [128, 128, 3, 3], "b": [128]}
    g = helper.make_graph(nodes, "f16", [vi(k, f16, v) for k, v in inputs.items()], [vi("y", f16, ["n", 128, 2, 2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    feeds = {k: (rng.standard_normal([2 if d == "n" else d for d in v]) * 0.1).astype(np.float16)
             for k, v in inputs.items()}
    before = ort_session(model).run(None, feeds)[0].astype(np.float32)
    assert lower_forward_convs(model, n_forward=2) > 0
    assert [n.name for n in model.graph.node if n.op_type == "Conv"] == ["with_bias"]
    after = ort_session(model).run(None, feeds)[0].astype(np.float32)
    np.testing.assert_allclose(after, before, rtol=2e-3, atol=2e-3 * np.abs(before).max())


def test_nothing_to_lower_leaves_the_graph_as_it_was():
    model, _ = _model()
    del model.graph.node[:2]
    model.graph.node[0].input[0] = "x"  # constant_kernel on x (4x4 map): a constant kernel anyway
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    assert lower_forward_convs(model, n_forward=3) == 0
    assert model == copy

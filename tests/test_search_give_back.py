"""The --max-error search starts from the most-FP16 plan the hard rules allow: nodes that
only the static range rule (|x| > --range-threshold in calibration; 512 here, one
threshold for every node, as the auto rule has near a subtraction) keeps FP32 start in
FP16 and stay there when the measured error allows ("given back"); up to 16x headroom
below FP16's max (classify.GIVE_BACK_RANGE). Past it they start FP32 and are given back
where the measured plan stays within the budget, and within UNSEEN x it on inputs LOUD x
as large (an overflow is inf in the emulation, so a node that overflows stays FP32)."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import graphmp
from graphmp.cli import main
from graphmp.emulate import emulated_runner
from graphmp.model_runs import cuda_available, runner
from graphmp.passes.classify import FP16_MAX, GIVE_BACK_RANGE
from graphmp.passes.search import LOUD


def _mlp(peak: float, cancel: bool = False, seed: int = 0) -> onnx.ModelProto:
    """x[4,64] -> MatMul 'wide' (|h| about `peak` on N(0,1) inputs) -> Relu -> head.
    head: a MatMul to small outputs, or (cancel) the difference of two MatMuls that
    agree to 0.1%: their FP16 rounding (0.25 at 700) is most of the result."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((64, 64)) * peak / 24).astype(np.float32)
    inits = [numpy_helper.from_array(w1, "w1")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="wide"),
             helper.make_node("Relu", ["h"], ["r"], name="relu")]
    if cancel:
        a = (rng.standard_normal((64, 16)) / 8).astype(np.float32)
        inits += [numpy_helper.from_array(a, "a"), numpy_helper.from_array((a * 1.001).astype(np.float32), "b")]
        nodes += [helper.make_node("MatMul", ["r", "a"], ["p"], name="head_p"),
                  helper.make_node("MatMul", ["r", "b"], ["q"], name="head_q"),
                  helper.make_node("Sub", ["q", "p"], ["y"], name="difference")]
    else:
        inits.append(numpy_helper.from_array((rng.standard_normal((64, 16)) / peak).astype(np.float32), "w2"))
        nodes.append(helper.make_node("MatMul", ["r", "w2"], ["y"], name="head"))
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", T.FLOAT, [4, 64])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [4, 16])], inits)
    # IR 9: what every onnxruntime of this project's range loads (onnx 1.23 writes IR 12 by
    # default, which onnxruntime-gpu 1.31.1 refused on the GPU machine)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _widest(peak: float) -> float:
    """The range the rule saw on 'wide' (from its static reason)."""
    reason = graphmp.convert(_mlp(peak), None, range_threshold=512).fp32_nodes["wide"]
    return float(reason.split("reached ")[1].split(" ")[0])


def _error(src, conv, seed=7) -> float:
    x = {"x": np.random.default_rng(seed).standard_normal((4, 64)).astype(np.float32)}
    want, got = runner(src)(x)["y"], emulated_runner(conv)(x)["y"]
    return float(np.abs(want - got).max() / np.abs(want).max())


def test_range_rule_is_given_back_where_the_budget_allows():
    src = _mlp(700)
    static = graphmp.convert(src, None, range_threshold=512)
    assert static.fp32_nodes["wide"].startswith("range:")  # the rule fires without a budget
    assert 512 < _widest(700) <= GIVE_BACK_RANGE
    rep = graphmp.convert(src, None, max_error="1e-2", range_threshold=512)
    assert "wide" not in rep.fp32_nodes and "head" not in rep.fp32_nodes
    back = {e["node"]: e["range_rule"] for e in rep["search"]["given_back"]}
    assert set(back) >= {"wide", "relu", "head"} and back["wide"].startswith("range:")
    assert rep["search"]["reached"] and rep["search"]["verified"]["normalized"] <= 1
    assert _error(src, rep.model) <= 1e-2  # held on inputs the search never saw


def test_past_the_headroom_the_range_rule_is_given_back_where_measured():
    """Past GIVE_BACK_RANGE the rule's node starts FP32 and goes to FP16 only where the
    measured plan stays within the budget, and within UNSEEN x it on the loud copy (inputs
    x LOUD) (before: it stayed FP32 whatever the budget)."""
    src = _mlp(20000)
    assert GIVE_BACK_RANGE < _widest(20000) < FP16_MAX / LOUD
    assert graphmp.convert(src, None, range_threshold=512).fp32_nodes["wide"].startswith("range:")
    rep = graphmp.convert(src, None, max_error="1e-2", range_threshold=512)
    assert not {"wide", "relu", "head"} & set(rep.fp32_nodes), rep.fp32_nodes
    assert {"wide", "relu", "head"} <= {e["node"] for e in rep["search"]["given_back"]}
    assert rep["search"]["reached"] and rep["search"]["verified"]["normalized"] <= 1
    assert _error(src, rep.model) <= 1e-2


@pytest.mark.parametrize("peak", [45000, 90000])
def test_a_range_rule_node_that_overflows_in_fp16_stays_fp32(peak):
    """90000: past FP16's max on the calibration batches (inf in the emulation); 45000:
    within it, but not on inputs LOUD x as large. Either way the node stays FP32 with the
    rule's reason and what the search measured, under a budget loose enough for the rest."""
    src = _mlp(peak)
    widest = _widest(peak)
    assert (widest > FP16_MAX) if peak > FP16_MAX else (FP16_MAX / LOUD < widest < FP16_MAX)
    rep = graphmp.convert(src, None, max_error="1e-1", range_threshold=512)
    for node in ("wide", "head"):
        why = rep.fp32_nodes[node]
        assert why.startswith("range:") and "it overflows (inf)" in why, why
    assert not rep["search"]["given_back"]
    assert rep["search"]["reached"] and np.isfinite(_error(src, rep.model))


def test_a_candidate_that_breaks_the_budget_is_kept_fp32_with_both_reasons():
    src = _mlp(700, cancel=True)
    rep = graphmp.convert(src, None, max_error="1e-2", range_threshold=512)
    kept = {k: v for k, v in rep.fp32_nodes.items() if k.startswith("head_")}
    assert kept, rep.fp32_nodes  # the cancelling MatMuls cannot be FP16 at this budget
    assert all(v.startswith("search:") and "range: |r| reached" in v for v in kept.values()), kept
    assert rep["search"]["reached"]
    assert _error(src, rep.model) <= 1e-2


def test_cli_summary_names_the_given_back_nodes(tmp_path, capsys):
    src = tmp_path / "mlp.onnx"
    onnx.save(_mlp(700), src)
    assert main(["convert", str(src), "-o", str(tmp_path / "out.onnx"), "--max-error", "1e-2",
                 "--range-threshold", "512"]) == 0
    out = capsys.readouterr().out
    assert "\n  given back: 3 node(s) the range rule" in out and "\\n" not in out, out  # a line of its own


def test_search_time_keeps_the_best_plan_so_far_and_says_so():
    src = _mlp(700, cancel=True)
    rep = graphmp.convert(src, None, max_error="1e-3", search_time=1e-6, range_threshold=512)
    s = rep["search"]
    assert "--search-time" in s["out_of_time"] and any("--search-time" in w for w in rep["warnings"])
    # nothing within budget was measured before the time ran out: every candidate stays FP32,
    # and the written model's error is the verdict
    assert s["verified"]["normalized"] == s["error"] and s["reached"] == (s["error"] <= 1)
    assert {"wide", "head_p", "head_q"} <= set(rep.fp32_nodes)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs onnxruntime-gpu and a CUDA GPU")
def test_the_written_model_is_also_measured_on_ort_cuda():
    src = _mlp(700, cancel=True)
    s = graphmp.convert(src, None, max_error="1e-2", range_threshold=512)["search"]
    v = s["verified_ort_cuda"]
    assert set(v["errors"]) == {"y"} and v["normalized"] == pytest.approx(v["errors"]["y"] / s["budget"]["allowed"]["y"])


def test_no_cuda_row_without_a_gpu():
    if cuda_available():
        pytest.skip("a GPU is present")
    assert "verified_ort_cuda" not in graphmp.convert(_mlp(700), None, max_error="1e-2")["search"]


def test_out_of_search_time_a_wide_range_rule_node_stays_fp32_untried():
    """--search-time past before anything was measured: the node past GIVE_BACK_RANGE keeps
    the range rule's verdict, and its reason says it was not tried in FP16."""
    rep = graphmp.convert(_mlp(20000), None, max_error="1e-2", search_time=1e-6, range_threshold=512)
    assert "--search-time" in rep["search"]["out_of_time"]
    why = rep.fp32_nodes["wide"]
    assert why.startswith("range:") and why.endswith("not tried in FP16"), why

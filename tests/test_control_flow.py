"""Weights inside If / Loop / Scan bodies (nested too) are converted like the main
graph's, the result is valid, runs in ONNX Runtime and is accurate FP16-faithfully.

Builders: tests/control_flow_cases.py (every float weight sits inside a subgraph, as
Constant nodes and as subgraph initializers).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import control_flow_cases as cf  # noqa: E402

import graphmp  # noqa: E402
from graphmp.model_runs import run_reference  # noqa: E402


def _ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _feed_variants(name, feeds):
    """Both branches of the If case; the others as given."""
    if name == "if_weights_in_branches":
        return [dict(feeds, cond=np.array(True)), dict(feeds, cond=np.array(False))]
    return [feeds]


@pytest.mark.parametrize("name", list(cf.CASES))
def test_oracle_reproduces_ort_on_the_fp32_source(name):
    """The FP16-faithful oracle is only worth something where it agrees with ORT in FP32
    (onnx.reference's own Loop ran zero iterations without `cond` and vstacked scans)."""
    model, feeds = cf.CASES[name]()
    for f in _feed_variants(name, feeds):
        want, got = _ort(model, f), run_reference(model, f)
        for k, v in want.items():
            assert got[k].shape == v.shape, (k, got[k].shape, v.shape)
            np.testing.assert_allclose(got[k], v, atol=1e-5, rtol=1e-5, err_msg=k)


@pytest.mark.parametrize("name", list(cf.CASES))
def test_subgraph_weights_converted_valid_and_accurate(name):
    model, feeds = cf.CASES[name]()
    before = cf.float_weight_bytes(model)
    out = graphmp.convert(model, None, calibration=[feeds]).model
    onnx.checker.check_model(out, full_check=True)
    after = cf.float_weight_bytes(out)
    # every weight lives in a subgraph; those feeding FP16 work are FP16 now, and the Loop's
    # bias b_body (16 floats) stays FP32: its Add updates the carried state (classify rule 9)
    kept = {"loop_weights_in_body": 64}.get(name, 0)
    assert after == {"FLOAT16": (before["FLOAT"] - kept) // 2, **({"FLOAT": kept} if kept else {})}, (before, after)
    for f in _feed_variants(name, feeds):
        want = _ort(model, f)
        got_ort = _ort(out, f)
        got = run_reference(out, f)
        for k, v in want.items():
            scale = max(1.0, float(np.abs(v).max()))
            assert np.all(np.isfinite(got[k])), k
            assert float(np.abs(got[k] - v).max()) <= 1e-2 * scale, (k, float(np.abs(got[k] - v).max()))
            assert float(np.abs(got_ort[k] - v).max()) <= 1e-2 * scale, k


def test_if_branches_keep_fp32_islands_and_io_types():
    """Softmax inside a branch stays FP32; the If's output type is the same in both
    branches (FP32, as declared), whatever each branch computes in."""
    model, feeds = cf.nested_if_in_loop()
    out = graphmp.convert(model, None, calibration=[feeds]).model
    body = out.graph.node[0].attribute[0].g
    if_node = next(n for n in body.node if n.op_type == "If")
    branches = {a.name: a.g for a in if_node.attribute}
    for g in branches.values():
        assert g.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    then = branches["then_branch"]
    softmax = next(n for n in then.node if n.op_type == "Softmax")
    producers = {o: n for n in then.node for o in n.output}
    # the Softmax reads an FP32 value: a Cast to FLOAT placed in the branch that owns it
    cast = producers[softmax.input[0]]
    assert cast.op_type == "Cast" and cast.attribute[0].i == onnx.TensorProto.FLOAT

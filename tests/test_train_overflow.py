"""Mixed-precision steps that are skipped at every loss scale, and saying so (issue 14, dnsmos).

The mechanism found on DNSMOS (Conv -> Relu -> Transpose -> ReduceMax over time): ONNX Runtime
on the CPU computes the FP16 graph in FP32 and drops the Casts it inserts around some ops but
not others, so the ReduceMax gradient's [X == Y] compared an unrounded X with an FP16-rounded Y:
no element matched, dY * mask / count was 0/0 = NaN, and every step was skipped down to loss
scale 1 and beyond. The tiny model here has the same Relu -> Transpose -> ReduceMax(keepdims=0)
shape; its mixed step's gradients must be finite and equal the FP32 step's to FP16 accuracy.

Real step graphs, real ONNX Runtime (CPU) sessions, the onnx reference evaluator for the FP16
comparison itself.
"""
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from fixtures import tiny as tm
from graphmp.cli import main
from graphmp.train.flat import pack
from graphmp.train.emitter import Emitter, tensor_info
from graphmp.train.optim import skipped_note
from graphmp.train.rules.common import _is_extreme
from graphmp.train.step import build_step


def _max_over_time_model(seed=0):
    """x[N,4,8] -> MatMul w1[8,8] -> Relu -> Transpose [N,8,4] -> ReduceMax(axis 1, keepdims 0)
    -> [N,4] -> MatMul w2[4,3] -> logits [N,3] (dnsmos' global max pooling, in small)."""
    r = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((r.standard_normal([8, 8]) * 0.5).astype(np.float32), "w1"),
             numpy_helper.from_array((r.standard_normal([4, 3]) * 0.5).astype(np.float32), "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Transpose", ["r"], ["rt"], name="to_time_major", perm=[0, 2, 1]),
             helper.make_node("ReduceMax", ["rt"], ["m"], name="max_over_time", axes=[1], keepdims=0),
             helper.make_node("MatMul", ["m", "w2"], ["logits"], name="fc2")]
    g = helper.make_graph(nodes, "max_over_time", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 8])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def _run_step(run_dir, feeds, scale):
    """One run of step.onnx from the initial state at loss scale `scale`: all outputs by name."""
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(os.path.join(run_dir, "step.onnx"), so, providers=["CPUExecutionProvider"])
    state = dict(np.load(os.path.join(run_dir, "state.npz")))
    if "loss_scale" in state:
        state["loss_scale"] = np.array(scale, np.float32)
    names = [o.name for o in sess.get_outputs()]
    meta = json.loads(open(os.path.join(run_dir, "train.json")).read())
    return dict(zip(names, sess.run(None, {**pack(meta, state), **feeds})))


@pytest.fixture(scope="module")
def max_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("maxtime")
    onnx.save(_max_over_time_model(), str(d / "m.onnx"))
    for prec in ("fp32", "mixed"):
        build_step(str(d / "m.onnx"), str(d / prec), precision=prec, optimizer="sgd", lr=0.1, expose_grads=True)
    return str(d)


def test_mixed_reduce_max_gradient_is_finite_and_matches_fp32(max_runs):
    """Before the fix: w1's gradient was NaN at every scale (1 and 1024 here), all_finite False."""
    step = onnx.load(os.path.join(max_runs, "mixed", "step.onnx"))
    types = {v.name: v.type.tensor_type.elem_type
             for v in onnx.shape_inference.infer_shapes(step).graph.value_info}
    rm = next(n for n in step.graph.node if n.op_type == "ReduceMax" and n.name == "max_over_time")
    assert types[rm.input[0]] == TensorProto.FLOAT16  # the mechanism needs the max in FP16
    r = np.random.default_rng(1)
    feeds = {"x": r.standard_normal([4, 4, 8]).astype(np.float32), "labels": np.array([0, 1, 2, 1], np.int64)}
    ref = _run_step(os.path.join(max_runs, "fp32"), feeds, 1.0)
    assert ref["all_finite"]
    for scale in (1.0, 1024.0):
        out = _run_step(os.path.join(max_runs, "mixed"), feeds, scale)
        assert out["all_finite"], f"mixed step skipped at loss scale {scale}"
        for w in ("w1", "w2"):
            g, g32 = out[w + "__grad"], ref[w + "__grad"]
            assert np.isfinite(g).all()
            np.testing.assert_allclose(g, g32, rtol=0, atol=2e-3 * np.abs(g32).max())
        assert np.abs(out["w1__grad"]).max() > 0.1  # the gradient reached the layer below the max


def test_fp16_extreme_mask_is_exact_on_real_fp16_values():
    """The tolerance of _is_extreme never merges two distinct FP16 numbers: on a runtime that
    computes in FP16 (onnx.reference), the mask equals [x == y], also at the binade edges
    where the gap below y is half the gap above."""
    m = helper.make_model(helper.make_graph(
        [], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [None]) for n in ("x", "y")], []),
        opset_imports=[helper.make_opsetid("", 13)])
    em = Emitter(m, tensor_info(m), "t")
    mask = _is_extreme(em, "x", "y")
    m.graph.node.extend(em.nodes)
    m.graph.output.append(helper.make_tensor_value_info(mask, TensorProto.BOOL, [None]))
    ys = np.array([1.0, 2.0, 1024.0, 0.75, 3.1416, 60000.0, 2.0 ** -14, 1e-6, 0.0, -4.0, -1.0], np.float16)
    y = np.repeat(ys, 3)
    x = np.stack([np.nextafter(ys, np.float16(-np.inf)), ys, np.nextafter(ys, np.float16(np.inf))], 1).reshape(-1)
    got = ReferenceEvaluator(m).run(None, {"x": x, "y": y})[0]
    np.testing.assert_array_equal(got, x == y)


def test_fp16_extreme_mask_matches_a_rounded_max(tmp_path):
    """The dnsmos case in isolation: x unrounded (FP32 values in an FP16-typed tensor, as ONNX
    Runtime's CPU leaves them), y = x's max rounded to FP16: exact Equal finds nothing; the
    mask finds the max (its FP16 rounding is within half an ulp)."""
    x32 = np.array([0.1234567, 3.3333333, 1.0000001, 2.7182818], np.float32)
    y16 = np.float16(x32.max())
    assert not (x32 == np.float32(y16)).any()
    m = helper.make_model(helper.make_graph(
        [], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [None]) for n in ("x", "y")], []),
        opset_imports=[helper.make_opsetid("", 13)])
    em = Emitter(m, tensor_info(m), "t")
    mask = _is_extreme(em, "x", "y")
    nodes = list(em.nodes)
    # the same mask nodes with x and y as FP32 (what the runtime actually compared)
    for n in nodes:
        for a in n.attribute:
            if a.name == "value" and a.t.data_type == TensorProto.FLOAT16:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
    m32 = helper.make_model(helper.make_graph(
        nodes, "g32", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None]) for n in ("x", "y")],
        [helper.make_tensor_value_info(mask, TensorProto.BOOL, [None])]), opset_imports=[helper.make_opsetid("", 13)])
    got = ReferenceEvaluator(m32).run(None, {"x": x32, "y": np.full(4, np.float32(y16))})[0]
    np.testing.assert_array_equal(got, x32 == x32.max())


# --- saying so when (nearly) every step is skipped ------------------------------------------------

@pytest.mark.parametrize("cfg,dynamic,steps,skipped,scale,want", [
    ({"precision": "mixed", "min_scale": 1.0}, True, 20, 20, 1.0, "all 20 steps were skipped for inf/NaN gradients at "
     "loss scale 1, its floor (--min-scale)"),
    ({"precision": "mixed", "min_scale": 1.0, "backoff": 0.5}, True, 20, 18, 64.0, "still backing off (now 64"),
    ({"precision": "mixed"}, False, 10, 10, 128.0, "at the fixed loss scale 128"),
    ({"precision": "fp32"}, False, 10, 9, 1.0, "9 of 10 steps were skipped for inf/NaN gradients, in FP32"),
    ({"precision": "mixed", "min_scale": 1.0}, True, 20, 17, 1.0, None),   # 85%: a scale still settling
    ({"precision": "mixed", "min_scale": 1.0}, True, 3, 3, 1.0, None),     # too few steps to tell
])
def test_skipped_note_cases(cfg, dynamic, steps, skipped, scale, want):
    note = skipped_note(cfg, dynamic, steps, skipped, scale)
    if want is None:
        assert note is None
    else:
        assert want in note and "\n" not in note


def test_train_says_when_every_step_overflowed_at_the_floor(tmp_path, capsys):
    """A real run whose every step overflows: the loss scale's floor (min = init = 2^100) makes
    the scaled FP16 gradients inf at every step. `graphmp train` says why, in the progress
    output (with -v, or on a terminal) and the summary (printed and summary.json), once each,
    and exits 1 (no step applied); a healthy run says nothing and exits 0."""
    onnx.save(tm.mlp(), str(tmp_path / "mlp.onnx"))
    np.savez(tmp_path / "d.npz", **tm.blobs(32))
    big = str(2.0 ** 100)
    assert main(["train-graph", str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "bad"), "--init-scale", big,
                 "--min-scale", big, "--max-scale", big]) == 0
    assert main(["train", str(tmp_path / "bad"), "--data", str(tmp_path / "d.npz"), "--batch-size", "8",
                 "--epochs", "2", "--checkpoint-every", "0", "--device", "cpu", "-v"]) == 1  # nothing trained
    out = capsys.readouterr()
    text = out.out + out.err
    want = "all 8 steps were skipped for inf/NaN gradients at loss scale 1.26765e+30, its floor (--min-scale)"
    assert text.count(want) == 2, text  # once in the progress output, once in the summary
    summary = json.load(open(tmp_path / "bad" / "summary.json"))
    assert summary["skipped_steps"] == 8 and summary["optimizer_steps"] == 0
    assert summary["skipped_note"].startswith(want)

    assert main(["train-graph", str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "ok")]) == 0
    assert main(["train", str(tmp_path / "ok"), "--data", str(tmp_path / "d.npz"), "--batch-size", "8",
                 "--epochs", "2", "--checkpoint-every", "0", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    assert "were skipped" not in out.out + out.err
    summary = json.load(open(tmp_path / "ok" / "summary.json"))
    assert summary["skipped_note"] is None and summary["skipped_steps"] < 8

"""Calibration: ranges of every float tensor, inside If/Loop/Scan bodies too; it either
observes tensors for real or stops with a one-line error (never "0 observed, exit 0")."""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nph

import graphmp
from graphmp.errors import GraphmpError
from graphmp.model_runs import run_ort, run_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32 = TP.FLOAT


def _w(seed, shape, scale):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _vi(name, shape, elem=F32):
    return oh.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=()):
    m = oh.make_model(oh.make_graph(nodes, "g", inputs, outputs, initializer=list(inits)),
                      opset_imports=[oh.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _branch_overflow_model():
    """If(cond): then = MatMul -> x300 -> MatMul whose output reaches ~1e5 (inf in FP16,
    so 'then_big' must stay FP32); else = one small MatMul. Weights live in the branches."""
    then_g = oh.make_graph(
        [oh.make_node("MatMul", ["x", "Wt"], ["t1"], name="then_mm"),
         oh.make_node("Mul", ["t1", "k"], ["t2"], name="then_scale"),
         oh.make_node("MatMul", ["t2", "Wt2"], ["then_out"], name="then_big")],
        "then_branch", [], [_vi("then_out", [4, 16])],
        initializer=[nph.from_array(_w(1, [16, 16], 0.25), "Wt"), nph.from_array(np.array(300, np.float32), "k"),
                     nph.from_array(_w(2, [16, 16], 20.0), "Wt2")])
    else_g = oh.make_graph([oh.make_node("MatMul", ["x", "We"], ["else_out"], name="else_mm")],
                           "else_branch", [], [_vi("else_out", [4, 16])],
                           initializer=[nph.from_array(_w(3, [16, 16], 0.25), "We")])
    return _model([oh.make_node("If", ["cond"], ["y"], name="if_node", then_branch=then_g, else_branch=else_g)],
                  [_vi("x", [4, 16]), _vi("cond", [], TP.BOOL)], [_vi("y", [4, 16])])


def test_ranges_inside_if_branches_keep_overflowing_nodes_fp32():
    m = _branch_overflow_model()
    feeds = {"x": np.random.default_rng(4).standard_normal([4, 16]).astype(np.float32), "cond": np.array(True)}
    ref = run_ort(m, feeds)["y"]
    assert np.abs(ref).max() > 65504 / 4  # the case is meaningful: far above the FP16-safe range
    rep = graphmp.convert(m, None, calibration=[feeds])
    fp32 = {e["name"]: e for e in rep.to_dict()["fp32_nodes"]}
    assert "then_big" in fp32 and fp32["then_big"]["reason"].startswith("range:"), fp32
    assert "then_branch" in fp32["then_big"]["graph"]
    assert "else_mm" not in fp32  # small values in the other branch: FP16
    assert rep["calibration"]["tensors_observed"] >= 5
    out = rep.model
    onnx.checker.check_model(out, full_check=True)
    got = run_reference(out, feeds)["y"]
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max()
    got_else = run_reference(out, dict(feeds, cond=np.array(False)))["y"]
    want_else = run_ort(m, dict(feeds, cond=np.array(False)))["y"]
    assert np.abs(got_else - want_else).max() <= 1e-2


def test_ranges_across_loop_iterations():
    """A Loop body whose state grows x8 per iteration: after 6 iterations it is above the
    threshold only in the later iterations, which calibration must see."""
    body = oh.make_graph(
        [oh.make_node("MatMul", ["h", "W"], ["m"], name="body_mm"),
         oh.make_node("Mul", ["m", "eight"], ["h_next"], name="body_grow"),
         oh.make_node("Identity", ["c"], ["c_out"], name="body_cond")],
        "body", [_vi("i", [], TP.INT64), _vi("c", [], TP.BOOL), _vi("h", [2, 8])],
        [_vi("c_out", [], TP.BOOL), _vi("h_next", [2, 8])],
        initializer=[nph.from_array(np.eye(8, dtype=np.float32), "W"),
                     nph.from_array(np.array(8, np.float32), "eight")])
    m = _model([oh.make_node("Loop", ["trip", "", "x"], ["y"], name="loop", body=body)],
               [_vi("x", [2, 8])], [_vi("y", [2, 8])], [nph.from_array(np.array(6, np.int64), "trip")])
    feeds = {"x": np.full([2, 8], 0.5, np.float32)}  # 0.5 * 8**6 = 131072 at the end
    rep = graphmp.convert(m, None, calibration=[feeds]).to_dict()
    fp32 = {e["name"]: e["reason"] for e in rep["fp32_nodes"]}
    assert fp32.get("body_mm", "").startswith("range:") or fp32.get("body_grow", "").startswith("range:"), fp32


def test_generated_inputs_report_batches_and_shapes():
    rep = graphmp.convert(os.path.join(ROOT, "models", "real", "ppocrv4_det.onnx"), None).to_dict()
    cal = rep["calibration"]
    assert cal["source"] == "generated inputs" and cal["batches"] == 2
    assert cal["shapes"] == ["x:1x3x224x224", "x:2x3x224x224"] and cal["tensors_observed"] > 300
    summary = graphmp.convert(os.path.join(ROOT, "models", "real", "ppocrv4_det.onnx"), None,
                              shapes="x:1x3x64x96").summary()
    assert "x:1x3x64x96" in summary and "tensors observed" in summary


def test_no_runnable_shapes_is_an_error_not_a_silent_conversion(tmp_path):
    from test_inputs import _fixed_size_model
    m = _fixed_size_model()
    with pytest.raises(GraphmpError, match="--shapes"):
        graphmp.convert(m, str(tmp_path / "o.onnx"))
    assert not (tmp_path / "o.onnx").exists()
    rep = graphmp.convert(m, None, shapes="x:1x49").to_dict()
    assert rep["calibration"]["tensors_observed"] > 0
    assert graphmp.convert(m, None, calibration="off").to_dict()["calibration"]["source"] == "off"


def test_user_data_that_fails_in_ort_is_an_error(tmp_path):
    from test_inputs import _fixed_size_model
    npz = tmp_path / "b.npz"
    np.savez(npz, x=np.zeros((1, 50), np.float32))  # 50 is not 7x7
    with pytest.raises(GraphmpError, match=r"b\.npz: ONNX Runtime cannot run"):
        graphmp.convert(_fixed_size_model(), None, calibration=[str(npz)])


def test_custom_op_model_converts_without_ranges_and_says_so():
    """docs/failure_modes.md #9: ONNX Runtime cannot load a custom op here; the conversion goes on
    with the types it can prove, and the report says calibration was skipped and why."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cases
    src, _ = cases.build("09a_custom_op_no_schema")
    rep = graphmp.convert(src, None).to_dict()
    assert rep["calibration"]["source"].startswith("skipped: ONNX Runtime cannot load the model")
    assert any("no range check was done" in w for w in rep["warnings"])


def test_generated_inputs_say_what_they_cannot_know(tmp_path):
    """Ranges from N(0,1) inputs miss what int16-scale audio or 0-255 pixels reach: the
    report says so, and does not when the user gave data."""
    from test_inputs import _audio_model
    m = _audio_model()
    warnings = graphmp.convert(m, None).to_dict()["warnings"]
    assert any("calibration ran on generated inputs" in w and "--calibration" in w for w in warnings)
    data = {"waveforms": np.zeros((1, 64), np.float32), "waveforms_lens": np.array([64], np.int64)}
    assert not any("generated" in w for w in graphmp.convert(m, None, calibration=[data]).to_dict()["warnings"])


def test_probe_reduces_each_tensor_right_after_its_producer_and_never_returns_it_whole():
    """Memory of calibration does not grow with the intermediates: every float tensor,
    including one whose type only ONNX Runtime knows (a com.microsoft op shape inference
    cannot type), is reduced to one scalar by nodes placed right after its producer; the
    session runs in that order (PRIORITY_BASED), and no activation is a probe output."""
    from graphmp.passes.calibrate import _ort_types, _Probe, calibrate
    from graphmp.passes import prepare, types
    from graphmp.context import Ctx, Options
    w = _w(0, [8, 8], 0.5)
    m = _model([oh.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                oh.make_node("FusedMatMul", ["h", "w"], ["f"], name="fused", domain="com.microsoft", alpha=300.0),
                oh.make_node("Relu", ["f"], ["y"], name="relu")],
               [_vi("x", [2, 8])], [_vi("y", [2, 8])], [nph.from_array(w, "w")])
    m.opset_import.append(oh.make_opsetid("com.microsoft", 1))
    ctx = Ctx(model=m, options=Options(), path="m")
    prepare.run(ctx)
    types.run(ctx)
    assert ctx.types["main"].get("f") is None  # unknown to onnx shape inference
    proven = _ort_types(ctx.model, ctx.types, None)
    assert proven["f"] == F32
    probe = _Probe(ctx.model, dict(ctx.types, main={**ctx.types["main"], **proven}))
    g = probe.model.graph
    order = [n.output[0] for n in g.node]
    for tensor in ("x", "h", "f", "y"):  # flattened (a Reshape: an alias, no copy), then reduced
        first_use = next(i for i, n in enumerate(g.node) if tensor in n.input and n.op_type == "Reshape")
        producer = order.index(tensor) if tensor in order else -1
        assert first_use == producer + 1, (tensor, order)
        assert [n.op_type for n in g.node[first_use + 1:first_use + 3]] == ["ReduceMax", "ReduceMin"]
    # only per-tensor scalars come back (one vector of max x and one of min x for the four
    # tensors, as few outputs as chunks), and their dims (an INT64 vector, -1 after each)
    (hi, lo, dims, tensors), = probe.chunks
    assert sorted(tensors) == ["f", "h", "x", "y"] and probe.shape_of == {dims: tensors}
    outs = {o.name: o.type.tensor_type for o in g.output[1:]}
    assert set(outs) == {hi, lo, dims}
    assert [d.dim_value for d in outs[hi].shape.dim] == [d.dim_value for d in outs[lo].shape.dim] == [4]
    assert outs[dims].elem_type == onnx.TensorProto.INT64
    cal = calibrate(ctx.model, ctx.types, data=[{"x": np.ones((2, 8), np.float32)}])
    want = np.abs(run_ort(m, {"x": np.ones((2, 8), np.float32)})["y"]).max()
    assert cal.proven_types == {"f": F32} and cal.ranges[("main", "f")] >= want > 10


def test_generated_token_ids_cover_the_embedding_table():
    """Token ids that index an embedding (Gather on a constant table) are generated uniformly
    over its rows, not 0/1: a row holding large values (row 5 of 8: |x| = 1000) is reached by
    calibration and the MatMul reading its projection stays FP32 (with ids 0/1 it never was,
    the MatMul was FP16, and token 5 overflowed it)."""
    from graphmp.inputs import generate, input_specs, value_hints
    table = _w(1, [8, 8], 0.5)
    table[5] = 1000.0
    nodes = [oh.make_node("Cast", ["ids"], ["ids64"], to=TP.INT64),
             oh.make_node("Gather", ["table", "ids64"], ["emb"], name="embed"),
             oh.make_node("MatMul", ["emb", "w"], ["h"], name="proj"),
             oh.make_node("MatMul", ["h", "w2"], ["y"], name="out")]
    g = oh.make_graph(nodes, "emb", [_vi("ids", ["N", "T"], TP.INT32)], [_vi("y", ["N", "T", 8])],
                      [nph.from_array(table, "table"), nph.from_array(_w(2, [8, 8], 20.0), "w"),
                       nph.from_array(_w(3, [8, 8], 0.1), "w2")])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    assert value_hints(m) == {"ids": {"below": 8}}
    feeds = generate(input_specs(m), {"ids": (2, 64)}, 0, value_hints(m))
    assert feeds["ids"].dtype == np.int32 and sorted(np.unique(feeds["ids"])) == list(range(8))
    rep = graphmp.convert(m, None)
    reasons = {n["name"]: n["reason"] for n in rep.to_dict()["fp32_nodes"]}
    assert reasons.get("out", "").startswith("range:"), reasons  # |h| reaches ~1e4 on row 5
    ids = np.full((1, 4), 5, np.int32)
    assert np.isfinite(run_reference(rep.model, {"ids": ids})["y"]).all()


def test_shapes_beside_calibration_data_are_said_to_be_unused(tmp_path, capsys):
    """--shapes sizes generated inputs; with --calibration batches it was ignored without a word."""
    from graphmp.cli import main
    resnet = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "tiny", "resnet.onnx")
    np.savez(tmp_path / "pix.npz", pixel_values=np.random.default_rng(0).random((2, 3, 32, 32), np.float32))
    out = str(tmp_path / "r.onnx")
    assert main(["convert", resnet, "-o", out, "--calibration", str(tmp_path / "pix.npz"),
                 "--shapes", "pixel_values:4x3x32x32"]) == 0
    assert "warning: --shapes is not used: the --calibration batches give the input shapes" in capsys.readouterr().out
    assert main(["convert", resnet, "-o", out, "--shapes", "pixel_values:4x3x32x32"]) == 0
    assert "--shapes is not used" not in capsys.readouterr().out

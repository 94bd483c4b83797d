"""The machinery that makes conversion run at I/O speed gives the same results as the
slow, obvious way: weights read by reference into the .onnx file, models written
streaming, FP16 conversion and range facts computed by ONNX Runtime in blocks.
(Speed and memory themselves are measured in benchmarks/convert_speed.py.)"""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphmp
from graphmp import weight_rounding
from graphmp.errors import GraphmpError
from graphmp.model_io import iter_graphs, load_model, tensor_array
from graphmp.passes.apply import convert_noting
from graphmp.wire import BY_REFERENCE_MIN, is_self_reference, read_by_reference, write_streaming


def _model():
    """Large and small weights, an int64 table, a Constant node and an If whose branch
    holds its own weight: everything a by-reference reader must leave intact."""
    rng = np.random.default_rng(0)
    big = rng.standard_normal((64, 48)).astype(np.float32)
    small = rng.standard_normal((48,)).astype(np.float32)
    table = np.arange(2000, dtype=np.int64)
    w2 = rng.standard_normal((48, 32)).astype(np.float32)
    then_w = rng.standard_normal((32,)).astype(np.float32) * 3
    then_g = helper.make_graph([helper.make_node("Add", ["z", "tw"], ["o_t"])], "then", [],
                               [helper.make_tensor_value_info("o_t", TensorProto.FLOAT, [2, 32])],
                               [numpy_helper.from_array(then_w, "tw")])
    else_g = helper.make_graph([helper.make_node("Neg", ["z"], ["o_e"])], "else", [],
                               [helper.make_tensor_value_info("o_e", TensorProto.FLOAT, [2, 32])])
    nodes = [
        helper.make_node("MatMul", ["x", "big"], ["h"]),
        helper.make_node("Add", ["h", "small"], ["h2"]),
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.float32(0.5), "c")),
        helper.make_node("Mul", ["h2", "c"], ["h3"]),
        helper.make_node("MatMul", ["h3", "w2"], ["z"]),
        helper.make_node("ReduceSum", ["z"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "c"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Gather", ["table", "idx"], ["picked"]),
    ]
    g = helper.make_graph(nodes, "m",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64]),
                           helper.make_tensor_value_info("idx", TensorProto.INT64, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32]),
                           helper.make_tensor_value_info("picked", TensorProto.INT64, [3])],
                          [numpy_helper.from_array(a, n) for a, n in
                           ((big, "big"), (small, "small"), (table, "table"), (w2, "w2"))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.metadata_props.add(key="k", value="v")
    return m


def _tensors(model, base_dir):
    return {t.name: tensor_array(t, base_dir) for g in iter_graphs(model.graph) for t in g.initializer}


def test_read_by_reference_keeps_every_value_and_the_graph(tmp_path):
    src = _model()
    path = tmp_path / "m.onnx"
    onnx.save(src, path)
    m = read_by_reference(str(path))
    refs = [t.name for t in m.graph.initializer if is_self_reference(t, str(path))]
    assert sorted(refs) == ["big", "table", "w2"]  # >= BY_REFERENCE_MIN bytes; 'small' stays inline
    assert all(len(t.raw_data) < BY_REFERENCE_MIN for g in iter_graphs(m.graph) for t in g.initializer)
    want, got = _tensors(src, None), _tensors(m, str(tmp_path))
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    for a, b in zip(m.graph.node, src.graph.node):
        assert a == b  # nodes (with the If's branch weight and the Constant) untouched
    assert m.metadata_props == src.metadata_props and m.opset_import == src.opset_import
    # ONNX Runtime reads the references itself: same outputs as the inline model
    from graphmp.model_runs import ort_session
    feeds = {"x": np.ones((2, 64), np.float32), "idx": np.array([3, 1999, 0], np.int64)}
    a = ort_session(m, base_dir=str(tmp_path)).run(None, feeds)
    b = ort_session(src).run(None, feeds)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "cut.onnx"
    onnx.save(_model(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut through the weights
    with pytest.raises(GraphmpError, match="not a readable ONNX model"):
        load_model(str(path), by_reference=True)


def test_write_streaming_parses_to_the_same_model(tmp_path):
    src = _model()
    path = tmp_path / "out.onnx"

    def tensor_data(t):
        if t.name != "big":
            return t, 0, None
        meta = onnx.TensorProto()
        meta.CopyFrom(t)
        meta.ClearField("raw_data")
        raw = t.raw_data
        return meta, len(raw), lambda: iter([raw[:100], raw[100:]])  # data in two chunks

    with open(path, "wb") as f:
        write_streaming(src, f, tensor_data)
    back = onnx.load(str(path))
    assert back == src  # protobuf equality: every field of every message
    onnx.checker.check_model(back, full_check=True)


EDGES = np.array([0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, -7e4, 3e38, 2.0 ** -24, 2.0 ** -25, 2.9e-8,
                  6.0e-8, 1e-30, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -12, np.pi], np.float32)


def _facts_numpy(a):
    back = a.astype(np.float16).astype(np.float32)
    finite = np.isfinite(a)
    d = np.abs(back[finite] - a[finite])
    rel = d / np.maximum(np.abs(a[finite]), 1e-30)
    return {"changed": int(np.count_nonzero(back != a)), "max_abs_change": float(d.max()) if d.size else 0.0,
            "max_rel_change": float(rel.max()) if rel.size else 0.0,
            "flushed_to_zero": int(np.count_nonzero((back == 0) & (a != 0))),
            "overflowed": int(np.count_nonzero(np.isinf(back) & finite))}


@pytest.mark.parametrize("with_nonfinite", [False, True])
@pytest.mark.parametrize("top", [3, 6])  # 1e3: blocks on ONNX Runtime's fast path; 1e6: some overflow
def test_fp16_conversion_matches_numpy_bit_for_bit(monkeypatch, with_nonfinite, top):
    monkeypatch.setattr(weight_rounding, "BLOCK", 1000)  # many blocks, the last with the edge values
    rng = np.random.default_rng(1)
    a = np.concatenate([rng.standard_normal(3500).astype(np.float32) * 10.0 ** rng.integers(-9, top, 3500),
                        EDGES, np.array([np.nan, np.inf, -np.inf], np.float32) if with_nonfinite else EDGES])
    with np.errstate(over="ignore"):
        want = a.astype(np.float16)
    got, facts = weight_rounding.to_fp16_noting(a)
    assert got.view(np.uint16).tolist() == want.view(np.uint16).tolist()
    with np.errstate(over="ignore", invalid="ignore"):
        ref = _facts_numpy(a)
    assert facts == pytest.approx(ref)
    raw, noted = convert_noting(a.reshape(-1, 7) if a.size % 7 == 0 else a, TensorProto.FLOAT16)
    assert raw == want.tobytes() and noted["elements"] == a.size


def test_weight_range_facts_match_numpy(monkeypatch):
    monkeypatch.setattr(weight_rounding, "BLOCK", 512)
    rng = np.random.default_rng(2)
    a = np.concatenate([rng.standard_normal(2000).astype(np.float32) * 1e-7, EDGES,
                        np.array([np.inf, np.nan, -1e5], np.float32)])
    finite = np.abs(a[np.isfinite(a)])
    tiny = 2.0 ** -25
    for fp16 in (False, True):  # with or without the rounding facts, the range facts agree
        f = weight_rounding.weight_facts(a, tiny, fp16=fp16)
        assert (f["max_abs"], f["tiny"]) == (pytest.approx(float(finite.max())),
                                             int(np.count_nonzero((finite > 0) & (finite < tiny))))
        assert weight_rounding.weight_facts(a[:1000], tiny, fp16=fp16)["max_abs"] == pytest.approx(float(np.abs(a[:1000]).max()))


def test_conversion_by_reference_equals_conversion_in_memory(tmp_path):
    """The same model converted from a file (weights by reference, converted while
    streaming the output) and from a ModelProto (parsed, converted in place): the same
    bytes in every weight and the same rounding report."""
    src = _model()
    path = tmp_path / "m.onnx"
    onnx.save(src, path)
    out = tmp_path / "m.mp.onnx"
    rep_file = graphmp.convert(str(path), str(out), calibration="off").to_dict()
    rep_mem = graphmp.convert(src, None, calibration="off")
    from_file, in_memory = onnx.load(str(out)), rep_mem.model
    assert _tensors(from_file, None).keys() == _tensors(in_memory, None).keys()
    for k, v in _tensors(in_memory, None).items():
        assert _tensors(from_file, None)[k].tobytes() == v.tobytes(), k
    assert {t.name: t.data_type for t in from_file.graph.initializer}["big"] == TensorProto.FLOAT16
    by_name = lambda r: {e["initializer"]: e for e in r["rounding"]}  # noqa: E731
    assert by_name(rep_file) == by_name(rep_mem.to_dict())
    assert not any(e.get("deferred") for e in rep_file["rounding"])
    assert {"load", "write"} <= set(rep_file["timings"])
    onnx.checker.check_model(str(out), full_check=True)
    assert os.path.getsize(out) < os.path.getsize(path)


def test_budget_verified_on_weights_converted_while_writing(tmp_path):
    """With weights read by reference, their FP16 conversion waits for the write; the
    search's verification still measures the model as written (the emulation rounds
    those weights in the graph), and agrees with the search's own prediction."""
    path = tmp_path / "m.onnx"
    onnx.save(_model(), path)
    rep = graphmp.convert(str(path), str(tmp_path / "out.onnx"), max_error=0.05).to_dict()
    s = rep["search"]
    assert isinstance(s["verified"], dict), s["verified"]
    assert s["verified"]["normalized"] == pytest.approx(s["error"], rel=1e-6, abs=1e-12)


def test_cli_starts_without_onnx_numpy_or_onnxruntime():
    """`graphmp --help` and argument errors cost the interpreter, not onnx (0.3 s):
    the heavy modules are imported by the commands that use them."""
    import subprocess
    import sys
    code = ("import sys, graphmp, graphmp.cli; graphmp.cli._parser().parse_args(['convert', 'm.onnx', '-o', 'o.onnx']);"
            "print(sorted(m for m in ('onnx', 'numpy', 'onnxruntime', 'onnx.reference') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_session_opens_a_converted_model_with_the_options_it_records(tmp_path):
    """convert records prefer_nhwc for models with FP16 convolutions (what ORT CUDA runs
    fastest); graphmp.session applies it on CUDA, opens a CPU session otherwise, and
    device='cuda' without CUDA is a clear error, not a silent CPU session."""
    from graphmp.model_runs import cuda_available
    from graphmp.session import recorded_options
    conv = os.path.join(os.path.dirname(__file__), "..", "models", "real", "mnist_cntk.onnx")
    out = tmp_path / "mnist.mp.onnx"
    graphmp.convert(conv, str(out))
    assert recorded_options(out) == {"prefer_nhwc": "1"}
    mlp = tmp_path / "mlp.onnx"
    onnx.save(_model(), mlp)
    graphmp.convert(str(mlp), str(tmp_path / "mlp.mp.onnx"), calibration="off")
    assert recorded_options(tmp_path / "mlp.mp.onnx") == {}  # no convolution: nothing to prefer
    sess = graphmp.session(out)
    x = np.random.default_rng(0).standard_normal((1, 1, 28, 28)).astype(np.float32)
    ref = graphmp.session(conv, device="cpu").run(None, {"Input3": x})[0]
    assert np.abs(sess.run(None, {"Input3": x})[0] - ref).max() <= 1e-2 * np.abs(ref).max()
    assert sess.graphmp_device == ("CUDAExecutionProvider" if cuda_available() else "CPUExecutionProvider")
    if not cuda_available():
        with pytest.raises(GraphmpError, match="no CUDAExecutionProvider"):
            graphmp.session(out, device="cuda")


def test_by_reference_ignores_an_explicit_default_data_location(tmp_path):
    """Exporters may write data_location = DEFAULT explicitly (proto2): still inline data,
    so still read by reference; EXTERNAL tensors keep their own file."""
    m = _model()
    for t in m.graph.initializer:
        t.data_location = TensorProto.DEFAULT
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    got = read_by_reference(str(path))
    assert sorted(t.name for t in got.graph.initializer if is_self_reference(t, str(path))) == ["big", "table", "w2"]
    np.testing.assert_array_equal(_tensors(got, str(tmp_path))["big"], _tensors(m, None)["big"])

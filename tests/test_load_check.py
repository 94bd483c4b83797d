"""Never write a model the runtime cannot load (issue 34): convert and pad open and run their
output in ONNX Runtime in a child process before it replaces -o; the pattern that crashes
ONNX Runtime (passes/ort_crash.py) is kept FP32; graphmp.session() and bench isolate the
runtime the same way, so a crash is an error line or a failed row, never the caller's end."""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphmp
from graphmp.cli import main
from graphmp.load_check import probe
from graphmp.passes import ort_crash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, capsys):
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _opens_with_defaults(path) -> int:
    """The exit code of a fresh Python that opens `path` with ONNX Runtime's default options
    and runs nothing else (negative: killed by that signal)."""
    code = f"import onnxruntime as o; o.InferenceSession({os.fspath(path)!r}, providers=['CPUExecutionProvider'])"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode


def _transpose_matmul(path, elem=TensorProto.FLOAT, perm=(1, 0, 2)):
    """x[b, s, 16] -> Transpose(perm) -> MatMul(constant 16x8): in FP16, the pattern that crashes
    ONNX Runtime 1.32's CPU session (for a batch-moving perm)."""
    dt = np.float16 if elem == TensorProto.FLOAT16 else np.float32
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 8)).astype(dt), "w")
    g = helper.make_graph([helper.make_node("Transpose", ["x"], ["t"], name="tr", perm=list(perm)),
                           helper.make_node("MatMul", ["t", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", elem, ["b", "s", 16])],
                          [helper.make_tensor_value_info("y", elem, ["d0", "d1", "d2"])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, os.fspath(path))
    return os.fspath(path)


def _crashing_fp16(tmp_path):
    """An FP16 model ONNX Runtime's CPU session dies on at default options, or a skip where this
    ONNX Runtime opens it (onnxruntime issue 28392 fixed)."""
    p = _transpose_matmul(tmp_path / "crash16.onnx", TensorProto.FLOAT16)
    if _opens_with_defaults(p) >= 0:
        pytest.skip("this ONNX Runtime opens an FP16 Transpose(perm [1, 0, 2]) -> MatMul (issue 28392 fixed)")
    return p


# --------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("perm, moves", [([1, 0, 2], True), ([1, 2, 0], True), ([1, 2, 0, 3], True),
                                         ([1, 2, 3, 0], True), ([0, 2, 1], False), ([2, 0, 1], False),
                                         ([1, 0, 2, 3], False), ([1, 0], False)])
def test_batch_moving_permutations_are_the_ones_fusedmatmul_absorbs(perm, moves):
    assert ort_crash.batch_moving(perm) is moves


def test_the_batch_moving_transpose_stays_fp32_and_the_output_loads(tmp_path, capsys):
    """Only the Transpose whose perm moves the batch axis is kept FP32 (with the reason); the
    MatMuls stay FP16; the written model opens with default options and passes check."""
    src = _transpose_matmul(tmp_path / "a.onnx")
    other = _transpose_matmul(tmp_path / "b.onnx", perm=(0, 2, 1))
    for path, kept in ((src, True), (other, False)):
        out = str(tmp_path / (os.path.basename(path) + ".mp.onnx"))
        rc, stdout, err = _run(["convert", path, "-o", out, "--shapes", "x:2x16x16"], capsys)
        assert rc == 0, err
        rep = graphmp.convert(path, None, shapes="x:2x16x16")
        assert ("tr" in rep.fp32_nodes) is kept
        assert "mm" not in rep.fp32_nodes
        if kept:
            assert rep.fp32_nodes["tr"] == ort_crash.TRANSPOSE_INTO_MATMUL
            assert "onnxruntime issue 28392" in stdout
        assert "load check: " in stdout and "loaded and ran once" in stdout
        assert _opens_with_defaults(out) == 0
        rc, _, err = _run(["check", path, out, "--shapes", "x:2x16x16", "-q"], capsys)
        assert rc == 0, err


def test_transformer_encoder_from_torch_converts_to_a_model_that_loads(tmp_path, capsys):
    """The issue's case: a batch_first nn.TransformerEncoder with a padding mask, exported with
    dynamo=False. Its FP16 in_proj Transpose segfaulted ONNX Runtime at session creation;
    now the output opens with default options and matches FP32 within check's yardstick."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 32)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2)
            self.head = nn.Linear(32, 5)

        def forward(self, ids, mask):
            return self.head(self.enc(self.emb(ids), src_key_padding_mask=(mask == 0))[:, 0])

    torch.manual_seed(0)
    ids, mask = torch.randint(0, 50, (2, 12)), torch.ones(2, 12, dtype=torch.int64)
    mask[1, 8:] = 0
    src, out = str(tmp_path / "enc.onnx"), str(tmp_path / "enc.mp.onnx")
    torch.onnx.export(Enc().eval(), (ids, mask), src, input_names=["input_ids", "attention_mask"],
                      output_names=["logits"], dynamic_axes={"input_ids": {0: "b", 1: "s"},
                                                             "attention_mask": {0: "b", 1: "s"}}, dynamo=False)
    rc, stdout, err = _run(["convert", src, "-o", out, "--validate", "--report", str(tmp_path / "r.json"),
                            "--shapes", "input_ids:2x12,attention_mask:2x12"], capsys)
    assert rc == 0, err
    rep = json.load(open(tmp_path / "r.json"))
    assert rep["load_check"]["passed"] and rep["load_check"]["ran"]
    assert rep["validation"]["passed"]
    kept = [e["name"] for e in rep["fp32_nodes"] if e["reason"] == ort_crash.TRANSPOSE_INTO_MATMUL]
    assert len(kept) == 2 and all(k.endswith("self_attn/Transpose") for k in kept)  # one per layer
    assert rep["nodes"]["low"] > 0
    assert _opens_with_defaults(out) == 0


# --------------------------------------------------------------------------- the safety net
def test_a_model_that_crashes_onnx_runtime_is_exit_1_and_nothing_is_written(tmp_path, capsys):
    """--fp16-nodes forces the Transpose FP16 (rule 1 wins over the crash rule): the load check
    sees ONNX Runtime die, says so and what to do; -o keeps what it held; the report is written."""
    _crashing_fp16(tmp_path)  # skips where this ONNX Runtime is fixed
    src = _transpose_matmul(tmp_path / "a.onnx")
    out, rep = tmp_path / "a.mp.onnx", tmp_path / "r.json"
    out.write_bytes(b"the user's previous file")
    rc, stdout, err = _run(["convert", src, "-o", str(out), "--fp16-nodes", "^tr$", "--shapes", "x:2x16x16",
                            "--report", str(rep)], capsys)
    assert rc == 1
    assert "load check FAILED" in err and "SIGSEGV" in err and "while creating the session" in err
    assert "ORT_ENABLE_EXTENDED it loads" in err and "--fp32-nodes" in err and "--max-error" not in err
    assert f"Nothing was written to {out}" in err and "Traceback" not in err
    assert out.read_bytes() == b"the user's previous file"
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".graphmp-")]
    data = json.load(open(rep))
    assert data["written"] is False and data["load_check"]["crashed"] == "SIGSEGV"
    assert "NOT written" in stdout
    rc, _, _ = _run(["convert", src, "-o", str(out), "--fp16-nodes", "^tr$", "--shapes", "x:2x16x16",
                     "--no-load-check", "-q"], capsys)
    assert rc == 0 and _opens_with_defaults(out) < 0  # the opt-out writes it


def test_pad_refuses_to_write_a_model_onnx_runtime_cannot_open(tmp_path, capsys):
    src = _crashing_fp16(tmp_path)
    out = tmp_path / "p.onnx"
    rc, _, err = _run(["pad", src, "-o", str(out), "-q"], capsys)
    assert rc == 1 and "load check FAILED" in err and "SIGSEGV" in err
    assert not out.exists()


def test_a_load_error_is_named_with_its_stage(tmp_path):
    """A model ONNX Runtime rejects (an op it has no kernel for) fails the probe with its
    error at the stage it happened; a model that loads runs once on generated inputs."""
    g = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"], domain="org.example")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    bad = str(tmp_path / "bad.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("org.example", 1)]),
              bad)
    res = probe(bad)
    assert not res["passed"] and res["stage"] == "load" and res["crashed"] is None
    assert "NoSuchOp" in res["error"] and "while creating the session" in res["error"]
    good = probe(_transpose_matmul(tmp_path / "ok.onnx"), shapes="x:2x3x16")
    assert good["passed"] and good["ran"] and good["inputs"] == "x:2x3x16"


def test_a_check_that_does_not_finish_in_time_fails(tmp_path):
    res = probe(_transpose_matmul(tmp_path / "ok.onnx"), timeout=0.01)
    assert not res["passed"] and "did not finish within" in res["error"]


# --------------------------------------------------------------------------- session() and bench
def test_session_raises_instead_of_crashing_the_caller(tmp_path):
    src = _crashing_fp16(tmp_path)
    with pytest.raises(graphmp.GraphmpError, match="SIGSEGV.*ORT_ENABLE_EXTENDED"):
        graphmp.session(src)
    import onnxruntime as ort
    sess = graphmp.session(src, graph_optimization_level=ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    assert sess.graphmp_device == "CPUExecutionProvider"


def test_bench_keeps_the_other_rows_the_table_and_the_json_when_a_row_crashes(tmp_path, capsys):
    crash = _crashing_fp16(tmp_path)
    src = _transpose_matmul(tmp_path / "src.onnx")
    out = tmp_path / "b.json"
    rc, stdout, _ = _run(["bench", src, "--converted", crash, "--backends", "ort-cpu", "--batch", "1,2",
                          "--warmup", "1", "--iterations", "2", "--min-time", "0", "--rounds", "1",
                          "--json", str(out)], capsys)
    assert rc == 0
    rows = json.load(open(out))["rows"]
    assert sorted((r["precision"], r["batch"], r["status"]) for r in rows) == [
        ("fp16", 1, "failed"), ("fp16", 2, "failed"), ("fp32", 1, "ok"), ("fp32", 2, "ok")]
    assert all("SIGSEGV" in r["error"] for r in rows if r["status"] == "failed")
    assert all(r["latency_ms"] for r in rows if r["status"] == "ok")
    assert "| ort-cpu | fp16" in stdout and "FAILED" in stdout


def test_int8_tts_like_model_loads_after_convert(tmp_path, capsys):
    """A stand-in for the INT8 text-to-speech model of the issue: a dynamic-quantized LSTM
    (onnxruntime.quantization) after a float attention encoder, durations rounded."""
    torch = pytest.importorskip("torch")
    from onnxruntime.quantization import QuantType, quantize_dynamic
    nn = torch.nn

    class Tts(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 16)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1)
            self.lstm = nn.LSTM(16, 16, batch_first=True)
            self.dur = nn.Linear(16, 1)

        def forward(self, ids):
            h, _ = self.lstm(self.enc(self.emb(ids)))
            return torch.round(torch.relu(self.dur(h)) * 4).squeeze(-1), h

    torch.manual_seed(0)
    f32, f8, out = (str(tmp_path / n) for n in ("tts.onnx", "tts8.onnx", "tts8.mp.onnx"))
    torch.onnx.export(Tts().eval(), (torch.randint(0, 40, (1, 10)),), f32, input_names=["ids"],
                      output_names=["dur", "h"], dynamic_axes={"ids": {1: "s"}}, dynamo=False)
    quantize_dynamic(f32, f8, weight_type=QuantType.QInt8, op_types_to_quantize=["LSTM"])
    assert any(n.op_type == "DynamicQuantizeLSTM" for n in onnx.load(f8).graph.node)
    rc, stdout, err = _run(["convert", f8, "-o", out, "--shapes", "ids:1x10"], capsys)
    assert rc == 0, err
    assert "loaded and ran once" in stdout
    assert _opens_with_defaults(out) == 0


def test_bf16_output_is_written_with_a_note_where_the_cpu_has_no_bf16_kernels(tmp_path, capsys):
    """ONNX Runtime's CPU provider has no BF16 MatMul: a BF16 model is for ORT CUDA and TensorRT,
    so the check says it could not judge it (and a crash would still fail it)."""
    src = _transpose_matmul(tmp_path / "a.onnx", perm=(0, 2, 1))
    out = tmp_path / "a.bf16.onnx"
    rc, stdout, err = _run(["convert", src, "-o", str(out), "--target", "bf16", "--shapes", "x:2x16x16"], capsys)
    assert rc == 0, err
    assert out.exists()
    if "load check: " in stdout and "not judged" in stdout:
        assert "no BF16 kernel" in stdout
    else:  # an ONNX Runtime with BF16 MatMul on the CPU runs it like any model
        assert "loaded and ran once" in stdout

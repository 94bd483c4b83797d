"""The command line: bad input gets a clear one-line error, a non-zero exit, the input
untouched and no partial output; good input gets a report and a valid model."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphmp.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST = os.path.join(ROOT, "models", "real", "mnist_cntk.onnx")


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _run(args, capsys):
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def src(tmp_path):
    p = tmp_path / "in" / "mnist.onnx"
    p.parent.mkdir()
    shutil.copy(MNIST, p)
    return str(p)


def _leftovers(d):
    return [f for f in os.listdir(d) if f.startswith(".graphmp-") or f.endswith(".tmp")]


def test_convert_writes_valid_model_and_json_report(src, tmp_path, capsys):
    out, rep = str(tmp_path / "out.onnx"), str(tmp_path / "r.json")
    before = _sha(src)
    rc, stdout, _ = _run(["convert", src, "-o", out, "--report", rep, "--validate", "-q"], capsys)
    assert rc == 0
    assert _sha(src) == before
    onnx.checker.check_model(out, full_check=True)
    data = json.load(open(rep))
    assert data["nodes"]["low"] > 0 and data["validation"]["passed"]
    assert data["weight_bytes_after"] < data["weight_bytes_before"]
    conv = onnx.load(out)
    assert any(t.data_type == TensorProto.FLOAT16 for t in conv.graph.initializer)
    assert conv.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT  # keep-io default


@pytest.mark.parametrize("content, needle", [
    (b"hello, not a model", "not a readable ONNX model"),
    ("TRUNCATE", "not a readable ONNX model"),
])
def test_bad_files_give_one_line_error(tmp_path, capsys, content, needle):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(open(MNIST, "rb").read()[:5000] if content == "TRUNCATE" else content)
    out = tmp_path / "out.onnx"
    rc, _, err = _run(["convert", str(bad), "-o", str(out), "-q"], capsys)
    assert rc == 2
    assert needle in err and str(bad) in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists() and not _leftovers(tmp_path)


def test_missing_file_and_same_output(src, tmp_path, capsys):
    rc, _, err = _run(["convert", str(tmp_path / "nope.onnx"), "-o", str(tmp_path / "o.onnx")], capsys)
    assert rc == 2 and "no such file" in err
    before = _sha(src)
    rc, _, err = _run(["convert", src, "-o", src, "-q"], capsys)
    assert rc == 2 and "never overwrites its input" in err
    assert _sha(src) == before


def test_unwritable_output_folder(src, tmp_path, capsys):
    target = tmp_path / "not_a_dir"
    target.write_text("x")
    rc, _, err = _run(["convert", src, "-o", str(target / "out.onnx"), "-q"], capsys)
    assert rc == 2 and "does not exist" in err


def test_missing_external_data_names_tensor_and_file(tmp_path, capsys):
    w = np.ones((64, 64), np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                          [onnx.numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    p = tmp_path / "ext.onnx"
    onnx.save_model(m, str(p), save_as_external_data=True, location="ext.bin", size_threshold=0)
    os.remove(tmp_path / "ext.bin")
    rc, _, err = _run(["convert", str(p), "-o", str(tmp_path / "o.onnx"), "-q"], capsys)
    assert rc == 2 and "'W'" in err and "ext.bin" in err and "missing" in err
    assert not (tmp_path / "o.onnx").exists()


def test_model_without_float_tensors(tmp_path, capsys):
    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"])], "g",
                          [helper.make_tensor_value_info("a", TensorProto.INT64, [3]),
                           helper.make_tensor_value_info("b", TensorProto.INT64, [3])],
                          [helper.make_tensor_value_info("c", TensorProto.INT64, [3])])
    p = tmp_path / "int.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(p))
    rc, out, _ = _run(["convert", str(p), "-o", str(tmp_path / "o.onnx")], capsys)
    assert rc == 0 and "warning: the model has no FP32 tensors, so there is nothing to convert" in out
    assert [n.op_type for n in onnx.load(tmp_path / "o.onnx").graph.node] == ["Add"]  # computes as the source


def test_bad_regex_is_a_clear_error(src, tmp_path, capsys):
    rc, _, err = _run(["convert", src, "-o", str(tmp_path / "o.onnx"), "--fp32-nodes", "(", "-q"], capsys)
    assert rc == 2 and "--fp32-nodes" in err


def test_check_exits_nonzero_on_a_broken_model(src, tmp_path, capsys):
    out = str(tmp_path / "o.onnx")
    assert _run(["convert", src, "-o", out, "-q"], capsys)[0] == 0
    assert _run(["check", src, out], capsys)[0] == 0
    broken = onnx.load(out)
    for t in broken.graph.initializer:
        if t.data_type == TensorProto.FLOAT16 and len(t.dims) == 4:
            arr = onnx.numpy_helper.to_array(t) * np.float16(3)
            t.CopyFrom(onnx.numpy_helper.from_array(arr, t.name))
            break
    bad = str(tmp_path / "broken.onnx")
    onnx.save(broken, bad)
    rc, stdout, _ = _run(["check", src, bad, "--json", str(tmp_path / "c.json")], capsys)
    assert rc == 1 and "FAIL" in stdout
    assert json.load(open(tmp_path / "c.json"))["passed"] is False


def test_console_script_help_teaches():
    r = subprocess.run([sys.executable, "-m", "graphmp.cli", "convert", "--help"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0
    for word in ("--calibration", "--fp32-nodes", "--keep-io-types", "examples:", "Softmax"):
        assert word in r.stdout


def test_output_has_normal_file_mode(src, tmp_path, capsys):
    out = tmp_path / "o.onnx"
    assert _run(["convert", src, "-o", str(out), "-q", "--external-data"], capsys)[0] == 0
    umask = os.umask(0)
    os.umask(umask)
    for f in (out, tmp_path / "o.onnx.data"):
        assert (os.stat(f).st_mode & 0o777) == (0o666 & ~umask), f


def test_every_command_takes_q(tmp_path, capsys):
    """-q is one shared flag: check, train-graph and export take it too (they refused it)."""
    out = str(tmp_path / "m.onnx")
    assert main(["convert", MNIST, "-o", out, "-q"]) == 0
    assert main(["check", MNIST, out, "-q"]) == 0
    assert capsys.readouterr().out == ""
    assert main(["check", MNIST, out, "-q", "--max-error", "1e-9"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"{out} vs {MNIST}") and "FAIL" in captured.err
    run = str(tmp_path / "run")
    assert main(["train-graph", MNIST, "-o", run, "--loss", "cross-entropy", "-q"]) == 0
    assert main(["export", run, "-o", str(tmp_path / "e.onnx"), "-q"]) == 0
    assert capsys.readouterr().out == ""


def _mnist_run(tmp_path, *build):
    """mnist_cntk (batch axis fixed at 1) as a run, 6 training and 4 eval samples."""
    rng = np.random.default_rng(0)
    run, data, ev = str(tmp_path / "run"), str(tmp_path / "d.npz"), str(tmp_path / "e.npz")
    np.savez(data, Input3=rng.standard_normal((6, 1, 28, 28)).astype(np.float32), labels=rng.integers(0, 10, 6))
    np.savez(ev, Input3=rng.standard_normal((4, 1, 28, 28)).astype(np.float32), labels=rng.integers(0, 10, 4))
    assert main(["train-graph", MNIST, "-o", run, "-q", *build]) == 0
    return run, data, ev


def test_eval_on_a_model_with_a_fixed_batch_runs_in_its_batch(tmp_path, capsys):
    """--eval on a model whose batch is fixed at 1 evaluates one sample at a time (it failed
    after the first epoch, blaming --calibration, which the user never passed)."""
    run, data, ev = _mnist_run(tmp_path)
    assert main(["train", run, "--data", data, "--eval", ev, "--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "eval: loss" in out and "on 4 samples" in out, out


def test_train_exits_1_when_no_step_was_applied(tmp_path, capsys):
    """A call whose every step is skipped trained nothing: exit 1 and a line that says so,
    also when there were too few steps for the summary's note (it exited 0)."""
    run, data, _ = _mnist_run(tmp_path, "--loss-scale", "1e30")  # every FP16 gradient overflows
    assert main(["train", run, "--data", data, "--batch-size", "1", "--max-steps", "2", "-q"]) == 1
    assert "none of this call's 2 steps was applied" in capsys.readouterr().err

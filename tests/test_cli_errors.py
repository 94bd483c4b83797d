"""Every command meets malformed input with a clear error and exit 2: no traceback, the
input untouched, nothing written. And an interrupted or killed run leaves no temporary
files behind (SIGTERM cleans up like Ctrl-C; the next run removes a killed run's)."""
import hashlib
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from graphmp.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SILERO = os.path.join(ROOT, "models", "real", "silero_vad.onnx")


@pytest.fixture
def work(tmp_path):
    """A copy of Silero VAD (inputs input/state/sr) and data files, good and bad."""
    src = tmp_path / "vad.onnx"
    shutil.copy(SILERO, src)
    good = {"input": np.zeros((1, 512), np.float32), "state": np.zeros((2, 1, 128), np.float32),
            "sr": np.array(16000, np.int64)}
    np.savez(tmp_path / "good.npz", **good)
    np.savez(tmp_path / "wrong_dtype.npz", **dict(good, input=good["input"].astype(np.float64)))
    np.savez(tmp_path / "wrong_name.npz", **{"inputs" if k == "input" else k: v for k, v in good.items()})
    np.savez(tmp_path / "wrong_rank.npz", **dict(good, state=np.zeros((1, 128), np.float32)))
    np.save(tmp_path / "one.npy", good["input"])
    (tmp_path / "garbage.npz").write_bytes(b"not a zip file")
    (tmp_path / "corrupt.npz").write_bytes(b"PK\x03\x04 a zip header and then nothing")
    np.savez(tmp_path / "nan.npz", **dict(good, input=np.full((1, 512), np.nan, np.float32)))
    (tmp_path / "afile").write_text("x")
    return tmp_path


def _sha(p):
    return hashlib.sha256(open(p, "rb").read()).hexdigest()


# (argv template, what the error must say). {d} is the work folder, {m} the model.
BAD = [
    # convert
    ("convert {m} -o {d}/o.onnx --range-threshold -1", "--range-threshold must be a positive number"),
    ("convert {m} -o {d}/o.onnx --pad-channels 0", "--pad-channels must be one of"),
    ("convert {m} -o {d}/o.onnx --pad-channels 7", "--pad-channels must be one of"),
    ("convert {m} -o {d}/o.onnx --fp32-ops Softmx", "--fp32-ops 'Softmx' is not an op"),
    ("convert {m} -o {d}/o.onnx --fp32-nodes (", "--fp32-nodes '(' is not a valid regular expression"),
    ("convert {m} -o {d}/o.onnx --calibration {d}/one.npy", "is an .npy file"),
    ("convert {m} -o {d}/o.onnx --calibration {d}/garbage.npz", "not a readable .npz"),
    ("convert {m} -o {d}/o.onnx --calibration {d}/missing.npz", "no such file"),
    ("convert {m} -o {d}/o.onnx --calibration {d}/corrupt.npz", "not a readable .npz"),
    ("convert {m} -o {d}/o.onnx --calibration {d}/nan.npz", "holds 512 NaN"),
    ("convert {m} -o {d}/o.onnx --shapes input:1x0,state:2x1x128,sr:", "ONNX Runtime cannot run the model on"),
    ("convert {m} -o {d}/o.onnx --calibration {d}/wrong_dtype.npz", "array 'input' is float64"),
    ("convert {m} -o {d}/o.onnx --calibration {d}/wrong_name.npz", "no array for model input(s) input"),
    ("convert {m} -o {d}/o.onnx --calibration {d}/wrong_rank.npz", "array 'state' has shape 1x128"),
    ("convert {m} -o {d}/o.onnx --calibration {d}/good.npz --no-calibration", "contradict"),
    ("convert {m} -o {d}/o.onnx --shapes input=1x512", "is not NAME:DIMS"),
    ("convert {m} -o {d}/o.onnx --shapes nope:1x512", "not an input of the model"),
    ("convert {m} -o {d}/o.onnx --shapes input:1x2x3", "does not fit input 'input'"),
    ("convert {m} -o {d}/o.onnx --report {d}/afile/r.json", "does not exist"),
    ("convert {d}/missing.onnx -o {d}/o.onnx", "no such file"),
    ("convert {d}/good.npz -o {d}/o.onnx", "not a readable ONNX model"),
    # check
    ("check {m} {m} --data {d}/wrong_name.npz", "no array for model input(s) input"),
    ("check {m} {m} --data {d}/one.npy", "is an .npy file"),
    ("check {m} {m} --data {d}/wrong_dtype.npz", "array 'input' is float64"),
    ("check {m} {d}/missing.onnx", "no such file"),
    ("check {m} " + os.path.join(ROOT, "models", "real", "mnist_cntk.onnx"), "does not have the inputs and outputs"),
    ("check {m} {m} --max-error nope", "--max-error 'nope' is not a number"),
    ("check {m} {m} --shapes x:1", "not an input of the model"),
    ("check {m} {m} --json {d}/afile/c.json", "does not exist"),
    # pad
    ("pad {m} -o {d}/o.onnx --multiple 7", "--multiple must be one of"),
    ("pad {m} -o {d}/o.onnx --validate --shapes input:1", "does not fit input 'input'"),
    ("pad {m} -o {d}/o.onnx --report {d}/afile/r.json", "does not exist"),
    # bench
    ("bench {m} --backends ort-gpu", "unknown backend"),
    ("bench {m} --backends ort-cpu --data {d}/wrong_dtype.npz", "array 'input' is float64"),
    ("bench {m} --backends ort-cpu --shapes input:1x2x3", "does not fit input 'input'"),
    # build (TensorRT is not installed here: a clear error, never an ImportError traceback)
    ("build {d}/missing.onnx", "no such file"),
    ("build {m} --shapes input=1", "is not NAME:DIMS"),
    # training
    ("train-graph {d}/missing.onnx -o {d}/run", "no such file"),
    ("train {d}/no_run --data {d}/good.npz", ""),
    ("export {d}/no_run -o {d}/o.onnx", ""),
]


@pytest.mark.parametrize("argv, needle", BAD, ids=[b[0].split(" {")[0] + ":" + b[1][:30] for b in BAD])
def test_bad_input_is_one_clear_error(work, capsys, argv, needle):
    m = str(work / "vad.onnx")
    before = _sha(m)
    args = argv.format(d=work, m=m).split()
    try:
        rc = main(args)
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert lines and lines[-1].startswith(("graphmp: error:", "usage:", "graphmp ")), err
    assert needle in lines[-1], lines[-1]
    assert _sha(m) == before
    assert not (work / "o.onnx").exists()
    assert not [f for f in os.listdir(work) if f.startswith(".graphmp-")]


def test_every_command_rejects_unknown_flags_without_traceback():
    for cmd in ("convert", "check", "pad", "train-graph", "train", "export", "build", "bench"):
        r = subprocess.run([sys.executable, "-m", "graphmp.cli", cmd, "--no-such-flag"], capture_output=True,
                           text=True, cwd=ROOT)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "unrecognized arguments" in r.stderr \
            or "required" in r.stderr, (cmd, r.stderr)


def _many_weights_model(path):
    """A model with 300 small weights (enough tensors for a mid-write interruption)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    nodes, inits, x = [], [], "x"
    for i in range(150):
        inits += [numpy_helper.from_array(np.eye(32, dtype=np.float32), f"W{i}"),
                  numpy_helper.from_array(np.zeros(32, np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"W{i}"], [f"m{i}"]), helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"])]
        x = f"a{i}"
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 32])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 32])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_sigterm_mid_write_cleans_up(tmp_path):
    """SIGTERM arrives while the converted weights are being streamed out: exit 143,
    'terminated' on stderr, no output and no temporary file left."""
    src = tmp_path / "m.onnx"
    _many_weights_model(str(src))
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {ROOT!r})
        import importlib
        conv = importlib.import_module("graphmp.convert")
        original = conv.save_model
        def save_and_get_killed(*a, **k):
            k["progress"] = lambda i, n: os.kill(os.getpid(), signal.SIGTERM) if i >= 100 else None
            return original(*a, **k)
        conv.save_model = save_and_get_killed
        from graphmp.cli import main
        sys.exit(main(["convert", {str(src)!r}, "-o", {str(tmp_path / 'o.onnx')!r}, "--external-data",
                       "--no-calibration"]))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 143, r.stderr
    assert "terminated; nothing was written" in r.stderr and "Traceback" not in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


def test_stale_temp_files_of_a_killed_run_are_removed(tmp_path):
    """Files a SIGKILLed run left (dead pid) go; those of a live writer stay."""
    src = tmp_path / "m.onnx"
    _many_weights_model(str(src))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".graphmp-o.onnx-{dead.pid}-abc123.data.tmp"
    stale.write_bytes(b"\0" * 1000)
    live = tmp_path / f".graphmp-o.onnx-{os.getppid()}-def456.onnx.tmp"
    live.write_bytes(b"x")
    other = tmp_path / f".graphmp-other.onnx-{dead.pid}-x.tmp"
    other.write_bytes(b"x")
    assert main(["convert", str(src), "-o", str(tmp_path / "o.onnx"), "-q", "--no-calibration"]) == 0
    left = sorted(os.listdir(tmp_path))
    assert stale.name not in left and live.name in left and other.name in left


def test_a_sigterm_while_an_error_is_being_reported_exits_143_without_a_traceback(monkeypatch, tmp_path):
    """torchrun stops the surviving ranks with SIGTERM while they report the all-reduce
    failure; one arriving in the error path (simulated: while the error line is formatted)
    must end the command with 143, not a Terminated traceback."""
    import graphmp.cli as cli

    def terminated_now(text):
        raise cli.Terminated()
    monkeypatch.setattr(cli, "_one_line", terminated_now)
    assert cli.main(["convert", str(tmp_path / "missing.onnx")]) == 143

"""Untrusted models and users' files in bench / check / build, through the command line.

- `bench --keep DIR` never writes through a symlink planted in DIR (models and their
  external data), and refuses a kept file that is a device before any work;
- no output (--json, --plot, --keep files, -o, --timing-cache) may be an input file (the
  models, their external data files, --data): a one-line error before any work, the
  input's bytes unchanged;
- a --json that is a character device, or this process's stdout redirected to a file, is
  written in place (`--json /dev/stdout`), never renamed over; a --plot that is a FIFO or
  stdout is refused;
- a model ONNX Runtime refuses is a one-line error, never a traceback.
"""
import importlib
import os
import shutil
import stat

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphmp.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESNET = os.path.join(ROOT, "models", "tiny", "resnet.onnx")  # input pixel_values [batch, 3, 32, 32]
QUICK = ["--backends", "ort-cpu", "--precisions", "fp32,fp16", "--warmup", "0", "--iterations", "1",
         "--min-time", "0", "--rounds", "1", "--oracle-max-mb", "0", "-q"]
SENTINEL = b"precious bytes outside the work folder\n"


def _one_error(capsys, name: str) -> str:
    """The single `graphmp: error:` line of stderr (it must name `name`); no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("graphmp: error:")]
    assert len(lines) == 1 and name in lines[0], err
    return lines[0]


def _bytes(*paths) -> dict:
    return {p: open(p, "rb").read() for p in paths}


def _sentinel(tmp_path, name="sentinel.txt") -> str:
    p = str(tmp_path / name)
    with open(p, "wb") as f:
        f.write(SENTINEL)
    return p


def _external_copy(tmp_path) -> tuple[str, str]:
    """resnet saved as m.onnx + m.onnx.data (its weights external; small tensors such as axes stay
    inline, where ONNX Runtime's shape inference needs them) in tmp_path."""
    d = tmp_path / "ext"
    d.mkdir()
    onnx.save(onnx.load(RESNET), str(d / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.onnx.data", size_threshold=1024)
    return str(d / "m.onnx"), str(d / "m.onnx.data")


def _data(tmp_path) -> str:
    p = str(tmp_path / "in.npz")
    np.savez(p, pixel_values=np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32))
    return p


def _small(tmp_path, name, nodes, w, opsets=()) -> str:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
                          [numpy_helper.from_array(w, "w")])
    p = str(tmp_path / name)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), *opsets]), p)
    return p


def _custom_op_model(tmp_path) -> str:
    """Valid for onnx and graphmp's loader; ONNX Runtime does not implement com.example:Foo."""
    return _small(tmp_path, "custom.onnx", [helper.make_node("Conv", ["x", "w"], ["c"]),
                                            helper.make_node("Foo", ["c"], ["y"], domain="com.example")],
                  np.ones((4, 3, 3, 3), np.float32), [helper.make_opsetid("com.example", 1)])


def _bad_conv_model(tmp_path) -> str:
    """Loads everywhere; ONNX Runtime refuses to run it: the weight has 5 input channels, x has 3."""
    return _small(tmp_path, "badconv.onnx", [helper.make_node("Conv", ["x", "w"], ["c"]),
                                             helper.make_node("Relu", ["c"], ["y"])],
                  np.ones((4, 5, 3, 3), np.float32))


# --- bench --keep DIR: never through a planted symlink ---------------------------------------------

def test_keep_never_writes_models_through_planted_symlinks(tmp_path, capsys):
    keep = tmp_path / "keep"
    keep.mkdir()
    s1, s2 = _sentinel(tmp_path, "s1.txt"), _sentinel(tmp_path, "s2.txt")
    os.symlink(s1, keep / "resnet.fp32.onnx")  # the FP32 baseline's name in DIR
    os.symlink(s2, keep / "resnet.mp.onnx")    # the converted model's name
    rc = main(["bench", RESNET, *QUICK, "--keep", str(keep)])
    assert rc == 0, capsys.readouterr().err
    assert _bytes(s1, s2) == {s1: SENTINEL, s2: SENTINEL}
    for name in ("resnet.fp32.onnx", "resnet.mp.onnx"):
        p = keep / name
        assert not os.path.islink(p) and os.path.isfile(p)
        onnx.checker.check_model(str(p))


def test_keep_never_writes_external_data_through_a_planted_symlink(tmp_path, capsys, monkeypatch):
    # the FP32 baseline is written with external data when its weights pass 1.8 GB: pretend they do
    models = importlib.import_module("graphmp.bench.models")  # graphmp.bench is also a function's name
    monkeypatch.setattr(models, "model_weight_bytes", lambda m: 2 * 10**9)
    keep = tmp_path / "keep"
    keep.mkdir()
    s = _sentinel(tmp_path)
    os.symlink(s, keep / "resnet.fp32.onnx.data")  # the data file's name
    rc = main(["bench", RESNET, *QUICK, "--keep", str(keep)])
    assert rc == 0, capsys.readouterr().err
    assert _bytes(s) == {s: SENTINEL}
    assert os.path.islink(keep / "resnet.fp32.onnx.data")  # passed over, not replaced or followed
    kept = onnx.load(str(keep / "resnet.fp32.onnx"), load_external_data=False)
    locations = {e.value for t in kept.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations and "resnet.fp32.onnx.data" not in locations  # its own data file, under a free name
    onnx.load(str(keep / "resnet.fp32.onnx"))  # which holds its weights


def test_keep_file_that_is_a_device_is_refused_before_work(tmp_path, capsys):
    keep = tmp_path / "keep"
    keep.mkdir()
    os.symlink("/dev/null", keep / "resnet.fp32.onnx")
    rc = main(["bench", RESNET, *QUICK, "--keep", str(keep)])
    assert rc == 2
    _one_error(capsys, str(keep / "resnet.fp32.onnx"))
    assert sorted(os.listdir(keep)) == ["resnet.fp32.onnx"]  # nothing converted, nothing written
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_keep_file_that_is_an_input_is_refused_before_work(tmp_path, capsys):
    keep = tmp_path / "keep"
    keep.mkdir()
    conv = str(keep / "resnet.fp32.onnx")  # --converted sits where the FP32 baseline would be kept
    shutil.copy(RESNET, conv)
    before = _bytes(conv)
    rc = main(["bench", RESNET, "--converted", conv, *QUICK, "--keep", str(keep)])
    assert rc == 2
    assert "--converted" in _one_error(capsys, conv)
    assert _bytes(conv) == before and sorted(os.listdir(keep)) == ["resnet.fp32.onnx"]


# --- outputs that are inputs ---------------------------------------------------------------------

@pytest.mark.parametrize("clash", ["model", "data file", "--data", "timing cache"])
def test_bench_output_that_is_an_input_is_refused_before_work(tmp_path, capsys, clash):
    model, data_file = _external_copy(tmp_path)
    npz = _data(tmp_path)
    target = {"model": model, "data file": data_file, "--data": npz, "timing cache": model}[clash]
    before = _bytes(model, data_file, npz)
    opt = ["--timing-cache", target] if clash == "timing cache" else ["--json", target]
    rc = main(["bench", model, "--data", npz, *QUICK, *opt])
    assert rc == 2
    assert "same file" in _one_error(capsys, target)
    assert _bytes(model, data_file, npz) == before


def test_bench_json_through_a_symlink_to_the_model_is_refused(tmp_path, capsys):
    model = str(tmp_path / "m.onnx")
    shutil.copy(RESNET, model)
    link = str(tmp_path / "out.json")
    os.symlink(model, link)
    before = _bytes(model)
    rc = main(["bench", model, *QUICK, "--json", link])
    assert rc == 2
    assert "same file" in _one_error(capsys, link)
    assert _bytes(model) == before and os.path.islink(link)


@pytest.mark.parametrize("which", ["reference", "converted", "data"])
def test_check_json_that_is_an_input_is_refused_before_work(tmp_path, capsys, which):
    ref, conv = str(tmp_path / "ref.onnx"), str(tmp_path / "conv.onnx")
    shutil.copy(RESNET, ref)
    shutil.copy(RESNET, conv)
    npz = _data(tmp_path)
    target = {"reference": ref, "converted": conv, "data": npz}[which]
    before = _bytes(ref, conv, npz)
    rc = main(["check", ref, conv, "--data", npz, "--json", target])
    assert rc == 2
    assert "same file" in _one_error(capsys, target)
    assert _bytes(ref, conv, npz) == before


@pytest.mark.parametrize("clash", ["-o symlink to the model", "-o the data file", "--timing-cache the model"])
def test_build_output_that_is_an_input_is_refused_before_tensorrt(tmp_path, capsys, clash):
    model, data_file = _external_copy(tmp_path)
    link = str(tmp_path / "engine.plan")
    os.symlink(model, link)
    args = {"-o symlink to the model": (["-o", link], link),
            "-o the data file": (["-o", data_file], data_file),
            "--timing-cache the model": (["-o", str(tmp_path / "e.plan"), "--timing-cache", model], model)}
    opts, named = args[clash]
    before = _bytes(model, data_file)
    rc = main(["build", model, "--shapes", "pixel_values:1x3x32x32", *opts])
    assert rc == 2
    line = _one_error(capsys, named)
    assert "same file" in line and "TensorRT" not in line  # refused before TensorRT is looked for
    assert _bytes(model, data_file) == before


# --- devices and FIFOs ---------------------------------------------------------------------------

def test_json_into_a_character_device_is_written_in_place(tmp_path, capsys):
    # `--json /dev/stdout`: a character device the user named is written into, never replaced
    # (a symlink to /dev/null here, so that a wrong rename replaces the link, not /dev/null)
    link = str(tmp_path / "out.json")
    os.symlink("/dev/null", link)
    assert main(["bench", RESNET, *QUICK, "--json", link]) == 0
    assert main(["check", RESNET, RESNET, "--json", link]) == 0
    assert "graphmp: error" not in capsys.readouterr().err
    assert os.path.islink(link) and os.readlink(link) == "/dev/null"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_json_into_stdout_redirected_to_a_file_is_written_in_place(tmp_path, capfd):
    # `--json /dev/stdout > out.txt`: /dev/stdout resolves to a regular file, and a rename would
    # replace the /dev/stdout link itself. Here a link of our own to /proc/self/fd/1 (pytest's
    # capture file), so that a wrong rename replaces our link, not the system's /dev/stdout.
    link = str(tmp_path / "stdout")
    os.symlink("/proc/self/fd/1", link)
    assert main(["check", RESNET, RESNET, "--json", link]) == 0
    assert main(["bench", RESNET, *QUICK, "--json", link]) == 0
    out = capfd.readouterr().out
    assert '"converted":' in out and '"schema_version": 2' in out  # both JSONs went to stdout
    assert os.path.islink(link) and os.readlink(link) == "/proc/self/fd/1"


def test_plot_into_stdout_is_refused_before_work(tmp_path, capsys):
    link = str(tmp_path / "plot.png")
    os.symlink("/proc/self/fd/1", link)
    assert main(["bench", RESNET, *QUICK, "--plot", link]) == 2
    assert "own stream" in _one_error(capsys, link)
    assert os.path.islink(link)


def test_plot_into_a_fifo_is_refused_before_work(tmp_path, capsys):
    fifo = str(tmp_path / "plot.png")
    os.mkfifo(fifo)
    js = tmp_path / "b.json"
    rc = main(["bench", RESNET, *QUICK, "--plot", fifo, "--json", str(js)])
    assert rc == 2
    assert "FIFO" in _one_error(capsys, fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and not js.exists()


# --- models ONNX Runtime refuses -----------------------------------------------------------------

def test_bench_model_onnxruntime_cannot_load_is_one_line(tmp_path, capsys):
    model = _custom_op_model(tmp_path)
    rc = main(["bench", model, *QUICK])
    assert rc == 2
    assert "com.example:Foo" in _one_error(capsys, model)


def test_check_model_onnxruntime_cannot_run_is_one_line(tmp_path, capsys):
    bad = _bad_conv_model(tmp_path)
    assert main(["check", bad, bad]) == 2
    assert "ONNX Runtime cannot run" in _one_error(capsys, bad)

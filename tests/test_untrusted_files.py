"""Untrusted models and users' files (issue 21): external data is read only from regular
files inside the model's folder, outputs never replace an input, a device or a FIFO,
and the model + data pair is replaced so that a kill at any instant leaves a
consistent pair."""
import hashlib
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import graphmp
from graphmp.pad import pad as graphmp_pad
from graphmp.cli import main

SECRET = b"GRAPHMP-SECRET-MARKER-0123456789" * 4  # 128 bytes: a whole [8, 4] FP32 weight


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _external(name, location, shape, offset="0", length=None):
    t = TensorProto()
    t.name, t.data_type = name, TensorProto.FLOAT
    t.dims.extend(shape)
    t.data_location = TensorProto.EXTERNAL
    n = int(np.prod(shape)) * 4
    for k, v in (("location", location), ("offset", offset), ("length", str(n) if length is None else length)):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def _matmul_model(w):
    """x[1,8] @ W[8,4] -> y, with W given (inline or external)."""
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture
def layout(tmp_path):
    """tmp/secret.bin outside the model's folder tmp/m/."""
    (tmp_path / "secret.bin").write_bytes(SECRET)
    (tmp_path / "m").mkdir()
    return tmp_path


def _no_secret_written(root):
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if f != "secret.bin" and os.path.isfile(p) and not os.path.islink(p):
                assert SECRET[:32] not in open(p, "rb").read(), f"{p} holds bytes of the secret"


def _one_error(rc, err, *needles):
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("graphmp: error:"), err
    for n in needles:
        assert n in lines[0], lines[0]


ESCAPES = {
    "dotdot": lambda root: "../secret.bin",
    "absolute": lambda root: str(root / "secret.bin"),
    "symlink": lambda root: os.symlink(root / "secret.bin", root / "m" / "w.data") or "w.data",
    "dotdot-inside": lambda root: "sub/../../secret.bin",
}


def _escape_model(root, kind, where="initializer"):
    loc = ESCAPES[kind](root)
    w = _external("W", loc, [8, 4])
    if where == "initializer":
        m = _matmul_model(w)
    elif where == "constant":  # a Constant node's tensor attribute
        m = _matmul_model(helper.make_tensor("unused", TensorProto.FLOAT, [1], [0.0]))
        del m.graph.initializer[:]
        m.graph.node.insert(0, helper.make_node("Constant", [], ["W"], value=w, name="c"))
    else:  # an If branch's initializer
        m = _if_model(w)
    p = root / "m" / "model.onnx"
    onnx.save(m, p)
    return str(p)


def _if_model(w):
    then = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"], name="mm_then")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 4])], [w])
    other = helper.make_graph([helper.make_node("Identity", ["z"], ["e"], name="id_else")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 4])])
    g = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other, name="if")],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8]),
                                helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("kind", sorted(ESCAPES))
@pytest.mark.parametrize("command", ["convert", "convert-no-cal", "pad", "train-graph"])
def test_external_data_never_read_outside_the_folder(layout, capsys, kind, command):
    src = _escape_model(layout, kind)
    before = _sha(src)
    out = str(layout / "m" / ("run" if command == "train-graph" else "out.onnx"))
    args = {"convert": ["convert", src, "-o", out, "-q", "--report", str(layout / "r.json")],
            "convert-no-cal": ["convert", src, "-o", out, "-q", "--no-calibration"],
            "pad": ["pad", src, "-o", out, "-q"],
            "train-graph": ["train-graph", src, "-o", out, "--loss", "mse"]}[command]
    rc = main(args)
    _one_error(rc, capsys.readouterr().err, "tensor 'W'", "outside" if kind == "symlink" else "location")
    assert not os.path.exists(out) and not os.path.exists(layout / "r.json")
    assert _sha(src) == before
    _no_secret_written(layout)


@pytest.mark.parametrize("where", ["constant", "subgraph"])
def test_external_data_containment_covers_constants_and_subgraphs(layout, capsys, where):
    src = _escape_model(layout, "dotdot", where)
    rc = main(["convert", src, "-o", str(layout / "m" / "out.onnx"), "-q", "--no-calibration"])
    _one_error(rc, capsys.readouterr().err, "'../secret.bin'")
    _no_secret_written(layout)


def test_check_refuses_an_escaping_reference(layout, capsys):
    good = layout / "m" / "good.onnx"
    onnx.save(_matmul_model(helper.make_tensor("W", TensorProto.FLOAT, [8, 4], np.ones(32, np.float32))), good)
    bad = _escape_model(layout, "absolute")
    rc = main(["check", str(good), bad])
    _one_error(rc, capsys.readouterr().err, "absolute path")


def test_python_api_refuses_too(layout):
    src = _escape_model(layout, "symlink")
    with pytest.raises(graphmp.GraphmpError, match="outside the model's folder"):
        graphmp.convert(src, calibration="off")
    with pytest.raises(graphmp.GraphmpError, match="outside the model's folder"):
        graphmp_pad(src)


def _data_model(root, **entry):
    """A model whose W lives in m/w.data (valid bytes) with the given external entry fields."""
    (root / "m" / "w.data").write_bytes(np.arange(32, dtype=np.float32).tobytes())
    fields = dict(location="w.data", offset="0", length=None)
    fields.update(entry)
    p = root / "m" / "model.onnx"
    onnx.save(_matmul_model(_external("W", fields["location"], [8, 4], fields["offset"], fields["length"])), p)
    return str(p)


@pytest.mark.parametrize("entry,needle", [
    (dict(offset="-8"), "offset '-8' is not a non-negative integer"),
    (dict(offset="abc"), "offset 'abc'"),
    (dict(length="-1"), "length '-1'"),
    (dict(offset="64"), "truncated"),              # 128 bytes from 64 run past the 128-byte file
    (dict(length="64"), "disagrees with its dims"),
    (dict(offset="99999999999999999999"), "truncated"),
    (dict(location=""), "is empty"),
    (dict(location="."), "outside the model's folder"),
    (dict(location="missing.data"), "cannot be read"),
])
def test_bad_external_entries_are_one_line(layout, capsys, entry, needle):
    src = _data_model(layout, **entry)
    rc = main(["convert", src, "-o", str(layout / "m" / "out.onnx"), "-q", "--no-calibration"])
    _one_error(rc, capsys.readouterr().err, "tensor 'W'", needle)
    assert "check free disk space" not in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_data_location_that_is_no_regular_file(layout, capsys, kind):
    src = _data_model(layout, location="d")
    d = layout / "m" / "d"
    os.mkdir(d) if kind == "dir" else os.mkfifo(d)  # a FIFO must not hang the load
    rc = main(["convert", src, "-o", str(layout / "m" / "out.onnx"), "-q", "--no-calibration"])
    _one_error(rc, capsys.readouterr().err, "tensor 'W'")


def test_hard_linked_data_file_is_refused(layout, capsys):
    """A hard link can bring a file from outside the folder in; onnx refuses them too."""
    src = _data_model(layout)
    os.link(layout / "m" / "w.data", layout / "outside-link.data")
    rc = main(["convert", src, "-o", str(layout / "m" / "out.onnx"), "-q", "--no-calibration"])
    _one_error(rc, capsys.readouterr().err, "tensor 'W'", "2 hard links")


def test_symlink_inside_the_folder_is_fine(layout, capsys):
    src = _data_model(layout)
    os.rename(layout / "m" / "w.data", layout / "m" / "real.data")
    os.symlink("real.data", layout / "m" / "w.data")
    assert main(["convert", src, "-o", str(layout / "m" / "out.onnx"), "-q", "--no-calibration"]) == 0


def test_model_given_through_a_symlink_reads_its_own_weights(tmp_path, capsys):
    """A download cache links model files to blobs elsewhere: the model's own inline
    weights (read by reference from its file) are not an escape."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snap").mkdir()
    w = helper.make_tensor("W", TensorProto.FLOAT, [64, 32], np.ones(64 * 32, np.float32))  # > by-reference size
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "blobs" / "sha")
    os.symlink("../blobs/sha", tmp_path / "snap" / "model.onnx")
    out = tmp_path / "out.onnx"
    assert main(["convert", str(tmp_path / "snap" / "model.onnx"), "-o", str(out), "-q"]) == 0
    onnx.checker.check_model(str(out), full_check=True)


# --- outputs never destroy inputs ------------------------------------------------------

def _torch_style(tmp_path):
    """model_fp32.onnx whose weights are in model.onnx.data (a renamed torch export)."""
    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    m = _matmul_model(onnx.numpy_helper.from_array(w, "W"))
    src = tmp_path / "model_fp32.onnx"
    onnx.save(m, src, save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data",
              size_threshold=0)
    return str(src), str(tmp_path / "model.onnx.data")


def test_output_data_file_never_overwrites_the_input_data(tmp_path, capsys):
    src, data = _torch_style(tmp_path)
    before = _sha(data)
    out = str(tmp_path / "model.onnx")
    for _ in range(3):  # a first write and two replacements of the pair
        assert main(["convert", src, "-o", out, "-q", "--no-calibration", "--external-data"]) == 0
        assert _sha(data) == before
        onnx.checker.check_model(out, full_check=True)
        ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    names = sorted(os.listdir(tmp_path))
    assert names == ["model.onnx", "model.onnx.1.data", "model.onnx.data", "model_fp32.onnx"], names


@pytest.mark.parametrize("flag", ["--report", "-o"])
@pytest.mark.parametrize("victim", ["model", "data", "calibration"])
def test_outputs_never_name_an_input(tmp_path, capsys, flag, victim):
    src, data = _torch_style(tmp_path)
    cal = str(tmp_path / "cal.npz")
    np.savez(cal, x=np.ones((1, 8), np.float32))
    target = {"model": src, "data": data, "calibration": cal}[victim]
    before = _sha(target)
    out = target if flag == "-o" else str(tmp_path / "o.onnx")
    args = ["convert", src, "-o", out, "-q", "--calibration", cal] + (["--report", target] if flag == "--report" else [])
    _one_error(main(args), capsys.readouterr().err, "never overwrites its inputs")
    assert _sha(target) == before


def test_pad_and_check_outputs_never_name_an_input(tmp_path, capsys):
    src, data = _torch_style(tmp_path)
    before = _sha(data)
    _one_error(main(["pad", src, "-o", str(tmp_path / "p.onnx"), "--report", data]), capsys.readouterr().err,
               "never overwrites")
    _one_error(main(["pad", src, "-o", data]), capsys.readouterr().err, "never overwrites")
    assert _sha(data) == before


@pytest.mark.parametrize("kind", ["fifo", "dir", "symlink-to-fifo", "symlink-to-null", "symlink-to-stdout"])
def test_model_output_that_is_no_regular_file_is_refused(tmp_path, capsys, kind):
    """(Devices through a link of the test's own: were the check broken, the link, not the
    system's /dev/null, would be replaced.)"""
    src, _ = _torch_style(tmp_path)
    out = tmp_path / "out.onnx"
    if kind in ("symlink-to-null", "symlink-to-stdout"):
        os.symlink("/dev/null" if kind == "symlink-to-null" else "/proc/self/fd/1", out)
        _one_error(main(["convert", src, "-o", str(out), "-q", "--no-calibration"]), capsys.readouterr().err,
                   "character device" if kind == "symlink-to-null" else "own stream")
        assert os.path.islink(out)
        return
    if kind == "dir":
        out.mkdir()
    else:
        os.mkfifo(tmp_path / "fifo")
        if kind == "fifo":
            out = tmp_path / "fifo"
        else:
            os.symlink(tmp_path / "fifo", out)
    _one_error(main(["convert", src, "-o", str(out), "-q", "--no-calibration"]), capsys.readouterr().err,
               "directory" if kind == "dir" else "FIFO")
    assert os.path.islink(out) if kind == "symlink-to-fifo" else True
    import stat
    assert stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode) if kind != "dir" else out.is_dir()


def test_report_into_a_character_device_is_written_in_place(tmp_path, capsys):
    """--report /dev/null (or /dev/stdout) writes into the device; it is never replaced."""
    src, _ = _torch_style(tmp_path)
    link = tmp_path / "report.json"
    os.symlink("/dev/null", link)  # a user's link to a device
    assert main(["convert", src, "-o", str(tmp_path / "o.onnx"), "-q", "--no-calibration",
                 "--report", str(link)]) == 0
    import stat
    assert os.path.islink(link) and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_report_into_this_process_stdout_is_written_through_it(tmp_path, capfd):
    """--report /dev/stdout with stdout redirected to a file (here: pytest's capture file)
    resolves to a regular file; the report goes into it, and the link is never replaced."""
    src, _ = _torch_style(tmp_path)
    link = tmp_path / "stdout"
    os.symlink("/proc/self/fd/1", link)  # what /dev/stdout is
    assert main(["convert", src, "-o", str(tmp_path / "o.onnx"), "-q", "--no-calibration",
                 "--report", str(link)]) == 0
    assert '"graphmp_version"' in capfd.readouterr().out
    assert os.path.islink(link) and os.readlink(link) == "/proc/self/fd/1"


def test_report_into_a_fifo_is_written_in_place(tmp_path):
    src, _ = _torch_style(tmp_path)
    fifo = tmp_path / "r.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "graphmp.cli", "convert", src, "-o", str(tmp_path / "o.onnx"),
                             "-q", "--no-calibration", "--report", str(fifo)])
    with open(fifo, "rb") as f:  # the reader of the pipe gets the report
        body = f.read()
    assert proc.wait(timeout=120) == 0
    assert b'"graphmp_version"' in body


# --- the model + data pair is replaced atomically --------------------------------------

KILLER = r"""
import os, sys, tempfile
k, n = int(sys.argv[1]), [0]
def step(fn):
    def wrapped(*a, **kw):
        if n[0] == k:
            os._exit(137)  # SIGKILL-like: no cleanup runs
        n[0] += 1
        return fn(*a, **kw)
    return wrapped
for name in ("replace", "link", "unlink", "fsync", "rename"):
    setattr(os, name, step(getattr(os, name)))
tempfile.mkstemp = step(tempfile.mkstemp)
from graphmp.cli import main
rc = main(sys.argv[2:])
print("FILE-OPS", n[0])
sys.exit(rc)
"""


def _outputs(path, x):
    onnx.checker.check_model(path, full_check=True)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_a_kill_between_any_two_file_operations_leaves_a_consistent_pair(tmp_path):
    src, _ = _torch_style(tmp_path)
    out = str(tmp_path / "out.onnx")
    x = np.random.default_rng(1).standard_normal((1, 8)).astype(np.float32)
    # the old pair: all FP32 (--fp32-nodes .); the new one: FP16 weights
    assert main(["convert", src, "-o", out, "-q", "--no-calibration", "--external-data", "--fp32-nodes", "."]) == 0
    old = _outputs(out, x)
    fresh = str(tmp_path / "fresh" / "out.onnx")
    os.mkdir(os.path.dirname(fresh))
    assert main(["convert", src, "-o", fresh, "-q", "--no-calibration", "--external-data"]) == 0
    new = _outputs(fresh, x)
    assert not np.array_equal(old, new)
    args = ["convert", src, "-o", out, "-q", "--no-calibration", "--external-data"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    seen = set()
    for k in range(40):
        p = subprocess.run([sys.executable, "-c", KILLER, str(k), *args], env=env, capture_output=True, text=True)
        got = _outputs(out, x)
        same_old, same_new = np.array_equal(got, old), np.array_equal(got, new)
        assert same_old or same_new, (k, got, old, new)
        seen.add("old" if same_old else "new")
        if p.returncode == 0:
            assert "FILE-OPS" in p.stdout
            break
        assert p.returncode == 137, p.stderr
        # the next run starts from whichever pair is there: put the old one back
        assert main(["convert", src, "-o", out, "-q", "--no-calibration", "--external-data",
                     "--fp32-nodes", "."]) == 0
    else:
        pytest.fail("the conversion never finished")
    assert k >= 6, f"only {k} file operations were interrupted"
    assert seen == {"old", "new"}
    assert np.array_equal(_outputs(out, x), new)


def test_constant_in_external_data_is_read_from_the_models_folder_not_the_cwd(tmp_path, monkeypatch, capsys):
    """onnx's numpy_helper reads an external tensor relative to the working directory: a
    Constant whose value lives in external data must be read from the model's folder by
    every command (check's FP16 emulation loaded the model itself and read the cwd)."""
    w = np.arange(32, dtype=np.float32).reshape(8, 4) / 32  # exact in FP16
    ref = _matmul_model(onnx.numpy_helper.from_array(w, "W"))
    (tmp_path / "m").mkdir()
    onnx.save(ref, tmp_path / "ref.onnx")
    (tmp_path / "m" / "w.data").write_bytes(w.astype(np.float16).tobytes())
    w16 = _external("W16", "w.data", [8, 4], length=str(64))
    w16.data_type = TensorProto.FLOAT16  # an FP16 Constant, as a converted model holds
    conv = _matmul_model(helper.make_tensor("unused", TensorProto.FLOAT, [1], [0.0]))
    del conv.graph.initializer[:]
    conv.graph.node.insert(0, helper.make_node("Cast", ["W16"], ["W"], to=TensorProto.FLOAT, name="cast"))
    conv.graph.node.insert(0, helper.make_node("Constant", [], ["W16"], value=w16, name="c"))
    onnx.save(conv, tmp_path / "m" / "conv.onnx")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "w.data").write_bytes(np.full((8, 4), 3e4, np.float16).tobytes())  # what a cwd read would see
    monkeypatch.chdir(cwd)
    rc = main(["check", str(tmp_path / "ref.onnx"), str(tmp_path / "m" / "conv.onnx")])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out, out

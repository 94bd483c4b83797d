"""Untrusted input, round 2 (issue 36): a data file swapped after its check is never read,
only data files graphmp wrote are ever removed, one process per run folder, bounded reads
of .npz data files, and deeply nested run-folder JSON is one line."""
import os
import subprocess
import sys
import zipfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphmp
import graphmp.model_io
from graphmp.cli import main
from test_untrusted_files import _one_error  # one line, exit 2, no traceback

N = 64  # W is [N, N] FP32: 16 KiB, over wire.BY_REFERENCE_MIN, so it is read after the load, not inlined at it
MARK = b"GRAPHMP-SECRET-MARKER-0123456789"


def _external_model(folder, weights):
    """folder/model.onnx: x[1,N] @ W -> y, W in folder/w.data."""
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])],
                          [onnx.numpy_helper.from_array(weights, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = os.path.join(folder, "model.onnx")
    onnx.save(m, path, save_as_external_data=True, all_tensors_to_one_file=True, location="w.data",
              size_threshold=0)
    return path


def _files_holding(root, needle):
    found = []
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if f != "secret.bin" and os.path.isfile(p) and not os.path.islink(p) and needle in open(p, "rb").read():
                found.append(p)
    return found


@pytest.fixture(params=["unlinked", "renamed"])
def swapped_after_load(tmp_path, monkeypatch, request):
    """A model in tmp/m/ whose w.data is replaced by a symlink to tmp/secret.bin right after
    graphmp's load has checked it (the race made deterministic: the hook runs where a sync
    client or a second user could act, before any weight is read for work). The checked
    file is unlinked, or renamed to tmp/m/old.data (ONNX Runtime is then given it through
    /dev/fd; once unlinked, through its contents)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "secret.bin").write_bytes(MARK * (N * N * 4 // len(MARK)))
    w = np.random.default_rng(0).standard_normal((N, N)).astype(np.float32) * 0.1
    src = _external_model(str(tmp_path / "m"), w)
    data = str(tmp_path / "m" / "w.data")
    real_inline = graphmp.model_io._inline_small_external
    swapped = []

    def inline_then_swap(model, base):
        real_inline(model, base)
        if not swapped and os.path.realpath(base) == os.path.realpath(tmp_path / "m"):
            if request.param == "unlinked":
                os.unlink(data)  # the checked file is gone from the folder; its open descriptor is not
            else:
                os.rename(data, tmp_path / "m" / "old.data")
            os.symlink(tmp_path / "secret.bin", data)
            swapped.append(True)

    monkeypatch.setattr(graphmp.model_io, "_inline_small_external", inline_then_swap)
    return tmp_path, src, w, swapped


@pytest.mark.parametrize("command", ["convert", "convert-external", "convert-no-cal", "pad-external", "check",
                                     "train-graph"])
def test_a_data_file_swapped_after_the_check_is_never_read(swapped_after_load, capsys, command):
    root, src, w, swapped = swapped_after_load
    out = str(root / "out" / ("run" if command == "train-graph" else "o.onnx"))
    os.mkdir(root / "out")
    ref = str(root / "ref.onnx")
    if command == "check":  # the converted model first (no swap yet: its load is the one hooked)
        onnx.save(onnx.load(src), ref)
    args = {"convert": ["convert", src, "-o", out, "-q"],
            "convert-external": ["convert", src, "-o", out, "-q", "--external-data"],
            "convert-no-cal": ["convert", src, "-o", out, "-q", "--no-calibration", "--external-data"],
            "pad-external": ["pad", src, "-o", out, "-q", "--multiple", "8", "--external-data"],
            "check": ["check", src, ref, "--json", str(root / "out" / "r.json")],
            "train-graph": ["train-graph", src, "-o", out, "--loss", "mse"]}[command]
    rc = main(args)
    err = capsys.readouterr().err
    assert swapped, "the hook never ran: the test proves nothing"
    if command == "check" and rc == 2:  # check loads the model again for each run: that load sees the swap
        _one_error(rc, err, "outside the model's folder")
    else:
        assert rc == 0, err  # the weights checked at load are the ones used
    assert not _files_holding(root / "out", MARK[:16])
    if command == "pad-external":  # the output holds the checked weights, bit for bit
        got = onnx.numpy_helper.to_array(onnx.load(out).graph.initializer[0])
        np.testing.assert_array_equal(got, w)


def test_graphmp_session_reads_the_checked_data_file(swapped_after_load):
    """The Python API's graphmp.session(path) too: its ONNX Runtime session is given the
    descriptor checked at its load, not the path."""
    root, src, w, swapped = swapped_after_load
    sess = graphmp.session(src, device="cpu")
    assert swapped
    x = np.ones((1, N), np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ w, rtol=1e-5)

def test_a_data_file_replaced_by_another_file_is_refused_on_reopening(tmp_path, capsys):
    """A descriptor closed (more data files than graphmp keeps open) and reopened must name
    the very file checked at load: (st_dev, st_ino) compared."""
    import graphmp.paths as paths
    (tmp_path / "m").mkdir()
    src = _external_model(str(tmp_path / "m"), np.ones((N, N), np.float32))
    model = graphmp.model_io.load_model(src)
    t = model.graph.initializer[0]
    os.rename(tmp_path / "m" / "w.data", tmp_path / "old.data")
    (tmp_path / "m" / "w.data").write_bytes(MARK * (N * N * 4 // len(MARK)))
    key = (os.path.realpath(tmp_path / "m"), "w.data")
    os.close(paths._OPEN.pop(key).fd)  # as MAX_OPEN's eviction does
    with pytest.raises(graphmp.model_io.GraphmpError, match="replaced by another file after graphmp checked it"):
        graphmp.model_io.tensor_array(t, str(tmp_path / "m"))


def test_onnx_runtime_maps_the_checked_descriptor_without_a_copy(tmp_path, monkeypatch):
    """Where /dev/fd exists, a session reads the checked file through /dev/fd/N (ONNX Runtime
    maps it as any data file: no copy of the weights per session); the copy of the
    contents is only the fallback."""
    import graphmp.model_runs as model_runs
    if not os.path.isdir(model_runs.FD_DIR):
        pytest.skip("no /dev/fd here")
    (tmp_path / "m").mkdir()
    w = np.random.default_rng(1).standard_normal((N, N)).astype(np.float32)
    src = _external_model(str(tmp_path / "m"), w)
    model = graphmp.model_io.load_model(src)

    def no_copy(fds):
        raise AssertionError("the weights were copied")
    monkeypatch.setattr(model_runs, "map_descriptors", no_copy)
    x = np.ones((1, N), np.float32)
    got = model_runs.runner(model, base_dir=str(tmp_path / "m"))({"x": x})["y"]
    np.testing.assert_allclose(got, x @ w, rtol=1e-5)
    assert model.graph.initializer[0].external_data[0].value == "w.data"  # the model's own location, restored

def test_more_data_files_than_graphmp_keeps_open(tmp_path, capsys):
    """Each of 100 weights in its own data file (onnx's all_tensors_to_one_file=False), more
    than paths.MAX_OPEN: descriptors closed and reopened (identity checked) as the model is
    read, and every session gets each file's own checked descriptor."""
    import graphmp.paths as paths
    k = paths.MAX_OPEN + 36
    rng = np.random.default_rng(2)
    ws = [(rng.standard_normal((32, 32)) / 6).astype(np.float32) for _ in range(k)]
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"W{i}"], [f"h{i}" if i < k - 1 else "y"])
             for i in range(k)]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
                          [onnx.numpy_helper.from_array(w, f"W{i}") for i, w in enumerate(ws)])
    (tmp_path / "m").mkdir()
    src = str(tmp_path / "m" / "chain.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), src,
              save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0)
    assert len(os.listdir(tmp_path / "m")) == k + 1
    x = np.ones((1, 32), np.float32)
    want = x
    for w in ws:
        want = want @ w
    import graphmp.model_runs as model_runs
    got = model_runs.runner(src)({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    out = str(tmp_path / "o.onnx")
    assert main(["pad", src, "-o", out, "-q", "--multiple", "8", "--external-data"]) == 0, capsys.readouterr().err
    assert main(["check", src, out, "-q"]) == 0, capsys.readouterr().err

# --- only data files graphmp wrote are ever removed -------------------------------------

KILL_AT_COMMIT = r"""
import os, sys
real_replace = os.replace
def replace(a, b, **kw):
    if str(b).endswith(".onnx"):
        os._exit(137)  # killed between the data file getting its name and the model's rename
    return real_replace(a, b, **kw)
os.replace = replace
from graphmp.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["convert", "pad"])
def test_only_data_files_graphmp_wrote_are_removed(tmp_path, capsys, command):
    """A user's OUT.3.data (and OUT.data) next to the output survive any number of writes;
    the orphan of a run killed before its commit is removed by the next write."""
    (tmp_path / "m").mkdir()
    src = _external_model(str(tmp_path / "m"), np.ones((N, N), np.float32))
    out = str(tmp_path / "o.onnx")
    mine = {name: os.urandom(64) for name in ("o.onnx.3.data", "o.onnx.data", "o.onnx.12.data")}
    for name, body in mine.items():
        (tmp_path / name).write_bytes(body)
    args = [command, src, "-o", out, "-q", "--external-data"] + (["--no-calibration"] if command == "convert" else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-c", KILL_AT_COMMIT, *args], env=env, capture_output=True, text=True)
    assert p.returncode == 137, p.stderr
    orphans = set(os.listdir(tmp_path)) - set(mine) - {"m", "o.onnx"}
    orphans = {n for n in orphans if not n.startswith(".graphmp-")}
    assert orphans == {"o.onnx.1.data"}, orphans  # the killed run's data file, named but unreferenced
    for _ in range(3):
        assert main(args) == 0, capsys.readouterr().err
    names = sorted(n for n in os.listdir(tmp_path) if n != "m")
    assert [n for n in names if n.startswith(".graphmp-")] == []
    data = [n for n in names if n.endswith(".data") and n not in mine]
    assert len(data) == 1, names  # the live pair's own, and no orphan
    assert "o.onnx.1.data" in data or "o.onnx.1.data" not in names
    for name, body in mine.items():
        assert (tmp_path / name).read_bytes() == body, f"{name} was changed or removed"
    onnx.checker.check_model(out, full_check=True)


def test_a_model_graphmp_did_not_write_keeps_its_data_file(tmp_path, capsys):
    """OUT was the user's own model (no graphmp record of its data file): replacing OUT,
    which the user asked for, leaves the data file it referenced."""
    (tmp_path / "m").mkdir()
    src = _external_model(str(tmp_path / "m"), np.ones((N, N), np.float32))
    own = _external_model(str(tmp_path), np.full((N, N), 2, np.float32))  # tmp/model.onnx + tmp/w.data
    os.rename(own, tmp_path / "o.onnx")
    m = onnx.load(str(tmp_path / "o.onnx"), load_external_data=False)
    m.graph.initializer[0].external_data[0].value = "o.onnx.data"
    onnx.save(m, str(tmp_path / "o.onnx"))
    os.rename(tmp_path / "w.data", tmp_path / "o.onnx.data")
    before = (tmp_path / "o.onnx.data").read_bytes()
    assert main(["pad", src, "-o", str(tmp_path / "o.onnx"), "-q", "--external-data"]) == 0
    assert (tmp_path / "o.onnx.data").read_bytes() == before
    again = main(["pad", src, "-o", str(tmp_path / "o.onnx"), "-q", "--external-data"])
    assert again == 0 and (tmp_path / "o.onnx.data").read_bytes() == before
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 4 and names[:2] == ["m", "o.onnx"] and names[3] == "o.onnx.data", names  # + the live pair's


# --- one process per run folder ---------------------------------------------------------

HOLDER = r"""
import sys
import graphmp.train.loop as loop
real_train = loop.train
def train(*a, **kw):  # inside the lock: say so, then wait until told to go on
    print("TRAINING", flush=True)
    sys.stdin.readline()
    return real_train(*a, **kw)
loop.train = train
from graphmp.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A built (never trained) run of the tests' tiny MLP and its data."""
    sys.path.insert(0, os.path.dirname(__file__))
    from fixtures import tiny as tm
    d = tmp_path_factory.mktemp("lock")
    onnx.save(tm.mlp(), str(d / "mlp.onnx"))
    assert main(["train-graph", str(d / "mlp.onnx"), "-o", str(d / "run"), "--precision", "fp32",
                 "--optimizer", "sgd", "--lr", "0.1"]) == 0
    np.savez(d / "data.npz", **tm.blobs(64))
    return str(d / "run"), str(d / "data.npz")


def _holder(run, data):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-c", HOLDER, "train", run, "--data", data, "--batch-size", "16", "-q",
                          "--max-steps", "2"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "TRAINING", p.stderr.read()
    return p


def test_a_second_train_of_a_run_folder_is_refused_naming_the_holder(tiny_run, capsys):
    run, data = tiny_run
    holder = _holder(run, data)
    try:
        for args in (["train", run, "--data", data, "--batch-size", "16", "-q", "--max-steps", "1"],
                     ["train", run, "--data", data, "--batch-size", "16", "-q", "--max-steps", "1", "--nproc", "2"],
                     ["export", run, "-o", os.path.join(os.path.dirname(run), "e.onnx")]):
            _one_error(main(args), capsys.readouterr().err, f"pid {holder.pid}", "another graphmp")
        assert not os.path.exists(os.path.join(os.path.dirname(run), "e.onnx"))
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.wait(timeout=120) == 0, holder.stderr.read()
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()
    # released at exit: the folder is free again
    assert main(["train", run, "--data", data, "--batch-size", "16", "-q", "--max-steps", "1"]) == 0


def test_a_killed_holder_never_blocks_the_next_run(tiny_run, capsys):
    run, data = tiny_run
    holder = _holder(run, data)
    holder.kill()  # SIGKILL: no clean-up runs; the kernel drops the flock
    holder.wait()
    assert os.path.exists(os.path.join(run, ".graphmp.lock"))
    assert main(["train", run, "--data", data, "--batch-size", "16", "-q", "--max-steps", "1"]) == 0
    assert main(["export", run, "-o", os.path.join(os.path.dirname(run), "e.onnx"), "-q"]) == 0


def test_a_lock_file_that_is_a_symlink_is_refused_and_never_followed(tiny_run, tmp_path, capsys):
    run, data = tiny_run
    lock = os.path.join(run, ".graphmp.lock")
    target = tmp_path / "victim"
    target.write_bytes(b"victim\n")
    os.unlink(lock) if os.path.lexists(lock) else None
    os.symlink(target, lock)
    try:
        _one_error(main(["export", run, "-o", str(tmp_path / "e.onnx")]), capsys.readouterr().err, "symlink")
        assert target.read_bytes() == b"victim\n"
    finally:
        os.unlink(lock)


# --- bounded reads of .npz data files ---------------------------------------------------

def _npy_header(shape, descr="<f4"):
    """A version 1.0 .npy header for `shape` (what numpy.save writes before the data)."""
    d = repr({"descr": descr, "fortran_order": False, "shape": tuple(shape)}).encode()
    d += b" " * (-(10 + len(d) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(d).to_bytes(2, "little") + d


def _zip_bomb(path, name="x", nbytes=256 << 20):
    """An .npz whose one member, [1, nbytes/4] float32 zeros, deflates to about 1/1000 of it."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open(name + ".npy", "w", force_zip64=True) as f:
            f.write(_npy_header((1, nbytes // 4)))
            chunk = bytes(1 << 20)
            for _ in range(nbytes >> 20):
                f.write(chunk)


def _lying_header(path, name="x"):
    """An .npz whose member's header claims [2**42, 2**2] float32 (64 TiB) over 16 bytes of data."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(name + ".npy", _npy_header((2 ** 42, 4)) + bytes(16))


def _object_array(path, name="x"):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(name + ".npy", _npy_header((1,), "|O") + b"\x80\x04N.")


@pytest.fixture
def reads(monkeypatch):
    """Arrays numpy inflated (a refused member must never be read)."""
    seen, real = [], np.lib.format.read_array

    def spy(fp, *a, **kw):
        seen.append(fp)
        return real(fp, *a, **kw)
    monkeypatch.setattr(np.lib.format, "read_array", spy)
    return seen


BAD_NPZ = {"zip-bomb": (_zip_bomb, "zip bomb"), "lying-header": (_lying_header, "corrupt or forged"),
           "objects": (_object_array, "never unpickles")}


@pytest.mark.parametrize("kind", sorted(BAD_NPZ))
@pytest.mark.parametrize("command", ["convert", "check"])
def test_a_bad_npz_is_one_line_before_any_array_is_read(tmp_path, capsys, reads, kind, command):
    make, needle = BAD_NPZ[kind]
    (tmp_path / "m").mkdir()
    src = _external_model(str(tmp_path / "m"), np.ones((N, N), np.float32))
    bad = str(tmp_path / "bad.npz")
    make(bad)
    out = str(tmp_path / "o.onnx")
    args = {"convert": ["convert", src, "-o", out, "-q", "--calibration", bad],
            "check": ["check", src, src, "--data", bad]}[command]
    _one_error(main(args), capsys.readouterr().err, "bad.npz", needle)
    assert not reads and not os.path.exists(out)


@pytest.mark.parametrize("kind", sorted(BAD_NPZ))
def test_a_bad_npz_is_one_line_for_train(tiny_run, tmp_path, capsys, reads, kind):
    run, _ = tiny_run
    make, needle = BAD_NPZ[kind]
    bad = str(tmp_path / "bad.npz")
    make(bad)
    _one_error(main(["train", run, "--data", bad, "--batch-size", "16", "-q", "--max-steps", "1"]),
               capsys.readouterr().err, "bad.npz", needle)
    assert not reads


def test_the_npz_size_limit_has_an_override(tiny_run, tmp_path, capsys, monkeypatch):
    run, data = tiny_run
    size = sum(i.file_size for i in zipfile.ZipFile(data).infolist())
    monkeypatch.setenv("GRAPHMP_MAX_NPZ_BYTES", str(size - 1))
    _one_error(main(["train", run, "--data", data, "--batch-size", "16", "-q", "--max-steps", "1"]),
               capsys.readouterr().err, "data.npz", f"{size} bytes", "GRAPHMP_MAX_NPZ_BYTES")
    monkeypatch.setenv("GRAPHMP_MAX_NPZ_BYTES", str(1 << 30))  # (the run's own state.npz is checked too)
    assert main(["train", run, "--data", data, "--batch-size", "16", "-q", "--max-steps", "1"]) == 0
    monkeypatch.setenv("GRAPHMP_MAX_NPZ_BYTES", "lots")
    _one_error(main(["train", run, "--data", data, "--batch-size", "16", "-q", "--max-steps", "1"]),
               capsys.readouterr().err, "GRAPHMP_MAX_NPZ_BYTES=lots")


def test_npz_written_by_numpy_reads_as_before(tmp_path):
    """savez and savez_compressed files, Fortran order and 0-d arrays included, read back equal."""
    arrays = {"a": np.arange(12, dtype=np.int64).reshape(3, 4), "f": np.asfortranarray(np.ones((2, 3), np.float16)),
              "s": np.array(3.5), "b": np.zeros((0, 2), bool)}
    for save in (np.savez, np.savez_compressed):
        p = str(tmp_path / f"{save.__name__}.npz")
        save(p, **arrays)
        got = graphmp.model_io.load_npz(p)
        assert sorted(got) == sorted(arrays)
        for k, v in arrays.items():
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v)


# --- deeply nested run JSON -------------------------------------------------------------

@pytest.mark.parametrize("depth", [40, 900, 100000])
@pytest.mark.parametrize("name,command", [("train.json", "train"), ("train.json", "export"),
                                          ("checkpoint.json", "train"), ("checkpoint.json", "export")])
def test_deeply_nested_run_json_is_one_line(tiny_run, tmp_path, capsys, name, command, depth):
    import shutil
    run_src, data = tiny_run
    run = str(tmp_path / "run")
    shutil.copytree(run_src, run)
    path = os.path.join(run, name)
    with open(path, "w") as f:  # a valid object whose one value nests `depth` lists deep
        f.write('{"config": ' + "[" * depth + "]" * depth + "}")
    args = (["train", run, "--data", data, "--batch-size", "16", "-q", "--max-steps", "1"] if command == "train"
            else ["export", run, "-o", str(tmp_path / "e.onnx")])
    _one_error(main(args), capsys.readouterr().err, name, "nested more than")


# --- fuzz: any .npz is arrays or one line ------------------------------------------------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_MEMBER = st.tuples(
    st.sampled_from(["x.npy", "y.npy", "labels.npy", "x", "../x.npy"]),
    st.lists(st.one_of(st.integers(0, 5), st.sampled_from([2 ** 31, 2 ** 42, 2 ** 63 - 1])), max_size=3),
    st.sampled_from(["<f4", "<i8", "|b1", "<f2", "|O", ">f8", "<U3", "<V0"]),
    st.one_of(st.none(), st.integers(0, 64)),  # data bytes: None = what the header calls for
    st.booleans(),  # deflated
    st.one_of(st.none(), st.binary(max_size=40)),  # replace the whole member by these bytes
)


@pytest.mark.filterwarnings("ignore:Duplicate name")
@settings(max_examples=int(os.environ.get("GRAPHMP_FUZZ_EXAMPLES", "60")), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(members=st.lists(_MEMBER, min_size=0, max_size=3))
def test_fuzz_any_npz_is_its_arrays_or_one_line(members):
    import tempfile
    with tempfile.TemporaryDirectory(prefix="graphmp-npz-") as d:
        path = os.path.join(d, "f.npz")
        with zipfile.ZipFile(path, "w") as z:
            for name, shape, descr, nbytes, deflate, raw in members:
                if raw is None:
                    count = int(np.prod(shape, dtype=object)) if shape else 1
                    want = count * np.dtype(descr).itemsize if descr != "|O" else 8
                    raw = _npy_header(shape, descr) + bytes(min(want, 64) if nbytes is None else nbytes)
                z.writestr(name, raw, zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED)
        try:
            arrays = graphmp.model_io.load_npz(path)
        except graphmp.model_io.GraphmpError as e:
            assert "\n" not in str(e) and str(e).startswith(path), str(e)
            return
        for name, arr in arrays.items():  # accepted: each array is exactly what its member held
            info = zipfile.ZipFile(path).getinfo(name + ".npy" if name + ".npy" in zipfile.ZipFile(path).namelist()
                                                 else name)
            assert arr.nbytes <= info.file_size and arr.dtype != object


@pytest.mark.parametrize("body", ["lying", "objects", "ok"])
def test_class_weights_npy_header_is_checked_before_reading(tmp_path, capsys, reads, body):
    sys.path.insert(0, os.path.dirname(__file__))
    from fixtures import tiny as tm
    onnx.save(tm.mlp(), str(tmp_path / "mlp.onnx"))
    npy = tmp_path / "w.npy"
    if body == "ok":
        np.save(npy, np.ones(3, np.float32))
    else:
        npy.write_bytes(_npy_header((2 ** 42, 4)) + bytes(16) if body == "lying" else _npy_header((1,), "|O") + b"N.")
    rc = main(["train-graph", str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "run"), "--loss", "cross-entropy",
               "--class-weights", str(npy)])
    err = capsys.readouterr().err
    if body == "ok":  # read, then judged on its length like any class weights
        assert "not a readable" not in err and "Traceback" not in err and reads
    else:
        _one_error(rc, err, "w.npy", "header claims")
        assert not reads and not os.path.exists(tmp_path / "run" / "train.json")

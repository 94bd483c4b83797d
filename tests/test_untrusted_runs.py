"""Run folders are data, not instructions (issue "untrusted models, safe files").

A run folder may come from anyone: every file name its train.json / checkpoint.json gives
must be a bare name of the kind graphmp writes there, naming a regular file inside the
folder; a corrupt file is a one-line error naming it; outputs never clobber inputs; a full
disk or a read-only folder is a one-line error. Each case goes through the CLI in-process
on a tiny real run (tests/fixtures/tiny.py), and checks that a sentinel file outside the run
folder is neither loaded, changed nor deleted.
"""
import errno
import json
import os
import shutil

import numpy as np
import onnx
import pytest

from fixtures import tiny as tm
from graphmp.cli import main

TRAIN = ["--batch-size", "16", "-q"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A built (never trained) fp32 SGD run of the MLP, its model and data (shared, read-only)."""
    d = tmp_path_factory.mktemp("untrusted")
    onnx.save(tm.mlp(), str(d / "mlp.onnx"))
    assert main(["train-graph", str(d / "mlp.onnx"), "-o", str(d / "run"), "--precision", "fp32",
                 "--optimizer", "sgd", "--lr", "0.1"]) == 0
    np.savez(d / "data.npz", **tm.blobs(64))
    return d


@pytest.fixture
def run(built, tmp_path):
    """A fresh copy of the run (tmp_path/run) and data (tmp_path/data.npz)."""
    shutil.copytree(built / "run", tmp_path / "run")
    shutil.copy(built / "data.npz", tmp_path / "data.npz")
    return str(tmp_path / "run")


@pytest.fixture
def loads(monkeypatch):
    """The real paths numpy.load opens (spy: a file outside the run folder must never be loaded)."""
    seen, real_load = [], np.load

    def spy(f, *a, **kw):
        if isinstance(f, (str, os.PathLike)):
            seen.append(os.path.realpath(f))
        return real_load(f, *a, **kw)
    monkeypatch.setattr(np, "load", spy)
    return seen


def _data(run):
    return os.path.join(os.path.dirname(run), "data.npz")


def _train(run, *extra):
    return main(["train", run, "--data", _data(run), *TRAIN, *extra])


def _trained(run, steps=2):
    """Train `steps` steps with a checkpoint after each; returns checkpoint.json's dict."""
    assert _train(run, "--max-steps", str(steps), "--checkpoint-every", "1") == 0
    with open(os.path.join(run, "checkpoint.json")) as f:
        return json.load(f)


def _sentinel(path, data: bytes | None = None) -> tuple[str, bytes]:
    if data is None:
        data = b"sentinel: never read, written or deleted by graphmp\n"
    with open(path, "wb") as f:
        f.write(data)
    return str(path), data


def _intact(sentinel):
    path, data = sentinel
    assert os.path.isfile(path), f"{path} was deleted"
    with open(path, "rb") as f:
        assert f.read() == data, f"{path} was changed"


def _refused(capsys, rc, *names):
    """rc 2, the last stderr line a one-line graphmp error naming every one of `names`."""
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("graphmp: error:"), err
    for n in names:
        assert n in last, (n, last)
    return last


def _set(path, key, value):
    with open(path) as f:
        d = json.load(f)
    d[key] = value
    with open(path, "w") as f:
        json.dump(d, f)


# --- checkpoint.json's state_file ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["parent", "absolute", "subfolder", "symlink"])
def test_checkpoint_state_file_outside_the_run_is_refused(run, tmp_path, capsys, loads, kind):
    """'../outside.npz', an absolute path, 'sub/ckpt-1.npz' and a symlink ckpt-5.npz to a file
    outside: refused before anything is loaded (a valid checkpoint lies there, so a run that
    followed the name would train from it)."""
    ck = _trained(run)
    state = os.path.join(run, ck["state_file"])
    outside = _sentinel(tmp_path / "outside.npz", open(state, "rb").read())
    name = {"parent": "../outside.npz", "absolute": outside[0], "subfolder": "sub/ckpt-1.npz",
            "symlink": "ckpt-5.npz"}[kind]
    if kind == "subfolder":
        os.makedirs(os.path.join(run, "sub"))
        shutil.copy(state, os.path.join(run, "sub", "ckpt-1.npz"))
    if kind == "symlink":
        os.symlink(outside[0], os.path.join(run, "ckpt-5.npz"))
    _set(os.path.join(run, "checkpoint.json"), "state_file", name)
    del loads[:]
    _refused(capsys, _train(run, "--max-steps", "4"), "checkpoint.json", "'state_file'")
    assert os.path.realpath(outside[0]) not in loads
    _intact(outside)


@pytest.mark.parametrize("name", ["../outside.npz", "ABSOLUTE"])
def test_no_resume_never_deletes_what_checkpoint_json_names(run, tmp_path, capsys, name):
    """--no-resume used to delete the old checkpoint.json's state_file, wherever it pointed."""
    _trained(run)
    outside = _sentinel(tmp_path / "outside.npz")
    _set(os.path.join(run, "checkpoint.json"), "state_file", outside[0] if name == "ABSOLUTE" else name)
    _refused(capsys, _train(run, "--no-resume", "--max-steps", "2"), "checkpoint.json", "'state_file'")
    _intact(outside)


# --- train.json's names -------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("step_model", "../x.onnx"), ("step_model", "ABSOLUTE"),
                                       ("infer_model", "../x.onnx"), ("initial_state", "../x.npz"),
                                       ("step_model", 5), ("initial_state", "sub/state.npz")])
def test_train_json_names_outside_the_run_are_refused(run, tmp_path, capsys, loads, key, value):
    """A copy of the real file lies where the name points, so a run that followed it would work."""
    real = os.path.join(run, {"step_model": "step.onnx", "infer_model": "infer.onnx",
                              "initial_state": "state.npz"}[key])
    target = tmp_path / ("x.onnx" if key != "initial_state" else "x.npz")
    outside = _sentinel(target, open(real, "rb").read())
    if value == "ABSOLUTE":
        value = outside[0]
    if value == "sub/state.npz":
        os.makedirs(os.path.join(run, "sub"))
        shutil.copy(real, os.path.join(run, "sub", "state.npz"))
    _set(os.path.join(run, "train.json"), key, value)
    _refused(capsys, _train(run, "--max-steps", "2"), "train.json", f"'{key}'")
    assert os.path.realpath(outside[0]) not in loads
    _intact(outside)
    assert not os.path.exists(os.path.join(run, "checkpoint.json"))


def test_export_refuses_a_source_that_is_not_a_path(run, tmp_path, capsys):
    _set(os.path.join(run, "train.json"), "source", 5)
    _refused(capsys, main(["export", run, "-o", str(tmp_path / "out.onnx")]), "train.json", "'source'")
    assert not os.path.exists(tmp_path / "out.onnx")


# --- corrupt files ---------------------------------------------------------------------------------

def _truncate(path):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])


@pytest.mark.parametrize("what", ["checkpoint.json", "train.json", "step.onnx", "train.json list",
                                  "checkpoint.json list", "checkpoint.json step", "ckpt shape"])
def test_corrupt_run_files_are_one_line_errors(run, capsys, what):
    ck = _trained(run)
    name = what.split()[0]
    path = os.path.join(run, name)
    if what == "ckpt shape":  # a checkpoint whose weight does not fit the step graph
        path = os.path.join(run, ck["state_file"])
        state = dict(np.load(path))
        state["fc1.weight"] = state["fc1.weight"][:3]
        np.savez(path, **state)
        name = "fc1.weight"
    elif what.endswith("list"):
        with open(path, "w") as f:
            json.dump(["step.onnx", "state.npz"], f)
    elif what.endswith("step"):
        _set(path, "step", "two")
    else:
        _truncate(path)
    last = _refused(capsys, _train(run, "--max-steps", "4"), name)
    if what.endswith("step"):
        assert "'step'" in last
    if what == "ckpt shape":  # blamed on the state file, not on the training data
        assert "state file" in last and "data.npz" not in last


def test_truncated_infer_onnx_is_a_one_line_error_for_export(run, tmp_path, capsys):
    _truncate(os.path.join(run, "infer.onnx"))
    _refused(capsys, main(["export", run, "-o", str(tmp_path / "out.onnx")]), "infer.onnx")
    assert not os.path.exists(tmp_path / "out.onnx")


# --- data checks, full disk, read-only folders ----------------------------------------------------------

def test_eval_data_with_no_samples_is_refused_before_any_step(run, tmp_path, capsys):
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 4), np.float32), labels=np.zeros((0,), np.int64))
    rc = _train(run, "--eval", str(tmp_path / "empty.npz"))
    _refused(capsys, rc, "empty.npz")
    assert not os.path.exists(os.path.join(run, "checkpoint.json"))


def test_full_disk_while_checkpointing_keeps_the_last_checkpoint(run, capsys, monkeypatch):
    ck = _trained(run, 2)
    capsys.readouterr()
    before = open(os.path.join(run, "checkpoint.json"), "rb").read()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    last = _refused(capsys, _train(run, "--max-steps", "4", "--checkpoint-every", "1"), "ckpt-")
    assert "disk is full" in last or "No space left" in last
    monkeypatch.undo()
    assert open(os.path.join(run, "checkpoint.json"), "rb").read() == before
    assert not [f for f in os.listdir(run) if f.endswith(".tmp")]
    assert sorted(f for f in os.listdir(run) if f.startswith("ckpt-")) == [ck["state_file"]]
    # the previous checkpoint still loads: the next call resumes from step 2
    assert _train(run, "--max-steps", "4") == 0
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["steps"] == 4 and summary["steps_this_call"] == 2


def _deny(monkeypatch, fn_name, inside):
    """As root (chmod does not stop root), make os.<fn_name> fail with EACCES under `inside`."""
    real = getattr(os, fn_name)

    def denied(path, *a, **kw):
        if os.path.abspath(os.fspath(path)).startswith(os.path.abspath(inside) + os.sep):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real(path, *a, **kw)
    monkeypatch.setattr(os, fn_name, denied)


def test_train_graph_into_a_read_only_parent(built, tmp_path, capsys, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    os.chmod(parent, 0o555)
    if os.geteuid() == 0:
        _deny(monkeypatch, "mkdir", str(parent))
    try:
        rc = main(["train-graph", str(built / "mlp.onnx"), "-o", str(parent / "run"), "--precision", "fp32"])
    finally:
        os.chmod(parent, 0o755)
    _refused(capsys, rc, str(parent))
    assert os.listdir(parent) == []


def test_train_graph_force_into_a_read_only_run(built, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(built / "run", run)
    files = sorted(os.listdir(run))
    os.chmod(run, 0o555)
    if os.geteuid() == 0:
        _deny(monkeypatch, "unlink", str(run))
    try:
        rc = main(["train-graph", str(built / "mlp.onnx"), "-o", str(run), "--precision", "fp32", "--force"])
    finally:
        os.chmod(run, 0o755)
    _refused(capsys, rc, str(run))
    assert sorted(os.listdir(run)) == files


# --- outputs never clobber inputs -------------------------------------------------------------------------

@pytest.mark.parametrize("flag,name", [("--data", "state.npz"), ("--data", "summary.json"),
                                       ("--eval", "loss.png"), ("--data", "checkpoint.json")])
def test_train_data_that_is_a_run_file_is_refused(run, capsys, flag, name):
    """The data (a valid .npz under a run file's name) would be overwritten by the run's output."""
    path = os.path.join(run, name)
    if name != "state.npz":  # the run's own state.npz as --data: refused before it is read
        shutil.copy(_data(run), path)
    kept = (path, open(path, "rb").read())
    args = ["train", run, "--data", path if flag == "--data" else _data(run), *TRAIN, "--max-steps", "2"]
    if flag == "--eval":
        args += ["--eval", path]
    _refused(capsys, main(args), name, flag, "run folder")
    _intact(kept)
    assert not os.path.exists(os.path.join(run, "checkpoint.json")) or name == "checkpoint.json"


def test_train_data_linked_to_a_run_file_is_refused(run, tmp_path, capsys):
    """Compared as files, not names: a hard link outside the run to its summary.json."""
    shutil.copy(_data(run), os.path.join(run, "summary.json"))
    os.link(os.path.join(run, "summary.json"), tmp_path / "linked.npz")
    kept = (str(tmp_path / "linked.npz"), open(tmp_path / "linked.npz", "rb").read())
    rc = main(["train", run, "--data", str(tmp_path / "linked.npz"), *TRAIN, "--max-steps", "2"])
    _refused(capsys, rc, "summary.json", "--data", "run folder")
    _intact(kept)


@pytest.mark.parametrize("name", ["step.onnx", "infer.onnx", "state.npz", "train.json", "CKPT"])
def test_export_onto_a_run_file_is_refused(run, capsys, name):
    if name == "CKPT":
        name = _trained(run)["state_file"]
        capsys.readouterr()
    path = os.path.join(run, name)
    kept = (path, open(path, "rb").read())
    _refused(capsys, main(["export", run, "-o", path]), name)
    _intact(kept)


def test_export_onto_the_source_models_data_file_is_refused(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(tm.mlp(), str(src / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    assert main(["train-graph", str(src / "m.onnx"), "-o", str(tmp_path / "run"), "--precision", "fp32"]) == 0
    kept = (str(src / "weights.bin"), open(src / "weights.bin", "rb").read())
    _refused(capsys, main(["export", str(tmp_path / "run"), "-o", kept[0]]), "weights.bin")
    _intact(kept)


@pytest.mark.parametrize("model,data", [("infer.onnx", None), ("model.onnx", "state.npz"),
                                        ("model.onnx", "model.bin")])
def test_train_graph_force_never_deletes_the_input_model(built, tmp_path, capsys, model, data):
    """The input model (and its data file) inside RUN: kept. Where the new run would have to
    replace it (a run file's name), refused before any work; otherwise the run is rebuilt
    around it."""
    run = tmp_path / "run"
    shutil.copytree(built / "run", run)
    m = tm.mlp()
    if data:
        onnx.save(m, str(run / model), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=data, size_threshold=0)
    else:
        onnx.save(m, str(run / model))
    kept = [(str(run / f), open(run / f, "rb").read()) for f in (model, data) if f]
    rc = main(["train-graph", str(run / model), "-o", str(run), "--precision", "fp32", "--force"])
    if data == "model.bin":
        assert rc == 0
        assert os.path.isfile(run / "train.json")
    else:
        _refused(capsys, rc, model if data is None else data, "run folder")
    for k in kept:
        _intact(k)


def test_train_graph_force_removes_only_run_files(built, tmp_path, capsys):
    """--force removes the run's own files (known names, regular files or symlinks themselves):
    never a symlink's target, a directory named like a run file, or a file of another kind."""
    run = tmp_path / "run"
    shutil.copytree(built / "run", run)
    target = _sentinel(tmp_path / "target.npz")
    os.symlink(target[0], run / "ckpt-000000003.npz")
    os.mkdir(run / "ckpt-000000009.npz")
    notes = _sentinel(run / "ckpt-notes.npz")
    rc = main(["train-graph", str(built / "mlp.onnx"), "-o", str(run), "--precision", "fp32", "--force"])
    assert rc == 0, capsys.readouterr().err
    _intact(target)
    _intact(notes)
    assert not os.path.lexists(run / "ckpt-000000003.npz")
    assert os.path.isdir(run / "ckpt-000000009.npz")


def test_train_graph_model_in_its_own_non_empty_folder_is_refused_without_force(built, tmp_path, capsys):
    d = tmp_path / "m"
    d.mkdir()
    onnx.save(tm.mlp(), str(d / "mlp.onnx"))
    kept = (str(d / "mlp.onnx"), open(d / "mlp.onnx", "rb").read())
    _refused(capsys, main(["train-graph", kept[0], "-o", str(d), "--precision", "fp32"]), str(d))
    _intact(kept)
    assert os.listdir(d) == ["mlp.onnx"]


def test_the_rules_hold_for_a_valid_run(run, tmp_path, capsys):
    """A run as graphmp writes it (relative names, a checkpoint, a symlinked run folder) still trains,
    resumes and exports."""
    link = tmp_path / "linked-run"
    os.symlink(run, link)
    assert _train(str(link), "--max-steps", "2", "--checkpoint-every", "1") == 0
    assert _train(str(link), "--max-steps", "3") == 0
    assert main(["export", str(link), "-o", str(tmp_path / "out.onnx")]) == 0
    onnx.checker.check_model(onnx.load(str(tmp_path / "out.onnx")))

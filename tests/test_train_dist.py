"""Data-parallel training on torch.distributed (issue 24), with real gloo process groups of 2
ranks on the CPU, launched as a user launches them (`graphmp train --nproc 2`)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest

from fixtures import tiny
from graphmp.train import build_step, train
from graphmp.train.loop import latest_state

torch = pytest.importorskip("torch", reason="data-parallel training needs torch (pip install 'graphmp[dist]')")
GRAPHMP = [sys.executable, "-m", "graphmp.cli"]


def _run(tmp_path, name, **kw):
    p = tmp_path / "mlp.onnx"
    if not p.exists():
        onnx.save(tiny.mlp(), p)
    run = tmp_path / name
    build_step(str(p), str(run), loss="cross-entropy", **kw)
    return str(run)


def _dp(run, data, *extra, timeout=120):
    return subprocess.run(GRAPHMP + ["train", run, "--data", str(data), "--nproc", "2", *extra],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("optimizer,precision,rtol", [("sgd", "fp32", 1e-6), ("adamw", "fp32", 1e-6),
                                                      ("adamw", "mixed", 2e-3)])
def test_two_ranks_of_batch_8_are_one_rank_of_batch_16(tmp_path, optimizer, precision, rtol):
    np.savez(tmp_path / "d.npz", **tiny.blobs(64))          # 4 global batches of 16 per epoch
    kw = dict(optimizer=optimizer, precision=precision, lr=0.05)
    one, two = _run(tmp_path, "one", **kw), _run(tmp_path, "two", **kw)
    train(one, str(tmp_path / "d.npz"), epochs=5, batch_size=16, progress=False)      # 20 steps
    res = _dp(two, tmp_path / "d.npz", "--epochs", "5", "--batch-size", "8")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "20 data-parallel steps on 2 ranks (global batch 16)" in res.stdout
    a, ck_a = latest_state(one)
    b, ck_b = latest_state(two)
    assert ck_a["step"] == ck_b["step"] == 20
    meta = json.loads(open(os.path.join(one, "train.json")).read())
    for w in meta["weights"]:
        np.testing.assert_allclose(b[w], a[w], rtol=rtol, atol=rtol * float(np.abs(a[w]).max()), err_msg=w)
    assert not np.allclose(a[meta["weights"][0]], np.load(os.path.join(one, "state.npz"))[meta["weights"][0]])


def test_an_overflow_in_one_ranks_shard_skips_the_step_on_both(tmp_path):
    """A finite 3e38 (the data check lets it through) overflows rank 1's forward only:
    its gradients are inf, the reduced ones too, and both ranks skip and back off S."""
    d = tiny.blobs(16)
    order = np.random.default_rng(0).permutation(16)   # epoch 0, seed 0: the step's global batch
    d["x"][order[1], :] = 3e38                          # position 1: rank 1's shard only
    np.savez(tmp_path / "d.npz", **d)
    run = _run(tmp_path, "run", optimizer="sgd", precision="mixed")
    before = dict(np.load(os.path.join(run, "state.npz")))
    res = _dp(run, tmp_path / "d.npz", "--batch-size", "8")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "1 data-parallel steps on 2 ranks" in res.stdout and ", 1 skipped" in res.stdout
    after, _ = latest_state(run)
    meta = json.loads(open(os.path.join(run, "train.json")).read())
    for w in meta["weights"]:
        np.testing.assert_array_equal(after[w], before[w])
    assert after["loss_scale"] < before["loss_scale"]


def test_a_rank_that_dies_ends_the_job_quickly(tmp_path):
    np.savez(tmp_path / "d.npz", **tiny.blobs(4096))
    run = _run(tmp_path, "run", optimizer="sgd", precision="fp32")
    t0 = time.perf_counter()
    p = subprocess.Popen(GRAPHMP + ["train", run, "--data", str(tmp_path / "d.npz"), "--nproc", "2", "--batch-size",
                                    "1", "--epochs", "50", "--dist-timeout", "20"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(8)  # the ranks are stepping
    kids = subprocess.run(["pgrep", "-f", f"graphmp.cli train {run}"], capture_output=True, text=True).stdout.split()
    ranks = [int(k) for k in kids if int(k) != p.pid]
    assert ranks, "no rank processes found"
    os.kill(ranks[-1], signal.SIGKILL)
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("the job did not end within 60 s of a rank dying")
    assert p.returncode != 0 and time.perf_counter() - t0 < 75


def test_resume_needs_the_same_world_and_batch(tmp_path):
    np.savez(tmp_path / "d.npz", **tiny.blobs(32))
    run = _run(tmp_path, "run", optimizer="sgd", precision="fp32")
    assert _dp(run, tmp_path / "d.npz", "--batch-size", "8").returncode == 0
    res = _dp(run, tmp_path / "d.npz", "--batch-size", "4")
    assert res.returncode != 0 and "made by 2 rank(s) x batch 8" in res.stderr and "--no-resume" in res.stderr


def test_without_torch_nproc_names_the_extra(tmp_path, monkeypatch):
    import builtins
    from graphmp.cli import main
    real = builtins.__import__

    def no_torch(name, *a, **k):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_torch)
    np.savez(tmp_path / "d.npz", **tiny.blobs(32))
    run = _run(tmp_path, "run", optimizer="sgd", precision="fp32")
    assert main(["train", run, "--data", str(tmp_path / "d.npz"), "--nproc", "2"]) == 2


def test_a_resumed_two_rank_run_ends_with_the_uninterrupted_weights(tmp_path):
    """Stopped after 7 steps (a checkpoint every 5), resumed to the end: the weights of one
    run of all 16 steps."""
    np.savez(tmp_path / "d.npz", **tiny.blobs(64))
    whole, parts = (_run(tmp_path, name, optimizer="adamw", precision="fp32", lr=0.05) for name in ("whole", "parts"))
    assert _dp(whole, tmp_path / "d.npz", "--batch-size", "8", "--epochs", "4").returncode == 0
    assert _dp(parts, tmp_path / "d.npz", "--batch-size", "8", "--epochs", "4", "--max-steps", "7",
               "--checkpoint-every", "5").returncode == 0
    assert latest_state(parts)[1]["step"] == 7
    res = _dp(parts, tmp_path / "d.npz", "--batch-size", "8", "--epochs", "4")
    assert res.returncode == 0 and "9 data-parallel steps" in res.stdout, res.stdout + res.stderr[-800:]
    a, b = latest_state(whole)[0], latest_state(parts)[0]
    meta = json.loads(open(os.path.join(whole, "train.json")).read())
    for w in meta["weights"]:
        np.testing.assert_array_equal(b[w], a[w], err_msg=w)


def test_bad_data_fails_the_job_before_the_first_step_naming_rank_and_file(tmp_path):
    d = tiny.blobs(32)
    d["labels"][5] = 7                                   # 3 classes: an index out of range
    np.savez(tmp_path / "bad.npz", **d)
    run = _run(tmp_path, "run", optimizer="sgd", precision="fp32")
    res = _dp(run, tmp_path / "bad.npz", "--batch-size", "8")
    assert res.returncode == 2
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("graphmp: error:")]
    assert errors and all(ln.startswith("graphmp: error: rank ") and "bad.npz" in ln for ln in errors), errors
    assert not os.path.exists(os.path.join(run, "checkpoint.json"))
    assert "Traceback" not in res.stderr

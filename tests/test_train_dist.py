"""Data-parallel training on torch.distributed (issue 24), with real gloo process groups of 2
ranks on the CPU, launched as a user launches them (`graphmp train --nproc 2`)."""
import json
import os
import re
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
    err = p.stderr.read()
    # the survivor says why in one line; torchrun's SIGTERM may reach it first ("terminated")
    assert ("graphmp: error: rank 0: the all-reduce failed" in err and "rerun the command" in err) \
        or "graphmp: terminated" in err, err[-1500:]
    assert "Traceback" not in err, err[-3000:]


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


def test_accumulation_reduces_once_per_window_and_matches_one_process(tmp_path):
    """--accumulate 2: 2 ranks x batch 8 give the weights of 1 process x batch 16 (10
    updates of 2 runs each), and the all-reduce runs once per window, not per batch."""
    np.savez(tmp_path / "d.npz", **tiny.blobs(64))
    kw = dict(optimizer="adamw", precision="fp32", lr=0.05, grad_accum=2)
    one, two = _run(tmp_path, "one", **kw), _run(tmp_path, "two", **kw)
    train(one, str(tmp_path / "d.npz"), epochs=5, batch_size=16, progress=False)
    res = _dp(two, tmp_path / "d.npz", "--epochs", "5", "--batch-size", "8", "--dist-summary", str(tmp_path / "s.json"))
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["steps"], summary["updates"], summary["accumulate"]) == (20, 10, 2)
    assert summary["all_reduces"] == 10                   # once per window, not per micro-batch
    a, b = latest_state(one)[0], latest_state(two)[0]
    assert int(a["optimizer_step"]) == int(b["optimizer_step"]) == 10
    meta = json.loads(open(os.path.join(one, "train.json")).read())
    for w in meta["weights"]:
        np.testing.assert_allclose(b[w], a[w], rtol=1e-6, atol=1e-6 * float(np.abs(a[w]).max()), err_msg=w)


def test_eval_with_nproc_is_the_whole_sets_eval_of_the_final_weights(tmp_path):
    from graphmp.train.loop import evaluate
    np.savez(tmp_path / "d.npz", **tiny.blobs(64))
    np.savez(tmp_path / "e.npz", **tiny.blobs(37, seed=5))   # odd: the ranks' shards differ in size
    run = _run(tmp_path, "run", optimizer="sgd", precision="fp32", lr=0.05)
    res = _dp(run, tmp_path / "d.npz", "--epochs", "2", "--batch-size", "8", "--eval", str(tmp_path / "e.npz"),
              "--dist-summary", str(tmp_path / "s.json"))
    assert res.returncode == 0, res.stderr[-2000:]
    evals = json.loads((tmp_path / "s.json").read_text())["eval_per_epoch"]
    assert [e["epoch"] for e in evals] == [1, 2] and evals[-1]["samples"] == 37
    assert "epoch 2: eval loss" in res.stdout
    ref = evaluate(run, str(tmp_path / "e.npz"), state=latest_state(run)[0])
    assert evals[-1]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert evals[-1]["accuracy"] == pytest.approx(ref["accuracy"], abs=1e-6)


def test_sync_bn_averages_the_running_statistics_over_the_ranks(tmp_path):
    """After one step the running mean is linear in the batch means: the ranks' average is
    the running mean of the global batch (one process, batch 16). Without --sync-bn rank 0
    keeps its own half's."""
    p = tmp_path / "cnn.onnx"
    onnx.save(tiny.cnn(), p)
    np.savez(tmp_path / "d.npz", **tiny.bars(32))
    runs = {}
    for name in ("one", "sync", "own"):
        runs[name] = str(tmp_path / name)
        build_step(str(p), runs[name], loss="cross-entropy", optimizer="sgd", precision="fp32")
    train(runs["one"], str(tmp_path / "d.npz"), batch_size=16, max_steps=1, progress=False)
    for name, extra in (("sync", ["--sync-bn"]), ("own", [])):
        res = _dp(runs[name], tmp_path / "d.npz", "--batch-size", "8", "--max-steps", "1", *extra)
        assert res.returncode == 0, res.stderr[-2000:]
    ref, synced, own = (latest_state(runs[k])[0]["bn.running_mean"] for k in ("one", "sync", "own"))
    np.testing.assert_allclose(synced, ref, rtol=1e-5, atol=1e-6)
    assert not np.allclose(own, ref, rtol=1e-5, atol=1e-6)


def test_max_restarts_resumes_after_a_rank_dies_and_ends_with_the_uninterrupted_weights(tmp_path):
    np.savez(tmp_path / "d.npz", **tiny.blobs(3000))
    whole, hit = (_run(tmp_path, name, optimizer="adamw", precision="fp32", lr=0.01) for name in ("whole", "hit"))
    flags = ["--batch-size", "1", "--epochs", "1", "--checkpoint-every", "100"]
    assert _dp(whole, tmp_path / "d.npz", *flags, timeout=300).returncode == 0
    p = subprocess.Popen(GRAPHMP + ["train", hit, "--data", str(tmp_path / "d.npz"), "--nproc", "2",
                                    "--max-restarts", "1", *flags],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ck = os.path.join(hit, "checkpoint.json")
        deadline = time.time() + 120
        while not os.path.exists(ck) and time.time() < deadline:
            time.sleep(0.05)
        kids = subprocess.run(["pgrep", "-f", f"graphmp.cli train {hit}"], capture_output=True, text=True).stdout.split()
        ranks = [int(k) for k in kids if int(k) != p.pid]
        assert ranks, "no rank processes found"
        os.kill(ranks[-1], signal.SIGKILL)
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, err[-2000:]
    # the restarted job resumed from a checkpoint: it ran fewer than the epoch's 1500 steps
    steps = int(re.search(r"(\d+) data-parallel steps", out).group(1))
    assert steps < 1500 and steps % 100 == 0, out
    a, b = latest_state(whole)[0], latest_state(hit)[0]
    meta = json.loads(open(os.path.join(whole, "train.json")).read())
    for w in meta["weights"]:
        np.testing.assert_array_equal(b[w], a[w], err_msg=w)


def test_nccl_without_cuda_is_one_line_naming_gloo(tmp_path):
    np.savez(tmp_path / "d.npz", **tiny.blobs(32))
    run = _run(tmp_path, "run", optimizer="sgd", precision="fp32")
    res = _dp(run, tmp_path / "d.npz", "--batch-size", "8", "--dist-backend", "nccl")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl is a valid choice here")
    assert res.returncode == 2
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("graphmp: error:")]
    assert errors and all("--dist-backend nccl" in ln and "--dist-backend gloo" in ln for ln in errors), errors
    assert "Traceback" not in res.stderr


def test_cuda_ranks_bind_their_local_gpu_and_reduce_with_nccl(monkeypatch):
    """What a rank asks for on a CUDA machine (the choice only: GPUs are not here): ONNX
    Runtime's CUDA provider on device LOCAL_RANK, NCCL when torch has CUDA, gloo when not."""
    from graphmp.session import CPU, CUDA
    from graphmp.train import distributed, device
    from graphmp.train.config import TrainConfig
    monkeypatch.setattr(device, "providers_for", lambda d: ([CUDA, CPU], None))
    c = TrainConfig.from_kwargs(device="auto")
    for has_cuda, backend in ((True, "nccl"), (False, "gloo")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: has_cuda)
        providers, got, _ = distributed._devices(torch, c, distributed.DistOptions(), local_rank=3)
        assert providers == [(CUDA, {"device_id": 3}), CPU] and got == backend
    monkeypatch.setattr(device, "providers_for", lambda d: ([CPU], None))
    assert distributed._devices(torch, c, distributed.DistOptions(), local_rank=3)[:2] == ([CPU], "gloo")


def test_data_that_is_a_file_the_run_writes_is_refused_and_kept(tmp_path):
    """--data naming a checkpoint file the run would write (32 samples, 2 x 8: the run ends
    at step 2 and rank 0 writes ckpt-000000002.npz): refused before any rank writes, and
    the user's file is left as it was."""
    run = _run(tmp_path, "run", optimizer="sgd", precision="fp32")
    victim = os.path.join(run, "ckpt-000000002.npz")
    np.savez(victim, **tiny.blobs(32))          # valid training data, in the run's own file name
    before = open(victim, "rb").read()
    res = _dp(run, victim, "--batch-size", "8")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert any("graphmp: error: rank" in ln and "a file graphmp writes" in ln for ln in res.stderr.splitlines())
    assert open(victim, "rb").read() == before

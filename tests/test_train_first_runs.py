"""A user's first training runs (issue 37): a short run applies steps (the dynamic loss
scale backs off within the first step instead of skipping the run's steps), the progress
line never shows -0.0000, loss.png reads at any batch size, and a data-parallel run leaves
the run folder describing the run that just ended (a world-size mismatch refused once,
before any rank starts)."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest

from fixtures import tiny
from graphmp.train import plot
from graphmp.train.first_step import FirstStepSearch
from graphmp.train.loop import _loss_text

GRAPHMP = [sys.executable, "-m", "graphmp.cli"]


def _cli(*args, timeout=300):
    return subprocess.run(GRAPHMP + [str(a) for a in args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """A small CNN (Conv, BatchNorm, Relu, MaxPool, Gemm) and 64 8x8 images of 4 classes."""
    d = tmp_path_factory.mktemp("cnn")
    onnx.save(tiny.cnn(), d / "cnn.onnx")
    np.savez(d / "train.npz", **tiny.bars(64))
    return d


def _build(tmp_path, data_dir, name="run"):
    """The CNN's step graph, its dynamic loss scale starting at 2^24 (its cap), where FP16
    gradients of order 0.01 and up overflow."""
    run = tmp_path / name
    res = _cli("train-graph", data_dir / "cnn.onnx", "-o", run, "--loss", "cross-entropy", "--optimizer", "adamw",
               "--lr", "1e-3", "--init-scale", str(2.0**24))
    assert res.returncode == 0, res.stderr
    return run


# --- the search itself ------------------------------------------------------------------------

CFG = {"init_scale": 2.0**16, "min_scale": 1.0, "backoff": 0.5}


class _FakeStep:
    """A step that overflows above `fits` and halves the scale on each overflow, as the graph does."""

    def __init__(self, fits: float, loss: float = 1.0, scale: float = 2.0**16):
        self.fits, self.loss, self.scale, self.calls = fits, loss, scale, 0

    def __call__(self):
        self.calls += 1
        if self.scale > self.fits:
            self.scale /= 2
            return self.loss, False, self.scale
        return self.loss, True, self.scale


def test_the_first_step_retries_at_the_backed_off_scale_until_it_applies():
    search = FirstStepSearch.for_run(CFG, dynamic=True, applied_before=0)
    assert search.max_tries == 17  # 65536 -> 1 in 16 halvings, and the floor itself
    step = _FakeStep(fits=16.0)
    loss, applied, scale = search.run(step)
    assert applied and scale == 16.0 and step.calls == 13
    assert search.as_dict() == {"tries": 12, "from_scale": 65536.0, "to_scale": 16.0}
    later = _FakeStep(fits=4.0, scale=16.0)  # an overflow after the first applied step: skipped as before
    assert search.run(later) == (1.0, False, 8.0) and later.calls == 1


def test_no_retry_for_a_nonfinite_loss_a_fixed_scale_or_a_run_that_has_trained():
    nan_loss = _FakeStep(fits=16.0, loss=float("nan"))
    assert not FirstStepSearch.for_run(CFG, True, 0).run(nan_loss)[1] and nan_loss.calls == 1
    for search in (FirstStepSearch.for_run(CFG, dynamic=False, applied_before=0),
                   FirstStepSearch.for_run(CFG, dynamic=True, applied_before=3)):
        step = _FakeStep(fits=16.0)
        assert not search.run(step)[1] and step.calls == 1 and search.as_dict() is None


def test_the_retries_end_at_the_scale_floor():
    search = FirstStepSearch.for_run(dict(CFG, min_scale=2.0**10), True, 0)
    step = _FakeStep(fits=0.5)  # never fits: the gradients overflow at any scale
    assert not search.run(step)[1]
    assert step.calls == 1 + search.max_tries and search.as_dict()["to_scale"] is None


# --- through the CLI -------------------------------------------------------------------------

def test_a_three_step_first_run_applies_steps(tmp_path, digits):
    """Before, the first ~19 steps of this run were skipped backing off from 2^24 and
    `--max-steps 3` applied none (exit 1)."""
    run = _build(tmp_path, digits)
    res = _cli("train", run, "--data", digits / "train.npz", "--batch-size", "8", "--max-steps", "3")
    assert res.returncode == 0, res.stderr
    summary = json.loads((run / "summary.json").read_text())
    # the first step is applied; a later one may still overflow and back off as usual
    assert summary["optimizer_steps"] >= 1 and summary["optimizer_steps"] + summary["skipped_steps"] == 3
    backoff = summary["first_step_backoff"]
    assert backoff["tries"] >= 1 and backoff["from_scale"] == 2.0**24 and backoff["to_scale"] < 2.0**24
    assert summary["final_scale"] <= backoff["to_scale"]
    assert f"backed off {2.0**24:g} -> {backoff['to_scale']:g}" in res.stdout
    # the resumed run has trained: no retry, nothing said about it
    res = _cli("train", run, "--data", digits / "train.npz", "--batch-size", "8", "--max-steps", "5")
    assert res.returncode == 0 and "backed off" not in res.stdout and res.stdout.startswith("steps: ")
    assert json.loads((run / "summary.json").read_text())["first_step_backoff"] is None


def test_no_resume_says_which_checkpoint_it_replaces(tmp_path, digits):
    run = _build(tmp_path, digits)
    assert _cli("train", run, "--data", digits / "train.npz", "--batch-size", "8", "--max-steps", "4",
                "-q").returncode == 0
    res = _cli("train", run, "--data", digits / "train.npz", "--batch-size", "8", "--max-steps", "2",
               "--no-resume")
    assert res.returncode == 0, res.stderr
    assert "starting over (--no-resume): the run's checkpoint at step 4 is replaced" in res.stdout
    assert json.loads((run / "checkpoint.json").read_text())["step"] == 2


def test_the_progress_line_never_shows_negative_zero():
    assert _loss_text(-0.0) == "0.0000" and _loss_text(-1e-9) == "0.0000"
    assert _loss_text(-0.5) == "-0.5000" and _loss_text(1.23456) == "1.2346"


# --- loss.png --------------------------------------------------------------------------------

def test_smoothing_keeps_the_ends_and_averages_the_middle():
    y = np.array([0.0, 10.0, 0.0, 10.0, 0.0, 10.0, 0.0])
    s = plot.smooth(y, 3)
    assert s[0] == 5.0 and s[-1] == 5.0 and np.allclose(s[1:-1], [10 / 3, 20 / 3, 10 / 3, 20 / 3, 10 / 3])
    np.testing.assert_array_equal(plot.smooth(y, 1), y)


def test_the_loss_axis_is_logarithmic_only_for_a_wide_positive_range():
    falling = 1000 * np.exp(-np.arange(600) / 100)
    no_eval = np.zeros((0, 2))
    assert plot._log_axis(falling, plot.smooth(falling, 11), no_eval)
    flat = 2 - np.arange(600) / 600
    assert not plot._log_axis(flat, plot.smooth(flat, 11), no_eval)
    with_zeros = np.where(np.arange(600) % 5 == 0, 0.0, falling)  # raw zeros, a positive trend
    assert plot._log_axis(with_zeros, plot.smooth(with_zeros, 11), no_eval)
    assert not plot._log_axis(flat, np.zeros(600), no_eval)


def test_loss_png_of_a_batch_1_run_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(0)
    loss = 1000 * np.exp(-np.arange(1200) / 200) * rng.exponential(1, 1200)
    path, hint = plot.write_loss_png(tmp_path / "loss.png", list(loss), [(600, 5.0), (1200, 1.0)])
    assert hint is None and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


# --- data parallel ---------------------------------------------------------------------------

def test_a_data_parallel_run_refuses_a_world_size_mismatch_before_starting_ranks_and_writes_its_summary(
        tmp_path, digits):
    pytest.importorskip("torch", reason="data-parallel training needs torch")
    run = _build(tmp_path, digits)
    data = digits / "train.npz"
    assert _cli("train", run, "--data", data, "--batch-size", "8", "--max-steps", "4", "-q").returncode == 0
    old_summary = json.loads((run / "summary.json").read_text())
    t0 = time.perf_counter()
    res = _cli("train", run, "--data", data, "--batch-size", "8", "--nproc", "2", "--max-steps", "6")
    assert res.returncode == 2 and time.perf_counter() - t0 < 15
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "made by 1 rank(s) x batch 8, this job is 2 x 8" in lines[0], res.stderr
    res = _cli("train", run, "--data", data, "--batch-size", "8", "--nproc", "2", "--max-steps", "6", "--epochs", "2",
               "--no-resume", timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "starting over (--no-resume): the run's checkpoint at step 4 is replaced" in res.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6 and summary != old_summary
    assert summary["first_step_backoff"]["tries"] >= 1 and summary["updates"] - summary["skipped"] >= 1
    assert json.loads((run / "checkpoint.json").read_text())["step"] == 6
    assert summary["loss_curve"] in os.listdir(run)


def test_train_graph_names_a_guessed_class_axis_as_a_warning(tmp_path):
    """A tagger's [b, t, 7] output: cross-entropy's default class axis (1, torch's) is the
    symbolic t. train-graph builds it, and says so as a warning line naming --class-axis -1."""
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 7)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "tagger",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", 4])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "t", 7])], [w])
    src = tmp_path / "tagger.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    res = _cli("train-graph", src, "-o", tmp_path / "run", "--loss", "cross-entropy", "--shapes", "x:2x5x4")
    assert res.returncode == 0, res.stderr
    warned = [x for x in res.stderr.splitlines() if "as the class axis" in x]
    assert len(warned) == 1 and warned[0].startswith("warning: ") and "--class-axis -1" in warned[0], res.stderr

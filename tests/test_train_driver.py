"""The training driver (graphmp.train.loop.train / `graphmp train`): data checks before any
step, eval per epoch, the loss curve (PNG, or CSV without matplotlib), and device honesty.
Real step graphs and ONNX Runtime (CPU) sessions on the tiny models of tests/fixtures/tiny.py.
"""
import json
import os
import struct
import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fixtures import tiny as tm
from graphmp.cli import main
from graphmp.errors import GraphmpError
from graphmp.train import plot
from graphmp.train.data import check_labels, label_rule, make_source
from graphmp.train.loop import CHECKPOINT, Evaluator, evaluate, latest_state, load_run, train
from graphmp.train.step import build_step


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    """A built (never trained) fp32 SGD run of the MLP: 4 inputs, 3 classes."""
    d = tmp_path_factory.mktemp("mlp")
    onnx.save(tm.mlp(), str(d / "mlp.onnx"))
    build_step(str(d / "mlp.onnx"), str(d / "run"), precision="fp32", optimizer="sgd", lr=0.1)
    return str(d / "run")


@pytest.fixture
def run(mlp_run, tmp_path):
    """A fresh copy of the built run (each test trains its own)."""
    import shutil
    dst = str(tmp_path / "run")
    shutil.copytree(mlp_run, dst)
    return dst


def _no_step_ran(run_dir):
    return not os.path.exists(os.path.join(run_dir, CHECKPOINT)) and \
        not any(f.startswith("ckpt-") for f in os.listdir(run_dir))


def _set_config(run_dir, **kw):
    p = os.path.join(run_dir, "train.json")
    meta = json.load(open(p))
    meta["config"].update(kw)
    json.dump(meta, open(p, "w"))


# --- labels ------------------------------------------------------------------------------------------

def test_label_out_of_range_is_named_before_any_step(run, tmp_path, capsys):
    d = tm.blobs(64)
    d["labels"][[12, 40]] = 3  # 3 classes: 0..2
    np.savez(tmp_path / "bad.npz", **d)
    assert main(["train", run, "--data", str(tmp_path / "bad.npz"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "bad.npz" in err and "'labels'" in err and "label 3 at sample 12" in err and "2 bad label(s)" in err
    assert "0 <= label < 3" in err
    assert _no_step_ran(run)


def test_negative_label_is_refused_unless_it_is_the_ignore_index(run):
    d = tm.blobs(64)
    d["labels"][7] = -1
    with pytest.raises(GraphmpError, match=r"label -1 at sample 7 .*ignore index"):
        train(run, d, batch_size=16, progress=False)
    assert _no_step_ran(run)
    # with an ignore index in the run's config, that value passes and others still fail
    _set_config(run, ignore_index=-1)
    rule = label_rule(run, load_run(run))
    assert rule == {"name": "labels", "axis": 1, "num_classes": 3, "ignore_index": -1}
    check_labels(d["labels"], rule, "data")
    d["labels"][9] = -100
    with pytest.raises(GraphmpError, match=r"label -100 at sample 9 .* or the ignore index -1"):
        check_labels(d["labels"], rule, "data")
    # num_classes from the config overrides the output's class dim
    _set_config(run, ignore_index=None, num_classes=2)
    with pytest.raises(GraphmpError, match="0 <= label < 2"):
        check_labels(np.array([0, 1, 2]), label_rule(run, load_run(run)), "data")


def test_eval_labels_and_batches_are_checked_too(run):
    good, bad = tm.blobs(64), tm.blobs(32, seed=3)
    bad["labels"][5] = 9
    with pytest.raises(GraphmpError, match=r"eval data: 'labels' holds label 9 at sample 5"):
        train(run, good, batch_size=16, eval_data=bad, progress=False)
    assert _no_step_ran(run)
    # an iterable of batches: checked as each batch comes, the position within the batch named
    batches = [{k: v[i * 16:(i + 1) * 16].copy() for k, v in good.items()} for i in range(4)]
    batches[2]["labels"][3] = 5
    with pytest.raises(GraphmpError, match=r"batch 2 of epoch 0: 'labels' holds label 5 at sample of this batch 3"):
        train(run, batches, progress=False, checkpoint_every=0)


def test_class_count_and_position_follow_the_class_axis(tmp_path):
    """An LM-style output [N, T, V]: classes on axis 1 (T) by default, on -1 (V) with class_axis=-1;
    a symbolic class dim leaves only negative labels checkable; 2-D labels name the element."""
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5, 4]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 7])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5, 7])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "infer.onnx"))
    meta = {"infer_model": "infer.onnx", "model_output": "logits", "label": {"name": "labels"},
            "config": {"loss": "cross-entropy"}}
    assert label_rule(tmp_path, meta)["num_classes"] == 5
    meta["config"]["class_axis"] = -1
    rule = label_rule(tmp_path, meta)
    assert rule["num_classes"] == 7 and rule["axis"] == -1
    labels = np.zeros((3, 5), np.int64)
    labels[2, 4] = 7
    with pytest.raises(GraphmpError, match=r"label 7 at sample 2, element \(2, 4\)"):
        check_labels(labels, rule, "lm.npz")
    meta["config"]["loss"] = "mse"
    assert label_rule(tmp_path, meta) is None
    # symbolic vocab: only negatives are checked
    rule = dict(rule, num_classes=None)
    check_labels(np.array([[0, 10**6]]), rule, "lm.npz")
    with pytest.raises(GraphmpError, match="label -3"):
        check_labels(np.array([[0, -3]]), rule, "lm.npz")


def test_eval_loss_follows_class_axis_and_ignore_index_like_ort(tmp_path):
    """Evaluator's numpy cross-entropy equals ONNX Runtime's SoftmaxCrossEntropyLoss (mean,
    ignore_index) on [N, T, V] logits with classes on the last axis."""
    r = np.random.default_rng(0)
    w = r.normal(size=(4, 7)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5, 4]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 7])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5, 7])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "infer.onnx"))
    meta = {"infer_model": "infer.onnx", "model_output": "logits", "weights": ["w"], "bn_stats": [],
            "inputs": {"x": ["N", 5, 4]}, "input_types": {"x": "float32"},
            "label": {"name": "labels", "shape": ["N", 5], "dtype": "int64"},
            "config": {"loss": "cross-entropy", "precision": "fp32", "class_axis": -1, "ignore_index": -100}}
    x = r.normal(size=(6, 5, 4)).astype(np.float32)
    t = r.integers(0, 7, (6, 5))
    t[r.random((6, 5)) < 0.3] = -100
    src = make_source({"x": x, "labels": t}, meta, "eval data")
    ev = Evaluator(tmp_path, meta, {"w": w}).run({"w": w}, src, batch_size=4)  # 2 batches: 4 + 2 samples
    sce = helper.make_graph([helper.make_node("SoftmaxCrossEntropyLoss", ["z", "t"], ["l"], reduction="mean",
                                              ignore_index=-100)], "sce",
                            [helper.make_tensor_value_info("z", TensorProto.FLOAT, [6, 7, 5]),
                             helper.make_tensor_value_info("t", TensorProto.INT64, [6, 5])],
                            [helper.make_tensor_value_info("l", TensorProto.FLOAT, [])])
    s = ort.InferenceSession(helper.make_model(sce, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(),
                             providers=["CPUExecutionProvider"])
    ref = s.run(None, {"z": np.ascontiguousarray(np.moveaxis(x @ w, -1, 1)), "t": t})[0]
    assert ev["loss"] == pytest.approx(float(ref), rel=1e-5)
    keep = t != -100
    assert ev["accuracy"] == pytest.approx(((x @ w).argmax(-1) == t)[keep].mean())
    assert ev["samples"] == 6


# --- NaN / inf in the data ---------------------------------------------------------------------------

def _with_nan(n=64):
    d = tm.blobs(n)
    d["x"][9, 1] = np.nan
    d["x"][20] = np.inf
    return d


def test_nonfinite_input_is_reported_as_such(run, tmp_path, capsys):
    np.savez(tmp_path / "nan.npz", **_with_nan())
    assert main(["train", run, "--data", str(tmp_path / "nan.npz"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nan.npz" in err
    assert "'x' has 5 NaN/inf value(s), first at sample 9" in err and "2 of 64 samples" in err
    assert "--skip-bad-samples" in err and "gradients" not in err
    assert _no_step_ran(run)
    with pytest.raises(GraphmpError, match=r"eval data: the input data is not finite: 'x' has 5"):
        train(run, tm.blobs(64), eval_data=_with_nan(), progress=False)
    assert _no_step_ran(run)


def test_skip_bad_samples_equals_training_on_the_clean_samples(run, tmp_path, capsys):
    d = _with_nan()
    clean = {k: np.delete(v, [9, 20], axis=0) for k, v in d.items()}
    ref_dir = str(tmp_path / "ref")
    import shutil
    shutil.copytree(run, ref_dir)
    ref = train(ref_dir, clean, epochs=2, batch_size=16, progress=False)
    res = train(run, d, epochs=2, batch_size=16, eval_data=_with_nan(32), skip_bad_samples=True, progress=True)
    assert res.summary["dropped_samples"] == {"train": 2, "eval": 2}
    assert res.summary["steps"] == ref.summary["steps"] == 2 * (62 // 16)
    for k, v in ref.state.items():
        assert np.array_equal(v, res.state[k]), k
    assert res.summary["eval"]["samples"] == 30
    err = capsys.readouterr().err
    assert "train data: dropped 2 sample(s)" in err and "eval data: dropped 2 sample(s)" in err
    # an iterable: bad rows dropped from their batch, counted as they come
    batches = [{k: v[i * 16:(i + 1) * 16] for k, v in d.items()} for i in range(4)]
    res = train(run, batches, skip_bad_samples=True, progress=False, resume=False, checkpoint_every=0)
    assert res.summary["dropped_samples"]["train"] == 2 and res.summary["steps"] == 4


# --- eval per epoch -----------------------------------------------------------------------------------

def test_eval_every_epoch_in_output_and_summary(run, tmp_path, capsys):
    np.savez(tmp_path / "train.npz", **tm.blobs(256, seed=1))
    np.savez(tmp_path / "eval.npz", **tm.blobs(128, seed=2))
    assert main(["train", run, "--data", str(tmp_path / "train.npz"), "--eval", str(tmp_path / "eval.npz"),
                 "--epochs", "3", "--batch-size", "32", "--device", "cpu"]) == 0
    cap = capsys.readouterr()
    summary = json.load(open(os.path.join(run, "summary.json")))
    per = summary["eval_per_epoch"]
    assert [(e["epoch"], e["step"]) for e in per] == [(1, 8), (2, 16), (3, 24)]
    for e in per:  # each in the progress output as it happened
        assert f"epoch {e['epoch']} (step {e['step']}): eval loss {e['loss']:.4f}, accuracy {e['accuracy']:.4f}" \
            in cap.err
    assert "eval per epoch: 1: " in cap.out
    # the last entry is the final weights' eval; the run learned in between
    final = evaluate(run, str(tmp_path / "eval.npz"))
    assert per[-1]["loss"] == pytest.approx(final["loss"], rel=1e-9) and summary["eval"] == per[-1]
    assert per[-1]["loss"] < per[0]["loss"]
    # before training, eval loss = the step graph's loss on the same full batch (fp32, no BN/Dropout)
    fresh = str(tmp_path / "fresh")
    import shutil
    shutil.copytree(run, fresh, ignore=shutil.ignore_patterns("ckpt-*", CHECKPOINT, "summary.json", "loss.png", "loss.csv"))
    ev = tm.blobs(128, seed=2)
    e0 = evaluate(fresh, ev)
    r = train(fresh, ev, batch_size=128, max_steps=1, progress=False, drop_last=True)
    assert e0["loss"] == pytest.approx(r.history["loss"][0], rel=1e-5)


# --- loss curve ---------------------------------------------------------------------------------------

def _png(path):
    """(width, height) of a PNG, checking signature, chunk CRCs and data size."""
    b = open(path, "rb").read()
    assert b[:8] == b"\x89PNG\r\n\x1a\n"
    i, chunks = 8, {}
    while i < len(b):
        n, = struct.unpack(">I", b[i:i + 4])
        kind, data = b[i + 4:i + 8], b[i + 8:i + 8 + n]
        assert struct.unpack(">I", b[i + 8 + n:i + 12 + n])[0] == zlib.crc32(kind + data) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + data
        i += 12 + n
    assert b"IEND" in chunks
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    raw = zlib.decompress(chunks[b"IDAT"])
    assert depth == 8 and len(raw) == h * (1 + w * {2: 3, 6: 4}[color])
    return w, h


def _csv(path):
    """The rows of loss.csv after its header, as (step, train loss or None, eval loss or None)."""
    lines = open(path).read().splitlines()
    assert lines[0] == plot.CSV_HEADER
    return [(int(s), float(t) if t else None, float(e) if e else None)
            for s, t, e in (line.split(",") for line in lines[1:])]


def _no_matplotlib(monkeypatch):
    def missing(*a, **k):
        raise ImportError("No module named 'matplotlib'")
    monkeypatch.setattr(plot, "_png_matplotlib", missing)


def test_without_matplotlib_the_losses_go_to_csv_with_a_hint(tmp_path, monkeypatch):
    _no_matplotlib(monkeypatch)
    curve = list(1.0 + np.exp(-np.arange(6) / 3))
    curve[2] = float("inf")  # a skipped step keeps its row, as recorded
    path, hint = plot.write_loss_png(tmp_path / "loss.png", curve, [(3, 1.5), (6, 1.2)], title="t")
    assert path == str(tmp_path / "loss.csv") and not (tmp_path / "loss.png").exists()
    assert "pip install 'graphmp[plot]'" in hint and "loss.png" in hint and path in hint and "\n" not in hint
    rows = _csv(path)
    assert [s for s, _, _ in rows] == [1, 2, 3, 4, 5, 6]
    assert [t for _, t, _ in rows] == curve  # repr: every float read back exactly
    assert [e for _, _, e in rows] == [None, None, 1.5, None, None, 1.2]
    # an eval point with no step of its own, and a second one at a step, get rows of their own
    path, _ = plot.write_loss_png(tmp_path / "loss.png", [2.0, 1.0], [(0, 3.0), (2, 1.1), (2, 1.05)],
                                  use_matplotlib=False)
    assert _csv(path) == [(0, None, 3.0), (1, 2.0, None), (2, 1.0, 1.1), (2, None, 1.05)]
    assert plot.write_loss_png(tmp_path / "e.png", [], use_matplotlib=False)[0] == str(tmp_path / "loss.csv")
    assert _csv(tmp_path / "loss.csv") == []
    with pytest.raises(ImportError):  # asked for matplotlib explicitly: no silent CSV
        plot.write_loss_png(tmp_path / "x.png", curve, use_matplotlib=True)


def test_png_with_matplotlib_when_importable(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread
    curve = 1.0 + np.exp(-np.arange(60) / 15)
    a, hint = plot.write_loss_png(tmp_path / "a.png", curve, [(30, 1.5)], use_matplotlib=True)
    b, _ = plot.write_loss_png(tmp_path / "b.png", curve * 2, [(30, 1.5)])
    assert a == str(tmp_path / "a.png") and hint is None and not (tmp_path / "loss.csv").exists()
    assert _png(a) == (plot.WIDTH, plot.HEIGHT)
    assert imread(a).shape[:2] == (plot.HEIGHT, plot.WIDTH)
    assert not np.array_equal(imread(a), imread(b))
    long = 1 + np.random.default_rng(0).random(10_000)
    long[::97] = np.inf  # a long noisy run (more steps than pixel columns) with skipped steps still draws
    assert _png(plot.write_loss_png(tmp_path / "l.png", long)[0]) == (plot.WIDTH, plot.HEIGHT)


def test_run_loss_curve_covers_the_whole_run_across_resume(run, monkeypatch):
    _no_matplotlib(monkeypatch)  # loss.csv: the numbers the curve is drawn from
    d, ev = tm.blobs(96), tm.blobs(32, seed=5)
    first = train(run, d, epochs=2, batch_size=16, eval_data=ev, max_steps=8, progress=False)
    second = train(run, d, epochs=2, batch_size=16, eval_data=ev, progress=False)
    _, ck = latest_state(run)
    losses = first.history["loss"] + second.history["loss"]
    assert ck["train_loss"] == losses and len(losses) == 12
    evs = [(e["step"], e["loss"]) for e in ck["eval_history"]]
    assert [s for s, _ in evs] == [6, 12]
    rows = _csv(os.path.join(run, "loss.csv"))
    assert [(s, t) for s, t, _ in rows] == list(zip(range(1, 13), losses))
    assert [(s, e) for s, _, e in rows if e is not None] == evs


def test_run_loss_png_with_matplotlib(run):
    pytest.importorskip("matplotlib")
    train(run, tm.blobs(32), epochs=1, batch_size=16, eval_data=tm.blobs(16, seed=5), progress=False)
    assert _png(os.path.join(run, "loss.png")) == (plot.WIDTH, plot.HEIGHT)
    assert not os.path.exists(os.path.join(run, "loss.csv"))


# --- device honesty -----------------------------------------------------------------------------------

def test_device_cuda_without_cuda_fails_in_one_line(run, tmp_path, capsys):
    import graphmp.model_runs as model_runs
    if model_runs.cuda_available():
        pytest.skip("this onnxruntime has CUDA")
    np.savez(tmp_path / "train.npz", **tm.blobs(64))
    assert main(["train", run, "--data", str(tmp_path / "train.npz"), "--device", "cuda", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda" in err and "no CUDAExecutionProvider" in err
    assert _no_step_ran(run)
    # auto falls back and says so, in the output and the summary
    assert main(["train", run, "--data", str(tmp_path / "train.npz"), "--device", "auto"]) == 0  # -q: silent
    out = capsys.readouterr().out
    s = json.load(open(os.path.join(run, "summary.json")))
    assert "device: auto: no CUDA in this onnxruntime" in out and s["device_note"].startswith("auto: no CUDA")
    assert s["providers"] == ["CPUExecutionProvider"] and s["device"] == "cpu"


def test_session_that_did_not_get_cuda_is_caught(run, monkeypatch):
    """onnxruntime lists CUDA but the session comes up on the CPU (here: a CPU build told it has
    CUDA; on a GPU machine: CUDA libraries that fail to load). The real session is checked."""
    import graphmp.model_runs as model_runs
    if model_runs.cuda_available():
        pytest.skip("this onnxruntime has CUDA")
    monkeypatch.setattr(model_runs, "cuda_available", lambda: True)
    d = tm.blobs(64)
    with pytest.warns(UserWarning), pytest.raises(GraphmpError, match=r"--device cuda: the training session "
                                                  r"came up on CPUExecutionProvider"):
        train(run, d, batch_size=16, device="cuda", progress=False)
    assert _no_step_ran(run)
    with pytest.warns(UserWarning):
        res = train(run, d, batch_size=16, device="auto", eval_data=d, progress=False)
    note = res.summary["device_note"]
    assert "training session came up on CPUExecutionProvider" in note and "eval session" in note
    assert res.summary["steps"] == 4 and res.summary["providers"] == ["CPUExecutionProvider"]


def test_nonfinite_mse_targets_are_data_errors_too(tmp_path):
    onnx.save(tm.mlp(), str(tmp_path / "mlp.onnx"))
    run = str(tmp_path / "run")
    build_step(str(tmp_path / "mlp.onnx"), run, loss="mse", precision="fp32")
    d = tm.blobs(32)
    d["labels"] = np.zeros((32, 3), np.float32)
    d["labels"][17, 2] = np.nan
    with pytest.raises(GraphmpError, match=r"'labels' has 1 NaN/inf value\(s\), first at sample 17"):
        train(run, d, batch_size=8, progress=False)
    assert _no_step_ran(run)
    d["labels"][17, 2] = -5.0  # any finite target is fine for mse (no class check)
    assert train(run, d, batch_size=8, progress=False).summary["steps"] == 4


# --- ONNX Runtime failures on user data; the precision eval runs in -----------------------------------

def _mlp_free_features():
    """The MLP with its feature axis declared symbolic ('F'): data of any width passes the data
    checks, and ONNX Runtime's Gemm is what refuses a width other than 4."""
    m = tm.mlp()
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "F"
    return m


def test_ort_failure_on_eval_data_is_one_line_naming_the_file(tmp_path, capsys):
    onnx.save(_mlp_free_features(), str(tmp_path / "m.onnx"))
    run_dir = str(tmp_path / "run")
    build_step(str(tmp_path / "m.onnx"), run_dir, precision="fp32", optimizer="sgd", lr=0.1)
    np.savez(tmp_path / "train.npz", **tm.blobs(64))
    wide = tm.blobs(32, n_in=5)
    np.savez(tmp_path / "wide.npz", **wide)
    assert main(["train", run_dir, "--data", str(tmp_path / "train.npz"), "--eval", str(tmp_path / "wide.npz"),
                 "--batch-size", "16", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "wide.npz" in err and "ONNX Runtime could not run the inference model" in err, err
    # the same data as training data: the step graph's failure, named the same way, before any checkpoint
    assert main(["train", run_dir, "--data", str(tmp_path / "wide.npz"), "--batch-size", "16", "-q",
                 "--no-resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "wide.npz" in err and "the training step graph" in err, err


def test_eval_of_a_bf16_run_says_what_precision_it_ran_in(run, tmp_path):
    """A --precision bf16 run is evaluated in BF16 (graphmp.convert target bf16) where ONNX
    Runtime has the kernels; where it has not (the CPU provider), eval runs in FP32 and the
    evaluator, the result and the summary line say so -- never FP32 passed off as BF16."""
    from graphmp.train.loop import format_summary
    data = tm.blobs(64)
    meta = load_run(run)
    state = latest_state(run)[0]
    ref = Evaluator(run, meta, state, sample_batch=data).run(state, make_source(data, meta), 32)
    assert ref["precision"] == "fp32"
    _set_config(run, precision="bf16")
    meta = load_run(run)
    ev = Evaluator(run, meta, state, sample_batch=data)
    res = ev.run(state, make_source(data, meta), 32)
    assert res["precision"] == ev.precision
    bf16_types = {i.type for i in ev.sess.get_inputs()} | {o.type for o in ev.sess.get_outputs()}
    if ev.precision == "bf16":  # a provider with BF16 kernels: close to FP32, not equal
        assert ev.note is None or "FP32" not in ev.note
        assert abs(res["loss"] - ref["loss"]) < 0.05 * ref["loss"]
    else:
        assert "eval runs in FP32, not BF16 as trained" in ev.note
        assert "implementation for" in ev.note  # refused for a missing BF16 kernel, i.e. BF16 was tried
        assert res["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert bf16_types == {"tensor(float)"}
        line = format_summary({"steps": 0, "optimizer_steps": 0, "skipped_steps": 0, "final_scale": 1.0,
                               "loss": None, "eval": res, "seconds_per_step": None, "precision": "bf16"})
        assert "(evaluated in fp32)" in line


def test_train_without_matplotlib_says_how_to_get_the_png(run, monkeypatch, capsys):
    _no_matplotlib(monkeypatch)
    d = tm.blobs(32)
    r = train(run, d, epochs=1, batch_size=16, progress=True)
    err = capsys.readouterr().err
    hints = [line for line in err.splitlines() if "pip install 'graphmp[plot]'" in line]
    assert len(hints) == 1 and "loss.png" in hints[0] and os.path.join(run, "loss.csv") in hints[0]
    assert r.summary["loss_curve"] == "loss.csv" and not os.path.exists(os.path.join(run, "loss.png"))
    assert json.load(open(os.path.join(run, "summary.json")))["loss_curve"] == "loss.csv"
    train(run, d, epochs=2, batch_size=16, progress=False)  # quiet: the files, no hint
    assert "graphmp[plot]" not in capsys.readouterr().err
    assert [s for s, _, _ in _csv(os.path.join(run, "loss.csv"))] == [1, 2, 3, 4]

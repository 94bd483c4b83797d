"""Learning-rate schedules and gradient accumulation of the training step (graphmp/train/optim.py),
measured on the real step graph in ONNX Runtime: the lr a step applied is read from the weight
change of a plain SGD step (w - w' = lr * g, g the exposed gradient); accumulation is checked
against one big batch.
"""
import math
import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
import onnx

from graphmp.cli import main
from graphmp.errors import GraphmpError
from graphmp.train.flat import next_state
from graphmp.train.loop import StepRunner, latest_state, load_run, train
from graphmp.train.step import NEXT, SCALE, STEP, build_step
from fixtures import tiny as tm

LR, WARM, TOTAL = 0.5, 4, 12


def expected_lr(t, schedule):
    """HF get_{constant,linear,cosine}_schedule_with_warmup, written out independently."""
    if t < WARM:
        return LR * t / WARM
    if schedule == "constant":
        return LR
    progress = (t - WARM) / (TOTAL - WARM)
    if schedule == "linear":
        return LR * max(0.0, 1.0 - progress)
    return LR * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@pytest.fixture(scope="module")
def linear_path(tmp_path_factory):
    """y = x @ W (W [3,1]), trained with MSE: the gradient is never zero on random data."""
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "lin",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
                          [numpy_helper.from_array(np.array([[0.3], [-0.2], [0.1]], np.float32), "W")])
    p = str(tmp_path_factory.mktemp("lin") / "lin.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), p)
    return p


def _applied_lrs(run, steps, start_state=None):
    """Run `steps` SGD steps; return the lr each applied: mean((w - w') / g) (g = exposed grad)."""
    meta = load_run(run)
    state = start_state or latest_state(run)[0]
    r = StepRunner(run, meta, state, device_state=False)  # r.state: numpy
    names = [o.name for o in r.sess.get_outputs()]
    rng = np.random.default_rng(0)
    lrs = []
    for _ in range(steps):
        x = rng.normal(0, 1, (8, 3)).astype(np.float32)
        feeds = dict(r.state, x=x, labels=rng.normal(0, 1, (8, 1)).astype(np.float32))
        out = dict(zip(names, r.sess.run(None, feeds)))
        g, before, after = out["W__grad"], r.state_numpy()["W"], next_state(meta, out)["W"]
        lrs.append(float(np.mean((before - after) / g)))
        r.state = {n: out[n + NEXT] for n in r.names}
    return lrs, r.state_numpy()


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_schedule_lr_applied_per_step_matches_formula(linear_path, tmp_path, schedule):
    run = str(tmp_path / schedule)
    meta = build_step(linear_path, run, loss="mse", precision="fp32", optimizer="sgd", momentum=0.0, lr=LR,
                      loss_scale=1.0, expose_grads=True, lr_schedule=schedule, warmup_steps=WARM,
                      total_steps=TOTAL)
    assert (meta["config"]["lr_schedule"], meta["config"]["warmup_steps"]) == (schedule, WARM)
    lrs, state = _applied_lrs(run, TOTAL + 2)
    want = [expected_lr(t, schedule) for t in range(TOTAL + 2)]
    np.testing.assert_allclose(lrs, want, rtol=1e-4, atol=1e-6)
    assert lrs[0] == pytest.approx(0.0, abs=1e-7) and lrs[WARM] == pytest.approx(LR, rel=1e-5)  # 0, warmup
    if schedule != "constant":  # middle and end
        mid = (WARM + TOTAL) // 2
        assert lrs[mid] == pytest.approx(LR / 2, rel=1e-4)  # both are at half at the midpoint
        assert lrs[TOTAL] == pytest.approx(0.0, abs=1e-6) and lrs[TOTAL + 1] == pytest.approx(0.0, abs=1e-6)
    assert int(state[STEP]) == TOTAL + 2


def test_schedule_reads_the_step_counter_so_resume_continues_it(linear_path, tmp_path):
    """The lr comes from the optimizer_step state (not baked in): a state at step 7 applies
    the lr of step 7, and a run interrupted and resumed through train() ends bit-identical."""
    kw = dict(loss="mse", precision="fp32", optimizer="sgd", momentum=0.0, lr=LR, loss_scale=1.0,
              expose_grads=True, lr_schedule="cosine", warmup_steps=WARM, total_steps=TOTAL)
    run = str(tmp_path / "run")
    build_step(linear_path, run, **kw)
    state = dict(latest_state(run)[0])
    state[STEP] = np.array(7, np.int64)
    lrs, _ = _applied_lrs(run, 2, state)
    np.testing.assert_allclose(lrs, [expected_lr(7, "cosine"), expected_lr(8, "cosine")], rtol=1e-4)

    rng = np.random.default_rng(3)
    data = {"x": rng.normal(0, 1, (64, 3)).astype(np.float32), "labels": rng.normal(0, 1, (64, 1)).astype(np.float32)}
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    build_step(linear_path, full, **kw)
    build_step(linear_path, part, **kw)
    ref = train(full, data, epochs=2, batch_size=8, progress=False, checkpoint_every=0)
    train(part, data, epochs=2, batch_size=8, progress=False, max_steps=5, checkpoint_every=0)
    got = train(part, data, epochs=2, batch_size=8, progress=False, checkpoint_every=0)
    assert int(got.state[STEP]) == int(ref.state[STEP]) == 16
    assert np.array_equal(got.state["W"], ref.state["W"])


def test_schedule_errors(linear_path, tmp_path, capsys):
    with pytest.raises(GraphmpError, match="needs total_steps"):
        build_step(linear_path, str(tmp_path / "a"), loss="mse", lr_schedule="linear")
    with pytest.raises(GraphmpError, match="must be larger than warmup_steps"):
        build_step(linear_path, str(tmp_path / "b"), loss="mse", lr_schedule="cosine", warmup_steps=10,
                   total_steps=10)
    assert main(["train-graph", linear_path, "-o", str(tmp_path / "c"), "--loss", "mse", "--lr-schedule",
                 "cosine"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs total_steps (--total-steps N" in err and len(err.splitlines()) == 1
    assert main(["train-graph", linear_path, "-o", str(tmp_path / "d"), "--loss", "mse", "--grad-accum", "0"]) == 2
    assert "grad_accum must be >= 1" in capsys.readouterr().err


# --- gradient accumulation --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("mlp") / "mlp.onnx")
    onnx.save(tm.mlp(), p)
    return p


@pytest.mark.parametrize("opt", [dict(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
                                 dict(optimizer="adamw", lr=1e-2, weight_decay=0.05, clip_norm=0.5,
                                      lr_schedule="linear", warmup_steps=1, total_steps=4)],
                         ids=["sgd", "adamw-clip-schedule"])
def test_accumulating_n_micro_batches_equals_one_big_batch(mlp_path, tmp_path, opt):
    n, b, windows = 4, 4, 2
    data = tm.blobs(n * b * windows, seed=5)
    big = str(tmp_path / "big")
    acc = str(tmp_path / "acc")
    kw = dict(precision="fp32", loss_scale="dynamic", init_scale=2.0**10, growth_interval=2, **opt)
    build_step(mlp_path, big, **kw)
    meta = build_step(mlp_path, acc, grad_accum=n, **kw)
    assert {s["input"] for s in meta["state"]} >= {"fc1.weight__accum", "accum_count"}
    st_big = latest_state(big)[0]
    r_big = StepRunner(big, load_run(big), st_big)
    r_acc = StepRunner(acc, meta, latest_state(acc)[0])
    after = dict(st_big)  # the weights after the last update
    for k in range(windows):
        lo = k * n * b
        r_big.step({key: v[lo:lo + n * b] for key, v in data.items()})
        for j in range(n):
            s = lo + j * b
            _, applied, scale = r_acc.step({key: v[s:s + b] for key, v in data.items()})
            st = r_acc.state_numpy()
            if j < n - 1:  # between updates: weights, step and scale stay; the sum grows
                assert int(st[STEP]) == k and scale == 2.0**10
                assert np.array_equal(st["fc2.weight"], after["fc2.weight"])
                assert int(st["accum_count"]) == j + 1 and np.abs(st["fc2.weight__accum"]).sum() > 0
            else:  # the update run: applied, sums zeroed
                assert applied and int(st[STEP]) == k + 1 and int(st["accum_count"]) == 0
                assert not st["fc2.weight__accum"].any()
        after = r_acc.state_numpy()
        ref = r_big.state_numpy()
        for w in meta["weights"]:
            np.testing.assert_allclose(after[w], ref[w], rtol=1e-5, atol=1e-6, err_msg=f"window {k}: {w}")
        assert float(after[SCALE]) == float(ref[SCALE])  # the scale moved as in the big-batch run


def test_overflow_in_one_micro_batch_skips_the_window(mlp_path, tmp_path):
    run = str(tmp_path / "run")
    meta = build_step(mlp_path, run, precision="fp32", optimizer="sgd", lr=0.1, grad_accum=3, init_scale=256.0)
    r = StepRunner(run, meta, latest_state(run)[0])
    w0 = r.state_numpy()
    d = tm.blobs(12, seed=2)
    batches = [{k: v[i * 4:(i + 1) * 4] for k, v in d.items()} for i in range(3)]
    batches[1]["x"] = batches[1]["x"].copy()
    batches[1]["x"][0, 0] = np.inf
    outs = [r.step(b) for b in batches]
    assert [o[1] for o in outs] == [True, False, False]  # micro 2 overflowed; the window's update is skipped
    st = r.state_numpy()
    assert int(st[STEP]) == 0 and float(st[SCALE]) == 128.0 and int(st["accum_count"]) == 0
    assert np.array_equal(st["fc1.weight"], w0["fc1.weight"]) and not st["fc1.weight__accum"].any()
    outs = [r.step(b) for b in [batches[0], batches[2], batches[0]]]  # the next window is clean again
    assert [o[1] for o in outs] == [True, True, True] and int(r.state_numpy()[STEP]) == 1


def test_train_loop_counts_optimizer_steps_with_accumulation(mlp_path, tmp_path):
    run = str(tmp_path / "run")
    build_step(mlp_path, run, precision="fp32", optimizer="sgd", lr=0.1, grad_accum=4)
    res = train(run, tm.blobs(64), epochs=1, batch_size=8, progress=False, checkpoint_every=0)
    assert res.summary["steps"] == 8 and res.summary["optimizer_steps"] == 2
    assert os.path.isfile(os.path.join(run, "checkpoint.json"))


# --- BF16 -------------------------------------------------------------------------------------------

def _ort_runs_bf16_gemm() -> bool:
    x = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 2])
    g = helper.make_graph([helper.make_node("Gemm", ["x", "x"], ["y"])], "g", [x],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    try:
        import onnxruntime as ort
        ort.InferenceSession(m.SerializeToString(), providers=ort.get_available_providers())
        return True
    except Exception:  # noqa: BLE001
        return False


def test_bf16_builds_where_ort_runs_it_else_says_what_to_use(mlp_path, tmp_path, capsys):
    run = str(tmp_path / "bf16")
    if _ort_runs_bf16_gemm():  # e.g. the CUDA provider: no loss scaling, and it trains
        meta = build_step(mlp_path, run, precision="bf16", optimizer="sgd", lr=0.1)
        assert meta["config"]["loss_scale"] == 1.0 and not meta["dynamic_scale"]
        m = onnx.load(os.path.join(run, "step.onnx"))
        assert any(t.type.tensor_type.elem_type == TensorProto.BFLOAT16 for t in m.graph.value_info) or \
            any(a.i == TensorProto.BFLOAT16 for n in m.graph.node if n.op_type == "Cast" for a in n.attribute)
        res = train(run, tm.blobs(64), epochs=3, batch_size=16, progress=False, checkpoint_every=0)
        assert res.history["loss"][-1] < res.history["loss"][0]
        return
    assert main(["train-graph", mlp_path, "-o", run, "--precision", "bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "cannot run the BF16 step graph (no BF16 kernel for Gemm, node 'fc1')" in err
    assert "use --precision mixed" in err
    assert not os.path.exists(os.path.join(run, "train.json"))

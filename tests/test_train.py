"""The training step graph (graphmp.train.step), its driver (graphmp.train.loop) and CLI.

Every claim is checked by running the real step graph in ONNX Runtime (CPU) or in the
FP16-faithful reference evaluator; tiny models keep it fast (see tests/fixtures/tiny.py).
"""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from fixtures import tiny as tm
from graphmp.cli import main
from graphmp.errors import GraphmpError
from graphmp.model_runs import cuda_available, run_reference
from graphmp.train.flat import graph_state, next_state, pack
from graphmp.train.loop import StepRunner, evaluate, export, latest_state, load_run, train
from graphmp.train.step import CLEAN, NEXT, SCALE, STEP, build_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save(model, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    onnx.save(model, path)
    return str(path)


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory):
    return _save(tm.mlp(), tmp_path_factory.mktemp("mlp") / "mlp.onnx")


@pytest.fixture(scope="module")
def cnn_path(tmp_path_factory):
    return _save(tm.cnn(), tmp_path_factory.mktemp("cnn") / "cnn.onnx")


def _run_dir(tmp_path, name="run"):
    return str(tmp_path / name)


def _batches(data, batch, n):
    return [{k: v[i * batch:(i + 1) * batch] for k, v in data.items()} for i in range(n)]


def _run_steps(run_dir, batches, **kw):
    """Run the step graph over `batches`; return the runner (state inside) and per-step outputs."""
    meta = load_run(run_dir)
    state, _ = latest_state(run_dir)
    r = StepRunner(run_dir, meta, state, **kw)
    outs = [r.step(b) for b in batches]
    return r, outs


# --- the step graph itself ------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_step_graph_is_plain_onnx_with_state_pairs(cnn_path, tmp_path, precision):
    run = _run_dir(tmp_path)
    meta = build_step(cnn_path, run, precision=precision, lr=0.01)
    m = onnx.load(os.path.join(run, "step.onnx"))
    onnx.checker.check_model(m, full_check=True)
    assert {n.domain for n in m.graph.node} <= {"", "ai.onnx"}  # standard ops only
    ins = {v.name for v in m.graph.input}
    outs = {v.name for v in m.graph.output}
    for s in graph_state(meta):  # the graph's own state: flat buffers and scalars
        assert s["input"] in ins and s["output"] == s["input"] + NEXT and s["output"] in outs
    assert set(meta["weights"]) == {"conv.weight", "conv.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias"}
    assert meta["bn_stats"] == ["bn.running_mean", "bn.running_var"]
    assert {"x", "labels", "loss", "all_finite"} <= ins | outs
    # the source model is untouched and state.npz holds its weights
    st = np.load(os.path.join(run, "state.npz"))
    src = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(cnn_path).graph.initializer}
    for w in meta["weights"] + meta["bn_stats"]:
        assert np.array_equal(st[w], src[w])
    assert float(st[SCALE]) == 2.0**16 and int(st[STEP]) == 0
    # one run = one optimizer step, in an ordinary InferenceSession
    d = tm.bars(16)
    r, outs = _run_steps(run, [d])
    loss, applied, scale = outs[0]
    assert np.isfinite(loss) and applied
    new = r.state_numpy()
    assert int(new[STEP]) == 1
    assert not np.array_equal(new["fc.weight"], st["fc.weight"])
    assert not np.array_equal(new["bn.running_mean"], st["bn.running_mean"])  # BN in training mode


# --- loss scaling: exactness, skipping, growth, floor, cap ---------------------------------------

def _final_state(tmp_path, model_path, name, batches, **kw):
    run = _run_dir(tmp_path, name)
    build_step(model_path, run, **kw)
    r, outs = _run_steps(run, batches)
    assert all(o[1] for o in outs), "no step may overflow in this test"
    return r.state_numpy(), outs


def _assert_same_run(ref, got, what):
    ref_state, ref_out = ref
    state, outs = got
    for k in ref_state:
        if k not in (SCALE, CLEAN):
            assert np.array_equal(ref_state[k], state[k]), f"{what}: state '{k}' differs"
    assert [o[0] for o in outs] == [o[0] for o in ref_out], what  # the reported loss is unscaled


SCALES = [("static1024", dict(loss_scale=1024)),
          ("dynamic", dict(loss_scale="dynamic", init_scale=2.0**12, growth_interval=2))]


@pytest.mark.parametrize("precision,model", [("fp32", "cnn"), ("mixed", "mlp")])
def test_power_of_two_scale_equals_unscaled_run_exactly(cnn_path, mlp_path, tmp_path, precision, model):
    path, data = (cnn_path, tm.bars(64, seed=1)) if model == "cnn" else (mlp_path, tm.blobs(64, seed=1))
    batches = _batches(data, 16, 4)
    kw = dict(precision=precision, optimizer="adamw", lr=1e-2, weight_decay=0.01)
    ref = _final_state(tmp_path, path, "s1", batches, loss_scale=1.0, **kw)
    for name, extra in SCALES:
        got = _final_state(tmp_path, path, name, batches, **extra, **kw)
        _assert_same_run(ref, got, f"{precision} {model} {name} vs S=1")
    assert float(got[0][SCALE]) == 2.0**14  # the dynamic run grew twice on the way (2 clean steps each)


def test_mixed_cnn_scaled_runs_agree_exactly_and_s1_underflows(cnn_path, tmp_path):
    """In FP16 the unscaled (S=1) CNN backward loses gradient bits to underflow (values
    below the FP16 normal range): that is what loss scaling is for. Every S from 2^8 to
    2^14, static or dynamic, gives the same run bit for bit. (2^8, not 2^6: since the
    BatchNorm's output and its ReLU are FP16, as with torch AMP, their gradients are FP16
    too, and at 2^6 a few of them fall below the FP16 normal range.)"""
    batches = _batches(tm.bars(64, seed=1), 16, 4)
    kw = dict(precision="mixed", optimizer="adamw", lr=1e-2, weight_decay=0.01)
    ref = _final_state(tmp_path, cnn_path, "s256", batches, loss_scale=256.0, **kw)
    for name, extra in SCALES + [("static16384", dict(loss_scale=2.0**14))]:
        _assert_same_run(ref, _final_state(tmp_path, cnn_path, name, batches, **extra, **kw), f"mixed cnn {name}")
    s1, _ = _final_state(tmp_path, cnn_path, "s1", batches, loss_scale=1.0, **kw)
    assert not np.array_equal(s1["conv.weight"], ref[0]["conv.weight"])
    np.testing.assert_allclose(s1["conv.weight"], ref[0]["conv.weight"], rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_overflow_step_is_skipped_and_scale_backs_off(mlp_path, tmp_path, bad):
    run = _run_dir(tmp_path)
    build_step(mlp_path, run, precision="mixed", optimizer="adamw", lr=1e-2, init_scale=256.0, growth_interval=100)
    good = tm.blobs(8)
    r, outs = _run_steps(run, [good, good])
    before = r.state_numpy()
    assert int(before[CLEAN]) == 2
    poisoned = {k: v.copy() for k, v in good.items()}
    poisoned["x"][3, 1] = bad
    loss, applied, scale = r.step(poisoned)
    after = r.state_numpy()
    assert not applied and scale == 128.0
    for s in load_run(run)["state"]:
        n = s["input"]
        if n == SCALE:
            assert float(after[n]) == 128.0
        elif n == CLEAN:
            assert int(after[n]) == 0
        else:  # weights, AdamW moments, step counter: bit-identical
            assert np.array_equal(after[n], before[n]), n
    assert int(after[STEP]) == 2
    _, applied, _ = r.step(good)  # training goes on
    assert applied and int(r.state_numpy()[STEP]) == 3


def test_natural_fp16_gradient_overflow_is_caught(mlp_path, tmp_path):
    """S = 2^24 overflows the FP16 backward (the Cast of S * dlogits to FP16 is inf): the
    step is skipped and S halves, until S is small enough for the gradients to fit."""
    run = _run_dir(tmp_path)
    build_step(mlp_path, run, precision="mixed", lr=1e-2, init_scale=2.0**24, growth_interval=1000)
    d = tm.blobs(8)
    r, outs = _run_steps(run, [d] * 12)
    applied = [o[1] for o in outs]
    assert not applied[0] and outs[0][2] == 2.0**23
    k = applied.index(True)
    assert all(not a for a in applied[:k]) and all(applied[k:])
    assert outs[k - 1][2] == 2.0 ** (24 - k)
    assert int(r.state_numpy()[STEP]) == 12 - k


def test_scale_growth_cap_and_floor(mlp_path, tmp_path):
    run = _run_dir(tmp_path)
    build_step(mlp_path, run, precision="fp32", lr=1e-3, init_scale=4.0, growth_interval=3,
               max_scale=16.0, min_scale=2.0)
    good = tm.blobs(8)
    bad = {k: v.copy() for k, v in good.items()}
    bad["x"][0, 0] = np.nan
    r, outs = _run_steps(run, [good] * 8)
    # doubles after every 3 clean steps, capped at 16
    assert [o[2] for o in outs] == [4, 4, 8, 8, 8, 16, 16, 16]
    assert int(r.state_numpy()[CLEAN]) == 2
    scales = [r.step(bad)[2] for _ in range(5)]
    assert scales == [8, 4, 2, 2, 2]  # halves on overflow, floor 2
    assert int(r.state_numpy()[CLEAN]) == 0


def test_static_scale_never_changes_but_still_skips(mlp_path, tmp_path):
    run = _run_dir(tmp_path)
    meta = build_step(mlp_path, run, precision="mixed", loss_scale=1024)
    assert not meta["dynamic_scale"] and SCALE not in {s["input"] for s in meta["state"]}
    good = tm.blobs(8)
    bad = {k: v.copy() for k, v in good.items()}
    bad["x"][0, 0] = np.inf
    r, outs = _run_steps(run, [good, bad, good, good, good])
    assert [o[2] for o in outs] == [1024.0] * 5
    assert [o[1] for o in outs] == [True, False, True, True, True]
    assert int(r.state_numpy()[STEP]) == 4


# --- optimizers against numpy ---------------------------------------------------------------------

def _optimizer_run(tmp_path, mlp_path, name, steps=4, **kw):
    run = _run_dir(tmp_path, name)
    meta = build_step(mlp_path, run, precision="fp32", expose_grads=True, loss_scale=8.0, **kw)
    state, _ = latest_state(run)
    r = StepRunner(run, meta, state, device_state=False)  # r.state: numpy
    sess = r.sess
    out_names = [o.name for o in sess.get_outputs()]
    history = []
    for b in _batches(tm.blobs(8 * steps, seed=3), 8, steps):
        before = r.state_numpy()
        feeds = dict(b)
        feeds.update(pack(meta, before))
        outs = dict(zip(out_names, sess.run(None, feeds)))
        r.state = {n: outs[n + NEXT] for n in r.names}
        history.append((before, {w: outs[g] for w, g in meta["grads"].items()}, r.state_numpy()))
    return meta, history


def _clip(grads, max_norm):
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    c = min(1.0, max_norm / (norm + 1e-6))
    return {k: g * np.float32(c) for k, g in grads.items()}, norm


@pytest.mark.parametrize("wd,clip,mom", [(0.0, None, 0.9), (0.05, None, 0.9), (0.0, 0.05, 0.9), (0.0, 0.05, 0.0)])
def test_sgd_momentum_matches_numpy(mlp_path, tmp_path, wd, clip, mom):
    """At loss scale 8, whose 1 / S (and the clipping factor) ride on the update's scalars."""
    lr = 0.1
    meta, hist = _optimizer_run(tmp_path, mlp_path, "sgd", optimizer="sgd", lr=lr, momentum=mom,
                                weight_decay=wd, clip_norm=clip)
    clipped = False
    for before, grads, after in hist:
        if clip:
            grads, norm = _clip(grads, clip)
            clipped |= norm > clip
        for w in meta["weights"]:
            g = grads[w] + wd * before[w]
            buf = mom * before[w + "__momentum"] + g if mom else g
            if mom:
                np.testing.assert_allclose(after[w + "__momentum"], buf, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(after[w], before[w] - lr * buf, rtol=1e-5, atol=1e-7)
    assert clipped or not clip  # the clipping case really clipped


@pytest.mark.parametrize("wd,clip", [(0.0, None), (0.1, None), (0.0, 0.05)])
def test_adamw_matches_numpy(mlp_path, tmp_path, wd, clip):
    lr, (b1, b2), eps = 0.01, (0.9, 0.99), 1e-8
    meta, hist = _optimizer_run(tmp_path, mlp_path, "adamw", optimizer="adamw", lr=lr, betas=(b1, b2), eps=eps,
                                weight_decay=wd, clip_norm=clip)
    for t, (before, grads, after) in enumerate(hist, start=1):
        if clip:
            grads, _ = _clip(grads, clip)
        for w in meta["weights"]:
            g = grads[w].astype(np.float64)
            m = b1 * before[w + "__exp_avg"] + (1 - b1) * g
            v = b2 * before[w + "__exp_avg_sq"] + (1 - b2) * g * g
            p = before[w] * (1 - lr * wd)
            p = p - lr / (1 - b1**t) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + eps)
            np.testing.assert_allclose(after[w + "__exp_avg"], m, rtol=1e-5, atol=1e-8)
            np.testing.assert_allclose(after[w + "__exp_avg_sq"], v, rtol=1e-5, atol=1e-10)
            np.testing.assert_allclose(after[w], p, rtol=1e-5, atol=1e-6)
        assert int(after[STEP]) == t


def test_exposed_gradients_are_unscaled(mlp_path, tmp_path):
    """The gradient output is d(mean loss)/dw whatever S is: same value at S=1 and S=512."""
    grads = []
    for s in (1.0, 512.0):
        run = _run_dir(tmp_path, f"g{s}")
        meta = build_step(mlp_path, run, precision="fp32", expose_grads=True, loss_scale=s)
        state, _ = latest_state(run)
        feeds = dict(tm.blobs(8))
        feeds.update(pack(meta, state))
        out = onnx_run(os.path.join(run, "step.onnx"), feeds)
        grads.append({w: out[g] for w, g in meta["grads"].items()})
    for w in grads[0]:
        assert np.array_equal(grads[0][w], grads[1][w])
    # and it is the gradient: d(mean CE)/d(fc2.bias) = mean(softmax - onehot), in numpy float64
    d = tm.blobs(8)
    w = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in onnx.load(mlp_path).graph.initializer}
    h = np.maximum(d["x"] @ w["fc1.weight"].T + w["fc1.bias"], 0)
    z = h @ w["fc2.weight"].T + w["fc2.bias"]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(8), d["labels"]] -= 1
    np.testing.assert_allclose(grads[0]["fc2.bias"], p.mean(0), rtol=1e-5, atol=1e-7)


def onnx_run(path, feeds):
    import onnxruntime as ort
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in s.get_outputs()]
    return dict(zip(names, s.run(None, {i.name: feeds[i.name] for i in s.get_inputs()})))


# --- the mixed precision contract ---------------------------------------------------------------

def test_mixed_step_graph_precision_contract(cnn_path, tmp_path):
    run = _run_dir(tmp_path)
    meta = build_step(cnn_path, run, precision="mixed", expose_grads=True)
    m = onnx.load(os.path.join(run, "step.onnx"))
    inf = onnx.shape_inference.infer_shapes(m)
    types = {v.name: v.type.tensor_type.elem_type for v in
             list(inf.graph.value_info) + list(inf.graph.input) + list(inf.graph.output)}
    types.update({t.name: t.data_type for t in inf.graph.initializer})
    for w in meta["weights"] + meta["bn_stats"]:
        assert types[w] == TensorProto.FLOAT  # FP32 masters (views of their flat buffer)
    for s in graph_state(meta):
        if s["kind"] in ("weight", "bn", "moment"):  # and the buffers they come from and go to
            assert types[s["input"]] == TensorProto.FLOAT and types[s["output"]] == TensorProto.FLOAT
    for w in meta["weights"]:
        assert types[meta["grads"][w]] == TensorProto.FLOAT  # gradients w.r.t. masters are FP32
    casts = [n for n in m.graph.node if n.op_type == "Cast" and n.input[0] in ("conv.weight", "fc.weight")]
    assert {n.input[0] for n in casts} == {"conv.weight", "fc.weight"}
    assert all(onnx.helper.get_attribute_value(n.attribute[0]) == TensorProto.FLOAT16 for n in casts)
    heavy = [n for n in m.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]
    assert len(heavy) >= 2 + 3  # forward Conv, Gemm and their backward products
    for n in heavy:
        assert types[n.input[0]] == TensorProto.FLOAT16 and types[n.output[0]] == TensorProto.FLOAT16, n.name
    for n in m.graph.node:
        if n.op_type in ("Softmax", "LogSoftmax", "SoftmaxCrossEntropyLoss"):
            assert types[n.input[0]] == TensorProto.FLOAT, n.name
    assert types["loss"] == TensorProto.FLOAT
    assert meta["convert"]["nodes"]["low"] > 0


# --- convergence: FP32 vs mixed, ORT and FP16-faithful ---------------------------------------------

def test_cnn_converges_same_in_fp32_and_mixed(cnn_path, tmp_path):
    train_d, eval_d = tm.bars(4096, seed=1), tm.bars(1024, seed=2)
    res = {}
    for precision in ("fp32", "mixed"):
        run = _run_dir(tmp_path, precision)
        build_step(cnn_path, run, precision=precision, optimizer="adamw", lr=1e-2)
        res[precision] = train(run, train_d, epochs=3, batch_size=32, eval_data=eval_d, checkpoint_every=0,
                               progress=False)
    acc = {p: r.summary["eval"]["accuracy"] for p, r in res.items()}
    assert acc["fp32"] >= 0.9 and acc["mixed"] >= 0.9, acc
    assert abs(acc["fp32"] - acc["mixed"]) <= 0.03, acc
    for r in res.values():
        loss = r.history["loss"]
        assert np.mean(loss[-20:]) < 0.5 * np.mean(loss[:20])
        assert r.summary["skipped_steps"] <= 3  # dynamic scale starts at 2^16: a few overflow steps at most
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for p, r in res.items():
        ax.plot(r.history["loss"], label=f"{p} (eval acc {acc[p]:.3f})", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    png = tmp_path / "curves.png"
    fig.savefig(png, dpi=80)
    plt.close(fig)
    assert png.stat().st_size > 1000


def test_mixed_step_fp16_faithful_matches_ort_and_learns(cnn_path, tmp_path):
    """ORT CPU computes FP16 ops in FP32; onnx.reference computes each op in its declared
    dtype. The same mixed step graph run both ways: the first steps agree within FP16
    tolerance and the FP16-faithful run's loss goes down."""
    run = _run_dir(tmp_path)
    build_step(cnn_path, run, precision="mixed", optimizer="sgd", lr=0.05, init_scale=2.0**10)
    meta = load_run(run)
    step = onnx.load(os.path.join(run, "step.onnx"))
    state, _ = latest_state(run)
    batch = tm.bars(16, seed=5)
    ort_r = StepRunner(run, meta, state)
    ref_state = dict(state)
    losses = []
    for i in range(6):
        feeds = dict(batch)
        feeds.update(pack(meta, ref_state))
        out = run_reference(step, feeds)
        assert bool(out["all_finite"])
        ref_state = next_state(meta, out)
        losses.append(float(out["loss"]))
        if i < 3:
            ort_loss, applied, _ = ort_r.step(batch)
            assert applied and abs(ort_loss - losses[-1]) <= 1e-2 * max(1.0, abs(ort_loss))
            o = ort_r.state_numpy()
            for w in meta["weights"]:
                np.testing.assert_allclose(ref_state[w], o[w], rtol=2e-2, atol=2e-3)
    assert losses[-1] < 0.8 * losses[0], losses


# --- train(): data, checkpoints, resume, eval, export ----------------------------------------------

class _Killed(Exception):
    pass


class _Dying:
    """Batches of a dataset; raises at batch `die_at` of epoch 1 (a simulated kill)."""

    def __init__(self, batches, die_at=None):
        self.batches, self.die_at, self.epoch = batches, die_at, -1

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        self.epoch += 1
        for i, b in enumerate(self.batches):
            if self.die_at is not None and self.epoch == 1 and i == self.die_at:
                raise _Killed()
            yield b


def test_resume_after_kill_equals_uninterrupted_run(cnn_path, tmp_path):
    batches = _batches(tm.bars(96, seed=4), 16, 6)
    full = _run_dir(tmp_path, "full")
    build_step(cnn_path, full, precision="mixed", lr=1e-2, growth_interval=4)
    ref = train(full, _Dying(batches), epochs=2, checkpoint_every=0, progress=False)

    run = _run_dir(tmp_path, "killed")
    build_step(cnn_path, run, precision="mixed", lr=1e-2, growth_interval=4)
    with pytest.raises(_Killed):  # dies in epoch 2 at batch 4 = step 10; last checkpoint at step 9
        train(run, _Dying(batches, die_at=4), epochs=2, checkpoint_every=3, progress=False)
    _, ck = latest_state(run)
    assert (ck["step"], ck["epoch"], ck["position"]) == (9, 1, 3)
    res = train(run, _Dying(batches), epochs=2, checkpoint_every=3, progress=False)
    assert len(res.history["loss"]) == 3  # only the lost steps were run again
    assert res.summary["steps"] == ref.summary["steps"] == 12
    for k, v in ref.state.items():
        assert np.array_equal(v, res.state[k]), k
    # the final checkpoint holds the final state
    st, ck = latest_state(run)
    assert ck["step"] == 12 and np.array_equal(st["fc.weight"], ref.state["fc.weight"])
    assert len([f for f in os.listdir(run) if f.startswith("ckpt-")]) == 1


KILL_SCRIPT = """
import os, signal, sys
from tests.fixtures import tiny as tm
from graphmp.train.loop import train
data = tm.bars(96, seed=4)
n = [0]
import graphmp.train.loop as loop
orig = loop.StepRunner.step
def step(self, batch):
    n[0] += 1
    if n[0] == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)
    return orig(self, batch)
loop.StepRunner.step = step
train({run!r}, data, epochs=2, batch_size=16, checkpoint_every=4, progress=False)
"""


def test_resume_after_sigkill_in_a_subprocess(cnn_path, tmp_path):
    """A real `kill -9` in the middle of training, then `graphmp train` resumes it."""
    data = tm.bars(96, seed=4)
    full = _run_dir(tmp_path, "full")
    build_step(cnn_path, full, precision="fp32", optimizer="sgd", lr=0.05)
    ref = train(full, data, epochs=2, batch_size=16, checkpoint_every=0, progress=False)

    run = _run_dir(tmp_path, "killed")
    build_step(cnn_path, run, precision="fp32", optimizer="sgd", lr=0.05)
    env = dict(os.environ, PYTHONPATH=ROOT)
    script = KILL_SCRIPT.format(kill_at=7, run=run)
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert p.returncode == -9, p.stderr.decode()[-2000:]
    _, ck = latest_state(run)
    assert ck["step"] == 4  # steps 5 and 6 were lost with the process
    np.savez(tmp_path / "train.npz", **data)
    rc = main(["train", run, "--data", str(tmp_path / "train.npz"), "--epochs", "2", "--batch-size", "16",
               "--checkpoint-every", "4", "-q"])
    assert rc == 0
    st, ck = latest_state(run)
    assert ck["step"] == 12 and ck["epoch"] == 2
    for k, v in ref.state.items():
        assert np.array_equal(v, st[k]), k


def test_device_state_binding_path_equals_plain_run(cnn_path, tmp_path):
    """The I/O-binding path (state in OrtValues, two buffers in turn) that CUDA uses, run on
    the CPU: bit-identical to plain session.run."""
    run = _run_dir(tmp_path)
    build_step(cnn_path, run, precision="mixed", lr=1e-2, growth_interval=2)
    batches = _batches(tm.bars(80, seed=6), 16, 5)
    bad = {k: v.copy() for k, v in batches[0].items()}
    bad["x"][0, 0, 0, 0] = np.inf
    batches.insert(2, bad)
    a, oa = _run_steps(run, batches, device_state=False)
    b, ob = _run_steps(run, batches, device_state=True)
    assert b.bound and not a.bound
    np.testing.assert_array_equal(np.array(oa), np.array(ob))  # loss (NaN for the bad batch), applied, S
    assert [o[1] for o in oa].count(False) == 1
    sa, sb = a.state_numpy(), b.state_numpy()
    for k in sa:
        assert np.array_equal(sa[k], sb[k]), k


def test_export_holds_trained_weights(cnn_path, tmp_path):
    import onnxruntime as ort
    run = _run_dir(tmp_path)
    build_step(cnn_path, run, precision="fp32", lr=1e-2)
    # before training: the export is the source model, output for output
    x = tm.bars(8, seed=9)["x"]
    src = ort.InferenceSession(cnn_path, providers=["CPUExecutionProvider"])
    e0 = export(run, tmp_path / "e0.onnx")
    y0 = ort.InferenceSession(e0, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.array_equal(y0, src.run(None, {"x": x})[0])
    data = tm.bars(256, seed=1)
    res = train(run, data, epochs=1, batch_size=32, checkpoint_every=0, progress=False)
    e1 = export(run, tmp_path / "e1.onnx")
    m1 = onnx.load(e1)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in m1.graph.initializer}
    for w in ("conv.weight", "fc.weight", "bn.running_mean", "bn.running_var"):
        assert np.array_equal(inits[w], res.state[w])
    assert [i.name for i in m1.graph.input] == ["x"]
    y1 = ort.InferenceSession(e1, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert not np.allclose(y1, y0)
    # the exported model gives what eval measured
    ev = evaluate(run, data, batch_size=64)
    z = ort.InferenceSession(e1, providers=["CPUExecutionProvider"]).run(None, {"x": data["x"]})[0]
    assert abs((z.argmax(1) == data["labels"]).mean() - ev["accuracy"]) < 1e-9
    # --mixed: a graphmp-converted model with the same weights
    e2 = export(run, tmp_path / "e2.onnx", precision="mixed")
    m2 = onnx.load(e2)
    assert any(p.key == "graphmp" for p in m2.metadata_props)
    assert any(n.op_type == "Cast" for n in m2.graph.node)
    y2 = run_reference(m2, {"x": x})["logits"]
    np.testing.assert_allclose(y2, y1, atol=5e-2, rtol=5e-2)


def test_mse_regression_learns_and_eval_agrees(mlp_path, tmp_path):
    r = np.random.default_rng(0)
    x = r.standard_normal((1024, 4)).astype(np.float32)
    data = {"x": x, "labels": (x @ r.standard_normal((4, 3)) * 0.5).astype(np.float32)}
    run = _run_dir(tmp_path)
    meta = build_step(mlp_path, run, loss="mse", precision="mixed", optimizer="adamw", lr=1e-2)
    assert meta["label"] == {"name": "labels", "shape": ["N", 3], "dtype": "float32"}
    before = evaluate(run, data)["loss"]
    res = train(run, data, epochs=4, batch_size=32, eval_data=data, checkpoint_every=0, progress=False)
    assert res.summary["eval"]["loss"] < 0.1 * before and "accuracy" not in res.summary["eval"]
    y = onnx_run(export(run, tmp_path / "m.onnx"), {"x": x})["logits"]
    fp32_mse = float(((y - data["labels"]) ** 2).mean())  # eval ran the mixed graph: FP16 rounding apart
    assert abs(fp32_mse - res.summary["eval"]["loss"]) <= 0.02 * fp32_mse + 1e-4


def test_loss_on_the_logits_before_a_final_softmax(tmp_path):
    m = tm.mlp()
    m.graph.node[-1].output[0] = "z"
    m.graph.node.append(onnx.helper.make_node("Softmax", ["z"], ["logits"], name="softmax", axis=1))
    p = _save(m, str(tmp_path / "m.onnx"))
    with pytest.raises(GraphmpError, match="comes from a Softmax; cross-entropy needs the logits"):
        build_step(p, str(tmp_path / "bad"), precision="fp32")
    run = _run_dir(tmp_path)
    build_step(p, run, precision="fp32", output="z", lr=1e-2)
    step = onnx.load(os.path.join(run, "step.onnx"))
    assert "softmax" not in {n.name for n in step.graph.node}  # the unused head is pruned from the step
    res = train(run, tm.blobs(512), epochs=3, batch_size=32, eval_data=tm.blobs(256, seed=1), progress=False,
                checkpoint_every=0)
    assert res.summary["eval"]["accuracy"] > 0.9
    probs = onnx_run(export(run, tmp_path / "e.onnx"), {"x": tm.blobs(4)["x"]})["logits"]
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-5)  # the export keeps the model's Softmax


# --- CLI and errors ---------------------------------------------------------------------------------

def test_cli_round_trip(mlp_path, tmp_path, capsys):
    np.savez(tmp_path / "train.npz", **tm.blobs(512, seed=1))
    np.savez(tmp_path / "eval.npz", **tm.blobs(256, seed=2))
    run = str(tmp_path / "run")
    assert main(["train-graph", mlp_path, "-o", run, "--loss", "cross-entropy", "--label-shape", "N",
                 "--optimizer", "adamw", "--lr", "1e-2", "--loss-scale", "dynamic"]) == 0
    assert main(["train", run, "--data", str(tmp_path / "train.npz"), "--epochs", "3", "--eval",
                 str(tmp_path / "eval.npz"), "--batch-size", "32"]) == 0  # -q: nothing on success
    out = capsys.readouterr().out
    assert "eval: loss" in out and "accuracy" in out
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["steps"] == 48 and summary["eval"]["accuracy"] > 0.9
    assert main(["export", run, "-o", str(tmp_path / "trained.onnx")]) == 0
    assert main(["export", run, "-o", str(tmp_path / "trained.mp.onnx"), "--mixed"]) == 0
    onnx.checker.check_model(str(tmp_path / "trained.mp.onnx"), full_check=True)
    # static scale and SGD from the CLI
    run2 = str(tmp_path / "run2")
    assert main(["train-graph", mlp_path, "-o", run2, "--optimizer", "sgd", "--lr", "0.1",
                 "--loss-scale", "1024", "--precision", "fp32"]) == 0
    cfg = load_run(run2)["config"]
    assert cfg["loss_scale"] == 1024.0 and cfg["optimizer"] == "sgd" and not load_run(run2)["dynamic_scale"]


def _err(capsys, argv):
    assert main(argv) == 2
    return capsys.readouterr().err


def test_errors_are_clear(mlp_path, tmp_path, capsys):
    run = str(tmp_path / "run")
    build_step(mlp_path, run, precision="fp32")
    d = tm.blobs(64)
    np.savez(tmp_path / "nolabels.npz", x=d["x"])
    e = _err(capsys, ["train", run, "--data", str(tmp_path / "nolabels.npz")])
    assert "missing array(s) ['labels']" in e and "['x', 'labels']" in e
    np.savez(tmp_path / "badname.npz", input=d["x"], labels=d["labels"])
    e = _err(capsys, ["train", run, "--data", str(tmp_path / "badname.npz")])
    assert "['x']" in e and "unused: ['input']" in e
    np.savez(tmp_path / "badshape.npz", x=d["x"][:, :3], labels=d["labels"])
    e = _err(capsys, ["train", run, "--data", str(tmp_path / "badshape.npz")])
    assert "'x' has shape (64, 3)" in e and "axis 1 must be 4" in e
    np.savez(tmp_path / "ragged.npz", x=d["x"], labels=d["labels"][:10])
    assert "number of samples" in _err(capsys, ["train", run, "--data", str(tmp_path / "ragged.npz")])
    np.savez(tmp_path / "small.npz", **tm.blobs(5))
    assert "fewer than one batch" in _err(capsys, ["train", run, "--data", str(tmp_path / "small.npz")])
    os.makedirs(tmp_path / "empty")
    e = _err(capsys, ["train", str(tmp_path / "empty"), "--data", str(tmp_path / "small.npz")])
    assert "has no train.json" in e and "graphmp train-graph" in e
    assert "no such run folder" in _err(capsys, ["export", str(tmp_path / "nope"), "-o", str(tmp_path / "o.onnx")])
    assert "--no-resume" in _resume_mismatch(run, tmp_path)
    e = _err(capsys, ["train-graph", mlp_path, "-o", str(tmp_path / "r2"), "--loss-scale", "-3"])
    assert "loss_scale must be 'dynamic' or a positive number" in e
    e = _err(capsys, ["train-graph", mlp_path, "-o", str(tmp_path / "r3"), "--model-output", "nope"])
    assert "'nope' is not a tensor of the model" in e
    e = _err(capsys, ["train-graph", mlp_path, "-o", str(tmp_path / "r4"), "--trainable", "zzz"])
    assert "no trainable FP32 initializer" in e
    # a converted model is refused; the input model is never modified
    import graphmp
    mp = str(tmp_path / "mlp.mp.onnx")
    graphmp.convert(mlp_path, mp)
    before = open(mp, "rb").read()
    assert "already converted by graphmp" in _err(capsys, ["train-graph", mp, "-o", str(tmp_path / "r5")])
    assert open(mp, "rb").read() == before


def _resume_mismatch(run, tmp_path):
    d = tm.blobs(64)
    train(run, d, epochs=1, batch_size=16, checkpoint_every=2, progress=False, max_steps=2)
    with pytest.raises(GraphmpError) as e:
        train(run, d, epochs=1, batch_size=8, progress=False)
    return str(e.value)


def test_unsupported_op_is_named(tmp_path):
    from onnx import helper, numpy_helper
    g = helper.make_graph([helper.make_node("Gemm", ["x", "w"], ["h"], name="fc", transB=1),
                           helper.make_node("LpNormalization", ["h"], ["logits"], name="weird_node", axis=1)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
                          [numpy_helper.from_array(np.ones((3, 4), np.float32), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    p = _save(m, str(tmp_path / "m.onnx"))
    with pytest.raises(GraphmpError, match="weird_node"):
        build_step(p, str(tmp_path / "run"), precision="fp32")
    assert not os.path.exists(tmp_path / "run" / "train.json")


# --- GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs onnxruntime-gpu and a CUDA GPU")
def test_cuda_state_stays_on_device_and_converges(cnn_path, tmp_path):
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    run = _run_dir(tmp_path)
    build_step(cnn_path, run, precision="mixed", lr=3e-3)
    meta = load_run(run)
    state, _ = latest_state(run)
    r = StepRunner(run, meta, state, providers=providers)
    assert r.bound and r.device == "cuda"
    assert all(v.device_name() == "cuda" for s in r.bindings.sets for v in s.values())
    res = train(run, tm.bars(2048, seed=1), epochs=3, batch_size=32, eval_data=tm.bars(512, seed=2),
                checkpoint_every=0, progress=False, providers=providers, resume=False)
    # the same run on the CPU provider is the yardstick (this small CNN reaches ~0.87 after 3
    # epochs on either: the 0.9 once asserted here had never met a GPU, and failed on an H100)
    cpu_run = _run_dir(tmp_path, "cpu")
    build_step(cnn_path, cpu_run, precision="mixed", lr=3e-3)
    cpu = train(cpu_run, tm.bars(2048, seed=1), epochs=3, batch_size=32, eval_data=tm.bars(512, seed=2),
                checkpoint_every=0, progress=False, providers=["CPUExecutionProvider"], resume=False)
    acc, cpu_acc = res.summary["eval"]["accuracy"], cpu.summary["eval"]["accuracy"]
    assert res.summary["state_on_device"] and acc >= 0.8 and abs(acc - cpu_acc) <= 0.03, (acc, cpu_acc)


@pytest.mark.parametrize("rows", [False, True])
def test_finite_flag_sees_one_bad_gradient_anywhere(rows):
    """optim.finite_flag over a flat gradient of whole rows (the step's form, rows=True) and
    element by element: one inf, -inf, NaN or inf - inf anywhere (the tail row too) makes it
    False; large finite values whose row sums stay in FP32's range keep it True."""
    from onnx import helper

    from graphmp.model_runs import ort_session
    from graphmp.train.builder import Builder
    from graphmp.train.optim import finite_flag
    vi = helper.make_tensor_value_info
    g = helper.make_graph([], "f", [vi("g", TensorProto.FLOAT, [4 * 8]), vi("loss", TensorProto.FLOAT, [])],
                          [vi("ok", TensorProto.BOOL, [])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    finite_flag(Builder(m), ["g", "loss"], out="ok", row=8 if rows else None)
    sess = ort_session(m)
    base = np.random.default_rng(0).standard_normal(32).astype(np.float32)

    def ok(values, loss=1.0):
        return bool(sess.run(None, {"g": values, "loss": np.array(loss, np.float32)})[0])
    assert ok(base) and ok(np.full(32, 1e35, np.float32)) and not ok(base, loss=np.nan)
    for where in (0, 13, 31):
        for bad in (np.inf, -np.inf, np.nan):
            v = base.copy()
            v[where] = bad
            assert not ok(v), (where, bad)
    v = base.copy()
    v[[9, 10]] = [np.inf, -np.inf]  # a row summing to NaN
    assert not ok(v)

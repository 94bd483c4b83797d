"""The step split for data parallelism (graphmp/train/split.py, issue 24): the gradient graph
then the update graph compute exactly what the fused step computes, skipped steps included."""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from fixtures import tiny
from graphmp.train import build_step
from graphmp.train.flat import graph_state, graph_state_names, pack, unpack
from graphmp.train.split import split_step


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _build(tmp_path, model, **kw):
    p = tmp_path / "m.onnx"
    onnx.save(model, p)
    run = tmp_path / "run"
    build_step(str(p), str(run), expose_grads=True, **kw)
    meta = json.loads((run / "train.json").read_text())
    state = dict(np.load(run / "state.npz"))
    return onnx.load(run / "step.onnx"), meta, state


def _batches(data, size):
    """Batches of a fixtures dataset dict ({input: array, "labels": array})."""
    n = len(data["labels"])
    return [{k: v[i:i + size] for k, v in data.items()} for i in range(0, n, size)]


def _fused_vs_split(step, meta, state, batches):
    grad_m, upd_m, handed = split_step(step, meta)
    fused, g_sess, u_sess = _session(step), _session(grad_m), _session(upd_m)
    s_fused, s_split = pack(meta, state), pack(meta, state)  # the step graph's state: flat buffers
    outs = [o.name for o in step.graph.output]
    for b in batches:
        f = dict(zip(outs, fused.run(None, {**b, **{k: s_fused[k] for k in s_fused}})))
        g_in = {i.name for i in grad_m.graph.input}
        got = dict(zip(handed, g_sess.run(handed, {k: v for k, v in {**b, **s_split}.items() if k in g_in})))
        u_in = {i.name for i in upd_m.graph.input}
        u_out = [o.name for o in upd_m.graph.output]
        u = dict(zip(u_out, u_sess.run(None, {k: v for k, v in {**s_split, **got}.items() if k in u_in})))
        for k in u_out:
            np.testing.assert_array_equal(u[k], f[k], err_msg=k)
        for s in graph_state(meta):
            s_fused[s["input"]] = f[s["output"]]
            s_split[s["input"]] = u[s["output"]]
    return unpack(meta, s_fused), unpack(meta, s_split)


@pytest.mark.parametrize("precision,optimizer", [("fp32", "sgd"), ("fp32", "adamw"), ("mixed", "adamw")])
def test_gradient_then_update_is_the_fused_step(tmp_path, precision, optimizer):
    step, meta, state = _build(tmp_path, tiny.mlp(), loss="cross-entropy", precision=precision,
                               optimizer=optimizer, lr=0.05)
    a, b = _fused_vs_split(step, meta, state, _batches(tiny.blobs(48), 8))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert not np.array_equal(a[meta["weights"][0]], state[meta["weights"][0]])  # it did train


def test_a_step_with_inf_is_skipped_by_both_halves(tmp_path):
    step, meta, state = _build(tmp_path, tiny.mlp(), loss="cross-entropy", precision="mixed", optimizer="sgd")
    data = tiny.blobs(8)
    data["x"][3, 0] = np.inf
    a, b = _fused_vs_split(step, meta, state, _batches(data, 8))
    w = meta["weights"][0]
    np.testing.assert_array_equal(b[w], state[w])        # skipped: the weights did not move
    assert b["loss_scale"] < state["loss_scale"]          # and S backed off, as in the fused step


def test_batchnorm_statistics_pass_through_the_split(tmp_path):
    step, meta, state = _build(tmp_path, tiny.cnn(), loss="cross-entropy", optimizer="sgd")
    _fused_vs_split(step, meta, state, _batches(tiny.bars(16), 8))


def test_a_step_built_without_exposed_gradients_splits_too(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(tiny.mlp(), p)
    build_step(str(p), str(tmp_path / "r1"), loss="cross-entropy", optimizer="sgd")
    meta = json.loads((tmp_path / "r1" / "train.json").read_text())
    step = onnx.load(tmp_path / "r1" / "step.onnx")
    assert not any(o.name.endswith("__grad") for o in step.graph.output)
    _fused_vs_split(step, meta, dict(np.load(tmp_path / "r1" / "state.npz")), _batches(tiny.blobs(16), 8))


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_a_window_fed_at_once_is_the_fused_steps_window(tmp_path, precision):
    """--accumulate 3: the fused step updates after its 3rd run; the split halves, fed the
    window's gradient sum once (graphmp.train.dp_step, a world of one), give the same
    weights and BN statistics after each window."""
    from graphmp.train.dp_step import DeviceState, Halves, dp_step
    p = tmp_path / "m.onnx"
    onnx.save(tiny.cnn(), p)
    build_step(str(p), str(tmp_path / "r"), loss="cross-entropy", optimizer="adamw", lr=0.05, grad_accum=3,
               precision=precision, init_scale=1024.0)
    meta = json.loads((tmp_path / "r" / "train.json").read_text())
    state = dict(np.load(tmp_path / "r" / "state.npz"))
    step = _session(onnx.load(tmp_path / "r" / "step.onnx"))
    halves = Halves(str(tmp_path / "r"), meta, 1, ["CPUExecutionProvider"])
    fused, split = pack(meta, state), pack(meta, state)  # the step graph's state: flat buffers
    times = {"compute": 0.0, "all_reduce": 0.0, "update": 0.0}
    batches = _batches(tiny.bars(48), 4)
    outs = [o.name for o in step.get_outputs()]
    for w in range(0, 12, 3):
        for b in batches[w:w + 3]:
            f = dict(zip(outs, step.run(None, {**b, **fused})))
            fused.update({s["input"]: f[s["output"]] for s in graph_state(meta)})
        st = DeviceState(split, graph_state_names(meta), halves.device)
        _, applied = dp_step(halves, lambda flat: flat, 1, batches[w:w + 3], st, times)
        split = st.numpy()
        assert applied == bool(f["all_finite"])
        for k in meta["weights"] + meta["bn_stats"]:
            np.testing.assert_allclose(unpack(meta, split)[k], unpack(meta, fused)[k], rtol=1e-5, atol=1e-6,
                                       err_msg=k)
    split, fused = unpack(meta, split), unpack(meta, fused)
    w0 = meta["weights"][0]
    assert not np.allclose(split[w0], state[w0])     # it trained
    assert int(split["optimizer_step"]) == int(fused["optimizer_step"]) == 4  # four updates, not twelve

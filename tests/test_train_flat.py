"""The update over flat buffers (graphmp/train/update.py, graphmp/train/flat.py): a handful of
nodes whatever the number of weights, the per-weight formulas exactly, a skipped step that
leaves every state tensor as it was, and run folders built before flat state still working."""
import json
import os
import shutil
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fixtures import tiny
from graphmp.errors import GraphmpError
from graphmp.train.flat import ALIGN, FLAT_BUFFERS, graph_state, next_state, pack, unpack
from graphmp.train.loop import StepRunner, evaluate, export, latest_state, load_run, train
from graphmp.train.step import CLEAN, SCALE, STEP, build_step
from graphmp.train.update import PREFIX

OLD_RUN = os.path.join(os.path.dirname(__file__), "fixtures", "run_before_flat")


def _deep_mlp(layers: int, width: int = 6, classes: int = 3):
    """x [N, 4] -> `layers` Gemm+Relu -> Gemm to `classes` logits: 2 * (layers + 1) weights."""
    r = np.random.default_rng(layers)
    nodes, inits, prev, n_in = [], [], "x", 4
    for i in range(layers + 1):
        n_out = classes if i == layers else width
        inits += [numpy_helper.from_array((r.standard_normal((n_out, n_in)) * 0.4).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(np.zeros(n_out, np.float32), f"b{i}")]
        out = "y" if i == layers else f"h{i}"
        nodes.append(helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [out if i == layers else f"z{i}"],
                                      transB=1))
        if i < layers:
            nodes.append(helper.make_node("Relu", [f"z{i}"], [out]))
        prev, n_in = out, n_out
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", classes])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _update_ops(run) -> Counter:
    return Counter(n.op_type for n in onnx.load(os.path.join(run, "step.onnx")).graph.node
                   if n.name.startswith(PREFIX + "/"))


@pytest.mark.parametrize("opts", [dict(optimizer="adamw", weight_decay=0.01, clip_norm=1.0),
                                  dict(optimizer="sgd", momentum=0.9, grad_accum=3)])
def test_update_node_count_does_not_grow_with_the_number_of_weights(tmp_path, opts):
    counts, inputs = {}, {}
    for layers in (1, 6):
        p = str(tmp_path / f"m{layers}.onnx")
        onnx.save(_deep_mlp(layers), p)
        run = str(tmp_path / f"r{layers}")
        meta = build_step(p, run, loss="cross-entropy", lr=0.01, precision="mixed", **opts)
        assert len(meta["weights"]) == 2 * (layers + 1)
        counts[layers] = _update_ops(run)
        inputs[layers] = [s["input"] for s in graph_state(meta)]
        assert meta["nodes"]["update"] == sum(counts[layers].values())
    small, big = counts[1], counts[6]
    extra_matrices = 5  # 5 more Gemm weights (their 1-D biases are Split outputs as they are)
    # a Reshape per matrix for its view and one for its flattened gradient; nothing else grows
    # (no size here is a multiple of flat.ALIGN: every tensor is in the buffers' tails)
    assert big["Reshape"] - small["Reshape"] == 2 * extra_matrices
    assert {k: v for k, v in big.items() if k != "Reshape"} == {k: v for k, v in small.items() if k != "Reshape"}
    # gradients in, weight views out: once each over the rows, once each over the tail
    assert small["Concat"] == 2 and small["Split"] == 2
    assert inputs[1] == inputs[6] and set(inputs[1]) - {STEP, SCALE, CLEAN, "accum_count"} <= set(FLAT_BUFFERS)


def test_buffers_are_cut_along_short_rows(tmp_path):
    """ONNX Runtime's CUDA Split and Concat copy a table with one entry per element of their
    axis to the GPU on every run (over a 1-D buffer of all of BERT-base's weights: 1.5 s per
    step on an H200). A buffer holds its tensors whose size is a multiple of flat.ALIGN first,
    each at a multiple of ALIGN, then a tail of the others padded to a whole row: the update's
    Splits and Concats run along its rows, or along the tail alone, never along the buffer.
    The padding is zero."""
    width = ALIGN // 4  # w0 [width, 4] fills one row exactly; b0 [width], w1 [3, width], b1 [3] do not
    p = str(tmp_path / "m.onnx")
    onnx.save(_deep_mlp(1, width=width), p)
    meta = build_step(p, str(tmp_path / "r"), loss="cross-entropy", lr=0.01, optimizer="adamw")
    assert meta["flat"]["align"] == ALIGN
    table = meta["flat"]["buffers"]["flat__weights"]
    assert [t for t, _, _ in table] == ["w0", "b0", "w1", "b1"]
    assert table[0][1] == 0 and table[1][1] == ALIGN  # w0 a whole row, then the tail packed tight
    assert table[2][1] == ALIGN + width and table[3][1] == ALIGN + 4 * width
    step = onnx.shape_inference.infer_shapes(onnx.load(str(tmp_path / "r" / "step.onnx")))
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(step.graph.value_info) + list(step.graph.input)}
    size = dims["flat__weights"][0]
    tail = size - ALIGN
    assert size % ALIGN == 0 and tail == ALIGN * -(-(4 * width + 3) // ALIGN)
    cuts = [n for n in step.graph.node if n.name.startswith(PREFIX + "/") and n.op_type in ("Split", "Concat")]
    axes = [dims[n.output[0] if n.op_type == "Concat" else n.input[0]][0] for n in cuts]
    assert len(cuts) == 4 and max(axes) <= max(size // ALIGN, tail) < size
    assert not any(n.op_type in ("Pad", "Slice") for n in step.graph.node if n.name.startswith(PREFIX + "/"))
    state = pack(meta, dict(np.load(str(tmp_path / "r" / "state.npz"))))
    w = state["flat__weights"]
    used = np.zeros(w.size, bool)
    for _, off, shape in table:
        used[off:off + int(np.prod(shape))] = True
    assert w.size == size and not w[~used].any()  # the padding is zero


def _adamw(w, m, v, g, t, lr, wd, b1=0.9, b2=0.999, eps=1e-8):
    """torch.optim.AdamW's step t (1-based), in float32."""
    f = np.float32
    m = f(b1) * m + f(1 - b1) * g
    v = f(b2) * v + f(1 - b2) * (g * g)
    w = w * f(1 - lr * wd)
    denom = np.sqrt(v) / f(np.sqrt(1 - b2 ** t)) + f(eps)
    return w - f(lr / (1 - b1 ** t)) * (m / denom), m, v


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_flat_step_is_the_per_weight_formula_and_a_skipped_step_changes_nothing(tmp_path, optimizer):
    p = str(tmp_path / "cnn.onnx")
    onnx.save(tiny.cnn(), p)
    run = str(tmp_path / "run")
    lr, wd, mom = 0.02, 0.01, 0.9
    meta = build_step(p, run, loss="cross-entropy", precision="fp32", optimizer=optimizer, lr=lr, weight_decay=wd,
                      momentum=mom, expose_grads=True, init_scale=256.0)
    r = StepRunner(run, meta, latest_state(run)[0], device_state=False)  # r.state: numpy
    names = [o.name for o in r.sess.get_outputs()]
    batches = [tiny.bars(8, seed=i) for i in range(5)]
    batches[2]["x"][1, 0, 2, 3] = np.inf  # the third step overflows: skipped
    t = 0
    for i, b in enumerate(batches):
        before = r.state_numpy()
        out = dict(zip(names, r.sess.run(None, {**b, **r.state})))
        r.state = {s["input"]: out[s["output"]] for s in graph_state(meta)}
        after = r.state_numpy()
        assert set(after) == set(before)  # the per-tensor state, whatever the buffers
        if i == 2:
            assert not out["all_finite"]
            for k in before:
                if k not in (SCALE, CLEAN):  # weights, moments, BN statistics, step: bit for bit
                    assert np.array_equal(after[k], before[k]), k
            assert float(after[SCALE]) == 128.0
            continue
        assert out["all_finite"]
        t += 1
        assert int(after[STEP]) == t
        for w in meta["weights"]:
            g = out[w + "__grad"]
            if optimizer == "adamw":
                want = _adamw(before[w], before[w + "__exp_avg"], before[w + "__exp_avg_sq"], g, t, lr, wd)
                # float32 rounding of the step beside the weight's size (test_train.py's tolerances)
                for got, ref, atol in zip((after[w], after[w + "__exp_avg"], after[w + "__exp_avg_sq"]), want,
                                          (1e-6, 1e-8, 1e-10)):
                    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=atol, err_msg=w)
            else:
                buf = np.float32(mom) * before[w + "__momentum"] + (g + np.float32(wd) * before[w])
                np.testing.assert_allclose(after[w + "__momentum"], buf, rtol=1e-5, atol=1e-7, err_msg=w)
                np.testing.assert_allclose(after[w], before[w] - np.float32(lr) * buf, rtol=1e-5, atol=1e-7)


def test_pack_and_unpack_are_inverse_and_refuse_a_foreign_state(tmp_path):
    p = str(tmp_path / "cnn.onnx")
    onnx.save(tiny.cnn(), p)
    meta = build_step(p, str(tmp_path / "run"), loss="cross-entropy", optimizer="adamw", grad_accum=2)
    state = latest_state(str(tmp_path / "run"))[0]
    rng = np.random.default_rng(0)
    state = {k: (rng.standard_normal(v.shape).astype(np.float32) if v.dtype == np.float32 else v)
             for k, v in state.items()}
    packed = pack(meta, state)
    assert set(packed) == {s["input"] for s in graph_state(meta)}
    assert len(packed) < len(state)
    back = unpack(meta, packed)
    assert set(back) == set(state) and all(np.array_equal(back[k], state[k]) for k in state)
    bad = dict(state, **{"conv.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(GraphmpError, match=r"'conv.weight' is float32 \[2, 2\]"):
        pack(meta, bad, "somewhere")
    with pytest.raises(GraphmpError, match="lacks"):
        pack(meta, {k: v for k, v in state.items() if k != "fc.bias"}, "somewhere")


def test_a_packing_table_with_overlapping_offsets_is_one_line_naming_the_buffer(tmp_path):
    """A run folder's train.json is untrusted: a table whose offsets do not follow each other
    (unpack would read another tensor's values, or past the buffer) is refused when the run
    is loaded, before any step."""
    import json
    p = str(tmp_path / "cnn.onnx")
    onnx.save(tiny.cnn(), p)
    run = tmp_path / "run"
    build_step(p, str(run), loss="cross-entropy", optimizer="sgd", lr=0.1)
    meta = json.loads((run / "train.json").read_text())
    table = meta["flat"]["buffers"]["flat__weights"]
    table[1][1] = table[0][1]  # the second tensor read from the first one's place
    (run / "train.json").write_text(json.dumps(meta))
    with pytest.raises(GraphmpError, match="'flat__weights' has gaps or overlaps"):
        load_run(str(run))


def _old_run(tmp_path) -> str:
    run = str(tmp_path / "old")
    shutil.copytree(OLD_RUN, run)
    return run


def test_a_run_folder_built_before_flat_state_resumes_from_its_checkpoint(tmp_path):
    run = _old_run(tmp_path)
    meta = load_run(run)
    assert "flat" not in meta and "conv.weight" in {s["input"] for s in meta["state"]}
    state, ck = latest_state(run)
    assert ck["step"] == 2
    data = tiny.bars(16)
    res = train(run, data, epochs=2, batch_size=8, seed=0, progress=False)
    assert res.summary["steps"] == 4 and res.summary["steps_this_call"] == 2
    after, ck2 = latest_state(run)
    assert ck2["step"] == 4 and set(after) == set(state)
    assert not np.array_equal(after["conv.weight"], state["conv.weight"])
    assert np.isfinite(evaluate(run, data)["loss"])
    export(run, str(tmp_path / "out.onnx"))
    assert onnx.load(str(tmp_path / "out.onnx")).graph.initializer


def test_a_flat_build_steps_an_old_checkpoint_as_the_old_graph_does(tmp_path):
    """The old run's checkpoint (per-tensor state) fed to a step built now from the same model
    and options gives the same next state as the old step graph: to FP32 rounding, since the
    gradients are now formulated otherwise (convolution weight gradients as GEMMs, BatchNorm's
    own rule), so they round differently."""
    run = _old_run(tmp_path)
    old_meta = load_run(run)
    state, _ = latest_state(run)
    p = str(tmp_path / "cnn.onnx")
    onnx.save(tiny.cnn(), p)
    cfg = old_meta["config"]
    meta = build_step(p, str(tmp_path / "new"), loss="cross-entropy", optimizer="adamw", lr=cfg["lr"],
                      weight_decay=cfg["weight_decay"], precision="fp32")
    assert meta["flat"] and [s["input"] for s in meta["state"]] == [s["input"] for s in old_meta["state"]]
    batch = tiny.bars(8, seed=3)
    old, new = StepRunner(run, old_meta, state), StepRunner(str(tmp_path / "new"), meta, state)
    (loss_a, applied_a, scale_a), (loss_b, applied_b, scale_b) = old.step(batch), new.step(batch)
    assert applied_a and applied_b and scale_a == scale_b and loss_a == pytest.approx(loss_b, rel=1e-6)
    a, b = old.state_numpy(), new.state_numpy()
    assert a.keys() == b.keys()
    # a conv bias before a BatchNorm has a gradient that cancels to rounding noise, which
    # AdamW's first step turns into +-lr moves: its moments agree, its update cannot
    biggest = max(np.abs(a[k]).max() for k in a if k.endswith("__exp_avg"))
    noise = {k for k in meta["weights"] if np.abs(a[k + "__exp_avg"]).max() < 1e-5 * biggest}
    assert noise == {"conv.bias"}
    for k in a.keys() - noise:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_an_old_run_folder_splits_for_data_parallelism_at_its_per_weight_gradients(tmp_path):
    from graphmp.train.dp_step import DeviceState, Halves, dp_step
    run = _old_run(tmp_path)
    meta = load_run(run)
    state, _ = latest_state(run)
    halves = Halves(run, meta, 1, ["CPUExecutionProvider"])
    assert halves.grads == [w + "__grad" for w in meta["weights"]]
    batch = tiny.bars(8, seed=1)
    st = DeviceState(pack(meta, state), [s["input"] for s in graph_state(meta)], halves.device)
    times = {"compute": 0.0, "all_reduce": 0.0, "update": 0.0}
    _, applied = dp_step(halves, lambda flat: flat, 1, [batch], st, times)
    fused = StepRunner(run, meta, state)
    fused.step(batch)
    assert applied
    split, ref = unpack(meta, st.numpy()), fused.state_numpy()
    for k in meta["weights"]:
        np.testing.assert_allclose(split[k], ref[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_next_state_reads_the_graph_outputs_per_tensor(tmp_path):
    p = str(tmp_path / "m.onnx")
    onnx.save(tiny.mlp(), p)
    run = str(tmp_path / "run")
    meta = build_step(p, run, loss="cross-entropy", optimizer="sgd", momentum=0.0, lr=0.1, loss_scale=1.0,
                      precision="fp32", expose_grads=True)
    state = latest_state(run)[0]
    r = StepRunner(run, meta, state)
    out = dict(zip([o.name for o in r.sess.get_outputs()], r.sess.run(None, {**tiny.blobs(8), **pack(meta, state)})))
    nxt = next_state(meta, out)
    for w in meta["weights"]:  # plain SGD: w - lr * g, each weight from its own slice
        np.testing.assert_allclose(nxt[w], state[w] - np.float32(0.1) * out[w + "__grad"], rtol=1e-6, atol=1e-7)
    assert json.loads(open(os.path.join(run, "train.json")).read())["flat"]["grad"] == "flat__grad"

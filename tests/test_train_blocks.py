"""The update's elementwise chain in cache-sized blocks (graphmp/train/blocks.py): a CPU
StepRunner runs it as Scans over rows of the flat buffers, and every step gives the same bits as
step.onnx itself run by ONNX Runtime, skipped steps, accumulation windows and the bound path
included."""
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphmp.train import blocks
from graphmp.train.blocks import BLOCK, MAX_BLOCK, MIN_BLOCK, MIN_SIZE, block_length, block_update, for_session
from graphmp.train.flat import WEIGHTS, next_state, pack
from graphmp.train.loop import StepRunner, latest_state
from graphmp.train.step import build_step


@pytest.fixture(autouse=True)
def small_buffers_block(monkeypatch):
    """These models' buffers (~0.27M weights) are under MIN_SIZE, which only says when blocks
    pay: let them block, so the tests run in a second."""
    monkeypatch.setattr(blocks, "MIN_SIZE", 0)


def _wide_mlp(width: int = 512, classes: int = 3):
    """x [N, 4] -> Gemm(width)+Relu -> Gemm(width)+Relu -> Gemm(classes): ~267K weights, enough
    for blocks of a few ten thousand elements."""
    r = np.random.default_rng(0)
    nodes, inits, prev, n_in = [], [], "x", 4
    for i, n_out in enumerate([width, width, classes]):
        inits += [numpy_helper.from_array((r.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32),
                                          f"w{i}"),
                  numpy_helper.from_array(np.zeros(n_out, np.float32), f"b{i}")]
        last = n_out == classes
        nodes.append(helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], ["y" if last else f"z{i}"], transB=1))
        if not last:
            nodes.append(helper.make_node("Relu", [f"z{i}"], [f"h{i}"]))
        prev, n_in = f"h{i}", n_out
    g = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", classes])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _batches(n: int, overflow_at: int | None = None) -> list:
    r = np.random.default_rng(1)
    out = [{"x": r.standard_normal((8, 4)).astype(np.float32), "labels": r.integers(0, 3, 8).astype(np.int64)}
           for _ in range(n)]
    if overflow_at is not None:
        out[overflow_at]["x"][2, 1] = np.inf
    return out


def _build(tmp_path, **opts):
    p = str(tmp_path / "wide.onnx")
    onnx.save(_wide_mlp(), p)
    run = str(tmp_path / "run")
    meta = build_step(p, run, loss="cross-entropy", lr=0.01, **opts)
    return run, meta


def _reference_states(run: str, meta: dict, batches: list) -> list:
    """The per-tensor state after each batch, step.onnx run as it is written (whole-buffer nodes)."""
    sess = ort.InferenceSession(os.path.join(run, "step.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    state, out = latest_state(run)[0], []
    for b in batches:
        state = next_state(meta, dict(zip(names, sess.run(None, {**b, **pack(meta, state)}))))
        out.append(state)
    return out


@pytest.mark.parametrize("opts", [
    dict(optimizer="adamw", weight_decay=0.01, clip_norm=1.0, precision="mixed"),
    dict(optimizer="sgd", momentum=0.9, grad_accum=2, precision="fp32", expose_grads=True),
], ids=["adamw-clip-mixed", "sgd-accum"])
@pytest.mark.parametrize("bound", [False, True], ids=["plain", "bound"])
def test_blocked_steps_are_the_step_graph_bit_for_bit(tmp_path, opts, bound):
    run, meta = _build(tmp_path, **opts)
    batches = _batches(6, overflow_at=2)
    want = _reference_states(run, meta, batches)
    r = StepRunner(run, meta, latest_state(run)[0], threads=1, device_state=bound)
    assert r.rows, "the runner did not block the update"
    declared = {i.name: i.shape for i in r.sess.get_inputs()}
    assert len(declared[WEIGHTS]) == 2 and declared[WEIGHTS][1] <= BLOCK
    applied = []
    for b, expected in zip(batches, want):
        applied.append(r.step(b)[1])
        got = r.state_numpy()
        assert set(got) == set(expected)
        for k in expected:
            assert np.array_equal(got[k], expected[k], equal_nan=True), k  # an overflowed window holds NaN
    assert applied[2] is False and applied[0] is True  # the overflowing batch was skipped


def test_accumulation_blocks_in_two_scans_around_the_window_check(tmp_path):
    """With grad_accum the window's mean feeds the finite check, which gates the optimizer: one
    Scan cannot both write the mean and wait for the check, so there are two, in order."""
    run, meta = _build(tmp_path, optimizer="adamw", grad_accum=3, precision="fp32")
    m = onnx.load(os.path.join(run, "step.onnx"))
    size = next(i for i in m.graph.input if i.name == WEIGHTS).type.tensor_type.shape.dim[0].dim_value
    blocked, rows = block_update(m, size, threads=1, pairs=[(WEIGHTS, WEIGHTS + "__next")])
    onnx.checker.check_model(blocked, full_check=True)
    scans = [n for n in blocked.graph.node if n.op_type == "Scan"]
    assert len(scans) == 2
    order = [n.name for n in blocked.graph.node]
    # the first Scan's results, back under their own names (the Reshapes that take its rows)
    first_outputs = {n.output[0] for n in blocked.graph.node
                     if n.op_type == "Reshape" and n.input[0] in scans[0].output}
    check = [n for n in blocked.graph.node if n.op_type == "ReduceSum" and set(n.input) & first_outputs]
    assert check and order.index(scans[0].name) < order.index(check[0].name) < order.index(scans[1].name)
    assert rows == {WEIGHTS: rows[WEIGHTS], WEIGHTS + "__next": rows[WEIGHTS]}  # only the pair it was given


@pytest.mark.parametrize("n,threads,want", [
    (1024 * 261, 1, 512 * 87),           # 261 rows of 1024 = 2^10 * 9 * 29: the largest divisor in range
    (BLOCK * 2, 1, BLOCK),
    (BLOCK * 2 - 1024, 1, None),          # fits in two blocks: not worth it
    (2 * 100_003, 1, None),               # 100003 is prime: no divisor in range
    (BLOCK * 8, 4, BLOCK * 4),            # each of 4 threads keeps a block of BLOCK
    (MAX_BLOCK * 12, 64, MAX_BLOCK),      # 64 threads share a block of MAX_BLOCK, not 64 * BLOCK
])
def test_block_length(n, threads, want):  # MIN_SIZE is 0 here (the fixture)
    c = block_length(n, threads)
    assert c == want
    if c:
        assert n % c == 0 and MIN_BLOCK <= c <= min(BLOCK * threads, MAX_BLOCK)


def test_no_block_length_leaves_the_model_as_it_is(tmp_path):
    run, meta = _build(tmp_path, optimizer="adamw", precision="fp32")
    m = onnx.load(os.path.join(run, "step.onnx"))
    same, rows = block_update(m, 1024 * 1009, threads=1)
    assert same is m and rows == {}


def test_data_parallel_update_half_is_blocked_and_gives_the_same_bits(tmp_path):
    """The data-parallel step's update half (dp_step.Halves, a world of one here: no all-reduce)
    runs blocked on the CPU, its buffers in their own shape (the gradient half shares them)."""
    from graphmp.train.dp_step import DeviceState, Halves, dp_step
    from graphmp.train.flat import graph_state_names, unpack
    from graphmp.train.runfiles import load_onnx
    from graphmp.train.split import split_step
    run, meta = _build(tmp_path, optimizer="adamw", weight_decay=0.01, precision="fp32")
    _, upd, _ = split_step(load_onnx(os.path.join(run, "step.onnx")), meta)
    blocked, rows = for_session(upd, meta, ["CPUExecutionProvider"], 1, row_io=False)
    assert rows == {} and any(n.op_type == "Scan" for n in blocked.graph.node)
    batches = _batches(4, overflow_at=1)
    want = _reference_states(run, meta, batches)
    h = Halves(run, meta, 1, ["CPUExecutionProvider"])
    st = DeviceState(pack(meta, latest_state(run)[0]), graph_state_names(meta), h.device)
    times = {"compute": 0.0, "all_reduce": 0.0, "update": 0.0}
    for b, expected in zip(batches, want):
        dp_step(h, None, 1, [b], st, times)
        got = unpack(meta, st.numpy())
        for k in expected:
            assert np.array_equal(got[k], expected[k]), k


def _runtime_view_model(classes: int = 3):
    """x [N, 512] @ (w [1024, 256] viewed as [-1, x's width], a shape computed at run time)
    -> Gemm(classes): the gradient of w is reshaped back by a shape computed at run time too, so
    ONNX shape inference cannot tell the flat gradient's length (as with torch's exported
    attention)."""
    r = np.random.default_rng(2)
    inits = [numpy_helper.from_array((r.standard_normal((1024, 256)) * 0.03).astype(np.float32), "w"),
             numpy_helper.from_array((r.standard_normal((classes, 512)) * 0.1).astype(np.float32), "head"),
             numpy_helper.from_array(np.zeros(classes, np.float32), "b"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus_one")]
    nodes = [helper.make_node("Shape", ["x"], ["x_shape"], start=1),
             helper.make_node("Concat", ["minus_one", "x_shape"], ["view"], axis=0),
             helper.make_node("Reshape", ["w", "view"], ["w_view"]),
             helper.make_node("MatMul", ["x", "w_view"], ["h"]),
             helper.make_node("Gemm", ["h", "head", "b"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "view", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 512])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", classes])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_a_gradient_of_run_time_shape_still_blocks_the_whole_chain(tmp_path):
    p = str(tmp_path / "view.onnx")
    onnx.save(_runtime_view_model(), p)
    run = str(tmp_path / "run")
    meta = build_step(p, run, loss="cross-entropy", lr=0.01, optimizer="adamw", precision="fp32")
    step = onnx.load(os.path.join(run, "step.onnx"))
    inferred = onnx.shape_inference.infer_shapes(step).graph
    grad = next((v for v in inferred.value_info if v.name == meta["flat"]["grad"]), None)
    assert grad is None or not grad.type.tensor_type.shape.dim[0].HasField("dim_value")  # what the test is about
    r = np.random.default_rng(3)
    batches = [{"x": r.standard_normal((4, 512)).astype(np.float32),
                "labels": r.integers(0, 3, 4).astype(np.int64)} for _ in range(3)]
    want = _reference_states(run, meta, batches)
    blocked, _ = for_session(step, meta, None, 1)
    scans = [n for n in blocked.graph.node if n.op_type == "Scan"]
    assert len(scans) == 1 and {n.op_type for n in scans[0].attribute[0].g.node} >= {"Where", "Sqrt", "Div"}
    runner = StepRunner(run, meta, latest_state(run)[0], threads=1)
    for b, expected in zip(batches, want):
        runner.step(b)
        got = runner.state_numpy()
        for k in expected:
            assert np.array_equal(got[k], expected[k]), k


def test_buffers_under_min_size_stay_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(blocks, "MIN_SIZE", 1 << 20)
    assert block_length(MIN_SIZE - 1024, 1) is None and block_length(MIN_SIZE, 1) == BLOCK
    run, meta = _build(tmp_path, optimizer="adamw", precision="fp32")  # ~0.27M weights
    r = StepRunner(run, meta, latest_state(run)[0], threads=1)
    assert r.rows == {} and len({i.name: i.shape for i in r.sess.get_inputs()}[WEIGHTS]) == 1


def test_a_step_graph_out_of_topological_order_is_left_as_written(tmp_path):
    """A run folder from elsewhere whose nodes are not in topological order (ONNX asks for it;
    the layers assume it): no blocking, no error of ours; ONNX Runtime judges the graph."""
    run, meta = _build(tmp_path, optimizer="adamw", precision="fp32")
    m = onnx.load(os.path.join(run, "step.onnx"))
    nodes = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(reversed(nodes))
    same, rows = for_session(m, meta, None, 1)
    assert same is m and rows == {}


def test_a_batchnorm_cnn_blocks_beside_its_running_statistics(tmp_path, monkeypatch):
    """BatchNorm's running statistics are a buffer of another length (their own Where on the
    finite flag): they stay outside the Scan, and every state tensor keeps the step graph's
    bits. Blocks this short only to fit the tiny CNN (the logic does not depend on the length)."""
    from fixtures import tiny
    monkeypatch.setattr(blocks, "BLOCK", 2048)
    monkeypatch.setattr(blocks, "MIN_BLOCK", 256)
    p = str(tmp_path / "cnn.onnx")
    onnx.save(tiny.cnn(channels=64), p)
    run = str(tmp_path / "run")
    meta = build_step(p, run, loss="cross-entropy", lr=0.01, optimizer="sgd", momentum=0.9, weight_decay=1e-4,
                      precision="mixed", lr_schedule="cosine", warmup_steps=2, total_steps=10)
    assert meta["bn_stats"]
    batches = [tiny.bars(4, seed=i) for i in range(4)]
    batches[1]["x"][0, 0, 1, 1] = np.inf
    want = _reference_states(run, meta, batches)
    r = StepRunner(run, meta, latest_state(run)[0], threads=1)
    assert r.rows
    for b, expected in zip(batches, want):
        r.step(b)
        got = r.state_numpy()
        for k in expected:
            assert np.array_equal(got[k], expected[k]), k

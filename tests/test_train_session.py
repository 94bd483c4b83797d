"""The step session: its CUDA provider options (chosen from the step graph, the rule shared
with graphmp.session), the bound path's fixed bindings (run here on the CPU provider with
device_state=True: the same code as on CUDA), and --cuda-graph's refusals. The CUDA path
itself needs a GPU (benchmarks/train_gpu.sh measures it); nothing here pretends to run it."""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from fixtures import tiny as tm
from graphmp.cli import main
from graphmp.errors import GraphmpError
from graphmp.session import CPU, CUDA, TRAINING_CONV_OPTIONS, conv_provider_options
from graphmp.train.device import batch_dims, cuda_graph_blockers, pin_dims, step_cuda_options, step_providers
from graphmp.train.flat import graph_state, graph_state_names, pack
from graphmp.train.loop import latest_state, load_run, train
from graphmp.train.runner import GRAPH_ID, StepRunner, graph_run_options
from graphmp.train.step import build_step


@pytest.fixture(scope="module")
def cnn_runs(tmp_path_factory):
    """{precision: run dir} of the tiny CNN (Conv + BatchNorm + MaxPool), dynamic batch."""
    d = tmp_path_factory.mktemp("cnn")
    onnx.save(tm.cnn(), str(d / "cnn.onnx"))
    runs = {}
    for p in ("fp32", "mixed"):
        runs[p] = str(d / p)
        build_step(str(d / "cnn.onnx"), runs[p], precision=p, lr=1e-2, growth_interval=2)
    return runs


def _step_model(run):
    meta = load_run(run)
    return onnx.load(f"{run}/{meta['step_model']}"), meta


def _batches(sizes, seed=3):
    data = tm.bars(sum(sizes), seed=seed)
    out, at = [], 0
    for n in sizes:
        out.append({k: v[at:at + n] for k, v in data.items()})
        at += n
    return out


# --- provider options -----------------------------------------------------------------------------

def _two_convs():
    """x [N, 1, 8, 8] -> Conv -> Relu -> Conv -> pool -> Gemm: the second Conv's input gradient
    is a ConvTranspose in the step graph (the first one's is not needed)."""
    r = np.random.default_rng(0)
    inits = {n: r.standard_normal(s) * 0.3 for n, s in (("w1", (4, 1, 3, 3)), ("w2", (4, 4, 3, 3)), ("fc", (3, 4)),
                                                          ("fcb", (3,)))}
    mk = onnx.helper.make_node
    nodes = [mk("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), mk("Relu", ["c1"], ["r1"]),
             mk("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]), mk("GlobalAveragePool", ["c2"], ["p"]),
             mk("Flatten", ["p"], ["f"]), mk("Gemm", ["f", "fc", "fcb"], ["logits"], transB=1)]
    return tm._model(nodes, inits, ["N", 1, 8, 8], ["N", 3], "two_convs")


def test_step_options_follow_the_precision_of_the_convolutions(cnn_runs, tmp_path):
    mixed, _ = _step_model(cnn_runs["mixed"])
    fp32, _ = _step_model(cnn_runs["fp32"])
    assert not any(n.op_type == "ConvTranspose" for n in mixed.graph.node)  # one Conv: no input gradient
    assert step_cuda_options(mixed) == {"prefer_nhwc": "1", **TRAINING_CONV_OPTIONS}  # FP16 convs: NHWC kernels
    # an FP16 input gradient is a ConvTranspose, which ORT 1.31 ran on the CPU under prefer_nhwc=1
    # (a mixed ResNet-50 step 4x slower): no NHWC for such a step graph
    onnx.save(_two_convs(), str(tmp_path / "two.onnx"))
    build_step(str(tmp_path / "two.onnx"), str(tmp_path / "two"), precision="mixed", optimizer="sgd", lr=0.1)
    two, _ = _step_model(str(tmp_path / "two"))
    assert any(n.op_type == "ConvTranspose" for n in two.graph.node)
    assert step_cuda_options(two) == TRAINING_CONV_OPTIONS
    assert step_cuda_options(fp32) == TRAINING_CONV_OPTIONS                           # FP32 convs: no NHWC
    assert step_cuda_options(fp32, cuda_graph=True) == {**TRAINING_CONV_OPTIONS, "enable_cuda_graph": "1"}


def test_a_step_without_convolutions_asks_for_no_conv_options(tmp_path):
    onnx.save(tm.mlp(), str(tmp_path / "mlp.onnx"))
    build_step(str(tmp_path / "mlp.onnx"), str(tmp_path / "run"), precision="mixed", optimizer="sgd", lr=0.1)
    model, _ = _step_model(str(tmp_path / "run"))
    assert step_cuda_options(model) == {}


def test_one_rule_for_converted_models_and_training_steps():
    """Inference (graphmp convert's metadata) gets prefer_nhwc only; a training step adds cuDNN's settings."""
    assert conv_provider_options(3, 2) == {"prefer_nhwc": "1"}
    assert conv_provider_options(3, 0) == {}
    assert conv_provider_options(3, 2, training=True) == {"prefer_nhwc": "1", **TRAINING_CONV_OPTIONS}
    assert conv_provider_options(3, 2, fp16_transposed=1) == {}  # an FP16 ConvTranspose: no NHWC
    assert conv_provider_options(3, 2, training=True, fp16_transposed=2) == TRAINING_CONV_OPTIONS
    assert conv_provider_options(0, 0, training=True) == {}


def test_step_providers_give_a_plain_cuda_entry_the_steps_options(cnn_runs):
    model, _ = _step_model(cnn_runs["mixed"])
    got = step_providers([CUDA, CPU], model)
    assert got == [(CUDA, step_cuda_options(model)), CPU]
    mine = (CUDA, {"prefer_nhwc": "0"})
    assert step_providers([mine, CPU], model) == [mine, CPU]  # options given by the caller are kept
    assert step_providers(None, model) == [CPU] and step_providers([CPU], model) == [CPU]


def test_summary_records_the_options_the_session_reports(cnn_runs, tmp_path):
    import shutil
    run = str(tmp_path / "run")
    shutil.copytree(cnn_runs["fp32"], run)
    res = train(run, tm.bars(64, seed=1), epochs=1, batch_size=16, checkpoint_every=0, progress=False)
    sess = ort.InferenceSession(f"{run}/{load_run(run)['step_model']}", providers=[CPU])
    assert res.summary["provider_options"] == sess.get_provider_options()[CPU]
    assert res.summary["cuda_graph"] is False
    assert json.load(open(f"{run}/summary.json"))["provider_options"] == res.summary["provider_options"]


# --- the bound path's bindings ----------------------------------------------------------------------

def test_bound_path_equals_plain_path_across_a_batch_shape_change(cnn_runs):
    """3 steps of 16, then a last partial batch of 8 (drop_last=False): the same losses, flags,
    scales and state, bit for bit."""
    run = cnn_runs["mixed"]
    batches = _batches([16, 16, 16, 8])
    runners = {}
    for bound in (False, True):
        r = StepRunner(run, load_run(run), latest_state(run)[0], device_state=bound)
        runners[bound] = (r, [r.step(b) for b in batches])
    (plain, a), (bound, b) = runners[False], runners[True]
    assert bound.bound and not plain.bound
    np.testing.assert_array_equal(np.array(a), np.array(b))
    sa, sb = plain.state_numpy(), bound.state_numpy()
    assert set(sa) == set(sb)
    for k in sa:
        assert np.array_equal(sa[k], sb[k]), k


@pytest.mark.parametrize("bound", [None, False])
def test_the_cpu_binds_by_default_and_set_state_puts_a_state_back(cnn_runs, bound):
    """With no device_state the CPU runs the bound path too (no fresh state buffers per step);
    set_state puts a per-tensor state back in place, after which the same batches give the same
    bits as a new runner from that state, on either path."""
    run = cnn_runs["fp32"]
    meta, init = load_run(run), latest_state(run)[0]
    batches = _batches([16, 16, 16])
    r = StepRunner(run, meta, init, device_state=bound)
    assert r.bound is (bound is None)
    first = [r.step(b) for b in batches]
    after = r.state_numpy()
    assert not np.array_equal(after[meta["weights"][0]], init[meta["weights"][0]])
    r.set_state(init)
    assert all(np.array_equal(r.state_numpy()[k], init[k]) for k in init)
    again = [r.step(b) for b in batches]
    np.testing.assert_array_equal(np.array(first), np.array(again))
    for k, v in r.state_numpy().items():
        assert np.array_equal(v, after[k]), k


class _Recorder:
    """Counts the IOBinding calls of the steps run while it is installed (monkeypatched methods)."""
    METHODS = ("bind_ortvalue_input", "bind_ortvalue_output", "bind_cpu_input", "bind_output", "bind_input",
               "clear_binding_inputs", "clear_binding_outputs")

    def __init__(self, monkeypatch):
        self.calls, self.runs = [], []
        cls = ort.IOBinding
        for m in self.METHODS:
            orig = getattr(cls, m)
            monkeypatch.setattr(cls, m, self._wrap(m, orig))
        orig_run = ort.InferenceSession.run_with_iobinding

        def run(sess, io, run_options=None):
            self.runs.append(id(io))
            return orig_run(sess, io, run_options)
        monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", run)

    def _wrap(self, name, orig):
        def wrapped(io, *a, **kw):
            self.calls.append((name, a[0] if a else None))
            return orig(io, *a, **kw)
        return wrapped


def test_a_bound_step_binds_nothing_but_a_batch_of_a_new_shape(cnn_runs, monkeypatch):
    run = cnn_runs["mixed"]
    meta = load_run(run)
    r = StepRunner(run, meta, latest_state(run)[0], device_state=True)
    b16, b16b, b16c, b8 = _batches([16, 16, 16, 8])
    r.step(b16)  # the first batch is bound here, once per IOBinding
    rec = _Recorder(monkeypatch)
    r.step(b16b)
    r.step(b16c)
    assert rec.calls == []  # no state, result or batch binding, no clear: the batch is copied in place
    assert len(rec.runs) == 2 and rec.runs[0] != rec.runs[1]  # the two fixed IOBindings in turn
    r.step(b8)  # a new batch shape: the batch inputs are bound again (on both IOBindings), nothing else
    rebound = sorted({name for _, name in rec.calls})
    assert rebound == sorted(b8) and {m for m, _ in rec.calls} == {"bind_ortvalue_input"}
    assert not set(rebound) & set(graph_state_names(meta))
    # and the batch the caller gave is not written to by the in-place copies
    again = _batches([16, 16, 16, 8])
    for mine, fresh in zip((b16, b16b, b16c, b8), again):
        for k in mine:
            assert np.array_equal(mine[k], fresh[k])


def test_graph_run_options_select_one_captured_graph_per_binding_set():
    ids = [graph_run_options(k).get_run_config_entry(GRAPH_ID) for k in (0, 1)]
    assert ids == ["1", "2"]  # distinct, and neither 0 (a run without the option) nor -1 (no graph)


# --- --cuda-graph's refusals --------------------------------------------------------------------------

def test_cuda_graph_blockers_name_the_free_batch_dims(cnn_runs):
    model, meta = _step_model(cnn_runs["mixed"])
    why = cuda_graph_blockers(model, set(graph_state_names(meta)))
    assert any("input 'x'" in w and "'N'" in w for w in why), why
    assert not any("flat__" in w for w in why)  # the state's dims are fixed: never a reason


def test_cuda_graph_is_refused_in_one_line_without_cuda(cnn_runs, tmp_path, capsys):
    np.savez(tmp_path / "train.npz", **tm.bars(64, seed=1))
    rc = main(["train", cnn_runs["fp32"], "--data", str(tmp_path / "train.npz"), "--batch-size", "16",
               "--device", "cpu", "--cuda-graph", "-q", "--no-resume", "--checkpoint-every", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--cuda-graph needs ONNX Runtime's CUDA provider" in err, err


def test_cuda_graph_refusals_on_this_cpu_only_onnxruntime(cnn_runs):
    """Asked for CUDA that does not come up (this onnxruntime has no CUDA provider), with the
    state not bound, or without the batch size to pin: one line each, no step run."""
    run = cnn_runs["mixed"]
    meta, state = load_run(run), latest_state(run)[0]
    with pytest.raises(GraphmpError, match="came up on CPUExecutionProvider, not CUDAExecutionProvider"):
        StepRunner(run, meta, state, providers=[CUDA, CPU], cuda_graph=True, batch_size=16)
    with pytest.raises(GraphmpError, match="needs the state bound"):
        StepRunner(run, meta, state, providers=[CUDA, CPU], cuda_graph=True, batch_size=16, device_state=False)
    with pytest.raises(GraphmpError, match="give batch_size"):
        StepRunner(run, meta, state, providers=[CUDA, CPU], cuda_graph=True)


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_pinning_the_batch_axis_folds_the_host_side_shape_nodes_and_steps_the_same(cnn_runs, precision):
    """pin_dims: no Shape or Size node left (under CUDA they write host memory, which blocks a
    CUDA graph), nothing else for cuda_graph_blockers to object to, and 3 steps of the pinned
    graph give what the step graph gives."""
    model, meta = _step_model(cnn_runs[precision])
    names = set(graph_state_names(meta))
    assert any(n.op_type in ("Shape", "Size") for n in model.graph.node)  # what there is to fold
    pinned = pin_dims(model, batch_dims(model, meta, 16))
    assert batch_dims(model, meta, 16) == {"N": 16}
    assert not [n.name for n in pinned.graph.node if n.op_type in ("Shape", "Size")]
    assert cuda_graph_blockers(pinned, names) == []
    assert "'N'" in cuda_graph_blockers(model, names)[0]  # unpinned: the free batch dim is named
    entries = graph_state(meta)
    sessions = [ort.InferenceSession(m.SerializeToString(), providers=[CPU]) for m in (model, pinned)]
    states = [pack(meta, latest_state(cnn_runs[precision])[0]) for _ in sessions]
    outputs = [meta["loss_output"], meta["finite_output"]] + [e["output"] for e in entries]
    for batch in _batches([16, 16, 16]):
        got = []
        for k, sess in enumerate(sessions):
            outs = sess.run(outputs, {**batch, **{e["input"]: states[k][e["input"]] for e in entries}})
            states[k] = {e["input"]: v for e, v in zip(entries, outs[2:])}
            got.append(outs)
        for a, b in zip(*got):
            np.testing.assert_array_equal(a, b)


def test_help_teaches_cuda_graph(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--cuda-graph" in out and "static shapes" in out


# --- on a GPU (skipped without onnxruntime's CUDA provider) -----------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(CUDA not in ort.get_available_providers(), reason="needs onnxruntime-gpu and a GPU")
def test_cuda_bound_and_cuda_graph_steps_follow_the_cpu_step(cnn_runs):
    """On CUDA: the session reports the options graphmp chose (prefer_nhwc for the mixed step);
    the bound step and the CUDA-graph step (captured, then replayed) of the FP32 step give the
    CPU's losses to TF32 rounding, and the CUDA-graph step the bound one's to cuDNN's rounding."""
    mixed = StepRunner(cnn_runs["mixed"], load_run(cnn_runs["mixed"]), latest_state(cnn_runs["mixed"])[0],
                       providers=[CUDA, CPU], cuda_graph=True, batch_size=16)
    assert mixed.provider_options["prefer_nhwc"] == "1" and mixed.provider_options["enable_cuda_graph"] == "1"
    run = cnn_runs["fp32"]
    meta, state = load_run(run), latest_state(run)[0]
    runners = {"cpu": StepRunner(run, meta, state),
               "cuda": StepRunner(run, meta, state, providers=[CUDA, CPU]),
               "graph": StepRunner(run, meta, state, providers=[CUDA, CPU], cuda_graph=True, batch_size=16)}
    model, _ = _step_model(run)
    for name in ("cuda", "graph"):
        r = runners[name]
        assert r.device == "cuda" and r.bound and r.cuda_graph == (name == "graph")
        for k, v in step_cuda_options(model, cuda_graph=r.cuda_graph).items():
            assert r.provider_options[k] == v, (k, r.provider_options)
    batches = _batches([16] * 6)
    outs = {k: np.array([r.step(b) for b in batches]) for k, r in runners.items()}
    assert outs["graph"][:, 1].all() and outs["cuda"][:, 1].all()  # FP32: no overflow at any scale reached here
    np.testing.assert_allclose(outs["cuda"][:, 0], outs["cpu"][:, 0], rtol=1e-2)
    np.testing.assert_allclose(outs["graph"], outs["cuda"], rtol=1e-4)
    s_cuda, s_graph = runners["cuda"].state_numpy(), runners["graph"].state_numpy()
    for k in s_cuda:
        np.testing.assert_allclose(s_graph[k], s_cuda[k], rtol=1e-4, atol=1e-6, err_msg=k)

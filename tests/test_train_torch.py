"""The step graph's first-step weight gradients against torch.autograd, for two real
architectures exported by torch.onnx: a small CNN with BatchNorm (training mode: batch
statistics) and a small pre-LN transformer block (LayerNorm, MatMul attention, Softmax,
GELU via Erf). The CNN also at 128 channels ("cnn-wide"), whose strided conv on a 2x2 map
takes the GEMM forms of a wide conv on a small map: the forward as one Gemm over the batch
(graphmp/train/lower.py; FP32 only, the conv has a bias), dX as MatMul + col2im and dW as
one GEMM over the column matrix (rules/conv_gemm.py). torch is a test-only dependency: without it this file is skipped.

    /work/venv-export/bin/python -m pytest -q tests/test_train_torch.py   (has torch)

Error measure per weight: max |g_graph - g_torch| / scale, scale = max |g_torch| of that
weight, floored at 1e-3 * the largest gradient of the model (a conv bias followed by
training-mode BN has a true gradient of zero; both sides hold rounding noise there).
Tolerances: FP32 step graph 1e-4. Mixed precision (FP16 compute, FP32 islands): 1e-2 on
ONNX Runtime CPU (it rounds to FP16 at every Cast but computes FP16 ops in FP32, as Tensor
Core kernels accumulate), 6e-2 on the FP16-faithful reference evaluator (every op in its
declared dtype: its Conv weight gradient sums N*H*W = 512 products in FP16; measured
1.2e-2 there, and 5e-2 on the conv bias whose true gradient is zero).
"""
import os

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from graphmp.model_runs import run_reference  # noqa: E402
from fixtures.torch_models import CNN, Block, export  # noqa: E402
from graphmp.train.flat import next_state, pack  # noqa: E402
from graphmp.train.loop import latest_state, load_run  # noqa: E402
from graphmp.train.step import build_step  # noqa: E402

TOL = {("fp32", "ort"): 1e-4, ("mixed", "ort"): 1e-2, ("mixed", "fp16-faithful"): 6e-2}


def _case(kind, seed=0):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    if kind in ("cnn", "cnn-wide"):
        m = CNN(width=128 if kind == "cnn-wide" else 8)
        with torch.no_grad():  # non-trivial BN state (and no de-duplicated initializers)
            m.bn.weight.uniform_(0.5, 1.5)
            m.bn.bias.uniform_(-0.2, 0.2)
            m.bn.running_mean.uniform_(-0.1, 0.1)
            m.bn.running_var.uniform_(0.8, 1.2)
        x = rng.standard_normal((8, 3, 8, 8)).astype(np.float32)
        y = rng.integers(0, 5, 8)
    else:
        m = Block()
        x = rng.standard_normal((4, 6, 16)).astype(np.float32)
        y = rng.integers(0, 3, 4)
    return m, x, y.astype(np.int64)


def _torch_step(m, x, y):
    m.train()
    m.zero_grad()
    loss = torch.nn.functional.cross_entropy(m(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    grads = {k: p.grad.detach().numpy().copy() for k, p in m.named_parameters()}
    buffers = {k: b.detach().numpy().copy() for k, b in m.named_buffers() if "running" in k}
    return float(loss), grads, buffers


def _errors(got: dict, ref: dict) -> dict:
    floor = 1e-3 * max(float(np.abs(g).max()) for g in ref.values())
    return {k: float(np.abs(got[k] - ref[k]).max()) / max(float(np.abs(ref[k]).max()), floor) for k in ref}


@pytest.fixture(scope="module", params=["cnn", "cnn-wide", "block"])
def case(request, tmp_path_factory):
    kind = request.param
    m, x, y = _case(kind)
    path = export(m, x, str(tmp_path_factory.mktemp(kind) / f"{kind}.onnx"))
    loss, grads, buffers = _torch_step(m, x, y)
    return kind, path, x, y, loss, grads, buffers


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_first_step_gradients_match_torch_autograd(case, tmp_path, precision):
    kind, path, x, y, t_loss, t_grads, t_buffers = case
    run = str(tmp_path / "run")
    meta = build_step(path, run, precision=precision, expose_grads=True, optimizer="sgd", lr=0.1,
                      loss_scale=1024.0)
    assert set(meta["weights"]) == set(t_grads), "every torch parameter is a trainable master weight"
    if kind == "block":  # torch.onnx wrote ln2.weight = Identity(ln1.weight) (equal values): untied again
        assert {"ln2.weight", "ln2.bias"} <= set(meta["untied"])
    if kind == "cnn-wide":  # conv2 (128 -> 128, stride 2, 4x4 -> 2x2) in its GEMM forms
        step = onnx.load(os.path.join(run, "step.onnx"))
        # (its forward only in FP32: an FP16 conv with a bias stays a Conv, graphmp/train/lower.py)
        lowered = not any(n.op_type == "Conv" and "conv2.weight" in n.input[1] for n in step.graph.node)
        assert lowered == (precision == "fp32")
        assert not any(n.op_type == "ConvTranspose" and "conv2.weight" in n.input[1] for n in step.graph.node)
    state, _ = latest_state(run)
    feeds = {"x": x, "labels": y, **pack(meta, state)}
    import onnxruntime as ort
    sess = ort.InferenceSession(os.path.join(run, "step.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    runs = {"ort": dict(zip(names, sess.run(None, feeds)))}
    if precision == "mixed" and kind != "cnn-wide":
        # (cnn-wide: 16x the channels of cnn gives the FP16 sums of conv's 512-term weight
        # gradient 16x the entries to round badly: 0.16 there, with or without the GEMM forms)
        runs["fp16-faithful"] = run_reference(onnx.load(os.path.join(run, "step.onnx")), feeds)
    report = {}
    for who, out in runs.items():
        assert bool(out["all_finite"])
        grads = {w: out[g] for w, g in meta["grads"].items()}
        err = _errors(grads, t_grads)
        report[who] = max(err.values())
        print(f"\n{kind} {precision} {who}: " + ", ".join(f"{k} {v:.1e}" for k, v in err.items()))
        tol = TOL[precision, who]
        assert abs(float(out["loss"]) - t_loss) <= tol * max(1.0, abs(t_loss)), (who, out["loss"], t_loss)
        bad = {k: v for k, v in err.items() if v > tol}
        assert not bad, f"{kind} {precision} {who}: gradient error above {tol}: {bad}"
        # BN running statistics updated as torch does (momentum 0.1, unbiased running variance)
        after = next_state(meta, out)  # per tensor, from the step graph's flat buffers
        for b, ref in t_buffers.items():
            np.testing.assert_allclose(after[b], ref, rtol=tol, atol=tol * 0.1)
    print(f"\n{kind} {precision}: max relative gradient error vs torch.autograd: "
          + ", ".join(f"{k} {v:.2e}" for k, v in report.items()))
    assert load_run(run)["config"]["precision"] == precision

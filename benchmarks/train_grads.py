#!/usr/bin/env python
"""Micro-benchmark of the gradient forms of graphmp/train/rules (conv_gemm.py, nn.py,
linalg.py) on ONNX Runtime CPU, and an interleaved whole-step timer.

Per layer shape (ResNet-50-like at batch 4 of 3x112x112, plus a grouped and two depthwise
convs, and a BERT-like MatMul; --net resnet18: ResNet-18's 3x3 convs at batch 8 of 3x64x64;
--net resnet50-224: ResNet-50's at batch 32 of 3x224x224, the GPU benchmark's shapes), each form is emitted by graphmp's own helpers into a small
graph (inputs X and dY, output the gradient) and timed in ONE process, 1 ORT thread, the
forms interleaved round by round (only ratios within one run mean anything on a shared
machine); every form's result is compared with the first form's (max abs diff / max |ref|):
  dW   conv (one Conv with batch and channels swapped: the form before the GEMM forms),
       channels_first, per_sample, per_tap (conv_gemm.py), auto (what the rule picks)
  dX   pad_slice (ConvTranspose without pads, then Pad + Slice to X), pads (ConvTranspose
       with the conv's pads and output_padding), gemm (one MatMul over the batch + col2im,
       conv_gemm.input_grad_gemm), auto (what the rule picks)
  fwd  the forward Conv with W a graph input (as in a step): conv (ONNX Runtime's Conv) vs
       gemm (conv_gemm.forward_gemm: the columns of X and one Gemm over the batch)
  dB   of A [8, 128, 256] @ B [256, 1024], and dA of A [256, 512] @ B [8, 512, 128]: partials
       (batched MatMul + ReduceSum over the batch) vs flat (one Gemm over the flattened batch)

--steps DIR[,DIR...]: graphmp run folders (train-graph outputs) whose StepRunner.step is timed
interleaved, each step from the run's initial state (reset untimed before every step:
carrying the state on over one fixed batch ends in denormal gradients that slow every engine
10-50x), denormals flushed, no spin-waiting ORT threads, one fixed random batch.

Usage:
  python benchmarks/train_grads.py [--rounds 5] [--threads 1] [--only dw,dx,fwd,matmul] [--net resnet18]
                                   [--device cuda]
                                   [--steps RUN_A,RUN_B] [--json benchmarks/results/train_grads.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphmp.train.emitter import Emitter, tensor_info  # noqa: E402
from graphmp.train.rules import conv_gemm, linalg, nn  # noqa: E402

F32 = TensorProto.FLOAT
BATCH = 4
# (name, Cin, Cout, kernel, stride, pad, input H = W, group): ResNet-50 at 112x112 input
LAYERS = [
    ("stem 7x7/2 3->64", 3, 64, 7, 2, 3, 112, 1),
    ("layer1 1x1 64->256", 64, 256, 1, 1, 0, 28, 1),
    ("layer1 3x3 64", 64, 64, 3, 1, 1, 28, 1),
    ("layer2 3x3/2 128", 128, 128, 3, 2, 1, 28, 1),
    ("layer2 down 1x1/2 256->512", 256, 512, 1, 2, 0, 28, 1),
    ("layer3 3x3 256", 256, 256, 3, 1, 1, 7, 1),
    ("layer4 3x3/2 512", 512, 512, 3, 2, 1, 7, 1),
    ("layer4 3x3 512", 512, 512, 3, 1, 1, 4, 1),
    ("layer4 1x1 512->2048", 512, 2048, 1, 1, 0, 4, 1),
    ("layer4 1x1 2048->512", 2048, 512, 1, 1, 0, 4, 1),
    ("grouped 3x3 g32 256", 256, 256, 3, 1, 1, 14, 32),
    ("depthwise 3x3 128", 128, 128, 3, 1, 1, 28, 128),
    ("depthwise 3x3/2 256", 256, 256, 3, 2, 1, 14, 256),
]
# --net resnet18: its 3x3 convs at a 64x64 input, batch 8 (benchmarks/train_cpu.py's case);
# --net resnet50-224: ResNet-50's at 224x224, batch 32 (the GPU benchmark's, train_gpu.sh)
NETS = {"resnet50": (4, LAYERS), "resnet50-224": (32, [
    ("stem 7x7/2 3->64", 3, 64, 7, 2, 3, 224, 1),
    ("layer1 1x1 64->256", 64, 256, 1, 1, 0, 56, 1),
    ("layer1 3x3 64", 64, 64, 3, 1, 1, 56, 1),
    ("layer2 3x3/2 128", 128, 128, 3, 2, 1, 56, 1),
    ("layer3 3x3 256", 256, 256, 3, 1, 1, 14, 1),
    ("layer4 3x3/2 512", 512, 512, 3, 2, 1, 14, 1),
    ("layer4 3x3 512", 512, 512, 3, 1, 1, 7, 1),
    ("layer4 1x1 512->2048", 512, 2048, 1, 1, 0, 7, 1),
    ("layer4 1x1 2048->512", 2048, 512, 1, 1, 0, 7, 1),
]), "resnet18": (8, [
    ("layer1 3x3 64 @16", 64, 64, 3, 1, 1, 16, 1),
    ("layer2 3x3/2 64->128 @16", 64, 128, 3, 2, 1, 16, 1),
    ("layer2 3x3 128 @8", 128, 128, 3, 1, 1, 8, 1),
    ("layer3 3x3/2 128->256 @8", 128, 256, 3, 2, 1, 8, 1),
    ("layer3 3x3 256 @4", 256, 256, 3, 1, 1, 4, 1),
    ("layer4 3x3/2 256->512 @4", 256, 512, 3, 2, 1, 4, 1),
    ("layer4 3x3 512 @2", 512, 512, 3, 1, 1, 2, 1),
])}


PROVIDERS = ["CPUExecutionProvider"]  # --device cuda: CUDA first


def _session(model, threads):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.set_denormal_as_zero", "1")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=PROVIDERS)
    if sess.get_providers()[0] != PROVIDERS[0]:  # ORT falls back to the CPU silently
        raise SystemExit(f"{PROVIDERS[0]} is not available here (onnxruntime {ort.__version__}: "
                         f"{ort.get_available_providers()})")
    return sess


def _emit(inputs: dict, build, out_shape, inits=()) -> onnx.ModelProto:
    """A model whose inputs are `inputs` {name: dims} and whose one output is what
    build(em) emits (an Emitter over that model)."""
    vi = helper.make_tensor_value_info
    g = helper.make_graph([], "g", [vi(k, F32, d) for k, d in inputs.items()], [], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    em = Emitter(m, tensor_info(m), "grad")
    out = build(em)
    m.graph.node.extend(em.nodes)
    m.graph.output.append(vi(out, F32, out_shape))
    return m


def _out(h, k, s, p):
    return (h + 2 * p - k) // s + 1


def dw_models(cin, cout, k, s, p, h, group):
    o = _out(h, k, s, p)
    xs, ys = [BATCH, cin, h, h], [BATCH, cout, o, o]
    args = (group, cin // group, cout, [k, k], [s, s], [1, 1], [p] * 4)
    wshape = [cout, cin // group, k, k]

    def form(name):
        def build(em):
            if name == "conv":
                return nn._dw_as_conv(em, "X", "dY", *args)
            if name == "auto":
                return nn._conv_weight_grad(em, "X", "dY", *args)
            shapes = conv_gemm.conv_shapes(em, "X", "dY", group, [k, k], [s, s], [1, 1], [p] * 4)
            return conv_gemm.WEIGHT_GRAD_FORMS[name](em, "X", "dY", shapes)
        return _emit({"X": xs, "dY": ys}, build, wshape)
    names = ["conv", "channels_first", "per_sample"] + (["per_tap"] if group == 1 else []) + ["auto"]
    feeds = {"X": np.random.default_rng(0).standard_normal(xs).astype(np.float32),
             "dY": np.random.default_rng(1).standard_normal(ys).astype(np.float32)}
    return {n: form(n) for n in names}, feeds, 2.0 * BATCH * o * o * cout * (cin // group) * k * k


def dx_models(cin, cout, k, s, p, h, group):
    o = _out(h, k, s, p)
    w = np.random.default_rng(2).standard_normal([cout, cin // group, k, k]).astype(np.float32)

    def form(name):
        def build(em):
            if name == "pad_slice":  # spatial lengths known only at run time: the Pad + Slice form
                em.info["X"] = (F32, [BATCH, cin, "h", "w"])
            pick = nn.input_grad_form
            if name != "auto":
                nn.input_grad_form = lambda shapes: "gemm" if name == "gemm" else None
            try:
                return nn._conv_input_grad(em, "dY", "W", "X", [k, k], [s, s], [1, 1], [p] * 4, group)
            finally:
                nn.input_grad_form = pick
        # W a graph input, as in a step (a view of the flat weights): ORT prepacks constant kernels only
        return _emit({"dY": [BATCH, cout, o, o], "X": [BATCH, cin, h, h], "W": list(w.shape)}, build, [BATCH, cin, h, h])
    feeds = {"X": np.zeros([BATCH, cin, h, h], np.float32), "W": w,
             "dY": np.random.default_rng(1).standard_normal([BATCH, cout, o, o]).astype(np.float32)}
    names = ["pads", "pad_slice"] + (["gemm"] if group == 1 else []) + ["auto"]
    return {n: form(n) for n in names}, feeds, 2.0 * BATCH * o * o * cout * (cin // group) * k * k


def fwd_models(cin, cout, k, s, p, h, group):
    """The forward Conv of a step (W a graph input) as ONNX Runtime's Conv and as
    conv_gemm.forward_gemm (one Gemm over the batch)."""
    o = _out(h, k, s, p)
    xs, ws, ys = [BATCH, cin, h, h], [cout, cin // group, k, k], [BATCH, cout, o, o]

    def conv(em):
        return em.op("Conv", ["X", "W"], strides=[s, s], pads=[p] * 4, group=group)

    def gemm(em):
        em.info["Y"] = (F32, ys)
        shapes = conv_gemm.conv_shapes(em, "X", "Y", group, [k, k], [s, s], [1, 1], [p] * 4)
        return conv_gemm.forward_gemm(em, "X", "W", None, shapes, em.fresh("Y"))
    rng = np.random.default_rng(5)
    feeds = {"X": rng.standard_normal(xs).astype(np.float32), "W": rng.standard_normal(ws).astype(np.float32)}
    models = {"conv": _emit({"X": xs, "W": ws}, conv, ys)}
    if group == 1:
        models["gemm"] = _emit({"X": xs, "W": ws}, gemm, ys)
    return models, feeds, 2.0 * BATCH * o * o * cout * (cin // group) * k * k


def matmul_models(n=8, t=128, k=256, m=1024):
    """dB [K, M] of A [n, t, K] @ B [K, M] (a Linear weight over a batch of sequences)."""
    a_shape, y_shape = [n, t, k], [n, t, m]

    def partials(em):
        return em.reduce("ReduceSum", em.op("MatMul", [em.transpose("A", [0, 2, 1]), "dY"]), [0], keepdims=0)
    models = {"partials": _emit({"A": a_shape, "dY": y_shape}, partials, [k, m]),
              "flat": _emit({"A": a_shape, "dY": y_shape}, lambda em: linalg._flat_rhs_grad(em, "A", "dY", [k, m]),
                            [k, m])}
    rng = np.random.default_rng(3)
    feeds = {"A": rng.standard_normal(a_shape).astype(np.float32), "dY": rng.standard_normal(y_shape).astype(np.float32)}
    return models, feeds, 2.0 * n * t * k * m


def matmul_lhs_models(n=8, t=256, k=512, m=128):
    """dA [t, K] of A [t, K] @ B [n, K, m] (a 2-D left operand broadcast over B's batch)."""
    b_shape, y_shape = [n, k, m], [n, t, m]

    def partials(em):
        return em.reduce("ReduceSum", em.op("MatMul", ["dY", em.transpose("B", [0, 2, 1])]), [0], keepdims=0)
    models = {"partials": _emit({"B": b_shape, "dY": y_shape}, partials, [t, k]),
              "flat": _emit({"B": b_shape, "dY": y_shape}, lambda em: linalg._flat_lhs_grad(em, "dY", "B", 3, [t, k]),
                            [t, k])}
    rng = np.random.default_rng(4)
    feeds = {"B": rng.standard_normal(b_shape).astype(np.float32), "dY": rng.standard_normal(y_shape).astype(np.float32)}
    return models, feeds, 2.0 * n * t * k * m


def time_forms(models: dict, feeds: dict, flops: float, rounds: int, threads: int) -> dict:
    """Median ms per form over `rounds` interleaved runs (after one warm-up each), GFLOP/s,
    and each form's max abs difference from the first form, relative to its max |value|."""
    sess = {k: _session(m, threads) for k, m in models.items()}
    fed = {k: {i.name: feeds[i.name] for i in s.get_inputs()} for k, s in sess.items()}
    ref, out, times = None, {}, {k: [] for k in sess}
    for k, s in sess.items():
        r = s.run(None, fed[k])[0].astype(np.float64)
        ref = r if ref is None else ref
        out[k] = {"rel_diff": float(np.abs(r - ref).max() / max(np.abs(ref).max(), 1e-30))}
    for _ in range(rounds):
        for k, s in sess.items():
            t0 = time.perf_counter()
            s.run(None, fed[k])
            times[k].append(time.perf_counter() - t0)
    for k in sess:
        ms = statistics.median(times[k]) * 1e3
        out[k].update(ms=round(ms, 3), min_ms=round(min(times[k]) * 1e3, 3), gflops=round(flops / ms / 1e6, 1),
                      nodes=len(models[k].graph.node))
    return out


def _random_batch(sess, state: dict) -> dict:
    """A fixed random batch for the session's non-state inputs (a symbolic dim is 4): floats
    N(0, 1), integers (labels) in {0, 1}, valid for any classifier."""
    rng = np.random.default_rng(0)
    batch = {}
    for i in sess.get_inputs():
        if i.name in state:
            continue
        shape = [v if isinstance(v, int) else 4 for v in i.shape]
        batch[i.name] = (rng.standard_normal(shape).astype(np.float32) if "float" in i.type
                         else rng.integers(0, 2, shape))
    return batch


def step_timer(run_dirs: list[str], rounds: int, threads: int) -> dict:
    """StepRunner.step of each run folder, interleaved, each step from the initial state."""
    import onnxruntime as ort

    from graphmp.train.loop import StepRunner, latest_state, load_run
    orig = ort.SessionOptions

    class Options(orig):  # StepRunner makes its own SessionOptions: no spinning, denormals flushed
        def __init__(self):
            super().__init__()
            self.add_session_config_entry("session.set_denormal_as_zero", "1")
            self.add_session_config_entry("session.intra_op.allow_spinning", "0")
    runners, batches = {}, {}
    ort.SessionOptions = Options
    try:
        for d in run_dirs:
            meta = load_run(d)
            state, _ = latest_state(d)
            runners[d] = (StepRunner(d, meta, state, providers=["CPUExecutionProvider"], threads=threads), dict(state))
            batches[d] = _random_batch(runners[d][0].sess, state)
    finally:
        ort.SessionOptions = orig
    times = {d: [] for d in run_dirs}
    losses = {}
    for r in range(rounds + 1):
        for d, (runner, init) in runners.items():
            runner.set_state(init)
            t0 = time.perf_counter()
            losses[d] = runner.step(batches[d])[0]
            if r:  # round 0 is the warm-up
                times[d].append(time.perf_counter() - t0)
    return {d: {"median_ms": round(statistics.median(times[d]) * 1e3, 1), "min_ms": round(min(times[d]) * 1e3, 1),
                "loss": round(losses[d], 5), "nodes": runners[d][0].meta.get("nodes")} for d in run_dirs}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="dw,dx,fwd,matmul")
    ap.add_argument("--layers", default=None, help="comma-separated indices into the net's layers")
    ap.add_argument("--net", default="resnet50", choices=sorted(NETS), help="whose conv layers (and batch)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the forms on ONNX Runtime's CUDA provider (each run's output copied back)")
    ap.add_argument("--steps", default=None, help="run folders to time StepRunner.step on, comma-separated")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import onnxruntime as ort
    global BATCH, PROVIDERS
    if a.device == "cuda":
        PROVIDERS = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    BATCH, net = NETS[a.net]
    res = {"onnxruntime": ort.__version__, "threads": a.threads, "rounds": a.rounds, "batch": BATCH, "net": a.net,
           "device": a.device}
    parts = a.only.split(",") if a.only else []
    layers = net if not a.layers else [net[int(i)] for i in a.layers.split(",")]
    for part, make in (("dw", dw_models), ("dx", dx_models), ("fwd", fwd_models)):
        if part not in parts:
            continue
        res[part] = {}
        for name, *shape in layers:
            models, feeds, flops = make(*shape)
            res[part][name] = time_forms(models, feeds, flops, a.rounds, a.threads)
            print(part, name, json.dumps(res[part][name]), flush=True)
    if "matmul" in parts:
        res["matmul_dB"] = time_forms(*matmul_models(), a.rounds, a.threads)
        print("matmul dB of [8,128,256]@[256,1024]", json.dumps(res["matmul_dB"]), flush=True)
        res["matmul_dA"] = time_forms(*matmul_lhs_models(), a.rounds, a.threads)
        print("matmul dA of [256,512]@[8,512,128]", json.dumps(res["matmul_dA"]), flush=True)
    if a.steps:
        res["steps"] = step_timer(a.steps.split(","), a.rounds, a.threads)
        print("steps", json.dumps(res["steps"]), flush=True)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""Embedding-gradient scatter and cross-entropy loss: the formulations graphmp's step graphs used
before (ScatterND(reduction='add'); SoftmaxCrossEntropyLoss) against the ones they use now
(ScatterElements(add) on [pre, rows, post]; LogSoftmax + GatherElements + mean), on ONNX
Runtime's CPU provider, with 1, 2 and 4 intra-op threads interleaved in one process.

    python benchmarks/scatter_exact.py [--vocab 30522 --dim 768 --tokens 4096 --distinct 300]
                                       [--rows 2048 --classes 8192] [--runs 8]

Scatter: the gradient of Gather(table [vocab, dim], ids [tokens]) with ids drawn from
`distinct` values (repeats); per formulation and thread count: max error / max |ref| against
float64 numpy, how many different results `runs` runs gave, median ms. Loss: forward + gradient
of the mean cross-entropy of [rows, classes] logits, median ms per formulation (both built by
graphmp's autodiff). Ratios compare only within one run of this script.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from graphmp.train.autodiff import add_backward

N = helper.make_node
F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, opset=17):
    g = helper.make_graph(nodes, "bench", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _vi(name, elem, dims):
    return helper.make_tensor_value_info(name, elem, dims)


def scatter_models(vocab, dim, tokens) -> dict:
    """{name: serialized model (x [vocab, dim], ids [tokens], g [tokens, dim]) -> loss, dx}: the
    same forward, loss = sum(Gather(x, ids) * g), and dx as graphmp's Gather rule emits it now
    or as it did before (ScatterND(add) of g at the ids into zeros)."""
    ins = [_vi("x", F32, [vocab, dim]), _vi("ids", I64, [tokens]), _vi("g", F32, [tokens, dim])]
    forward = [N("Gather", ["x", "ids"], ["y"], axis=0), N("Mul", ["y", "g"], ["yg"]),
               N("ReduceSum", ["yg"], ["loss"], keepdims=0)]
    outs = [_vi("loss", F32, []), _vi("dx", F32, [vocab, dim])]
    before = _model(forward + [
        N("Shape", ["x"], ["shape"]),
        N("ConstantOfShape", ["shape"], ["zeros"], value=helper.make_tensor("z", F32, [1], [0])),
        N("Constant", [], ["ax"], value=helper.make_tensor("a", I64, [1], [1])),
        N("Unsqueeze", ["ids", "ax"], ["idx"]),
        N("ScatterND", ["zeros", "idx", "g"], ["dx"], reduction="add")], ins, outs)
    now = _model(list(forward), ins, outs[:1])
    grads = add_backward(now, "loss", ["x"])
    now.graph.output.append(_vi(grads["x"], F32, [vocab, dim]))
    return {"ScatterND (before)": before.SerializeToString(), "ScatterElements rows (now)": now.SerializeToString()}


def loss_models(rows, classes) -> dict:
    """{name: serialized model (s [rows, classes], y [rows]) -> loss, ds}, both differentiated
    by graphmp's autodiff."""
    ins = [_vi("s", F32, [rows, classes]), _vi("y", I64, [rows])]
    one = helper.make_tensor("one", I64, [1], [1])
    before = _model([N("SoftmaxCrossEntropyLoss", ["s", "y"], ["loss"], reduction="mean")], ins,
                    [_vi("loss", F32, [])])
    now = _model([N("LogSoftmax", ["s"], ["logp"], axis=1), N("Constant", [], ["one"], value=one),
                  N("Unsqueeze", ["y", "one"], ["y1"]), N("GatherElements", ["logp", "y1"], ["picked"], axis=1),
                  N("ReduceMean", ["picked"], ["m"], keepdims=0), N("Neg", ["m"], ["loss"])], ins,
                 [_vi("loss", F32, [])])
    out = {}
    for name, m in (("SoftmaxCrossEntropyLoss (before)", before), ("LogSoftmax+GatherElements (now)", now)):
        grads = add_backward(m, "loss", ["s"])
        m.graph.output.append(_vi(grads["s"], F32, [rows, classes]))
        out[name] = m.SerializeToString()
    return out


def sessions(models: dict, threads) -> dict:
    out = {}
    for name, model in models.items():
        for t in threads:
            so = ort.SessionOptions()
            so.intra_op_num_threads = t
            so.log_severity_level = 4
            out[name, t] = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    return out


def interleaved(sess: dict, feeds_of, runs: int) -> tuple[dict, dict]:
    """Runs every session once per round, `runs` rounds: ({key: [outputs]}, {key: [seconds]})."""
    outs, secs = {k: [] for k in sess}, {k: [] for k in sess}
    for _ in range(runs):
        for k, s in sess.items():
            feeds = feeds_of(s)
            t0 = time.perf_counter()
            res = s.run(None, feeds)
            secs[k].append(time.perf_counter() - t0)
            outs[k].append(res[-1])
    return outs, secs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--distinct", type=int, default=300)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--classes", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=8)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, a.distinct, a.tokens).astype(np.int64)
    g = rng.standard_normal((a.tokens, a.dim)).astype(np.float32)
    x = np.zeros((a.vocab, a.dim), np.float32)
    ref = np.zeros((a.vocab, a.dim))
    np.add.at(ref, ids, g.astype(np.float64))
    sess = sessions(scatter_models(a.vocab, a.dim, a.tokens), (1, 2, 4))
    feeds = {"ids": ids, "g": g, "x": x}
    outs, secs = interleaved(sess, lambda s: {i.name: feeds[i.name] for i in s.get_inputs()}, a.runs)
    print(f"embedding gradient: vocab {a.vocab} x dim {a.dim}, {a.tokens} ids over {a.distinct} values, {a.runs} runs")
    for k in sess:
        err = max(float(np.abs(o - ref).max()) for o in outs[k]) / float(np.abs(ref).max())
        print(f"  {k[0]:28s} threads {k[1]}: max err {err:.1e}, {len({o.tobytes() for o in outs[k]})} "
              f"different results, median {1e3 * np.median(secs[k]):.1f} ms")
    s = rng.standard_normal((a.rows, a.classes)).astype(np.float32)
    y = rng.integers(0, a.classes, a.rows).astype(np.int64)
    sess = sessions(loss_models(a.rows, a.classes), (1,))
    outs, secs = interleaved(sess, lambda _: {"s": s, "y": y}, a.runs)
    print(f"cross-entropy forward + gradient: [{a.rows}, {a.classes}] logits, 1 thread")
    first = next(iter(outs.values()))[0]
    for k in sess:
        diff = float(np.abs(outs[k][0] - first).max() / np.abs(first).max())
        print(f"  {k[0]:34s} median {1e3 * np.median(secs[k]):.1f} ms, gradient vs the first: {diff:.1e}")


if __name__ == "__main__":
    main()

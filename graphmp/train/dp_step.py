"""One data-parallel training step on every rank (issue 24; graphmp/train/distributed.py runs
the ranks, the data order and the checkpoints).

A step, on every rank:
  1. the gradient half of the step graph (graphmp.train.split) runs on each of this rank's
     micro-batches: one, or --grad-accum K of them; the loss and the gradients are summed
     over them here, and each micro-batch reads the BatchNorm statistics the one before it
     left (as the fused step's successive runs do);
  2. ONE all-reduce per step (per accumulation window) averages, in one flat FP32 bucket,
     the loss, every gradient and, with sync_bn, the BatchNorm running statistics;
  3. the update half runs on the reduced numbers. With accumulation the update half still
     holds the fused step's window logic; it is fed an empty window (zero sums, count K-1)
     and the window's gradient sum, so the one update divides by K exactly as the fused step
     does after its K-th run. Every rank feeds the same numbers, so every rank computes the
     same finite flag: all skip the same steps and keep the same loss scale.

Gradients are reduced in FP32: FP16 would halve the bytes but round every rank's share and
overflow where the sum passes 65504.
"""
from __future__ import annotations

import time

import numpy as np
import onnx

from .optim import ACCUM, ACCUM_COUNT

GRAD = "__grad"


class Halves:
    """The two ONNX Runtime sessions of the split step, and how their tensors are named."""

    def __init__(self, run_dir: str, meta: dict, threads: int, providers: list):
        import onnxruntime as ort
        from .runfiles import run_file
        from .split import split_step
        step = onnx.load(run_file(run_dir, meta, "step_model"))
        grad_m, upd_m, self.handed = split_step(step, meta)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        self.grad = ort.InferenceSession(grad_m.SerializeToString(), so, providers=providers)
        self.upd = ort.InferenceSession(upd_m.SerializeToString(), so, providers=providers)
        self.grad_in = [i.name for i in self.grad.get_inputs()]
        self.upd_in = [i.name for i in self.upd.get_inputs()]
        self.upd_out = [o.name for o in self.upd.get_outputs()]
        self.loss = meta["loss_output"]
        self.grads = [t for t in self.handed if t.endswith(GRAD)]
        # (BN statistic input, the tensor the gradient half gives its value after the batch)
        self.bn = list(zip([s["input"] for s in meta["state"] if s["kind"] == "bn"],
                           self.handed[1 + len(self.grads):]))
        self.state = [(s["input"], s["output"]) for s in meta["state"]]
        self.window = int(meta["config"].get("grad_accum", 1) or 1)


def _gradients(h: Halves, batches: list, state: dict) -> dict:
    """The gradient half over this rank's micro-batches: {loss: the mean, <w>__grad: the sum,
    BN value after the last micro-batch}; each micro-batch reads the BN statistics the one
    before it left."""
    stats = {i: state[i] for i, _ in h.bn}
    total = None
    for batch in batches:
        feeds = {**batch, **state, **stats}
        got = dict(zip(h.handed, h.grad.run(h.handed, {k: feeds[k] for k in h.grad_in})))
        stats = {i: got[o] for i, o in h.bn}
        if total is None:
            total = {t: np.array(got[t], np.float32) for t in [h.loss] + h.grads}
        else:
            for t in total:
                total[t] += got[t]
    total[h.loss] = total[h.loss] / len(batches)
    total.update({o: np.asarray(stats[i], np.float32) for i, o in h.bn})
    return total


def _all_reduce_mean(reduce, tensors: dict, names: list, n: int) -> None:
    """Average `names` of `tensors` over the ranks, in one flat FP32 bucket, in place."""
    flat = np.concatenate([np.asarray(tensors[t], np.float32).ravel() for t in names])
    flat = reduce(flat) / n
    pos = 0
    for t in names:
        shape = np.shape(tensors[t])
        size = int(np.prod(shape, dtype=np.int64))
        tensors[t] = flat[pos:pos + size].reshape(shape)
        pos += size


def dp_step(h: Halves, reduce, n: int, batches: list, state: dict, times: dict,
            sync_bn: bool = False) -> tuple[float, bool]:
    """One data-parallel step (one accumulation window: len(batches) == h.window) on this
    rank: (the loss averaged over ranks and micro-batches, whether the update was applied);
    state updated in place; seconds added to times["compute"], ["all_reduce"], ["update"].
    reduce(flat FP32 array) -> its sum over the ranks."""
    t0 = time.perf_counter()
    got = _gradients(h, batches, state)
    t1 = time.perf_counter()
    _all_reduce_mean(reduce, got, [h.loss] + h.grads + ([o for _, o in h.bn] if sync_bn else []), n)
    t2 = time.perf_counter()
    merged = {**state, **got}
    if h.window > 1:  # an empty window that this (K-th) run completes: the update divides the sum by K
        for w in h.grads:
            acc = w[:-len(GRAD)] + ACCUM
            merged[acc] = np.zeros_like(state[acc])
        merged[ACCUM_COUNT] = np.asarray(h.window - 1, dtype=np.asarray(state[ACCUM_COUNT]).dtype)
    out = dict(zip(h.upd_out, h.upd.run(h.upd_out, {k: merged[k] for k in h.upd_in})))
    for i, o in h.state:
        state[i] = out[o]
    times["compute"] += t1 - t0
    times["all_reduce"] += t2 - t1
    times["update"] += time.perf_counter() - t2
    return float(got[h.loss]), bool(out.get("all_finite", True))

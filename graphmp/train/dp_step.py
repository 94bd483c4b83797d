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

from .blocks import for_session
from .flat import GRAD as FLAT_GRAD, WEIGHTS, graph_state
from .optim import ACCUM_COUNT

GRAD = "__grad"


class Halves:
    """The two ONNX Runtime sessions of the split step, and how their tensors are named."""

    def __init__(self, run_dir: str, meta: dict, threads: int, providers: list):
        import onnxruntime as ort
        from .runfiles import load_onnx, run_file
        from .split import split_step
        step = load_onnx(run_file(run_dir, meta, "step_model"))  # inline tensors only: no file the model names
        grad_m, upd_m, self.handed = split_step(step, meta)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        self.grad = ort.InferenceSession(grad_m.SerializeToString(), so, providers=providers)
        # on the CPU, the update's elementwise chain in cache-sized blocks; its buffers keep their
        # shape, which the gradient half shares
        upd_m, _ = for_session(upd_m, meta, providers, threads, row_io=False)
        self.upd = ort.InferenceSession(upd_m.SerializeToString(), so, providers=providers)
        self.grad_in = [i.name for i in self.grad.get_inputs()]
        self.upd_in = [i.name for i in self.upd.get_inputs()]
        self.upd_out = [o.name for o in self.upd.get_outputs()]
        self.loss, self.finite = meta["loss_output"], meta["finite_output"]
        self.grads = [t for t in self.handed if t.endswith(GRAD)]
        state = graph_state(meta)  # the step graph's own state: flat buffers and scalars (or per tensor)
        # the state input each gradient has the shape of: the flat weights, or its weight
        self.grad_like = {g: WEIGHTS if g == FLAT_GRAD else g[:-len(GRAD)] for g in self.grads}
        # (BN statistic input, the tensor the gradient half gives its value after the batch)
        self.bn = list(zip([s["input"] for s in state if s.get("kind") == "bn"],
                           self.handed[1 + len(self.grads):]))
        self.state = [(s["input"], s["output"]) for s in state]
        self.accum = [s["input"] for s in state if s.get("kind") == "accum"]  # the window's sums
        self.window = int(meta["config"].get("grad_accum", 1) or 1)
        self.bucket = self.scratch = None  # made at the first step, from the state's shapes
        self.empty_window = None           # the accumulation inputs of a window fed at once
        from ..session import CUDA, ran_on
        on_cuda = ran_on(self.grad) == CUDA
        cuda_id = next((int(p[1].get("device_id", 0)) for p in providers if isinstance(p, tuple) and p[0] == CUDA), 0)
        self.device = ("cuda", cuda_id) if on_cuda else ("cpu", 0)


class DeviceState:
    """The training state as OrtValues on the sessions' device, double-buffered like the
    single process's bound state (loop.StepRunner): the update half writes the next state
    into the other buffer, so no step copies the weights and moments to numpy and back
    (on CUDA: no PCIe round trip of the optimizer state). numpy() copies, for checkpoints
    and eval."""

    def __init__(self, state: dict, names: list, device: tuple):
        from onnxruntime import OrtValue
        kind, index = device
        arrays = {n: np.array(state[n], order="C") for n in names}
        self.bufs = [{n: OrtValue.ortvalue_from_numpy(a, kind, index) for n, a in arrays.items()},
                     {n: OrtValue.ortvalue_from_shape_and_type(list(a.shape), a.dtype, kind, index)
                      for n, a in arrays.items()}]
        self.cur = 0

    @property
    def now(self) -> dict:
        return self.bufs[self.cur]

    @property
    def next(self) -> dict:
        return self.bufs[1 - self.cur]

    def swap(self) -> None:
        self.cur = 1 - self.cur

    def numpy(self) -> dict:
        return {n: np.array(v.numpy()) for n, v in self.now.items()}


class Bucket:
    """The flat FP32 buffer of one step's all-reduce: the loss, the gradients (one flat
    gradient, or one per weight for a step built before flat state), then the BatchNorm
    values, each a view of its slice (shapes from the state: a gradient has its weights'
    shape). The gradient half writes straight into it (IOBinding onto the slices),
    so no concatenation copies the gradients before the all-reduce, and the update half
    reads the reduced views."""

    def __init__(self, h: "Halves", st: DeviceState):
        dims = {n: tuple(v.shape()) for n, v in st.now.items()}
        shapes = [(h.loss, ())] + [(g, dims[h.grad_like[g]]) for g in h.grads] + [(o, dims[i]) for i, o in h.bn]
        sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape in shapes]
        self.flat = np.zeros(sum(sizes), np.float32)
        self.views, pos = {}, 0
        for (name, shape), size in zip(shapes, sizes):
            self.views[name] = self.flat[pos:pos + size].reshape(shape)
            pos += size
        self.grads_end = sizes[0] + sum(sizes[1:1 + len(h.grads)])  # loss + gradients: summed over micro-batches


def _run_into(h: "Halves", feeds: dict, st: DeviceState, bucket: Bucket) -> None:
    """One run of the gradient half on `feeds` (the batch, BN statistics of the micro-batch
    before) and the state's OrtValues, writing its outputs into the bucket's views."""
    io = h.grad.io_binding()
    for k in h.grad_in:
        if k in feeds:
            io.bind_cpu_input(k, np.asarray(feeds[k], order="C"))  # ascontiguousarray would make a scalar [1]
        else:
            io.bind_ortvalue_input(k, st.now[k])
    for name, view in bucket.views.items():
        io.bind_output(name, "cpu", 0, np.float32, list(view.shape), view.ctypes.data)
    h.grad.run_with_iobinding(io)


def _gradients(h: "Halves", batches: list, st: DeviceState) -> Bucket:
    """The gradient half over this rank's micro-batches into h's bucket: the loss's mean and
    the gradients' sum over them, the BN values after the last; each micro-batch reads the
    BN statistics the one before it left."""
    if h.bucket is None:
        h.bucket, h.scratch = Bucket(h, st), (Bucket(h, st) if h.window > 1 else None)
    total = h.bucket
    feeds = {}
    for k, batch in enumerate(batches):
        feeds.update(batch)
        _run_into(h, feeds, st, total if k == 0 else h.scratch)
        if k:
            with np.errstate(over="ignore", invalid="ignore"):  # an overflowed micro-batch: the step is skipped
                total.flat[:total.grads_end] += h.scratch.flat[:total.grads_end]
            total.flat[total.grads_end:] = h.scratch.flat[total.grads_end:]
        last = total if k == 0 else h.scratch
        feeds.update({i: np.array(last.views[o]) for i, o in h.bn})
    if len(batches) > 1:
        total.views[h.loss][...] /= len(batches)
    return total


def _all_reduce_mean(reduce, bucket: Bucket, sync_bn: bool, n: int) -> None:
    """Average the bucket over the ranks in place (with sync_bn the BN values too; else each
    rank keeps its own). A world of one has nothing to average."""
    if n == 1:
        return
    part = bucket.flat if sync_bn else bucket.flat[:bucket.grads_end]  # a view: reduced in place
    summed = reduce(part)
    if summed is not part:  # NCCL's came back from the GPU
        part[...] = summed
    np.multiply(part, np.float32(1.0 / n), out=part)


def _empty_window(h: Halves, st: DeviceState) -> dict:
    """With accumulation, the window state the update half is fed: zero sums and the count
    K-1, so that this one run completes the window and divides the sum by K."""
    if h.empty_window is None:
        h.empty_window = {a: np.zeros(st.now[a].shape(), np.float32) for a in h.accum}
        h.empty_window[ACCUM_COUNT] = np.asarray(h.window - 1, dtype=np.int64)
    return h.empty_window


def _update(h: Halves, st: DeviceState, bucket: Bucket) -> bool:
    """The update half on the state's OrtValues and the reduced bucket, writing the next
    state into the other buffer; whether the step was applied (all_finite)."""
    extra = {**bucket.views, **(_empty_window(h, st) if h.window > 1 else {})}
    io = h.upd.io_binding()
    for k in h.upd_in:
        if k in extra:
            io.bind_cpu_input(k, extra[k])
        else:
            io.bind_ortvalue_input(k, st.now[k])
    io.bind_output(h.finite, "cpu")
    for i, o in h.state:
        io.bind_ortvalue_output(o, st.next[i])
    h.upd.run_with_iobinding(io)
    st.swap()
    return bool(io.get_outputs()[0].numpy())


def dp_step(h: Halves, reduce, n: int, batches: list, st: DeviceState, times: dict,
            sync_bn: bool = False) -> tuple[float, bool]:
    """One data-parallel step (one accumulation window: len(batches) == h.window) on this
    rank: (the loss averaged over ranks and micro-batches, whether the update was applied);
    the state advanced in place; seconds added to times["compute"], ["all_reduce"],
    ["update"]. reduce(flat FP32 array) -> its sum over the ranks."""
    t0 = time.perf_counter()
    bucket = _gradients(h, batches, st)
    t1 = time.perf_counter()
    _all_reduce_mean(reduce, bucket, sync_bn, n)
    t2 = time.perf_counter()
    applied = _update(h, st, bucket)
    times["compute"] += t1 - t0
    times["all_reduce"] += t2 - t1
    times["update"] += time.perf_counter() - t2
    return float(bucket.views[h.loss]), applied

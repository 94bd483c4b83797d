"""Data-parallel training on torch.distributed (issue 24): `graphmp train RUN --data D.npz
--nproc N` starts N local ranks through torchrun's own launcher (torch.distributed.run), and
`torchrun --nproc-per-node N [--nnodes M --rdzv-endpoint ...] -m graphmp.cli train RUN
--data D.npz` works as any torchrun job (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR from the
environment).

Each step, on every rank:
  1. the gradient graph (graphmp.train.split) runs on this rank's shard of the step's
     global batch: the epoch's permutation (numpy default_rng(seed + epoch), as the single
     process uses), global batch N x --batch-size, rank r taking positions r, r+N, ... of
     it (DistributedSampler's interleave), so N ranks x batch b see exactly the samples of
     1 rank x batch N*b, step by step;
  2. one all-reduce (gloo on the CPU, NCCL with CUDA) sums the loss and every FP32 gradient
     in one flat bucket, divided by N: the mean over the global batch, as the loss's mean
     reduction defines it. Gradients are reduced in FP32: FP16 would halve the bytes but
     round every rank's contribution and overflow where the sum exceeds 65504;
  3. the update graph runs on the reduced gradients: every rank computes the same finite
     flag from the same numbers, so all skip the same steps and keep the same loss scale.
BatchNorm statistics stay per rank (each rank's own batch statistics; rank 0's are saved).
Rank 0 writes the checkpoint (atomically, as the single process does) every
--checkpoint-every steps and at the end; a resume (after a kill, or torchrun's
--max-restarts) reads it on every rank and continues the same data order, so it ends with
the weights of an uninterrupted run; it needs the same world size and per-rank batch size.
A rank that dies ends the job (torchrun stops the others); a rank that hangs makes the
others' all-reduce fail after --dist-timeout seconds. Gradient accumulation and eval
during training are the single process's (train without --nproc).
"""
from __future__ import annotations

import datetime
import os
import time

import numpy as np
import onnx

from ..errors import GraphmpError

DEFAULT_TIMEOUT_S = 60.0
EXTRA = "pip install 'graphmp[dist]'"


def world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) outside it."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def under_torchrun() -> bool:
    """This process is a rank torchrun started (even a world of one)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise GraphmpError(f"data-parallel training (--nproc, torchrun) needs torch: {EXTRA}") from None
    return torch, dist


def launch(argv: list, nproc: int) -> int:
    """Run `graphmp <argv>` (a train command without --nproc) on `nproc` local ranks through
    torch.distributed.run, the launcher behind torchrun; the exit code of the job."""
    _torch()
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    args = torchrun.parse_args(["--nproc-per-node", str(nproc), "--max-restarts", "0", "--monitor-interval", "0.2",
                                "--module", "graphmp.cli", *argv])
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        first = next(iter(e.failures.values()), None)
        code = getattr(first, "exitcode", 1) if first is not None else 1
        return code if isinstance(code, int) and code > 0 else 1
    return 0


class _Shards:
    """The per-rank batches of a Dataset: the global batch of step i of an epoch is
    order[i*N*b:(i+1)*N*b] of the epoch's permutation; rank r takes every N-th from r."""

    def __init__(self, src, rank: int, n: int, batch_size: int, seed: int):
        self.src, self.rank, self.n, self.b, self.seed = src, rank, n, batch_size, seed
        self.steps_per_epoch = src.n // (n * batch_size)

    def batch(self, epoch: int, i: int) -> dict:
        order = np.random.default_rng(self.seed + epoch).permutation(self.src.n)
        g = order[i * self.n * self.b:(i + 1) * self.n * self.b]
        return self.src.take(g[self.rank::self.n])


class _Halves:
    """The two ONNX Runtime sessions of the split step, and how their tensors are named."""

    def __init__(self, run_dir: str, meta: dict, threads: int):
        import onnxruntime as ort
        from .runfiles import run_file
        from .split import split_step
        step = onnx.load(run_file(run_dir, meta, "step_model"))
        grad_m, upd_m, self.handed = split_step(step, meta)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        self.grad = ort.InferenceSession(grad_m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self.upd = ort.InferenceSession(upd_m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self.grad_in = [i.name for i in self.grad.get_inputs()]
        self.upd_in = [i.name for i in self.upd.get_inputs()]
        self.upd_out = [o.name for o in self.upd.get_outputs()]
        self.reduced = [t for t in self.handed if t.endswith("__grad") or t == meta["loss_output"]]
        self.state = [(s["input"], s["output"]) for s in meta["state"]]


def _step(h: _Halves, dist, torch, n: int, batch: dict, state: dict, times: dict) -> tuple[float, bool]:
    """One data-parallel step: gradients here, one all-reduce, the update; state in place;
    seconds added to times["compute"], ["all_reduce"], ["update"]."""
    t0 = time.perf_counter()
    feeds = {**batch, **state}
    got = dict(zip(h.handed, h.grad.run(h.handed, {k: feeds[k] for k in h.grad_in})))
    flat = np.concatenate([np.asarray(got[t], np.float32).ravel() for t in h.reduced])
    t1 = time.perf_counter()
    bucket = torch.from_numpy(flat)
    dist.all_reduce(bucket)  # sum over ranks, in place (numpy shares the memory)
    flat /= n
    t2 = time.perf_counter()
    pos = 0
    for t in h.reduced:
        size = int(np.asarray(got[t]).size)
        got[t] = flat[pos:pos + size].reshape(np.shape(got[t]))
        pos += size
    merged = {**state, **got}
    out = dict(zip(h.upd_out, h.upd.run(h.upd_out, {k: merged[k] for k in h.upd_in})))
    for i, o in h.state:
        state[i] = out[o]
    t3 = time.perf_counter()
    times["compute"] += t1 - t0
    times["all_reduce"] += t2 - t1
    times["update"] += t3 - t2
    return float(got[h.reduced[0]]) if h.reduced[0] in got else float("nan"), bool(out.get("all_finite", True))


def _start(run_dir: str, meta: dict, rank: int, n: int, c) -> tuple[dict, dict]:
    """The state to start from (the checkpoint, on every rank, when one exists and resume is
    on) and the position (step, epoch) in the data order the global step defines."""
    from .loop import latest_state
    from .runfiles import run_file
    from ..model_io import load_npz
    state, ck = latest_state(run_dir) if c.resume else (load_npz(run_file(run_dir, meta, "initial_state")), None)
    pos = {"step": 0, "epoch": 0, "position": 0}
    if ck is not None:
        was = (ck.get("setup") or {}).get("world_size", 1), (ck.get("setup") or {}).get("batch_size")
        if was != (n, c.batch_size):
            raise GraphmpError(f"{run_dir}: the checkpoint was made by {was[0]} rank(s) x batch {was[1]}, this job is "
                               f"{n} x {c.batch_size}: the data order would differ. Resume with --nproc {was[0]} "
                               f"--batch-size {was[1]}, or start over with --no-resume.")
        pos = {k: ck[k] for k in pos}
    return state, pos


def train_ranks(run_dir, data, c, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict | None:
    """This process's part of a data-parallel run (torchrun's environment). Returns rank 0's
    summary dict (None on the other ranks)."""
    torch, dist = _torch()
    from .data import DataCheck, Dataset, label_rule, make_source
    from .loop import save_checkpoint, load_run
    rank, n, _ = world()
    run_dir = os.fspath(run_dir)
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        try:
            meta = load_run(run_dir)
            src = make_source(data, meta, check=DataCheck(label_rule(run_dir, meta), c.skip_bad_samples))
            if not isinstance(src, Dataset):
                raise GraphmpError("data-parallel training reads an .npz (--data FILE)")
            shards = _Shards(src, rank, n, c.batch_size, c.seed)
            if shards.steps_per_epoch == 0:
                raise GraphmpError(f"{getattr(src, 'where', 'data')}: {src.n} samples, fewer than one global batch of "
                                   f"{n} x {c.batch_size}; lower --batch-size")
            halves = _Halves(run_dir, meta, max(1, (os.cpu_count() or 1) // n))
            state, pos = _start(run_dir, meta, rank, n, c)
        except GraphmpError as e:
            raise GraphmpError(f"rank {rank}: {e}") from None
        return _run_epochs(run_dir, c, dist, torch, n, rank, shards, halves, state, pos, save_checkpoint)
    finally:
        dist.destroy_process_group()


def _run_epochs(run_dir, c, dist, torch, n, rank, shards, halves, state, pos, save) -> dict | None:
    losses, skipped, t0 = [], 0, time.perf_counter()
    times = {"compute": 0.0, "all_reduce": 0.0, "update": 0.0}
    step, epoch, i = pos["step"], pos["epoch"], pos["position"]
    total = c.epochs * shards.steps_per_epoch
    setup = {"batch_size": c.batch_size, "seed": c.seed, "drop_last": True, "samples": shards.src.n, "world_size": n}

    def checkpoint():  # rank 0 writes; the weights are the same on every rank (BN statistics: rank 0's)
        if rank == 0:
            save(run_dir, state, {"step": step, "epoch": epoch, "position": i, "skipped": skipped, "setup": setup},
                 losses)
    while epoch < c.epochs and step < total and (c.max_steps is None or step < c.max_steps):
        loss, finite = _step(halves, dist, torch, n, shards.batch(epoch, i), state, times)
        losses.append(loss)
        skipped += not finite
        step, i = step + 1, i + 1
        if i == shards.steps_per_epoch:
            epoch, i = epoch + 1, 0
        if c.checkpoint_every and step % c.checkpoint_every == 0:
            checkpoint()
    dist.barrier()
    if rank != 0:
        return None
    checkpoint()
    return {"steps": len(losses), "skipped": skipped, "world_size": n, "global_batch": n * c.batch_size,
            "last_loss": losses[-1] if losses else None, "seconds": time.perf_counter() - t0,
            "seconds_per_step": {k: v / max(1, len(losses)) for k, v in times.items()}}

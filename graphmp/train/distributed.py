"""Data-parallel training on torch.distributed (issue 24): `graphmp train RUN --data D.npz
--nproc N` starts N local ranks through torchrun's own launcher (torch.distributed.run), and
`torchrun --nproc-per-node N [--nnodes M --rdzv-endpoint ...] -m graphmp.cli train RUN
--data D.npz` works as any torchrun job (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR from the
environment).

This module runs the ranks: the process group, each rank's device, the data order, eval and
checkpoints. graphmp/train/dp_step.py is one step (gradients, one all-reduce, the update).

- Data order: the epoch's permutation (numpy default_rng(seed + epoch), as the single
  process uses), global batch N x --batch-size, rank r taking positions r, r+N, ... of it
  (DistributedSampler's interleave), so N ranks x batch b see exactly the samples of one
  process with batch N*b, step by step; the last partial global batch of an epoch is
  dropped (drop_last), and with --grad-accum K a last window of fewer than K batches too.
- Devices: on CUDA (onnxruntime-gpu, --device auto|cuda) each rank's sessions run on GPU
  LOCAL_RANK, the state stays there (dp_step.DeviceState) and the all-reduce is NCCL's when
  torch has CUDA (the host bucket of gradients goes to that GPU and back); on the CPU
  gloo, and each rank gets cores / N threads.
- BatchNorm statistics: per rank by default (each rank's own batch statistics; rank 0's
  are saved); sync_bn averages the running statistics over the ranks after every step (in
  the same all-reduce; as timm's distribute_bn). The forward still normalises with each
  rank's own batch: an ONNX graph has no collective to share batch statistics mid-forward.
- Eval (--eval): after every epoch, each rank evaluates positions r, r+N, ... of the eval
  set and the sums are all-reduced: the loss and accuracy of the whole set.
- Checkpoints: rank 0 writes (atomically, as the single process does) every
  --checkpoint-every runs and at the end; a resume (after a kill, or torchrun's
  --max-restarts) reads it on every rank and continues the same data order, so it ends with
  the weights of an uninterrupted run; it needs the same world size and per-rank batch.
- Faults: a rank that dies ends the job (torchrun stops the others); a rank that hangs makes
  the others' all-reduce fail after --dist-timeout seconds.
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import numpy as np

from ..errors import GraphmpError, first_line
from ..progress import says_results
from .flat import graph_state_names, pack, unpack
from .first_step import FirstStepSearch
from .step import SCALE

DEFAULT_TIMEOUT_S = 60.0
EXTRA = "pip install 'graphmp[dist]'"
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class DistOptions:
    """What data parallelism adds to TrainConfig (the flags --dist-*, --sync-bn, --eval)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    backend: str = "auto"       # "auto": NCCL when the sessions run on CUDA and torch has CUDA, else gloo
    sync_bn: bool = False
    eval_data: object = None


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise GraphmpError(f"{name}={text!r} in the environment is not an integer: start the ranks with "
                           "`graphmp train --nproc N` or torchrun, which set it") from None


def world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) outside it.
    A value that is not an integer, a world size below 1, or a rank outside the world is a
    GraphmpError naming the variable."""
    rank, n, local = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    if n < 1 or not 0 <= rank < n or local < 0:
        raise GraphmpError(f"RANK={rank}, WORLD_SIZE={n}, LOCAL_RANK={local} in the environment: need "
                           "WORLD_SIZE >= 1, 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0 (torchrun sets them)")
    return rank, n, local


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


def launch(argv: list, nproc: int, max_restarts: int = 0) -> int:
    """Run `graphmp <argv>` (a train command without --nproc) on `nproc` local ranks through
    torch.distributed.run, the launcher behind torchrun; the exit code of the job. With
    max_restarts, torchrun restarts the failed job that many times (each resumes from the
    last checkpoint)."""
    _torch()
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    # --standalone: the c10d rendezvous on a free local port. Its rounds give every restart a
    # fresh store; the static rendezvous keeps one store across restarts, and a restarted rank
    # can then read a dead rank's address from the first attempt (gloo: connection refused)
    args = torchrun.parse_args(["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
                                "--monitor-interval", "0.2", "--module", "graphmp.cli", *argv])
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        first = next(iter(e.failures.values()), None)
        code = getattr(first, "exitcode", 1) if first is not None else 1
        return code if isinstance(code, int) and code > 0 else 1
    return 0


def _attempt_store(dist, rank: int, n: int, timeout):
    """The rendezvous store of this attempt of the job. torchrun's agent keeps one store
    across --max-restarts; without a per-attempt prefix a restarted rank can read the
    address a dead rank of the previous attempt published (gloo: connection refused)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)  # torchrun's agent hosts it
    addr, port = os.environ.get("MASTER_ADDR"), _env_int("MASTER_PORT", -1)
    if not addr or not 0 < port < 65536:
        raise GraphmpError(f"rank {rank}: MASTER_ADDR={addr!r} / MASTER_PORT={os.environ.get('MASTER_PORT')!r} in "
                           "the environment: need a host and a port (1-65535); torchrun sets them")
    try:
        store = dist.TCPStore(addr, port, n, is_master=not agent and rank == 0, timeout=timeout, multi_tenant=True)
    except (RuntimeError, OSError, ValueError) as e:  # port in use, master unreachable, rendezvous timeout
        raise GraphmpError(f"rank {rank}: cannot reach the rendezvous at {addr}:{port} ({first_line(e)}): the port "
                           "may be in use or the master unreachable; pick another MASTER_PORT, or check that rank 0 "
                           "runs") from None
    return dist.PrefixStore(f"graphmp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


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


def _devices(torch, c, opts: DistOptions, local_rank: int) -> tuple[list, str, str | None]:
    """(ONNX Runtime providers of this rank, process-group backend, a note or None)."""
    from ..session import CPU, CUDA
    from .device import providers_for
    if opts.backend not in BACKENDS:
        raise GraphmpError(f"--dist-backend must be one of {list(BACKENDS)}, not '{opts.backend}'")
    providers, note = (list(c.providers), None) if c.providers else providers_for(c.device or "auto")
    on_cuda = CUDA in providers
    if on_cuda:
        providers = [(CUDA, {"device_id": local_rank}), CPU]
    backend = opts.backend
    if backend == "auto":
        backend = "nccl" if on_cuda and torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise GraphmpError("--dist-backend nccl needs a CUDA build of torch with a GPU (torch.cuda.is_available() is "
                           "False here); use --dist-backend gloo")
    return providers, backend, note


def _reducer(dist, torch, backend: str, local_rank: int):
    """reduce(flat FP32 numpy array) -> its sum over the ranks."""
    def on_host(flat):
        dist.all_reduce(torch.from_numpy(flat))  # in place: the tensor shares the array's memory
        return flat

    def on_gpu(flat):
        t = torch.from_numpy(flat).to(f"cuda:{local_rank}")
        dist.all_reduce(t)
        return t.cpu().numpy()

    def reduce(flat):
        try:
            return (on_gpu if backend == "nccl" else on_host)(flat)
        except RuntimeError as e:  # torch's DistBackendError is one: a peer closed its connection or timed out
            raise GraphmpError(f"the all-reduce failed ({first_line(e)[:200]}): another rank stopped or hung (its "
                               "own error, if it had one, is above); rerun the command to resume from the last "
                               "checkpoint") from None
    return reduce


@dataclass
class _Rank:
    """One rank's view of the job: who it is, its data, its sessions and its reduce."""
    run_dir: str
    meta: dict
    rank: int
    n: int
    shards: _Shards
    halves: object            # dp_step.Halves
    reduce: object
    evaluator: object = None  # (Evaluator, this rank's eval shard, eval batch) or None


def _setup(run_dir, data, c, opts: DistOptions, torch, dist, devices) -> tuple[_Rank, dict, dict]:
    """This rank's job and the state and position to start from; every data and run error is
    raised before the first step, prefixed with the rank."""
    from .data import DataCheck, Dataset, label_rule, make_source
    from .dp_step import DeviceState, Halves
    from .loop import load_run, refuse_data_in_run
    rank, n, local = world()
    meta = load_run(run_dir)
    refuse_data_in_run(run_dir, data, opts.eval_data)  # rank 0 writes checkpoints there
    check = DataCheck(label_rule(run_dir, meta), c.skip_bad_samples)
    src = make_source(data, meta, check=check)
    if not isinstance(src, Dataset):
        raise GraphmpError("data-parallel training reads an .npz (--data FILE)")
    shards = _Shards(src, rank, n, c.batch_size, c.seed)
    if shards.steps_per_epoch == 0:
        raise GraphmpError(f"{getattr(src, 'where', 'data')}: {src.n} samples, fewer than one global batch of "
                           f"{n} x {c.batch_size}; lower --batch-size")
    providers, backend, note = devices
    halves = Halves(run_dir, meta, max(1, (os.cpu_count() or 1) // n), providers)
    note = _check_sessions(halves, providers, c.device) or note
    job = _Rank(run_dir, meta, rank, n, shards, halves, _reducer(dist, torch, backend, local))
    if opts.eval_data is not None:
        job.evaluator = _eval_setup(run_dir, meta, opts.eval_data, check, providers, c)
    state, pos = _start(run_dir, meta, rank, n, c)
    state = DeviceState(pack(meta, state, run_dir), graph_state_names(meta), halves.device)
    info = {"backend": backend, "providers": halves.grad.get_providers(), "note": note}  # what runs, not what was asked
    return job, state, dict(pos, info=info)


def _check_sessions(halves, providers: list, device: str | None) -> str | None:
    """ONNX Runtime falls back to the CPU quietly when the CUDA provider does not load:
    --device cuda then fails, auto goes on and says so (graphmp.train.device)."""
    from .device import check_session
    names = [p if isinstance(p, str) else p[0] for p in providers]
    notes = [check_session(sess, names, device, what) for what, sess in
             (("gradient", halves.grad), ("update", halves.upd))]
    return next((x for x in notes if x), None)


def _eval_setup(run_dir, meta, eval_data, check, providers, c):
    """(the Evaluator, this rank's shard of the eval set, the eval batch size)."""
    from .data import make_source
    from .evaluator import Evaluator
    from .loop import eval_batch_size, first_eval_batch
    from .runfiles import run_file
    from ..model_io import load_npz
    src = make_source(eval_data, meta, "eval data", check)
    rank, n, _ = world()
    batch = eval_batch_size(meta, src, max(c.batch_size, 256))
    first = first_eval_batch(src, batch)  # calibrates a mixed eval graph: the same on every rank
    state = load_npz(run_file(run_dir, meta, "initial_state"))
    return Evaluator(run_dir, meta, state, providers, first, c.device), src.shard(rank, n), batch


def _evaluate(job: _Rank, state: dict) -> dict:
    """Eval of the state on the whole eval set: each rank its shard, the sums all-reduced."""
    ev, shard, batch = job.evaluator
    r = ev.run(state, shard, batch) if shard.n else {"loss": 0.0, "accuracy": 0.0, "counted": 0, "samples": 0}
    sums = np.array([r["loss"] * r["counted"], r.get("accuracy", 0.0) * r["counted"], r["counted"], r["samples"]],
                    np.float64)
    sums = job.reduce(sums.astype(np.float32)).astype(np.float64)
    out = {"loss": float(sums[0] / max(sums[2], 1)), "samples": int(round(sums[3])), "precision": ev.precision}
    if job.meta["config"]["loss"] == "cross-entropy":
        out["accuracy"] = float(sums[1] / max(sums[2], 1))
    return out


def check_resumable(run_dir, n: int, batch_size: int, resume: bool) -> dict | None:
    """The run's checkpoint info when this job resumes from it (None: it starts from the initial
    state). A checkpoint made by another world size or batch size would change the data order:
    a GraphmpError saying how to resume or start over. The launcher calls it before starting any
    rank, so the mismatch is one line, said once."""
    from .runfiles import read_checkpoint
    if not resume:
        return None
    ck = read_checkpoint(os.fspath(run_dir))[0]
    if ck is None:
        return None
    was = (ck.get("setup") or {}).get("world_size", 1), (ck.get("setup") or {}).get("batch_size")
    if was != (n, batch_size):
        raise GraphmpError(f"{run_dir}: the checkpoint was made by {was[0]} rank(s) x batch {was[1]}, this job is "
                           f"{n} x {batch_size}: the data order would differ. Resume with --nproc {was[0]} "
                           f"--batch-size {was[1]}, or start over with --no-resume.")
    return ck


def _start(run_dir: str, meta: dict, rank: int, n: int, c) -> tuple[dict, dict]:
    """The state to start from (the checkpoint, on every rank, when one exists and resume is
    on) and the position (step, epoch) in the data order the global step defines, with the
    run's loss so far ("train_loss", for loss.png)."""
    from .loop import latest_state
    from .runfiles import run_file
    from ..model_io import load_npz
    ck = check_resumable(run_dir, n, c.batch_size, c.resume)
    state, ck = latest_state(run_dir) if ck is not None else (load_npz(run_file(run_dir, meta, "initial_state")), None)
    pos = {"step": 0, "epoch": 0, "position": 0}
    if ck is not None:
        pos = {k: ck[k] for k in pos}
    return state, dict(pos, train_loss=list(ck.get("train_loss", [])) if ck else [])


def train_ranks(run_dir, data, c, opts: DistOptions = DistOptions()) -> dict | None:
    """This process's part of a data-parallel run (torchrun's environment). Returns rank 0's
    summary dict (None on the other ranks)."""
    torch, dist = _torch()
    rank, n, _ = world()
    run_dir = os.fspath(run_dir)
    try:
        devices = _devices(torch, c, opts, world()[2])
    except GraphmpError as e:
        raise GraphmpError(f"rank {rank}: {e}") from None
    if devices[1] == "nccl":
        torch.cuda.set_device(world()[2])
    timeout = datetime.timedelta(seconds=opts.timeout_s)
    dist.init_process_group(devices[1], store=_attempt_store(dist, rank, n, timeout), rank=rank, world_size=n,
                            timeout=timeout)
    try:
        try:
            job, state, pos = _setup(run_dir, data, c, opts, torch, dist, devices)
        except GraphmpError as e:
            raise GraphmpError(f"rank {rank}: {e}") from None
        try:
            return _Loop(job, c, opts, state, pos).run()
        except GraphmpError as e:
            raise GraphmpError(f"rank {rank}: {e}") from None
    finally:
        dist.destroy_process_group()


class _Loop:
    """The epochs of one rank: windows of --grad-accum micro-batches (one per run of the
    single process: `step` counts them, as its checkpoints do), eval after every epoch,
    checkpoints by rank 0."""

    def __init__(self, job: _Rank, c, opts: DistOptions, state: dict, pos: dict):
        self.job, self.c, self.opts, self.state = job, c, opts, state
        self.step, self.epoch, self.i = pos["step"], pos["epoch"], pos["position"]
        self.info = pos["info"]
        self.losses, self.skipped, self.evals = [], 0, []
        self.run_loss = list(pos["train_loss"])  # the whole run's, checkpointed and plotted
        self.times = {"compute": 0.0, "all_reduce": 0.0, "update": 0.0}
        self.reductions, self.step_seconds = 0, []
        # a fresh run retries a skipped first window at the backed-off scale (first_step.py); every
        # rank sees the same all-reduced finite flag, so every rank retries the same windows
        self.first_step = FirstStepSearch.for_run(job.meta["config"], job.meta["dynamic_scale"], self.step)
        self.setup = {"batch_size": c.batch_size, "seed": c.seed, "drop_last": True,
                      "samples": job.shards.src.n, "world_size": job.n}

    def _reduce(self, flat):
        """The job's all-reduce, counted (the summary's all_reduces: one per window)."""
        self.reductions += 1
        return self.job.reduce(flat)

    def _window(self) -> list | None:
        """The next window's micro-batches of this rank (None: not a whole window left)."""
        c, spe, k = self.c, self.job.shards.steps_per_epoch, self.job.halves.window
        limit = c.epochs * spe if c.max_steps is None else min(c.epochs * spe, c.max_steps)
        if self.step + k > limit:
            return None
        batches = []
        for _ in range(k):
            batches.append(self.job.shards.batch(self.epoch, self.i))
            self.step, self.i = self.step + 1, self.i + 1
            if self.i == spe:
                self.epoch, self.i = self.epoch + 1, 0
        return batches

    def _dp_step(self, batches: list) -> tuple[float, bool, float]:
        """One window's optimizer step; (loss, applied, loss scale after it)."""
        from .dp_step import dp_step
        loss, applied = dp_step(self.job.halves, self._reduce, self.job.n, batches, self.state, self.times,
                                self.opts.sync_bn)
        scale = self.state.now.get(SCALE)
        return loss, applied, float(scale.numpy()) if scale is not None else float("nan")

    def _checkpoint(self) -> None:
        """Rank 0 writes; the weights are the same on every rank (BN statistics: rank 0's,
        or the ranks' mean with sync_bn)."""
        from .loop import save_checkpoint
        if self.job.rank == 0:
            save_checkpoint(self.job.run_dir, unpack(self.job.meta, self.state.numpy()),
                            {"step": self.step, "epoch": self.epoch, "position": self.i, "skipped": self.skipped,
                             "setup": self.setup}, self.run_loss)

    def run(self) -> dict | None:
        c, job, t0 = self.c, self.job, time.perf_counter()
        every = c.checkpoint_every
        while True:
            before, epoch = self.step, self.epoch
            batches = self._window()
            if batches is None:
                break
            t_step = time.perf_counter()
            loss, applied, _ = self.first_step.run(lambda: self._dp_step(batches))
            self.step_seconds.append(time.perf_counter() - t_step)
            self.losses.append(loss)
            self.run_loss.append(loss)
            self.skipped += not applied
            if job.evaluator is not None and self.epoch != epoch:
                self.evals.append(dict(_evaluate(job, unpack(job.meta, self.state.numpy())), epoch=self.epoch,
                                       step=self.step))
                if job.rank == 0 and (c.progress or says_results()):  # a result, not progress: also in a log
                    print(_eval_line(self.evals[-1]), flush=True)
            if every and self.step // every > before // every:
                self._checkpoint()
        job.reduce(np.zeros(1, np.float32))  # a barrier on the job's own backend
        if job.rank != 0:
            return None
        self._checkpoint()
        summary = self._summary(time.perf_counter() - t0)
        self._write_run_files(summary)
        return summary

    def _write_run_files(self, summary: dict) -> None:
        """Rank 0, after the last checkpoint: the whole run's loss curve and summary.json, as the
        single process writes them, so the run folder describes the run that just ended."""
        from .loop import write_run_files
        write_run_files(self.job.run_dir, self.step, self.run_loss, self.evals,
                        f"{self.job.meta['config']['precision']}, {self.job.n} ranks", summary)

    def _summary(self, seconds: float) -> dict:
        windows = max(1, len(self.losses))
        return {"steps": len(self.losses) * self.job.halves.window, "updates": len(self.losses),
                "skipped": self.skipped, "world_size": self.job.n, "global_batch": self.job.n * self.c.batch_size,
                "accumulate": self.job.halves.window, "last_loss": self.losses[-1] if self.losses else None,
                "seconds": seconds, "seconds_per_step": {k: v / windows for k, v in self.times.items()},
                # the median, as the single process reports: the first steps' ORT warm-up left out
                "median_step_s": float(np.median(self.step_seconds)) if self.step_seconds else None,
                "all_reduces": self.reductions, "eval_per_epoch": self.evals, "sync_bn": self.opts.sync_bn,
                "first_step_backoff": self.first_step.as_dict(), **self.info}


def _eval_line(r: dict) -> str:
    acc = f", accuracy {r['accuracy']:.4f}" if "accuracy" in r else ""
    return f"epoch {r['epoch']}: eval loss {r['loss']:.6g}{acc} ({r['samples']} samples, all ranks)"

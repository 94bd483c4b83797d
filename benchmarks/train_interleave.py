"""The CPU timing protocol of the training-step benchmarks (train_cpu.py, train_heldout.py):
torch eager and graphmp's StepRunner in ONE process, interleaved round by round, each timed
step the same first optimizer step from the initial state.

Why each rule (each one changed the measured ratios by 2-50x on a shared 2-core machine):
- One process, engines interleaved round by round: load from other jobs hits every engine alike,
  and only ratios from the same run are compared.
- Every timed step starts from the initial state (reset untimed before the step): carrying the
  state on over one fixed batch overfits it within ~10 steps, the gradients become denormal
  floats, and every engine slows 10-50x. Denormals are flushed as well (torch.set_flush_denormal;
  ORT session.set_denormal_as_zero).
- ORT's worker threads do not spin-wait (session.intra_op.allow_spinning 0): idle sessions kept
  alive beside the one being timed would otherwise spin and steal the cores from it.
- A fixed thread count for both (OMP_NUM_THREADS set before torch is imported; torch
  set_num_threads, StepRunner threads=), and malloc settings that keep freed memory in the
  process (protocol_env).
"""
from __future__ import annotations

import contextlib
import copy
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

LR = 1e-3  # AdamW on both sides; weight decay 0 (graphmp's default, set on torch's side to match)


def protocol_env(threads: int) -> dict:
    """The environment the protocol runs in: OMP_NUM_THREADS (OpenMP reads it once, at load),
    and glibc malloc settings that keep freed memory in the process (no trimming back to the
    OS, no fresh mmap per large block below 32 MB): otherwise each step's large tensors
    page-fault again, and the faults land on whichever engine allocates next."""
    return {"OMP_NUM_THREADS": str(threads), "MALLOC_MMAP_THRESHOLD_": "33554432",
            "MALLOC_TRIM_THRESHOLD_": "100000000000"}


def enter_protocol_env(threads: int, reexec: bool) -> dict:
    """Make this process run in protocol_env(threads). The malloc settings are read when the
    process starts, so with `reexec` (a command-line run) the script restarts itself once
    with them set; without it (an in-process call, e.g. a test) only OMP_NUM_THREADS is set,
    which takes effect when torch has not been imported yet. Returns the settings in force."""
    want = protocol_env(threads)
    if reexec and any(os.environ.get(k) != v for k, v in want.items()):
        os.environ.update(want)
        os.execv(sys.executable, [sys.executable] + sys.argv)
    os.environ["OMP_NUM_THREADS"] = want["OMP_NUM_THREADS"]
    return {k: os.environ.get(k) for k in want}


class Engine:
    """One engine of a run: step() -> (loss, applied) runs one optimizer step on the engine's
    fixed batch (step(feed=batch): on another one); reset() puts the initial state back
    (untimed). torch's step(update=False) computes the loss and gradients and skips the
    optimizer, as GradScaler skips a step whose gradients overflowed."""

    def __init__(self, step, reset, perturb=None):
        self.step, self.reset, self.perturb = step, reset, perturb


def torch_engine(module, batch: dict, threads: int, token_classes: bool = False) -> Engine:
    """torch eager FP32, AdamW lr LR. reset() restores the initial weights (BN statistics
    included) and an AdamW state whose moments and step count are zero, so that every step
    after it is AdamW's first step with the state already allocated (as ORT gets it)."""
    import torch
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # set once per process; a second case finds it set
        torch.set_num_interop_threads(1)
    torch.set_flush_denormal(True)
    module.train()
    init = copy.deepcopy(module.state_dict())
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.0)
    fixed = {k: torch.from_numpy(v) for k, v in batch.items()}

    def step(update: bool = True, feed: dict | None = None):
        x, y = (fixed["x"], fixed["labels"]) if feed is None else (torch.from_numpy(feed["x"]),
                                                                   torch.from_numpy(feed["labels"]))
        opt.zero_grad(set_to_none=True)
        logits = module(x)
        if token_classes:  # [N, T, C] against [N, T]: the mean over every token, as graphmp's loss
            logits, target = logits.flatten(0, 1), y.flatten()
        else:
            target = y
        loss = torch.nn.functional.cross_entropy(logits, target)
        loss.backward()
        if update:
            opt.step()
        return float(loss.detach()), update

    step()  # allocates AdamW's state, which reset() zeroes in place

    def reset():
        module.load_state_dict(init)  # copies into the parameters and BN buffers
        # in place: Optimizer.load_state_dict would adopt the saved tensors themselves, and the
        # next steps would change the saved "initial" state
        for st in opt.state.values():
            for v in st.values():
                v.zero_()

    def perturb(rel: float):
        """Scale every weight by (1 + rel * N(0, 1)), seeded: rounding-sized noise."""
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(1 + rel * torch.randn(p.shape, generator=g))

    reset()
    return Engine(step, reset, perturb)


def step_config(precision: str, **extra):
    """The StepConfig `graphmp train-graph MODEL --precision P` gives (AdamW lr 1e-3,
    dynamic loss scale), with `extra` flags on top."""
    from graphmp.train.config import StepConfig
    return StepConfig.from_kwargs(precision=precision, optimizer="adamw", lr=LR, **extra)


def build(onnx_path: str, run_dir: str, precision: str, **extra) -> tuple[dict, float]:
    """build_step into run_dir (replacing it); (train.json dict, seconds)."""
    from graphmp.train.step import build_step
    t0 = time.perf_counter()
    meta = build_step(onnx_path, run_dir, step_config(precision, force=True, **extra))
    return meta, time.perf_counter() - t0


@contextlib.contextmanager
def quiet_sessions(profile_prefix: str | None = None):
    """While open, every onnxruntime.SessionOptions made (StepRunner makes its own) flushes
    denormals and has no spin-waiting worker threads (see the module docstring); with
    profile_prefix, ORT's profiler is on and writes its file under that prefix."""
    import onnxruntime as ort
    orig = ort.SessionOptions

    class QuietOptions(orig):
        def __init__(self):
            super().__init__()
            self.add_session_config_entry("session.set_denormal_as_zero", "1")
            self.add_session_config_entry("session.intra_op.allow_spinning", "0")
            if profile_prefix:
                self.enable_profiling = True
                self.profile_file_prefix = profile_prefix

    ort.SessionOptions = QuietOptions
    try:
        yield
    finally:
        ort.SessionOptions = orig


def graphmp_engine(run_dir: str, batch: dict, threads: int, blocks: bool = True,
                   device_state: bool | None = None) -> Engine:
    """graphmp's StepRunner (public API, CPU provider, `threads` intra-op threads) on a built
    run folder, on its default (bound) path; reset() puts the run's initial state back
    (StepRunner.set_state, untimed). blocks=False: the update as step.onnx's whole-buffer nodes;
    device_state=False: the plain path (numpy state fed and fetched each step)."""
    from graphmp.train.loop import StepRunner, latest_state, load_run
    meta = load_run(run_dir)
    state, _ = latest_state(run_dir)
    with quiet_sessions():
        runner = StepRunner(run_dir, meta, state, providers=["CPUExecutionProvider"], threads=threads, blocks=blocks,
                            device_state=device_state)
    init = runner.state_numpy()

    def step(feed: dict | None = None):
        loss, applied, _ = runner.step(batch if feed is None else feed)
        return loss, applied

    def reset():
        runner.set_state(init)

    return Engine(step, reset)


def interleave(engines: dict, rounds: int, warmup: int = 1, per_round: int = 1) -> dict:
    """Time `engines` ({name: Engine}) round by round: `warmup` untimed steps each, then `rounds`
    rounds of `per_round` timed steps of each engine in turn, each after an untimed reset().
    {name: {"times_s": [...], "losses": [...], "applied": [...]}} (losses of the timed steps)."""
    out = {k: {"times_s": [], "losses": [], "applied": []} for k in engines}
    for e in engines.values():
        for _ in range(warmup):
            e.reset()
            e.step()
    for _ in range(rounds):
        for name, e in engines.items():
            for _ in range(per_round):
                e.reset()
                t0 = time.perf_counter()
                loss, applied = e.step()
                out[name]["times_s"].append(time.perf_counter() - t0)
                out[name]["losses"].append(loss)
                out[name]["applied"].append(bool(applied))
    return out


def row(timed: dict) -> dict:
    """A JSON row of one engine's timed steps: median/min/max ms, the loss (the same every
    step: the same step from the same state), whether the update was applied (False: the
    dynamic loss scale overflowed and the step was skipped, as GradScaler skips it)."""
    ms = [t * 1e3 for t in timed["times_s"]]
    return {"median_ms": round(statistics.median(ms), 2), "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2),
            "steps": len(ms), "loss": round(float(timed["losses"][-1]), 6),
            "applied": all(timed["applied"])}


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def carried_steps(engine: Engine, feeds: list, updates: list | None = None, perturb: float = 0.0) -> tuple[list, list]:
    """(losses, applied flags) of one optimizer step per batch of `feeds`, carrying the state
    on from the initial state; the loss of step k+1 is the loss of the weights after k updates.
    updates: per step, whether to apply it; perturb: start from weights scaled by (1 + perturb
    * noise) (both torch only: replaying the steps another engine's loss scale skipped, and
    measuring how much rounding-sized differences grow over the steps)."""
    engine.reset()
    if perturb:
        engine.perturb(perturb)
    done = [engine.step(feed=f) if updates is None else engine.step(updates[i], feed=f) for i, f in enumerate(feeds)]
    return [float(loss) for loss, _ in done], [bool(ok) for _, ok in done]


def versions() -> dict:
    import onnxruntime
    out = {"python": sys.version.split()[0], "numpy": np.__version__, "onnxruntime": onnxruntime.__version__}
    with contextlib.suppress(ImportError):
        import torch
        out["torch"] = torch.__version__
    return out


def add_run_args(ap, json_default: str, what: str) -> None:
    """The options train_cpu.py and train_heldout.py share: --rounds, --warmup, --threads,
    --tiny, --work, --json (default json_default), --before (run folders <what>-fp32 /
    <what>-mixed built by an older checkout), --before-whole-buffers, --before-plain."""
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per engine, one per round")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="toy sizes: checks the script, times mean nothing")
    ap.add_argument("--work", help="folder for the exported models and run folders (default: a temporary one)")
    ap.add_argument("--json", default=json_default)
    ap.add_argument("--before", help=f"a folder of run folders <{what}>-fp32 / <{what}>-mixed built by an older "
                                     "checkout (its --work): timed in the same rounds, as *-before")
    ap.add_argument("--before-whole-buffers", action="store_true",
                    help="run the --before steps with the update as step.onnx's whole-buffer nodes (StepRunner "
                         "blocks=False), as StepRunner ran every step before graphmp/train/blocks.py")
    ap.add_argument("--before-plain", action="store_true",
                    help="run the --before steps on the plain path (StepRunner device_state=False: numpy state fed "
                         "and fetched each step), the CPU's default before the bound path was")


def before_engine_kw(args) -> dict:
    """graphmp_engine's keywords for the --before steps from --before-whole-buffers / --before-plain."""
    return {"blocks": not args.before_whole_buffers, "device_state": False if args.before_plain else None}


def chosen(ap, csv: str, specs: dict, what: str) -> list:
    """The names in `csv` (comma-separated), each a key of specs; else ap.error naming them."""
    names = csv.split(",")
    bad = [n for n in names if n not in specs]
    if bad:
        ap.error(f"unknown {what}(s) {bad}; choose from {sorted(specs)}")
    return names


def work_dir(args, prefix: str) -> str:
    """args.work (made if missing), or a new temporary folder named with prefix."""
    work = args.work or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(work, exist_ok=True)
    return work

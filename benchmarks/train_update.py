#!/usr/bin/env python
"""The update phase of the training step, before and after flat state buffers: nodes, bound
state tensors and the CPU time of one step, for a ResNet-50-like model.

The model is benchmarks/train.py's ResNet50 (torchvision layout, width 64, 1000 classes),
exported at batch 4 of 3x112x112 (torch needed). Its step (AdamW lr 1e-3, FP32 unless
--precision) is built with this checkout's graphmp and, with --before REPO, with the graphmp
of another checkout (a subprocess with PYTHONPATH=REPO; e.g. a worktree of the commit
before flat state), into --work.

Counted from each step graph: nodes by phase (backward = nodes named grad/...; update = the
update phase: update/... in a flat step, in an older step every node after the forward that
is not backward), the update's op types, and the state tensors a step binds (graph state
inputs). Timed in ONE process, engines interleaved round by round: every timed run starts
from the initial state (no drift into denormal gradients), ONNX Runtime with 1 intra-op
thread and no spinning; the median of --rounds runs after one warm-up. Compare ratios within
one run only (shared machines vary between runs).

Usage:
  python benchmarks/train_update.py --work /tmp/upd [--before /path/to/old/checkout] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH = (4, 3, 112, 112)
CLASSES = 1000
BUILD = dict(loss="cross-entropy", optimizer="adamw", lr=1e-3)


def export_resnet50(path: str) -> None:
    import numpy as np
    import torch
    from benchmarks.train import _gpu_sized_modules
    from tests.fixtures import torch_models
    torch.manual_seed(0)
    model = _gpu_sized_modules()["ResNet50"](width=64, classes=CLASSES)
    torch_models.export(model, np.zeros(BATCH, np.float32), path)


BUILD_SCRIPT = """
import json, sys
from graphmp.train.step import build_step
build_step(sys.argv[1], sys.argv[2], force=True, precision=sys.argv[3], **json.loads(sys.argv[4]))
"""


def build(model: str, run: str, precision: str, repo: str) -> None:
    """The step of `model` built by the graphmp of checkout `repo`, in its own process."""
    env = dict(os.environ, PYTHONPATH=repo)
    subprocess.run([sys.executable, "-c", BUILD_SCRIPT, model, run, precision, json.dumps(BUILD)], env=env,
                   check=True, cwd=repo)


def phases(run: str) -> dict:
    """Node counts by phase, the update's op types and the bound state of a run folder."""
    import onnx
    meta = json.load(open(os.path.join(run, "train.json")))
    nodes = list(onnx.load(os.path.join(run, "step.onnx")).graph.node)
    flat = meta.get("flat")
    bwd = [n for n in nodes if n.name.startswith("grad/")]
    if flat:
        upd = [n for n in nodes if n.name.startswith("update/")]
    else:
        upd = [n for n in nodes[meta["nodes"]["forward"]:] if not n.name.startswith("grad/")]
    state = flat["state"] if flat else meta["state"]
    return {"nodes": len(nodes), "backward": len(bwd), "update": len(upd),
            "forward": len(nodes) - len(bwd) - len(upd), "bound_state": len(state),
            "update_ops": dict(Counter(n.op_type for n in upd).most_common())}


def session(run: str):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return ort.InferenceSession(os.path.join(run, "step.onnx"), so, providers=["CPUExecutionProvider"])


def feeds(run: str) -> dict:
    """The batch and the run's initial state as the step graph takes it."""
    import numpy as np
    from graphmp.train.flat import pack
    meta = json.load(open(os.path.join(run, "train.json")))
    state = dict(np.load(os.path.join(run, "state.npz")))
    r = np.random.default_rng(0)
    batch = {"x": r.standard_normal(BATCH).astype(np.float32),
             meta["label"]["name"]: r.integers(0, CLASSES, BATCH[0]).astype(np.int64)}
    return {**batch, **pack(meta, state)}


def time_steps(runs: dict, rounds: int) -> dict:
    """{name: (median seconds, loss)}: the runs' steps interleaved, one warm-up each."""
    import numpy as np
    sess = {k: session(v) for k, v in runs.items()}
    inputs = {k: feeds(v) for k, v in runs.items()}
    loss = {k: float(sess[k].run(["loss"], inputs[k])[0]) for k in runs}  # warm-up
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k in runs:
            t0 = time.perf_counter()
            sess[k].run(None, inputs[k])
            times[k].append(time.perf_counter() - t0)
    return {k: (float(np.median(times[k])), loss[k]) for k in runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--before", help="a graphmp checkout to build the 'before' step with")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-build", action="store_true", help="reuse the run folders in --work")
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    model = os.path.join(args.work, "resnet50.onnx")
    runs = {"flat": os.path.join(args.work, "run-flat")}
    if args.before:
        runs = {"before": os.path.join(args.work, "run-before"), **runs}
    if not args.no_build:
        if not os.path.exists(model):
            export_resnet50(model)
        for name, run in runs.items():
            t0 = time.perf_counter()
            build(model, run, args.precision, args.before if name == "before" else ROOT)
            print(f"built {name} in {time.perf_counter() - t0:.0f} s", flush=True)
    report = {name: phases(run) for name, run in runs.items()}
    for name, (sec, loss) in time_steps(runs, args.rounds).items():
        report[name].update(step_ms=round(sec * 1e3, 1), loss=round(loss, 4))
    print(json.dumps(report, indent=1))
    if "before" in report:
        b, f = report["before"], report["flat"]
        print(f"update nodes {b['update']} -> {f['update']}, bound state {b['bound_state']} -> {f['bound_state']}, "
              f"step {b['step_ms']:.0f} -> {f['step_ms']:.0f} ms ({f['step_ms'] / b['step_ms']:.2f}x), "
              f"1 ORT thread, {args.precision}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

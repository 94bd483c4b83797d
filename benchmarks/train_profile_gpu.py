#!/usr/bin/env python
"""Where a graphmp training step spends its time on ONNX Runtime's CUDA provider, node by node.

    python benchmarks/train_profile_gpu.py RUN_DIR [RUN_DIR ...] --device cuda [--steps 4] --json OUT
    python benchmarks/train_profile_gpu.py RUN_DIR ... --device cpu --tiny ...   # the dry run

RUN_DIR: run folders that benchmarks/train.py built (<model>-<precision>: the model's batch
comes from train.py's model_specs). Each runs in its own process with CUDA_LAUNCH_BLOCKING=1
and ONNX Runtime's profiler on: ORT times a node around its kernel launches, which on CUDA
return at once; with launches blocking, a node's time is its kernels' GPU time plus one launch
overhead per kernel (microseconds), so the per-node sums say where the GPU time goes, while
the step's wall time here is slower than an unprofiled step's. Reported per run: the wall time
of the profiled steps, kernel time by phase (forward, backward, update; step_audit's phases)
and by op type:phase, the slowest nodes, and the nodes ONNX Runtime placed on the CPU
provider (each one a device-to-host copy and a sync per step). The first step (cuDNN's
algorithm search) is left out.
Exit 0 done, 1 a run failed, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
TAG = "@@PROFILE "


def _model_of(run_dir: str) -> str:
    """train.py names its run folders <model>-<precision>."""
    return os.path.basename(os.path.normpath(run_dir)).rsplit("-", 1)[0]


def profile(run_dir: str, device: str, tiny: bool, steps: int) -> dict:
    """One run folder, profiled in this process (the child)."""
    import onnx
    import step_audit
    import train
    import train_interleave as ti
    from train_profile import _summarize
    from graphmp.train.device import providers_for
    from graphmp.train.loop import StepRunner, latest_state, load_run
    meta = load_run(run_dir)
    state, _ = latest_state(run_dir)
    m = onnx.load(os.path.join(run_dir, meta.get("step_model", "step.onnx")), load_external_data=False)
    phase_of = {n.name: p for n, p in zip(m.graph.node, step_audit._phases(m, meta["nodes"]["forward"]))}
    op_of = {n.name: n.op_type for n in m.graph.node}
    batch = train._batch(train.model_specs(tiny)[_model_of(run_dir)])
    providers, _ = providers_for(device)
    prefix = os.path.join(tempfile.mkdtemp(prefix="graphmp-prof-"), "step")
    with ti.quiet_sessions(profile_prefix=prefix):
        runner = StepRunner(run_dir, meta, state, providers=providers)
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.step(batch)
        walls.append(time.perf_counter() - t0)
    with open(runner.sess.end_profiling()) as f:
        events = json.load(f)
    res = _summarize(events, phase_of, op_of, steps, walls)
    on_cpu = collections.Counter()
    if runner.device == "cuda":  # on the CPU provider every node is a CPU node: nothing to say
        on_cpu.update(op_of.get(e["name"][: -len("_kernel_time")], "?") for e in events
                      if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                      and e.get("args", {}).get("provider") == "CPUExecutionProvider")
    per = max(sum(1 for e in events if e.get("name") == "model_run"), 1)
    res.update(run=os.path.basename(os.path.normpath(run_dir)), providers=runner.providers,
               nodes=len(m.graph.node), cpu_nodes_per_step={k: v // per for k, v in on_cpu.items()},
               launch_blocking=os.environ.get("CUDA_LAUNCH_BLOCKING") == "1")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders <model>-<precision> built by benchmarks/train.py")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the models are train.py's --tiny ones")
    ap.add_argument("--steps", type=int, default=4, help="profiled steps (the first is left out)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is left out)")
    if args.one:
        print(TAG + json.dumps(profile(args.runs[0], args.device, args.tiny, args.steps)), flush=True)
        return 0
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    results, rc = [], 0
    for run in args.runs:
        cmd = [sys.executable, __file__, run, "--one", "--device", args.device, "--steps", str(args.steps)]
        p = subprocess.run(cmd + (["--tiny"] if args.tiny else []), capture_output=True, text=True, env=env,
                           timeout=900)
        line = next((x for x in p.stdout.splitlines() if x.startswith(TAG)), None)
        if p.returncode or line is None:
            rc = 1
            results.append({"run": run, "error": (p.stderr.strip().splitlines() or ["no output"])[-1]})
            print(f"{run}: FAILED: {results[-1]['error']}", flush=True)
            continue
        r = json.loads(line[len(TAG):])
        results.append(r)
        _write(args.json, args, results)  # after each run: a cut-short session keeps what it measured
        print(f"{r['run']}: wall {r['wall_ms']} ms (launches blocking), kernels {r['kernel_ms']} ms, "
              f"phases {r['phase_ms']}, on CPU {r['cpu_nodes_per_step'] or 'none'}", flush=True)
        for k, v in list(r["op_ms"].items())[:12]:
            print(f"    {k:32s} {v:9.2f} ms", flush=True)
    _write(args.json, args, results)
    return rc


def _write(path: str | None, args, results: list) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"device": args.device, "steps": args.steps, "results": results}, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())

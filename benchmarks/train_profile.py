#!/usr/bin/env python
"""Where a graphmp training step spends its time on the CPU, phase by phase, beside torch.

    OMP_NUM_THREADS=1 python benchmarks/train_profile.py [--cases resnet18,...] [--precisions fp32,mixed]
        [--steps 3] [--threads 1] [--work DIR] [--json out.json] [--heldout resnext] [--tiny]

Cases: benchmarks/train_cpu.py's (resnet50, resnet18, bert) and, with --heldout NAME,
benchmarks/train_heldout.py's models (e.g. resnext). For each case and precision the step is
built (or reused from --work), run `--steps` times under ONNX Runtime's profiler (StepRunner's
session, the benchmark protocol's options: denormals flushed, no spinning) and the node events
of all but the first step are summed per phase (step_audit's phases: forward, backward =
nodes named grad/..., update = the flat state's views and everything after the backward) and
per op type:phase. torch eager FP32 is timed in the same three phases on the same model and
batch (forward + loss, backward, AdamW's step), median of the same steps.
Kernel times exclude ORT's scheduling between nodes; the step's wall time is printed beside
their sum. StepRunner runs the update's elementwise chain as a Scan over blocks on the CPU
(graphmp/train/blocks.py): the Scan's time counts in the update phase, and the nodes of its
body are listed among the top nodes (their times summed over the blocks) but not added again.
The profiler records every body node of every block, which makes the Scan look slower under
it than it runs (ResNet-18: ~45 ms profiled, against ~11 ms less step time than the
whole-buffer update it replaces): compare the update across such runs by train_cpu.py.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import step_audit  # noqa: E402
import train_cpu  # noqa: E402
import train_interleave as ti  # noqa: E402
import train_nets  # noqa: E402


def profile_graphmp(run_dir: str, batch: dict, threads: int, steps: int, prefix: str) -> dict:
    """Run the step `steps` times with the ORT profiler on; {wall_ms: median of steps 2.., phase_ms,
    op_ms: {op:phase: ms per step}, top_nodes} from the events of steps 2.. (the first warms up)."""
    import onnx
    from graphmp.train.blocks import block_update, cpu_threads, weights_size
    from graphmp.train.loop import StepRunner, latest_state, load_run
    meta = load_run(run_dir)
    state, _ = latest_state(run_dir)
    m = onnx.load(os.path.join(run_dir, "step.onnx"), load_external_data=False)
    phase_of = {n.name: p for n, p in zip(m.graph.node, step_audit._phases(m, meta["nodes"]["forward"]))}
    op_of = {n.name: n.op_type for n in m.graph.node}
    # StepRunner runs the update's elementwise chain as Scans (graphmp/train/blocks.py): the same
    # lowering here names them; the nodes of their bodies are timed inside the Scan's event
    blocked, _ = block_update(m, weights_size(m), cpu_threads(threads))
    for n in blocked.graph.node:
        if n.op_type == "Scan":
            phase_of[n.name], op_of[n.name] = "update", "Scan"
            phase_of.update({b.name: "in-scan" for a in n.attribute if a.type == a.GRAPH for b in a.g.node})
    with ti.quiet_sessions(profile_prefix=prefix):
        runner = StepRunner(run_dir, meta, state, providers=["CPUExecutionProvider"], threads=threads)
    init, walls = runner.state_numpy(), []
    for _ in range(steps):
        runner.set_state(init)
        t0 = time.perf_counter()
        runner.step(batch)
        walls.append(time.perf_counter() - t0)
    path = runner.sess.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    return _summarize(events, phase_of, op_of, steps, walls)


def _summarize(events: list, phase_of: dict, op_of: dict, steps: int, walls: list) -> dict:
    """Per-step ms by phase and by op type:phase over the runs after the first (see profile_graphmp)."""
    runs = [e for e in events if e.get("name") == "model_run"]
    start = runs[0]["ts"] + runs[0]["dur"] if len(runs) > 1 else 0
    per = max(len(runs) - 1, 1)
    phase, op, node = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time") or e["ts"] < start:
            continue
        name = e["name"][: -len("_kernel_time")]
        ph = phase_of.get(name, "other")
        if ph == "in-scan":  # already in its Scan's time: listed per node, not added to a phase
            node[name] += e["dur"]
            continue
        phase[ph] += e["dur"]
        op[f"{op_of.get(name, e['args'].get('op_name', '?'))}:{ph}"] += e["dur"]
        node[name] += e["dur"]
    ms = lambda us: round(us / 1e3 / per, 2)  # noqa: E731
    return {"wall_ms": round(statistics.median(walls[1:] or walls) * 1e3, 1),
            "kernel_ms": ms(sum(phase.values())),
            "phase_ms": {k: ms(v) for k, v in phase.most_common()},
            "op_ms": {k: ms(v) for k, v in op.most_common(25)},
            "top_nodes": {k: ms(v) for k, v in node.most_common(12)}}


def profile_torch(module, batch: dict, threads: int, steps: int, token_classes: bool = False) -> dict:
    """torch eager FP32 AdamW (lr ti.LR) timed per phase: forward + loss, backward, optimizer step;
    the median ms of each over steps 2.. ({phase_ms, wall_ms})."""
    import torch
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    module.train()
    opt = torch.optim.AdamW(module.parameters(), lr=ti.LR, weight_decay=0.0)
    x, y = torch.from_numpy(batch["x"]), torch.from_numpy(batch["labels"])
    times = collections.defaultdict(list)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logits = module(x)
        if token_classes:
            logits, target = logits.flatten(0, 1), y.flatten()
        else:
            target = y
        loss = torch.nn.functional.cross_entropy(logits, target)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        for k, v in (("forward", t1 - t0), ("backward", t2 - t1), ("update", t3 - t2), ("wall", t3 - t0)):
            times[k].append(v)
    med = {k: round(statistics.median(v[1:] or v) * 1e3, 1) for k, v in times.items()}
    return {"wall_ms": med.pop("wall"), "phase_ms": med}


def case_specs(args) -> dict:
    specs = {k: v for k, v in train_cpu.cases(args.tiny).items() if k in args.cases.split(",")}
    if args.heldout:
        import train_heldout
        held = train_heldout.models(args.tiny)
        for name in args.heldout.split(","):
            specs[name] = held[name]
    return specs


def build_case(name: str, spec: dict, work: str, precisions: list) -> dict:
    """Export the case once and build each precision's step into work/ unless it is there."""
    import torch
    torch.manual_seed(0)
    module = spec["make"]()
    batch = train_nets.make_batch(spec)
    runs = {}
    for prec in precisions:
        runs[prec] = os.path.join(work, f"{name}-{prec}")
        if not os.path.exists(os.path.join(runs[prec], "step.onnx")):
            path = train_nets.export(module, batch, os.path.join(work, f"{name}.onnx"))
            ti.build(path, runs[prec], prec, **spec.get("build", {}))
    return {"module": module, "batch": batch, "runs": runs}


def print_case(name: str, res: dict) -> None:
    t = res["torch"]
    print(f"{name}: torch wall {t['wall_ms']} ms {t['phase_ms']}", flush=True)
    for prec, r in res["graphmp"].items():
        print(f"  graphmp {prec}: wall {r['wall_ms']} ms, kernels {r['kernel_ms']} ms {r['phase_ms']}", flush=True)
        print("    ops: " + ", ".join(f"{k} {v}" for k, v in list(r["op_ms"].items())[:14]), flush=True)
        print("    nodes: " + ", ".join(f"{k} {v}" for k, v in list(r["top_nodes"].items())[:6]), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="resnet50,resnet18,bert")
    ap.add_argument("--heldout", default="", help="train_heldout.py model names to add, comma-separated")
    ap.add_argument("--precisions", default="fp32,mixed")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per engine; the first is dropped")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--work", help="folder for the built steps (reused when present)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    ti.enter_protocol_env(args.threads, reexec=argv is None)
    work = args.work or tempfile.mkdtemp(prefix="graphmp-train-profile-")
    os.makedirs(work, exist_ok=True)
    out = {}
    for name, spec in case_specs(args).items():
        prep = build_case(name, spec, work, args.precisions.split(","))
        res = {"torch": profile_torch(prep["module"], prep["batch"], args.threads, args.steps,
                                      bool(spec.get("vocab"))), "graphmp": {}}
        for prec, run in prep["runs"].items():
            res["graphmp"][prec] = profile_graphmp(run, prep["batch"], args.threads, args.steps,
                                                   os.path.join(work, f"prof-{name}-{prec}"))
        print_case(name, res)
        out[name] = res
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

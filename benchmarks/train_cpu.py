#!/usr/bin/env python
"""The training-speed yardstick on the CPU: graphmp's step (ORT CPU, FP32 and mixed) against
torch eager FP32 on the same model, batch, initial weights and thread count, interleaved in one
process (the protocol of benchmarks/train_interleave.py: every timed step is AdamW's first
step from the initial state; denormals flushed; no spinning ORT threads; the script restarts
itself once with OMP_NUM_THREADS and glibc malloc settings, train_interleave.protocol_env).
Goal: graphmp's step <= 1.2x torch's, FP32 and mixed.

    python benchmarks/train_cpu.py [--cases resnet50,resnet18,bert]
        [--rounds 3] [--warmup 1] [--threads 1] [--json benchmarks/results/train_cpu.json] [--tiny]
        [--before DIR [--before-whole-buffers] [--before-plain]]

--before DIR times, in the same run, the steps an older checkout built in DIR (its --work);
with --before-whole-buffers they run with the update as step.onnx's whole-buffer nodes, as
StepRunner ran every step before it blocked the update (graphmp/train/blocks.py), and with
--before-plain on the plain path (numpy state fed and fetched each step), the CPU's default
before the bound one. Steps built by this checkout in DIR with those flags give the two
changes' own before/after.
Cases:
  resnet50  torchvision-layout ResNet-50 (bottleneck 3-4-6-3), batch 4 of 3x112x112, 1000 classes
  resnet18  torchvision-layout ResNet-18 (basic 2-2-2-2), batch 8 of 3x64x64, 1000 classes
  bert      benchmarks/train.py's EncoderStack: 4 post-LN layers, d 256, 4 heads, FFN 1024,
            batch 8 x 128 tokens (embeddings in), 2 classes
--tiny runs the same cases at toy size (a check that the script works; its times mean nothing).

Per case the JSON holds, per engine (torch-fp32, graphmp-fp32, graphmp-mixed), the median /
min / max ms of the timed steps and the loss; the ratios graphmp/torch and mixed/FP32 of the
medians; whether the losses agree; and the step graphs' audit (benchmarks/step_audit.py: nodes
by phase, MB moved by the non-GEMM nodes at the benchmark's batch). ORT CPU computes FP16 ops
in FP32 with casts, so mixed is not expected to be faster than FP32 here; it should not be
slower either.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import step_audit  # noqa: E402
import train_interleave as ti  # noqa: E402
import train_nets  # noqa: E402

GOAL = 1.2  # graphmp's step / torch eager FP32's, FP32 and mixed
LOSS_RTOL = {"fp32": 1e-3, "mixed": 1e-2}  # the same step's loss, graphmp vs torch


def cases(tiny: bool = False) -> dict:
    """name -> {make: () -> torch module, x: input shape, classes, what}."""
    if tiny:
        return {
            "resnet50": dict(make=lambda: train_nets.resnet("bottleneck", (1, 1, 1, 1), width=4, classes=10),
                             x=(2, 3, 32, 32), classes=10, what="toy ResNet-50 layout (width 4, 1-1-1-1)"),
            "resnet18": dict(make=lambda: train_nets.resnet("basic", (1, 1, 1, 1), width=4, classes=10),
                             x=(2, 3, 32, 32), classes=10, what="toy ResNet-18 layout (width 4, 1-1-1-1)"),
            "bert": dict(make=lambda: train_nets.encoder_stack(d=32, heads=2, layers=1), x=(2, 8, 32), classes=2,
                         what="toy EncoderStack (1 layer, d 32)")}
    return {
        "resnet50": dict(make=lambda: train_nets.resnet("bottleneck", (3, 4, 6, 3)), x=(4, 3, 112, 112),
                         classes=1000, what="ResNet-50 (torchvision layout), batch 4 of 3x112x112"),
        "resnet18": dict(make=lambda: train_nets.resnet("basic", (2, 2, 2, 2)), x=(8, 3, 64, 64), classes=1000,
                         what="ResNet-18 (torchvision layout), batch 8 of 3x64x64"),
        "bert": dict(make=lambda: train_nets.encoder_stack(d=256, heads=4, layers=4), x=(8, 128, 256), classes=2,
                     what="EncoderStack 4 post-LN layers, d 256, 4 heads, FFN 1024, batch 8 x 128 tokens")}


def prepare(name: str, spec: dict, work: str) -> dict:
    """Export the case's module and build its FP32 and mixed steps in work/; returns
    {module, batch, runs: {precision: run dir}, build_s, audit}."""
    import torch
    torch.manual_seed(0)
    module = spec["make"]()
    batch = train_nets.make_batch(spec)
    path = train_nets.export(module, batch, os.path.join(work, f"{name}.onnx"))
    runs, build_s, audit = {}, {}, {}
    for prec in ("fp32", "mixed"):
        runs[prec] = os.path.join(work, f"{name}-{prec}")
        _, build_s[prec] = ti.build(path, runs[prec], prec)
        audit[prec] = step_audit.audit_run(runs[prec], spec["x"][0])
    return {"module": module, "batch": batch, "runs": runs, "build_s": build_s, "audit": audit}


def measure(spec: dict, prep: dict, args) -> dict:
    """Interleave torch-fp32, graphmp-fp32, graphmp-mixed; the case's JSON (module docstring)."""
    engines = {"torch-fp32": ti.torch_engine(prep["module"], prep["batch"], args.threads),
               "graphmp-fp32": ti.graphmp_engine(prep["runs"]["fp32"], prep["batch"], args.threads),
               "graphmp-mixed": ti.graphmp_engine(prep["runs"]["mixed"], prep["batch"], args.threads)}
    for prec, run in prep.get("before", {}).items():  # --before: the same steps as an older checkout built them
        engines[f"graphmp-{prec}-before"] = ti.graphmp_engine(run, prep["batch"], args.threads,
                                                              **ti.before_engine_kw(args))
    timed = ti.interleave(engines, args.rounds, args.warmup)
    rows = {k: ti.row(v) for k, v in timed.items()}
    torch_ms, torch_loss = rows["torch-fp32"]["median_ms"], rows["torch-fp32"]["loss"]
    ratios = {f"graphmp_{p}_vs_torch": round(rows[f"graphmp-{p}"]["median_ms"] / torch_ms, 3) for p in LOSS_RTOL}
    ratios["graphmp_mixed_vs_fp32"] = round(rows["graphmp-mixed"]["median_ms"] / rows["graphmp-fp32"]["median_ms"], 3)
    for prec in prep.get("before", {}):
        before = rows[f"graphmp-{prec}-before"]["median_ms"]
        ratios[f"graphmp_{prec}_before_vs_torch"] = round(before / torch_ms, 3)
        ratios[f"graphmp_{prec}_vs_before"] = round(rows[f"graphmp-{prec}"]["median_ms"] / before, 3)
    losses = {p: {"rel_diff_vs_torch": round(ti.rel_diff(rows[f"graphmp-{p}"]["loss"], torch_loss), 6),
                  "tolerance": LOSS_RTOL[p]} for p in LOSS_RTOL}
    for v in losses.values():
        v["agree"] = v["rel_diff_vs_torch"] <= v["tolerance"]
    return {"what": spec["what"], "input_shape": list(spec["x"]), "batch": spec["x"][0], "rows": rows,
            "ratios": ratios, "losses": losses,
            "meets_goal": {p: ratios[f"graphmp_{p}_vs_torch"] <= GOAL for p in LOSS_RTOL},
            "build_s": {k: round(v, 1) for k, v in prep["build_s"].items()},
            "step_graph": prep["audit"]}


def print_case(name: str, res: dict) -> None:
    r, q = res["rows"], res["ratios"]
    print(f"{name}: torch {r['torch-fp32']['median_ms']:.1f} ms, graphmp FP32 {r['graphmp-fp32']['median_ms']:.1f} "
          f"ms ({q['graphmp_fp32_vs_torch']:.2f}x), mixed {r['graphmp-mixed']['median_ms']:.1f} ms "
          f"({q['graphmp_mixed_vs_torch']:.2f}x; {q['graphmp_mixed_vs_fp32']:.2f}x FP32); loss torch "
          f"{r['torch-fp32']['loss']:.4f} fp32 {r['graphmp-fp32']['loss']:.4f} mixed {r['graphmp-mixed']['loss']:.4f}"
          + ("" if r["graphmp-mixed"]["applied"] else " (mixed step skipped: loss scale overflow)"), flush=True)
    for p in ("fp32", "mixed"):
        if f"graphmp-{p}-before" in r:
            print(f"  before ({p}): {r[f'graphmp-{p}-before']['median_ms']:.1f} ms "
                  f"({q[f'graphmp_{p}_before_vs_torch']:.2f}x torch); now / before {q[f'graphmp_{p}_vs_before']:.2f}x",
                  flush=True)
    for p, a in res["step_graph"].items():
        print(f"  step graph {p}: nodes {a['nodes']}, non-GEMM {a['non_gemm_mb']} MB {a['non_gemm_mb_by_phase']}",
              flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="resnet50,resnet18,bert")
    ti.add_run_args(ap, os.path.join(HERE, "results", "train_cpu.json"), "case")
    args = ap.parse_args(argv)
    env = ti.enter_protocol_env(args.threads, reexec=argv is None)
    specs = cases(args.tiny)
    names = ti.chosen(ap, args.cases, specs, "case")
    work = ti.work_dir(args, "graphmp-train-cpu-")
    out = {"schema": "train_cpu/1", "host": platform.node(), "cpu_count": os.cpu_count(), **ti.versions(),
           "threads": args.threads, "env": env, "rounds": args.rounds, "warmup": args.warmup, "tiny": args.tiny,
           "optimizer": f"AdamW lr {ti.LR}, weight decay 0, both engines", "goal_max_ratio": GOAL, "work": work,
           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cases": {}}
    for name in names:
        prep = prepare(name, specs[name], work)
        if args.before:
            prep["before"] = {p: os.path.join(args.before, f"{name}-{p}") for p in LOSS_RTOL}
        out["cases"][name] = measure(specs[name], prep, args)
        print_case(name, out["cases"][name])
        del prep
        gc.collect()
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""train_dist.py: data-parallel training throughput, 1 vs N ranks (issue 24).

For each workload (the tiny CNN and MLP of tests/fixtures, and models/tiny/bert.onnx, a small
BERT encoder, trained with mse on its last hidden state), through the CLI as a user runs it:
  single   `graphmp train RUN --batch-size B` (one process, the fused step graph)
  dp-1     `graphmp train RUN --nproc 1 --batch-size B` (the split step, one rank: the cost
           of splitting and of a world-of-one all-reduce)
  dp-N     `graphmp train RUN --nproc N --batch-size B` (B per rank: N x B per step)
Recorded: wall seconds of the command, steps, and samples/s from the median step time, for
every row alike (the single process's summary and rank 0's --dist-summary: process start,
torch import and the first steps' ONNX Runtime warm-up are not in it), the mean seconds per
step split into compute (the gradient half), all-reduce and update, and the scaling efficiency
throughput(dp-N) / (N x throughput(dp-1)). On a 2-core machine N=2 shares the cores the
single rank had: the efficiency says what the all-reduce and the split cost, not what a
second machine would give.

usage: python benchmarks/train_dist.py [--nproc 2] [--batch-size 16] [--epochs 3]
                                      [--bert-base-layers 12] [--json out.json]
A fourth workload is a BERT-base-sized encoder (benchmarks/synth.py, 110 M parameters at 12
layers: the all-reduce moves 440 MB a step), batch 2 per rank, 6 steps.
On a GPU machine with onnxruntime-gpu and a CUDA torch the ranks run on CUDA and reduce
with NCCL (--device auto); with one GPU run it with --nproc 1, which measures the split
step and the all-reduce overhead of a world of one. Several GPUs: docs/train.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), HERE]
GRAPHMP = [sys.executable, "-m", "graphmp.cli"]


def workloads(tmp: str, n_samples: int) -> list:
    """(name, model path, data path, train-graph flags)."""
    from fixtures import tiny
    out = []
    for name, model, data, loss in (("cnn", tiny.cnn(), tiny.bars(n_samples), "cross-entropy"),
                                    ("mlp", tiny.mlp(hidden=256), tiny.blobs(n_samples), "cross-entropy")):
        p, d = os.path.join(tmp, f"{name}.onnx"), os.path.join(tmp, f"{name}.npz")
        onnx.save(model, p)
        np.savez(d, **data)
        out.append((name, p, d, ["--loss", loss, "--optimizer", "adamw", "--lr", "1e-3", "--precision", "fp32"]))
    bert = os.path.join(ROOT, "models", "tiny", "bert.onnx")
    if os.path.exists(bert):
        r = np.random.default_rng(0)
        d = os.path.join(tmp, "bert.npz")
        ids = r.integers(0, 100, (n_samples, 16)).astype(np.int64)
        np.savez(d, input_ids=ids, attention_mask=np.ones_like(ids), token_type_ids=np.zeros_like(ids),
                 labels=r.standard_normal((n_samples, 16, 64)).astype(np.float32))
        out.append(("bert-tiny", bert, d, ["--loss", "mse", "--optimizer", "adamw", "--lr", "1e-4",
                                           "--precision", "fp32", "--shapes", "input_ids:2x16,attention_mask:2x16,"
                                           "token_type_ids:2x16"]))
    return out


def bert_base(tmp: str, layers: int, seq: int = 64, n_samples: int = 64) -> tuple:
    """A BERT-base-sized encoder (hidden 768, 12 heads, FFN 3072, vocab 30522: 110 M
    parameters at 12 layers, a 440 MB all-reduce per step), benchmarks/synth.py's layout,
    trained with mse on its last hidden state; (name, model, data, flags, overrides)."""
    import synth
    p, d = os.path.join(tmp, "bert-base.onnx"), os.path.join(tmp, "bert-base.npz")
    synth.save(synth.bert(layers=layers), p)
    r = np.random.default_rng(0)
    ids = r.integers(0, 30522, (n_samples, seq)).astype(np.int64)
    np.savez(d, input_ids=ids, attention_mask=np.ones_like(ids),
             labels=r.standard_normal((n_samples, seq, 768)).astype(np.float32))
    flags = ["--loss", "mse", "--optimizer", "adamw", "--lr", "1e-4", "--precision", "fp32",
             "--shapes", f"input_ids:2x{seq},attention_mask:2x{seq}"]
    return (f"bert-base-{layers}l", p, d, flags, {"batch_size": 2, "max_steps": 6})


def _error(p) -> str:
    """graphmp's own error line of a failed command (torchrun's log lines aside)."""
    lines = p.stderr.strip().splitlines()
    mine = [ln for ln in lines if "graphmp: error:" in ln]
    return (mine or lines or ["failed"])[-1][:300]


def run(cmd: list, timeout: float) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return time.perf_counter() - t0, p


def measure(name, model, data, flags, args, tmp, overrides=None) -> dict:
    """One workload's row: single, dp-1 and dp-N (overrides: batch_size, max_steps for it)."""
    o = overrides or {}
    batch = o.get("batch_size", args.batch_size)
    row = {"workload": name, "per_rank_batch": batch}
    for label, extra in (("single", []), ("dp-1", ["--nproc", "1"]), (f"dp-{args.nproc}", ["--nproc", str(args.nproc)])):
        rd = os.path.join(tmp, f"{name}-{label}")
        wall, p = run(GRAPHMP + ["train-graph", model, "-o", rd, "--force", "-q", *flags], args.timeout)
        if p.returncode:
            row[label] = {"error": _error(p)}
            continue
        summ = os.path.join(tmp, f"{name}-{label}.json")
        cmd = GRAPHMP + ["train", rd, "--data", data, "--batch-size", str(batch), "--epochs",
                         str(args.epochs), "-q", "--no-resume", *extra]
        if "max_steps" in o:
            cmd += ["--max-steps", str(o["max_steps"])]
        if extra:
            cmd += ["--dist-summary", summ]
        wall, p = run(cmd, args.timeout)
        if p.returncode:
            row[label] = {"error": _error(p)}
            continue
        r = {"wall_s": wall}
        if extra:
            s = json.load(open(summ))
            per_rank = batch
            med = s["median_step_s"]  # per step (window), like the single process's median: warm-up left out
            r.update(steps=s["steps"], loop_s=s["seconds"], median_step_s=med, steps_per_s=1.0 / med,
                     samples_per_s=s["global_batch"] * s["accumulate"] / med, split=s["seconds_per_step"],
                     global_batch=s["global_batch"], per_rank_batch=per_rank)
        else:
            s = json.load(open(os.path.join(rd, "summary.json")))
            t = s.get("seconds_per_step")
            r.update(steps=s.get("steps_this_call"), median_step_s=t,
                     samples_per_s=batch / t if t else None)
        row[label] = r
    one, many = row.get("dp-1", {}), row.get(f"dp-{args.nproc}", {})
    if "samples_per_s" in one and "samples_per_s" in many:
        row["scaling_efficiency"] = many["samples_per_s"] / (args.nproc * one["samples_per_s"])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16, help="per rank")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--bert-base-layers", type=int, default=12, metavar="L",
                    help="also a BERT-base-sized encoder of L layers, batch 2 per rank, 6 steps (0: leave it out)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="graphmp-train-dist-") as tmp:
        jobs = [(*w, None) for w in workloads(tmp, args.samples)]
        if args.bert_base_layers:
            jobs.append(bert_base(tmp, args.bert_base_layers))
        for name, model, data, flags, overrides in jobs:
            row = measure(name, model, data, flags, args, tmp, overrides)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n| workload | single samples/s | dp-1 samples/s | dp-{args.nproc} samples/s | efficiency | dp-{args.nproc} s/step: "
          "compute / all-reduce / update |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        one, many = r.get("dp-1", {}), r.get(f"dp-{args.nproc}", {})
        sp = many.get("split", {})
        cell = lambda d: f"{d['samples_per_s']:.0f}" if d.get("samples_per_s") else d.get("error", "-")  # noqa: E731
        eff = f"{r['scaling_efficiency']:.2f}" if "scaling_efficiency" in r else "-"
        split = " / ".join(f"{1e3 * sp[k]:.2f} ms" for k in ("compute", "all_reduce", "update")) if sp else "-"
        print(f"| {r['workload']} | {cell(r.get('single', {}))} | {cell(one)} | {cell(many)} | {eff} | {split} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nproc": args.nproc, "batch_size_per_rank": args.batch_size, "epochs": args.epochs,
                       "cpus": os.cpu_count(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

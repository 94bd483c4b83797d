#!/usr/bin/env python
"""The step session's settings side by side, on one run folder, in one run (benchmarks/train_gpu.sh
calls it for the mixed ResNet-50 and BERT-base b32 steps that benchmarks/train.py built):

  ort-default         CUDA provider with no options: ONNX Runtime's defaults (prefer_nhwc=0), what
                      graphmp's step session got before it chose options from the step graph
  graphmp             the options graphmp chooses (graphmp.train.device.step_cuda_options:
                      prefer_nhwc=1 for FP16 convolutions when none is a ConvTranspose, cuDNN
                      EXHAUSTIVE + max workspace)
  graphmp-cuda-graph  the same plus --cuda-graph (batch axis pinned, two captured graphs replayed)

Each variant runs in its own process, one after the other (a ResNet-50 b32 step session holds
several GB of GPU memory), through graphmp's StepRunner on the same state and the same fixed
batch: the median and p90 of --steps steps after --warmup (the first step, cuDNN's algorithm
search and the captures, is timed apart as first_step_s), the options the session reports
(get_provider_options), and the loss of the first and last step (the variants compute the same
step: their losses agree to the FP16 rounding that NHWC kernels may change). A variant graphmp
refuses (--cuda-graph on a step that would run a node on the CPU; any variant off CUDA) is a row
with "refused": the one-line reason. Ratios: each variant's median over ort-default's.

  python benchmarks/train_session.py RUN_DIR --device cuda [--steps 20] [--warmup 5] --json OUT
  python benchmarks/train_session.py RUN_DIR --device cpu --tiny ...   # the dry run: CPU, toy size
Exit 0 done (refusals included), 1 a variant failed, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import train as train_bench  # noqa: E402  (benchmarks/train.py: the model specs, the batch, the timer)

TAG = "@@SESSION "
VARIANTS = ("ort-default", "graphmp", "graphmp-cuda-graph")


def _model_of(run_dir: str) -> str:
    """The model of a run folder of benchmarks/train.py (<model>-<precision>): its batch."""
    name = os.path.basename(os.path.normpath(run_dir)).rsplit("-", 1)[0]
    return name if name in train_bench.model_specs(True) else "resnet50"


def run_variant(args) -> dict:
    """One variant in this process: the StepRunner it asks for, timed; "refused" when graphmp
    refuses it (one line)."""
    from graphmp.errors import GraphmpError
    from graphmp.session import CPU, CUDA, ran_on
    from graphmp.train.loop import latest_state, load_run
    from graphmp.train.runner import StepRunner
    meta = load_run(args.run_dir)
    state, _ = latest_state(args.run_dir)
    batch = train_bench._batch(train_bench.model_specs(args.tiny)[_model_of(args.run_dir)])
    cuda = args.device == "cuda"
    providers = {"ort-default": [(CUDA, {}), CPU], "graphmp": [CUDA, CPU],
                 "graphmp-cuda-graph": [CUDA, CPU]}[args.variant] if cuda else [CPU]
    try:
        t0 = time.perf_counter()
        r = StepRunner(args.run_dir, meta, state, providers=providers,
                       cuda_graph=args.variant == "graphmp-cuda-graph", batch_size=batch["x"].shape[0])
        setup_s = time.perf_counter() - t0
    except GraphmpError as e:
        return {"refused": str(e)}
    losses = []
    t0 = time.perf_counter()
    losses.append(float(r.step(batch)[0]))
    first = time.perf_counter() - t0
    res = train_bench._time(lambda: losses.append(float(r.step(batch)[0])), args.steps, args.warmup)
    res.update(session_s=round(setup_s, 3), first_step_s=round(first, 3), ran_on=ran_on(r.sess),
               provider_options=r.provider_options, cuda_graph=r.cuda_graph, state_on_device=r.bound,
               loss_first=losses[0], loss_last=losses[-1], steps=args.steps)
    return res


def _child(argv: list, timeout: int = 1200) -> dict:
    p = subprocess.run([sys.executable, __file__] + argv, capture_output=True, text=True, timeout=timeout,
                       env=train_bench.child_env())
    for line in p.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    return {"error": ((p.stderr or p.stdout).strip().splitlines() or [f"exit {p.returncode}"])[-1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run folder <model>-<precision> of benchmarks/train.py --work (its model "
                    "gives the batch; the mixed ResNet-50 step by default in train_gpu.sh)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the toy-size ResNet-50 of train.py --tiny (its batch)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", required=True)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a child: this variant only
    args = ap.parse_args(argv)
    if args.variant:
        print(TAG + json.dumps(run_variant(args)))
        return 0
    common = [args.run_dir, "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--json", args.json] + (["--tiny"] if args.tiny else [])
    rows = {}
    for v in VARIANTS:
        rows[v] = _child(common + ["--variant", v])
        r = rows[v]
        print(f"  {v:20s} " + (f"{r['median_ms']:9.2f} ms/step (p90 {r['p90_ms']:.2f}) on {r['ran_on']}, first step "
                               f"{r['first_step_s']:.2f} s, loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}"
                               if "median_ms" in r else f"REFUSED: {r['refused']}" if "refused" in r
                               else f"FAILED: {r['error']}"), flush=True)
    base = rows["ort-default"].get("median_ms")
    out = {"run_dir": args.run_dir, "device": args.device, "tiny": args.tiny, "steps": args.steps,
           "warmup": args.warmup, "variants": rows,
           "vs_ort_default": {v: base / r["median_ms"] for v, r in rows.items() if base and "median_ms" in r}}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json + ".tmp", "w") as f:
        json.dump(out, f, indent=2)
    os.replace(args.json + ".tmp", args.json)
    print(f"train_session: wrote {args.json} (speed-up over ort-default: "
          + ", ".join(f"{v} {x:.2f}x" for v, x in out["vs_ort_default"].items()) + ")")
    return 1 if any("error" in r for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

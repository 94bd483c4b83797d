#!/usr/bin/env python
"""Which FP16 oracle to trust: graphmp's emulation, onnx.reference and ORT CUDA, side by side.

For each model and its input batches: graphmp converts it (the static plan, and the
plan of `--max-error 1e-2` when --budget is given), then graphmp.check judges the
converted model against the FP32 source on the same batches, once per oracle:
  emulation   FP16 storage, FP32 math on ONNX Runtime CPU (graphmp/emulate.py)
  reference   onnx.reference with graphmp's ideal-kernel overrides (graphmp/model_runs.py)
  ORT CUDA    the converted model as it is on ONNX Runtime's CUDA provider (only where
              onnxruntime-gpu and a GPU are present: check adds these rows itself)
The table gives max|a-b|/max|ref| per output for each; the closer an oracle is to ORT
CUDA, the better it predicts what a GPU computes.

Usage:
  python benchmarks/oracles.py MODEL.onnx:DATA.npz[,DATA2.npz] [...] [--budget 1e-2] [--json OUT]
e.g. (from the repo root)
  python benchmarks/oracles.py models/real/ppocr_mobile_v2_cls.onnx:cls0.npz,cls1.npz
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from graphmp import convert  # noqa: E402
from graphmp.check import EMULATION, check  # noqa: E402
from graphmp.model_runs import cuda_available  # noqa: E402

CUDA = " [ORT CUDA]"


def _errors(report) -> dict:
    return {k: o["error"] for k, o in report.outputs.items()}


def judge(src: str, conv: str, data: list) -> dict:
    """{output: {"emulation", "reference", "ort_cuda"}} plus the seconds each oracle took."""
    rows: dict = {}
    seconds = {}
    for oracle in ("emulation", "reference"):
        t = time.perf_counter()
        rep = check(src, conv, data=data, oracle=oracle)
        seconds[oracle] = round(time.perf_counter() - t, 2)
        for k, e in _errors(rep).items():
            if k.endswith(CUDA):
                rows.setdefault(k[:-len(CUDA)], {})["ort_cuda"] = e
            else:
                fell_back = oracle == "reference" and rep.data["oracle"] == EMULATION
                rows.setdefault(k, {})[oracle] = None if fell_back else e
    return {"outputs": rows, "seconds": seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("items", nargs="+", metavar="MODEL:DATA[,DATA]")
    ap.add_argument("--budget", help="also judge the plan of convert --max-error BUDGET")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.items:
            src, _, data = item.partition(":")
            data = [d for d in data.split(",") if d]
            for plan, opts in [("static", {})] + ([(f"--max-error {args.budget}", {"max_error": args.budget})]
                                                   if args.budget else []):
                out = os.path.join(tmp, f"{len(results)}.onnx")
                convert(src, out, calibration=data or None, **opts)
                row = {"model": os.path.basename(src), "plan": plan, **judge(src, out, data or None)}
                results.append(row)
                for k, e in row["outputs"].items():
                    cells = [f"{e[c]:.3g}" if isinstance(e.get(c), float) else "-"
                             for c in ("emulation", "reference", "ort_cuda")]
                    print(f"| {row['model']} | {plan} | {k} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cuda": cuda_available(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The corpus table: every model under models/ converted by graphmp, then loaded in
ONNX Runtime and compared with FP32 FP16-faithfully (onnx.reference) on generated
inputs. Prints a markdown table and writes JSON.

    python benchmarks/corpus_table.py [MODEL ...] [--json benchmarks/results/corpus.json] [--timeout 900]

Default models: models/real/*.onnx, models/tiny/*.onnx and models/build/*.onnx (made by
models/corpus.py and models/export_hf.py). Each model runs in its own subprocess with a
time budget, since the pure-numpy oracle takes minutes on large images.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def one(path: str) -> dict:
    import onnx

    import graphmp
    from graphmp.check import check
    from graphmp.inputs import find_shapes
    from graphmp.model_runs import runner
    row = {"model": os.path.relpath(path, ROOT)}
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.onnx")
        t = time.perf_counter()
        rep = graphmp.convert(path, out).to_dict()
        row["convert_s"] = round(time.perf_counter() - t, 2)
        n = rep["nodes"]
        row["fp16_share"] = round(n["low"] / max(1, n["low"] + n["fp32"]), 3)
        row["nodes_fp16"], row["nodes_fp32"] = n["low"], n["fp32"]
        row["casts"] = rep["casts_added"]
        row["weights_mb"] = round(rep["weight_bytes_before"] / 1e6, 2)
        row["weights_mb_after"] = round(rep["weight_bytes_after"] / 1e6, 2)
        onnx.checker.check_model(out, full_check=True)
        feeds = find_shapes(onnx.load(path, load_external_data=False), runner(path)).feeds()
        runner(out)(feeds)  # loads and runs in ORT
        row["ort_loads"] = True
        t = time.perf_counter()
        res = check(path, out, data=feeds)
        row["oracle"] = "fp16-faithful" if res.data["oracle"].startswith("onnx.reference") else "ORT CPU (fallback)"
        row["check_s"] = round(time.perf_counter() - t, 1)
        outs = res.outputs.values()
        row["max_abs"] = max(o["max_abs"] for o in outs)
        row["rel_to_scale"] = max(o["max_abs"] / max(o["ref_max_abs"], 1e-12) for o in outs)
        agrees = [o["argmax_agree"] for o in outs if o["argmax_agree"] is not None]
        row["argmax_agree"] = min(agrees) if agrees else None
        row["nonfinite"] = sum(o["nonfinite"] for o in outs)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*")
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "corpus.json"))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one)))
        return
    models = a.models or [m for d in ("real", "tiny", "build")
                          for m in sorted(glob.glob(os.path.join(ROOT, "models", d, "*.onnx")))]
    rows = []
    for m in models:
        if os.path.getsize(m) < 1_000_000 and os.path.exists(m + ".data") and os.path.getsize(m + ".data") > 2**31:
            rows.append({"model": os.path.relpath(m, ROOT), "error": "over 2 GB: see the large-model run"})
            continue
        t = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, __file__, "--one", m], capture_output=True, text=True, timeout=a.timeout)
            row = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else \
                {"model": os.path.relpath(m, ROOT), "error": (r.stderr.strip().splitlines() or ["?"])[-1][:160]}
        except subprocess.TimeoutExpired:
            row = {"model": os.path.relpath(m, ROOT), "error": f"timeout after {a.timeout:.0f} s"}
        row["wall_s"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    hdr = "| model | convert s | fp16 share | fp32 nodes | Casts | weights MB | after MB | oracle | max abs | err/scale | argmax agree | inf/NaN |"
    lines = [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error']} |")
            continue
        agree = "-" if r["argmax_agree"] is None else f"{r['argmax_agree']:.4f}"
        lines.append(f"| {r['model']} | {r['convert_s']} | {r['fp16_share']:.2f} | {r['nodes_fp32']} | {r['casts']} | "
                     f"{r['weights_mb']} | {r['weights_mb_after']} | {r['oracle']} | {r['max_abs']:.3g} | "
                     f"{r['rel_to_scale']:.2%} | {agree} | {r['nonfinite']} |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"command": " ".join(sys.argv), "python": sys.version.split()[0], "machine": platform.platform(),
                   "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

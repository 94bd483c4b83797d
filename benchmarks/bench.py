#!/usr/bin/env python
"""Speed and accuracy of mixed FP16 vs TF32 vs strict FP32 vs onnxconverter-common, in one run.

For each model (default: ResNet-50 and BERT-base from models/build, falling back to the
tiny committed exports in models/tiny when those were not built) and each available
backend, runs graphmp.bench at the given batch sizes (default 1 and 32) with precisions
fp32 (TF32 off), tf32, fp16 (graphmp) and occ (onnxconverter-common), prints each table,
checks the issue's target (mixed FP16 >= 1.8x faster than TF32 at the largest batch with
argmax agreement >= 99.9%) and writes one JSON file.

Usage:
  python benchmarks/bench.py                                   # defaults, results/bench.json
  python benchmarks/bench.py --models resnet50 --batch 1 --backends ort-cpu --iterations 5
  python benchmarks/bench.py --models path/to/model.onnx --backends ort-cuda,trt
Default backends: trt and ort-cuda where a GPU backend can run, else ort-cpu (said so).
See benchmarks/README.md ("Inference benchmark") for the JSON layout.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from graphmp.bench import bench  # noqa: E402
from graphmp.errors import GraphmpError  # noqa: E402
from graphmp.save import write_json  # noqa: E402

# name -> (full-size export, committed tiny fallback, size of the other symbolic dims: sequence length)
MODELS = {
    "resnet50": ("models/build/resnet50.onnx", "models/tiny/resnet.onnx", 16),
    "bert-base": ("models/build/bert-base.onnx", "models/tiny/bert.onnx", 128),
}
TARGET_SPEEDUP, TARGET_ARGMAX = 1.8, 0.999


def _resolve(name):
    """(label, path, dim, note) for a known model name or an .onnx path."""
    if name in MODELS:
        full, tiny, dim = MODELS[name]
        if os.path.exists(os.path.join(REPO, full)):
            return name, os.path.join(REPO, full), dim, None
        return (f"{name} (tiny fallback)", os.path.join(REPO, tiny), dim,
                f"{full} is missing (build it with models/export_hf.py); used {tiny}, a toy-sized model")
    if not os.path.exists(name):
        raise GraphmpError(f"{name}: not a known model ({', '.join(MODELS)}) and no such file")
    return os.path.splitext(os.path.basename(name))[0], name, 16, None


def _default_backends():
    from graphmp.bench import _ort_cuda_status, _trt_status
    gpu = [b for b, why in (("trt", _trt_status()), ("ort-cuda", _ort_cuda_status())) if why is None]
    return gpu or ["ort-cpu"]


def _seq_shapes(path, seq, batch=1):
    """--shapes text giving every rank-2 integer input (token ids, masks) `seq` positions."""
    import onnx
    from graphmp.inputs import input_specs
    specs = [s for s in input_specs(onnx.load(path, load_external_data=False))
             if len(s.dims) == 2 and s.elem in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)]
    return ",".join(f"{s.name}:{batch}x{seq}" for s in specs) or None


def _targets(label, d):
    """Mixed FP16 vs TF32 at the largest batch, per GPU backend: the issue's target. Both rows
    of a comparison use the same session options (variant); the best variant is reported."""
    out = []
    batch = max(d["settings"]["batches"]) if d["model"]["fixed_batch"] is None else d["model"]["fixed_batch"]
    for backend in sorted({r["backend"] for r in d["rows"]}):
        pairs = [(r, r["speedup_vs_tf32"]) for r in d["rows"] if (r["backend"], r["precision"], r["batch"]) ==
                 (backend, "fp16", batch) and r["status"] == "ok" and r["speedup_vs_tf32"]]
        fp16 = max(pairs, key=lambda x: x[1])[0] if pairs else None
        t = {"model": label, "backend": backend, "batch": batch, "variant": fp16["variant"] if fp16 else None,
             "speedup_fp16_vs_tf32": None, "argmax_agree": None, "met": None, "why": None}
        if backend == "ort-cpu":
            t["why"] = "CPU backend: no TF32 and no FP16 compute; the target is about GPU Tensor Cores"
        elif fp16 is None:
            t["why"] = "no finished fp16 row with a finished tf32 row of the same session options"
        else:
            t["speedup_fp16_vs_tf32"] = fp16["speedup_vs_tf32"]
            t["argmax_agree"] = (fp16["accuracy"] or {}).get("argmax_agree")
            t["met"] = bool(t["speedup_fp16_vs_tf32"] >= TARGET_SPEEDUP and t["argmax_agree"] is not None
                            and t["argmax_agree"] >= TARGET_ARGMAX)
        out.append(t)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert-base", help="names (resnet50, bert-base) or .onnx paths")
    ap.add_argument("--batch", default="1,32", help="batch sizes (default 1,32)")
    ap.add_argument("--backends", help="trt,ort-cuda,ort-cpu (default: GPU backends if usable, else ort-cpu)")
    ap.add_argument("--no-occ", action="store_true", help="leave out onnxconverter-common")
    ap.add_argument("--compare", default="", help="also: ort-opt (ONNX Runtime's transformers optimizer, float16)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--min-time", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (see graphmp bench --help)")
    ap.add_argument("--seq", type=int, help="sequence length for BERT-like inputs (default 128)")
    ap.add_argument("--cudnn-conv-algo-search", default="EXHAUSTIVE")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "bench.json"))
    ap.add_argument("--plot-dir", default=os.path.join(HERE, "results"), help="one PNG per model ('' = none)")
    ap.add_argument("--keep", help="keep converted models and engines here")
    args = ap.parse_args(argv)
    command = shlex.join([os.path.relpath(__file__, os.getcwd()), *(sys.argv[1:] if argv is None else argv)])

    backends = args.backends or ",".join(_default_backends())
    notes = []
    if not args.backends and backends == "ort-cpu":
        notes.append("no usable GPU backend here (TensorRT / onnxruntime-gpu / NVIDIA GPU missing): ORT CPU "
                     "numbers only; they do not measure Tensor Core speed")
        print(f"note: {notes[-1]}", file=sys.stderr)
    results, targets = {}, []
    t0 = time.perf_counter()
    for name in [m for m in args.models.split(",") if m]:
        label, path, dim, note = _resolve(name)
        if note:
            notes.append(f"{label}: {note}")
            print(f"note: {note}", file=sys.stderr)
        print(f"== {label}: {os.path.relpath(path, REPO)}", file=sys.stderr)
        compare = [c for c in args.compare.split(",") if c] + ([] if args.no_occ else ["occ"])
        res = bench(path, backends=backends, batches=args.batch, shapes=_seq_shapes(path, args.seq or dim),
                    warmup=args.warmup, iterations=args.iterations, min_time=args.min_time, rounds=args.rounds,
                    compare=compare,
                    cudnn_conv_algo_search=args.cudnn_conv_algo_search, command=command,
                    keep=os.path.join(args.keep, label) if args.keep else None)
        print(res.table())
        print()
        d = res.to_dict()
        results[label] = d
        targets += _targets(label, d)
        if args.plot_dir:
            try:
                res.plot(os.path.join(args.plot_dir, f"bench-{label.split()[0]}.png"))
            except GraphmpError as e:
                print(f"note: no plot: {e}", file=sys.stderr)
    print("target (mixed FP16 >= 1.8x TF32 at the largest batch, argmax agreement >= 99.9%):")
    for t in targets:
        verdict = {True: "MET", False: "NOT MET", None: "not measured"}[t["met"]]
        got = (f"{t['speedup_fp16_vs_tf32']:.2f}x, argmax {t['argmax_agree']}" if t["speedup_fp16_vs_tf32"]
               else t["why"])
        print(f"  {t['model']} {t['backend']} batch {t['batch']} ({t['variant'] or '-'}): {verdict} ({got})")
    notes.append("resnet50 / bert-base in models/build have seeded random weights (models/export_hf.py), not "
                 "trained ones: argmax agreement on them is a proxy for the real-weight target")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    write_json(args.json, {"schema": "graphmp-bench-benchmark", "schema_version": 1, "command": command,
                           "seconds": time.perf_counter() - t0, "backends": backends, "notes": notes,
                           "targets": targets, "models": results})
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except GraphmpError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        sys.exit(2)

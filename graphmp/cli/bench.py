"""`graphmp bench`: FP32 vs TF32 vs mixed FP16 on TensorRT and ONNX Runtime."""
from __future__ import annotations

import argparse
import sys

from .args import (add_data, add_json, add_max_error, add_model_type, add_quiet, add_seed, add_shapes,
                   add_timing_cache, add_tolerances, add_workspace)

EPILOG_BENCH = """\
what one run does:
  builds the FP32 baseline (the model through graphmp's pipeline with no precision change,
  so it has the same graph cleanups as the converted model: a speedup is precision alone),
  converts with graphmp (or takes --converted), then for each backend, precision, batch and
  session-option variant: creates the session / builds the engine, checks what provider
  actually runs, warms up, times synchronized runs on the host clock (the same for every
  backend) until --iterations and --min-time are both reached, and compares the outputs
  with ONNX Runtime CPU FP32 on the same inputs. While a row warms up and is timed, a line on
  stderr says how far it got, at most every 2 s (on a terminal, or with -v; never with -q). Ctrl-C stops the run: the rows
  that finished are printed and written to --json with "partial": true, and the exit code is 130.

backends:  trt       TensorRT, strongly typed, one engine per precision and batch
                     (needs tensorrt and torch with CUDA for buffers and CUDA events)
           ort-cuda  ONNX Runtime CUDA, inputs/outputs bound on the device (I/O binding);
                     every precision also with prefer_nhwc=1 (variant nhwc) and, where the
                     model's shapes are static, with CUDA graphs (variant cuda-graph); the
                     fastest variant per precision is reported. A session that comes up on
                     the CPU fails its row (never a CPU time under an ort-cuda label).
           ort-cpu   ONNX Runtime CPU (no TF32; FP16 ops mostly run in FP32 there)
precisions: fp32 (TF32 off), tf32 (TF32 on), fp16 (graphmp mixed); --compare adds
  occ (onnxconverter-common, keep_io_types=True) and ort-opt (ONNX Runtime's transformers
  optimizer: fused, then float16 with keep_io_types=True; needs sympy).

accuracy, per output: err = max|a-b| / max|ref| (normalised: near-zero references do not
  dominate), cosine similarity, SNR, argmax agreement (class scores). The TF32 error is
  the yardstick (the tf32 row of the same backend, batch and variant; on the CPU, TF32
  emulated): a row is in tolerance when it has no new inf/NaN and, per output,
  err <= max(--max-error, --tf32-factor x TF32 err, --tf32-factor x the FP16-input floor:
  the FP32 source with only its inputs rounded to FP16), the yardstick of graphmp check.

examples:
  # the first runs from a clone of the repository, on the CPU
  graphmp bench models/tiny/resnet.onnx --backends ort-cpu --iterations 10 --min-time 0.1
  graphmp bench model.onnx                                    # all backends, batch 1
  graphmp bench model.onnx --backends ort-cuda,trt --batch 1,8,32 --json out.json --plot out.png
  graphmp bench model.onnx --backends ort-cpu --iterations 20 --min-time 0.5
  graphmp bench bert.onnx --backends ort-cuda --compare ort-opt,occ --batch 32 --shapes input_ids:32x128
  graphmp bench model.onnx --converted model.mp.onnx --data inputs.npz
"""


def _int_list(s):
    try:
        items = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        items = []
    if not items or any(b < 1 for b in items):
        raise argparse.ArgumentTypeError(f"'{s}' is not a list of positive integers like 1,8,32")
    return items



def add(sub):
    b = sub.add_parser("bench", help="FP32 vs TF32 vs mixed FP16: latency, throughput, memory and accuracy",
                       description="Benchmark a model in strict FP32, TF32 and graphmp mixed FP16 on TensorRT, "
                       "ONNX Runtime CUDA and ONNX Runtime CPU, with the accuracy of every row on the same inputs.",
                       epilog=EPILOG_BENCH, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("model", help="FP32 .onnx (converted here), or a model already converted by graphmp "
                   "(then only its own rows run)")
    b.add_argument("--converted", metavar="ONNX", help="use this converted model for the fp16 rows instead of "
                   "converting MODEL")
    b.add_argument("--backends", default="trt,ort-cuda,ort-cpu", metavar="LIST",
                   help="any of trt,ort-cuda,ort-cpu (default: all three)")
    b.add_argument("--precisions", metavar="LIST", help="any of fp32,tf32,fp16,occ,ort-opt (default: "
                   "fp32,tf32,fp16, plus those of --compare)")
    b.add_argument("--compare", metavar="LIST", help="add other converters' FP16 models as rows: occ "
                   "(onnxconverter-common, pip install 'graphmp[bench]'), ort-opt (ONNX Runtime's transformers "
                   "optimizer, fused + float16; needs sympy)")
    b.add_argument("--compare-occ", action="store_true", help="same as --compare occ")
    add_model_type(b, "ort-opt: the optimizer's model type (bert, gpt2, vit, clip, ...; default: guessed from the "
                   "graph)")
    b.add_argument("--batch", type=_int_list, default=[1], metavar="N,N", help="batch sizes: the symbolic "
                   "batch dims, also where --shapes gives them (default 1); a fixed-batch model runs its own batch")
    add_data(b, "inputs (.npz, one array per input); the batch axis is repeated/sliced to each batch. Default: "
             "generated (seeded) inputs")
    add_shapes(b)
    add_seed(b)
    b.add_argument("--warmup", type=int, default=10, help="untimed runs first (default 10)")
    b.add_argument("--iterations", type=int, default=50, help="at least this many timed runs (default 50)")
    b.add_argument("--min-time", type=float, default=1.0, metavar="S",
                   help="and at least this many seconds of timed runs (default 1.0)")
    b.add_argument("--rounds", type=int, default=5, help="time the rows of a backend and batch in this "
                   "many interleaved rounds, so load changes hit them alike (default 5)")
    b.add_argument("--cudnn-conv-algo-search", choices=["EXHAUSTIVE", "HEURISTIC", "DEFAULT"],
                   default="EXHAUSTIVE", help="ORT CUDA's cuDNN conv algorithm search (default EXHAUSTIVE)")
    add_timing_cache(b, "TensorRT timing cache to read and update")
    add_workspace(b, "TensorRT builder workspace limit")
    add_max_error(b, "in tolerance: per output max|a-b|/max|ref| <= max(E, K x the TF32 error, K x the FP16-input "
                  "floor) (default 1e-2; the yardstick of graphmp check)", "E", type=float, default=1e-2)
    b.add_argument("--tf32-factor", type=float, default=2.0, metavar="K", help="K above (default 2)")
    add_tolerances(b, "also require |a-b| <= atol + rtol*|ref| element-wise (default: not applied)")
    b.add_argument("--oracle-max-mb", type=float, default=50.0, metavar="MB", help="run the FP16-faithful "
                   "oracle (graphmp check's emulation, on the CPU) on the mixed models when the FP32 weights are at most this (default 50; "
                   "0 = never)")
    b.add_argument("--keep", metavar="DIR", help="keep the compared models and engines in DIR")
    add_json(b, "write the results as JSON (schema: graphmp.bench docstring; 'timing' says how rows were timed)")
    b.add_argument("--plot", metavar="PNG", help="write a bar chart (needs matplotlib: pip install 'graphmp[plot]')")
    add_quiet(b, "the table and errors only: no progress or step line")



def run(args) -> int:
    from ..bench import BenchInterrupted, bench
    from ..model_io import check_writable
    outputs = []  # refused before any work when one is an input (bench's refuse_overwrites) or a device/FIFO
    for what, path, in_place_ok in (("--json", args.json, True), ("--plot", args.plot, False)):
        if path:
            check_writable(path, None, what, in_place_ok)
            outputs.append((what, path))
    try:
        res = _bench(bench, args, outputs)
    except BenchInterrupted as e:  # Ctrl-C: the finished rows are still written and shown (exit 130)
        res = e.result
    if args.json:
        res.write_json(args.json, in_place_ok=True)
    if args.plot:
        res.plot(args.plot)
    print(res.table())  # the result, also with -q (which drops the progress and step lines)
    if res.data["partial"]:
        n, kept = len(res.rows), f"; {args.json} with \"partial\": true" if args.json else ""
        print(f"graphmp: interrupted (Ctrl-C): {n} row{'' if n == 1 else 's'} had finished (the table above{kept})",
              file=sys.stderr)
        return 130
    if not any(r["status"] == "ok" for r in res.rows):
        print("graphmp: no benchmark row finished (each failed or its backend was skipped; see the table). "
              "Check --shapes / --data, or the backends' notes above.", file=sys.stderr)
        return 1
    return 0


def _bench(bench, args, outputs):
    """graphmp.bench with the command's arguments."""
    from ..progress import shows_progress
    return bench(args.model, converted=args.converted, backends=args.backends, precisions=args.precisions,
                 compare=args.compare, compare_occ=args.compare_occ, model_type=args.model_type,
                 batches=args.batch, data=args.data, shapes=args.shapes, seed=args.seed, warmup=args.warmup,
                 iterations=args.iterations, min_time=args.min_time, rounds=args.rounds,
                 cudnn_conv_algo_search=args.cudnn_conv_algo_search, timing_cache=args.timing_cache,
                 workspace_mb=args.workspace, max_error=args.max_error, tf32_factor=args.tf32_factor,
                 atol=args.atol, rtol=args.rtol, oracle_max_mb=args.oracle_max_mb,
                 keep=args.keep, command=getattr(args, "command_line", None), progress=shows_progress(),
                 outputs=outputs)

"""The `graphmp` command: a thin layer over graphmp.convert and graphmp.check."""
from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .errors import GraphmpError
from .io import write_json

EPILOG_CONVERT = """\
how precision is chosen:
  fp16   Conv, ConvTranspose, MatMul, Gemm, Einsum, RNNs (what Tensor Cores accelerate)
  fp32   Softmax, LayerNorm/GroupNorm/InstanceNorm, reductions, Exp/Log/Pow, losses, ...
  follow/clear ops (Add, Relu, Reshape, ...) take the precision of their neighbourhood,
  so Casts appear only where an FP16 region meets an FP32 one.
  A calibration run (your --calibration data, else generated inputs) keeps nodes whose
  values exceed --range-threshold in FP32; initializers beyond the FP16 range keep
  their consumers FP32. The report says why every FP32 node is FP32.

examples:
  graphmp convert model.onnx -o model.mp.onnx
  graphmp convert model.onnx -o out.onnx --report report.json --validate
  graphmp convert model.onnx -o out.onnx --calibration batch0.npz batch1.npz
  graphmp convert model.onnx -o out.onnx --fp32-nodes 'head|classifier' --fp32-ops Sigmoid
"""


def _csv(s):
    return tuple(x for x in s.split(",") if x)


def _add_convert(sub):
    c = sub.add_parser("convert", help="FP32 -> mixed precision (FP16 compute, FP32 islands)",
                       description="Rewrite an FP32 ONNX model to mixed precision by inserting Casts. "
                       "The input is never modified.", epilog=EPILOG_CONVERT,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("model", help="input FP32 .onnx model (external data is read from its folder)")
    c.add_argument("-o", "--output", help="output .onnx (default: MODEL.mp.onnx next to the input)")
    c.add_argument("--target", choices=["fp16", "bf16"], default="fp16", help="low-precision type (default fp16)")
    c.add_argument("--keep-io-types", dest="keep_io_types", action="store_true", default=True,
                   help="graph inputs/outputs keep their FP32 types (default)")
    c.add_argument("--no-keep-io-types", dest="keep_io_types", action="store_false",
                   help="float graph inputs/outputs become the low type")
    c.add_argument("--fp32-ops", type=_csv, default=(), metavar="OP,OP", help="op types to keep FP32")
    c.add_argument("--fp32-nodes", metavar="REGEX", help="keep nodes whose name matches FP32")
    c.add_argument("--fp16-nodes", metavar="REGEX", help="force matching nodes to the low type "
                   "(wins over the defaults, where the op has a low-precision form)")
    c.add_argument("--calibration", nargs="+", metavar="NPZ", help="input batches (.npz, one array per "
                   "model input) for the range check; default: generated inputs")
    c.add_argument("--no-calibration", action="store_true", help="skip the calibration run")
    c.add_argument("--range-threshold", type=float, default=512.0,
                   help="keep nodes FP32 whose |values| exceed this in calibration (default 512)")
    c.add_argument("--external-data", dest="external_data", action="store_true", default=None,
                   help="write weights to OUTPUT.data (default: when the input had external data or >1.8 GB)")
    c.add_argument("--no-external-data", dest="external_data", action="store_false")
    c.add_argument("--report", metavar="JSON", help="write the full report (every FP32 node and why) as JSON")
    c.add_argument("--validate", action="store_true", help="compare against the FP32 model FP16-faithfully "
                   "afterwards; exit 1 if the error exceeds --atol/--rtol")
    c.add_argument("--atol", type=float, default=1e-2)
    c.add_argument("--rtol", type=float, default=1e-2)
    c.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")


def _add_check(sub):
    k = sub.add_parser("check", help="accuracy of a converted model vs its FP32 source (FP16-faithful)",
                       description="Run the FP32 model (ONNX Runtime) and the converted one (an evaluator "
                       "that computes every op in its declared dtype, and ORT CUDA when a GPU is present) "
                       "on the same inputs; report max abs/rel error, argmax agreement and inf/NaN per "
                       "output. Exit 1 when the error exceeds --atol/--rtol.")
    k.add_argument("reference", help="FP32 source .onnx")
    k.add_argument("converted", help="converted .onnx")
    k.add_argument("--data", metavar="NPZ", help="inputs (.npz, one array per model input); default: generated")
    k.add_argument("--atol", type=float, default=1e-2)
    k.add_argument("--rtol", type=float, default=1e-2)
    k.add_argument("--json", metavar="PATH", help="write the result as JSON")


def _run_convert(args) -> int:
    from .convert import convert
    out = args.output or os.path.splitext(args.model)[0] + ".mp.onnx"
    cal = "off" if args.no_calibration else args.calibration
    rep = convert(args.model, out, target=args.target, keep_io_types=args.keep_io_types,
                  fp32_ops=args.fp32_ops, fp32_nodes=args.fp32_nodes, fp16_nodes=args.fp16_nodes,
                  calibration=cal, range_threshold=args.range_threshold,
                  external_data=args.external_data, validate=args.validate, atol=args.atol,
                  rtol=args.rtol, verbose=not args.quiet)
    if args.report:
        write_json(args.report, rep.to_dict())
    if not args.quiet:
        print(rep.summary())
    if args.validate and not rep.to_dict()["validation"]["passed"]:
        print(f"graphmp: validation FAILED for {out} (atol {args.atol}, rtol {args.rtol}); "
              "see the per-output errors above. Try --fp32-nodes for the offending layers "
              "or --calibration with real data.", file=sys.stderr)
        return 1
    return 0


def _run_check(args) -> int:
    from .check import check
    rep = check(args.reference, args.converted, data=args.data, atol=args.atol, rtol=args.rtol)
    if args.json:
        write_json(args.json, rep.to_dict())
    print(rep.summary())
    return 0 if rep.passed else 1


# One entry per subcommand: name -> (add its parser, run it). Each `_add_*` builds the
# subparser; each `_run_*` calls the API and returns the exit code.
COMMANDS = {
    "convert": (_add_convert, _run_convert),
    "check": (_add_check, _run_check),
}


def _parser():
    p = argparse.ArgumentParser(prog="graphmp", description="Make FP32 ONNX models fast on Tensor Cores "
                                "without losing accuracy.")
    p.add_argument("--version", action="version", version=f"graphmp {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for add, _ in COMMANDS.values():
        add(sub)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd is None:
        _parser().print_help()
        return 2
    try:
        return COMMANDS[args.cmd][1](args)
    except GraphmpError as e:
        print(f"graphmp: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("graphmp: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

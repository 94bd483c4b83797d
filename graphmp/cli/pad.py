"""`graphmp pad`: pad Conv channels and GEMM dims for Tensor Core tiles."""
from __future__ import annotations

import argparse
import sys

from .args import add_external_data, add_load_check, add_output, add_quiet, add_report, add_shapes, add_validate
from .outputs import default_output, load_check_failed, refuse_clobber, writable, write_json, write_report

EPILOG_PAD = """\
what is padded (with zero weights, so outputs are unchanged):
  Conv/ConvTranspose output channels, Gemm/MatMul N (e.g. a 50257 vocabulary -> 50264);
  the consumers' input channels / K rows follow. Padded channels flow through per-channel
  ops (BatchNorm, activations, Add/Mul, pooling, Concat, Flatten, ...) and are sliced back
  only where they would become observable (graph outputs, Reshape, Softmax, reductions).
  A first Conv on a 3-channel input gets one Pad node: to 4 channels with stride >= 2,
  else 8 (--stem off leaves it). A GEMM K fed by OneHot (depth 257 -> 264), an embedding
  Gather (table columns) or a Concat with a constant input is padded at that producer.
  Grouped convs, layers already aligned and layers where padding would cost more than
  --max-overhead stay as they are; the report says why, and which layers could only be
  aligned by a runtime Pad copy.

examples:
  # the first runs from a clone of the repository
  graphmp pad models/real/ultraface_rfb640.onnx -o /tmp/ultraface.pad.onnx --validate
  graphmp pad model.onnx -o model.pad.onnx                      # multiples of 8
  graphmp pad model.onnx -o out.onnx --multiple 64 --validate    # A100/H100 tiles, checked
  graphmp convert model.onnx -o out.onnx --pad-channels 8       # padding + mixed precision
"""


def add(sub):
    c = sub.add_parser("pad", help="pad Conv channels and GEMM dims to multiples of 8 (outputs unchanged)",
                       description="Pad channel counts and GEMM dimensions so FP16 Tensor Core kernels run "
                       "their best tiles. Precision is not changed (use convert --pad-channels for both). "
                       "The input is never modified.", epilog=EPILOG_PAD,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("model", help="input .onnx model (FP32 or already converted)")
    add_output(c, "output .onnx (default: MODEL.pad.onnx in the current directory)")
    c.add_argument("--multiple", type=int, default=8, help="pad to multiples of this (8, 16 or 64; default 8)")
    c.add_argument("--stem", choices=["auto", "off"], default="auto",
                   help="pad a first Conv's 3-channel input with one Pad node (default auto)")
    c.add_argument("--max-overhead", type=float, default=0.5, metavar="FRACTION",
                   help="leave a layer unpadded when padding would grow it by more than this (default 0.5)")
    add_external_data(c, "when the input had external data")
    add_report(c, "write the report (every padded and unaligned layer) as JSON")
    add_validate(c, "run ONNX Runtime on both models with the same inputs; exit 1 if outputs differ by more than "
                 "--atol or change shape")
    c.add_argument("--atol", type=float, default=1e-4, help="--validate: the largest absolute difference "
                   "allowed between the outputs of the two models")
    add_shapes(c)
    add_load_check(c, "padded model")
    add_quiet(c)


def run(args) -> int:
    from ..load_check import LoadCheckFailed
    from ..pad import pad
    out = args.output or default_output(args.model, ".pad.onnx")
    writable(args.report, "--report")
    refuse_clobber([("the output (-o)", out), ("--report", args.report)], [("the model", args.model)])
    try:
        rep = pad(args.model, out, multiple=args.multiple, stem=args.stem, max_overhead=args.max_overhead,
                  external_data=args.external_data, validate=args.validate, shapes=args.shapes,
                  load_check=args.load_check)
    except LoadCheckFailed as e:
        if args.report:
            write_json(args.report, e.report.to_dict())
        return load_check_failed(e, out, "Padding changes no precision: the source may fail the same way (graphmp "
                                 "check SOURCE checks it); please report the model. --no-load-check writes it anyway, "
                                 "for sessions opened with graph_optimization_level=ORT_ENABLE_EXTENDED.")
    if args.report:
        write_report(args.report, rep.to_dict(), out)
    if not args.quiet:
        print(f"{args.model} -> {out}")
        print(rep.summary())
    if args.validate:
        v = rep["validation"]
        if not v["validity"]["valid"]:
            print(f"graphmp: validation FAILED for {out}: the padded model is invalid (onnx.checker: "
                  f"{v['validity']['checker']}; ONNX Runtime: {v['validity']['ort']}). Please report this model.",
                  file=sys.stderr)
            return 1
        if not args.quiet:
            print(f"  validation on {v['inputs']}: max abs difference {v['max_abs']:.3g}, output shapes "
                  f"{'unchanged' if v['shapes_unchanged'] else 'CHANGED'}")
        if v["max_abs"] > args.atol or not v["shapes_unchanged"]:
            print(f"graphmp: validation FAILED for {out}: outputs differ by {v['max_abs']:.3g} "
                  f"(atol {args.atol}) or changed shape. Please report this model.", file=sys.stderr)
            return 1
    return 0


"""`graphmp inspect`: how much of any ONNX model runs in which precision; with two models,
the plan diff."""
from __future__ import annotations

import json
import os
import sys

from .args import add_quiet, add_shapes


def add(sub):
    k = sub.add_parser("inspect", help="precision of any ONNX model: FLOPs by precision, Casts, FP32 nodes; "
                       "with two models a plan diff",
                       description="For any ONNX model, whoever converted it: the share of Conv/ConvTranspose/"
                       "MatMul/Gemm/Einsum FLOPs in FP16, BF16, INT8 (MatMulInteger, ConvInteger, QLinear*, "
                       "QDQ) and FP32; the Casts and the bytes they move per inference; the FP32 compute nodes "
                       "by op type with, for a model graphmp converted, why each stayed FP32. With MODEL2, also "
                       "the nodes whose precision differs and both models' figures side by side. Nothing is "
                       "run: shapes come from ONNX shape inference at the declared input shapes, --shapes, "
                       "and for a dim still free the first size convert's shape finding tries for its role "
                       "(batch 1, image side 224, 16 tokens, ...; the output says which). Details: "
                       "docs/inspect.md.",
                       epilog="examples:\n  # from a clone (the second after graphmp convert wrote /tmp/resnet.mp.onnx)\n"
                       "  graphmp inspect models/tiny/resnet.onnx --shapes pixel_values:8x3x32x32\n"
                       "  graphmp inspect models/tiny/resnet.onnx /tmp/resnet.mp.onnx   # the plan diff\n")
    k.add_argument("model", help=".onnx model")
    k.add_argument("model2", nargs="?", help="a second .onnx model to compare with (e.g. the same source "
                   "converted by another tool)")
    add_shapes(k, "input shapes, trtexec syntax: x:8x3x224x224,mask:8x128 (inputs with dynamic dims; "
               "default: the declared dims, a plausible size for a free one)")
    k.add_argument("--json", action="store_true", help="print the result as JSON (schema graphmp.inspect, "
                   "version 1) instead of text")
    add_quiet(k, "print nothing but errors (the exit code says whether the models could be read)")


def run(args) -> int:
    from ..inspect import inspect
    rep = inspect(args.model, args.model2, shapes=args.shapes)
    if args.quiet:
        return 0
    try:
        print(json.dumps(rep.to_dict(), indent=1) if args.json else rep.summary(), flush=True)
    except BrokenPipeError:
        # the reader stopped early (`| head`): what it read is all it wanted; stdout goes to
        # /dev/null so the interpreter's flush at exit does not fail a second time
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0

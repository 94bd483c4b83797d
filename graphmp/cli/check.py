"""`graphmp check`: the accuracy of a converted model against its FP32 source."""
from __future__ import annotations

import sys

from .args import add_data, add_json, add_max_error, add_metric, add_quiet, add_shapes, add_tolerances
from .outputs import refuse_clobber, writable, write_json


EPILOG_CHECK = """\
exit codes: 0 every output within its budget; 1 a FAIL (invalid model, new inf/NaN, an
output over budget); 2 a usage or input error.

examples:
  # the first two run from a clone, after graphmp convert wrote /tmp/resnet.mp.onnx
  graphmp check models/tiny/resnet.onnx /tmp/resnet.mp.onnx
  graphmp check models/tiny/resnet.onnx /tmp/resnet.mp.onnx --max-error 1e-5 --json /tmp/resnet.check.json  # FAIL: exit 1
  graphmp check model.onnx model.mp.onnx --data batch0.npz batch1.npz --metric argmax
"""


def add(sub):
    k = sub.add_parser("check", help="accuracy of a converted model vs its FP32 source (FP16-faithful)",
                       description="First check that the converted model is valid (full onnx.checker, ONNX "
                       "Runtime loads it); then run the FP32 model (ONNX Runtime) and the converted one "
                       "FP16-faithfully (see --oracle; and ORT CUDA when a GPU is present) on the same inputs; "
                       "report per output the error against its budget, max abs error, argmax agreement and "
                       "inf/NaN. Exit 1 when the model is invalid or does not run, an output gains inf/NaN or "
                       "exceeds the budget, a class-score output changes more argmax decisions than 2x what TF32 "
                       "or FP16 inputs change, or (generated inputs only) an output is 'not judged': TF32 or "
                       "FP16 rounding of the inputs alone moves it by more than its own spread, so the inputs are "
                       "outside the model's range; --data with real inputs judges it.", epilog=EPILOG_CHECK)
    k.add_argument("reference", help="FP32 source .onnx")
    k.add_argument("converted", help="converted .onnx")
    add_data(k, "inputs (.npz, one array per model input; several files = several batches); default: generated",
             nargs="+")
    add_shapes(k)
    add_max_error(k, "allowed error per output (default auto: max(1e-2 for max-rel, 2 x the TF32 error, 2 x the "
                  "error of rounding only the inputs to FP16), both measured on the same inputs and printed); "
                  "E, tf32, floor[:K] as for convert --max-error", "auto[:K]|E|tf32|floor[:K]", default="auto")
    add_metric(k, "max-rel = max|a-b| / max|ref| (default), max-abs, argmax = fraction of changed classes")
    add_tolerances(k, "also require |a-b| <= atol + rtol*|ref| at every element")
    k.add_argument("--oracle", choices=["emulation", "reference"], default="emulation",
                   help="who computes the converted model FP16-faithfully (FP16 storage, each op's result rounded "
                   "once to FP16, as an ideal kernel stores it): emulation = FP32 math on ONNX Runtime (as Tensor "
                   "Cores; fast; the measure of --max-error; default), reference = float64 math in onnx.reference "
                   "(the ideal kernel exactly; slow on big inputs; where it cannot run the model, the emulation "
                   "judges and the report says so)")
    add_json(k, "write the result as JSON")
    add_quiet(k, "print nothing but errors; a FAIL prints its verdict line (the exit code says it too)")


def run(args) -> int:
    from ..check import check
    writable(args.json, "--json")
    refuse_clobber([("--json", args.json)], [("the reference model", args.reference),
                                             ("the converted model", args.converted)], [("--data", args.data)])
    rep = check(args.reference, args.converted, data=args.data, shapes=args.shapes, atol=args.atol, rtol=args.rtol,
                max_error=args.max_error, metric=args.metric, oracle=args.oracle)
    if args.json:
        write_json(args.json, rep.to_dict())
    if not args.quiet:
        print(rep.summary())
    elif not rep.passed:  # -q: the verdict alone, where it fails
        print(rep.summary().splitlines()[0], file=sys.stderr)
    return 0 if rep.passed else 1

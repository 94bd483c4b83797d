"""`graphmp convert`: FP32 -> mixed precision."""
from __future__ import annotations

import argparse
import sys

from ..errors import GraphmpError
from .args import (add_calibration, add_external_data, add_load_check, add_max_error, add_metric, add_model_type,
                   add_output, add_quiet, add_report, add_shapes, add_tolerances, add_validate)
from .outputs import default_output, load_check_failed, refuse_clobber, writable, write_json, write_report

# after a failed load check whose model loads with ORT_ENABLE_EXTENDED (an optimizer of ORT_ENABLE_ALL breaks on it)
LOAD_CHECK_FIX = ("Fix: keep the nodes around the failing pattern FP32 (--fp32-nodes REGEX, --fp32-ops OP) and convert "
                  "again, and please report the model; --no-load-check writes it anyway, for sessions opened with "
                  "graph_optimization_level=ORT_ENABLE_EXTENDED.")

EPILOG_CONVERT = """\
how precision is chosen:
  fp16   Conv, ConvTranspose, MatMul, Gemm, Einsum, RNNs (what Tensor Cores accelerate)
  fp32   Softmax, LayerNorm/GroupNorm/InstanceNorm, reductions, Exp/Log/Pow, losses, ...
  follow/clear ops (Add, Relu, Reshape, ...) take the precision of their neighbourhood,
  so Casts appear only where an FP16 region meets an FP32 one.
  Softmax/LogSoftmax between FP16 work read and write FP16 (--norm-io).
  A calibration run (your --calibration data, else generated inputs) keeps nodes whose
  values exceed --range-threshold in FP32; initializers beyond the FP16 range keep
  their consumers FP32. The report says why every FP32 node is FP32, and what the
  Casts cost per inference.

examples:
  # the first two run from a clone of the repository
  graphmp convert models/tiny/resnet.onnx -o /tmp/resnet.mp.onnx
  graphmp convert models/tiny/gpt2.onnx -o /tmp/gpt2.mp.onnx --max-error auto --validate -v
  graphmp convert model.onnx                      # writes model.mp.onnx in the current directory
  graphmp convert model.onnx -o out.onnx --report report.json --validate
  graphmp convert model.onnx -o out.onnx --calibration batch0.npz batch1.npz
  graphmp convert model.onnx -o out.onnx --fp32-nodes 'head|classifier' --fp32-ops Sigmoid
  graphmp convert det.onnx -o det.mp.onnx --calibration page1.npz page2.npz --max-error 1e-2
  graphmp convert det.onnx -o det.mp.onnx --calibration pages.npz --max-error tf32 --report r.json
  graphmp convert cls.onnx -o cls.mp.onnx --calibration imgs.npz --metric argmax --max-error 0.001
  graphmp convert det.onnx -o det.mp.onnx --calibration pages.npz --max-error 1e-2 --save-plan det.plan.json
  graphmp convert det_v2.onnx -o det_v2.mp.onnx --calibration pages.npz --plan det.plan.json   # no search

accuracy budget (--max-error):
  The search measures the error FP16-faithfully (FP16 storage, FP32 math, as Tensor Cores
  do) on the calibration batches, finds which regions of the model cause it, and keeps
  the cheapest set FP32 that brings every output within the budget. It starts from the
  most-FP16 plan: nodes only the range rule keeps FP32 (|x| up to 4094) start in FP16 and
  stay there where the error allows ("given back"); wider ones start FP32 and go to FP16
  only where the measured error allows, also on the first batch x2 (within 1.5x the
  budget: a node that overflows FP16 there stays FP32). With two batches or more the last one is held
  back, with a perturbed copy of the first (shifted one step, x1.01); where the plan errs
  more there than on the batches it was chosen on (the margin), it is chosen again on
  every batch within 1.5 / margin x the budget, so that unseen inputs stay within 1.5x
  the budget. A progress line every 2 s (on a terminal, or with -v); --search-time S stops with the best plan so far (the
  plan then depends on the machine). The measured islands then run on the search's plan,
  kept only where every output stays within 2/3 of the budget. The
  report lists every node the search kept FP32, the error it removed and its share of
  the compute, and the error per batch.

plans you keep (--save-plan, --plan):
  --save-plan writes the precision chosen for every float node (FP16/BF16 or FP32, and
  why), the budget and the errors measured. --plan applies it to the same network again
  (new weights, a re-export that renamed nodes) in about the time of a plain conversion:
  nodes are matched by name, then by op type and position in the graph; the static rules
  that make FP16 impossible still win; the output is checked FP16-faithfully on the
  calibration batches against the plan's budget (--max-error, if given, replaces it).
  The report names every node the plan missed and every entry that matched nothing.
"""


def _csv(s):
    return tuple(x for x in s.split(",") if x)


def add(sub):
    c = sub.add_parser("convert", help="FP32 -> mixed precision (FP16 compute, FP32 islands)",
                       description="Rewrite an FP32 ONNX model to mixed precision by inserting Casts. "
                       "The input is never modified.", epilog=EPILOG_CONVERT,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("model", help="input FP32 .onnx model (external data is read from its folder)")
    add_output(c, "output .onnx (default: MODEL.mp.onnx in the current directory, MODEL being the input's file "
               "name without .onnx; refused when that file exists)")
    c.add_argument("--target", choices=["fp16", "bf16"], default="fp16", help="low-precision type (default fp16)")
    c.add_argument("--keep-io-types", dest="keep_io_types", action="store_true", default=True,
                   help="graph inputs/outputs keep their FP32 types (default)")
    c.add_argument("--no-keep-io-types", dest="keep_io_types", action="store_false",
                   help="float graph inputs/outputs become the low type")
    c.add_argument("--cache-io", choices=("fp32", "fp16", "bf16"), default=None,
                   help="a decoder's KV cache (past inputs appended to and returned as present outputs, found by "
                        "structure): fp32 declares them FP32 with the Casts inside; the target type (fp16 with "
                        "--target fp16) declares them in it, half the bytes the caller keeps and moves per step. "
                        "Default: as the other inputs/outputs (--keep-io-types: fp32)")
    c.add_argument("--fp32-ops", type=_csv, default=(), metavar="OP,OP", help="op types to keep FP32")
    c.add_argument("--fp32-nodes", metavar="REGEX", help="keep nodes whose name matches FP32")
    c.add_argument("--fp16-nodes", metavar="REGEX", help="force matching nodes to the low type "
                   "(wins over the defaults, where the op has a low-precision form)")
    add_calibration(c, "input batches (.npz, one array per model input) for the range check; default: "
                    "generated inputs")
    c.add_argument("--no-calibration", action="store_true", help="skip the calibration run (no range check)")
    add_shapes(c)
    c.add_argument("--range-threshold", type=float, default=None, metavar="T",
                   help="keep nodes FP32 whose |values| exceed T in calibration (default: 512 on the way into a "
                        "subtraction or normalisation, where rounding cancels; 4094 elsewhere, 16x below FP16's max)")
    c.add_argument("--norm-io", choices=("softmax", "all", "fp32"), default="softmax",
                   help="FP32-class ops that read and write FP16 where they sit between FP16 work (their kernels "
                        "accumulate in FP32): softmax (default) Softmax/LogSoftmax; all: LayerNormalization too "
                        "(fewer Casts, a post-LN encoder's residual stream in FP16); fp32: none")
    c.add_argument("--island-trials", type=int, default=None, metavar="N",
                   help="measure up to N FP32 islands (or groups of them, or FP16 segments between FP32 work) whose "
                        "Casts move the most bytes: an island goes FP16, a segment FP32, only where no output's error "
                        "on the calibration batches exceeds its error in the plan without trials (with --max-error: "
                        "stays within 2/3 of the budget, after the search). Default: 8 for a model whose weights are at most "
                        "256 MB, else 0, as each trial runs an emulated copy of the model, and fewer where 8 would be "
                        "more than 1e12 FLOP-equivalents of emulated runs: a budget in work, so the plan is the same "
                        "on any machine; 0: off; refused with --plan)")
    _add_budget(c)
    add_external_data(c, "when the input had external data or >1.8 GB")
    add_report(c, "write the full report (every FP32 node and why) as JSON")
    _add_plans(c)
    add_validate(c, "afterwards check the output (graphmp check): valid, and every output within --max-error "
                 "(default: the yardstick of graphmp check, max(1e-2, 2 x the TF32 error, 2 x the FP16-input "
                 "floor)) FP16-faithfully; exit 1 if not")
    add_tolerances(c, "--validate: also require |a-b| <= atol + rtol*|ref| everywhere")
    c.add_argument("--pad-channels", type=int, metavar="N", help="also pad Conv channels and GEMM dims to "
                   "multiples of N first (see `graphmp pad --help`)")
    _add_fuse(c)
    add_load_check(c, "converted model")
    add_quiet(c)


def _add_budget(c):
    """--max-error, --metric, --strict, --search-time: the accuracy budget and its search."""
    add_max_error(c, "accuracy budget: after the static rules, keep the fewest nodes FP32 that bring the error "
                  "of every output on the calibration batches within E (measured FP16-faithfully); tf32: within the "
                  "error TF32 Conv/MatMul already have; floor:K: within K x the error of rounding only the inputs "
                  "to FP16 (default K=2); auto: graphmp check's yardstick, max(1e-2, 2 x the TF32 error, 2 x the FP16-input "
                  "floor). Default: no budget (the static rules alone)", "auto[:K]|E|tf32|floor[:K]")
    add_metric(c, "error for --max-error: max-rel = max|a-b|/max|ref| per output (default), max-abs, or "
               "argmax = fraction of class predictions that change (class-score outputs)")
    c.add_argument("--strict", action="store_true", help="exit 1 when --max-error (or the budget of --plan) cannot "
                   "be met (default: write the best model found and warn)")
    c.add_argument("--search-time", type=float, metavar="S", help="stop the --max-error search after about S "
                   "seconds and write the best plan found so far (the written model is then measured again), and the "
                   "island trials after S seconds. A limit in seconds makes the plan depend on the machine's speed "
                   "and load (said in the summary and the report). Default: no limit, and the same inputs and "
                   "options write the same model on any machine")


def _add_plans(c):
    """--save-plan and --plan."""
    c.add_argument("--save-plan", metavar="JSON", help="also write the plan: every float node's precision and "
                   "why, with the budget and errors measured, keyed so that --plan finds the nodes again in a "
                   "re-export of the same network")
    c.add_argument("--plan", metavar="JSON", help="apply a plan saved by --save-plan instead of searching: its "
                   "precisions replace the static rules' and the search's, except where FP16 is impossible (no FP16 "
                   "form, integer-derived values, weights beyond FP16, --fp32-nodes); the output is then verified "
                   "against the plan's budget (or --max-error's) on the calibration batches")


def _add_fuse(c):
    """--fuse ort and --model-type."""
    c.add_argument("--fuse", metavar="ort", help="first fuse with ONNX Runtime's own transformer optimizer "
                   "(Attention, SkipLayerNormalization, BiasGelu, ... as com.microsoft ops: fewer, faster kernels "
                   "on ORT CUDA), then choose precisions on the fused graph. The output then runs on ONNX Runtime "
                   "ONLY: TensorRT's parser rejects com.microsoft ops, so leave --fuse out for TensorRT (the "
                   "default output is standard ONNX). Needs sympy: pip install 'graphmp[fuse]'")
    add_model_type(c, "--fuse ort: the model type of ORT's optimizer (bert, gpt2, vit, clip, t5, ...; default: "
                   "found from the graph: encoder -> bert, causal decoder -> gpt2, patch-embedding vision model -> "
                   "vit)")


def run(args) -> int:
    from ..load_check import LoadCheckFailed
    out = args.output or default_output(args.model, ".mp.onnx")
    if args.no_calibration and args.calibration:
        raise GraphmpError("--calibration and --no-calibration contradict each other; give one")
    writable(args.report, "--report")
    writable(args.save_plan, "--save-plan")
    refuse_clobber([("the output (-o)", out), ("--report", args.report), ("--save-plan", args.save_plan)],
                   [("the model", args.model)], [("a --calibration file", args.calibration),
                                                 ("the --plan file", args.plan)])
    cal = "off" if args.no_calibration else args.calibration
    try:
        rep = _convert(args, out, cal)
    except LoadCheckFailed as e:
        _print_report(args, e.report, None)
        return load_check_failed(e, out, LOAD_CHECK_FIX)
    _print_report(args, rep, out)
    return _verdict(args, out, rep.to_dict())


def _print_report(args, rep, written: str | None) -> None:
    """--report (written: the output the report follows, None when none was written) and the summary."""
    if args.report:
        if written is None:
            write_json(args.report, rep.to_dict())
        else:
            write_report(args.report, rep.to_dict(), written)
    if not args.quiet:
        print(rep.summary())


def _convert(args, out: str, cal):
    from ..convert import convert
    return convert(args.model, out, target=args.target, keep_io_types=args.keep_io_types, cache_io=args.cache_io,
                   fp32_ops=args.fp32_ops, fp32_nodes=args.fp32_nodes, fp16_nodes=args.fp16_nodes,
                   calibration=cal, shapes=args.shapes, range_threshold=args.range_threshold, norm_io=args.norm_io,
                   island_trials=args.island_trials, max_error=args.max_error, metric=args.metric, strict=args.strict,
                   search_time=args.search_time, external_data=args.external_data, validate=args.validate,
                   atol=args.atol, rtol=args.rtol, verbose=args.verbose, pad_channels=args.pad_channels,
                   fuse=args.fuse, model_type=args.model_type, plan=args.plan, save_plan=args.save_plan,
                   load_check=args.load_check)


def _verdict(args, out: str, d: dict) -> int:
    """The exit code of a finished conversion: --strict's budget, --validate's result."""
    if args.strict and d.get("search", {}).get("reached") is False:
        print(f"graphmp: --max-error {args.max_error} not met (best: {d['search']['error']:.3g} x the budget); "
              f"{out} holds the best plan found", file=sys.stderr)
        return 1
    if args.strict and d.get("plan", {}).get("met") is False:
        print(f"graphmp: the budget of --plan {args.plan} is not met (error {d['plan']['verified']['normalized']:.3g} "
              f"x the budget); {out} holds the plan's model", file=sys.stderr)
        return 1
    if args.validate and "validation" not in d:
        print(f"graphmp: --validate skipped: {d.get('validation_skipped', 'nothing was converted')}", file=sys.stderr)
        return 0
    if args.validate and not d["validation"]["passed"]:
        v = d["validation"]
        print(f"graphmp: validation FAILED for {out}: {_failed_outputs(v)}. {_advice(v)} {_left_on_disk(args, out)}",
              file=sys.stderr)
        return 1
    return 0


def _left_on_disk(args, out: str) -> str:
    """What a conversion whose validation failed leaves behind (it is written before the
    check runs, so that the check, and the user, can read it)."""
    kept = [f"--report {args.report}"] if args.report else []
    kept += [f"--save-plan {args.save_plan}"] if args.save_plan else []
    return (f"Left on disk: {out}, as converted" + (f" (and {', '.join(kept)})" if kept else "")
            + "; delete it, or convert again as this line advises.")


def _advice(v: dict) -> str:
    """What to do about a failed validation, fitted to what failed: a model that is invalid
    or does not run is not an accuracy problem; outputs the generated inputs cannot judge
    need real inputs; accuracy failures need a budget or real ranges."""
    if v.get("not_run"):
        return "Nothing was compared (no --max-error or --calibration changes that reason)."
    if v.get("crash") or not v["validity"]["valid"]:
        from ..verdict import hints
        return (hints(v)[0] + "." if v.get("crash") else "The converted model is invalid: that is not an accuracy "
                "problem (no --max-error or --calibration changes it); the checker's or ONNX Runtime's message is "
                "the cause.")
    failing = [o for o in v["outputs"].values() if not o["passed"]]
    if all(o.get("not_judged") for o in failing):
        return ("Generated inputs cannot judge these outputs: --calibration with real inputs (.npz, one array per "
                "input) calibrates and validates on the range the model will see.")
    if all(o.get("decisions") and o["decisions"].get("allowed_changed") is not None and not o["nonfinite"]
           and (o.get("allowed") is None or o["error"] <= o["allowed"]) for o in failing):
        return "Convert again with --metric argmax --max-error auto: it keeps FP32 the nodes that change them."
    return ("--max-error makes the conversion meet a budget; --calibration with real data finds the ranges your "
            "inputs reach.")


def _failed_outputs(v: dict) -> str:
    """What failed in a validation, in words (so -q, which prints no report, still says it)."""
    if v.get("not_run"):
        return f"the check did not run ({v['not_run']})"
    if v.get("crash"):
        return f"the converted model does not run ({v['crash']})"
    if not v["validity"]["valid"]:
        return f"the model is invalid (onnx.checker: {v['validity']['checker']}; ONNX Runtime: {v['validity']['ort']})"
    bad = []
    for name, o in v["outputs"].items():
        if o["passed"]:
            continue
        if o.get("not_judged"):
            bad.append(f"'{name}' not judged: {o['not_judged']}")
        elif o.get("nonfinite"):
            bad.append(f"'{name}' gains {o['nonfinite']} inf/NaN")
        elif o.get("error") is not None and o.get("allowed") is not None and o["error"] > o["allowed"]:
            bad.append(f"'{name}' {v['metric']} {o['error']:.3g} > allowed {o['allowed']:.3g}")
        elif o.get("decisions") and o["decisions"]["changed"]:
            dec = o["decisions"]
            bad.append(f"'{name}' changes {dec['changed']} of {dec['rows']} class decisions (at most "
                       f"{dec['allowed_changed'] * dec['rows']:.3g} allowed)")
        else:
            bad.append(f"'{name}' outside --atol/--rtol somewhere")
    return "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more outputs" if len(bad) > 4 else "")

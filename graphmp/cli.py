"""The `graphmp` command: a thin layer over graphmp.convert and graphmp.check."""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading

from .version import __version__
from .errors import GraphmpError


# graphmp.io imports onnx and numpy (0.3 s): `graphmp --help` and usage errors need neither
def write_json(path, data):
    """A user-named JSON output (--report, --json): atomic, or written in place into a
    FIFO or character device (--report /dev/stdout)."""
    from .save import write_json as write
    return write(path, data, in_place_ok=True)


def refuse_clobber(outputs, models=(), files=()):
    """One line before any work when an output (label, path) is one of the input files:
    each model in `models` (label, path) with the data files it references, and `files`
    (label, path or list of paths: calibration, data)."""
    from .io import model_inputs
    from .paths import refuse_clobber as refuse
    inputs = []
    for what, path in models:
        if path is not None:
            inputs += model_inputs(what, path)
    for what, paths in files:
        if paths is not None and not isinstance(paths, (list, tuple)):
            paths = [paths]
        inputs += [(what, p) for p in paths or () if p not in ("auto", "off")]
    refuse(outputs, inputs)

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
  stay there where the error allows ("given back"). With two batches or more the last
  one is held back; the plan must also hold on a perturbed copy of the first (shifted one
  step, x1.01). Progress every 2 s; --search-time S stops with the best plan so far. The
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


SHAPES_HELP = ("input shapes for generated inputs, trtexec syntax: x:1x3x640x640,mask:1x640 (only inputs with "
               "dynamic dims need one). Default: graphmp tries plausible sizes and uses the first that runs")


def _add_shapes(p):
    p.add_argument("--shapes", metavar="NAME:DIMS,...", help=SHAPES_HELP)


def _add_quiet(p, text: str = "print nothing but errors"):
    p.add_argument("-q", "--quiet", action="store_true", help=text)


def _writable(path, what):
    """Fail before long work when a user-named text output cannot be written (nothing is
    written); a FIFO or character device is written in place."""
    if path:
        from .io import check_writable as check
        check(path, None, what, in_place_ok=True)


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
    c.add_argument("--no-calibration", action="store_true", help="skip the calibration run (no range check)")
    _add_shapes(c)
    c.add_argument("--range-threshold", type=float, default=512.0,
                   help="keep nodes FP32 whose |values| exceed this in calibration (default 512)")
    c.add_argument("--max-error", metavar="E|tf32|floor[:K]",
                   help="accuracy budget: after the static rules, keep the fewest nodes FP32 that bring the error "
                   "of every output on the calibration batches within E (measured FP16-faithfully); tf32: within the "
                   "error TF32 Conv/MatMul already have; floor:K: within K x the error of rounding only the inputs "
                   "to FP16 (default K=2)")
    c.add_argument("--metric", choices=["max-rel", "max-abs", "argmax"], default="max-rel",
                   help="error for --max-error: max-rel = max|a-b|/max|ref| per output (default), max-abs, or "
                   "argmax = fraction of class predictions that change (class-score outputs)")
    c.add_argument("--strict", action="store_true", help="exit 1 when --max-error (or the budget of --plan) cannot "
                   "be met (default: write the best model found and warn)")
    c.add_argument("--search-time", type=float, metavar="S", help="--max-error: stop the search after about S "
                   "seconds and write the best plan found so far (said in the summary and the report; the written "
                   "model is then measured again). Default: no limit; the search prints its progress")
    c.add_argument("--external-data", dest="external_data", action="store_true", default=None,
                   help="write weights to OUTPUT.data (OUTPUT.1.data while an existing OUTPUT.data is still in use: "
                   "the pair is replaced atomically; default: when the input had external data or >1.8 GB)")
    c.add_argument("--no-external-data", dest="external_data", action="store_false")
    c.add_argument("--report", metavar="JSON", help="write the full report (every FP32 node and why) as JSON")
    c.add_argument("--save-plan", metavar="JSON", help="also write the plan: every float node's precision and "
                   "why, with the budget and errors measured, keyed so that --plan finds the nodes again in a "
                   "re-export of the same network")
    c.add_argument("--plan", metavar="JSON", help="apply a plan saved by --save-plan instead of searching: its "
                   "precisions replace the static rules' and the search's, except where FP16 is impossible (no FP16 "
                   "form, integer-derived values, weights beyond FP16, --fp32-nodes); the output is then verified "
                   "against the plan's budget (or --max-error's) on the calibration batches")
    c.add_argument("--validate", action="store_true", help="afterwards check the output (graphmp check): valid, "
                   "and every output within --max-error (default: the yardstick of graphmp check, max(1e-2, 2 x the "
                   "TF32 error, 2 x the FP16-input floor)) FP16-faithfully; exit 1 if not")
    c.add_argument("--atol", type=float, help="--validate: also require |a-b| <= atol + rtol*|ref| everywhere")
    c.add_argument("--rtol", type=float, help="see --atol")
    c.add_argument("--pad-channels", type=int, metavar="N", help="also pad Conv channels and GEMM dims to "
                   "multiples of N first (see `graphmp pad --help`)")
    c.add_argument("--fuse", metavar="ort", help="first fuse with ONNX Runtime's own transformer optimizer "
                   "(Attention, SkipLayerNormalization, BiasGelu, ... as com.microsoft ops: fewer, faster kernels "
                   "on ORT CUDA), then choose precisions on the fused graph. The output then runs on ONNX Runtime "
                   "ONLY: TensorRT's parser rejects com.microsoft ops, so leave --fuse out for TensorRT (the "
                   "default output is standard ONNX). Needs sympy: pip install 'graphmp[fuse]'")
    c.add_argument("--model-type", metavar="TYPE", help="--fuse ort: the model type of ORT's optimizer (bert, "
                   "gpt2, vit, clip, t5, ...; default: found from the graph: encoder -> bert, causal decoder -> "
                   "gpt2, patch-embedding vision model -> vit)")
    _add_quiet(c)


def _add_check(sub):
    k = sub.add_parser("check", help="accuracy of a converted model vs its FP32 source (FP16-faithful)",
                       description="First check that the converted model is valid (full onnx.checker, ONNX "
                       "Runtime loads it); then run the FP32 model (ONNX Runtime) and the converted one "
                       "FP16-faithfully (see --oracle; and ORT CUDA when a GPU is present) on the same inputs; "
                       "report per output the error against its budget, max abs error, argmax agreement and "
                       "inf/NaN. Exit 1 when the model is invalid, an output gains inf/NaN or exceeds the budget.")
    k.add_argument("reference", help="FP32 source .onnx")
    k.add_argument("converted", help="converted .onnx")
    k.add_argument("--data", metavar="NPZ", nargs="+", help="inputs (.npz, one array per model input; several "
                   "files = several batches); default: generated")
    _add_shapes(k)
    k.add_argument("--max-error", default="auto", metavar="auto[:K]|E|tf32|floor[:K]",
                   help="allowed error per output (default auto: max(1e-2 for max-rel, 2 x the TF32 error, 2 x the "
                   "error of rounding only the inputs to FP16), both measured on the same inputs and printed); "
                   "E, tf32, floor[:K] as for convert --max-error")
    k.add_argument("--metric", choices=["max-rel", "max-abs", "argmax"], default="max-rel",
                   help="max-rel = max|a-b| / max|ref| (default), max-abs, argmax = fraction of changed classes")
    k.add_argument("--atol", type=float, help="also require |a-b| <= atol + rtol*|ref| at every element")
    k.add_argument("--rtol", type=float, help="see --atol")
    k.add_argument("--oracle", choices=["emulation", "reference"], default="emulation",
                   help="who computes the converted model FP16-faithfully (FP16 storage, each op's result rounded "
                   "once to FP16, as an ideal kernel stores it): emulation = FP32 math on ONNX Runtime (as Tensor "
                   "Cores; fast; the measure of --max-error; default), reference = float64 math in onnx.reference "
                   "(the ideal kernel exactly; slow on big inputs; where it cannot run the model, the emulation "
                   "judges and the report says so)")
    k.add_argument("--json", metavar="PATH", help="write the result as JSON")
    _add_quiet(k, "print nothing but errors; a FAIL prints its verdict line (the exit code says it too)")


def _run_convert(args) -> int:
    from .convert import convert
    out = args.output or os.path.splitext(args.model)[0] + ".mp.onnx"
    if args.no_calibration and args.calibration:
        raise GraphmpError("--calibration and --no-calibration contradict each other; give one")
    _writable(args.report, "--report")
    _writable(args.save_plan, "--save-plan")
    refuse_clobber([("the output (-o)", out), ("--report", args.report), ("--save-plan", args.save_plan)],
                   [("the model", args.model)], [("a --calibration file", args.calibration),
                                                 ("the --plan file", args.plan)])
    cal = "off" if args.no_calibration else args.calibration
    rep = convert(args.model, out, target=args.target, keep_io_types=args.keep_io_types,
                  fp32_ops=args.fp32_ops, fp32_nodes=args.fp32_nodes, fp16_nodes=args.fp16_nodes,
                  calibration=cal, shapes=args.shapes, range_threshold=args.range_threshold,
                  max_error=args.max_error, metric=args.metric, strict=args.strict, search_time=args.search_time,
                  external_data=args.external_data, validate=args.validate, atol=args.atol,
                  rtol=args.rtol, verbose=not args.quiet, pad_channels=args.pad_channels,
                  fuse=args.fuse, model_type=args.model_type, plan=args.plan, save_plan=args.save_plan)
    if args.report:
        write_json(args.report, rep.to_dict())
    if not args.quiet:
        print(rep.summary())
    d = rep.to_dict()
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
        print(f"graphmp: validation FAILED for {out}: {_failed_outputs(d['validation'])}. --max-error makes the "
              "conversion meet a budget; --calibration with real data finds the ranges your inputs reach.",
              file=sys.stderr)
        return 1
    return 0


def _failed_outputs(v: dict) -> str:
    """What failed in a validation, in words (so -q, which prints no report, still says it)."""
    if not v["validity"]["valid"]:
        return f"the model is invalid (onnx.checker: {v['validity']['checker']}; ONNX Runtime: {v['validity']['ort']})"
    bad = []
    for name, o in v["outputs"].items():
        if o["passed"]:
            continue
        if o.get("nonfinite"):
            bad.append(f"'{name}' gains {o['nonfinite']} inf/NaN")
        elif o.get("error") is not None and o.get("allowed") is not None and o["error"] > o["allowed"]:
            bad.append(f"'{name}' {v['metric']} {o['error']:.3g} > allowed {o['allowed']:.3g}")
        else:
            bad.append(f"'{name}' outside --atol/--rtol somewhere")
    return "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more outputs" if len(bad) > 4 else "")


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
  graphmp pad model.onnx -o model.pad.onnx                      # multiples of 8
  graphmp pad model.onnx -o out.onnx --multiple 64 --validate    # A100/H100 tiles, checked
  graphmp convert model.onnx -o out.onnx --pad-channels 8       # padding + mixed precision
"""


def _add_pad(sub):
    c = sub.add_parser("pad", help="pad Conv channels and GEMM dims to multiples of 8 (outputs unchanged)",
                       description="Pad channel counts and GEMM dimensions so FP16 Tensor Core kernels run "
                       "their best tiles. Precision is not changed (use convert --pad-channels for both). "
                       "The input is never modified.", epilog=EPILOG_PAD,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("model", help="input .onnx model (FP32 or already converted)")
    c.add_argument("-o", "--output", help="output .onnx (default: MODEL.pad.onnx next to the input)")
    c.add_argument("--multiple", type=int, default=8, help="pad to multiples of this (8, 16 or 64; default 8)")
    c.add_argument("--stem", choices=["auto", "off"], default="auto",
                   help="pad a first Conv's 3-channel input with one Pad node (default auto)")
    c.add_argument("--max-overhead", type=float, default=0.5, metavar="FRACTION",
                   help="leave a layer unpadded when padding would grow it by more than this (default 0.5)")
    c.add_argument("--external-data", dest="external_data", action="store_true", default=None,
                   help="write weights to OUTPUT.data (OUTPUT.1.data while an existing OUTPUT.data is still in use: "
                   "the pair is replaced atomically; default: when the input had external data)")
    c.add_argument("--no-external-data", dest="external_data", action="store_false")
    c.add_argument("--report", metavar="JSON", help="write the report (every padded and unaligned layer) as JSON")
    c.add_argument("--validate", action="store_true", help="run ONNX Runtime on both models with the same "
                   "inputs; exit 1 if outputs differ by more than --atol or change shape")
    c.add_argument("--atol", type=float, default=1e-4)
    _add_shapes(c)
    _add_quiet(c)


def _run_pad(args) -> int:
    from .pad import pad
    out = args.output or os.path.splitext(args.model)[0] + ".pad.onnx"
    _writable(args.report, "--report")
    refuse_clobber([("the output (-o)", out), ("--report", args.report)], [("the model", args.model)])
    rep = pad(args.model, out, multiple=args.multiple, stem=args.stem, max_overhead=args.max_overhead,
              external_data=args.external_data, validate=args.validate, shapes=args.shapes)
    if args.report:
        write_json(args.report, rep.to_dict())
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


def _run_check(args) -> int:
    from .check import check
    _writable(args.json, "--json")
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


EPILOG_TRAIN_GRAPH = """\
what the step graph does (one ONNX Runtime run = one optimizer step):
  FP32 master weights -> (mixed) Casts to FP16 placed by `graphmp convert` -> forward in
  training mode (BatchNorm batch statistics, Dropout on) -> loss -> backward seeded with
  the loss scale S -> gradients / S in FP32 -> one all-finite check -> optional clipping
  -> optimizer update, applied only when every gradient is finite -> S halves on an
  overflow (not below --min-scale) and doubles after --growth-interval clean steps (not
  above --max-scale). A static --loss-scale never changes. Writes OUT/step.onnx,
  OUT/state.npz (initial state), OUT/infer.onnx and OUT/train.json.

LSTM/GRU: no gradient rule; each LSTM/GRU node is unrolled into primitive ops over the
  sequence length from the model, or from --shapes where the model leaves it dynamic (e.g.
  --shapes x:1x50x40). The step graph then accepts only that sequence length (the batch may
  vary): train on data of that length, or rebuild with other --shapes. A Resize, or a
  Conv/pool with auto_pad SAME_*, over dynamic sizes is likewise built for the --shapes
  sizes (their gradients need the lengths). Tensor ranks that onnx shape inference loses
  (a Reshape to a computed shape) are measured in ONNX Runtime at the --shapes sizes (or
  sizes graphmp finds that run); the step graph keeps the free dims free.

examples:
  graphmp train-graph model.onnx -o run/ --loss cross-entropy --label-shape N --lr 1e-3
  graphmp train-graph model.onnx -o run/ --optimizer sgd --lr 0.1 --momentum 0.9 --loss-scale 1024
  graphmp train-graph model.onnx -o run/ --loss mse --precision fp32 --trainable 'head\\.'
  graphmp train-graph lm.onnx -o run/ --class-axis -1 --ignore-index -100 --label-smoothing 0.1 \\
      --lr-schedule cosine --warmup-steps 100 --total-steps 5000 --grad-accum 4
  graphmp train-graph model.onnx -o run/ --force    # replace the run in run/ (its checkpoints are deleted)

export for training: torch's dynamo exporter in eval mode folds BatchNorm into Conv and drops
Dropout; train-graph warns when a CNN looks like that. Keep the module's parameters with
torch.onnx.export(..., dynamo=False, do_constant_folding=False,
training=torch.onnx.TrainingMode.TRAINING).
"""

EPILOG_TRAIN = """\
data: an .npz with one array per model input (named as the input) plus `labels`
(class indices for cross-entropy, targets for mse); first axis = samples. Each epoch
shuffles (numpy default_rng(seed + epoch)) and drops the last partial batch.
An input with no batch axis (a scalar, or an RNN's initial state [layers, 1, hidden] beside
a batch-first input) is given whole: one array of exactly its shape, fed with every batch
(zeros for an initial state), or one per sample stacked on a new first axis (then
--batch-size 1). Labels for an output with no batch axis are one per sample, likewise.
Checked before the first step (train and --eval data): cross-entropy labels must lie in
[0, classes) or equal the run's ignore index; NaN/inf in a float array is an error naming
the array, the count and the first sample (--skip-bad-samples drops those samples instead).
A checkpoint (RUN/ckpt-*.npz + RUN/checkpoint.json) is written every --checkpoint-every
steps and at the end; rerunning the same command resumes from it (--no-resume starts over).
Output: eval loss/accuracy after every epoch (with --eval), RUN/summary.json (eval per
epoch in "eval_per_epoch", the providers that ran in "providers") and RUN/loss.png (train
loss per step, eval loss per epoch, the whole run). When (nearly) every step is skipped
for inf/NaN gradients, the progress output and summary say why and what to do; exit 1
when no step of the call was applied (nothing was trained), else 0.

examples:
  graphmp train run/ --data train.npz --epochs 3 --eval eval.npz
  graphmp train run/ --data train.npz --batch-size 64 --checkpoint-every 500 --device cuda
"""


def _shape(s):
    return [int(d) if d.strip().isdigit() else d.strip() for d in s.split(",") if d.strip()]


def _add_train_graph(sub):
    t = sub.add_parser("train-graph", help="build a loss-scaled mixed-precision training step graph",
                       description="Build the training step of an FP32 ONNX model as a graph of standard ONNX "
                       "ops that ONNX Runtime (CPU, CUDA) runs as an ordinary session. The model is not modified.",
                       epilog=EPILOG_TRAIN_GRAPH, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("model", help="FP32 .onnx model to train")
    t.add_argument("-o", "--output", required=True, metavar="RUN_DIR", help="run folder to write (created; a "
                   "non-empty folder is refused unless --force)")
    _add_quiet(t)
    t.add_argument("--force", action="store_true", help="replace the run in a non-empty RUN_DIR: its train.json, "
                   "checkpoints, summary and loss curve are deleted first, so old and new never mix")
    t.add_argument("--loss", choices=["cross-entropy", "mse"], default="cross-entropy",
                   help="cross-entropy: integer class labels (torch's F.cross_entropy); mse: mean squared error")
    t.add_argument("--class-axis", type=int, default=1, metavar="AXIS", help="cross-entropy: the output axis "
                   "holding the classes (default 1 for [N,C,...]; -1 for a language model's [N,T,V] logits, "
                   "whose labels are then [N,T])")
    t.add_argument("--ignore-index", type=int, metavar="LABEL", help="cross-entropy: positions with this label "
                   "give neither loss nor gradient; the mean is over the others (torch's convention: -100)")
    t.add_argument("--label-smoothing", type=float, default=0.0, metavar="EPS",
                   help="cross-entropy: torch's label smoothing, in [0, 1) (default 0)")
    t.add_argument("--class-weights", metavar="FILE.npy|W1,W2,...", help="cross-entropy: one weight per class "
                   "(torch's weight=: the mean is weighted by the labels' class weights)")
    t.add_argument("--label-shape", type=_shape, metavar="DIMS", help="labels shape, comma separated, names "
                   "for symbolic dims (e.g. N or N,10); default: derived from the model output")
    t.add_argument("--model-output", metavar="TENSOR", help="tensor that feeds the loss (default: the first "
                   "output; for a model ending in Softmax name the logits before it)")
    t.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    t.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3); the peak of a schedule")
    t.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default="constant",
                   help="lr over the optimizer steps, computed in the graph from the step counter (a resumed run "
                   "continues it): linear/cosine decay to 0 at --total-steps (default constant)")
    t.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                   help="linear warmup from 0 to --lr over the first N optimizer steps (default 0)")
    t.add_argument("--total-steps", type=int, metavar="N", help="optimizer steps of the whole run (linear/cosine)")
    t.add_argument("--grad-accum", type=int, default=1, metavar="N", help="sum the gradients of N consecutive "
                   "batches and update once with their mean (an effective batch N times larger; default 1)")
    t.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9; 0 = none)")
    t.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999), metavar=("B1", "B2"), help="AdamW betas")
    t.add_argument("--eps", type=float, default=1e-8, help="AdamW epsilon")
    t.add_argument("--weight-decay", type=float, default=0.0, help="AdamW: decoupled; SGD: added to the gradient")
    t.add_argument("--clip-norm", type=float, metavar="MAX", help="clip the global gradient norm (after unscaling)")
    t.add_argument("--loss-scale", default="dynamic", metavar="dynamic|S",
                   help="'dynamic' (default) or a fixed scale such as 1024")
    t.add_argument("--init-scale", type=float, default=2.0**16, help="dynamic: initial S (default 65536)")
    t.add_argument("--growth-interval", type=int, default=2000, help="dynamic: clean steps before S grows (2000)")
    t.add_argument("--backoff", type=float, default=0.5, help="dynamic: S factor on overflow (0.5)")
    t.add_argument("--growth", type=float, default=2.0, help="dynamic: S factor after growth-interval clean steps (2)")
    t.add_argument("--min-scale", type=float, default=1.0, help="dynamic: floor of S (1)")
    t.add_argument("--max-scale", type=float, default=2.0**24, help="dynamic: cap of S (2^24)")
    t.add_argument("--precision", choices=["mixed", "fp32", "bf16"], default="mixed",
                   help="mixed: FP16 compute with FP32 islands, as `graphmp convert` decides (default); bf16: "
                   "the same in BF16, no loss scaling (refused where ONNX Runtime lacks BF16 kernels, e.g. CPU)")
    t.add_argument("--trainable", metavar="REGEX", help="train only the initializers whose name matches")
    t.add_argument("--calibration", nargs="+", metavar="NPZ", help="(mixed) input batches for the convert "
                   "range check, one array per model input; default: a generated batch")
    _add_shapes(t)


def _add_train(sub):
    t = sub.add_parser("train", help="run a training step graph on ONNX Runtime (checkpoints, eval)",
                       description="Train the run folder made by `graphmp train-graph`: one step per batch, "
                       "progress line with loss / loss scale / skipped steps, checkpoints, eval, summary.",
                       epilog=EPILOG_TRAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("run_dir", help="run folder made by `graphmp train-graph`")
    t.add_argument("--data", required=True, metavar="NPZ", help="training data (see below)")
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--eval", metavar="NPZ", help="eval data, same layout; evaluated after every epoch")
    t.add_argument("--checkpoint-every", type=int, default=100, metavar="STEPS")
    t.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint and start over")
    t.add_argument("--seed", type=int, default=0, help="shuffling seed")
    t.add_argument("--max-steps", type=int, help="stop after this many steps in total")
    t.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cuda: ONNX Runtime's CUDA provider (state stays on the device); fails with a message "
                   "when onnxruntime has no CUDA provider or a session does not get it. auto (default): CUDA "
                   "when available, else the CPU, and says so. cpu: the CPU")
    t.add_argument("--skip-bad-samples", action="store_true",
                   help="drop samples holding NaN/inf (train and eval data) and say how many, instead of failing")
    _add_quiet(t, "no progress line")


def _add_export(sub):
    e = sub.add_parser("export", help="write an inference model holding the trained weights",
                       description="Write the source model with the run's latest trained weights and BatchNorm "
                       "running statistics (FP32), or converted to mixed precision with --mixed. Weights the "
                       "source model stored as Constant nodes are written back as Constant nodes.")
    e.add_argument("run_dir", help="run folder made by `graphmp train-graph` (and trained)")
    e.add_argument("-o", "--output", required=True, help="output .onnx")
    e.add_argument("--mixed", action="store_true", help="convert to mixed precision (as `graphmp convert`)")
    _add_quiet(e)


def _run_train_graph(args) -> int:
    from .train.runfiles import os_error
    from .train.step import build_step
    try:
        meta = build_step(args.model, args.output, loss=args.loss, label_shape=args.label_shape,
                          optimizer=args.optimizer, lr=args.lr, momentum=args.momentum, betas=args.betas,
                          eps=args.eps, weight_decay=args.weight_decay, clip_norm=args.clip_norm,
                          loss_scale=args.loss_scale, init_scale=args.init_scale,
                          growth_interval=args.growth_interval, backoff=args.backoff, growth=args.growth,
                          min_scale=args.min_scale, max_scale=args.max_scale, precision=args.precision,
                          output=args.model_output, trainable=args.trainable, calibration=args.calibration,
                          shapes=args.shapes, class_axis=args.class_axis, ignore_index=args.ignore_index,
                          label_smoothing=args.label_smoothing, class_weights=args.class_weights,
                          lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
                          total_steps=args.total_steps, grad_accum=args.grad_accum, force=args.force)
    except OSError as e:  # one the builder did not name (a full disk, a folder's permissions): still one line
        raise os_error(e, e.filename or args.output) from None
    if not args.quiet:
        _say_built(meta, args.output)
    return 0


def _say_built(meta: dict, output: str) -> None:
    """What train-graph built: its warnings, what it did to the model, the step's interface."""
    for w in meta["warnings"]:
        print(w, file=sys.stderr)
    lifted = [w for w in meta["weights"] if w in meta["constant_weights"]]
    if lifted:
        print(f"{len(lifted)} trainable tensors were stored as Constant nodes; they are trained as parameters "
              "(export writes them back as Constant nodes)")
    if meta["shared_weights"]:
        names = sorted(meta["shared_weights"])
        print(f"{len(names)} trainable parameters are shared by several consumers (tied, trained as one): "
              f"{names[:5]}{' ...' if len(names) > 5 else ''}")
    if meta["config"].get("pinned_shapes"):
        print(f"built for the input sizes {meta['config']['pinned_shapes']} (Resize / SAME-padding gradients need "
              "static lengths; the batch may vary): the step graph accepts only those sizes")
    for r in meta["config"].get("recurrent") or []:
        print(f"{r['op']} node '{r['node']}' unrolled over sequence length {r['sequence_length']} into "
              f"{r['nodes']} nodes: the step graph accepts only that length (rebuild with --shapes for another)")
    print(f"{output}: step graph for {len(meta['weights'])} trainable tensors "
          f"({meta['config']['precision']}, {meta['config']['optimizer']}, loss scale "
          f"{meta['config']['loss_scale']}); inputs {list(meta['inputs'])} + '{meta['label']['name']}' "
          f"{meta['label']['shape']}")


def _run_train(args) -> int:
    from .train.loop import format_summary, train
    from .train.runfiles import os_error
    try:
        res = train(args.run_dir, args.data, epochs=args.epochs, batch_size=args.batch_size, eval_data=args.eval,
                    checkpoint_every=args.checkpoint_every, resume=not args.no_resume, device=args.device,
                    progress=not args.quiet, seed=args.seed, max_steps=args.max_steps,
                    skip_bad_samples=args.skip_bad_samples)
    except OSError as e:  # one the driver did not name (a full disk, a folder's permissions): still one line
        raise os_error(e, e.filename or args.run_dir) from None
    print(format_summary(res.summary))
    steps, applied = len(res.history["applied"]), sum(bool(a) for a in res.history["applied"])
    # nothing trained: every step of this call skipped (exit 1, as a failed check, so a script
    # does not take an unchanged model for a trained one); the summary's note says why when
    # there were enough steps to tell, else this line does
    if steps and not applied:
        if not res.summary.get("skipped_note"):
            print(f"graphmp: none of this call's {steps} step{'s' if steps != 1 else ''} was applied (each skipped "
                  "for inf/NaN gradients; a dynamic loss scale backs off from its initial value over the first "
                  "steps): train more steps", file=sys.stderr)
        return 1
    return 0


def _run_export(args) -> int:
    from .train.loop import export
    from .train.runfiles import os_error
    try:
        out = export(args.run_dir, args.output, precision="mixed" if args.mixed else "fp32")
    except OSError as e:  # one the writers did not name (a full disk, a folder's permissions): still one line
        raise os_error(e, e.filename or args.output) from None
    if not args.quiet:
        print(f"{out}: inference model with the trained weights ({'mixed precision' if args.mixed else 'FP32'})")
    return 0


EPILOG_BUILD = """\
precision:
  The network is strongly typed (TensorRT 10: STRONGLY_TYPED flag; TensorRT 11: always), so
  the types and Casts in the ONNX graph ARE the engine's precision: build the output of
  `graphmp convert` for FP16 Tensor Cores. An FP32 model gives an FP32 engine, which uses
  TF32 Tensor Cores unless --no-tf32. No FP16/INT8 builder flag is set (gone in TensorRT 11).

shapes (trtexec syntax, NAME:DxDx..., several separated by commas):
  --shapes is the profile's opt shape of every input with a dynamic dim; --min-shapes and
  --max-shapes default to it (an engine for exactly that shape).

examples:
  graphmp build model.mp.onnx -o model.plan --shapes pixel_values:8x3x224x224
  graphmp build bert.mp.onnx -o bert.plan --shapes input_ids:8x128,attention_mask:8x128,token_type_ids:8x128 \\
      --min-shapes input_ids:1x128,attention_mask:1x128,token_type_ids:1x128 \\
      --max-shapes input_ids:32x128,attention_mask:32x128,token_type_ids:32x128
  graphmp build model.mp.onnx -o model.plan --shapes x:1x3x224x224 --timing-cache trt.cache
needs TensorRT 10 or 11 and an NVIDIA GPU: pip install 'graphmp[gpu]' (or pip install tensorrt).
"""

EPILOG_BENCH = """\
what one run does:
  builds the FP32 baseline (the model through graphmp's pipeline with no precision change,
  so it has the same graph cleanups as the converted model: a speedup is precision alone),
  converts with graphmp (or takes --converted), then for each backend, precision, batch and
  session-option variant: creates the session / builds the engine, checks what provider
  actually runs, warms up, times synchronized runs on the host clock (the same for every
  backend) until --iterations and --min-time are both reached, and compares the outputs
  with ONNX Runtime CPU FP32 on the same inputs.

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


def _add_build(sub):
    b = sub.add_parser("build", help="TensorRT engine from an ONNX model (its Casts set the precision)",
                       description="Build a strongly typed TensorRT engine from an ONNX model and save it. "
                       "The model is never modified.", epilog=EPILOG_BUILD,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("model", help="input .onnx (normally the output of graphmp convert); external data is read "
                   "from its folder")
    b.add_argument("-o", "--output", help="engine file (default: MODEL.plan next to the input)")
    b.add_argument("--shapes", metavar="NAME:DIMS,...", help="opt shapes of the dynamic inputs, e.g. "
                   "input:8x3x224x224")
    b.add_argument("--min-shapes", metavar="NAME:DIMS,...", help="smallest shapes (default: --shapes)")
    b.add_argument("--max-shapes", metavar="NAME:DIMS,...", help="largest shapes (default: --shapes)")
    b.add_argument("--timing-cache", metavar="FILE", help="read this timing cache if it exists and write it "
                   "back after the build (rebuilds are much faster)")
    b.add_argument("--no-tf32", action="store_true", help="strict FP32 for FP32 layers (clear BuilderFlag.TF32)")
    b.add_argument("--workspace", type=int, metavar="MB", help="limit the builder's workspace memory")
    b.add_argument("--verbose", action="store_true", help="TensorRT's verbose log")


def _run_build(args) -> int:
    from .trt import build_engine
    out = args.output or os.path.splitext(args.model)[0] + ".plan"
    res = build_engine(args.model, out, shapes=args.shapes, min_shapes=args.min_shapes, max_shapes=args.max_shapes,
                       tf32=not args.no_tf32, timing_cache=args.timing_cache, workspace_mb=args.workspace,
                       verbose=args.verbose)
    print(res.summary())
    return 0


def _add_bench(sub):
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
    b.add_argument("--model-type", metavar="TYPE", help="ort-opt: the optimizer's model type (bert, gpt2, vit, clip, ...; "
                   "default: guessed from the graph)")
    b.add_argument("--batch", type=_int_list, default=[1], metavar="N,N", help="batch sizes: the symbolic "
                   "batch dims, also where --shapes gives them (default 1); a fixed-batch model runs its own batch")
    b.add_argument("--data", metavar="NPZ", help="inputs (.npz, one array per input); the batch axis is "
                   "repeated/sliced to each batch. Default: generated (seeded) inputs")
    _add_shapes(b)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--warmup", type=int, default=10, help="untimed runs first (default 10)")
    b.add_argument("--iterations", type=int, default=50, help="at least this many timed runs (default 50)")
    b.add_argument("--min-time", type=float, default=1.0, metavar="S",
                   help="and at least this many seconds of timed runs (default 1.0)")
    b.add_argument("--rounds", type=int, default=5, help="time the rows of a backend and batch in this "
                   "many interleaved rounds, so load changes hit them alike (default 5)")
    b.add_argument("--cudnn-conv-algo-search", choices=["EXHAUSTIVE", "HEURISTIC", "DEFAULT"],
                   default="EXHAUSTIVE", help="ORT CUDA's cuDNN conv algorithm search (default EXHAUSTIVE)")
    b.add_argument("--timing-cache", metavar="FILE", help="TensorRT timing cache to read and update")
    b.add_argument("--workspace", type=int, metavar="MB", help="TensorRT builder workspace limit")
    b.add_argument("--max-error", type=float, default=1e-2, metavar="E", help="in tolerance: per output "
                   "max|a-b|/max|ref| <= max(E, K x the TF32 error, K x the FP16-input floor) (default 1e-2; the "
                   "yardstick of graphmp check)")
    b.add_argument("--tf32-factor", type=float, default=2.0, metavar="K", help="K above (default 2)")
    b.add_argument("--atol", type=float, help="also require |a-b| <= atol + rtol*|ref| element-wise (default: "
                   "not applied)")
    b.add_argument("--rtol", type=float, help="see --atol")
    b.add_argument("--oracle-max-mb", type=float, default=50.0, metavar="MB", help="run the FP16-faithful "
                   "oracle (slow, CPU) on the mixed models when the FP32 weights are at most this (default 50; "
                   "0 = never)")
    b.add_argument("--keep", metavar="DIR", help="keep the compared models and engines in DIR")
    b.add_argument("--json", metavar="PATH", help="write the results as JSON (schema: graphmp.bench docstring; "
                   "'timing' says how rows were timed)")
    b.add_argument("--plot", metavar="PNG", help="write a bar chart (needs matplotlib: pip install 'graphmp[plot]')")
    _add_quiet(b, "no progress line")


def _run_bench(args) -> int:
    from .bench import bench
    from .io import check_writable
    outputs = []  # refused before any work when one is an input (bench's refuse_overwrites) or a device/FIFO
    for what, path, in_place_ok in (("--json", args.json, True), ("--plot", args.plot, False)):
        if path:
            check_writable(path, None, what, in_place_ok)
            outputs.append((what, path))
    res = bench(args.model, converted=args.converted, backends=args.backends, precisions=args.precisions,
                compare=args.compare, compare_occ=args.compare_occ, model_type=args.model_type,
                batches=args.batch, data=args.data, shapes=args.shapes, seed=args.seed, warmup=args.warmup,
                iterations=args.iterations, min_time=args.min_time, rounds=args.rounds,
                cudnn_conv_algo_search=args.cudnn_conv_algo_search, timing_cache=args.timing_cache,
                workspace_mb=args.workspace, max_error=args.max_error, tf32_factor=args.tf32_factor,
                atol=args.atol, rtol=args.rtol, oracle_max_mb=args.oracle_max_mb,
                keep=args.keep, command=getattr(args, "command_line", None), progress=not args.quiet,
                outputs=outputs)
    if args.json:
        res.write_json(args.json, in_place_ok=True)
    if args.plot:
        res.plot(args.plot)
    print(res.table())
    if not any(r["status"] == "ok" for r in res.rows):
        print("graphmp: no benchmark row finished (each failed or its backend was skipped; see the table). "
              "Check --shapes / --data, or the backends' notes above.", file=sys.stderr)
        return 1
    return 0


# One entry per subcommand: name -> (add its parser, run it). Each `_add_*` builds the
# subparser; each `_run_*` calls the API and returns the exit code.
COMMANDS = {
    "convert": (_add_convert, _run_convert),
    "check": (_add_check, _run_check),
    "pad": (_add_pad, _run_pad),
    "train-graph": (_add_train_graph, _run_train_graph),
    "train": (_add_train, _run_train),
    "export": (_add_export, _run_export),
    "build": (_add_build, _run_build),
    "bench": (_add_bench, _run_bench),
}


def _parser():
    p = argparse.ArgumentParser(prog="graphmp", description="Make FP32 ONNX models fast on Tensor Cores "
                                "without losing accuracy.")
    p.add_argument("--version", action="version", version=f"graphmp {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for add, _ in COMMANDS.values():
        add(sub)
    return p


def _one_line(text: str) -> str:
    """An error as one printable line: names from a model (tensor, node, location) may hold
    newlines, NULs or terminal escapes, which must not forge lines or reach the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class Terminated(BaseException):
    """SIGTERM, raised where Python code runs so that temporary files are cleaned up
    (by the same `finally`/`except` paths as Ctrl-C)."""


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    args.command_line = shlex.join(["graphmp", *(sys.argv[1:] if argv is None else argv)])  # recorded by bench
    if args.cmd is None:
        _parser().print_help()
        return 2
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return COMMANDS[args.cmd][1](args)
    except GraphmpError as e:
        print(f"graphmp: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("graphmp: interrupted; nothing was written", file=sys.stderr)
        return 130
    except Terminated:
        print("graphmp: terminated; nothing was written", file=sys.stderr)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())

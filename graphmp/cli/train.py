"""`graphmp train-graph`, `train` and `export`: build a mixed-precision training step graph,
run it on ONNX Runtime, write the trained inference model."""
from __future__ import annotations

import argparse
import sys

from .args import add_calibration, add_data, add_output, add_quiet, add_seed, add_shapes

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
  graphmp train-graph models/real/mnist_cntk.onnx -o /tmp/mnist-run --force   # from a clone
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
A fully static model (every input's first axis fixed, a streaming model's frame and
caches): every input stacked one per sample, or a cache given once at exactly its shape.
Checked before the first step (train and --eval data): cross-entropy labels must lie in
[0, classes) or equal the run's ignore index; NaN/inf in a float array is an error naming
the array, the count and the first sample (--skip-bad-samples drops those samples instead).
A checkpoint (RUN/ckpt-*.npz + RUN/checkpoint.json) is written every --checkpoint-every
steps and at the end; rerunning the same command resumes from it (--no-resume starts over).
Output: eval loss/accuracy after every epoch (with --eval), RUN/summary.json (eval per
epoch in "eval_per_epoch", the providers that ran in "providers") and RUN/loss.png (train
loss per step, eval loss per epoch, the whole run; without matplotlib the numbers as
RUN/loss.csv). When (nearly) every step is skipped for inf/NaN gradients, the progress
output and summary say why and what to do; exit 1 when no step of the call was applied
(nothing was trained), else 0.

examples:
  # the first two from a clone, after the README's digits data is written
  graphmp train-graph models/real/mnist_cntk.onnx -o /tmp/graphmp-tour/run --force
  graphmp train /tmp/graphmp-tour/run --data /tmp/graphmp-tour/train.npz --epochs 1 --batch-size 16
  graphmp train run/ --data train.npz --epochs 3 --eval eval.npz
  graphmp train run/ --data train.npz --batch-size 64 --checkpoint-every 500 --device cuda
  graphmp train run/ --data train.npz --nproc 2 --batch-size 32 --eval eval.npz   # 2 ranks, global batch 64
"""


def _shape(s):
    return [int(d) if d.strip().isdigit() else d.strip() for d in s.split(",") if d.strip()]


def add_train_graph(sub):
    t = sub.add_parser("train-graph", help="build a loss-scaled mixed-precision training step graph",
                       description="Build the training step of an FP32 ONNX model as a graph of standard ONNX "
                       "ops that ONNX Runtime (CPU, CUDA) runs as an ordinary session. The model is not modified.",
                       epilog=EPILOG_TRAIN_GRAPH, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("model", help="FP32 .onnx model to train")
    add_output(t, "run folder to write (created; a non-empty folder is refused unless --force)", required=True,
               metavar="RUN_DIR")
    add_quiet(t)
    t.add_argument("--force", action="store_true", help="replace the run in a non-empty RUN_DIR: its train.json, "
                   "checkpoints, summary and loss curve are deleted first, so old and new never mix")
    _add_loss(t)
    _add_optimizer(t)
    _add_loss_scale(t)
    t.add_argument("--precision", choices=["mixed", "fp32", "bf16"], default="mixed",
                   help="mixed: FP16 compute with FP32 islands, as `graphmp convert` decides (default); bf16: "
                   "the same in BF16, no loss scaling (refused where ONNX Runtime lacks BF16 kernels, e.g. CPU)")
    t.add_argument("--trainable", metavar="REGEX", help="train only the initializers whose name matches")
    add_calibration(t, "(mixed) input batches for the convert range check, one array per model input; default: "
                    "a generated batch")
    add_shapes(t)


def _add_loss(t):
    """--loss and its options, --label-shape, --model-output."""
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


def _add_optimizer(t):
    """--optimizer, the learning rate schedule, accumulation, clipping."""
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


def _add_loss_scale(t):
    """--loss-scale and the dynamic scale's settings."""
    t.add_argument("--loss-scale", default="dynamic", metavar="dynamic|S",
                   help="'dynamic' (default) or a fixed scale such as 1024")
    t.add_argument("--init-scale", type=float, default=2.0**16, help="dynamic: initial S (default 65536)")
    t.add_argument("--growth-interval", type=int, default=2000, help="dynamic: clean steps before S grows (2000)")
    t.add_argument("--backoff", type=float, default=0.5, help="dynamic: S factor on overflow (0.5)")
    t.add_argument("--growth", type=float, default=2.0, help="dynamic: S factor after growth-interval clean steps (2)")
    t.add_argument("--min-scale", type=float, default=1.0, help="dynamic: floor of S (1)")
    t.add_argument("--max-scale", type=float, default=2.0**24, help="dynamic: cap of S (2^24)")


def add_train(sub):
    t = sub.add_parser("train", help="run a training step graph on ONNX Runtime (checkpoints, eval)",
                       description="Train the run folder made by `graphmp train-graph`: one step per batch, "
                       "progress line with loss / loss scale / skipped steps, checkpoints, eval, summary.",
                       epilog=EPILOG_TRAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("run_dir", help="run folder made by `graphmp train-graph`")
    add_data(t, "training data (see below)", required=True)
    t.add_argument("--epochs", type=int, default=1, help="passes over the training data")
    t.add_argument("--batch-size", type=int, default=32, help="samples per step (per rank with --nproc)")
    t.add_argument("--eval", metavar="NPZ", help="eval data, same layout; evaluated after every epoch")
    t.add_argument("--checkpoint-every", type=int, default=100, metavar="STEPS",
                   help="write a checkpoint every STEPS steps, and always at the end (0: only at the end)")
    t.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint and start over")
    add_seed(t, "shuffling seed")
    t.add_argument("--max-steps", type=int, help="stop after this many steps in total")
    t.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cuda: ONNX Runtime's CUDA provider (state stays on the device); fails with a message "
                   "when onnxruntime has no CUDA provider or a session does not get it. auto (default): CUDA "
                   "when available, else the CPU, and says so. cpu: the CPU")
    t.add_argument("--skip-bad-samples", action="store_true",
                   help="drop samples holding NaN/inf (train and eval data) and say how many, instead of failing")
    t.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads ONNX Runtime uses inside each step's ops (intra-op threads, as "
                   "torch.set_num_threads). Default (or 0): ONNX Runtime's choice, one per physical core. Give "
                   "fewer when other jobs share the cores: ONNX Runtime's idle threads spin, so two runs that "
                   "each take every core slow each other down. With --nproc each rank takes cores / N instead")
    t.add_argument("--cuda-graph", action="store_true",
                   help="CUDA only: capture the step as CUDA graphs and replay them (ONNX Runtime's enable_cuda_graph; "
                   "no per-node launch cost). Needs a step built with static shapes (train-graph --shapes) whose "
                   "every node runs on CUDA: refused in one line otherwise. Off by default")
    _add_data_parallel(t)
    add_quiet(t, "print nothing but errors (and why nothing was trained, when no step was applied)")



def _add_data_parallel(t):
    """The flags of data-parallel training (docs/train.md "Train on several GPUs or machines")."""
    d = t.add_argument_group("data parallelism (pip install 'graphmp[dist]'; docs/train.md)")
    d.add_argument("--nproc", type=int, metavar="N", help="N local ranks through torchrun's "
                   "launcher (torch.distributed: gloo on the CPU, NCCL on CUDA); --batch-size is per rank. "
                   "Under torchrun (WORLD_SIZE set) the ranks come from it instead")
    d.add_argument("--dist-summary", dest="summary_json", metavar="JSON",
                   help="rank 0 writes its summary here (steps, seconds per step: compute, "
                        "all-reduce, update)")
    d.add_argument("--dist-timeout", type=float, default=60.0, metavar="S",
                   help="a rank waits this long for the others before the job fails (60)")
    d.add_argument("--dist-backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="the all-reduce's torch.distributed backend; auto (default): nccl when "
                   "the ranks run on CUDA and torch has CUDA, else gloo")
    d.add_argument("--sync-bn", action="store_true",
                   help="average the BatchNorm running statistics over the ranks every step "
                   "(default: each rank keeps its own; rank 0's are saved)")
    d.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="with --nproc: restart the job up to K times after a rank fails; each restart resumes "
                   "from the last checkpoint (torchrun's --max-restarts)")


def add_export(sub):
    e = sub.add_parser("export", help="write an inference model holding the trained weights",
                       description="Write the source model with the run's latest trained weights and BatchNorm "
                       "running statistics (FP32), or converted to mixed precision with --mixed. Weights the "
                       "source model stored as Constant nodes are written back as Constant nodes.",
                       epilog="example (from a clone, after the train-graph and train examples of `graphmp train "
                       "--help`):\n  graphmp export /tmp/graphmp-tour/run -o /tmp/digits.mp.onnx --mixed\n")
    e.add_argument("run_dir", help="run folder made by `graphmp train-graph` (and trained)")
    add_output(e, "output .onnx", required=True)
    e.add_argument("--mixed", action="store_true", help="convert to mixed precision (as `graphmp convert`)")
    add_quiet(e)



# StepConfig / TrainConfig options that are the flag of the same name
STEP_FLAGS = ("loss", "label_shape", "optimizer", "lr", "momentum", "betas", "eps", "weight_decay", "clip_norm",
              "loss_scale", "init_scale", "growth_interval", "backoff", "growth", "min_scale", "max_scale",
              "precision", "trainable", "calibration", "shapes", "class_axis", "ignore_index", "label_smoothing",
              "class_weights", "lr_schedule", "warmup_steps", "total_steps", "grad_accum", "force")
TRAIN_FLAGS = ("epochs", "batch_size", "checkpoint_every", "device", "seed", "max_steps", "skip_bad_samples",
               "threads", "cuda_graph")


def step_config(args):
    """The StepConfig of `graphmp train-graph`'s flags, checked (errors start with the model path)."""
    from ..train.config import StepConfig
    return StepConfig.from_kwargs(args.model, output=args.model_output, **{k: getattr(args, k) for k in STEP_FLAGS})


def train_config(args):
    """The TrainConfig of `graphmp train`'s flags, checked."""
    from ..train.config import TrainConfig
    from ..progress import shows_progress
    return TrainConfig.from_kwargs(resume=not args.no_resume, progress=shows_progress(),
                                   **{k: getattr(args, k) for k in TRAIN_FLAGS})


def run_train_graph(args) -> int:
    from ..train.runfiles import os_error
    from ..train.step import build_step
    try:
        meta = build_step(args.model, args.output, step_config(args))
    except OSError as e:  # one the builder did not name (a full disk, a folder's permissions): still one line
        raise os_error(e, e.filename or args.output) from None
    if not args.quiet:
        _say_built(meta, args.output)
    return 0


def _say_built(meta: dict, output: str) -> None:
    """What train-graph built: its warnings, what it did to the model, the step's interface."""
    for w in meta["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
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
    cost = meta.get("precision_cost")
    if cost and cost["gemm_low_share"] is not None:
        print(f"at the build's batch {cost['shapes']}: {cost['gemm_low_share']:.0%} of {cost['gemm_gflop']:g} GFLOP "
              f"of Conv/MatMul/Gemm work in FP16/BF16 (forward + backward), {cost['casts']} Casts moving "
              f"{cost['cast_mb']:g} MB per step")


MAX_NPROC = 64  # local ranks: one machine's GPUs or cores; beyond, each rank starts a process for nothing


def _without_nproc(argv: list) -> list:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def run_train_parallel(args) -> int:
    """--nproc N here: start N ranks running this command; under torchrun: this rank's part."""
    import shlex
    from ..errors import GraphmpError
    from ..train.distributed import DistOptions, check_resumable, launch, train_ranks, under_torchrun
    from ..train.runfiles import started_over_note
    from ..train.runlock import launcher_lock, run_lock
    if args.threads is not None:  # the ranks split the cores themselves (distributed.py)
        raise GraphmpError("--threads is for one process; with --nproc each rank takes cores / N threads "
                           "(leave --threads out)")
    if args.cuda_graph:
        raise GraphmpError("--cuda-graph is for one process; leave it out with --nproc")
    if not under_torchrun():
        if args.nproc is None or not 1 <= args.nproc <= MAX_NPROC:
            raise GraphmpError(f"--nproc must be between 1 and {MAX_NPROC} local ranks, not {args.nproc} (more "
                               "ranks on one machine: start torchrun on several nodes)")
        if args.max_restarts < 0:
            raise GraphmpError(f"--max-restarts must be at least 0, not {args.max_restarts}")
        # before any rank starts: a run folder that cannot be resumed by this job is one line, once
        check_resumable(args.run_dir, args.nproc, args.batch_size, not args.no_resume)
        with launcher_lock(args.run_dir, "train"):  # its ranks share it
            note = started_over_note(args.run_dir, not args.no_resume)
            if note and not args.quiet:
                print(note, file=sys.stderr)
            return launch(_without_nproc(shlex.split(args.command_line)[1:]), args.nproc, args.max_restarts)
    opts = DistOptions(timeout_s=args.dist_timeout, backend=args.dist_backend, sync_bn=args.sync_bn,
                       eval_data=args.eval)
    with run_lock(args.run_dir, "train"):  # rank 0's, unless the launcher holds it
        summary = train_ranks(args.run_dir, args.data, train_config(args), opts)
    if summary is not None and args.summary_json:
        from .outputs import write_json
        write_json(args.summary_json, summary)
    if summary is not None and not args.quiet:
        if summary.get("note"):
            print(f"device: {summary['note']}")
        window = f", {summary['updates']} updates of {summary['accumulate']}" if summary["accumulate"] > 1 else ""
        print(f"{args.run_dir}: {summary['steps']} data-parallel steps on {summary['world_size']} ranks (global batch "
              f"{summary['global_batch']}{window}), {summary['skipped']} skipped; last loss {summary['last_loss']:.6g}; "
              f"{summary['seconds']:.1f} s")
        backoff = summary.get("first_step_backoff")
        if backoff:
            print(f"first step: loss scale backed off {backoff['from_scale']:g} -> {backoff['to_scale']:g} on the "
                  f"first window ({backoff['tries']} retried step(s), not counted as skipped)")
    return 0


def run_train(args) -> int:
    from ..train.distributed import under_torchrun
    from ..train.loop import format_summary, train
    from ..train.runfiles import os_error
    from ..train.runlock import run_lock
    if args.nproc is not None or under_torchrun():
        return run_train_parallel(args)
    try:
        with run_lock(args.run_dir, "train"):  # one process per run folder
            res = train(args.run_dir, args.data, train_config(args), eval_data=args.eval)
    except OSError as e:  # one the driver did not name (a full disk, a folder's permissions): still one line
        raise os_error(e, e.filename or args.run_dir) from None
    if not args.quiet:
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


def run_export(args) -> int:
    from ..train.loop import export
    from ..train.runfiles import os_error
    from ..train.runlock import run_lock
    try:
        with run_lock(args.run_dir, "export"):  # not while a train writes the run's checkpoints
            out = export(args.run_dir, args.output, precision="mixed" if args.mixed else "fp32")
    except OSError as e:  # one the writers did not name (a full disk, a folder's permissions): still one line
        raise os_error(e, e.filename or args.output) from None
    if not args.quiet:
        print(f"{out}: inference model with the trained weights ({'mixed precision' if args.mixed else 'FP32'})")
    return 0

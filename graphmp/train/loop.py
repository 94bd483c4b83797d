"""train() / export(): run a step graph made by build_step on ONNX Runtime.

Guarantees:
- One step-graph run per batch (runner.StepRunner). The state lives in OrtValues on the session's device (the
  GPU or the CPU; device_state=False: numpy arrays fed and fetched), bound with I/O binding, two buffers used in
  turn (outputs of step k are the inputs of step k+1): a step copies the batch in and the loss / finite flag out. cuda_graph=True
  (--cuda-graph) replays the step as captured CUDA graphs.
- Data: an .npz (or a dict) with one array per model input, named as the input, plus the
  labels array (`labels` unless build_step was given another label_name), first axis =
  samples. Every epoch visits the samples in a fresh order (numpy default_rng(seed + epoch));
  the last partial batch is dropped (BatchNormalization statistics of a tiny batch are
  noise; with drop_last=False it is kept). Or any re-iterable of batch dicts (a list, an
  object whose __iter__ starts over); each epoch iterates it again.
- Checkpoints (every `checkpoint_every` steps and at the end): run_dir/ckpt-<step>.npz then
  run_dir/checkpoint.json naming it, each written atomically, so a killed run resumes from
  the last complete checkpoint and repeats exactly the steps after it: the resumed run
  ends with the same weights as an uninterrupted one, bit for bit (deterministic kernels,
  i.e. the CPU provider; no Dropout).
- Run folders are data, not instructions (runfiles.py): every file name train.json or
  checkpoint.json gives is a bare name graphmp writes, naming a regular file inside the
  folder; corrupt files, a full disk, data files that are run files: one-line errors.
- Eval: the inference graph (the source model with the current weights and BN running
  statistics, BN in inference mode), in the training precision (a BF16 run where ONNX
  Runtime lacks BF16 kernels: FP32, and the eval result, progress output and summary say
  so); loss (and accuracy for cross-entropy) computed in numpy from the model output.
- An ONNX Runtime run that fails on user data (a shape or dtype the data checks let through,
  e.g. another sequence length than the step graph was unrolled for) is a one-line
  GraphmpError naming the data file and input (run_failure), never a traceback.
- export(): the source model with the trained tensors as its initializers (FP32), or that
  converted by graphmp.convert (precision="mixed").
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import onnx

from ..errors import GraphmpError, first_line
from ..model_io import check_writable, load_npz
from ..save import save_model, save_npz, write_json
from ..progress import Progress, says_results
from .data import DataCheck, Dataset, in_order, label_rule, make_source, whole_arrays
from .device import check_session, providers_for
from .runner import StepRunner
from .evaluator import Evaluator, infer_model
from .first_step import FirstStepSearch
from .optim import skipped_note
from .plot import write_loss_png
from .runfiles import (CHECKPOINT, FIX, REBUILD, TRAIN_JSON, check_meta, export_inputs, json_file,
                       read_checkpoint, read_json, refuse_run_files, run_file, started_over_note, writing)
from .config import TrainConfig
from .step import SCALE, STEP

LOSS_PNG = "loss.png"
HISTORY_KEY = "__history__loss"  # per-step train loss of the whole run, kept in each checkpoint file


# --- the run dir -------------------------------------------------------------------------

def load_run(run_dir) -> dict:
    """train.json of a run dir made by build_step, checked (runfiles: its types, and every
    file name it gives a regular file graphmp wrote inside the folder); clear errors when
    it is not one."""
    run_dir = os.fspath(run_dir)
    if not os.path.isdir(run_dir):
        raise GraphmpError(f"{run_dir}: no such run folder. Make one with "
                           f"`graphmp train-graph model.onnx -o {run_dir}`.")
    meta_path = json_file(run_dir, TRAIN_JSON)
    if meta_path is None:
        raise GraphmpError(f"{run_dir}: has no train.json, so it is not a (complete) run folder. Make one with "
                           f"`graphmp train-graph model.onnx -o {run_dir}`.")
    meta = read_json(meta_path, REBUILD)
    for k in ("step_model", "infer_model", "initial_state"):
        run_file(run_dir, meta, k)
    check_meta(meta, meta_path)
    return meta


def latest_state(run_dir) -> tuple[dict, dict | None]:
    """(state arrays, checkpoint info or None): the last checkpoint, else the initial state.

    The checkpoint info also holds "train_loss": the per-step train loss of the run up to it
    (a list; empty for checkpoints written before it was kept)."""
    run_dir = os.fspath(run_dir)
    meta = load_run(run_dir)
    ck, state_path = read_checkpoint(run_dir)
    if ck is not None:
        state = load_npz(state_path, hint=f" {FIX[CHECKPOINT].capitalize()}.")
        hist = state.pop(HISTORY_KEY, None)
        ck["train_loss"] = [] if hist is None else [float(x) for x in np.ravel(hist)]
        return state, ck
    return load_npz(run_file(run_dir, meta, "initial_state"), hint=f" {REBUILD.capitalize()}."), None


def save_checkpoint(run_dir, state: dict, info: dict, train_loss=()):
    """ckpt-<step>.npz (the state + the run's per-step loss) then checkpoint.json naming it;
    then the previous checkpoint file is removed, only when checkpoint.json named a valid
    one (runfiles.run_file: never a file outside the run folder). A failed write (a full
    disk) is one line naming the file; the previous checkpoint stays complete and named."""
    name = f"ckpt-{info['step']:09d}.npz"
    path = os.path.join(run_dir, name)
    try:
        old = read_checkpoint(run_dir)[1]
    except GraphmpError:  # changed under us since train() checked it: keep whatever it names
        old = None
    kept = (f"the last complete checkpoint {os.path.basename(old)} is unchanged: free some space and run "
            "`graphmp train` again to resume from it") if old else "no checkpoint was written"
    with writing(path, "the checkpoint", kept):
        save_npz(path, dict(state, **{HISTORY_KEY: np.asarray(train_loss, np.float64)}))
    try:
        with writing(os.path.join(run_dir, CHECKPOINT), "the checkpoint", kept):
            write_json(os.path.join(run_dir, CHECKPOINT), dict(info, state_file=name))
    except GraphmpError:
        if not (old and os.path.basename(old) == name):
            _unlink_quietly(path)
        raise
    if old and os.path.basename(old) != name:
        _unlink_quietly(old)  # a symlink itself, never its target


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# --- eval -------------------------------------------------------------------------------------

def evaluate(run_dir, data, batch_size: int = 256, providers=None, state: dict | None = None,
             skip_bad_samples: bool = False) -> dict:
    """Eval loss (and accuracy) of the run's latest weights (or `state`) on `data` (checked as
    train() checks it: labels in range, NaN/inf an error unless skip_bad_samples)."""
    meta = load_run(run_dir)
    state = state if state is not None else latest_state(run_dir)[0]
    src = make_source(data, meta, "eval data", DataCheck(label_rule(run_dir, meta), skip_bad_samples))
    batch_size = eval_batch_size(meta, src, batch_size)
    first = first_eval_batch(src, batch_size)
    return Evaluator(run_dir, meta, state, providers, first).run(state, src, batch_size)


def first_eval_batch(src, batch_size: int = 256) -> dict:
    """The first eval batch (what the mixed eval graph is calibrated on); an eval set with no
    samples is a one-line error naming it."""
    first = next(iter(in_order(src, batch_size)), None)
    if first is None:
        raise GraphmpError(f"{getattr(src, 'where', 'eval data')}: the eval data holds no samples (after the data "
                           "checks); give eval data with at least one sample, or leave out --eval")
    return first


# --- train ---------------------------------------------------------------------------------------

def _check_batch_size(run_dir, meta, src, batch_size: int) -> None:
    """A batch size the model and the data allow: the model's fixed batch axis, or 1 when the
    data gives some array once per sample with no batch axis (the model takes one sample)."""
    if not isinstance(src, Dataset):
        return
    if src.one_per_step and batch_size != 1:
        name = src.stacked[0]
        why = whole_arrays(meta, src.arrays).get(name, f"labels of shape {meta['label']['shape']}, one more axis in "
                                                       "the data")
        raise GraphmpError(f"{src.where}: '{name}' is given once per sample, and the model takes it whole with no "
                           f"batch axis ({why}), so each step is one sample: use batch size 1.")
    fixed = _fixed_batch(meta, given_whole=list(src.stacked) + list(src.constants))
    if fixed is not None and fixed != batch_size:
        raise GraphmpError(f"{run_dir}: the model's batch axis is fixed at {fixed}; use batch_size {fixed} "
                           "or re-export the model with a dynamic batch axis.")


def _fixed_batch(meta, given_whole=()) -> int | None:
    """The model's batch size when its batch axis is fixed (inputs given whole aside: by the
    model's dims, or by the data, `given_whole`)."""
    whole = set(whole_arrays(meta)) | set(given_whole)
    fixed = [d[0] for k, d in meta["inputs"].items() if d and isinstance(d[0], int) and k not in whole]
    return fixed[0] if fixed else None


def eval_batch_size(meta, src, batch_size: int) -> int:
    """The batch eval runs with: the model's fixed batch, 1 for data given once per sample,
    else `batch_size` (eval batches are big: no gradients to hold)."""
    if isinstance(src, Dataset) and src.one_per_step:
        return 1
    fixed = _fixed_batch(meta)
    return fixed if fixed is not None else batch_size


def refuse_data_in_run(run_dir: str, data, eval_data) -> None:
    """Training and eval data files must not be files the run writes (checkpoints,
    summary.json, loss.png, ...: runfiles.run_paths), compared as files (samefile/realpath)."""
    def path(d):
        return os.fspath(d) if isinstance(d, (str, os.PathLike)) else None
    refuse_run_files(run_dir, [("--data", path(data)), ("--eval", path(eval_data))],
                     "Keep data files outside the run folder, or give them other names.")


@dataclass
class TrainResult:
    summary: dict
    history: dict = field(default_factory=dict)  # per step of this call: loss, scale, applied
    state: dict = field(default_factory=dict)


@dataclass
class _Data:
    """train()'s data, checked before any step (_open_data gives it)."""
    src: object                 # the training batches (data.Dataset or a batch iterable)
    eval_src: object | None     # the eval set (None: no eval)
    nb: int | None              # batches per epoch (None: an iterable of unknown length)
    eval_batch: int             # the batch size eval runs with
    where: str                  # what the batches come from, for errors


@dataclass
class _Run:
    """One train() call under way: the runner, where the run stands, what it has seen."""
    run_dir: str
    meta: dict
    runner: StepRunner
    providers: list | None      # what the sessions asked for (device= picks them)
    setup: dict                 # what a resumed run must match (checkpoint.json "setup")
    pos: dict                   # step, epoch, position in the epoch, skipped steps
    run_loss: list              # the whole run's per-step loss (for loss.png)
    run_eval: list              # the whole run's eval per epoch
    notes: list                 # device notes (progress output, summary["device_note"])
    history: dict = field(default_factory=lambda: {"loss": [], "scale": [], "applied": [], "eval": []})
    times: list = field(default_factory=list)
    evaluator: Evaluator | None = None
    ev_result: dict | None = None
    first_step: FirstStepSearch | None = None  # retries of skipped steps until the first is applied
    started_over: str | None = None             # --no-resume over a checkpoint: which one is replaced

    def checkpoint(self):
        save_checkpoint(self.run_dir, self.runner.state_numpy(),
                         dict(self.pos, setup=self.setup, eval_history=self.run_eval), self.run_loss)


def _resolve_config(config: TrainConfig | None, options: dict) -> TrainConfig:
    """The TrainConfig train() runs with: `config` (default: all defaults) with `options` on
    top, checked (TrainConfig.from_kwargs)."""
    if config is not None and not isinstance(config, TrainConfig):
        raise TypeError(f"train(): config must be a TrainConfig (TrainConfig.from_kwargs(...)), "
                        f"not {type(config).__name__}")
    base = config.as_kwargs() if config is not None else {}
    return TrainConfig.from_kwargs(**{**base, **options})


def _open_data(run_dir: str, meta: dict, data, eval_data, c: TrainConfig) -> _Data:
    """Needs the run and the data. Gives the training and eval data checked before any step
    (labels, NaN/inf, a batch size the model and the data allow, at least one batch, an eval
    set with samples) and the batch counts."""
    rule = label_rule(run_dir, meta)
    src = make_source(data, meta, check=DataCheck(rule, c.skip_bad_samples))
    where = getattr(src, "where", "data")
    _check_batch_size(run_dir, meta, src, c.batch_size)
    nb = src.num_batches(c.batch_size, c.drop_last)
    if isinstance(src, Dataset) and nb == 0:
        raise GraphmpError(f"{where}: {src.n} samples, fewer than one batch of {c.batch_size}; lower batch_size.")
    eval_src = None
    if eval_data is not None:  # checked now, before any step
        eval_src = make_source(eval_data, meta, "eval data", DataCheck(rule, c.skip_bad_samples))
        if isinstance(eval_src, Dataset) and eval_src.n == 0:
            first_eval_batch(eval_src)  # the error naming the file
    return _Data(src, eval_src, nb, eval_batch_size(meta, eval_src, max(c.batch_size, 256)), where)


def _start_run(run_dir: str, meta: dict, d: _Data, c: TrainConfig, providers, notes: list) -> _Run:
    """Needs the checked data. Gives the run started from its last checkpoint (resume; its
    setup must match this call's) or its initial state, on a StepRunner whose session got the
    providers asked for (device "cuda": else an error; otherwise a note)."""
    read_checkpoint(run_dir)  # checked even with resume=False: its state file is removed at the first checkpoint
    state, ck = latest_state(run_dir) if c.resume else (load_npz(run_file(run_dir, meta, "initial_state")), None)
    setup = {"batch_size": c.batch_size, "seed": c.seed, "drop_last": c.drop_last,
             "samples": getattr(d.src, "n", None)}
    pos = {"step": 0, "epoch": 0, "position": 0, "skipped": 0}
    if ck is not None:
        for k, v in setup.items():
            if ck["setup"].get(k) != v:
                raise GraphmpError(f"{run_dir}: the checkpoint was made with {k}={ck['setup'].get(k)}, this run has "
                                   f"{k}={v}; pass the same value, or resume=False (--no-resume) to start over.")
        pos = {k: ck[k] for k in pos}
    run_loss = list(ck.get("train_loss", [])) if ck else []  # the whole run's, for loss.png
    run_eval = list(ck.get("eval_history", [])) if ck else []
    runner = StepRunner(run_dir, meta, state, providers, c.device_state, c.threads, c.cuda_graph, c.batch_size)
    runner.where = d.where
    notes += [n for n in [check_session(runner.sess, providers, c.device, "training")] if n]
    r = _Run(run_dir, meta, runner, providers, setup, pos, run_loss, run_eval, notes)
    r.started_over = started_over_note(run_dir, c.resume)
    # the step graph's skip restarts an accumulation window: retrying one micro-batch would not redo it
    single = int(meta["config"].get("grad_accum", 1) or 1) == 1
    r.first_step = FirstStepSearch.for_run(meta["config"], meta["dynamic_scale"] and single,
                                           pos["step"] - pos["skipped"])
    return r


def _train_epochs(r: _Run, d: _Data, c: TrainConfig) -> str | None:
    """Needs the started run. Runs the epochs from where the run stands, with the progress
    line (and the notes above it), eval after each epoch; gives the note on (nearly) every
    step skipped, or a falsy value."""
    total = None if d.nb is None else d.nb * c.epochs
    if c.max_steps is not None and total is not None:
        total = min(total, c.max_steps)
    with Progress(total=total, desc="train", enabled=c.progress) as bar:
        bar.n = r.pos["step"] if total else 0
        for line in [r.started_over] * bool(r.started_over) + r.notes + _dropped_lines(d.src, d.eval_src):
            _say(bar, line)
        for epoch in range(r.pos["epoch"], c.epochs):
            if not _train_epoch(r, d, c, epoch, bar):
                break
            r.pos["epoch"], r.pos["position"] = epoch + 1, 0
            if d.eval_src is not None:
                _eval_epoch(r, d, c, epoch, bar)
        note = r.history["scale"] and skipped_note(r.meta["config"], r.meta["dynamic_scale"], r.pos["step"],
                                                   r.pos["skipped"], r.history["scale"][-1])  # (nearly) all skipped
        if note:
            _say(bar, note)
    return note


def _train_epoch(r: _Run, d: _Data, c: TrainConfig, epoch: int, bar: Progress) -> bool:
    """The steps of one epoch from the run's position (a checkpoint every checkpoint_every
    steps); False when max_steps stopped it."""
    pos, history = r.pos, r.history
    start = pos["position"] if epoch == pos["epoch"] else 0
    for batch in d.src.batches(epoch, c.batch_size, c.seed, c.drop_last, start):
        if c.max_steps is not None and pos["step"] >= c.max_steps:
            return False
        if batch is None:  # every sample dropped by --skip-bad-samples: keep its place
            pos["position"] += 1
            continue
        t0 = time.perf_counter()
        loss, applied, scale = r.first_step.run(lambda: r.runner.step(batch))
        r.times.append(time.perf_counter() - t0)
        pos["step"] += 1
        pos["position"] += 1
        pos["skipped"] += not applied
        history["loss"].append(loss)
        history["scale"].append(scale)
        history["applied"].append(applied)
        r.run_loss.append(loss)
        bar.update(1, epoch=epoch + 1, loss=_loss_text(loss), scale=f"{scale:g}", skipped=pos["skipped"])
        if c.checkpoint_every and pos["step"] % c.checkpoint_every == 0:
            r.checkpoint()
    return True


def _eval_epoch(r: _Run, d: _Data, c: TrainConfig, epoch: int, bar: Progress) -> None:
    """Eval of the current state after an epoch (the evaluator made at the first, calibrated
    on the first eval batch); recorded in the history and the run's eval, and said."""
    st = r.runner.state_numpy()
    if r.evaluator is None:
        first = first_eval_batch(d.eval_src, d.eval_batch)
        r.evaluator = Evaluator(r.run_dir, r.meta, st, r.providers, first, c.device)
        if r.evaluator.note:
            r.notes.append(r.evaluator.note)
            _say(bar, r.evaluator.note)
    r.ev_result = dict(r.evaluator.run(st, d.eval_src, d.eval_batch), epoch=epoch + 1, step=r.pos["step"])
    r.history["eval"].append(r.ev_result)
    r.run_eval.append(r.ev_result)
    if bar.enabled:
        _say(bar, _eval_line(r.ev_result))
    elif says_results():  # a result as it comes, also into a log where no progress line is drawn
        print(_eval_line(r.ev_result), file=sys.stderr, flush=True)
    bar.update(0, eval_loss=f"{r.ev_result['loss']:.4f}")


def _summary(r: _Run, d: _Data, state: dict, note) -> dict:
    """The summary of the run after this call (summary.json, format_summary)."""
    meta, pos, history = r.meta, r.pos, r.history
    losses = [x for x, a in zip(history["loss"], history["applied"]) if np.isfinite(x)]
    return {
        "steps": pos["step"], "steps_this_call": len(history["loss"]),
        "optimizer_steps": int(state[STEP]), "skipped_steps": pos["skipped"],
        "final_scale": float(state[SCALE]) if meta["dynamic_scale"] else float(meta["config"]["loss_scale"]),
        "loss": float(np.mean(losses[-max(1, (d.nb or 10)):])) if losses else None,
        "last_loss": history["loss"][-1] if history["loss"] else None,
        "eval": r.ev_result, "seconds_per_step": statistics.median(r.times) if r.times else None,
        "device": r.runner.device, "providers": r.runner.providers, "device_note": "; ".join(r.notes) or None,
        "state_on_device": r.runner.bound, "provider_options": r.runner.provider_options,
        "cuda_graph": r.runner.cuda_graph, "precision": meta["config"]["precision"],
        "epochs_done": pos["epoch"], "eval_per_epoch": r.run_eval,
        "dropped_samples": {"train": d.src.check.dropped, "eval": d.eval_src.check.dropped if d.eval_src else 0},
        "loss_curve": LOSS_PNG, "skipped_note": note or None,
        "first_step_backoff": r.first_step.as_dict() if r.first_step else None, "started_over": r.started_over,
    }


def write_run_files(run_dir: str, step: int, train_loss, evals: list, what: str, summary: dict) -> str | None:
    """After the run's last checkpoint (at `step`): the whole run's loss curve (loss.png; loss.csv
    without matplotlib) and summary.json (its "loss_curve" set to the file written), each
    atomically. what: the title's parenthesis (the precision, and the ranks of a data-parallel
    run). Returns the hint line to print when matplotlib is missing, else None."""
    done = f"the run's checkpoint (step {step}) is complete"
    with writing(os.path.join(run_dir, LOSS_PNG), "the loss curve", done):
        curve, hint = write_loss_png(os.path.join(run_dir, LOSS_PNG), train_loss,
                                     [(e["step"], e["loss"]) for e in evals],
                                     title=f"{os.path.basename(os.path.abspath(run_dir))}: loss ({what})")
    summary["loss_curve"] = os.path.basename(curve)  # loss.csv without matplotlib
    with writing(os.path.join(run_dir, "summary.json"), "the summary", done):
        write_json(os.path.join(run_dir, "summary.json"), summary)
    return hint


def _finish(r: _Run, d: _Data, note, progress: bool) -> TrainResult:
    """The last checkpoint, then the whole run's loss curve (loss.png; loss.csv and a hint line
    without matplotlib) and summary.json."""
    r.checkpoint()
    state = r.runner.state_numpy()
    summary = _summary(r, d, state, note)
    hint = write_run_files(r.run_dir, r.pos["step"], r.run_loss, r.run_eval, r.meta["config"]["precision"], summary)
    if hint and progress:  # a line after the closed progress line, on its stream
        sys.stderr.write(hint + "\n")
    return TrainResult(summary, r.history, state)


def train(run_dir, data, config: TrainConfig | None = None, *, eval_data=None, **options) -> TrainResult:
    """Train the run in run_dir on `data` for `epochs` epochs (see the module docstring).

    The options: a TrainConfig (graphmp.train.config), or keywords (TrainConfig's fields, the
    flags of `graphmp train`; on top of `config` when both are given), checked first: an
    unknown one is a TypeError, a bad value a GraphmpError naming it. eval_data: evaluated
    after every epoch (same layout as data).
    resume: continue from run_dir/checkpoint.json when present (with the same batch_size,
    seed, drop_last and number of samples). max_steps: stop after this many steps in total (counting resumed ones).
    Data (train and eval) is checked before use: cross-entropy labels must be class indices
    (or the ignore index), float arrays finite; skip_bad_samples drops samples holding NaN/inf
    instead of failing. device: "cuda" | "auto" | "cpu" picks the providers (instead of
    `providers`) and checks every session got them: "cuda" fails when not, "auto" says so in
    the progress output and summary["device_note"].
    Returns the summary (also written to run_dir/summary.json, with eval per epoch), this
    call's per-step history (+ "eval": one dict per epoch) and the final state; writes the
    whole run's loss curve to run_dir/loss.png (without matplotlib: its numbers to run_dir/loss.csv
    and a hint line in the progress output)."""
    c = _resolve_config(config, options)
    run_dir = os.fspath(run_dir)
    meta = load_run(run_dir)
    refuse_data_in_run(run_dir, data, eval_data)
    providers, notes = c.providers, []
    if c.device is not None:
        providers, note = providers_for(c.device)
        notes += [note] if note else []
    d = _open_data(run_dir, meta, data, eval_data, c)
    r = _start_run(run_dir, meta, d, c, providers, notes)
    note = _train_epochs(r, d, c)
    return _finish(r, d, note, c.progress)


def _say(bar: Progress, line: str):
    """A line of its own in the progress output (above the progress line on a terminal)."""
    if bar.enabled:
        bar.stream.write(("\r" + line + "\x1b[K\n") if bar.tty else line + "\n")
        bar.stream.flush()


def _loss_text(loss: float) -> str:
    """The progress line's loss: 4 decimals, and no "-0.0000" for a loss that rounds to zero
    from below (cross-entropy of a confident right answer is -0.0 or -1e-8 in float arithmetic)."""
    text = f"{loss:.4f}"
    return text[1:] if text == "-0.0000" else text


def _eval_line(e: dict) -> str:
    return (f"epoch {e['epoch']} (step {e['step']}): eval loss {e['loss']:.4f}"
            + (f", accuracy {e['accuracy']:.4f}" if "accuracy" in e else "") + f" on {e['samples']} samples")


def _dropped_lines(*sources) -> list:
    """What --skip-bad-samples dropped from the datasets (known when loaded; iterables count as they go)."""
    return [f"{role}{'' if s.where in ('data', 'eval data') else ' ' + s.where}: dropped {s.check.dropped} "
            "sample(s) holding NaN/inf (--skip-bad-samples)"
            for role, s in zip(("train data", "eval data"), sources) if isinstance(s, Dataset) and s.check.dropped]


def format_summary(s: dict) -> str:
    lines = [f"steps: {s['steps']} ({s['optimizer_steps']} applied, {s['skipped_steps']} skipped for inf/NaN "
             f"gradients); loss scale now {s['final_scale']:g}"]
    lines += [s["skipped_note"]] if s.get("skipped_note") else []  # (nearly) all skipped: why, what to do
    lines += [s["started_over"]] if s.get("started_over") else []
    backoff = s.get("first_step_backoff")
    if backoff:
        lines.append(f"first step: loss scale backed off {backoff['from_scale']:g} -> "
                     + (f"{backoff['to_scale']:g}" if backoff["to_scale"] is not None else "(no step applied)")
                     + f" on the first batch ({backoff['tries']} retried step(s), not counted as skipped)")
    if s["loss"] is not None:
        lines.append(f"train loss (last epoch mean): {s['loss']:.4f}")
    per_epoch = s.get("eval_per_epoch") or []
    if len(per_epoch) > 1:
        lines.append("eval per epoch: " + ", ".join(f"{e['epoch']}: {e['loss']:.4f}" for e in per_epoch))
    if s.get("eval"):
        e = s["eval"]
        lines.append(f"eval: loss {e['loss']:.4f}" + (f", accuracy {e['accuracy']:.4f}" if "accuracy" in e else "")
                     + f" on {e['samples']} samples" + (f" (evaluated in {e['precision']})" if e.get("precision")
                                                        and e["precision"] != s.get("precision") else ""))
    dropped = s.get("dropped_samples") or {}
    if any(dropped.values()):
        lines.append(f"dropped for NaN/inf (--skip-bad-samples): {dropped.get('train', 0)} train, "
                     f"{dropped.get('eval', 0)} eval sample(s)")
    if s["seconds_per_step"]:
        lines.append(f"time/step: {s['seconds_per_step'] * 1e3:.2f} ms (median, {s['device']}, {s['precision']})")
    if s.get("device_note"):
        lines.append(f"device: {s['device_note']}")
    return "\n".join(lines)


# --- export ----------------------------------------------------------------------------------------

def export(run_dir, out_path, precision: str = "fp32", state: dict | None = None) -> str:
    """Write the inference model with the run's latest weights to out_path (atomically).

    Weights that the source model stored as Constant nodes (train.json "constant_weights")
    are written back as Constant nodes of the same name, holding the trained values."""
    from .source import restore_constants
    if precision not in ("fp32", "mixed"):
        raise GraphmpError(f"precision must be 'fp32' or 'mixed', not '{precision}'")
    from ..paths import refuse_clobber
    meta = load_run(run_dir)
    out_path = os.fspath(out_path)
    refuse_clobber([("-o", out_path)], export_inputs(run_dir, meta))  # never a file of the run or its source
    check_writable(out_path, None)
    state = state if state is not None else latest_state(run_dir)[0]
    model = infer_model(run_dir, meta, state)
    restore_constants(model, meta.get("constant_weights") or {})
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:  # noqa: BLE001 - ValidationError, InferenceError: a damaged infer.onnx / train.json
        raise GraphmpError(f"{run_file(run_dir, meta, 'infer_model')}: the model with the trained weights fails "
                           f"onnx's checker ({first_line(e, 200)}); {REBUILD}") from None
    if precision == "mixed":
        from ..convert import convert
        convert(model, out_path, keep_io_types=True)
    else:
        save_model(model, out_path, None, None, external=False)
    return out_path


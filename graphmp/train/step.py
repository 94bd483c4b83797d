"""build_step(): one loss-scaled optimizer step as an ordinary ONNX graph.

    FP32 master weights (inputs) -> [mixed/bf16: Casts placed by graphmp.convert]
      -> forward in training mode (BN batch statistics, Dropout on) -> loss (FP32, losses.py)
      -> backward seeded with the loss scale S -> gradients w.r.t. the masters (FP32)
      -> / S -> [accumulation over grad_accum runs] -> one all-finite flag
      -> [global-norm clipping] -> SGD / AdamW at the scheduled lr (optim.py)
      -> new state, applied only when finite -> S updated (dynamic scaling)

Only standard ONNX ops, so any current ONNX Runtime (CPU, CUDA, ...) runs it as an
InferenceSession: one `run` = one optimizer step (or one micro-batch with grad_accum > 1).

State naming (every state tensor is a graph input AND a graph output):
    input X                      -> output  X + NEXT ("X__next")
    <weight>                     trainable FP32 master weight (the model's initializer name,
                                 or a lifted Constant node's output name)
    <weight>__momentum           SGD momentum buffer (momentum > 0)
    <weight>__exp_avg/_exp_avg_sq  AdamW moments (torch's names)
    <weight>__accum              gradient sum of the accumulation window (grad_accum > 1)
    <bn running mean/var>        BatchNormalization running statistics (not trainable)
    optimizer_step               int64 [], optimizer steps applied (skipped steps do not count;
                                 the lr schedule reads it)
    accum_count                  int64 [], runs summed in the window so far (grad_accum > 1)
    loss_scale                   float32 [], S (dynamic scaling only; static S is a constant)
    loss_scale_clean_steps       int64 [], finite steps since S last changed (dynamic only)
Other inputs: the model's data inputs and `labels`. Other outputs: `loss` (FP32, unscaled,
the batch mean), `all_finite` (bool: the step was applied; with grad_accum > 1, on the
runs between updates: this run's gradients were finite), and with expose_grads=True
`<weight>__grad` (this run's unscaled, unclipped FP32 gradient).

A skipped step (some gradient inf/NaN) leaves every state tensor unchanged except the
scale and its counter (and the accumulation window, which restarts); BN running
statistics are not updated either.

Trainable by default: every FP32 initializer with at least one axis that the loss depends
on, except BN running statistics and op parameters (Resize scales, Clip bounds, ...; see
source.NON_TRAINABLE). Float Constant nodes with at least one axis (paddle2onnx / TF weights)
become initializers first (train.json "constant_weights": {tensor: node}; export writes them
back as Constant nodes). `b = Identity(a)` of an initializer (torch.onnx's de-duplication of
equal parameters) is untied. Nodes the loss does not need (other heads) are pruned.

run_dir layout: step.onnx, state.npz (initial state), infer.onnx (the FP32 inference
model with the trained tensors as inputs: eval and export use it), train.json (names,
shapes, config, source path). train.json is written last, so a run dir that has it is
complete; every file is written atomically. A non-empty run dir is refused unless
force=True; then, once the new step is built (a failed build leaves the old run as it
was), the old run's train.json, checkpoints and outputs are removed before writing: only
the names graphmp writes there (runfiles.RUN_FILE), only regular files or symlinks (the
link, never its target). A model (or one of its data files) that is one of those files is
refused before any work, and so is a run folder that cannot be written.
"""
from __future__ import annotations

import copy
import os
import re

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import GraphmpError
from ..io import iter_graphs, load_model, tensor_array
from ..opset import upgrade
from ..passes.prepare import initializers_out_of_inputs
from . import losses, optim, source
from .builder import (Builder, all_names, ancestors, dims, elem_name, lift_to_inputs, passes_full_check, producer,
                      prune, value_info)
from .losses import LOSS, LOSSES  # noqa: F401  (re-exported)
from .optim import ACCUM, ACCUM_COUNT, OPTIMIZERS, SCHEDULES
from .ort_checks import calibration_batch, check_runs
from .runfiles import check_run_dir, write_run
from .source import NON_TRAINABLE  # noqa: F401  (re-exported)

NEXT = "__next"
GRAD = "__grad"
STEP = "optimizer_step"
SCALE = "loss_scale"
CLEAN = "loss_scale_clean_steps"
FINITE = "all_finite"
MIN_OPSET = 13
FORMAT = 1

PRECISIONS = ("mixed", "fp32", "bf16")
# ops whose gradient rule needs the static lengths of its input's axes (graphmp/train/rules/resize.py,
# auto_pad SAME_* of Conv/ConvTranspose/pools): with --shapes, the step graph's inputs are declared
# at those sizes (the batch stays free)
STATIC_LENGTH_OPS = ("Resize",)


def _needs_static_lengths(node) -> bool:
    if node.op_type in STATIC_LENGTH_OPS:
        return True
    pad = next((a.s for a in node.attribute if a.name == "auto_pad"), b"NOTSET")
    if node.op_type == "ConvTranspose" and (pad != b"NOTSET" or any(a.name == "output_shape" for a in node.attribute)):
        return True  # its pads follow from the input lengths (graphmp/train/rules/nn.py _transpose_pads)
    return pad in (b"SAME_UPPER", b"SAME_LOWER")


def _static_length_tensors(model, cfg) -> list:
    """With pinned input sizes (for a node whose gradient needs static lengths: Resize, SAME
    padding): every node output, for declare_measured to measure those whose lengths onnx
    inference leaves open (sizes computed at run time). All, not only those nodes' inputs,
    because the conversion of a mixed step may drop a Cast between them and their producer."""
    if not cfg.get("pinned_shapes"):
        return []
    return [t for n in model.graph.node for t in n.output if t]


# old private names, kept for importers
_Builder = Builder


# --- build_step ------------------------------------------------------------------------

def _validate_config(cfg: dict, path: str):
    def bad(msg):
        raise GraphmpError(f"{path}: {msg}")
    losses.check_loss_config(cfg, bad)
    if cfg["optimizer"] not in OPTIMIZERS:
        bad(f"optimizer must be one of {OPTIMIZERS}, not '{cfg['optimizer']}'")
    if cfg["precision"] not in PRECISIONS:
        bad(f"precision must be one of {PRECISIONS}, not '{cfg['precision']}'")
    if not cfg["lr"] > 0:
        bad(f"lr must be > 0 (got {cfg['lr']})")
    if cfg["lr_schedule"] not in SCHEDULES:
        bad(f"lr_schedule must be one of {SCHEDULES}, not '{cfg['lr_schedule']}'")
    if cfg["warmup_steps"] < 0:
        bad(f"warmup_steps must be >= 0 (got {cfg['warmup_steps']})")
    if cfg["lr_schedule"] != "constant":
        if cfg["total_steps"] is None:
            bad(f"lr_schedule '{cfg['lr_schedule']}' needs total_steps (--total-steps N: the optimizer steps "
                "of the whole run, where the lr reaches its end)")
        if cfg["total_steps"] <= cfg["warmup_steps"]:
            bad(f"total_steps ({cfg['total_steps']}) must be larger than warmup_steps ({cfg['warmup_steps']})")
    if cfg["grad_accum"] < 1:
        bad(f"grad_accum must be >= 1 (got {cfg['grad_accum']})")
    if cfg["precision"] == "bf16":
        cfg["loss_scale"] = 1.0  # BF16 has FP32's exponent range: no loss scaling
    if cfg["loss_scale"] != "dynamic":
        try:
            s = float(cfg["loss_scale"])
        except (TypeError, ValueError):
            s = -1.0
        if not (s > 0 and np.isfinite(s)):
            bad(f"loss_scale must be 'dynamic' or a positive number (got {cfg['loss_scale']!r})")
        cfg["loss_scale"] = s
    if not 0 < cfg["min_scale"] <= cfg["init_scale"] <= cfg["max_scale"]:
        bad(f"need 0 < min_scale <= init_scale <= max_scale (got {cfg['min_scale']}, {cfg['init_scale']}, "
            f"{cfg['max_scale']})")
    if not (0 < cfg["backoff"] < 1 and cfg["growth"] > 1 and cfg["growth_interval"] >= 1):
        bad("need 0 < backoff < 1, growth > 1 and growth_interval >= 1")
    if cfg["clip_norm"] is not None and not cfg["clip_norm"] > 0:
        bad(f"clip_norm must be > 0 (got {cfg['clip_norm']})")
    if cfg["trainable"]:
        try:
            re.compile(cfg["trainable"])
        except re.error as e:
            bad(f"trainable '{cfg['trainable']}' is not a valid regular expression ({e})")


def _needed_opset(model) -> int:
    """The opset the gradient rules need for this model: 13, or more for ops whose
    gradient uses a newer op (rules.NEEDS_OPSET)."""
    from .rules import NEEDS_OPSET
    ops = {n.op_type for g in iter_graphs(model.graph) for n in g.node}
    return max([MIN_OPSET] + [v for op, v in NEEDS_OPSET.items() if op in ops])


def build_step(model, out_dir, *, loss: str = "cross-entropy", label_shape=None, label_name: str = "labels",
               optimizer: str = "adamw", lr: float = 1e-3, momentum: float = 0.9, betas=(0.9, 0.999),
               eps: float = 1e-8, weight_decay: float = 0.0, clip_norm: float | None = None,
               loss_scale="dynamic", init_scale: float = 2.0**16, growth_interval: int = 2000,
               backoff: float = 0.5, growth: float = 2.0, min_scale: float = 1.0, max_scale: float = 2.0**24,
               precision: str = "mixed", output: str | None = None, trainable: str | None = None,
               calibration=None, shapes=None, expose_grads: bool = False,
               bn_momentum: float | None = None, class_axis: int = 1, ignore_index: int | None = None,
               label_smoothing: float = 0.0, class_weights=None, lr_schedule: str = "constant",
               warmup_steps: int = 0, total_steps: int | None = None, grad_accum: int = 1,
               force: bool = False) -> dict:
    """Write the training step for an FP32 model (path) to out_dir; return the train.json dict.

    loss: "cross-entropy" (integer class labels; class_axis, ignore_index, label_smoothing,
    class_weights as torch's F.cross_entropy, see losses.py) or "mse" (mean over all
    elements). output: the model tensor fed to the loss (default: the first graph output; any
    intermediate tensor, e.g. the logits before a final Softmax, works). label_shape: e.g.
    ["N"] (default: the output's shape without the class axis). trainable: regex over
    initializer names (default: every float initializer the loss depends on, except BN
    running statistics). loss_scale: "dynamic" (starts at init_scale) or a number (static).
    lr_schedule "constant" | "linear" | "cosine" with warmup_steps / total_steps (optim.py),
    grad_accum: optimizer update every grad_accum runs, on the mean gradient.
    precision "mixed": the forward+loss graph goes through graphmp.convert (keep_io_types, so the
    masters stay FP32 inputs with Casts to FP16 inside); "bf16": the same with target bf16 and
    no loss scaling, refused when this machine's ONNX Runtime cannot run it. calibration: as
    for convert, default a generated batch (shapes from `shapes` or a trial run) with the real
    weights. The backward takes each op's precision from it. force: replace a run in a
    non-empty out_dir (else refused).
    """
    from .autodiff import add_backward, training_forward

    path = os.fspath(model)
    out_dir = os.fspath(out_dir)
    cfg = dict(loss=loss, label_shape=list(label_shape) if label_shape is not None else None,
               label_name=label_name, optimizer=optimizer, lr=float(lr), momentum=float(momentum),
               betas=[float(x) for x in betas], eps=float(eps), weight_decay=float(weight_decay),
               clip_norm=None if clip_norm is None else float(clip_norm), loss_scale=loss_scale,
               init_scale=float(init_scale), growth_interval=int(growth_interval), backoff=float(backoff),
               growth=float(growth), min_scale=float(min_scale), max_scale=float(max_scale),
               precision=precision, output=output, trainable=trainable, expose_grads=bool(expose_grads),
               bn_momentum=bn_momentum, class_axis=int(class_axis),
               ignore_index=None if ignore_index is None else int(ignore_index),
               label_smoothing=float(label_smoothing), class_weights=losses.parse_class_weights(class_weights),
               num_classes=None, lr_schedule=lr_schedule, warmup_steps=int(warmup_steps),
               total_steps=None if total_steps is None else int(total_steps), grad_accum=int(grad_accum))
    _validate_config(cfg, path)
    check_run_dir(out_dir, force, path, calibration)

    src = load_model(path)
    if any(p.key == "graphmp" for p in src.metadata_props):
        raise GraphmpError(f"{path}: this model was already converted by graphmp; build the training step "
                           "from the FP32 source model (precision='mixed' converts it for you).")
    raw = src  # as written (the opset upgrade may wrap a Softmax-11 in Flatten/Reshape)
    source.dynamic_negative_dims(src)
    # ImageScaler/Crop/Affine (removed experimental ops) would stop the upgrade: standard ops first
    from .legacy import rewrite_experimental
    legacy_consts = set(rewrite_experimental(src, path))
    src = upgrade(src, _needed_opset(src), path)
    initializers_out_of_inputs(src)
    base = os.path.dirname(os.path.abspath(path))
    values = {t.name: np.array(tensor_array(t, base)) for t in src.graph.initializer}
    for t in src.graph.initializer:  # bring external data inline: the run dir is self-contained
        if t.data_location == TensorProto.EXTERNAL:
            t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))
    constants = source.lift_constant_weights(src, values)
    untied = source.untie_identity_initializers(src, values)
    out_name = cfg["output"] = output or src.graph.output[0].name
    if out_name not in all_names(src):
        outs = [o.name for o in src.graph.output]
        raise GraphmpError(f"{path}: output '{out_name}' is not a tensor of the model; its outputs are {outs}.")
    data_inputs = [v.name for v in src.graph.input]
    for reserved in [label_name, LOSS, FINITE, STEP, SCALE, CLEAN, ACCUM_COUNT]:
        if reserved in all_names(src):
            raise GraphmpError(f"{path}: the model already has a tensor named '{reserved}', which the step "
                               "graph needs" + (" (choose another label_name)" if reserved == label_name else "."))

    # --- forward in training mode + loss ---------------------------------------------
    fwd = copy.deepcopy(src)
    del fwd.graph.value_info[:]
    # LSTM/GRU have no gradient rule: unrolled over the sequence length the step is built for
    # (static in the model or pinned by `shapes`); the step graph then accepts only that length
    from .rnn import decompose_recurrent
    fwd, unrolled = decompose_recurrent(fwd, shapes=shapes, where=path)
    if unrolled:
        cfg["recurrent"] = unrolled  # train.json: which LSTM/GRU nodes, sequence length, nodes added
    elif shapes and any(_needs_static_lengths(n) for n in fwd.graph.node):
        # Resize / SAME-padding gradients need the input lengths, which --shapes gives
        from .rnn import pin_inputs
        pin_inputs(fwd, shapes)
        cfg["pinned_shapes"] = shapes if isinstance(shapes, str) else {k: list(v) for k, v in shapes.items()}
    # ranks that onnx inference loses (a Reshape to a computed shape): measured in ONNX Runtime at
    # the build's shapes and declared, dims only where they do not follow the free input dims
    from .measure import declare_measured, declared_dims, redeclare, with_measure_note
    measured = declare_measured(fwd, shapes, where=path, base_dir=base, need_static=_static_length_tensors(fwd, cfg))
    if measured["tensors"] or measured["note"]:
        cfg["measured_shapes"] = measured  # train.json: how many tensors, at which shapes, or why not
    out_vi = value_info(src, out_name)
    if dims(out_vi) is None:  # the output is one of the measured tensors
        out_vi = value_info(fwd, out_name) or out_vi
    if out_vi is not None and out_vi.type.tensor_type.elem_type != TensorProto.FLOAT:
        raise GraphmpError(f"{path}: output '{out_name}' is not FP32; train from the FP32 model.")
    soft = producer(raw, out_name, through_identity=True) or producer(src, out_name, through_identity=True)
    if cfg["loss"] == "cross-entropy" and soft is not None and soft.op_type in ("Softmax", "LogSoftmax"):
        raise GraphmpError(f"{path}: output '{out_name}' comes from a {soft.op_type}; cross-entropy needs the "
                           f"logits. Pass output=<the tensor before it> (--model-output {soft.input[0]}).")
    out_dims = dims(out_vi)
    label_dims, label_elem = losses.label_spec(cfg, out_dims, path)
    cfg["label_shape"] = label_dims
    bn_kw = {} if bn_momentum is None else {"momentum": bn_momentum}
    try:
        running = training_forward(fwd, **bn_kw)  # {running stat: its updated value}
    except GraphmpError as e:
        raise with_measure_note(e, measured, path) from None
    b = Builder(fwd)
    loss_t = losses.add_loss(fwd, b, cfg, out_dims, label_dims, label_elem)

    deps = ancestors(fwd.graph, loss_t)
    rx = re.compile(trainable) if trainable else None
    fixed = source.non_trainable_slots(fwd) | legacy_consts
    weights = [t.name for t in src.graph.initializer
               if t.data_type == TensorProto.FLOAT and t.name in deps and t.name not in running
               and t.name not in fixed and (rx.search(t.name) if rx else values[t.name].ndim >= 1)]
    if not weights:
        raise GraphmpError(f"{path}: no trainable FP32 initializer feeds output '{out_name}'"
                           + (f" matching trainable='{trainable}'" if trainable else "")
                           + source.subgraph_weights_note(src) + ".")
    bn_stats = [n for n in running if n in values]
    lift_to_inputs(fwd, weights + bn_stats)
    del fwd.graph.output[:]
    fwd.graph.output.append(helper.make_tensor_value_info(loss_t, TensorProto.FLOAT, []))
    for r in bn_stats:
        fwd.graph.output.append(helper.make_tensor_value_info(running[r], TensorProto.FLOAT, list(values[r].shape)))
    prune(fwd)

    # --- mixed precision: the convert pipeline assigns every op's precision -------------
    convert_report = None
    if cfg["precision"] in ("mixed", "bf16"):
        from ..convert import convert
        cal = calibration
        if cal is None:
            cal = [calibration_batch(src, base, shapes, path, cfg, label_dims, label_elem,
                                      {w: values[w] for w in weights + bn_stats})]
        carried = declared_dims(fwd) if measured["tensors"] else {}
        rep = convert(fwd, calibration=cal, keep_io_types=True,
                      **({"target": "bf16"} if cfg["precision"] == "bf16" else {}))
        fwd, convert_report = rep.model, rep.to_dict()
        if carried:  # convert re-derives value_info, dropping what was measured: declared again
            redeclare(fwd, carried)

    # --- backward, loss scaling, optimizer ----------------------------------------------
    b = Builder(fwd)
    g = fwd.graph
    dynamic = cfg["loss_scale"] == "dynamic"
    if dynamic:
        g.input.append(helper.make_tensor_value_info(SCALE, TensorProto.FLOAT, []))
        g.input.append(helper.make_tensor_value_info(CLEAN, TensorProto.INT64, []))
        scale = SCALE
    else:
        scale = b.const(cfg["loss_scale"])
    g.input.append(helper.make_tensor_value_info(STEP, TensorProto.INT64, []))
    n_before = len(g.node)
    try:
        grads_scaled = add_backward(fwd, loss_t, weights, seed=scale)
    except GraphmpError as e:
        raise with_measure_note(e, measured, path) from None
    missing = [w for w in weights if w not in grads_scaled]
    if missing:
        raise GraphmpError(f"{path}: no gradient was produced for {missing}")
    grads = {w: b.op("Div", [grads_scaled[w], scale], out=(w + GRAD) if expose_grads else None) for w in weights}
    new, applied, finite, accum_init = _update(b, cfg, grads, loss_t, dynamic)
    for r in bn_stats:
        new[r] = running[r]
    moments = new.pop("__moments__")
    for m in moments:
        g.input.append(helper.make_tensor_value_info(m, TensorProto.FLOAT, list(values[moments[m]].shape)))
    for a in accum_init:
        g.input.append(helper.make_tensor_value_info(a, TensorProto.FLOAT if a != ACCUM_COUNT else TensorProto.INT64,
                                                     [] if a == ACCUM_COUNT else list(values[accum_init[a]].shape)))
    outputs = [helper.make_tensor_value_info(loss_t, TensorProto.FLOAT, []),
               helper.make_tensor_value_info(FINITE, TensorProto.BOOL, [])]
    state = [(w, "weight") for w in weights] + [(m, "moment") for m in moments] + [(r, "bn") for r in bn_stats]
    state += [(STEP, "counter")]
    state += [(a, "accum" if a != ACCUM_COUNT else "counter") for a in accum_init]
    for name, kind in state:
        if kind == "accum" or name == ACCUM_COUNT:  # accumulate()'s next value already holds the update logic
            b.op("Identity", [new[name]], out=name + NEXT)
        else:
            gate = finite if kind == "bn" else applied  # BN statistics follow each finite forward
            b.op("Where", [gate, new[name], name], out=name + NEXT)
    if dynamic:
        state += [(SCALE, "scale"), (CLEAN, "counter")]
    elem_of = {STEP: TensorProto.INT64, CLEAN: TensorProto.INT64, ACCUM_COUNT: TensorProto.INT64}
    init = {}
    for name, kind in state:
        if kind in ("weight", "bn"):
            init[name] = values[name].astype(np.float32)
        elif kind in ("moment", "accum"):
            init[name] = np.zeros_like(values[moments.get(name) or accum_init[name]], dtype=np.float32)
        elif name == SCALE:
            init[name] = np.array(cfg["init_scale"], np.float32)
        else:
            init[name] = np.array(0, np.int64)
        outputs.append(helper.make_tensor_value_info(name + NEXT, elem_of.get(name, TensorProto.FLOAT),
                                                     list(init[name].shape)))
    if expose_grads:
        outputs += [helper.make_tensor_value_info(w + GRAD, TensorProto.FLOAT, list(values[w].shape))
                    for w in weights]
    del g.output[:]
    g.output.extend(outputs)
    _check_no_fp16_state(fwd, weights, path)
    check_runs(fwd, path, bf16=cfg["precision"] == "bf16")

    # --- inference graph for eval/export: the source model, trained tensors as inputs ----
    infer = copy.deepcopy(src)
    lift_to_inputs(infer, weights + bn_stats)

    shared = source.shared_weights(src, weights)
    warning = source.eval_export_warning(src, path)
    # a source that onnx's full check refuses (ONNX Runtime may run it all the same): its step
    # graph cannot pass that check either, so it gets the basic check (and the ORT load above)
    src_check = passes_full_check(src)
    if src_check is not None:
        try:
            onnx.checker.check_model(src)
        except onnx.checker.ValidationError as e:
            raise GraphmpError(f"{path}: the model fails onnx's checker ({str(e).strip().splitlines()[0][:200]}); "
                               "fix the model (onnx.checker.check_model names the problem), then build its "
                               "training step.") from None
    checked = [] if src_check is None else [
        f"{path}: the model fails onnx's full check ({src_check}); its step graph was checked with onnx's "
        "basic checker and loaded in ONNX Runtime"]
    meta = {
        "format": FORMAT, "source": os.path.abspath(path), "step_model": "step.onnx", "infer_model": "infer.onnx",
        "initial_state": "state.npz", "inputs": {n: dims(value_info(src, n)) for n in data_inputs},
        "input_types": {n: elem_name(src, n) for n in data_inputs},
        "label": {"name": label_name, "shape": label_dims, "dtype": "int64" if label_elem == TensorProto.INT64
                  else "float32"},
        "model_output": out_name, "loss_output": loss_t, "finite_output": FINITE,
        "state": [{"input": n, "output": n + NEXT, "kind": k} for n, k in state],
        "weights": weights, "bn_stats": bn_stats, "dynamic_scale": dynamic, "untied": untied,
        "constant_weights": constants, "shared_weights": shared,
        "warnings": ([warning] if warning else []) + checked,
        "grads": {w: w + GRAD for w in weights} if expose_grads else {},
        "nodes": {"forward": n_before, "total": len(g.node)}, "config": cfg,
        "convert": None if convert_report is None else {
            k: convert_report.get(k) for k in ("nodes", "casts_added", "fp32_by_reason", "calibration")},
    }
    write_run(out_dir, fwd, infer, init, meta, full=src_check is None)
    return meta


def _update(b: Builder, cfg: dict, grads: dict, loss_t: str, dynamic: bool):
    """Accumulation, finiteness, clipping, schedule, optimizer and loss-scale update.
    Returns ({state: new value ungated, "__moments__": {moment: weight}}, the `applied` flag
    gating weights/moments/step, this run's finite flag (gates BN statistics),
    {accumulation state: weight it mirrors (ACCUM_COUNT: None)})."""
    n = cfg["grad_accum"]
    accum_init, nxt = {}, {}
    if n > 1:
        micro_finite = optim.finite_flag(b, list(grads.values()) + [loss_t])
        grads, update, nxt = optim.accumulate(b, grads, n)
        window_finite = optim.finite_flag(b, list(grads.values()) + [loss_t])
        applied = b.op("And", [update, window_finite])
        # FINITE = update ? window_finite : micro_finite (ORT has no bool Where kernel)
        b.op("Or", [applied, b.op("And", [b.op("Not", [update]), micro_finite])], out=FINITE)
        accum_init = {w + ACCUM: w for w in grads}
        accum_init[ACCUM_COUNT] = None
    else:
        applied = finite = optim.finite_flag(b, list(grads.values()) + [loss_t], out=FINITE)
        micro_finite = finite
    if cfg["clip_norm"] is not None:
        grads = optim.clip(b, grads, cfg["clip_norm"])
    step_next = b.op("Add", [STEP, b.const(1, np.int64)])
    lr = optim.lr_tensor(b, cfg, STEP)
    new, moments = optim.optimizer(b, cfg, grads, lr, b.op("Cast", [step_next], to=TensorProto.FLOAT))
    new[STEP] = step_next
    new.update(nxt)
    new["__moments__"] = moments
    if dynamic:
        s_new, c_new = optim.scale_update(b, cfg, finite if n == 1 else window_finite, SCALE, CLEAN)
        if n > 1:  # S changes only when a window ends, so a window's gradients share one S
            b.op("Where", [update, s_new, SCALE], out=SCALE + NEXT)
            b.op("Where", [update, c_new, CLEAN], out=CLEAN + NEXT)
        else:
            b.op("Identity", [s_new], out=SCALE + NEXT)
            b.op("Identity", [c_new], out=CLEAN + NEXT)
    return new, applied, micro_finite, accum_init


def _check_no_fp16_state(model, weights, path):
    """The contract: masters are FP32 graph inputs (graphmp.convert keeps IO types)."""
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    bad = [w for w in weights if types.get(w) != TensorProto.FLOAT]
    if bad:
        raise GraphmpError(f"{path}: internal error: master weights {bad[:3]} are not FP32 inputs of the step graph")

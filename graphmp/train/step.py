"""build_step(): one loss-scaled optimizer step as an ordinary ONNX graph.

    FP32 master weights (inputs) -> [mixed/bf16: Casts placed by graphmp.convert]
      -> forward in training mode (BN batch statistics, Dropout on) -> loss (FP32, losses.py)
      -> backward seeded with the loss scale S -> gradients w.r.t. the masters (FP32)
      -> all flattened into one buffer (update.py) -> / S -> [accumulation over grad_accum runs]
      -> one all-finite flag
      -> [global-norm clipping] -> SGD / AdamW at the scheduled lr (optim.py)
      -> new state, applied only when finite -> S updated (dynamic scaling)

Only standard ONNX ops, so any current ONNX Runtime (CPU, CUDA, ...) runs it as an
InferenceSession: one `run` = one optimizer step (or one micro-batch with grad_accum > 1).

build_step takes a StepConfig (config.py; or the same keywords), then runs its phases in turn:
_load_source -> _forward_and_loss -> _select_weights -> _convert_precision -> _add_backward
-> lower_forward_convs (lower.py) -> _add_update -> _set_outputs -> _finish (checks, inference
graph, the run folder written).

State naming (per tensor, as train.json "state" lists it; the graph packs them, see below):
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
These are the logical state tensors (train.json "state"; state.npz and checkpoints hold them).
The step graph itself takes the FP32 ones as a few flat 1-D buffers (graphmp.train.flat,
train.json "flat"): flat__weights, flat__momentum or flat__exp_avg/_exp_avg_sq,
flat__bn_stats, flat__accum, each with its X__next output, and the scalars above as they
are; inside the graph every weight and BN statistic is a view of its buffer under its own
name. flat.pack() turns the logical state into the graph's feeds, flat.next_state() the
graph's outputs back into the logical state (loop.StepRunner does both).
Other inputs: the model's data inputs and `labels`. Other outputs: `loss` (FP32, unscaled,
the batch mean), `all_finite` (bool: the step was applied; with grad_accum > 1, on the
runs between updates: this run's gradients were finite), and with expose_grads=True
`<weight>__grad` (this run's unscaled, unclipped FP32 gradient, a view of flat__grad / S).

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
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import GraphmpError
from ..model_io import iter_graphs, load_model, tensor_array
from ..opset import upgrade
from ..passes.prepare import initializers_out_of_inputs
from . import losses, source
from .flat import WEIGHTS, pack
from .builder import (Builder, all_names, ancestors, dims, elem_name, lift_to_inputs, passes_full_check, producer,
                      prune, value_info)
from .config import PRECISIONS, StepConfig
from .losses import LOSS, LOSSES
from .lower import lower_forward_convs
from .optim import ACCUM_COUNT
from .ort_checks import calibration_batch, check_runs, prove_runs
from .runfiles import check_run_dir, write_run
from .source import NON_TRAINABLE
from .step_cost import precision_cost_of_build
from .update import CLEAN, FINITE, GRAD, NEXT, SCALE, STEP, State, add_update, initial_state, set_outputs
from .weight_checks import refuse_frozen_int8, small_weight_warning

MIN_OPSET = 13
FORMAT = 1

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


# old private names, kept for importers; names importers take from here
_Builder = Builder
_REEXPORTED = (LOSSES, NON_TRAINABLE, PRECISIONS)


# --- build_step: the phases --------------------------------------------------------------

def _needed_opset(model) -> int:
    """The opset the gradient rules need for this model: 13, or more for ops whose
    gradient uses a newer op (rules.NEEDS_OPSET)."""
    from .rules import NEEDS_OPSET
    ops = {n.op_type for g in iter_graphs(model.graph) for n in g.node}
    return max([MIN_OPSET] + [v for op, v in NEEDS_OPSET.items() if op in ops])


@dataclass
class _Source:
    """The source model as the step is built from it (_load_source gives it)."""
    path: str
    model: onnx.ModelProto      # upgraded, external data inline, Constant weights lifted, Identity ties undone
    raw: onnx.ModelProto        # as written (the opset upgrade may wrap a Softmax-11 in Flatten/Reshape)
    base: str                   # the model's folder (its external data)
    values: dict                # initializer -> numpy value
    legacy_consts: set          # tensors the rewrite of experimental ops made (not trained)
    constants: dict             # train.json "constant_weights"
    untied: list                # train.json "untied"
    out_name: str               # the tensor fed to the loss
    data_inputs: list


@dataclass
class _Forward:
    """The forward + loss graph, then the step graph being built (each phase adds to it)."""
    model: onnx.ModelProto
    measured: dict              # declare_measured's report (train.json "measured_shapes")
    label_dims: list
    label_elem: int
    running: dict               # BN running statistic -> its updated value
    loss_t: str
    weights: list = field(default_factory=list)     # trainable masters (graph inputs)
    bn_stats: list = field(default_factory=list)    # BN running statistics (graph inputs)
    convert_report: dict | None = None              # graphmp.convert's report (mixed, bf16)
    generated: dict | None = None                   # the generated batch (calibration_batch), made once
    forward_info: dict | None = None                # emitter.tensor_info of the forward + loss graph
    warnings: list = field(default_factory=list)    # train.json warnings about the loss's choices


_State = State  # the old private name


def _load_source(path: str, cfg: dict) -> _Source:
    """Needs the model path and cfg (output, label_name). Gives the source model read and
    upgraded to the opset the gradient rules need, its weights' values (external data
    brought inline: the run dir is self-contained), Constant weights lifted, Identity ties
    undone; sets cfg["output"] (default: the first graph output). Refuses a model graphmp
    converted, an output that is no tensor of it, and names the step graph needs."""
    src = load_model(path)
    if any(p.key == "graphmp" for p in src.metadata_props):
        raise GraphmpError(f"{path}: this model was already converted by graphmp; build the training step "
                           "from the FP32 source model (precision='mixed' converts it for you).")
    raw = src  # as written (the opset upgrade may wrap a Softmax-11 in Flatten/Reshape)
    source.dynamic_negative_dims(src)
    # ImageScaler/Crop/Affine (removed experimental ops) would stop the upgrade: standard ops first
    from .removed_ops import rewrite_experimental
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
    out_name = cfg["output"] = cfg["output"] or src.graph.output[0].name
    _check_names(src, path, out_name, cfg["label_name"])
    return _Source(path, src, raw, base, values, legacy_consts, constants, untied, out_name,
                   [v.name for v in src.graph.input])


def _check_names(src, path: str, out_name: str, label_name: str) -> None:
    """The loss's output is a tensor of the model; the names the step graph adds are not."""
    if out_name not in all_names(src):
        outs = [o.name for o in src.graph.output]
        raise GraphmpError(f"{path}: output '{out_name}' is not a tensor of the model; its outputs are {outs}.")
    for reserved in [label_name, LOSS, FINITE, STEP, SCALE, CLEAN, ACCUM_COUNT]:
        if reserved in all_names(src):
            raise GraphmpError(f"{path}: the model already has a tensor named '{reserved}', which the step "
                               "graph needs" + (" (choose another label_name)" if reserved == label_name else "."))


def _forward_graph(s: _Source, cfg: dict, shapes):
    """Needs the source and `shapes`. Gives (forward model, declare_measured's report): a copy
    of the source with LSTM/GRU unrolled over the sequence length the step is built for
    (static in the model or pinned by `shapes`; cfg["recurrent"]), or its inputs pinned to
    `shapes` when a gradient needs static lengths (cfg["pinned_shapes"]), and the ranks onnx
    inference loses measured in ONNX Runtime and declared (cfg["measured_shapes"])."""
    from .measure import declare_measured
    from .rnn import decompose_recurrent, pin_inputs
    fwd = copy.deepcopy(s.model)
    del fwd.graph.value_info[:]
    # LSTM/GRU have no gradient rule: the step graph then accepts only that sequence length
    fwd, unrolled = decompose_recurrent(fwd, shapes=shapes, where=s.path)
    if unrolled:
        cfg["recurrent"] = unrolled  # train.json: which LSTM/GRU nodes, sequence length, nodes added
    elif shapes and any(_needs_static_lengths(n) for n in fwd.graph.node):
        # Resize / SAME-padding gradients need the input lengths, which --shapes gives
        pin_inputs(fwd, shapes)
        cfg["pinned_shapes"] = shapes if isinstance(shapes, str) else {k: list(v) for k, v in shapes.items()}
    _redeclare_output_rank(fwd, s, cfg)
    # ranks that onnx inference loses (a Reshape to a computed shape): measured in ONNX Runtime at
    # the build's shapes and declared, dims only where they do not follow the free input dims
    measured = declare_measured(fwd, shapes, where=s.path, base_dir=s.base,
                                need_static=_static_length_tensors(fwd, cfg))
    if measured["tensors"] or measured["note"]:
        cfg["measured_shapes"] = measured  # train.json: how many tensors, at which shapes, or why not
    return fwd, measured


def _redeclare_output_rank(fwd, s: _Source, cfg: dict) -> None:
    """An exporter may declare the loss's output with a rank the graph does not give (ddddocr's
    CTC logits declared [1, seqlen], computed [T, 1, V]). Where onnx inference, without the
    declaration, finds another rank, the forward graph declares what inference found; the
    build then shapes labels and loss after the real output, and train.json says so
    (cfg["output_redeclared"], turned into a warning)."""
    out = next((o for o in fwd.graph.output if o.name == s.out_name), None)
    declared = dims(out)
    if out is None or declared is None:
        return
    probe = copy.deepcopy(fwd)
    for o in probe.graph.output:
        if o.name == s.out_name:
            o.type.tensor_type.ClearField("shape")
    try:
        g = onnx.shape_inference.infer_shapes(probe).graph
    except Exception:  # noqa: BLE001 - onnx inference fails on many exports; keep what is declared
        return
    inferred = next((dims(v) for v in list(g.output) + list(g.value_info) if v.name == s.out_name), None)
    if inferred is None or len(inferred) == len(declared):
        return
    out.type.tensor_type.ClearField("shape")
    out.type.tensor_type.shape.dim.extend(
        onnx.TensorShapeProto.Dimension(**({"dim_value": d} if isinstance(d, int) else {"dim_param": d or ""}))
        for d in inferred)
    cfg["output_redeclared"] = {"declared": declared, "graph_gives": inferred}


def _output_dims(s: _Source, fwd, cfg: dict) -> list | None:
    """Needs the source and the forward graph. Gives the dims of the output fed to the loss,
    refusing one that is not FP32, and (cross-entropy) one that comes out of a Softmax."""
    path, out_name = s.path, s.out_name
    out_vi = value_info(s.model, out_name)
    if dims(out_vi) is None or "output_redeclared" in cfg:  # measured, or declared again from the graph
        out_vi = value_info(fwd, out_name) or out_vi
    if out_vi is not None and out_vi.type.tensor_type.elem_type != TensorProto.FLOAT:
        floats = [o.name for o in s.model.graph.output if o.type.tensor_type.elem_type == TensorProto.FLOAT]
        fix = (f"name an FP32 output with --model-output ({', '.join(floats[:4])})" if floats else
               "name an FP32 tensor inside the model with --model-output, or train from the FP32 model")
        kind = TensorProto.DataType.Name(out_vi.type.tensor_type.elem_type)
        raise GraphmpError(f"{path}: output '{out_name}' is {kind}, not FP32, so no loss can train through it; "
                           f"{fix}.")
    soft = producer(s.raw, out_name, through_identity=True) or producer(s.model, out_name, through_identity=True)
    if cfg["loss"] == "cross-entropy" and soft is not None and soft.op_type in ("Softmax", "LogSoftmax"):
        raise GraphmpError(f"{path}: output '{out_name}' comes from a {soft.op_type}; cross-entropy needs the "
                           f"logits. Pass output=<the tensor before it> (--model-output {soft.input[0]}).")
    return dims(out_vi)


def _forward_and_loss(s: _Source, cfg: dict, config: StepConfig) -> _Forward:
    """Needs the source and the config (shapes, bn_momentum, the loss's keys). Gives the forward
    graph in training mode (BN batch statistics, Dropout on) ending in the FP32 loss, with the
    labels' shape and type (sets cfg["label_shape"], cfg["num_classes"])."""
    from .autodiff import training_forward
    from .measure import with_measure_note
    fwd, measured = _forward_graph(s, cfg, config.shapes)
    out_dims = _output_dims(s, fwd, cfg)
    label_dims, label_elem = losses.label_spec(cfg, out_dims, s.path)
    cfg["label_shape"] = label_dims
    bn_kw = {} if config.bn_momentum is None else {"momentum": config.bn_momentum}
    try:
        running = training_forward(fwd, **bn_kw)  # {running stat: its updated value}
    except GraphmpError as e:
        raise with_measure_note(e, measured, s.path) from None
    loss_t = losses.add_loss(fwd, Builder(fwd), cfg, out_dims, label_dims, label_elem)
    notes = [losses.class_axis_warning(cfg, out_dims, s.path)]
    if running and config.bn_momentum is not None and config.bn_momentum < 0.5:  # torch's convention?
        notes.append(f"{s.path}: bn_momentum {config.bn_momentum:g} keeps {config.bn_momentum:g} of the old BatchNorm "
                     f"running statistics a step (ONNX's convention); torch's momentum={config.bn_momentum:g} is "
                     f"bn_momentum {1 - config.bn_momentum:g}")
    redeclared = cfg.pop("output_redeclared", None)
    if redeclared:
        notes.append(f"{s.path}: output '{s.out_name}' is declared {redeclared['declared']} but the graph gives "
                     f"{redeclared['graph_gives']}; labels and loss follow the graph ({out_dims})")
    return _Forward(fwd, measured, label_dims, label_elem, running, loss_t, warnings=[n for n in notes if n])


def _select_weights(s: _Source, f: _Forward, trainable: str | None) -> None:
    """Needs the forward + loss graph. Sets f.weights (every FP32 initializer the loss depends
    on, matching `trainable` or else with at least one axis; not BN statistics, op parameters
    or legacy constants) and f.bn_stats, lifts both to graph inputs, makes the loss and the
    updated BN statistics the outputs and prunes what they do not need (other heads)."""
    fwd, values = f.model, s.values
    deps = ancestors(fwd.graph, f.loss_t)
    rx = re.compile(trainable) if trainable else None
    fixed = source.non_trainable_slots(fwd) | s.legacy_consts
    refuse_frozen_int8(s, f, deps, trainable)
    f.weights = [t.name for t in s.model.graph.initializer
                 if t.data_type == TensorProto.FLOAT and t.name in deps and t.name not in f.running
                 and t.name not in fixed and (rx.search(t.name) if rx else values[t.name].ndim >= 1)]
    if not f.weights:
        raise GraphmpError(f"{s.path}: no trainable FP32 initializer feeds output '{s.out_name}'"
                           + (f" matching trainable='{trainable}'" if trainable else "")
                           + source.subgraph_weights_note(s.model) + ".")
    f.bn_stats = [n for n in f.running if n in values]
    lift_to_inputs(fwd, f.weights + f.bn_stats)
    # the loss's output keeps its declaration (measured, or redeclared from the graph) as
    # value_info: a Resize to sizes computed at run time gets its output lengths from it,
    # which onnx inference alone gives with a fresh batch symbol (its gradient then refuses)
    known = {v.name for v in fwd.graph.value_info}
    kept = [copy.deepcopy(o) for o in fwd.graph.output if o.name == s.out_name and o.name not in known]
    fwd.graph.value_info.extend(kept)
    if kept and not _agrees_with_inference(fwd):
        # ONNX's inference computes other lengths than ONNX Runtime ran (a ConvTranspose with
        # SAME padding and output_padding: 11 vs 10): the declaration would fail the checker
        del fwd.graph.value_info[len(fwd.graph.value_info) - len(kept):]
    del fwd.graph.output[:]
    fwd.graph.output.append(helper.make_tensor_value_info(f.loss_t, TensorProto.FLOAT, []))
    for r in f.bn_stats:
        fwd.graph.output.append(helper.make_tensor_value_info(f.running[r], TensorProto.FLOAT,
                                                              list(values[r].shape)))
    prune(fwd)


def _agrees_with_inference(model) -> bool:
    """ONNX's strict shape inference accepts the model's declarations."""
    try:
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except onnx.shape_inference.InferenceError:
        return False
    return True


def _convert_precision(s: _Source, f: _Forward, cfg: dict, config: StepConfig) -> None:
    """Needs the pruned forward + loss graph. precision mixed/bf16: the convert pipeline assigns
    every op's precision (keep_io_types: the masters stay FP32 inputs), calibrated on
    config.calibration or a generated batch with the real weights; sets f.model and
    f.convert_report. fp32: nothing."""
    if cfg["precision"] not in ("mixed", "bf16"):
        return
    from ..convert import convert
    from .measure import declared_dims, redeclare
    cal = config.calibration
    if cal is None:
        f.generated = calibration_batch(s.model, s.base, config.shapes, s.path, cfg, f.label_dims, f.label_elem, {})
        cal = [{**f.generated, **{w: s.values[w] for w in f.weights + f.bn_stats}}]
    carried = declared_dims(f.model) if f.measured["tensors"] else {}
    # island_trials=0: the measured-islands step prices a node's Casts against its forward
    # FLOPs only; in a step graph each node's precision also sets its backward's (about twice
    # the forward's work), so training keeps paint's plan
    rep = convert(f.model, calibration=cal, keep_io_types=True, island_trials=0,
                  **({"target": "bf16"} if cfg["precision"] == "bf16" else {}))
    f.model, f.convert_report = rep.model, rep.to_dict()
    if carried:  # convert re-derives value_info, dropping what was measured: declared again
        redeclare(f.model, carried)


def _add_backward(s: _Source, f: _Forward, cfg: dict, expose_grads: bool) -> tuple[Builder, dict, _State]:
    """Needs the (converted) forward + loss graph. Adds the loss-scale and step-counter inputs
    and the backward seeded with the scale S; gives (the builder, {weight: FP32 gradient
    scaled by S}, the state with its counts and st.scale)."""
    from .autodiff import add_backward, batchnorm_params_to_x_type, tensor_info
    from .measure import with_measure_note
    b, g = Builder(f.model), f.model.graph
    st = _State(dynamic=cfg["loss_scale"] == "dynamic", n_before=0)
    if st.dynamic:
        g.input.append(helper.make_tensor_value_info(SCALE, TensorProto.FLOAT, []))
        g.input.append(helper.make_tensor_value_info(CLEAN, TensorProto.INT64, []))
        scale = SCALE
    else:
        scale = b.const(cfg["loss_scale"])
    g.input.append(helper.make_tensor_value_info(STEP, TensorProto.INT64, []))
    st.n_before = len(g.node)
    f.forward_info = tensor_info(f.model)  # the backward's and lower_forward_convs' shapes
    try:
        grads_scaled = add_backward(f.model, f.loss_t, f.weights, seed=scale, info=f.forward_info)
    except GraphmpError as e:
        raise with_measure_note(e, f.measured, s.path) from None
    if f.convert_report is not None:  # FP16 X with FP32 parameters has no CUDA kernel
        n = len(g.node)
        batchnorm_params_to_x_type(f.model)
        st.n_before += len(g.node) - n  # the nodes it adds compute forward [C] vectors
    missing = [w for w in f.weights if w not in grads_scaled]
    if missing:
        raise GraphmpError(f"{s.path}: no gradient was produced for {missing}")
    st.scale = scale  # the update unscales the gradients through its scalars (update.py)
    return b, grads_scaled, st


def _add_update(s: _Source, f: _Forward, cfg: dict, grads: dict, st: _State) -> None:
    """Needs the scaled gradients. Adds the update over flat buffers (update.py: unscale,
    accumulation, finiteness, clipping, schedule, optimizer, loss scale, the gated next
    state) and fills the state: st.pairs (per tensor, train.json "state"), st.flat (the
    buffers the step graph takes), st.init (per tensor, state.npz)."""
    shapes = {n: s.values[n].shape for n in f.weights + f.bn_stats}
    add_update(f.model, cfg, f.loss_t, f.weights, {r: f.running[r] for r in f.bn_stats}, grads, st, shapes,
               s.path)
    st.init = initial_state(s.values, st, cfg)


def _set_outputs(f: _Forward, st: _State, expose_grads: bool) -> None:
    """The step graph's outputs: loss, all_finite, every X__next of its state, then
    <weight>__grad with expose_grads (update.set_outputs)."""
    set_outputs(f.model, f.loss_t, st, expose_grads)


def _source_check_warnings(s: _Source) -> tuple[list, str | None]:
    """(train.json warnings about the source, onnx's full-check failure or None). A source
    that onnx's full check refuses (ONNX Runtime may run it all the same): its step graph
    cannot pass that check either, so it gets the basic check (and the ORT load)."""
    path = s.path
    warning = source.eval_export_warning(s.model, path)
    src_check = passes_full_check(s.model)
    if src_check is not None:
        try:
            onnx.checker.check_model(s.model)
        except onnx.checker.ValidationError as e:
            raise GraphmpError(f"{path}: the model fails onnx's checker ({str(e).strip().splitlines()[0][:200]}); "
                               "fix the model (onnx.checker.check_model names the problem), then build its "
                               "training step.") from None
    checked = [] if src_check is None else [
        f"{path}: the model fails onnx's full check ({src_check}); its step graph was checked with onnx's "
        "basic checker and loaded in ONNX Runtime"]
    return ([warning] if warning else []) + checked, src_check


def _meta(s: _Source, f: _Forward, st: _State, cfg: dict, expose_grads: bool, warnings: list) -> dict:
    """The train.json dict of the built step (names, shapes, config, source path)."""
    src, weights = s.model, f.weights
    return {
        "format": FORMAT, "source": os.path.abspath(s.path), "step_model": "step.onnx", "infer_model": "infer.onnx",
        "initial_state": "state.npz", "inputs": {n: dims(value_info(src, n)) for n in s.data_inputs},
        "input_types": {n: elem_name(src, n) for n in s.data_inputs},
        "label": {"name": cfg["label_name"], "shape": f.label_dims,
                  "dtype": "int64" if f.label_elem == TensorProto.INT64 else "float32"},
        "model_output": s.out_name, "loss_output": f.loss_t, "finite_output": FINITE,
        "state": [{"input": n, "output": n + NEXT, "kind": k} for n, k in st.pairs],
        "weights": weights, "bn_stats": f.bn_stats, "dynamic_scale": st.dynamic, "untied": s.untied,
        "constant_weights": s.constants, "shared_weights": source.shared_weights(src, weights),
        "warnings": warnings,
        "grads": {w: w + GRAD for w in weights} if expose_grads else {},
        "nodes": {"forward": st.n_before, "update": st.n_update, "total": len(f.model.graph.node)}, "config": cfg,
        "flat": st.flat,
        "convert": None if f.convert_report is None else {
            k: f.convert_report.get(k) for k in ("nodes", "casts_added", "fp32_by_reason", "calibration")},
    }


def _finish(s: _Source, f: _Forward, st: _State, cfg: dict, config: StepConfig, out_dir: str) -> dict:
    """Needs the finished step graph. Checks it (FP32 masters; ONNX Runtime loads and runs
    it), makes the inference graph for eval/export (the source model, trained tensors as
    inputs) and writes the run (train.json last); gives the train.json dict."""
    _check_no_fp16_state(f.model, [WEIGHTS], s.path)
    _generated_batch(s, f, cfg, config)  # before the load: a label shape the real output contradicts says so
    check_runs(f.model, s.path, bf16=cfg["precision"] == "bf16")
    infer = copy.deepcopy(s.model)
    lift_to_inputs(infer, f.weights + f.bn_stats)
    if f.generated is not None:
        packed = pack({"state": [{"input": n} for n, _ in st.pairs], "flat": st.flat}, st.init)
        prove_runs(f.model, infer, s.path, f.generated, {**st.init, **packed}, f.weights + f.bn_stats,
                   bf16=cfg["precision"] == "bf16")
    warnings, src_check = _source_check_warnings(s)
    meta = _meta(s, f, st, cfg, config.expose_grads, f.warnings + warnings)
    meta["precision_cost"] = precision_cost_of_build(f.model, f.generated)
    write_run(out_dir, f.model, infer, st.init, meta, full=src_check is None)
    return meta


def _generated_batch(s: _Source, f: _Forward, cfg: dict, config: StepConfig) -> None:
    """Needs the loss's label shape. Sets f.generated (once): a generated batch of the build's
    shapes with labels shaped after the output it really gives (calibration_batch), which
    proves the finished graphs (ort_checks.prove_runs). A label shape that output contradicts
    (an exporter's declared shape that is not the real one) is the build's error, naming the
    --label-shape that fits; a source that cannot run on generated inputs (its inputs need
    real values) leaves the proof to the first batch."""
    if f.generated is not None:
        return
    try:
        f.generated = calibration_batch(s.model, s.base, config.shapes, s.path, cfg, f.label_dims, f.label_elem, {})
    except losses.LabelMismatch:
        raise
    except GraphmpError:
        f.generated = None


def _resolve_config(config: StepConfig | None, options: dict, path: str) -> StepConfig:
    """The StepConfig build_step runs with: `config` (default: all defaults) with `options`
    on top, converted and checked (errors start with the model path)."""
    if config is not None and not isinstance(config, StepConfig):
        raise TypeError(f"build_step(): config must be a StepConfig (StepConfig.from_kwargs(...)), "
                        f"not {type(config).__name__}")
    base = config.as_kwargs() if config is not None else {}
    return StepConfig.from_kwargs(path, **{**base, **options})


# --- build_step ------------------------------------------------------------------------

def build_step(model, out_dir, config: StepConfig | None = None, **options) -> dict:
    """Write the training step for an FP32 model (path) to out_dir; return the train.json dict.

    The options: a StepConfig (graphmp.train.config), or keywords (StepConfig's fields, the
    flags of `graphmp train-graph`; on top of `config` when both are given). Checked before
    any work: an unknown one is a TypeError, a bad value a GraphmpError naming it.

    loss: "cross-entropy" (integer class labels; class_axis, ignore_index, label_smoothing,
    class_weights as torch's F.cross_entropy, see losses.py) or "mse" (mean over all
    elements). output: the model tensor fed to the loss (default: the first graph output; any
    intermediate tensor, e.g. the logits before a final Softmax, works). label_shape: e.g.
    ["N"] (default: the output's shape, without the class axis for cross-entropy). trainable:
    regex over initializer names (default: every FP32 initializer with at least one axis that
    the loss depends on, except BN running statistics and op parameters). loss_scale:
    "dynamic" (starts at init_scale) or a number (static).
    lr_schedule "constant" | "linear" | "cosine" with warmup_steps / total_steps (optim.py),
    grad_accum: optimizer update every grad_accum runs, on the mean gradient.
    precision "mixed": the forward+loss graph goes through graphmp.convert (keep_io_types, so the
    masters stay FP32 inputs with Casts to FP16 inside); "bf16": the same with target bf16 and
    no loss scaling, refused when this machine's ONNX Runtime cannot run it. calibration: as
    for convert, default a generated batch (shapes from `shapes` or a trial run) with the real
    weights. The backward takes each op's precision from it. force: replace a run in a
    non-empty out_dir (else refused).
    """
    path, out_dir = os.fspath(model), os.fspath(out_dir)
    config = _resolve_config(config, options, path)
    cfg = config.to_json_dict()  # train.json "config"; the phases add what they find
    check_run_dir(out_dir, config.force, path, config.calibration)
    s = _load_source(path, cfg)
    f = _forward_and_loss(s, cfg, config)
    _select_weights(s, f, config.trainable)
    small_weight_warning(s, f, cfg)
    _convert_precision(s, f, cfg, config)
    _, grads, st = _add_backward(s, f, cfg, config.expose_grads)
    st.n_before += lower_forward_convs(f.model, st.n_before, f.forward_info)
    _add_update(s, f, cfg, grads, st)
    _set_outputs(f, st, config.expose_grads)
    return _finish(s, f, st, cfg, config, out_dir)


def _check_no_fp16_state(model, weights, path):
    """The contract: masters are FP32 graph inputs (graphmp.convert keeps IO types)."""
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    bad = [w for w in weights if types.get(w) != TensorProto.FLOAT]
    if bad:
        raise GraphmpError(f"{path}: internal error: master weights {bad[:3]} are not FP32 inputs of the step graph")

"""build_step(): one loss-scaled optimizer step as an ordinary ONNX graph.

    FP32 master weights (inputs) -> [mixed: Casts to FP16 placed by graphmp.convert]
      -> forward in training mode (BN batch statistics, Dropout on) -> loss (FP32)
      -> backward seeded with the loss scale S -> gradients w.r.t. the masters (FP32)
      -> / S -> one all-finite flag -> [global-norm clipping] -> SGD / AdamW
      -> new state, applied only when finite -> S updated (dynamic scaling)

Only standard ONNX ops, so any current ONNX Runtime (CPU, CUDA, ...) runs it as an
InferenceSession: one `run` = one optimizer step.

State naming (every state tensor is a graph input AND a graph output):
    input X                      -> output  X + NEXT ("X__next")
    <weight>                     trainable FP32 master weight (the model's initializer name)
    <weight>__momentum           SGD momentum buffer (momentum > 0)
    <weight>__exp_avg/_exp_avg_sq  AdamW moments (torch's names)
    <bn running mean/var>        BatchNormalization running statistics (not trainable)
    optimizer_step               int64 [], optimizer steps applied (skipped steps do not count)
    loss_scale                   float32 [], S (dynamic scaling only; static S is a constant)
    loss_scale_clean_steps       int64 [], finite steps since S last changed (dynamic only)
Other inputs: the model's data inputs and `labels`. Other outputs: `loss` (FP32, unscaled,
the batch mean), `all_finite` (bool: the step was applied), and with expose_grads=True
`<weight>__grad` (the unscaled, unclipped FP32 gradient).

A skipped step (some gradient inf/NaN) leaves every state tensor unchanged except the
scale and its counter; BN running statistics are not updated either.

Trainable by default: every FP32 initializer with at least one axis that the loss depends
on, except BN running statistics and op parameters (Resize scales, Clip bounds, ...; see
NON_TRAINABLE). `b = Identity(a)` of an initializer (torch.onnx's de-duplication of equal
parameters) is untied first. Nodes the loss does not need (other heads) are pruned.

run_dir layout: step.onnx, state.npz (initial state), infer.onnx (the FP32 inference
model with the trained tensors as inputs: eval and export use it), train.json (names,
shapes, config, source path). train.json is written last, so a run dir that has it is
complete; every file is written atomically.
"""
from __future__ import annotations

import copy
import itertools
import os
import re

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import GraphmpError
from ..io import iter_graphs, load_model, save_model, save_npz, tensor_array, write_json
from ..opset import upgrade
from ..passes.prepare import initializers_out_of_inputs

NEXT = "__next"
GRAD = "__grad"
STEP = "optimizer_step"
SCALE = "loss_scale"
CLEAN = "loss_scale_clean_steps"
LOSS = "loss"
FINITE = "all_finite"
MIN_OPSET = 13
FORMAT = 1

LOSSES = ("cross-entropy", "mse")
OPTIMIZERS = ("adamw", "sgd")
PRECISIONS = ("mixed", "fp32")


# --- small helpers ---------------------------------------------------------------------

class _Builder:
    """Appends nodes and constant initializers to a graph with unique names."""

    def __init__(self, model: onnx.ModelProto, prefix: str = "train_step"):
        self.g = model.graph
        self.prefix = prefix
        self.taken = _all_names(model)
        self.count = itertools.count()

    def name(self, hint: str) -> str:
        while True:
            n = f"{self.prefix}/{hint}_{next(self.count)}"
            if n not in self.taken:
                self.taken.add(n)
                return n

    def const(self, value, dtype=np.float32) -> str:
        name = self.name("const")
        self.g.initializer.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs, out: str | None = None, **attrs) -> str:
        out = out or self.name(op_type)
        self.g.node.append(helper.make_node(op_type, list(inputs), [out], name=self.name(op_type + "_node"),
                                            **attrs))
        return out


def _all_names(model) -> set:
    names = set()
    for g in iter_graphs(model.graph):
        names.update(t.name for t in g.initializer)
        names.update(v.name for v in itertools.chain(g.input, g.output, g.value_info))
        for n in g.node:
            names.update(n.input)
            names.update(n.output)
            names.add(n.name)
    names.discard("")
    return names


def _value_info(model, name):
    """ValueInfoProto of tensor `name` (graph input/output or inferred)."""
    for v in itertools.chain(model.graph.input, model.graph.output, model.graph.value_info):
        if v.name == name:
            return v
    inferred = onnx.shape_inference.infer_shapes(model)
    for v in itertools.chain(inferred.graph.value_info, inferred.graph.output):
        if v.name == name:
            return v
    return None


def _dims(vi) -> list:
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in vi.type.tensor_type.shape.dim]


def _ancestors(graph, target: str) -> set:
    """Every tensor `target` depends on (main graph; subgraph captures included)."""
    prod = {o: n for n in graph.node for o in n.output}
    seen, todo = set(), [target]
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        n = prod.get(t)
        if n is None:
            continue
        todo.extend(x for x in n.input if x)
        for a in n.attribute:
            for sg in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                for sn in sg.node:
                    todo.extend(x for x in sn.input if x)
    return seen


def lift_to_inputs(model: onnx.ModelProto, names) -> None:
    """Turn initializers `names` into graph inputs of the same name, type and shape (in place)."""
    names = list(names)
    wanted = set(names)
    by_name = {t.name: t for t in model.graph.initializer}
    for n in names:
        t = by_name[n]
        model.graph.input.append(helper.make_tensor_value_info(n, t.data_type, list(t.dims)))
    keep = [t for t in model.graph.initializer if t.name not in wanted]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)


def _save_onnx(model, path):
    onnx.checker.check_model(model, full_check=True)
    save_model(model, path, None, None, external=False)


# --- the pieces of the step ----------------------------------------------------------

def _add_loss(model, b: _Builder, output: str, loss: str, label_name: str, label_shape, label_elem) -> str:
    """labels input + loss nodes appended; returns the (FP32 scalar) loss tensor name."""
    model.graph.input.append(helper.make_tensor_value_info(label_name, label_elem, label_shape))
    if loss == "cross-entropy":
        model.graph.node.append(helper.make_node("SoftmaxCrossEntropyLoss", [output, label_name], [LOSS],
                                                 name=b.name("SoftmaxCrossEntropyLoss"), reduction="mean"))
    else:
        d = b.op("Sub", [output, label_name])
        b.op("ReduceMean", [b.op("Mul", [d, d])], out=LOSS, keepdims=0)
    return LOSS


def _finite_flag(b: _Builder, tensors) -> str:
    """One bool scalar: True iff every element of every tensor is finite.

    Each tensor contributes ReduceSum(t * 0): exactly 0 when t is finite, NaN as soon as
    one element is inf or NaN (inf * 0 = NaN). Sum of those is NaN iff any is. Unlike a
    plain ReduceSum(t), this cannot report a false overflow when a large finite sum
    exceeds the FP32 range, and it needs only ops every runtime has (Mul, ReduceSum, Sum,
    IsNaN, Not) in any float type."""
    zero = b.const(0.0)
    parts = [b.op("ReduceSum", [b.op("Mul", [t, zero])], keepdims=0) for t in tensors]
    total = parts[0] if len(parts) == 1 else b.op("Sum", parts)
    return b.op("Not", [b.op("IsNaN", [total])], out=FINITE)


def _clip(b: _Builder, grads: dict, max_norm: float) -> dict:
    """torch.nn.utils.clip_grad_norm_: g *= min(1, max_norm / (||g||_2 + 1e-6)), global norm."""
    sq = [b.op("ReduceSumSquare", [g], keepdims=0) for g in grads.values()]
    norm = b.op("Sqrt", [sq[0] if len(sq) == 1 else b.op("Sum", sq)])
    coef = b.op("Div", [b.const(max_norm), b.op("Add", [norm, b.const(1e-6)])])
    coef = b.op("Min", [coef, b.const(1.0)])
    return {w: b.op("Mul", [g, coef]) for w, g in grads.items()}


def _optimizer(b: _Builder, cfg: dict, grads: dict, step_next_f: str) -> tuple[dict, dict]:
    """Returns ({state input: new value (ungated)}, {state input: initial array-maker kind})."""
    new, moments = {}, {}
    lr, wd = cfg["lr"], cfg["weight_decay"]
    if cfg["optimizer"] == "sgd":
        mom = cfg["momentum"]
        for w, g in grads.items():
            if wd:
                g = b.op("Add", [g, b.op("Mul", [w, b.const(wd)])])
            if mom:
                buf = w + "__momentum"
                g = b.op("Add", [b.op("Mul", [buf, b.const(mom)]), g])
                new[buf] = g
                moments[buf] = w
            new[w] = b.op("Sub", [w, b.op("Mul", [g, b.const(lr)])])
        return new, moments
    b1, b2 = cfg["betas"]
    eps = cfg["eps"]
    # bias corrections from the new step count t (as torch: step is incremented first)
    bc1 = b.op("Sub", [b.const(1.0), b.op("Pow", [b.const(b1), step_next_f])])
    bc2 = b.op("Sub", [b.const(1.0), b.op("Pow", [b.const(b2), step_next_f])])
    step_size = b.op("Div", [b.const(lr), bc1])
    bc2_sqrt = b.op("Sqrt", [bc2])
    for w, g in grads.items():
        m, v = w + "__exp_avg", w + "__exp_avg_sq"
        decayed = b.op("Mul", [w, b.const(1.0 - lr * wd)]) if wd else w
        m_new = b.op("Add", [b.op("Mul", [m, b.const(b1)]), b.op("Mul", [g, b.const(1.0 - b1)])])
        v_new = b.op("Add", [b.op("Mul", [v, b.const(b2)]),
                             b.op("Mul", [b.op("Mul", [g, g]), b.const(1.0 - b2)])])
        denom = b.op("Add", [b.op("Div", [b.op("Sqrt", [v_new]), bc2_sqrt]), b.const(eps)])
        new[w] = b.op("Sub", [decayed, b.op("Mul", [b.op("Div", [m_new, denom]), step_size])])
        new[m], new[v] = m_new, v_new
        moments[m] = moments[v] = w
    return new, moments


def _scale_update(b: _Builder, cfg: dict, finite: str) -> dict:
    """Dynamic loss scale (torch GradScaler semantics, plus floor and cap):
    overflow -> S = max(S * backoff, min_scale), clean = 0;
    finite   -> clean += 1; if clean >= growth_interval: S = min(S * growth, max_scale), clean = 0."""
    clean1 = b.op("Add", [CLEAN, b.const(1, np.int64)])
    grow = b.op("GreaterOrEqual", [clean1, b.const(cfg["growth_interval"], np.int64)])
    grown = b.op("Min", [b.op("Mul", [SCALE, b.const(cfg["growth"])]), b.const(cfg["max_scale"])])
    s_ok = b.op("Where", [grow, grown, SCALE])
    c_ok = b.op("Where", [grow, b.const(0, np.int64), clean1])
    s_bad = b.op("Max", [b.op("Mul", [SCALE, b.const(cfg["backoff"])]), b.const(cfg["min_scale"])])
    return {SCALE: b.op("Where", [finite, s_ok, s_bad], out=SCALE + NEXT),
            CLEAN: b.op("Where", [finite, c_ok, b.const(0, np.int64)], out=CLEAN + NEXT)}


# --- build_step ------------------------------------------------------------------------

def _validate_config(cfg: dict, path: str):
    def bad(msg):
        raise GraphmpError(f"{path}: {msg}")
    if cfg["loss"] not in LOSSES:
        bad(f"loss must be one of {LOSSES}, not '{cfg['loss']}'")
    if cfg["optimizer"] not in OPTIMIZERS:
        bad(f"optimizer must be one of {OPTIMIZERS}, not '{cfg['optimizer']}'")
    if cfg["precision"] not in PRECISIONS:
        bad(f"precision must be one of {PRECISIONS}, not '{cfg['precision']}'")
    if not cfg["lr"] > 0:
        bad(f"lr must be > 0 (got {cfg['lr']})")
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


def _label_spec(cfg, out_dims, path):
    """(shape, elem type) of the labels input."""
    shape = cfg["label_shape"]
    if shape is None:
        if out_dims is None or not out_dims:
            raise GraphmpError(f"{path}: the shape of output '{cfg['output']}' is unknown; give label_shape "
                               "(e.g. --label-shape N for class indices of a batch of N).")
        shape = [out_dims[0]] + out_dims[2:] if cfg["loss"] == "cross-entropy" else list(out_dims)
        shape = [d if d is not None else f"label_dim{i}" for i, d in enumerate(shape)]
    shape = [int(d) if isinstance(d, str) and d.isdigit() else d for d in shape]
    elem = TensorProto.INT64 if cfg["loss"] == "cross-entropy" else TensorProto.FLOAT
    return shape, elem


def _needed_opset(model) -> int:
    """The opset the gradient rules need for this model: 13, or more for ops whose
    gradient uses a newer op (rules.NEEDS_OPSET)."""
    from .rules import NEEDS_OPSET
    ops = {n.op_type for g in iter_graphs(model.graph) for n in g.node}
    return max([MIN_OPSET] + [v for op, v in NEEDS_OPSET.items() if op in ops])


def _calibration_batch(src, base_dir, shapes, path, label_name, label_dims, label_elem, state) -> dict:
    """One generated batch for the mixed conversion of the step's forward: the model's
    inputs (shapes that run, batch 2 where the model allows it), zero labels of the
    matching shape, and the real weights and BatchNorm statistics (`state`)."""
    from ..inputs import find_shapes
    from ..oracle import runner
    plan = find_shapes(src, runner(src, base_dir=base_dir), shapes, where=path)
    batch = 2 if plan.batch_free else None
    feeds = plan.feeds(0, batch=batch)
    sizes = {d: n for s in plan.specs for d, n in zip(s.dims, feeds[s.name].shape) if isinstance(d, str)}
    label = [d if isinstance(d, int) else sizes.get(d, batch or 1) for d in label_dims]
    feeds[label_name] = np.zeros(label, dtype=helper.tensor_dtype_to_np_dtype(label_elem))
    feeds.update(state)
    return feeds


def build_step(model, out_dir, *, loss: str = "cross-entropy", label_shape=None, label_name: str = "labels",
               optimizer: str = "adamw", lr: float = 1e-3, momentum: float = 0.9, betas=(0.9, 0.999),
               eps: float = 1e-8, weight_decay: float = 0.0, clip_norm: float | None = None,
               loss_scale="dynamic", init_scale: float = 2.0**16, growth_interval: int = 2000,
               backoff: float = 0.5, growth: float = 2.0, min_scale: float = 1.0, max_scale: float = 2.0**24,
               precision: str = "mixed", output: str | None = None, trainable: str | None = None,
               calibration=None, shapes=None, expose_grads: bool = False,
               bn_momentum: float | None = None) -> dict:
    """Write the training step for an FP32 model (path) to out_dir; return the train.json dict.

    loss: "cross-entropy" (integer class labels, SoftmaxCrossEntropyLoss over axis 1 of `output`)
    or "mse" (mean over all elements). output: the model tensor fed to the loss (default: the
    first graph output; any intermediate tensor, e.g. the logits before a final Softmax, works).
    label_shape: e.g. ["N"] (default: derived from `output`). trainable: regex over initializer
    names (default: every float initializer the loss depends on, except BN running statistics).
    loss_scale: "dynamic" (starts at init_scale) or a number (static: never changes).
    precision "mixed": the forward+loss graph goes through graphmp.convert (keep_io_types, so the
    masters stay FP32 inputs with Casts to FP16 inside); calibration: as for convert, default a
    generated batch (shapes from `shapes` or a trial run, graphmp.inputs) with the real weights.
    The backward takes each op's precision from it.
    """
    from .autodiff import add_backward, training_forward

    path = os.fspath(model)
    cfg = dict(loss=loss, label_shape=list(label_shape) if label_shape is not None else None,
               label_name=label_name, optimizer=optimizer, lr=float(lr), momentum=float(momentum),
               betas=[float(x) for x in betas], eps=float(eps), weight_decay=float(weight_decay),
               clip_norm=None if clip_norm is None else float(clip_norm), loss_scale=loss_scale,
               init_scale=float(init_scale), growth_interval=int(growth_interval), backoff=float(backoff),
               growth=float(growth), min_scale=float(min_scale), max_scale=float(max_scale),
               precision=precision, output=output, trainable=trainable, expose_grads=bool(expose_grads),
               bn_momentum=bn_momentum)
    _validate_config(cfg, path)
    os.makedirs(out_dir, exist_ok=True)

    src = load_model(path)
    if any(p.key == "graphmp" for p in src.metadata_props):
        raise GraphmpError(f"{path}: this model was already converted by graphmp; build the training step "
                           "from the FP32 source model (precision='mixed' converts it for you).")
    src = upgrade(src, _needed_opset(src), path)
    initializers_out_of_inputs(src)
    base = os.path.dirname(os.path.abspath(path))
    values = {t.name: np.array(tensor_array(t, base)) for t in src.graph.initializer}
    for t in src.graph.initializer:  # bring external data inline: the run dir is self-contained
        if t.data_location == TensorProto.EXTERNAL:
            t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))
    untied = _untie_identity_initializers(src, values)
    out_name = cfg["output"] = output or src.graph.output[0].name
    if out_name not in _all_names(src):
        outs = [o.name for o in src.graph.output]
        raise GraphmpError(f"{path}: output '{out_name}' is not a tensor of the model; its outputs are {outs}.")
    data_inputs = [v.name for v in src.graph.input]
    for reserved in [label_name, LOSS, FINITE, STEP, SCALE, CLEAN]:
        if reserved in _all_names(src):
            raise GraphmpError(f"{path}: the model already has a tensor named '{reserved}', which the step "
                               "graph needs" + (" (choose another label_name)" if reserved == label_name else "."))

    # --- forward in training mode + loss ---------------------------------------------
    fwd = copy.deepcopy(src)
    del fwd.graph.value_info[:]
    out_vi = _value_info(src, out_name)
    if out_vi is not None and out_vi.type.tensor_type.elem_type != TensorProto.FLOAT:
        raise GraphmpError(f"{path}: output '{out_name}' is not FP32; train from the FP32 model.")
    if cfg["loss"] == "cross-entropy" and _producer_op(src, out_name) in ("Softmax", "LogSoftmax"):
        raise GraphmpError(f"{path}: output '{out_name}' comes from a {_producer_op(src, out_name)}; "
                           "cross-entropy needs the logits. Pass output=<the tensor before it>.")
    label_dims, label_elem = _label_spec(cfg, _dims(out_vi), path)
    cfg["label_shape"] = label_dims
    bn_kw = {} if bn_momentum is None else {"momentum": bn_momentum}
    running = training_forward(fwd, **bn_kw)  # {running stat: its updated value}
    b = _Builder(fwd)
    loss_t = _add_loss(fwd, b, out_name, cfg["loss"], label_name, label_dims, label_elem)

    deps = _ancestors(fwd.graph, loss_t)
    rx = re.compile(trainable) if trainable else None
    fixed = _non_trainable_slots(fwd)
    weights = [t.name for t in src.graph.initializer
               if t.data_type == TensorProto.FLOAT and t.name in deps and t.name not in running
               and t.name not in fixed and (rx.search(t.name) if rx else values[t.name].ndim >= 1)]
    if not weights:
        raise GraphmpError(f"{path}: no trainable FP32 initializer feeds output '{out_name}'"
                           + (f" matching trainable='{trainable}'" if trainable else "") + ".")
    bn_stats = [n for n in running if n in values]
    lift_to_inputs(fwd, weights + bn_stats)
    del fwd.graph.output[:]
    fwd.graph.output.append(helper.make_tensor_value_info(loss_t, TensorProto.FLOAT, []))
    for r in bn_stats:
        fwd.graph.output.append(helper.make_tensor_value_info(running[r], TensorProto.FLOAT, list(values[r].shape)))
    _prune(fwd)

    # --- mixed precision: the convert pipeline assigns every op's precision -------------
    convert_report = None
    if cfg["precision"] == "mixed":
        from ..convert import convert
        cal = calibration
        if cal is None:
            cal = [_calibration_batch(src, base, shapes, path, label_name, label_dims, label_elem,
                                      {w: values[w] for w in weights + bn_stats})]
        rep = convert(fwd, calibration=cal, keep_io_types=True)
        fwd, convert_report = rep.model, rep.to_dict()

    # --- backward, loss scaling, optimizer ----------------------------------------------
    b = _Builder(fwd)
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
    grads_scaled = add_backward(fwd, loss_t, weights, seed=scale)
    missing = [w for w in weights if w not in grads_scaled]
    if missing:
        raise GraphmpError(f"{path}: no gradient was produced for {missing}")
    grads = {w: b.op("Div", [grads_scaled[w], scale], out=(w + GRAD) if expose_grads else None) for w in weights}
    finite = _finite_flag(b, list(grads.values()) + [loss_t])
    if cfg["clip_norm"] is not None:
        grads = _clip(b, grads, cfg["clip_norm"])
    step_next = b.op("Add", [STEP, b.const(1, np.int64)])
    new, moments = _optimizer(b, cfg, grads, b.op("Cast", [step_next], to=TensorProto.FLOAT))
    new[STEP] = step_next
    for r in bn_stats:
        new[r] = running[r]
    for m in moments:
        g.input.append(helper.make_tensor_value_info(m, TensorProto.FLOAT, list(values[moments[m]].shape)))
    outputs = [helper.make_tensor_value_info(loss_t, TensorProto.FLOAT, []),
               helper.make_tensor_value_info(FINITE, TensorProto.BOOL, [])]
    state = []  # (input, kind)
    state += [(w, "weight") for w in weights]
    state += [(m, "moment") for m in moments]
    state += [(r, "bn") for r in bn_stats]
    state += [(STEP, "counter")]
    gated = {}
    for name, kind in state:
        gated[name] = b.op("Where", [finite, new[name], name], out=name + NEXT)
    if dynamic:
        gated.update(_scale_update(b, cfg, finite))
        state += [(SCALE, "scale"), (CLEAN, "counter")]
    elem_of = {STEP: TensorProto.INT64, CLEAN: TensorProto.INT64}
    init = {}
    for name, kind in state:
        if kind in ("weight", "bn"):
            init[name] = values[name].astype(np.float32)
        elif kind == "moment":
            init[name] = np.zeros_like(values[moments[name]], dtype=np.float32)
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

    # --- inference graph for eval/export: the source model, trained tensors as inputs ----
    infer = copy.deepcopy(src)
    lift_to_inputs(infer, weights + bn_stats)

    meta = {
        "format": FORMAT, "source": os.path.abspath(path), "step_model": "step.onnx", "infer_model": "infer.onnx",
        "initial_state": "state.npz", "inputs": {n: _dims(_value_info(src, n)) for n in data_inputs},
        "input_types": {n: _elem(src, n) for n in data_inputs},
        "label": {"name": label_name, "shape": label_dims, "dtype": "int64" if label_elem == TensorProto.INT64
                  else "float32"},
        "model_output": out_name, "loss_output": loss_t, "finite_output": FINITE,
        "state": [{"input": n, "output": n + NEXT, "kind": k} for n, k in state],
        "weights": weights, "bn_stats": bn_stats, "dynamic_scale": dynamic, "untied": untied,
        "grads": {w: w + GRAD for w in weights} if expose_grads else {},
        "nodes": {"forward": n_before, "total": len(g.node)}, "config": cfg,
        "convert": None if convert_report is None else {
            k: convert_report.get(k) for k in ("nodes", "casts_added", "fp32_by_reason", "calibration")},
    }
    _save_onnx(fwd, os.path.join(out_dir, "step.onnx"))
    _save_onnx(infer, os.path.join(out_dir, "infer.onnx"))
    save_npz(os.path.join(out_dir, "state.npz"), init)
    write_json(os.path.join(out_dir, "train.json"), meta)
    return meta


def _untie_identity_initializers(model, values: dict) -> list:
    """Identity(initializer) -> its own initializer (a copy, named as the Identity output).

    The torch exporter de-duplicates initializers that happen to hold equal values and
    writes `ln2.weight = Identity(ln1.weight)`, `bn.running_var = Identity(bn.weight)`
    (fresh LayerNorm/BatchNorm parameters are all ones or zeros). Trained as written, those
    distinct parameters would be tied (and a running statistic tied to a weight). Each such
    Identity becomes a separate tensor with the same value, so they train apart as in the
    original module. Weights that are really shared (one initializer read by several nodes)
    stay shared. Returns the untied names."""
    outs = {o.name for o in model.graph.output}
    keep, untied = [], []
    for n in model.graph.node:
        if n.op_type == "Identity" and n.input[0] in values and n.output[0] not in outs \
                and values[n.input[0]].dtype.kind == "f":
            values[n.output[0]] = values[n.input[0]].copy()
            model.graph.initializer.append(numpy_helper.from_array(values[n.output[0]], n.output[0]))
            untied.append(n.output[0])
            continue
        keep.append(n)
    if untied:
        del model.graph.node[:]
        model.graph.node.extend(keep)
    return untied


def _producer_op(model, name):
    for n in model.graph.node:
        if name in n.output:
            return n.op_type
    return None


# inputs that are parameters of an op, not values to learn (weight decay would shrink them)
NON_TRAINABLE = {"Resize": (1, 2), "Upsample": (1,), "Clip": (1, 2), "Range": (0, 1, 2), "Pad": (1, 3),
                 "ConstantOfShape": (0,), "Dropout": (1,), "Reshape": (1,), "Expand": (1,), "Tile": (1,)}


def _non_trainable_slots(model) -> set:
    """Initializers read only at non-trainable input positions (NON_TRAINABLE)."""
    fixed, used = set(), set()
    for n in model.graph.node:
        slots = NON_TRAINABLE.get(n.op_type, ())
        for i, x in enumerate(n.input):
            (fixed if i in slots else used).add(x)
    return fixed - used


def _prune(model) -> None:
    """Drop nodes no graph output depends on (other heads of a multi-output model)."""
    needed = {o.name for o in model.graph.output}
    keep = []
    for n in reversed(model.graph.node):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(n.input)
            for a in n.attribute:
                for sg in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    needed.update(x for sn in sg.node for x in sn.input)
    if len(keep) != len(model.graph.node):
        kept = [onnx.NodeProto() for _ in keep]
        for dst, src in zip(kept, reversed(keep)):
            dst.CopyFrom(src)
        del model.graph.node[:]
        model.graph.node.extend(kept)
        used = {x for n in model.graph.node for x in n.input}
        inits = [t for t in model.graph.initializer if t.name in used]
        del model.graph.initializer[:]
        model.graph.initializer.extend(inits)


def _elem(model, name) -> str:
    vi = _value_info(model, name)
    return np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)).name


def _check_no_fp16_state(model, weights, path):
    """The contract: masters are FP32 graph inputs (graphmp.convert keeps IO types)."""
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    bad = [w for w in weights if types.get(w) != TensorProto.FLOAT]
    if bad:
        raise GraphmpError(f"{path}: internal error: master weights {bad[:3]} are not FP32 inputs of the step graph")

"""The loss of the training step: cross-entropy (torch's F.cross_entropy semantics) or MSE.

Cross-entropy options (config keys, as train.json stores them):
    class_axis       axis of the model output holding the classes (default 1: [N, C, d...];
                     -1 for a language model's [N, T, V] logits). The labels have the output's
                     shape without that axis ([N, T] for [N, T, V]).
    ignore_index     label value that contributes neither loss nor gradient (torch: -100); the
                     mean is over the other positions (weighted: over their class weights).
    label_smoothing  eps in [0, 1): loss = (1 - eps) * NLL + eps / C * sum_c -w_c log p_c,
                     the smoothing term averaged as the NLL is (torch's definition).
    class_weights    one weight per class (torch's `weight`): weighted mean
                     sum_i w[y_i] * nll_i / sum_i w[y_i].
    num_classes      the size of the class axis (None when it is dynamic).

The NLL part is LogSoftmax over the class axis (brought to axis 1 by a Transpose), the label's
log-probability picked by GatherElements (a one-hot mask below opset 16), and a (weighted,
masked) mean: ops every ONNX Runtime execution provider has kernels for. SoftmaxCrossEntropyLoss
computes the same, but ORT's CUDA provider registers it only in training builds: under
onnxruntime-gpu the loss node ran on the CPU, a copy of the logits and a stream sync every step.
Label smoothing adds a weighted ReduceSum of the same log-probabilities over the classes, masked
like the NLL.
"""
from __future__ import annotations

import os

import numpy as np
from onnx import TensorProto, helper

from ..errors import GraphmpError
from .builder import Builder

LOSSES = ("cross-entropy", "mse")
MSE_RESHAPE = "mse_labels_as_output"  # the node giving the targets the output's shape
LOSS = "loss"


def parse_class_weights(spec) -> list | None:
    """Class weights from a .npy path or 'w1,w2,...' (CLI) or a sequence (API); None for None.
    Raises GraphmpError naming the bad value."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec.endswith(".npy") or os.path.isfile(spec):
            if not os.path.isfile(spec):
                raise GraphmpError(f"{spec}: no such file (class weights: a .npy of one weight per class, "
                                   "or comma-separated numbers)")
            from ..npz import read_npy  # its header checked against the file before it is read
            arr = read_npy(spec, ".npy array of class weights")
        else:
            try:
                arr = np.array([float(x) for x in spec.split(",") if x.strip()])
            except ValueError:
                raise GraphmpError(f"class weights '{spec}': expected comma-separated numbers "
                                   "(e.g. 1,2.5,1) or a .npy file") from None
    else:
        arr = np.asarray(spec)
    arr = np.asarray(arr, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise GraphmpError(f"class weights: need a 1-D list of one weight per class, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0) or not arr.sum() > 0:
        raise GraphmpError(f"class weights must be finite, >= 0 and not all zero (got {arr.tolist()})")
    return [float(x) for x in arr]


def check_loss_config(cfg: dict, bad) -> None:
    """Validate the loss keys of cfg (bad(msg) raises)."""
    if cfg["loss"] not in LOSSES:
        bad(f"loss must be one of {LOSSES}, not '{cfg['loss']}'")
    ls = cfg["label_smoothing"]
    if not 0.0 <= ls < 1.0:
        bad(f"label_smoothing must be in [0, 1) (got {ls})")
    if cfg["loss"] != "cross-entropy":
        used = [k for k, off in (("class_axis", 1), ("ignore_index", None), ("label_smoothing", 0.0),
                                 ("class_weights", None)) if cfg[k] != off]
        if used:
            bad(f"{', '.join(used)} only apply to the cross-entropy loss, not '{cfg['loss']}'")


def class_axis(cfg: dict, rank: int | None, path: str) -> int:
    """The class axis as a non-negative index of an output of `rank` dims."""
    a = int(cfg["class_axis"])
    if rank is None:
        if a == 1:
            return 1
        raise GraphmpError(f"{path}: the rank of output '{cfg['output']}' is unknown, so class_axis {a} cannot "
                           "be placed; give the model output a known shape (--shapes) or use --class-axis 1.")
    if not -rank <= a < rank:
        raise GraphmpError(f"{path}: class_axis {a} is out of range for output '{cfg['output']}' of rank {rank}; "
                           f"--class-axis takes 1..{rank - 1} or -1..-{rank - 1}.")
    a %= rank
    if a == 0:
        raise GraphmpError(f"{path}: class_axis {cfg['class_axis']} is the batch axis of output "
                           f"'{cfg['output']}' (rank {rank}); the classes need their own axis (--class-axis 1 or -1).")
    return a


def class_axis_warning(cfg: dict, out_dims, path: str) -> str | None:
    """A warning when cross-entropy's class axis is a guess: the axis is symbolic (its size
    is not known, so nothing says it holds the classes) or, on an output of rank 3 or more,
    not the last axis while the last is fixed (a [batch, seq, classes] tagger's layout)."""
    if cfg["loss"] != "cross-entropy" or not out_dims:
        return None
    a = class_axis(cfg, len(out_dims), path)
    symbolic = not isinstance(out_dims[a], int)
    tagger = len(out_dims) >= 3 and a != len(out_dims) - 1 and isinstance(out_dims[-1], int)
    if not (symbolic or tagger):
        return None
    why = f"its size '{out_dims[a]}' is symbolic" if symbolic else f"the last axis ({out_dims[-1]}) is fixed"
    return (f"{path}: cross-entropy takes axis {a} of output '{cfg['output']}' {list(out_dims)} as the class axis, "
            f"but {why}; --class-axis -1 takes the last axis, --class-axis N any other")


def label_spec(cfg: dict, out_dims, path: str):
    """(shape, elem type) of the labels input; sets cfg['num_classes'] (cross-entropy)."""
    shape = cfg["label_shape"]
    ce = cfg["loss"] == "cross-entropy"
    cfg["num_classes"] = None
    if ce and out_dims is not None:
        a = class_axis(cfg, len(out_dims), path)
        n = out_dims[a]
        cfg["num_classes"] = n if isinstance(n, int) and n > 0 else None
    if shape is None:
        if not out_dims:
            raise GraphmpError(f"{path}: the shape of output '{cfg['output']}' is unknown; give label_shape "
                               "(e.g. --label-shape N for class indices of a batch of N).")
        shape = [d for i, d in enumerate(out_dims) if i != a] if ce else list(out_dims)
        shape = [d if d is not None else f"label_dim{i}" for i, d in enumerate(shape)]
    shape = [int(d) if isinstance(d, str) and d.isdigit() else d for d in shape]
    w = cfg["class_weights"]
    if ce and w is not None and cfg["num_classes"] is not None and len(w) != cfg["num_classes"]:
        raise GraphmpError(f"{path}: {len(w)} class weights for {cfg['num_classes']} classes (axis "
                           f"{cfg['class_axis']} of output '{cfg['output']}'); give one weight per class.")
    return shape, (TensorProto.INT64 if ce else TensorProto.FLOAT)


def add_loss(model, b: Builder, cfg: dict, out_dims, label_dims, label_elem) -> str:
    """Append the labels input and the loss nodes; return the FP32 scalar loss tensor (LOSS)."""
    output, label_name = cfg["output"], cfg["label_name"]
    model.graph.input.append(helper.make_tensor_value_info(label_name, label_elem, label_dims))
    if cfg["loss"] != "cross-entropy":
        # the targets take the output's shape: an element count that differs fails the run (the
        # node's name lets data.run_failure say so) instead of broadcasting -- [N] against [N, 1]
        # would silently train on N*N differences
        target = b.name("labels_as_output")
        b.g.node.append(helper.make_node("Reshape", [label_name, b.op("Shape", [output])], [target],
                                         name=b.name(MSE_RESHAPE)))
        d = b.op("Sub", [output, target])
        return b.op("ReduceMean", [b.op("Mul", [d, d])], out=LOSS, keepdims=0)
    rank = None if out_dims is None else len(out_dims)
    a = class_axis(cfg, rank, cfg["output"])
    scores = output
    if a != 1:  # the classes on axis 1, as LogSoftmax(axis=1) and the label gather below take them
        perm = [0, a] + [i for i in range(1, rank) if i != a]
        scores = b.op("Transpose", [output], perm=perm)
    logp = b.op("LogSoftmax", [scores], axis=1)
    lab, valid, pos_w, denom = _label_weights(b, cfg)
    picked = _label_log_prob(b, logp, lab, _opset(model), len(cfg["label_shape"]) + 1)
    per = b.op("Neg", [picked])  # -log p(label), labels' shape
    eps = float(cfg["label_smoothing"])
    nll = LOSS if not eps else b.name("nll")
    if pos_w is None:
        b.op("ReduceMean", [per], out=nll, keepdims=0)
    else:
        b.op("Div", [b.op("ReduceSum", [b.op("Mul", [per, pos_w])], keepdims=0), denom], out=nll)
    if not eps:
        return LOSS
    return _smoothed(b, cfg, logp, nll, valid, denom, eps)


def _opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _label_log_prob(b: Builder, logp: str, lab: str, opset: int, rank: int) -> str:
    """log p of each position's label (the labels' shape), from logp [N, C, d...] of `rank`.

    Opset >= 16: GatherElements along the classes (its gradient scatters one term per
    position; ScatterElements with reduction, which that gradient rule emits, is opset 16).
    Below 16 -- the step keeps the model's opset, and the loss's ops are not counted when the
    build picks it -- a one-hot mask of the labels times logp, summed over the classes: about
    four more passes over a logits-sized tensor, no scatter, opset 13."""
    axis1 = b.const([1], np.int64)
    if opset >= 16:
        return b.op("Squeeze", [b.op("GatherElements", [logp, b.op("Unsqueeze", [lab, axis1])], axis=1), axis1])
    classes = b.op("Range", [b.const(0, np.int64), b.op("Gather", [b.op("Shape", [logp]), b.const(1, np.int64)],
                                                        axis=0), b.const(1, np.int64)])
    classes = b.op("Reshape", [classes, b.const([1, -1] + [1] * (rank - 2), np.int64)])
    onehot = b.op("Cast", [b.op("Equal", [b.op("Unsqueeze", [lab, axis1]), classes])], to=TensorProto.FLOAT)
    return b.op("ReduceSum", [b.op("Mul", [logp, onehot]), axis1], keepdims=0)


def _label_weights(b: Builder, cfg) -> tuple[str, str | None, str | None, str]:
    """(labels with ignored positions set to class 0, the FP32 mask of kept positions or None
    without ignore_index, each position's FP32 weight or None when all are 1, the mean's FP32
    denominator): the weight is w[y_i] (class weights) times the mask; the denominator their
    sum, or the count of the positions kept (torch's mean)."""
    label_name, ignore = cfg["label_name"], cfg["ignore_index"]
    lab, valid = label_name, None
    if ignore is not None:
        keep = b.op("Not", [b.op("Equal", [label_name, b.const(int(ignore), np.int64)])])
        lab = b.op("Where", [keep, label_name, b.const(0, np.int64)])
        valid = b.op("Cast", [keep], to=TensorProto.FLOAT)
    pos_w = valid
    if cfg["class_weights"] is not None:
        pos_w = b.op("Gather", [b.const(cfg["class_weights"]), lab], axis=0)
        if valid is not None:
            pos_w = b.op("Mul", [pos_w, valid])
    if pos_w is None:
        return lab, None, None, b.op("Cast", [b.op("Size", [label_name])], to=TensorProto.FLOAT)
    return lab, valid, pos_w, b.op("ReduceSum", [pos_w], keepdims=0)


def _smoothed(b: Builder, cfg, logp, nll, valid, denom, eps) -> str:
    """(1 - eps) * nll + eps / C * sum_i k_i sum_c -w_c log p_ic / denom (torch's label
    smoothing: k_i 0 at ignored positions, w_c the class weights or 1; the same denominator
    as the NLL's mean: the sum of w[y_i] over kept positions, or their count)."""
    if cfg["class_weights"] is not None:
        rank = len(cfg["label_shape"]) + 1
        wb = b.const(np.array(cfg["class_weights"], np.float32).reshape([1, -1] + [1] * (rank - 2)))
        logp = b.op("Mul", [logp, wb])
    per = b.op("Neg", [b.op("ReduceSum", [logp, b.const([1], np.int64)], keepdims=0)])  # labels' shape
    if valid is not None:
        per = b.op("Mul", [per, valid])
    smooth = b.op("Div", [b.op("ReduceSum", [per], keepdims=0), denom])
    classes = b.op("Cast", [b.op("Gather", [b.op("Shape", [logp]), b.const(1, np.int64)], axis=0)],
                   to=TensorProto.FLOAT)
    coef = b.op("Div", [b.const(eps), classes])
    return b.op("Add", [b.op("Mul", [nll, b.const(1.0 - eps)]), b.op("Mul", [smooth, coef])], out=LOSS)


class LabelMismatch(GraphmpError):
    """The labels a build would ask for contradict what the model's output really is."""


def label_mismatch(path: str, cfg: dict, label_dims, want) -> GraphmpError:
    """The error for a label shape (from the output's declared shape, or --label-shape) that
    contradicts the labels the output really needs (`want`, measured on a generated batch)."""
    what = "one target per element of" if cfg["loss"] != "cross-entropy" else "a class index per position of"
    return LabelMismatch(f"{path}: the loss needs {what} output '{cfg['output']}', i.e. labels {list(want)} on a "
                        f"generated batch, but the label shape is {list(label_dims)} (from the output's declared "
                        f"shape or --label-shape). Pass the real shape: --label-shape {','.join(map(str, want))} "
                        "(label_shape=...; a name such as N for the batch axis), and give labels of that shape.")

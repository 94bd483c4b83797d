"""What train-graph does to the source model before building the step, and what it reports
about it: Constant-node weights lifted to initializers (and written back by export), torch's
Identity-tied parameters untied, op parameters that are not trained, parameters shared by
several consumers, and the look of an eval-mode export (which trains a different model).
"""
from __future__ import annotations

import re

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# inputs that are parameters of an op, not values to learn (weight decay would shrink them)
NON_TRAINABLE = {"Resize": (1, 2), "Upsample": (1,), "Clip": (1, 2), "Range": (0, 1, 2), "Pad": (1, 2, 3),
                 "ConstantOfShape": (0,), "Dropout": (1, 2), "Reshape": (1,), "Expand": (1,), "Tile": (1,),
                 "Slice": (1, 2, 3, 4), "Squeeze": (1,), "Unsqueeze": (1,), "ReduceSum": (1,),
                 "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "ReduceProd": (1,),
                 "ReduceSumSquare": (1,), "ReduceL1": (1,), "ReduceL2": (1,), "ReduceLogSum": (1,),
                 "ReduceLogSumExp": (1,), "Split": (1,), "TopK": (1,), "OneHot": (1, 2), "CumSum": (1,),
                 "Gather": (1,), "GatherElements": (1,), "GatherND": (1,), "Trilu": (1,), "RoiAlign": (1, 2),
                 # a quantizer's scale and zero point are its calibration, not weights
                 "DequantizeLinear": (1, 2), "QuantizeLinear": (1, 2)}

# the export settings that keep a torch module's parameters as they are in the module
TORCH_TRAINING_EXPORT = ("torch.onnx.export(..., dynamo=False, do_constant_folding=False, "
                         "training=torch.onnx.TrainingMode.TRAINING)")
NORM_OPS = {"BatchNormalization", "InstanceNormalization", "LayerNormalization", "GroupNormalization",
            "LpNormalization", "MeanVarianceNormalization", "LRN", "RMSNormalization"}


LOW_BIT_WEIGHTS = {TensorProto.INT8, TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4, TensorProto.INT16,
                   TensorProto.UINT16}


def quantized_weights(model, deps: set) -> list:
    """(initializer, DequantizeLinear node) of the integer weights the loss depends on:
    weight-only quantized matrices, which no gradient can update."""
    inits = {t.name: t.data_type for t in model.graph.initializer}
    return [(n.input[0], n.name) for n in model.graph.node
            if n.op_type == "DequantizeLinear" and n.input and inits.get(n.input[0]) in LOW_BIT_WEIGHTS
            and n.output[0] in deps]


def non_trainable_slots(model) -> set:
    """Initializers read only at non-trainable input positions (NON_TRAINABLE)."""
    fixed, used = set(), set()
    for n in model.graph.node:
        slots = NON_TRAINABLE.get(n.op_type, ())
        for i, x in enumerate(n.input):
            (fixed if i in slots else used).add(x)
    return fixed - used


def dynamic_negative_dims(model) -> int:
    """dim_value < 0 (paddle2onnx writes -1 for a dynamic batch) -> a named dynamic dim, in place,
    in the main graph's inputs, outputs and value_info; shape inference and the gradient rules
    would take -1 for a static size. Returns how many dims changed."""
    changed = 0
    for v in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if not v.type.tensor_type.HasField("shape"):
            continue
        for i, d in enumerate(v.type.tensor_type.shape.dim):
            if d.HasField("dim_value") and d.dim_value < 0:
                d.Clear()
                d.dim_param = "N" if i == 0 else f"{v.name}_dim{i}"
                changed += 1
    return changed


def lift_constant_weights(model, values: dict) -> dict:
    """Float Constant nodes of the main graph (tensor `value` of more than one element: a single
    number is an epsilon or a scale, not a weight; read at some
    position that is not an op parameter, NON_TRAINABLE) -> initializers named as the Constant's
    output, in place; their arrays added to `values`. Returns {tensor: Constant node name}.

    paddle2onnx and many TF exports store weights this way; as initializers they can be
    trained. Integer constants and constants read only as shapes/axes/pads/scales stay."""
    readers = {}
    for n in model.graph.node:
        for i, x in enumerate(n.input):
            readers.setdefault(x, []).append((n.op_type, i))
    outs = {o.name for o in model.graph.output}
    lifted, keep = {}, []
    for n in model.graph.node:
        t = _constant_tensor(n)
        out = n.output[0] if n.output else ""
        if (t is None or t.data_type != TensorProto.FLOAT or int(np.prod(t.dims)) <= 1 or out in outs
                or all(i in NON_TRAINABLE.get(op, ()) for op, i in readers.get(out, [(None, 0)]))):
            keep.append(n)
            continue
        arr = numpy_helper.to_array(t).astype(np.float32)
        values[out] = arr
        model.graph.initializer.append(numpy_helper.from_array(arr, out))
        lifted[out] = n.name or out
    if lifted:
        del model.graph.node[:]
        model.graph.node.extend(keep)
    return lifted


def _constant_tensor(node):
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    for a in node.attribute:
        if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
            return a.t
    return None


def restore_constants(model, constants: dict) -> None:
    """Initializers named in `constants` ({tensor: node name}) -> Constant nodes of that name
    holding the initializer's value, at the front of the graph (in place): the layout of the
    source model the weights came from."""
    inits = {t.name: t for t in model.graph.initializer}
    nodes = []
    for tensor, node_name in constants.items():
        t = inits.get(tensor)
        if t is None:
            continue
        nodes.append(helper.make_node("Constant", [], [tensor], name=node_name, value=t))
    if nodes:
        keep = [t for t in model.graph.initializer if t.name not in constants]
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)
        rest = list(model.graph.node)
        del model.graph.node[:]
        model.graph.node.extend(nodes + rest)


def untie_identity_initializers(model, values: dict) -> list:
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


def shared_weights(model, weights) -> dict:
    """{weight: number of node inputs reading it} for weights read by more than one (tied
    parameters, e.g. a language model's embedding and output projection)."""
    count = {}
    wanted = set(weights)
    for n in model.graph.node:
        for x in n.input:
            if x in wanted:
                count[x] = count.get(x, 0) + 1
    return {w: c for w, c in count.items() if c > 1}


def eval_export_warning(model, path: str) -> str | None:
    """A one-line warning when the model looks like an eval-mode, constant-folded torch export of
    a CNN, else None. Conservative, all of: written by torch (producer "pytorch"), at least 2
    Convs, every Conv with a bias, no normalization op and no Dropout anywhere, and most Conv
    weights not named as module parameters (`onnx::Conv_816` instead of `layer1.0.conv1.weight`):
    what the exporter leaves when it folds BatchNorm into the Conv weights and biases. A CNN
    that truly has no norm (e.g. the classic super-resolution net) keeps its parameter names."""
    if model.producer_name != "pytorch":
        return None
    ops = [n.op_type for n in model.graph.node]
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    if len(convs) < 2 or NORM_OPS & set(ops) or "Dropout" in ops:
        return None
    if not all(len(n.input) > 2 and n.input[2] for n in convs):
        return None
    renamed = [n for n in convs if not _PARAM_NAME.match(n.input[1])]
    if 2 * len(renamed) < len(convs):
        return None
    return (f"warning: {path} looks like an eval-mode torch export ({len(convs)} Convs, all with biases, "
            f"{len(renamed)} with weights not named as module parameters, e.g. '{renamed[0].input[1]}'; no "
            "normalization and no Dropout anywhere): BatchNorm was folded into the Convs and Dropout dropped, so "
            "this trains a different model than the torch module. Re-export it with "
            f"{TORCH_TRAINING_EXPORT}.")


# a module parameter path as torch names initializers: `conv1.weight`, `layer1.0.conv1.weight`
_PARAM_NAME = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)+$")


def subgraph_weights_note(model) -> str:
    """'; N FP32 tensors ...' when the model keeps weight-like tensors (FP32 initializers or
    Constants of rank >= 1) only inside If/Loop/Scan bodies, which train-graph does not
    differentiate (it differentiates the main graph); '' otherwise."""
    from ..model_io import iter_graphs
    count, ops = 0, set()
    for n in model.graph.node:
        for g in (g for a in n.attribute for g in ([a.g] if a.HasField("g") else list(a.graphs))):
            for sub in iter_graphs(g):
                count += sum(t.data_type == TensorProto.FLOAT and len(t.dims) >= 1 for t in sub.initializer)
                count += sum(c.op_type == "Constant" and (t := _constant_tensor(c)) is not None
                             and t.data_type == TensorProto.FLOAT and len(t.dims) >= 1 for c in sub.node)
            ops.add(n.op_type)
    if not count:
        return ""
    return (f"; its {count} FP32 weight tensors sit inside {'/'.join(sorted(ops))} branches or bodies, which "
            "train-graph does not differentiate (it trains the main graph): the model has no trainable path")

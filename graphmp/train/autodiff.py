"""Reverse-mode differentiation of ONNX graphs into standard ONNX ops.

`add_backward(model, loss, wrt)` appends to the graph the nodes computing d(loss)/d(w) for
every w in `wrt` and returns {w: gradient tensor name}. It guarantees:

- the gradient of a tensor has that tensor's dtype and shape (the gradient of a Cast is a
  Cast back, so FP16 regions are differentiated in FP16 and FP32 islands stay FP32);
  constants a rule creates take the dtype of the tensor they combine with;
- only nodes on a path from some w to `loss` get gradient nodes; integer/bool tensors and
  zero-derivative ops (Shape, comparisons, Floor, ...) carry no gradient;
- a node on the path without a rule raises GraphmpError naming the node, its op and the
  supported ops; existing nodes are untouched, new names are unique, the result is
  checker-clean; ops emitted are valid at the model's opset (>= 13).

`training_forward(model)` rewrites BatchNormalization (batch statistics fed to one
BatchNormalization, running-statistic updates as new tensors) and Dropout (training mode,
mask output) in place; `batchnorm_params_to_x_type(model)`, after the backward, gives a
mixed graph's BatchNormalizations parameters of their X's type (ONNX Runtime's CUDA kernel).

How it works. A forward sweep marks the *active* tensors: float tensors that depend on
some w through nodes that are not zero-grad (emitter.ZERO_GRAD). A backward sweep keeps
those that also reach `loss`. Then the nodes are visited in reverse topological order
(graph order reversed); each node with an output gradient and an active input calls the
rule registered for its op (emitter.RULES, filled by the modules of graphmp/train/rules/,
one file per family of ops). A rule gets the Emitter, the node and the gradients of its
outputs, emits nodes, and returns one gradient per input; gradients of a tensor used
several times are summed. The loss is seeded with ones (or `seed`, e.g. the loss scale).

Adding a rule: write `@rule("Op") def op(em, node, g): ...` in the family file under
graphmp/train/rules/ (see that package's docstring for the conventions), add a
finite-difference case to tests/test_autodiff.py (test_every_rule_is_covered_by_a_case
fails otherwise) and a CLI gradient check to tests/test_grad_cli.py where the op matters
for exported models, then regenerate docs/training_ops.md
(`python -m graphmp.train.rules --table > docs/training_ops.md`). A rule whose gradient
needs an op newer than opset 13 declares it (`@rule("Op", opset=16)`); train-graph
upgrades such models (graphmp/train/step.py reads NEEDS_OPSET).

The `Emitter` (graphmp/train/emitter.py) and its helpers (unbroadcast, reshape_like,
reductions at the right opset, dtype-matched constants) are what the rules are written with.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import GraphmpError
from ..policy import FLOAT_TYPES
from ..opset import default_opset
from .builder import subgraph_inputs
from .emitter import Emitter, attr, tensor_info
from .rules import RULES, ZERO_GRAD
from .rules.common import per_channel_count
from .rules.nn import BATCH_MEAN, BATCH_VAR

__all__ = ["MIN_OPSET", "add_backward", "training_forward", "batchnorm_params_to_x_type", "Emitter", "attr", "tensor_info"]

MIN_OPSET = 13


def add_backward(model: onnx.ModelProto, loss: str, wrt: Sequence[str], *, seed: str | None = None,
                 prefix: str = "grad", info: dict | None = None) -> dict[str, str]:
    """Append the nodes computing d(loss)/d(w) for every w in `wrt`; return {w: gradient name}.
    `info`: tensor_info(model) of the model as it is now, when the caller already has it.

    See the module docstring for the guarantees and how rules are applied.
    A w that does not reach `loss` gets a zero gradient of its own shape and dtype."""
    opset = default_opset(model)
    if opset < MIN_OPSET:
        raise GraphmpError(f"add_backward: the model's opset is {opset}; gradients need opset >= "
                           f"{MIN_OPSET} (convert it with onnx.version_converter first)")
    info = tensor_info(model) if info is None else info
    graph = model.graph
    known = set(info) | {o for n in graph.node for o in n.output}
    for name in [loss, *wrt] + ([seed] if seed else []):
        if name not in known:
            raise GraphmpError(f"add_backward: tensor '{name}' is not in the graph (give a graph input, "
                               "initializer or node output)")
    for w in wrt:
        if info.get(w, (0,))[0] not in FLOAT_TYPES:
            raise GraphmpError(f"add_backward: '{w}' is not a floating-point tensor; only float "
                               "tensors have gradients")

    # forward: tensors that depend on some w through float values
    # (a subgraph's outer-scope reads count as inputs: an If whose branch returns an active
    # value passes its gradient, or stops the build for want of a rule, never silently)
    reads = {tuple(node.output): [i for i in node.input if i] + list(subgraph_inputs(node)) for node in graph.node}
    active = set(wrt)
    for node in graph.node:
        if node.op_type in ZERO_GRAD or not any(i in active for i in reads.get(tuple(node.output), node.input)):
            continue
        for o in node.output:
            if o and info.get(o, (TensorProto.FLOAT,))[0] in FLOAT_TYPES:
                active.add(o)
    # backward: active tensors that reach the loss
    useful = {loss}
    for node in reversed(graph.node):
        if any(o in useful for o in node.output):
            useful.update(i for i in reads.get(tuple(node.output), node.input) if i in active)

    em = Emitter(model, info, prefix, active=frozenset(active & useful))
    grads: dict[str, list[str]] = defaultdict(list)
    if loss in active:
        grads[loss].append(seed or em.op("ConstantOfShape", [em.shape(loss)],
                                         value=helper.make_tensor("one", em.dtype(loss), [1], [1])))
    for node in reversed(graph.node):
        outs = [em.sum(grads.pop(o)) if o in grads else None for o in node.output]
        for o, go in zip(node.output, outs):
            if go is not None and o in info:
                em.info.setdefault(go, info[o])  # a gradient has its tensor's dtype and shape
        if all(g is None for g in outs) or not any(em.needs(i) for i in reads.get(tuple(node.output), node.input)):
            continue
        rule = RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if rule is None:
            raise GraphmpError(
                f"node '{node.name}' (op {node.domain + '.' if node.domain else ''}{node.op_type}) lies "
                f"between the differentiated tensors and the loss and has no gradient rule. Train through "
                f"a tensor before it (--model-output {_tensor_before(graph, node, reads, active, wrt)}), "
                f"make it non-differentiable (e.g. feed it a constant) or add a rule in graphmp/train/rules/. "
                f"Supported ops: {', '.join(sorted(RULES))}.")
        if rule.outputs is not None:
            extra = [i for i, g in enumerate(outs) if g is not None and i not in rule.outputs]
            if extra:
                raise GraphmpError(f"node '{node.name}' ({node.op_type}): its output {extra[0]} is used "
                                   "on the way to the loss, but the gradient rule only supports outputs "
                                   f"{list(rule.outputs)}")
        in_grads = rule.fn(em, node, outs)
        for i, gi in zip(node.input, in_grads):
            if gi is not None and em.needs(i):
                grads[i].append(gi)

    result = {}
    for w in wrt:
        name = em.fresh(w)
        if grads.get(w):
            em.op("Identity", [em.sum(grads[w])], name=name)
        else:
            em.op("ConstantOfShape", [em.shape(w)], name=name,
                  value=helper.make_tensor("zero", em.dtype(w), [1], [0]))
        result[w] = name
    graph.node.extend(em.nodes)
    return result


# --- training-mode forward -------------------------------------------------------------

def _tensor_before(graph, node, reads: dict, active: set, wrt) -> str:
    """A differentiable tensor the node reads, by its name in the user's model: a mixed
    build's Casts (x -> x_fp16, a master weight -> its FP16 copy) are looked through, and
    weights are not tensors to train through ('?' when there is none)."""
    producer = {o: n for n in graph.node for o in n.output}
    for t in reads.get(tuple(node.output), node.input):
        if t not in active:
            continue
        while t in producer and producer[t].op_type == "Cast":
            t = producer[t].input[0]
        if t not in wrt:
            return t
    return "?"


def training_forward(model: onnx.ModelProto, *, momentum: float | None = None) -> dict[str, str]:
    """Rewrite BatchNormalization and Dropout to their training form, in place.

    BatchNormalization(X, scale, B, mean, var) becomes the batch statistics of X and ONE
    standard BatchNormalization (inference form) that reads them instead of the running
    statistics, so it computes the training-mode output in a single pass over X:
      batch mean  = ReduceMean(X) over N and the spatial axes, named `<Y>__batch_mean`;
      batch var   = max(ReduceSumSquare(X) / M - mean^2, 0) (biased, M = elements per
                    channel), named `<Y>__batch_var`;
    both [C] and FP32 (FP64 for a double model; X is Cast to that type for the two
    reductions only). The variance as E[X^2] - mean^2 in FP32 loses about
    1e-7 * (mean/std)^2 of its value to cancellation: negligible for activations whose
    channel mean is within a few hundred standard deviations. The gradient rule of
    BatchNormalization (rules/nn.py) recognises the node by those names and differentiates
    the whole training form at once (the statistics get no gradient nodes of their own).
    A graphmp mixed build paints that node like any BatchNormalization (FP16 X and Y, FP32
    parameters) and convert's calibration sees the batch-statistics output.
    New tensors running' = momentum*running + (1-momentum)*batch on [C], with the UNBIASED
    batch variance (M/(M-1) * biased) going into running var, as torch.nn.BatchNorm does;
    momentum (ONNX's convention: the weight of the old value; torch's momentum 0.1 is ONNX
    0.9): the argument, else the node's attribute, else 0.9.
    Dropout -> training_mode=True with a mask output (its gradient uses the mask).
    Returns {running mean/var name: updated tensor name}."""
    opset = default_opset(model)
    if opset < MIN_OPSET:
        raise GraphmpError(f"training_forward: opset {opset} < {MIN_OPSET}; convert the model first")
    info = tensor_info(model)
    em = Emitter(model, info, "train")
    new_nodes, updates = [], {}
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            em.nodes = []
            updates.update(_bn_training(em, node, momentum))
            new_nodes.extend(em.nodes)
        elif node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            em.nodes = []
            ratio = node.input[1] if len(node.input) > 1 and node.input[1] else em.const(0.5, TensorProto.FLOAT)
            mask = node.output[1] if len(node.output) > 1 and node.output[1] else em.fresh("dropout_mask")
            em.nodes.append(helper.make_node("Dropout", [node.input[0], ratio, em.const(True, TensorProto.BOOL)],
                                             [node.output[0], mask], name=node.name,
                                             **{a.name: helper.get_attribute_value(a) for a in node.attribute}))
            new_nodes.extend(em.nodes)
        else:
            new_nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return updates


def _float_attr(value: float) -> float:
    """An ONNX float attribute is stored in FP32 (0.9 reads back as 0.89999998): the
    shortest decimal that rounds to the same FP32 value, so a double model's running
    statistics mix with 0.9 exactly, as torch's do."""
    return float(str(np.float32(value)))


def _bn_training(em: Emitter, node, momentum) -> dict[str, str]:
    """One BatchNormalization in training form (see training_forward); gives {running
    statistic: its updated value}."""
    x, scale, bias, mean, var = node.input[:5]
    y = node.output[0]
    eps = attr(node, "epsilon", 1e-5)
    mom = float(momentum) if momentum is not None else _float_attr(attr(node, "momentum", 0.9))
    xdt, sdt = em.dtype(x), em.dtype(scale)
    cdt = TensorProto.DOUBLE if TensorProto.DOUBLE in (xdt, sdt) else TensorProto.FLOAT
    chan = [0] + list(range(2, em.rank(x)))  # the axes reduced per channel
    xs = em.cast(x, cdt, xdt)
    bmean = em.reduce("ReduceMean", xs, chan, keepdims=0, name=em.names.fresh(y + BATCH_MEAN))
    count = per_channel_count(em, x, chan, cdt)
    ex2 = em.op("Div", [em.reduce("ReduceSumSquare", xs, chan, keepdims=0), count])
    centred = em.op("Sub", [ex2, em.op("Mul", [bmean, bmean])])
    bvar = em.op("Max", [centred, em.const(0.0, cdt)], name=em.names.fresh(y + BATCH_VAR))
    # BN-15 types the statistics and the parameters apart from X, BN-14 the statistics only,
    # BN-13 nothing: where the types do not fit, normalise the FP32 copy and Cast back
    if em.opset >= 15 or (xdt == sdt and (cdt == xdt or em.opset == 14)):
        em.op("BatchNormalization", [x, scale, bias, bmean, bvar], name=y, epsilon=eps)
    else:
        yc = em.op("BatchNormalization", [xs, em.cast(scale, cdt, sdt), em.cast(bias, cdt, em.dtype(bias)),
                                          bmean, bvar], epsilon=eps)
        em.op("Cast", [yc], name=y, to=xdt)
    # running var takes the unbiased variance: (1 - momentum) * M / (M - 1) * biased, that
    # weight made once per feature-map shape (count is shared the same way)
    key = ("bn_var_weight", count, mom)
    if key not in em._cache:
        em._cache[key] = em.op("Mul", [em.op("Div", [count, em.op("Sub", [count, em.const(1.0, cdt)])]),
                                       em.const(1.0 - mom, cdt)])
    out = {}
    for run, batch, weight in ((mean, bmean, em.const(1.0 - mom, cdt)), (var, bvar, em._cache[key])):
        rdt = em.dtype(run)
        out[run] = em.op("Add", [em.op("Mul", [run, em.const(mom, rdt)]),
                                 em.cast(em.op("Mul", [batch, weight]), rdt, cdt)])
    # a BN exported in training form (opset 14+) may already name its updated statistics
    for extra, run in zip(list(node.output[1:3]), (mean, var)):
        if extra:
            em.op("Identity", [out[run]], name=extra)
            out[run] = extra
    return out


def batchnorm_params_to_x_type(model: onnx.ModelProto) -> int:
    """Rewrite, in place, every BatchNormalization whose parameters (scale, B, mean, var) have
    another type than its X (a mixed build: FP16 X and Y, FP32 parameters, as BN-15 allows)
    into one whose five inputs share X's type and that computes the same
    Y = (X - mean) * scale' + B, with scale' = scale / sqrt(var + epsilon) computed in the
    parameters' type and var 0, epsilon 1 (a divisor of exactly 1). Returns the number of
    nodes rewritten; the graph's tensors keep their names.

    Why: ONNX Runtime's CUDA BatchNormalization types all five inputs alike, so a node with
    FP16 X and FP32 parameters has no CUDA kernel and runs on the CPU, with copies to and
    from it. Range: mean and B of X's range fit X's type; |scale'| <= |scale| / sqrt(epsilon)
    (316 |scale| at the default 1e-5) fits FP16 for the scales BatchNorm layers learn.
    A BF16 X gets Y = X * scale' + (B - mean * scale') as Mul and Add instead (ONNX Runtime
    has no BF16 BatchNormalization kernel, CPU or CUDA). Run it after add_backward: the gradient rules read the parameters of the original node."""
    info = tensor_info(model)
    em = Emitter(model, info, "bn_types")
    new_nodes, rewritten = [], 0
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or \
                node.input[0] not in info or node.input[1] not in info or \
                em.dtype(node.input[0]) == em.dtype(node.input[1]) == em.dtype(node.input[3]):
            new_nodes.append(node)
            continue
        em.nodes = []
        x, scale, bias, mean, var = node.input[:5]
        xdt, pdt = em.dtype(x), em.dtype(var)
        inv = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [var, em.const(attr(node, "epsilon", 1e-5), pdt)])])])
        scaled = em.op("Mul", [em.cast(scale, pdt, em.dtype(scale)), inv])
        if xdt == TensorProto.BFLOAT16:  # ORT has no BF16 BatchNormalization kernel: Mul and Add
            shift = em.op("Sub", [em.cast(bias, pdt, em.dtype(bias)),
                                  em.op("Mul", [em.cast(mean, pdt, em.dtype(mean)), scaled])])
            chan = [0] + list(range(2, em.rank(x)))
            em.op("Add", [em.op("Mul", [x, em.unsqueeze(em.cast(scaled, xdt, pdt), chan)]),
                          em.unsqueeze(em.cast(shift, xdt, pdt), chan)], name=node.output[0])
        else:
            mean_x = em.cast(mean, xdt, em.dtype(mean))
            zeros = em.op("Mul", [mean_x, em.const(0.0, xdt)])
            em.nodes.append(helper.make_node("BatchNormalization", [x, em.cast(scaled, xdt, pdt),
                                                                    em.cast(bias, xdt, em.dtype(bias)), mean_x, zeros],
                                             [node.output[0]], name=node.name, epsilon=1.0))
        new_nodes.extend(em.nodes)
        rewritten += 1
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return rewritten

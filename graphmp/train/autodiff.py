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

`training_forward(model)` rewrites BatchNormalization (batch statistics, running-statistic
updates as new tensors) and Dropout (training mode, mask output) in place.

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

import onnx
from onnx import TensorProto, helper

from ..errors import GraphmpError
from ..policy import FLOAT_TYPES
from ..opset import default_opset
from .builder import subgraph_inputs
from .emitter import Emitter, attr, tensor_info
from .rules import RULES, ZERO_GRAD

__all__ = ["MIN_OPSET", "add_backward", "training_forward", "Emitter", "attr", "tensor_info"]

MIN_OPSET = 13


def add_backward(model: onnx.ModelProto, loss: str, wrt: Sequence[str], *, seed: str | None = None,
                 prefix: str = "grad") -> dict[str, str]:
    """Append the nodes computing d(loss)/d(w) for every w in `wrt`; return {w: gradient name}.

    See the module docstring for the guarantees and how rules are applied.
    A w that does not reach `loss` gets a zero gradient of its own shape and dtype."""
    opset = default_opset(model)
    if opset < MIN_OPSET:
        raise GraphmpError(f"add_backward: the model's opset is {opset}; gradients need opset >= "
                           f"{MIN_OPSET} (convert it with onnx.version_converter first)")
    info = tensor_info(model)
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

    BatchNormalization(X, scale, B, mean, var) -> Y normalised with the batch statistics
    (mean and biased variance over N and the spatial axes, computed in the dtype of `scale`,
    i.e. FP32 for a graphmp FP16 model), plus new tensors
    running' = momentum*running + (1-momentum)*batch (unbiased variance for var, as PyTorch);
    momentum: the argument, else the node's attribute, else 0.9.
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


def _bn_training(em: Emitter, node, momentum) -> dict[str, str]:
    x, scale, bias, mean, var = node.input[:5]
    y = node.output[0]
    eps = attr(node, "epsilon", 1e-5)
    mom = momentum if momentum is not None else attr(node, "momentum", 0.9)
    rank = em.rank(x)
    axes = [0] + list(range(2, rank))
    pdt, xdt = em.dtype(scale), em.dtype(x)
    xf = em.cast(x, pdt, xdt)
    bmean = em.reduce("ReduceMean", xf, axes, keepdims=1)
    centred = em.op("Sub", [xf, bmean])
    bvar = em.reduce("ReduceMean", em.op("Mul", [centred, centred]), axes, keepdims=1)
    inv = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [bvar, em.const(eps, pdt)])])])
    chan = [0] + list(range(2, rank))  # axes to unsqueeze a [C] vector to [1, C, 1, ...]
    s = em.unsqueeze(scale, chan)
    b = em.unsqueeze(bias, chan)
    yf = em.op("Add", [em.op("Mul", [em.op("Mul", [centred, inv]), s]), b])
    if pdt == xdt:
        em.op("Identity", [yf], name=y)
    else:
        em.op("Cast", [yf], name=y, to=xdt)
    # running statistics: unbiased variance, n = elements per channel
    n = em.op("Cast", [em.op("Div", [em.op("Size", [x]), em.dim(x, 1)])], to=pdt)
    unbiased = em.op("Div", [em.op("Mul", [em.squeeze(bvar, chan), n]),
                             em.op("Sub", [n, em.const(1.0, pdt)])])
    out = {}
    for run, batch in ((mean, em.squeeze(bmean, chan)), (var, unbiased)):
        rdt = em.dtype(run)
        upd = em.op("Add", [em.op("Mul", [run, em.const(mom, rdt)]),
                            em.op("Mul", [em.cast(batch, rdt, pdt), em.const(1.0 - mom, rdt)])])
        out[run] = upd
    # a BN exported in training form (opset 14+) may already name its updated statistics
    for extra, run in zip(list(node.output[1:3]), (mean, var)):
        if extra:
            em.op("Identity", [out[run]], name=extra)
            out[run] = extra
    return out

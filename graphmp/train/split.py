"""The training step split in two, for data parallelism (issue 24): a gradient graph that
each rank runs on its own batch, and an update graph that every rank runs on the gradients
all ranks reduced.

Both are cut out of the fused step graph at the FP32 gradient: flat__grad, all weights'
gradients in one buffer, still scaled by the loss scale S (graphmp.train.flat; every rank
has the same S, and the update half unscales; a step built before: the unscaled flat
gradient, or each <weight>__grad), so they compute exactly what the fused step computes:

  gradient graph  inputs: the batch, the labels, the weights, BN statistics, the loss
                  scale (dynamic scaling) and the step counter where the loss reads it;
                  outputs: the loss, the gradient(s), and the BN statistics' values
                  after this batch (FP32; one flat buffer with flat state).
  update graph    inputs: the step graph's state (flat buffers of the weights, moments and
                  BN statistics, counters, scale; or one input per tensor) plus the
                  tensors the gradient graph gives (the reduced gradients and loss);
                  outputs: the fused step's all_finite and every <state>__next.

Every rank feeding the update graph the same reduced gradients and loss gets the same
finite flag, so all ranks skip the same steps and keep the same loss scale. With gradient
accumulation the update graph keeps the fused step's window logic (the window's sums and
count are state inputs); graphmp.train.dp_step feeds it a whole window at once.
"""
from __future__ import annotations

import copy

import onnx
from onnx import helper

from ..errors import GraphmpError
from .builder import subgraph_inputs
from .flat import graph_state

GRAD = "__grad"


def _needed(graph, outputs: list, stops: set) -> list:
    """The nodes (in graph order) the outputs depend on, not looking past `stops`."""
    prod = {o: n for n in graph.node for o in n.output}
    keep, seen, todo = set(), set(), list(outputs)
    while todo:
        t = todo.pop()
        if t in seen or t in stops:
            continue
        seen.add(t)
        n = prod.get(t)
        if n is None or id(n) in keep:
            continue
        keep.add(id(n))
        todo.extend(x for x in n.input if x)
        todo.extend(subgraph_inputs(n))
    return [n for n in graph.node if id(n) in keep]


def _value_infos(model) -> dict:
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    return {v.name: v for v in list(g.value_info) + list(g.input) + list(g.output)}


def _sub_model(model, nodes: list, inputs: list, outputs: list, infos: dict, name: str):
    """A model holding `nodes`, reading `inputs` (+ the initializers they use), writing `outputs`."""
    g = model.graph
    used = {x for n in nodes for x in list(n.input) + list(subgraph_inputs(n))}
    missing = [x for x in inputs if x not in infos]
    if missing:
        raise GraphmpError(f"the step graph does not declare the type of {missing[:3]}; cannot split it")
    graph = helper.make_graph([copy.deepcopy(n) for n in nodes], name,
                              [copy.deepcopy(infos[x]) for x in inputs if x in used or x in outputs],
                              [copy.deepcopy(infos[y]) for y in outputs],
                              [copy.deepcopy(t) for t in g.initializer if t.name in used])
    out = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return out


def split_step(model, meta: dict) -> tuple:
    """(gradient model, update model, the tensors the gradient graph hands over) of a fused
    step graph (meta: its train.json dict)."""
    flat = meta.get("flat")
    grads = [flat["grad"]] if flat else [w + GRAD for w in meta["weights"]]
    produced = {o for n in model.graph.node for o in n.output}
    if any(gname not in produced for gname in grads):
        raise GraphmpError("the step graph names no <weight>__grad tensors (built by an older graphmp): rebuild it "
                           "with `graphmp train-graph ... --force`")
    loss = meta["loss_output"]
    prod = {o: n for n in model.graph.node for o in n.output}
    bn_new = []
    state = graph_state(meta)
    for s in state:
        if s.get("kind") == "bn":  # X__next = Where(finite, new value, X): the new value comes from the forward
            bn_new.append(prod[s["output"]].input[1])
    handed = [loss] + grads + bn_new
    infos = _value_infos(model)
    inputs = [v.name for v in model.graph.input]
    grad_nodes = _needed(model.graph, handed, set())
    grad_model = _sub_model(model, grad_nodes, inputs, handed, infos, "gradients")
    outputs = [o.name for o in model.graph.output if not o.name.endswith(GRAD) and o.name != loss]
    update_nodes = _needed(model.graph, outputs, set(handed))
    state_inputs = [s["input"] for s in state]
    update_model = _sub_model(model, update_nodes, state_inputs + handed, outputs, infos, "update")
    reads = {x for n in update_nodes for x in list(n.input) + list(subgraph_inputs(n))}
    stray = sorted(reads & (set(inputs) - set(state_inputs)))
    if stray:
        raise GraphmpError(f"the update half of the step reads {stray[:3]} beyond the state and the gradients; "
                           "this step cannot be split (please report it with the model)")
    return grad_model, update_model, handed

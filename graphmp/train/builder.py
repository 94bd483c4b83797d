"""Graph-building helpers shared by the pieces of the training step (step.py, losses.py,
optim.py, source.py): a node/constant appender with unique names, tensor-info lookups,
dependency walks, pruning, and lifting initializers to graph inputs.

Nothing here imports another module of graphmp.train, so every piece can use it."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import GraphmpError
from ..model_io import iter_graphs
from ..ir import Names
from ..save import save_model


class Builder:
    """Appends nodes and constant initializers to a graph with unique names."""

    def __init__(self, model: onnx.ModelProto, prefix: str = "train_step"):
        self.g = model.graph
        self.prefix = prefix
        self.names = Names(model)

    def name(self, hint: str) -> str:
        return self.names.numbered(f"{self.prefix}/{hint}")

    def const(self, value, dtype=np.float32) -> str:
        name = self.name("const")
        self.g.initializer.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs, out: str | None = None, **attrs) -> str:
        out = out or self.name(op_type)
        self.g.node.append(helper.make_node(op_type, list(inputs), [out], name=self.name(op_type + "_node"),
                                            **attrs))
        return out


def all_names(model) -> set:
    """Every tensor and node name of the model (subgraphs included)."""
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


def value_info(model, name):
    """ValueInfoProto of tensor `name` (graph input/output or inferred); None when unknown."""
    for v in itertools.chain(model.graph.input, model.graph.output, model.graph.value_info):
        if v.name == name:
            return v
    inferred = onnx.shape_inference.infer_shapes(model)
    for v in itertools.chain(inferred.graph.value_info, inferred.graph.output):
        if v.name == name:
            return v
    return None


def dims(vi) -> list | None:
    """[int | str | None] of a ValueInfoProto's shape; None when the rank is unknown. A negative
    dim_value (paddle2onnx writes -1 for a dynamic batch) is a dynamic dim."""
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else (d.dim_param or None)
            for d in vi.type.tensor_type.shape.dim]


def elem_name(model, name) -> str:
    """numpy dtype name of tensor `name`."""
    vi = value_info(model, name)
    return np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)).name


def subgraph_inputs(node):
    for a in node.attribute:
        for sg in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            for sn in sg.node:
                yield from (x for x in sn.input if x)


def ancestors(graph, target: str) -> set:
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
        todo.extend(subgraph_inputs(n))
    return seen


def producer(model, name, through_identity: bool = False):
    """The node writing tensor `name` (None for inputs/initializers); through_identity: the
    first producer that is not an Identity (exports often end in Identity(Softmax))."""
    prod = {o: n for n in model.graph.node for o in n.output}
    n = prod.get(name)
    while through_identity and n is not None and n.op_type == "Identity":
        n = prod.get(n.input[0])
    return n


def producer_op(model, name, through_identity: bool = False):
    n = producer(model, name, through_identity)
    return None if n is None else n.op_type


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


def prune(model) -> None:
    """Drop nodes no graph output depends on (other heads of a multi-output model)."""
    needed = {o.name for o in model.graph.output}
    keep = []
    for n in reversed(model.graph.node):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(n.input)
            needed.update(subgraph_inputs(n))
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


def save_checked(model, path, full: bool = True):
    """ONNX check (full: with strict shape inference), then an atomic save (inline tensors).
    A model that fails it is a GraphmpError naming the file (nothing is written)."""
    try:
        onnx.checker.check_model(model, full_check=full)
    except onnx.checker.ValidationError as e:
        raise GraphmpError(f"{path}: the graph train-graph built fails onnx's checker "
                           f"({str(e).strip().splitlines()[0][:200]}); this is a graphmp bug: please report it "
                           "with the model.") from None
    save_model(model, path, None, None, external=False)


def passes_full_check(model) -> str | None:
    """None when the model passes onnx's full check, else the checker's first line."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:  # noqa: BLE001 - the checker raises ValidationError and InferenceError
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return None


def cone(model: onnx.ModelProto, tensors) -> onnx.ModelProto:
    """The part of `model` that computes `tensors` (their producers and everything upstream),
    as a model whose outputs they are (same inputs, initializers and opsets).

    For data propagation (onnx.shape_inference.infer_shapes(..., data_prop=True)) on a step
    graph: on the whole graph it also evaluates the index arithmetic of the backward and the
    optimizer over whole buffers, none of which a shape question needs. A BERT-base step
    graph took 9 GB and 11 s per encoder layer, and was killed on a 24 GB machine."""
    producer = {o: n for n in model.graph.node for o in n.output}
    kept, stack = set(), list(tensors)
    while stack:
        n = producer.get(stack.pop())
        if n is not None and id(n) not in kept:
            kept.add(id(n))
            stack.extend(t for t in n.input if t)
    nodes = [n for n in model.graph.node if id(n) in kept]
    outputs = [helper.make_tensor_value_info(t, 0, None) for t in sorted(set(tensors)) if t in producer]
    graph = helper.make_graph(nodes, "cone", list(model.graph.input), outputs, list(model.graph.initializer))
    return helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                             functions=list(model.functions))

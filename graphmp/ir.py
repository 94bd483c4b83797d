"""A thin view over an ONNX ModelProto: graphs with scopes (subgraphs of If/Loop/Scan
see their parents' values), nodes with stable identity, tensor types, unique names,
and topological sorting that understands outer-scope captures.

Weights are never copied here: initializers stay where the proto keeps them (inline
or external data), so a 3 GB model costs only its graph structure.
"""
from __future__ import annotations

import heapq
import itertools

import onnx
from onnx import GraphProto, ModelProto, NodeProto

from .errors import GraphmpError


def attr_graphs(a) -> list:
    """The subgraphs an attribute holds (If branches, Loop/Scan bodies)."""
    return [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)


def iter_graphs(graph):
    """Every GraphProto in the model: the main graph and all subgraphs."""
    yield graph
    for n in graph.node:
        for a in n.attribute:
            for g in attr_graphs(a):
                yield from iter_graphs(g)


class Node:
    """One NodeProto plus the graph it lives in and its subgraphs (by attribute).

    A Node compares and hashes by identity (object's defaults: it defines no __eq__), so
    the passes key per-node state by the Node itself (ctx.info, ctx.lowered, ...): a key
    keeps its node alive and names it, where an id could be reused by a later object."""

    __slots__ = ("proto", "graph", "subgraphs", "order")

    def __init__(self, proto: NodeProto, graph: "Graph", order: float):
        self.proto = proto
        self.graph = graph
        self.order = order
        self.subgraphs: list[Graph] = []

    @property
    def name(self) -> str:
        return self.proto.name

    @property
    def op_type(self) -> str:
        return self.proto.op_type

    @property
    def domain(self) -> str:
        return self.proto.domain

    @property
    def inputs(self):
        return self.proto.input

    @property
    def outputs(self):
        return self.proto.output

    def attr(self, name, default=None):
        for a in self.proto.attribute:
            if a.name == name:
                return onnx.helper.get_attribute_value(a)
        return default

    def implicit_inputs(self) -> set[str]:
        """Outer-scope names read by this node's subgraphs (recursively)."""
        names: set[str] = set()
        for sg in self.subgraphs:
            names |= sg.free_names()
        return names

    def __repr__(self):
        return f"Node({self.op_type} '{self.name}')"


class Graph:
    def __init__(self, proto: GraphProto, parent: "Graph | None", key: str, owner: Node | None = None):
        self.proto = proto
        self.parent = parent
        self.key = key
        self.owner = owner
        self.nodes: list[Node] = [Node(n, self, i) for i, n in enumerate(proto.node)]
        self.initializers = {t.name: t for t in proto.initializer}
        self.input_names = [v.name for v in proto.input]
        self.output_names = [v.name for v in proto.output]
        self.children: list[Graph] = []
        for node in self.nodes:
            for a in node.proto.attribute:
                for j, g in enumerate(attr_graphs(a)):
                    sub = Graph(g, self, f"{key}/{node.name}.{a.name}{j or ''}", node)
                    node.subgraphs.append(sub)
                    self.children.append(sub)

    # --- scopes -------------------------------------------------------------
    def local_names(self) -> set[str]:
        names = set(self.input_names) | set(self.initializers)
        for n in self.nodes:
            names.update(o for o in n.outputs if o)
        return names

    def free_names(self) -> set[str]:
        """Names this graph (and its subgraphs) read but do not define: outer-scope captures."""
        local = self.local_names()
        used = set()
        for n in self.nodes:
            used.update(i for i in n.inputs if i)
            used |= n.implicit_inputs()
        used.update(self.output_names)
        return used - local

    def owner_of(self, name: str) -> "Graph | None":
        """The graph (this one or an ancestor) that defines `name`."""
        g = self
        while g is not None:
            if name in g._defined():
                return g
            g = g.parent
        return None

    def _defined(self) -> set[str]:
        cache = getattr(self, "_defined_cache", None)
        if cache is None:
            cache = self.local_names()
            self._defined_cache = cache
        return cache

    def invalidate(self):
        self._defined_cache = None

    def walk(self):
        yield self
        for c in self.children:
            yield from c.walk()

    # --- edges --------------------------------------------------------------
    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs if o}

    def consumers(self) -> dict[str, list[Node]]:
        """Tensor name -> nodes of this graph reading it (directly or from a subgraph)."""
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for name in dict.fromkeys(list(n.inputs) + sorted(n.implicit_inputs())):
                if name:
                    out.setdefault(name, []).append(n)
        return out

    # --- writing back ---------------------------------------------------------
    def toposort(self, model_path: str = "<model>"):
        """Sort nodes so every value is defined before use (outer-scope captures of
        subgraphs count as inputs). Keeps the original order where it is free."""
        produced = {o: n for n in self.nodes for o in n.outputs if o}
        deps: dict[Node, set[Node]] = {}
        for n in self.nodes:
            reads = set(i for i in n.inputs if i) | n.implicit_inputs()
            deps[n] = {produced[r] for r in reads if r in produced and produced[r] is not n}
        users: dict[Node, list[Node]] = {n: [] for n in self.nodes}
        for n in self.nodes:
            for d in deps[n]:
                users[d].append(n)
        indeg = {n: len(deps[n]) for n in self.nodes}
        tie = itertools.count()
        heap = [(n.order, next(tie), n) for n in self.nodes if indeg[n] == 0]
        heapq.heapify(heap)
        out = []
        while heap:
            _, _, n = heapq.heappop(heap)
            out.append(n)
            for u in users[n]:
                indeg[u] -= 1
                if indeg[u] == 0:
                    heapq.heappush(heap, (u.order, next(tie), u))
        if len(out) != len(self.nodes):
            stuck = [n.name for n in self.nodes if indeg[n] > 0][:5]
            raise GraphmpError(f"{model_path}: graph '{self.key}' has a cycle through nodes {stuck}; "
                               "the model is not a valid ONNX DAG. Re-export it.")
        self.nodes = out
        for i, n in enumerate(out):
            n.order = i

    def write_back(self):
        """Store node order/additions into the GraphProto (children first)."""
        for c in self.children:
            c.write_back()
        protos = []
        for n in self.nodes:
            p = NodeProto()
            p.CopyFrom(n.proto)
            protos.append(p)
        self.proto.ClearField("node")
        self.proto.node.extend(protos)
        self._rebind(self.proto)

    def _rebind(self, proto: GraphProto):
        """Point this graph, its nodes, initializers and subgraphs (recursively) at the
        protos stored in the model. Protobuf copies messages on insertion, so without
        this an edit after write_back (a converted subgraph weight, a rewired input)
        would land on a detached copy and silently vanish."""
        self.proto = proto
        self.initializers = {t.name: t for t in proto.initializer}
        for n, p in zip(self.nodes, proto.node):
            n.proto = p
            subs = iter(n.subgraphs)
            for a in p.attribute:
                for g in attr_graphs(a):
                    next(subs)._rebind(g)
        self.invalidate()


class Names:
    """Fresh, model-wide unique names for nodes and tensors (every graph's, subgraphs
    included, count as used): fresh(base) is `base` while it is free, else base_N;
    numbered(stem) always numbers, stem_N with N the next of one sequence from `start`
    (the names of generated pieces: training graphs, unrolled RNNs)."""

    def __init__(self, model: ModelProto, start: int = 0):
        self.used: set[str] = set()
        stack = [model.graph]
        while stack:
            g = stack.pop()
            self.used.update(v.name for v in itertools.chain(g.input, g.output, g.value_info, g.initializer))
            for n in g.node:
                self.used.add(n.name)
                self.used.update(n.input)
                self.used.update(n.output)
                for a in n.attribute:
                    stack.extend(attr_graphs(a))
        self.counter = itertools.count()
        self.sequence = itertools.count(start)

    def fresh(self, base: str) -> str:
        name = base
        while name in self.used:
            name = f"{base}_{next(self.counter)}"
        self.used.add(name)
        return name

    def numbered(self, stem: str) -> str:
        while True:
            name = f"{stem}_{next(self.sequence)}"
            if name not in self.used:
                self.used.add(name)
                return name


def name_nodes(model: ModelProto, names: Names) -> int:
    """Give every unnamed or duplicate-named node (in every graph) a unique name.
    Returns how many nodes were renamed."""
    seen: set[str] = set()
    renamed = 0
    stack = [model.graph]
    while stack:
        g = stack.pop()
        for n in g.node:
            if not n.name or n.name in seen:
                n.name = names.fresh(f"{n.op_type}_{n.name}" if n.name else n.op_type)
                renamed += 1
            seen.add(n.name)
            for a in n.attribute:
                stack.extend(attr_graphs(a))
    return renamed

"""paint: decide which nodes run in low precision, TensorFlow auto-mixed-precision style.

Works per graph on the FP32 edges between nodes (a subgraph is painted on its own;
its I/O keep their declared types). Named steps, in order:
  1. islands:  nodes after a source Cast(FP16->FP32) up to the next Cast stay FP32
               (deliberate FP32 islands of an already mixed model);
  2. deny:     FP32 spreads forward from FP32 nodes through follow/clear nodes that
               lead into FP32 or follow work (deny -> Add -> LayerNorm keeps the Add FP32);
  3. between:  follow/clear nodes on a path between two fp16 nodes become fp16
               (an embedding Gather from a float initializer counts as fp16 work);
  4. after:    follow/clear nodes whose float inputs all come from fp16 work (or are
               constants) become fp16: widest wins, an FP32 operand keeps them FP32;
  5. clear:    clear nodes connected to fp16 nodes through clear nodes become fp16.
Everything else keeps its FP32 type. Casts then appear only where a painted region
meets an FP32 one.

Needs: ctx.info (classify). Guarantees: ctx.lowered holds id(node) of every node that
runs in the low type; nothing else changes.
"""
from __future__ import annotations

from collections import deque

from ..context import FLOAT
from . import PassResult

ISLAND = "inside a deliberate FP32 island of the source model"
SPREAD = "FP32 spread from an FP32 neighbour ({})"


def float_edges(ctx, g):
    """succ/pred over nodes of graph g, through tensors whose source type is FP32."""
    prod = g.producers()
    succ = {id(n): [] for n in g.nodes}
    pred = {id(n): [] for n in g.nodes}
    for n in g.nodes:
        reads = list(n.inputs) + sorted(n.implicit_inputs())
        for x in dict.fromkeys(reads):
            p = prod.get(x)
            if p is None or p is n or ctx.type_of(g, x) != FLOAT:
                continue
            succ[id(p)].append(n)
            pred[id(n)].append(p)
    return succ, pred


def _fp32_sources(ctx, g):
    """ids of the nodes that read an FP32 graph input or outer-scope value (a source no
    painting can lower)."""
    local = {o for n in g.nodes for o in n.outputs if o}
    out = set()
    for n in g.nodes:
        for x in list(n.inputs) + sorted(n.implicit_inputs()):
            if not x or x in local:
                continue
            owner = g.owner_of(x)
            if owner is not None and x in owner.initializers:
                continue
            if ctx.type_of(g, x) == FLOAT:
                out.add(id(n))
    return out


def _reach(starts, nbrs, ok):
    """Nodes reachable from `starts` (excluded) via nbrs, stepping only onto ok nodes."""
    seen = {}
    dq = deque(starts)
    while dq:
        n = dq.popleft()
        for m in nbrs[id(n)]:
            if id(m) not in seen and ok(m):
                seen[id(m)] = m
                dq.append(m)
    return seen


def paint_graph(ctx, g):
    info = ctx.info
    nodes = [n for n in g.nodes if info[id(n)].cls != "none"]
    succ, pred = float_edges(ctx, g)

    def kind(n):
        i = info[id(n)]
        if i.reason:
            return "deny"
        return {"fp16": "allow", "follow": "infer", "clear": "clear"}.get(i.cls, "barrier")

    # 1. islands
    island_starts = [n for n in nodes if n.op_type == "Cast" and info[id(n)].reason and "island" in info[id(n)].reason]
    for m in _reach(island_starts, succ, lambda m: kind(m) != "barrier" and m.op_type != "Cast").values():
        if not info[id(m)].reason:
            info[id(m)].reason = ISLAND

    # 2. deny forward through infer/clear into deny/infer
    deny = {id(n): n for n in nodes if kind(n) == "deny"}
    reach = _reach(deny.values(), succ, lambda m: kind(m) in ("infer", "clear"))
    ends = [m for m in reach.values() if kind(m) == "infer" or any(id(s) in deny for s in succ[id(m)])]
    marked = {id(m): m for m in ends}
    marked.update(_reach(ends, pred, lambda m: id(m) in reach))
    for m in marked.values():
        src = next((p for p in pred[id(m)] if id(p) in deny or id(p) in marked), None)
        info[id(m)].reason = SPREAD.format(src.name if src is not None else "?")
        deny[id(m)] = m

    # 3. between allow nodes. Embedding lookups (Gather from a float initializer)
    #    count as fp16 work: the table is stored FP16 and gathering is exact.
    def embedding(n):
        owner = g.owner_of(n.inputs[0]) if n.op_type == "Gather" else None
        return owner is not None and n.inputs[0] in owner.initializers
    allow = {id(n): n for n in nodes if kind(n) == "allow" or (kind(n) == "clear" and embedding(n))}
    free = lambda m: kind(m) in ("infer", "clear")  # noqa: E731
    down = _reach(allow.values(), succ, free)
    up = _reach(allow.values(), pred, free)
    allow.update({k: v for k, v in down.items() if k in up})
    # 4. follow nodes after allow (through clear nodes), widest wins: only when every
    #    float input that is not a constant already comes from fp16 work
    fp32_in = _fp32_sources(ctx, g)
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if id(n) in allow or not free(n):
                continue
            ps = pred[id(n)]
            if ps and id(n) not in fp32_in and all(id(p) in allow for p in ps):
                allow[id(n)] = n
                changed = True
    # 5. clear nodes connected to allow through clear nodes
    is_clear = lambda m: kind(m) == "clear"  # noqa: E731
    both = {k: succ[k] + pred[k] for k in succ}
    allow.update(_reach(list(allow.values()), both, is_clear))
    ctx.lowered.update(allow)


def paint(ctx):
    for g in ctx.root.walk():
        paint_graph(ctx, g)


def run(ctx) -> PassResult:
    paint(ctx)
    return PassResult(changed=False, details={"nodes_lowered": len(ctx.lowered)})

"""paint: decide which nodes run in low precision, TensorFlow auto-mixed-precision style.

Works per graph on the FP32 edges between nodes (a subgraph is painted on its own;
its I/O keep their declared types). Named steps, in order:
  1. islands:  nodes after a source Cast(FP16->FP32) up to the next Cast stay FP32
               (deliberate FP32 islands of an already mixed model);
  2. deny:     FP32 spreads forward from FP32 nodes through follow/clear nodes that
               lead into FP32 or follow work (deny -> Add -> LayerNorm keeps the Add FP32),
               except that it stops at a join: a follow node that also reads FP16 work
               (the residual Add of an FP32 branch and a conv's output) and does not
               lead into FP32 work is left to the FP16 steps, saving two Casts for one;
  3. between:  follow/clear/norm nodes on a path between two fp16 nodes become fp16
               (an embedding Gather from a float initializer counts as fp16 work);
               a norm node (Softmax, LogSoftmax; LayerNormalization with --norm-io
               all) becomes fp16 only here: FP16 in and out, FP32 inside the kernel;
  4. after:    follow/clear nodes whose float inputs all come from fp16 work (or are
               constants) become fp16: widest wins, an FP32 operand keeps them FP32;
  5. clear:    clear nodes connected to fp16 nodes through clear nodes become fp16.
Everything else keeps its FP32 type (a norm node left out gets its FP32 reason). Casts
then appear only where a painted region meets an FP32 one.

Needs: ctx.info (classify). Guarantees: ctx.lowered holds every node (graphmp.ir.Node)
that runs in the low type; the nodes step 2 marks and the norm nodes left FP32 get their
reason in ctx.info (class fp32).
"""
from __future__ import annotations

from collections import deque

from ..context import FLOAT
from . import PassResult

ISLAND = "inside a deliberate FP32 island of the source model"
SPREAD = "FP32 spread from an FP32 neighbour ({})"
NORM_KEPT = ("{} is range-sensitive (FP32 op class); --norm-io lowers it only between FP16 work, and its "
             "input or output is FP32 here")


def float_edges(ctx, g):
    """succ/pred over nodes of graph g, through tensors whose source type is FP32."""
    prod = g.producers()
    succ = {n: [] for n in g.nodes}
    pred = {n: [] for n in g.nodes}
    for n in g.nodes:
        reads = list(n.inputs) + sorted(n.implicit_inputs())
        for x in dict.fromkeys(reads):
            p = prod.get(x)
            if p is None or p is n or ctx.type_of(g, x) != FLOAT:
                continue
            succ[p].append(n)
            pred[n].append(p)
    return succ, pred


def _fp32_sources(ctx, g):
    """The nodes that read an FP32 graph input or outer-scope value (a source no
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
                out.add(n)
    return out


def _reach(starts, nbrs, ok):
    """Nodes reachable from `starts` (excluded) via nbrs, stepping only onto ok nodes: an
    ordered set (a dict node -> None, in the order reached)."""
    seen = {}
    dq = deque(starts)
    while dq:
        n = dq.popleft()
        for m in nbrs[n]:
            if m not in seen and ok(m):
                seen[m] = None
                dq.append(m)
    return seen


def _joins(nodes, succ, pred, kind, reach) -> set:
    """The follow nodes where FP32 from a deny node meets FP16 work: a node reached
    by the spread that also reads a tensor of allow work (directly or through clear nodes,
    not itself reached by the spread), e.g. the residual Add of conv(x) + fp32_branch(x).
    Computing it in FP32 would cast the FP16 operand up and the sum back down for the FP16
    work after it; in FP16 only the FP32 operand is cast (one rounding of a value the next
    FP16 op rounds anyway). A join that leads into FP32 work stays FP32 (step 2's
    deny -> ... -> deny rule), as the residual stream into a LayerNorm does."""
    low = {n for n in nodes if kind(n) == "allow"}
    todo = [n for n in nodes if n in low]
    while todo:
        n = todo.pop()
        for m in succ[n]:
            if kind(m) == "clear" and m not in low:
                low.add(m)
                todo.append(m)
    return {m for m in reach if kind(m) == "infer"
            and any(p in low and p not in reach for p in pred[m])}


def paint_graph(ctx, g):
    info = ctx.info
    nodes = [n for n in g.nodes if info[n].cls != "none"]
    succ, pred = float_edges(ctx, g)

    def kind(n):
        i = info[n]
        if i.reason:
            return "deny"
        return {"fp16": "allow", "follow": "infer", "clear": "clear", "norm": "norm"}.get(i.cls, "barrier")

    # 1. islands
    island_starts = [n for n in nodes if n.op_type == "Cast" and info[n].reason and "island" in info[n].reason]
    for m in _reach(island_starts, succ, lambda m: kind(m) != "barrier" and m.op_type != "Cast"):
        if not info[m].reason:
            info[m].reason = ISLAND

    # 2. deny forward through infer/clear into deny/infer; a join stops the spread
    #    (deny, marked, allow: ordered sets, dicts node -> None)
    deny = dict.fromkeys(n for n in nodes if kind(n) == "deny")
    free = lambda m: kind(m) in ("infer", "clear", "norm")  # noqa: E731
    reach = _reach(deny, succ, free)
    joins = _joins(nodes, succ, pred, kind, reach)
    spread = _reach(deny, succ, lambda m: free(m) and m not in joins)
    ends = [m for m in spread if kind(m) in ("infer", "norm")]
    ends += [m for m in reach if any(s in deny for s in succ[m])]  # deny -> ... -> deny
    marked = dict.fromkeys(ends)
    marked.update(_reach(ends, pred, lambda m: m in reach))
    for m in marked:
        src = next((p for p in pred[m] if p in deny or p in marked), None)
        info[m].reason = SPREAD.format(src.name if src is not None else "?")
        deny[m] = None

    # 3. between allow nodes. Embedding lookups (Gather from a float initializer)
    #    count as fp16 work: the table is stored FP16 and gathering is exact.
    def embedding(n):
        owner = g.owner_of(n.inputs[0]) if n.op_type == "Gather" else None
        return owner is not None and n.inputs[0] in owner.initializers
    allow = dict.fromkeys(n for n in nodes if kind(n) == "allow" or (kind(n) == "clear" and embedding(n)))
    down = _reach(allow, succ, free)
    up = _reach(allow, pred, free)
    allow.update(dict.fromkeys(m for m in down if m in up))
    # 4. follow nodes after allow (through clear nodes), widest wins: only when every
    #    float input that is not a constant already comes from fp16 work
    fp32_in = _fp32_sources(ctx, g)
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if n in allow or kind(n) not in ("infer", "clear"):
                continue
            ps = pred[n]
            if ps and n not in fp32_in and all(p in allow for p in ps):
                allow[n] = None
                changed = True
    # 5. clear nodes connected to allow through clear nodes
    is_clear = lambda m: kind(m) == "clear"  # noqa: E731
    both = {k: succ[k] + pred[k] for k in succ}
    allow.update(_reach(list(allow), both, is_clear))
    ctx.lowered.update(allow)
    for n in nodes:  # a norm node not between low-precision work is an FP32 island, as its class says
        if kind(n) == "norm" and n not in allow:
            info[n].cls, info[n].reason = "fp32", NORM_KEPT.format(n.op_type)


def paint(ctx):
    for g in ctx.root.walk():
        paint_graph(ctx, g)


def run(ctx) -> PassResult:
    paint(ctx)
    return PassResult(changed=False, details={"nodes_lowered": len(ctx.lowered)})

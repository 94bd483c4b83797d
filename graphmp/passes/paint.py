"""paint: decide which nodes run in low precision, TensorFlow auto-mixed-precision style.

Works per graph on the FP32 edges between nodes (a subgraph is painted on its own;
its I/O keep their declared types). Named steps, in order (STEPS):
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

repaint(ctx, g, freed) paints g again as if the nodes `freed` had no FP32 reason (the
islands pass tries an FP32 island in FP16 with it).

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


class _Canvas:
    """One graph being painted: its nodes, float edges, each node's kind (allow, infer,
    clear, norm, deny, barrier: from ctx.info, so a reason set by a step makes it deny)
    and the allow set the steps grow (an ordered set: dict node -> None)."""

    KINDS = {"fp16": "allow", "follow": "infer", "clear": "clear", "norm": "norm"}

    def __init__(self, ctx, g):
        self.ctx, self.g, self.info = ctx, g, ctx.info
        self.nodes = [n for n in g.nodes if self.info[n].cls != "none"]
        self.succ, self.pred = float_edges(ctx, g)
        self.allow = {}

    def kind(self, n) -> str:
        i = self.info[n]
        return "deny" if i.reason else self.KINDS.get(i.cls, "barrier")

    def free(self, n) -> bool:
        return self.kind(n) in ("infer", "clear", "norm")


def _islands(c: _Canvas) -> None:
    """Step 1: nodes after a source Cast(FP16->FP32), up to the next Cast, stay FP32."""
    starts = [n for n in c.nodes if n.op_type == "Cast" and c.info[n].reason and "island" in c.info[n].reason]
    for m in _reach(starts, c.succ, lambda m: c.kind(m) != "barrier" and m.op_type != "Cast"):
        if not c.info[m].reason:
            c.info[m].reason = ISLAND


def _deny(c: _Canvas) -> None:
    """Step 2: FP32 spreads forward from deny nodes through infer/clear/norm nodes into
    infer or deny work; a join (_joins) stops it unless it leads into deny work."""
    deny = dict.fromkeys(n for n in c.nodes if c.kind(n) == "deny")
    reach = _reach(deny, c.succ, c.free)
    joins = _joins(c.nodes, c.succ, c.pred, c.kind, reach)
    spread = _reach(deny, c.succ, lambda m: c.free(m) and m not in joins)
    ends = [m for m in spread if c.kind(m) in ("infer", "norm")]
    ends += [m for m in reach if any(s in deny for s in c.succ[m])]  # deny -> ... -> deny
    marked = dict.fromkeys(ends)
    marked.update(_reach(ends, c.pred, lambda m: m in reach))
    for m in marked:
        src = next((p for p in c.pred[m] if p in deny or p in marked), None)
        c.info[m].reason = SPREAD.format(src.name if src is not None else "?")
        deny[m] = None


def _between(c: _Canvas) -> None:
    """Step 3: allow nodes, and the infer/clear/norm nodes on a path between two of them.
    Embedding lookups (Gather from a float initializer) count as allow: the table is
    stored FP16 and gathering is exact."""
    def embedding(n):
        owner = c.g.owner_of(n.inputs[0]) if n.op_type == "Gather" else None
        return owner is not None and n.inputs[0] in owner.initializers
    c.allow = dict.fromkeys(n for n in c.nodes if c.kind(n) == "allow" or (c.kind(n) == "clear" and embedding(n)))
    down = _reach(c.allow, c.succ, c.free)
    up = _reach(c.allow, c.pred, c.free)
    c.allow.update(dict.fromkeys(m for m in down if m in up))


def _after(c: _Canvas) -> None:
    """Step 4: infer/clear nodes whose float inputs all come from allow work (constants
    aside) join it, until nothing changes; an FP32 operand keeps them FP32 (widest wins)."""
    fp32_in = _fp32_sources(c.ctx, c.g)
    changed = True
    while changed:
        changed = False
        for n in c.nodes:
            if n in c.allow or c.kind(n) not in ("infer", "clear"):
                continue
            ps = c.pred[n]
            if ps and n not in fp32_in and all(p in c.allow for p in ps):
                c.allow[n] = None
                changed = True


def _clear(c: _Canvas) -> None:
    """Step 5: clear nodes connected to allow work through clear nodes join it."""
    both = {k: c.succ[k] + c.pred[k] for k in c.succ}
    c.allow.update(_reach(list(c.allow), both, lambda m: c.kind(m) == "clear"))


# the steps of the module docstring, in its order (tests/test_policy.py holds them equal)
STEPS = [("islands", _islands), ("deny", _deny), ("between", _between), ("after", _after), ("clear", _clear)]


def _painted(ctx, g) -> _Canvas:
    """The canvas of g after STEPS; a norm node left out gets its FP32 class and reason."""
    c = _Canvas(ctx, g)
    for _, step in STEPS:
        step(c)
    for n in c.nodes:  # a norm node not between low-precision work is an FP32 island, as its class says
        if c.kind(n) == "norm" and n not in c.allow:
            c.info[n].cls, c.info[n].reason = "fp32", NORM_KEPT.format(n.op_type)
    return c


def paint_graph(ctx, g):
    ctx.lowered.update(_painted(ctx, g).allow)


def _unpaint(ctx, g) -> None:
    """Back to classify's verdicts on g: the FP32 reasons steps 1-2 and the norm rule gave go."""
    for n in g.nodes:
        i = ctx.info[n]
        if i.reason == ISLAND or (i.reason or "").startswith(SPREAD.split("(")[0]):
            i.reason = None
        elif i.cls == "fp32" and i.reason == NORM_KEPT.format(n.op_type):
            i.cls, i.reason = "norm", None


def repaint(ctx, g, freed=(), commit: bool = False) -> set:
    """The nodes of g that paint lowers when the nodes `freed` lose their FP32 reason and
    count as elementwise work (class follow: FP16 storage, FP32 math inside the kernel).
    Used by the islands pass to try an FP32 island in FP16. ctx.info is left as it was
    unless `commit` (then the freed nodes and the new paint's reasons stay; ctx.lowered is
    the caller's to update)."""
    saved = {n: (ctx.info[n].cls, ctx.info[n].reason) for n in g.nodes}
    try:
        _unpaint(ctx, g)
        for n in freed:
            ctx.info[n].cls, ctx.info[n].reason = "follow", None
        return set(_painted(ctx, g).allow)
    finally:
        if not commit:
            for n, (cls, reason) in saved.items():
                ctx.info[n].cls, ctx.info[n].reason = cls, reason


def paint(ctx):
    for g in ctx.root.walk():
        paint_graph(ctx, g)


def run(ctx) -> PassResult:
    paint(ctx)
    return PassResult(changed=False, details={"nodes_lowered": len(ctx.lowered)})

"""regions: the units the --max-error search switches (graphmp.passes.search, step 1).

A region is a lowered compute node (Conv, MatMul, Gemm, ...) with the lowered follow and
clear nodes that hang from it; the cheapest neighbours are merged down to MAX_REGIONS, so
one decision moves a whole region. Nodes only the range rule keeps FP32 past
classify.GIVE_BACK_RANGE (ctx.wide_range), with what paint lowered only beside them, are
one region per graph (`wide`), never merged: the search starts them FP32 and gives them
back where measured. Each region has two switches (units): its compute
nodes (unit 2k) and its followers (unit 2k+1). Costs are FLOPs at the calibration
batch's shapes; weight bytes stand in where shape inference gives none.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto

from .. import policy
from ..cast_cost import compute_flops
from .paint import float_edges, repaint

MAX_REGIONS = 48


@dataclass
class Region:
    nodes: list = field(default_factory=list)      # IR nodes
    graph: str = "main"
    cost: float = 0.0
    weight_bytes: int = 0
    error_alone: float = 0.0                       # normalized error with only this region in FP16
    wide: bool = False                             # range-rule nodes past GIVE_BACK_RANGE: starts FP32
    error_fp16: float | None = None                # wide: the plan's error when it was tried in FP16 alone

    @property
    def anchor(self):
        return next((n for n in self.nodes if _is_compute(n)), self.nodes[0])

    def parts(self) -> tuple[list, list]:
        """(compute nodes, followers): the region's two switches."""
        return [n for n in self.nodes if _is_compute(n)], [n for n in self.nodes if not _is_compute(n)]


def _is_compute(n) -> bool:
    return policy.op_class(n.op_type, n.domain) == "fp16"


def whole(regions) -> frozenset:
    """The switches (units) of these regions: unit 2k is region k's compute nodes, 2k+1
    its followers."""
    return frozenset(u for k in regions for u in (2 * k, 2 * k + 1))


def node_costs(ctx, batch) -> tuple[dict, bool]:
    """({name: FLOPs}, approximate): FLOPs (Conv/MatMul/Gemm: multiply-adds x 2; other
    ops: output elements) at the batch's concrete input shapes, for the nodes of every
    graph (If/Loop/Scan bodies too: Silero VAD computes inside If branches), from shape
    inference with data propagation (a Reshape to a computed shape keeps its dims).
    Inside bodies inference often keeps the rank but loses a dim (batch, time): such a
    dim counts as 1 and `approximate` is True (the nodes of one body share those dims,
    so shares between them hold); a node without any shape gets no entry."""
    from ..model_io import iter_graphs, skeleton
    skel = skeleton(ctx.model)
    for v in skel.graph.input:
        if v.name in batch:
            shape = v.type.tensor_type.shape
            shape.ClearField("dim")
            for d in np.shape(batch[v.name]):
                shape.dim.add().dim_value = int(d)
    try:
        skel = onnx.shape_inference.infer_shapes(skel, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - costs fall back on weight bytes
        return {}, False
    shapes, nodes = {}, []
    for g in iter_graphs(skel.graph):
        for v in list(g.value_info) + list(g.output) + list(g.input):
            if v.type.tensor_type.HasField("shape"):
                shapes[v.name] = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                                  for d in v.type.tensor_type.shape.dim]
        shapes.update({t.name: list(t.dims) for t in g.initializer})
        nodes += list(g.node)
    costs, approximate = {}, False
    filled = {x: [d or 1 for d in dims] for x, dims in shapes.items()}
    for n in nodes:
        used = [shapes.get(x) for x in list(n.output[:1]) + list(n.input[:2])]
        c = _flops(n, filled)
        if c is not None:
            costs[n.name] = c
            approximate |= _is_compute(n) and any(None in d for d in used if d is not None)
    return costs, approximate


def _flops(n, shapes: dict) -> float | None:
    """graphmp.cast_cost's FLOPs of a compute node; other ops (and a compute node whose
    weight shape is unknown) cost their output elements."""
    out = shapes.get(n.output[0]) if n.output else None
    if out is None:
        return None
    c = compute_flops(n, shapes)
    return c if c is not None else (float(np.prod(out)) if out else 1.0)


def _weight_bytes(ctx, g, n) -> int:
    total = 0
    for x in n.inputs:
        owner = g.owner_of(x) if x else None
        if owner is not None and x in owner.initializers:
            t = owner.initializers[x]
            total += int(np.prod(t.dims)) * 4 if t.data_type == TensorProto.FLOAT else 0
    return total


def wide_units(ctx) -> dict:
    """{graph key: the nodes of its wide unit}: the wide range-rule candidates of each
    graph, with the nodes paint lowered only because those were candidates (painted
    without them, as without --max-error, they are FP32). Kept FP32 together, the unit is
    the painting the range rule gives (Silero VAD: an LSTM's weight Slices stay FP32 with
    it, not FP16 behind a Cast at every run, 0.8 MB per inference); given back, it is the
    painting with the candidates lowered."""
    out: dict = {}
    for g in ctx.root.walk():
        wide = [n for n in g.nodes if n in ctx.wide_range and n in ctx.lowered]
        if not wide:
            continue
        saved = {n: (ctx.info[n].cls, ctx.info[n].reason) for n in wide}
        for n in wide:
            ctx.info[n].cls, ctx.info[n].reason = "fp32", ctx.range_candidates[n]
        try:
            without = repaint(ctx, g)
        finally:
            for n, (cls, reason) in saved.items():
                ctx.info[n].cls, ctx.info[n].reason = cls, reason
        out[g.key] = {n for n in g.nodes if n in ctx.lowered and (n in ctx.wide_range or n not in without)}
    return out


def regions(ctx, costs: dict, wide: dict | None = None) -> list[Region]:
    """Candidate regions of the painted plan (step 1). wide ({graph key: nodes}, from
    wide_units): in each graph, those nodes (the range rule's wide candidates and what paint
    lowered only beside them) are one region of their own (`wide`: the search starts it
    FP32), so that giving it back moves no other node and keeping it keeps no other."""
    forced = re.compile(ctx.options.fp16_nodes) if ctx.options.fp16_nodes else None
    out: list[Region] = []
    for g in ctx.root.walk():
        _, pred = float_edges(ctx, g)
        region_of: dict = {}
        apart = (wide or {}).get(g.key, set())
        wide_region = None
        for n in g.nodes:
            if n not in ctx.lowered or (forced and forced.search(n.name)):
                continue
            if n in apart:
                if wide_region is None:
                    wide_region = Region(graph=g.key, wide=True)
                    out.append(wide_region)
                r = wide_region
            else:
                up = [region_of[p] for p in pred[n] if p in region_of]
                if policy.op_class(n.op_type, n.domain) == "fp16" or not up:
                    r = Region(graph=g.key)
                    out.append(r)
                else:
                    r = up[0]
                region_of[n] = r
            r.nodes.append(n)
            r.cost += costs.get(n.name, 0.0)
            r.weight_bytes += _weight_bytes(ctx, g, n)
    _fill_unknown_costs(out)
    while len(out) > MAX_REGIONS:  # merge the cheapest pair of neighbours in one graph, wide regions apart
        pairs = [(out[i].cost + out[i + 1].cost, i) for i in range(len(out) - 1)
                 if out[i].graph == out[i + 1].graph and not (out[i].wide or out[i + 1].wide)]
        if not pairs:
            break
        _, i = min(pairs)
        a, b = out[i], out.pop(i + 1)
        a.nodes += b.nodes
        a.cost += b.cost
        a.weight_bytes += b.weight_bytes
    return out


def _fill_unknown_costs(regs: list[Region]):
    """Regions whose FLOPs shape inference could not give (a body whose shapes it left
    unknown: Silero VAD's If branches) get their weight bytes at the model's FLOPs per
    weight byte, so that merging and prices do not treat them as free (merged as free,
    one region held every conv of Silero's encoder and its STFT together)."""
    known = [r for r in regs if r.cost and r.weight_bytes]
    ratio = sum(r.cost for r in known) / sum(r.weight_bytes for r in known) if known else 1.0
    for r in regs:
        if not r.cost:
            r.cost = float(r.weight_bytes * ratio or len(r.nodes))

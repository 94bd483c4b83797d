"""search: meet an accuracy budget (--max-error) with the fewest FP32 nodes.

Needs: the painted plan (ctx.lowered, ctx.info), the calibration batches (ctx.batches),
the options max_error / metric. Runs only when --max-error is given.
Guarantees: ctx.lowered shrinks to a plan whose error, measured FP16-faithfully
(graphmp.emulate's semantics: FP16 storage, FP32 math, in ONNX Runtime), is within the
budget on every calibration batch; or, when no plan reaches it, the plan with the
smallest error and report["search"]["reached"] = False. Nodes it moves to FP32 get the
reason "search: ..." (the static rules' reasons are left as they were); --fp16-nodes and
--fp32-nodes still win (forced nodes are never candidates).

Steps:
  1. regions: every lowered compute node (Conv, MatMul, Gemm, ...) together with the
     lowered follow/clear nodes that hang from it; cheapest neighbours merged down to
     MAX_REGIONS, so one decision moves a whole region. A region has two switches: its
     compute nodes, and its followers (BatchNorm as Mul/Add, activations, scales);
  2. one switchable model: the FP32 model where each switch's low inputs and outputs
     pass through Where(flag, round16(x), x); any plan is one ONNX Runtime run;
  3. the static plan's error; within budget: done (nothing moves);
  4. sensitivity: the error with only region r in FP16, everything else FP32;
  5. regions ordered by squared error per unit of price (half compute share, half weight
     share; rounding errors add about in quadrature): the most error for the least
     price goes FP32 first; bisection on how many;
  6. give back: FP32 regions tried in FP16 again, least useful first, while the budget
     holds;
  7. split: for each FP32 region, most expensive first, its compute nodes go back to
     FP16 with only its followers FP32 (the rounding of elementwise chains is often the
     damage, and FP32 elementwise work is cheap), where the budget holds;
  8. held-out: with two batches or more, steps 4-7 use all but the last, which then
     checks the plan (not overfitting the search batches); if it fails there, steps 5-7
     run again on every batch. Both errors are reported.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from .. import ops
from ..budget import errors, measure
from ..errors import GraphmpError
from ..ir import Names
from ..opset import default_opset, upgrade
from ..oracle import runner
from . import PassResult
from .paint import float_edges

MAX_REGIONS = 48
MAX_SEARCH_BATCHES = 4
GIVE_BACK = 8       # evaluations spent giving regions back (step 6)
SPLIT = 10          # and splitting them (step 7)


@dataclass
class Region:
    nodes: list = field(default_factory=list)      # IR nodes
    graph: str = "main"
    cost: float = 0.0
    weight_bytes: int = 0
    error_alone: float = 0.0                       # normalized error with only this region in FP16

    @property
    def anchor(self):
        return next((n for n in self.nodes if _is_compute(n)), self.nodes[0])

    def parts(self) -> tuple[list, list]:
        """(compute nodes, followers): the region's two switches."""
        return [n for n in self.nodes if _is_compute(n)], [n for n in self.nodes if not _is_compute(n)]


def _is_compute(n) -> bool:
    return ops.op_class(n.op_type, n.domain) == "fp16"


def whole(regions) -> frozenset:
    """The switches (units) of these regions: unit 2k is region k's compute nodes, 2k+1
    its followers."""
    return frozenset(u for k in regions for u in (2 * k, 2 * k + 1))


# --------------------------------------------------------------------------- 1. regions
def _node_costs(ctx, batch) -> dict:
    """name -> FLOPs (Conv/MatMul/Gemm: multiply-adds x 2; other ops: output elements)
    from shape inference with the batch's concrete input shapes; missing shapes -> 0."""
    from ..io import skeleton
    skel = skeleton(ctx.model)
    for v in skel.graph.input:
        if v.name in batch:
            shape = v.type.tensor_type.shape
            shape.ClearField("dim")
            for d in np.shape(batch[v.name]):
                shape.dim.add().dim_value = int(d)
    try:
        skel = onnx.shape_inference.infer_shapes(skel, strict_mode=False)
    except Exception:  # noqa: BLE001 - costs fall back on weight bytes
        return {}
    shapes = {}
    for v in list(skel.graph.value_info) + list(skel.graph.output) + list(skel.graph.input):
        dims = [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
        if v.type.tensor_type.HasField("shape") and None not in dims:
            shapes[v.name] = dims
    shapes.update({t.name: list(t.dims) for t in skel.graph.initializer})
    costs = {}
    for n in skel.graph.node:
        out = shapes.get(n.output[0]) if n.output else None
        if out is None:
            continue
        elems = float(np.prod(out)) if out else 1.0
        w = shapes.get(n.input[1]) if len(n.input) > 1 else None
        a = shapes.get(n.input[0]) if n.input else None
        if n.op_type == "Conv" and w:
            costs[n.name] = 2 * elems * float(np.prod(w[1:]))
        elif n.op_type == "ConvTranspose" and w and a:
            costs[n.name] = 2 * float(np.prod(a)) * float(np.prod(w[1:]))
        elif n.op_type in ("MatMul", "Gemm") and a:
            trans_a = next((x.i for x in n.attribute if x.name == "transA"), 0)
            costs[n.name] = 2 * elems * float(a[-2] if trans_a and len(a) > 1 else a[-1])
        else:
            costs[n.name] = elems
    return costs


def _weight_bytes(ctx, g, n) -> int:
    total = 0
    for x in n.inputs:
        owner = g.owner_of(x) if x else None
        if owner is not None and x in owner.initializers:
            t = owner.initializers[x]
            total += int(np.prod(t.dims)) * 4 if t.data_type == TensorProto.FLOAT else 0
    return total


def regions(ctx, costs: dict) -> list[Region]:
    """Candidate regions of the painted plan (step 1)."""
    forced = re.compile(ctx.options.fp16_nodes) if ctx.options.fp16_nodes else None
    out: list[Region] = []
    for g in ctx.root.walk():
        _, pred = float_edges(ctx, g)
        region_of: dict = {}
        for n in g.nodes:
            if id(n) not in ctx.lowered or (forced and forced.search(n.name)):
                continue
            up = [region_of[id(p)] for p in pred[id(n)] if id(p) in region_of]
            if ops.op_class(n.op_type, n.domain) == "fp16" or not up:
                r = Region(graph=g.key)
                out.append(r)
            else:
                r = up[0]
            r.nodes.append(n)
            r.cost += costs.get(n.name, 0.0)
            r.weight_bytes += _weight_bytes(ctx, g, n)
            region_of[id(n)] = r
    if not any(r.cost for r in out):  # no shapes: weight bytes stand for compute
        for r in out:
            r.cost = float(r.weight_bytes or len(r.nodes))
    while len(out) > MAX_REGIONS:  # merge the cheapest pair of neighbours in one graph
        pairs = [(out[i].cost + out[i + 1].cost, i) for i in range(len(out) - 1) if out[i].graph == out[i + 1].graph]
        if not pairs:
            break
        _, i = min(pairs)
        a, b = out[i], out.pop(i + 1)
        a.nodes += b.nodes
        a.cost += b.cost
        a.weight_bytes += b.weight_bytes
    return out


# --------------------------------------------------------------------------- 2. switchable model
class Switchable:
    """The FP32 model with one boolean input per unit (see `whole`): True rounds the
    unit's low inputs and outputs to the low type (it runs in FP16), False: FP32.
    Lowered nodes that are no candidate (--fp16-nodes) are rounded always."""

    def __init__(self, ctx, regs: list[Region]):
        ctx.root.write_back()  # the proto holds exactly the IR's nodes
        model = onnx.ModelProto()
        model.CopyFrom(ctx.model)
        if default_opset(model) < 9:  # Where needs opset 9
            model = upgrade(model, 9, ctx.path)
        names = Names(model)
        self.flags = [names.fresh(f"graphmp_search_unit_{u}") for u in range(2 * len(regs))]
        where = {n.name: (None, ctx.info[id(n)]) for _, n in ctx.nodes() if id(n) in ctx.lowered}
        for k, r in enumerate(regs):
            for part, nodes in enumerate(r.parts()):
                for n in nodes:
                    where[n.name] = (2 * k + part, ctx.info[id(n)])
        low = ctx.low

        def sel(x, k, out=None):
            """x rounded when unit k runs in FP16 (k None: always)."""
            mid = names.fresh(f"{x}__s_low")
            y = out or names.fresh(f"{x}__s_r{k}")
            up = y if k is None else names.fresh(f"{x}__s_round")
            nodes = [helper.make_node("Cast", [x], [mid], to=low, name=names.fresh("search_cast")),
                     helper.make_node("Cast", [mid], [up], to=TensorProto.FLOAT, name=names.fresh("search_cast"))]
            if k is not None:
                nodes.append(helper.make_node("Where", [self.flags[k], up, x], [y], name=names.fresh("search_where")))
            return y, nodes

        def rewrite(g):
            nodes, cache = [], {}
            for n in g.node:
                for a in n.attribute:
                    for sg in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                        rewrite(sg)
                hit = where.get(n.name)
                if hit is None:
                    nodes.append(n)
                    continue
                k, info = hit
                for i in info.low_inputs:
                    x = n.input[i]
                    if (x, k) not in cache:
                        cache[(x, k)], extra = sel(x, k)
                        nodes.extend(extra)
                    n.input[i] = cache[(x, k)]
                post = []
                for i in info.low_outputs:
                    y = n.output[i]
                    raw = names.fresh(f"{y}__s_fp32")
                    n.output[i] = raw
                    post.extend(sel(raw, k, out=y)[1])
                nodes.append(n)
                nodes.extend(post)
            del g.node[:]
            g.node.extend(nodes)
        rewrite(model.graph)
        for f in self.flags:
            model.graph.input.append(helper.make_tensor_value_info(f, TensorProto.BOOL, []))
        self.run = runner(model, base_dir=ctx.base_dir, optimize=False)  # see graphmp.emulate

    def outputs(self, batch: dict, fp32: frozenset) -> dict:
        """The model's outputs with the units in `fp32` computed in FP32, the rest in FP16."""
        flags = {f: np.array(u not in fp32) for u, f in enumerate(self.flags)}
        return self.run({**batch, **flags})


# --------------------------------------------------------------------------- 3-7. the search
class _Search:
    def __init__(self, ctx, regs, costs, model, budget, batches, refs):
        self.ctx, self.regs, self.costs, self.model, self.budget = ctx, regs, costs, model, budget
        self.batches, self.refs = batches, refs
        self.evaluations = 0
        self.t0 = time.perf_counter()
        self.seen: dict = {}
        self.prefix = 0

    def error(self, fp32: frozenset, which: list) -> float:
        """Normalized error (<= 1: within budget) with the units in `fp32` kept FP32."""
        key = (frozenset(fp32), tuple(which))
        if key not in self.seen:
            gots = [self.model.outputs(self.batches[i], key[0]) for i in which]
            self.evaluations += 1
            self.seen[key] = self.budget.normalized(errors([self.refs[i] for i in which], gots, self.budget.metric))
        return self.seen[key]

    def log(self, what, err, fp32):
        self.ctx.log(f"search: {what}: error {err:.3g} x budget, {len(fp32)} of {2 * len(self.regs)} switches "
                     f"FP32, {self.evaluations} evaluations, {time.perf_counter() - self.t0:.1f} s")

    def sensitivities(self, which):
        everything = whole(range(len(self.regs)))
        for k, r in enumerate(self.regs):
            r.error_alone = self.error(everything - whole([k]), which)
        self.log("sensitivity measured", max((r.error_alone for r in self.regs), default=0.0), frozenset())

    def price(self, k, part=None) -> float:
        """What keeping region k (or one of its parts) FP32 costs: half its share of the
        compute (speed), half its share of the weights (memory and bandwidth)."""
        compute = sum(r.cost for r in self.regs) or 1.0
        weights = sum(r.weight_bytes for r in self.regs) or 1
        r = self.regs[k]
        if part is None:
            return 0.5 * r.cost / compute + 0.5 * r.weight_bytes / weights
        nodes = r.parts()[part]
        return (0.5 * sum(self.costs.get(n.name, 0.0) for n in nodes) / compute
                + 0.5 * sum(_weight_bytes(self.ctx, n.graph, n) for n in nodes) / weights)

    def usefulness(self, k) -> float:
        return self.regs[k].error_alone ** 2 / max(self.price(k), 1e-4)

    def select(self, which, start: int = 0) -> frozenset:
        """Steps 5-7: the cheapest FP32 units found that meet the budget on `which`
        (`start`: a prefix length known to be too short, from an earlier select)."""
        order = sorted((k for k, r in enumerate(self.regs) if r.error_alone > 0), key=lambda k: -self.usefulness(k))
        if self.error(whole(order), which) > 1:
            everything = whole(range(len(self.regs)))
            return everything if self.error(everything, which) <= 1 else whole(order)
        lo, hi = min(start, len(order)), len(order)
        while lo < hi:  # the smallest prefix that meets the budget
            mid = (lo + hi) // 2
            if self.error(whole(order[:mid]), which) <= 1:
                hi = mid
            else:
                lo = mid + 1
        chosen = set(order[:hi])
        self.prefix = hi
        self.log("bisection", self.error(whole(chosen), which), whole(chosen))
        for k in sorted(chosen, key=self.usefulness)[:GIVE_BACK]:  # give back
            if self.error(whole(chosen - {k}), which) <= 1:
                chosen.discard(k)
        fp32 = set(whole(chosen))
        for k in sorted(chosen, key=lambda k: -self.price(k, 0))[:SPLIT]:  # split
            compute, followers = self.regs[k].parts()
            if compute and followers and self.error(frozenset(fp32 - {2 * k}), which) <= 1:
                fp32.discard(2 * k)
        return frozenset(fp32)


def run(ctx) -> PassResult:
    opts = ctx.options
    if opts.max_error is None:
        return PassResult(changed=False)
    t0 = time.perf_counter()
    if not ctx.batches:
        raise GraphmpError(f"{ctx.path}: --max-error measures the error on calibration batches, and none ran "
                           f"({ctx.report.get('calibration', {}).get('source', 'no calibration')}); pass "
                           "--calibration DATA")
    batches = ctx.batches[:MAX_SEARCH_BATCHES + 1]
    # the FP32 references run unoptimised, like the switchable model and the emulation:
    # an all-FP32 plan then has error 0, not ORT's fusion noise (which matters next to
    # near-zero outputs such as a detector's probability map on a blank page)
    ref_run = runner(ctx.model, base_dir=ctx.base_dir, optimize=False)
    refs = ctx.search_refs = [ref_run(b) for b in batches]
    budget = ctx.search_budget = measure(ctx.model, batches, refs, opts.max_error, opts.metric, ctx.base_dir)
    costs = _node_costs(ctx, batches[0])
    regs = regions(ctx, costs)
    details = {"budget": budget.to_dict(), "regions": len(regs), "batches": len(batches),
               "generated_inputs": ctx.report.get("calibration", {}).get("source") == "generated inputs"}
    if details["generated_inputs"]:
        ctx.warn("--max-error on generated inputs: real data (--calibration) gives a budget that holds on real inputs")
    below = [k for k, f in budget.floor.items() if f > budget.allowed.get(k, float("inf"))]
    if below:
        ctx.warn(f"--max-error {opts.max_error} is below this model's FP16 floor for {', '.join(below)} (rounding only "
                 f"the inputs to FP16 already gives {', '.join(f'{budget.floor[k]:.3g}' for k in below)}): expect "
                 "most of the model to stay FP32; --max-error floor or tf32 sets a reachable budget")
    if not regs:
        details.update(reached=True, evaluations=0, error=0.0, error_static_plan=0.0, fp32_regions=[],
                       static_plan_compute_kept_fp16=1.0, model_compute_fp16=_model_compute_fp16(ctx, costs),
                       seconds=round(time.perf_counter() - t0, 3))
        return PassResult(changed=False, details=details)
    s = _Search(ctx, regs, costs, Switchable(ctx, regs), budget, batches, refs)
    every = list(range(len(batches)))
    search_on, held_out = (every[:-1], every[-1:]) if len(batches) > 1 else (every, [])
    details["error_static_plan"] = s.error(frozenset(), every)
    fp32 = frozenset()
    if details["error_static_plan"] > 1:
        s.sensitivities(search_on)
        fp32 = s.select(search_on)
        if held_out:
            details["held_out_error"] = s.error(fp32, held_out)
            details["refit_on_all_batches"] = details["held_out_error"] > 1
            if details["refit_on_all_batches"]:  # too tight for unseen data: select again on every batch
                fp32 = s.select(every, start=s.prefix)
    final = s.error(fp32, every)
    moved, kept_cost = _apply_plan(ctx, s, fp32)
    total_cost = sum(r.cost for r in regs) or 1.0
    details.update(reached=final <= 1, error=final, evaluations=s.evaluations, fp32_regions=moved,
                   static_plan_compute_kept_fp16=1 - kept_cost / total_cost,
                   model_compute_fp16=_model_compute_fp16(ctx, costs), seconds=round(time.perf_counter() - t0, 3))
    if final > 1:
        ctx.warn(f"--max-error {opts.max_error} not reached: the best plan found has {final:.3g} x the budget "
                 f"(floor of this model: {budget.floor})")
    elif moved and details["model_compute_fp16"] < 0.1:
        ctx.warn(f"--max-error {opts.max_error} leaves {100 * details['model_compute_fp16']:.0f}% of the model's "
                 "Conv/MatMul/Gemm compute in FP16: the budget is near what FP16 can give on this model (see the "
                 "floor in the report)")
    s.log("done", final, fp32)
    return PassResult(changed=bool(fp32), details=details)


def _model_compute_fp16(ctx, costs: dict) -> float:
    """Share of the model's Conv/MatMul/Gemm/... FLOPs (main graph) that run in FP16 now."""
    compute = [(n, costs.get(n.name, 0.0)) for n in ctx.root.nodes if _is_compute(n)]
    total = sum(c for _, c in compute)
    return sum(c for n, c in compute if id(n) in ctx.lowered) / total if total else 0.0


def _apply_plan(ctx, s: _Search, fp32: frozenset):
    """Take the nodes of the FP32 units out of ctx.lowered, with their reason; returns
    (report entries per region, compute kept FP32)."""
    total_cost = sum(r.cost for r in s.regs) or 1.0
    total_weights = sum(r.weight_bytes for r in s.regs) or 1
    moved, kept_cost = [], 0.0
    for k, r in enumerate(s.regs):
        parts = [p for p in (0, 1) if 2 * k + p in fp32 and r.parts()[p]]
        if not parts:
            continue
        nodes = [n for p in parts for n in r.parts()[p]]
        cost = sum(s.costs.get(n.name, 0.0) for n in nodes) or (r.cost if parts == [0, 1] else 0.0)
        weights = sum(_weight_bytes(ctx, n.graph, n) for n in nodes)
        kept_cost += cost
        what = "region" if parts == [0, 1] else "followers of" if parts == [1] else "compute nodes of"
        for n in nodes:
            ctx.lowered.discard(id(n))
            info = ctx.info[id(n)]
            info.cls = "fp32"
            info.reason = (f"search: kept FP32 to meet --max-error ({what} {r.anchor.name}: the region alone in "
                           f"FP16 gives {r.error_alone:.3g} x the budget; {100 * cost / total_cost:.2f}% of the "
                           "converted compute)")
        moved.append({"anchor": r.anchor.name, "kept_fp32": what, "nodes": [n.name for n in nodes], "graph": r.graph,
                      "error_alone": r.error_alone, "compute_share": cost / total_cost,
                      "weight_share": weights / total_weights})
    return moved, kept_cost


def verify(ctx) -> PassResult:
    """Needs the converted model (after apply and sort). Measures its error with the
    emulation of the model as written, on the same batches, against the budget: the
    switchable model's prediction, checked on the real output."""
    budget = ctx.search_budget
    if budget is None:
        return PassResult(changed=False)
    from ..emulate import emulated_runner
    batches = ctx.batches[:MAX_SEARCH_BATCHES + 1]
    emu = emulated_runner(ctx.model, ctx.base_dir)
    errs = errors(ctx.search_refs, [emu(x) for x in batches], budget.metric)
    return PassResult(changed=False, details={"verified": {"errors": errs, "normalized": budget.normalized(errs)}})

"""islands: pay for FP32 only where it buys accuracy (issue 26).

After paint, an FP32 island costs its Casts: every tensor that crosses between FP16 and
FP32 work is cast once, reading 2 or 4 bytes per element and writing the other. This pass
prices those Casts, and where an island's Casts move a large share of the model's bytes,
measures whether the island buys accuracy; where it does not, the Casts go.

Needs: ctx.info, ctx.lowered (paint), ctx.batches, ctx.batch_outputs, ctx.shapes
(calibrate); with --max-error also ctx.search_budget and ctx.search_refs (the search ran
first). Gives: ctx.lowered, changed only where a measurement allowed it;
report["islands"]: every trial, its bytes, its errors and the decision. Runs with
calibration batches and trial_limit > 0: --island-trials N, or by default at most
AUTO_TRIALS for a model whose weights are at most AUTO_MAX_WEIGHT_BYTES, and only as many
as AUTO_WORK allows (_work_trials: a budget in work, sized from the model's FLOPs and
activations and the batches, never in seconds, so the same inputs and options give the
same plan on any machine under any load); --search-time S also stops the trials after S
seconds (the user's choice: the plan then depends on the machine). Not with --plan (the
file decides the precisions). With --max-error it runs after the search, on the search's
plan, and the yardstick is the budget (step 4). Works on the main graph (bodies of
If/Loop/Scan keep paint's plan).

Steps (STEPS), in order:
  1. price:    the bytes the plan's Casts move per inference (_cast_bytes): a float
               tensor produced in one type and read in the other costs its elements x
               (4 + 2) bytes, at the largest shapes calibration saw;
  2. drop:     an FP32 island (a connected group of FP32 nodes) whose FP32 comes from a
               precision rule (a node's FP32 op class: a reduction, Softmax, Exp, ...; a
               summed square; precision_seed) is a candidate to run in FP16: paint runs again
               with those nodes as elementwise work (paint.repaint). Also each such node
               alone, where an island has several, and all islands with the same seed op
               types as one group (fifteen InstanceNorms each move too few bytes to be worth
               a run; together they move most of them). Range, initializer, unknown-op and user rules
               (--fp32-nodes/--fp32-ops; --norm-io fp32 for Softmax and LayerNormalization)
               keep their nodes: never candidates;
  3. merge:    a connected group of FP16 nodes joins its FP32 neighbours when its Casts
               move more bytes than its Tensor Core work is worth: FLOPs of its
               Conv/MatMul/Gemm x BYTES_PER_FLOP (a conv on a 3-channel image between
               the FP32 input and an FP32 island), and all merges together give up at
               most MERGE_FLOPS_SHARE of the model's Conv/MatMul FLOPs. Those that fit it
               are also one group (one run instead of one per merge);
  4. measure:  candidates saving at least MIN_SHARE of the model's Cast bytes (and
               MIN_TRAFFIC of what its activations move), the --island-trials that save most,
               merges first, each tried on top of those accepted before it: one emulated run
               per calibration batch (passes/switchable.py: graphmp.emulate's FP16 storage /
               FP32 math, the yardstick of the verdict) against the FP32 outputs calibration
               kept. A candidate is accepted only where every output's error (max|a-b|/max|ref|,
               worst batch) is at most FACTOR x its error in paint's plan, or below FLOOR: the
               plan that comes out moves fewer bytes than paint's and no output is less
               accurate. With --max-error the trials run on the search's batches (and its
               perturbed copy), in its metric, and a candidate is accepted where every
               output stays within BUDGET_SHARE of the budget (or within its error in the
               search's plan, where that is higher): the search's plan priced for its Casts.
               Merges go first because each makes more of the model FP32, and the
               error it takes away may pay for a drop after it. A group that is refused is
               tried again as two halves (graph order), so the islands that buy accuracy are
               found and kept and the rest go FP16. A merge exists to save the Casts of the
               islands beside it: a drop that takes them also undoes the merge where FP16
               there then moves fewer bytes, measured together.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import numpy as np

from .. import policy
from ..budget import errors
from ..cast_cost import itemsize
from ..cast_cost import compute_flops
from ..context import FLOAT
from . import PassResult
from .classify import SQUARE_REASON
from .paint import NORM_KEPT, float_edges, repaint
from .regions import Region, whole

# A candidate may raise no output's error above its error in paint's plan (the measured
# error of a plan on the same batches is deterministic: any rise is a real change, and
# issue 26 asks for an error no worse than paint's plan on every output)...
FACTOR = 1.0
# ... or must leave it below 2^-20 of the output's scale: 1/500 of an FP16 rounding, what
# FP32 summation order alone changes (an output computed in FP32 has error 0 or ~1e-7).
FLOOR = 2.0 ** -20
# With --max-error a trial may take an output to at most this share of its budget (or to
# its error in the search's plan, where that is higher): the search chose its plan to hold
# on inputs it never saw, and a plan at 1.0 x budget on the calibration batches reached
# 1.5-1.7 x on unseen pages (issue 35); the island trials, which save Casts and buy no
# accuracy, leave that margin to the search.
BUDGET_SHARE = 2 / 3
MIN_SHARE = 0.10        # a candidate must save this share of the model's Cast bytes to be measured,
MIN_TRAFFIC = 0.01      # and this share of the bytes its float activations move (written once, 4 bytes
                        # each): Casts a style-transfer net hardly notices are not worth emulated runs
MAX_BATCHES = 4         # calibration batches a trial runs on
# What a FLOP moved from FP16 Tensor Cores to FP32 costs, in bytes of memory traffic that
# take the same time on an H100 SXM (3.35e12 bytes/s): FP32 Conv/MatMul run on TF32
# Tensor Cores where the runtime allows it (TensorRT's and cuDNN's default math for
# convolutions, ONNX Runtime CUDA's use_tf32), at half the FP16 rate (494.7 vs 989.4
# dense TFLOP/s). Elementwise work counts nothing: fused into the producing Conv (TensorRT,
# cuDNN epilogues) it costs the same in either type, and unfused its FP32 intermediates
# move about what the Casts they replace move (a Cast: 6 bytes per element).
BYTES_PER_FLOP = 3.35e12 * (1 / 494.7e12 - 1 / 989.4e12)
# Merges may give up at most this share of the model's Conv/MatMul FLOPs in all: a cheap
# model whose activations are large (magika: 1.5 GFLOP, 16 MB of Casts) would otherwise
# price every Tensor Core FLOP below its Casts and go FP32 whole.
MERGE_FLOPS_SHARE = 0.10
# Without --island-trials: 8 trials (a refused group of islands is split in halves: finding
# the one island in sixteen that buys accuracy takes ~8) for a model whose weights are at
# most 256 MB, none above (the report says so). A trial runs an emulated copy of the model:
# on a BERT-base (438 MB) the step took 3 s and raised convert's peak memory from 0.5 to
# 2.3 GB to find that its LayerNorm islands buy accuracy.
AUTO_TRIALS = 8
AUTO_MAX_WEIGHT_BYTES = 256 * 2 ** 20
# ... and only as many runs as fit in this much work, counted as FLOP-equivalents: per run,
# each measured batch costs the model's Conv/MatMul FLOPs plus its float activation
# elements, at calibration's largest shapes (_work_trials). Work, not seconds: a limit in
# seconds gave the mosaic style transfer 30 Casts (586.8 MB per inference) on a loaded
# 2-core machine and 2 Casts (40.1 MB) on an idle one. A run of that net at 720x720 on its
# two generated batches is 1.6e11; it needs 3 runs (paint's plan, its merges, its fifteen
# InstanceNorms), which took 1.2 s each on an idle 2-core CPU. 1e12 allows it 6 runs; a
# model of 1e11 or less a run gets all AUTO_TRIALS.
AUTO_WORK = 1.0e12
LOW_BYTES, FP32_BYTES = 2, 4
MERGED = ("islands: merged with its FP32 neighbours (its Casts moved {mb:.3g} MB per inference, more than its "
          "Tensor Core work is worth: {flops:.3g} FLOPs x {bpf:.3g} bytes; error x{ratio:.3g})")


def trial_limit(ctx) -> int:
    """How many candidates the pass may measure: --island-trials, or by default AUTO_TRIALS
    for a model whose weights are at most AUTO_MAX_WEIGHT_BYTES (AUTO_WORK may allow fewer:
    _work_trials); 0 with --plan (the file decides). Needs the prepare step's weight bytes."""
    o = ctx.options
    if o.plan is not None:
        return 0
    if o.island_trials is not None:
        return o.island_trials
    return AUTO_TRIALS if _weight_bytes(ctx) <= AUTO_MAX_WEIGHT_BYTES else 0


def trials_wanted(ctx) -> bool:
    """The pass measures (the batches must also have run)."""
    return trial_limit(ctx) > 0


def _weight_bytes(ctx) -> int:
    return int((ctx.report.get("prepare") or {}).get("weight_bytes", 0))


def precision_seed(n, info, norm_io: str) -> bool:
    """n is FP32 by a precision rule the measurement may overrule: its FP32 op class
    (classify rule 7, or a norm node paint left FP32) or a summed square (rule 8). With
    --norm-io fp32 the user asked for Softmax/LayerNormalization islands: not seeds."""
    if norm_io == "fp32" and n.op_type in policy.NORM_IO["all"]:
        return False
    return info.reason in (f"{n.op_type} is range-sensitive (FP32 op class)", NORM_KEPT.format(n.op_type),
                           SQUARE_REASON) and bool(info.low_inputs or info.low_outputs)


@dataclass
class Candidate:
    kind: str                                   # "drop" (an FP32 island in FP16) or "merge" (FP16 nodes in FP32)
    nodes: frozenset                            # drop: the freed seeds; merge: the FP16 nodes made FP32
    saved: float = 0.0                          # Cast bytes saved against the plan it was priced on
    flops: float = 0.0                          # merge: Tensor Core FLOPs given up
    record: dict = field(default_factory=dict)  # the report's entry
    parts: tuple = ()                           # a group: the seeds of each island it frees, in graph order
    group: str = ""                             # a group: its op type

    def halves(self, flops) -> list["Candidate"]:
        """A rejected group's two halves (graph order): each a group again, or one part.
        flops: _Plans.flops (a merge's Tensor Core FLOPs)."""
        k = len(self.parts) // 2
        return [Candidate(self.kind, frozenset().union(*ps), parts=ps if len(ps) > 1 else (), group=self.group,
                          flops=flops(frozenset().union(*ps)) if self.kind == "merge" else 0.0)
                for ps in (self.parts[:k], self.parts[k:])]


class _Plans:
    """The main graph's plans: paint's, and paint's with some FP32 seeds freed and some
    FP16 groups merged into FP32; each priced by its Cast bytes."""

    def __init__(self, ctx):
        self.ctx, self.g = ctx, ctx.root
        self.base = {n for n in self.g.nodes if n in ctx.lowered}
        self.producers, self.consumers = self.g.producers(), self.g.consumers()
        self.succ, self.pred = float_edges(ctx, self.g)
        self._painted: dict = {}
        # every tensor's dims, once: calibration's activations and the initializers
        self._dims = {**ctx.shapes, **{k: list(t.dims) for k, t in self.g.initializers.items()}}
        self.model_flops = self.flops(self.g.nodes)
        self.activation_bytes = FP32_BYTES * sum(float(np.prod(d, dtype=np.float64)) for d in ctx.shapes.values())
        self._unfreed = None  # paint's plan of the graph now (== base unless the search moved nodes)

    def lowered(self, freed: frozenset, merged: frozenset) -> set:
        """The main graph's lowered nodes with `freed` seeds free and `merged` nodes FP32:
        what freeing the seeds changes in paint's plan, applied to the base plan (after a
        --max-error search, paint alone would spread FP32 from the nodes the search moved,
        and undo its plan elsewhere)."""
        if freed not in self._painted:
            self._painted[freed] = self._freed_plan(freed) if freed else self.base
        return self._painted[freed] - merged

    def _freed_plan(self, freed: frozenset) -> set:
        if self._unfreed is None:
            self._unfreed = repaint(self.ctx, self.g)
        painted = repaint(self.ctx, self.g, freed)
        if self._unfreed == self.base:
            return painted
        return (self.base - (self._unfreed - painted)) | (painted - self._unfreed)

    def run_work(self, batches: int) -> float:
        """FLOP-equivalents of one emulated run over `batches` batches: per batch, the
        Conv/MatMul FLOPs and the float activation elements at calibration's largest shapes."""
        return batches * (self.model_flops + self.activation_bytes / FP32_BYTES)

    def cast_bytes(self, low: set) -> float:
        """Step 1: bytes the Casts of the plan `low` move per inference (main graph), as
        apply places them: one Cast per tensor read in the other type, and a source
        Cast to FLOAT from BOOL/INT8/UINT8 writes the low type where every reader wants it."""
        g = self.g
        outputs = set(g.output_names)
        total = 0.0
        for t, readers in list(self.consumers.items()) + [(o, []) for o in outputs if o not in self.consumers]:
            if t in g.initializers or self.ctx.type_of(g, t) != FLOAT or t not in self.ctx.shapes:
                continue  # weights are converted offline, not cast
            total += self._tensor_bytes(t, readers, low, t in outputs)
        return total

    def _tensor_bytes(self, t, readers, low: set, is_output: bool) -> float:
        """Cast bytes of float tensor t under the plan `low`: its source Cast (if it is one)
        and the Cast to the type its producer does not write."""
        ctx, info = self.ctx, self.ctx.info
        elems = float(np.prod(ctx.shapes[t], dtype=np.float64))
        p = self.producers.get(t)
        made_low = (p is not None and p in low and list(p.outputs).index(t) in info[p].low_outputs) or (
            p is None and t in ctx.low_io["inputs"])   # an input declared in the low type (kv_cache)
        wants = {c in low and i in info[c].low_inputs for c in readers for i, x in enumerate(c.inputs) if x == t}
        wants |= {False for c in readers if t in c.implicit_inputs()}  # a body reads the source type
        if is_output:
            wants.add(t in ctx.low_io["outputs"])   # declared FP32 or low (kv_cache): a Cast where made otherwise
        source = 0.0
        if p is not None and p.op_type == "Cast":  # a source Cast to FLOAT (apply's step 5)
            src = ctx.type_of(self.g, p.inputs[0])
            read = itemsize(src) or FP32_BYTES
            if src in policy.EXACT_IN_LOW and wants == {True}:
                return elems * (read + LOW_BYTES)
            source = elems * (read + FP32_BYTES)
        return source + (elems * (LOW_BYTES + FP32_BYTES) if (not made_low) in wants else 0.0)

    def groups(self, nodes) -> list[list]:
        """Connected groups of `nodes` over float edges, in graph order."""
        nodes, seen, out = set(nodes), set(), []
        for n in self.g.nodes:
            if n not in nodes or n in seen:
                continue
            group, todo = [], [n]
            seen.add(n)
            while todo:
                m = todo.pop()
                group.append(m)
                for k in self.succ[m] + self.pred[m]:
                    if k in nodes and k not in seen:
                        seen.add(k)
                        todo.append(k)
            out.append(sorted(group, key=lambda m: m.order))
        return out

    def flops(self, nodes) -> float:
        """Tensor Core FLOPs of `nodes` (Conv/MatMul/Gemm/...) at calibration's shapes."""
        return sum(compute_flops(n.proto, self._dims) or 0.0 for n in nodes
                   if policy.op_class(n.op_type, n.domain) == "fp16")


def _drop_candidates(plans: _Plans) -> list[Candidate]:
    """Step 2: each FP32 island with precision seeds, freed whole, and its seeds one by one."""
    info = plans.ctx.info
    fp32 = [n for n in plans.g.nodes if n not in plans.base and info[n].cls not in ("none", "fixed")]
    out, by_op = [], {}
    for island in plans.groups(fp32):
        seeds = [n for n in island if precision_seed(n, info[n], plans.ctx.options.norm_io)]
        if not seeds:
            continue
        out.append(Candidate("drop", frozenset(seeds)))
        if len(seeds) > 1:
            out += [Candidate("drop", frozenset([s])) for s in seeds]
        by_op.setdefault("+".join(sorted({n.op_type for n in seeds})), []).append(frozenset(seeds))
    # every island with the same seed op types together (15 InstanceNorms, 12 Softmaxes, 4
    # decomposed LayerNorms' ReduceMean+Pow): each alone may move too small a share of the
    # bytes to be worth a run, together they move most of them
    out += [Candidate("drop", frozenset().union(*ps), parts=tuple(ps), group=op)
            for op, ps in by_op.items() if len(ps) > 1]
    return out


def _merge_candidates(plans: _Plans) -> list[Candidate]:
    """Step 3: connected FP16 groups (no --fp16-nodes among them) whose Casts cost more
    than their Tensor Core work is worth."""
    rx = re.compile(plans.ctx.options.fp16_nodes) if plans.ctx.options.fp16_nodes else None
    return [Candidate("merge", frozenset(group), flops=plans.flops(group)) for group in plans.groups(plans.base)
            if not (rx and any(rx.search(n.name) for n in group))]


def measured_batches(ctx) -> tuple[list, list]:
    """(batches, their FP32 outputs) step 4 runs on: the first MAX_BATCHES calibration
    batches; with --max-error the search's (calibration batches and its perturbed copy of
    the first, passes/search.py), so that a trial is judged where the search was."""
    if ctx.search_budget is None:
        k = min(len(ctx.batch_outputs), len(ctx.batches), MAX_BATCHES)
        return ctx.batches[:k], ctx.batch_outputs[:k]
    from ..model_runs import runner
    from .search import perturbed
    batches = ctx.batches[:len(ctx.search_refs)]
    shaken = [perturbed(batches[0])]
    run = runner(ctx.model, base_dir=ctx.base_dir, optimize=False)  # as the search's references
    return batches + shaken, list(ctx.search_refs) + [run(b) for b in shaken]


class _Measure:
    """Step 4's yardstick: the plans of the main graph run on one switchable model (each
    node a candidate may move is its own unit), against the FP32 outputs of
    measured_batches. metric: max-rel, or the --max-error budget's."""

    def __init__(self, ctx, plans: _Plans, movable: set, batches: list, refs: list):
        from .switchable import Switchable
        self.ctx, self.plans = ctx, plans
        self.movable = sorted(movable, key=lambda n: n.order)
        self.unit = {n: k for k, n in enumerate(self.movable)}
        self.batches, self.refs = batches, refs
        self.metric = ctx.search_budget.metric if ctx.search_budget is not None else "max-rel"
        saved = set(ctx.lowered)
        ctx.lowered -= set(self.movable)  # movable nodes are switched; the rest of paint's plan is rounded always
        try:
            self.model = Switchable(ctx, [Region(nodes=[n], graph=plans.g.key) for n in self.movable])
        finally:
            ctx.lowered.clear()
            ctx.lowered.update(saved)
        self.runs = 0

    def measurable(self, low: set) -> bool:
        fixed = self.plans.base - set(self.movable)
        return fixed <= low <= self.plans.base | set(self.movable)

    def errors(self, low: set) -> dict:
        """{output: max|a-b|/max|ref|, worst batch} of the plan `low`."""
        fp32 = whole(k for n, k in self.unit.items() if n not in low)
        self.runs += 1
        return errors(self.refs, [self.model.outputs(b, fp32) for b in self.batches], self.metric)


def within(new: dict, old: dict, budget=None) -> bool:
    """Every output's error at most FACTOR x before, or below FLOOR; with a --max-error
    budget (graphmp.budget.Budget), at most BUDGET_SHARE of its allowed error or its error
    before."""
    if budget is not None:
        return all(e <= max(BUDGET_SHARE * budget.allowed.get(k, float("inf")), old.get(k, 0.0)) or e <= FLOOR
                   for k, e in new.items())
    return all(e <= FACTOR * old.get(k, 0.0) or e <= FLOOR for k, e in new.items())


def _plan_of(plans: _Plans, c: Candidate, freed=frozenset(), merged=frozenset()) -> tuple:
    """(freed, merged, lowered) with candidate c on top of the plan (freed, merged)."""
    freed = freed | c.nodes if c.kind == "drop" else freed
    merged = merged | c.nodes if c.kind == "merge" else merged
    return freed, merged, plans.lowered(freed, merged)


def _unworthy(plans: _Plans, c: Candidate, saved: float, total: float, merged_flops: float = 0.0) -> str:
    """Why c is not worth measuring ("" if it is): it must save MIN_SHARE of the model's Cast
    bytes (and MIN_TRAFFIC of its activation bytes); a merge, more bytes than its Tensor Core
    work is worth, within MERGE_FLOPS_SHARE of the model's FLOPs with the merges accepted
    before it (merged_flops)."""
    if saved <= 0:
        return "the trials accepted before it took its Casts"
    if saved < MIN_SHARE * total or saved < MIN_TRAFFIC * plans.activation_bytes:
        return f"it saves under {MIN_SHARE:.0%} of the model's Cast bytes, what a trial must save"
    if c.kind == "merge" and saved <= c.flops * BYTES_PER_FLOP:
        return "its Tensor Core work is worth more than its Casts"
    if c.kind == "merge" and c.flops + merged_flops > MERGE_FLOPS_SHARE * plans.model_flops:
        return f"with the merges before it, over {MERGE_FLOPS_SHARE:.0%} of the model's Tensor Core FLOPs"
    return ""


def _merge_group(plans: _Plans, merges: list, total: float) -> list[Candidate]:
    """The merges worth measuring, most bytes first while their FLOPs fit MERGE_FLOPS_SHARE,
    as one candidate (where there are two or more): one run instead of one per merge, where
    a run of a 720x720 style-transfer net is a sixth of the step's AUTO_WORK."""
    parts, flops = [], 0.0
    for c in sorted(merges, key=lambda c: -c.saved):
        if flops + c.flops <= MERGE_FLOPS_SHARE * plans.model_flops:
            parts.append(c)
            flops += c.flops
    if len(parts) < 2:
        return []
    parts.sort(key=lambda c: min(n.order for n in c.nodes))
    g = Candidate("merge", frozenset().union(*(c.nodes for c in parts)), flops=flops,
                  parts=tuple(c.nodes for c in parts), group="merges")
    g.saved = total - plans.cast_bytes(frozenset(_plan_of(plans, g)[2]))
    return [g] if not _unworthy(plans, g, g.saved, total) else []


def _chosen(plans: _Plans, total: float, limit: int) -> list[Candidate]:
    """Steps 2-3: the candidates worth measuring, most bytes saved first, at most `limit`,
    each plan once."""
    out, seen = [], set()
    for c in _drop_candidates(plans) + _merge_candidates(plans):
        low = frozenset(_plan_of(plans, c)[2])
        c.saved = total - plans.cast_bytes(low)
        if low not in seen and not _unworthy(plans, c, c.saved, total):
            seen.add(low)
            out.append(c)
    out += _merge_group(plans, [c for c in out if c.kind == "merge"], total)
    # merges first: each makes more of the model FP32, and the error it takes away may pay
    # for a drop after it (the yardstick is paint's plan, not the plan of the moment)
    return sorted(sorted(out, key=lambda c: -c.saved)[:limit], key=lambda c: c.kind != "merge")


def _record(c: Candidate, total: float) -> dict:
    names = sorted(n.name for n in c.nodes)
    r = {"kind": c.kind, ("seeds" if c.kind == "drop" else "nodes"): names[:12], "node_count": len(names),
         "cast_bytes_saved": c.saved, "share_of_cast_bytes": c.saved / total if total else 0.0}
    if c.kind == "merge":
        r.update(flops=c.flops, flops_worth_bytes=c.flops * BYTES_PER_FLOP)
    if c.parts:
        r.update({"group": c.group, ("islands" if c.kind == "drop" else "segments"): len(c.parts)})
    return r


def _try(plans: _Plans, m: _Measure, c: Candidate, state: dict, total: float) -> dict:
    """Step 4 for one candidate on top of the accepted plan `state` (updated when the
    candidate is accepted); returns its report entry."""
    rec = _record(c, total)
    freed, merged, low = _plan_of(plans, c, state["freed"], state["merged"])
    after = plans.cast_bytes(low)
    undone = []
    for mc, mrec in state["merges"] if c.kind == "drop" else ():
        # a merge exists to save the Casts of the islands beside it: where this drop takes
        # them, the merge goes with it if FP16 there now moves fewer bytes
        low2 = plans.lowered(freed, merged - mc.nodes)
        after2 = plans.cast_bytes(low2)
        if after2 < after:
            merged, low, after = merged - mc.nodes, low2, after2
            undone.append((mc, mrec))
    if undone:
        rec["merges_undone"] = sorted(n.name for mc, _ in undone for n in mc.nodes)[:12]
    c.saved = rec["cast_bytes_saved"] = state["bytes"] - after
    rec["share_of_cast_bytes"] = c.saved / total if total else 0.0
    why = _unworthy(plans, c, c.saved, total, plans.flops(state["merged"]))
    if why:
        rec["decision"] = f"not tried: {why}"
        return rec
    if not m.measurable(low):
        rec["decision"] = "not tried: its plan moves nodes outside the measured ones"
        return rec
    err = m.errors(low)
    rec.update(errors_before=state["errors"], errors_after=err)
    yard, budget = state["paint_errors"], m.ctx.search_budget
    if budget is not None:  # what each output may reach: its budget, or its error in the search's plan
        yard = {k: max(BUDGET_SHARE * budget.allowed.get(k, 0.0), e) for k, e in yard.items()}
    worst = max(err, key=lambda k: err[k] / yard[k] if yard.get(k) else 0.0, default=None)
    if within(err, state["paint_errors"], budget):
        rec["decision"] = ("FP32: its Casts cost more than its FP16 work saves" if c.kind == "merge" else
                           f"FP16: without it every output stays within {BUDGET_SHARE:.2g} x --max-error"
                           if budget is not None else
                           "FP16: without it no output's error exceeds paint's plan's")
        rec["error_ratio"] = max((e / state["errors"][k] for k, e in err.items() if state["errors"].get(k)),
                                 default=1.0)
        for mc, mrec in undone:
            mrec.setdefault("undone", []).extend(sorted(n.name for n in mc.nodes))
            if len(mrec["undone"]) == mrec["node_count"]:
                mrec["decision"] = "FP32, then undone: a later drop took the islands it saved Casts against"
        kept = [p for p in state["merges"] if not any(p[0] is u for u, _ in undone)]
        # a group of merges is kept as its segments: a later drop may undo one of them
        new = [(Candidate("merge", p, flops=plans.flops(p)), rec) for p in (c.parts or (c.nodes,))]
        state.update(freed=freed, merged=merged, low=low, bytes=after, errors=err,
                     merges=kept + (new if c.kind == "merge" else []))
    else:
        rec["decision"] = ("kept FP32: it buys accuracy" if c.kind == "drop" else "kept FP16: FP32 changes the error") \
            + f" ({worst}: {yard.get(worst, 0.0):.3g} " \
            + ("allowed" if budget is not None else "in paint's plan") + f", {err[worst]:.3g} in this one)"
    return rec


def _commit(ctx, plans: _Plans, state: dict, accepted: list) -> None:
    """The accepted plan into ctx: the freed seeds' and the new paint's reasons, merged
    nodes FP32 with their reason, the main graph's lowered nodes. A node the plan keeps
    lowered keeps its reasons (after a search, paint alone would give it an FP32 one)."""
    if state["freed"]:
        saved = {n: (ctx.info[n].cls, ctx.info[n].reason) for n in state["low"] if n not in state["freed"]}
        repaint(ctx, plans.g, state["freed"], commit=True)
        for n, (cls, reason) in saved.items():
            ctx.info[n].cls, ctx.info[n].reason = cls, reason
    for c, rec in accepted:
        if c.kind == "merge":
            for n in c.nodes:
                ctx.info[n].cls = "fp32"
                ctx.info[n].reason = MERGED.format(mb=rec["cast_bytes_saved"] / 1e6, flops=c.flops,
                                                   bpf=BYTES_PER_FLOP, ratio=rec.get("error_ratio", 1.0))
    ctx.lowered -= set(plans.g.nodes)
    ctx.lowered |= state["low"]


def _searched(ctx, plans: _Plans, total: float) -> dict:
    """The Cast bytes the --max-error search's FP32 nodes (main graph) cost: the plan's bytes
    less those of the same plan with them lowered again; the report names them and why
    (report["search"]["fp32_regions"]: the error each region causes alone)."""
    kept = {n for n in plans.g.nodes if (ctx.info[n].reason or "").startswith("search:")}
    return {"search_kept_fp32": len(kept),
            "cast_bytes_search_kept": total - plans.cast_bytes(plans.base | kept) if kept else 0.0}


def _work_trials(ctx, plans: _Plans, batches: int) -> tuple[int, str]:
    """(trials allowed, why no more): --island-trials N, or AUTO_TRIALS within AUTO_WORK
    (the first run, of the plan the trials start from, counts too). The same model,
    batches and options give the same number on any machine."""
    limit = trial_limit(ctx)
    if ctx.options.island_trials is not None:
        return limit, f"{limit} trials ran (--island-trials N tries N)"
    work = plans.run_work(batches)
    allowed = max(0, min(limit, int(AUTO_WORK // work) - 1)) if work > 0 else limit
    if allowed < limit:
        return allowed, (f"the step's work budget is spent ({allowed + 1} emulated runs of {work:.3g} FLOP-equivalents "
                         f"each within {AUTO_WORK:.3g}); --island-trials N tries N")
    return limit, f"{limit} trials ran (--island-trials N tries N)"


def _measure_all(ctx, plans: _Plans, m: _Measure, chosen: list, state: dict, total: float, trials: list,
                 limit: tuple, deadline: float | None) -> list:
    """Step 4 over the chosen candidates, in order, at most limit = (trials, why no more:
    _work_trials) and, with --search-time, until `deadline` (time.perf_counter()). A group
    that buys accuracy is split in halves, tried next (one island in fifteen that matters
    costs about 2 x log2(15) runs to find, and the other fourteen go FP16). Returns the
    accepted drops and the merges no drop undid, as (candidate, record) pairs; every
    decision goes into `trials`."""
    (limit, spent), queue, accepted = limit, list(chosen), []  # accepted: drops
    bar = ctx.progress("island trials")
    while queue:
        c = queue.pop(0)
        if c.nodes <= (state["freed"] if c.kind == "drop" else state["merged"]):
            continue  # a group accepted before it took these nodes
        if m.runs - 1 >= limit:  # the first run measured the starting plan
            rec = dict(_record(c, total), decision=f"not tried: {spent}")
        elif deadline is not None and time.perf_counter() > deadline:
            rec = dict(_record(c, total), decision=f"not tried: --search-time {ctx.options.search_time:g} s ran out "
                       "(a limit in seconds: this plan depends on the machine's speed and load)")
        else:
            rec = _try(plans, m, c, state, total)
            if c.parts and rec["decision"].startswith("kept"):
                queue[:0] = c.halves(plans.flops)
        trials.append(rec)
        ctx.detail(f"islands: {c.kind} {rec.get('group') or rec.get('seeds', rec.get('nodes'))[:3]}: "
                   f"{rec['decision']}")
        if rec["decision"].startswith("FP16:"):
            accepted.append((c, rec))
        bar.update(1, accepted=len(accepted))
    bar.close()
    return accepted + state["merges"]


def run(ctx) -> PassResult:
    if not (trials_wanted(ctx) and ctx.batches and ctx.batch_outputs):
        if ctx.options.island_trials is None and trial_limit(ctx) == 0 and ctx.options.plan is None:
            return PassResult(changed=False, details={"skipped": (
                f"not measured: the model's weights ({_weight_bytes(ctx) / 2 ** 20:.0f} MB) are over "
                f"{AUTO_MAX_WEIGHT_BYTES / 2 ** 20:.0f} MB, and each trial runs an emulated copy of it; "
                "--island-trials N measures anyway")})
        return PassResult(changed=False)
    t0 = time.perf_counter()
    deadline = t0 + ctx.options.search_time if ctx.options.search_time else None
    plans = _Plans(ctx)
    total = plans.cast_bytes(plans.base)
    details = {"cast_bytes_before": total, "factor": FACTOR, "floor": FLOOR, "min_share": MIN_SHARE, "trials": []}
    if ctx.search_budget is not None:
        details.update(yardstick="the --max-error budget, on the search's plan and batches",
                       **_searched(ctx, plans, total))
    chosen = _chosen(plans, total, trial_limit(ctx)) if total else []
    if not chosen:
        details.update(cast_bytes_after=total, runs=0, seconds=round(time.perf_counter() - t0, 3))
        return PassResult(changed=False, details=details)
    batches, refs = measured_batches(ctx)
    limit = _work_trials(ctx, plans, len(batches))
    details.update(trials_allowed=limit[0], work_per_run=plans.run_work(len(batches)), work_budget=AUTO_WORK)
    seeds = frozenset(n for c in chosen if c.kind == "drop" for n in c.nodes)
    movable = (plans.lowered(seeds, frozenset()) - plans.base) | {n for c in chosen if c.kind == "merge" for n in c.nodes}
    m = _Measure(ctx, plans, movable, batches, refs)
    state = {"freed": frozenset(), "merged": frozenset(), "merges": [], "low": plans.base, "bytes": total,
             "errors": m.errors(plans.base)}
    state["paint_errors"] = state["errors"]
    accepted = _measure_all(ctx, plans, m, chosen, state, total, details["trials"], limit, deadline)
    _commit(ctx, plans, state, accepted)
    details.update(cast_bytes_after=state["bytes"], errors_paint=state["paint_errors"], errors_after=state["errors"],
                   runs=m.runs, accepted=len(accepted), seconds=round(time.perf_counter() - t0, 3))
    return PassResult(changed=False, details=details)


# the steps of the module docstring, in its order (tests/test_policy.py holds them equal)
STEPS = [("price", _Plans.cast_bytes), ("drop", _drop_candidates), ("merge", _merge_candidates), ("measure", _try)]

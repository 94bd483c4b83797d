"""search: meet an accuracy budget (--max-error) with the fewest FP32 nodes.

Needs: the painted plan (ctx.lowered, ctx.info), the calibration batches (ctx.batches),
the options max_error / metric. Runs only when --max-error is given.
Guarantees: ctx.lowered shrinks to a plan whose error, measured FP16-faithfully
(graphmp.emulate's semantics: FP16 storage, FP32 math, in ONNX Runtime), is within the
budget on every calibration batch; or, when no plan reaches it, the plan with the
smallest error and report["search"]["reached"] = False. Nodes it moves to FP32 get the
reason "search: ..." (the static rules' reasons are left as they were); --fp16-nodes and
--fp32-nodes still win (forced nodes are never candidates).

Steps (1 in passes/regions.py, 2 in passes/switchable.py):
  1. regions: every lowered compute node (Conv, MatMul, Gemm, ...) together with the
     lowered follow/clear nodes that hang from it; cheapest neighbours merged down to
     MAX_REGIONS, so one decision moves a whole region. A region has two switches: its
     compute nodes, and its followers (BatchNorm as Mul/Add, activations, scales);
  2. one switchable model: the FP32 model where each switch's low inputs and outputs
     pass through If(flag) -> round16(x) | x; any plan is one ONNX Runtime run;
  3. the static plan's error (the most-FP16 plan: nodes only the range rule keeps FP32
     start in FP16 up to classify.GIVE_BACK_RANGE; wider ones, ctx.wide_range, in regions
     of their own, start FP32); within budget: done (nothing moves) when there are no
     wide regions or they all fit in FP16 at once; else steps 4-8 choose among every
     region, wide ones included, and the cheaper of that plan and the static one is kept;
  4. sensitivity: the error with only region r in FP16, everything else FP32, on the
     first batch; quiet groups of regions measured together (group testing);
  5. regions ordered by squared error per unit of price (half compute share, half weight
     share; rounding errors add about in quadrature): the most error for the least
     price goes FP32 first; bisection on how many;
  6. give back: FP32 regions tried in FP16 again, least useful first, while the budget
     holds;
  7. split: for each FP32 region, most expensive first, its compute nodes go back to
     FP16 with only its followers FP32 (the rounding of elementwise chains is often the
     damage, and FP32 elementwise work is cheap), where the budget holds;
  8. held-out: steps 4-7 use all calibration batches but the last (with one: that one);
     the last and a perturbed copy of the first (`perturbed`: shifted one step, x1.01)
     then check the plan. The margin, its error there over its error on the batches it
     was chosen on (1 to MAX_MARGIN), is how much further unseen inputs may take it: if
     its error on every batch is over min(1, UNSEEN / margin), steps 5-7 run again on
     every batch within that limit, each region ranked by the larger of its error alone
     on the first batch and on the batch the plan errs most on. The error per batch is
     reported;
  9. wide range-rule regions still FP32 go to FP16 where the plan stays within the limit
     (all at once, else one by one), and a plan that frees one must stay within UNSEEN x
     the budget on the first batch x LOUD (`louder`): FP16 overflow is inf in the
     emulation, so a node that overflows, or would on inputs a little larger, stays FP32 (with the nodes
     paint lowered only beside it: regions.wide_units).
--search-time S: past S seconds no new plan is measured; the cheapest plan measured
within budget so far is kept (or every region FP32), said in the report and a warning,
and verify measures the written model. Without it the search is bounded by evaluations
alone (the regions' count, GIVE_BACK, SPLIT), so its plan does not depend on the machine.
The measured islands (passes/islands.py) run after it, on its plan, within the budget;
verify then measures the written model, and its error is the search's verdict.
"""
from __future__ import annotations

import time

import numpy as np

from ..budget import errors, measure
from ..errors import GraphmpError, first_line
from ..model_runs import runner
from ..session import CUDA, ran_on
from . import PassResult
from .regions import _is_compute, _weight_bytes, node_costs, regions, whole, wide_units
from .switchable import Switchable

MAX_SEARCH_BATCHES = 4
GIVE_BACK = 8       # evaluations spent giving regions back (step 6)
GIVE_BACK_WIDE = 16  # and giving back wide range-rule regions one by one (step 9)
LOUD = 2.0          # the factor on the float inputs of the overflow check of wide regions
UNSEEN = 1.5        # the error (x budget) a plan may reach on inputs like the calibration batches, unseen
MAX_MARGIN = 2.0    # the most growth to unseen inputs the held-out batches can ask headroom for (step 8)
SPLIT = 10          # and splitting them (step 7)
QUIET = 0.05        # sensitivity: a group whose squared error is at most its share of this is not split
SINGLES = 3         # sensitivity: groups this small are measured region by region


# --------------------------------------------------------------------------- 3-7. the search
class OutOfTime(Exception):
    """--search-time ran out: the search stops and keeps the best plan measured so far."""


class _Search:
    PROGRESS_EVERY = 2.0  # seconds between progress lines

    def __init__(self, ctx, regs, costs, model, budget, batches, refs, started: float):
        self.ctx, self.regs, self.costs, self.model, self.budget = ctx, regs, costs, model, budget
        self.batches, self.refs = batches, refs
        self.evaluations = 0
        self.t0 = self._shown = started
        limit = ctx.options.search_time
        self.deadline = self.t0 + limit if limit else float("inf")
        self.per: dict = {}        # (FP32 units, batch) -> normalized error
        self.prefix = 0
        self.limit = 1.0           # the normalized error a plan must stay within (step 8)
        self.start = whole(k for k, r in enumerate(regs) if r.wide)  # the static plan: wide regions FP32
        self.loud = None           # (batch, FP32 outputs): the first batch, louder (overflow_free; run sets it)
        self.loud_ok: dict = {}
        self.stage = "static plan"

    def error(self, fp32: frozenset, which: list) -> float:
        """Normalized error (<= 1: within budget) with the units in `fp32` kept FP32: the
        worst of the batches `which`, each measured once per plan (self.per).
        Raises OutOfTime when --search-time has passed and a batch must still run."""
        fp32 = frozenset(fp32)
        todo = [i for i in which if (fp32, i) not in self.per]
        if todo:
            now = time.perf_counter()
            if now > self.deadline:
                raise OutOfTime
            if now - self._shown >= self.PROGRESS_EVERY:
                self._shown = now
                self.ctx.say_progress(f"search: {self.stage}, {self.evaluations} evaluations, "
                                      f"{now - self.t0:.1f} s")
            for i in todo:
                got = self.model.outputs(self.batches[i], fp32)
                self.per[(fp32, i)] = self.budget.normalized(errors([self.refs[i]], [got], self.budget.metric))
            self.evaluations += 1
        worst = max(self.per[(fp32, i)] for i in which)
        if worst <= 1 and self.start - fp32 and not self.overflow_free(fp32):
            return float("inf")
        return worst

    def overflow_free(self, fp32: frozenset) -> bool:
        """A plan with a wide range-rule region in FP16 stays within UNSEEN x the budget (so
        finite: an overflow makes the error inf) on the loud copy of the first batch (`loud`:
        float inputs x LOUD), so that a node calibration saw within a factor LOUD of FP16's
        max does not overflow on inputs a little larger than the calibration batches (where
        a saturating op, an LSTM's gates, turns the inf into a wrong finite output, the error
        shows it). Measured once per plan."""
        if self.loud is None:  # the FP32 model did not run on it: no wide region is freed
            return False
        if fp32 not in self.loud_ok:
            if time.perf_counter() > self.deadline:
                raise OutOfTime
            try:
                got = self.model.outputs(self.loud[0], fp32)
            except Exception:  # noqa: BLE001 - a plan that cannot run there is not overflow-free
                self.loud_ok[fp32] = False
            else:
                err = errors([self.loud[1]], [got], self.budget.metric)  # inf where an output overflowed
                self.loud_ok[fp32] = self.budget.normalized(err) <= UNSEEN
            self.evaluations += 1
        return self.loud_ok[fp32]

    def measured(self, fp32: frozenset) -> dict:
        """{batch: normalized error} of the batches this plan ran on."""
        return {i: e for (f, i), e in self.per.items() if f == fp32}

    def best_so_far(self, every: list) -> frozenset | None:
        """The cheapest plan measured within budget (on every batch when one was measured
        there, else on the batches it ran on; one that frees a wide region only when its
        overflow check passed), or None when none was."""
        plans: dict = {}
        for (fp32, i), e in self.per.items():
            plans.setdefault(fp32, {})[i] = e
        ok = [(self.plan_price(f), -len(m), f) for f, m in plans.items()
              if max(m.values()) <= 1 and (not self.start - f or self.loud_ok.get(f, False))]
        pool = [x for x in ok if -x[1] == len(every)] or ok
        return min(pool, key=lambda x: (x[0], x[1]))[2] if pool else None

    def unit_price(self, u: int) -> float:
        return self.price(u // 2, u % 2)

    def plan_price(self, fp32: frozenset) -> float:
        return sum(self.unit_price(u) for u in fp32)

    def log(self, what, err, fp32):
        self.ctx.log(f"search: {what}: error {err:.3g} x budget, {len(fp32)} of {2 * len(self.regs)} switches "
                     f"FP32, {self.evaluations} evaluations, {time.perf_counter() - self.t0:.1f} s")

    def sensitivities(self, which):
        """Each region's error alone in FP16, on the first search batch only (the order
        of the regions needs no more; the selection that follows measures on all).
        Group testing: rounding errors add about in quadrature, so a group of regions
        whose error together is small (squared, at most its share of QUIET) cannot be
        what breaks the budget; its regions get the group's error spread evenly. A loud
        group is halved; when both halves are loud the error is spread over the model
        and every region of both is measured alone. Few regions matter on most models
        (Silero VAD: 1 of 48): a few groups are measured instead of every region; where
        every region matters, it costs two evaluations more than measuring each."""
        self._everything, self._which = whole(range(len(self.regs))), which[:1]
        todo = [list(range(len(self.regs)))]
        while todo:
            group = todo.pop()
            self.stage = f"sensitivity ({len(self.regs) - sum(map(len, todo)) - len(group)} of {len(self.regs)} regions)"
            if len(group) <= SINGLES:
                self._alone(group)
                continue
            halves = [group[:len(group) // 2], group[len(group) // 2:]]
            loud = [h for h in halves if not self._quiet(h)]
            if len(loud) == 2:  # spread out: no group will be quiet below this
                self._alone(group)
            else:
                todo += loud
        self.log("sensitivity measured", max((r.error_alone for r in self.regs), default=0.0), frozenset())

    def _alone(self, group):
        for k in group:
            self.regs[k].error_alone = self.error(self._everything - whole([k]), self._which)

    def _quiet(self, group) -> bool:
        """Measures the group alone in FP16; when quiet, gives each region its share."""
        err = self.error(self._everything - whole(group), self._which)
        if err * err > QUIET * len(group) / len(self.regs):
            return False
        for k in group:
            self.regs[k].error_alone = err / len(group) ** 0.5
        return True

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
        if self.error(whole(order), which) > self.limit:
            everything = whole(range(len(self.regs)))
            return everything if self.error(everything, which) <= self.limit else whole(order)
        lo, hi = min(start, len(order)), len(order)
        self.stage = f"bisection over {len(order)} regions"
        while lo < hi:  # the smallest prefix that meets the budget
            mid = (lo + hi) // 2
            if self.error(whole(order[:mid]), which) <= self.limit:
                hi = mid
            else:
                lo = mid + 1
        chosen = set(order[:hi])
        self.prefix = hi
        self.log("bisection", self.error(whole(chosen), which), whole(chosen))
        self.stage = "giving regions back"
        for k in sorted(chosen, key=self.usefulness)[:GIVE_BACK]:  # give back
            if self.error(whole(chosen - {k}), which) <= self.limit:
                chosen.discard(k)
        fp32 = set(whole(chosen))
        self.stage = "splitting regions"
        for k in sorted(chosen, key=lambda k: -self.price(k, 0))[:SPLIT]:  # split
            compute, followers = self.regs[k].parts()
            if compute and followers and self.error(frozenset(fp32 - {2 * k}), which) <= self.limit:
                fp32.discard(2 * k)
        return frozenset(fp32)

    def rank_again(self, worst: int, ranked_on: int):
        """Before a refit: each region's error alone is also measured on `worst`, the batch
        the chosen plan errs most on (when it is not the batch `ranked_on` that ranked them),
        and the larger of the two ranks it: a region that matters on either batch comes
        early (ranked on the worst batch alone, the refit of basic_pitch kept more compute
        FP32 for a larger error than ranked on the first)."""
        if worst == ranked_on:
            return
        before = [r.error_alone for r in self.regs]
        self.sensitivities([worst])
        for r, e in zip(self.regs, before):
            r.error_alone = max(r.error_alone, e)

    def give_back_wide(self, fp32: frozenset, which: list) -> frozenset:
        """Step 9: the wide range-rule regions still FP32 tried in FP16, first all together
        (one evaluation where every one fits), else one by one, most expensive first (at
        most GIVE_BACK_WIDE), each kept in FP16 where the plan stays within self.limit on
        `which`. An overflow in FP16 is an infinite error in the emulation, so a region
        that overflows on these batches is never given back."""
        wide = sorted((k for k, r in enumerate(self.regs) if r.wide and whole([k]) & fp32),
                      key=lambda k: (-self.price(k), k))
        if not wide:
            return fp32
        self.stage = "giving wide range-rule regions back"
        if len(wide) > 1 and self.error(fp32 - whole(wide), which) <= self.limit:
            return fp32 - whole(wide)
        for k in wide[:GIVE_BACK_WIDE]:
            err = self.error(fp32 - whole([k]), which)
            self.regs[k].error_fp16 = err
            if err <= self.limit:
                fp32 = fp32 - whole([k])
        self.log("wide range-rule regions tried in FP16", self.error(fp32, which), fp32)
        return fp32

    def margin(self, fp32: frozenset, seen: list, unseen: list) -> float:
        """Step 8: how much larger the plan's error is on the batches it was not chosen on
        than on those it was (held-out / seen, between 1 and MAX_MARGIN): where the
        calibration batches disagree, unseen inputs can be as far again from them."""
        held, fit = self.error(fp32, unseen), self.error(fp32, seen)
        if held <= fit:
            return 1.0
        return MAX_MARGIN if fit <= 0 else min(MAX_MARGIN, held / fit)


def run(ctx) -> PassResult:
    opts = ctx.options
    if opts.max_error is None:
        return PassResult(changed=False)
    t0 = time.perf_counter()
    if not ctx.batches:
        raise GraphmpError(f"{ctx.path}: --max-error measures the error on calibration batches, and none ran "
                           f"({ctx.report.get('calibration', {}).get('source', 'no calibration')}); pass "
                           "--calibration DATA")
    batches, refs = _references(ctx)
    budget = ctx.search_budget = measure(ctx.model, batches, refs, opts.max_error, opts.metric, ctx.base_dir)
    costs, approximate = node_costs(ctx, batches[0])
    regs = regions(ctx, costs, wide_units(ctx))
    details = {"budget": budget.to_dict(), "regions": len(regs), "batches": len(batches),
               "compute_share_approximate": approximate,
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
    shaken = [perturbed(b) for b in batches[:1]]
    s = _Search(ctx, regs, costs, Switchable(ctx, regs), budget, batches + shaken, refs + _run_fp32(ctx, shaken), t0)
    every = list(range(len(batches) + len(shaken)))
    if s.start:
        s.loud = _loud_reference(ctx, batches[0], details)
    try:
        fp32 = _search(s, details, every, len(batches))
        final = s.error(fp32, every)
    except OutOfTime:
        best = s.best_so_far(every)
        fp32 = best if best is not None else whole(range(len(regs)))
        final = max(s.measured(fp32).values(), default=None)
        details["out_of_time"] = (f"--search-time {opts.search_time:g} s ran out after {s.evaluations} evaluations: "
                                  + ("the cheapest plan measured within budget so far" if best is not None else
                                     "no plan within budget was measured yet, so every candidate region stays FP32")
                                  + "; the written model is measured again below")
        ctx.warn(details["out_of_time"])
    moved, kept_cost = _apply_plan(ctx, s, fp32)
    details["given_back"] = _given_back(ctx)
    spread = s.measured(fp32)
    details["batch_errors"] = {"calibration": [spread.get(i) for i in range(len(batches))],
                               "perturbed": [spread.get(i) for i in range(len(batches), len(every))]}
    total_cost = sum(r.cost for r in regs) or 1.0
    details.update(reached=None if final is None else final <= 1, error=final, evaluations=s.evaluations, fp32_regions=moved,
                   static_plan_compute_kept_fp16=1 - kept_cost / total_cost,
                   model_compute_fp16=_model_compute_fp16(ctx, costs), seconds=round(time.perf_counter() - t0, 3))
    if final is not None and final > 1:
        ctx.warn(f"--max-error {opts.max_error} not reached: the best plan found has {final:.3g} x the budget "
                 f"(floor of this model: {budget.floor})")
    elif moved and details["model_compute_fp16"] is not None and details["model_compute_fp16"] < 0.1:
        ctx.warn(f"--max-error {opts.max_error} leaves {100 * details['model_compute_fp16']:.0f}% of the model's "
                 "Conv/MatMul/Gemm compute in FP16: the budget is near what FP16 can give on this model (see the "
                 "floor in the report)")
    s.log("done", float("nan") if final is None else final, fp32)
    return PassResult(changed=bool(fp32), details=details)


def _search(s: _Search, details: dict, every: list, real: int) -> frozenset:
    """Steps 3-9 on the batches `every` (the first `real` are calibration batches, the
    rest perturbed copies): the FP32 units of the plan found. The plan is chosen on all
    calibration batches but the last; the last and the perturbed copies are held out, and
    how much larger its error is there (the margin) is how far unseen inputs may take a
    plan chosen to fit the batches it saw, so the final plan keeps its error on every batch
    within min(1, UNSEEN / margin) (within the budget, and within UNSEEN x the budget once
    grown by the margin); where it is over that, steps 5-7 run again on every batch with
    that limit. The static plan is chosen on no batch: it is judged on every batch as it
    is. Then the wide range-rule regions go back to FP16 where the plan stays within the
    limit."""
    search_on = every[:real - 1] if real > 1 else every[:1]
    held_out = [i for i in every if i not in search_on]
    details["error_static_plan"] = s.error(s.start, every)
    fp32 = s.start
    if details["error_static_plan"] > 1 or (s.start and s.error(frozenset(), every) > 1):
        # over budget, or wide regions that do not all fit in FP16: choose, wide regions included
        s.sensitivities(search_on)
        chosen = s.select(search_on)
        if held_out:
            s.stage = "checking the held-out batches"
            details["held_out_error"] = s.error(chosen, held_out)
            details["margin"] = s.margin(chosen, search_on, held_out)
            s.limit = details["limit"] = min(1.0, UNSEEN / details["margin"])
            details["refit_on_all_batches"] = s.error(chosen, every) > s.limit
            if details["refit_on_all_batches"]:  # too tight for unseen data: select again on every batch,
                s.rank_again(max(every, key=lambda i: (s.error(chosen, [i]), -i)), search_on[0])
                chosen = s.select(every)
        if details["error_static_plan"] > 1 or s.plan_price(chosen) < s.plan_price(s.start):
            fp32 = chosen
        else:  # the static plan (chosen on no batch) is cheaper: kept, its wide regions tried one by one
            s.limit = 1.0
            for k in ("held_out_error", "margin", "limit", "refit_on_all_batches"):
                details.pop(k, None)
    elif s.start:
        fp32 = frozenset()  # every wide region fits in FP16 at once
    return s.give_back_wide(fp32, every)


def _loud_reference(ctx, batch: dict, details: dict):
    """(the batch x LOUD, the FP32 model's outputs on it), or None with the reason in
    details["overflow_check"] when the FP32 model cannot run on it (wide regions then stay
    FP32: their headroom cannot be measured)."""
    loud = louder(batch)
    try:
        return loud, _run_fp32(ctx, [loud])[0]
    except Exception as e:  # noqa: BLE001 - the model's own limit, not the user's mistake
        details["overflow_check"] = (f"the FP32 model did not run on the first batch x{LOUD:g} ({first_line(e)}): "
                                     "nodes the range rule keeps FP32 past 4094 stay FP32")
        ctx.warn(details["overflow_check"])
        return None


def louder(batch: dict) -> dict:
    """A copy of the batch with every float input x LOUD (the overflow check of wide
    range-rule regions: louder audio, higher-contrast pixels)."""
    return {k: (v * v.dtype.type(LOUD)).astype(v.dtype) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v
            for k, v in batch.items()}


def perturbed(batch: dict) -> dict:
    """A copy of the batch with every float input shifted by one step along its last
    axis and scaled by 1.01: inputs as close to the calibration batch as a 1-pixel (or
    1-sample) shift, whose error should be as good. A budget met on one batch alone can
    miss it by 2x (a Softmax turns a small logit change at one uncertain position into
    the reported number); the plan must hold on this copy too."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, np.ndarray) and v.dtype.kind == "f" and v.ndim >= 1 and v.shape[-1] > 1:
            v = (np.roll(v, 1, axis=-1) * v.dtype.type(1.01)).astype(v.dtype)
        out[k] = v
    return out


def _references(ctx) -> tuple[list, list]:
    """(calibration batches the search measures on, the FP32 model's outputs on them).
    The references run unoptimised, like the switchable model and the emulation: an
    all-FP32 plan then has error 0, not ORT's fusion noise (which matters next to
    near-zero outputs such as a detector's probability map on a blank page)."""
    batches = ctx.batches[:MAX_SEARCH_BATCHES + 1]
    if len(ctx.batch_outputs) >= len(batches):  # calibration ran the FP32 model on them already
        ctx.search_refs = ctx.batch_outputs[:len(batches)]
    else:
        ctx.search_refs = _run_fp32(ctx, batches)
    return batches, ctx.search_refs


def _run_fp32(ctx, batches: list) -> list:
    if not batches:
        return []
    run = runner(ctx.model, base_dir=ctx.base_dir, optimize=False)
    return [run(b) for b in batches]


def _given_back(ctx) -> list:
    """The nodes the static range rule would have kept FP32 that the measured error lets
    run in FP16 (classify's range candidates still lowered), with that rule's reason."""
    out = [{"node": n.name, "graph": g.key, "range_rule": ctx.range_candidates[n]}
           for g, n in ctx.nodes() if n in ctx.range_candidates and n in ctx.lowered]
    if out:
        ctx.log(f"search: {len(out)} node(s) the range rule keeps FP32 run in FP16 within the budget "
                f"(e.g. {out[0]['node']}: {out[0]['range_rule']})")
    return out


def _model_compute_fp16(ctx, costs: dict) -> float | None:
    """Share of the model's Conv/MatMul/Gemm/... FLOPs (every graph) that run in FP16
    now; None when shape inference gave no FLOPs for them (not a false 0)."""
    compute = [(n, costs.get(n.name, 0.0)) for _, n in ctx.nodes() if _is_compute(n)]
    total = sum(c for _, c in compute)
    return sum(c for n, c in compute if n in ctx.lowered) / total if total else None


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
        if r.wide:  # the range rule's verdict stands, with what the search measured
            _keep_range_rule(ctx, r)
            continue
        nodes = [n for p in parts for n in r.parts()[p]]
        cost = sum(s.costs.get(n.name, 0.0) for n in nodes) or (r.cost if parts == [0, 1] else 0.0)
        weights = sum(_weight_bytes(ctx, n.graph, n) for n in nodes)
        kept_cost += cost
        what = "region" if parts == [0, 1] else "followers of" if parts == [1] else "compute nodes of"
        for n in nodes:
            ctx.lowered.discard(n)
            info = ctx.info[n]
            info.cls = "fp32"
            info.reason = (f"search: kept FP32 to meet --max-error ({what} {r.anchor.name}: the region alone in "
                           f"FP16 gives {r.error_alone:.3g} x the budget; {100 * cost / total_cost:.2f}% of the "
                           "converted compute)"
                           + (f"; {ctx.range_candidates[n]}" if n in ctx.range_candidates else ""))
        moved.append({"anchor": r.anchor.name, "kept_fp32": what, "nodes": [n.name for n in nodes], "graph": r.graph,
                      "error_alone": r.error_alone, "compute_share": cost / total_cost,
                      "weight_share": weights / total_weights})
    return moved, kept_cost


def _keep_range_rule(ctx, r):
    """A wide region the search did not give back: FP32, its range-rule nodes with the
    rule's reason and the error the plan had with the region in FP16 (when it was tried);
    the nodes paint lowered only beside them (regions.wide_units) as paint leaves them."""
    tried = (f"in FP16 it overflows (inf) on the calibration batches, or errs over {UNSEEN:g}x the budget on the "
             f"first one x{LOUD:g}"
             if r.error_fp16 == float("inf") else
             f"in FP16 the plan gave {r.error_fp16:.3g} x the budget" if r.error_fp16 is not None else
             "not tried in FP16")
    for n in r.nodes:
        ctx.lowered.discard(n)
        if n in ctx.range_candidates:
            ctx.info[n].cls = "fp32"
            ctx.info[n].reason = f"{ctx.range_candidates[n]}; --max-error search: {tried}"


def verify(ctx) -> PassResult:
    """Needs the converted model (after apply and sort). Measures its error with the
    emulation of the model as written, on the same batches, against the budget: the
    switchable model's prediction, checked on the real output. When the static plan met
    the budget at once, that one run is the verification."""
    budget = ctx.search_budget
    if budget is None:
        return PassResult(changed=False)
    done = ctx.report.get("search", {})
    batches = ctx.batches[:MAX_SEARCH_BATCHES + 1]
    cuda = _verify_on_cuda(ctx, batches, budget)
    islands_moved = bool(ctx.report.get("islands", {}).get("accepted"))
    if islands_moved:  # the islands step (after the search) moved nodes: the range rule's list as written
        done["given_back"] = _given_back(ctx)
    if done.get("evaluations") == 1 and not done.get("fp32_regions") and not islands_moved:
        # the static plan met the budget and nothing moved: its one evaluation measured
        # this model already (test_search holds the switchable model equal to the
        # emulation), and a second run would double the time of a plain conversion
        return PassResult(changed=False, details={"verified": {"normalized": done["error"],
                                                               "by": "the search's run of the static plan"},
                                                  **cuda})
    from ..emulate import emulated_runner
    emu = emulated_runner(ctx.model, ctx.base_dir)
    errs = errors(ctx.search_refs, [emu(x) for x in batches], budget.metric)
    details = {"verified": {"errors": errs, "normalized": budget.normalized(errs)}, **cuda}
    if islands_moved:  # the island trials changed the search's plan: the written model's error is the verdict
        details.update(error=details["verified"]["normalized"], reached=details["verified"]["normalized"] <= 1,
                       after_islands=True)
    if done.get("out_of_time"):  # the search stopped early: the written model's error is the verdict
        details.update(error=details["verified"]["normalized"], reached=details["verified"]["normalized"] <= 1)
        if not details["reached"]:
            ctx.warn(f"--max-error {ctx.options.max_error} not reached in --search-time: the written model has "
                     f"{details['error']:.3g} x the budget; allow more --search-time")
    return PassResult(changed=False, details=details)


def _verify_on_cuda(ctx, batches: list, budget) -> dict:
    """{"verified_ort_cuda": ...} where onnxruntime-gpu and a GPU are present: the written
    model as it is on ORT CUDA, against the same references. The emulation models an ideal
    kernel; on an H100, ORT CUDA's FP16 kernels erred 1.1-4.2x as much on PP-OCR models
    (benchmarks/oracles.py), so a plan the emulation passes can miss the budget there, and
    the user is told. {} without CUDA."""
    from ..model_runs import cuda_available
    if not cuda_available():
        return {}
    try:
        run = runner(ctx.model, providers=[CUDA], base_dir=ctx.base_dir)
        if ran_on(run.session) != CUDA:
            return {}
        errs = errors(ctx.search_refs, [run(x) for x in batches], budget.metric)
    except Exception as e:  # noqa: BLE001 - a CUDA failure is a note, the CPU verdict stands
        return {"verified_ort_cuda": {"error": first_line(e)}}
    n = budget.normalized(errs)
    if n > 1:
        ctx.warn(f"on ORT CUDA the written model has {n:.3g} x the --max-error budget (the FP16-faithful emulation "
                 "models an ideal kernel; this GPU's kernels round more): a tighter --max-error, or --fp32-nodes on "
                 "the regions the report names, meets it there")
    return {"verified_ort_cuda": {"errors": errs, "normalized": n}}

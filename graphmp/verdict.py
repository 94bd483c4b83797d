"""verdict: what an output's numbers say beyond its error against the budget (graphmp.check).

Two yardsticks are measured on the check's own inputs (graphmp.budget): the FP32 model with
its Conv/MatMul inputs rounded to TF32 (what the GPU already does), and the FP32 model with
only its float inputs rounded to FP16 (the FP16-input floor). This module reads their
outputs twice more:

- **Decisions.** An output with a class axis (float, [N, C] or [N, T, V], C > 1) is judged
  on its argmax too: the converted model may change at most K x as many of its n row
  decisions as the yardstick that changes the most (TF32, or FP16 inputs) changes on the
  same inputs, K being the budget's (auto:K, floor:K; 2 otherwise, auto's default).
  That count t is taken at its one-sided 95% Poisson upper bound, since it is a small
  count: t = 0 of n rows still bounds the yardstick's rate by 3/n (the rule of three),
  so a few flipped near-ties never fail a check, and a collapse (most decisions
  changed) always does once n >= 7 (6/n < 1). This is independent of max-rel: logits
  that share a large offset (max-rel small) can lose every decision in FP16. Top-5
  agreement (FP32's class among the converted model's five best) is reported where
  C > 5.
- **The domain.** When a yardstick alone changes an output by more than the output's
  own spread (RMS of the change > standard deviation of the FP32 output, over every
  element of every batch), the output on these inputs is noise to the model: it is
  chaotic there (a quantizer's scale, Sin/Cos of large arguments) or barely depends
  on them, and any converted model would pass a budget built on that noise. On
  generated inputs such an output is "not judged" (the check fails, exit 1) and the
  inputs that cause it are named: those whose FP16 rounding alone does it, and what
  the graph feeds them into (quantizers, Sin/Cos, embedding rows). On the user's own
  data it is judged as usual, with a warning.
"""
from __future__ import annotations

import math

import numpy as np
import onnx

from .budget import as_tensor, round_float_inputs

CONFIDENCE_Z = 1.6449  # one-sided 95%
TOP_K = 5
# ops that make an output jump, or go flat, with where their input lies: quantizers pick
# their scale from the data's range and round to a few levels; Sin/Cos lose their phase at
# large arguments and barely move at tiny ones (coordinates that N(0,1) puts near the origin)
SENSITIVE = {"DynamicQuantizeLinear": "its quantization scale comes from the data's range",
             "QuantizeLinear": "it rounds to a few integer levels",
             "MatMulInteger": "it computes on quantized levels",
             "DynamicQuantizeMatMul": "its quantization scale comes from the data's range",
             "DynamicQuantizeLSTM": "its quantization scale comes from the data's range",
             "Sin": "periodic: large arguments lose their phase, tiny ones make it flat",
             "Cos": "periodic: large arguments lose their phase, tiny ones make it flat"}


def class_scores(ref) -> bool:
    """An output with a class axis: float, [N, C] or [N, T, V] with C > 1 (the rule of
    graphmp.check.compare's argmax agreement; image maps [N, C, H, W] are not)."""
    r = as_tensor(ref)
    return r.dtype.kind == "f" and r.ndim in (2, 3) and r.shape[-1] > 1 and r.size > 0


def changed_decisions(ref, got) -> tuple[int, int]:
    """(rows whose argmax differs, rows) between two outputs of the same shape."""
    r = np.nan_to_num(as_tensor(ref).astype(np.float64))
    g = np.nan_to_num(as_tensor(got).astype(np.float64))
    a, b = np.argmax(r, axis=-1), np.argmax(g, axis=-1)
    return int(np.count_nonzero(a != b)), int(a.size)


def top_k_agreement(refs: list, gots: list, k: int = TOP_K) -> float | None:
    """Share of rows whose FP32 class is among the converted model's k best; None where
    the class axis has k classes or fewer."""
    hit = rows = 0
    for ref, got in zip(refs, gots):
        r, g = as_tensor(ref), np.nan_to_num(as_tensor(got).astype(np.float64))
        if r.shape[-1] <= k:
            return None
        best = np.argmax(r, axis=-1)[..., None]
        top = np.argpartition(-g, k - 1, axis=-1)[..., :k]
        hit += int(np.count_nonzero(np.any(top == best, axis=-1)))
        rows += best.size
    return hit / rows if rows else None


def poisson_upper(t: int) -> float:
    """One-sided 95% upper bound of a Poisson mean from `t` observed events (3.0 for t=0;
    the normal approximation with continuity above 100 events)."""
    if t > 100:
        return t + 0.5 + CONFIDENCE_Z * math.sqrt(t + 0.5)
    lo, hi = float(t), t + 10.0 + 4 * math.sqrt(t + 1)
    for _ in range(60):  # bisection on P(X <= t; lam) = 0.05
        lam = (lo + hi) / 2
        cdf = sum(math.exp(-lam + i * math.log(lam) - math.lgamma(i + 1)) for i in range(t + 1))
        lo, hi = (lam, hi) if cdf > 0.05 else (lo, lam)
    return hi


def decisions(name: str, wants: list, gots: list, budget, judged: bool = True) -> dict | None:
    """The class-decision verdict of output `name` (see the module docstring): {changed,
    rows, agree, allowed_changed (share; None: not judged), by (the yardstick that set it),
    k, yardsticks: {y: changed}, top5}; None for an output without a class axis."""
    if not wants or not class_scores(wants[0][name]):
        return None
    t = n = 0
    for want, got in zip(wants, gots):
        c, rows = changed_decisions(want[name], got[name])
        t, n = t + c, n + rows
    out = {"changed": t, "rows": n, "agree": 1 - t / n if n else None, "allowed_changed": None, "by": None,
           "k": decision_factor(budget.spec), "yardsticks": {},
           "top5": top_k_agreement([w[name] for w in wants], [g[name] for g in gots])}
    for y, outs in budget.runs.items():
        out["yardsticks"][y] = sum(changed_decisions(w[name], o[name])[0] for w, o in zip(wants, outs))
    if judged and n and out["yardsticks"]:
        out["by"] = max(out["yardsticks"], key=lambda y: (out["yardsticks"][y], y == "tf32"))
        out["allowed_changed"] = min(1.0, out["k"] * poisson_upper(out["yardsticks"][out["by"]]) / n)
    return out


def decision_factor(spec) -> float:
    """K of --max-error auto:K or floor:K (how many times the yardsticks' own effect the
    budget allows), 2 for any other budget (auto's default)."""
    from .budget import parse
    kind, value = parse(spec)
    return value if kind in ("auto", "floor") else 2.0


def decisions_fail(d: dict | None) -> bool:
    """The converted model changes a larger share of decisions than the yardsticks allow."""
    if not d or d["allowed_changed"] is None or not d["rows"]:
        return False
    return d["changed"] / d["rows"] > d["allowed_changed"]


def _pooled(values: list) -> np.ndarray:
    return np.concatenate([as_tensor(v).astype(np.float64).ravel() for v in values])


def domain(name: str, wants: list, budget) -> dict | None:
    """{spread, changes: {yardstick: RMS change}, ratio, outside}: how far each yardstick
    moves output `name` against its own standard deviation; None for a non-float output,
    one with fewer than two finite values, or one whose shape or finiteness the
    yardsticks change (the verdict says that already)."""
    if not wants or as_tensor(wants[0][name]).dtype.kind != "f":
        return None
    ref = _pooled([w[name] for w in wants])
    ok = np.isfinite(ref)
    if np.count_nonzero(ok) < 2:  # one value has no spread to compare with
        return None
    spread = float(np.std(ref[ok]))
    changes = {}
    for y, outs in budget.runs.items():
        got = _pooled([o[name] for o in outs])
        if got.shape != ref.shape or not np.all(np.isfinite(got[ok])):
            return None
        changes[y] = float(np.sqrt(np.mean((got[ok] - ref[ok]) ** 2)))
    worst = max(changes.values(), default=0.0)
    ratio = worst / spread if spread > 0 else (math.inf if worst > 0 else 0.0)
    return {"spread": spread, "changes": changes, "ratio": ratio, "outside": ratio > 1.0}


MAX_ATTRIBUTED_INPUTS = 16  # one run of the source per input: beyond this, the graph alone names them


def culprits(model: onnx.ModelProto, batch: dict, run_ref, outputs: list) -> list[str]:
    """Why the inputs are out of range, one phrase per responsible input: the float inputs
    whose FP16 rounding alone moves one of `outputs` by more than its spread on `batch`
    (every float input when none does alone, or when there are more than
    MAX_ATTRIBUTED_INPUTS), each with the first node the graph feeds it into that makes its
    output jump (SENSITIVE); integer inputs read as Gather indices (ids) are named with the
    rows they pick when no float input is responsible alone. Best effort: a run that fails
    names the inputs from the graph alone."""
    floats = [k for k, v in batch.items() if getattr(v, "dtype", None) == np.float32]
    alone = []
    if len(floats) <= MAX_ATTRIBUTED_INPUTS:
        try:
            alone = _moved_alone(batch, run_ref, outputs, floats)
        except Exception:  # noqa: BLE001 - a hint, never a second failure
            alone = []
    found = _sensitive_consumers(model)
    out = [f"input '{k}'" + (f" feeds {found[k]}" if k in found else "") for k in alone or floats]
    if not alone:
        out += [f"input '{k}' (ids) {found[k]}" for k in batch if k not in floats and k in found]
    return out


def _moved_alone(batch: dict, run_ref, outputs: list, floats: list) -> list[str]:
    """The inputs of `floats` whose FP16 rounding alone moves one of `outputs` by more
    than its standard deviation on `batch`."""
    want = run_ref(batch)
    alone = []
    for k in floats:
        got = run_ref({**batch, k: round_float_inputs({k: batch[k]})[k]})
        for o in outputs:
            r, g = as_tensor(want[o]).astype(np.float64), as_tensor(got[o]).astype(np.float64)
            if r.shape == g.shape and np.sqrt(np.mean((g - r) ** 2)) > np.std(r):
                alone.append(k)
                break
    return alone


def _sensitive_consumers(model: onnx.ModelProto) -> dict:
    """{graph input: 'Op 'node' (why)'}: the first SENSITIVE node each input reaches in the
    main graph (breadth first), or for an integer input read as Gather indices, the table
    whose rows it picks."""
    consumers: dict = {}
    for n in model.graph.node:
        for i, x in enumerate(n.input):
            consumers.setdefault(x, []).append((n, i))
    init = {t.name for t in model.graph.initializer}
    out = {}
    for v in model.graph.input:
        if v.name in init:
            continue
        for n, i in consumers.get(v.name, []):
            if n.op_type == "Gather" and i == 1:
                out[v.name] = f"picks rows of '{n.input[0]}' (Gather '{n.name}')"
        seen, frontier = {v.name}, [v.name]
        while frontier and v.name not in out:
            nxt = []
            for x in frontier:
                for n, _ in consumers.get(x, []):
                    if n.op_type in SENSITIVE:
                        out[v.name] = f"{n.op_type} '{n.name}' ({SENSITIVE[n.op_type]})"
                        break
                    nxt += [y for y in n.output if y and y not in seen]
                    seen.update(n.output)
                if v.name in out:
                    break
            frontier = nxt
    return out


CUDA_ROW = " [ORT CUDA]"


def judge(merged: dict, wants: list, gots: list, budget, *, generated_flag: str | None, explain) -> list[str]:
    """Adds 'decisions' and 'domain' to every row of `merged` (graphmp.check's rows, one
    per output) and turns them into the verdict: a row fails where decisions_fail; an
    output outside the inputs' domain gets 'not_judged' and fails when the inputs were
    generated (`generated_flag`: the option that gives real data, '--data' or
    '--calibration'; None: the user's data, judged as usual). explain(outputs) names the
    inputs responsible (culprits). Returns the warnings for the user's data."""
    outside, warnings = [], []
    for name, row in merged.items():
        if name.endswith(CUDA_ROW):
            continue
        # --metric argmax judges the decisions already, by the budget
        row["decisions"] = decisions(name, wants, gots, budget, judged=budget.metric != "argmax")
        row["domain"] = domain(name, wants, budget)
        if decisions_fail(row["decisions"]):
            row["passed"] = False
        if row["domain"] and row["domain"]["outside"]:
            outside.append(name)
    if not outside:
        return warnings
    why = "; ".join(explain(outside))
    for name in outside:
        dom = merged[name]["domain"]
        moved = " and ".join(f"{'TF32' if y == 'tf32' else 'FP16 input'} rounding {c / dom['spread']:.3g}x"
                             if dom["spread"] > 0 else f"{y} {c:.3g}" for y, c in dom["changes"].items())
        size = f"its own spread (RMS change vs its standard deviation {dom['spread']:.3g}: {moved})"
        if generated_flag is None:
            warnings.append(f"{name}: on your data the yardsticks alone move it by more than {size}; {why}: a "
                            "budget measured from them (auto, tf32, floor) is built on that noise; --max-error E "
                            "judges it by a fixed one")
            continue
        text = (f"the generated inputs are out of range for this model: rounding alone moves it by more than "
                f"{size}; {why}; pass {generated_flag} with real inputs")
        for row_name in (name, name + CUDA_ROW):
            if row_name in merged:
                merged[row_name]["not_judged"], merged[row_name]["passed"] = text, False
    return warnings


def hints(d: dict) -> list[str]:
    """What a user can do about a check report `d` (graphmp.check's dict) that failed,
    fitted to the failure: a converted model that does not run is answered with the
    cause; a budget below the FP16-input floor is named unreachable (and what is
    reachable); accuracy failures get the options that meet a budget."""
    if d.get("crash"):
        return [_crash_hint(d)]
    floor = (d.get("budget") or {}).get("floor") or {}
    bad = {k: o for k, o in d["outputs"].items() if not o["passed"] and not o["nonfinite"] and o.get("error")
           and not o.get("not_judged") and not k.endswith(CUDA_ROW)}
    out = []
    same = [k for k, o in bad.items() if o["argmax_agree"] == 1.0]
    if same and d["metric"] != "argmax":
        out.append(f"if {', '.join(same)} holds class scores, no decision changed (argmax agree 1.0): --metric "
                   "argmax judges a classifier by its decisions")
    unreachable = [k for k, o in bad.items() if _fixed_budget(d["max_error"]) and floor.get(k, 0) > o["allowed"]]
    for k in unreachable:
        out.append(f"{k}: --max-error {d['max_error']} is below what rounding only the inputs to FP16 already costs "
                   f"(FP16 input floor {floor[k]:.3g}): no plan that computes this output in FP16 can reach it; "
                   f"reachable budgets start near {floor[k]:.3g} (--max-error floor:2 allows 2x the floor; auto, the "
                   "default, also allows 2x the TF32 error)")
    near = [k for k, o in bad.items() if floor.get(k) and o["error"] <= 4 * floor[k]]
    if near:
        out.append(f"{', '.join(near)}: the error is within 4x what rounding only the inputs to FP16 costs; "
                   "--max-error auto:4 allows 4x the floor and the TF32 error")
    flipped = [k for k, o in bad.items() if decisions_fail(o.get("decisions"))]
    if flipped:
        fix = _convert_command(d, "--metric argmax --max-error auto")
        out.append(f"{', '.join(flipped)}: the conversion changes more class decisions than {_k(d)}x what TF32 or "
                   f"FP16 inputs change, whatever its {d['metric']}: {fix} keeps FP32 what changes them")
    if any(o.get("allowed") is not None and o["error"] > o["allowed"] for o in bad.values()):
        out.append("graphmp convert --max-error E (or tf32) converts to meet a budget")
    return out


def _k(d: dict) -> str:
    return f"{decision_factor(d['max_error']):g}"


def _convert_command(d: dict, flags: str) -> str:
    """`graphmp convert SOURCE -o NEW flags`, written to a file that is neither the checked
    model nor its source (a check of in-memory models names placeholders)."""
    import shlex
    ref = d["reference"] if d["reference"] != "<model>" else "SOURCE.onnx"
    conv = d["converted"] if d["converted"] != "<model>" else "OUT.onnx"
    return f"`graphmp convert {shlex.quote(ref)} -o {shlex.quote(fresh_output(conv, ref))} {flags}`"


def _fixed_budget(spec) -> bool:
    """--max-error was a number (not a budget measured from the yardsticks)."""
    try:
        float(spec)
        return True
    except (TypeError, ValueError):
        return False


def fresh_output(converted: str, reference: str) -> str:
    """Where a suggested `graphmp convert` should write: beside `converted`, named after it
    (X.onnx -> X.fixed.onnx, then X.fixed2.onnx, ...), never the checked file, the
    source, or a file that exists."""
    import os
    stem = converted[:-5] if converted.endswith(".onnx") else converted
    taken = {os.path.abspath(converted), os.path.abspath(reference)}
    i = 1
    while True:
        path = f"{stem}.fixed{i if i > 1 else ''}.onnx"
        if os.path.abspath(path) not in taken and not os.path.exists(path):
            return path
        i += 1


def _crash_hint(d: dict) -> str:
    """The answer to a converted model that does not run: its cause, and what changes it
    (no budget or calibration data does)."""
    import re
    import shlex
    node = re.search(r"(?:Name|node):\s*'([^']+)'", d["crash"])
    keep = ("; keeping the node it names as the source has it may avoid it: "
            + _convert_command(d, f"--fp32-nodes {shlex.quote('^' + re.escape(node.group(1)) + '$')}")) if node else ""
    return ("the converted model does not run, so nothing was compared: ONNX Runtime's message is the cause "
            f"(no --max-error or --calibration changes it){keep}; where the FP32 source runs on the same inputs, "
            "it is a graphmp bug worth reporting with the model")

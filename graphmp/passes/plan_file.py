"""plan_file: plans you keep. `--save-plan FILE` writes the precision the conversion chose
for every float node; `--plan FILE` applies such a plan to the same network again (a
re-export with other weights or other node names included) without the search.

Node keys (they survive a re-export):
  graph    the graph's key: main, or main/IF_NODE.then_branch for a subgraph;
  scope    the same path with each owner named by op type and position instead
           (main/If#0.then_branch), for re-exports that renamed nodes;
  op_type, index  the op type and the position among the graph's nodes of that op type
           in a canonical topological walk (post-order from the graph outputs, inputs in
           slot order): independent of node names and of the order nodes are stored in;
  name     the node's name.
An entry matches a node by (graph, name) with the same op type first, then by
(scope, op_type, index). Entries and nodes that match nothing are named in the report.

The plan file (JSON, written atomically; see `save`): schema "graphmp.plan", version 1,
graphmp and onnx versions, the source's file name and the sha256 of its structure
(ops, wiring by position, attributes, weight shapes: no names, no weight values), the
target type, the budget (--max-error and --metric) with the errors measured, and one
entry per float node: graph, scope, op_type, index, name, precision (low or fp32),
reason. A plan is untrusted input: graphmp.plan_read.load checks every key, type and size; nothing in it
is executed; a bad one is a one-line GraphmpError naming the file and the key.

run. Needs: ctx.lowered and ctx.info after paint (the search is skipped with --plan:
`unless_plan`), ctx.batches (calibrate). Runs with --plan or --save-plan. Guarantees:
ctx.plan holds every node's key; with --plan, a matched node runs in the precision the
plan says, except where a binding rule keeps it (`binding`: no low-precision form, an
integer-derived or FP16-island value, weights beyond the low type, Q/DQ, unknown op,
--fp32-nodes/--fp32-ops/--fp16-nodes of this run), which report["plan"]["overruled"]
lists; unmatched nodes keep paint's decision; the FP32 references and the budget (the
plan's, or --max-error's when given; with neither, graphmp check's yardstick) are measured
for `verify` (a fixed budget, a number, needs no yardstick runs).
verify. Needs the written model (after apply and sort). Measures its error FP16-faithfully
(graphmp.emulate) on the calibration batches against that budget: report["plan"]["met"].
save. Last: writes --save-plan from the final decisions and the search's measurements.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import math
import os
import re
from dataclasses import dataclass, field

import onnx

from ..budget import Budget, errors, measure, parse
from ..plan_read import MAX_TEXT, SCHEMA, VERSION, Plan
from . import PassResult
from .classify import RECURRENCE_REASON, SQUARE_REASON

MAX_BATCHES = 5               # verification batches (search.MAX_SEARCH_BATCHES + its held-out one)
# Reasons that record a choice the plan may change: data-dependent or heuristic. Any other
# reason (and a node with no low-precision form) is binding: the plan cannot lower it.
CHOICES = ("range:", "search:", "FP32 spread", "plan:")
CHOICE_SUFFIX = "(FP32 op class)"


@dataclass(frozen=True)
class Key:
    graph: str
    scope: str
    op_type: str
    index: int
    name: str


@dataclass
class State:
    """What run leaves for verify and save (ctx.plan)."""
    keys: dict                                  # node (graphmp.ir.Node) -> Key
    structure: str                              # sha256 of the graph structure
    budget: object = None                       # graphmp.budget.Budget verify measures against
    batches: list = field(default_factory=list)
    refs: list = field(default_factory=list)


def unless_plan(step):
    """`step` (the search) as a pipeline step that is skipped when --plan gives the precisions."""
    @functools.wraps(step)
    def skipped_with_plan(ctx):
        return PassResult(changed=False) if ctx.options.plan is not None else step(ctx)
    return skipped_with_plan


# --------------------------------------------------------------------------- keys
def _canonical(g) -> list:
    """g's nodes in post-order from its outputs (inputs in slot order, then captures),
    nodes no output needs last, each from its own walk."""
    prod = g.producers()

    def preds(n):
        reads = list(n.inputs) + sorted(n.implicit_inputs())
        return iter([prod[x] for x in reads if x in prod and prod[x] is not n])
    order, done = [], set()
    for start in [prod[o] for o in g.output_names if o in prod] + list(g.nodes):
        if start in done:
            continue
        done.add(start)
        stack = [(start, preds(start))]
        while stack:
            n, it = stack[-1]
            p = next((p for p in it if p not in done), None)
            if p is None:
                stack.pop()
                order.append(n)
            else:
                done.add(p)
                stack.append((p, preds(p)))
    return order


def _attr_token(a) -> str:
    if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        return a.name
    if a.type == onnx.AttributeProto.TENSOR:
        return f"{a.name}=t{a.t.data_type}{list(a.t.dims)}"
    return f"{a.name}={onnx.helper.get_attribute_value(a)!r}"


def _structure(g, order: list) -> str:
    """g's structure as text: per node (canonical order) its op and where each input comes
    from by position; the outputs; no names, no weight values."""
    pos = {n: i for i, n in enumerate(order)}
    slot = {o: (pos[n], k) for n in order for k, o in enumerate(n.outputs) if o}
    ins = {v.name: i for i, v in enumerate(g.proto.input)}

    def ref(x):
        if not x:
            return "-"
        if x in slot:
            return "n%d.%d" % slot[x]
        if x in ins:
            return f"i{ins[x]}"
        t = g.initializers.get(x)
        return f"w{t.data_type}{list(t.dims)}" if t is not None else "o"
    parts = [f"in:{[v.type.tensor_type.elem_type for v in g.proto.input]}"]
    for n in order:
        attrs = ";".join(sorted(_attr_token(a) for a in n.proto.attribute))
        parts.append(f"{n.domain}:{n.op_type}({','.join(ref(x) for x in n.inputs)})[{attrs}]")
    parts.append(f"out:{[ref(o) for o in g.output_names]}")
    return "\n".join(parts)


def node_keys(ctx) -> tuple[dict, str]:
    """({node: Key} for every node of every graph, sha256 of the structure)."""
    keys, scopes, texts = {}, {}, {}
    for g in ctx.root.walk():  # parents first
        if g.parent is None:
            scope = g.key
        else:
            attr = g.key[len(f"{g.parent.key}/{g.owner.name}."):]
            scope = f"{scopes[g.parent.key]}/{g.owner.op_type}#{keys[g.owner].index}.{attr}"
        scopes[g.key] = scope
        order = _canonical(g)
        count = collections.Counter()
        for n in order:
            keys[n] = Key(g.key, scope, n.op_type, count[n.op_type], n.name)
            count[n.op_type] += 1
        texts[scope] = _structure(g, order)
    h = hashlib.sha256()
    for scope in sorted(texts):
        h.update(f"graph {scope}\n{texts[scope]}\n".encode())
    return keys, h.hexdigest()


def decided(info) -> bool:
    """A float node whose precision the conversion decides (as convert's report counts them)."""
    return info is not None and info.cls != "none" and not (info.cls == "fixed" and not info.reason)


def binding(info) -> str | None:
    """Why the node cannot run in the low type whatever a plan says (None: it can)."""
    if not (info.low_inputs or info.low_outputs):
        return info.reason or "no low-precision form of this node"
    r = info.reason
    if r is None or r.startswith(CHOICES) or r.endswith(CHOICE_SUFFIX) or r in (SQUARE_REASON, RECURRENCE_REASON):
        return None
    return r


# --------------------------------------------------------------------------- run: apply a plan
def _match(ctx, keys: dict, nodes: list) -> tuple[dict, int]:
    """({node: entry index}, how many matched by position) over the decided nodes."""
    by_name = {(e["graph"], e["name"]): i for i, e in enumerate(nodes)}
    by_place = {(e["scope"], e["op_type"], e["index"]): i for i, e in enumerate(nodes)}
    candidates = [(n, k) for n, k in keys.items() if decided(ctx.info.get(n))]
    match, used = {}, set()
    for n, k in candidates:
        i = by_name.get((k.graph, k.name))
        if i is not None and nodes[i]["op_type"] == k.op_type:
            match[n] = i
            used.add(i)
    by_position = 0
    for n, k in candidates:
        i = by_place.get((k.scope, k.op_type, k.index)) if n not in match else None
        if i is not None and i not in used:
            match[n] = i
            used.add(i)
            by_position += 1
    return match, by_position


def _set(ctx, n, e, forced, label) -> str | None:
    """Put node n in the precision of entry e. Returns 'changed', None (already so), or
    'overruled: WHY' when a binding rule or a flag of this run keeps it."""
    info = ctx.info[n]
    want_low, is_low = e["precision"] == "low", n in ctx.lowered
    if want_low == is_low:
        return None
    if not want_low:
        if forced is not None and forced.search(n.name):
            return "overruled: --fp16-nodes"
        ctx.lowered.discard(n)
        info.reason = f"plan: FP32 in {label} ({(e.get('reason') or 'no reason saved')[:200]})"
        return "changed"
    why = binding(info)
    if why is not None:
        return f"overruled: {why}"
    ctx.lowered.add(n)
    info.reason = None
    return "changed"


def _apply(ctx, plan: Plan, keys: dict) -> dict:
    nodes = plan.data["nodes"]
    label = os.path.basename(plan.path)
    match, by_position = _match(ctx, keys, nodes)
    forced = re.compile(ctx.options.fp16_nodes) if ctx.options.fp16_nodes else None
    changed, overruled = 0, []
    for n, k in keys.items():
        if n not in match:
            continue
        e = nodes[match[n]]
        what = _set(ctx, n, e, forced, label)
        changed += what == "changed"
        if what and what.startswith("overruled"):
            overruled.append({"name": n.name, "op_type": n.op_type, "graph": k.graph, "plan": e["precision"],
                              "kept": "low" if n in ctx.lowered else "fp32", "why": what[len("overruled: "):]})
    used = set(match.values())
    unmatched_nodes = [k.name for n, k in keys.items() if decided(ctx.info.get(n)) and n not in match]
    unmatched_entries = [e["name"] for i, e in enumerate(nodes) if i not in used]
    return {"file": plan.path, "source": plan.data.get("source"), "matched": len(match),
            "matched_by_position": by_position, "changed": changed, "overruled": overruled,
            "unmatched_nodes": unmatched_nodes, "unmatched_entries": unmatched_entries}


def _warn_unmatched(ctx, d: dict):
    def few(names):
        return ", ".join(f"'{x[:60]}'" for x in names[:3]) + (", ..." if len(names) > 3 else "")
    parts = []
    if d["unmatched_nodes"]:
        parts.append(f"{len(d['unmatched_nodes'])} node(s) of the model are not in the plan "
                     f"({few(d['unmatched_nodes'])}) and keep the static rules' precision")
    if d["unmatched_entries"]:
        parts.append(f"{len(d['unmatched_entries'])} plan entr{'y' if len(d['unmatched_entries']) == 1 else 'ies'} "
                     f"matched no node ({few(d['unmatched_entries'])})")
    if parts:
        ctx.warn(f"--plan {os.path.basename(d['file'])}: " + "; ".join(parts) + " (all named in the JSON report "
                 "'plan')")
    if d["overruled"]:
        o = d["overruled"][0]
        ctx.warn(f"--plan {os.path.basename(d['file'])}: {len(d['overruled'])} entr"
                 f"{'y' if len(d['overruled']) == 1 else 'ies'} overruled by rules of this run (e.g. '{o['name']}' "
                 f"stays {o['kept']}: {o['why'][:120]})")


def _budget_spec(opts, plan: Plan) -> tuple:
    """(spec, metric, where from): --max-error when given, else the plan's, else the yardstick."""
    if opts.max_error is not None:
        return opts.max_error, opts.metric, "--max-error"
    b = plan.data.get("budget")
    if b is not None:
        return b["max_error"], b["metric"], "the plan"
    return "auto", "max-rel", "the yardstick of graphmp check (the plan holds no budget)"


def _prepare_verify(ctx, st: State, plan: Plan) -> dict:
    """The FP32 references and the budget on the calibration batches (before apply)."""
    from ..model_runs import runner
    spec, metric, origin = _budget_spec(ctx.options, plan)
    st.batches = ctx.batches[:MAX_BATCHES]
    if not st.batches:
        ctx.warn(f"--plan: not verified: no calibration batch ran ({ctx.report.get('calibration', {}).get('source')})")
        return {"budget_from": origin}
    ctx.root.write_back()  # the proto holds exactly the IR's nodes
    kept = getattr(ctx, "batch_outputs", None) or []  # calibration's own FP32 outputs, when it kept them
    if len(kept) >= len(st.batches):
        st.refs = kept[:len(st.batches)]
    else:  # unoptimised, as the emulation runs (see search.run)
        run32 = runner(ctx.model, base_dir=ctx.base_dir, optimize=False)
        st.refs = [run32(b) for b in st.batches]
    kind, value = parse(spec)
    judged = errors(st.refs, st.refs, metric)  # the outputs the metric judges
    if kind == "abs" and judged:  # a fixed budget needs no yardstick runs
        st.budget = Budget(str(spec), metric, allowed={k: value for k in judged})
    else:
        st.budget = measure(ctx.model, st.batches, st.refs, spec, metric, ctx.base_dir)
    return {"budget_from": origin, "budget": st.budget.to_dict()}


def run(ctx) -> PassResult:
    opts = ctx.options
    if opts.plan is None and not opts.save_plan:
        return PassResult(changed=False)
    keys, structure = node_keys(ctx)
    st = ctx.plan = State(keys, structure)
    if opts.plan is None:
        return PassResult(changed=False)
    plan = opts.plan
    saved_target = plan.data.get("target")
    if saved_target and saved_target != opts.target:
        ctx.warn(f"--plan {plan.path} was saved for --target {saved_target}; its low nodes run in {opts.target} here")
    details = _apply(ctx, plan, keys)
    details["same_structure"] = plan.data.get("source_sha256") == structure
    _warn_unmatched(ctx, details)
    details.update(_prepare_verify(ctx, st, plan))
    return PassResult(changed=bool(details["changed"]), details=details)


def verify(ctx) -> PassResult:
    """The written model's error (emulated, FP16-faithful) against the plan's budget."""
    st = ctx.plan
    if st is None or st.budget is None:
        return PassResult(changed=False)
    from ..emulate import emulated_runner
    emu = emulated_runner(ctx.model, ctx.base_dir)
    errs = errors(st.refs, [emu(b) for b in st.batches], st.budget.metric)
    norm = st.budget.normalized(errs)
    if norm > 1:
        ctx.warn(f"--plan: the budget ({st.budget.metric} <= {st.budget.spec}) is NOT met: error {norm:.3g} x the "
                 "budget on the calibration batches; a search (--max-error without --plan) fits this model")
    return PassResult(changed=False, details={"met": norm <= 1, "verified": {"errors": errs, "normalized": norm,
                                                                             "batches": len(st.batches)}})


# --------------------------------------------------------------------------- save
def _finite(x):
    """JSON without NaN/Infinity (which plan files may not hold): such floats as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _measurements(ctx) -> tuple:
    """(budget, measured) for the plan file: the search's, or the --plan verification's."""
    s, p = ctx.report.get("search", {}), ctx.report.get("plan", {})
    if s.get("budget"):
        b = s["budget"]
        measured = {"by": "search", **{k: s[k] for k in ("reached", "error", "error_static_plan", "held_out_error",
                                                         "margin", "evaluations") if k in s}, "verified": s.get("verified")}
    elif p.get("budget"):
        b = p["budget"]
        measured = {"by": "plan verification", "met": p.get("met"), "verified": p.get("verified")}
    else:
        return None, None
    return {"max_error": b["spec"], "metric": b["metric"], "allowed": b["allowed"]}, _finite(measured)


def plan_data(ctx) -> dict:
    """The plan file's JSON for the decisions in ctx (after run and, for the errors, verify)."""
    nodes = []
    for n, k in ctx.plan.keys.items():
        info = ctx.info.get(n)
        if not decided(info):
            continue
        low = n in ctx.lowered
        reason = None if low else (info.reason or "stays in its FP32 region (an FP32 operand, or no fp16 neighbour)")
        reason = reason if reason is None else reason[:MAX_TEXT]
        nodes.append({"graph": k.graph, "scope": k.scope, "op_type": k.op_type, "index": k.index, "name": k.name,
                      "precision": "low" if low else "fp32", "reason": reason})
    budget, measured = _measurements(ctx)
    from ..version import __version__
    return {"schema": SCHEMA, "version": VERSION, "graphmp_version": __version__, "onnx_version": onnx.__version__,
            "source": os.path.basename(ctx.path), "source_sha256": ctx.plan.structure, "target": ctx.options.target,
            "budget": budget, "measured": measured, "nodes": nodes}


def save(ctx) -> PassResult:
    """--save-plan: the plan file, atomically; never one of the inputs."""
    path = ctx.options.save_plan
    if not path or ctx.plan is None:
        return PassResult(changed=False)
    from ..model_io import model_inputs
    from ..paths import refuse_clobber
    from ..save import write_json
    opts = ctx.options
    inputs = model_inputs("the model", ctx.path) if os.path.isfile(ctx.path) else []
    if opts.plan is not None and opts.plan.path != "<plan>":
        inputs.append(("the --plan file", opts.plan.path))
    cal = opts.calibration if isinstance(opts.calibration, (list, tuple)) else [opts.calibration]
    inputs += [("a --calibration file", c) for c in cal
               if isinstance(c, (str, os.PathLike)) and c not in ("auto", "off")]
    refuse_clobber([("--save-plan", path), ("the output", ctx.report.get("output"))], inputs)
    data = plan_data(ctx)
    write_json(path, data, in_place_ok=True)
    return PassResult(changed=False, details={"saved": os.fspath(path), "saved_nodes": len(data["nodes"])})


def summary_line(d: dict) -> str:
    """The plan line(s) of convert's summary (--plan applied, --save-plan written)."""
    saved = f"  plan saved: {d['saved']} ({d['saved_nodes']} nodes)" if "saved" in d else ""
    if "file" not in d:
        return saved
    parts = [f"{d['matched']} nodes matched" + (f" ({d['matched_by_position']} by op type and position)"
                                                if d["matched_by_position"] else ""),
             f"{d['changed']} changed from the static rules"]
    for key, what in (("overruled", "overruled (see warnings)"), ("unmatched_nodes", "not in the plan"),
                      ("unmatched_entries", "entries matched nothing")):
        if d[key]:
            parts.append(f"{len(d[key])} {what}")
    if not d["same_structure"]:
        parts.append("the plan's source had another graph structure")
    line = f"  plan {os.path.basename(d['file'])}: " + ", ".join(parts)
    if "met" in d:
        b, v = d["budget"], d["verified"]
        line += (f"; budget ({b['metric']} <= {b['spec']}, from {d['budget_from']}): "
                 f"{'met' if d['met'] else 'NOT met'}, error {v['normalized']:.3g} x budget on {v['batches']} "
                 f"batch{'es' if v['batches'] > 1 else ''} (FP16-faithful)")
    else:
        line += "; not verified (no calibration batches)"
    return line + ("\n" + saved if saved else "")

"""classify: for every node, its op class and whether it may run in low precision.

Needs: ctx.types (types pass), ctx.ranges (calibrate; may be empty), the options.
Guarantees: ctx.info[node] for every node (graphmp.ir.Node) of every graph: the op class, the input
and output positions that would take the low type, and the reason it must stay FP32
(None when it may be lowered).

A node may be lowered only where the schema at the model's opset allows the target
type for every float type variable that gets retyped; a custom/unknown op, one with no
low-precision form at this opset, or one that touches a tensor whose type could not be
proven stays FP32 (_schema_info). A Cast (op class fixed) producing FP32 from integers
(shape arithmetic, element counts that can exceed 65504; not from BOOL/INT8/UINT8, whose
values FP16 holds exactly: apply casts those straight to FP16 where every reader wants
it) or from FP16 (a deliberate FP32 island in the source) stays FP32 (_source_cast).
Every other node goes through RULES, in this order; the first rule that gives a reason
keeps the node FP32 (tests/test_policy.py holds this list to RULES):
  1. [fp16-nodes] --fp16-nodes matches its name: forced low precision where the schema
     allows it (no later rule applies);
  2. [fp32-nodes] --fp32-nodes / --fp32-ops name it;
  3. [int8-qdq] it is INT8 work of a Q/DQ model: it reads a DequantizeLinear output or
     feeds a QuantizeLinear (TensorRT and ONNX Runtime fuse DQ -> op -> Q into INT8
     kernels; a Cast inside that unit would break the fusion and move quantization buckets);
  4. [unknown-op] its op is in none of graphmp's lists;
  5. [initializers] an initializer it reads would change meaning in the target type
     (beyond the range, or a small constant that rounds to zero where that matters: the
     flushed value is at least 2^-11 of the scale it meets, its own max |x| and, when
     added, the calibrated max |x| of the other operand; or the sum reaches a divisor,
     Sqrt, Log or a comparison, where an epsilon guards against 0);
  6. [range] calibration saw a value above the range threshold on one of its float
     tensors (--range-threshold, else 512 where the value reaches a subtraction or
     normalisation through follow/clear nodes, where FP16 rounding cancels, and 4094
     elsewhere: 16x headroom below FP16's max; the report names the data that decided it)
     (with --max-error it is only a candidate, ctx.range_candidates, and the search
     decides by the measured error: up to GIVE_BACK_RANGE the node starts in FP16, beyond
     it (ctx.wide_range) in FP32, and goes to FP16 only where the measured error, with
     FP16 overflow as inf, allows);
  7. [op-class] its op class is fp32 (reductions, Softmax, normalisations, Exp/Log, ...);
     the ops --norm-io names (default softmax: Softmax, LogSoftmax; all: LayerNormalization
     too) get the class "norm" instead: paint lowers them only where both their input and
     their output are low-precision work (their kernels accumulate in FP32,
     policy.NORM_IO); a Pow by a positive scalar constant whose output range calibration
     measured and no sum reduction reads (GELU's x^3) is elementwise math: class follow;
  8. [summed-square] it squares a tensor (Mul(x, x)) whose squares are summed
     (ReduceSum/ReduceMean, through data movement), as Pow already is by its class: a
     variance taken as E[x^2] - E[x]^2 (Flax's LayerNorm, exported by jax2tf) cancels
     everything but the FP16 rounding of the squares (magika's file-type model: 0.2
     relative error, the wrong class);
  9. [recurrence] it is elementwise math (follow class) on the way from a loop-carried
     float state of a Loop/Scan body to that state's next value: the recurrence (a
     hand-written GRU cell, an attention decoder's hidden state) is rounded again at every
     iteration, and the error compounds (PaddleOCR's SLANet table decoder, 500 iterations:
     box error 0.027 -> 0.001). Its MatMuls stay FP16: Tensor Core work, rounded once per use.
 10. [ort-crash] it is a pattern ONNX Runtime cannot open in FP16 (passes/ort_crash.py: a
     Transpose that moves the batch axis into a MatMul with a constant weight, which
     torch's batch_first attention exports, crashes its CPU session at default options).
 11. [mask-sentinel] it carries a constant beyond the low type's max (finfo(float32).min in
     `(1 - mask) * min`) into a Softmax through elementwise/data-movement nodes: in FP16 the
     constant is -inf and a fully masked row becomes NaN (passes/value_rules.py);
 12. [periodic] it is a Sin/Cos whose argument calibration saw at |x| >= 8, where FP16's
     spacing is >= 2^-10 of the period, or work that computes that argument (value_rules);
 13. [rounded] it computes a value that is rounded to an integer (Round/Floor/Ceil, a Cast
     to an integer type: durations, lengths, indices), where FP16 error moves values across
     a rounding boundary (value_rules).
"""
from __future__ import annotations

import re

import numpy as np

from onnx import TensorProto

from .. import policy
from ..context import FLOAT, NodeInfo
from ..model_io import tensor_array
from ..weight_rounding import weight_facts
from . import PassResult, ort_crash, value_rules

FP16_MAX = 65504.0
FP16_TINY = 2.0 ** -24          # smallest FP16 subnormal: below half of it rounds to 0
BF16_MAX = 3.3895e38
SMALL_CONST = 64                # initializers this small are constants (eps, scales, masks)
# With --max-error, rule 6 is a guess the search can test: a node it would keep FP32 starts
# in FP16 when calibration's widest |x| leaves 16x headroom below FP16's max, and stays
# there only where the measured error allows (passes/search.py, "given back"); a wider one
# starts in FP32 and is given back only where measured in FP16 within the budget (a value
# past FP16's max is inf there, so a node that overflows on the batches stays FP32).
GIVE_BACK_RANGE = FP16_MAX / 16


def _raised(schema, n, ins, outs, var_types) -> NodeInfo | None:
    """--fp32-nodes on a node of an FP16/BF16 source: the positions it reads and writes
    in FP32 (Casts around it), where the schema allows FLOAT."""
    up = {v for v, ts in var_types.items()
          if ts <= {TensorProto.FLOAT16, TensorProto.BFLOAT16} and policy.allows(schema, v, FLOAT)}
    if not up:
        return None
    return NodeInfo(cls="fp32", reason="user: --fp32-nodes (computed in FP32 in an FP16 model)",
                    high_inputs=tuple(i for i, ts in enumerate(ins) if ts in up and n.inputs[i]),
                    high_outputs=tuple(i for i, ts in enumerate(outs) if ts in up and n.outputs[i]))


def _schema_info(ctx, g, n, cls, raise_to_fp32=False) -> NodeInfo:
    low = ctx.low
    if cls == "fixed" or n.domain not in ("", "ai.onnx", policy.MS_DOMAIN):  # contrib ops: ORT's schemas (policy.py)
        return NodeInfo(cls=cls)
    schema = policy.get_schema(n.op_type, n.domain, ctx.opsets.get("", 1))
    types_in = [ctx.type_of(g, x) if x else 0 for x in n.inputs]
    types_out = [ctx.type_of(g, x) if x else 0 for x in n.outputs]
    if schema is None:
        return NodeInfo(cls="unknown")
    ins, outs = policy.bindings(schema, len(n.inputs), len(n.outputs))
    var_types: dict = {}
    for ts, t in zip(ins + outs, types_in + types_out):
        if ts is not None and t != 0 and ts not in policy.STR_TYPE:
            var_types.setdefault(ts, set()).add(t)
    if not any(FLOAT in v for v in var_types.values()):
        raised = _raised(schema, n, ins, outs, var_types) if raise_to_fp32 else None
        if raised is not None:
            return raised
        if any(None in v for v in var_types.values()) and any(t == FLOAT for t in types_in):
            return NodeInfo(cls=cls, reason="type of an output could not be proven (shape inference incomplete)")
        return NodeInfo(cls="none")
    keep_vars = {ins[i] for i in policy.KEEP_INPUTS.get(n.op_type, ()) if i < len(ins)}
    keep_vars -= {ins[0]} | set(outs)
    retype = set()
    for v, ts in var_types.items():
        if None in ts:
            return NodeInfo(cls=cls, reason="touches a tensor whose type could not be proven")
        if ts == {FLOAT} and v not in keep_vars and policy.allows(schema, v, low):
            retype.add(v)
    if not retype:
        return NodeInfo(cls=cls, reason=f"no {ctx.options.target.upper()} form of {n.op_type} at opset "
                                        f"{schema.since_version}")
    return NodeInfo(cls=cls,
                    low_inputs=tuple(i for i, ts in enumerate(ins) if ts in retype and n.inputs[i]),
                    low_outputs=tuple(i for i, ts in enumerate(outs) if ts in retype and n.outputs[i]))


class InitStats:
    """Range facts about float initializers, computed once per tensor, in the same pass
    as what FP16 rounding changes in it (kept in ctx.weight_rounding for apply's report,
    so the write only casts)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.cache = {}

    def get(self, g, name):
        owner = g.owner_of(name)
        if owner is None or name not in owner.initializers:
            return None
        key = (owner.key, name)
        if key not in self.cache:
            t = owner.initializers[name]
            if t.data_type != TensorProto.FLOAT:
                self.cache[key] = None
            else:
                a = tensor_array(t, self.ctx.base_dir)
                f = weight_facts(a, FP16_TINY / 2, fp16=self.ctx.low == TensorProto.FLOAT16)
                if self.ctx.low == TensorProto.FLOAT16:
                    self.ctx.weight_rounding[key] = f["rounding"]
                flushed = 0.0  # the largest |x| FP16 rounds to 0 (small constants only: rule 5)
                if f["tiny"] and a.size <= SMALL_CONST:
                    ax = np.abs(a.astype(np.float64).ravel())
                    flushed = float(ax[(ax > 0) & (ax < FP16_TINY / 2)].max())
                self.cache[key] = (f["max_abs"], f["tiny"], int(a.size), flushed)
        return self.cache[key]


# Rule 5, small constants FP16 flushes to 0: what the constant is combined with decides
# whether the flush matters. Dropping a value matters when it is at least FP16's relative
# precision (2^-11) times the scale it meets: the constant's own largest |x| and, where it
# is added (positions below), the calibrated max |x| of what it is added to. An additive
# constant whose sum reaches an op that is singular or discontinuous at zero (a divisor,
# Sqrt, Log, a comparison: the epsilon guard, x / (|y| + eps)) is judged as before: any
# flushed value keeps the node FP32.
FP16_REL = 2.0 ** -11
# op -> {constant's input position: ("in", i) / ("out", i) tensors it is added to (None: all other inputs)}
ADDITIVE = {"Add": None, "Sub": None, "Sum": None,
            "Conv": {2: (("out", 0),)}, "ConvTranspose": {2: (("out", 0),)}, "Gemm": {2: (("out", 0),)},
            "BatchNormalization": {2: (("out", 0),), 3: (("in", 0),)}}
# (op, input position or None for any): the read is singular or discontinuous at 0
GUARDED = {("Div", 1), ("Reciprocal", None), ("Sqrt", None), ("Log", None), ("Pow", 0), ("Sign", None),
           ("Mod", 1), ("Greater", None), ("Less", None), ("GreaterOrEqual", None), ("LessOrEqual", None),
           ("Equal", None)}


def _partners(n, i):
    """Tensors the constant at input i of n is added to, or None when it is not added."""
    pos = ADDITIVE.get(n.op_type, False) if n.domain in ("", "ai.onnx") else False
    if pos is False:
        return None
    if pos is None:
        return [x for j, x in enumerate(n.inputs) if j != i and x]
    sel = pos.get(i)
    if sel is None:
        return None
    return [(n.inputs if side == "in" else n.outputs)[j] for side, j in sel
            if j < len(n.inputs if side == "in" else n.outputs)]


def _moves_data(c, t) -> bool:
    """c passes the value t unchanged but reshaped (PASS_THROUGH, through its first input)."""
    return c.op_type in PASS_THROUGH and bool(c.inputs) and c.inputs[0] == t


def _elementwise(c, t) -> bool:
    """c is follow or clear work: elementwise math or data movement."""
    return policy.op_class(c.op_type, c.domain) in ("follow", "clear")


def _readers(g, n, consumers, through=_moves_data, outputs=1, max_depth=None):
    """(tensor, reader) pairs of n's first `outputs` outputs (None: all) and of what the
    readers `through` accepts make of them, up to max_depth such steps (None: any). By
    default: whoever reads n's value, unchanged but reshaped."""
    users = consumers(g)
    todo, seen = [(o, 0) for o in n.outputs[:outputs] if o], set()
    while todo:
        t, depth = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        for c in users.get(t, ()):
            yield t, c
            if through(c, t) and (max_depth is None or depth < max_depth):
                todo.extend((o, depth + 1) for o in c.outputs if o)


def _reaches_guard(g, n, consumers) -> str | None:
    """The first op singular/discontinuous at 0 that n's output reaches through data
    movement (or a subgraph reading it: unknown use, counted), as 'Op name', else None."""
    for t, c in _readers(g, n, consumers):
        if t not in c.inputs:
            return f"subgraph of {c.op_type} '{c.name}'"
        if any(x == t and ((c.op_type, None) in GUARDED or (c.op_type, j) in GUARDED) for j, x in enumerate(c.inputs)):
            return f"{c.op_type} '{c.name}'"
    return None


def _flush_reason(ctx, g, n, i, s, stats, consumers) -> str | None:
    """Rule 5's reason for the small constant at input i of n whose values FP16 flushes to 0
    (s: its InitStats), or None when the flush is below FP16's rounding at the scale it meets."""
    maxabs, _, _, flushed = s
    name = n.inputs[i]
    head = f"initializer '{name}' holds {_fmt(flushed)}, which FP16 rounds to 0 (|x| < {_fmt(FP16_TINY / 2)})"
    partners = _partners(n, i)
    if partners is not None:
        guard = _reaches_guard(g, n, consumers)
        if guard:
            return f"{head}; the sum reaches {guard}, where a guard against 0 matters"
    scale, seen = maxabs, f"its own max |x| {_fmt(maxabs)}"
    for x in partners or ():
        owner = g.owner_of(x)
        r = (ctx.ranges or {}).get((owner.key if owner is not None else g.key, x))
        if r is None:
            ps = stats.get(g, x)
            r = ps[0] if ps else None
        if r is not None and r > scale:
            scale, seen = r, f"'{x}' (max |x| {_fmt(r)})"
    if flushed >= FP16_REL * scale:
        return f"{head}, significant beside {seen} (>= 2^-11 of it)"
    return None


def _fmt(x):
    return f"{x:.4g}"


QDQ_REASON = ("INT8 Q/DQ op: reads a DequantizeLinear output or feeds a QuantizeLinear (kept as the "
              "quantizer placed it: a Cast there would break the INT8 fusion)")


def _qdq_edges(g):
    """(DequantizeLinear outputs, QuantizeLinear data inputs) of graph g."""
    dq = {n.outputs[0] for n in g.nodes if n.op_type == "DequantizeLinear" and n.outputs}
    q = {n.inputs[0] for n in g.nodes if n.op_type == "QuantizeLinear" and n.inputs}
    return dq, q


SQUARE_REASON = ("square summed (Mul(x, x) -> ReduceSum/ReduceMean): a sum of squares, e.g. a variance "
                 "E[x^2] - E[x]^2, cancels to the low-precision rounding of the squares (FP32, as Pow)")
SUM_REDUCTIONS = frozenset({"ReduceSum", "ReduceMean"})
PASS_THROUGH = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Expand"})


class _PerGraph:
    """fn(g) computed once per graph (by key) on first use."""

    def __init__(self, fn):
        self.fn, self.cache = fn, {}

    def __call__(self, g):
        if g.key not in self.cache:
            self.cache[g.key] = self.fn(g)
        return self.cache[g.key]


def _summed_square(g, n, consumers) -> bool:
    """n is Mul(x, x) and its output reaches a sum reduction through data movement only."""
    if n.op_type != "Mul" or n.domain not in ("", "ai.onnx") or len(n.inputs) != 2 \
            or not n.inputs[0] or n.inputs[0] != n.inputs[1]:
        return False
    return any(c.op_type in SUM_REDUCTIONS for _, c in _readers(g, n, consumers))


def _bounded_power(ctx, g, n, consumers) -> bool:
    """Pow by a positive scalar constant (GELU's x^3, a square root) whose output range
    calibration measured, and rule 6 therefore cleared, and whose result no sum reduction
    reads (the variance of a decomposed LayerNorm stays FP32): elementwise math, rounded
    once like Mul, so it follows its neighbours instead of forming an FP32 island."""
    if n.op_type != "Pow" or n.domain not in ("", "ai.onnx") or len(n.inputs) != 2:
        return False
    owner = g.owner_of(n.inputs[1])
    if owner is None or n.inputs[1] not in owner.initializers:
        return False
    e = tensor_array(owner.initializers[n.inputs[1]], ctx.base_dir)
    if e.size != 1 or not float(e.ravel()[0]) > 0:
        return False
    out_owner = g.owner_of(n.outputs[0])
    if ctx.ranges.get((out_owner.key if out_owner is not None else g.key, n.outputs[0])) is None:
        return False
    return not any(c.op_type in SUM_REDUCTIONS for _, c in _readers(g, n, consumers))


RECURRENCE_REASON = ("recurrent state: elementwise math from a Loop/Scan body's carried float state to its next "
                     "value is rounded again at every iteration, so FP16 error compounds")


def _carried_pairs(g, opset: int) -> list[tuple[str, str]]:
    """(body input, body output) of each loop-carried state of g, when g is the body of a
    Loop (inputs: iter, cond, states...; outputs: cond, states..., scan outputs) or a Scan
    (inputs: states..., scan inputs; outputs: states..., scan outputs; the node's inputs
    are [sequence_lens,] states..., scan inputs, sequence_lens only at opset 8)."""
    owner = g.owner
    if owner is None or owner.domain not in ("", "ai.onnx"):
        return []
    if owner.op_type == "Loop":
        n = len(owner.inputs) - 2
        return list(zip(g.input_names[2:2 + n], g.output_names[1:1 + n]))
    if owner.op_type == "Scan":
        n = len(owner.inputs) - int(owner.attr("num_scan_inputs") or 0) - (opset < 9)
        return list(zip(g.input_names[:n], g.output_names[:n]))
    return []


def _recurrence_nodes(ctx, g, users: dict) -> set:
    """g's nodes on a path from a carried float state to its next value (users: g's
    consumers map)."""
    pairs = [(i, o) for i, o in _carried_pairs(g, ctx.opsets.get("", 1)) if ctx.type_of(g, i) == FLOAT]
    if not pairs:
        return set()
    producers = g.producers()
    out = set()
    for start, end in pairs:
        ahead, todo = set(), [start]          # tensors that depend on the state
        while todo:
            t = todo.pop()
            for c in users.get(t, ()):
                for o in c.outputs:
                    if o and o not in ahead:
                        ahead.add(o)
                        todo.append(o)
        back, todo = set(), [end]             # nodes the next state depends on, reached from it
        while todo:
            t = todo.pop()
            p = producers.get(t)
            if p is None or p in back or not any(o in ahead for o in p.outputs):
                continue
            back.add(p)
            todo.extend(i for i in p.inputs if i)
        out |= back
    return out


# Rule 6's thresholds when --range-threshold is not given. Large values lose nothing
# relative to themselves in FP16; they cost precision where an op subtracts them from
# something of the same size (a Sub, a normalisation's mean: x ~ 3000 with a spread of 10
# keeps 1.5 significant bits of the difference; a style-transfer net's InstanceNorms give
# 10x the error at 4094), and range where they come near FP16's max (overflow to inf).
# So: 512 on the way into a subtraction (the AutoCast-style threshold), elsewhere 16x
# headroom below FP16's max.
RANGE_CANCELS = 512.0
RANGE_HEADROOM = 16
SUBTRACTING = frozenset({"Sub", "ReduceMean", "InstanceNormalization", "LayerNormalization", "GroupNormalization",
                         "MeanVarianceNormalization"})
CANCEL_WALK = 8   # follow/clear steps searched from a node's outputs for a subtraction


def _reaches_subtraction(g, n, consumers) -> bool:
    """n's outputs reach a subtracting op (SUBTRACTING: Sub, a mean, a normalisation's
    data input) through at most CANCEL_WALK follow/clear nodes."""
    return any(c.op_type in SUBTRACTING and (c.op_type == "Sub" or c.inputs[0] == t)
               for t, c in _readers(g, n, consumers, through=_elementwise, outputs=None, max_depth=CANCEL_WALK))


def _range_threshold(ctx, g, n, consumers) -> float:
    """The |x| above which rule 6 keeps n FP32: --range-threshold when given, else
    RANGE_CANCELS on the way into a subtraction and FP16_MAX / RANGE_HEADROOM elsewhere."""
    if ctx.options.range_threshold is not None:
        return ctx.options.range_threshold
    return RANGE_CANCELS if _reaches_subtraction(g, n, consumers) else FP16_MAX / RANGE_HEADROOM


def _range_reason(ctx, g, n, consumers) -> tuple[str | None, float]:
    """(rule 6's reason or None, the widest |x| calibration saw on the node's float tensors)."""
    reason, widest = None, 0.0
    user = ctx.options.range_threshold
    limit = user  # auto: found on the first value above RANGE_CANCELS (the walk costs)
    for x in list(n.inputs) + list(n.outputs):
        owner = g.owner_of(x) if x else None
        r = ctx.ranges.get((owner.key if owner is not None else g.key, x))
        if r is None or ctx.type_of(g, x) != FLOAT:
            continue
        widest = max(widest, r)
        if limit is None and r > RANGE_CANCELS:
            limit = _range_threshold(ctx, g, n, consumers)
        if reason is None and limit is not None and r > limit:
            why = ("" if user is not None else
                   ", on the way into a subtraction" if limit == RANGE_CANCELS else
                   ", beyond FP16's max" if r > FP16_MAX else f", only {FP16_MAX / r:.1f}x below FP16's max")
            reason = f"range: |{x}| reached {_fmt(r)} in calibration (threshold {_fmt(limit)}{why})"
    return reason, widest


class _Rules:
    """What RULES share over one conversion: the options, compiled patterns, Q/DQ edges,
    initializer facts and per-graph consumer maps, each computed once."""

    def __init__(self, ctx):
        opt = self.opt = ctx.options
        self.ctx = ctx
        self.qdq = {g.key: _qdq_edges(g) for g in ctx.root.walk()}
        self.fp16_re = re.compile(opt.fp16_nodes) if opt.fp16_nodes else None
        self.fp32_re = re.compile(opt.fp32_nodes) if opt.fp32_nodes else None
        self.fp32_ops = set(opt.fp32_ops or ())
        self.stats = InitStats(ctx)
        self.consumers = _PerGraph(lambda g: g.consumers())
        self.producers = _PerGraph(lambda g: g.producers())
        self.recurrences = _PerGraph(lambda g: _recurrence_nodes(ctx, g, self.consumers(g)))
        self.lim = FP16_MAX if opt.target == "fp16" else BF16_MAX
        self.values = _PerGraph(self._value_reasons)

    def _value_reasons(self, g) -> dict:
        """{node: reason} of rules 11-13 for graph g (passes/value_rules.py)."""
        out = dict(value_rules.sentinel_reasons(self.ctx, g, self._big_constant))
        if self.ctx.ranges:
            for n, why in value_rules.periodic_reasons(self.ctx, g).items():
                out.setdefault(n, why)
        for n, why in value_rules.rounded_reasons(self.ctx, g).items():
            out.setdefault(n, why)
        return out

    def _big_constant(self, g, name):
        """max |x| of float initializer `name` when finite and beyond the low type's max, else None."""
        s = self.stats.get(g, name)
        return s[0] if s is not None and self.lim < s[0] < float("inf") else None


DECIDED = object()  # a rule's verdict that settles the node without an FP32 reason


def _forced_fp16(r: _Rules, g, n, info, cls):
    if r.fp16_re and r.fp16_re.search(n.name):
        info.cls = "fp16"
        return DECIDED
    return None


def _user_fp32(r: _Rules, g, n, info, cls):
    if r.fp32_re and r.fp32_re.search(n.name):
        return "user: --fp32-nodes"
    return "user: --fp32-ops" if n.op_type in r.fp32_ops else None


def _int8_qdq(r: _Rules, g, n, info, cls):
    dq_out, q_in = r.qdq[g.key]
    return QDQ_REASON if any(x in dq_out for x in n.inputs) or any(y in q_in for y in n.outputs) else None


def _unknown_op(r: _Rules, g, n, info, cls):
    return "op not in graphmp's FP16 lists (kept FP32 to be safe)" if cls == "unknown" else None


def _initializers(r: _Rules, g, n, info, cls):
    for i in info.low_inputs:
        s = r.stats.get(g, n.inputs[i])
        if s is None:
            continue
        maxabs, tiny, size, _ = s
        if maxabs > r.lim:
            return f"initializer '{n.inputs[i]}' holds {_fmt(maxabs)}, beyond the {r.opt.target.upper()} range"
        if r.opt.target == "fp16" and tiny and size <= SMALL_CONST:
            reason = _flush_reason(r.ctx, g, n, i, s, r.stats, r.consumers)
            if reason:
                return reason
    return None


def _range(r: _Rules, g, n, info, cls):
    if not r.ctx.ranges:
        return None
    reason, widest = _range_reason(r.ctx, g, n, r.consumers)
    if reason and r.opt.max_error is not None:
        r.ctx.range_candidates[n] = reason  # the search decides by the measured error
        if widest > GIVE_BACK_RANGE:
            r.ctx.wide_range.add(n)  # starts FP32; FP16 only where measured (overflow is inf there)
        return None
    return reason


def _op_class(r: _Rules, g, n, info, cls):
    if cls != "fp32":
        return None
    if policy.norm_io(n, r.opt.norm_io):
        info.cls = "norm"  # paint lowers it only between low-precision work
        return None
    if _bounded_power(r.ctx, g, n, r.consumers):
        info.cls = "follow"
        return None
    return f"{n.op_type} is range-sensitive (FP32 op class)"


def _summed_square_rule(r: _Rules, g, n, info, cls):
    return SQUARE_REASON if _summed_square(g, n, r.consumers) else None


def _recurrence(r: _Rules, g, n, info, cls):
    return RECURRENCE_REASON if cls == "follow" and n in r.recurrences(g) else None


def _ort_crash(r: _Rules, g, n, info, cls):
    return ort_crash.reason(g, n, r.consumers(g), r.producers(g)) if n.op_type == "Transpose" else None


def _value_rule(prefix: str):
    """Rule 11, 12 or 13: the reason value_rules gave n, when it starts with `prefix`."""
    def rule(r: _Rules, g, n, info, cls):
        why = r.values(g).get(n)
        return why if why and why.startswith(prefix) else None
    return rule


# the rules of the module docstring, in its order: (name, rule(rules, graph, node, info, op
# class) -> an FP32 reason, None (no verdict: the next rule), or DECIDED (no more rules))
RULES = [("fp16-nodes", _forced_fp16), ("fp32-nodes", _user_fp32), ("int8-qdq", _int8_qdq),
         ("unknown-op", _unknown_op), ("initializers", _initializers), ("range", _range),
         ("op-class", _op_class), ("summed-square", _summed_square_rule), ("recurrence", _recurrence),
         ("ort-crash", _ort_crash), ("mask-sentinel", _value_rule("mask sentinel")),
         ("periodic", _value_rule("periodic")), ("rounded", _value_rule("rounded"))]


def _source_cast(ctx, g, n, info) -> None:
    """A Cast to FLOAT from FP16/BF16 (a deliberate island) or from integers FP16 may not
    hold stays FP32; other fixed-class nodes are left as the source has them."""
    if n.op_type != "Cast" or n.attr("to") != FLOAT:
        return
    src = ctx.type_of(g, n.inputs[0])
    if src in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
        info.cls, info.reason = "fp32", "deliberate FP32 island in the source (Cast from FP16)"
    elif src not in (FLOAT, TensorProto.DOUBLE, *policy.EXACT_IN_LOW):
        info.cls, info.reason = "fp32", "integer-derived value (Cast to FLOAT from integers) may exceed the FP16 range"


def classify(ctx):
    rules = _Rules(ctx)
    for g, n in ctx.nodes():
        cls = policy.op_class(n.op_type, n.domain)
        info = _schema_info(ctx, g, n, cls, raise_to_fp32=bool(rules.fp32_re and rules.fp32_re.search(n.name)))
        ctx.info[n] = info
        if info.cls == "none":
            continue
        if cls == "fixed":
            _source_cast(ctx, g, n, info)
            continue
        if info.reason:  # infeasible: nothing can lower it
            continue
        for _, rule in RULES:
            verdict = rule(rules, g, n, info, cls)
            if verdict is DECIDED:
                break
            if verdict:
                info.reason, info.cls = verdict, "fp32"
                break


def run(ctx) -> PassResult:
    """Also says when a model has nothing to do (no FP32 work to lower and no FP16 node
    that --fp32-nodes raises: an FP16, BF16 or integer-only source): a warning, and the
    output computes as the source does."""
    classify(ctx)
    fp32 = sum(1 for i in ctx.info.values() if i.reason)
    raised = sum(1 for i in ctx.info.values() if i.high_inputs or i.high_outputs)
    if not raised and not any(t == FLOAT for d in ctx.types.values() for t in d.values()):
        ctx.warn("the model has no FP32 tensors, so there is nothing to convert (an FP16, BF16 or integer-only model); "
                 "the output computes as the source does"
                 + ("; --fp32-nodes matched no FP16 node" if ctx.options.fp32_nodes else "")
                 + " (to compute FP16 nodes in FP32, name them with --fp32-nodes REGEX)")
    return PassResult(changed=False, details={"nodes_that_must_stay_fp32": fp32, "nodes_raised_to_fp32": raised})

"""apply: rewrite the graph to the painted precision plan.

Needs: ctx.info (classify), ctx.lowered (paint), ctx.types, ctx.low_io (kv_cache).
Steps (apply(), in order; each function's docstring says what it needs and gives):
  1. _set_produced_types:   the type each lowered (or raised) node's outputs are produced
                            in; the main graph's float inputs of ctx.low_io;
  2. _collect_needs:        every (graph, consumer, slot, tensor, wanted type);
  3. _convert_initializers: float initializers wanted in the low type, converted in place
                            or as a second copy;
  4. _keep_output_types:    graph outputs keep their declared types, or the low type for
                            ctx.low_io's (a Cast back under the output's name);
  5. _rewire_consumers:     source Casts from exact types straight to the low type; then
                            every consumer reads its wanted type;
  6. _retype_value_info:    value_info follows the new types.
Guarantees:
- a lowered node reads its retyped inputs in the target type and produces its retyped
  outputs in it; every other node reads exactly the types it read in the source, so
  its attributes (Cast `to`, dtype, ConstantOfShape value) stay consistent;
- one Cast per (tensor, type), shared by all consumers, placed in the graph that owns
  the tensor (subgraphs read it by outer-scope capture);
- a consumer that needs the FP32 value of a tensor whose producer is FP32 reads it
  directly (no FP16 round trip); a Cast(FP16->FP32) in the source followed by a need
  for FP16 reads the FP16 value itself;
- a source Cast to FP32 from a type the low type holds exactly (BOOL, INT8, UINT8: a
  one-hot or mask) whose every reader wants the low type casts to it directly (one Cast
  that writes 2 bytes per element instead of two that move 4 + 4 + 2);
- float initializers read in low precision are converted offline: in place when every
  consumer wants the low type, else as a second copy; external tensors are converted
  while streaming the output (save.save_model);
- graph inputs/outputs keep their declared types (always for subgraphs), except the
  main graph's ctx.low_io (without keep_io_types every float one; with --cache-io the
  KV cache's), declared in the low type; an output also read inside the graph serves
  each reader its type.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from .. import policy
from ..context import FLOAT
from ..model_io import CONVERT_MARK, is_external, tensor_array
from ..weight_rounding import from_bf16_bits, to_bf16_bits, to_fp16, to_fp16_noting
from . import PassResult
SUFFIX = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16", TensorProto.FLOAT: "fp32"}


_UNKNOWN = object()  # no facts from classify for this weight
BLOCK = 1 << 18  # elements per block of the BF16 path: its temporaries stay in cache


def _bf16_block(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(BF16 bits, their float32 value) of a float32 block, rounded to nearest even."""
    y = to_bf16_bits(x)
    return y, from_bf16_bits(y)


def convert_noting(arr: np.ndarray, low: int) -> tuple[memoryview, dict | None]:
    """(raw bytes in the low type (a byte view, no copy), what rounding changed or None
    when nothing did): elements changed, the largest absolute and relative change among
    finite values, nonzero values flushed to zero, finite values that overflowed to inf.

    FP16 goes through ONNX Runtime (graphmp.weight_rounding: 10x numpy's speed, same rounding);
    BF16 through numpy, blockwise, so its temporaries are block-sized."""
    if low == TensorProto.FLOAT16:
        out, facts = to_fp16_noting(arr)
        return memoryview(out).cast("B"), ({"elements": int(out.size), **facts} if facts["changed"] else None)
    a = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
    out = np.empty(a.size, dtype=np.uint16)
    changed = flushed = overflowed = 0
    max_abs = max_rel = 0.0
    for i in range(0, a.size, BLOCK):
        x = a[i:i + BLOCK]
        y, back = _bf16_block(x)
        out[i:i + BLOCK] = y
        n = x.size - int(np.count_nonzero(back == x))
        if not n:
            continue
        changed += n
        ax = np.abs(x)
        d = np.abs(back - x)               # NaN where x is not finite: fmax skips it
        if np.isinf(back).any():
            over = np.isinf(back) & np.isfinite(x)
            overflowed += int(np.count_nonzero(over))
            d[over] = np.inf
        max_abs = max(max_abs, float(np.fmax.reduce(d)))
        max_rel = max(max_rel, float(np.fmax.reduce(d / np.maximum(ax, 1e-30))))
        flushed += int(np.count_nonzero((back == 0) & (ax > 0)))
    if not changed:
        return memoryview(out).cast("B"), None
    return memoryview(out).cast("B"), {"elements": int(a.size), "changed": changed, "max_abs_change": max_abs,
                                       "max_rel_change": max_rel, "flushed_to_zero": flushed,
                                       "overflowed": overflowed}


def to_low(arr: np.ndarray, low: int, name=None):
    """(elem_type, raw bytes) of a float32 array in the low type (round to nearest even),
    without the rounding facts (FP16: one ONNX Runtime Cast)."""
    if low == TensorProto.FLOAT16:
        return low, memoryview(to_fp16(arr)).cast("B")
    return low, convert_noting(arr, low)[0]


class LowConverter:
    """The convert_fn of save.save_model / io.materialize for conversions the apply pass
    deferred to the write: converts, and fills the tensor's entry of the rounding report
    when it is marked "deferred" (facts that classify did not compute already)."""

    def __init__(self, rounding: list):
        self.rounding = rounding
        self.pending = {e["initializer"]: e for e in rounding if e.get("deferred")}

    def __call__(self, arr: np.ndarray, low: int, name=None):
        entry = self.pending.pop(name, None)
        if entry is None:  # facts already in the report (classify), or none wanted
            return to_low(arr, low)
        raw, facts = convert_noting(arr, low)
        i = self.rounding.index(entry)
        if facts is None:
            del self.rounding[i]
        else:
            self.rounding[i] = {"initializer": name, **facts}
        return low, raw


class Rewriter:
    def __init__(self, ctx):
        self.ctx = ctx
        self.low = ctx.low
        self.produced = {}   # (owner key, name) -> elem type after rewriting
        self.current = {}    # (owner key, name) -> name holding the produced value
        self.cache = {}      # (owner key, name, type) -> name holding that variant
        self.casts_added = 0
        self.rounding = []
        self.twice = []      # initializers stored in both types
        self.prods = {g.key: g.producers() for g in ctx.root.walk()}

    # --- types ----------------------------------------------------------------
    def ptype(self, owner, name):
        return self.produced.get((owner.key, name), self.ctx.types.get(owner.key, {}).get(name))

    # --- resolve a (tensor, type) need ------------------------------------------
    def get(self, g, name, want):
        owner = g.owner_of(name)
        if owner is None or want is None:
            return name
        key = (owner.key, name)
        cur = self.ptype(owner, name)
        cur_name = self.current.get(key, name)
        if cur == want or cur is None:
            return cur_name
        if (owner.key, name, want) in self.cache:
            return self.cache[(owner.key, name, want)]
        p = self.prods[owner.key].get(name)
        if p is not None and p.op_type == "Cast" and cur == FLOAT and want in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
            src = p.inputs[0]
            src_owner = owner.owner_of(src)
            if src_owner is not None and self.ptype(src_owner, src) == want:
                out = self.current.get((src_owner.key, src), src)
                self.cache[(owner.key, name, want)] = out
                return out
        out = self.ctx.names.fresh(f"{cur_name}_{SUFFIX.get(want, want)}")
        node = helper.make_node("Cast", [cur_name], [out], to=want,
                                name=self.ctx.names.fresh(f"graphmp_cast_{out}"))
        self._insert(owner, node, after=p)
        self.casts_added += 1
        self.cache[(owner.key, name, want)] = out
        return out

    def _insert(self, owner, node_proto, after):
        from ..ir import Node
        order = after.order + 0.5 if after is not None else -1.0
        owner.nodes.append(Node(node_proto, owner, order))
        owner.invalidate()

    # --- initializers -------------------------------------------------------------
    def convert_initializer(self, owner, t: TensorProto, new_name: str | None):
        """Convert `t` (or a copy named new_name) to the low type, offline."""
        ctx = self.ctx
        if new_name is not None:
            dst = owner.proto.initializer.add()
            dst.CopyFrom(t)
            dst.name = new_name
            owner.initializers[new_name] = dst
            owner.invalidate()
        else:
            dst = t
        elements = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
        known = ctx.weight_rounding.get((owner.key, t.name), _UNKNOWN)  # classify's pass over the weight
        if known is not _UNKNOWN and known is not None:
            self.rounding.append({"initializer": dst.name, "elements": elements, **known})
        if is_external(t):
            dst.doc_string = CONVERT_MARK + str(self.low)  # save.save_model converts it while streaming
            if known is _UNKNOWN:
                self.rounding.append({"initializer": dst.name, "deferred": True, "elements": elements})
            return dst.name
        arr = tensor_array(t, ctx.base_dir)
        if known is _UNKNOWN:
            raw, facts = convert_noting(arr, self.low)
            if facts is not None:
                self.rounding.append({"initializer": dst.name, **facts})
        else:
            raw = to_low(arr, self.low)[1]
        for f in ("float_data", "raw_data", "double_data"):
            dst.ClearField(f)
        dst.data_type = self.low
        dst.raw_data = bytes(raw)
        return dst.name


def _retarget_exact_casts(ctx, rw, graphs, needs):
    """Cast(to=FLOAT) from BOOL/INT8/UINT8 whose every reader wants the low type (and that
    is no graph output) casts to the low type itself: the values are the same, the FP32
    copy and the Cast after it disappear."""
    wants = {}
    for g, n, i, x, want in needs:
        wants.setdefault((g.owner_of(x).key if g.owner_of(x) is not None else g.key, x), set()).add(want)
    for g in graphs:
        for n in g.nodes:
            if n.op_type != "Cast" or n.attr("to") != FLOAT or not n.outputs or n.outputs[0] in g.output_names:
                continue
            y = n.outputs[0]
            if ctx.type_of(g, n.inputs[0]) in policy.EXACT_IN_LOW and wants.get((g.key, y)) == {ctx.low}:
                for a in n.proto.attribute:
                    if a.name == "to":
                        a.i = ctx.low
                rw.produced[(g.key, y)] = ctx.low


def apply(ctx):
    """Rewrite the graph to the painted plan: the steps of the module docstring, in order.
    Returns the Rewriter (casts_added, rounding)."""
    rw = Rewriter(ctx)
    graphs = list(ctx.root.walk())
    _set_produced_types(ctx, rw, graphs)           # 1.
    needs = _collect_needs(ctx, graphs)            # 2.
    _convert_initializers(ctx, rw, needs)          # 3.
    _keep_output_types(ctx, rw, graphs)            # 4.
    _rewire_consumers(ctx, rw, graphs, needs)      # 5.
    _retype_value_info(rw, graphs)                 # 6.
    return rw


def _set_produced_types(ctx, rw, graphs):
    """1. Needs ctx.info, ctx.lowered, ctx.types, ctx.low_io. Gives rw.produced: the low
    type for the low outputs of lowered nodes, FLOAT for every node's high outputs; the
    low type for the main graph's inputs in ctx.low_io["inputs"], whose declared type it
    changes to the low type."""
    low = ctx.low
    for g in graphs:
        for n in g.nodes:
            info = ctx.info[n]
            if n in ctx.lowered:
                for i in info.low_outputs:
                    rw.produced[(g.key, n.outputs[i])] = low
            for i in info.high_outputs:
                rw.produced[(g.key, n.outputs[i])] = FLOAT
    for v in ctx.root.proto.input:
        if v.name in ctx.low_io["inputs"]:
            rw.produced[("main", v.name)] = low
            v.type.tensor_type.elem_type = low


def _collect_needs(ctx, graphs) -> list:
    """2. Needs ctx.info, ctx.lowered, ctx.types. Gives every need, in graph and node order:
    (graph, consumer node, input slot, tensor, wanted type): the low type for a lowered
    node's low inputs, FLOAT for high inputs, else the type the source reads."""
    low = ctx.low
    needs = []
    for g in graphs:
        for n in g.nodes:
            lowered = n in ctx.lowered
            low_in = set(ctx.info[n].low_inputs) if lowered else set()
            high_in = set(ctx.info[n].high_inputs)
            for i, x in enumerate(n.inputs):
                if not x:
                    continue
                want = low if i in low_in else FLOAT if i in high_in else ctx.type_of(g, x)
                needs.append((g, n, i, x, want))
    return needs


def _convert_initializers(ctx, rw, needs):
    """3. Needs the needs (step 2) and ctx.weight_rounding. Gives float initializers wanted
    in the low type converted offline: in place (rw.produced) when every reader wants the
    low type and it is no graph output, else as a second copy (rw.cache, rw.twice, and a
    warning naming the extra bytes); their rounding facts in rw.rounding."""
    low = ctx.low
    init_wants = {}
    for g, n, i, x, want in needs:
        owner = g.owner_of(x)
        if owner is not None and x in owner.initializers:
            init_wants.setdefault((owner.key, x), (owner, set()))[1].add(want)
    for (okey, x), (owner, wants) in init_wants.items():
        t = owner.initializers[x]
        if low not in wants or t.data_type != FLOAT:
            continue
        outward = x in owner.output_names
        if wants == {low} and not outward:
            rw.convert_initializer(owner, t, None)
            rw.produced[(okey, x)] = low
        else:
            name = rw.convert_initializer(owner, t, ctx.names.fresh(f"{x}_{SUFFIX[low]}"))
            rw.cache[(okey, x, low)] = name
            rw.twice.append(x)
    if rw.twice:
        _warn_twice(ctx, rw, init_wants)


def _warn_twice(ctx, rw, init_wants):
    """The warning for weights stored in both types: how many, the extra bytes, an example."""
    from ..model_io import tensor_nbytes
    extra = sum(tensor_nbytes(owner.initializers[x]) // 2 for (_, x), (owner, _) in init_wants.items()
                if x in rw.twice)
    ctx.warn(f"{len(rw.twice)} weight(s) are read in FP32 by some nodes and in the low type by others, so both "
             f"copies are stored (+{extra / 1e6:.2f} MB; e.g. '{rw.twice[0]}'); --fp32-nodes or --fp16-nodes on "
             "their readers keeps one")


def _keep_output_types(ctx, rw, graphs):
    """4. Needs rw.produced (steps 1 and 3), ctx.types, ctx.low_io. Gives graph outputs in
    their declared types (the main graph's outputs in ctx.low_io["outputs"] are declared in
    the low type): a producer of another type is renamed and a Cast back
    writes the output's name (rw.current, rw.cache); a subgraph output naming an
    outer-scope value names the variant of the declared type."""
    low = ctx.low
    for g in graphs:
        for v in g.proto.output:
            y = v.name
            declared = ctx.types[g.key].get(y)
            if g is ctx.root and y in ctx.low_io["outputs"]:
                declared = low  # declared in the low type, a Cast at the boundary where produced FP32
                v.type.tensor_type.elem_type = low
            cur = rw.ptype(g, y)
            if cur == declared or declared is None:
                continue
            p = rw.prods[g.key].get(y)
            if p is None:  # a subgraph output naming an outer-scope value
                if g is not ctx.root:
                    v.name = rw.get(g, y, declared)
                continue
            new = ctx.names.fresh(f"{y}_{SUFFIX.get(cur, cur)}")
            for j, o in enumerate(p.outputs):
                if o == y:
                    p.proto.output[j] = new
            rw.current[(g.key, y)] = new
            rw.prods[g.key][new] = p
            node = helper.make_node("Cast", [new], [y], to=declared, name=ctx.names.fresh(f"graphmp_cast_{y}"))
            rw._insert(g, node, after=p)
            rw.casts_added += 1
            rw.cache[(g.key, y, declared)] = y


def _rewire_consumers(ctx, rw, graphs, needs):
    """5. Needs the needs (step 2) and rw (steps 1, 3, 4). Gives source Casts from exact
    types retargeted to the low type (_retarget_exact_casts), then every consumer input
    reading its wanted type (Rewriter.get: one shared Cast per (tensor, type))."""
    _retarget_exact_casts(ctx, rw, graphs, needs)
    for g, n, i, x, want in needs:
        n.proto.input[i] = rw.get(g, x, want)


def _retype_value_info(rw, graphs):
    """6. Needs rw.produced. Gives value_info entries (other than graph outputs) in the
    types their tensors are now produced in."""
    for g in graphs:
        for v in g.proto.value_info:
            if v.name in g.output_names:
                continue
            t = rw.produced.get((g.key, v.name))
            if t is not None and v.type.HasField("tensor_type"):
                v.type.tensor_type.elem_type = t


def run(ctx) -> PassResult:
    rw = apply(ctx)
    return PassResult(changed=True, details={"casts_added": rw.casts_added, "rounding": rw.rounding})

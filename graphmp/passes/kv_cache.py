"""kv_cache: find a decoder's KV cache by structure, and decide the types of the model's
float inputs and outputs (the boundary).

A decoder exported with its cache (Hugging Face's `past_key_values` -> `present`, any
exporter) takes the cache of the previous step as graph inputs, appends the new keys
and values to it, and returns the longer cache as graph outputs, which the caller feeds
back as the next step's inputs. Found by structure, not by name: a cache input is a
float graph input whose values reach a float graph output of the same rank through
data movement only (Cast, Identity, Reshape, Transpose, Squeeze, Unsqueeze, Split,
Slice, Gather of its values, Concat) with at least one append on the way (a Concat, or a
ScatterND / ScatterElements into a fixed-size cache); those outputs are its cache outputs
(a stacked cache, [2, B, H, P, D] per layer as older GPT-2 exports have it, is found
through its Gathers and the Concat that stacks the halves again). Names do
not matter: `past_key_values.0.key`, `past_0` and `cache_in` are found alike; a
`pixel_values` input copied to an output without an append is not a cache.

The boundary: graph inputs and outputs keep their declared FP32 types by default
(options.keep_io_types); --no-keep-io-types declares every float input and output in
the low type. options.cache_io overrides that for the cache alone: "fp32" keeps it
FP32 whatever keep_io_types says, the target type ("fp16"/"bf16") declares it in the
low type (half the bytes the caller stores and moves per step, no Cast of the whole
cache on the way in and out); None: the cache follows keep_io_types.

Needs: ctx.root, ctx.types. Gives: ctx.low_io = {"inputs": set, "outputs": set}, the
main graph's float inputs and outputs declared in the low type (apply and islands read
it); report["kv_cache"]: the cache pairs found and the type of the cache's I/O.
"""
from __future__ import annotations

from ..context import FLOAT
from . import PassResult

# data movement a cache passes through on its way from input to output (values unchanged)
MOVES = {"Cast", "Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Split", "Slice", "Gather", "Concat",
         "ScatterND", "ScatterElements"}
APPENDS = {"Concat", "ScatterND", "ScatterElements"}  # where new keys/values join the cache
DATA_SLOT = {"ScatterND": 0, "ScatterElements": 0}     # the cache operand of a scatter (its updates are new)


def _rank(value_info) -> int | None:
    t = value_info.type.tensor_type
    return len(t.shape.dim) if t.HasField("shape") else None


def _reached_outputs(graph, start: str, outputs: set) -> set:
    """The graph outputs that `start`'s values reach through MOVES with an append on the
    way (a breadth-first walk over (tensor, appended so far) states)."""
    consumers = graph.consumers()
    seen, todo, found = set(), [(start, False)], set()
    while todo:
        t, appended = todo.pop()
        if (t, appended) in seen:
            continue
        seen.add((t, appended))
        if appended and t in outputs:
            found.add(t)
        for n in consumers.get(t, ()):
            if n.op_type not in MOVES or n.domain not in ("", "ai.onnx"):
                continue
            slots = [i for i, x in enumerate(n.inputs) if x == t]
            if n.op_type in DATA_SLOT and DATA_SLOT[n.op_type] not in slots:
                continue   # the new entries of a scatter, not the cache it writes into
            if n.op_type not in ("Concat",) + tuple(DATA_SLOT) and 0 not in slots:
                continue   # a shape, an axes or a starts operand: not the cache's values
            for y in n.outputs:
                if y:
                    todo.append((y, appended or n.op_type in APPENDS))
    return found


def find_cache(ctx) -> list:
    """[(input, [outputs])] of the main graph, in input order: each float graph input
    whose values reach float graph outputs of its rank through data movement with an
    append on the way (the module docstring)."""
    g = ctx.root
    types = ctx.types.get("main", {})
    outs = {v.name: _rank(v) for v in g.proto.output if types.get(v.name) == FLOAT}
    pairs = []
    for v in g.proto.input:
        if v.name in g.initializers or types.get(v.name) != FLOAT:
            continue
        rank = _rank(v)
        reached = sorted(o for o in _reached_outputs(g, v.name, set(outs)) if outs[o] == rank)
        if reached:
            pairs.append((v.name, reached))
    return pairs


def run(ctx) -> PassResult:
    """ctx.low_io from keep_io_types, the cache found and cache_io (module docstring)."""
    opts = ctx.options
    types = ctx.types.get("main", {})
    g = ctx.root
    low_in = {v.name for v in g.proto.input if not opts.keep_io_types and types.get(v.name) == FLOAT
              and v.name not in g.initializers}
    low_out = {v.name for v in g.proto.output if not opts.keep_io_types and types.get(v.name) == FLOAT}
    pairs = find_cache(ctx)
    cache_in = {x for x, _ in pairs}
    cache_out = {y for _, ys in pairs for y in ys}
    if opts.cache_io == "fp32":
        low_in, low_out = low_in - cache_in, low_out - cache_out
    elif opts.cache_io is not None:   # the target type (Options checks they agree)
        low_in, low_out = low_in | cache_in, low_out | cache_out
    ctx.low_io = {"inputs": low_in, "outputs": low_out}
    io = opts.target if pairs and cache_in <= low_in else "fp32"
    details = {}
    if pairs:
        details = {"pairs": [{"input": x, "outputs": ys} for x, ys in pairs], "io": io, "target": opts.target,
                   "decided_by": "--cache-io" if opts.cache_io is not None else "--keep-io-types"}
        ctx.log(f"KV cache: {len(pairs)} cache input(s) found by structure; cache I/O {io}")
    return PassResult(changed=False, details=details)


def summary_line(d: dict) -> str:
    """The summary's line for report["kv_cache"]."""
    first = d["pairs"][0]
    how = (f"declared FP32 at the boundary, Casts inside (--cache-io {d['target']}: half the bytes per step)"
           if d["io"] == "fp32" else f"declared {d['io'].upper()} at the boundary ("
           + ("--cache-io)" if d["decided_by"] == "--cache-io" else "--no-keep-io-types; --cache-io fp32 keeps it FP32)"))
    return (f"  KV cache: {len(d['pairs'])} cache input(s) found by structure (e.g. {first['input']} -> "
            f"{', '.join(first['outputs'])}); {how}")

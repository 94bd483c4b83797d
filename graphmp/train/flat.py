"""Flat state buffers of a training step: the packing table, and packing/unpacking of state.

A step graph built with flat state (train.json "flat") takes the weights, the optimizer's
moments, the accumulation window and the BatchNorm running statistics as a few 1-D FP32
buffers (FLAT_BUFFERS) instead of one input per tensor, so the update is a handful of nodes
over whole buffers and a step binds a handful of tensors. Inside the graph each tensor is a
view of its buffer (one Split, then a Reshape of each tensor that is not 1-D) under its own
name, so the forward and the backward are the same as with one input per tensor.

train.json keeps "state" as the logical, per-tensor state (state.npz and checkpoints hold
those arrays: eval, export, resume and older run folders read them unchanged) and adds:
    "flat": {"state":   [{"input", "output", "kind"}, ...]  the step graph's own state inputs
                                                            (the buffers, then the counters
                                                            and the scale, which stay scalars),
             "buffers": {buffer: [[tensor, offset, shape], ...]},  each tensor's place
             "grad":    the flat gradient, scaled by the loss scale (the data-parallel
                        split cuts there)
             "align":   the row length A (absent: 1, run folders built before it)}
A run folder without "flat" (built before flat state) runs with the per-tensor inputs.

Why rows: inside the graph a buffer is cut into its tensors (a Split) and the gradients are
joined into flat__grad (a Concat). ONNX Runtime's CUDA Split and Concat fill a host-side table
with one entry per element of the split/concatenated axis and copy it to the GPU on every run:
over a 1-D buffer of all the weights that was 230 ms (Split) + 295 ms (Concat) of a ResNet-50
step and 640 + 822 ms of a BERT-base step on an H200 (ORT 1.31.1). So a buffer is laid out
(rows_first, layout) as the tensors whose size is a multiple of A = ALIGN, each at a multiple
of A, then a tail: the other tensors one after another (biases, normalisation parameters:
small), padded with zeros to a whole row. Seen as [rows, A], the buffer is split along its
rows (A times shorter than the buffer), and only the tail is split along its elements. The
padding stays zero: its gradient is zero, so its moments and updates are too.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from ..errors import GraphmpError

FLAT = "flat"
WEIGHTS = "flat__weights"
BN_STATS = "flat__bn_stats"
GRAD = "flat__grad"
FLAT_BUFFERS = (WEIGHTS, "flat__momentum", "flat__exp_avg", "flat__exp_avg_sq", "flat__accum", BN_STATS)
ALIGN = 1024  # elements; see the module docstring
MAX_ALIGN = 1 << 20  # what check_flat accepts from a train.json


def graph_state(meta: dict) -> list:
    """The step graph's state entries ({"input", "output", "kind"}): the flat buffers and
    scalars of a flat run, or train.json "state" of an older one."""
    flat = meta.get("flat")
    return list(flat["state"]) if flat else list(meta["state"])


def graph_state_names(meta: dict) -> list:
    return [s["input"] for s in graph_state(meta)]


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def rows_first(members: list, align: int) -> list:
    """[(tensor, shape)] in the order a buffer lays them out: those whose size is a multiple of
    `align` first, then the others (each group in the given order)."""
    return sorted(members, key=lambda m: _size(m[1]) % align != 0)


def layout(members: list, align: int = 1) -> list:
    """[[tensor, offset, shape], ...] of tensors packed one after another from [(tensor, shape)]
    in the given order: one whose size is a multiple of `align` starts at a multiple of
    `align`, any other right after the tensor before it (align 1: no gaps at all)."""
    table, offset = [], 0
    for name, shape in members:
        if _size(shape) % align == 0:
            offset = _round_up(offset, align)
        table.append([name, offset, [int(d) for d in shape]])
        offset += _size(shape)
    return table


def buffer_size(table: list, align: int = 1) -> int:
    """The length of a buffer with this table: its last tensor's end, rounded up to `align`."""
    if not table:
        return 0
    _, offset, shape = table[-1]
    return _round_up(offset + _size(shape), align)


def align_of(meta: dict) -> int:
    """train.json "flat" "align" (1 for a run folder built before it)."""
    return int((meta.get("flat") or {}).get("align", 1))


def pack(meta: dict, state: dict, where: str = "the state") -> dict:
    """The step graph's state from the logical state (train.json "state" names: state.npz, a
    checkpoint): each buffer is its tensors' values, raveled and concatenated in table order
    (new arrays; `state` is not changed). A run without flat state: the same arrays. A tensor
    missing, or of another size than the table's, is one line naming it."""
    flat = meta.get("flat")
    names = [s["input"] for s in meta["state"]]
    missing = [n for n in names if n not in state]
    if missing:
        raise GraphmpError(f"{where}: the state file lacks {missing[:5]}; it does not belong to this step graph.")
    if not flat:
        return {n: state[n] for n in names}
    out, align = {}, align_of(meta)
    for s in flat["state"]:
        name = s["input"]
        table = flat["buffers"].get(name)
        if table is None:
            out[name] = state[name]
            continue
        buf = np.zeros(buffer_size(table, align), np.float32)  # the padding between tensors stays 0
        for tensor, offset, shape in table:
            a = np.asarray(state[tensor])
            if list(a.shape) != list(shape) or a.dtype != np.float32:
                raise GraphmpError(f"{where}: the state file's '{tensor}' is {a.dtype} {list(a.shape)}, the step "
                                   f"graph takes float32 {list(shape)}; it does not belong to this step graph.")
            buf[offset:offset + a.size] = a.ravel()
        out[name] = buf
    return out


def unpack(meta: dict, graph_values: dict) -> dict:
    """The logical state (train.json "state" names) from the step graph's state: each tensor a
    copy of its slice of its buffer, in its shape. A run without flat state: the same arrays."""
    flat = meta.get("flat")
    if not flat:
        return dict(graph_values)
    out = {}
    for s in flat["state"]:
        name = s["input"]
        table = flat["buffers"].get(name)
        if table is None:
            out[name] = graph_values[name]
            continue
        buf = np.asarray(graph_values[name])
        for tensor, offset, shape in table:
            size = int(np.prod(shape, dtype=np.int64))
            out[tensor] = np.array(buf[offset:offset + size].reshape(shape))
    return {s["input"]: out[s["input"]] for s in meta["state"]}


def check_flat(flat, bad) -> None:
    """train.json "flat" is what graphmp writes (else bad(key, what it should be) raises)."""
    if not isinstance(flat, dict):
        bad("flat", "an object")
    if not (isinstance(flat.get("state"), list)
            and all(isinstance(s, dict) and isinstance(s.get("input"), str) for s in flat["state"])):
        bad("flat", "an object whose 'state' is a list of {'input': name, ...} objects")
    buffers = flat.get("buffers")
    ok = isinstance(buffers, dict) and all(
        isinstance(k, str) and isinstance(v, list) and all(
            isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and type(e[1]) is int and e[1] >= 0
            and isinstance(e[2], list) and all(type(d) is int and d >= 0 for d in e[2]) for e in v)
        for k, v in buffers.items())
    if not ok or not isinstance(flat.get("grad"), str):
        bad("flat", "an object with 'buffers' {buffer: [[tensor, offset, shape], ...]} and 'grad'")
    align = flat.get("align", 1)
    if type(align) is not int or not 1 <= align <= MAX_ALIGN:
        bad("flat", f"an object whose 'align' is a whole number from 1 to {MAX_ALIGN}")
    for name, table in buffers.items():  # pack() and unpack() place each tensor at its offset
        if [e[1] for e in table] != [e[1] for e in layout([(e[0], e[2]) for e in table], align)]:
            bad("flat", f"a packing table whose offsets follow each other at multiples of {align} (buffer "
                f"'{name}' has gaps or overlaps)")


# --- in the step graph --------------------------------------------------------------------

def add_views(graph, buffer: str, table: list, prefix: str, align: int) -> None:
    """Makes each tensor of `table` (laid out at multiples of `align`) a view of the 1-D FP32
    graph input `buffer` (added; the tensors stop being graph inputs): split_views' nodes, put
    first in the graph so every reader comes after them."""
    names = {t for t, _, _ in table}
    kept = [v for v in graph.input if v.name not in names]
    del graph.input[:]
    graph.input.extend(kept)
    graph.input.append(helper.make_tensor_value_info(buffer, TensorProto.FLOAT, [buffer_size(table, align)]))
    nodes = split_views(graph, buffer, table, [t for t, _, _ in table], prefix, align)
    everything = nodes + list(graph.node)
    del graph.node[:]
    graph.node.extend(everything)


def _const(graph, name: str, values) -> str:
    graph.initializer.append(numpy_helper.from_array(np.array(values, np.int64), name))
    return name


def _parts(table: list, align: int) -> tuple:
    """(rows of each tensor of the row part, the tail's first table index, the tail's length) of
    a table laid out by layout(rows_first(...), align)."""
    k = next((i for i, (_, _, shape) in enumerate(table) if _size(shape) % align), len(table))
    if any(_size(shape) % align == 0 for _, _, shape in table[k:]):
        raise GraphmpError("internal error: a flat buffer's table does not put its whole rows first (flat.rows_first)")
    total = buffer_size(table, align)
    tail_start = table[k][1] if k < len(table) else total
    ends = [off for _, off, _ in table[1:k]] + [tail_start]
    return [(end - off) // align for (_, off, _), end in zip(table[:k], ends)], k, total - tail_start


def split_views(graph, flat: str, table: list, outs: list, prefix: str, align: int) -> list:
    """The nodes (not added to the graph) that give outs[i] = flat[offset:offset+size] shaped as
    table[i] (a table of layout(rows_first(...), align); constants as initializers of `graph`):
    the buffer seen as [rows, align] and split along its rows, each whole-row tensor a Reshape
    of its rows, and the tail (its last rows) raveled and split into its tensors and padding,
    with a Reshape for each of those that is not 1-D."""
    base = f"{prefix}/{flat}"
    rows_of, k, tail_len = _parts(table, align)
    tail = f"{base}/tail"
    row_pieces = [f"{base}/{o}" for o in outs[:k]] + ([tail] if tail_len else [])
    nodes = [helper.make_node("Reshape", [flat, _const(graph, f"{base}/rows_shape", [-1, align])], [f"{base}/rows"],
                              name=f"{base}/rows/Reshape"),
             helper.make_node("Split", [f"{base}/rows", _const(graph, f"{base}/sizes",
                                                                  rows_of + ([tail_len // align] if tail_len else []))],
                              row_pieces, name=f"{base}/Split", axis=0)]
    pieces = list(row_pieces[:k])
    if tail_len:
        sizes = [_size(shape) for _, _, shape in table[k:]]
        pad = [tail_len - sum(sizes)] if tail_len > sum(sizes) else []
        tail_pieces = [o if len(shape) == 1 else f"{base}/{o}" for o, (_, _, shape) in zip(outs[k:], table[k:])]
        nodes += [helper.make_node("Reshape", [tail, _const(graph, f"{tail}/shape", [-1])], [f"{tail}/line"],
                                   name=f"{tail}/Reshape"),
                  helper.make_node("Split", [f"{tail}/line", _const(graph, f"{tail}/sizes", sizes + pad)],
                                   tail_pieces + [f"{tail}/padding"] * len(pad), name=f"{tail}/Split", axis=0)]
        pieces += tail_pieces
    for piece, out, (_, _, shape) in zip(pieces, outs, table):
        if piece != out:
            nodes.append(helper.make_node("Reshape", [piece, _const(graph, f"{base}/{out}/shape", shape)], [out],
                                          name=f"{base}/{out}/Reshape"))
    return nodes


def flatten_concat(b, tensors: list, table: list, align: int, out: str | None = None) -> str:
    """One 1-D tensor laid out as `table` says (a table of layout(rows_first(...), align); b: a
    Builder; tensors[i] has table[i]'s shape): each whole-row tensor as [rows, align], the
    others raveled, concatenated with the zero padding and seen as rows, then one Concat of all
    rows, raveled."""
    rows_of, k, tail_len = _parts(table, align)
    rows_shape, minus_one = b.const([-1, align], np.int64), b.const([-1], np.int64)
    parts = [b.op("Reshape", [t, rows_shape]) for t in tensors[:k]]
    if tail_len:
        line = [t if len(shape) == 1 else b.op("Reshape", [t, minus_one]) for t, (_, _, shape) in
                zip(tensors[k:], table[k:])]
        pad = tail_len - sum(_size(shape) for _, _, shape in table[k:])
        if pad:
            line.append(b.const(np.zeros(pad, np.float32), np.float32))
        parts.append(b.op("Reshape", [b.op("Concat", line, axis=0), rows_shape]))
    rows = b.op("Concat", parts, axis=0)
    return b.op("Reshape", [rows, minus_one], out=out)


def next_state(meta: dict, outputs: dict) -> dict:
    """The logical state after a step from the step graph's outputs ({X__next: value} by
    name): what a caller running step.onnx itself (not through graphmp's StepRunner) keeps
    for the next run, per tensor; feed it again with pack(meta, state)."""
    return unpack(meta, {s["input"]: outputs[s["output"]] for s in graph_state(meta)})

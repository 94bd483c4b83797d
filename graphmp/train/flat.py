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
             "grad":    the flat unscaled gradient (the data-parallel split cuts there)}
A run folder without "flat" (built before flat state) runs with the per-tensor inputs.
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


def graph_state(meta: dict) -> list:
    """The step graph's state entries ({"input", "output", "kind"}): the flat buffers and
    scalars of a flat run, or train.json "state" of an older one."""
    flat = meta.get("flat")
    return list(flat["state"]) if flat else list(meta["state"])


def graph_state_names(meta: dict) -> list:
    return [s["input"] for s in graph_state(meta)]


def layout(members: list) -> list:
    """[[tensor, offset, shape], ...] of tensors packed one after another, from [(tensor, shape)]."""
    table, offset = [], 0
    for name, shape in members:
        table.append([name, offset, [int(d) for d in shape]])
        offset += int(np.prod(shape, dtype=np.int64))
    return table


def buffer_size(table: list) -> int:
    if not table:
        return 0
    _, offset, shape = table[-1]
    return offset + int(np.prod(shape, dtype=np.int64))


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
    out = {}
    for s in flat["state"]:
        name = s["input"]
        table = flat["buffers"].get(name)
        if table is None:
            out[name] = state[name]
            continue
        parts = []
        for tensor, _, shape in table:
            a = np.asarray(state[tensor])
            if list(a.shape) != list(shape) or a.dtype != np.float32:
                raise GraphmpError(f"{where}: the state file's '{tensor}' is {a.dtype} {list(a.shape)}, the step "
                                   f"graph takes float32 {list(shape)}; it does not belong to this step graph.")
            parts.append(a.ravel())
        out[name] = np.concatenate(parts) if parts else np.zeros(0, np.float32)
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
    for name, table in buffers.items():  # pack() concatenates in table order; unpack() reads the offsets
        if [e[1] for e in table] != [e[1] for e in layout([(e[0], e[2]) for e in table])]:
            bad("flat", f"a packing table whose offsets follow each other (buffer '{name}' has gaps or overlaps)")


# --- in the step graph --------------------------------------------------------------------

def add_views(graph, buffer: str, table: list, prefix: str) -> None:
    """Makes each tensor of `table` a view of the 1-D FP32 graph input `buffer` (added; the
    tensors stop being graph inputs): one Split into the tensors' sizes and a Reshape to each
    shape that is not 1-D (split_views), put first in the graph so every reader comes after
    them."""
    names = {t for t, _, _ in table}
    kept = [v for v in graph.input if v.name not in names]
    del graph.input[:]
    graph.input.extend(kept)
    graph.input.append(helper.make_tensor_value_info(buffer, TensorProto.FLOAT, [buffer_size(table)]))
    nodes = split_views(graph, buffer, table, [t for t, _, _ in table], prefix)
    everything = nodes + list(graph.node)
    del graph.node[:]
    graph.node.extend(everything)


def split_views(graph, flat: str, table: list, outs: list, prefix: str) -> list:
    """The nodes (not added to the graph) that give outs[i] = flat[offset:offset+size] shaped as
    table[i]: one Split (sizes as an initializer of `graph`), then a Reshape for each tensor
    that is not 1-D (a 1-D one is its Split output)."""
    sizes = [int(np.prod(shape, dtype=np.int64)) for _, _, shape in table]
    split = f"{prefix}/{flat}/sizes"
    graph.initializer.append(numpy_helper.from_array(np.array(sizes, np.int64), split))
    pieces = [out if len(shape) == 1 else f"{prefix}/{flat}/{out}" for out, (_, _, shape) in zip(outs, table)]
    nodes = [helper.make_node("Split", [flat, split], pieces, name=f"{prefix}/{flat}/Split", axis=0)]
    for piece, out, (_, _, shape) in zip(pieces, outs, table):
        if piece == out:
            continue
        dims = f"{prefix}/{flat}/{out}/shape"
        graph.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), dims))
        nodes.append(helper.make_node("Reshape", [piece, dims], [out], name=f"{prefix}/{flat}/{out}/Reshape"))
    return nodes


def flatten_concat(b, tensors: list, ranks: list, out: str | None = None) -> str:
    """One 1-D tensor: the tensors (of these ranks) raveled and concatenated in order (b: a
    Builder); a Reshape for each tensor that is not 1-D already."""
    minus_one = b.const([-1], np.int64) if any(rank != 1 for rank in ranks) else None  # no unused initializer
    parts = [t if rank == 1 else b.op("Reshape", [t, minus_one]) for t, rank in zip(tensors, ranks)]
    return b.op("Concat", parts, out=out, axis=0)


def next_state(meta: dict, outputs: dict) -> dict:
    """The logical state after a step from the step graph's outputs ({X__next: value} by
    name): what a caller running step.onnx itself (not through graphmp's StepRunner) keeps
    for the next run, per tensor; feed it again with pack(meta, state)."""
    return unpack(meta, {s["input"]: outputs[s["output"]] for s in graph_state(meta)})

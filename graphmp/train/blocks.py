"""The update's elementwise chain run in cache-sized blocks: a CPU session's lowering of a step graph.

The update phase of a step (update.py, optim.py) is a chain of ~13 elementwise nodes over the
flat buffers (the gated gradient, AdamW's m, v and w), each a pass over every weight: ResNet-18's
11.7M weights make each node read and write ~90 MB, so on the CPU the chain streams ~1.4 GB
through memory per step. Run instead over blocks of BLOCK elements, one block through the whole
chain before the next, the intermediates stay in the core's cache: on the 2-core AMD EPYC of the
CPU yardstick (1 MB L2 per core), 1 thread, the AdamW chain over 11.5M floats took 49.4 ms as
whole-buffer nodes and 33.8 ms as a Scan over blocks of 65536 (36.8 at 16384; the Scan costs ~6
us per block). In the whole step (benchmarks/train_cpu.py, 1 thread): ResNet-18 107.5 -> 95.0 ms,
ResNet-50 291.8 -> 264.0 ms.

block_update(model) finds that chain by phase and shape: the nodes named `update/...` (the
update phase) whose op is elementwise (ELEMENTWISE), whose output is the 1-D size N of the flat
weights, and whose every input is either of that size or a scalar. Each group of them that does
not wait on its own results through other nodes (the finite check reads the gradient, the gate
reads the check) becomes one Scan over the buffers seen as [N / C, C] rows, its body those nodes
per row (scalars read from the outer graph), its results reshaped back under their own names.
Every element goes through the same ops in the same order, so the results are the same bits.

Only for a CPU session: ONNX Runtime's CUDA Scan runs its body once per block from the host
(N / C times ~13 kernel launches) and cannot be captured in a CUDA graph, while the whole-buffer
chain is ~1.2 GB for ResNet-18, under a millisecond at an H100's 3 TB/s. step.onnx itself stays
in the whole-buffer form; the CPU's StepRunner and the data-parallel update half block it when
they make their session.
"""
from __future__ import annotations

import heapq
import os

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..ir import Names, attr_graphs
from ..session import CPU
from .flat import WEIGHTS, graph_state

BLOCK = 65536        # elements per block at most (256 KB of FP32: a few buffers fit a 1 MB L2)
MIN_BLOCK = 8192     # shorter blocks cost more in the Scan's per-block overhead than they save
# A block of many threads' shares stops here: the chain's ~6 live buffers of 4 MB stay within
# a server's L3 (the threads of a node share a block, and the next node's split of it between
# them need not give a thread the part it wrote). Not measured beyond 2 threads.
MAX_BLOCK = 1 << 20
# Buffers shorter than this stay whole: the chain's ~6 live buffers of 2 MB then fit a
# server's L3 anyway, and the Scan's overhead made the step slower (1 thread: an Embedding +
# TransformerEncoder tagger with 0.53M weights 16.2 -> 16.7 ms, a depthwise CNN with 0.5M
# 17.6 -> 18.1 ms), where a 3.2M-weight ViT and BERT-like encoder gained 2-3%
MIN_SIZE = 1 << 20
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Sqrt", "Where", "Neg", "Reciprocal", "Abs", "Pow",
                         "Max", "Min", "Identity"})
PHASE = "update/"    # the update phase's node names (update.PREFIX)


def for_session(model: onnx.ModelProto, meta: dict, providers, threads: int | None, row_io: bool = True) -> tuple:
    """block_update(model, ...) for a session whose first provider is the CPU's (providers as
    ONNX Runtime takes them; None: the CPU), on `threads` intra-op threads (None: ONNX
    Runtime's default); (model, {}) for any other. meta: the run's train.json, which names the
    flat gradient (its length is the weights', which shape inference cannot always tell: an
    embedding's gradient has a shape computed at run time) and, with row_io, the state pairs
    that may be declared as rows."""
    first = (providers or [CPU])[0]
    if (first[0] if isinstance(first, tuple) else first) != CPU:
        return model, {}
    size = weights_size(model)
    grad = (meta.get("flat") or {}).get("grad")
    pairs = [(s["input"], s["output"]) for s in graph_state(meta)] if row_io else None
    return block_update(model, size, cpu_threads(threads), pairs, known={grad: [size]} if grad else None)


def weights_size(model: onnx.ModelProto) -> int:
    """The length of a step graph's flat weights buffer (0: a step graph without one, built
    before flat state)."""
    info = next((i for i in model.graph.input if i.name == WEIGHTS), None)
    dims = [d.dim_value for d in info.type.tensor_type.shape.dim] if info is not None else []
    return dims[0] if len(dims) == 1 else 0


def cpu_threads(threads: int | None) -> int:
    """The intra-op threads of a CPU session: `threads`, or for None / 0 ONNX Runtime's default
    (one per core; the CPUs this process may use stand for them, which errs towards longer blocks
    where cores run two threads each)."""
    if threads:
        return int(threads)
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def block_length(n: int, threads: int = 1) -> int | None:
    """The block length C for buffers of n elements run on `threads` intra-op threads (ONNX
    Runtime splits each node of a block between them, so a block holds BLOCK per thread, up to
    MAX_BLOCK): the largest divisor of n from an eighth of that (MIN_BLOCK at least) to it;
    None when there is none, or n is under MIN_SIZE or fits two blocks (blocking would not pay)."""
    high = min(BLOCK * max(1, threads), MAX_BLOCK)
    low = max(MIN_BLOCK, high // 8)
    if n < max(MIN_SIZE, 2 * high):
        return None
    return next((c for c in range(high, low - 1, -1) if n % c == 0), None)


def block_update(model: onnx.ModelProto, size: int, threads: int = 1, pairs: list | None = None,
                 known: dict | None = None) -> tuple[onnx.ModelProto, dict]:
    """Needs a step graph (nodes in topological order) whose flat weight buffers hold `size`
    elements, to run on `threads` intra-op threads. Returns (a copy of the model with the
    update's elementwise chain as Scans over blocks, {graph input or output: its new shape
    [rows, C]}). pairs: the graph's state as (input, output) pairs (a step's X, X__next); a
    pair whose input a Scan reads and whose output a Scan writes is declared as rows on both
    sides, so that no copy reshapes the buffer (a Reshape writing a graph output copies it:
    2.8 ms per buffer for ResNet-18), and the caller feeds and takes it in that shape (a view
    of the same values). Without pairs every input and output keeps its shape (for a caller
    that shares the buffers with another graph). known: {tensor: dims} for tensors whose
    static shape the caller knows and shape inference may not find. (model itself, {}) when
    nothing qualifies or no block length divides `size`."""
    c = block_length(size, threads)
    if c is None:
        return model, {}
    shapes = _shapes(model, known or {})
    nodes = list(model.graph.node)
    region = {i for i, n in enumerate(nodes) if _in_region(n, shapes, size)}
    layers = _layers(nodes, region)
    groups = {}
    for i in sorted(region):
        groups.setdefault(layers[i], []).append(i)
    groups = [g for g in groups.values() if len(g) > 1]  # one node gains nothing from blocks
    if not groups:
        return model, {}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = Names(model)
    rows, flat = names.fresh("update/blocks/rows"), names.fresh("update/blocks/flat")
    out.graph.initializer.extend([numpy_helper.from_array(np.array([size // c, c], np.int64), rows),
                                  numpy_helper.from_array(np.array([size], np.int64), flat)])
    readers = _readers(nodes, model.graph.output)
    moved = {i for g in groups for i in g}
    items = [(i, [n], _needs(n)) for i, n in enumerate(nodes) if i not in moved]
    for k, group in enumerate(groups):
        items.append(_scan(k, [nodes[i] for i in group], group, readers, shapes, names, rows, flat, c))
    order = _topological(items, model.graph)
    if order is None:  # a graph whose nodes were not in topological order: run it as it is written
        return model, {}
    del out.graph.node[:]
    out.graph.node.extend(order)
    return out, _rows_interface(out.graph, names, flat, [size // c, c], pairs or [])


def _rows_interface(graph, names: Names, flat: str, row_shape: list, pairs: list) -> dict:
    """Declares as row_shape both sides of each (input, output) pair whose output a Scan's
    results are reshaped into and whose input is reshaped into a Scan's rows: the Scan writes
    the output itself, and the input's other readers read it through a Reshape (a view, where
    one into a graph output is a copy). Returns {name: row_shape} of each one changed."""
    made_by = {o: n for n in graph.node for o in n.output}
    changed = {}
    for name, out in pairs:
        writer = made_by.get(out)
        src = writer.input[0] if writer is not None and writer.name.startswith("update/blocks/") else None
        if getattr(made_by.get(src), "op_type", None) != "Scan" or any(out in _needs(r) for r in graph.node):
            continue  # not a Scan's result, or read again inside the graph: keep the Reshape
        readers = [n for n in graph.node if name in _needs(n)]
        if not any(r.op_type == "Reshape" and r.name.startswith("update/blocks/") for r in readers) or any(
                name not in r.input for r in readers):
            continue  # no Scan reads it, or a subgraph does: keep its shape
        scan = made_by[src]
        scan.output[list(scan.output).index(src)] = out
        graph.node.remove(writer)
        line = names.fresh(f"{name}/line")
        for r in readers:
            r.input[:] = [line if t == name else t for t in r.input]
        graph.node.insert(0, helper.make_node("Reshape", [name, flat], [line],
                                              name=names.fresh(f"{name}/line/Reshape")))
        changed[name] = changed[out] = row_shape
    for v in list(graph.input) + list(graph.output):
        if v.name in changed:
            _set_dims(v, row_shape)
    return changed


def _set_dims(info, dims: list) -> None:
    shape = info.type.tensor_type.shape
    del shape.dim[:]
    for d in dims:
        shape.dim.add().dim_value = d


def _shapes(model, known: dict) -> dict:
    """{tensor: (elem_type, dims or None)} from ONNX shape inference (dims None: not all static),
    told the FP32 dims of `known` first (a value_info hint, which inference carries on to the
    nodes downstream)."""
    hinted = onnx.ModelProto()
    hinted.CopyFrom(model)
    declared = {v.name for v in list(hinted.graph.value_info) + list(hinted.graph.input) + list(hinted.graph.output)}
    hinted.graph.value_info.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, dims)
                                   for name, dims in known.items() if name not in declared)
    try:
        g = onnx.shape_inference.infer_shapes(hinted).graph
    except Exception:  # noqa: BLE001  (onnx raises several types; a hint that contradicts the graph)
        return {}  # nothing known: nothing is blocked, the step runs as written
    out = {}
    for v in list(g.value_info) + list(g.input) + list(g.output):
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim] if t.HasField("shape") else None
        out[v.name] = (t.elem_type, None if dims is None or None in dims else dims)
    for init in g.initializer:
        out[init.name] = (init.data_type, list(init.dims))
    return out


def _in_region(node, shapes: dict, size: int) -> bool:
    """An update-phase elementwise node over flat buffers of `size` elements and scalars."""
    if node.op_type not in ELEMENTWISE or not node.name.startswith(PHASE) or len(node.output) != 1 or node.domain:
        return False
    if (shapes.get(node.output[0]) or (0, None))[1] != [size]:
        return False
    return all(t and (shapes.get(t) or (0, None))[1] in ([size], []) for t in node.input)


def _needs(node) -> list:
    """Every tensor the node reads, those its subgraphs read from the outer scope included."""
    names = list(node.input)
    for a in node.attribute:
        for g in attr_graphs(a):
            for n in g.node:
                names.extend(_needs(n))
    return [t for t in names if t]


def _layers(nodes: list, region: set) -> dict:
    """{region node index: its layer}: a node goes in the lowest layer after every layer that a
    tensor it reads from outside the region waits on (a Scan cannot read what it writes)."""
    after = {}  # tensor -> the highest layer it waits on (-1: none)
    made_in_region = set()
    layers = {}
    for i, n in enumerate(nodes):
        if i in region:
            layer = max([after[t] if t in made_in_region else after.get(t, -1) + 1 for t in n.input] + [0])
            layers[i] = layer
            made_in_region.update(n.output)
            for o in n.output:
                after[o] = layer
        else:
            wait = max([after.get(t, -1) for t in _needs(n)] + [-1])
            for o in n.output:
                after[o] = wait
    return layers


def _readers(nodes: list, outputs) -> dict:
    """{tensor: indices of the nodes that read it (-1: a graph output)}."""
    readers = {}
    for i, n in enumerate(nodes):
        for t in _needs(n):
            readers.setdefault(t, set()).add(i)
    for o in outputs:
        readers.setdefault(o.name, set()).add(-1)
    return readers


def _scan(k: int, group: list, indices: list, readers: dict, shapes: dict, names: Names, rows: str, flat: str,
          c: int) -> tuple:
    """(position, nodes, needs) of one group as Reshapes to rows, a Scan over them whose body is the
    group per row, and Reshapes of its results back to the flat tensors' names."""
    made = {o for n in group for o in n.output}
    inside = set(indices)
    ins = [t for t in dict.fromkeys(t for n in group for t in n.input) if t not in made and shapes[t][1] != []]
    outs = [o for n in group for o in n.output if readers.get(o, set()) - inside]
    row = {t: names.fresh(f"{t}/row") for t in ins + [o for n in group for o in n.output]}
    body_nodes = [helper.make_node(n.op_type, [row.get(t, t) for t in n.input], [row[o] for o in n.output],
                                   name=n.name, **{a.name: helper.get_attribute_value(a) for a in n.attribute})
                  for n in group]
    body = helper.make_graph(body_nodes, f"update_block_{k}",
                             [helper.make_tensor_value_info(row[t], shapes[t][0], [c]) for t in ins],
                             [helper.make_tensor_value_info(row[o], shapes[o][0], [c]) for o in outs])
    rows_in = {t: names.fresh(f"{t}/rows") for t in ins}
    rows_out = {o: names.fresh(f"{o}/rows") for o in outs}
    made_nodes = [helper.make_node("Reshape", [t, rows], [rows_in[t]], name=names.fresh(f"update/blocks/{k}/in"))
                  for t in ins]
    made_nodes.append(helper.make_node("Scan", [rows_in[t] for t in ins], [rows_out[o] for o in outs],
                                       name=names.fresh(f"update/blocks/{k}/Scan"), body=body,
                                       num_scan_inputs=len(ins)))
    made_nodes += [helper.make_node("Reshape", [rows_out[o], flat], [o], name=names.fresh(f"update/blocks/{k}/out"))
                   for o in outs]
    scalars = [t for n in group for t in n.input if t not in made and shapes[t][1] == []]
    return indices[0], made_nodes, list(ins) + scalars


def _topological(items: list, graph) -> list | None:
    """The nodes of items [(position, [nodes], tensors they need)] in an order where every tensor
    is made before it is read, the lowest position first among those ready; None when there is
    none (the layers assume the model's own nodes in topological order, as ONNX asks: a run
    folder from elsewhere may not keep to it, and ONNX Runtime then says what is wrong)."""
    ready_names = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    made_by = {}
    for k, (_, ns, _) in enumerate(items):
        for n in ns:
            for o in n.output:
                made_by[o] = k
    waiting, users = {}, {}
    for k, (_, ns, needs) in enumerate(items):
        inner = {o for n in ns for o in n.output}
        deps = {made_by[t] for t in needs if t not in ready_names and t not in inner and t in made_by}
        waiting[k] = len(deps)
        for d in deps:
            users.setdefault(d, []).append(k)
    heap = [(items[k][0], k) for k, w in waiting.items() if w == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, k = heapq.heappop(heap)
        order.extend(items[k][1])
        for u in users.get(k, []):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(heap, (items[u][0], u))
    return order if len(order) == sum(len(ns) for _, ns, _ in items) else None

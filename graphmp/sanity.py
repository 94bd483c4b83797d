"""Graph sanity at load: a model's wiring and inline tensor data checked before any work.

Models come from anywhere (downloads, broken exporters, damaged or tampered files). A
malformed graph must be one clear GraphmpError (the file, the graph, the node or tensor,
what to do) right after parsing, not a converted model that onnx and ONNX Runtime reject,
nor a traceback deep in a pass (`cannot reshape array`, a MemoryError for a declared
petabyte weight). `check_graph` checks every graph, If/Loop/Scan subgraphs included:

1. Undefined names: every non-empty node input ("" is an omitted optional input) and
   every graph output is a graph input, an initializer (sparse ones too) or a node output
   of this graph (in any order: graphmp sorts nodes later) or of an enclosing graph
   (subgraphs read outer-scope values; Loop/Scan bodies also their own graph inputs);
   no graph output is listed twice, one that is an initializer declares its type and
   shape, and no attribute refers to a function's attribute outside a function.
2. One producer per name within a graph: no two nodes write the same tensor, no node
   writes a graph input or initializer, no two initializers or graph inputs share a name.
3. No cycles: the nodes of each graph form a DAG, counting a subgraph's reads of this
   graph's values as inputs of the node that owns the subgraph.
4. Inline tensor data agrees with the declared type and dims (initializers, sparse
   initializers, tensors in node attributes such as Constant's `value`): no negative
   dims, a known data_type, raw_data of exactly the size the dims call for, typed fields
   (float_data, int32_data, ...) with exactly the count onnx's packing rules call for
   (numpy_helper / helper.make_tensor: FLOAT16, BFLOAT16, 8-bit and BOOL one int32_data
   entry per element, INT4/UINT4/FLOAT4E2M1 two elements per byte, INT2/UINT2 four,
   FLOAT6 raw 6 bits packed, COMPLEX two values per element). An initializer with
   elements but no data is an error; an attribute tensor without data is left alone.
5. Absurd declared sizes follow from 4: sizes are Python ints computed from dims (no
   overflow, nothing allocated), and the bytes present must match them.
6. Names (graphs, nodes, tensors, value infos) are at most MAX_NAME_CHARS characters: a
   100 KB name is no exporter's, and every regex a user matches against names
   (--fp32-nodes) and every line that prints one stays quick.
7. Loops end: a Loop whose constant trip count (times those of the Loops around it) is
   over graphmp.run_limits.MAX_LOOP_TRIPS is refused, naming the Loop node.

External-data tensors (including the large weights load_model(by_reference=True)
points back into the .onnx file) have their type and dims checked here; their data is
checked against the file by graphmp.paths. Cost: linear in the graph (names, dims and
field counts; raw_data is never copied). `check_schemas` then runs onnx's own (basic)
checker on the model's skeleton: ops, attributes and input counts against their schemas.
"""
from __future__ import annotations

import math

from onnx import AttributeProto, TensorProto

from .errors import GraphmpError
from .names import shown

MALFORMED = "the model is malformed (a broken exporter or a damaged file): re-export it"
MAX_NAME_CHARS = 4096

# data_type -> (raw_data bytes per element as (num, den), typed field, field values per element (num, den))
_SPEC_BY_NAME = {
    **{k: ((1, 1), "int32_data", (1, 1)) for k in (
        "UINT8", "INT8", "BOOL", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT8E8M0")},
    **{k: ((2, 1), "int32_data", (1, 1)) for k in ("UINT16", "INT16", "FLOAT16", "BFLOAT16")},
    **{k: ((1, 2), "int32_data", (1, 2)) for k in ("INT4", "UINT4", "FLOAT4E2M1")},
    **{k: ((1, 4), "int32_data", (1, 4)) for k in ("INT2", "UINT2")},
    **{k: ((6, 8), "int32_data", (1, 1)) for k in ("FLOAT6E2M3", "FLOAT6E3M2")},
    "FLOAT": ((4, 1), "float_data", (1, 1)), "INT32": ((4, 1), "int32_data", (1, 1)),
    "UINT32": ((4, 1), "uint64_data", (1, 1)), "DOUBLE": ((8, 1), "double_data", (1, 1)),
    "INT64": ((8, 1), "int64_data", (1, 1)), "UINT64": ((8, 1), "uint64_data", (1, 1)),
    "COMPLEX64": ((8, 1), "float_data", (2, 1)), "COMPLEX128": ((16, 1), "double_data", (2, 1)),
    "STRING": (None, "string_data", (1, 1)),
}
_SPEC = {getattr(TensorProto, k): v for k, v in _SPEC_BY_NAME.items() if hasattr(TensorProto, k)}
_TYPE_NAME = {getattr(TensorProto, k): k for k in _SPEC_BY_NAME if hasattr(TensorProto, k)}
_TYPED_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def check_graph(model, path: str) -> None:
    """Raise one GraphmpError (one line naming the file, graph and node/tensor, and what
    to do) when the model's graphs cannot be a valid ONNX graph; see the module doc."""
    from .run_limits import check_trip_counts
    g = model.graph
    _check_graph(g, path, f"main graph {_q(g.name)}" if g.name else "main graph", [])
    check_trip_counts(model, path)


def _s(text: str, limit: int = 120) -> str:
    """Text from the model made safe for a one-line message (control characters escaped,
    long names cut): graphmp.names.shown."""
    return shown(text, limit)


def _check_name_lengths(g, path: str, where: str) -> None:
    """Every name g declares or uses (its own, its nodes', their inputs and outputs, graph
    inputs, outputs, initializers, value infos) is at most MAX_NAME_CHARS long."""
    def names():
        yield "graph name", g.name
        for kind, vs in (("input", g.input), ("output", g.output), ("value_info", g.value_info)):
            for v in vs:
                yield kind, v.name
        for t in g.initializer:
            yield "initializer", t.name
        for n in g.node:
            yield "node name", n.name
            for x in n.input:
                yield f"input of node {_q(n.name)}", x
            for x in n.output:
                yield f"output of node {_q(n.name)}", x
    for kind, name in names():
        if len(name) > MAX_NAME_CHARS:
            _fail(path, f"{where}: a {kind} is {len(name)} characters long ({_q(name)}), more than the "
                  f"{MAX_NAME_CHARS} graphmp accepts", "rename it (no exporter writes such names)")


def _q(name: str) -> str:
    return f"'{_s(name)}'"


def _node(n, i: int) -> str:
    op = _s(n.op_type, 60)
    return f"node {_q(n.name)} ({op})" if n.name else f"node #{i} ({op}, unnamed)"


def _fail(path: str, msg: str, todo: str = MALFORMED):
    raise GraphmpError(f"{path}: {msg}; {todo}.")


def _sub_graphs(a) -> list:
    """(label suffix, graph) for the subgraphs an attribute holds."""
    if a.type == AttributeProto.GRAPH:
        return [("", a.g)]
    return [(f"[{j}]", g) for j, g in enumerate(a.graphs)]


def _check_graph(g, path: str, where: str, outer: list) -> set:
    """Check graph `g` (and its subgraphs) whose enclosing graphs define the names in
    `outer` (one dict per level); returns the outer-scope names it reads."""
    _check_name_lengths(g, path, where)
    _check_tensors(g, path, where)
    defined = _definitions(g, path, where)
    scopes = outer + [defined]
    free: set = set()
    reads = []
    for i, n in enumerate(g.node):
        names = []
        for x in n.input:
            if x and x not in defined and not any(x in s for s in outer):
                _fail(path, f"{where} {_node(n, i)} reads {_q(x)}, which no node, graph input or initializer "
                      f"{'of this graph or an enclosing one ' if outer else ''}defines")
            if x:
                names.append(x)
        for a in n.attribute:
            if a.ref_attr_name:
                _fail(path, f"{where} {_node(n, i)} attribute {_q(a.name)} refers to a function attribute "
                      f"{_q(a.ref_attr_name)}, but the node is not inside a function body")
            for suffix, sg in _sub_graphs(a):
                label = f"subgraph {_q(sg.name)}" if sg.name else "subgraph"
                label += f" (attribute {_q(a.name)}{suffix} of {_node(n, i)}"
                label += f" in {where})" if outer else ")"
                names.extend(_check_graph(sg, path, label, scopes))
        free.update(x for x in names if x not in defined)
        reads.append(names)
    listed: set = set()
    for v in g.output:
        if v.name in listed:
            _fail(path, f"{where} lists output {_q(v.name)} twice (each graph output is one tensor, named once)")
        listed.add(v.name)
        if defined.get(v.name) == -1:
            _check_declared(v, g, path, where)
        if v.name not in defined:
            if not any(v.name in s for s in outer):
                _fail(path, f"{where} output {_q(v.name)} is not written by any node, nor a graph input or "
                      "initializer")
            free.add(v.name)
    _check_acyclic(g, defined, reads, path, where)
    return free


def _check_declared(v, g, path: str, where: str) -> None:
    """A graph output that is an initializer declares the type and shape the initializer
    has (no node's inference would catch a mismatch; one added in front of it would)."""
    t = next((t for t in g.initializer if t.name == v.name), None)
    tt = v.type.tensor_type if v.type.HasField("tensor_type") else None
    if t is None or tt is None:
        return
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] if tt.HasField("shape") else None
    if (tt.elem_type and tt.elem_type != t.data_type) or (dims is not None and (
            len(dims) != len(t.dims) or any(d is not None and d != w for d, w in zip(dims, t.dims)))):
        _fail(path, f"{where} output {_q(v.name)} is the initializer of that name ({_dims(t.dims)}, type "
              f"{t.data_type}) but declares type {tt.elem_type} shape {dims}")


def _definitions(g, path: str, where: str) -> dict:
    """name -> index of the node writing it, or -1 for graph inputs and initializers;
    a name defined twice is an error."""
    defined: dict = {}
    for v in g.input:
        if v.name in defined:
            _fail(path, f"{where} lists graph input {_q(v.name)} twice")
        defined[v.name] = -1
    inits = set()
    for t in list(g.initializer) + [s.values for s in g.sparse_initializer]:
        if not t.name:
            _fail(path, f"{where} has an initializer without a name")
        if t.name in inits:
            _fail(path, f"{where} has two initializers named {_q(t.name)}")
        inits.add(t.name)
        defined[t.name] = -1
    for i, n in enumerate(g.node):
        for o in n.output:
            if not o:
                continue  # an omitted optional output
            prev = defined.get(o)
            if prev is None:
                defined[o] = i
            elif prev == i:
                _fail(path, f"{where} {_node(n, i)} lists output {_q(o)} twice")
            elif prev >= 0:
                _fail(path, f"{where} {_node(g.node[prev], prev)} and {_node(n, i)} both write {_q(o)} "
                      "(a tensor has one producer)")
            else:
                what = "an initializer" if o in inits else "a graph input"
                _fail(path, f"{where} {_node(n, i)} writes {_q(o)}, which is already {what} "
                      "(a tensor has one producer)")
    return defined


def _check_acyclic(g, defined: dict, reads: list, path: str, where: str) -> None:
    """Kahn's algorithm over the nodes (linear); on a cycle, name the nodes on it."""
    deps = [{defined[x] for x in names if defined.get(x, -1) >= 0} for names in reads]
    users: list = [[] for _ in deps]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    indeg = [len(d) for d in deps]
    ready = [i for i, k in enumerate(indeg) if k == 0]
    done = 0
    while ready:
        i = ready.pop()
        done += 1
        for u in users[i]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    if done == len(deps):
        return
    # every node left has a dependency left: walking them back must come round again
    i = next(i for i, k in enumerate(indeg) if k > 0)
    order: dict = {}
    while i not in order:
        order[i] = len(order)
        i = min(j for j in deps[i] if indeg[j] > 0)
    cycle = [j for j in order if order[j] >= order[i]][::-1]  # in data-flow order
    shown = " -> ".join(_node(g.node[j], j) for j in cycle[:8])
    more = f" -> ... ({len(cycle)} nodes)" if len(cycle) > 8 else ""
    _fail(path, f"{where} has a cycle: {shown}{more} -> back to {_node(g.node[cycle[0]], cycle[0])} "
          "(an ONNX graph is acyclic)")


def _check_tensors(g, path: str, where: str) -> None:
    """Inline data vs declared type and dims of every tensor the graph itself holds
    (its subgraphs' tensors are checked with the subgraphs)."""
    for t in g.initializer:
        _check_tensor(t, path, f"{where} initializer {_q(t.name)}", required=True)
    for s in g.sparse_initializer:
        _check_sparse(s, path, f"{where} sparse initializer {_q(s.values.name)}")
    for i, n in enumerate(g.node):
        for a in n.attribute:
            what = f"{where} {_node(n, i)} attribute {_q(a.name)}"
            if a.HasField("t"):
                _check_tensor(a.t, path, what, required=False)
            for k, t in enumerate(a.tensors):
                _check_tensor(t, path, f"{what}[{k}]", required=False)
            if a.HasField("sparse_tensor"):
                _check_sparse(a.sparse_tensor, path, what)
            for k, s in enumerate(a.sparse_tensors):
                _check_sparse(s, path, f"{what}[{k}]")


def _dims(dims) -> str:
    shown = ", ".join(str(d) for d in dims[:8])
    return f"[{shown}{', ...' if len(dims) > 8 else ''}]"


def _human(nbytes: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if nbytes < 1024 or unit == "EiB":
            return f"{nbytes} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


def _check_tensor(t, path: str, what: str, required: bool) -> None:
    problem = _tensor_problem(t, required)
    if problem:
        _fail(path, f"{what} {problem}")


def _tensor_problem(t, required: bool) -> str | None:
    """What is wrong with tensor `t`'s declared type, dims and inline data, or None."""
    dims = t.dims
    if any(d < 0 for d in dims):
        return f"declares dims {_dims(dims)}, with a negative dimension"
    spec = _SPEC.get(t.data_type)
    if spec is None:
        return f"has data_type {t.data_type}, which is not an ONNX tensor element type"
    if t.data_location == TensorProto.EXTERNAL:
        return None  # its data is checked against the file (graphmp.paths)
    n = math.prod(dims)  # Python ints: a declared petabyte does not wrap around
    raw, field, (fn, fd) = spec
    decl = f"({_TYPE_NAME[t.data_type]}, dims {_dims(dims)}, {n} elements)"
    typed = [f for f in _TYPED_FIELDS if len(getattr(t, f))]
    if t.HasField("raw_data"):
        if raw is None:
            return f"{decl} stores strings in raw_data; ONNX keeps them in string_data"
        if typed:
            return f"{decl} holds both raw_data and {typed[0]}; a tensor has one data field"
        want, have = -(-n * raw[0] // raw[1]), len(t.raw_data)
        if have != want:
            size = f" ({_human(want)})" if want >= 1024 else ""
            return f"{decl} needs {want} bytes of raw_data{size}, but holds {have} bytes"
        return None
    wrong = [f for f in typed if f != field]
    if wrong:
        return f"{decl} stores its values in {wrong[0]}; ONNX keeps {_TYPE_NAME[t.data_type]} values in {field}"
    want, have = -(-n * fn // fd), len(getattr(t, field))
    if have == 0 and want and not required:
        return None  # an attribute tensor without data (its op's default applies)
    if have != want:
        if have == 0:
            return f"{decl} holds no data (no raw_data, no {field})"
        return f"{decl} needs {want} {field} values, but holds {have}"
    return None


def _check_sparse(s, path: str, what: str) -> None:
    """A sparse tensor: its values and indices as tensors, and NNZ consistent between them."""
    if any(d < 0 for d in s.dims):
        _fail(path, f"{what} declares dims {_dims(s.dims)}, with a negative dimension")
    _check_tensor(s.values, path, f"{what} values", required=True)
    _check_tensor(s.indices, path, f"{what} indices", required=True)
    vd, idd = list(s.values.dims), list(s.indices.dims)
    if len(vd) != 1:
        _fail(path, f"{what} has values of dims {_dims(vd)}; sparse values must be 1-D [NNZ]")
    if idd != vd and idd != [vd[0], len(s.dims)]:
        _fail(path, f"{what} has indices of dims {_dims(idd)} for {vd[0]} values; they must be [{vd[0]}] "
              f"or [{vd[0]}, {len(s.dims)}]")


def _allow_shapeless(graph) -> None:
    """Give each tensor type without a shape an empty one (the basic checker infers nothing,
    so the rank does not matter to it), in every graph."""
    for v in list(graph.input) + list(graph.output) + list(graph.value_info):
        tt = v.type.tensor_type if v.type.HasField("tensor_type") else None
        if tt is not None and not tt.HasField("shape"):
            tt.shape.SetInParent()
    for n in graph.node:
        for a in n.attribute:
            for _, g in _sub_graphs(a):
                _allow_shapeless(g)


def check_schemas(model, path: str) -> None:
    """onnx's own checker (not the full one: no shape inference) on the model's skeleton:
    every node an op of its opset with the attributes and input counts its schema allows,
    a valid IR version and opset imports. A model failing it is converted into one that
    onnx and ONNX Runtime reject, or trips a pass (an INT where a list of ints belongs).
    The skeleton is the model with each weight replaced by an empty tensor of its name and
    type: the weights are checked by graphmp.paths and _check_tensors, the checker would
    look for external ones relative to the working directory, and the skeleton costs the
    graph, not the weights. Shapeless value types (old exporters write tensor types
    without a shape; ONNX Runtime runs them) are not held against the model."""
    import onnx
    from .paths import iter_tensors
    from .wire import copy_except
    skeleton = copy_except(model, onnx.ModelProto(), "graph")
    copy_except(model.graph, skeleton.graph, "initializer")
    for t in model.graph.initializer:  # name and type only: the weights are not the checker's business
        m = skeleton.graph.initializer.add()
        m.name, m.data_type = t.name, t.data_type
        m.dims.append(0)
    for t in iter_tensors(skeleton.graph):
        if t.data_location == TensorProto.EXTERNAL:
            del t.external_data[:]
            del t.dims[:]
            t.data_location = TensorProto.DEFAULT
            t.dims.append(0)
    _allow_shapeless(skeleton.graph)
    from .ir import Graph
    root = Graph(skeleton.graph, None, "main")  # the checker wants topological order; graphmp sorts later
    for g in root.walk():
        g.toposort(path)
    root.write_back()
    try:
        onnx.checker.check_model(skeleton)
    except (onnx.checker.ValidationError, ValueError, RuntimeError) as e:
        first = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
        _fail(path, f"the model fails onnx's checker: {_s(first, 240)}",
              "graphmp converts valid ONNX models only: re-export it (or fix the node it names)")

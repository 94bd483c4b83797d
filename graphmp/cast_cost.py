"""cast_cost: what the Casts of a converted model cost per inference, and how much of
its compute runs in the low type (issue 26; convert's report["cast_traffic"]).

Cheap by design: no ONNX Runtime run, only shape inference (data propagation on) of a
weightless skeleton (graphmp.model_io.skeleton) with the graph inputs set to the shapes of the
first calibration batch, or the declared shapes when there is none. As in
graphmp.passes.regions.node_costs, inside If/Loop/Scan bodies inference often keeps
only the rank: an unknown dim counts as 1 and the figures are marked approximate. In
the main graph an unknown dim with no concrete input shapes (no calibration, dynamic
declared dims) makes the figure unavailable rather than a guess.

- Cast bytes: elements x (size of the source type + size of the target type): the
  input read plus the output written. "boundary": Casts that read a graph input or
  write a graph output of the main graph (keep_io_types); "inside": the rest.
- compute_fp16_share: FLOPs (multiply-adds x 2) of Conv/ConvTranspose/MatMul/Gemm/Einsum
  in every graph whose output is FLOAT16/BFLOAT16, over all their FLOPs.
"""
from __future__ import annotations

import time

import numpy as np
import onnx
from onnx import TensorProto

from .compute_share import compute_flops as share_flops, compute_nodes
from .model_io import CONVERT_MARK, iter_graphs, skeleton

COMPUTE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum")
LOW_TYPES = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
TOP = 5


def itemsize(elem_type: int) -> int | None:
    if elem_type == TensorProto.BFLOAT16:
        return 2
    try:
        return int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)
    except Exception:  # noqa: BLE001 - undefined/string/unknown: no size
        return None


def _type_name(elem_type) -> str:
    try:
        return TensorProto.DataType.Name(elem_type)
    except ValueError:
        return str(elem_type)


def _skeleton(model, shapes: dict):
    """Weightless copy: initializers that save converts to the low type (CONVERT_MARK)
    get that type (no data: types and dims are all inference needs), the graph inputs
    the given shapes."""
    skel = skeleton(model)
    for g in iter_graphs(skel.graph):
        for t in g.initializer:
            if t.doc_string.startswith(CONVERT_MARK):
                t.data_type = int(t.doc_string[len(CONVERT_MARK):])
                for f in ("raw_data", "float_data", "int32_data"):
                    t.ClearField(f)
            elif t.data_type in LOW_TYPES and len(t.raw_data) > 4096:  # converted weights (an in-memory model)
                t.ClearField("raw_data")
    for g in iter_graphs(skel.graph):  # a declared dim_param ('batch') would hide the inferred dim
        for v in list(g.value_info) + (list(g.output) if g is skel.graph else []):
            for d in v.type.tensor_type.shape.dim:
                if d.HasField("dim_param"):
                    d.ClearField("dim_param")
    for v in skel.graph.input:
        if v.name in shapes:
            shape = v.type.tensor_type.shape
            shape.ClearField("dim")
            for d in shapes[v.name]:
                shape.dim.add().dim_value = int(d)
    return skel


def _input_shapes(model, batch) -> tuple[dict, bool, str]:
    """({graph input: dims}, every dim concrete, where the shapes come from)."""
    inits = {t.name for t in model.graph.initializer}
    shapes, concrete = {}, True
    for v in model.graph.input:
        if v.name in inits:
            continue
        if batch is not None and v.name in batch:
            shapes[v.name] = [int(d) for d in np.shape(batch[v.name])]
            continue
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                for d in v.type.tensor_type.shape.dim]
        concrete &= v.type.tensor_type.HasField("shape") and None not in dims
        shapes[v.name] = dims
    return shapes, concrete, "calibration batch 1" if batch is not None else "declared shapes"


def shapes_label(shapes: dict) -> str:
    """Input3:1x1x28x28, with ? for an unknown dim."""
    return ", ".join(f"{k}:{'x'.join('?' if d is None else str(d) for d in dims) or 'scalar'}"
                     for k, dims in shapes.items())


def compute_flops(n, shapes: dict) -> float | None:
    """Multiply-adds x 2 of a Conv/ConvTranspose/MatMul/Gemm/Einsum node at these (filled)
    shapes; None without shapes or for another op (the search's region prices use it too;
    graphmp.compute_share also counts the integer ops)."""
    return share_flops(n, shapes) if n.op_type in COMPUTE_OPS else None


def cast_traffic(model, batch=None, casts_added: int | None = None, measure: bool = False) -> dict:
    """The report's cast_traffic entry for this (converted) model; batch: the first
    calibration batch ({input name: array}) or None (declared shapes). measure (with a
    batch): the sizes inference leaves unknown, of the main graph's Casts, are taken from
    one ONNX Runtime run on the batch with those Casts' outputs exposed (benchmarks: a
    converter whose output inference cannot follow is not counted as casting less).

    Phases: the input shapes; the inferred skeleton (_infer); the type, shape, producer
    and consumers of every tensor (_Facts); the bytes the Casts move (_cast_entries,
    _traffic); the share of the compute in the low type (_compute_share)."""
    t0 = time.perf_counter()
    in_shapes, concrete, shapes_from = _input_shapes(model, batch)
    out = {"shapes": in_shapes, "shapes_from": shapes_from, "casts_added": casts_added}
    skel, error = _infer(model, in_shapes)
    inferred = error is None
    if not inferred:
        out["inference_error"] = error
    facts = _Facts(skel, concrete)
    if measure and batch is not None:
        unknown = [n.output[0] for n in facts.graphs[0].node
                   if n.op_type == "Cast" and facts.dims_of(n.output[0], 0)[1]]
        sizes = _run_sizes(model, batch, unknown, facts.types)
        facts.shapes.update({x: (dims, 0) for x, dims in sizes.items()})
        out["sizes_measured"] = f"{len(sizes)} of {len(unknown)}"
    casts, approximate, unavailable = _cast_entries(facts)
    out.update(_traffic(casts, approximate, unavailable, inferred))
    out.update(_compute_share(facts, inferred))
    out["seconds"] = round(time.perf_counter() - t0, 4)
    return out


def infer_facts(model, in_shapes: dict, concrete: bool = True) -> tuple["_Facts", str | None]:
    """(what the shape-inferred weightless skeleton says of every tensor of `model` with its
    graph inputs at `in_shapes` ({input: dims}, None for an unknown dim), None or the
    inference error). concrete: every main-graph input dim is known (else figures that
    need one are unavailable). For callers outside this module (graphmp.inspect)."""
    skel, error = _infer(model, in_shapes)
    return _Facts(skel, concrete), error


def cast_fields(facts: "_Facts", inferred: bool) -> dict:
    """The Cast fields of cast_traffic's entry (count, bytes total/boundary/inside, MB per
    inference, the largest Casts) from infer_facts' result."""
    casts, approximate, unavailable = _cast_entries(facts)
    return _traffic(casts, approximate, unavailable, inferred)


def _run_sizes(model, batch: dict, names: list, types: dict) -> dict:
    """{tensor: dims} of main-graph tensors `names`, from one ONNX Runtime run on `batch`
    with them exposed as outputs ({} where ONNX Runtime cannot run the model)."""
    if not names:
        return {}
    from .model_runs import ort_session
    from .run_limits import guarded, model_bytes
    m = onnx.ModelProto()
    m.CopyFrom(model)
    declared = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.helper.make_tensor_value_info(x, types.get(x, onnx.TensorProto.FLOAT), None)
                          for x in names if x not in declared)
    try:
        sess = ort_session(m, optimize=False)  # unoptimised: the Casts stay as they are
        feeds = {i.name: batch[i.name] for i in sess.get_inputs() if i.name in batch}
        guard = guarded("the model: measuring tensor sizes", model_bytes(m))
        got = guard(lambda options: sess.run(names, feeds, options))
    except Exception:  # noqa: BLE001 - the figures stay inferred (approximate), as without measure
        return {}
    return {x: [int(d) for d in np.shape(v)] for x, v in zip(names, got)}


def _infer(model, in_shapes: dict):
    """(the skeleton with the concrete input shapes, shape-inferred with data propagation
    (the uninferred skeleton when inference fails), None or the inference error)."""
    skel = _skeleton(model, {k: v for k, v in in_shapes.items() if None not in v})
    try:
        return onnx.shape_inference.infer_shapes(skel, strict_mode=False, data_prop=True), None
    except Exception as e:  # noqa: BLE001 - the figures become unavailable, not the conversion
        return skel, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


class _Facts:
    """What the inferred skeleton says of every tensor, over all its graphs (index 0: the
    main graph): shapes {name: (dims with None where unknown, index of the graph that
    gave them)}, types {name: elem type}, producer {name: op type}, consumers {name: [op
    types]}; the main graph's input and output names; concrete: every main-graph input
    dim known."""

    def __init__(self, skel, concrete: bool):
        self.concrete = concrete
        self.graphs = list(iter_graphs(skel.graph))
        self.main_inputs = {v.name for v in skel.graph.input}
        self.main_outputs = {v.name for v in skel.graph.output}
        self.shapes, self.types, self.producer, self.consumers = {}, {}, {}, {}
        for gi, g in enumerate(self.graphs):
            self._note_values(g, gi)
            self._note_nodes(g, gi)

    def _note_values(self, g, gi):
        """Declared/inferred types and shapes of g's inputs, value_info and outputs (the
        first all-known dims win), and of its initializers."""
        for v in list(g.input) + list(g.value_info) + list(g.output):
            tt = v.type.tensor_type
            if tt.elem_type:
                self.types.setdefault(v.name, tt.elem_type)
            if tt.HasField("shape"):
                dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tt.shape.dim]
                if v.name not in self.shapes or (None in self.shapes[v.name] and None not in dims):
                    self.shapes[v.name] = (dims, gi)
        for t in g.initializer:
            self.types[t.name] = t.data_type
            self.shapes[t.name] = (list(t.dims), gi)

    def _note_nodes(self, g, gi):
        """Producers and consumers of g's tensors; the type and shape of Constant outputs."""
        for n in g.node:
            for x in n.output:
                self.producer[x] = n.op_type
            for x in n.input:
                self.consumers.setdefault(x, []).append(n.op_type)
            if n.op_type == "Constant":
                v = next((a.t for a in n.attribute if a.name == "value"), None)
                if v is not None:
                    self.types.setdefault(n.output[0], v.data_type)
                    self.shapes.setdefault(n.output[0], (list(v.dims), gi))

    def dims_of(self, x, gi):
        """(filled dims or None, approximate, unavailable)."""
        if x not in self.shapes:
            return None, True, gi == 0 and not self.concrete
        dims, where = self.shapes[x]
        if None not in dims:
            return dims, False, False
        return [d or 1 for d in dims], True, where == 0 and not self.concrete


def _cast_entries(f: _Facts) -> tuple[list, bool, bool]:
    """(an entry per Cast of every graph (_cast_entry), any figure approximate, any
    main-graph figure unavailable)."""
    approximate = unavailable = False
    casts = []
    for gi, g in enumerate(f.graphs):
        for n in g.node:
            if n.op_type != "Cast" or not n.input or not n.output:
                continue
            entry, approx, unavail = _cast_entry(f, gi, n)
            approximate |= approx
            unavailable |= unavail
            casts.append(entry)
    return casts, approximate, unavailable


def _cast_entry(f: _Facts, gi: int, n) -> tuple[dict, bool, bool]:
    """(the entry of Cast n of graph gi: bytes moved, elements, types, producer and
    consumers, boundary or not; its size approximate, its size unavailable)."""
    to = next((a.i for a in n.attribute if a.name == "to"), 0)
    src = f.types.get(n.input[0])
    # the output's dims, or the input's where only they are all known (same count)
    dims, approx, unavail = f.dims_of(n.output[0], gi)
    if approx:
        dims2, approx2, unavail2 = f.dims_of(n.input[0], gi)
        if dims is None or (dims2 is not None and not approx2):
            dims, approx, unavail = dims2, approx2, unavail2
    s_in, s_out = itemsize(src) if src else None, itemsize(to)
    if dims is None or s_in is None or s_out is None:
        approx = True
        unavail |= gi == 0 and not f.concrete
    elems = int(np.prod(dims)) if dims is not None else 1
    nbytes = elems * ((s_in or 4) + (s_out or 4))
    boundary = gi == 0 and (n.input[0] in f.main_inputs or n.output[0] in f.main_outputs)
    entry = {"name": n.name, "graph": "main" if gi == 0 else f"body {gi}", "bytes": nbytes,
             "elements": elems, "from": _type_name(src) if src else "unknown", "to": _type_name(to),
             "producer": f.producer.get(n.input[0], "graph input" if n.input[0] in f.main_inputs
                                        else "initializer" if n.input[0] in f.types else "outer scope"),
             "consumers": sorted(set(f.consumers.get(n.output[0], [])))
             + (["graph output"] if n.output[0] in f.main_outputs else []),
             "boundary": boundary}
    return entry, approx, unavail


def _traffic(casts: list, approximate: bool, unavailable: bool, inferred: bool) -> dict:
    """The Cast fields of the entry: count, bytes (total, boundary, inside; None when
    unavailable, with the reason), MB per inference, the TOP largest Casts."""
    total = sum(c["bytes"] for c in casts)
    boundary = sum(c["bytes"] for c in casts if c["boundary"])
    ok = inferred and not unavailable
    return dict(casts=len(casts), approximate=bool(approximate),
                unavailable=None if ok else ("shape inference failed" if not inferred else
                                             "main-graph dims unknown without a calibration batch; calibration "
                                             "(generated inputs, --shapes, or --calibration) gives them"),
                bytes=total if ok else None, boundary_bytes=boundary if ok else None,
                inside_bytes=total - boundary if ok else None,
                mb_per_inference={"total": total / 1e6, "boundary": boundary / 1e6,
                                  "inside": (total - boundary) / 1e6} if ok else None,
                top=[{k: c[k] for k in ("name", "graph", "bytes", "elements", "from", "to", "producer", "consumers")}
                     for c in sorted(casts, key=lambda c: -c["bytes"])[:TOP]] if ok else [])


def _compute_share(f: _Facts, inferred: bool) -> dict:
    """The compute fields of the entry: FLOPs of the compute ops (graphmp.compute_share: the
    float ones and the INT8 ones), those in the low type and in INT8, the low type's share
    (None when unavailable), the INT8 ops by type, and whether approximate."""
    filled = {x: [d or 1 for d in dims] for x, (dims, _) in f.shapes.items()}
    flops = low = int8 = 0.0
    int8_ops: dict = {}
    flops_approx = flops_unavail = False
    for gi, n, p, fl in compute_nodes(f.graphs, filled, f.types):
        used = [f.shapes[x][0] for x in list(n.output[:1]) + list(n.input[:2]) if x in f.shapes]
        if fl is None or any(None in d for d in used):
            flops_approx = True
            flops_unavail |= gi == 0 and not f.concrete
        if fl is None:
            continue
        flops += fl
        low += fl if p in ("fp16", "bf16") else 0.0
        if p == "int8":
            int8 += fl
            int8_ops[n.op_type] = int8_ops.get(n.op_type, 0) + 1
    ok_flops = inferred and flops > 0 and not flops_unavail
    out = dict(compute_flops=flops if ok_flops else None, compute_flops_low=low if ok_flops else None,
               compute_fp16_share=low / flops if ok_flops else None, compute_approximate=bool(flops_approx))
    if int8_ops:
        out.update(compute_flops_int8=int8 if ok_flops else None,
                   compute_int8_share=int8 / flops if ok_flops else None, int8_ops=int8_ops)
    return out


def _size(b: float) -> str:
    return f"{b / 1e6:.1f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def summary_line(c: dict, target: str = "fp16") -> str:
    """  cast traffic: 14 Casts, 3.2 MB per inference at Input3:1x1x28x28 (boundary 0.1 MB); 92.3% of
    Conv/MatMul FLOPs in FP16   ("~" where approximate)."""
    added = c.get("casts_added")
    n = f"{c['casts']} Cast{'s' if c['casts'] != 1 else ''}" + (
        f" ({added} added)" if added is not None and added != c["casts"] else "")
    at = shapes_label(c["shapes"]) or "no inputs"
    if c.get("bytes") is None:
        traffic = f"bytes per inference unavailable at {at} ({c['unavailable']})"
    else:
        approx = "~" if c["approximate"] else ""
        traffic = (f"{approx}{_size(c['bytes'])} per inference at {at} "
                   f"(boundary {approx}{_size(c['boundary_bytes'])})")
    if c.get("compute_fp16_share") is None:
        share = "Conv/MatMul FLOPs share unknown" if c.get("compute_flops") is None and c.get("compute_approximate") \
            else "no Conv/MatMul FLOPs"
    else:
        share = _share_text(c, target)
    return f"  cast traffic: {n}, {traffic}; {share}"


def _share_text(c: dict, target: str) -> str:
    """'92.3% of Conv/MatMul FLOPs in FP16', or for a model with INT8 compute '10.0% FP16,
    85.0% INT8, 5.0% FP32 of Conv/MatMul FLOPs (INT8: 56 MatMulInteger, kept as quantized)'."""
    approx = "~" if c["compute_approximate"] else ""
    if not c.get("int8_ops"):
        return f"{approx}{100 * c['compute_fp16_share']:.1f}% of Conv/MatMul FLOPs in {target.upper()}"
    low, int8 = c["compute_fp16_share"], c.get("compute_int8_share") or 0.0
    ops = ", ".join(f"{k} {v}" for k, v in sorted(c["int8_ops"].items()))
    return (f"{approx}{100 * low:.1f}% {target.upper()}, {approx}{100 * int8:.1f}% INT8, "
            f"{approx}{100 * max(0.0, 1 - low - int8):.1f}% FP32 of Conv/MatMul FLOPs "
            f"(INT8 compute kept as quantized: {ops}; the float work around it converted)")

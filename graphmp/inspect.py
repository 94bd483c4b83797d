"""inspect: how much of any ONNX model, whoever converted it, runs in which precision
(`graphmp inspect MODEL [MODEL2]`).

For one model: the FLOPs of Conv/ConvTranspose/MatMul/Gemm/Einsum by precision (FP16, BF16,
INT8, FP32, ...), the Casts and the bytes they move per inference, and the FP32 compute
nodes grouped by op type with, for a model graphmp converted, why each stayed FP32 (the
REASON_MARK line convert writes into the node's doc_string). For two models, a plan
diff: the nodes (matched by graph and name) whose precision differs, and the two models'
FLOPs shares and Cast bytes side by side.

Nothing is run: the figures come from ONNX shape inference of a weightless skeleton
(graphmp.cast_cost, which convert's summary uses too), at the declared input shapes,
`shapes` where given, and for a dim still free the first size convert's shape finding
tries for its role (graphmp.inputs.first_guess; said in the report). Experimental ops
removed in opset 10 are read in their standard forms (graphmp.passes.legalize). The
model is untrusted input: it is read by graphmp.model_io.load_model (never outside its
folder; large weights not read).

A node's precision (`node_precision`):
- MatMulInteger, ConvInteger, QLinearConv, QLinearMatMul: the type of their quantized
  input (INT8 for int8/uint8);
- a compute op whose first two inputs come straight from DequantizeLinear (QDQ): the
  type DequantizeLinear reads (INT8 for int8/uint8; FP8, INT4 likewise);
- else the element type of its first output (FP16, BF16, FP32, FP64), or "unknown"
  where inference cannot tell.
"""
from __future__ import annotations

import collections
import json
import re
from dataclasses import dataclass

import onnx
from onnx import TensorProto

from .cast_cost import COMPUTE_OPS, cast_fields, compute_flops, infer_facts
from .ir import attr_graphs
from .model_io import REASON_MARK, open_model

# Integer compute ops: (the float op whose FLOPs they have, the index of its A and B inputs).
INTEGER_OPS = {"MatMulInteger": ("MatMul", 0, 1), "ConvInteger": ("Conv", 0, 1),
               "QLinearMatMul": ("MatMul", 0, 3), "QLinearConv": ("Conv", 0, 3)}
LABELS = {TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.BFLOAT16: "BF16",
          TensorProto.DOUBLE: "FP64", TensorProto.INT8: "INT8", TensorProto.UINT8: "INT8"}
ORDER = ("FP16", "BF16", "FP8", "INT8", "INT4", "FP32", "FP64")   # report order; others follow by name
# Ops of other domains (com.microsoft's FusedConv, QGemm, Attention, MatMulNBits, ...) that do
# Tensor Core work but are not counted: the report names them.
OTHER_COMPUTE = re.compile("Conv|MatMul|Gemm|Attention")
SHOW_NODES = 5          # FP32 nodes named per op type, and precision changes, in the text summary
SHOW_CHANGES = 20


def precision_label(elem_type) -> str:
    """FP16/BF16/FP32/FP64/INT8 (uint8 too)/FP8/INT4 for an ONNX element type; 'unknown' for none."""
    if not elem_type:
        return "unknown"
    if elem_type in LABELS:
        return LABELS[elem_type]
    name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else str(elem_type)
    return "FP8" if name.startswith("FLOAT8") else "INT4" if name in ("INT4", "UINT4") else name


def _walk(graph, path: str = "main"):
    """(path, GraphProto) of every graph, in graphmp.ir.iter_graphs' order (the index
    is cast_cost's graph index); a subgraph's path names its owner and attribute:
    main/NODE.then_branch (NODE: the node's name, or op_type#k for an unnamed one)."""
    yield path, graph
    for key, n in _node_keys(graph):
        for a in n.attribute:
            for i, g in enumerate(attr_graphs(a)):
                yield from _walk(g, f"{path}/{key}.{a.name}" + (f"[{i}]" if a.type == onnx.AttributeProto.GRAPHS else ""))


def _node_keys(graph):
    """(key, node) per node: its name, or op_type#k (the k-th unnamed node of that op type)."""
    seen = collections.Counter()
    for n in graph.node:
        if n.name:
            yield n.name, n
        else:
            seen[n.op_type] += 1
            yield f"{n.op_type}#{seen[n.op_type] - 1}", n


def node_precision(n, types: dict, producers: dict) -> str:
    """The precision a node computes in (module docstring); producers: {tensor: node}."""
    if n.op_type in INTEGER_OPS:
        return precision_label(types.get(n.input[INTEGER_OPS[n.op_type][1]]))
    if n.op_type in COMPUTE_OPS and len(n.input) >= 2:
        dq = [producers.get(x) for x in n.input[:2]]
        if all(p is not None and p.op_type == "DequantizeLinear" for p in dq):
            return precision_label(types.get(dq[0].input[0]))
    # the output's type; for a compute op where inference stopped before it, its operands'
    # (a Conv's weight is an initializer of the type it computes in)
    out = next((x for x in n.output if x), None)
    operands = list(n.input[:2]) if n.op_type in COMPUTE_OPS else []
    return precision_label(next((types[x] for x in [out, *operands] if x in types), None))


def _flops(n, filled: dict) -> float | None:
    """FLOPs of a compute node (cast_cost.compute_flops; an integer op as its float op)."""
    if n.op_type in INTEGER_OPS:
        op, a, b = INTEGER_OPS[n.op_type]
        if len(n.input) <= b:
            return None
        n = onnx.helper.make_node(op, [n.input[a], n.input[b]], list(n.output[:1]))
    return compute_flops(n, filled)


def _reason(n) -> str | None:
    return next((line[len(REASON_MARK):] for line in n.doc_string.splitlines() if line.startswith(REASON_MARK)), None)


def compute_nodes(graphs: list, facts) -> list[dict]:
    """One entry per Conv/ConvTranspose/MatMul/Gemm/Einsum (and integer form) of the
    standard domain in every graph: graph path, key, op type, precision, FLOPs (None
    where shapes are missing), approximate (a dim unknown, counted as 1), the recorded
    FP32 reason. The one place that says what counts as compute and in which precision:
    an INT8-aware share elsewhere in graphmp can replace it."""
    filled = {x: [d or 1 for d in dims] for x, (dims, _) in facts.shapes.items()}
    producers = {x: n for _, g in graphs for n in g.node for x in n.output}
    out = []
    for path, g in graphs:
        for key, n in _node_keys(g):
            if n.domain not in ("", "ai.onnx") or (n.op_type not in COMPUTE_OPS and n.op_type not in INTEGER_OPS):
                continue
            used = [x for x in list(n.output[:1]) + list(n.input[:4]) if x in facts.shapes]
            out.append({"graph": path, "name": key, "op_type": n.op_type,
                        "precision": node_precision(n, facts.types, producers), "flops": _flops(n, filled),
                        "approximate": any(None in facts.shapes[x][0] for x in used), "reason": _reason(n)})
    return out


def flops_shares(nodes: list[dict]) -> dict:
    """{total, by_precision {label: FLOPs}, share {label: fraction}, approximate, uncounted
    (compute nodes without shapes)} over compute_nodes' entries."""
    by = collections.Counter()
    for e in nodes:
        if e["flops"] is not None:
            by[e["precision"]] += e["flops"]
    total = sum(by.values())
    labels = sorted(by, key=lambda k: (ORDER.index(k) if k in ORDER else len(ORDER), k))
    return {"total": total, "by_precision": {k: by[k] for k in labels},
            "share": {k: by[k] / total for k in labels} if total else {},
            "approximate": any(e["approximate"] for e in nodes),
            "uncounted": sum(e["flops"] is None for e in nodes)}


def _fp32_groups(nodes: list[dict], total: float) -> dict:
    """FP32 compute nodes by op type: {op: {nodes, flops, share, entries [{graph, name, flops, reason}]}},
    the op types with the most FLOPs first."""
    groups: dict = {}
    for e in nodes:
        if e["precision"] != "FP32":
            continue
        g = groups.setdefault(e["op_type"], {"nodes": 0, "flops": 0.0, "entries": []})
        g["nodes"] += 1
        g["flops"] += e["flops"] or 0.0
        g["entries"].append({k: e[k] for k in ("graph", "name", "flops", "reason")})
    for g in groups.values():
        g["share"] = g["flops"] / total if total else None
        g["entries"].sort(key=lambda x: -(x["flops"] or 0.0))
    return dict(sorted(groups.items(), key=lambda kv: (-kv[1]["flops"], kv[0])))


def _input_shapes(model, given: dict, path: str) -> tuple[dict, list, bool]:
    """({input: dims} to infer at, what was assumed (one line each), every input's rank
    known). --shapes first (checked against the declared dims), then the declared dims,
    then for a dim still free the first size graphmp's shape finding would try for its
    role (batch 1, image side 224 or the model's metadata imgsz, sequence 16 tokens, ...:
    graphmp.inputs.first_guess), without a run."""
    from .inputs import first_guess
    shapes, guesses = first_guess(model, given, where=path)
    has_shape = {v.name: v.type.tensor_type.HasField("shape") for v in model.graph.input}
    unranked = [name for name in shapes if not has_shape.get(name, False) and name not in given]
    assumed = [f"{key} ({role}) = {size}" for key, role, size in guesses]
    assumed += [f"{name}: no shape declared, so figures that need it are approximate" for name in unranked]
    return {k: list(v) for k, v in shapes.items() if k not in unranked}, assumed, not unranked


def _legalized(model):
    """The model for shape inference: a copy with the experimental ops ONNX removed in opset
    10 (Crop, ImageScaler, Affine, ...) in their standard forms, as convert reads them
    (graphmp.passes.legalize); onnx's inference stops at them. The rewrite keeps every
    tensor name, so what inference says holds for the original graph's tensors."""
    from .passes.legalize import EXPERIMENTAL, legalize
    if not any(n.op_type in EXPERIMENTAL for _, g in _walk(model.graph) for n in g.node):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    try:
        legalize(copy)
    except Exception:  # noqa: BLE001 - a help for inference only: without it the figures are partial, as said
        return model
    return copy


def _converted_by(model) -> tuple[bool, str]:
    """(graphmp's output, who made it: graphmp's mark, else the producer fields)."""
    meta = {p.key: p.value for p in model.metadata_props}
    if "graphmp" in meta:
        try:
            mark = json.loads(meta["graphmp"])
            return True, f"graphmp {mark.get('version', '?')} (target {mark.get('target', '?')})"
        except (ValueError, AttributeError):
            return True, "graphmp"
    who = f"{model.producer_name} {model.producer_version}".strip()
    return False, who or "unknown (no producer recorded)"


def _node_precisions(graphs: list, facts) -> dict:
    """{(graph path, node key): (op type, precision, recorded FP32 reason or None)} of every
    node but Casts that computes in a float type or is a compute op: what the plan diff
    compares."""
    producers = {x: n for _, g in graphs for n in g.node for x in n.output}
    out = {}
    for path, g in graphs:
        for key, n in _node_keys(g):
            if n.op_type == "Cast":
                continue
            p = node_precision(n, facts.types, producers)
            if p in ("FP16", "BF16", "FP32", "FP64") or n.op_type in COMPUTE_OPS or n.op_type in INTEGER_OPS:
                out[(path, key)] = (n.op_type, p, _reason(n))
    return out


def inspect_model(model, shapes=None) -> tuple[dict, dict]:
    """(the report of one model, its node precisions for plan_diff). model: a path (loaded
    by graphmp.model_io.load_model: checked, weights not read) or a ModelProto; shapes:
    'x:1x3x224x224,...' or {name: dims}."""
    from .inputs import parse_shapes
    given = parse_shapes(shapes)
    model, path, _ = open_model(model, by_reference=True)  # a ModelProto gets a file's checks too
    in_shapes, assumed, ranked = _input_shapes(model, given, path)
    facts, error = infer_facts(_legalized(model), in_shapes, concrete=ranked)
    graphs = list(_walk(model.graph))
    nodes = compute_nodes(graphs, facts)
    flops = flops_shares(nodes)
    precisions = _node_precisions(graphs, facts)
    is_graphmp, who = _converted_by(model)
    rep = {"path": path, "converted_by": who, "graphmp_output": is_graphmp,
           "shapes": in_shapes, "shapes_from": ("--shapes and declared" if given else "declared")
           + (", free dims guessed" if assumed else ""),
           "assumed": assumed, "inference_error": error, "flops": flops,
           "casts": cast_fields(facts, error is None),
           "nodes": dict(sorted(collections.Counter(p for _, p, _ in precisions.values()).items())),
           "fp32_nodes_by_op": dict(collections.Counter(op for op, p, _ in precisions.values() if p == "FP32")
                                    .most_common()),
           "fp32_compute": _fp32_groups(nodes, flops["total"]), "compute_nodes": nodes,
           "uncounted_ops": sorted({f"{n.domain}.{n.op_type}" for _, g in graphs for n in g.node
                                    if n.domain not in ("", "ai.onnx") and OTHER_COMPUTE.search(n.op_type)})}
    return rep, precisions


def plan_diff(first: dict, second: dict, p1: dict, p2: dict) -> dict:
    """Two models' plans side by side: nodes matched by (graph, name) whose precision
    differs (with the FP32 reason either model records), the count of nodes in one only,
    FLOPs shares and Cast bytes of each."""
    common = [k for k in p1 if k in p2]
    changed = [{"graph": k[0], "name": k[1], "op_type": p1[k][0], "first": p1[k][1], "second": p2[k][1],
                "reason": p1[k][2] or p2[k][2]} for k in common if p1[k][1] != p2[k][1]]
    changed.sort(key=lambda e: e["op_type"] not in COMPUTE_OPS and e["op_type"] not in INTEGER_OPS)  # compute first
    s1, s2 = first["flops"]["share"], second["flops"]["share"]
    labels = [k for k in ORDER if k in s1 or k in s2] + sorted((set(s1) | set(s2)) - set(ORDER))
    return {"matched": len(common), "only_in_first": len(p1) - len(common), "only_in_second": len(p2) - len(common),
            "changed": changed, "flops_share": {k: [s1.get(k, 0.0), s2.get(k, 0.0)] for k in labels},
            "casts": [first["casts"]["casts"], second["casts"]["casts"]],
            "cast_bytes": [first["casts"]["bytes"], second["casts"]["bytes"]]}


@dataclass
class InspectReport:
    """What `inspect` found: `models` (one report per model), `diff` (with two models, else
    None). to_dict() is the JSON `graphmp inspect --json` prints; summary() its text."""
    models: list
    diff: dict | None

    def to_dict(self) -> dict:
        return {"schema": "graphmp.inspect", "version": 1, "models": self.models, "diff": self.diff}

    def summary(self) -> str:
        return summary(self.to_dict())


def inspect(model, other=None, shapes=None) -> InspectReport:
    """How much of `model` (a path or ModelProto; any ONNX model, whoever converted it) runs
    in which precision, and with `other` the plan diff of the two (module docstring).
    shapes: 'x:1x3x224x224,...' or {name: dims} for inputs with dynamic dims (else a
    plausible size, said in the report). Nothing is run or written; a bad model or shape
    is a GraphmpError."""
    first, p1 = inspect_model(model, shapes)
    if other is None:
        return InspectReport([first], None)
    second, p2 = inspect_model(other, shapes)
    return InspectReport([first, second], plan_diff(first, second, p1, p2))


def _size(b) -> str:
    return "unknown" if b is None else f"{b / 1e6:.2f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def _gflops(f: float) -> str:
    return next(f"{f / scale:.3g} {unit}FLOPs" for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""))
                if f >= scale or scale == 1)


def _shares_text(shares: dict) -> str:
    return ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items())


def _model_text(m: dict) -> list[str]:
    """The lines of one model: who made it, shapes (and what was assumed), the FLOPs by
    precision, the Casts, the FP32 compute nodes by op type with their reasons."""
    from .cast_cost import shapes_label
    f, c = m["flops"], m["casts"]
    lines = [f"{m['path']} (made by {m['converted_by']})",
             f"  shapes: {shapes_label(m['shapes']) or 'no inputs'} ({m['shapes_from']})"]
    if m["assumed"]:
        lines.append(f"  assumed: {'; '.join(m['assumed'])} (give --shapes NAME:DIMS for the real sizes)")
    if m["inference_error"]:
        lines.append(f"  shape inference failed ({m['inference_error']}): the figures below are partial")
    approx = "~" if f["approximate"] else ""
    if f["total"]:
        lines.append(f"  compute: {approx}{_gflops(f['total'])} in Conv/ConvTranspose/MatMul/Gemm/Einsum: "
                     f"{_shares_text(f['share'])}")
    else:
        lines.append("  compute: no Conv/ConvTranspose/MatMul/Gemm/Einsum FLOPs found")
    if f["uncounted"]:
        lines.append(f"  {f['uncounted']} compute node(s) not counted: shapes unknown")
    if m["uncounted_ops"]:
        lines.append(f"  not counted (ops of other domains): {', '.join(m['uncounted_ops'])}")
    lines.append(f"  casts: {c['casts']}, " + (
        f"{'~' if c['approximate'] else ''}{_size(c['bytes'])} per inference (boundary {_size(c['boundary_bytes'])}, "
        f"inside {_size(c['inside_bytes'])})" if c["bytes"] is not None else f"bytes unknown ({c['unavailable']})"))
    lines.append("  nodes: " + (", ".join(f"{n} {k}" for k, n in m["nodes"].items()) or "none in a float type"))
    if m["fp32_nodes_by_op"]:
        lines.append("  FP32 nodes by op type: " + ", ".join(f"{op} {n}" for op, n in m["fp32_nodes_by_op"].items()))
    lines += _fp32_text(m)
    return lines


def _fp32_text(m: dict) -> list[str]:
    groups = m["fp32_compute"]
    if not groups:
        return ["  FP32 compute nodes: none"]
    lines = [f"  FP32 compute nodes: {sum(g['nodes'] for g in groups.values())}"]
    for op, g in groups.items():
        share = f", {100 * g['share']:.1f}% of the FLOPs" if g["share"] is not None else ""
        lines.append(f"    {op} x{g['nodes']}{share}:")
        for e in g["entries"][:SHOW_NODES]:
            where = "" if e["graph"] == "main" else f" in {e['graph']}"
            why = e["reason"] or ("no reason recorded" if m["graphmp_output"] else "")
            lines.append(f"      {e['name']}{where}" + (f": {why}" if why else ""))
        if g["nodes"] > SHOW_NODES:
            lines.append(f"      ... {g['nodes'] - SHOW_NODES} more (--json lists all)")
    return lines


def _diff_text(d: dict) -> list[str]:
    """The plan diff: FLOPs shares and Casts side by side, the nodes whose precision differs."""
    lines = ["plan diff (first -> second; nodes matched by graph and name):"]
    for k, (a, b) in d["flops_share"].items():
        lines.append(f"  {k + ' FLOPs':<12} {100 * a:6.1f}% -> {100 * b:6.1f}%")
    lines.append(f"  Casts        {d['casts'][0]} ({_size(d['cast_bytes'][0])}) -> "
                 f"{d['casts'][1]} ({_size(d['cast_bytes'][1])}) per inference")
    lines.append(f"  precision differs at {len(d['changed'])} of {d['matched']} matched nodes"
                 + (f"; {d['only_in_first']} in the first only, {d['only_in_second']} in the second only"
                    if d["only_in_first"] or d["only_in_second"] else ""))
    for e in d["changed"][:SHOW_CHANGES]:
        where = "" if e["graph"] == "main" else f" in {e['graph']}"
        why = f" ({e['reason']})" if e["reason"] else ""
        lines.append(f"    {e['op_type']} {e['name']}{where}: {e['first']} -> {e['second']}{why}")
    if len(d["changed"]) > SHOW_CHANGES:
        lines.append(f"    ... {len(d['changed']) - SHOW_CHANGES} more (--json lists all)")
    return lines


def summary(data: dict) -> str:
    """InspectReport.to_dict() as text: each model, then the plan diff."""
    lines = []
    for m in data["models"]:
        lines += _model_text(m)
    if data["diff"] is not None:
        lines += _diff_text(data["diff"])
    return "\n".join(lines)

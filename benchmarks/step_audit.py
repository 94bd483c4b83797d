#!/usr/bin/env python
"""Static audit of a graphmp training step (a run folder from `graphmp train-graph` or
build_step) at a fixed batch: node counts by phase and op type, and the bytes moved by the
non-GEMM nodes (the memory-bound part of the step: elementwise, normalization, the optimizer).

    python benchmarks/step_audit.py RUN_DIR [RUN_DIR...] --batch 4 [--json out.json]
    from step_audit import audit_run; audit_run(run_dir, batch=4)

Phases: update = the nodes named update/... (the flat state's views, first in the graph) and
the nodes after the backward (optimizer, loss scale, gating); forward = the first train.json
nodes.forward of the others (forward + loss); backward = the nodes named grad/.... Shapes: onnx shape
inference (no data propagation: it took 14 GB on a ResNet-18 step; the run-time shape values below stand in for it) with the batch dims of the data inputs and labels pinned to --batch.
Bytes of a node = the sizes of all its inputs and outputs; GEMM-like nodes (Conv,
ConvTranspose, MatMul, Gemm, Einsum) are left out (compute-bound), as are nodes that move no
data (Constant, Shape, Size and the views Reshape/Squeeze/Unsqueeze/Flatten/Identity). A node
with a shape inference cannot resolve is counted in `nodes_unknown_shapes` and adds only its
known tensors.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np
import onnx
import onnx.numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

GEMM_LIKE = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum")
NO_TRAFFIC = ("Constant", "Shape", "Size", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten")
PHASES = ("forward", "backward", "update")
BOOL_OUT = ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN", "IsInf")
ELEMENTWISE = BOOL_OUT + ("Add", "Sub", "Mul", "Div", "Pow", "Where", "Neg", "Sqrt", "Reciprocal", "Abs", "Exp", "Log",
                          "Relu", "Sigmoid", "Tanh", "Erf", "Max", "Min", "Sum", "Mean", "Cast", "Clip")


def _pinned_model(model, batch_dims: set, batch: int):
    """A copy of `model` with the dims named in `batch_dims` set to `batch`, shape-inferred."""
    import onnx
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for v in list(m.graph.input) + list(m.graph.output):
        for d in v.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in batch_dims:
                d.dim_value = batch  # setting the value clears the dim_param (a oneof)
    del m.graph.value_info[:]
    return onnx.shape_inference.infer_shapes(m, data_prop=False)


def _shape_values(m, run_dir: str, meta: dict, batch: int) -> dict:
    """{tensor: value} of the small int64 tensors the graph computes at run time (shapes,
    Slice bounds, Pad amounts), from one ORT run of the step on a zero batch of size `batch`
    with the run's initial state. Shape inference cannot follow some of them (graphmp's
    backward computes shapes from Shape -> Add -> Slice); as constants it can."""
    import onnxruntime as ort
    from onnx import TensorProto
    sys.path.insert(0, REPO)
    from graphmp.train import flat
    from graphmp.train.loop import latest_state
    known = {t.name for t in m.graph.initializer} | {i.name for i in m.graph.input}
    small = {v.name for v in m.graph.value_info if v.type.tensor_type.elem_type == TensorProto.INT64
             and v.type.tensor_type.HasField("shape") and len(v.type.tensor_type.shape.dim) <= 1}
    wanted = [o for n in m.graph.node if n.op_type != "Constant" for o in n.output if o in small and o not in known]
    probe = onnx.ModelProto()
    probe.CopyFrom(m)
    probe.graph.output.extend([onnx.helper.make_empty_tensor_value_info(t) for t in wanted])
    feeds = flat.pack(meta, latest_state(run_dir)[0])  # the step graph's own state (flat buffers)
    dims = {k: [batch if isinstance(d, str) else d for d in v] for k, v in meta["inputs"].items()}
    dims[meta["label"]["name"]] = [batch if isinstance(d, str) else d for d in meta["label"]["shape"]]
    types = dict(meta.get("input_types", {}), **{meta["label"]["name"]: meta["label"]["dtype"]})
    for k, shape in dims.items():
        feeds[k] = np.zeros(shape, types.get(k, "float32"))
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip(wanted, sess.run(wanted, feeds)))


def _with_constants(m, values: dict):
    """A copy of m where every node whose outputs are all in `values` is replaced by
    initializers holding them, shape-inferred again."""
    out = onnx.ModelProto()
    out.CopyFrom(m)
    keep = [n for n in out.graph.node if not (n.output and all(o in values for o in n.output))]
    gone = {o for n in out.graph.node if n not in keep for o in n.output}
    del out.graph.node[:]
    out.graph.node.extend(keep)
    out.graph.initializer.extend(onnx.numpy_helper.from_array(np.asarray(values[t]), t) for t in gone)
    del out.graph.value_info[:]
    return onnx.shape_inference.infer_shapes(out, data_prop=False)


def _tensor_shapes(m) -> dict:
    """{tensor name: (bytes per element, dims)} for every tensor whose shape and type
    inference fully resolved."""
    from onnx import helper
    out = {}

    def put(name, elem_type, dims):
        if dims is not None and all(isinstance(d, int) and d >= 0 for d in dims):
            out[name] = (helper.tensor_dtype_to_np_dtype(elem_type).itemsize if elem_type else 4, list(dims))

    for t in m.graph.initializer:
        put(t.name, t.data_type, list(t.dims))
    for v in list(m.graph.input) + list(m.graph.value_info) + list(m.graph.output):
        tt = v.type.tensor_type
        if tt.HasField("shape"):
            put(v.name, tt.elem_type, [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim])
    for n in m.graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    put(n.output[0], a.t.data_type, list(a.t.dims))
    return out


def _fill_elementwise(m, shapes: dict) -> None:
    """Give the outputs of elementwise nodes that shape inference left unknown the broadcast
    shape of their inputs (when those are known): graphmp's backward computes some shapes at
    run time (Shape -> Slice), which data propagation does not always follow."""
    from onnx import helper
    for n in m.graph.node:
        if n.op_type not in ELEMENTWISE or not n.output or n.output[0] in shapes:
            continue
        ins = [shapes.get(t) for t in n.input if t]
        if not ins or any(s is None for s in ins):
            continue
        try:
            dims = list(np.broadcast_shapes(*[tuple(s[1]) for s in ins]))
        except ValueError:
            continue
        if n.op_type in BOOL_OUT:
            size = 1
        elif n.op_type == "Cast":
            to = next(a.i for a in n.attribute if a.name == "to")
            size = helper.tensor_dtype_to_np_dtype(to).itemsize
        else:
            size = ins[-1][0]  # Where: the value inputs, not the bool condition
        shapes[n.output[0]] = (size, dims)


def _phases(m, n_forward: int) -> list:
    """The phase of each node. The flat state's views (nodes named update/..., put first in
    the graph after nodes.forward was counted) belong to the update; of the other nodes the
    first n_forward are the forward + loss."""
    phases, forward = [], 0
    for n in m.graph.node:
        if n.name.startswith("update/"):
            phases.append("update")
        elif forward < n_forward:
            phases.append("forward")
            forward += 1
        else:
            phases.append("backward" if n.name.startswith("grad/") else "update")
    return phases


def audit_run(run_dir: str, batch: int, top: int = 15, run_shapes: bool = True) -> dict:
    """The audit of run_dir's step graph at `batch` (see the module docstring). Needs a run
    folder with train.json and its step model; returns a JSON-ready dict: nodes (total and by
    phase), nodes by op type and phase (the `top` most), MB moved by the non-GEMM nodes (total,
    by phase, by op type and phase), Cast MB, and the count of nodes with unknown shapes.
    run_shapes: first compute the graph's run-time shape values with one ORT run of the step
    (_shape_values; about one step's time), so that inference resolves every shape it can."""
    with open(os.path.join(run_dir, "train.json")) as f:
        meta = json.load(f)
    model = onnx.load(os.path.join(run_dir, meta.get("step_model", "step.onnx")))
    shapes = list(meta["inputs"].values()) + [meta["label"]["shape"]]
    batch_dims = {s[0] for s in shapes if s and isinstance(s[0], str)}
    m = _pinned_model(model, batch_dims, batch)
    shapes = _tensor_shapes(m)
    if run_shapes:
        values = _shape_values(m, run_dir, meta, batch)
        shapes.update(_tensor_shapes(_with_constants(m, values)))
        shapes.update({k: (8, list(np.shape(v))) for k, v in values.items()})
    _fill_elementwise(m, shapes)
    size = {k: b * int(np.prod(d, dtype=np.int64)) for k, (b, d) in shapes.items()}
    phase = _phases(m, meta["nodes"]["forward"])
    nodes, moved, unknown = collections.Counter(), collections.Counter(), 0
    for n, ph in zip(m.graph.node, phase):
        nodes[(n.op_type, ph)] += 1
        if n.op_type in GEMM_LIKE or n.op_type in NO_TRAFFIC:
            continue
        names = [t for t in list(n.input) + list(n.output) if t]
        unknown += any(t not in size for t in names)
        moved[(n.op_type, ph)] += sum(size.get(t, 0) for t in names)
    mb = 1e6
    by_phase = {p: sum(v for (_, ph), v in moved.items() if ph == p) for p in PHASES}
    return {"run": os.path.abspath(run_dir), "batch": batch, "precision": meta["config"].get("precision"),
            "nodes": {"total": len(phase), **{p: phase.count(p) for p in PHASES}},
            "nodes_by_op_phase": {f"{op}:{ph}": c for (op, ph), c in nodes.most_common(top)},
            "gemm_like_nodes": sum(c for (op, _), c in nodes.items() if op in GEMM_LIKE),
            "non_gemm_mb": round(sum(moved.values()) / mb, 1),
            "non_gemm_mb_by_phase": {p: round(v / mb, 1) for p, v in by_phase.items()},
            "non_gemm_mb_by_op_phase": {f"{op}:{ph}": round(v / mb, 1) for (op, ph), v in moved.most_common(top)},
            "cast_mb": round(sum(v for (op, _), v in moved.items() if op == "Cast") / mb, 1),
            "nodes_unknown_shapes": unknown, "shapes": "run-time shape values" if run_shapes else "inference only"}


def summary(a: dict) -> str:
    return (f"{os.path.basename(a['run'])} (batch {a['batch']}): nodes {a['nodes']}, non-GEMM {a['non_gemm_mb']} MB "
            f"{a['non_gemm_mb_by_phase']}, Casts {a['cast_mb']} MB, unknown shapes {a['nodes_unknown_shapes']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--top", type=int, default=15, help="how many op type:phase rows to list")
    ap.add_argument("--no-run", action="store_true", help="shape inference only (no ORT run for the run-time "
                    "shape values; some backward shapes stay unknown)")
    ap.add_argument("--json", help="write {run folder name: audit} here")
    a = ap.parse_args(argv)
    out = {}
    for run in a.run_dirs:
        out[os.path.basename(os.path.abspath(run))] = res = audit_run(run, a.batch, a.top, run_shapes=not a.no_run)
        print(summary(res), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

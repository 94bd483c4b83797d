"""graphmp.pad: Tensor Core channel padding as a command of its own (FP32 stays FP32).

    load -> PAD_STEPS -> save (atomic)
         -> optional validation: ONNX Runtime outputs before vs after on the same inputs

PAD_STEPS (below) is a list of Steps like convert's PIPELINE, with the same contracts
(the PadState fields each step needs and gives, checked with GRAPHMP_DEBUG=1 and in the
tests): canonical constants and node names, alignment before, the padder
(graphmp/passes/pad/, entry point pad_channels), topological order, alignment after.
`graphmp.convert(..., pad_channels=8)` runs the same steps (pad_model) before converting.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import numpy as np
import onnx

from .version import __version__
from .errors import GraphmpError
from .load_check import Gate, LoadCheckFailed
from .load_check import summary_line as load_check_line
from .names import printable_lines, shown
from .model_io import is_external, iter_graphs, load_model, materialize, model_weight_bytes, open_model
from .save import save_model
from .ir import Names, name_nodes
from .policy import PAD_MULTIPLES as MULTIPLES
from .passes import PassResult, Step, run_steps
from .passes.pad import pad_channels
from .passes.prepare import constants_to_initializers, initializers_out_of_inputs

PAD_KEY = "graphmp.pad"


class PadReport:
    def __init__(self, data: dict, model=None):
        self.data, self.model = data, model

    def to_dict(self) -> dict:
        return self.data

    def __getitem__(self, k):
        return self.data[k]

    def summary(self) -> str:
        return summarize(self.data)


def summarize(d: dict) -> str:
    """Text for a padding report (also used by convert --pad-channels)."""
    lines = [f"  padding to multiples of {d['multiple']}: {len(d['padded'])} layer dims padded, "
             f"{len(d['unaligned'])} left unaligned, {d['slice_nodes']} Slice/Gather nodes where padded "
             "channels become observable"]
    for p in d["padded"]:
        lines.append(f"    {shown(p['node'])} ({p['op_type']}) {p['dim']}: {p['old']} -> {p['new']}")
    for s in d["stem"]:
        lines.append(f"    stem {s['node']}: {s['choice']}")
    if d["flops_model_before"]:
        added = d["flops_padded_layers_after"] - d["flops_padded_layers_before"]
        lines.append(f"  added FLOPs: {added / 1e6:.2f} M ({100 * added / d['flops_model_before']:.2f}% of the "
                     "Conv/Gemm/MatMul FLOPs; symbolic dims counted as 1)")
    lines.append(f"  added weight bytes: {d['weight_bytes_added'] / 1e6:.3f} MB"
                 + (f" ({100 * d['weight_bytes_added'] / d['weight_bytes_before']:.2f}%)" if d.get("weight_bytes_before") else ""))
    for u in d["unaligned"]:
        lines.append(f"    unaligned {shown(u['node'])} ({u['op_type']}) {u['dim']}={u['value']}: {u['reason']}")
    if "aligned_after" in d:
        a, b = d["aligned_before"], d["aligned_after"]
        lines.append(f"  weight layers with every dim a multiple of {d['multiple']}: {a['aligned']}/{a['weight_layers']} "
                     f"({a['fraction']:.2f}) -> {b['aligned']}/{b['weight_layers']} ({b['fraction']:.2f})")
    if d.get("needs_copy"):
        lines.append(f"  {len(d['needs_copy'])} layer(s) left unaligned because padding them would need a runtime "
                     "Pad node (a copy per run): " + ", ".join(u["node"] for u in d["needs_copy"]))
    for w in d.get("warnings", []):
        lines.append(f"  warning: {w}")
    if load_check_line(d.get("load_check")):
        lines.append(load_check_line(d.get("load_check")))
    return printable_lines(lines)


def _const_shapes(graph) -> dict:
    """Shapes of the constants a weight layer can read: initializers, Constant nodes and
    Transpose/Reshape/Concat/Cast/Identity/DequantizeLinear of those."""
    from onnx import helper, numpy_helper
    shapes = {t.name: list(t.dims) for t in graph.initializer}
    values = {}
    for n in graph.node:
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        ins = [shapes.get(x) for x in n.input]
        if n.op_type == "Constant" and "value" in a:
            shapes[n.output[0]] = list(a["value"].dims)
            values[n.output[0]] = numpy_helper.to_array(a["value"])
        elif not n.input or any(s is None for s in ins[:1]):
            continue
        elif n.op_type in ("Cast", "Identity", "DequantizeLinear"):
            shapes[n.output[0]] = ins[0]
        elif n.op_type == "Transpose":
            perm = a.get("perm", list(range(len(ins[0])))[::-1])
            shapes[n.output[0]] = [ins[0][p] for p in perm]
        elif n.op_type == "Concat" and all(s is not None for s in ins):
            ax = a["axis"] % len(ins[0])
            shapes[n.output[0]] = [sum(s[ax] for s in ins) if i == ax else d for i, d in enumerate(ins[0])]
        elif n.op_type == "Reshape" and len(n.input) > 1:
            t = next((t for t in graph.initializer if t.name == n.input[1]), None)
            shape = numpy_helper.to_array(t) if t is not None and not is_external(t) else values.get(n.input[1])
            if shape is not None and 0 not in shape.tolist() and shape.tolist().count(-1) == 0:
                shapes[n.output[0]] = [int(d) for d in shape]
    return shapes


def alignment(model: onnx.ModelProto, multiple: int) -> dict:
    """How many weight layers of the main graph have every Tensor Core dim a multiple of
    `multiple`: Conv (output channels; input channels per group unless depthwise; 4 input
    channels count, as the stem rule pads to 4 for cuDNN's C=4 first-layer kernels), ConvTranspose (both), Gemm and
    MatMul with a constant 2-D B (K and N). Read from the weights' shapes."""
    shapes = _const_shapes(model.graph)
    layers, unaligned = 0, []
    for n in model.graph.node:
        if n.op_type not in ("Conv", "ConvTranspose", "Gemm", "MatMul") or len(n.input) < 2:
            continue
        w = shapes.get(n.input[1])
        if not w or (n.op_type in ("Gemm", "MatMul") and len(w) != 2):
            continue
        group = next((a.i for a in n.attribute if a.name == "group"), 1)
        if n.op_type == "Conv":
            dims = [w[0]] + ([] if w[1] == 1 and group > 1 else [w[1]] if w[1] != 4 else [])
        elif n.op_type == "ConvTranspose":
            dims = [w[0], w[1]]
        else:
            dims = list(w)
        layers += 1
        if any(d % multiple for d in dims):
            unaligned.append(f"{n.name} ({n.op_type} {'x'.join(map(str, w))})")
    return {"weight_layers": layers, "aligned": layers - len(unaligned),
            "fraction": (layers - len(unaligned)) / layers if layers else 1.0, "unaligned": unaligned}


def _sort(model: onnx.ModelProto) -> None:
    """Every graph in topological order (the source's nodes may come in any order; the
    checker wants them sorted), as convert's last pass does."""
    from .ir import Graph
    root = Graph(model.graph, None, "main")
    for g in root.walk():
        g.toposort()
    root.write_back()


def _outputs_off_initializers(model: onnx.ModelProto) -> int:
    """A graph output that is an initializer is read through an Identity of it, so that
    padding the weight (which changes its shape) never changes what the output declares;
    the output declares the weight's own type and shape (what it really is). Returns how
    many outputs."""
    inits = {t.name: t for t in model.graph.initializer}
    moved = 0
    for v in model.graph.output:
        t = inits.get(v.name)
        if t is not None:
            v.CopyFrom(onnx.helper.make_tensor_value_info(v.name, t.data_type, list(t.dims)))
            t.name = f"{v.name}.value"
            model.graph.node.insert(0, onnx.helper.make_node("Identity", [t.name], [v.name], name=f"{v.name}.output"))
            moved += 1
    return moved


@dataclass
class PadState:
    """One padding run: its options and the fields PAD_STEPS need and give."""
    model: onnx.ModelProto
    base_dir: str | None
    multiple: int
    stem: str = "auto"
    max_overhead: float = 0.5
    warnings: list = field(default_factory=list)
    names: Names | None = None              # every node of every graph has a unique name
    weight_bytes_before: int | None = None
    aligned_before: dict | None = None      # alignment() before padding
    padding: dict | None = None             # the padder's report (pad_channels)
    aligned_after: dict | None = None


def _canonical(st: PadState) -> PassResult:
    """Initializers out of the graph inputs, float Constants as initializers, graph outputs
    off initializers, every node named: what the padder's walk and its report rely on."""
    moved = initializers_out_of_inputs(st.model)
    if moved:
        st.warnings.append(f"{moved} initializers were also graph inputs; they are now constants (so their "
                           "weights can be padded; ONNX Runtime recommends the same)")
    constants = constants_to_initializers(st.model)
    outputs = _outputs_off_initializers(st.model)
    st.names = Names(st.model)
    named = name_nodes(st.model, st.names)
    return PassResult(changed=bool(moved or constants or outputs or named))


def _measure_before(st: PadState) -> PassResult:
    st.weight_bytes_before = model_weight_bytes(st.model)
    st.aligned_before = alignment(st.model, st.multiple)
    return PassResult(changed=False)


def _pad_channels(st: PadState) -> PassResult:
    st.padding = pad_channels(st.model, st.base_dir, st.multiple, st.stem, st.max_overhead)
    return PassResult(changed=bool(st.padding["padded"] or st.padding["stem"] or st.padding["slice_nodes"]))


def _sort_model(st: PadState) -> PassResult:
    _sort(st.model)
    return PassResult(changed=True)


def _measure_after(st: PadState) -> PassResult:
    st.aligned_after = alignment(st.model, st.multiple)
    return PassResult(changed=False)


# The padding steps in order, with their contracts (PadState fields), as convert.PIPELINE.
PAD_STEPS = [
    Step(None, _canonical, needs=("model",), gives=("names",)),            # constants, node names
    Step(None, _measure_before, needs=("names",), gives=("weight_bytes_before", "aligned_before")),
    Step(None, _pad_channels, needs=("names",), gives=("padding",)),       # the padder (passes/pad/)
    Step(None, _sort_model, needs=("padding",)),                            # topological order, written back
    Step(None, _measure_after, needs=("padding",), gives=("aligned_after",)),
]


def pad_model(model: onnx.ModelProto, base_dir: str | None, multiple: int, stem: str = "auto",
              max_overhead: float = 0.5, check: bool | None = None) -> dict:
    """Pad an in-memory model (modified in place) and return the report. check: the
    steps' contracts (None: with GRAPHMP_DEBUG=1 and in the tests)."""
    if multiple not in MULTIPLES:
        raise GraphmpError(f"--multiple must be one of {', '.join(map(str, MULTIPLES))}, not {multiple}")
    if stem not in ("auto", "off"):
        raise GraphmpError(f"stem must be 'auto' or 'off', not '{stem}'")
    st = PadState(model, base_dir, multiple, stem, max_overhead)
    for _ in run_steps(st, PAD_STEPS, check):
        pass
    rep = st.padding
    rep["aligned_before"], rep["aligned_after"] = st.aligned_before, st.aligned_after
    rep["needs_copy"] = [u for u in rep["unaligned"] if u.get("needs_copy")]
    rep["weight_bytes_before"] = st.weight_bytes_before
    rep["weight_bytes_added"] = model_weight_bytes(model) - st.weight_bytes_before
    rep["warnings"] = st.warnings
    meta = model.metadata_props.add()
    meta.key, meta.value = PAD_KEY, json.dumps({"version": __version__, "multiple": multiple})
    return rep


def pad(src, dst=None, *, multiple: int = 8, stem: str = "auto", max_overhead: float = 0.5,
        external_data: bool | None = None, validate: bool = False, shapes=None, seed: int = 0,
        load_check: bool = True) -> PadReport:
    """Pad Conv channels and GEMM dimensions of `src` (path or ModelProto) to `multiple`.

    dst: output path (atomic; the input is never touched) or None to get the model in
    `report.model`. validate: check the padded model (full checker, ONNX Runtime load), then
    run ONNX Runtime on the original and the padded model with the same generated inputs
    (dynamic dims from `shapes` or a trial run) and record the max abs difference per output.
    load_check: dst is written only after ONNX Runtime opened and ran it in a child process
    (graphmp/load_check.py; inputs generated, `shapes` for the dynamic dims); else
    LoadCheckFailed, with the report in its `.report`, and nothing is written."""
    t0 = time.perf_counter()
    model, path, base_dir = open_model(src, dst)
    if validate and shapes is not None:  # a bad --shapes is an error before anything is written
        from .inputs import check_shapes, input_specs, parse_shapes
        shapes = parse_shapes(shapes)
        check_shapes(input_specs(model), shapes, path)
    rep = pad_model(model, base_dir, multiple, stem, max_overhead)
    rep.update(source=path, output=os.fspath(dst) if dst is not None else None)
    had_external = any(is_external(t) for g in iter_graphs(model.graph) for t in g.initializer)
    if dst is not None:
        gate = Gate(shapes=shapes, shown_as=os.fspath(dst)) if load_check else None
        try:
            save_model(model, os.fspath(dst), base_dir, None, had_external if external_data is None else external_data,
                       before_commit=gate)
        except LoadCheckFailed as e:
            rep.update(load_check=e.result, written=False, seconds=time.perf_counter() - t0)
            e.report = PadReport(rep)
            raise
        rep["load_check"] = gate.result if gate is not None else {"skipped": "--no-load-check"}
        out = os.fspath(dst)
    else:
        for g in iter_graphs(model.graph):
            for t in g.initializer:
                materialize(t, base_dir, None)
        out = model
    if validate:
        try:
            rep["validation"] = validate_padding(src, out, shapes, seed)
        except GraphmpError as e:  # it could not run (no input shapes, a run limit): say what stays on disk
            if dst is None:
                raise
            raise GraphmpError(f"{e}; the padded model was written to {os.fspath(dst)} (not validated)") from None
    rep["seconds"] = time.perf_counter() - t0
    return PadReport(rep, None if dst is not None else model)


def validate_padding(ref, padded, shapes=None, seed: int = 0) -> dict:
    """Validity of the padded model, then ONNX Runtime outputs of the original and the
    padded model on the same inputs (batch 2 where the model allows it)."""
    from .check import validity
    from .inputs import find_shapes
    from .model_runs import runner
    valid = validity(padded, ref)
    if not valid["valid"]:
        return {"validity": valid, "outputs": {}, "shapes_unchanged": False, "max_abs": float("inf"), "inputs": None}
    ref_model = load_model(ref) if isinstance(ref, (str, os.PathLike)) else ref
    run_ref = runner(ref)
    plan = find_shapes(ref_model, run_ref, shapes, where="pad --validate")
    feeds = plan.feeds(seed, batch=2 if plan.batch_free else None)
    a = run_ref(feeds)
    b = runner(padded)(feeds)
    outs = {}
    for k, v in a.items():
        w = b[k]
        outs[k] = {"shape_before": list(v.shape), "shape_after": list(w.shape),
                   "max_abs": float(np.max(np.abs(v.astype(np.float64) - w.astype(np.float64)))) if v.size else 0.0,
                   "ref_max_abs": float(np.max(np.abs(v))) if v.size else 0.0}
    return {"validity": valid, "inputs": plan.describe(2 if plan.batch_free else None), "outputs": outs,
            "shapes_unchanged": all(o["shape_before"] == o["shape_after"] for o in outs.values()),
            "max_abs": max((o["max_abs"] for o in outs.values()), default=0.0)}

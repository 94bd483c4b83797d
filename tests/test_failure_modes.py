"""One test (or a few) per case of docs/failure_modes.md.

For every case (models in tests/cases.py) the converted model must
  * pass ``onnx.checker.check_model(full_check=True)`` and, where the case has no
    custom op, ``onnx.shape_inference.infer_shapes(strict_mode=True)``;
  * load and run in ONNX Runtime (CPU);
  * agree, evaluated FP16-faithfully (``graphmp.model_runs.run_reference``), with the FP32
    source run by ONNX Runtime, within the tolerance stated in ``TOL`` (and hold no
    inf/NaN where FP32 has none);
  * keep graph input/output names, dtypes and shapes (keep_io_types=True default);
  * be a fixed point: converting the converted model again changes nothing;
plus the case-specific assertion that fails if that converter bug comes back.

Tolerance: |fp16_faithful - fp32| <= atol_eff + rtol * |fp32|, with
atol_eff = max(atol, atol_of_max * max|fp32|) for outputs whose scale is not O(1).
The ReferenceEvaluator rounds after every scalar op (numpy half arithmetic), so an FP16
MatMul with K terms is off by ~sqrt(K) * 2^-11 relative: with K <= 64 and O(1) values
1e-2 is a safe, still meaningful bound (a wrong dtype/clamp/inf gives errors >> 1e-2).
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time
from typing import NamedTuple

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import numpy_helper as nph
from onnx.reference import ReferenceEvaluator

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import cases  # noqa: E402

F32, F16 = TP.FLOAT, TP.FLOAT16
FLOATS = {TP.FLOAT, TP.FLOAT16, TP.DOUBLE, TP.BFLOAT16}
SHORT = {TP.FLOAT: "f32", TP.FLOAT16: "f16", TP.DOUBLE: "f64", TP.BFLOAT16: "bf16",
         TP.INT64: "i64", TP.INT32: "i32", TP.BOOL: "bool", TP.UINT8: "u8", TP.INT8: "i8"}


# =========================================================================== graphmp
def graphmp():
    """Imported lazily so that this file collects while graphmp is being written."""
    import graphmp as g
    return g


def run_reference(model, feeds):
    from graphmp.model_runs import run_reference as rr
    return rr(model, feeds)


# =========================================================================== tolerances
class Tol(NamedTuple):
    atol: float = 1e-2
    rtol: float = 1e-2
    atol_of_max: float = 0.0


DEFAULT_TOL = Tol()
TOL = {
    # Convs (K = 27..36) + linear Resize, O(1) values.
    "01_resize_scales": Tol(1e-2, 1e-2),
    # three chained FP16 MatMuls (K = 16), outputs up to ~5.
    "02_existing_cast_to_float": Tol(2e-2, 1e-2),
    # y_exp / y_pow are FP32 islands (exact-ish); y_mm is one FP16 MatMul.
    "03_shared_initializer": Tol(1e-2, 1e-2),
    # output ~ 800 = sum of squares of FP16 MatMul outputs*300: ~2*2^-11 relative.
    "04_cascaded_casts": Tol(1e-2, 1e-2),
    # output ~ 7e6, same reasoning; inf if the overflow is not caught.
    "05_activation_overflow": Tol(1.0, 1e-2),
    # FP32-kept paths are exact to ~4e-3 (x + 70000 - 70000 in fp32); 20000 - x has an
    # FP16 step of 16 if computed in FP16 (< 1e-2 relative); clamping to 1e4 fails.
    "06_out_of_range_constants": Tol(1e-2, 1e-2),
    "09a_custom_op_no_schema": Tol(1e-2, 1e-2),
    "09b_com_microsoft_ops": Tol(1e-2, 1e-2),
    # 3 loop iterations of MatMul/Softmax/residual, values <= ~7 (scan sums).
    "10_control_flow": Tol(2e-2, 1e-2),
    "11_unsorted_nodes": Tol(1e-2, 1e-2),
    "12_dtype_attributes": Tol(1e-2, 1e-2),
    "13_output_consumed_and_empty": Tol(1e-2, 1e-2),
    "14_names": Tol(1e-2, 1e-2),
    "15_existing_fp16_parts": Tol(1e-2, 1e-2),
    # means (0.5) must be exact-ish: the count path must stay FP32 (inf/0 otherwise);
    # y_scaled = FP16 MatMul output (abs err ~1e-3) * 90000: 0.2% of its max.
    "16_integer_count_cast": Tol(1e-3, 1e-3, 2e-3),
    # y_risky ~ 7e6 (relative), y_benign / y_conv O(1).
    "17_search_robustness": Tol(1e-2, 1e-2),  # y_risky ~ 1e9: relative
    "19_dynamic_batch": Tol(1e-2, 1e-2),
    "07_external_data": Tol(1e-2, 1e-2),
    "08_large_model_scaled": Tol(1e-2, 1e-2),
}

#: extra convert() keyword arguments per case (calibration is always the case's feeds)
CONVERT_KW = {
    "04_cascaded_casts": {"fp32_nodes": cases.CASE_04_BLOCKED},
}


# =========================================================================== helpers
def ort_run(model_or_path, feeds):
    """ONNX Runtime CPU, FP32 reference (own helper: independent of graphmp)."""
    src = model_or_path if isinstance(model_or_path, (str, os.PathLike)) else \
        model_or_path.SerializeToString()
    sess = ort.InferenceSession(str(src) if isinstance(src, os.PathLike) else src,
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    inputs = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in inputs})))


def ref_eval(model, feeds):
    """onnx.reference with the custom-op kernels of cases.py (for the custom-op cases)."""
    r = ReferenceEvaluator(model, new_ops=cases.CUSTOM_OPS)
    return dict(zip(r.output_names, r.run(None, feeds)))


def walk_graphs(graph, path="main"):
    """Yield (path, graph, parent_path) for the graph and all nested subgraphs."""
    stack = [(path, graph, None)]
    while stack:
        p, g, parent = stack.pop(0)
        yield p, g, parent
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    stack.append((f"{p}/{n.name or n.op_type}.{a.name}", a.g, p))
                for j, sg in enumerate(a.graphs):
                    stack.append((f"{p}/{n.name or n.op_type}.{a.name}{j}", sg, p))


def all_nodes(model):
    for p, g, _ in walk_graphs(model.graph):
        for n in g.node:
            yield p, n


def _const_elem(node):
    for a in node.attribute:
        if a.name == "value":
            return a.t.data_type
        if a.name in ("value_float", "value_floats"):
            return F32
        if a.name in ("value_int", "value_ints"):
            return TP.INT64
    return 0


def type_map(model) -> dict:
    """tensor name -> elem type, model-wide (ONNX forbids shadowing names in subgraphs),
    from non-strict shape inference plus initializers, Constants and Cast `to`."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - fall back to what the model declares
        inferred = model
    tm = {}
    for _, g, _ in walk_graphs(inferred.graph):
        for v in list(g.input) + list(g.output) + list(g.value_info):
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
                tm[v.name] = v.type.tensor_type.elem_type
        for t in g.initializer:
            tm[t.name] = t.data_type
        for n in g.node:
            if n.op_type == "Constant":
                tm.setdefault(n.output[0], _const_elem(n))
            if n.op_type == "Cast":
                tm.setdefault(n.output[0], next(a.i for a in n.attribute if a.name == "to"))
    # where inference stopped (ops without schema): an output takes the type shared by the
    # node's float inputs (what elementwise custom ops like Gelu/MyOp/FusedMatMul do)
    for _, g, _ in walk_graphs(inferred.graph):
        for n in g.node:
            ins = {tm.get(i) for i in n.input if i and tm.get(i) in FLOATS}
            if len(ins) == 1:
                for o in n.output:
                    if o and o not in tm:
                        tm[o] = next(iter(ins))
    return tm


def declared_types(model) -> dict:
    """Types the model itself declares (inputs, outputs, value_info, initializers)."""
    tm = {}
    for _, g, _ in walk_graphs(model.graph):
        for v in list(g.input) + list(g.output) + list(g.value_info):
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
                tm[v.name] = v.type.tensor_type.elem_type
        for t in g.initializer:
            tm[t.name] = t.data_type
    return tm


def describe(model, tm=None, limit=150) -> str:
    """Readable listing of a model's nodes with tensor dtypes (for failure messages)."""
    tm = tm if tm is not None else type_map(model)
    lines = []
    for p, n in all_nodes(model):
        def fmt(x):
            return f"{x}:{SHORT.get(tm.get(x), '?')}" if x else "''"
        attrs = ""
        if n.op_type == "Cast":
            attrs = f" to={SHORT.get(n.attribute[0].i, n.attribute[0].i)}"
        lines.append(f"  [{p}] {n.name or '<unnamed>'}: {n.op_type}{attrs}("
                     f"{', '.join(fmt(i) for i in n.input)}) -> "
                     f"{', '.join(fmt(o) for o in n.output)}")
    if len(lines) > limit:
        lines = lines[:limit] + [f"  ... {len(lines) - limit} more nodes"]
    return "converted model:\n" + "\n".join(lines)


def find_node(model, name):
    """The node named `name` in any graph; fails with the list of names otherwise."""
    found = [(p, n) for p, n in all_nodes(model) if n.name == name]
    if len(found) != 1:
        names = sorted({n.name for _, n in all_nodes(model)})
        pytest.fail(f"expected exactly one node named {name!r} in the converted model, found "
                    f"{len(found)} (a converter must keep the names of the nodes it does not "
                    f"create). Node names: {names}\n{describe(model)}")
    return found[0][1]


def float_types(tm, node, which="all"):
    names = []
    if which in ("all", "in"):
        names += [i for i in node.input if i]
    if which in ("all", "out"):
        names += [o for o in node.output if o]
    return [tm.get(x) for x in names if tm.get(x) in FLOATS]


def precision(tm, node) -> str:
    """'fp16' / 'fp32' if every float input/output has that type, 'mixed', or 'none'."""
    ts = set(float_types(tm, node))
    if not ts:
        return "none"
    if ts == {F16}:
        return "fp16"
    if ts == {F32}:
        return "fp32"
    return "mixed:" + ",".join(sorted(SHORT.get(t, str(t)) for t in ts))


def assert_precision(model, tm, names, want, why=""):
    bad = {}
    for name in names:
        n = find_node(model, name)
        got = precision(tm, n)
        if got != want:
            bad[name] = f"{got} (inputs {[(i, SHORT.get(tm.get(i))) for i in n.input]}, " \
                        f"outputs {[(o, SHORT.get(tm.get(o))) for o in n.output]})"
    assert not bad, f"nodes expected to compute in {want} {why}:\n" + \
        "\n".join(f"  {k}: {v}" for k, v in bad.items()) + "\n" + describe(model, tm)


def producers(model) -> dict:
    return {o: n for _, n in all_nodes(model) for o in n.output if o}


def compare(ref: dict, got: dict, tol: Tol, label="") -> list[str]:
    """Problems found comparing `got` (converted, fp16-faithful) with `ref` (FP32)."""
    problems = []
    for name, r in ref.items():
        if name not in got:
            problems.append(f"{label}{name}: missing from the converted model's outputs "
                            f"(has {sorted(got)})")
            continue
        g = np.asarray(got[name])
        r = np.asarray(r)
        if g.shape != r.shape:
            problems.append(f"{label}{name}: shape {g.shape} != FP32 shape {r.shape}")
            continue
        if r.dtype.kind != "f":
            if not np.array_equal(g, r):
                problems.append(f"{label}{name}: non-float output differs")
            continue
        g64, r64 = g.astype(np.float64), r.astype(np.float64)
        r_nf = ~np.isfinite(r64)
        g_nf = ~np.isfinite(g64)
        if (g_nf & ~r_nf).any():
            problems.append(f"{label}{name}: {int((g_nf & ~r_nf).sum())}/{g.size} inf/NaN values "
                            f"where FP32 is finite (e.g. got {g64[g_nf & ~r_nf][:4]})")
            continue
        if r.size == 0:
            continue
        fin = ~r_nf
        scale = float(np.max(np.abs(r64[fin]), initial=0.0))
        atol = max(tol.atol, tol.atol_of_max * scale)
        err = np.abs(g64 - r64)
        bound = atol + tol.rtol * np.abs(r64)
        viol = fin & (err > bound)
        if viol.any():
            i = np.unravel_index(int(np.argmax(np.where(fin, err - bound, -np.inf))), r.shape)
            problems.append(
                f"{label}{name}: {int(viol.sum())}/{r.size} values off by more than "
                f"atol={atol:g} + rtol={tol.rtol:g}*|ref|; worst at {i}: got {g64[i]:.6g}, "
                f"FP32 {r64[i]:.6g} (max abs err {float(np.max(err[fin])):.4g}, "
                f"output max |FP32| {scale:.4g})")
    return problems


def is_sorted(graph, outer=frozenset()) -> list[str]:
    """Nodes that read a tensor not yet produced (topological order), in every graph."""
    problems = []
    known = set(outer) | {i.name for i in graph.input} | {t.name for t in graph.initializer}
    known.add("")
    for n in graph.node:
        for i in n.input:
            if i not in known:
                problems.append(f"{n.name or n.op_type} reads {i!r} before it is produced")
        for a in n.attribute:
            subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
            for sg in subs:
                problems += is_sorted(sg, frozenset(known))
        known.update(n.output)
    return problems


def roundtrip_casts(model, tm) -> list[str]:
    """Cast(f32->f16) whose result only goes to Cast(->f32) (and the reverse pattern):
    a value needlessly round-tripped through FP16."""
    consumers = {}
    for _, n in all_nodes(model):
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    prods = producers(model)
    bad = []
    for _, n in all_nodes(model):
        if n.op_type != "Cast" or n.input[0] not in prods:
            continue
        to = n.attribute[0].i
        src_t = tm.get(n.input[0])
        if src_t == F32 and to == F16:
            for c in consumers.get(n.output[0], []):
                if c.op_type == "Cast" and c.attribute[0].i == F32:
                    bad.append(f"{n.input[0]} (f32) -> {n.name} (to f16) -> {c.name} (to f32)")
    return bad


def io_signature(model):
    def sig(v):
        tt = v.type.tensor_type
        dims = tuple(d.dim_param if d.HasField("dim_param") else
                     (d.dim_value if d.HasField("dim_value") else None) for d in tt.shape.dim) \
            if tt.HasField("shape") else None
        return v.name, SHORT.get(tt.elem_type, tt.elem_type), dims
    inits = {t.name for t in model.graph.initializer}
    return ([sig(v) for v in model.graph.input if v.name not in inits],
            [sig(v) for v in model.graph.output])


def fp32_node_names(model) -> set:
    """Nodes (not Cast/Constant) whose float inputs/outputs are all FP32."""
    tm = type_map(model)
    return {n.name for _, n in all_nodes(model)
            if n.op_type not in ("Cast", "Constant") and precision(tm, n) == "fp32"}


def report_dict(rep) -> dict:
    d = rep.to_dict()
    json.dumps(d)  # must be JSON-able
    return d


def report_fp32(rep) -> dict:
    """name -> reason from the report's fp32_nodes list."""
    return {e["name"]: str(e.get("reason", "")) for e in report_dict(rep).get("fp32_nodes", [])}


# =========================================================================== conversion
class Converted(NamedTuple):
    src: onnx.ModelProto
    feeds: dict
    rep: object
    out: onnx.ModelProto
    src_mutated: bool
    seconds: float


def do_convert(model, **kw):
    """convert(model, None, **kw) -> (report, converted ModelProto)."""
    rep = graphmp().convert(model, None, **kw)
    out = rep.model
    assert isinstance(out, onnx.ModelProto), \
        f"convert(model, None) must return a report whose .model is a ModelProto, got {type(out)}"
    return rep, out


@functools.lru_cache(maxsize=None)
def converted(name: str) -> Converted:
    src, feeds = cases.build(name)
    before = src.SerializeToString(deterministic=True)
    kw = dict(calibration=[feeds], **CONVERT_KW.get(name, {}))
    t0 = time.perf_counter()
    rep, out = do_convert(src, **kw)
    dt = time.perf_counter() - t0
    mutated = src.SerializeToString(deterministic=True) != before
    return Converted(src, feeds, rep, out, mutated, dt)


def fp32_reference(name, src, feeds):
    if name == "11_unsorted_nodes":
        return ort_run(cases.case_11_sorted_reference(), feeds)
    if name in cases.NO_ORT_CASES:
        return ref_eval(src, feeds)
    return ort_run(src, feeds)


def fp16_faithful(name, out, feeds):
    if name in cases.CUSTOM_OP_CASES:
        return ref_eval(out, feeds)  # run_reference has no kernels for custom ops
    return run_reference(out, feeds)


ALL = list(cases.IN_MEMORY_CASES)
RUNNABLE_ORT = [c for c in ALL if c not in cases.NO_ORT_CASES]


# =========================================================================== builders
@pytest.mark.parametrize("name", ALL + list(cases.FILE_CASES))
def test_builder_is_valid_fp32(name, tmp_path):
    """The source models themselves: valid, FP32, ORT == ReferenceEvaluator."""
    if name in cases.FILE_CASES:
        path = cases.FILE_CASES[name](tmp_path)
        onnx.checker.check_model(path, full_check=True)
        src = onnx.load(path)
        feeds = cases.default_feeds(src)
        a, b = ort_run(path, feeds), ref_eval(src, feeds)
    else:
        src, feeds = cases.build(name)
        if name in cases.INVALID_INPUT_CASES:
            with pytest.raises(onnx.checker.ValidationError):
                onnx.checker.check_model(src, full_check=True)
            ref_model = cases.case_11_sorted_reference()
            onnx.checker.check_model(ref_model, full_check=True)
        else:
            onnx.checker.check_model(src, full_check=True)
            ref_model = src
        b = ref_eval(ref_model, feeds)
        a = b if name in cases.NO_ORT_CASES else ort_run(src, feeds)
    # ORT and the ReferenceEvaluator agree to FP32 rounding; case 15 holds FP16 math,
    # which ORT CPU computes in FP32 and the ReferenceEvaluator in FP16.
    tol = Tol(1e-3, 1e-3) if name == "15_existing_fp16_parts" else Tol(1e-5, 1e-4)
    assert not compare(a, b, tol), compare(a, b, tol)
    for k, v in a.items():
        assert np.all(np.isfinite(v)), f"{name}: FP32 output {k} is not finite"


# =========================================================================== generic
@pytest.mark.parametrize("name", ALL)
def test_valid_model(name):
    c = converted(name)
    assert not c.src_mutated, "convert() modified the ModelProto it was given"
    try:
        onnx.checker.check_model(c.out, full_check=True)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"[{name}] converted model fails onnx.checker full_check: {e}\n"
                    f"{describe(c.out)}")
    if name not in cases.CUSTOM_OP_CASES:
        try:
            onnx.shape_inference.infer_shapes(c.out, check_type=True, strict_mode=True)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"[{name}] strict shape/type inference fails on the converted model: "
                        f"{e}\n{describe(c.out)}")
    assert not is_sorted(c.out.graph), is_sorted(c.out.graph)
    report_dict(c.rep)


@pytest.mark.parametrize("name", RUNNABLE_ORT)
def test_runs_in_ort(name):
    c = converted(name)
    try:
        got = ort_run(c.out, c.feeds)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"[{name}] ORT CPU cannot load/run the converted model: {e}\n"
                    f"{describe(c.out)}")
    ref = fp32_reference(name, c.src, c.feeds)
    # ORT CPU computes most FP16 ops in FP32: same tolerance is generous here.
    problems = compare(ref, got, TOL.get(name, DEFAULT_TOL), "ORT: ")
    assert not problems, "\n".join(problems) + "\n" + describe(c.out)


@pytest.mark.parametrize("name", ALL)
def test_fp16_faithful_numerics(name):
    c = converted(name)
    ref = fp32_reference(name, c.src, c.feeds)
    got = fp16_faithful(name, c.out, c.feeds)
    problems = compare(ref, got, TOL.get(name, DEFAULT_TOL))
    assert not problems, f"[{name}] fp16-faithful outputs vs FP32 ORT:\n" + \
        "\n".join(problems) + "\n" + describe(c.out)


@pytest.mark.parametrize("name", ALL)
def test_io_types_kept(name):
    c = converted(name)
    assert io_signature(c.out) == io_signature(c.src), (
        f"[{name}] graph inputs/outputs changed with keep_io_types=True:\n"
        f"  source:    {io_signature(c.src)}\n  converted: {io_signature(c.out)}")


@pytest.mark.parametrize("name", ALL)
def test_no_fp16_roundtrip(name):
    c = converted(name)
    bad = roundtrip_casts(c.out, type_map(c.out))
    assert not bad, f"[{name}] FP32 values needlessly round-tripped through FP16:\n  " + \
        "\n  ".join(bad) + "\n" + describe(c.out)


@pytest.mark.parametrize("name", ALL)
def test_idempotent(name):
    c = converted(name)
    kw = dict(calibration=[c.feeds], **CONVERT_KW.get(name, {}))
    _, again = do_convert(copy.deepcopy(c.out), **kw)
    a = c.out.graph.SerializeToString(deterministic=True)
    b = again.graph.SerializeToString(deterministic=True)
    if a != b:
        na, nb = [f"{n.name}:{n.op_type}" for _, n in all_nodes(c.out)], \
            [f"{n.name}:{n.op_type}" for _, n in all_nodes(again)]
        first = next((i for i, (x, y) in enumerate(zip(na, nb)) if x != y), min(len(na), len(nb)))
        pytest.fail(f"[{name}] converting the converted model changed it: {len(na)} -> {len(nb)} "
                    f"nodes, casts {sum('Cast' in x for x in na)} -> "
                    f"{sum('Cast' in x for x in nb)}, first difference at node #{first}: "
                    f"{na[first:first + 3]} vs {nb[first:first + 3]}\n"
                    f"second conversion:\n{describe(again)}")


# =========================================================================== 1
def test_01_resize_scales_stay_float():
    c = converted("01_resize_scales")
    tm = type_map(c.out)
    assert_precision(c.out, tm, ["conv1", "conv2", "conv3", "conv4"], "fp16",
                     "(the Conv path must be lowered, else the test exercises nothing)")
    problems = []
    for name in ("resize_init", "resize_const", "resize_sizes"):
        n = find_node(c.out, name)
        ins = list(n.input) + ["", "", ""]
        if tm.get(ins[0]) != F16:
            problems.append(f"{name}: X is {SHORT.get(tm.get(ins[0]))}, expected f16 (lowered)")
        if ins[2] and tm.get(ins[2]) != F32:
            problems.append(f"{name}: scales {ins[2]!r} is {SHORT.get(tm.get(ins[2]))}; the spec "
                            f"allows tensor(float) only")
        if ins[1] and tm.get(ins[1]) not in (F16, F32, TP.DOUBLE):
            problems.append(f"{name}: roi {ins[1]!r} is {SHORT.get(tm.get(ins[1]))}")
        if ins[3] and tm.get(ins[3]) != TP.INT64:
            problems.append(f"{name}: sizes {ins[3]!r} is {SHORT.get(tm.get(ins[3]))}")
    assert not problems, "\n".join(problems) + "\n" + describe(c.out, tm)


# =========================================================================== 2
def test_02_existing_casts_consistent():
    c = converted("02_existing_cast_to_float")
    tm = type_map(c.out)
    decl = declared_types(c.out)
    bad = []
    for _, n in all_nodes(c.out):
        if n.op_type == "Cast":
            to = n.attribute[0].i
            for src in (("inferred", tm), ("declared", decl)):
                t = src[1].get(n.output[0])
                if t is not None and t != to:
                    bad.append(f"{n.name}: to={SHORT.get(to)} but output {n.output[0]!r} "
                               f"{src[0]} {SHORT.get(t)}")
    assert not bad, "\n".join(bad) + "\n" + describe(c.out, tm)
    assert_precision(c.out, tm, ["mm1", "mm2", "mm3"], "fp16",
                     "(an existing Cast(to=FLOAT) must not block the FP16 path)")


# =========================================================================== 3
def test_03_shared_initializer_each_consumer_typed():
    c = converted("03_shared_initializer")
    tm = type_map(c.out)
    mm, pw, ex = (find_node(c.out, n) for n in ("mm_w", "pow_w", "exp_w"))
    msg = describe(c.out, tm)
    assert tm.get(mm.input[1]) == F16, f"MatMul reads W_shared as {SHORT.get(tm.get(mm.input[1]))}" \
        f" ({mm.input[1]!r}), expected an FP16 copy\n{msg}"
    assert tm.get(pw.input[1]) == F32, f"Pow (fp32 class) reads W_shared as " \
        f"{SHORT.get(tm.get(pw.input[1]))} ({pw.input[1]!r})\n{msg}"
    assert precision(tm, pw) == "fp32" and precision(tm, ex) == "fp32", msg
    # at most one FP16 copy of the weight (as initializer or Cast)
    w16 = nph.to_array(next(t for t in c.src.graph.initializer if t.name == "W_shared"))
    w16 = w16.astype(np.float16)
    copies = [t.name for _, g, _ in walk_graphs(c.out.graph) for t in g.initializer
              if t.data_type == F16 and list(t.dims) == [8, 8]
              and np.array_equal(nph.to_array(t), w16)]
    casts = [n.name for _, n in all_nodes(c.out) if n.op_type == "Cast"
             and n.input[0] == "W_shared" and n.attribute[0].i == F16]
    assert len(copies) + len(casts) <= 1, f"W_shared converted more than once: {copies} {casts}"


# =========================================================================== 4
def test_04_blocked_island_reads_fp32_producer():
    c = converted("04_cascaded_casts")
    tm = type_map(c.out)
    msg = describe(c.out, tm)
    assert_precision(c.out, tm, ["scale300", "square", "rsum"], "fp32",
                     f"(blocked by fp32_nodes={cases.CASE_04_BLOCKED!r})")
    prods = producers(c.out)
    sq, rs, sc = find_node(c.out, "square"), find_node(c.out, "rsum"), find_node(c.out, "scale300")
    assert prods[sq.input[0]].name == "scale300" and prods[sq.input[1]].name == "scale300", \
        f"square must read scale300's FP32 output directly, reads {list(sq.input)}\n{msg}"
    assert prods[rs.input[0]].name == "square", f"rsum must read square directly\n{msg}"
    # the way from the MatMul into the island: at most one Cast (f16 -> f32)
    chain, t = [], sc.input[0]
    while t in prods and prods[t].op_type == "Cast":
        chain.append(prods[t])
        t = prods[t].input[0]
    assert len(chain) <= 1, f"cascaded Casts into the island: {[n.name for n in chain]}\n{msg}"
    assert prods.get(t) is not None and prods[t].name == "mm", msg
    assert set(cases.CASE_04_BLOCKED.strip("^$()").split("|")) <= set(report_fp32(c.rep)), \
        f"report fp32_nodes: {report_fp32(c.rep)}"


# =========================================================================== 5
DATA_MOVEMENT = {"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Split",
                 "Slice", "Gather", "Identity", "Shape", "Expand", "Tile", "Pad"}
RANGE_REASON = re.compile(r"range|magnitude|overflow|65504|threshold|calib|max", re.I)


def test_05_naive_fp16_overflows_so_the_case_is_meaningful():
    naive = cases.case_05_naive_fp16()
    onnx.checker.check_model(naive, full_check=True)
    _, feeds = cases.case_05_activation_overflow()
    with np.errstate(over="ignore", invalid="ignore"):
        plain = ref_eval(naive, feeds)["y"]
        oracle = run_reference(naive, feeds)["y"]
    assert not np.isfinite(plain).any(), f"naive FP16 model should overflow, got {plain}"
    assert not np.isfinite(oracle).any(), \
        f"graphmp.model_runs.run_reference must be FP16-faithful and overflow here, got {oracle}"


def test_05_forced_fp16_overflows():
    """With the range check off and every node forced FP16, the oracle must see inf."""
    src, feeds = cases.case_05_activation_overflow()
    rep, out = do_convert(src, calibration=[feeds], fp16_nodes=".*",
                          range_threshold=float("inf"))
    with np.errstate(over="ignore", invalid="ignore"):
        y = run_reference(out, feeds)["y"]
    assert not np.isfinite(y).all(), (
        "fp16_nodes='.*', range_threshold=inf should give the naive (overflowing) model; "
        f"got finite {y.ravel()}\n{describe(out)}")


@pytest.mark.parametrize("calibration", ["case_feeds", "generated"])
def test_05_overflow_nodes_kept_fp32(calibration):
    if calibration == "case_feeds":
        c = converted("05_activation_overflow")
        rep, out, feeds = c.rep, c.out, c.feeds
    else:
        src, feeds = cases.case_05_activation_overflow()
        rep, out = do_convert(src)  # calibration=None: generated inputs (graphmp.inputs)
    tm = type_map(out)
    assert_precision(out, tm, ["square", "rsum", "add_bias"], "fp32",
                     "(|square| ~ 1e6 > 65504)")
    reasons = report_fp32(rep)
    assert "square" in reasons and RANGE_REASON.search(reasons["square"]), \
        f"report must list 'square' as FP32 with a range reason, fp32_nodes: {reasons}"
    # |mul300| ~ 1200 is 54x below FP16's max and reaches no normalisation: FP16 keeps it
    # (the auto threshold); one explicit threshold of 512 keeps it FP32 as well
    assert "mul300" not in reasons, f"|mul300| ~ 1200 is within the auto threshold 4094: {reasons}"
    strict_rep, _ = do_convert(cases.case_05_activation_overflow()[0], calibration=[feeds], range_threshold=512)
    assert "mul300" in report_fp32(strict_rep), report_fp32(strict_rep)
    y = run_reference(out, feeds)["y"]
    assert np.isfinite(y).all(), f"{y.ravel()}\n{describe(out, tm)}"


# =========================================================================== 6
def _value_of(model, name):
    """The constant value behind a tensor (initializer / Constant, through Casts)."""
    prods = producers(model)
    while name in prods and prods[name].op_type == "Cast":
        name = prods[name].input[0]
    for _, g, _ in walk_graphs(model.graph):
        for t in g.initializer:
            if t.name == name:
                return nph.to_array(t)
    if name in prods and prods[name].op_type == "Constant":
        return nph.to_array(prods[name].attribute[0].t)
    return None


def test_06_out_of_range_constants_keep_meaning():
    c = converted("06_out_of_range_constants")
    tm = type_map(c.out)
    assert_precision(c.out, tm, ["add_big", "sub_big"], "fp32", "(read 70000 > 65504)")
    assert_precision(c.out, tm, ["mul_tiny", "add_tiny", "div_tiny"], "fp32",
                     "(1e-9 flushes to 0 in FP16)")
    sub_neg = find_node(c.out, "sub_negtiny")
    assert precision(tm, sub_neg) == "fp32", f"(-1e-9 flushes to -0 in FP16)\n{describe(c.out, tm)}"
    v = _value_of(c.out, find_node(c.out, "sub_20k").input[0])
    assert v is not None and float(v) == 20000.0, f"20000 became {v}"
    d = report_dict(c.rep)
    # either rounded (then listed in 'rounding') or kept FP32 (then named in a reason)
    said = json.dumps(d.get("rounding", [])) + json.dumps(d.get("fp32_nodes", []))
    missing = [n for n in ("c70000", "c1e_9", "c_neg1e_9") if n not in said]
    assert not missing, f"the report must name the out-of-range initializers {missing} " \
        f"(in 'rounding' or in an fp32_nodes reason); it holds {said[:1500]}"
    got = run_reference(c.out, c.feeds)
    x = c.feeds["x"]
    np.testing.assert_allclose(got["y_ratio"][:, ::2], x[:, ::2], rtol=1e-3,
                               err_msg="x*1e-9/(|0|+1e-9) must be x")
    np.testing.assert_array_equal(got["y_sign"][:, ::2], x[:, ::2],
                                  err_msg="0 - (-1e-9) > 0 must select x")


# =========================================================================== 7 / 8
def _sha(paths):
    return {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths}


def _check_external(path) -> tuple[int, list[str]]:
    """(number of external tensors, problems) for a saved model."""
    m = onnx.load(str(path), load_external_data=False)
    base = os.path.dirname(str(path))
    problems, n_ext = [], 0
    for _, g, _ in walk_graphs(m.graph):
        for t in g.initializer:
            numel = int(np.prod(t.dims)) if t.dims else 1
            item = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
            if t.data_location == TP.EXTERNAL:
                n_ext += 1
                info = {e.key: e.value for e in t.external_data}
                f = os.path.join(base, info["location"])
                if not os.path.exists(f):
                    problems.append(f"{t.name}: external file {f} missing")
                    continue
                off, length = int(info.get("offset", 0)), int(info.get("length", -1))
                if length >= 0 and length != numel * item:
                    problems.append(f"{t.name}: {SHORT.get(t.data_type)} {list(t.dims)} needs "
                                    f"{numel * item} bytes, external length is {length}")
                if off + numel * item > os.path.getsize(f):
                    problems.append(f"{t.name}: data ends past the end of {f}")
    full = onnx.load(str(path))
    for _, g, _ in walk_graphs(full.graph):
        for t in g.initializer:
            numel = int(np.prod(t.dims)) if t.dims else 1
            item = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
            if t.raw_data and len(t.raw_data) != numel * item:
                problems.append(f"{t.name}: raw_data {len(t.raw_data)} bytes for "
                                f"{SHORT.get(t.data_type)} {list(t.dims)} ({numel * item})")
    return n_ext, problems


def _file_case(name, tmp_path, **kw):
    src_path = cases.FILE_CASES[name](tmp_path)
    src_dir = os.path.dirname(src_path)
    src_files = [os.path.join(src_dir, f) for f in os.listdir(src_dir)]
    before = _sha(src_files)
    dst = tmp_path / "out" / "converted.onnx"
    dst.parent.mkdir()
    src_model = onnx.load(src_path)
    feeds = cases.default_feeds(src_model)
    graphmp().convert(src_path, str(dst), calibration=[feeds], **kw)
    assert _sha(src_files) == before, "conversion modified the source model's files"
    assert dst.exists(), "convert(src, dst) did not write dst"
    onnx.checker.check_model(str(dst), full_check=True)
    onnx.shape_inference.infer_shapes_path(str(dst), str(tmp_path / "inferred.onnx"),
                                           check_type=True, strict_mode=True)
    n_ext, problems = _check_external(dst)
    assert not problems, "\n".join(problems)
    out = onnx.load(str(dst))
    ref = ort_run(src_path, feeds)
    problems = compare(ref, ort_run(str(dst), feeds), TOL[name], "ORT: ")
    problems += compare(ref, run_reference(out, feeds), TOL[name])
    assert not problems, "\n".join(problems) + "\n" + describe(out)
    assert io_signature(out) == io_signature(src_model)
    assert any(t.data_type == F16 for t in out.graph.initializer), \
        f"no FP16 weights in the output\n{describe(out)}"
    return dst, n_ext, out, feeds, src_path


def test_07_external_data_file_to_file(tmp_path):
    dst, n_ext, out, feeds, src_path = _file_case("07_external_data", tmp_path)
    assert n_ext > 0, "source had external data: external_data=None (auto) must keep it"


def test_07_external_data_path_to_memory(tmp_path):
    src_path = cases.case_07_external_data(tmp_path)
    feeds = cases.default_feeds(onnx.load(src_path))
    rep = graphmp().convert(src_path, None, calibration=[feeds])
    out = rep.model
    ext = [t.name for t in out.graph.initializer if t.data_location == TP.EXTERNAL]
    assert not ext, f"dst=None must give weights inline, external: {ext}"
    onnx.checker.check_model(out, full_check=True)
    problems = compare(ort_run(src_path, feeds), run_reference(out, feeds), TOL["07_external_data"])
    assert not problems, "\n".join(problems)


def test_07_loaded_model_with_external_data(tmp_path):
    src_path = cases.case_07_external_data(tmp_path)
    model = onnx.load(src_path)  # weights loaded into memory
    feeds = cases.default_feeds(model)
    rep, out = do_convert(model, calibration=[feeds])
    onnx.checker.check_model(out, full_check=True)
    problems = compare(ort_run(src_path, feeds), run_reference(out, feeds), TOL["07_external_data"])
    assert not problems, "\n".join(problems)


def test_08_scaled_large_model_external_on(tmp_path):
    assert cases.CASE_08_SCALED_DOWN  # the real > 2 GB run is elsewhere
    dst, n_ext, out, _, _ = _file_case("08_large_model_scaled", tmp_path, external_data=True)
    m = onnx.load(str(dst), load_external_data=False)
    inline_big = [t.name for t in m.graph.initializer if t.data_location != TP.EXTERNAL
                  and len(t.raw_data) >= 1024]
    assert n_ext >= 3 and not inline_big, \
        f"external_data=True must store the weights (>= 1 KiB) externally; inline: {inline_big}"


def test_08_scaled_large_model_external_off(tmp_path):
    dst, n_ext, _, _, _ = _file_case("08_large_model_scaled", tmp_path, external_data=False)
    assert n_ext == 0, f"external_data=False must store every weight inline ({n_ext} external)"


MEM_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{root!r}, {here!r}]
    import numpy as np, onnx, onnxruntime, graphmp, graphmp.model_runs, cases
    small = cases.case_07_external_data({warm!r})          # warm up every lazy import
    graphmp.convert(small, {warm!r} + "/w.onnx")
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])
    with open("/proc/self/clear_refs", "w") as f:             # reset the RSS high-water mark
        f.write("5")
    base = status("VmRSS")
    graphmp.convert({src!r}, {dst!r})
    print(json.dumps({{"base_kb": base, "peak_kb": status("VmHWM")}}))
""")


def test_08_memory_bounded(tmp_path):
    """Scaled-down version of 'memory bounded well below twice the model size':
    a ~48 MB model (3 x 2048^2 FP32) converted path -> path in a fresh process; the peak
    RSS growth during convert() (VmHWM after resetting it, minus VmRSS before) must stay
    below 2x the weight bytes. Linux only."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs")
    src = cases.case_08_large_model_scaled(tmp_path, hidden=2048)
    weight_bytes = sum(os.path.getsize(os.path.join(os.path.dirname(src), f))
                       for f in os.listdir(os.path.dirname(src)) if not f.endswith(".onnx"))
    warm = tmp_path / "warm"
    warm.mkdir()
    dst = tmp_path / "out" / "big.onnx"
    dst.parent.mkdir()
    script = MEM_SCRIPT.format(root=str(ROOT), here=str(HERE), warm=str(warm), src=src,
                               dst=str(dst))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    grown = (d["peak_kb"] - d["base_kb"]) * 1024
    assert grown < 2 * weight_bytes, (
        f"peak RSS grew by {grown / 2**20:.0f} MiB converting a {weight_bytes / 2**20:.0f} MiB "
        f"model ({grown / weight_bytes:.2f}x); must stay below 2x")


# =========================================================================== 9
def test_09a_custom_op_left_fp32():
    c = converted("09a_custom_op_no_schema")
    tm = type_map(c.out)
    my = find_node(c.out, "myop")
    assert tm.get(my.input[0]) == F32, \
        f"unknown op MyOp must receive FP32, gets {SHORT.get(tm.get(my.input[0]))}\n" \
        f"{describe(c.out, tm)}"
    assert_precision(c.out, tm, ["mm_a"], "fp16", "(provably FP16 before the custom op)")
    cases.MyOp.seen_dtypes.clear()
    ref_eval(c.out, c.feeds)
    assert cases.MyOp.seen_dtypes and all(d == np.float32 for d in cases.MyOp.seen_dtypes), \
        cases.MyOp.seen_dtypes
    assert "myop" in report_fp32(c.rep), f"report should say why myop is FP32: {report_fp32(c.rep)}"


def test_09b_com_microsoft_ops_left_fp32():
    c = converted("09b_com_microsoft_ops")
    tm = type_map(c.out)
    for name in ("fused_mm", "gelu"):
        n = find_node(c.out, name)
        assert tm.get(n.input[0]) == F32, \
            f"{name} (no ONNX schema; ORT CPU has FP32 kernels only) receives " \
            f"{SHORT.get(tm.get(n.input[0]))}\n{describe(c.out, tm)}"
    # (mm_c after the custom ops may stay FP32: its input type is not provable by
    # ONNX inference; FP16 there would need the type from the calibration run)
    # dynamic dims: runs at another batch / seq length too
    feeds = {"x": np.random.default_rng(9).standard_normal([3, 5, 16]).astype(np.float32)}
    problems = compare(ort_run(c.src, feeds), ort_run(c.out, feeds), TOL["09b_com_microsoft_ops"])
    problems += compare(ort_run(c.src, feeds), ref_eval(c.out, feeds), TOL["09b_com_microsoft_ops"])
    assert not problems, "\n".join(problems)


# =========================================================================== 10
def test_10_control_flow_casts_in_owner_graph():
    c = converted("10_control_flow")
    tm = type_map(c.out)
    msg = describe(c.out, tm)
    # each tensor's owner graph; each graph's visible names
    owner, parent_of, graphs = {}, {}, {}
    for p, g, parent in walk_graphs(c.out.graph):
        graphs[p], parent_of[p] = g, parent
        for v in list(g.input) + list(g.initializer):
            owner[v.name] = p
        for n in g.node:
            for o in n.output:
                owner[o] = p
    problems = []
    for p, g in graphs.items():
        scope, q = set(), p
        while q is not None:
            scope.add(q)
            q = parent_of[q]
        for n in g.node:
            for i in n.input:
                if i and owner.get(i) not in scope:
                    problems.append(f"[{p}] {n.name} reads {i!r} owned by {owner.get(i)} "
                                    f"(not visible from here)")
            if n.op_type == "Cast" and owner.get(n.input[0]) != p:
                problems.append(f"[{p}] Cast {n.name} reads {n.input[0]!r} owned by "
                                f"{owner.get(n.input[0])}: put it in the owner graph")
    assert not problems, "\n".join(problems) + "\n" + msg
    assert_precision(c.out, tm, ["then_softmax", "else_exp", "else_rsum", "body_softmax",
                                 "body_rsum"], "fp32", "(fp32-class ops inside subgraphs)")
    assert_precision(c.out, tm, ["then_mm", "else_mm", "body_mm", "outer_mm"], "fp16",
                     "(MatMuls reading outer-scope tensors)")
    for cond in (True, False):
        feeds = dict(c.feeds, cond=np.array(cond))
        problems += compare(ort_run(c.src, feeds), run_reference(c.out, feeds),
                            TOL["10_control_flow"], f"cond={cond}: ")
    assert not problems, "\n".join(problems) + "\n" + msg


# =========================================================================== 11
def test_11_output_topologically_sorted():
    c = converted("11_unsorted_nodes")
    assert is_sorted(c.src.graph), "case 11 source should be unsorted"
    problems = is_sorted(c.out.graph)
    assert not problems, "\n".join(problems) + "\n" + describe(c.out)
    names = {n.name for _, n in all_nodes(c.out)}
    assert {n.name for n in c.src.graph.node} <= names


# =========================================================================== 12
def _attr_dtype(node, in_types):
    """Output elem type an op's attributes imply (None when not attribute-driven)."""
    attrs = {a.name: a for a in node.attribute}
    op = node.op_type
    if op == "Cast":
        return attrs["to"].i
    if op in ("RandomNormal", "RandomUniform"):
        return attrs["dtype"].i if "dtype" in attrs else F32
    if op in ("RandomNormalLike", "RandomUniformLike", "EyeLike"):
        return attrs["dtype"].i if "dtype" in attrs else in_types[0]
    if op == "ConstantOfShape":
        return attrs["value"].t.data_type if "value" in attrs else F32
    return None


def test_12_dtype_attributes_agree():
    c = converted("12_dtype_attributes")
    inferred = onnx.shape_inference.infer_shapes(c.out, check_type=True, strict_mode=True)
    tm = type_map(inferred)
    decl = declared_types(c.out)
    problems, seen = [], set()
    for _, n in all_nodes(c.out):
        want = _attr_dtype(n, [tm.get(i) for i in n.input])
        if want is None:
            continue
        seen.add(n.op_type)
        for kind, types in (("inferred", tm), ("declared", decl)):
            t = types.get(n.output[0])
            if t is not None and t != want:
                problems.append(f"{n.name} ({n.op_type}): attributes give {SHORT.get(want)}, "
                                f"{kind} output type {SHORT.get(t)}")
        if want not in FLOATS and n.op_type != "Cast":
            problems.append(f"{n.name}: dtype {want} is not a float type")
    assert not problems, "\n".join(problems) + "\n" + describe(c.out, tm)
    assert {"RandomNormalLike", "RandomUniformLike", "RandomNormal", "RandomUniform",
            "EyeLike", "ConstantOfShape"} <= seen, f"dtype ops disappeared: saw {seen}"


# =========================================================================== 13
def test_13_output_consumed_inside_and_empty_tensor():
    c = converted("13_output_consumed_and_empty")
    tm = type_map(c.out)
    outs = {v.name: v.type.tensor_type.elem_type for v in c.out.graph.output}
    assert outs == {"y1": F32, "y2": F32, "y3": F32, "y_empty": F32}, outs
    sm = find_node(c.out, "softmax")
    assert tm.get(sm.input[0]) == F32, describe(c.out, tm)
    got = run_reference(c.out, c.feeds)
    assert got["y_empty"].shape == (0, 8), got["y_empty"].shape
    assert ort_run(c.out, c.feeds)["y_empty"].shape == (0, 8)


def test_13_keep_io_types_false():
    src, feeds = cases.case_13_output_consumed_and_empty()
    rep, out = do_convert(src, calibration=[feeds], keep_io_types=False)
    onnx.checker.check_model(out, full_check=True)
    onnx.shape_inference.infer_shapes(out, check_type=True, strict_mode=True)
    ins, outs = io_signature(out)
    # every float graph input and output becomes FP16; an output whose producer stays
    # FP32 (y3 comes from a Softmax) gets a Cast at the boundary
    outs_t = {n: t for n, t, _ in outs}
    assert all(t == "f16" for _, t, _ in ins) and all(t == "f16" for t in outs_t.values()), (ins, outs)
    f16 = {k: v.astype(np.float16) for k, v in feeds.items()}
    got = run_reference(out, f16)
    ref = ort_run(src, {k: v.astype(np.float32) for k, v in f16.items()})
    problems = compare(ref, got, Tol(2e-2, 1e-2))
    assert not problems, "\n".join(problems) + "\n" + describe(out)
    ort_run(out, f16)


# =========================================================================== 14
def test_14_unique_names_and_originals_kept():
    c = converted("14_names")
    names = [n.name for _, n in all_nodes(c.out)]
    dups = sorted({x for x in names if names.count(x) > 1})
    assert all(names), f"unnamed nodes remain\n{describe(c.out)}"
    assert not dups, f"duplicate node names {dups}\n{describe(c.out)}"
    produced = [o for _, n in all_nodes(c.out) for o in n.output if o]
    assert len(produced) == len(set(produced)), "a tensor is produced twice"
    kept = {n.name for n in c.src.graph.node if n.name}
    assert kept <= set(names), f"named nodes renamed: {sorted(kept - set(names))}"


def test_14_convert_twice_identical():
    src = cases.case_14_names()
    feeds = cases.default_feeds(src)
    _, once = do_convert(src, calibration=[feeds])
    _, twice = do_convert(copy.deepcopy(once), calibration=[feeds])
    assert once.graph.SerializeToString(deterministic=True) == \
        twice.graph.SerializeToString(deterministic=True), \
        f"not idempotent\nfirst:\n{describe(once)}\nsecond:\n{describe(twice)}"


# =========================================================================== 15
def test_15_existing_fp16_parts_and_island_kept():
    c = converted("15_existing_fp16_parts")
    tm = type_map(c.out)
    msg = describe(c.out, tm)
    assert_precision(c.out, tm, ["mm_half", "add_half"], "fp16", "(already FP16 in the source)")
    assert_precision(c.out, tm, ["softmax_island"], "fp32", "(deliberate FP32 island)")
    w16 = [t for t in c.out.graph.initializer if t.name == "W16"]
    assert w16 and w16[0].data_type == F16 and np.array_equal(
        nph.to_array(w16[0]), nph.to_array(c.src.graph.initializer[0])), "W16 changed"
    prods = producers(c.out)
    sm = find_node(c.out, "softmax_island")
    p = prods[sm.input[0]]
    assert p.op_type == "Cast" and p.attribute[0].i == F32 and tm.get(p.input[0]) == F16, \
        f"softmax_island must be fed by one Cast(f16->f32), is fed by {p.name}\n{msg}"


# =========================================================================== 16
def test_16_integer_count_stays_fp32():
    c = converted("16_integer_count_cast")
    tm = type_map(c.out)
    msg = describe(c.out, tm)
    for name in ("count_cast", "size_cast", "gather_cast"):
        n = find_node(c.out, name)
        assert n.attribute[0].i == F32 and tm.get(n.output[0]) == F32, \
            f"{name}: an element count of 90000 (> 65504) cast to {SHORT.get(n.attribute[0].i)}\n{msg}"
    assert_precision(c.out, tm, ["mean_div", "mean_div2", "mean_div3", "mul_count"], "fp32",
                     "(consume the 90000 count)")
    got = run_reference(c.out, c.feeds)["y_means"]
    np.testing.assert_allclose(got, np.full(3, c.feeds["x"].mean()), rtol=1e-4)


# =========================================================================== 17
def test_17_only_risky_nodes_fp32():
    c = converted("17_search_robustness")
    tm = type_map(c.out)
    assert_precision(c.out, tm, ["r_square", "r_rsum"], "fp32")
    assert_precision(c.out, tm, list(cases.CASE_17_BENIGN_FP16), "fp16",
                     "(benign paths must not be dragged to FP32)")
    extra = {n for n in fp32_node_names(c.out) - set(cases.CASE_17_RISKY)
             if find_node(c.out, n).op_type not in DATA_MOVEMENT}
    assert not extra, f"FP32 outside the risky path: {sorted(extra)}\n{describe(c.out, tm)}"
    extra = set(report_fp32(c.rep)) - set(cases.CASE_17_RISKY)
    assert not extra, f"report lists FP32 nodes outside the risky path: {sorted(extra)}"


def test_17_validate_is_fast_and_fp16_faithful():
    src, feeds = cases.case_17_search_robustness()
    t0 = time.perf_counter()
    rep, out = do_convert(src, calibration=[feeds], validate=True)
    dt = time.perf_counter() - t0
    assert dt < 60, f"convert(validate=True) took {dt:.1f}s on a 13-node model"
    problems = compare(ort_run(src, feeds), run_reference(out, feeds), TOL["17_search_robustness"])
    assert not problems, "\n".join(problems)
    d = report_dict(rep)
    assert "validation" in json.dumps(d).lower() or hasattr(rep, "validation"), \
        f"validate=True should leave a validation result in the report: keys {sorted(d)}"


def test_17_validate_file_to_file(tmp_path):
    src, feeds = cases.case_17_search_robustness()
    sp, dst = tmp_path / "src.onnx", tmp_path / "dst.onnx"
    onnx.save(src, str(sp))
    rep = graphmp().convert(str(sp), str(dst), calibration=[feeds], validate=True)
    d = report_dict(rep)
    assert "validation" in d, f"validate=True left no 'validation' in the report: {sorted(d)}"
    assert d["validation"].get("passed") is True, d["validation"]


# =========================================================================== 18
def test_18_no_removed_apis_in_source():
    pkg = ROOT / "graphmp"
    assert pkg.is_dir()
    hits = []
    for f in sorted(pkg.rglob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for pat in cases.CASE_18_REMOVED_APIS:
                if re.search(pat, code):
                    hits.append(f"{f.relative_to(ROOT)}:{i}: {pat}: {line.strip()}")
    assert not hits, "removed onnx/numpy APIs used:\n" + "\n".join(hits)


def test_18_imports_cleanly_in_fresh_process():
    script = textwrap.dedent(f"""
        import sys, warnings
        sys.path.insert(0, {str(ROOT)!r})
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import graphmp, graphmp.model_runs
            for attr in ("convert", "check", "GraphmpError"):
                assert hasattr(graphmp, attr), attr
            for attr in ("run_reference", "run_ort", "runner"):
                assert hasattr(graphmp.model_runs, attr), attr
        own = [f"{{x.filename}}:{{x.lineno}}: {{x.category.__name__}}: {{x.message}}"
               for x in w if "graphmp" in x.filename]
        print("\\n".join(own))
        sys.exit(1 if own else 0)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"


# =========================================================================== 19
def test_19_calibration_batch_independent_and_dims_dynamic():
    model, b1, b4 = cases.case_19_dynamic_batch()
    results = {}
    for label, calib in (("b1", [b1]), ("b4", [b4]), ("b1+b4", [b1, b4]), ("generated", None)):
        rep, out = do_convert(copy.deepcopy(model), calibration=calib)
        results[label] = (fp32_node_names(out), set(report_fp32(rep)), out)
    base = results["b1"]
    for label, (model_fp32, rep_fp32, _) in results.items():
        assert model_fp32 == base[0] and rep_fp32 == base[1], (
            f"classification depends on calibration: b1 -> {sorted(base[0])} / report "
            f"{sorted(base[1])}, {label} -> {sorted(model_fp32)} / report {sorted(rep_fp32)}")
    out = results["b4"][2]
    ins, outs = io_signature(out)
    assert all(d[0] == "batch" for _, _, d in ins + outs), f"dim_param lost: {ins} {outs}"
    # no declared value_info pins the batch dim that inference leaves symbolic
    src_inf = onnx.shape_inference.infer_shapes(model)
    sym = {v.name for v in src_inf.graph.value_info
           if v.type.tensor_type.shape.dim and v.type.tensor_type.shape.dim[0].HasField("dim_param")}
    pinned = [v.name for v in out.graph.value_info if v.name in sym and
              v.type.tensor_type.shape.dim and v.type.tensor_type.shape.dim[0].HasField("dim_value")]
    assert not pinned, f"value_info fixes the batch dim of {pinned}"
    for batch in (1, 4, 7):
        feeds = cases.default_feeds(model, seed=batch, batch=batch)
        problems = compare(ort_run(model, feeds), run_reference(out, feeds),
                           TOL["19_dynamic_batch"], f"batch={batch}: ")
        problems += compare(ort_run(model, feeds), ort_run(out, feeds), TOL["19_dynamic_batch"],
                            f"ORT batch={batch}: ")
        assert not problems, "\n".join(problems)


def test_19_generated_inputs_batch():
    from graphmp.inputs import find_shapes
    from graphmp.model_runs import runner
    model, _, _ = cases.case_19_dynamic_batch()
    plan = find_shapes(model, runner(model))
    assert plan.batch_free and plan.batch_dims == (("x", 0),)
    assert plan.feeds(batch=4)["x"].shape == (4, 64)
    assert plan.feeds(batch=1)["x"].shape == (1, 64)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # the model's dim stays dynamic

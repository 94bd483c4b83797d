#!/usr/bin/env python
"""Compare FP32 -> mixed-precision FP16 converters on the same models, in one run.

Tools:
  graphmp   graphmp.convert(src, dst, target="fp16", keep_io_types=True)
  occ       onnxconverter_common.float16.convert_float_to_float16(model, keep_io_types=True)
  autocast  modelopt.onnx.autocast.convert_to_mixed_precision(onnx_path=src,
            low_precision_type="fp16", keep_io_types=True, providers=["cpu"]),
            run in its own venv (benchmarks/setup_autocast.sh) via _autocast_runner.py

Every conversion, evaluation and oracle run happens in a fresh subprocess, so a
crash, hang or memory blow-up of one tool is recorded as a result. Peak RSS is the
conversion subprocess's own VmHWM (os.wait4's ru_maxrss only when it could not say).

Usage:
  python benchmarks/convert.py [MODEL ...] [--tools graphmp,occ,autocast]
                               [--json benchmarks/results/convert.json]
                               [--oracle-timeout 600] [--convert-timeout 1800]
See benchmarks/README.md for the JSON schema.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from common import (DEFAULT_AUTOCAST_PY, clean_floats, emit, err, json_default, load_npz, machine_info,
                    record_failure, rss_now, run_child, tool_availability, vmhwm)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ALL_TOOLS = ("graphmp", "occ", "autocast")
SCHEMA_VERSION = 1
# Input shapes for models whose symbolic dims make the generated default (batch 1, other
# symbolic dims 16) meaningless; keyed by file stem, then input name. --shape overrides.
DEFAULT_SHAPES = {
    "ppocr_mobile_v2_cls": {"x": [1, 3, 48, 192]},   # 16x16 pools down to an empty tensor
    "rivagan_encoder": {"frame": [1, 3, 1, 64, 64], "data": [1, 32]},
    "rivagan_decoder": {"frame": [1, 3, 1, 64, 64]},
}


# --------------------------------------------------------------------------- helpers
def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _import_graphmp():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import graphmp  # noqa: F401

    return graphmp


# --------------------------------------------------------------------------- oracle
def _oracle_funcs():
    """(make_inputs, run_reference, run_ort, impl) - graphmp's when it imports, else
    equivalent local code. make_inputs(model, seed, batch, shapes, path)."""
    try:
        _import_graphmp()
        from graphmp.model_runs import run_ort, run_reference

        return _graphmp_make_inputs, run_reference, run_ort, "graphmp.model_runs"
    except Exception:  # noqa: BLE001
        return _local_make_inputs, _local_run_reference, _local_run_ort, "local"


def _load(model_or_path, external=True):
    import onnx

    if isinstance(model_or_path, (str, Path)):
        return onnx.load(str(model_or_path), load_external_data=external)
    return model_or_path


def _graphmp_make_inputs(model, seed=0, batch=1, shapes=None, path=None):
    """graphmp's input mechanism: --shapes, else shapes found by a trial run."""
    from graphmp.inputs import find_shapes
    from graphmp.model_runs import runner

    plan = find_shapes(model, runner(path or model), shapes)
    return plan.feeds(seed, batch=batch if plan.batch_free and batch != 1 else None)


def _local_make_inputs(model, seed=0, batch=1, shapes=None, path=None):
    import numpy as np
    import onnx

    model = _load(model, external=False)
    if shapes:
        model = _with_input_shapes(model, shapes)
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        tt = inp.type.tensor_type
        shape = []
        for i, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                shape.append(d.dim_value)
            else:
                shape.append(batch if i == 0 else 16)
        dt = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if np.issubdtype(dt, np.floating):
            feeds[inp.name] = rng.random(shape, dtype=np.float32).astype(dt)
        elif dt == np.bool_:
            feeds[inp.name] = rng.random(shape) < 0.5
        else:
            feeds[inp.name] = rng.integers(0, 16, size=shape).astype(dt)
    return feeds


def _local_run_reference(model_or_path, feeds):
    from onnx.reference import ReferenceEvaluator

    model = _load(model_or_path)
    ev = ReferenceEvaluator(model)
    outs = ev.run(None, feeds)
    return {o.name: v for o, v in zip(model.graph.output, outs)}


def _local_run_ort(model_or_path, feeds):
    import onnxruntime as ort

    src = str(model_or_path) if isinstance(model_or_path, (str, Path)) else model_or_path.SerializeToString()
    sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


# --------------------------------------------------------------------------- node classification
def classify_nodes(model) -> dict:
    """Count nodes by the precision of their float tensors after ONNX shape inference.

    For each node (all graphs, subgraphs included) look at the element types of its
    inputs and outputs, ignoring slots whose type is fixed by the operator schema
    (e.g. Resize 'scales' is always tensor(float)) unless the node has no other float
    slot. Buckets: fp32 (only float32), low (only float16/bfloat16), mixed (both),
    fp64, non_float (no float tensor: shape/index ops), unknown (types not inferred).
    Cast/CastLike are counted as 'casts'; Constant nodes are skipped.
    """
    import onnx
    from onnx import TensorProto as TP

    model = _load(model, external=False)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - fall back to declared types
        inferred = model
    opsets = {(o.domain or "ai.onnx"): o.version for o in inferred.opset_import}

    types: dict[str, int] = {}

    def collect(g):
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                types[vi.name] = vi.type.tensor_type.elem_type
        for t in g.initializer:
            types[t.name] = t.data_type
        for n in g.node:
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
                for a in n.attribute:
                    if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                        types[n.output[0]] = a.t.data_type
                    elif a.name in ("value_float", "value_floats"):
                        types[n.output[0]] = TP.FLOAT
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    collect(a.g)
                for sg in a.graphs:
                    collect(sg)

    collect(inferred.graph)
    schema_cache: dict = {}

    def fixed_flags(node):
        key = (node.domain, node.op_type)
        if key not in schema_cache:
            dom = node.domain or "ai.onnx"
            try:
                s = onnx.defs.get_schema(node.op_type, opsets.get(dom, 1000), node.domain or "")
                params = {tc.type_param_str for tc in s.type_constraints}
                schema_cache[key] = ([f.type_str not in params for f in s.inputs],
                                     [f.type_str not in params for f in s.outputs])
            except Exception:  # noqa: BLE001 - custom domain
                schema_cache[key] = None
        return schema_cache[key]

    def flag(flags, i):
        if not flags:
            return False
        return flags[min(i, len(flags) - 1)]

    FLOATS = {TP.FLOAT: "fp32", TP.FLOAT16: "fp16", TP.BFLOAT16: "bf16", TP.DOUBLE: "fp64"}
    counts = {"total": 0, "casts": 0, "fp32": 0, "low": 0, "mixed": 0, "fp64": 0,
              "non_float": 0, "unknown": 0}
    fp32_ops: dict[str, int] = {}

    def visit(g):
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    visit(a.g)
                for sg in a.graphs:
                    visit(sg)
            if n.domain in ("", "ai.onnx") and n.op_type == "Constant":
                continue
            counts["total"] += 1
            if n.domain in ("", "ai.onnx") and n.op_type in ("Cast", "CastLike"):
                counts["casts"] += 1
                continue
            ff = fixed_flags(n)
            free, fixed, unknown = set(), set(), False
            for slots, flags in ((n.input, ff[0] if ff else None), (n.output, ff[1] if ff else None)):
                for i, name in enumerate(slots):
                    if not name:
                        continue
                    t = types.get(name)
                    if t is None:
                        unknown = True
                        continue
                    if t in FLOATS:
                        (fixed if flag(flags, i) else free).add(FLOATS[t])
            kinds = free or fixed
            if not kinds:
                counts["unknown" if unknown else "non_float"] += 1
            elif "fp32" in kinds and ({"fp16", "bf16"} & kinds):
                counts["mixed"] += 1
                fp32_ops[n.op_type] = fp32_ops.get(n.op_type, 0) + 1
            elif "fp32" in kinds:
                counts["fp32"] += 1
                fp32_ops[n.op_type] = fp32_ops.get(n.op_type, 0) + 1
            elif kinds <= {"fp16", "bf16"}:
                counts["low"] += 1
            else:
                counts["fp64"] += 1

    visit(inferred.graph)
    counts["compute"] = counts["fp32"] + counts["low"] + counts["mixed"] + counts["fp64"]
    counts["fp32_any"] = counts["fp32"] + counts["mixed"]
    counts["fp32_op_types"] = dict(sorted(fp32_ops.items(), key=lambda kv: -kv[1]))
    return counts


# --------------------------------------------------------------------------- metrics
def compare(ref: dict, got: dict, floor: float = 1e-2, tol: float = 1e-2) -> dict:
    """Per-output errors of `got` vs FP32 `ref` (same definitions as graphmp.check).

    max_abs: max |got - ref| over elements where both are finite.
    max_rel: max |got - ref| / max(|ref|, floor) over the same elements (floor = 1e-2
             by default, graphmp.check's atol, so near-zero references do not dominate).
    nonfinite: count of non-finite values in `got` where `ref` is finite.
    argmax_agree: fraction of positions whose argmax over the last axis matches
             (top-1 agreement for [N, classes] outputs); None for scalars/last dim 1.
    within_tol: no new non-finite and |got - ref| <= tol + tol * |ref| everywhere.
    Non-float outputs must match exactly (max_abs 0 or inf).
    """
    import numpy as np

    outs, worst_abs, worst_rel, min_agree, nonfinite, all_ok = {}, 0.0, 0.0, None, 0, True
    for name, r in ref.items():
        o = {"max_abs": None, "max_rel": None, "nonfinite": None, "argmax_agree": None, "within_tol": False}
        g = got.get(name)
        r = np.asarray(r)
        if g is None or np.asarray(g).shape != r.shape:
            o["error"] = "output missing" if g is None else \
                f"shape {list(np.asarray(g).shape)} != reference {list(r.shape)}"
            outs[name] = o
            worst_abs = worst_rel = math.inf
            all_ok = False
            continue
        g = np.asarray(g)
        if r.dtype.kind not in "fc":
            same = bool(np.array_equal(r, g))
            o.update(max_abs=0.0 if same else math.inf, max_rel=0.0 if same else math.inf,
                     nonfinite=0, within_tol=same)
        else:
            rf = r.astype(np.float64)
            gf = g.astype(np.float64)
            both = np.isfinite(rf) & np.isfinite(gf)
            o["nonfinite"] = int(np.sum(np.isfinite(rf) & ~np.isfinite(gf)))
            d = np.abs(gf - rf)[both]
            o["max_abs"] = float(d.max()) if d.size else 0.0
            o["max_rel"] = float((d / np.maximum(np.abs(rf[both]), floor)).max()) if d.size else 0.0
            o["within_tol"] = o["nonfinite"] == 0 and bool(np.all(d <= tol + tol * np.abs(rf[both])))
            if r.ndim >= 1 and r.shape[-1] > 1 and r.size:
                o["argmax_agree"] = float(np.mean(np.argmax(np.nan_to_num(gf), -1) == np.argmax(rf, -1)))
                min_agree = o["argmax_agree"] if min_agree is None else min(min_agree, o["argmax_agree"])
        nonfinite += o["nonfinite"]
        worst_abs = max(worst_abs, o["max_abs"])
        worst_rel = max(worst_rel, o["max_rel"])
        all_ok = all_ok and o["within_tol"]
        outs[name] = o
    return {"max_abs": worst_abs, "max_rel": worst_rel, "nonfinite": nonfinite,
            "argmax_agree_min": min_agree, "within_tol": all_ok, "outputs": outs}


def _save_npz(path, d):
    import numpy as np

    np.savez(path, **{k: np.asarray(v) for k, v in d.items()})


# --------------------------------------------------------------------------- workers (subprocess side)
def worker_convert(tool, src, dst, options):
    res = {"ok": False, "error": None}
    t0 = time.perf_counter()
    try:
        if tool == "graphmp":
            graphmp = _import_graphmp()
            res["import_s"] = time.perf_counter() - t0
            res["rss_after_import_bytes"] = rss_now()
            kw = dict(target="fp16", keep_io_types=True)
            kw.update(options)
            t1 = time.perf_counter()
            rep = graphmp.convert(src, dst, **kw)
            res["time_s"] = time.perf_counter() - t1
            try:
                res["tool_report"] = rep.to_dict()
            except Exception as e:  # noqa: BLE001
                res["tool_report"] = {"error": err(e)}
            res["version"] = getattr(graphmp, "__version__", None)
        elif tool == "occ":
            import onnx
            from onnxconverter_common.float16 import convert_float_to_float16

            res["import_s"] = time.perf_counter() - t0
            res["rss_after_import_bytes"] = rss_now()
            kw = dict(keep_io_types=True)
            kw.update(options)
            t1 = time.perf_counter()
            model = onnx.load(src)
            out = convert_float_to_float16(model, **kw)
            if out.ByteSize() > 1_800_000_000:
                onnx.save(out, dst, save_as_external_data=True, all_tensors_to_one_file=True,
                          location=os.path.basename(dst) + ".data")
            else:
                onnx.save(out, dst)
            res["time_s"] = time.perf_counter() - t1
        else:
            raise ValueError(f"unknown tool {tool}")
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - a failure is a result
        res["error"] = err(e)
        res["traceback"] = traceback.format_exc()[-4000:]
    import resource

    res["peak_rss_bytes"] = vmhwm() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    emit(res)


def _with_input_shapes(model, shapes: dict):
    """A copy with the declared dims of the named graph inputs set (for the local inputs)."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    model = copy
    for inp in model.graph.input:
        if inp.name in shapes:
            dims = inp.type.tensor_type.shape.dim
            want = shapes[inp.name]
            if len(dims) != len(want):
                raise ValueError(f"--shape {inp.name}: rank {len(want)} != model rank {len(dims)}")
            for d, v in zip(dims, want):
                d.Clear()
                d.dim_value = int(v)
    return model


def worker_ref(src, workdir, seed, shapes=None):
    """Generate inputs, run the FP32 model in ORT CPU, classify its nodes."""
    workdir = Path(workdir)
    res = {"ok": False}
    make_inputs, _, run_ort, impl = _oracle_funcs()
    res["oracle_impl"] = impl
    try:
        import onnx

        m = onnx.load(src, load_external_data=False)
        res["nodes"] = classify_nodes(m)
        if shapes:
            res["input_shape_overrides"] = shapes
        feeds = make_inputs(m, seed=seed, batch=1, shapes=shapes, path=src)
        _save_npz(workdir / "inputs.npz", feeds)
        res["inputs"] = {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in feeds.items()}
        res["opset"] = {(o.domain or "ai.onnx"): o.version for o in m.opset_import}
        t = time.perf_counter()
        outs = run_ort(src, feeds)
        res["ort_run_s"] = time.perf_counter() - t
        _save_npz(workdir / "ref.npz", outs)
        res["outputs"] = {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in outs.items()}
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001
        res["error"] = err(e)
        res["traceback"] = traceback.format_exc()[-4000:]
    emit(res)


def worker_eval(path, inputs_npz, out_npz):
    """onnx.checker full_check, ORT CPU load and run, node classification."""
    res = {}
    _, _, run_ort, impl = _oracle_funcs()
    import onnx

    try:
        res["nodes"] = classify_nodes(onnx.load(path, load_external_data=False))
    except BaseException as e:  # noqa: BLE001
        res["nodes"] = {"error": err(e)}
    try:
        onnx.checker.check_model(path, full_check=True)
        res["checker"] = {"ok": True, "error": None}
    except BaseException as e:  # noqa: BLE001
        res["checker"] = {"ok": False, "error": err(e)}
    ortres = {"load_ok": False, "run_ok": False, "error": None}
    try:
        import onnxruntime as ort

        t = time.perf_counter()
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        ortres["load_s"] = time.perf_counter() - t
        ortres["load_ok"] = True
        del sess
        if inputs_npz == "-":
            raise RuntimeError("not run: no generated inputs for this model (see fp32_reference)")
        feeds = load_npz(inputs_npz)
        t = time.perf_counter()
        outs = run_ort(path, feeds)
        ortres["run_s"] = time.perf_counter() - t
        _save_npz(out_npz, outs)
        ortres["run_ok"] = True
    except BaseException as e:  # noqa: BLE001
        ortres["error"] = err(e)
    res["ort"] = ortres
    res["oracle_impl"] = impl
    emit(res)


def worker_oracle(path, inputs_npz, out_npz):
    res = {"ok": False}
    _, run_reference, _, impl = _oracle_funcs()
    res["impl"] = impl
    try:
        feeds = load_npz(inputs_npz)
        t = time.perf_counter()
        outs = run_reference(path, feeds)
        res["time_s"] = time.perf_counter() - t
        _save_npz(out_npz, outs)
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001
        res["error"] = err(e)
        res["traceback"] = traceback.format_exc()[-4000:]
    res["peak_rss_bytes"] = vmhwm()
    emit(res)


def worker_main(argv):
    kind = argv[0]
    if kind == "convert":
        worker_convert(argv[1], argv[2], argv[3], json.loads(argv[4]))
    elif kind == "ref":
        worker_ref(argv[1], argv[2], int(argv[3]), json.loads(argv[4]) if len(argv) > 4 else None)
    elif kind == "eval":
        worker_eval(argv[1], argv[2], argv[3])
    elif kind == "oracle":
        worker_oracle(argv[1], argv[2], argv[3])
    else:
        raise SystemExit(f"unknown worker {kind}")


# --------------------------------------------------------------------------- subprocess runner (parent side)
def _self_cmd(*args):
    return [sys.executable, str(Path(__file__).resolve()), "_worker", *map(str, args)]


# --------------------------------------------------------------------------- orchestration
def default_models() -> list[str]:
    return sorted(glob.glob(str(REPO / "models" / "real" / "*.onnx"))) + \
        sorted(glob.glob(str(REPO / "models" / "tiny" / "*.onnx")))


def model_key(path: str, seen: set) -> str:
    p = Path(path)
    key = p.stem if p.parent.name not in ("real", "tiny") else f"{p.parent.name}/{p.stem}"
    base, i = key, 2
    while key in seen:
        key, i = f"{base}#{i}", i + 1
    seen.add(key)
    return key


def bench_tool(tool, src, workdir: Path, args, avail) -> dict:
    row = {"tool": tool, "status": None, "error": None}
    if not avail.get(tool, {}).get("ok"):
        row["status"] = "unavailable"
        row["error"] = avail.get(tool, {}).get("error")
        return row
    tdir = workdir / tool
    tdir.mkdir(parents=True, exist_ok=True)
    dst = tdir / "model.onnx"
    inputs = workdir / "inputs.npz"
    options = {}
    if args.calibrate and inputs.exists():
        if tool == "graphmp":
            options["calibration"] = str(inputs)
        elif tool == "autocast":
            options["calibration_data"] = str(inputs)
    if tool == "autocast":
        cmd = [args.autocast_python, str(HERE / "_autocast_runner.py"), src, str(dst),
               "--options", json.dumps(options)]
    else:
        cmd = _self_cmd("convert", tool, src, dst, json.dumps(options))
    c = run_child(cmd, args.convert_timeout)
    r = c["result"] or {}
    row["convert"] = {
        "time_s": r.get("time_s"), "wall_s": c["wall_s"], "import_s": r.get("import_s"),
        # VmHWM reported by the child itself; wait4's ru_maxrss is only a fallback (it can
        # include the parent's RSS inherited through fork, and is all we have after a crash)
        "peak_rss_bytes": r.get("peak_rss_bytes") or c["peak_rss_bytes"],
        "peak_rss_source": "VmHWM" if r.get("peak_rss_bytes") else "wait4 ru_maxrss (upper bound)",
        "rss_after_import_bytes": r.get("rss_after_import_bytes"),
        "returncode": c["rc"], "options": options,
    }
    if "tool_report" in r:
        row["tool_report"] = r["tool_report"]
    if r.get("versions"):
        row["tool_versions"] = r["versions"]
    if record_failure(row, c, r):
        return row
    row["status"] = "ok"
    row["output"] = {"path": str(dst) if args.keep else None, "bytes": _dir_bytes(tdir)}

    # checker, ORT, node classes
    e = run_child(_self_cmd("eval", dst, inputs if inputs.exists() else "-", tdir / "ort.npz"),
                  args.convert_timeout)
    er = e["result"] or {}
    row["nodes"] = er.get("nodes")
    row["checker"] = er.get("checker") or {"ok": False, "error": e["crash"]}
    row["ort"] = er.get("ort") or {"load_ok": False, "run_ok": False, "error": e["crash"]}
    ref_npz = workdir / "ref.npz"
    if row["ort"].get("run_ok") and ref_npz.exists():
        row["ort"]["metrics"] = compare(load_npz(ref_npz), load_npz(tdir / "ort.npz"), args.tol, args.tol)

    # FP16-faithful oracle
    orc = {"status": None, "error": None}
    if args.no_oracle:
        orc["status"] = "not run (--no-oracle)"
    elif not ref_npz.exists():
        orc["status"] = "not run (no FP32 reference)"
    else:
        o = run_child(_self_cmd("oracle", dst, inputs, tdir / "oracle.npz"), args.oracle_timeout)
        orr = o["result"] or {}
        orc["impl"] = orr.get("impl")
        orc["time_s"] = orr.get("time_s")
        orc["peak_rss_bytes"] = orr.get("peak_rss_bytes") or o["peak_rss_bytes"]
        if o["timed_out"]:
            orc["status"] = "oracle skipped (timeout)"
            orc["error"] = f"no result within --oracle-timeout {args.oracle_timeout:.0f} s"
        elif o["crash"] or not orr.get("ok"):
            orc["status"] = "failed"
            orc["error"] = o["crash"] or orr.get("error")
        else:
            orc["status"] = "ok"
            orc["metrics"] = compare(load_npz(ref_npz), load_npz(tdir / "oracle.npz"), args.tol, args.tol)
    row["oracle"] = orc
    if not args.keep:
        for f in ("ort.npz", "oracle.npz"):
            (tdir / f).unlink(missing_ok=True)
    return row


def bench_model(path, key, workdir: Path, tools, args, avail, log) -> tuple[dict, list[dict]]:
    info = {"model": key, "path": str(Path(path).resolve())}
    try:
        info["bytes"] = os.path.getsize(path) + sum(
            os.path.getsize(f) for f in glob.glob(str(Path(path).parent / "*"))
            if f.endswith((".data", ".bin", ".weights")) and Path(f).stem.startswith(Path(path).stem))
    except OSError as e:
        info["error"] = err(e)
    workdir.mkdir(parents=True, exist_ok=True)
    shapes = dict(DEFAULT_SHAPES.get(Path(path).stem, {})) if not args.no_default_shapes else {}
    for spec in args.shape:
        scope, _, rest = spec.rpartition(":")
        if scope and scope not in (Path(path).stem, key):
            continue
        name, _, dims = rest.partition("=")
        shapes[name] = [int(x) for x in dims.lower().split("x")]
    ref = run_child(_self_cmd("ref", path, workdir, args.seed, json.dumps(shapes)), args.convert_timeout)
    rr = ref["result"] or {}
    info["oracle_impl"] = rr.get("oracle_impl")
    info["inputs"] = rr.get("inputs")
    info["input_shape_overrides"] = shapes or None
    info["outputs"] = rr.get("outputs")
    info["opset"] = rr.get("opset")
    info["nodes"] = rr.get("nodes")
    info["fp32_reference"] = {"ok": bool(rr.get("ok")) and not ref["crash"],
                              "ort_run_s": rr.get("ort_run_s"),
                              "error": ref["crash"] or rr.get("error")}
    # Oracle floor: the FP16-faithful oracle on the FP32 source vs ORT CPU. Converted-model
    # errors at or below this level are the oracle's own disagreement with ORT, not FP16.
    fl = {"status": None, "error": None}
    if args.no_oracle:
        fl["status"] = "not run (--no-oracle)"
    elif not (workdir / "ref.npz").exists():
        fl["status"] = "not run (no FP32 reference)"
    else:
        o = run_child(_self_cmd("oracle", path, workdir / "inputs.npz", workdir / "oracle_fp32.npz"),
                      args.oracle_timeout)
        orr = o["result"] or {}
        fl["time_s"] = orr.get("time_s")
        if o["timed_out"]:
            fl["status"] = "oracle skipped (timeout)"
        elif o["crash"] or not orr.get("ok"):
            fl["status"] = "failed"
            fl["error"] = o["crash"] or orr.get("error")
        else:
            fl["status"] = "ok"
            fl["metrics"] = compare(load_npz(workdir / "ref.npz"), load_npz(workdir / "oracle_fp32.npz"),
                                    args.tol, args.tol)
    info["oracle_fp32_floor"] = fl
    rows = []
    for tool in tools:
        log(f"  {key}: {tool} ...")
        try:
            row = bench_tool(tool, path, workdir, args, avail)
        except Exception as e:  # noqa: BLE001 - the harness itself must not die
            row = {"tool": tool, "status": "harness-error", "error": err(e),
                   "traceback": traceback.format_exc()[-4000:]}
        row = {"model": key, **row}
        base = info.get("nodes") or {}
        if row.get("nodes") and "casts" in row["nodes"] and "casts" in base:
            row["casts_added"] = row["nodes"]["casts"] - base["casts"]
        rows.append(row)
        log(f"  {key}: {tool} -> {row['status']}" + (f" ({row['error'][:160]})" if row.get("error") else ""))
    return info, rows


# --------------------------------------------------------------------------- report
def _fmt_num(x, fmt="{:.3g}"):
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return fmt.format(x)


def _rss_cell(conv):
    peak, base = conv.get("peak_rss_bytes"), conv.get("rss_after_import_bytes")
    if not peak:
        return "-"
    cell = f"{peak / 2**20:.0f}"
    if base:
        cell += f" (+{max(peak - base, 0) / 2**20:.0f})"
    return cell


def markdown_table(rows, model_infos=()) -> str:
    floors = {i["model"]: i.get("oracle_fp32_floor") or {} for i in model_infos}
    hdr = ["model", "tool", "status", "conv s", "peak RSS MB (+over imports)", "FP32 nodes", "casts +",
           "checker", "ORT CPU", "max abs", "max rel", "argmax", "tol ok", "note"]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for r in rows:
        conv = r.get("convert") or {}
        nodes = r.get("nodes") or {}
        orc = r.get("oracle") or {}
        m = orc.get("metrics") or {}
        note = ""
        if r["status"] != "ok":
            note = (r.get("error") or "")[:90]
        elif orc.get("status") != "ok":
            note = f"oracle: {orc.get('status')}" + (f" ({(orc.get('error') or '')[:60]})" if orc.get("status") == "failed" else "")
        if m.get("nonfinite"):
            note = (note + f" nonfinite={m['nonfinite']}").strip()
        fl = floors.get(r["model"]) or {}
        if m and fl.get("status") == "ok" and (fl["metrics"].get("max_abs") or 0) > 1e-3:
            note = (note + f" oracle floor abs {_fmt_num(fl['metrics']['max_abs'])}").strip()
        elif m and fl.get("status") not in (None, "ok"):
            note = (note + f" oracle floor {fl['status']}").strip()
        ortm = (r.get("ort") or {}).get("metrics")
        ort_cell = "-"
        if r.get("ort"):
            o = r["ort"]
            ort_cell = "ok" if o.get("run_ok") else ("load only" if o.get("load_ok") else "FAIL")
        fp32 = "-"
        if "fp32_any" in nodes:
            fp32 = f"{nodes['fp32_any']}/{nodes['compute']}"
        if not m and ortm and r["status"] == "ok":
            note = (note + f"; ORT max_abs {_fmt_num(ortm.get('max_abs'))}").strip("; ")
        cells = [
            r["model"], r["tool"], r["status"],
            _fmt_num(conv.get("time_s"), "{:.2f}"),
            _rss_cell(conv),
            fp32,
            _fmt_num(r.get("casts_added"), "{:d}"),
            ("ok" if (r.get("checker") or {}).get("ok") else "FAIL") if r.get("checker") else "-",
            ort_cell,
            _fmt_num(m.get("max_abs")), _fmt_num(m.get("max_rel")),
            _fmt_num(m.get("argmax_agree_min"), "{:.3f}"),
            ("yes" if m["within_tol"] else "no") if m else "-",
            note.replace("|", "\\|").replace("\n", " "),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help="extra .onnx models (default set is always included "
                    "unless --only-given)")
    ap.add_argument("--only-given", action="store_true", help="benchmark only the models named on the command line")
    ap.add_argument("--tools", default=",".join(ALL_TOOLS), help="comma list of graphmp,occ,autocast")
    ap.add_argument("--json", default=str(HERE / "results" / "convert.json"), help="output JSON path")
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    ap.add_argument("--oracle-timeout", type=float, default=600.0,
                    help="seconds for each FP16-faithful oracle subprocess (per model: the FP32-source floor run "
                    "and one per converted model)")
    ap.add_argument("--convert-timeout", type=float, default=1800.0, help="seconds per conversion, per checker/ORT evaluation and per FP32 reference run")
    ap.add_argument("--no-oracle", action="store_true", help="skip the FP16-faithful oracle runs")
    ap.add_argument("--tol", type=float, default=1e-2,
                    help="atol=rtol for within_tol and the max_rel floor (graphmp.check default)")
    ap.add_argument("--shape", action="append", default=[], metavar="[MODEL:]INPUT=DxDx..",
                    help="fix an input's shape for generated inputs, e.g. x=1x3x48x192 or "
                    "ppocr_mobile_v2_cls:x=1x3x48x192 (repeatable)")
    ap.add_argument("--no-default-shapes", action="store_true",
                    help="ignore the built-in DEFAULT_SHAPES for known corpus models")
    ap.add_argument("--seed", type=int, default=0, help="seed for generated inputs")
    ap.add_argument("--calibrate", action="store_true",
                    help="pass the benchmark inputs as calibration data to graphmp and autocast "
                    "(default: each tool's own defaults)")
    ap.add_argument("--autocast-python", default=DEFAULT_AUTOCAST_PY,
                    help="python of the AutoCast venv (default %(default)s; env AUTOCAST_PYTHON)")
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep converted models and inputs in DIR")
    args = ap.parse_args(argv)

    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = [t for t in tools if t not in ALL_TOOLS]
    if bad:
        ap.error(f"unknown tool(s) {bad}; choose from {ALL_TOOLS}")
    models = [] if args.only_given else default_models()
    for m in args.models:
        if m not in models:
            models.append(m)
    if not models:
        ap.error("no models found (models/real, models/tiny) and none given")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    started = _dt.datetime.now(_dt.timezone.utc)
    avail = tool_availability(tools, args.autocast_python)
    for t, a in avail.items():
        log(f"{t}: " + (f"available {a.get('version') or ''}" if a["ok"] else f"UNAVAILABLE: {a['error']}"))

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="graphmp-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    seen, model_infos, rows = set(), [], []
    try:
        for m in models:
            key = model_key(m, seen)
            log(f"[{len(model_infos) + 1}/{len(models)}] {key} ({m})")
            info, r = bench_model(m, key, root / key.replace("/", "__").replace("#", "_"),
                                  tools, args, avail, log)
            model_infos.append(info)
            rows.extend(r)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    oracle_impls = sorted({i.get("oracle_impl") for i in model_infos if i.get("oracle_impl")})
    doc = {
        "schema_version": SCHEMA_VERSION,
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "cwd": os.getcwd(),
        "started_utc": started.isoformat(timespec="seconds"),
        "duration_s": (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds(),
        "machine": machine_info(),
        "tools": avail,
        "settings": {"tools": tools, "seed": args.seed, "oracle_timeout_s": args.oracle_timeout,
                     "convert_timeout_s": args.convert_timeout, "calibrate": args.calibrate,
                     "no_oracle": args.no_oracle, "tol": args.tol,
                     "shape_args": args.shape, "default_shapes": None if args.no_default_shapes else DEFAULT_SHAPES, "oracle_impl": oracle_impls},
        "models": model_infos,
        "results": rows,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(clean_floats(doc), indent=1, default=json_default, allow_nan=False))
    os.replace(tmp, out)
    table = markdown_table(rows, model_infos)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    print(table)
    print(f"\nJSON: {out}   oracle: {', '.join(oracle_impls) or '-'}   "
          f"errors are vs the FP32 model in ORT CPU; 'max abs/rel' from the FP16-faithful oracle run")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker_main(sys.argv[2:])
    else:
        sys.exit(main())

"""casts.py: what each converter's Casts cost, and what they are bought with (issue 26).

Per model and converter: the number of Casts, the MB they move per inference at the real
input shapes, the FP16 share of Conv/ConvTranspose/MatMul/Gemm/Einsum FLOPs (all from
graphmp.cast_cost.cast_traffic, the same count for every converter's output: Casts are
counted wherever they are), whether ONNX Runtime loads the output, and the error of every
output under graphmp's FP16-faithful emulation (graphmp.emulate.emulated_runner) against
the FP32 source on graphmp.model_runs.runner(src, optimize=False): max|a-b| / max|ref| per
output, the worst over the batches. Fewer Casts are never bought with accuracy unseen.

Converters:
  graphmp       graphmp.convert(src, dst) with default options, calibrated on the same
                batches the error is measured on. --graphmp-root PATH adds a second
                graphmp row ("graphmp before") that imports graphmp from PATH/graphmp.
  occ           onnxconverter-common float16.convert_float_to_float16(model, keep_io_types=True)
  autocast      ModelOpt AutoCast (keep_io_types, CPU reference run, calibrated on the first
                batch) when --autocast-python (a modelopt venv's python, default
                /work/venv-modelopt/bin/python from benchmarks/setup_autocast.sh) exists;
                else "not available". It runs in that venv via _autocast_runner.py.

Inputs: graphmp.inputs.find_shapes (as `graphmp check` does: declared dims, dynamic dims
tried until ONNX Runtime runs), batches plan.feeds(0) and plan.feeds(1). Every
conversion runs in its own subprocess (a crash or timeout is that row's result); the
measurement runs in this process with this checkout's graphmp.

usage: python benchmarks/casts.py [MODEL.onnx ...] [--graphmp-root PATH] [--json OUT.json]
                                   [--autocast-python PATH] [--timeout S] [--work DIR]
Without models: models/real/*.onnx, models/tiny/*.onnx and /tmp/rm/{ddddocr_ocr,magika,
ppocrv4_rec}.onnx where present.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# PYTHONPATH first (a --graphmp-root child imports that checkout's graphmp), then this checkout
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO)]

RESULT_TAG = "@@RESULT "  # the line _autocast_runner.py prints its result on
EXTRA = ["/tmp/rm/ddddocr_ocr.onnx", "/tmp/rm/magika.onnx", "/tmp/rm/ppocrv4_rec.onnx"]


def default_models() -> list:
    return sorted(glob.glob(str(REPO / "models/real/*.onnx"))) + sorted(glob.glob(str(REPO / "models/tiny/*.onnx"))) \
        + [p for p in EXTRA if os.path.exists(p)]


# --------------------------------------------------------------------------- child side
def _child(tool: str, src: str, dst: str, batches: list) -> dict:
    import numpy as np
    t0 = time.perf_counter()
    if tool == "graphmp":
        import graphmp
        cal = [dict(np.load(b)) for b in batches]
        graphmp.convert(src, dst, calibration=cal)
        return {"time_s": time.perf_counter() - t0, "graphmp_file": graphmp.__file__,
                "graphmp_version": getattr(graphmp, "__version__", None)}
    if tool == "occ":
        import onnx
        from onnxconverter_common import float16
        m = float16.convert_float_to_float16(onnx.load(src), keep_io_types=True)
        onnx.save(m, dst, save_as_external_data=m.ByteSize() > 1.9e9)
        return {"time_s": time.perf_counter() - t0}
    raise SystemExit(f"unknown tool {tool}")


# --------------------------------------------------------------------------- parent side
def _count_casts(model) -> int:
    from graphmp.model_io import iter_graphs
    return sum(n.op_type == "Cast" for g in iter_graphs(model.graph) for n in g.node)


def run_child(cmd: list, timeout: float, env=None) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timeout after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    out = {"wall_s": time.perf_counter() - t0}
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    last = last[len(RESULT_TAG):] if last.startswith(RESULT_TAG) else last  # _autocast_runner's tagged line
    res = json.loads(last) if p.returncode == 0 and last.startswith("{") else None
    if res is not None and res.get("ok", True):
        out.update(ok=True, **{k: v for k, v in res.items() if k != "ok"})
    else:
        err = (res or {}).get("error") or (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        out.update(ok=False, error=f"exit {p.returncode}: {str(err)[:300]}")
    return out


def measure(dst: str, src_model, batches: list, refs: list) -> dict:
    """cast_traffic, ORT load and the emulated error of a converted model."""
    import numpy as np
    import onnx
    from graphmp.cast_cost import cast_traffic
    from graphmp.emulate import emulated_runner
    from graphmp.model_runs import ort_session
    row: dict = {}
    m = onnx.load(dst, load_external_data=False)
    try:
        ct = cast_traffic(m, batches[0], _count_casts(m) - _count_casts(src_model), measure=True)
        row["cast_traffic"] = {k: ct.get(k) for k in ("casts", "casts_added", "bytes", "boundary_bytes",
                                                      "inside_bytes", "approximate", "unavailable", "inference_error",
                                                      "compute_fp16_share", "compute_approximate", "top")}
    except Exception as e:  # noqa: BLE001
        row["cast_traffic"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    try:
        ort_session(dst)
        row["ort_load"] = {"ok": True}
    except Exception as e:  # noqa: BLE001
        row["ort_load"] = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    try:
        emu = emulated_runner(dst)
        errs: dict = {}
        for feeds, ref in zip(batches, refs):
            got = emu(feeds)
            for k, r in ref.items():
                a = np.asarray(got[k], dtype=np.float64)
                b = np.asarray(r, dtype=np.float64)
                scale = float(np.max(np.abs(b))) if b.size else 0.0
                d = float(np.max(np.abs(a - b))) if b.size else 0.0
                e = d / scale if scale > 0 else (0.0 if d == 0 else float("inf"))
                if not np.isfinite(a).all() and np.isfinite(b).all():
                    e = float("inf")
                errs[k] = max(errs.get(k, 0.0), e)
        row["errors"] = errs
        row["max_error"] = max(errs.values()) if errs else 0.0
    except Exception as e:  # noqa: BLE001
        row["errors"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        row["max_error"] = None
    return row


def bench_model(path: str, args, work: Path, log) -> dict:
    import numpy as np
    import onnx
    from graphmp.inputs import find_shapes
    from graphmp.model_runs import runner
    name = Path(path).stem
    out: dict = {"model": name, "path": path, "rows": {}}
    mdir = work / name
    mdir.mkdir(parents=True, exist_ok=True)
    try:
        src_model = onnx.load(path, load_external_data=False)
        ref_run = runner(path, optimize=False)
        plan = find_shapes(onnx.load(path), ref_run, where=name)
        batches = [plan.feeds(0), plan.feeds(1)]
        refs = [ref_run(b) for b in batches]
    except Exception as e:  # noqa: BLE001
        out["error"] = f"inputs/reference: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        log(f"{name}: {out['error']}")
        return out
    out["shapes"] = plan.describe()
    out["source_casts"] = _count_casts(src_model)
    files = []
    for i, b in enumerate(batches):
        f = mdir / f"batch{i}.npz"
        np.savez(f, **b)
        files.append(str(f))
    jobs = []
    if args.graphmp_root:
        jobs.append(("graphmp before", "graphmp", args.graphmp_root))
    jobs.append(("graphmp after" if args.graphmp_root else "graphmp", "graphmp", str(REPO)))
    jobs.append(("occ", "occ", None))
    autocast = bool(args.autocast_python and os.path.exists(args.autocast_python))
    if autocast:
        jobs.append(("autocast", "autocast", None))
    for label, tool, root in jobs:
        dst = mdir / (label.replace(" ", "_") + ".onnx")
        env = dict(os.environ)
        if root:
            env["PYTHONPATH"] = os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x)
        if tool == "autocast":  # its own venv; calibrated on the first batch, as graphmp is on both
            cmd = [args.autocast_python, str(HERE / "_autocast_runner.py"), path, str(dst),
                   "--options", json.dumps({"calibration_data": files[0]})]
            env.pop("PYTHONPATH", None)
        else:
            cmd = [sys.executable, str(HERE / "casts.py"), "--_child", tool, path, str(dst), *files]
        c = run_child(cmd, args.timeout, env=env)
        row = {"convert": c}
        if c.get("ok"):
            if root and not str(c.get("graphmp_file", "")).startswith(str(Path(root).resolve()) + os.sep):
                row["warning"] = f"graphmp imported from {c.get('graphmp_file')}, not {root}"
            row.update(measure(str(dst), src_model, batches, refs))
        row["status"] = "ok" if c.get("ok") else c.get("error")
        out["rows"][label] = row
        ct = row.get("cast_traffic", {})
        log(f"{name:22s} {label:15s} {row['status'] if not c.get('ok') else ''}"
            f"casts={ct.get('casts')} MB={_mb(ct.get('bytes'))} fp16={_pct(ct.get('compute_fp16_share'))} "
            f"ort={row.get('ort_load', {}).get('ok')} err={_err(row.get('max_error'))}")
    if not autocast:
        out["rows"]["autocast"] = {"status": "not available"}
    return out


def _mb(b):
    return "-" if b is None else f"{b / 1e6:.3f}"


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def _err(x):
    return "-" if x is None else f"{x:.2e}"


def _cell(row: dict | None) -> str:
    if not row:
        return "-"
    if row.get("status") != "ok":
        return f"failed: {str(row.get('status'))[:60]}"
    ct = row.get("cast_traffic", {})
    approx = "~" if ct.get("approximate") else ""
    load = "" if row.get("ort_load", {}).get("ok") else " (ORT load FAILS)"
    return (f"{ct.get('casts')} / {approx}{_mb(ct.get('bytes'))} / {_pct(ct.get('compute_fp16_share'))} / "
            f"{_err(row.get('max_error'))}{load}")


def table(results: list, labels: list) -> str:
    lines = ["| model | shapes | " + " | ".join(labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error'][:80]} |" + " |" * len(labels))
            continue
        lines.append(f"| {r['model']} | {r.get('shapes', '')[:50]} | "
                     + " | ".join(_cell(r["rows"].get(lb)) for lb in labels) + " |")
    return "\n".join(lines)


def totals(results: list, labels: list) -> dict:
    """Sum of Cast MB per converter over the models where every compared row has bytes."""
    def mb(r, lb):
        row = r["rows"].get(lb) or {}
        return (row.get("cast_traffic") or {}).get("bytes") if row.get("status") == "ok" else None
    out: dict = {}
    for lb in labels:
        vals = [mb(r, lb) for r in results if "rows" in r]
        out[lb] = {"mb": sum(v for v in vals if v is not None) / 1e6, "models": sum(v is not None for v in vals),
                   "casts": sum(((r["rows"].get(lb) or {}).get("cast_traffic") or {}).get("casts") or 0
                                for r in results if "rows" in r)}

    def loads(r, lb):
        return ((r["rows"].get(lb) or {}).get("ort_load") or {}).get("ok")

    def paired(a, b, usable=False):  # only models where both rows have bytes (usable: and both load in ORT)
        pa = pb = 0.0
        n = 0
        for r in results:
            if "rows" not in r or (usable and not (loads(r, a) and loads(r, b))):
                continue
            x, y = mb(r, a), mb(r, b)
            if x is not None and y is not None:
                pa, pb, n = pa + x, pb + y, n + 1
        return {"numerator_mb": pa / 1e6, "denominator_mb": pb / 1e6, "models": n,
                "ratio": pa / pb if pb else None}
    g = "graphmp after" if "graphmp after" in labels else "graphmp"
    if "graphmp before" in labels:
        out["ratio_after_over_before"] = paired(g, "graphmp before")
    out["ratio_graphmp_over_occ"] = paired(g, "occ")
    out["ratio_graphmp_over_occ_where_occ_loads"] = paired(g, "occ", usable=True)
    if "autocast" in labels:
        out["ratio_graphmp_over_autocast"] = paired(g, "autocast", usable=True)
        out["models_over_2x_autocast"] = [
            r["model"] for r in results if "rows" in r and mb(r, g) is not None and mb(r, "autocast")
            and mb(r, g) > 2 * mb(r, "autocast") and mb(r, g) - 2 * mb(r, "autocast") > 1e5]
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        tool, src, dst, *batches = argv[1:]
        print(json.dumps(_child(tool, src, dst, batches)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--graphmp-root", default=None, metavar="PATH",
                    help="another checkout: adds a 'graphmp before' row converted with PATH/graphmp")
    ap.add_argument("--autocast-python", default="/work/venv-modelopt/bin/python")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=600.0, help="per conversion, seconds")
    ap.add_argument("--work", default=None, help="keep the converted models here (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.graphmp_root:
        args.graphmp_root = str(Path(args.graphmp_root).resolve())
        if not (Path(args.graphmp_root) / "graphmp" / "__init__.py").is_file():
            ap.error(f"--graphmp-root {args.graphmp_root}: no graphmp/__init__.py there")
    models = args.models or default_models()
    tmp = None
    if args.work:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="graphmp-casts-")
        work = Path(tmp.name)

    def log(s):
        print(s, file=sys.stderr, flush=True)
    results = [bench_model(m, args, work, log) for m in models]
    labels = (["graphmp before", "graphmp after"] if args.graphmp_root else ["graphmp"]) + ["occ"]
    if args.autocast_python and os.path.exists(args.autocast_python):
        labels.append("autocast")
    tot = totals(results, labels)
    print("cells: Casts / MB moved per inference / FP16 share of Conv-MatMul FLOPs / max emulated error\n")
    print(table(results, labels))
    print()
    for lb in labels:
        print(f"total {lb}: {tot[lb]['casts']} Casts, {tot[lb]['mb']:.2f} MB over {tot[lb]['models']} models")
    if "models_over_2x_autocast" in tot:
        print(f"models above 2x AutoCast's bytes (and 0.1 MB over): {tot['models_over_2x_autocast'] or 'none'}")
    for k in ("ratio_after_over_before", "ratio_graphmp_over_occ", "ratio_graphmp_over_occ_where_occ_loads",
              "ratio_graphmp_over_autocast"):
        if k in tot:
            t = tot[k]
            r = "-" if t["ratio"] is None else f"{t['ratio']:.3f}"
            print(f"{k}: {r} ({t['numerator_mb']:.2f} / {t['denominator_mb']:.2f} MB, {t['models']} models)")
    auto = "not available" if not os.path.exists(args.autocast_python) else args.autocast_python
    if args.json:
        Path(args.json).write_text(json.dumps({"graphmp_root": args.graphmp_root, "models": results,
                                               "totals": tot, "autocast": auto}, indent=1, default=str))
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The GPU check: one run that says whether graphmp's Tensor Core paths work on this machine.

Run it through benchmarks/gpu_check.sh, which first installs the GPU extra from the wheels
it is given (onnxruntime-gpu in five parts, TensorRT if its wheel is there). Steps:

  models    ResNet-50, BERT-base and GPT-2 (models/build/, else exported with
            models/export_hf.py: torch + transformers) and a detector (models/real/
            ultraface_rfb640.onnx, face detector, committed).
  convert   graphmp convert each -> <out>/<name>.mp.onnx (report JSON beside it).
  numerics  the converted model on ORT CUDA vs the FP32 model on ORT CPU, same inputs:
            per output max|a-b|/max|ref|, argmax agreement (class-score outputs), new inf/NaN;
            the FP32 model on ORT CUDA with TF32 is the yardstick. Pass: no new inf/NaN,
            error <= max(1e-2, 2 x TF32 error), argmax agreement >= 0.99. Batch: the largest
            bench batch (BERT-base and GPT-2: 8 sequences of 128 tokens).
  bench     graphmp bench --precisions fp32,tf32,fp16 --batch 1,32 on ort-cuda (and trt
            when TensorRT imports); the JSON of each model is kept.
  train     benchmarks/train.py --device cuda (FP32 vs mixed step time, vs torch CUDA AMP).
  tests     pytest -m gpu (the GPU-marked tests).
Writes <out>/gpu_check.json and <out>/gpu_check.png (matplotlib) and prints a table.
Exit 0: every step passed; 1: a check failed (the table says which); 2: cannot run here.

--dry-run runs the same steps on the CPU with the committed tiny models (tiny ResNet,
BERT, GPT-2 and the detector), batch 1 and 2, ORT CPU, a few timed runs, train.py on the
tiny CNN, and pytest -m gpu (its tests skip without a GPU): tests/test_gpu_check.py runs it
so that this script never rots. Its numbers say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
GPU_MODELS = {"resnet50": "build/resnet50.onnx", "bert-base": "build/bert-base.onnx",
              "detector": "real/ultraface_rfb640.onnx", "gpt2": "build/gpt2.onnx"}
DRY_MODELS = {"resnet50": "tiny/resnet.onnx", "bert-base": "tiny/bert.onnx",
              "detector": "real/ultraface_rfb640.onnx", "gpt2": "tiny/gpt2.onnx"}
EXPORT_NAMES = {"resnet50": "resnet50", "bert-base": "bert-base", "gpt2": "gpt2"}
TEXT_NUMERICS_BATCH = 8
# sequence length 128 for the full-size text models (batch 1 here; --batch sets the batch dims)
GPU_SHAPES = {"bert-base": {"input_ids": (1, 128), "attention_mask": (1, 128), "token_type_ids": (1, 128)},
              "gpt2": {"input_ids": (1, 128), "attention_mask": (1, 128)}}
MAX_ERROR, TF32_FACTOR, ARGMAX_MIN = 1e-2, 2.0, 0.99
CLASS_SCORES = ("logit", "score", "prob")  # output names whose argmax is a class


def _sub(cmd, log, timeout, env=None) -> tuple[int, float]:
    """Run cmd with output to `log`; (exit code, seconds). 124 = timed out."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO,
                                env=env or _env()).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\ngpu_check: timed out after {timeout} s\n")
            rc = 124
    return rc, time.perf_counter() - t0


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _graphmp(*args) -> list:
    return [sys.executable, "-c", "import sys; from graphmp.cli import main; sys.exit(main(sys.argv[1:]))", *args]


def _tail(log, n=1) -> str:
    try:
        with open(log) as f:
            lines = [x.strip() for x in f if x.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[:300]


def environment(dry: bool) -> dict:
    import onnxruntime as ort
    env = {"mode": "dry-run (CPU, tiny models)" if dry else "gpu", "host": platform.node(),
           "python": sys.version.split()[0], "onnxruntime": ort.__version__,
           "onnxruntime_package": os.path.dirname(ort.__file__), "providers": ort.get_available_providers()}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        env["gpu"] = out or None
    except (OSError, subprocess.SubprocessError):
        env["gpu"] = None
    for mod in ("tensorrt", "torch"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:  # not installed, or its libraries do not load
            env[mod] = f"not available ({type(e).__name__})"
    return env


# --- steps ----------------------------------------------------------------------------------------

def get_models(args, out) -> dict:
    """{name: path}; GPU mode exports what models/build lacks (export_hf.py, torch + transformers)."""
    table = DRY_MODELS if args.dry_run else GPU_MODELS
    names = [n for n in args.models.split(",") if n]
    bad = [n for n in names if n not in table]
    if bad:
        raise SystemExit(f"gpu_check: unknown model(s) {bad}; choose from {list(table)}")
    paths = {n: os.path.join(REPO, "models", table[n]) for n in names}
    missing = [n for n in names if not os.path.exists(paths[n])]
    if missing:
        dest = os.path.join(out, "models")
        log = os.path.join(out, "export.log")
        only = ",".join(EXPORT_NAMES[n] for n in missing if n in EXPORT_NAMES)
        rc, s = _sub([sys.executable, os.path.join(REPO, "models", "export_hf.py"), "--only", only, "--dest", dest],
                     log, args.step_timeout)
        print(f"  exported {only} in {s:.0f} s (exit {rc}; log {log})", flush=True)
        for n in missing:
            paths[n] = os.path.join(dest, f"{EXPORT_NAMES.get(n, n)}.onnx")
    return paths


def convert(name, src, out, timeout) -> dict:
    dst = os.path.join(out, f"{name}.mp.onnx")
    log = os.path.join(out, f"convert-{name}.log")
    rc, s = _sub(_graphmp("convert", src, "-o", dst, "--report", os.path.join(out, f"convert-{name}.json")),
                 log, timeout)
    return {"model": name, "source": src, "converted": dst if rc == 0 else None, "seconds": round(s, 2),
            "passed": rc == 0, "error": None if rc == 0 else _tail(log)}


def _session(path, providers, tf32: bool | None = None):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if providers[0] == CUDA:
        providers = [(CUDA, {"use_tf32": "1" if tf32 else "0"}), CPU]
    return ort.InferenceSession(path, so, providers=providers)


def output_metrics(ref, got, name) -> dict:
    """max|a-b|/max|ref| over the finite elements, argmax agreement over the last axis (class
    scores only, by output name), and the count of new inf/NaN."""
    import numpy as np
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    fin = np.isfinite(ref)
    new_nonfinite = int(np.sum(fin & ~np.isfinite(got)))
    denom = float(np.max(np.abs(ref[fin]))) if fin.any() else 0.0
    diff = np.abs(np.where(fin & np.isfinite(got), got - ref, 0.0))  # new inf/NaN are counted apart
    err = float(np.nanmax(diff)) / denom if denom > 0 else float(np.nanmax(diff) if diff.size else 0.0)
    m = {"error": err, "new_nonfinite": new_nonfinite, "argmax_agree": None}
    if ref.ndim >= 2 and ref.shape[-1] >= 2 and any(k in name.lower() for k in CLASS_SCORES):
        m["argmax_agree"] = float(np.mean(np.argmax(ref, -1) == np.argmax(np.nan_to_num(got), -1)))
    return m


def _shapes(name, dry, batch=1) -> dict | None:
    """--shapes of a model (None: graphmp finds plausible sizes), at `batch`."""
    given = None if dry else GPU_SHAPES.get(name)
    return {n: (batch,) + tuple(s[1:]) for n, s in given.items()} if given else None


def _shapes_text(shapes) -> str:
    return ",".join(f"{n}:{'x'.join(map(str, s))}" for n, s in shapes.items())


def numerics(name, src, converted, batch, provider, shapes=None) -> dict:
    """The converted model on `provider` vs the FP32 source on ORT CPU (and the FP32 source
    on `provider` with TF32 on as the yardstick), one generated batch."""
    import onnx
    from graphmp.inputs import find_shapes
    from graphmp.session import ran_on
    ref_sess = _session(src, [CPU])
    model = onnx.load(src, load_external_data=False)
    plan = find_shapes(model, lambda f: ref_sess.run(None, f), shapes, where=src)
    feeds = plan.feeds(seed=0, batch=batch if plan.batch_free else None)
    names = [o.name for o in ref_sess.get_outputs()]
    ref = dict(zip(names, ref_sess.run(None, feeds)))
    cand_sess = _session(converted, [provider, CPU] if provider == CUDA else [CPU], tf32=False)
    got = ran_on(cand_sess)
    cand = dict(zip(names, cand_sess.run(names, feeds)))
    yard = {}
    if provider == CUDA:
        yard = dict(zip(names, _session(src, [CUDA, CPU], tf32=True).run(names, feeds)))
    res = {"model": name, "inputs": plan.describe(batch if plan.batch_free else None), "ran_on": got,
           "outputs": {}, "passed": got == provider}
    if got != provider:
        res["error"] = f"the converted model's session came up on {got}, not {provider}"
    for n in names:
        m = output_metrics(ref[n], cand[n], n)
        m["tf32_error"] = output_metrics(ref[n], yard[n], n)["error"] if n in yard else None
        m["allowed"] = max(MAX_ERROR, TF32_FACTOR * (m["tf32_error"] or 0.0))
        m["passed"] = (m["new_nonfinite"] == 0 and m["error"] <= m["allowed"]
                       and (m["argmax_agree"] is None or m["argmax_agree"] >= ARGMAX_MIN))
        res["outputs"][n] = m
        res["passed"] = res["passed"] and m["passed"]
    return res


def bench(name, src, converted, args, out, backends) -> dict:
    js = os.path.join(out, f"bench-{name}.json")
    log = os.path.join(out, f"bench-{name}.log")
    cmd = _graphmp("bench", src, "--converted", converted, "--backends", backends, "--precisions", "fp32,tf32,fp16",
                   "--batch", args.batch, "--json", js, "--oracle-max-mb", "0", "-q", *args.bench_timing.split())
    shapes = _shapes(name, args.dry_run)
    if shapes:
        cmd += ["--shapes", _shapes_text(shapes)]
    rc, s = _sub(cmd, log, args.step_timeout)
    res = {"model": name, "exit": rc, "seconds": round(s, 1), "json": js, "rows": []}
    try:
        with open(js) as f:
            d = json.load(f)
    except (OSError, ValueError):
        res.update(passed=False, error=_tail(log) or f"exit {rc}, no JSON")
        return res
    for r in d.get("rows", []):
        acc = r.get("accuracy") or {}
        res["rows"].append({"backend": r["backend"], "precision": r["precision"], "variant": r.get("variant"),
                            "batch": r["batch"], "provider": r.get("provider"), "status": r["status"],
                            "median_ms": (r.get("latency_ms") or {}).get("median"),
                            "vs_fp32": r.get("speedup_vs_fp32"), "vs_tf32": r.get("speedup_vs_tf32"),
                            "error": acc.get("error"), "argmax": acc.get("argmax_agree"),
                            "in_tol": acc.get("passed"), "why": r.get("error")})
    ok = [r for r in res["rows"] if r["status"] == "ok"]
    res["passed"] = rc == 0 and bool(ok) and all(r["in_tol"] is not False for r in ok if r["precision"] == "fp16")
    if not res["passed"]:
        res["error"] = _tail(log) if rc else "a row failed or an FP16 row is out of tolerance"
    return res


def train(args, out) -> dict:
    js = os.path.join(out, "train.json")
    log = os.path.join(out, "train.log")
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--json", js, "--no-curves"] + args.train_args.split()
    rc, s = _sub(cmd, log, args.step_timeout)
    res = {"exit": rc, "seconds": round(s, 1), "json": js, "passed": rc == 0}
    try:
        with open(js) as f:
            d = json.load(f)
        res["rows"] = [{k: r.get(k) for k in ("model", "engine", "precision", "ran_on", "batch", "median_ms",
                                               "gpu_mem_mb", "loss_first", "loss_last", "error", "note")}
                       for r in d["results"]]
        res["targets"] = d.get("targets", [])
    except (OSError, ValueError, KeyError):
        res.update(passed=False, rows=[], error=_tail(log) or f"exit {rc}")
    rising = loss_failures(res["rows"])
    if rising:
        res.update(passed=False, error="; ".join(rising))
    if rc and "error" not in res:
        res["error"] = _tail(log)
    return res


# a row's loss may end at most this much above where it started (each row trains on one fixed
# batch, so its loss falls; noise of a few steps stays well under 2%)
LOSS_RISE_TOLERANCE = 0.02


def loss_failures(rows: list) -> list:
    """The rows whose training did not work: a loss that is not finite, or that rose over the
    row's steps on its fixed batch. One string per failed row (model, engine, precision, losses)."""
    bad = []
    for r in rows:
        first, last = r.get("loss_first"), r.get("loss_last")
        if first is None or last is None:
            continue  # a row that did not run: its error says why
        name = f"{r.get('model')} {r.get('engine')} {r.get('precision')}"
        if not (math.isfinite(first) and math.isfinite(last)):
            bad.append(f"{name}: loss {first:.4g} -> {last:.4g} is not finite")
        elif last > first * (1 + LOSS_RISE_TOLERANCE):
            bad.append(f"{name}: loss rose {first:.4g} -> {last:.4g} on a fixed batch")
    return bad


def gpu_tests(args, out) -> dict:
    log = os.path.join(out, "pytest-gpu.log")
    rc, s = _sub([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                  os.path.join(REPO, "tests")], log, args.step_timeout)
    return {"exit": rc, "seconds": round(s, 1), "summary": _tail(log), "passed": rc == 0}


# --- report ---------------------------------------------------------------------------------------

def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def table(res) -> str:
    """The printed summary: one section per step, markdown tables."""
    lines = [f"graphmp GPU check: {res['environment']['mode']}; GPU: {res['environment']['gpu'] or 'none'}; "
             f"onnxruntime {res['environment']['onnxruntime']} {res['environment']['providers']}; "
             f"TensorRT {res['environment']['tensorrt']}; torch {res['environment']['torch']}", ""]
    lines += ["| step | passed | seconds | note |", "|---|---|---|---|"]
    for s in res["steps"]:
        lines.append(f"| {s['step']} | {'yes' if s['passed'] else 'NO'} | {s['seconds']:.1f} | {s.get('note') or ''} |")
    if res.get("numerics"):
        lines += ["", "| model | inputs | ran on | output | err (max|a-b|/max|ref|) | TF32 err | argmax | new inf/NaN "
                  "| passed |", "|---|---|---|---|---|---|---|---|---|"]
        for n in res["numerics"]:
            for o, m in n.get("outputs", {}).items():
                lines.append(f"| {n['model']} | {n['inputs']} | {n['ran_on']} | {o} | {m['error']:.2e} | "
                             f"{_f(m['tf32_error'], '{:.2e}')} | {_f(m['argmax_agree'], '{:.4f}')} | "
                             f"{m['new_nonfinite']} | {'yes' if m['passed'] else 'NO'} |")
            if n.get("error"):
                lines.append(f"| {n['model']} | | | error: {n['error']} | | | | | NO |")
    if res.get("bench"):
        lines += ["", "| model | backend | precision | variant | batch | ran on | median ms | vs FP32 | vs TF32 | err | "
                  "argmax | in tol |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for b in res["bench"]:
            for r in b["rows"]:
                lines.append(f"| {b['model']} | {r['backend']} | {r['precision']} | {r['variant']} | {r['batch']} | "
                             f"{r['provider']} | {_f(r['median_ms'], '{:.3f}')} | {_f(r['vs_fp32'])} | "
                             f"{_f(r['vs_tf32'])} | {_f(r['error'], '{:.2e}')} | {_f(r['argmax'], '{:.4f}')} | "
                             f"{'-' if r['in_tol'] is None else 'yes' if r['in_tol'] else 'NO'} |"
                             + (f" {r['why']}" if r["status"] != "ok" else ""))
            if b.get("error") and not b["rows"]:
                lines.append(f"| {b['model']} | error: {b['error']} |")
    t = res.get("train")
    if t:
        lines += ["", "| model | engine | precision | ran on | batch | ms/step | GPU MB | loss first -> last |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in t.get("rows", []):
            lines.append(f"| {r['model']} | {r['engine']} | {r['precision']} | {r['ran_on'] or '-'} | {r['batch']} | "
                         + (f"{r['median_ms']:.2f} | {_f(r['gpu_mem_mb'], '{:.0f}')} | {r['loss_first']:.4f} -> "
                            f"{r['loss_last']:.4f} |" if r.get("median_ms") is not None
                            else f"failed: {r['error']} | | |"))
        for g in t.get("targets", []):
            lines.append(f"target {g['model']}: ORT CUDA mixed {_f(g['mixed_vs_fp32'])}x its FP32 step (>= 1.5), "
                         f"{_f(g['mixed_vs_torch_amp'])}x torch AMP's time (<= 1.2)")
    if res.get("tests"):
        lines += ["", f"pytest -m gpu: {res['tests']['summary']}"]
    lines += ["", f"result: {'PASSED' if res['passed'] else 'FAILED'}; wrote {res['json']}"
              + (f" and {res['png']}" if res.get("png") else "")]
    return "\n".join(lines)


def plot(res, path) -> str | None:
    """Bench medians (fastest variant per model/precision/batch) and train step times; None
    (and a note in the JSON) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        res["notes"].append("no PNG: matplotlib not installed (pip install 'graphmp[plot]')")
        return None
    best = {}
    for b in res.get("bench", []):
        for r in b["rows"]:
            if r["median_ms"] is not None:
                k = (f"{b['model']} b{r['batch']}", f"{r['backend']} {r['precision']}")
                best[k] = min(best.get(k, float("inf")), r["median_ms"])
    trows = [r for r in (res.get("train") or {}).get("rows", []) if r.get("median_ms") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    groups = sorted({g for g, _ in best})
    series = sorted({s for _, s in best})
    width = 0.8 / max(len(series), 1)
    for i, s in enumerate(series):
        axes[0].bar([j + i * width for j in range(len(groups))], [best.get((g, s), 0) for g in groups], width, label=s)
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups, rotation=30, ha="right", fontsize=8)
    axes[0].set_ylabel("median latency, ms (fastest variant)")
    axes[0].set_yscale("log")
    axes[0].set_title("graphmp bench")
    axes[0].legend(fontsize=7)
    axes[1].barh([f"{r['model']} {r['engine']} {r['precision']}" for r in trows], [r["median_ms"] for r in trows])
    axes[1].set_xlabel("ms / training step (median)")
    axes[1].set_title("benchmarks/train.py")
    axes[1].tick_params(axis="y", labelsize=7)
    fig.suptitle(f"graphmp GPU check ({res['environment']['mode']}; {res['environment']['gpu'] or 'no GPU'})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# --- main -----------------------------------------------------------------------------------------

def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with tiny models")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu_check"), help="folder for every output")
    ap.add_argument("--models", default="resnet50,bert-base,detector,gpt2")
    ap.add_argument("--batch", help="bench batch sizes (default 1,32; dry run 1,2); numerics uses the largest")
    ap.add_argument("--skip", default="", help="steps to leave out: numerics,bench,train,tests")
    ap.add_argument("--bench-timing", help="timing options passed to graphmp bench (default: --warmup 5 "
                    "--iterations 20 --min-time 0.3 --rounds 2; dry run: one quick round)")
    ap.add_argument("--train-args", help="options for benchmarks/train.py (default: --device cuda --steps 20 "
                    "--warmup 5; dry run: --device cpu --models tiny-cnn --steps 2 --warmup 1)")
    ap.add_argument("--step-timeout", type=int, default=None, help="seconds per command (default 300; dry run 120)")
    a = ap.parse_args(argv)
    dry = a.dry_run
    a.batch = a.batch or ("1,2" if dry else "1,32")
    a.bench_timing = a.bench_timing or ("--warmup 1 --iterations 2 --min-time 0 --rounds 1" if dry
                                        else "--warmup 5 --iterations 20 --min-time 0.3 --rounds 2")
    a.train_args = a.train_args or ("--device cpu --models tiny-cnn --steps 2 --warmup 1" if dry
                                    else "--device cuda --steps 20 --warmup 5")
    a.step_timeout = a.step_timeout or (120 if dry else 300)
    return a


def main(argv=None) -> int:
    args = _args(argv)
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    env = environment(args.dry_run)
    if not args.dry_run and CUDA not in env["providers"]:
        print(f"gpu_check: onnxruntime {env['onnxruntime']} ({env['onnxruntime_package']}) has no {CUDA} "
              f"(providers {env['providers']}). Run benchmarks/gpu_check.sh with the onnxruntime-gpu parts "
              "(.ortgpu1..N from benchmarks/ortgpu_parts.sh, see docs/gpu.md), or use --dry-run.", file=sys.stderr)
        return 2
    provider = CPU if args.dry_run else CUDA
    backends = "ort-cpu" if args.dry_run else "ort-cuda" + (",trt" if "not available" not in env["tensorrt"] else "")
    skip = set(filter(None, args.skip.split(",")))
    res = {"environment": env, "settings": {k: v for k, v in vars(args).items()}, "steps": [], "notes": [],
           "json": os.path.join(args.out, "gpu_check.json")}

    def step(name, fn):
        t0 = time.perf_counter()
        print(f"[{time.perf_counter() - t_start:6.0f} s] {name} ...", flush=True)
        try:
            passed, note = fn()
        except Exception as e:  # one step's crash is that step's failure; the others still run
            passed, note = False, f"{type(e).__name__}: {str(e)[:200]}"
        res["steps"].append({"step": name, "passed": passed, "seconds": time.perf_counter() - t0, "note": note})

    models, converted = {}, {}

    def do_models():
        models.update(get_models(args, args.out))
        missing = [n for n, p in models.items() if not os.path.exists(p)]
        for n in missing:
            models.pop(n)
        return not missing, (f"missing {missing}: see export.log" if missing else ", ".join(models))

    def do_convert():
        res["convert"] = [convert(n, p, args.out, args.step_timeout) for n, p in models.items()]
        converted.update({c["model"]: c["converted"] for c in res["convert"] if c["passed"]})
        bad = [f"{c['model']}: {c['error']}" for c in res["convert"] if not c["passed"]]
        return not bad, "; ".join(bad) or None

    def do_numerics():
        largest = max(int(b) for b in args.batch.split(","))
        res["numerics"] = []
        for n, c in converted.items():
            # GPT-2's batch-32 logits are 0.8 GB per run: 8 sequences of 128 tokens are samples enough
            batch = min(largest, TEXT_NUMERICS_BATCH) if n in GPU_SHAPES else largest
            try:
                res["numerics"].append(numerics(n, models[n], c, batch, provider, _shapes(n, args.dry_run, batch)))
            except Exception as e:
                res["numerics"].append({"model": n, "inputs": "-", "ran_on": "-", "outputs": {}, "passed": False,
                                        "error": f"{type(e).__name__}: {str(e)[:200]}"})
        bad = [x["model"] for x in res["numerics"] if not x["passed"]]
        return not bad and bool(res["numerics"]), (f"failed: {bad}" if bad else None)

    def do_bench():
        res["bench"] = [bench(n, models[n], c, args, args.out, backends) for n, c in converted.items()]
        bad = [f"{b['model']}: {b.get('error')}" for b in res["bench"] if not b["passed"]]
        return not bad and bool(res["bench"]), "; ".join(bad) or f"backends {backends}"

    def do_train():
        res["train"] = train(args, args.out)
        return res["train"]["passed"], res["train"].get("error")

    def do_tests():
        res["tests"] = gpu_tests(args, args.out)
        return res["tests"]["passed"], res["tests"]["summary"]

    step("models", do_models)
    step("convert", do_convert)
    for name, fn in (("numerics", do_numerics), ("bench", do_bench), ("train", do_train), ("tests", do_tests)):
        if name not in skip:
            step(name, fn)
    res["seconds"] = time.perf_counter() - t_start
    res["passed"] = all(s["passed"] for s in res["steps"])
    res["png"] = plot(res, os.path.join(args.out, "gpu_check.png"))
    with open(res["json"] + ".tmp", "w") as f:
        json.dump(res, f, indent=2, default=str)
    os.replace(res["json"] + ".tmp", res["json"])
    print(table(res))
    print(f"total {res['seconds']:.0f} s")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

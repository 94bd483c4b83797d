#!/usr/bin/env python
"""Training-step benchmark: graphmp step graph (FP32 vs mixed) on ONNX Runtime CPU and
(when onnxruntime-gpu sees a GPU) CUDA, against the same model's step in PyTorch (eager
FP32 on CPU; FP32 and AMP FP16 on GPU) when torch is importable; plus a short FP32-vs-mixed
convergence run plotted to benchmarks/results/train_curves.png (matplotlib, optional).

Every measurement runs in its own subprocess, so peak RSS (VmHWM) belongs to one
engine/precision; `rss_before_session_mb` is the same process after its imports. Step time = median over --steps steps after --warmup steps, one batch
per step (the batch is a fixed random batch: data loading is not timed).
Device memory: torch.cuda.max_memory_allocated for torch; for ORT CUDA the process's
used GPU memory from nvidia-smi after the steps (includes the CUDA context and arena).

Note: ONNX Runtime's CPU provider computes almost every FP16 op in FP32 (it inserts
casts), so the mixed step graph is NOT expected to be faster than FP32 on the CPU; the
mixed CPU numbers measure the cost of the extra Casts. Speed from FP16 needs a GPU.

Usage:
  python benchmarks/train.py [--steps 30] [--warmup 5] [--models cnn,block]
                             [--json benchmarks/results/train.json] [--no-curves]
Models (torch needed to export them; without torch only `tiny-cnn`, built with onnx.helper):
  cnn    models/train/torch_models.CNN(cin=3, width=32, size=32, classes=10), batch 64 of 3x32x32
  block  models/train/torch_models.Block(d=128, heads=4, classes=10), batch 32 of 64 tokens x 128
  tiny-cnn  models/train/tiny.cnn(channels=32, size=32), batch 64 of 1x32x32
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
TAG = "@@RESULT "

MODELS = {
    "cnn": dict(kind="torch", cls="CNN", kw=dict(cin=3, width=32, size=32, classes=10), x=(64, 3, 32, 32), classes=10),
    "block": dict(kind="torch", cls="Block", kw=dict(d=128, heads=4, classes=10), x=(32, 64, 128), classes=10),
    "tiny-cnn": dict(kind="onnx", kw=dict(channels=32, size=32, classes=4), x=(64, 1, 32, 32), classes=4),
}


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401  (only whether it imports)
        return True
    except ImportError:
        return False


def _batch(spec, seed=0):
    import numpy as np
    r = np.random.default_rng(seed)
    return {"x": r.standard_normal(spec["x"]).astype(np.float32),
            "labels": r.integers(0, spec["classes"], spec["x"][0]).astype(np.int64)}


def _peak_rss_mb() -> float:
    """Peak RSS of this process: VmHWM (Linux; ru_maxrss would carry the parent's peak
    across fork+exec), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _gpu_mem_mb() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        pid, mem = (s.strip() for s in line.split(","))
        if pid == str(os.getpid()):
            return float(mem)
    return None


def _time(fn, steps, warmup, sync=None):
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        ts.append(time.perf_counter() - t0)
    return {"median_ms": statistics.median(ts) * 1e3, "p90_ms": sorted(ts)[int(0.9 * (len(ts) - 1))] * 1e3}


# --- one measurement (child process) --------------------------------------------------------------

def child_ort(args):
    from graphmp.train.loop import StepRunner, latest_state, load_run
    spec = MODELS[args.model]
    meta = load_run(args.run_dir)
    state, _ = latest_state(args.run_dir)
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if args.engine == "ort-cuda" else None
    base = _peak_rss_mb()
    r = StepRunner(args.run_dir, meta, state, providers=providers)
    batch = _batch(spec)
    res = _time(lambda: r.step(batch), args.steps, args.warmup)
    res.update(peak_rss_mb=_peak_rss_mb(), rss_before_session_mb=base, state_on_device=r.bound,
               skipped=0, providers=r.sess.get_providers()[:1])
    if args.engine == "ort-cuda":
        res["gpu_mem_mb"] = _gpu_mem_mb()
    return res


def child_torch(args):
    import torch
    from models.train import torch_models
    spec = MODELS[args.model]
    torch.manual_seed(0)
    m = getattr(torch_models, spec["cls"])(**spec["kw"])
    m.load_state_dict(torch.load(os.path.join(args.work, f"{args.model}.pt")))
    dev = "cuda" if args.engine == "torch-cuda" else "cpu"
    m = m.to(dev).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    b = _batch(spec)
    x, y = torch.from_numpy(b["x"]).to(dev), torch.from_numpy(b["labels"]).to(dev)
    amp = args.precision == "mixed"
    scaler = torch.amp.GradScaler("cuda", enabled=amp) if dev == "cuda" else None
    if amp and dev != "cuda":
        raise SystemExit("torch AMP is measured on the GPU only")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=dev, dtype=torch.float16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()

    base = _peak_rss_mb()
    res = _time(step, args.steps, args.warmup, torch.cuda.synchronize if dev == "cuda" else None)
    res.update(peak_rss_mb=_peak_rss_mb(), rss_before_session_mb=base, threads=torch.get_num_threads())
    if dev == "cuda":
        res["gpu_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return res


# --- parent ---------------------------------------------------------------------------------------

def _prepare_models(names, work):
    """Export each model (ONNX + torch state dict) into work/; return {name: onnx path}."""
    import numpy as np
    import onnx
    paths = {}
    for name in names:
        spec = MODELS[name]
        path = os.path.join(work, f"{name}.onnx")
        if spec["kind"] == "torch":
            import torch
            from models.train import torch_models
            torch.manual_seed(0)
            m = getattr(torch_models, spec["cls"])(**spec["kw"])
            torch.save(m.state_dict(), os.path.join(work, f"{name}.pt"))
            torch_models.export(m, np.zeros(spec["x"], np.float32), path)
        else:
            from models.train import tiny
            onnx.save(tiny.cnn(**spec["kw"]), path)
        paths[name] = path
    return paths


def _child(argv, timeout=900):
    p = subprocess.run([sys.executable, __file__] + argv, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, PYTHONPATH=REPO))
    for line in p.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit {p.returncode}"]}


def _curves(out_png, results_json):
    """FP32 vs mixed on the synthetic bars task (models/train/tiny.py), loss per step."""
    import onnx
    from graphmp.train.loop import train
    from graphmp.train.step import build_step
    from models.train import tiny
    work = tempfile.mkdtemp(prefix="graphmp-curves-")
    path = os.path.join(work, "cnn.onnx")
    onnx.save(tiny.cnn(), path)
    tr, ev = tiny.bars(4096, seed=1), tiny.bars(1024, seed=2)
    res = {}
    for p in ("fp32", "mixed"):
        run = os.path.join(work, p)
        build_step(path, run, precision=p, optimizer="adamw", lr=1e-2)
        r = train(run, tr, epochs=3, batch_size=32, eval_data=ev, checkpoint_every=0, progress=False)
        res[p] = {"loss": r.history["loss"], "eval": r.summary["eval"], "skipped": r.summary["skipped_steps"],
                  "final_scale": r.summary["final_scale"]}
    results_json["convergence"] = {p: {k: v for k, v in d.items() if k != "loss"} for p, d in res.items()}
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        results_json["convergence"]["png"] = "matplotlib not installed (pip install 'graphmp[plot]')"
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for p, d in res.items():
        ax.plot(d["loss"], lw=0.8, label=f"{p}: eval acc {d['eval']['accuracy']:.3f}, {d['skipped']} skipped")
    ax.set_xlabel("step (batch 32)")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title("graphmp step graph on ORT CPU: small CNN, synthetic 8x8 bars (4 classes)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    results_json["convergence"]["png"] = out_png


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--models", default=None, help="comma separated (default: cnn,block with torch, else tiny-cnn)")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "train.json"))
    ap.add_argument("--no-curves", action="store_true")
    ap.add_argument("--one", nargs=4, metavar=("MODEL", "ENGINE", "PRECISION", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        args.model, args.engine, args.precision, d = args.one
        args.run_dir = args.work = d
        fn = child_torch if args.engine.startswith("torch") else child_ort
        print(TAG + json.dumps(fn(args)))
        return

    from graphmp.oracle import cuda_available
    from graphmp.train.step import build_step
    torch_ok = _has_torch()
    torch_cuda = False
    if torch_ok:
        import torch
        torch_cuda = torch.cuda.is_available()
    names = args.models.split(",") if args.models else (["cnn", "block"] if torch_ok else ["tiny-cnn"])
    work = tempfile.mkdtemp(prefix="graphmp-bench-train-")
    paths = _prepare_models(names, work)
    engines = [("ort-cpu", "fp32"), ("ort-cpu", "mixed")]
    if cuda_available():
        engines += [("ort-cuda", "fp32"), ("ort-cuda", "mixed")]
    if torch_ok:
        engines += [("torch-cpu", "fp32")]
        if torch_cuda:
            engines += [("torch-cuda", "fp32"), ("torch-cuda", "mixed")]
    out = {"host": platform.node(), "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
           "steps": args.steps, "warmup": args.warmup, "optimizer": "adamw lr 1e-3",
           "torch": (__import__("torch").__version__ if torch_ok else "not installed: no PyTorch reference"),
           "onnxruntime": __import__("onnxruntime").__version__, "ort_cuda": cuda_available(),
           "note": "ORT CPU computes FP16 ops in FP32: mixed is not expected to be faster on the CPU.",
           "results": []}
    for name in names:
        run_dirs = {}
        for prec in ("fp32", "mixed"):
            run_dirs[prec] = os.path.join(work, f"{name}-{prec}")
            t0 = time.perf_counter()
            meta = build_step(paths[name], run_dirs[prec], precision=prec, optimizer="adamw", lr=1e-3)
            out.setdefault("build_seconds", {})[f"{name}-{prec}"] = round(time.perf_counter() - t0, 2)
            out.setdefault("step_graph_nodes", {})[f"{name}-{prec}"] = meta["nodes"]["total"]
        for engine, prec in engines:
            d = run_dirs[prec] if engine.startswith("ort") else work
            r = _child(["--one", name, engine, prec, d, "--steps", str(args.steps), "--warmup", str(args.warmup)])
            r.update(model=name, engine=engine, precision=prec, batch=MODELS[name]["x"][0])
            out["results"].append(r)
            print(f"  {name:6s} {engine:10s} {prec:6s} " + (f"{r['median_ms']:8.2f} ms/step  peak RSS "
                  f"{r['peak_rss_mb']:7.1f} MB" + (f"  GPU {r['gpu_mem_mb']} MB" if r.get("gpu_mem_mb") else "")
                  if "median_ms" in r else f"FAILED: {r['error']}"), flush=True)
    if not args.no_curves:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        _curves(os.path.join(os.path.dirname(args.json), "train_curves.png"), out)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json + ".tmp", "w") as f:
        json.dump(out, f, indent=2, default=str)
    os.replace(args.json + ".tmp", args.json)
    print("\n| model | engine | precision | batch | ms/step (median) | p90 | peak RSS MB | GPU MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out["results"]:
        if "median_ms" in r:
            print(f"| {r['model']} | {r['engine']} | {r['precision']} | {r['batch']} | {r['median_ms']:.2f} | "
                  f"{r['p90_ms']:.2f} | {r['peak_rss_mb']:.0f} | {r.get('gpu_mem_mb') or '-'} |")
        else:
            print(f"| {r['model']} | {r['engine']} | {r['precision']} | {r['batch']} | failed: {r['error']} | | | |")
    if "convergence" in out:
        c = out["convergence"]
        print("\nconvergence (tiny CNN, bars task, 3 epochs): " + ", ".join(
            f"{p} eval acc {c[p]['eval']['accuracy']:.3f} ({c[p]['skipped']} skipped)" for p in ("fp32", "mixed"))
            + f"; plot: {c.get('png')}")
    print(out["note"] + (" " if torch_ok else " torch not installed: no PyTorch reference.") + f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

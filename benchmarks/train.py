#!/usr/bin/env python
"""Training-step benchmark: graphmp step graph (FP32 vs mixed) on ONNX Runtime CPU and
CUDA, against the same model's step in PyTorch (eager FP32 on CPU; FP32 and AMP FP16 on
GPU) when torch is importable; plus a short FP32-vs-mixed convergence run plotted to
benchmarks/results/train_curves.png (matplotlib, optional).

Honest rows:
- Every measurement runs in its own subprocess (peak RSS = VmHWM of one engine/precision).
  Children get PYTHONPATH = the repo PREPENDED to the caller's PYTHONPATH, so an
  onnxruntime-gpu reachable only through PYTHONPATH is the one the child imports.
- Every ORT row names the provider its session actually ran on (`ran_on`, from
  sess.get_providers()); torch rows name their device. An `ort-cuda` row that came up on
  the CPU fails with --device cuda, and with --device auto is kept and labelled
  `ran_on: CPUExecutionProvider` with a note (never a CPU time under a CUDA label).
- GPU memory is measured the same way for ORT and torch: device memory in use by the
  child process after the timed steps, from NVML (nvidia-ml-py), else nvidia-smi, else
  (containers hide per-process figures) GPU memory in use after minus before the child
  touched CUDA; it includes the CUDA context and each framework's allocator cache (ORT
  arena, torch caching allocator). torch's max_memory_allocated is reported beside it,
  named as such. Each row's `gpu_mem_method` says which method was used.
- Step time = median over --steps steps after --warmup steps, one fixed random batch per
  step (data loading is not timed); `loss_first`/`loss_last` (first warm-up step, last
  timed step) show that ORT FP32, ORT mixed and torch follow the same loss on that batch.

Note: ONNX Runtime's CPU provider computes almost every FP16 op in FP32 (it inserts
casts), so the mixed step graph is NOT expected to be faster than FP32 on the CPU. Speed
from FP16 needs a GPU, and a model big enough for Tensor Cores to matter: the GPU-sized
cases below (target on a GPU: ORT CUDA mixed >= 1.5x its FP32 step, within 1.2x of torch
CUDA AMP; the `targets` section of the JSON checks both).

Usage:
  python benchmarks/train.py [--device auto|cpu|cuda] [--steps 30] [--warmup 5] [--models cnn,block]
                             [--tiny] [--json benchmarks/results/train.json] [--no-curves] [--work DIR]
                             [--build-only | --reuse]
Models (torch needed to export them; without torch only `tiny-cnn`, built with onnx.helper):
  cnn        tests/fixtures/torch_models.CNN(cin=3, width=32, size=32, classes=10), batch 64 of 3x32x32
  block      tests/fixtures/torch_models.Block(d=128, heads=4, classes=10), batch 32 of 64 tokens x 128
  tiny-cnn   tests/fixtures/tiny.cnn(channels=32, size=32), batch 64 of 1x32x32
GPU-sized (in the default run only when ORT CUDA runs; never on the CPU unless --tiny):
  bert-base  BERT-base encoder stack: 12 post-LN layers, d 768, 12 heads, FFN 3072, batch 32 x 128 tokens
  resnet50   ResNet-50 (bottleneck 3-4-6-3, BatchNorm), batch 32 of 3x224x224, 1000 classes
  --tiny     the GPU-sized cases at toy size (2 layers d 64 / width 1/16 at 32x32, batch 4), for CPU checks
"""
from __future__ import annotations

import argparse
import json
import math
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
GPU_SIZED = ("bert-base", "resnet50")
CUDA_ENGINES = ("ort-cuda", "torch-cuda")
# AdamW's learning rate for every row (ORT and torch alike). Each row trains on one fixed
# batch, so its loss must fall: at 1e-3 the first AdamW steps (each weight moves by about
# lr) overshoot on tiny-cnn's 8192-input Gemm and its loss rose from 1.59 to 9.09 in 3 steps.
LR = 1e-4


def model_specs(tiny: bool = False) -> dict:
    """name -> spec: kind (torch | onnx), class and keywords, input shape x, classes."""
    specs = {
        "cnn": dict(kind="torch", cls="CNN", kw=dict(cin=3, width=32, size=32, classes=10), x=(64, 3, 32, 32),
                    classes=10),
        "block": dict(kind="torch", cls="Block", kw=dict(d=128, heads=4, classes=10), x=(32, 64, 128), classes=10),
        "tiny-cnn": dict(kind="onnx", kw=dict(channels=32, size=32, classes=4), x=(64, 1, 32, 32), classes=4),
    }
    if tiny:
        specs["bert-base"] = dict(kind="torch", cls="EncoderStack", kw=dict(d=64, heads=2, layers=2, classes=2),
                                  x=(4, 16, 64), classes=2)
        specs["resnet50"] = dict(kind="torch", cls="ResNet50", kw=dict(width=4, classes=10), x=(4, 3, 32, 32),
                                 classes=10)
    else:
        specs["bert-base"] = dict(kind="torch", cls="EncoderStack", kw=dict(d=768, heads=12, layers=12, classes=2),
                                  x=(32, 128, 768), classes=2)
        specs["resnet50"] = dict(kind="torch", cls="ResNet50", kw=dict(width=64, classes=1000),
                                 x=(32, 3, 224, 224), classes=1000)
    return specs


def _gpu_sized_modules():
    """torch modules of the GPU-sized cases (torch imported only here)."""
    import torch
    nn, F = torch.nn, torch.nn.functional

    class EncoderLayer(nn.Module):
        """BERT's post-LN encoder layer: x = LN(x + Attn(x)); x = LN(x + FFN(x)), GELU FFN (4d)."""

        def __init__(self, d, heads):
            super().__init__()
            self.h = heads
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)

        def forward(self, x):
            n, t, d = x.shape
            q, k, v = self.qkv(x).split(d, dim=-1)
            q, k, v = (z.reshape(n, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
            att = torch.softmax(q @ k.transpose(-2, -1) * (d // self.h) ** -0.5, dim=-1)
            x = self.ln1(x + self.proj((att @ v).transpose(1, 2).reshape(n, t, d)))
            return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))

    class EncoderStack(nn.Module):
        """`layers` encoder layers on [N, T, d] embeddings, mean-pooled classifier head."""

        def __init__(self, d=768, heads=12, layers=12, classes=2):
            super().__init__()
            self.layers = nn.ModuleList(EncoderLayer(d, heads) for _ in range(layers))
            self.head = nn.Linear(d, classes)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x.mean(1))

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, stride):
            super().__init__()
            cout = 4 * mid
            self.c1, self.b1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
            self.c2, self.b2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
            self.c3, self.b3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = F.relu(self.b1(self.c1(x)))
            y = F.relu(self.b2(self.c2(y)))
            y = self.b3(self.c3(y))
            return F.relu(y + (x if self.down is None else self.down(x)))

    class ResNet50(nn.Module):
        """torchvision's ResNet-50 layout (stem 7x7/2 + max pool, bottlenecks 3-4-6-3);
        `width` 64 is the real network."""

        def __init__(self, width=64, classes=1000):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1))
            blocks, cin = [], width
            for i, n in enumerate((3, 4, 6, 3)):
                mid = width * 2 ** i
                for j in range(n):
                    blocks.append(Bottleneck(cin, mid, 2 if (j == 0 and i > 0) else 1))
                    cin = 4 * mid
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(cin, classes)

        def forward(self, x):
            x = self.blocks(self.stem(x))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    return {"EncoderStack": EncoderStack, "ResNet50": ResNet50}


def _torch_module(spec):
    from tests.fixtures import torch_models
    cls = getattr(torch_models, spec["cls"], None) or _gpu_sized_modules()[spec["cls"]]
    return cls(**spec["kw"])


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


def _nvml_query(fn):
    """fn(pynvml, device 0 handle), or None when NVML is not there or not allowed."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, no driver, or NVML not allowed here (containers)
        return None
    try:
        return fn(pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


def device_used_mb() -> float | None:
    """Device memory in use on GPU 0 (all processes), MiB: NVML, else nvidia-smi."""
    used = _nvml_query(lambda nv, h: nv.nvmlDeviceGetMemoryInfo(h).used / 2**20)
    if used is not None:
        return used
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return float(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def gpu_mem_mb(device_before: float | None = None) -> tuple[float | None, str]:
    """(device memory this process uses, MiB; how it was measured). The same measurement for
    ORT and torch: what the driver charges the process (CUDA context + allocations +
    allocator caches): NVML's per-process figure, else nvidia-smi's; where containers hide
    per-process figures, GPU 0's memory in use now minus `device_before` (read before this
    process touched CUDA; right while no other process uses the GPU). (None, why) otherwise."""
    pid = os.getpid()
    mine = _nvml_query(lambda nv, h: [p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(h)
                                      if p.pid == pid and p.usedGpuMemory is not None])
    if mine:
        return mine[0] / 2**20, "nvml per-process"
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        for line in out.splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
                return float(parts[1]), "nvidia-smi per-process"
    except (OSError, subprocess.SubprocessError):
        pass
    now = device_used_mb()
    if now is not None and device_before is not None:
        return now - device_before, "device memory in use after minus before this process (no per-process figure)"
    return None, "unavailable (no NVML or nvidia-smi answer for this process)"


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
    p90 = sorted(ts)[min(len(ts) - 1, math.ceil(0.9 * (len(ts) - 1)))]  # ceil: never below the median
    return {"median_ms": statistics.median(ts) * 1e3, "p90_ms": p90 * 1e3}


# --- one measurement (child process) --------------------------------------------------------------

def child_ort(args):
    """One ORT row. Raises GraphmpError for --device cuda when the session is not on CUDA."""
    from graphmp.session import ran_on
    from graphmp.train.device import CUDA, check_session, providers_for
    from graphmp.train.loop import StepRunner, latest_state, load_run
    spec = model_specs(args.tiny)[args.model]
    meta = load_run(args.run_dir)
    state, _ = latest_state(args.run_dir)
    providers = ["CPUExecutionProvider"]
    note = None
    dev_before = device_used_mb() if args.engine == "ort-cuda" else None
    if args.engine == "ort-cuda":
        providers, note = providers_for(args.device)  # cuda without the provider: GraphmpError
    base = _peak_rss_mb()
    r = StepRunner(args.run_dir, meta, state, providers=providers)
    if args.engine == "ort-cuda":
        note = check_session(r.sess, providers, args.device, "training step") or note
    got = ran_on(r.sess)
    batch = _batch(spec)
    losses = []
    res = _time(lambda: losses.append(float(r.step(batch)[0])), args.steps, args.warmup)
    res.update(peak_rss_mb=_peak_rss_mb(), rss_before_session_mb=base, state_on_device=r.bound,
               ran_on=got, loss_first=losses[0], loss_last=losses[-1])
    if note or (args.engine == "ort-cuda" and got != CUDA):
        res["note"] = note or f"asked for {CUDA}, ran on {got}"
    if got == CUDA:
        res["gpu_mem_mb"], res["gpu_mem_method"] = gpu_mem_mb(dev_before)
    return res


def child_torch(args):
    dev_before = device_used_mb() if args.engine == "torch-cuda" else None  # before torch touches CUDA
    import torch
    spec = model_specs(args.tiny)[args.model]
    torch.manual_seed(0)
    m = _torch_module(spec)
    m.load_state_dict(torch.load(os.path.join(args.work, f"{args.model}.pt")))
    dev = "cuda" if args.engine == "torch-cuda" else "cpu"
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("torch-cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    m = m.to(dev).train()
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    b = _batch(spec)
    x, y = torch.from_numpy(b["x"]).to(dev), torch.from_numpy(b["labels"]).to(dev)
    amp = args.precision == "mixed"
    scaler = torch.amp.GradScaler("cuda", enabled=amp) if dev == "cuda" else None
    if amp and dev != "cuda":
        raise SystemExit("torch AMP is measured on the GPU only")
    losses = []

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
        losses.append(loss.detach())  # read after timing: .item() here would add a sync

    base = _peak_rss_mb()
    res = _time(step, args.steps, args.warmup, torch.cuda.synchronize if dev == "cuda" else None)
    res.update(peak_rss_mb=_peak_rss_mb(), rss_before_session_mb=base, threads=torch.get_num_threads(),
               ran_on=f"torch {dev}", loss_first=float(losses[0]), loss_last=float(losses[-1]))
    if dev == "cuda":
        res["gpu_mem_mb"], res["gpu_mem_method"] = gpu_mem_mb(dev_before)
        res["torch_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return res


# --- parent ---------------------------------------------------------------------------------------

def _prepare_models(names, work, tiny):
    """Export each model (ONNX + torch state dict) into work/; return {name: onnx path}."""
    import numpy as np
    import onnx
    paths, specs = {}, model_specs(tiny)
    for name in names:
        spec = specs[name]
        path = os.path.join(work, f"{name}.onnx")
        if spec["kind"] == "torch":
            import torch
            from tests.fixtures import torch_models
            torch.manual_seed(0)
            m = _torch_module(spec)
            torch.save(m.state_dict(), os.path.join(work, f"{name}.pt"))
            torch_models.export(m, np.zeros(spec["x"], np.float32), path)
        else:
            from tests.fixtures import tiny as tiny_models
            onnx.save(tiny_models.cnn(**spec["kw"]), path)
        paths[name] = path
    return paths


def _exported(name: str, spec: dict, work: str) -> bool:
    """Whether work/ holds name's export (and its torch weights, for a torch model)."""
    files = [f"{name}.onnx"] + ([f"{name}.pt"] if spec["kind"] == "torch" else [])
    return all(os.path.isfile(os.path.join(work, f)) for f in files)


def child_env(environ=None) -> dict:
    """The children's environment: the repo PREPENDED to PYTHONPATH (never replacing it,
    so packages reachable only through the caller's PYTHONPATH, e.g. onnxruntime-gpu
    installed with --target, are what the child imports)."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _child(argv, timeout=1800):
    p = subprocess.run([sys.executable, __file__] + argv, capture_output=True, text=True, timeout=timeout,
                       env=child_env())
    for line in p.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    return {"error": ((p.stderr or p.stdout).strip().splitlines() or [f"exit {p.returncode}"])[-1]}


def _curves(out_png, results_json):
    """FP32 vs mixed on the synthetic bars task (tests/fixtures/tiny.py), loss per step."""
    import onnx
    from graphmp.train.config import StepConfig, TrainConfig
    from graphmp.train.loop import train
    from graphmp.train.step import build_step
    from tests.fixtures import tiny
    work = tempfile.mkdtemp(prefix="graphmp-curves-")
    path = os.path.join(work, "cnn.onnx")
    onnx.save(tiny.cnn(), path)
    tr, ev = tiny.bars(4096, seed=1), tiny.bars(1024, seed=2)
    res = {}
    for p in ("fp32", "mixed"):
        run = os.path.join(work, p)
        build_step(path, run, StepConfig.from_kwargs(precision=p, optimizer="adamw", lr=1e-2))
        r = train(run, tr, TrainConfig.from_kwargs(epochs=3, batch_size=32, checkpoint_every=0, progress=False),
                  eval_data=ev)
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


def _usage_error(msg: str):
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def plan(args, torch_ok: bool, torch_cuda: bool, ort_cuda: bool) -> tuple[list, list]:
    """(model names, [(engine, precision)]) for this run; exits 2 for an explicit
    --device cuda that cannot run, or a model that needs torch without it."""
    if args.device == "cuda" and not ort_cuda and not getattr(args, "build_only", False):
        from graphmp.train.device import providers_for
        try:
            providers_for("cuda")
        except Exception as e:
            _usage_error(str(e))
    use_cuda = args.device != "cpu" and ort_cuda
    if args.models:
        names = args.models.split(",")
    else:
        names = ["cnn", "block"] if torch_ok else ["tiny-cnn"]
        if torch_ok and (use_cuda or args.tiny):
            names += list(GPU_SIZED)
    specs = model_specs(args.tiny)
    bad = [n for n in names if n not in specs]
    if bad:
        _usage_error(f"unknown model(s) {bad}; choose from {sorted(specs)}")
    if not torch_ok and any(specs[n]["kind"] == "torch" for n in names):
        _usage_error("these models are exported with torch, which is not installed; use --models tiny-cnn")
    engines = []
    if args.device != "cuda":
        engines += [("ort-cpu", "fp32"), ("ort-cpu", "mixed")] + ([("torch-cpu", "fp32")] if torch_ok else [])
    if use_cuda or args.device == "cuda":
        engines += [("ort-cuda", "fp32"), ("ort-cuda", "mixed")]
    if args.device != "cpu" and torch_cuda:
        engines += [("torch-cuda", "fp32"), ("torch-cuda", "mixed")]
    return names, engines


def targets(results) -> list:
    """Per GPU-sized model: ORT CUDA mixed vs FP32 (target >= 1.5x) and vs torch CUDA AMP
    (target: within 1.2x), from the finished rows that ran on CUDA."""
    out = []
    for name in sorted({r["model"] for r in results}):
        ms = {(r["engine"], r["precision"]): r["median_ms"] for r in results if r["model"] == name
              and "median_ms" in r and (r["engine"] not in CUDA_ENGINES or "cuda" in r.get("ran_on", "").lower())}
        mixed, fp32, amp = ms.get(("ort-cuda", "mixed")), ms.get(("ort-cuda", "fp32")), ms.get(("torch-cuda", "mixed"))
        if mixed is None:
            continue
        t = {"model": name, "mixed_vs_fp32": fp32 / mixed if fp32 else None,
             "mixed_vs_torch_amp": mixed / amp if amp else None}
        t["meets_1_5x_fp32"] = None if fp32 is None else t["mixed_vs_fp32"] >= 1.5
        t["within_1_2x_torch_amp"] = None if amp is None else t["mixed_vs_torch_amp"] <= 1.2
        out.append(t)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--models", default=None, help="comma separated (default: cnn,block with torch, else tiny-cnn; "
                    "plus bert-base,resnet50 when ORT CUDA runs or with --tiny)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="cuda: only CUDA rows, and fail when ORT/torch cannot run there; cpu: only CPU rows; "
                    "auto (default): CPU rows, plus CUDA rows when onnxruntime has CUDA (a row that fell back to the "
                    "CPU says so)")
    ap.add_argument("--tiny", action="store_true", help="the GPU-sized cases at toy size (CPU checks)")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "train.json"))
    ap.add_argument("--no-curves", action="store_true")
    ap.add_argument("--work", help="folder for the exported models and the step run folders <model>-<precision> "
                    "(default: a new temporary folder)")
    ap.add_argument("--build-only", action="store_true", help="export the models and build their step graphs "
                    "into --work, then stop (no rows; needs no GPU: a GPU session can build while it waits)")
    ap.add_argument("--reuse", action="store_true", help="with --work: use the exported models and run folders "
                    "already there (a finished build: train.json written) instead of building them again")
    ap.add_argument("--one", nargs=4, metavar=("MODEL", "ENGINE", "PRECISION", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        args.model, args.engine, args.precision, d = args.one
        args.run_dir = args.work = d
        fn = child_torch if args.engine.startswith("torch") else child_ort
        try:
            print(TAG + json.dumps(fn(args)))
        except Exception as e:  # GraphmpError and friends: one line for the parent's row
            raise SystemExit(f"{type(e).__name__}: {e}") from None
        return 0

    from graphmp.model_runs import cuda_available
    from graphmp.train.step import build_step
    torch_ok = _has_torch()
    torch_cuda = False
    if torch_ok:
        import torch
        torch_cuda = torch.cuda.is_available()
    if (args.build_only or args.reuse) and not args.work:
        _usage_error("--build-only and --reuse need --work DIR (the folder the builds go to / come from)")
    names, engines = plan(args, torch_ok, torch_cuda, cuda_available())
    specs = model_specs(args.tiny)
    work = args.work or tempfile.mkdtemp(prefix="graphmp-bench-train-")
    os.makedirs(work, exist_ok=True)
    fresh = [n for n in names if not (args.reuse and _exported(n, specs[n], work))]
    paths = {**{n: os.path.join(work, f"{n}.onnx") for n in names}, **_prepare_models(fresh, work, args.tiny)}
    out = {"host": platform.node(), "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
           "device": args.device, "tiny": args.tiny, "steps": args.steps, "warmup": args.warmup,
           "optimizer": f"adamw lr {LR:g}",
           "torch": (__import__("torch").__version__ if torch_ok else "not installed: no PyTorch reference"),
           "onnxruntime": __import__("onnxruntime").__version__,
           "onnxruntime_providers": __import__("onnxruntime").get_available_providers(),
           "ort_cuda": cuda_available(),
           "gpu_memory_method": ("gpu_mem_mb: device memory the child process uses after the timed steps, measured "
                                 "the same way for ORT and torch (NVML per-process, else nvidia-smi, else GPU memory "
                                 "in use after minus before the child touched CUDA; each row's gpu_mem_method says "
                                 "which); includes the CUDA context and allocator caches (ORT arena, torch caching "
                                 "allocator). torch_max_allocated_mb is torch's own max_memory_allocated (tensors "
                                 "only), not comparable with ORT."),
           "note": "ORT CPU computes FP16 ops in FP32: mixed is not expected to be faster on the CPU.",
           "results": []}
    for name in names:
        run_dirs = {}
        for prec in ("fp32", "mixed"):
            run_dirs[prec] = os.path.join(work, f"{name}-{prec}")
            t0 = time.perf_counter()
            if args.reuse and name not in fresh and os.path.isfile(os.path.join(run_dirs[prec], "train.json")):
                from graphmp.train.loop import load_run
                meta = load_run(run_dirs[prec])
            else:
                meta = build_step(paths[name], run_dirs[prec], precision=prec, optimizer="adamw", lr=LR,
                                  force=bool(args.work))
                out.setdefault("build_seconds", {})[f"{name}-{prec}"] = round(time.perf_counter() - t0, 2)
            out.setdefault("step_graph_nodes", {})[f"{name}-{prec}"] = meta["nodes"]["total"]
        if args.build_only:
            print(f"  {name}: built {', '.join(run_dirs.values())}", flush=True)
            continue
        for engine, prec in engines:
            if name in GPU_SIZED and not args.tiny and engine not in CUDA_ENGINES:
                continue  # a BERT-base / ResNet-50 b32 step on the CPU takes minutes: GPU rows only
            if engine.startswith("torch") and specs[name]["kind"] != "torch":
                continue
            d = run_dirs[prec] if engine.startswith("ort") else work
            r = _child(["--one", name, engine, prec, d, "--steps", str(args.steps), "--warmup", str(args.warmup),
                        "--device", args.device] + (["--tiny"] if args.tiny else []))
            r.update(model=name, engine=engine, precision=prec, batch=specs[name]["x"][0])
            out["results"].append(r)
            print(f"  {name:9s} {engine:10s} {prec:6s} " + (f"{r['median_ms']:8.2f} ms/step on {r['ran_on']}  "
                  f"peak RSS {r['peak_rss_mb']:7.1f} MB" + (f"  GPU {r['gpu_mem_mb']:.0f} MB" if r.get("gpu_mem_mb")
                                                            else "") + (f"  NOTE: {r['note']}" if r.get("note") else "")
                  if "median_ms" in r else f"FAILED: {r['error']}"), flush=True)
    if args.build_only:
        return 0
    out["targets"] = targets(out["results"])
    if not args.no_curves:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        _curves(os.path.join(os.path.dirname(os.path.abspath(args.json)), "train_curves.png"), out)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json + ".tmp", "w") as f:
        json.dump(out, f, indent=2, default=str)
    os.replace(args.json + ".tmp", args.json)
    print("\n| model | engine | precision | ran on | batch | ms/step (median) | p90 | loss first -> last | "
          "peak RSS MB | GPU MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in out["results"]:
        if "median_ms" in r:
            print(f"| {r['model']} | {r['engine']} | {r['precision']} | {r['ran_on']} | {r['batch']} | "
                  f"{r['median_ms']:.2f} | {r['p90_ms']:.2f} | {r['loss_first']:.4f} -> {r['loss_last']:.4f} | "
                  f"{r['peak_rss_mb']:.0f} | {'%.0f' % r['gpu_mem_mb'] if r.get('gpu_mem_mb') else '-'} |")
        else:
            print(f"| {r['model']} | {r['engine']} | {r['precision']} | - | {r['batch']} | failed: {r['error']} "
                  "| | | | |")
    for t in out["targets"]:
        print(f"target {t['model']}: ORT CUDA mixed vs FP32 {t['mixed_vs_fp32'] or float('nan'):.2f}x (>= 1.5), "
              f"vs torch AMP {t['mixed_vs_torch_amp'] or float('nan'):.2f}x its time (<= 1.2)")
    if "convergence" in out:
        c = out["convergence"]
        print("\nconvergence (tiny CNN, bars task, 3 epochs): " + ", ".join(
            f"{p} eval acc {c[p]['eval']['accuracy']:.3f} ({c[p]['skipped']} skipped)" for p in ("fp32", "mixed"))
            + f"; plot: {c.get('png')}")
    print(out["note"] + (" " if torch_ok else " torch not installed: no PyTorch reference.") + f"\nwrote {args.json}")
    failed = [r for r in out["results"] if "median_ms" not in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

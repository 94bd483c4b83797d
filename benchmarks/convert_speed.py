#!/usr/bin/env python
"""Conversion speed and memory: graphmp against onnxconverter-common, side by side.

    python benchmarks/convert_speed.py                         # the default set, 3 runs each
    python benchmarks/convert_speed.py --repeat 5 --search     # also graphmp --max-error 1e-2
    python benchmarks/convert_speed.py --large                 # also a GPT-2-large-sized model (3 GB)

Every conversion is the whole command in a fresh process, as a user runs it: graphmp's
CLI with its defaults (calibration on, generated inputs) and occ's
`convert_float_to_float16(keep_io_types=True)` with onnx.load / onnx.save around it.
Wall time is measured around the process, peak RSS is the process's ru_maxrss
(os.wait4). Runs of the tools alternate, and each cell is the median of --repeat runs;
the ratio graphmp / occ is what to read (both ran on the same machine, minutes apart).

Models are synthetic with the layout and size of real exports (benchmarks/synth.py:
BERT-base, GPT-2 with a tied head, ResNet-50), plus the 640 px face detector and the
720 px style-transfer net committed in models/real.

Also measured:
- start-up: `graphmp --help` (no onnx imported), `import onnx, onnxruntime` (what any
  ONNX tool pays) and the whole conversion of a 26 kB model, graphmp against occ;
- per-phase times (load, each pass, write) from graphmp's --report;
- a cost model: graphmp's time on synthetic encoders of 2..48 layers, fitted as
  time = a + b * nodes + c * weight MB (least squares; R^2 says whether it is linear).

Writes JSON (--json) and, with matplotlib, a PNG (--plot); prints the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import synth  # noqa: E402

REAL = REPO / "models" / "real"
OCC = """
import sys, onnx
from onnxconverter_common.float16 import convert_float_to_float16
m = onnx.load(sys.argv[1])
out = convert_float_to_float16(m, keep_io_types=True)
big = out.ByteSize() > 1_800_000_000
onnx.save(out, sys.argv[2], save_as_external_data=big, all_tensors_to_one_file=True,
          location=(sys.argv[2].rsplit('/', 1)[-1] + '.data') if big else None)
"""


def _env():
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # users' Pythons cache bytecode
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def timed(cmd: list) -> dict:
    """Wall seconds and peak RSS (MB, the process's own VmHWM via _hwm.py) of one
    `python -c ...` / `python -m ...` command in a fresh process."""
    with tempfile.NamedTemporaryFile(suffix=".hwm") as hwm:
        env = dict(_env(), GRAPHMP_HWM_FILE=hwm.name)
        t = time.perf_counter()
        p = subprocess.run([cmd[0], str(HERE / "_hwm.py")] + cmd[1:], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, env=env)
        wall = time.perf_counter() - t
        kb = open(hwm.name).read().strip()
    err = p.stderr.decode(errors="replace").strip().splitlines()[-1:]
    return {"seconds": wall, "peak_rss_mb": int(kb) / 1024 if kb else None, "ok": p.returncode == 0,
            "error": None if p.returncode == 0 else err}


def tools(args, src: str, work: Path) -> dict:
    """{tool: command} for one model."""
    stem = Path(src).stem
    py = sys.executable
    cmds = {"occ": [py, "-c", OCC, src, str(work / f"{stem}.occ.onnx")],
            "graphmp": [py, "-m", "graphmp.cli", "convert", src, "-o", str(work / f"{stem}.mp.onnx"),
                        "--report", str(work / f"{stem}.report.json")]}
    if args.search:
        cmds["graphmp --max-error 1e-2"] = [py, "-m", "graphmp.cli", "convert", src, "-o",
                                            str(work / f"{stem}.search.onnx"), "--max-error", "1e-2"]
    return cmds


def bench_model(args, name: str, src: str, work: Path) -> dict:
    cmds = tools(args, src, work)
    runs = {k: [] for k in cmds}
    for _ in range(args.repeat):
        for k, cmd in cmds.items():  # alternate the tools: drift hits all of them alike
            runs[k].append(timed(cmd))
    row = {"model": name, "file_mb": _size_mb(src), "tools": {}}
    for k, rs in runs.items():
        ok = [r for r in rs if r["ok"]]
        row["tools"][k] = {"ok": len(ok) == len(rs), "error": next((r["error"] for r in rs if not r["ok"]), None),
                           "seconds": statistics.median(r["seconds"] for r in ok) if ok else None,
                           "peak_rss_mb": max(r["peak_rss_mb"] for r in ok) if ok else None,
                           "runs": [round(r["seconds"], 3) for r in rs]}
    rep = work / f"{Path(src).stem}.report.json"
    if rep.exists():
        r = json.loads(rep.read_text())
        row["graphmp_phases"] = r.get("timings", {})
        row["graphmp_calibration"] = r.get("calibration", {}).get("source")
    occ, gm = row["tools"]["occ"], row["tools"]["graphmp"]
    if occ["seconds"] and gm["seconds"]:
        row["time_ratio"] = gm["seconds"] / occ["seconds"]
        row["rss_over_file_mb"] = gm["peak_rss_mb"] - row["file_mb"]
    return row


def _size_mb(path: str) -> float:
    data = path + ".data"
    return (os.path.getsize(path) + (os.path.getsize(data) if os.path.exists(data) else 0)) / 2**20


def startup(repeat: int) -> dict:
    py = sys.executable
    mnist = str(REPO / "models" / "real" / "mnist_cntk.onnx")
    out_dir = tempfile.mkdtemp(prefix="graphmp-startup-")
    cases = {"python": [py, "-c", "pass"],
             "import onnx, onnxruntime": [py, "-c", "import onnx, onnxruntime"],
             "graphmp --help": [py, "-m", "graphmp.cli", "--help"],
             "graphmp convert mnist": [py, "-m", "graphmp.cli", "convert", mnist, "-o", out_dir + "/m.onnx"],
             "occ mnist": [py, "-c", OCC, mnist, out_dir + "/o.onnx"]}
    out = {k: [] for k in cases}
    for _ in range(repeat):
        for k, c in cases.items():
            out[k].append(timed(c)["seconds"])
    return {k: statistics.median(v) for k, v in out.items()}


def cost_model(args, work: Path) -> dict:
    """graphmp's time against node count and weight bytes: encoders of growing depth at
    hidden 256 (nodes grow), and 6-layer encoders of growing width (bytes grow), so the
    two terms of the fit are not confounded."""
    import numpy as np
    points = []
    shapes = [(layers, 256) for layers in args.layers] + [(6, h) for h in (128, 512, 1024)]
    for layers, hidden in shapes:
        src = str(work / f"enc{layers}x{hidden}.onnx")
        if not os.path.exists(src):
            synth.save(synth.bert(layers, hidden=hidden, heads=max(hidden // 64, 1), ffn=4 * hidden, vocab=8000), src)
        import onnx
        m = onnx.load(src, load_external_data=False)
        nodes = len(m.graph.node)
        t = statistics.median(timed([sys.executable, "-m", "graphmp.cli", "convert", src, "-o",
                                     str(work / f"enc{layers}x{hidden}.mp.onnx")])["seconds"] for _ in range(args.repeat))
        points.append({"layers": layers, "hidden": hidden, "nodes": nodes, "weight_mb": _size_mb(src), "seconds": t})
    X = np.array([[1.0, p["nodes"], p["weight_mb"]] for p in points])
    y = np.array([p["seconds"] for p in points])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    pred = X @ coef
    r2 = 1 - float(((y - pred) ** 2).sum()) / max(float(((y - y.mean()) ** 2).sum()), 1e-12)
    return {"points": points, "fit": {"seconds": float(coef[0]), "ms_per_node": 1e3 * float(coef[1]),
                                      "ms_per_weight_mb": 1e3 * float(coef[2]), "r2": r2,
                                      "max_residual_s": float(np.abs(y - pred).max())}}


def models(args, work: Path) -> list:
    out = []
    gen = {"bert-base": lambda p: synth.save(synth.bert(), p),
           "gpt2": lambda p: synth.save(synth.bert(vocab=50257, max_pos=1024, lm_head=True), p),
           "resnet50": lambda p: synth.save(synth.resnet50(), p)}
    if args.large:
        gen["gpt2-large"] = lambda p: synth.save(synth.bert(36, 1280, 20, 5120, vocab=50257, max_pos=1024,
                                                            lm_head=True), p)
    for name, make in gen.items():
        if args.models and name not in args.models:
            continue
        p = work / f"{name}.onnx"
        if not p.exists():
            print(f"  generating {name} ...", flush=True)
            make(str(p))
        out.append((name, str(p)))
    for name, file in (("ultraface-640", "ultraface_rfb640.onnx"), ("style-mosaic-720", "style_mosaic.onnx")):
        if (REAL / file).exists() and (not args.models or name in args.models):
            out.append((name, str(REAL / file)))
    return out


def table(rows) -> str:
    tool_names = list(dict.fromkeys(k for r in rows for k in r["tools"]))
    head = ["model", "MB"] + [f"{t} s" for t in tool_names] + ["graphmp/occ", "graphmp RSS MB", "occ RSS MB",
                                                              "RSS - file MB"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        cells = [r["model"], f"{r['file_mb']:.0f}"]
        for t in tool_names:
            c = r["tools"].get(t, {})
            cells.append(f"{c['seconds']:.2f}" if c.get("seconds") else "FAILED")
        cells += [f"{r['time_ratio']:.2f}x" if "time_ratio" in r else "-",
                  f"{r['tools']['graphmp']['peak_rss_mb'] or 0:.0f}", f"{r['tools']['occ']['peak_rss_mb'] or 0:.0f}",
                  f"{r['rss_over_file_mb']:+.0f}" if "rss_over_file_mb" in r else "-"]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def phase_table(rows) -> str:
    phases = list(dict.fromkeys(k for r in rows for k in r.get("graphmp_phases", {})))
    short = [p.replace(".run", "").replace("prepare.run_drop_redundant_casts", "drop casts") for p in phases]
    lines = [" | ".join(["model"] + short), " | ".join("---" for _ in range(len(phases) + 1))]
    for r in rows:
        ph = r.get("graphmp_phases", {})
        lines.append(" | ".join([r["model"]] + [f"{ph.get(p, 0):.2f}" for p in phases]))
    return "\n".join(lines)


def plot(res: dict, path: str) -> bool:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("  (no matplotlib: no plot)")
        return False
    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1)
    rows = res["models"]
    names = [r["model"] for r in rows]
    for i, tool in enumerate(("occ", "graphmp")):
        ax.bar([k + 0.4 * i for k in range(len(rows))], [r["tools"][tool]["seconds"] or 0 for r in rows], 0.4,
               label=tool)
    ax.set_xticks([k + 0.2 for k in range(len(rows))], names, rotation=20, fontsize=8)
    ax.set_ylabel("seconds (whole command)")
    ax.legend()
    if res.get("cost_model"):
        cm = res["cost_model"]
        ax2 = fig.add_subplot(1, 2, 2)
        pts = cm["points"]
        f = cm["fit"]
        fit = [f["seconds"] + f["ms_per_node"] / 1e3 * p["nodes"] + f["ms_per_weight_mb"] / 1e3 * p["weight_mb"]
               for p in pts]
        ax2.plot(fit, [p["seconds"] for p in pts], "o", label=f"encoders, depth and width sweeps (R^2 {f['r2']:.3f})")
        top = max(fit + [p["seconds"] for p in pts])
        ax2.plot([0, top], [0, top], "--", color="grey")
        ax2.set_xlabel("fit: a + b nodes + c weight MB (s)")
        ax2.set_ylabel("measured graphmp seconds")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--repeat", type=int, default=3, help="runs per tool and model (median reported)")
    ap.add_argument("--models", type=lambda s: s.split(","), default=None,
                    help="comma list: bert-base,gpt2,resnet50,ultraface-640,style-mosaic-720,gpt2-large")
    ap.add_argument("--search", action="store_true", help="also time graphmp --max-error 1e-2")
    ap.add_argument("--large", action="store_true", help="also a GPT-2-large-sized model (3 GB, external data)")
    ap.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[2, 6, 12, 24, 48],
                    help="encoder depths for the cost model ('' to skip)")
    ap.add_argument("--work", default=None, help="folder for generated and converted models (default: a temp dir)")
    ap.add_argument("--json", default=str(HERE / "results" / "convert_speed.json"))
    ap.add_argument("--plot", default=str(HERE / "results" / "convert_speed.png"))
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="graphmp-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    res = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
           "repeat": args.repeat, "startup": startup(max(args.repeat, 5))}
    print("start-up (s): " + ", ".join(f"{k} {v:.3f}" for k, v in res["startup"].items()), flush=True)
    res["models"] = []
    for name, src in models(args, work):
        print(f"  {name} ...", flush=True)
        res["models"].append(bench_model(args, name, src, work))
    print(table(res["models"]))
    print()
    print(phase_table(res["models"]))
    if args.layers:
        res["cost_model"] = cost_model(args, work)
        f = res["cost_model"]["fit"]
        print(f"\ncost model: {f['seconds']:.3f} s + {f['ms_per_node']:.3f} ms/node + {f['ms_per_weight_mb']:.2f} ms/MB "
              f"(R^2 {f['r2']:.4f}, max residual {f['max_residual_s']:.3f} s)")
        for p in res["cost_model"]["points"]:
            print(f"  {p['layers']:3d} layers x {p['hidden']:4d}: {p['nodes']:5d} nodes, {p['weight_mb']:7.1f} MB -> "
                  f"{p['seconds']:.2f} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(res, fh, indent=2)
    print(f"\nwrote {args.json}" + (f" and {args.plot}" if args.plot and plot(res, args.plot) else ""))
    return 0 if all(r["tools"]["graphmp"]["ok"] for r in res["models"]) else 1


if __name__ == "__main__":
    sys.exit(main())

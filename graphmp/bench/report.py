"""The report writer: a bench run's data as a table, JSON and a PNG chart.

BenchResult wraps the JSON-ready dict (schema in graphmp/bench/__init__.py); it computes
nothing about the rows, so it can be tested on any dict of that shape.
"""
from __future__ import annotations

import math
import os

import numpy as np

from ..errors import GraphmpError
from ..names import printable_lines, shown
from ..save import atomic_write, write_json
from ..paths import check_target
from .plan import LABELS, PRECISIONS


def clean(x):
    """JSON-safe: non-finite floats -> None, numpy scalars -> Python."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def _fmt(v, spec=".3g", none="-"):
    return none if v is None else format(v, spec)


def _md(headers, rows) -> str:
    rows = [[shown(c) for c in r] for r in rows]  # names from the model: escaped, cut
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(r) for r in rows])


TITLE_POINTS = 9


def _wrapped(lines: list, width_inches: float, points: float) -> str:
    """The plot's title lines wrapped to the figure's width (an average glyph is about 0.55 em)."""
    import textwrap
    chars = max(20, int(width_inches * 72 / (points * 0.55)))
    return "\n".join(w for line in lines for w in textwrap.wrap(line, chars))


RAN_ON = {"CUDAExecutionProvider": "CUDA", "CPUExecutionProvider": "CPU", "TensorRT": "TensorRT"}
HEAD = ["backend", "precision", "variant", "ran on", "batch", "median ms", "p90 ms", "p99 ms", "items/s",
        "vs FP32", "vs TF32", "mem MB", "engine MB", "build s", "err", "x TF32", "cosine", "argmax", "in tol"]


def _row_cells(r) -> list:
    ran = RAN_ON.get(r.get("provider"), r.get("provider") or "-")
    first = [r["backend"], r["precision"], r["variant"], ran, r["batch"]]
    if r["status"] != "ok":
        return first + ["FAILED"] + ["-"] * (len(HEAD) - len(first) - 1)
    lat, acc = r["latency_ms"], r["accuracy"] or {}
    mb = lambda b: None if b is None else b / 1e6  # noqa: E731
    tol = "-" if not acc else ("yes" if acc["passed"] else "NO") + (
        f" ({acc['nonfinite']} inf/nan)" if acc.get("nonfinite") else "")
    return first + [_fmt(lat["median"], ".3f"), _fmt(lat["p90"], ".3f"), _fmt(lat["p99"], ".3f"),
                    _fmt(r["throughput_per_s"], ".1f"), _speedup(r, "speedup_vs_fp32"),
                    _speedup(r, "speedup_vs_tf32"), _fmt(mb(r["peak_device_memory_bytes"]), ".0f"),
                    _fmt(mb(r["engine_bytes"]), ".1f"), _fmt(r["build_s"], ".2f"), _fmt(acc.get("error"), ".2e"),
                    _fmt(acc.get("vs_tf32"), ".2f"), _fmt(acc.get("cosine"), ".6f"),
                    _fmt(acc.get("argmax_agree"), ".4f"), tol]


def _speedup(r, key) -> str:
    """A speedup cell: '?' after it where the rows' timing spread makes the ratio unreliable."""
    text = _fmt(r[key], ".2f")
    return text + "?" if r.get(key) is not None and r.get("speedup_noisy") else text


class BenchResult:
    """The rows of one bench run. `to_dict()` is the JSON (schema in graphmp.bench)."""

    def __init__(self, data: dict):
        self.data = data

    def to_dict(self) -> dict:
        return self.data

    @property
    def rows(self) -> list:
        return self.data["rows"]

    def row(self, backend, precision, batch, variant="default") -> dict | None:
        return next((r for r in self.rows if (r["backend"], r["precision"], r["batch"], r["variant"])
                     == (backend, precision, batch, variant)), None)

    def write_json(self, path, in_place_ok: bool = False) -> None:
        """Atomically (graphmp.save.write_json); in_place_ok: a FIFO, character device or this
        process's own stream that the user named (--json /dev/stdout) is written in place."""
        write_json(os.fspath(path), self.data, in_place_ok)

    def table(self) -> str:
        d = self.data
        env = d["environment"]
        lines = [f"graphmp bench: {d['model']['path']} on {env['device']}"]
        table = _md(HEAD, [_row_cells(r) for r in d["rows"]])  # its cells escaped already
        if d.get("partial"):  # Ctrl-C: the rows above are those that finished
            lines.append(f"  PARTIAL: {d.get('interrupted') or 'interrupted'}")
        src = d["model"].get("source_precision") or {}
        if src.get("precision") not in (None, "fp32"):
            lines.append(f"  source precision: {src['precision']}")
        named = {}  # rows whose label is not their precision's usual one: what they really run
        for r in d["rows"]:
            if r.get("label") != LABELS.get(r["precision"]):
                named.setdefault(r["precision"], f"{r['label']} ({r['model']})")
        lines += [f"  {p} rows: {what}" for p, what in named.items()]
        for r in d["rows"]:
            if r.get("accuracy_note"):
                lines.append(f"  {r['backend']} {r['precision']} accuracy {r['accuracy_note']}")
                break
        said = {}  # one line per distinct error (a fallback fails every row of its backend alike)
        for r in d["rows"]:
            if r["status"] != "ok":
                said.setdefault(r["error"], []).append(f"{r['backend']} {r['precision']} {r['variant']} "
                                                       f"batch {r['batch']}")
        for err, where in said.items():
            more = f" (and {len(where) - 1} more rows)" if len(where) > 1 else ""
            lines.append(f"  {where[0]}{more}: FAILED: {err}")
        for name, b in d["backends"].items():
            if b["status"] != "ok":
                lines.append(f"  {name}: {b['status']}: {b['reason']}")
        for f in d.get("fastest", []):
            lines.append(f"  fastest {f['backend']} {f['precision']} batch {f['batch']}: {f['variant']} "
                         f"({f['median_ms']:.3f} ms; " + ", ".join(f"{v} {ms:.3f}" for v, ms in f["by_variant"].items())
                         + ")")
        acc = d["accuracy"]
        lines.append(f"  accuracy: err = max|a-b|/max|ref| per output (worst shown), vs {acc['reference']}; "
                     f"x TF32 = err / the TF32 error; {acc['rule']}")
        for y in acc.get("yardsticks", []):
            lines.append(f"  TF32 yardstick, batch {y['batch']} ({y['source']}): "
                         + ", ".join(f"{k} {_fmt(v, '.2e')}" for k, v in (y["errors"] or {}).items()))
        for o in d["oracle"]:
            what = f"FP16-faithful oracle, {o['precision']} at batch {o['batch']}"
            if o["status"] != "ok":
                lines.append(f"  {what}: {o['status']}: {o['reason']}")
            else:
                lines.append(f"  {what} ({o['oracle']}): {'PASS' if o['passed'] else 'FAIL'}, max abs "
                             f"{_fmt(o['max_abs'], '.2e')}, max rel {_fmt(o['max_rel'], '.2e')}, argmax "
                             f"{_fmt(o['argmax_agree'], '.4f')}"
                             + (f", {o['nonfinite']} inf/nan" if o["nonfinite"] else ""))
        lines += [f"  note: {n}" for n in d["notes"]]
        lines.append(f"  timing: {d['timing']} ({d['settings']['timing_text']})")
        versions = ", ".join(f"{k} {env[k]}" for k in ("onnxruntime", "tensorrt", "onnx", "numpy", "graphmp") if env[k])
        lines.append(f"  environment: {versions}; driver {env['driver'] or '-'}; CUDA {env['cuda'] or '-'}; "
                     f"cuDNN {env['cudnn'] or '-'}; {env['timestamp']}")
        lines.append(f"  command: {env['command']}")
        return printable_lines(lines[:1]) + "\n" + table + "\n" + printable_lines(lines[1:])

    summary = table

    def plot(self, path) -> str:
        """A PNG bar chart: throughput per backend, batch and precision (default variant),
        labelled with the speedup vs FP32 (strict). Needs matplotlib (graphmp[plot])."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            raise GraphmpError("the plot needs matplotlib: pip install 'graphmp[plot]' "
                               "(or pip install matplotlib)") from None
        path = os.fspath(path)
        check_target(path, "the plot")  # a FIFO, device or /dev/stdout: refused, never replaced
        ok = [r for r in self.rows if r["status"] == "ok" and r["variant"] == "default"]
        backends = [b for b in self.data["backends"] if any(r["backend"] == b for r in ok)]
        fig = Figure(figsize=(5.5 * max(1, len(backends)), 4.5))
        FigureCanvasAgg(fig)
        if not backends:
            fig.text(0.5, 0.5, "no backend produced a timing", ha="center")
        for k, b in enumerate(backends):
            ax = fig.add_subplot(1, len(backends), k + 1)
            rows = [r for r in ok if r["backend"] == b]
            batches = sorted({r["batch"] for r in rows})
            precs = [p for p in PRECISIONS if any(r["precision"] == p for r in rows)]
            width = 0.8 / len(precs)
            for j, p in enumerate(precs):
                xs, ys, labels = [], [], []
                for i, bt in enumerate(batches):
                    r = next((r for r in rows if r["precision"] == p and r["batch"] == bt), None)
                    if r:
                        xs.append(i + (j - (len(precs) - 1) / 2) * width)
                        ys.append(r["throughput_per_s"])
                        s = r["speedup_vs_fp32"]
                        labels.append(f"{s:.2f}x{'?' if r.get('speedup_noisy') else ''}" if s
                                      else f"{r['latency_ms']['median']:.2f}ms")
                label = next((r["label"] for r in rows if r["precision"] == p), LABELS[p])
                bars = ax.bar(xs, ys, width, label=label)
                ax.bar_label(bars, labels, fontsize=7)
            ax.set_xticks(range(len(batches)), [f"batch {bt}" for bt in batches])
            ax.set_ylabel("items / s (batch / median latency)")
            ax.set_title(f"{b} (default session options)")
            ax.legend(fontsize=7)
        partial = " (interrupted: finished rows only)" if self.data.get("partial") else ""
        noisy = "; '?': timing too noisy to trust the ratio" if any(r.get("speedup_noisy") for r in ok) else ""
        title = _wrapped([f"{os.path.basename(self.data['model']['path'])} on {self.data['environment']['device']}"
                          f"{partial}", f"bar labels: speedup vs FP32 strict (latency where there is no FP32 row)"
                          f"{noisy}; timing {self.data['timing']}"], fig.get_figwidth(), TITLE_POINTS)
        fig.suptitle(title, fontsize=TITLE_POINTS)
        # room above the axes for every line of the title (tight_layout alone clips a long one)
        fig.tight_layout(rect=(0, 0, 1, 1 - (title.count("\n") + 1) * TITLE_POINTS * 1.1 / 72 / fig.get_figheight()))
        with atomic_write(path) as f:
            fig.savefig(f, format="png", dpi=100)
        return path

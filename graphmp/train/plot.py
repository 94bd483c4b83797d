"""The loss curve of a training run: run_dir/loss.png, drawn with matplotlib (graphmp[plot]).

write_loss_png(path, train_loss, eval_points) draws the train loss per step as light raw
points (when there are more than twice as many steps as pixel columns, the per-column
min..max band instead) under a smoothed line (a centred moving mean over about 1/50 of the
steps: at batch 1 the raw per-step loss is a comb that hides the trend), and the eval loss
per epoch (markers joined by a line). The loss axis is logarithmic when the losses are
positive and span more than LOG_SPAN (a loss falling from 1000 to 0.1 is a flat line at the
bottom of a linear axis). Drawn with matplotlib (Agg, no pyplot state touched). Non-finite losses (steps skipped for overflow)
are left out of the plot. Without matplotlib it writes the numbers instead, as loss.csv
beside `path` (write_loss_csv), and returns (that path, a hint line (HINT) for the caller to
print). Files are written atomically.
"""
from __future__ import annotations

import io
import os

import numpy as np

from ..save import atomic_write

WIDTH, HEIGHT = 640, 400
TRAIN_RGB = (31, 119, 180)
BAND_RGB = (190, 214, 236)
EVAL_RGB = (255, 127, 14)
LOSS_CSV = "loss.csv"
CSV_HEADER = "step,train_loss,eval_loss"
LOG_SPAN = 30.0     # max/min of the plotted losses above which the loss axis is logarithmic
SMOOTH_FRACTION = 50  # the smoothing window: about len / SMOOTH_FRACTION steps
HINT = "no matplotlib: the losses are in {csv}; pip install 'graphmp[plot]' would draw loss.png"


def write_loss_png(path, train_loss, eval_points=(), width: int = WIDTH, height: int = HEIGHT,
                   title: str = "loss", use_matplotlib: bool | None = None) -> tuple[str, str | None]:
    """Write the curve to `path` (atomically); returns (the path written, None).

    train_loss: loss per step (step k+1 at index k). eval_points: [(step, loss)], e.g. one
    per epoch. Without matplotlib (or with use_matplotlib=False) writes loss.csv in the
    folder of `path` instead and returns (its path, the HINT line naming it)."""
    if use_matplotlib is not False:
        steps = np.arange(1, len(train_loss) + 1, dtype=np.float64)
        loss = np.asarray(train_loss, dtype=np.float64).reshape(-1)
        ev = np.asarray(list(eval_points), dtype=np.float64).reshape(-1, 2)
        try:
            data = _png_matplotlib(steps, loss, ev, width, height, title)
        except ImportError:
            if use_matplotlib:
                raise
        else:
            with atomic_write(str(path)) as f:
                f.write(data)
            return str(path), None
    csv = os.path.join(os.path.dirname(os.fspath(path)), LOSS_CSV)
    return write_loss_csv(csv, train_loss, eval_points), HINT.format(csv=csv)


def write_loss_csv(path, train_loss, eval_points=()) -> str:
    """CSV_HEADER, then a row per step (1..len(train_loss)) with its train loss (nan/inf as
    recorded for a skipped step) and, on the steps evaluated, the eval loss (else empty); an
    eval point at a step with no train row (or a second one at a step) gets a row of its own."""
    rows = [[k, repr(float(x)), ""] for k, x in enumerate(train_loss, 1)]
    for step, loss in eval_points:
        step = int(step)
        row = rows[step - 1] if 1 <= step <= len(train_loss) else None
        if row is None or row[2]:
            rows.append(row := [step, "", ""])
        row[2] = repr(float(loss))
    rows.sort(key=lambda r: r[0])  # stable: an extra eval row follows its step's row
    text = "\n".join([CSV_HEADER] + [f"{s},{t},{e}" for s, t, e in rows]) + "\n"
    with atomic_write(str(path)) as f:
        f.write(text.encode())
    return str(path)


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Centred moving mean of y over `window` points (odd), the window shrinking at the ends
    so the line starts at the first point and ends at the last; y unchanged for window <= 1."""
    y = np.asarray(y, dtype=np.float64)
    if window <= 1 or len(y) < 3:
        return y
    half = window // 2
    c = np.concatenate([[0.0], np.cumsum(y)])
    i = np.arange(len(y))
    lo, hi = np.maximum(i - half, 0), np.minimum(i + half + 1, len(y))
    return (c[hi] - c[lo]) / (hi - lo)


def _log_axis(y, line, ev) -> bool:
    """A logarithmic loss axis: the smoothed train loss (and the eval loss) positive and the
    losses spanning more than LOG_SPAN; a few raw zeros do not prevent it."""
    levels = np.concatenate([line, ev[:, 1][np.isfinite(ev[:, 1])]]) if len(ev) else line
    if not len(levels) or levels.min() <= 0:
        return False
    top = max(levels.max(), y.max() if len(y) else 0.0)
    return top / levels.min() > LOG_SPAN


def _png_matplotlib(steps, loss, ev, width, height, title) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width / 100, height / 100), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ok = np.isfinite(loss)
    x, y = steps[ok], loss[ok]
    line = smooth(y, 2 * (len(y) // (2 * SMOOTH_FRACTION)) + 1)
    raw = np.array(TRAIN_RGB) / 255
    if len(x) > 2 * width:  # more steps than pixels: the per-column min..max band (fast, same picture)
        edges = np.linspace(x[0], x[-1] + 1, width + 1)
        b = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, width - 1)
        lo, hi = np.full(width, np.inf), np.full(width, -np.inf)
        np.minimum.at(lo, b, y)
        np.maximum.at(hi, b, y)
        has = np.bincount(b, minlength=width) > 0
        mid = ((edges[:-1] + edges[1:]) / 2)[has]
        ax.fill_between(mid, lo[has], hi[has], color=np.array(BAND_RGB) / 255, lw=0, label="train (per step)")
    elif len(x) > 50:
        ax.plot(x, y, ".", ms=2, color=np.array(BAND_RGB) / 255, label="train (per step)")
    elif len(x):  # a short run: every step readable, joined
        ax.plot(x, y, ".-", ms=3, lw=1, color=raw, label="train (per step)")
    if len(x) > 50:
        ax.plot(x, line, color=raw, lw=1.5, label="train (smoothed)")
    if len(ev):
        ax.plot(ev[:, 0], ev[:, 1], "o-", color=np.array(EVAL_RGB) / 255, label="eval (per epoch)")
    if _log_axis(y, line, ev):
        ax.set_yscale("log", nonpositive="clip")  # raw zero losses (a confident right answer) sit at the bottom
        ax.set_ylabel("loss (log scale)")
    else:
        ax.set_ylabel("loss")
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ok.any() or len(ev):
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return buf.getvalue()

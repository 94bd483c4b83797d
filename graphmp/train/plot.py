"""The loss curve of a training run as a PNG (run_dir/loss.png), with no new dependency.

write_loss_png(path, train_loss, eval_points) draws the train loss per step (a line; when
there are more steps than pixel columns, the per-column mean with a light min..max band)
and the eval loss per epoch (markers joined by a line) on a linear loss axis. With
matplotlib importable it draws with matplotlib (Agg, no pyplot state touched); otherwise
it rasterises the same plot with numpy and encodes the PNG with zlib + struct (axes, the
loss range and the step count as small bitmap digits). Non-finite losses (steps skipped
for overflow) are left out. The file is written atomically.
"""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np

from ..save import atomic_write

WIDTH, HEIGHT = 640, 400
TRAIN_RGB = (31, 119, 180)
BAND_RGB = (190, 214, 236)
EVAL_RGB = (255, 127, 14)


def write_loss_png(path, train_loss, eval_points=(), width: int = WIDTH, height: int = HEIGHT,
                   title: str = "loss", use_matplotlib: bool | None = None) -> str:
    """Write the curve to `path` (atomically); returns path.

    train_loss: loss per step (step k+1 at index k). eval_points: [(step, loss)], e.g. one
    per epoch. use_matplotlib: None = when importable; False = the numpy rasteriser."""
    steps = np.arange(1, len(train_loss) + 1, dtype=np.float64)
    loss = np.asarray(train_loss, dtype=np.float64).reshape(-1)
    ev = np.asarray(list(eval_points), dtype=np.float64).reshape(-1, 2)
    data = None
    if use_matplotlib is not False:
        try:
            data = _png_matplotlib(steps, loss, ev, width, height, title)
        except ImportError:
            if use_matplotlib:
                raise
    if data is None:
        data = encode_png(render(steps, loss, ev, width, height))
    with atomic_write(str(path)) as f:
        f.write(data)
    return str(path)


def _png_matplotlib(steps, loss, ev, width, height, title) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width / 100, height / 100), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ok = np.isfinite(loss)
    x, y = steps[ok], loss[ok]
    if len(x) > 2 * width:  # more steps than pixels: per-bin mean and min..max band (fast, same picture)
        edges = np.linspace(x[0], x[-1] + 1, width + 1)
        b = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, width - 1)
        lo, hi = np.full(width, np.inf), np.full(width, -np.inf)
        np.minimum.at(lo, b, y)
        np.maximum.at(hi, b, y)
        cnt = np.bincount(b, minlength=width)
        has = cnt > 0
        mid = ((edges[:-1] + edges[1:]) / 2)[has]
        ax.fill_between(mid, lo[has], hi[has], color=np.array(BAND_RGB) / 255, lw=0)
        x, y = mid, (np.bincount(b, y, minlength=width) / np.maximum(cnt, 1))[has]
    ax.plot(x, y, color=np.array(TRAIN_RGB) / 255, lw=1, label="train (per step)")
    if len(ev):
        ax.plot(ev[:, 0], ev[:, 1], "o-", color=np.array(EVAL_RGB) / 255, label="eval (per epoch)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ok.any() or len(ev):
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return buf.getvalue()


# --- the numpy rasteriser ----------------------------------------------------------------------

def render(steps, loss, ev, width: int = WIDTH, height: int = HEIGHT) -> np.ndarray:
    """uint8 RGB image [height, width, 3] of the curve (see the module docstring)."""
    img = np.full((height, width, 3), 255, np.uint8)
    left, right, top, bottom = 44, width - 12, 12, height - 22   # plot box in pixels
    ok = np.isfinite(loss)
    ev = ev[np.isfinite(ev).all(axis=1)] if len(ev) else ev
    ys = np.concatenate([loss[ok], ev[:, 1]]) if len(ev) else loss[ok]
    x_max = max(float(steps[-1]) if len(steps) else 1.0, float(ev[:, 0].max()) if len(ev) else 1.0, 1.0)
    lo, hi = (float(ys.min()), float(ys.max())) if len(ys) else (0.0, 1.0)
    pad = (hi - lo) * 0.05 or max(abs(hi) * 0.05, 1e-3)
    lo, hi = lo - pad, hi + pad

    def px(x, y):
        return (left + (np.asarray(x) - 1) / max(x_max - 1, 1) * (right - left),
                bottom - (np.asarray(y) - lo) / (hi - lo) * (bottom - top))

    _line(img, [left, left, right], [top, bottom, bottom], (0, 0, 0))  # axes
    if ok.any():
        x, y = px(steps[ok], loss[ok])
        cols = right - left + 1
        if len(x) > 2 * cols:  # too many steps: per-column mean and a min..max band
            c = np.clip(np.round(x - left).astype(int), 0, cols - 1)
            ymin = np.full(cols, np.inf)
            ymax = np.full(cols, -np.inf)
            np.minimum.at(ymin, c, y)
            np.maximum.at(ymax, c, y)
            cnt = np.bincount(c, minlength=cols)
            mean = np.bincount(c, y, minlength=cols) / np.maximum(cnt, 1)
            has = cnt > 0
            for col in np.flatnonzero(has):
                img[int(round(ymax[col])):int(round(ymin[col])) + 1, left + col] = BAND_RGB
            x, y = left + np.flatnonzero(has).astype(float), mean[has]
        _line(img, x, y, TRAIN_RGB, thick=True)
    if len(ev):
        x, y = px(ev[:, 0], ev[:, 1])
        _line(img, x, y, EVAL_RGB)
        for cx, cy in zip(np.round(x).astype(int), np.round(y).astype(int)):
            img[max(cy - 3, 0):cy + 4, max(cx - 3, 0):cx + 4] = EVAL_RGB
    _text(img, _num(hi - pad), 2, top)
    _text(img, _num(lo + pad), 2, bottom - 6)
    _text(img, str(int(x_max)), right - 4 * len(str(int(x_max))), bottom + 6)
    _text(img, "1", left, bottom + 6)
    return img


def _line(img, xs, ys, rgb, thick=False):
    """Polyline through the points (pixel coordinates), sampled densely enough to be unbroken."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(xs) == 1:
        xs, ys = np.repeat(xs, 2), np.repeat(ys, 2)
    n = np.maximum(np.ceil(np.maximum(np.abs(np.diff(xs)), np.abs(np.diff(ys)))).astype(int), 1) + 1
    t = np.concatenate([np.linspace(0, 1, k) for k in n])
    i = np.repeat(np.arange(len(n)), n)
    x = np.round(xs[i] + (xs[i + 1] - xs[i]) * t).astype(int)
    y = np.round(ys[i] + (ys[i + 1] - ys[i]) * t).astype(int)
    h, w = img.shape[:2]
    for dy in ((0, 1) if thick else (0,)):
        keep = (x >= 0) & (x < w) & (y + dy >= 0) & (y + dy < h)
        img[y[keep] + dy, x[keep]] = rgb


# 3x5 bitmap glyphs for the axis labels: 5 rows top to bottom, each a 3-bit number (4 = left pixel)
_FONT = {"0": "75557", "1": "26227", "2": "71747", "3": "71717", "4": "55711", "5": "74717", "6": "74757",
         "7": "71111", "8": "75757", "9": "75717", ".": "00002", "-": "00700", "e": "75747", "+": "02720"}


def _glyph(ch) -> np.ndarray:
    rows = [int(c) for c in _FONT.get(ch, "00000")]
    return np.array([[(r >> (2 - b)) & 1 for b in range(3)] for r in rows], bool)


def _text(img, s, x, y):
    """Draw `s` with the 3x5 font, top-left at (x, y), in black (clipped to the image)."""
    h, w = img.shape[:2]
    for k, ch in enumerate(s):
        g = _glyph(ch)
        for (r, c) in zip(*np.nonzero(g)):
            yy, xx = y + r, x + 4 * k + c
            if 0 <= yy < h and 0 <= xx < w:
                img[yy, xx] = 0


def _num(v: float) -> str:
    return f"{v:.3g}"


def encode_png(rgb: np.ndarray) -> bytes:
    """PNG bytes of a uint8 [height, width, 3] image (8-bit RGB, filter 0 on every row)."""
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), np.ascontiguousarray(rgb, np.uint8).reshape(h, w * 3)], 1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) + chunk(b"IEND", b""))

"""Document-like pages for OCR models: the tests and benchmarks calibrate and judge text
detectors on them (random noise makes a detector output nothing, which says nothing).

    pages(n, height, width, seed)   -> float32 [n, 3, H, W] in RapidOCR's detector
                                        preprocessing: BGR / 255, (x - 0.5) / 0.5
    text_lines(n, height, width)    -> float32 [n, 3, H, W] for recognizers: RGB / 255,
                                        (x - 0.5) / 0.5 (PP-OCR rec)
    table_page(height, width)       -> float32 [1, 3, H, W], pages()' preprocessing: a
                                        spreadsheet-like table drawn here (grid lines, a
                                        shaded header row, cells of words and numbers);
                                        always the same image for the same size

Text is drawn with Pillow's built-in font (Pillow comes with matplotlib in the test
extra); without Pillow, strokes of random lengths stand in for words.

SAMPLES is a folder of optional sample photos (`<name>.jpg`) that benchmarks may read when
it exists: $GRAPHMP_SAMPLES, else `models/samples/` (none ship with the repository;
readers fall back to synthetic pages). SHARED is its old name.
"""
from __future__ import annotations

import os

import numpy as np

SAMPLES = os.environ.get("GRAPHMP_SAMPLES") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "samples")
SHARED = SAMPLES  # the old name, still read by benchmarks
WORDS = ("graphmp", "Tensor", "Cores", "invoice", "total", "2026-11-23", "ONNX", "FP16", "mixed", "precision",
         "page", "12.50", "EUR", "reference", "accuracy", "budget", "detector", "text", "line", "table")


def _draw(h, w, rng, lines=True):
    """One page, uint8 RGB [h, w, 3]: dark text on a light background."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        return _strokes(h, w, rng)
    img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(225, 256, 3)))
    d = ImageDraw.Draw(img)
    y = int(rng.integers(4, 16))
    while y < h - 8:
        size = int(rng.integers(10, max(11, min(40, h // 3))))
        try:
            font = ImageFont.load_default(size=size)
        except TypeError:  # Pillow < 10.1: one bitmap size
            font = ImageFont.load_default()
        x = int(rng.integers(2, max(3, w // 8)))
        while x < w - 20:
            word = WORDS[int(rng.integers(len(WORDS)))]
            color = tuple(int(v) for v in rng.integers(0, 90, 3))
            d.text((x, y), word, fill=color, font=font)
            x += int(d.textlength(word, font=font)) + int(rng.integers(size // 3 + 2, size + 4))
        y += size + int(rng.integers(4, 3 * size))
        if not lines:
            break
    return np.asarray(img)


def _strokes(h, w, rng):
    page = np.full((h, w, 3), 240, np.uint8)
    for y in range(8, h - 12, 24):
        x = 4
        while x < w - 20:
            n = int(rng.integers(8, 60))
            page[y:y + 10, x:x + n] = rng.integers(0, 80)
            x += n + 8
    return page


def _normalize(rgb: np.ndarray, bgr: bool) -> np.ndarray:
    x = rgb[..., ::-1] if bgr else rgb
    return ((x.astype(np.float32) / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)


def pages(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([_normalize(_draw(height, width, rng), bgr=True) for _ in range(n)])


def text_lines(n: int, height: int = 48, width: int = 320, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([_normalize(_draw(height, width, rng, lines=False), bgr=False) for _ in range(n)])


TABLE_HEADER = ("Item", "Qty", "Price", "Total", "Date")


def _table_cells(rows: int, cols: int, rng) -> list:
    """The text of every cell: a header row, then item names, counts, prices and dates."""
    cells = [[TABLE_HEADER[c % len(TABLE_HEADER)] for c in range(cols)]]
    for _ in range(rows - 1):
        row = []
        for c in range(cols):
            k = c % len(TABLE_HEADER)
            if k == 0:
                row.append(WORDS[int(rng.integers(len(WORDS)))])
            elif k == 1:
                row.append(str(int(rng.integers(1, 250))))
            elif k in (2, 3):
                row.append(f"{rng.uniform(0.5, 9999):.2f}")
            else:
                row.append(f"2026-{int(rng.integers(1, 13)):02d}-{int(rng.integers(1, 29)):02d}")
        cells.append(row)
    return cells


def _table(h: int, w: int) -> np.ndarray:
    """A spreadsheet-like page, uint8 RGB [h, w, 3]: white cells, grey grid lines, a
    shaded header row, dark text (Pillow) or dark bars of the text's length (no Pillow).
    Fixed seed: the same size always gives the same image."""
    rng = np.random.default_rng(1234)
    row_h = max(8, min(28, h // 8))
    cols = max(2, min(len(TABLE_HEADER), w // 64))
    col_w = w // cols
    rows = max(2, h // row_h)
    cells = _table_cells(rows, cols, rng)
    page = np.full((h, w, 3), 255, np.uint8)
    page[:row_h] = (221, 230, 241)                      # header row shading
    ys = [r * row_h for r in range(rows + 1) if r * row_h < h] + [h - 1]
    xs = [c * col_w for c in range(cols + 1) if c * col_w < w] + [w - 1]
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        for r, row in enumerate(cells):
            y = r * row_h + row_h // 3
            bar = max(1, row_h // 3)
            for c, text in enumerate(row):
                x = c * col_w + 4
                n = min(len(text) * max(2, row_h // 4), col_w - 8)
                if y + bar < h and n > 0:
                    page[y:y + bar, x:x + n] = 40 if r else 20
    else:
        img = Image.fromarray(page)
        d = ImageDraw.Draw(img)
        size = max(6, row_h - 10)
        try:
            font = ImageFont.load_default(size=size)
        except TypeError:  # Pillow < 10.1: one bitmap size
            font = ImageFont.load_default()
        for r, row in enumerate(cells):
            for c, text in enumerate(row):
                while text and d.textlength(text, font=font) > col_w - 8:
                    text = text[:-1]
                d.text((c * col_w + 4, r * row_h + (row_h - size) // 2 - 1), text,
                       fill=(20, 20, 20) if r == 0 else (50, 50, 60), font=font)
        page = np.array(img)
    for y in ys:                                        # grid lines over the text
        page[y] = (170, 170, 170)
    for x in xs:
        page[:, x] = (170, 170, 170)
    page[row_h if row_h < h else h - 1] = (90, 90, 90)  # a darker rule under the header
    return page


def table_page(height: int, width: int) -> np.ndarray:
    """A table page drawn here (see _table), normalised as pages() does: [1, 3, H, W].
    Never None (callers written for the old screenshot may still test for it)."""
    return _normalize(_table(height, width), bgr=True)[None]

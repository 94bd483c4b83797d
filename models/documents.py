"""Document-like pages for OCR models: the tests and benchmarks calibrate and judge text
detectors on them (random noise makes a detector output nothing, which says nothing).

    pages(n, height, width, seed)   -> float32 [n, 3, H, W] in RapidOCR's detector
                                        preprocessing: BGR / 255, (x - 0.5) / 0.5
    text_lines(n, height, width)    -> float32 [n, 3, H, W] for recognizers: RGB / 255,
                                        (x - 0.5) / 0.5 (PP-OCR rec)
    table_page(height, width)       -> the table screenshot shipped in shared/corpus
                                        (exceltable.png), resized; None when absent

Text is drawn with Pillow's built-in font (Pillow comes with matplotlib in the test
extra); without Pillow, strokes of random lengths stand in for words.
"""
from __future__ import annotations

import os

import numpy as np

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "corpus", "samples")
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


def table_page(height: int, width: int) -> np.ndarray | None:
    path = os.path.join(SHARED, "exceltable.png")
    try:
        from PIL import Image
        img = Image.open(path).convert("RGB").resize((width, height))
    except (ImportError, OSError):
        return None
    return _normalize(np.asarray(img), bgr=True)[None]

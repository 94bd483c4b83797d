"""Make models/data/digits.npz: printed digits 0-9 for the training tour (README) and tests.

Each sample is one digit drawn with a font that ships inside matplotlib (the DejaVu
family: Sans, Serif, Sans Mono, in regular, bold and oblique; Bitstream Vera licence,
free to redistribute), rotated up to 12 degrees, scaled and shifted at random, white on
black in a 28 x 28 box like MNIST, as uint8 pixel values 0-255 (the range the MNIST model
in models/real/mnist_cntk.onnx reads). Seeded: the same file on every run.

Arrays: train_Input3 [N, 1, 28, 28], train_labels [N] (int64), and eval_ ones likewise;
graphmp's data files take one array per model input plus `labels`, so the tour splits
this file into train.npz and eval.npz.

usage: python models/data/make_digits.py [-o models/data/digits.npz] [--train 600] [--eval 200]
"""
from __future__ import annotations

import argparse
import io

import numpy as np

FONTS = [("DejaVu Sans", "normal", "normal"), ("DejaVu Sans", "bold", "normal"), ("DejaVu Sans", "normal", "oblique"),
         ("DejaVu Serif", "normal", "normal"), ("DejaVu Serif", "bold", "normal"),
         ("DejaVu Sans Mono", "normal", "normal"), ("DejaVu Sans Mono", "bold", "normal")]


def render(digit: int, rng) -> np.ndarray:
    """One 28 x 28 uint8 image of `digit` in a random font, size, angle and position."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    family, weight, style = FONTS[rng.integers(len(FONTS))]
    fig = plt.figure(figsize=(1, 1), dpi=28)
    fig.patch.set_facecolor("black")
    fig.text(0.5 + rng.uniform(-0.08, 0.08), 0.5 + rng.uniform(-0.08, 0.08), str(digit), color="white",
             ha="center", va="center", fontsize=rng.uniform(40, 54), family=family, weight=weight, style=style,
             rotation=rng.uniform(-12, 12))
    buf = io.BytesIO()
    fig.savefig(buf, format="raw", dpi=28, facecolor="black")
    plt.close(fig)
    rgba = np.frombuffer(buf.getvalue(), np.uint8).reshape(28, 28, 4)
    return rgba[..., 0].copy()


def make(n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, 10, n).astype(np.int64)
    images = np.stack([render(int(d), rng) for d in labels])[:, None, :, :]
    return images, labels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-o", "--output", default="models/data/digits.npz")
    ap.add_argument("--train", type=int, default=600)
    ap.add_argument("--eval", type=int, default=200)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    tx, ty = make(a.train, rng)
    ex, ey = make(a.eval, rng)
    np.savez_compressed(a.output, train_Input3=tx, train_labels=ty, eval_Input3=ex, eval_labels=ey)
    print(f"{a.output}: {a.train} training and {a.eval} eval digits, 28x28 uint8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""pad.layout: the facts shared by the padding modules (channels.py and its mixins).

- Layout: where a padded tensor's real channels sit (name, axis, padded size, positions).
- round_up, scatter: the arithmetic of padding a dimension and of placing a constant's
  values at the real positions of a longer axis.
- flops, model_flops: the FLOP counts the report uses (symbolic dims count as 1).
No ONNX rewriting happens here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Layout:
    name: str            # the padded tensor
    axis: int            # negative: counted from the last axis, so broadcasting keeps it
    size: int            # padded size of that axis
    real: np.ndarray     # positions of the original channels (int64, increasing)

    def same(self, o: "Layout") -> bool:
        return self.axis == o.axis and self.size == o.size and np.array_equal(self.real, o.real)

    @property
    def is_prefix(self) -> bool:
        return bool(np.array_equal(self.real, np.arange(len(self.real))))


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def scatter(arr: np.ndarray, axis: int, size: int, real: np.ndarray, fill: float = 0.0) -> np.ndarray:
    """`arr` placed at positions `real` of a new axis of length `size`, the rest `fill`."""
    moved = np.moveaxis(arr, axis, 0)
    out = np.full((size,) + moved.shape[1:], fill, dtype=arr.dtype)
    out[real] = moved
    return np.moveaxis(out, 0, axis)


def flops(shape_out, per_output) -> int:
    return 2 * int(np.prod([d or 1 for d in shape_out], dtype=np.int64)) * int(per_output)



def model_flops(model, shapes) -> int:
    """FLOPs of the Conv/ConvTranspose/Gemm/MatMul layers before padding (symbolic dims = 1)."""
    total = 0
    inits = {t.name: list(t.dims) for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and len(n.input) > 1:
            w = inits.get(n.input[1]) or shapes.get(n.input[1])
            out = shapes.get(n.output[0])
            if not w or not out or None in w:
                continue
            if n.op_type in ("Conv", "ConvTranspose"):
                src = shapes.get(n.input[0]) if n.op_type == "ConvTranspose" else out
                if not src:
                    continue
                total += flops(src[:1] + src[2:], int(np.prod(w, dtype=np.int64)))
            else:
                total += flops(out[:-1], int(np.prod(w, dtype=np.int64)))
    return total

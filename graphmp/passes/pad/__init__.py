"""The padder: Tensor Core channel padding, a group of its own (not a conversion pass).

It pads Conv channels and GEMM dimensions to a multiple of N (8 for FP16 Tensor Cores,
64 for A100/H100 tiles) with zero weights, so the model computes the same function with
every output shaped as before; FP32 stays FP32. Entry point: `pad_channels(model,
base_dir, multiple, stem, max_overhead) -> report` (channels.py), which graphmp/pad.py
runs as one step of its PAD_STEPS (`graphmp pad`, and `graphmp convert --pad-channels`
before the conversion pipeline).

- channels.py: the walk over the main graph, the rewriting helpers, the Slices back to
  the original tensors and the report (class Padder, built from the mixins below);
- weights.py: the weight layers (Conv, ConvTranspose, Gemm, MatMul) and the stem;
- flow.py: the per-channel ops padded channels flow through;
- producers.py: producers padded for free (OneHot, embedding tables, a Concat's constant);
- layout.py: Layout (where a padded tensor's real channels sit), the arithmetic, FLOPs.
"""
from __future__ import annotations

from .channels import pad_channels

__all__ = ["pad_channels"]

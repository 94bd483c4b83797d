"""Gradient rules: one small function per ONNX op, registered with `@rule("Op")`.

One module per family of ops; importing this package imports them all, which fills the
registry of graphmp/train/emitter.py (re-exported here as RULES, ZERO_GRAD, NEEDS_OPSET):

    common.py       helpers shared by the families (no rules)
    elementwise.py  arithmetic, activations, trigonometry, Cast, Dropout; the zero-derivative ops
    linalg.py       MatMul, Gemm, Einsum
    nn.py           Conv, ConvTranspose, pooling, Softmax, Batch/Layer/Instance/Group/RMS normalisation
    conv_gemm.py    the convolution weight gradient as GEMMs (helpers of nn.py, no rules)
    loss.py         SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss
    reduce.py       Reduce* (ReduceMax/Min split ties evenly), CumSum
    shape.py        Reshape, Flatten, (Un)Squeeze, Expand, Transpose, Concat, Split, Slice, Gather*,
                    Scatter*, Pad, Tile, TopK, DepthToSpace, SpaceToDepth, Trilu
    resize.py       Resize (nearest, linear and cubic, as the transpose of the interpolation)
    table.py        the docs table of every ONNX op (`python -m graphmp.train.rules --table`)

A rule gets the Emitter `em` (graphmp/train/emitter.py), the forward node, and the
gradients of the node's outputs (tensor names, None where an output has none). It returns
one gradient per node input (None for inputs that need none; `em.needs(x)` says which do).
A gradient has the dtype and shape of its tensor. Rules read forward tensors (inputs,
outputs) straight from the forward graph rather than recomputing them, and build
constants with `em.like(value, tensor)` so they match the dtype they meet (FP16 regions
stay FP16). A rule that finds the elements a max/min picked compares them with
`common._is_extreme`, not a bare Equal: a runtime may keep one side of the comparison in
FP32 and round the other to FP16 (ONNX Runtime on the CPU does), and an exact Equal then
matches nothing (0/0 = NaN gradients at every loss scale). A rule that cannot
differentiate a node's settings raises GraphmpError naming the node.
"""
from __future__ import annotations

from ..emitter import NEEDS_OPSET, RULES, ZERO_GRAD, Rule
from . import elementwise, linalg, loss, nn, reduce, resize, shape  # noqa: F401  (registers the rules)

__all__ = ["RULES", "ZERO_GRAD", "NEEDS_OPSET", "Rule"]

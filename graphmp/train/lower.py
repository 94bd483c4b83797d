"""Forward rewrites of a step graph: the same values, computed in the form that suits a step.

In a training step every weight is a graph value (a view of the flat weights, or a Cast of
one), not a constant. ONNX Runtime's CPU Conv prepacks only constant kernels for its fast
path; with a run-time kernel it runs one GEMM per image that re-reads the whole kernel,
with as many columns as the image has output positions. On the last stages of a network
fed small images (a 2x2 or 3x3 map) that is 2-3x slower than one Gemm over the whole batch
(conv_gemm.forward_form says where, with the measurements).

`lower_forward_convs` runs after the backward is built, so the gradient rules still see the
Conv; the rewrite keeps the Conv's output name, so every node reading it is unchanged.
Inference, eval and export use the model itself, with constant weights, and are untouched.

An FP16/BF16 Conv with a bias is left as it is: ONNX Runtime's CPU Gemm rounds the product
to FP16 before it adds C, so an output near zero (the product close to -bias) came out
~4e-5 off on average where the Conv's one rounding was 2e-7 off, enough to flip a ReLU
decision and move a channel's gradient by 3-15% (a held-out 1-D CNN, 2 of 5 seeds).
"""
from __future__ import annotations

import onnx
from onnx import TensorProto

from .emitter import Emitter, attr, tensor_info
from .rules.conv_gemm import conv_shapes, forward_form, forward_gemm

PREFIX = "forward_gemm"


def _candidates(graph, n_forward: int) -> list:
    """Forward Conv nodes (group 1, explicit pads) whose weight is not an initializer or a
    Constant: only those run without a prepacked kernel."""
    consts = {t.name for t in graph.initializer} | {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    found = []
    for node in list(graph.node)[:n_forward]:
        if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] in consts:
            continue
        auto = attr(node, "auto_pad", b"NOTSET")
        if attr(node, "group", 1) == 1 and (auto.decode() if isinstance(auto, bytes) else auto) in ("NOTSET", ""):
            found.append(node)
    return found


def lower_forward_convs(model: onnx.ModelProto, n_forward: int, info: dict | None = None) -> int:
    """Needs the step graph with its backward, the forward (and loss) being its first n_forward
    nodes, and `info`: emitter.tensor_info of the forward (made here when None). Rewrites each
    forward Conv that conv_gemm.forward_form picks (static shapes but the batch, a run-time
    kernel; an FP32 one, or one without a bias) as conv_gemm.forward_gemm, in place; returns
    how many nodes the forward grew by (0: nothing rewritten)."""
    graph = model.graph
    picked = _candidates(graph, n_forward)
    if not picked:
        return 0
    if info is None:
        forward = onnx.ModelProto()
        forward.CopyFrom(model)
        del forward.graph.node[n_forward:]
        info = tensor_info(forward)
    em = Emitter(model, info, PREFIX)
    replaced = {}
    for node in picked:
        x, w = node.input[0], node.input[1]
        wshape = em.static_shape(w)
        if wshape is None:
            continue
        sp = len(wshape) - 2
        kernel = list(attr(node, "kernel_shape", wshape[2:]))
        strides, dil = list(attr(node, "strides", [1] * sp)), list(attr(node, "dilations", [1] * sp))
        s = conv_shapes(em, x, node.output[0], 1, kernel, strides, dil, list(attr(node, "pads", [0] * (2 * sp))))
        if s is None or forward_form(s) != "gemm":
            continue
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        if bias and em.dtype(x) not in (TensorProto.FLOAT, TensorProto.DOUBLE):
            continue
        start = len(em.nodes)
        forward_gemm(em, x, w, bias, s, node.output[0])
        replaced[id(node)] = em.nodes[start:]
    if not replaced:
        return 0
    nodes = []
    for i, node in enumerate(graph.node):
        nodes.extend(replaced.get(id(node), [node]) if i < n_forward else [node])
    added = len(nodes) - len(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    return added

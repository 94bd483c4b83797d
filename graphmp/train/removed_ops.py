"""Experimental ops of early ONNX (opset <= 9), rewritten into standard ops before train-graph
upgrades the opset.

onnx removed ImageScaler, Crop and Affine (they never left the experimental list), so its
version converter cannot carry a model holding them past opset 9 -- and train-graph needs a
newer opset for its gradient rules. Old CNTK/Core ML exports (e.g. the WinML style-transfer
models) still use them. `rewrite_experimental` replaces each with the same computation in
ops that exist at the model's own opset (7..9), written so that the version converter
upgrades them:
    ImageScaler(x; scale, bias[C])     -> x * scale + bias.reshape(1, C, 1, 1)   (Mul, Add)
    Affine(x; alpha, beta)             -> x * alpha + beta                       (Mul, Add)
    Crop(x; border=[l, t, r, b])       -> x[:, :, t:H-b, l:W-r]                 (Slice-1)
    Crop(x; border=[l, t, ..], scale=[h, w]) -> x[:, :, t:t+h, l:l+w]           (Slice-1)
(the ONNX-ML 1.x definitions of these ops). The new nodes keep the old output names, so the
rest of the graph is untouched; the constants are new initializers (not trained: train-graph
trains only FP32 initializers that are not op parameters, and these are 0-d or feed Add/Mul
as constants named `<node>.legacy_*`, listed in the returned report so the caller can keep
them fixed).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import GraphmpError
from ..opset import default_opset

EXPERIMENTAL = ("ImageScaler", "Affine", "Crop")
_INT64_MAX = 2 ** 63 - 1


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def rewrite_experimental(model: onnx.ModelProto, where: str = "<model>") -> list:
    """Rewrite the main graph's ImageScaler / Affine / Crop nodes in place (see the module
    docstring). Returns the names of the constant initializers it added (to be kept out of
    training); an empty list, and the model untouched, when it has none of these ops.
    Raises GraphmpError for a Crop whose border/scale attributes are malformed."""
    if not any(n.op_type in EXPERIMENTAL and n.domain in ("", "ai.onnx") for n in model.graph.node):
        return []
    added, new_nodes = [], []
    opset = default_opset(model)

    def const(node, tag, value):
        name = f"{node.name or node.output[0]}.legacy_{tag}"
        model.graph.initializer.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        added.append(name)
        return name

    for node in model.graph.node:
        if node.op_type not in EXPERIMENTAL or node.domain not in ("", "ai.onnx"):
            new_nodes.append(node)
            continue
        x, y, base = node.input[0], node.output[0], node.name or node.output[0]
        if node.op_type in ("ImageScaler", "Affine"):
            if node.op_type == "ImageScaler":
                scale = float(_attr(node, "scale", 1.0))
                bias = np.asarray(_attr(node, "bias", []) or [0.0], np.float32)
                shift = bias.reshape(1, -1, 1, 1) if bias.size > 1 else bias.reshape(())
            else:
                scale, shift = float(_attr(node, "alpha", 1.0)), np.float32(_attr(node, "beta", 0.0))
            mid = f"{base}.legacy_scaled"
            new_nodes.append(helper.make_node("Mul", [x, const(node, "scale", scale)], [mid], name=f"{base}/mul"))
            new_nodes.append(helper.make_node("Add", [mid, const(node, "shift", shift)], [y], name=f"{base}/add"))
            continue
        border = list(_attr(node, "border", []) or [])
        scale = list(_attr(node, "scale", []) or [])
        if len(border) != 4 or (scale and len(scale) != 2) or min(border) < 0:
            raise GraphmpError(f"{where}: Crop node '{base}' has border {border} and scale {scale}; ONNX's Crop "
                               "needs border=[left, top, right, bottom] (>= 0) and optionally scale=[height, width].")
        left, top, right, bottom = border
        if scale:
            ends = [top + scale[0], left + scale[1]]
        else:  # numpy-style negative ends count from the back; 0 means "to the end"
            ends = [-bottom if bottom else _INT64_MAX, -right if right else _INT64_MAX]
        if opset < 10:  # Slice-1: attributes
            new_nodes.append(helper.make_node("Slice", [x], [y], name=f"{base}/slice", axes=[2, 3],
                                              starts=[top, left], ends=ends))
        else:  # Slice-10+: inputs
            ints = []
            for tag, v in (("starts", [top, left]), ("ends", ends), ("axes", [2, 3])):
                ints.append(f"{base}.legacy_{tag}")
                model.graph.initializer.append(numpy_helper.from_array(np.asarray(v, np.int64), ints[-1]))
            new_nodes.append(helper.make_node("Slice", [x] + ints, [y], name=f"{base}/slice"))
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    if model.ir_version < 4:  # IR 3: every initializer must also be a graph input (the converter checks)
        have = {v.name for v in model.graph.input}
        for t in model.graph.initializer:
            if t.name not in have and ".legacy_" in t.name:
                model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return added

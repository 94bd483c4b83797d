"""Experimental ops of early ONNX (opset <= 9), rewritten into standard ops before train-graph
upgrades the opset.

onnx removed ImageScaler, Crop, Affine and the other experimental ops in opset 10, so its
version converter cannot carry a model holding them past opset 9 -- and train-graph needs a
newer opset for its gradient rules. Old CNTK/Core ML exports (e.g. the WinML style-transfer
models) still use them. The rewrite is convert's (graphmp/passes/legalize.py: each op as the
standard ops that compute the same thing, in every graph); training adds two needs: the
constants it made must stay fixed (they are the op's attributes, not weights), and a node the
rewrite cannot express stops the build with one line, since the upgrade would stop there.
"""
from __future__ import annotations

import onnx

from ..errors import GraphmpError
from ..model_io import iter_graphs
from ..passes.legalize import REMOVED_AT, legalize


def rewrite_experimental(model: onnx.ModelProto, where: str = "<model>") -> list:
    """Rewrite the model's experimental ops in place. Returns the names of the constant
    initializers it added (to be kept out of training); an empty list, and the model
    untouched, when it has none. Raises GraphmpError for a node it cannot rewrite (a Crop
    whose border/scale attributes are malformed, ...)."""
    before = {t.name for g in iter_graphs(model.graph) for t in g.initializer}
    _, kept = legalize(model)
    if kept:
        k = kept[0]
        raise GraphmpError(f"{where}: {k['op_type']} node '{k['name']}' (an experimental op ONNX removed in opset "
                           f"{REMOVED_AT}) cannot be written as standard ops: {k['why']}; re-export the model with "
                           "a current exporter.")
    return [t.name for g in iter_graphs(model.graph) for t in g.initializer if t.name not in before]

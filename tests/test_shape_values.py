"""Reshape lengths computed from the graph's own shapes (graphmp/train/shape_values.py): the
head length of `x.reshape(n, t, h, d // h)` is a Div of a Shape, which onnx's data
propagation does not follow. Resolved, the training step keeps its static forms (no NonZero
to find a gradient's unbroadcast axes at run time) and pins for --cuda-graph; never a guess:
placeholders onnx invents for unknown lengths, and a -1 against a symbolic size, stay
unknown."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphmp.train.emitter import tensor_info
from graphmp.train.shape_values import declare_reshapes, dims_table, infer

torch = pytest.importorskip("torch")

from fixtures.torch_models import Block, export  # noqa: E402
from graphmp.train.device import batch_dims, cuda_graph_blockers, pin_dims  # noqa: E402
from graphmp.train.flat import graph_state_names  # noqa: E402
from graphmp.train.step import build_step  # noqa: E402

N = helper.make_node


def _block(tmp_path, d=16, heads=2, t=5):
    torch.manual_seed(0)
    return export(Block(d=d, heads=heads), np.zeros((3, t, d), np.float32), str(tmp_path / "block.onnx"))


def test_the_head_length_of_a_torch_attention_reshape_is_known(tmp_path):
    path = _block(tmp_path)
    model = onnx.load(path)
    plain = dims_table(onnx.shape_inference.infer_shapes(model, data_prop=True))
    info = tensor_info(model)
    heads = [n.output[0] for n in model.graph.node if n.op_type == "Reshape"
             and len(info[n.output[0]][1]) == 4]
    assert len(heads) == 3  # q, k and v split into heads
    for out in heads:
        assert not isinstance(plain[out][3], int)       # onnx alone: the head length unknown
        assert info[out][1] == ["N", 5, 2, 8], out        # here: the batch symbol kept, 16 // 2 = 8
    # every 4-D tensor of the attention is now fully known, apart from the batch symbol
    att = [k for k, (_, dims) in info.items() if dims and len(dims) == 4]
    assert att and all(dims[0] == "N" and all(isinstance(x, int) for x in dims[1:])
                       for k, (_, dims) in info.items() if k in att)


def _reshape_model(x_dims, target):
    """x -> Reshape(x, Concat(Shape-derived pieces...)) with `target` an int64 initializer."""
    g = helper.make_graph([N("Reshape", ["x", "s"], ["y"]), N("Relu", ["y"], ["z"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.array(target, np.int64), "s")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_no_guess_where_a_length_is_not_determined():
    # -1 against a symbolic size: onnx itself leaves the first length open, and so does this
    m = infer(_reshape_model(["N", 6], [-1, 3]))
    assert dims_table(m)["y"][1] == 3 and not isinstance(dims_table(m)["y"][0], int)
    # onnx's placeholders (unk__N) are renamed on every run: two of them are never the same length
    m = onnx.shape_inference.infer_shapes(_reshape_model(["unk__0", 6], [0, 2, 3]))
    assert declare_reshapes(m, {"x": ["unk__0", 6], "y": [None, 2, 3]}.get) == []
    # all ints: -1 resolved, and the declaration is what ONNX Runtime computes
    m = infer(_reshape_model([4, 6], [-1, 3]))
    assert dims_table(m)["y"] == [8, 3]


def test_a_torch_attention_step_has_static_gradients_and_pins_for_cuda_graphs(tmp_path):
    path = _block(tmp_path)
    meta = build_step(path, str(tmp_path / "run"), precision="mixed", optimizer="adamw", lr=1e-3)
    step = onnx.load(os.path.join(str(tmp_path / "run"), meta["step_model"]))
    ops = {n.op_type for n in step.graph.node}
    assert "NonZero" not in ops  # no unbroadcast axes found at run time
    assert meta["precision_cost"]["unknown_shapes"] == 0 and meta["precision_cost"]["gemm_low_share"] == 1.0
    pinned = pin_dims(step, batch_dims(step, meta, 3))
    assert cuda_graph_blockers(pinned, graph_state_names(meta)) == []
    with open(tmp_path / "run" / "train.json") as f:
        assert json.load(f)["nodes"]["total"] == len(step.graph.node)


def test_a_slice_of_a_shape_is_followed():
    """Hugging Face's Conv1D reshapes to x.size()[:-1] + (nf,): a Concat of a Slice of a Shape."""
    nodes = [N("Shape", ["x"], ["s"]), N("Slice", ["s", "zero", "minus_one"], ["lead"]),
             N("Concat", ["lead", "nf"], ["target"], axis=0), N("Reshape", ["x2", "target"], ["y"]),
             N("Relu", ["y"], ["z"])]
    ints = {"zero": [0], "minus_one": [-1], "nf": [12]}
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 7, 5]),
                                       helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["N", 84])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()])
    m = infer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9))
    assert dims_table(m)["y"] == ["N", 7, 12] and dims_table(m)["z"] == ["N", 7, 12]


def test_a_division_that_leaves_a_remainder_is_not_resolved():
    """ceil(7 / 2) and 7 // 2 differ: a length computed with an inexact Div (then Ceil, Floor or
    a Cast) stays unknown rather than taking one rounding for the other."""
    nodes = [N("Shape", ["x"], ["s"]), N("Gather", ["s", "one"], ["n"], axis=0),
             N("Cast", ["n"], ["nf"], to=TensorProto.FLOAT), N("Div", ["nf", "two_f"], ["h"]),
             N("Ceil", ["h"], ["c"]), N("Cast", ["c"], ["ci"], to=TensorProto.INT64),
             N("Unsqueeze", ["ci", "zero"], ["u"]), N("Concat", ["minus_one", "u"], ["target"], axis=0),
             N("Reshape", ["x2", "target"], ["y"]), N("Relu", ["y"], ["z"])]
    inits = [numpy_helper.from_array(np.array(1, np.int64), "one"), numpy_helper.from_array(np.array(2.0, np.float32),
                                                                                           "two_f"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus_one")]
    for length, want in ((8, [2, 4]), (7, None)):
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, length]),
                                           helper.make_tensor_value_info("x2", TensorProto.FLOAT, [8])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], inits)
        got = dims_table(infer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)))
        if want:
            assert got["y"] == want
        else:
            assert got.get("y") is None or not all(isinstance(d, int) for d in got["y"])

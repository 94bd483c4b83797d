"""FP32 models whose weights live inside control-flow bodies (If / Loop / Scan, nested).

Real exports put weights there: Silero VAD holds every Conv/LSTM weight as a Constant
inside the branches of an If on the sample rate; scripted torch models put loop weights
in Loop bodies. Each builder returns (model, feeds) with a valid opset-17 model whose
float weights are all inside subgraphs (so a converter that only converts the main
graph's initializers leaves them FP32 and produces an invalid model).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nph

F32 = TP.FLOAT
OPSET = 17


def _w(seed, shape, scale=None):
    rng = np.random.default_rng(seed)
    if scale is None:
        scale = 1.0 / np.sqrt(np.prod(shape[1:]) if len(shape) > 1 else shape[0])
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _const(name, arr):
    return oh.make_node("Constant", [], [name], name=f"{name}_const", value=nph.from_array(arr))


def _vi(name, elem, shape):
    return oh.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=()):
    g = oh.make_graph(nodes, "cf", inputs, outputs, initializer=list(inits))
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", OPSET)], producer_name="graphmp-tests")
    m.ir_version = 8
    return m


def if_weights_in_branches():
    """If(cond): then = Conv(x, W_then) with W_then a Constant node -> Relu -> Conv(Wc);
    else = Conv(x, W_else) with W_else a branch initializer -> Sigmoid. x is an
    outer-scope capture; the output y is read after the If by a Conv whose weight is
    also inside nothing (outer initializer) so the If output crosses back."""
    then_g = oh.make_graph(
        [_const("W_then", _w(1, [8, 3, 3, 3])),
         oh.make_node("Conv", ["x", "W_then"], ["t1"], name="then_conv", pads=[1, 1, 1, 1]),
         oh.make_node("Relu", ["t1"], ["t2"], name="then_relu"),
         _const("Wc_then", _w(2, [8, 8, 1, 1])),
         oh.make_node("Conv", ["t2", "Wc_then"], ["then_out"], name="then_conv2")],
        "then_branch", [], [_vi("then_out", F32, None)])
    else_g = oh.make_graph(
        [oh.make_node("Conv", ["x", "W_else"], ["e1"], name="else_conv", pads=[1, 1, 1, 1]),
         oh.make_node("Sigmoid", ["e1"], ["else_out"], name="else_sigmoid")],
        "else_branch", [], [_vi("else_out", F32, None)],
        initializer=[nph.from_array(_w(3, [8, 3, 3, 3]), "W_else")])
    nodes = [oh.make_node("If", ["cond"], ["y_if"], name="if_node", then_branch=then_g, else_branch=else_g),
             oh.make_node("Conv", ["y_if", "W_out"], ["y"], name="out_conv")]
    m = _model(nodes, [_vi("x", F32, ["N", 3, 16, 16]), _vi("cond", TP.BOOL, [])],
               [_vi("y", F32, ["N", 4, 16, 16])], [nph.from_array(_w(4, [4, 8, 1, 1]), "W_out")])
    x = np.random.default_rng(5).standard_normal([2, 3, 16, 16]).astype(np.float32)
    return m, {"x": x, "cond": np.array(True)}


def loop_weights_in_body():
    """Loop of 3 steps: h = Tanh(MatMul(h, W_body) + b_body) with W_body a body
    initializer and b_body a body Constant; scan output MatMul(h, W_scan) (a Constant)."""
    body = oh.make_graph(
        [oh.make_node("MatMul", ["h_in", "W_body"], ["bm"], name="body_mm"),
         _const("b_body", _w(11, [16], 0.1)),
         oh.make_node("Add", ["bm", "b_body"], ["ba"], name="body_add"),
         oh.make_node("Tanh", ["ba"], ["h_out"], name="body_tanh"),
         _const("W_scan", _w(12, [16, 4])),
         oh.make_node("MatMul", ["h_out", "W_scan"], ["scan_out"], name="body_scan_mm"),
         oh.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "loop_body", [_vi("i", TP.INT64, []), _vi("cond_in", TP.BOOL, []), _vi("h_in", F32, [2, 16])],
        [_vi("cond_out", TP.BOOL, []), _vi("h_out", F32, [2, 16]), _vi("scan_out", F32, [2, 4])],
        initializer=[nph.from_array(_w(10, [16, 16]), "W_body")])
    nodes = [oh.make_node("MatMul", ["x", "W_in"], ["h0"], name="in_mm"),
             oh.make_node("Loop", ["trip", "", "h0"], ["h_last", "scans"], name="loop_node", body=body)]
    inits = [nph.from_array(_w(13, [8, 16]), "W_in"), nph.from_array(np.array(3, np.int64), "trip")]
    m = _model(nodes, [_vi("x", F32, [2, 8])],
               [_vi("h_last", F32, [2, 16]), _vi("scans", F32, [3, 2, 4])], inits)
    return m, {"x": np.random.default_rng(14).standard_normal([2, 8]).astype(np.float32)}


def scan_weights_in_body():
    """Scan over the time axis of x [T, 2, 8]: s = Relu(MatMul(x_t, W_x) + MatMul(s, W_s)),
    with W_x a body initializer and W_s a body Constant; scan output = s."""
    body = oh.make_graph(
        [oh.make_node("MatMul", ["x_t", "W_x"], ["a"], name="scan_mm_x"),
         _const("W_s", _w(21, [8, 8])),
         oh.make_node("MatMul", ["s_in", "W_s"], ["b"], name="scan_mm_s"),
         oh.make_node("Add", ["a", "b"], ["c"], name="scan_add"),
         oh.make_node("Relu", ["c"], ["s_out"], name="scan_relu"),
         oh.make_node("Identity", ["s_out"], ["y_t"], name="scan_emit")],
        "scan_body", [_vi("s_in", F32, [2, 8]), _vi("x_t", F32, [2, 8])],
        [_vi("s_out", F32, [2, 8]), _vi("y_t", F32, [2, 8])],
        initializer=[nph.from_array(_w(20, [8, 8]), "W_x")])
    nodes = [oh.make_node("Scan", ["s0", "x"], ["s_last", "ys"], name="scan_node", body=body,
                          num_scan_inputs=1)]
    m = _model(nodes, [_vi("s0", F32, [2, 8]), _vi("x", F32, [5, 2, 8])],
               [_vi("s_last", F32, [2, 8]), _vi("ys", F32, [5, 2, 8])])
    rng = np.random.default_rng(22)
    return m, {"s0": rng.standard_normal([2, 8]).astype(np.float32),
               "x": rng.standard_normal([5, 2, 8]).astype(np.float32)}


def nested_if_in_loop():
    """Loop whose body holds an If (on the iteration parity) with a Constant weight in
    each branch; the branches read the loop-carried value (a capture of a capture)."""
    then_g = oh.make_graph(
        [_const("W_even", _w(31, [8, 8])),
         oh.make_node("MatMul", ["h_in", "W_even"], ["te"], name="even_mm"),
         oh.make_node("Softmax", ["te"], ["even_out"], name="even_softmax", axis=-1)],
        "even", [], [_vi("even_out", F32, [2, 8])])
    else_g = oh.make_graph(
        [oh.make_node("MatMul", ["h_in", "W_odd"], ["to"], name="odd_mm"),
         oh.make_node("Tanh", ["to"], ["odd_out"], name="odd_tanh")],
        "odd", [], [_vi("odd_out", F32, [2, 8])],
        initializer=[nph.from_array(_w(32, [8, 8]), "W_odd")])
    body = oh.make_graph(
        [_const("two", np.array(2, np.int64)),
         oh.make_node("Mod", ["i", "two"], ["par"], name="body_mod"),
         _const("zero", np.array(0, np.int64)),
         oh.make_node("Equal", ["par", "zero"], ["even"], name="body_eq"),
         oh.make_node("If", ["even"], ["branch_out"], name="body_if", then_branch=then_g, else_branch=else_g),
         oh.make_node("Add", ["h_in", "branch_out"], ["h_out"], name="body_residual"),
         oh.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "body", [_vi("i", TP.INT64, []), _vi("cond_in", TP.BOOL, []), _vi("h_in", F32, [2, 8])],
        [_vi("cond_out", TP.BOOL, []), _vi("h_out", F32, [2, 8])])
    nodes = [oh.make_node("Loop", ["trip", "", "x"], ["y"], name="loop_node", body=body)]
    m = _model(nodes, [_vi("x", F32, [2, 8])], [_vi("y", F32, [2, 8])],
               [nph.from_array(np.array(4, np.int64), "trip")])
    return m, {"x": np.random.default_rng(33).standard_normal([2, 8]).astype(np.float32)}


CASES = {
    "if_weights_in_branches": if_weights_in_branches,
    "loop_weights_in_body": loop_weights_in_body,
    "scan_weights_in_body": scan_weights_in_body,
    "nested_if_in_loop": nested_if_in_loop,
}


def float_weight_bytes(model: onnx.ModelProto) -> dict:
    """{dtype name: bytes} of float initializers and Constant values in every graph."""
    out: dict = {}

    def walk(g):
        tensors = list(g.initializer)
        for n in g.node:
            for a in n.attribute:
                if n.op_type == "Constant" and a.name == "value":
                    tensors.append(a.t)
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                for sg in a.graphs:
                    walk(sg)
        for t in tensors:
            if t.data_type in (TP.FLOAT, TP.FLOAT16, TP.BFLOAT16, TP.DOUBLE):
                arr = nph.to_array(t)
                key = TP.DataType.Name(t.data_type)
                out[key] = out.get(key, 0) + arr.nbytes
    walk(model.graph)
    return out

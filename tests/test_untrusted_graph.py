"""Untrusted models: a malformed graph (undefined or doubly defined tensors, cycles, inline
tensor data that disagrees with its dims) is one clear error and exit 2 before any work,
from every command (graphmp.sanity.check_graph, called by graphmp.model_io.load_model). Valid
models that look unusual (nodes out of order, outer-scope captures, Loop bodies, omitted
optional inputs "") still convert."""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh

from graphmp.cli import main
from graphmp.errors import GraphmpError
from graphmp.sanity import check_graph

from cases import _init, _model, _vi, case_10_control_flow, case_11_unsorted_nodes
from control_flow_cases import if_weights_in_branches, loop_weights_in_body, nested_if_in_loop, scan_weights_in_body

F32 = TP.FLOAT


# --------------------------------------------------------------------------- builders
def _mlp(w=None, extra_nodes=(), extra_inits=(), outputs=None):
    """x [2, 8] -> MatMul(W) -> Relu -> Add(b) -> y; pieces replaceable to break it."""
    w = w if w is not None else _init("W", np.full((8, 8), 0.1, np.float32))
    nodes = [oh.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             oh.make_node("Relu", ["h"], ["r"], name="relu"),
             oh.make_node("Add", ["r", "b"], ["y"], name="add_b"), *extra_nodes]
    inits = [w, _init("b", np.zeros(8, np.float32)), *extra_inits]
    return _model(nodes, [_vi("x", F32, [2, 8])], outputs or [_vi("y", F32, [2, 8])], inits, name="mlp")


def _raw_w(dims, nbytes, name="W"):
    """A FLOAT initializer declaring `dims` whose raw_data holds `nbytes` bytes."""
    t = onnx.TensorProto(name=name, data_type=F32, dims=dims)
    t.raw_data = bytes(nbytes)
    return t


def _sub(model, node_name, attr):
    node = next(n for n in model.graph.node if n.name == node_name)
    return next(a for a in node.attribute if a.name == attr).g


def _node(graph, name):
    return next(n for n in graph.node if n.name == name)


# --------------------------------------------------------------------------- runner
def _rejected(capsys, tmp_path, model, argv, *needles, name="bad.onnx"):
    """Save `model`, run `argv` ({m} = its path, {d} = tmp_path) and check the contract:
    exit 2, exactly one stderr line `graphmp: error: ...` naming the file and `needles`,
    nothing written, the input unchanged. Returns the line."""
    m = tmp_path / name
    onnx.save(model, str(m))
    before, listing = m.read_bytes(), sorted(os.listdir(tmp_path))
    capsys.readouterr()
    rc = main([a.format(m=m, d=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    line = lines[0]
    assert line.startswith("graphmp: error: "), line
    assert str(m) in line, line
    for needle in needles:
        assert needle in line, (needle, line)
    assert "re-export" in line.lower(), line
    assert m.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == listing  # no output, no temporary files
    return line


CONVERT = ["convert", "{m}", "-o", "{d}/out.onnx", "-q"]
PAD = ["pad", "{m}", "-o", "{d}/out.onnx"]
TRAIN = ["train-graph", "{m}", "-o", "{d}/run", "--loss", "mse"]


# --------------------------------------------------------------------------- 1. undefined inputs
def test_undefined_input_main_graph(capsys, tmp_path):
    model = _mlp()
    _node(model.graph, "relu").input[0] = "h_typo"
    _rejected(capsys, tmp_path, model, CONVERT, "node 'relu' (Relu)", "'h_typo'", "main graph")


def test_names_with_control_characters_stay_on_one_line(capsys, tmp_path):
    model = _mlp()
    _node(model.graph, "relu").input[0] = "h\nINJECTED\rline"
    _rejected(capsys, tmp_path, model, CONVERT, "node 'relu' (Relu)", "INJECTED")


def test_undefined_graph_output(capsys, tmp_path):
    model = _mlp(outputs=[_vi("y", F32, [2, 8]), _vi("z", F32, [2, 8])])
    _rejected(capsys, tmp_path, model, CONVERT, "output 'z'")


def test_undefined_input_in_if_branch(capsys, tmp_path):
    model, _ = case_10_control_flow()
    _node(_sub(model, "if_node", "then_branch"), "then_mm").input[0] = "t_missing"
    _rejected(capsys, tmp_path, model, CONVERT, "node 'then_mm' (MatMul)", "'t_missing'",
              "node 'if_node'", "then_branch")


def test_undefined_input_in_loop_body(capsys, tmp_path):
    model, _ = loop_weights_in_body()
    _node(_sub(model, "loop_node", "body"), "body_add").input[1] = "b_missing"
    _rejected(capsys, tmp_path, model, CONVERT, "node 'body_add' (Add)", "'b_missing'", "node 'loop_node'")


def test_undefined_input_in_if_nested_in_loop(capsys, tmp_path):
    model, _ = nested_if_in_loop()
    body = _sub(model, "loop_node", "body")
    _node(_sub_of(body, "body_if", "else_branch"), "odd_mm").input[0] = "h_gone"
    _rejected(capsys, tmp_path, model, CONVERT, "node 'odd_mm' (MatMul)", "'h_gone'",
              "node 'body_if'", "node 'loop_node'")


def _sub_of(graph, node_name, attr):
    return next(a for a in _node(graph, node_name).attribute if a.name == attr).g


def test_subgraph_value_is_not_visible_to_the_outer_graph(capsys, tmp_path):
    """A name defined only inside a branch does not exist for the main graph."""
    model, _ = case_10_control_flow()
    _node(model.graph, "post_mm").input[1] = "ta"  # then_branch's MatMul output
    _rejected(capsys, tmp_path, model, CONVERT, "node 'post_mm' (MatMul)", "'ta'")


# --------------------------------------------------------------------------- 2. duplicate producers
def test_two_nodes_write_the_same_tensor(capsys, tmp_path):
    model = _mlp(extra_nodes=[oh.make_node("Sigmoid", ["x"], ["h"], name="sig_dup")])
    _rejected(capsys, tmp_path, model, CONVERT, "'h'", "node 'mm' (MatMul)", "node 'sig_dup' (Sigmoid)")


def test_node_output_overwrites_initializer(capsys, tmp_path):
    model = _mlp(extra_nodes=[oh.make_node("Identity", ["x"], ["b"], name="shadow_b")])
    _rejected(capsys, tmp_path, model, CONVERT, "node 'shadow_b' (Identity)", "'b'", "initializer")


def test_node_output_overwrites_graph_input(capsys, tmp_path):
    model = _mlp(extra_nodes=[oh.make_node("Identity", ["y"], ["x"], name="shadow_x")])
    _rejected(capsys, tmp_path, model, CONVERT, "node 'shadow_x' (Identity)", "'x'", "graph input")


def test_two_initializers_with_one_name(capsys, tmp_path):
    model = _mlp(extra_inits=[_init("b", np.ones(8, np.float32))])
    _rejected(capsys, tmp_path, model, CONVERT, "two initializers named 'b'")


def test_duplicate_producer_in_train_graph(capsys, tmp_path):
    model = _mlp(extra_nodes=[oh.make_node("Sigmoid", ["x"], ["r"], name="sig_dup")])
    _rejected(capsys, tmp_path, model, TRAIN, "'r'", "node 'sig_dup' (Sigmoid)")


# --------------------------------------------------------------------------- 3. cycles
def _cyclic():
    """h = MatMul(x, W); a = Add(h, c); bb = Relu(a); c = Neg(bb): a -> bb -> c -> a."""
    nodes = [oh.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             oh.make_node("Add", ["h", "c"], ["a"], name="cyc_add"),
             oh.make_node("Relu", ["a"], ["bb"], name="cyc_relu"),
             oh.make_node("Neg", ["bb"], ["c"], name="cyc_neg"),
             oh.make_node("Identity", ["bb"], ["y"], name="out")]
    return _model(nodes, [_vi("x", F32, [2, 8])], [_vi("y", F32, [2, 8])],
                  [_init("W", np.eye(8, dtype=np.float32))], name="cyclic")


@pytest.mark.parametrize("argv", [CONVERT, PAD], ids=["convert", "pad"])
def test_cycle(capsys, tmp_path, argv):
    line = _rejected(capsys, tmp_path, _cyclic(), argv, "cycle", "'cyc_add' (Add)", "'cyc_relu' (Relu)",
                     "'cyc_neg' (Neg)")
    assert "'out'" not in line and "'mm'" not in line  # only the cycle, not what hangs off it


def test_node_reading_its_own_output(capsys, tmp_path):
    model = _mlp()
    _node(model.graph, "relu").input[0] = "r"
    _rejected(capsys, tmp_path, model, CONVERT, "cycle", "'relu' (Relu)")


def test_cycle_through_subgraph_capture(capsys, tmp_path):
    """The If's branch reads `y_if`'s consumer output: If -> (capture) post_mm -> If."""
    model, _ = case_10_control_flow()
    _node(_sub(model, "if_node", "then_branch"), "then_mm").input[0] = "y_if"
    _rejected(capsys, tmp_path, model, CONVERT, "cycle", "'if_node' (If)", "'post_mm' (MatMul)")


# --------------------------------------------------------------------------- 4/5. inline tensor data
@pytest.mark.parametrize("nbytes", [128, 512], ids=["shorter", "longer"])
def test_raw_data_length_vs_dims(capsys, tmp_path, nbytes):
    _rejected(capsys, tmp_path, _mlp(_raw_w([8, 8], nbytes)), CONVERT, "initializer 'W'", "256",
              f"{nbytes} bytes")


@pytest.mark.parametrize("argv", [PAD, TRAIN], ids=["pad", "train-graph"])
def test_large_raw_data_shorter_than_dims(capsys, tmp_path, argv):
    """8 KiB of a declared 16 KiB. (convert and check load such weights by reference, as
    external data into the .onnx itself: graphmp.paths checks those against the file.)"""
    model = _mlp(extra_inits=[_raw_w([64, 64], 8192, name="W_big")],
                 extra_nodes=[oh.make_node("Identity", ["W_big"], ["w_big_out"], name="use_big")],
                 outputs=[_vi("y", F32, [2, 8]), _vi("w_big_out", F32, [64, 64])])
    _rejected(capsys, tmp_path, model, argv, "initializer 'W_big'", "16384", "8192 bytes")


def test_float_data_count(capsys, tmp_path):
    w = onnx.TensorProto(name="W", data_type=F32, dims=[8, 8])
    w.float_data.extend([0.0] * 60)
    _rejected(capsys, tmp_path, _mlp(w), CONVERT, "initializer 'W'", "float_data", "60", "64")


def test_absurd_declared_size_with_16_bytes(capsys, tmp_path):
    """[1<<20, 1<<20, 1024] FP32 = 4 PiB declared, 16 bytes present: an error, not a MemoryError."""
    dims = [1 << 20, 1 << 20, 1024]
    _rejected(capsys, tmp_path, _mlp(_raw_w(dims, 16)), CONVERT, "initializer 'W'",
              str(4 * (1 << 50)), "16 bytes")


def test_absurd_declared_size_in_train_graph(capsys, tmp_path):
    _rejected(capsys, tmp_path, _mlp(_raw_w([1 << 20, 1 << 20, 1024], 16)), TRAIN, "initializer 'W'")


def test_negative_dim(capsys, tmp_path):
    _rejected(capsys, tmp_path, _mlp(_raw_w([-1, 8], 32)), CONVERT, "initializer 'W'", "negative", "-1")


def test_initializer_without_data(capsys, tmp_path):
    _rejected(capsys, tmp_path, _mlp(onnx.TensorProto(name="W", data_type=F32, dims=[8, 8])), CONVERT,
              "initializer 'W'", "no data")


def test_values_in_the_wrong_field(capsys, tmp_path):
    w = onnx.TensorProto(name="W", data_type=F32, dims=[8, 8])
    w.int64_data.extend([0] * 64)
    _rejected(capsys, tmp_path, _mlp(w), CONVERT, "initializer 'W'", "int64_data", "float_data")


def test_constant_attribute_shorter_than_dims(capsys, tmp_path):
    model = _mlp()
    t = onnx.TensorProto(name="", data_type=F32, dims=[8])
    t.raw_data = bytes(8)
    model.graph.node.insert(0, oh.make_node("Constant", [], ["bc"], name="bias_const", value=t))
    _node(model.graph, "add_b").input[1] = "bc"
    _rejected(capsys, tmp_path, model, CONVERT, "node 'bias_const' (Constant)", "attribute 'value'",
              "32", "8 bytes")


def test_subgraph_initializer_shorter_than_dims(capsys, tmp_path):
    model, _ = if_weights_in_branches()
    w = next(t for t in _sub(model, "if_node", "else_branch").initializer if t.name == "W_else")
    w.raw_data = w.raw_data[:100]
    _rejected(capsys, tmp_path, model, CONVERT, "initializer 'W_else'", "node 'if_node'", "100 bytes")


def test_sparse_initializer_values_count(capsys, tmp_path):
    model = _mlp()
    values = onnx.TensorProto(name="S", data_type=F32, dims=[3])
    values.float_data.extend([1.0, 2.0])  # 3 declared, 2 given
    indices = oh.make_tensor("S_idx", TP.INT64, [3], [0, 5, 9])
    model.graph.sparse_initializer.append(oh.make_sparse_tensor(values, indices, [8, 8]))
    model.graph.node.append(oh.make_node("Identity", ["S"], ["s_out"], name="use_s"))
    model.graph.output.append(_vi("s_out", F32, [8, 8]))
    _rejected(capsys, tmp_path, model, CONVERT, "sparse initializer 'S'", "float_data", "2", "3")


# --------------------------------------------------------------------------- check command
def test_check_with_malformed_reference(capsys, tmp_path):
    good = tmp_path / "good.onnx"
    onnx.save(_mlp(), str(good))
    model = _mlp()
    _node(model.graph, "add_b").input[1] = "b_nowhere"
    _rejected(capsys, tmp_path, model, ["check", "{m}", str(good)], "node 'add_b' (Add)", "'b_nowhere'")


def test_check_with_malformed_converted_model(capsys, tmp_path):
    good = tmp_path / "good.onnx"
    onnx.save(_mlp(), str(good))
    _rejected(capsys, tmp_path, _cyclic(), ["check", str(good), "{m}"], "cycle", "'cyc_add' (Add)",
              name="conv.onnx")


# --------------------------------------------------------------------------- the packing rules
def _t(dtype, dims, **fields):
    t = onnx.TensorProto(name="T", data_type=dtype, dims=dims)
    for k, v in fields.items():
        if k == "raw_data":
            t.raw_data = v
        else:
            getattr(t, k).extend(v)
    return t


# (tensor that is right, the same with one value or byte too many or too few)
PACKING = {
    "float16-int32_data": (oh.make_tensor("T", TP.FLOAT16, [3], [1.0, 2.0, 3.0]), _t(TP.FLOAT16, [3], int32_data=[0, 0])),
    "bfloat16-int32_data": (_t(TP.BFLOAT16, [2], int32_data=[0, 0]), _t(TP.BFLOAT16, [2], int32_data=[0])),
    "bool-int32_data": (oh.make_tensor("T", TP.BOOL, [4], [1, 0, 1, 1]), _t(TP.BOOL, [4], int32_data=[1] * 5)),
    "int8-int32_data": (_t(TP.INT8, [2, 2], int32_data=[1, 2, 3, 4]), _t(TP.INT8, [2, 2], int32_data=[1])),
    "complex64-float_data": (oh.make_tensor("T", TP.COMPLEX64, [2], [1 + 2j, 3 - 1j]),
                             _t(TP.COMPLEX64, [2], float_data=[1.0, 2.0])),
    "complex128-raw": (_t(TP.COMPLEX128, [2], raw_data=bytes(32)), _t(TP.COMPLEX128, [2], raw_data=bytes(16))),
    "int4-int32_data": (oh.make_tensor("T", TP.INT4, [5], [1, 2, 3, 4, 5]), _t(TP.INT4, [5], int32_data=[0, 0])),
    "uint4-raw": (_t(TP.UINT4, [5], raw_data=bytes(3)), _t(TP.UINT4, [5], raw_data=bytes(5))),
    "int64-int64_data": (_t(TP.INT64, [3], int64_data=[1, 2, 3]), _t(TP.INT64, [3], int64_data=[1, 2])),
    "uint32-uint64_data": (_t(TP.UINT32, [2], uint64_data=[1, 2]), _t(TP.UINT32, [2], uint64_data=[1, 2, 3])),
    "double-double_data": (_t(TP.DOUBLE, [1], double_data=[1.0]), _t(TP.DOUBLE, [1], double_data=[1.0, 2.0])),
    "string-string_data": (_t(TP.STRING, [2], string_data=[b"a", b"b"]), _t(TP.STRING, [2], string_data=[b"a"])),
    "string-in-raw": (_t(TP.STRING, [1], string_data=[b"ab"]), _t(TP.STRING, [1], raw_data=b"ab")),
    "scalar-raw": (_t(TP.FLOAT, [], raw_data=bytes(4)), _t(TP.FLOAT, [], raw_data=bytes(8))),
    "empty-with-data": (_t(TP.FLOAT, [0, 4]), _t(TP.FLOAT, [0, 4], float_data=[1.0])),
    "undefined-type": (_t(TP.FLOAT, [1], float_data=[1.0]), _t(TP.UNDEFINED, [1], float_data=[1.0])),
}


def _model_with_constant(t):
    node = oh.make_node("Constant", [], ["c"], name="const_t", value=t)
    g = oh.make_graph([node], "g", [], [oh.make_value_info("c", onnx.TypeProto())])
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])


@pytest.mark.parametrize("case", list(PACKING))
def test_packing_rules(case):
    good, bad = PACKING[case]
    check_graph(_model_with_constant(good), "m.onnx")
    with pytest.raises(GraphmpError, match=r"m\.onnx: main graph 'g' node 'const_t' \(Constant\) attribute 'value'"):
        check_graph(_model_with_constant(bad), "m.onnx")


def test_constant_attribute_without_data_is_allowed_initializer_is_not():
    check_graph(_model_with_constant(_t(TP.FLOAT, [4])), "m.onnx")
    model = _mlp(onnx.TensorProto(name="W", data_type=F32, dims=[8, 8]))
    with pytest.raises(GraphmpError, match="initializer 'W'"):
        check_graph(model, "m.onnx")


# --------------------------------------------------------------------------- valid models still convert
VALID = {
    "unsorted_nodes": lambda: case_11_unsorted_nodes(),
    "if_and_loop_outer_scope": lambda: case_10_control_flow()[0],
    "loop_body_optional_input": lambda: loop_weights_in_body()[0],
    "if_in_loop_captures": lambda: nested_if_in_loop()[0],
    "if_branch_initializers": lambda: if_weights_in_branches()[0],
    "scan_body": lambda: scan_weights_in_body()[0],
}


@pytest.mark.parametrize("name", list(VALID))
def test_valid_model_converts(tmp_path, capsys, name):
    model = VALID[name]()
    m, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, str(m))
    check_graph(model, str(m))
    rc = main(["convert", str(m), "-o", str(out), "-q"])
    assert rc == 0, capsys.readouterr().err
    assert out.exists()


def test_valid_optional_inputs_and_outputs():
    """"" is an omitted optional input or output, never an undefined name."""
    model = _mlp(extra_nodes=[oh.make_node("Clip", ["y", "", ""], ["yc"], name="clip"),
                              oh.make_node("Dropout", ["yc"], ["yd", ""], name="drop")],
                 outputs=[_vi("yd", F32, [2, 8])])
    check_graph(model, "m.onnx")


def test_check_is_linear_on_a_long_chain():
    """20 000 nodes, reversed (worst case for a naive sort), checked in well under a second."""
    import time
    n = 20000
    nodes = [oh.make_node("Relu", [f"t{i}"], [f"t{i + 1}"], name=f"r{i}") for i in range(n)][::-1]
    model = _model(nodes, [_vi("t0", F32, [1])], [_vi(f"t{n}", F32, [1])])
    t0 = time.perf_counter()
    check_graph(model, "m.onnx")
    assert time.perf_counter() - t0 < 2.0
    model.graph.node[0].input[0] = f"t{n}"  # r{n-1} now reads its own output
    with pytest.raises(GraphmpError, match="cycle"):
        check_graph(model, "m.onnx")


# --------------------------------------------------------------------------- found by the fuzz suite
def test_output_that_is_an_initializer_must_declare_what_it_is(capsys, tmp_path):
    """No node's inference checks a graph output that is an initializer; a Cast or Identity
    put in front of it would, so the mismatch is refused at load."""
    model = _mlp(outputs=[_vi("y", F32, [2, 8]), _vi("b", F32, [1, 8])])
    _rejected(capsys, tmp_path, model, PAD, "output 'b'", "initializer", "[1, 8]")


def test_output_that_is_an_initializer_pads_and_converts(tmp_path, capsys):
    """Declared as it is, such an output survives padding (the weight read through an
    Identity) and conversion, and the results pass the full checker."""
    model = _mlp(outputs=[_vi("y", F32, [2, 8]), _vi("b", F32, [8])])
    m = tmp_path / "m.onnx"
    onnx.save(model, str(m))
    for cmd in ("pad", "convert"):
        out = tmp_path / f"{cmd}.onnx"
        assert main([cmd, str(m), "-o", str(out)] + (["-q"] if cmd == "convert" else [])) == 0, capsys.readouterr()
        onnx.checker.check_model(str(out), full_check=True)


def test_reference_attribute_outside_a_function(capsys, tmp_path):
    model = _mlp()
    a = oh.make_attribute("alpha", 0.1)
    a.ref_attr_name = "outer"
    _node(model.graph, "relu").op_type = "LeakyRelu"
    _node(model.graph, "relu").attribute.append(a)
    _rejected(capsys, tmp_path, model, PAD, "'relu'", "not inside a function")


def test_pad_writes_sorted_graphs(tmp_path, capsys):
    """The nodes of a source may come in any order; pad's output is sorted like convert's."""
    model = _mlp()
    nodes = list(model.graph.node)[::-1]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    m, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, str(m))
    assert main(["pad", str(m), "-o", str(out)]) == 0, capsys.readouterr()
    onnx.checker.check_model(str(out), full_check=True)

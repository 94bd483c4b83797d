"""LSTM/GRU in training graphs: graphmp/train/rnn.py unrolls them into primitive ops.

- forward: the unrolled model's outputs equal ONNX Runtime's LSTM/GRU (FP32, 1e-5) for every
  direction x layout (x linear_before_reset), with and without B / initial states / peepholes;
- gradients: the step graph's exposed gradients w.r.t. W, R, B (and initial states, P) equal
  central finite differences of the loss, computed in float64 on the original (not unrolled)
  model with onnx's reference LSTM/GRU;
- end to end: a tiny GRU classifier through `graphmp train-graph` + 20 training steps has a
  falling loss in FP32 and mixed precision;
- refusals are one-line GraphmpErrors naming the node.
"""
from __future__ import annotations

import json
import os
import zlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from graphmp.cli import main
from graphmp.errors import GraphmpError
from graphmp.model_runs import ort_session
from graphmp.train.flat import pack
from graphmp.train.loop import evaluate, latest_state, load_run
from graphmp.train.rnn import decompose_recurrent
from graphmp.train.step import build_step

F32 = TensorProto.FLOAT
SEQ, BATCH, IN, HID = 5, 2, 3, 4


def _rng(key):
    return np.random.default_rng(zlib.crc32(key.encode()))


def rnn_model(op, direction="forward", layout=0, lbr=0, bias=True, init=True, peep=False, outputs=(0, 1, 2),
              opset=14, seq=SEQ, weights_as_inputs=False, key="m", **attrs):
    """X -> one LSTM/GRU -> its outputs as graph outputs y0 (Y), y1 (Y_h), y2 (Y_c).
    Weights (and initial states, P) are initializers unless weights_as_inputs."""
    r = _rng(f"{key}{op}{direction}{layout}{lbr}{bias}{init}{peep}")
    nd = 2 if direction == "bidirectional" else 1
    g = 4 if op == "LSTM" else 3
    lstm = op == "LSTM"
    state_shape = [nd, BATCH, HID] if layout == 0 else [BATCH, nd, HID]
    arrays = {"W": r.standard_normal((nd, g * HID, IN)) * 0.5, "R": r.standard_normal((nd, g * HID, HID)) * 0.5}
    names = ["X", "W", "R", "", "", "", "", ""]
    if bias:
        arrays["B"] = r.standard_normal((nd, 2 * g * HID)) * 0.5
        names[3] = "B"
    if init:
        arrays["h0"] = r.standard_normal(state_shape) * 0.5
        names[5] = "h0"
        if lstm:
            arrays["c0"] = r.standard_normal(state_shape) * 0.5
            names[6] = "c0"
    if peep:
        arrays["P"] = r.standard_normal((nd, 3 * HID)) * 0.5
        names[7] = "P"
    names = names[:8 if lstm else 6]
    while names[-1] == "":
        names.pop()
    n_out = 3 if lstm else 2
    outs = [f"y{i}" if i in outputs else "" for i in range(n_out)]
    while outs[-1] == "":
        outs.pop()
    if layout:
        attrs["layout"] = 1
    if not lstm:
        attrs["linear_before_reset"] = lbr
    node = helper.make_node(op, names, outs, name=f"{op.lower()}_0", hidden_size=HID, direction=direction, **attrs)
    xshape = [seq, BATCH, IN] if layout == 0 else [BATCH, seq, IN]
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in arrays.items()]
    inputs = [helper.make_tensor_value_info("X", F32, xshape)]
    if weights_as_inputs:
        inputs += [helper.make_tensor_value_info(t.name, F32, list(t.dims)) for t in inits]
        inits = []
    yshape = [seq, nd, BATCH, HID] if layout == 0 else [BATCH, seq, nd, HID]
    graph = helper.make_graph([node], "rnn", inputs, [helper.make_tensor_value_info(o, F32, yshape if i == 0 else
                                                                                    state_shape)
                                                      for i, o in enumerate(outs) if o], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _x(model, key="x"):
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return _rng(key).standard_normal(dims).astype(np.float32)


def _outputs(model, x):
    return ort_session(model).run(None, {"X": x})


def _ort_reference(model, x):
    """ONNX Runtime's outputs of the LSTM/GRU model. ORT's CPU kernels refuse layout=1, so a
    layout-1 node runs as its layout-0 twin: X and initial states transposed in, outputs back."""
    node = model.graph.node[0]
    if not any(a.name == "layout" and a.i == 1 for a in node.attribute):
        return _outputs(model, x)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    node = m.graph.node[0]
    keep = [a for a in node.attribute if a.name != "layout"]
    del node.attribute[:]
    node.attribute.extend(keep)
    for t in m.graph.initializer:
        if t.name in ("h0", "c0"):
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).transpose(1, 0, 2).copy(), t.name))
    for v in list(m.graph.input) + list(m.graph.output):
        v.type.tensor_type.ClearField("shape")
    outs = _outputs(m, x.transpose(1, 0, 2).copy())
    return [o.transpose(2, 0, 1, 3) if o.ndim == 4 else o.transpose(1, 0, 2) for o in outs]


def _ops(model):
    return {n.op_type for n in model.graph.node}


def _assert_unrolled_equals_ort(model, **kw):
    x = _x(model)
    ref = _ort_reference(model, x)
    dec, report = decompose_recurrent(model, **kw)
    assert not _ops(dec) & {"LSTM", "GRU"} and len(report) == 1
    onnx.checker.check_model(dec, full_check=True)
    got = _outputs(dec, x)
    assert [o.name for o in dec.graph.output] == [o.name for o in model.graph.output]
    for name, r, g in zip([o.name for o in model.graph.output], ref, got):
        assert r.shape == g.shape, name
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=name)
    return dec, report


# --- forward equivalence with ONNX Runtime --------------------------------------------------------

DIRS = ["forward", "reverse", "bidirectional"]


@pytest.mark.parametrize("full", [True, False], ids=["B+init+P", "bare"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("direction", DIRS)
def test_lstm_unrolled_equals_ort(direction, layout, full):
    model = rnn_model("LSTM", direction, layout, bias=full, init=full, peep=full)
    dec, report = _assert_unrolled_equals_ort(model)
    assert report[0]["sequence_length"] == SEQ and report[0]["direction"] == direction
    assert _ops(dec) <= {"Split", "Transpose", "MatMul", "Add", "Mul", "Sigmoid", "Tanh", "Concat",
                         "Unsqueeze", "Identity"}


@pytest.mark.parametrize("full", [True, False], ids=["B+init", "bare"])
@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("direction", DIRS)
def test_gru_unrolled_equals_ort(direction, layout, lbr, full):
    model = rnn_model("GRU", direction, layout, lbr, bias=full, init=full)
    dec, _ = _assert_unrolled_equals_ort(model)
    assert _ops(dec) <= {"Split", "Transpose", "MatMul", "Add", "Sub", "Mul", "Sigmoid", "Tanh", "Concat",
                         "Unsqueeze", "Identity"}


@pytest.mark.parametrize("op,outputs", [("LSTM", (1,)), ("LSTM", (2,)), ("LSTM", (0, 2)), ("GRU", (1,))])
def test_only_some_outputs_used(op, outputs):
    _assert_unrolled_equals_ort(rnn_model(op, "bidirectional", 1, lbr=1, outputs=outputs))


def test_opset9_gru_and_sequence_one():
    """Below opset 13 Split/Unsqueeze take attributes; a length-1 sequence needs no Split."""
    _assert_unrolled_equals_ort(rnn_model("GRU", "bidirectional", lbr=1, opset=9))
    _assert_unrolled_equals_ort(rnn_model("LSTM", "reverse", 1, peep=True, seq=1))


def test_activations_spelled_out_and_full_sequence_lens_are_accepted():
    m = rnn_model("LSTM", "bidirectional", activations=["Sigmoid", "Tanh", "Tanh"] * 2)
    _assert_unrolled_equals_ort(m)
    m = rnn_model("GRU", "forward", key="lens")
    m.graph.initializer.append(numpy_helper.from_array(np.full([BATCH], SEQ, np.int32), "lens"))
    m.graph.node[0].input[4] = "lens"  # X, W, R, B, sequence_lens, initial_h
    _assert_unrolled_equals_ort(m)


def test_sequence_length_comes_from_pinned_shapes():
    m = rnn_model("GRU", "reverse", 1, init=False)  # no initial_h: the batch is free
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "T"
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    with pytest.raises(GraphmpError, match=r"GRU node 'gru_0'.*not static.*--shapes"):
        decompose_recurrent(m)
    dec, report = decompose_recurrent(m, shapes=f"X:{BATCH}x7x{IN}")
    assert report[0]["sequence_length"] == 7
    x = _rng("T").standard_normal([3, 7, IN]).astype(np.float32)  # the batch stays free
    for r, g in zip(_ort_reference(m, x), _outputs(dec, x)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_length_behind_a_shape_computation_is_measured():
    """torch writes Reshape(x, Concat(Shape(x)[0], <initializer>)) before its RNNs; onnx data
    propagation stops at the initializer, so the length is measured in one ORT run at the
    pinned shapes."""
    m = rnn_model("LSTM", "bidirectional", init=False)
    inits = [numpy_helper.from_array(np.array([-1, IN], np.int64), "rest"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "ax0")]
    pre = [helper.make_node("Shape", ["x_in"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["t"]),
           helper.make_node("Unsqueeze", ["t", "ax0"], ["t1"]),
           helper.make_node("Concat", ["t1", "rest"], ["shp"], axis=0),
           helper.make_node("Reshape", ["x_in", "shp"], ["X"])]
    rnn = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(pre + rnn)
    m.graph.initializer.extend(inits)
    m.graph.input[0].name = "x_in"
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "T"
    inferred = onnx.shape_inference.infer_shapes(m, data_prop=True)
    assert not any(v.name == "X" and v.type.tensor_type.shape.dim[0].HasField("dim_value")
                   for v in inferred.graph.value_info)  # the precondition: inference leaves it open
    dec, report = decompose_recurrent(m, shapes=f"x_in:7x{BATCH}x{IN}")
    assert report[0]["sequence_length"] == 7
    x = _rng("measured").standard_normal([7, BATCH, IN]).astype(np.float32)
    ref, got = ort_session(m).run(None, {"x_in": x}), ort_session(dec).run(None, {"x_in": x})
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op,attrs,match", [
    ("LSTM", dict(activations=["Sigmoid", "Relu", "Tanh"]), "activations"),
    ("GRU", dict(clip=1.0), "clip"),
    ("LSTM", dict(input_forget=1), "input_forget"),
])
def test_unsupported_settings_are_refused(op, attrs, match):
    with pytest.raises(GraphmpError, match=rf"{op} node '{op.lower()}_0'.*{match}") as e:
        decompose_recurrent(rnn_model(op, **attrs), where="m.onnx")
    assert "\n" not in str(e.value) and str(e.value).startswith("m.onnx: ")


def test_variable_sequence_lens_is_refused():
    m = rnn_model("GRU")
    m.graph.input.append(helper.make_tensor_value_info("lens", TensorProto.INT32, [BATCH]))
    m.graph.node[0].input[4:] = ["lens"]
    with pytest.raises(GraphmpError, match="sequence_lens input 'lens'"):
        decompose_recurrent(m)
    m.graph.input.pop()
    m.graph.initializer.append(numpy_helper.from_array(np.array([SEQ, 2], np.int32), "lens"))
    with pytest.raises(GraphmpError, match="not a constant equal to the full length 5"):
        decompose_recurrent(m)


def test_model_without_recurrence_is_returned_unchanged():
    m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["X"], ["y"])], "g",
                                            [helper.make_tensor_value_info("X", F32, [2])],
                                            [helper.make_tensor_value_info("y", F32, [2])]))
    out, report = decompose_recurrent(m)
    assert out is m and report == []


# --- gradients through the built step graph -------------------------------------------------------

def _float64(model):
    """The same model in float64 (initializers, inputs, outputs), for onnx's reference runtime."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if t.data_type == F32:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for v in list(m.graph.input) + list(m.graph.output):
        if v.type.tensor_type.elem_type == F32:
            v.type.tensor_type.elem_type = TensorProto.DOUBLE
    return m


def _fd_loss(model, x, labels, out):
    """loss(name, value) = mean((out - labels)^2) in float64 on the original model, with the
    tensor `name` (a weight) replaced by `value`."""
    m64 = _float64(model)
    inits = {t.name: numpy_helper.to_array(t) for t in m64.graph.initializer}
    for t in list(m64.graph.initializer):
        m64.graph.input.append(helper.make_tensor_value_info(t.name, TensorProto.DOUBLE, list(t.dims)))
    del m64.graph.initializer[:]
    ref = ReferenceEvaluator(m64)

    def loss(name, value):
        feeds = dict(inits, X=x.astype(np.float64))
        feeds[name] = value
        y = ref.run([out], feeds)[0]
        return float(np.mean((y - labels) ** 2))
    return loss, inits


GRAD_CASES = [  # (op, direction, layout, lbr, full, loss on)
    ("LSTM", "bidirectional", 0, 0, True, "y0"),
    ("LSTM", "reverse", 1, 0, True, "h+c"),
    ("LSTM", "forward", 0, 0, False, "y1"),
    ("GRU", "bidirectional", 1, 1, True, "y0"),
    ("GRU", "forward", 0, 0, True, "y1"),
    ("GRU", "reverse", 0, 1, False, "y0"),
]


@pytest.mark.parametrize("op,direction,layout,lbr,full,out", GRAD_CASES,
                         ids=["-".join(map(str, c)) for c in GRAD_CASES])
def test_step_graph_gradients_match_finite_differences(op, direction, layout, lbr, full, out, tmp_path):
    model = rnn_model(op, direction, layout, lbr, bias=full, init=full, peep=full and op == "LSTM", key="grad")
    if out == "h+c":
        model.graph.node.append(helper.make_node("Add", ["y1", "y2"], ["hc"]))
        model.graph.output.append(helper.make_tensor_value_info("hc", F32, [BATCH, 1, HID]))
        out = "hc"
    path = str(tmp_path / "rnn.onnx")
    onnx.save(model, path)
    run = str(tmp_path / "run")
    meta = build_step(path, run, loss="mse", output=out, precision="fp32", expose_grads=True, loss_scale=1.0,
                      optimizer="sgd", momentum=0.0)
    assert meta["config"]["recurrent"][0]["sequence_length"] == SEQ
    x = _x(model, "gx")
    y = ReferenceEvaluator(_float64(model)).run([out], {"X": x.astype(np.float64)})[0]
    labels = (y + _rng("labels").standard_normal(y.shape)).astype(np.float32)
    loss, inits = _fd_loss(model, x, labels.astype(np.float64), out)
    state, _ = latest_state(run)
    feeds = dict(pack(meta, state), X=x, labels=labels)
    sess = ort_session(onnx.load(os.path.join(run, "step.onnx")))
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    assert abs(float(got["loss"]) - loss("W", inits["W"])) < 1e-5 * max(1.0, abs(float(got["loss"])))
    expected = {"W", "R"} | ({"B", "h0", "P", "c0"} & set(inits) if full else set())
    assert expected <= set(meta["weights"])
    h = 1e-5
    for w in sorted(expected):
        base = inits[w]
        fd = np.zeros(base.size)
        for i in range(base.size):
            plus, minus = base.copy(), base.copy()
            plus.flat[i] += h
            minus.flat[i] -= h
            fd[i] = (loss(w, plus) - loss(w, minus)) / (2 * h)
        assert np.abs(fd).max() > 1e-3, f"the loss does not depend on {w}; the check is vacuous"
        np.testing.assert_allclose(got[meta["grads"][w]].reshape(-1), fd, rtol=1e-4, atol=1e-4 * np.abs(fd).max(),
                                   err_msg=f"d loss / d {w}")


# --- end to end through the CLI -------------------------------------------------------------------

def gru_classifier(seq=6, feat=4, hid=8, classes=3, seq_dim=None):
    """x [N, T, F] -> Transpose -> GRU (linear_before_reset 1) -> Y_h -> Transpose, Flatten -> linear ->
    logits [N, C] (torch's batch_first export; ONNX Runtime's CPU kernels have no layout=1)."""
    r = _rng("clf")
    inits = [numpy_helper.from_array((r.standard_normal(s) * 0.4).astype(np.float32), n) for n, s in
             (("gru.W", [1, 3 * hid, feat]), ("gru.R", [1, 3 * hid, hid]), ("gru.B", [1, 6 * hid]),
              ("fc.W", [hid, classes]), ("fc.b", [classes]))]
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
             helper.make_node("GRU", ["xt", "gru.W", "gru.R", "gru.B"], ["", "h"], name="gru", hidden_size=hid,
                              linear_before_reset=1),
             helper.make_node("Transpose", ["h"], ["ht"], perm=[1, 0, 2]),
             helper.make_node("Flatten", ["ht"], ["hf"], axis=1),
             helper.make_node("MatMul", ["hf", "fc.W"], ["z"]),
             helper.make_node("Add", ["z", "fc.b"], ["logits"])]
    graph = helper.make_graph(nodes, "gru_clf", [helper.make_tensor_value_info("x", F32, ["N", seq_dim or seq, feat])],
                              [helper.make_tensor_value_info("logits", F32, ["N", classes])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def _gru_data(n, seed, seq=6, feat=4, classes=3):
    r = np.random.default_rng(seed)
    labels = r.integers(0, classes, n)
    x = r.standard_normal((n, seq, feat)) * 0.5
    x[np.arange(n), :, labels] += 1.0  # the class is the feature that is high over time
    return {"x": x.astype(np.float32), "labels": labels.astype(np.int64)}


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_gru_classifier_trains_through_the_cli(precision, tmp_path):
    path = str(tmp_path / "gru.onnx")
    onnx.save(gru_classifier(seq_dim="T"), path)
    np.savez(tmp_path / "train.npz", **_gru_data(320, 1))
    np.savez(tmp_path / "eval.npz", **_gru_data(128, 2))
    run = str(tmp_path / "run")
    assert main(["train-graph", path, "-o", run, "--lr", "0.03", "--precision", precision,
                 "--shapes", "x:2x6x4"]) == 0
    meta = load_run(run)
    if precision == "mixed":  # the unrolled GRU really runs in FP16
        assert meta["convert"]["nodes"]["low"] > meta["convert"]["nodes"]["total"] / 2
    rec = meta["config"]["recurrent"]
    assert [(e["node"], e["op"], e["sequence_length"]) for e in rec] == [("gru", "GRU", 6)] and rec[0]["nodes"] > 6
    x = next(v for v in onnx.load(os.path.join(run, "step.onnx")).graph.input if v.name == "x")
    assert [d.dim_value or d.dim_param for d in x.type.tensor_type.shape.dim] == ["N", 6, 4]  # length pinned
    before = evaluate(run, str(tmp_path / "eval.npz"))["loss"]
    assert main(["train", run, "--data", str(tmp_path / "train.npz"), "--batch-size", "16", "--max-steps", "20",
                 "-q"]) == 0
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["steps"] == 20 and summary["skipped_steps"] <= 2
    after = evaluate(run, str(tmp_path / "eval.npz"))
    assert after["loss"] < 0.7 * before, (before, after)
    assert after["accuracy"] > 0.6


def test_train_graph_without_a_static_length_names_the_node(tmp_path, capsys):
    path = str(tmp_path / "gru.onnx")
    onnx.save(gru_classifier(seq_dim="T"), path)
    assert main(["train-graph", path, "-o", str(tmp_path / "run"), "--precision", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "GRU node 'gru'" in err and "--shapes" in err and "Traceback" not in err


# --- the fixed sequence length, said where users look -----------------------------------------------

def test_train_graph_help_says_the_length_is_fixed(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train-graph", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "LSTM/GRU" in text and "unrolled" in text and "--shapes" in text
    assert "accepts only that sequence length" in text


def test_summary_names_the_unrolled_length_and_another_length_is_a_one_line_error(tmp_path, capsys):
    """train-graph prints the unrolled node and length; `graphmp train` on data of another
    length (the data checks pass: the model's T is symbolic) is a one-line error naming the
    data file, the input and the length the step graph was built for -- not a traceback."""
    path = str(tmp_path / "gru.onnx")
    onnx.save(gru_classifier(seq_dim="T"), path)
    run = str(tmp_path / "run")
    assert main(["train-graph", path, "-o", run, "--precision", "fp32", "--shapes", "x:2x6x4"]) == 0
    out = capsys.readouterr().out
    assert "GRU node 'gru' unrolled over sequence length 6 into" in out and "accepts only that length" in out
    np.savez(tmp_path / "long.npz", **_gru_data(32, 3, seq=8))
    assert main(["train", run, "--data", str(tmp_path / "long.npz"), "--batch-size", "8", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "long.npz" in err and "input 'x' has shape [8, 8, 4]" in err, err
    assert "sequence length 6" in err and "--shapes" in err, err
    assert not os.path.exists(os.path.join(run, "checkpoint.json"))  # nothing was trained or saved
    # the right length trains
    np.savez(tmp_path / "ok.npz", **_gru_data(32, 3))
    assert main(["train", run, "--data", str(tmp_path / "ok.npz"), "--batch-size", "8", "-q"]) == 0

"""train-graph proves the graph it writes (issue 23): one step and one inference on a
generated batch of the build's shapes run in ONNX Runtime before the run folder is
written, so a step graph that loads but cannot step fails the build with one line that
names the node and says the graph is graphmp's."""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fixtures import tiny
from graphmp.errors import GraphmpError
from graphmp.train import build_step
from graphmp.train import step as step_mod


@pytest.fixture
def mlp_path(tmp_path):
    p = tmp_path / "mlp.onnx"
    onnx.save(tiny.mlp(), p)
    return str(p)


def _break_the_step(monkeypatch):
    """A rewrite that emits a node ONNX Runtime loads but cannot run: a Reshape of the loss
    to 7 elements, exposed as an extra output of the step graph."""
    original = step_mod._set_outputs

    def broken(f, st, expose_grads):
        original(f, st, expose_grads)
        g = f.model.graph
        g.initializer.append(numpy_helper.from_array(np.array([7], np.int64), "bad_shape"))
        g.node.append(helper.make_node("Reshape", [f.loss_t, "bad_shape"], ["bad"], name="graphmp_bad_reshape"))
        g.output.append(helper.make_tensor_value_info("bad", TensorProto.FLOAT, None))
    monkeypatch.setattr(step_mod, "_set_outputs", broken)


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_a_step_graph_that_loads_but_cannot_step_fails_the_build(mlp_path, tmp_path, monkeypatch, precision):
    _break_the_step(monkeypatch)
    run = tmp_path / "run"
    with pytest.raises(GraphmpError) as e:
        build_step(mlp_path, str(run), precision=precision, loss="cross-entropy")
    msg = str(e.value)
    assert "training step graph graphmp built does not run" in msg and "graphmp_bad_reshape" in msg, msg
    assert "not your data" in msg and "\n" not in msg
    assert not (run / "train.json").exists() and not (run / "step.onnx").exists()


def test_a_sound_build_is_proven_and_written(mlp_path, tmp_path):
    meta = build_step(mlp_path, str(tmp_path / "run"), precision="mixed", loss="cross-entropy")
    assert os.path.exists(tmp_path / "run" / "train.json") and meta["config"]["precision"] == "mixed"


def test_the_cli_says_it_in_one_line(mlp_path, tmp_path, monkeypatch, capsys):
    from graphmp.cli import main
    _break_the_step(monkeypatch)
    rc = main(["train-graph", mlp_path, "-o", str(tmp_path / "run"), "--loss", "cross-entropy"])
    err = capsys.readouterr().err
    assert rc == 2, rc
    assert "graphmp_bad_reshape" in err and "Traceback" not in err


def _save(tmp_path, nodes, inputs, outputs, inits, name):
    g = helper.make_graph(nodes, name, inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    p = tmp_path / f"{name}.onnx"
    onnx.save(m, p)
    return str(p)


def test_a_non_float_first_output_names_the_fix(tmp_path):
    """An encoder whose first output passes its INT64 ids through: the refusal names
    --model-output and the FP32 outputs it could take."""
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    p = _save(tmp_path, [helper.make_node("Identity", ["ids"], ["ids_out"]),
                         helper.make_node("MatMul", ["x", "w"], ["emb"])],
              [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 5]),
               helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
              [helper.make_tensor_value_info("ids_out", TensorProto.INT64, ["n", 5]),
               helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["n", 3])], [w], "enc")
    with pytest.raises(GraphmpError) as e:
        build_step(p, str(tmp_path / "run"), loss="mse")
    assert "output 'ids_out' is INT64, not FP32" in str(e.value) and "--model-output (emb)" in str(e.value)
    build_step(p, str(tmp_path / "run2"), loss="mse", output="emb")   # the fix it names works
    _cli_refuses(p, tmp_path / "run3", "--model-output (emb)")


def _cli_refuses(model, run, fix):
    """`graphmp train-graph MODEL -o RUN --loss mse` as a user runs it: exit 2, one line on
    stderr that names the fix, no traceback, no run written."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-m", "graphmp.cli", "train-graph", str(model), "-o", str(run),
                          "--loss", "mse"], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and fix in lines[0], res.stderr
    assert "Traceback" not in res.stderr and not (run / "train.json").exists()


def test_a_symbolic_class_axis_is_a_warning_that_says_how_to_choose(tmp_path, capsys):
    """cross-entropy on a [1, seq, 2] tagger output: axis 1 is taken, and the build says so."""
    from graphmp.cli import main
    w = numpy_helper.from_array(np.ones((4, 2), np.float32) * 0.1, "w")
    p = _save(tmp_path, [helper.make_node("MatMul", ["x", "w"], ["logits"])],
              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", 4])],
              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "seq", 2])], [w], "tagger")
    meta = build_step(p, str(tmp_path / "run"), loss="cross-entropy", shapes="x:1x6x4")
    assert any("takes axis 1" in w and "--class-axis -1" in w for w in meta["warnings"]), meta["warnings"]
    capsys.readouterr()
    assert main(["train-graph", p, "-o", str(tmp_path / "run2"), "--loss", "cross-entropy", "--shapes", "x:1x6x4"]) == 0
    said = capsys.readouterr()
    assert "takes axis 1" in said.out + said.err
    assert main(["train-graph", p, "-o", str(tmp_path / "run3"), "--loss", "cross-entropy", "--class-axis", "-1",
                 "--shapes", "x:1x6x4"]) == 0
    said = capsys.readouterr()
    assert "class axis" not in said.out + said.err


def _weight_only_int8(tmp_path):
    """x -> MatMul(x, DequantizeLinear(w_int8, scale)) -> Add(bias) -> y."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.integers(-100, 100, (4, 3)).astype(np.int8), "w_q"),
             numpy_helper.from_array(np.array(0.01, np.float32), "w_scale"),
             numpy_helper.from_array(np.zeros(3, np.float32), "bias")]
    return _save(tmp_path, [helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], name="dq"),
                            helper.make_node("MatMul", ["x", "w"], ["h"]),
                            helper.make_node("Add", ["h", "bias"], ["y"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], inits, "int8_wo")


def test_weight_only_int8_is_refused_not_frozen_silently(tmp_path):
    p = _weight_only_int8(tmp_path)
    with pytest.raises(GraphmpError) as e:
        build_step(p, str(tmp_path / "run"), loss="mse")
    msg = str(e.value)
    assert "1 weight(s) are stored as integers behind DequantizeLinear (e.g. 'w_q' -> 'dq')" in msg
    assert "--trainable REGEX" in msg and "\n" not in msg
    assert not (tmp_path / "run" / "train.json").exists()
    _cli_refuses(p, tmp_path / "run_cli", "--trainable REGEX")


def test_weight_only_int8_with_trainable_says_what_stays_frozen(tmp_path):
    meta = build_step(_weight_only_int8(tmp_path), str(tmp_path / "run"), loss="mse", trainable=".")
    assert meta["weights"] == ["bias"], meta["weights"]          # the scale is the quantizer's, not a weight
    assert any("they stay frozen" in w for w in meta["warnings"]), meta["warnings"]


def _streaming(tmp_path):
    """A fully static streaming model: cache [2, 1, 4, 4] and frame mix [1, 5, 2], no batch axis
    anywhere (first axes 2 and 1 differ); y [1, 5, 2] = MatMul(mix, W) + mean(cache)."""
    w = numpy_helper.from_array(np.eye(2, dtype=np.float32), "W")
    return _save(tmp_path, [helper.make_node("MatMul", ["mix", "W"], ["h"]),
                            helper.make_node("ReduceMean", ["cache"], ["m"], keepdims=0),
                            helper.make_node("Add", ["h", "m"], ["y"])],
                 [helper.make_tensor_value_info("cache", TensorProto.FLOAT, [2, 1, 4, 4]),
                  helper.make_tensor_value_info("mix", TensorProto.FLOAT, [1, 5, 2])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5, 2])], [w], "stream")


def test_a_fully_static_streaming_model_takes_whole_inputs_stacked_per_sample(tmp_path):
    from graphmp.cli import main
    p = _streaming(tmp_path)
    run = tmp_path / "run"
    assert main(["train-graph", p, "-o", str(run), "--loss", "mse", "-q"]) == 0
    r = np.random.default_rng(0)
    n = 6
    data = tmp_path / "d.npz"
    mix = r.standard_normal((n, 1, 5, 2)).astype(np.float32)
    np.savez(data, cache=np.zeros((n, 2, 1, 4, 4), np.float32), mix=mix, labels=mix @ np.array([[0, 1], [1, 0]],
                                                                                                  np.float32))
    assert main(["train", str(run), "--data", str(data), "--batch-size", "1", "--max-steps", "5", "-q"]) == 0
    with pytest.raises(GraphmpError, match="data stacks whole inputs, one per sample.*use batch size 1"):
        from graphmp.train import train
        train(str(run), str(data), batch_size=4, max_steps=1, progress=False)
    # a layout that fits neither reading: the error shows both accepted layouts
    bad = tmp_path / "bad.npz"
    np.savez(bad, cache=np.zeros((n, 2, 1, 4), np.float32), mix=mix, labels=mix)
    with pytest.raises(GraphmpError) as e:
        from graphmp.train.data import make_source
        import json
        make_source(str(bad), json.loads((run / "train.json").read_text()))
    assert "accepted: [samples, 1, 4, 4]" in str(e.value) and "[samples, 2, 1, 4, 4] for every input" in str(e.value)
    assert "given once beside stacked inputs" in str(e.value)


def test_a_static_streaming_models_zero_cache_can_be_given_once(tmp_path):
    """The cache at exactly its input's shape [2, 1, 4, 4], beside frames stacked one per
    sample: fed with every step (a zero initial state), as the docs' streaming recipe says."""
    from graphmp.cli import main
    from graphmp.train import train
    run = tmp_path / "run"
    assert main(["train-graph", _streaming(tmp_path), "-o", str(run), "--loss", "mse", "-q"]) == 0
    mix = np.random.default_rng(0).standard_normal((6, 1, 5, 2)).astype(np.float32)
    cache = np.full((2, 1, 4, 4), 0.5, np.float32)
    swap = np.array([[0, 1], [1, 0]], np.float32)
    np.savez(tmp_path / "d.npz", cache=cache, mix=mix, labels=mix @ swap + 0.5)
    res = train(str(run), str(tmp_path / "d.npz"), batch_size=1, epochs=3, progress=False)
    assert res.summary["steps"] == 18                     # six samples a step each, three epochs
    losses = res.history["loss"]
    assert np.mean(losses[-6:]) < np.mean(losses[:6])     # it learns the swap, the cache's 0.5 added


DIGITS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "data", "digits.npz")
MNIST = os.path.join(os.path.dirname(DIGITS), "..", "real", "mnist_cntk.onnx")


def test_the_shipped_digits_teach_the_shipped_mnist_model(tmp_path):
    """The README's training tour on real data: the MNIST classifier trained on the printed
    digits of models/data/digits.npz reads them better than before, and its exported mixed
    model says the same under ONNX Runtime."""
    import onnxruntime as ort
    from graphmp.train import export, train
    d = np.load(DIGITS)
    assert d["train_Input3"].shape == (600, 1, 28, 28) and d["train_Input3"].dtype == np.uint8
    assert set(np.unique(d["train_labels"])) == set(range(10))
    for s in ("train", "eval"):
        np.savez(tmp_path / f"{s}.npz", Input3=d[s + "_Input3"], labels=d[s + "_labels"])

    def accuracy(path):
        sess = ort.InferenceSession(str(path))
        p = [sess.run(None, {"Input3": x[None].astype(np.float32)})[0].argmax() for x in d["eval_Input3"]]
        return float(np.mean(np.array(p) == d["eval_labels"]))
    before = accuracy(MNIST)
    run = str(tmp_path / "run")
    build_step(MNIST, run, loss="cross-entropy", optimizer="adamw", lr=1e-4)
    train(run, str(tmp_path / "train.npz"), epochs=2, batch_size=1, progress=False)
    export(run, str(tmp_path / "out.onnx"), precision="mixed")
    after = accuracy(tmp_path / "out.onnx")
    assert after >= before + 0.1, (before, after)


def test_an_output_declared_with_the_wrong_rank_follows_the_graph(tmp_path):
    """ddddocr's CTC logits are declared [1, seqlen] and computed [T, 1, V]: the build shapes
    labels and loss after what the graph gives, and says so."""
    w = numpy_helper.from_array(np.ones((4, 3), np.float32) * 0.1, "w")
    p = _save(tmp_path, [helper.make_node("MatMul", ["x", "w"], ["y"])],
              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])], [w], "liar")
    meta = build_step(p, str(tmp_path / "run"), loss="mse")
    assert any("is declared ['n'] but the graph gives ['n', 3]" in w for w in meta["warnings"]), meta["warnings"]
    assert meta["label"]["shape"] == ["n", 3]


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_a_value_passed_through_an_if_is_not_trained_silently(tmp_path, precision):
    """openwakeword's classifier returns sigmoid(net(x)) through an If (a second model runs when
    it is high). Its gradient used to stop there unnoticed (every gradient exactly 0, the loss
    flat); now the If, which has no gradient rule, stops the build and names the tensor before it,
    by its name in the user's model (a mixed build once named a weight's FP16 copy, v_fp16,
    which the else branch reads)."""
    w = numpy_helper.from_array(np.full((4, 1), 0.1, np.float32), "w")
    v = numpy_helper.from_array(np.full((2, 1), 0.7, np.float32), "v")
    then_g = helper.make_graph([helper.make_node("Identity", ["p"], ["t_out"])], "then", [],
                               [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Mul", ["v", "p"], ["e_out"])], "else", [],
                               [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, None)])
    th = numpy_helper.from_array(np.array(0.5, np.float32), "th")
    p = _save(tmp_path, [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Sigmoid", ["h"], ["p"]),
                         helper.make_node("ReduceMax", ["p"], ["pm"], keepdims=0),
                         helper.make_node("GreaterOrEqual", ["pm", "th"], ["hi"]),
                         helper.make_node("If", ["hi"], ["y"], name="gate", then_branch=then_g, else_branch=else_g)],
              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1])], [w, v, th], "gated")
    with pytest.raises(GraphmpError) as e:
        build_step(p, str(tmp_path / "run"), loss="mse", precision=precision)
    assert "node 'gate' (op If)" in str(e.value) and "--model-output p)" in str(e.value), str(e.value)
    build_step(p, str(tmp_path / "run2"), loss="mse", precision=precision, output="p")   # the fix it names

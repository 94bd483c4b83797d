"""train-graph on a Resize whose output size is only known at run time (issue 23 round 2).

The Resize gradient is the transpose of a fixed interpolation matrix per resized axis, so it
needs the input's and the output's lengths along those axes when the step is built. A
model with free spatial dims (constant scales on an [N, C, H, W] input), or whose sizes
come from the Shape of another input (torch's F.interpolate(x, size=ref.shape[2:])), is
refused in one line (exit 2) that names the node and --shapes; with --shapes the step graph
is built for those sizes, and `graphmp train` steps it.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphmp.cli import main

N = helper.make_node
F = TensorProto.FLOAT


def _save(path, nodes, inputs, out_dims, inits):
    g = helper.make_graph(nodes, "m", inputs, [helper.make_tensor_value_info("y", F, out_dims)], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return str(path)


def _ints(name, *v):
    return numpy_helper.from_array(np.array(v, np.int64), name)


def _conv_weight():
    return numpy_helper.from_array(np.random.default_rng(0).standard_normal((3, 3, 1, 1)).astype(np.float32), "w")


def free_spatial(tmp_path):
    """x [n, 3, h, w] -> Conv 1x1 -> Resize x2 (constant scales): H and W are free."""
    sc = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "sc")
    return _save(tmp_path / "free.onnx", [N("Conv", ["x", "w"], ["c"]),
                                          N("Resize", ["c", "", "sc"], ["y"], mode="linear", name="up")],
                 [helper.make_tensor_value_info("x", F, ["n", 3, "h", "w"])], ["n", 3, "oh", "ow"],
                 [_conv_weight(), sc]), "up", {"x": [3, 5, 6]}


def size_of_other_input(tmp_path, relu=True):
    """x [n, 3, 4, 4] -> Conv 1x1 -> Resize to sizes = Concat(Shape(c)[:2], Shape(ref)[2:]),
    ref [n, 3, H, W] (interpolate to another tensor's size), then a Relu (or not: the Resize
    gives the model's output, whose measured declaration the gradient needs)."""
    nodes = [N("Conv", ["x", "w"], ["c"]), N("Shape", ["c"], ["s1"]), N("Slice", ["s1", "zero", "two"], ["nc"]),
             N("Shape", ["ref"], ["s2"]), N("Slice", ["s2", "two", "four"], ["hw"]),
             N("Concat", ["nc", "hw"], ["sz"], axis=0),
             N("Resize", ["c", "", "", "sz"], ["r" if relu else "y"], mode="nearest", name="up_like")]
    nodes += [N("Relu", ["r"], ["y"])] if relu else []
    return _save(tmp_path / "like.onnx", nodes,
                 [helper.make_tensor_value_info("x", F, ["n", 3, 4, 4]),
                  helper.make_tensor_value_info("ref", F, ["n", 3, "H", "W"])], ["n", 3, "oh", "ow"],
                 [_conv_weight(), _ints("zero", 0), _ints("two", 2), _ints("four", 4)]), "up_like", \
        {"x": [3, 4, 4], "ref": [3, 8, 7]}


def size_of_other_input_as_output(tmp_path):
    return size_of_other_input(tmp_path, relu=False)


@pytest.mark.parametrize("make", [free_spatial, size_of_other_input, size_of_other_input_as_output])
def test_resize_of_run_time_size_is_refused_then_built_with_shapes(make, tmp_path, capsys):
    src, node, dims = make(tmp_path)
    run = str(tmp_path / "run")
    base = ["train-graph", src, "-o", run, "--loss", "mse", "--precision", "fp32", "--optimizer", "sgd",
            "--lr", "0.01"]
    assert main(base) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert f"node '{node}' (Resize)" in err and "--shapes" in err, err

    shapes = ",".join(f"{k}:2x{'x'.join(map(str, v))}" for k, v in dims.items())
    assert main(base + ["--shapes", shapes]) == 0, capsys.readouterr().err
    rng = np.random.default_rng(1)
    data = {k: rng.standard_normal([4] + v).astype(np.float32) for k, v in dims.items()}
    out = [3] + [2 * d for d in dims["x"][1:]] if node == "up" else dims["ref"]
    data["labels"] = rng.random([4] + out).astype(np.float32)
    np.savez(tmp_path / "d.npz", **data)
    assert main(["train", run, "--data", str(tmp_path / "d.npz"), "--batch-size", "2", "--max-steps", "2",
                 "-q"]) == 0, capsys.readouterr().err


def test_weights_small_beside_the_adamw_lr_get_a_warning_naming_the_lr(tmp_path, capsys):
    """openwakeword's mel front end: a filterbank of RMS ~1e-3 (mostly zeros) under a Log.
    AdamW at lr 1e-3 moves each element by ~its RMS in one step, filters go negative, bins
    die at the Clip floor and the loss jumps 100x. train-graph says so and names the --lr
    (1e-3 of the RMS) that makes the loss fall; a matrix of usual size gets no warning."""
    rng = np.random.default_rng(0)
    mel = np.where(rng.random((16, 4)) < 0.1, rng.random((16, 4)) * 0.01, 0).astype(np.float32)
    rms = float(np.sqrt(np.mean(mel.astype(np.float64) ** 2)))
    nodes = [N("Mul", ["x", "x"], ["p"]), N("MatMul", ["p", "mel"], ["m"]), N("Clip", ["m", "lo"], ["c"]),
             N("Log", ["c"], ["y"])]
    src = _save(tmp_path / "mel.onnx", nodes, [helper.make_tensor_value_info("x", F, ["n", 16])], ["n", 4],
                [numpy_helper.from_array(mel, "mel"), numpy_helper.from_array(np.array(1e-10, np.float32), "lo")])
    base = ["train-graph", src, "-o", str(tmp_path / "run"), "--loss", "mse", "--precision", "fp32", "--force"]
    assert main(base) == 0
    out = capsys.readouterr()
    line = next(ln for ln in (out.out + out.err).splitlines() if "small beside lr" in ln)
    assert "'mel'" in line and f"--lr {1e-3 * rms:.0e}" in line, line
    assert main(base + ["--lr", f"{1e-3 * rms:.0e}"]) == 0
    out = capsys.readouterr()
    assert "small beside lr" not in out.out + out.err


def test_a_vit_style_cubic_resize_of_position_embeddings_builds_and_steps(tmp_path, capsys):
    """The report's ViT: learned position embeddings [1, 3, 4, 4] interpolated (cubic, as
    timm's resample_abs_pos_embed) to the input's 8x8 grid and added to it. The step graph
    train-graph writes must step in ONNX Runtime (train-graph proves it), in FP32 and mixed,
    and the embeddings get trained."""
    import json
    from graphmp.train.loop import latest_state
    sc = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "sc")
    pos = numpy_helper.from_array(np.random.default_rng(1).standard_normal((1, 3, 4, 4)).astype(np.float32), "pos")
    p = _save(tmp_path / "vit.onnx", [N("Resize", ["pos", "", "sc"], ["pe"], mode="cubic", name="resize_pos",
                                        coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75),
                                      N("Add", ["x", "pe"], ["t"]), N("Conv", ["t", "w"], ["y"])],
              [helper.make_tensor_value_info("x", F, ["n", 3, 8, 8])], ["n", 3, 8, 8], [_conv_weight(), sc, pos])
    r = np.random.default_rng(0)
    x = r.standard_normal((8, 3, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, labels=r.standard_normal((8, 3, 8, 8)).astype(np.float32))
    for precision in ("fp32", "mixed"):
        run = tmp_path / precision
        assert main(["train-graph", p, "-o", str(run), "--loss", "mse", "--precision", precision, "-q"]) == 0
        assert "pos" in json.loads((run / "train.json").read_text())["weights"]
        assert main(["train", str(run), "--data", str(tmp_path / "d.npz"), "--batch-size", "2", "--epochs", "2",
                     "-q"]) == 0
        before, after = np.load(run / "state.npz")["pos"], latest_state(str(run))[0]["pos"]
        assert not np.allclose(before, after)
    assert "Traceback" not in capsys.readouterr().err

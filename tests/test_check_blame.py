"""A FAIL of `graphmp check` names where the error comes from (graphmp.attribute) and the
command that fixes it; the command, run as printed, makes the check PASS."""
import shlex

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from graphmp.cli import main
from test_search_give_back import _mlp


def _check(capsys, src, conv, *extra) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["check", str(src), str(conv), *extra])
    return rc, capsys.readouterr().out


def test_fail_names_the_node_where_the_error_grows_and_the_fix_works(tmp_path, capsys):
    src, conv = tmp_path / "cancel.onnx", tmp_path / "cancel.mp.onnx"
    onnx.save(_mlp(700, cancel=True), src)
    # the range rule would keep this FP32; lifted, the cancelling difference fails the yardstick
    assert main(["convert", str(src), "-o", str(conv), "-q", "--range-threshold", "5000"]) == 0
    rc, out = _check(capsys, src, conv)
    assert rc == 1 and "FAIL" in out.splitlines()[0]
    where = next(line for line in out.splitlines() if line.startswith("  where:"))
    assert "Sub 'difference'" in where and "--fp32-nodes '^(difference" in where
    fix = where.split("`")[1]  # the command, as printed
    argv = shlex.split(fix)
    assert argv[:2] == ["graphmp", "convert"] and "--max-error" in argv
    fixed = argv[argv.index("-o") + 1]  # a new file: never the checked model or its source (issue 35)
    assert fixed not in (str(src), str(conv)) and fixed.endswith(".onnx")
    assert main(argv[1:] + ["-q", "--range-threshold", "5000"]) == 0
    rc, out = _check(capsys, src, fixed)
    assert rc == 0 and "PASS" in out.splitlines()[0] and "where:" not in out


def _overflow_model() -> onnx.ModelProto:
    """x -> MatMul 'grow' (x 300) -> Mul 'square' (x*x: ~1e5, past FP16's 65504) -> scale."""
    w = (np.eye(8) * 300).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="grow"),
             helper.make_node("Mul", ["h", "h"], ["s"], name="square"),
             helper.make_node("Mul", ["s", "k"], ["y"], name="scale")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [2, 8])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.float32([1e-5]), "k")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_an_overflow_fails_and_names_the_first_inf(tmp_path, capsys):
    src, conv = tmp_path / "sq.onnx", tmp_path / "sq.mp.onnx"
    onnx.save(_overflow_model(), src)
    np.savez(tmp_path / "x.npz", x=np.full((2, 8), 1.5, np.float32))
    # forced FP16 (the static range rule would have kept it FP32): a model that really breaks
    assert main(["convert", str(src), "-o", str(conv), "-q", "--fp16-nodes", ".*"]) == 0
    rc, out = _check(capsys, src, conv, "--data", str(tmp_path / "x.npz"))
    assert rc == 1 and "NON-FINITE" in out
    where = next(line for line in out.splitlines() if line.startswith("  where:"))
    assert "Mul 'square' (first inf/NaN)" in where
    assert f"--calibration {tmp_path / 'x.npz'}" in where  # the fix measures on the user's data


def test_a_pass_names_nothing(tmp_path, capsys):
    src, conv = tmp_path / "mlp.onnx", tmp_path / "mlp.mp.onnx"
    onnx.save(_mlp(5), src)
    assert main(["convert", str(src), "-o", str(conv), "-q"]) == 0
    rc, out = _check(capsys, src, conv)
    assert rc == 0 and "where:" not in out


def test_several_batches_report_their_spread(tmp_path, capsys):
    src, conv = tmp_path / "mlp.onnx", tmp_path / "mlp.mp.onnx"
    onnx.save(_mlp(5), src)
    assert main(["convert", str(src), "-o", str(conv), "-q"]) == 0
    data = []
    for i in range(3):
        data.append(str(tmp_path / f"x{i}.npz"))
        np.savez(data[-1], x=np.random.default_rng(i).standard_normal((4, 64)).astype(np.float32) * (i + 1))
    from graphmp.check import check
    o = check(str(src), str(conv), data=data).outputs["y"]
    assert len(o["per_batch"]) == 3 and max(o["per_batch"]) == o["error"] and min(o["per_batch"]) < o["error"]
    rc, out = _check(capsys, src, conv, "--data", *data)
    assert rc == 0 and f"(worst of 3 batches, best {min(o['per_batch']):.3g})" in out

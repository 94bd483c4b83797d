"""graphmp.check.check and graphmp.inputs.find_shapes as short lists of named phases
(issue 22, "small units"): the options check() takes are checked at the boundary
(CheckOptions.from_kwargs, as graphmp.context.Options is for convert), and the trial
search of find_shapes goes one phase at a time, in the same order as before.
"""
import ast
import os

import numpy as np
import pytest
from onnx import TensorProto, helper

import graphmp
from graphmp.check import CheckOptions, check
from graphmp import inputs
from graphmp.errors import GraphmpError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(dims, op="Relu"):
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _units(path):
    tree = ast.parse(open(os.path.join(ROOT, "graphmp", path)).read())
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef):
            a = n.args
            params = len(a.posonlyargs + a.args + a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            yield n.name, n.end_lineno - n.lineno + 1, params


@pytest.mark.parametrize("path,name", [("check.py", "check"), ("inputs.py", "find_shapes")])
def test_the_top_functions_are_short(path, name):
    sizes = {n: (lines, params) for n, lines, params in _units(path)}
    lines, params = sizes[name]
    assert lines <= 40 and params <= 6, (name, lines, params)
    assert all(lines <= 60 for n, lines, _ in _units(path) if n.startswith("_") and n != "__init__"), sizes


def test_check_options_are_checked_before_any_work():
    """Bad options fail before the files are even opened (the paths here do not exist)."""
    with pytest.raises(GraphmpError, match="--oracle must be one of emulation, reference, not 'x'"):
        check("no-such.onnx", "no-such.mp.onnx", oracle="x")
    with pytest.raises(GraphmpError, match="--max-error 'bogus' is not a number"):
        check("no-such.onnx", "no-such.mp.onnx", max_error="bogus")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['bogus'\]"):
        check("no-such.onnx", "no-such.mp.onnx", bogus=1)
    o = CheckOptions.from_kwargs({"atol": 0.1, "data_flag": "--calibration"})
    assert (o.atol, o.rtol, o.max_error, o.metric, o.oracle, o.seed, o.data_flag) == \
        (0.1, None, "auto", "max-rel", "emulation", 0, "--calibration")


def test_check_takes_data_by_position_and_options_by_keyword():
    m = _model([1, 8])
    out = graphmp.convert(m, None).model
    x = {"x": np.linspace(-1, 1, 8, dtype=np.float32)[None]}
    rep = check(m, out, [x], max_error=1e-2, metric="max-abs", seed=3).to_dict()
    assert rep["passed"] and rep["inputs"] == "1 batch(es) of user data"
    assert (rep["max_error"], rep["metric"], rep["atol"], rep["rtol"]) == ("0.01", "max-abs", None, None)
    gen = check(m, out, data_flag="--calibration").to_dict()
    assert gen["passed"] and "--calibration with real inputs" in gen["inputs"]


def test_fixed_dims_refuse_two_sizes_for_one_name():
    m = helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])]),
        opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(GraphmpError, match=r"m\.onnx: --shapes gives dim 'n' two sizes \(2 and 3\)"):
        inputs.find_shapes(m, lambda f: None, "a:2x4,b:3x4", where="m.onnx")
    plan = inputs.find_shapes(m, lambda f: None, "a:2x4")  # 'n' fixed by a holds for b too
    assert plan.shapes == {"a": (2, 4), "b": (2, 4)} and plan.how == "given by --shapes"


def _search(want, **kw):
    """find_shapes on x[batch, seq, h] where only `want` (seq, h) runs: (plan, shapes run)."""
    m = _model(["batch", "seq", "h"])
    seen = []

    def run(feeds):
        shape = feeds["x"].shape
        seen.append(shape)
        if shape[1:] != want:
            raise RuntimeError(f"no: {shape}")
    return inputs.find_shapes(m, run, **kw), seen


def test_trial_phases_in_order():
    """The first choice, then one size at a time (cheap roles first: the length before
    the image side), then all sizes together; then batch 2; every assignment once."""
    plan, seen = _search((64, 224))  # the length alone moves: 512 1024 16000 4096 256 128 64
    assert seen == [(1, n, 224) for n in (512, 1024, 16000, 4096, 256, 128, 64)] + [(2, 64, 224)]
    assert plan.shapes["x"] == (1, 64, 224) and plan.batch_free and plan.trials == 8
    assert plan.how == "found by 8 trial runs" and plan.batch_dims == (("x", 0),)
    plan, seen = _search((1024, 256))  # neither alone: both at their second choice together
    assert len(seen) == len(set(seen)) == 1 + 8 + 12 + 1 + 1 and seen[-2:] == [(1, 1024, 256), (2, 1024, 256)]
    assert plan.shapes["x"] == (1, 1024, 256) and plan.trials == 23


def test_no_shapes_error_names_what_was_tried():
    with pytest.raises(GraphmpError, match=r"^m\.onnx: could not find input shapes that run \(3 tried, e\.g\. "
                                           r"\{'x': \(1, 512, 224\)\}; ONNX Runtime said: no: \(1, 512, 224\)\)\. "
                                           r"Give them with --shapes NAME:DIMS,\.\.\. for x\[batch,seq,h\]"):
        _search((7, 7), where="m.onnx", max_trials=3)


def test_cuda_row_that_cannot_load_or_lands_on_the_cpu_is_a_warning(monkeypatch):
    """Where a GPU is listed: a CUDA session that fails to load, or comes up on the CPU,
    leaves no CUDA row and says why; the verdict is the emulation's."""
    import sys
    mod = sys.modules["graphmp.check"]
    m = _model([1, 8])
    out = graphmp.convert(m, None).model
    monkeypatch.setattr(mod, "cuda_available", lambda: True)
    real = mod.runner

    def no_cuda(model, providers=None, **kw):
        if providers:
            raise RuntimeError("CUDA provider failed\nmore")
        return real(model, **kw)
    monkeypatch.setattr(mod, "runner", no_cuda)
    rep = check(m, out).to_dict()
    assert rep["passed"] and list(rep["outputs"]) == ["y"]
    assert rep["warnings"] == ["ORT CUDA could not load the model: CUDA provider failed"]
    monkeypatch.setattr(mod, "runner", lambda model, providers=None, **kw: real(model, **kw))
    rep = check(m, out).to_dict()
    assert rep["passed"] and list(rep["outputs"]) == ["y"]
    assert rep["warnings"] == ["ORT CUDA was asked for but the session runs on CPUExecutionProvider: no CUDA row"]


def test_compare_counts_inf_where_fp32_is_finite_as_an_infinite_difference():
    """Every converted value inf: 'max abs 0' read as a perfect match (nothing else was finite)."""
    from graphmp.check import compare
    ref = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    row = compare(ref, np.full_like(ref, np.inf))
    assert row["nonfinite"] == 4 and row["max_abs"] == float("inf") and not row["passed"]
    assert compare(ref, ref + 0.5)["max_abs"] == 0.5  # finite differences as before


def test_compare_says_where_the_fp32_reference_itself_is_not_finite():
    from graphmp.check import compare
    ref = np.array([[1.0, np.nan], [3.0, np.inf]], np.float32)
    row = compare(ref, ref.copy())
    assert row["ref_nonfinite"] == 2 and row["nonfinite"] == 0 and row["passed"] and row["max_abs"] == 0.0

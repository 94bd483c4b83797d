"""A verdict means what it says (issue 35), through the command line:
- inputs outside a model's domain (the yardsticks alone move an output by more than its
  own spread) are "not judged" and fail (exit 1) unless the user gave data, naming the
  input and the node that make it so; with realistic data the same model passes;
- a class-score output is judged on its decisions too: a conversion that changes more of
  them than TF32 or FP16 inputs do is not PASS, whatever its max-rel;
- hints fit the failure: a budget below the FP16-input floor is named unreachable, a
  suggested command never writes over the checked file or its source, a converted model
  that does not run is answered with the cause, and --validate says what it left on disk."""
import json
import shlex
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from graphmp import verdict
from graphmp.check import check
from graphmp.cli import main

CHECK_MODULE = sys.modules["graphmp.check"]  # graphmp.check is also the package's check() function


def _save(model, path) -> str:
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


def _points_model(name: str = "prompt") -> onnx.ModelProto:
    """A point-prompt encoding: pixel coordinates [1, 64, 2] (0..1024) -> /1024 -> @B ->
    Cos -> @W. Generated N(0,1) coordinates are all within a pixel of the origin: Cos is
    flat there, the output barely varies, and TF32 rounding moves it by more than that.
    The input's name ("prompt") does not say it holds coordinates, so graphmp generates
    N(0,1) for it (a name like "points" gets pixel coordinates: graphmp.input_roles)."""
    rng = np.random.default_rng(0)
    b = (rng.standard_normal((2, 8)) * 2 * np.pi).astype(np.float32)
    w = (rng.standard_normal((8, 1)) / np.sqrt(8)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Div", [name, "size"], ["n"], name="normalize"),
                           helper.make_node("MatMul", ["n", "B"], ["e"], name="project"),
                           helper.make_node("Cos", ["e"], ["c"], name="encode"),
                           helper.make_node("MatMul", ["c", "W"], ["score"], name="head")], "points",
                          [helper.make_tensor_value_info(name, T.FLOAT, [1, 64, 2])],
                          [helper.make_tensor_value_info("score", T.FLOAT, [1, 64, 1])],
                          [numpy_helper.from_array(np.array(1024, np.float32), "size"),
                           numpy_helper.from_array(b, "B"), numpy_helper.from_array(w, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _offset_classifier() -> onnx.ModelProto:
    """logits [64, 10] = x @ W (~0.03) + 1000: class scores that share a large offset. FP16
    stores values near 1000 in steps of 0.5, so a converted Add loses most decisions while
    max-rel (~1e-4 of 1000) stays far within 1e-2."""
    w = (np.random.default_rng(0).standard_normal((16, 10)) * 0.01).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["s"], name="head"),
                           helper.make_node("Add", ["s", "offset"], ["logits"], name="offset")], "cls",
                          [helper.make_tensor_value_info("x", T.FLOAT, [64, 16])],
                          [helper.make_tensor_value_info("logits", T.FLOAT, [64, 10])],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array(1000, np.float32), "offset")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def points(tmp_path):
    src = _save(_points_model(), tmp_path / "points.onnx")
    real = str(tmp_path / "real.npz")
    np.savez(real, prompt=np.random.default_rng(1).uniform(0, 1024, (1, 64, 2)).astype(np.float32))
    out = str(tmp_path / "points.mp.onnx")
    assert main(["convert", src, "-o", out, "-q"]) == 0
    return src, out, real


def _run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    got = capsys.readouterr()
    return rc, got.out, got.err


def test_out_of_domain_inputs_are_not_judged_and_fail(points, tmp_path, capsys):
    src, out, real = points
    rc, text, _ = _run(capsys, "check", src, out, "--json", str(tmp_path / "c.json"))
    assert rc == 1 and "NOT JUDGED" in text.splitlines()[0] and "PASS" not in text, text
    line = next(x for x in text.splitlines() if x.startswith("  score:"))
    assert "not judged: the generated inputs are out of range for this model" in line
    assert "input 'prompt' feeds Cos 'encode'" in line and "pass --data with real inputs" in line
    row = json.load(open(tmp_path / "c.json"))["outputs"]["score"]
    assert row["passed"] is False and row["domain"]["outside"] and row["domain"]["ratio"] > 1
    # the error alone is within the yardstick: before, this was a PASS
    assert row["error"] <= row["allowed"]
    assert "where:" not in text  # no node to blame: the inputs are the problem


def test_out_of_domain_model_passes_with_realistic_data(points, capsys):
    src, out, real = points
    rc, text, _ = _run(capsys, "check", src, out, "--data", real)
    assert rc == 0 and ": PASS (" in text.splitlines()[0] and "not judged" not in text, text


def test_an_input_named_as_coordinates_is_generated_in_pixels_and_judged(tmp_path, capsys):
    """The same model with its input named "points": check generates pixel coordinates for
    it (graphmp.input_roles), says so, and judges the output without --data."""
    src = _save(_points_model("points"), tmp_path / "points.onnx")
    out = str(tmp_path / "points.mp.onnx")
    assert main(["convert", src, "-o", out, "-q"]) == 0
    rc, text, _ = _run(capsys, "check", src, out)
    assert rc == 0 and ": PASS (" in text.splitlines()[0] and "not judged" not in text, text
    assert "points uniform over [0, 1024) (pixel coordinates)" in text


def test_users_data_is_judged_even_where_it_is_out_of_range(points, tmp_path, capsys):
    """The user's data is the domain: it is judged as usual, with a warning that the
    yardsticks move that output by more than its spread."""
    src, out, _ = points
    near_origin = str(tmp_path / "n01.npz")
    np.savez(near_origin, prompt=np.random.default_rng(3).standard_normal((1, 64, 2)).astype(np.float32))
    rc, text, _ = _run(capsys, "check", src, out, "--data", near_origin)
    assert rc == 0 and ": PASS (" in text.splitlines()[0], text
    assert "warning: score: on your data the yardsticks alone move it by more than its own spread" in text


def test_validate_on_out_of_domain_inputs_fails_and_says_what_it_left(points, tmp_path, capsys):
    src, _, real = points
    out = str(tmp_path / "v.onnx")
    rc, _, err = _run(capsys, "convert", src, "-o", out, "-q", "--validate")
    assert rc == 1 and "'score' not judged" in err and "pass --calibration with real inputs" in err, err
    assert f"Left on disk: {out}, as converted" in err and "--max-error makes" not in err
    rc, _, err = _run(capsys, "convert", src, "-o", out, "-q", "--validate", "--calibration", real)
    assert rc == 0, err


def test_a_collapsed_classifier_is_not_pass(tmp_path, capsys):
    src = _save(_offset_classifier(), tmp_path / "cls.onnx")
    out = str(tmp_path / "cls.mp.onnx")
    assert main(["convert", src, "-o", out, "-q"]) == 0
    rc, text, _ = _run(capsys, "check", src, out, "--json", str(tmp_path / "c.json"))
    row = json.load(open(tmp_path / "c.json"))["outputs"]["logits"]
    assert rc == 1 and "FAIL" in text.splitlines()[0], text
    assert row["error"] <= row["allowed"]  # max-rel alone passes it: before, this was a PASS
    dec = row["decisions"]
    assert dec["changed"] / dec["rows"] > dec["allowed_changed"] and dec["yardsticks"]["tf32"] < dec["changed"]
    assert "logits: BAD" in text and "argmax agree" in text and "top-5" in text
    hint = next(x for x in text.splitlines() if "class decisions" in x)
    argv = shlex.split(hint.split("`")[1])
    assert argv[:2] == ["graphmp", "convert"] and "--metric" in argv and argv[argv.index("-o") + 1] not in (src, out)
    assert main(argv[1:] + ["-q"]) == 0  # the printed fix, run as printed, keeps the decisions
    rc, text, _ = _run(capsys, "check", src, argv[argv.index("-o") + 1])
    assert rc == 0 and ": PASS (" in text.splitlines()[0], text


def test_a_budget_below_the_floor_is_named_unreachable(tmp_path, capsys):
    src = _save(_offset_classifier(), tmp_path / "cls.onnx")
    out = str(tmp_path / "cls.mp.onnx")
    assert main(["convert", src, "-o", out, "-q", "--metric", "argmax", "--max-error", "auto"]) == 0
    rep = check(src, out)
    floor = rep.to_dict()["budget"]["floor"]["logits"]
    rc, text, _ = _run(capsys, "check", src, out, "--max-error", f"{floor / 4:.3g}")
    assert rc == 1, text
    hint = next(x for x in text.splitlines() if "is below what rounding only the inputs to FP16" in x)
    assert "no plan that computes this output in FP16 can reach it" in hint and "reachable budgets start near" in hint
    rc, text, _ = _run(capsys, "check", src, out, "--max-error", f"{floor * 1.5:.3g}")
    assert "is below what rounding only the inputs" not in text  # a reachable budget is not called unreachable


def test_suggested_commands_never_write_over_the_checked_files(tmp_path, capsys):
    from graphmp.verdict import fresh_output
    src = _save(_offset_classifier(), tmp_path / "cls.onnx")
    out = str(tmp_path / "cls.mp.onnx")
    assert main(["convert", src, "-o", out, "-q"]) == 0
    (tmp_path / "cls.mp.fixed.onnx").write_bytes(b"")  # an existing file is not overwritten either
    rc, text, _ = _run(capsys, "check", src, out, "--max-error", "1e-9")
    commands = [shlex.split(part) for line in text.splitlines() for part in line.split("`")[1::2]]
    outs = [c[c.index("-o") + 1] for c in commands if c[:2] == ["graphmp", "convert"]]
    assert rc == 1 and outs and all(o not in (src, out, str(tmp_path / "cls.mp.fixed.onnx")) for o in outs), text
    assert fresh_output(src, src) not in (src,) and fresh_output("m.onnx", "m.fixed.onnx") == "m.fixed2.onnx"


def _failing_emulation(model):
    def run(feeds):
        raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while "
                           "running Conv node. Name:'conv_0' Status Message: invalid weights")
    return run


def test_a_converted_model_that_does_not_run_is_answered_with_the_cause(monkeypatch, tmp_path, capsys):
    src = _save(_offset_classifier(), tmp_path / "cls.onnx")
    out = str(tmp_path / "cls.mp.onnx")
    assert main(["convert", src, "-o", out, "-q"]) == 0
    monkeypatch.setattr(CHECK_MODULE, "emulated_runner", _failing_emulation)
    rc, text, err = _run(capsys, "check", src, out)
    assert rc == 1 and "FAIL" in text.splitlines()[0] and "DOES NOT RUN" in text and "Name:'conv_0'" in text, text
    hint = next(x for x in text.splitlines() if x.startswith("  hint:"))
    advice = hint.replace("(no --max-error or --calibration changes it)", "")
    assert "the converted model does not run" in hint and "--fp32-nodes '^conv_0$'" in hint
    assert "--max-error" not in advice and "--calibration" not in advice and "where:" not in text


def test_validate_answers_a_crash_with_its_cause_and_names_what_it_left(monkeypatch, tmp_path, capsys):
    src = _save(_offset_classifier(), tmp_path / "cls.onnx")
    out, report = str(tmp_path / "v.onnx"), str(tmp_path / "r.json")
    monkeypatch.setattr(CHECK_MODULE, "emulated_runner", _failing_emulation)
    rc, _, err = _run(capsys, "convert", src, "-o", out, "-q", "--validate", "--report", report)
    assert rc == 1 and "the converted model does not run" in err and "invalid weights" in err, err
    assert "--max-error makes" not in err and f"Left on disk: {out}, as converted (and --report {report})" in err


def test_validate_of_an_invalid_model_gives_no_accuracy_advice(monkeypatch, tmp_path, capsys):
    """ONNX Runtime crashing on the converted model (validity: 'crashed (SIGSEGV)') is not
    an accuracy problem: --validate names the crash, not --max-error/--calibration."""
    src = _save(_offset_classifier(), tmp_path / "cls.onnx")
    out = str(tmp_path / "v.onnx")
    crashed = "ONNX Runtime 1.0 crashed (SIGSEGV) creating a CPU session with its default options"
    monkeypatch.setattr(CHECK_MODULE, "validity", lambda converted, reference=None: {
        "valid": False, "checker": "ok", "ort": crashed, "note": None})
    rc, _, err = _run(capsys, "convert", src, "-o", out, "-q", "--validate")
    assert rc == 1 and crashed in err and "not an accuracy problem" in err and "--max-error makes" not in err, err
    assert f"Left on disk: {out}" in err


def test_validate_that_cannot_run_its_check_says_why_and_what_it_left(monkeypatch, tmp_path, capsys):
    """A check that cannot run under --validate (here its budget measurement fails) was an
    error that left the written model on disk without a word; it is now a failed
    validation that gives the reason and names the file."""
    from graphmp.errors import GraphmpError
    src = _save(_offset_classifier(), tmp_path / "cls.onnx")
    out = str(tmp_path / "v.onnx")

    def refuse(*args, **kwargs):
        raise GraphmpError("cls.onnx: ONNX Runtime cannot run the FP32 reference to measure the error budget (boom)")
    monkeypatch.setattr(CHECK_MODULE, "_budget", refuse)
    rc, _, err = _run(capsys, "convert", src, "-o", out, "-q", "--validate")
    assert rc == 1 and "the check did not run" in err and "(boom)" in err and f"Left on disk: {out}" in err, err
    assert "--max-error makes" not in err


def test_decision_allowance_follows_the_yardsticks_count():
    """The allowance is K x the one-sided 95% Poisson bound of what a yardstick changes:
    the rule of three at 0, textbook values above, and a collapse fails once n >= 7."""
    assert verdict.poisson_upper(0) == pytest.approx(-np.log(0.05), rel=1e-3)
    assert verdict.poisson_upper(1) == pytest.approx(4.744, rel=1e-3)
    assert verdict.poisson_upper(10) == pytest.approx(16.96, rel=1e-3)

    class B:
        spec, runs = "auto", {"tf32": []}
    ref = np.eye(8, dtype=np.float32)
    collapsed = np.roll(ref, 1, axis=1)
    B.runs = {"tf32": [{"y": ref}]}
    d = verdict.decisions("y", [{"y": ref}], [{"y": collapsed}], B)
    assert d["changed"] == 8 and verdict.decisions_fail(d)
    d = verdict.decisions("y", [{"y": ref}], [{"y": ref}], B)
    assert d["changed"] == 0 and not verdict.decisions_fail(d)


def test_quantizer_inputs_are_named_from_the_graph(tmp_path):
    """An input that reaches a DynamicQuantizeLinear (onnxruntime.quantization's dynamic
    INT8 MatMul) is named with that node; ids with the table whose rows they pick."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    w = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
                           helper.make_node("Add", ["e", "hidden"], ["h"]),
                           helper.make_node("MatMul", ["h", "W"], ["y"], name="proj")], "q",
                          [helper.make_tensor_value_info("hidden", T.FLOAT, [1, 4, 16]),
                           helper.make_tensor_value_info("ids", T.INT64, [1, 4])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [1, 4, 16])],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w, "table")])
    src = _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "f.onnx")
    quantize_dynamic(src, str(tmp_path / "q.onnx"), weight_type=QuantType.QInt8)
    found = verdict._sensitive_consumers(onnx.load(str(tmp_path / "q.onnx")))
    assert found["hidden"].startswith("DynamicQuantizeLinear") and "scale comes from the data's range" in found["hidden"]
    assert found["ids"].startswith("picks rows of 'table") and found["ids"].endswith("(Gather 'embed')")


def test_the_input_whose_rounding_alone_does_it_is_the_one_named(tmp_path, capsys):
    """Two inputs: rounding 't' to FP16 alone scrambles Sin(20000 t) (FP16's step at 1 is
    ~1e-3, 20 rad after the scale), rounding 'x' moves little. Only 't' is named, with
    the Sin it feeds, and the output is not judged."""
    w = (np.random.default_rng(0).standard_normal((8, 64)) * 0.01).astype(np.float32)
    g = helper.make_graph([helper.make_node("Mul", ["t", "freq"], ["phase"], name="scale"),
                           helper.make_node("Sin", ["phase"], ["wave"], name="wave"),
                           helper.make_node("MatMul", ["x", "W"], ["xw"], name="proj"),
                           helper.make_node("Add", ["wave", "xw"], ["y"], name="mix")], "two",
                          [helper.make_tensor_value_info("t", T.FLOAT, [1, 64]),
                           helper.make_tensor_value_info("x", T.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [1, 64])],
                          [numpy_helper.from_array(np.array(20000, np.float32), "freq"),
                           numpy_helper.from_array(w, "W")])
    src = _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "two.onnx")
    out = str(tmp_path / "two.mp.onnx")
    assert main(["convert", src, "-o", out, "-q"]) == 0
    rc, text, _ = _run(capsys, "check", src, out)
    line = next(x for x in text.splitlines() if x.startswith("  y:"))
    assert rc == 1 and "not judged" in line and "input 't' feeds Sin 'wave'" in line and "input 'x'" not in line, text

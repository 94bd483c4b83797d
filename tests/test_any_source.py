"""Any source: a model that is already FP16 / BF16, mixed FP16/FP32, INT8 with Q/DQ, or
dynamically quantized INT8 (DynamicQuantizeLinear + MatMulInteger, com.microsoft
DynamicQuantizeLSTM, onnxruntime.quantization.quantize_dynamic output) goes through
`graphmp convert` (plain, --max-error tf32, --max-error 1e-2, --validate), `graphmp check`
and `graphmp bench` with real ONNX Runtime: never a traceback; exit 0, or 2 with exactly
one `graphmp: error:` line; convert says when nothing was converted and why; bench runs
the source as it is and labels its rows for what they run, with the detected source
precision in the JSON and accuracy judged only where it means something."""
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as H
from onnx import numpy_helper as nh

from graphmp.bench import source_precision
from graphmp.bench.plan import LABELS
from graphmp.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["--backends", "ort-cpu", "--warmup", "1", "--iterations", "2", "--min-time", "0", "--rounds", "1", "-q"]
NOTHING = "converted: nothing to convert, same as source"


# --- the models ----------------------------------------------------------------------------------

def _model(nodes, inits, x_type, y_type, opsets=(("", 17),)):
    g = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", x_type, ["N", 16])],
                     [H.make_tensor_value_info("y", y_type, ["N", 8])], inits)
    m = H.make_model(g, opset_imports=[H.make_opsetid(d, v) for d, v in opsets])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _weights(dtype):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((16, 8)) * 0.3).astype(dtype)


def _mlp(dtype, elem):
    """MatMul + Add + Relu + Softmax, every tensor of type `elem`."""
    nodes = [H.make_node("MatMul", ["x", "w"], ["h"]), H.make_node("Add", ["h", "b"], ["h2"]),
             H.make_node("Relu", ["h2"], ["r"]), H.make_node("Softmax", ["r"], ["y"], axis=-1)]
    return _model(nodes, [nh.from_array(_weights(dtype), "w"), nh.from_array(np.full(8, 0.1, dtype), "b")],
                  elem, elem)


def _mixed():
    """FP32 in and out, MatMul + Relu in FP16 between Casts, Softmax in FP32."""
    nodes = [H.make_node("Cast", ["x"], ["x16"], to=T.FLOAT16), H.make_node("MatMul", ["x16", "w"], ["h"]),
             H.make_node("Relu", ["h"], ["r"]), H.make_node("Cast", ["r"], ["r32"], to=T.FLOAT),
             H.make_node("Softmax", ["r32"], ["y"], axis=-1)]
    return _model(nodes, [nh.from_array(_weights(np.float16), "w")], T.FLOAT, T.FLOAT)


def _qdq():
    """Q/DQ on the activation, DQ on INT8 weights, FP32 MatMul + Relu + Softmax."""
    rng = np.random.default_rng(1)
    inits = [nh.from_array(rng.integers(-100, 100, (16, 8)).astype(np.int8), "wq"),
             nh.from_array(np.array(0.01, np.float32), "ws"), nh.from_array(np.array(0, np.int8), "wz"),
             nh.from_array(np.array(0.02, np.float32), "xs"), nh.from_array(np.array(0, np.int8), "xz")]
    nodes = [H.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             H.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             H.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"]), H.make_node("MatMul", ["xd", "wd"], ["h"]),
             H.make_node("Relu", ["h"], ["r"]), H.make_node("Softmax", ["r"], ["y"], axis=-1)]
    return _model(nodes, inits, T.FLOAT, T.FLOAT)


def _dynamic():
    """DynamicQuantizeLinear + MatMulInteger + Cast + Mul (the scales), then Relu + Softmax."""
    rng = np.random.default_rng(2)
    inits = [nh.from_array(rng.integers(0, 255, (16, 8)).astype(np.uint8), "wq"),
             nh.from_array(np.array(128, np.uint8), "wz"), nh.from_array(np.array(0.01, np.float32), "ws")]
    nodes = [H.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             H.make_node("MatMulInteger", ["xq", "wq", "xz", "wz"], ["hi"]),
             H.make_node("Cast", ["hi"], ["hf"], to=T.FLOAT), H.make_node("Mul", ["xs", "ws"], ["s"]),
             H.make_node("Mul", ["hf", "s"], ["h"]), H.make_node("Relu", ["h"], ["r"]),
             H.make_node("Softmax", ["r"], ["y"], axis=-1)]
    return _model(nodes, inits, T.FLOAT, T.FLOAT)


def _quantize_dynamic(src, dst, op_types=None):
    """onnxruntime.quantization.quantize_dynamic, the tool users quantize with."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(src, dst, weight_type=QuantType.QInt8, op_types_to_quantize=op_types)
    return dst


def _lstm(path):
    """An FP32 LSTM + Softmax: quantize_dynamic turns the LSTM into com.microsoft DynamicQuantizeLSTM."""
    rng = np.random.default_rng(3)
    hid = 8
    inits = [nh.from_array((rng.standard_normal((1, 4 * hid, 16)) * 0.2).astype(np.float32), "W"),
             nh.from_array((rng.standard_normal((1, 4 * hid, hid)) * 0.2).astype(np.float32), "R"),
             nh.from_array(np.zeros((1, 8 * hid), np.float32), "B"), nh.from_array(np.array([0], np.int64), "ax")]
    nodes = [H.make_node("Unsqueeze", ["x", "ax"], ["seq"]),
             H.make_node("LSTM", ["seq", "W", "R", "B"], ["Y", "Yh"], hidden_size=hid),
             H.make_node("Squeeze", ["Yh", "ax"], ["h"]), H.make_node("Softmax", ["h"], ["y"], axis=-1)]
    onnx.save(_model(nodes, inits, T.FLOAT, T.FLOAT), path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("any_source")
    out = {}
    for name, m in (("fp32", _mlp(np.float32, T.FLOAT)), ("fp16", _mlp(np.float16, T.FLOAT16)),
                    ("mixed", _mixed()), ("qdq", _qdq()), ("dynamic", _dynamic())):
        out[name] = str(d / f"{name}.onnx")
        onnx.save(m, out[name])
    out["ort-dynamic"] = _quantize_dynamic(out["fp32"], str(d / "ort_dynamic.onnx"), ["MatMul"])
    out["lstm-dynamic"] = _quantize_dynamic(_lstm(str(d / "lstm.onnx")), str(d / "lstm_dynamic.onnx"), ["LSTM"])
    return out


SOURCES = {"fp16": "fp16", "mixed": "mixed fp16/fp32", "qdq": "int8 qdq", "dynamic": "int8 dynamic",
           "ort-dynamic": "int8 dynamic", "lstm-dynamic": "int8 dynamic"}


def _run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if rc == 2:  # a user error: exactly one error line, graphmp's, after the progress log (if any)
        lines = [x for x in err.splitlines() if x.strip() and not x.startswith("[graphmp ")]
        assert len(lines) == 1 and lines[0].startswith("graphmp: error: "), err
    return rc, out, err


def _bench(path, tmp_path, capsys, *extra):
    js = tmp_path / (os.path.basename(path) + ".bench.json")
    rc, out, err = _run(["bench", path, *QUICK, "--json", str(js), *extra], capsys)
    assert rc == 0, err
    return json.loads(js.read_text()), out


# --- what the source is --------------------------------------------------------------------------

def test_source_precision_is_detected(models):
    got = {k: source_precision(onnx.load(p)) for k, p in models.items()}
    assert {k: v["precision"] for k, v in got.items() if k in SOURCES} == SOURCES
    assert got["fp32"]["precision"] == "fp32" and got["fp32"]["quantization"] is None
    assert got["mixed"]["float_nodes"] == {"fp16": 2, "fp32": 1}
    assert got["qdq"]["quant_ops"] == {"QuantizeLinear": 1, "DequantizeLinear": 2}
    assert got["dynamic"]["quant_ops"] == {"DynamicQuantizeLinear": 1, "MatMulInteger": 1}
    assert got["lstm-dynamic"]["quant_ops"] == {"DynamicQuantizeLSTM": 1}


# --- convert --------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [[], ["--max-error", "tf32"], ["--max-error", "1e-2"], ["--validate"]],
                         ids=["plain", "tf32", "1e-2", "validate"])
@pytest.mark.parametrize("name", list(SOURCES))
def test_convert_any_source_says_what_it_did(models, name, flags, tmp_path, capsys):
    out = tmp_path / "out.onnx"
    rc, text, err = _run(["convert", models[name], "-o", str(out), *flags], capsys)
    if name == "fp16":  # no FP32 work at all: refused in one line that says so and why
        if rc == 2:
            assert "nothing to convert" in err and "no FP32 tensors" in err and not out.exists()
            return
        assert rc == 0 and "nothing" in text
        return
    assert rc == 0, err
    assert out.exists()
    onnx.checker.check_model(str(out), full_check=True)
    # every float node of these sources must stay FP32 (Q/DQ, integer-derived, an FP16 island): said, with why
    warning = next(x for x in text.splitlines() if "warning: nothing was converted" in x)
    assert "stay FP32 (" in warning and "computes as the source does" in warning
    if flags == ["--validate"]:
        assert "validation:" in text and "PASS" in text


def test_convert_in_a_subprocess_never_prints_a_traceback(models, tmp_path):
    for name in ("fp16", "dynamic"):
        r = subprocess.run([sys.executable, "-m", "graphmp.cli", "convert", models[name], "-o",
                            str(tmp_path / f"{name}.out.onnx"), "--max-error", "tf32", "-q"],
                           capture_output=True, text=True, cwd=ROOT)
        assert "Traceback" not in r.stderr and r.returncode in (0, 2), r.stderr
        if r.returncode == 2:
            assert r.stderr.count("graphmp: error:") == 1 and len(r.stderr.strip().splitlines()) == 1


# --- check ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SOURCES))
def test_check_gives_a_verdict_on_any_source(models, name, capsys):
    rc, out, _ = _run(["check", models[name], models[name]], capsys)
    assert rc == 0 and out.splitlines()[0].endswith("per output)") and ": PASS (" in out.splitlines()[0]
    assert "y: ok" in out


def test_check_fp32_against_its_dynamic_int8_model_is_a_verdict(models, capsys):
    rc, out, _ = _run(["check", models["fp32"], models["ort-dynamic"]], capsys)
    assert rc in (0, 1) and (": PASS (" in out or ": FAIL (" in out)
    assert "y: " in out and "max-rel" in out


# --- bench ----------------------------------------------------------------------------------------

def _rows(d):
    return {r["precision"]: r for r in d["rows"]}


def test_bench_fp16_source_runs_it_as_it_is_against_fp32_compute(models, tmp_path, capsys):
    d, table = _bench(models["fp16"], tmp_path, capsys)
    assert d["model"]["source_precision"]["precision"] == "fp16"
    rows = _rows(d)
    assert set(rows) == {"fp32", "fp16"} and all(r["status"] == "ok" for r in rows.values())
    src, fp32 = rows["fp16"], rows["fp32"]
    assert src["label"] == "source (fp16)" and src["model"] == NOTHING
    assert fp32["label"] == "FP32 strict: the fp16 source computed in FP32" and "raised to FP32" in fp32["model"]
    # the reference is the source computed in FP32: the source's own FP16 error is judged, and small
    assert "computed in FP32" in d["accuracy"]["reference"]
    assert src["accuracy"]["passed"] and 0 <= src["accuracy"]["error"] < 1e-2
    # the FP32 row is the reference itself on the reference's backend: not judged, and says so
    assert fp32["accuracy"] is None and "reference model itself" in fp32["accuracy_note"]
    assert d["model"]["converted_path"] is None
    assert "nothing to convert" in d["model"]["conversion"]["nothing_converted"]
    # ORT CPU hides FP16 rounding; the FP16-faithful oracle compares the source with FP32 compute and sees it
    assert [(o["precision"], o["status"], o["passed"]) for o in d["oracle"]] == [("fp16", "ok", True)]
    assert 0 < d["oracle"][0]["max_rel"] < 1e-2
    assert "fp16 rows: source (fp16) (" + NOTHING + ")" in table and "source precision: fp16" in table


@pytest.mark.parametrize("name", ["dynamic", "ort-dynamic", "lstm-dynamic", "qdq"])
def test_bench_int8_source_rows_are_the_int8_model(models, name, tmp_path, capsys):
    d, table = _bench(models[name], tmp_path, capsys)
    prec = SOURCES[name]
    assert d["model"]["source_precision"]["precision"] == prec
    rows = _rows(d)
    assert set(rows) == {"fp32", "fp16"} and all(r["status"] == "ok" for r in rows.values())
    # no "fp16" row that is really the INT8 model under the graphmp label
    assert rows["fp16"]["label"] == f"source ({prec})" and rows["fp16"]["model"] == NOTHING
    assert rows["fp16"]["label"] != LABELS["fp16"]
    assert rows["fp32"]["label"] == f"source ({prec}), float ops FP32 strict"
    # the reference is the INT8 source: its own row is not judged, the cleaned-up baseline matches it
    assert f"the {prec} source as it is" in d["accuracy"]["reference"]
    assert rows["fp16"]["accuracy"] is None and rows["fp16"]["accuracy_note"]
    assert rows["fp32"]["accuracy"]["passed"] and rows["fp32"]["accuracy"]["error"] < 1e-6
    assert d["oracle"][0]["status"] == "skipped" and "nothing was converted" in d["oracle"][0]["reason"]
    assert d["model"]["conversion"]["nothing_converted"].startswith("nothing was converted")
    assert any(n.startswith(f"the source is {prec}") for n in d["notes"])
    assert f"fp16 rows: source ({prec})" in table


def test_bench_mixed_source_is_judged_against_its_fp32_compute(models, tmp_path, capsys):
    d, _ = _bench(models["mixed"], tmp_path, capsys)
    rows = _rows(d)
    assert d["model"]["source_precision"]["precision"] == "mixed fp16/fp32"
    assert rows["fp16"]["label"] == "source (mixed fp16/fp32)" and rows["fp16"]["model"] == NOTHING
    # the FP16 MatMul of the source costs a small, non-zero error against FP32 compute
    assert rows["fp16"]["accuracy"]["passed"] and 0 < rows["fp16"]["accuracy"]["error"] < 1e-2


def test_bench_fp32_source_keeps_its_labels(models, tmp_path, capsys):
    d, table = _bench(models["fp32"], tmp_path, capsys, "--oracle-max-mb", "0")
    rows = _rows(d)
    assert d["model"]["source_precision"]["precision"] == "fp32"
    assert {p: (r["label"], r["model"]) for p, r in rows.items()} == {
        "fp32": (LABELS["fp32"], "fp32 source"), "fp16": (LABELS["fp16"], "graphmp")}
    assert all(r["accuracy"] is not None for r in rows.values())
    assert not any(x.startswith(("  fp32 rows:", "  fp16 rows:", "  source precision:")) for x in table.splitlines())


def test_bench_model_with_no_float_runs_as_it_is(tmp_path, capsys):
    vi = [H.make_tensor_value_info(n, T.INT64, ["N", 3]) for n in "abc"]
    g = H.make_graph([H.make_node("Add", ["a", "b"], ["c"])], "g", vi[:2], vi[2:])
    p = str(tmp_path / "int.onnx")
    onnx.save(H.make_model(g, opset_imports=[H.make_opsetid("", 17)]), p)
    d, _ = _bench(p, tmp_path, capsys)
    rows = _rows(d)
    assert d["model"]["source_precision"]["precision"] == "no float"
    assert rows["fp32"]["label"] == "source (no float)"
    assert rows["fp32"]["model"].startswith("the source")  # as it is, or through graphmp's cleanups
    assert rows["fp16"]["model"] == NOTHING and all(r["status"] == "ok" for r in rows.values())


def test_bench_bf16_inputs_are_one_line_before_any_work(tmp_path, capsys):
    w = H.make_tensor("w", T.BFLOAT16, [16, 8], _weights(np.float32).ravel().tolist())
    m = _model([H.make_node("MatMul", ["x", "w"], ["h"]), H.make_node("Softmax", ["h"], ["y"], axis=-1)], [w],
               T.BFLOAT16, T.BFLOAT16)
    p = str(tmp_path / "bf16.onnx")
    onnx.save(m, p)
    assert source_precision(m)["precision"] == "bf16"
    rc, _, err = _run(["bench", p, *QUICK], capsys)
    assert rc == 2 and "'x' is BF16" in err and "--target bf16" in err


def test_convert_counts_the_sources_own_fp16_nodes():
    """A mixed source's FP16 nodes are counted as such, not as 'non-float'."""
    import graphmp
    w = onnx.numpy_helper.from_array(np.ones((4, 4), np.float16), "W")
    w2 = onnx.numpy_helper.from_array(np.ones((4, 4), np.float32), "W2")
    g = H.make_graph([H.make_node("MatMul", ["x", "W"], ["a"], name="mm16"),
                      H.make_node("Cast", ["a"], ["b"], to=T.FLOAT, name="up"),
                      H.make_node("MatMul", ["b", "W2"], ["y"], name="mm32")], "g",
                     [H.make_tensor_value_info("x", T.FLOAT16, [1, 4])], [H.make_tensor_value_info("y", T.FLOAT, [1, 4])],
                     [w, w2])
    rep = graphmp.convert(H.make_model(g, opset_imports=[H.make_opsetid("", 17)]), None)
    assert rep["nodes"]["source_low"] == 1 and rep["nodes"]["total"] == 3
    assert "(1 already FP16/BF16 in the source)" in rep.summary()

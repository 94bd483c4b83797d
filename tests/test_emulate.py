"""graphmp.emulate: FP16 storage / FP32 math on ONNX Runtime, held against the
FP16-faithful reference evaluator (onnx.reference) and against plain numpy."""
import os
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nph

import graphmp
from graphmp.emulate import emulated_runner, emulation_model
from graphmp.inputs import find_shapes
from graphmp.model_runs import run_reference, runner

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def _mixed_elementwise():
    """x (FP32) -> Cast FP16 -> Mul 300 (FP16) -> Cast FP32 -> Mul 300 -> y."""
    g = oh.make_graph([oh.make_node("Cast", ["x"], ["x16"], to=TP.FLOAT16),
                       oh.make_node("Mul", ["x16", "k16"], ["a16"]),
                       oh.make_node("Cast", ["a16"], ["a"], to=TP.FLOAT),
                       oh.make_node("Mul", ["a", "k"], ["y"])], "g",
                      [oh.make_tensor_value_info("x", TP.FLOAT, [5])], [oh.make_tensor_value_info("y", TP.FLOAT, [5])],
                      [nph.from_array(np.array(300, np.float16), "k16"), nph.from_array(np.array(300, np.float32), "k")])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_rounding_overflow_and_underflow_exactly_as_fp16():
    m = _mixed_elementwise()
    x = np.array([1.0001, 2.3456789, 300.0, 1e-9, -7.77], np.float32)
    emu = emulation_model(m)
    assert all(t.data_type == TP.FLOAT for t in emu.graph.initializer)
    onnx.checker.check_model(emu, full_check=True)
    got = runner(emu)({"x": x})["y"]
    with np.errstate(over="ignore"):
        want = ((x.astype(np.float16) * np.float16(300)).astype(np.float32)) * 300
    np.testing.assert_array_equal(got, want)             # rounding as FP16 does it
    assert np.isinf(got[2]) and got[3] == 0               # overflow to inf, underflow to 0
    np.testing.assert_array_equal(got, run_reference(m, {"x": x})["y"])


def test_overflow_seen_where_ort_cpu_hides_it():
    """Case 05 forced to FP16: ORT CPU runs the FP16 ops in FP32 and shows no inf; the
    emulation shows the same inf as the reference evaluator."""
    import cases
    src = cases.case_05_naive_fp16()
    feeds = cases.default_feeds(src)
    conv = graphmp.convert(src, None, fp16_nodes=".*", calibration="off").model
    ort_cpu = runner(conv)(feeds)
    emu = emulated_runner(conv)(feeds)
    ref = run_reference(conv, feeds)
    for k in ref:
        assert np.isfinite(ort_cpu[k]).all()
        assert (~np.isfinite(emu[k])).sum() == (~np.isfinite(ref[k].astype(np.float32))).sum() > 0


@pytest.mark.parametrize("name, shapes", [("mnist_cntk", None), ("ppocrv4_det", "x:1x3x64x96"),
                                          ("silero_vad", None), ("fastestdet", None)])
def test_error_agrees_with_the_reference_evaluator(name, shapes):
    """Both are FP16-faithful: FP32 math rounded once here, float64 math rounded once by
    the ideal-kernel reference; their error against FP32 is the same order: within 3x."""
    path = os.path.join(ROOT, "models", "real", name + ".onnx")
    src = onnx.load(path)
    run32 = runner(path)
    feeds = find_shapes(src, run32, shapes).feeds()
    conv = graphmp.convert(path, None, shapes=shapes).model
    ref, emu, orc = run32(feeds), emulated_runner(conv)(feeds), run_reference(conv, feeds)
    for k, v in ref.items():
        scale = float(np.abs(v).max())
        e_emu = float(np.abs(emu[k] - v).max()) / scale
        e_orc = float(np.abs(orc[k].astype(np.float32) - v).max()) / scale
        assert 0 < e_emu < 0.1 and e_orc / 3 <= e_emu <= 3 * e_orc, (k, e_emu, e_orc)


def test_control_flow_bodies_are_emulated():
    import control_flow_cases as cf
    for name, build in cf.CASES.items():
        m, feeds = build()
        conv = graphmp.convert(m, None, calibration=[feeds]).model
        emu_model = emulation_model(conv)
        onnx.checker.check_model(emu_model, full_check=True)
        got, orc = runner(emu_model)(feeds), run_reference(conv, feeds)
        for k in orc:
            assert np.abs(got[k] - orc[k].astype(np.float32)).max() <= 2e-3, (name, k)


def test_bf16_weights_in_int32_data_keep_their_values():
    """onnx.helper.make_tensor stores BF16 values in int32_data, not raw_data: the emulation
    read them as zeros (a false NON-FINITE FAIL in check)."""
    from onnx import TensorProto, helper, numpy_helper
    from graphmp.emulate import emulation_model
    w = helper.make_tensor("w", TensorProto.BFLOAT16, [2, 2], [1.0, 2.0, -3.0, 0.5])
    assert not w.raw_data and list(w.int32_data)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], [w])
    emu = emulation_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    got = {t.name: numpy_helper.to_array(t) for t in emu.graph.initializer}["w"]
    assert got.dtype == np.float32 and got.ravel().tolist() == [1.0, 2.0, -3.0, 0.5]

"""The convert report's cast traffic (graphmp/cast_cost.py, issue 26): the bytes the
Casts move per inference at the calibration shapes, split boundary/inside, the top
Casts, and the share of Conv/MatMul FLOPs that runs in FP16."""
import json
import os
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nph

import graphmp
from graphmp.cast_cost import cast_traffic
from graphmp.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PPOCR = os.path.join(ROOT, "models", "real", "ppocrv4_det.onnx")


def conv_softmax_conv(batch="1"):
    """x [1,3,8,8] -> conv1 (4x3x3x3, pad 1) -> [1,4,8,8] -> Softmax -> conv2 (2x4x1x1) -> y [1,2,8,8]."""
    rng = np.random.default_rng(0)
    nodes = [oh.make_node("Conv", ["x", "W1", "B1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
             oh.make_node("Softmax", ["a"], ["s"], name="sm", axis=1),
             oh.make_node("Conv", ["s", "W2"], ["y"], name="conv2")]
    inits = [nph.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.2).astype(np.float32), "W1"),
             nph.from_array(np.zeros(4, np.float32), "B1"),
             nph.from_array((rng.standard_normal((2, 4, 1, 1)) * 0.5).astype(np.float32), "W2")]
    n = 1 if batch == "1" else batch
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [n, 3, 8, 8])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, [n, 2, 8, 8])], inits)
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    m.ir_version = 8
    return m


CONV1_FLOPS = 2 * (4 * 8 * 8) * (3 * 3 * 3)   # 2 x output elements x (C_in x kH x kW)
CONV2_FLOPS = 2 * (2 * 8 * 8) * 4


def test_hand_counted_casts_and_bytes():
    # island_trials=0: paint's plan, whose Casts are counted here (the islands pass would make
    # conv2, between the pinned Softmax and the FP32 output, FP32: tests/test_islands.py)
    rep = graphmp.convert(conv_softmax_conv(), fp32_nodes="^sm$", keep_io_types=True, island_trials=0)
    c = rep["cast_traffic"]
    # x -> fp16 (192 elements), conv1 -> fp32 for Softmax (256), Softmax -> fp16 (256), conv2 -> fp32 at y (128);
    # each moves elements x (4 + 2) bytes
    assert c["casts"] == rep["casts_added"] == 4
    assert c["bytes"] == (192 + 256 + 256 + 128) * 6 == 4992
    assert c["boundary_bytes"] == (192 + 128) * 6 and c["inside_bytes"] == (256 + 256) * 6
    assert c["mb_per_inference"] == {"total": 4992 / 1e6, "boundary": 1920 / 1e6, "inside": 3072 / 1e6}
    assert not c["approximate"] and c["unavailable"] is None and c["shapes"] == {"x": [1, 3, 8, 8]}
    assert [t["bytes"] for t in c["top"]] == [1536, 1536, 1152, 768]
    by_producer = {t["producer"]: t for t in c["top"]}
    assert by_producer["Conv"]["consumers"] in (["Softmax"], ["graph output"])
    assert by_producer["Softmax"]["consumers"] == ["Conv"] and by_producer["graph input"]["consumers"] == ["Conv"]
    assert c["compute_flops"] == CONV1_FLOPS + CONV2_FLOPS and c["compute_fp16_share"] == 1.0
    line = next(x for x in rep.summary().splitlines() if "cast traffic" in x)
    assert line == ("  cast traffic: 4 Casts, 5.0 kB per inference at x:1x3x8x8 (boundary 1.9 kB); "
                    "100.0% of Conv/MatMul FLOPs in FP16")


def test_fp16_flops_share_with_one_fp32_conv():
    rep = graphmp.convert(conv_softmax_conv(), fp32_nodes="^(sm|conv2)$", keep_io_types=True)
    c = rep["cast_traffic"]
    assert c["compute_flops"] == CONV1_FLOPS + CONV2_FLOPS
    assert c["compute_flops_low"] == CONV1_FLOPS
    assert c["compute_fp16_share"] == pytest.approx(CONV1_FLOPS / (CONV1_FLOPS + CONV2_FLOPS))  # 13824 / 14848
    assert c["casts"] == 2 and c["bytes"] == (192 + 256) * 6 and c["boundary_bytes"] == 192 * 6
    assert "93.1% of Conv/MatMul FLOPs in FP16" in rep.summary()


def test_no_calibration_declared_shapes_or_unavailable():
    static = graphmp.convert(conv_softmax_conv(), fp32_nodes="^sm$", calibration="off")["cast_traffic"]
    assert static["shapes_from"] == "declared shapes" and static["bytes"] == 4992
    rep = graphmp.convert(conv_softmax_conv(batch="N"), fp32_nodes="^sm$", calibration="off")
    c = rep["cast_traffic"]
    assert c["bytes"] is None and c["unavailable"] and c["compute_fp16_share"] is None
    assert "bytes per inference unavailable at x:?x3x8x8" in rep.summary()
    # with a calibration batch the dynamic dim takes the batch's size
    batch = {"x": np.random.default_rng(1).standard_normal((3, 3, 8, 8)).astype(np.float32)}
    c = graphmp.convert(conv_softmax_conv(batch="N"), fp32_nodes="^sm$", calibration=[batch],
                        island_trials=0)["cast_traffic"]
    assert c["shapes"] == {"x": [3, 3, 8, 8]} and c["bytes"] == 3 * 4992


def _real_cast_bytes(model, feed) -> tuple[int, int]:
    """(Casts, bytes they move) from an ONNX Runtime run with every Cast's input and
    output exposed as graph outputs."""
    import onnxruntime as ort
    m = onnx.ModelProto()
    m.CopyFrom(model)
    casts = [n for n in m.graph.node if n.op_type == "Cast"]
    assert not any(n.op_type in ("If", "Loop", "Scan") for n in m.graph.node)
    have = {o.name for o in m.graph.output} | set(feed)
    for n in casts:
        for x in (n.input[0], n.output[0]):
            if x not in have:
                m.graph.output.append(onnx.ValueInfoProto(name=x))
                have.add(x)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    vals = dict(zip(names, sess.run(names, feed)))
    vals.update(feed)
    total = 0
    for n in casts:
        a, b = np.asarray(vals[n.input[0]]), np.asarray(vals[n.output[0]])
        assert a.size == b.size
        total += a.size * (a.dtype.itemsize + b.dtype.itemsize)
    return len(casts), total


@pytest.mark.skipif(not os.path.exists(PPOCR), reason="models/real/ppocrv4_det.onnx missing")
def test_bytes_match_an_onnx_runtime_run_on_a_real_model():
    rep = graphmp.convert(PPOCR, range_threshold=512, island_trials=0)  # one threshold everywhere: FP32 islands, Casts to count
    c = rep["cast_traffic"]
    assert not c["approximate"] and c["casts"] >= 10
    feed = {k: np.random.default_rng(2).standard_normal(v).astype(np.float32) for k, v in c["shapes"].items()}
    n, real = _real_cast_bytes(rep.model, feed)
    assert n == c["casts"] and real == c["bytes"]
    assert c["top"][0]["bytes"] == max(t["bytes"] for t in c["top"]) and len(c["top"]) == 5
    assert c["boundary_bytes"] + c["inside_bytes"] == c["bytes"] and c["boundary_bytes"] > 0
    # cheap: shape inference of a weightless skeleton, no run
    t = time.perf_counter()
    cast_traffic(rep.model, {k: np.zeros(v, np.float32) for k, v in c["shapes"].items()})
    assert time.perf_counter() - t < 0.2


def test_cli_summary_and_json(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(conv_softmax_conv(), src)
    report = tmp_path / "r.json"
    assert main(["convert", str(src), "-o", str(tmp_path / "o.onnx"), "--fp32-nodes", "^sm$",
                 "--island-trials", "0", "--report", str(report)]) == 0
    d = json.loads(report.read_text())
    assert d["cast_traffic"]["bytes"] == 4992 and d["cast_traffic"]["compute_fp16_share"] == 1.0
    assert d["casts_added"] == 4 and "cast_traffic" in d["timings"]


def test_measure_takes_the_sizes_inference_cannot_know_from_an_ort_run():
    """NonZero's count is data: inference leaves it unknown (counted as 1, approximate);
    measure=True runs the model once and counts the Cast at its real size."""
    import numpy as np
    from onnx import TensorProto, helper
    from graphmp.cast_cost import cast_traffic
    g = helper.make_graph([helper.make_node("NonZero", ["x"], ["nz"]),
                           helper.make_node("Cast", ["nz"], ["y"], to=TensorProto.FLOAT16, name="c")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    batch = {"x": np.ones((1, 8), np.float32)}
    guessed = cast_traffic(m, batch)
    measured = cast_traffic(m, batch, measure=True)
    assert guessed["approximate"] and not measured["approximate"]
    assert measured["bytes"] == 2 * 8 * (8 + 2)     # [2, 8] int64 read, FP16 written
    assert guessed["bytes"] < measured["bytes"]

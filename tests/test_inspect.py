"""`graphmp inspect` (graphmp/inspect.py, issue 37): FLOPs by precision, Casts and FP32 compute
nodes of any ONNX model (converted by graphmp, by onnxconverter-common, an FP32 source, an
INT8 QDQ model, a model with If branches and dynamic dims), the plan diff of two models,
the JSON schema, and bad input as one line with exit 2."""
import json
import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nph

from graphmp.cast_cost import COMPUTE_OPS
from graphmp.cli import main

from control_flow_cases import if_weights_in_branches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESNET = os.path.join(ROOT, "models", "tiny", "resnet.onnx")
QDQ = os.path.join(ROOT, "models", "real", "super_resolution_qdq.onnx")
MOSAIC = os.path.join(ROOT, "models", "real", "style_mosaic.onnx")
PPOCR = os.path.join(ROOT, "models", "real", "ppocrv4_det.onnx")
KEPT = "node_Conv_124"          # a Conv of the tiny ResNet that the tests keep FP32


def _inspect(args, capsys, json_out=True):
    rc = main(["inspect", *args] + (["--json"] if json_out else []))
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out) if json_out else out.out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny ResNet: FP32 source; graphmp's conversion with KEPT forced FP32; onnxconverter-common's."""
    from onnxconverter_common import float16
    d = tmp_path_factory.mktemp("inspect")
    src = str(d / "resnet.onnx")
    shutil.copy(RESNET, src)
    mp = str(d / "resnet.mp.onnx")
    assert main(["convert", src, "-o", mp, "-q", "--fp32-nodes", KEPT]) == 0
    occ = str(d / "resnet.occ.onnx")
    onnx.save(float16.convert_float_to_float16(onnx.load(src), keep_io_types=True), occ)
    return {"fp32": src, "graphmp": mp, "occ": occ}


def _compute_nodes(path):
    return [n for n in onnx.load(path).graph.node if n.op_type in COMPUTE_OPS]


def test_fp32_source_is_all_fp32(models, capsys):
    m = _inspect([models["fp32"]], capsys)["models"][0]
    assert m["graphmp_output"] is False
    assert m["flops"]["share"] == {"FP32": 1.0} and m["flops"]["total"] > 0
    listed = {e["name"] for g in m["fp32_compute"].values() for e in g["entries"]}
    assert listed == {n.name for n in _compute_nodes(models["fp32"])}
    assert m["casts"]["casts"] == sum(n.op_type == "Cast" for n in onnx.load(models["fp32"]).graph.node)


def test_graphmp_output_names_the_kept_node_and_its_reason(models, capsys):
    m = _inspect([models["graphmp"]], capsys)["models"][0]
    assert m["graphmp_output"] and m["converted_by"].startswith("graphmp")
    (entry,) = m["fp32_compute"]["Conv"]["entries"]
    assert entry["name"] == KEPT and "--fp32-nodes" in entry["reason"]
    share = m["flops"]["share"]
    assert set(share) == {"FP16", "FP32"} and abs(sum(share.values()) - 1) < 1e-9
    assert share["FP32"] == pytest.approx(entry["flops"] / m["flops"]["total"])
    model = onnx.load(models["graphmp"])
    assert m["casts"]["casts"] == sum(n.op_type == "Cast" for n in model.graph.node)
    text = _inspect([models["graphmp"]], capsys, json_out=False)
    assert f"{KEPT}: {entry['reason']}" in text


def test_onnxconverter_common_output_is_all_fp16(models, capsys):
    m = _inspect([models["occ"]], capsys)["models"][0]
    assert m["graphmp_output"] is False
    assert m["flops"]["share"] == {"FP16": 1.0}
    assert m["fp32_compute"] == {}
    assert m["casts"]["casts"] == sum(n.op_type == "Cast" for n in onnx.load(models["occ"]).graph.node) > 0


def test_shapes_scale_flops_and_cast_bytes(models, capsys):
    """--shapes sets the batch: FLOPs and Cast bytes grow with it; without it dim 0 is assumed 1, and said."""
    one = _inspect([models["graphmp"]], capsys)["models"][0]
    eight = _inspect([models["graphmp"], "--shapes", "pixel_values:8x3x32x32"], capsys)["models"][0]
    assert one["assumed"] == ["batch (batch) = 1"] and eight["assumed"] == []
    assert eight["shapes"] == {"pixel_values": [8, 3, 32, 32]}
    assert eight["flops"]["total"] == pytest.approx(8 * one["flops"]["total"])
    assert eight["casts"]["bytes"] == 8 * one["casts"]["bytes"]


def test_plan_diff_of_two_conversions(models, capsys):
    data = _inspect([models["graphmp"], models["occ"]], capsys)
    first, second = data["models"]
    d = data["diff"]
    assert [(e["name"], e["first"], e["second"]) for e in d["changed"] if e["op_type"] in COMPUTE_OPS] == \
        [(KEPT, "FP32", "FP16")]
    assert d["matched"] >= len(_compute_nodes(models["fp32"]))
    for k, (a, b) in d["flops_share"].items():
        assert a == first["flops"]["share"].get(k, 0.0) and b == second["flops"]["share"].get(k, 0.0)
    assert d["cast_bytes"] == [first["casts"]["bytes"], second["casts"]["bytes"]]
    text = _inspect([models["graphmp"], models["occ"]], capsys, json_out=False)
    assert "plan diff" in text and f"Conv {KEPT}: FP32 -> FP16" in text


def test_python_api_takes_a_model_proto(models):
    import graphmp
    rep = graphmp.inspect(onnx.load(models["fp32"]), onnx.load(models["graphmp"]))
    assert rep.models[0]["path"] == "<model>" and rep.models[0]["flops"]["share"] == {"FP32": 1.0}
    assert [e["name"] for e in rep.diff["changed"] if e["op_type"] == "Conv"] == \
        [n.name for n in _compute_nodes(models["fp32"]) if n.op_type == "Conv" and n.name != KEPT]


def test_json_schema(models, capsys):
    data = _inspect([models["fp32"], models["graphmp"]], capsys)
    assert data["schema"] == "graphmp.inspect" and data["version"] == 1 and len(data["models"]) == 2
    for m in data["models"]:
        assert {"path", "converted_by", "graphmp_output", "shapes", "shapes_from", "assumed", "inference_error",
                "flops", "casts", "nodes", "fp32_nodes_by_op", "fp32_compute", "compute_nodes",
                "uncounted_ops"} <= set(m)
        assert {"total", "by_precision", "share", "approximate", "uncounted"} <= set(m["flops"])
        assert {"casts", "bytes", "boundary_bytes", "inside_bytes", "top"} <= set(m["casts"])
        for e in m["compute_nodes"]:
            assert {"graph", "name", "op_type", "precision", "flops", "approximate", "reason"} <= set(e)
    assert {"matched", "only_in_first", "only_in_second", "changed", "flops_share", "casts",
            "cast_bytes"} <= set(data["diff"])


def test_qdq_model_counts_int8(capsys):
    m = _inspect([QDQ], capsys)["models"][0]
    assert m["flops"]["share"] == {"INT8": 1.0}
    assert {e["precision"] for e in m["compute_nodes"]} == {"INT8"}


def test_integer_ops_count_as_int8_with_their_flops(tmp_path, capsys):
    """MatMulInteger's FLOPs are those of the MatMul it stands for: 2 x M x K x N."""
    w = nph.from_array(np.ones((16, 8), np.int8), "w")
    nodes = [oh.make_node("MatMulInteger", ["x", "w"], ["acc"], name="mmi"),
             oh.make_node("Cast", ["acc"], ["accf"], name="to_float", to=TP.FLOAT),
             oh.make_node("MatMul", ["accf", "w2"], ["y"], name="mm")]
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.INT8, [4, 16])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, [4, 2])],
                      [w, nph.from_array(np.ones((8, 2), np.float32), "w2")])
    p = tmp_path / "int8.onnx"
    onnx.save(oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)]), p)
    m = _inspect([str(p)], capsys)["models"][0]
    assert m["flops"]["by_precision"] == {"INT8": 2 * 4 * 16 * 8, "FP32": 2 * 4 * 8 * 2}
    assert m["casts"]["casts"] == 1 and m["casts"]["bytes"] == 4 * 8 * (4 + 4)


def test_bf16_matmul_and_its_casts(tmp_path, capsys):
    """A MatMul between Casts to and from BFLOAT16: BF16 FLOPs 2 x M x K x N; each Cast moves
    its elements x (4 + 2) bytes; both Casts touch a graph input/output, so boundary."""
    nodes = [oh.make_node("Cast", ["x"], ["xb"], name="to_bf16", to=TP.BFLOAT16),
             oh.make_node("MatMul", ["xb", "w"], ["yb"], name="mm"),
             oh.make_node("Cast", ["yb"], ["y"], name="to_fp32", to=TP.FLOAT)]
    w = oh.make_tensor("w", TP.BFLOAT16, [16, 8], np.zeros(16 * 8, np.uint16).tolist())
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [4, 16])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, [4, 8])], [w])
    p = tmp_path / "bf16.onnx"
    onnx.save(oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)]), p)
    m = _inspect([str(p)], capsys)["models"][0]
    assert m["flops"]["by_precision"] == {"BF16": 2 * 4 * 16 * 8}
    assert m["casts"]["bytes"] == m["casts"]["boundary_bytes"] == (4 * 16 + 4 * 8) * (4 + 2)
    assert m["nodes"] == {"BF16": 1}


def test_if_branches_and_dynamic_dims(tmp_path, capsys):
    model, _ = if_weights_in_branches()
    p = tmp_path / "if.onnx"
    onnx.save(model, p)
    m = _inspect([str(p)], capsys)["models"][0]
    assert m["assumed"] == ["N (batch) = 1"] and m["shapes"]["x"] == [1, 3, 16, 16]
    where = {e["name"]: e["graph"] for e in m["compute_nodes"]}
    assert where == {"then_conv": "main/if_node.then_branch", "then_conv2": "main/if_node.then_branch",
                     "else_conv": "main/if_node.else_branch", "out_conv": "main"}
    assert m["flops"]["share"] == {"FP32": 1.0}
    wide = _inspect([str(p), "--shapes", "x:4x3x16x16"], capsys)["models"][0]
    assert wide["flops"]["total"] > m["flops"]["total"]


def test_experimental_ops_do_not_stop_the_count(capsys):
    """style_mosaic (opset 8) holds Crop/ImageScaler, which onnx's inference stops at: read as
    their standard forms (as convert does), every Conv is counted, at its declared 720x720."""
    m = _inspect([MOSAIC], capsys)["models"][0]
    convs = [n for n in onnx.load(MOSAIC).graph.node if n.op_type in COMPUTE_OPS]
    assert len(m["compute_nodes"]) == len(convs) and m["flops"]["uncounted"] == 0
    assert all(e["flops"] and not e["approximate"] for e in m["compute_nodes"])
    assert m["flops"]["share"] == {"FP32": 1.0}


def test_free_image_dims_get_a_plausible_size(capsys):
    """ppocrv4_det's input is [?, 3, ?, ?]: the sides get the first size graphmp's shape finding
    tries for an image (not 1, which would make every 3x3 Conv a 1x1 one), and the output says so."""
    m = _inspect([PPOCR], capsys)["models"][0]
    h, w = m["shapes"]["x"][2:]
    assert h == w > 1 and any("(spatial)" in a for a in m["assumed"])
    wide = _inspect([PPOCR, "--shapes", f"x:1x3x{2 * h}x{2 * w}"], capsys)["models"][0]
    assert wide["flops"]["total"] == pytest.approx(4 * m["flops"]["total"], rel=0.05)


@pytest.mark.parametrize("args, needle", [
    (["{d}/missing.onnx"], "no such file"),
    (["{d}/notes.onnx"], "not a readable ONNX model"),
    (["{resnet}", "--shapes", "nope:1x3x32x32"], "not an input of the model"),
    (["{resnet}", "--shapes", "pixel_values=8"], "--shapes"),
    (["{resnet}", "{d}/missing.onnx"], "no such file"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, args, needle):
    (tmp_path / "notes.onnx").write_text("not a model")
    rc = main(["inspect", *(a.format(d=tmp_path, resnet=RESNET) for a in args)])
    out = capsys.readouterr()
    assert rc == 2 and out.out == ""
    assert needle in out.err and len(out.err.strip().splitlines()) == 1 and "Traceback" not in out.err

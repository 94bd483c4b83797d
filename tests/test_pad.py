"""Tensor Core channel padding: outputs unchanged, dims aligned, every choice reported.

Each targeted graph is built so that a wrong padding would show: biases and BN shifts
are non-zero, Sigmoid turns padded zeros into 0.5, so any consumer that did not get
zero weights for the padded channels (or forgot to slice) changes the outputs.
"""
from __future__ import annotations

import glob
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphmp
from graphmp.cli import main
from graphmp.inputs import find_shapes, generate, input_specs
from graphmp.model_runs import run_ort, run_reference, runner
from graphmp.pad import pad

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RNG = np.random.default_rng(0)


class G:
    """A tiny graph builder: NCHW float input with a symbolic batch (and optionally spatial) dims."""

    def __init__(self, c=3, hw=(8, 8), dynamic_hw=False, opset=17):
        self.nodes, self.inits, self.opset = [], [], opset
        dims = ["N", c] + (["H", "W"] if dynamic_hw else list(hw))
        self.inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)]
        self.k = 0

    def name(self, base):
        self.k += 1
        return f"{base}{self.k}"

    def init(self, base, arr):
        n = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(arr, dtype=np.float32), n))
        return n

    def node(self, op, ins, n_out=1, **attrs):
        outs = [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, ins, outs, name=self.name(op), **attrs))
        return outs[0] if n_out == 1 else outs

    def conv(self, x, cin, cout, k=3, stride=1, group=1, bias=True):
        w = self.init("w", RNG.normal(0, 0.3, (cout, cin // group, k, k)))
        ins = [x, w] + ([self.init("b", RNG.normal(0, 0.5, cout))] if bias else [])
        return self.node("Conv", ins, kernel_shape=[k, k], pads=[k // 2] * 4, strides=[stride, stride], group=group)

    def bn(self, x, c):
        ins = [x] + [self.init(b, v) for b, v in (("s", RNG.uniform(0.5, 1.5, c)), ("bb", RNG.normal(0, 1, c)),
                                                    ("m", RNG.normal(0, 0.2, c)), ("v", RNG.uniform(0.5, 2, c)))]
        return self.node("BatchNormalization", ins)

    def model(self, *outputs):
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
        g = helper.make_graph(self.nodes, "t", self.inputs, outs, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)], ir_version=9)
        m = onnx.shape_inference.infer_shapes(m)
        del m.graph.value_info[:]
        onnx.checker.check_model(m, full_check=True)
        return m


def node_by_name(model, name):
    return next(n for n in model.graph.node if n.name == name)


def weight(model, name):
    """The initializer behind a weight input (through a Transpose, as in a tied LM head)."""
    inits = {t.name: t for t in model.graph.initializer}
    if name not in inits:
        name = next(n.input[0] for n in model.graph.node if n.op_type == "Transpose" and n.output[0] == name)
    return inits[name]


def weight_dims(model, name):
    return list(weight(model, name).dims)


def make_feeds(model, seed=0, batch=1, size=None):
    """Generated inputs: dynamic axis 0 = batch, other dynamic dims = size; without a
    size, the shapes graphmp finds by a trial run (batch applied where it can change)."""
    specs = input_specs(model)
    if size is None:
        plan = find_shapes(model, runner(model))
        return plan.feeds(seed, batch=batch if plan.batch_free else None)
    shapes = {s.name: tuple(d if isinstance(d, int) else (batch if i == 0 else size) for i, d in enumerate(s.dims))
              for s in specs}
    return generate(specs, shapes, seed)


def assert_padded_ok(src, multiple=8, batches=(1, 3), hw=None, **kw):
    """Pad `src`, then: checker-clean, outputs equal to FP32 rounding on several input
    sizes, output shapes unchanged, every padded dim a multiple (stems: 4 or 8) and
    really present in the padded weights. Returns (report dict, padded model)."""
    rep = pad(src, None, multiple=multiple, **kw)
    out = rep.model
    onnx.checker.check_model(out, full_check=True)
    base = src if isinstance(src, onnx.ModelProto) else onnx.load(src)
    for b in batches:
        feeds = make_feeds(base, seed=b, batch=b, size=hw)
        ref, got = run_ort(base, feeds), run_ort(out, feeds)
        for k, v in ref.items():
            assert got[k].shape == v.shape, k
            err = float(np.max(np.abs(got[k].astype(np.float64) - v))) if v.size else 0.0
            assert err <= 1e-5 * max(1.0, float(np.max(np.abs(v)))), (k, err)
    d = rep.to_dict()
    for p in d["padded"]:
        if "stem" in p["dim"]:
            assert p["new"] in (4, 8)
        else:
            assert p["new"] % multiple == 0, p
        assert p["new"] > p["old"] and p["flops_after"] >= p["flops_before"]
        n = node_by_name(out, p["node"])
        if n.op_type not in ("Conv", "ConvTranspose", "Gemm", "MatMul"):
            continue                                # producers padded for free: checked by their tests
        w = weight_dims(out, n.input[1])
        if n.op_type in ("Conv", "ConvTranspose"):
            axis = {"out_channels": 0 if n.op_type == "Conv" else 1,
                    "in_channels": 1 if n.op_type == "Conv" else 0}.get(p["dim"].split(" ")[0], 0)
            assert w[axis] == (p["new"] if "depthwise" in p["dim"] or p["dim"] == "out_channels" or n.op_type == "ConvTranspose"
                               else p["new"] // next((a.i for a in n.attribute if a.name == "group"), 1)), (p, w)
        elif n.op_type in ("Gemm", "MatMul"):
            assert p["new"] in w, (p, w)
    return d, out


def test_conv_bn_sigmoid_conv_padded_and_sliced_at_output():
    g = G(c=8)
    y = g.node("Sigmoid", [g.bn(g.conv("x", 8, 13), 13)])       # padded channels become 0.5
    z = g.conv(y, 13, 21)
    m = g.model(z)
    d, out = assert_padded_ok(m)
    dims = {(p["dim"], p["old"], p["new"]) for p in d["padded"]}
    assert ("out_channels", 13, 16) in dims and ("in_channels", 13, 16) in dims and ("out_channels", 21, 24) in dims
    assert d["slice_nodes"] == 1                                 # only at the graph output
    assert [n.op_type for n in out.graph.node].count("Slice") == 1
    assert d["weight_bytes_added"] > 0 and d["flops_padded_layers_after"] > d["flops_padded_layers_before"]


def test_wrong_padding_would_be_caught():
    """The check above is not vacuous: zero-padding a consumer's weights with ones breaks it."""
    g = G(c=8)
    m = g.model(g.conv(g.node("Sigmoid", [g.conv("x", 8, 13)]), 13, 16))
    out = pad(m, None, multiple=8).model
    conv2 = [n for n in out.graph.node if n.op_type == "Conv"][1]
    t = next(t for t in out.graph.initializer if t.name == conv2.input[1])
    w = numpy_helper.to_array(t).copy()
    w[:, 13:] = 1.0
    t.CopyFrom(numpy_helper.from_array(w, t.name))
    feeds = make_feeds(m, batch=2)
    assert np.max(np.abs(run_ort(out, feeds)[m.graph.output[0].name] - run_ort(m, feeds)[m.graph.output[0].name])) > 1


def test_grouped_conv_is_left_with_a_reason_and_depthwise_follows():
    g = G(c=8)
    a = g.node("Relu", [g.conv("x", 8, 12)])                      # 12 -> 16
    dw = g.conv(a, 12, 12, group=12)                              # depthwise: follows to 16 groups
    b = g.conv(g.node("Relu", [dw]), 12, 20)                      # absorbs 16, pads 20 -> 24
    grp = g.conv(b, 20, 10, group=2)                              # grouped: left, input sliced
    m = g.model(grp)
    d, out = assert_padded_ok(m)
    assert any("depthwise" in p["dim"] and p["new"] == 16 for p in d["padded"])
    dwn = next(n for n in out.graph.node if n.op_type == "Conv" and any(a.name == "group" and a.i == 16 for a in n.attribute))
    assert weight_dims(out, dwn.input[1])[0] == 16
    assert any("grouped conv (group=2)" in u["reason"] for u in d["unaligned"])
    assert any(s["op_type"] == "Conv" for s in d["sliced_back"])


def test_residual_add_of_two_padded_branches_stays_padded():
    g = G(c=8)
    a = g.conv("x", 8, 13)
    b = g.conv("x", 8, 13, k=1)
    s = g.node("Add", [g.node("Relu", [a]), b])
    m = g.model(g.conv(s, 13, 16))
    d, out = assert_padded_ok(m)
    assert d["slice_nodes"] == 0 and not d["sliced_back"]        # the Add ran on 16 channels
    add = next(n for n in out.graph.node if n.op_type == "Add")
    assert all(i.endswith(".padded") or ".padded" in i for i in add.input)


def test_concat_of_padded_and_unpadded():
    g = G(c=8)
    a = g.conv("x", 8, 12)                                        # 12 -> 16
    b = g.conv("x", 8, 16)                                        # aligned, not padded
    cat = g.node("Concat", [a, b], axis=1)                        # 32 channels, real ones scattered
    c = g.conv(cat, 28, 24)
    odd = g.node("Concat", [a, g.conv("x", 8, 3, bias=False)], axis=1)   # 16+3: not aligned -> originals
    m = g.model(c, g.conv(odd, 15, 8))
    d, out = assert_padded_ok(m)
    assert ("in_channels", 28, 32) in {(p["dim"], p["old"], p["new"]) for p in d["padded"]}
    assert any(s["op_type"] == "Concat" for s in d["sliced_back"])


def test_matmul_odd_k_and_n_with_dynamic_dims():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 13])
    w1 = numpy_helper.from_array(RNG.normal(0, 0.3, (13, 21)).astype(np.float32), "w1")
    b1 = numpy_helper.from_array(RNG.normal(0, 1, 21).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(RNG.normal(0, 0.3, (21, 19)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="bias"),
             helper.make_node("Tanh", ["hb"], ["t"], name="tanh"),
             helper.make_node("MatMul", ["t", "w2"], ["y"], name="mm2"),
             helper.make_node("Softmax", ["y"], ["p"], name="sm", axis=-1)]
    m = helper.make_model(helper.make_graph(nodes, "mm", [x], [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["B", "S", 19])],
                                            [w1, b1, w2]), opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    d, out = assert_padded_ok(m, batches=(1, 4), hw=7)
    dims = {(p["node"], p["dim"], p["old"], p["new"]) for p in d["padded"]}
    assert {("mm1", "N", 21, 24), ("mm2", "K", 21, 24), ("mm2", "N", 19, 24)} <= dims
    assert any(u["node"] == "mm1" and u["dim"] == "K" for u in d["unaligned"])   # K from the raw input
    assert any(s["op_type"] == "Softmax" for s in d["sliced_back"])              # softmax sees 19 classes


@pytest.mark.parametrize("stride,expect", [(2, 4), (1, 8)])
def test_first_conv_with_three_channels(stride, expect):
    g = G(c=3, dynamic_hw=True)
    m = g.model(g.conv(g.node("Relu", [g.conv("x", 3, 16, stride=stride)]), 16, 16))
    d, out = assert_padded_ok(m, hw=12)
    assert d["stem"] and d["stem"][0]["new"] == expect and "Pad node" in d["stem"][0]["choice"]
    pads = [n for n in out.graph.node if n.op_type == "Pad"]
    assert len(pads) == 1 and pads[0].input[0] == "x"
    off = pad(m, None, multiple=8, stem="off").to_dict()
    assert not off["stem"] and any("stem off" in u["reason"] for u in off["unaligned"])


def test_flatten_gemm_after_padded_convs():
    g = G(c=8, hw=(4, 4))
    a = g.node("Relu", [g.conv("x", 8, 13)])
    p = g.node("MaxPool", [a], kernel_shape=[2, 2], strides=[2, 2])    # 13 x 2 x 2
    f = g.node("Flatten", [p], axis=1)                                  # 52 features, padded: 64
    w = g.init("fc", RNG.normal(0, 0.3, (21, 52)))
    y = g.node("Gemm", [f, w, g.init("fcb", RNG.normal(0, 1, 21))], transB=1)
    gap = g.node("GlobalAveragePool", [g.node("Sigmoid", [a])])
    z = g.node("Gemm", [g.node("Flatten", [gap]), g.init("fc2", RNG.normal(0, 0.3, (13, 5)))])
    m = g.model(y, z)
    d, out = assert_padded_ok(m)
    dims = {(p["dim"], p["old"], p["new"]) for p in d["padded"]}
    assert ("K", 52, 64) in dims and ("N", 21, 24) in dims and ("K", 13, 16) in dims
    assert not any(s["op_type"] in ("Flatten", "Gemm") for s in d["sliced_back"])


def test_conv_transpose_instance_norm_and_resize():
    g = G(c=8)
    a = g.conv("x", 8, 12)
    inorm = g.node("InstanceNormalization", [a, g.init("s", RNG.uniform(0.5, 1.5, 12)), g.init("b", RNG.normal(0, 1, 12))])
    up = g.node("Resize", [g.node("Relu", [inorm]), "", g.init("sc", [1, 1, 2, 2])], mode="nearest")
    w = g.init("wt", RNG.normal(0, 0.3, (12, 6, 2, 2)))
    ct = g.node("ConvTranspose", [up, w, g.init("bt", RNG.normal(0, 1, 6))], strides=[2, 2], kernel_shape=[2, 2])
    m = g.model(ct)
    d, out = assert_padded_ok(m)
    assert any(p["op_type"] == "ConvTranspose" and p["dim"] == "in_channels" and p["new"] == 16 for p in d["padded"])
    assert any(p["op_type"] == "ConvTranspose" and p["dim"] == "out_channels" and p["new"] == 8 for p in d["padded"])
    assert not d["sliced_back"] and d["slice_nodes"] == 1


@pytest.mark.parametrize("multiple", [8, 16, 64])
def test_multiples(multiple):
    g = G(c=8)
    m = g.model(g.conv(g.node("Relu", [g.bn(g.conv("x", 8, 45), 45)]), 45, 100))
    d, _ = assert_padded_ok(m, multiple=multiple, max_overhead=1.0)
    assert {p["new"] for p in d["padded"]} == {-(-45 // multiple) * multiple, -(-100 // multiple) * multiple}
    assert all(p["new"] % multiple == 0 for p in d["padded"])


def test_aligned_model_is_left_alone():
    g = G(c=8)
    m = g.model(g.conv(g.node("Relu", [g.conv("x", 8, 16)]), 16, 32))
    d, out = assert_padded_ok(m)
    assert not d["padded"] and not d["unaligned"] and d["slice_nodes"] == 0
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in m.graph.node]


def test_overhead_limit_is_reported():
    g = G(c=8)
    m = g.model(g.conv("x", 8, 2))
    d = pad(m, None, multiple=8).to_dict()
    assert not d["padded"] and "300%" in d["unaligned"][0]["reason"]
    d2, _ = assert_padded_ok(m, max_overhead=4)
    assert d2["padded"][0]["new"] == 8


REAL = sorted(glob.glob(os.path.join(ROOT, "models", "real", "*.onnx")) + glob.glob(os.path.join(ROOT, "models", "tiny", "*.onnx")))


@pytest.mark.parametrize("path", REAL, ids=[os.path.basename(p) for p in REAL])
def test_real_models_unchanged_outputs(path):
    d, out = assert_padded_ok(path, batches=(1, 2))
    assert not any(p["new"] % 8 for p in d["padded"] if "stem" not in p["dim"])


def test_real_models_are_padded_where_it_matters():
    d, out = assert_padded_ok(os.path.join(ROOT, "models", "tiny", "gpt2.onnx"))
    assert ("N", 1001, 1008) in {(p["dim"], p["old"], p["new"]) for p in d["padded"]}     # the tied LM head
    assert d["slice_nodes"] == 1
    assert d["weight_bytes_added"] < 8 * 64 * 4 + 4096          # the embedding table got rows, not a copy
    gathers = [n for n in out.graph.node if n.op_type == "Gather" and weight_dims(out, n.input[0])[0] == 1008]
    assert gathers                                               # the lookup reads the same padded table
    d, _ = assert_padded_ok(os.path.join(ROOT, "models", "real", "ppocr_mobile_v2_cls.onnx"))
    assert len(d["padded"]) >= 10 and d["stem"][0]["new"] == 4


def test_pad_converted_mixed_precision_model(tmp_path):
    src = os.path.join(ROOT, "models", "tiny", "gpt2.onnx")
    mp = graphmp.convert(src, None).model
    d, out = assert_padded_ok(mp)
    head = node_by_name(out, next(p["node"] for p in d["padded"] if p["dim"] == "N"))
    assert weight(out, head.input[1]).data_type == TensorProto.FLOAT16
    # the FP16-faithful oracle agrees too: padding did not change what FP16 computes
    feeds = make_feeds(mp, batch=1)
    a, b = run_reference(mp, feeds), run_reference(out, feeds)
    for k in a:
        assert np.max(np.abs(a[k].astype(np.float32) - b[k].astype(np.float32))) <= 1e-2 * np.max(np.abs(a[k]))


def test_convert_with_pad_channels_validates(tmp_path):
    src = os.path.join(ROOT, "models", "real", "ppocr_mobile_v2_cls.onnx")
    out = tmp_path / "p.onnx"
    before = open(src, "rb").read()
    rep = graphmp.convert(src, out, pad_channels=8, validate=True)
    d = rep.to_dict()
    assert d["validation"]["passed"] and len(d["padding"]["padded"]) >= 10
    assert "padding to multiples of 8" in rep.summary()
    assert open(src, "rb").read() == before
    m = onnx.load(out)
    assert {p.key for p in m.metadata_props} >= {"graphmp", "graphmp.pad"}


def test_cli_pad(tmp_path, capsys):
    src = os.path.join(ROOT, "models", "real", "ppocr_mobile_v2_cls.onnx")
    out, rep = tmp_path / "o.onnx", tmp_path / "r.json"
    assert main(["pad", src, "-o", str(out), "--multiple", "16", "--validate", "--report", str(rep)]) == 0
    text = capsys.readouterr().out
    assert "padding to multiples of 16" in text and "validation on x:2x3x224x224: max abs difference" in text
    import json
    d = json.load(open(rep))
    assert d["multiple"] == 16 and d["validation"]["shapes_unchanged"]
    assert main(["pad", src, "-o", str(out), "--multiple", "7"]) == 2
    assert "must be one of" in capsys.readouterr().err
    assert main(["pad", str(tmp_path / "missing.onnx")]) == 2


def test_shared_weight_is_padded_once():
    g = G(c=8)
    w = g.init("shared", RNG.normal(0, 0.3, (13, 8, 3, 3)))
    a = g.node("Conv", ["x", w], kernel_shape=[3, 3], pads=[1] * 4)
    b = g.node("Conv", [g.node("Relu", ["x"]), w], kernel_shape=[3, 3], pads=[1] * 4)
    m = g.model(g.node("Add", [a, b]))
    d, out = assert_padded_ok(m)
    convs = [n for n in out.graph.node if n.op_type == "Conv"]
    assert convs[0].input[1] == convs[1].input[1] and weight_dims(out, convs[0].input[1])[0] == 16
    assert d["weight_bytes_added"] == 3 * 8 * 9 * 4 + 3 * 8            # 3 zero rows + the Slice's 3 int64s


def test_conv_whose_bias_is_computed_is_left_whole():
    g = G(c=8)
    b = g.node("Identity", [g.init("b", RNG.normal(0, 1, 13))])
    y = g.node("Conv", ["x", g.init("w", RNG.normal(0, 0.3, (13, 8, 3, 3))), b], kernel_shape=[3, 3], pads=[1] * 4)
    m = g.model(g.conv(g.node("Relu", [y]), 13, 16))
    d, out = assert_padded_ok(m)
    assert not d["padded"] and d["unaligned"][0]["reason"] == "bias is not an initializer"


# ---- producers padded for free: OneHot, embedding Gather, Concat with a constant ---------------

def _mm_model(nodes, inputs, output, inits, opset=17):
    m = helper.make_model(helper.make_graph(nodes, "t", inputs, [output], inits),
                          opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    onnx.checker.check_model(m, full_check=True)
    return m


def _f32(name, arr):
    return numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name)


def byte_classifier(hidden=(100, 45), classes=7, depth_type=np.int64, index_type=TensorProto.INT64):
    """bytes [B, L] (uint8 ones read through a Cast to int64) -> OneHot(257) -> MatMul(257 x H1) + b -> Relu -> MatMul(H1 x H2) -> Relu -> MatMul(H2 x C)."""
    h1, h2 = hidden
    inits = [numpy_helper.from_array(np.array(257, depth_type), "depth"), _f32("onoff", [0.0, 1.0]),
             _f32("w1", RNG.normal(0, 0.1, (257, h1))), _f32("b1", RNG.normal(0, 1, h1)),
             _f32("w2", RNG.normal(0, 0.1, (h1, h2))), _f32("w3", RNG.normal(0, 0.1, (h2, classes)))]
    cast = [helper.make_node("Cast", ["bytes"], ["idx"], name="cast", to=TensorProto.INT64)]
    nodes = ([] if index_type == TensorProto.INT64 else cast) + [
             helper.make_node("OneHot", ["bytes" if index_type == TensorProto.INT64 else "idx", "depth", "onoff"], ["oh"],
                              name="onehot", axis=-1),
             helper.make_node("MatMul", ["oh", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu1"),
             helper.make_node("MatMul", ["r", "w2"], ["h2"], name="mm2"),
             helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
             helper.make_node("MatMul", ["r2", "w3"], ["logits"], name="mm3")]
    return _mm_model(nodes, [helper.make_tensor_value_info("bytes", index_type, ["B", "L"])],
                     helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "L", classes]), inits)


def embedding_classifier(vocab=300, emb=45, hidden=99, classes=6):
    """ids [B, L] -> Gather(table [V, 45]) + b -> Tanh -> MatMul(45 x 99) -> Relu -> MatMul(99 x 6)."""
    inits = [_f32("table", RNG.normal(0, 1, (vocab, emb))), _f32("eb", RNG.normal(0, 1, emb)),
             _f32("w1", RNG.normal(0, 0.2, (emb, hidden))), _f32("w2", RNG.normal(0, 0.2, (hidden, classes)))]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="embed", axis=0),
             helper.make_node("Add", ["e", "eb"], ["eb2"], name="add"),
             helper.make_node("Tanh", ["eb2"], ["t"], name="tanh"),
             helper.make_node("MatMul", ["t", "w1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["logits"], name="mm2")]
    return _mm_model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "L"])],
                     helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "L", classes]), inits)


def assert_same_outputs(ref, out, feeds):
    a, b = run_ort(ref, feeds), run_ort(out, feeds)
    for k, v in a.items():
        assert b[k].shape == v.shape
        assert np.max(np.abs(b[k].astype(np.float64) - v)) <= 1e-5 * max(1.0, float(np.max(np.abs(v)))), k


def test_byte_classifier_onehot_depth_is_padded():
    m = byte_classifier()
    rep = pad(m, None, multiple=8)
    d, out = rep.to_dict(), rep.model
    onnx.checker.check_model(out, full_check=True)
    assert d["aligned_before"]["fraction"] < 0.5 and d["aligned_after"]["fraction"] >= 0.95
    assert {("onehot", "depth", 257, 264), ("mm1", "K", 257, 264)} <= {(p["node"], p["dim"], p["old"], p["new"])
                                                                        for p in d["padded"]}
    assert d["slice_nodes"] == 1 and not d["needs_copy"]        # only the 7 -> 8 logits, at the graph output
    oh = node_by_name(out, "onehot")
    assert numpy_helper.to_array(weight(out, oh.input[1])).shape == () and int(numpy_helper.to_array(weight(out, oh.input[1]))) == 264
    w1 = numpy_helper.to_array(weight(out, node_by_name(out, "mm1").input[1]))
    assert w1.shape[0] == 264 and not w1[257:].any()          # the new columns meet zero rows
    # bytes, negative indices (counted from the end of depth) and out-of-range ones alike
    for seed, (lo, hi) in enumerate([(0, 256), (-257, 0), (-400, 400)]):
        feeds = {"bytes": np.random.default_rng(seed).integers(lo, hi, (3, 17)).astype(np.int64)}
        assert_same_outputs(m, out, feeds)
    assert "weight layers with every dim a multiple of 8: 0/3 (0.00) -> 3/3 (1.00)" in rep.summary()


def test_onehot_negative_index_shift_is_needed():
    """Without the index shift, -1 would select the last *padded* column: the check above would fail."""
    m = byte_classifier()
    out = pad(m, None, multiple=8).model
    for n in list(out.graph.node):
        if n.op_type == "OneHot":
            n.input[0] = "bytes"
    feeds = {"bytes": np.full((1, 4), -1, np.int64)}
    a, b = run_ort(m, feeds)["logits"], run_ort(out, feeds)["logits"]
    assert np.max(np.abs(a - b)) > 1e-3


def test_onehot_unsigned_indices_need_no_shift():
    m = byte_classifier(index_type=TensorProto.UINT8, depth_type=np.int32)
    d, out = assert_padded_ok(m, batches=(2,), hw=9)
    assert d["aligned_after"]["fraction"] >= 0.95
    assert not any(n.op_type in ("Where", "Less") for n in out.graph.node)


def test_embedding_table_columns_are_padded():
    m = embedding_classifier()
    rep = pad(m, None, multiple=8)
    d, out = rep.to_dict(), rep.model
    onnx.checker.check_model(out, full_check=True)
    assert d["aligned_before"]["fraction"] == 0.0 and d["aligned_after"]["fraction"] >= 0.95
    assert {("embed", "embedding columns", 45, 48), ("mm1", "K", 45, 48)} <= {(p["node"], p["dim"], p["old"], p["new"])
                                                                              for p in d["padded"]}
    table = numpy_helper.to_array(weight(out, node_by_name(out, "embed").input[0]))
    assert table.shape == (300, 48) and not table[:, 45:].any()
    assert sum(1 for t in out.graph.initializer if list(t.dims)[:1] == [300]) == 1     # replaced, not copied
    assert d["slice_nodes"] == 1                                # the 6 -> 8 logits, at the graph output
    for seed in range(2):
        assert_same_outputs(m, out, {"ids": np.random.default_rng(seed).integers(-300, 300, (2, 13)).astype(np.int64)})


def test_embedding_table_read_elsewhere_is_left_with_a_reason():
    m = embedding_classifier()
    m.graph.node.append(helper.make_node("ReduceSum", ["table"], ["tsum"], name="tsum", keepdims=0))
    m.graph.output.append(helper.make_tensor_value_info("tsum", TensorProto.FLOAT, []))
    d, out = assert_padded_ok(m, batches=(2,), hw=5)
    assert any(u["node"] == "embed" and "also read by tsum" in u["reason"] for u in d["unaligned"])


def test_concat_with_a_constant_takes_the_padding():
    """x [2, 13] ++ constant [2, 2] = 15 features -> the constant gets one zero column: K 15 -> 16."""
    inits = [_f32("c", RNG.normal(0, 1, (2, 2))), _f32("w", RNG.normal(0, 0.3, (15, 16)))]
    nodes = [helper.make_node("Concat", ["x", "c"], ["cat"], name="cat", axis=1),
             helper.make_node("MatMul", ["cat", "w"], ["y"], name="mm")]
    m = _mm_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 13])],
                  helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16]), inits)
    d, out = assert_padded_ok(m, batches=(2,))
    assert ("mm", "K", 15, 16) in {(p["node"], p["dim"], p["old"], p["new"]) for p in d["padded"]}
    assert d["aligned_after"]["fraction"] == 1.0 and d["slice_nodes"] == 0


def test_matmul_weight_built_by_concat_of_constants_is_padded():
    inits = [_f32("wa", RNG.normal(0, 0.3, (16, 10))), _f32("wb", RNG.normal(0, 0.3, (16, 11)))]
    nodes = [helper.make_node("Concat", ["wa", "wb"], ["w"], name="wcat", axis=1),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    m = _mm_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16])],
                  helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 21]), inits)
    d, out = assert_padded_ok(m, batches=(1, 3))
    assert ("mm", "N", 21, 24) in {(p["node"], p["dim"], p["old"], p["new"]) for p in d["padded"]}
    assert not any(n.op_type == "Concat" for n in out.graph.node)      # folded into one padded weight
    assert {t.name for t in out.graph.initializer}.isdisjoint({"wa", "wb"})


def test_k_that_would_need_a_runtime_copy_is_reported(capsys):
    """Softmax output (and a raw graph input) feeding an odd K: no free producer, so it is left and named."""
    inits = [_f32("w1", RNG.normal(0, 0.3, (13, 13))), _f32("w2", RNG.normal(0, 0.3, (13, 16)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Softmax", ["h"], ["p"], name="sm", axis=-1),
             helper.make_node("MatMul", ["p", "w2"], ["y"], name="mm2")]
    m = _mm_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 13])],
                  helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 16]), inits)
    rep = pad(m, None, multiple=8)
    d = rep.to_dict()
    left = {u["node"]: u for u in d["needs_copy"]}
    assert set(left) == {"mm1", "mm2"} and "Softmax 'sm'" in left["mm2"]["reason"]
    assert "runtime Pad node" in left["mm1"]["reason"] and d["aligned_after"]["fraction"] == 0.0
    assert "2 layer(s) left unaligned because padding them would need a runtime Pad node" in rep.summary()


def test_k_behind_a_layer_left_unpadded_needs_no_copy():
    """K=2 comes (through a Relu) from a MatMul whose N=2 was too costly to pad: named, not a runtime copy."""
    inits = [_f32("w1", RNG.normal(0, 0.3, (16, 2))), _f32("w2", RNG.normal(0, 0.3, (2, 16)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")]
    m = _mm_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16])],
                  helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 16]), inits)
    d = pad(m, None, multiple=8).to_dict()
    k = next(u for u in d["unaligned"] if u["node"] == "mm2")
    assert not k["needs_copy"] and "MatMul 'mm1' (through Relu 'relu')" in k["reason"] and not d["needs_copy"]


def test_onehot_on_the_channel_axis_feeds_a_conv():
    """A class map [N, H, W] -> OneHot(13, axis=1) -> Conv 13 -> 16: input channels padded at the OneHot."""
    inits = [numpy_helper.from_array(np.array([13], np.int64), "depth"), _f32("onoff", [-0.5, 2.0]),
             _f32("w", RNG.normal(0, 0.3, (16, 13, 3, 3))), _f32("b", RNG.normal(0, 1, 16))]
    nodes = [helper.make_node("OneHot", ["cls", "depth", "onoff"], ["oh"], name="onehot", axis=1),
             helper.make_node("Conv", ["oh", "w", "b"], ["y"], name="conv", kernel_shape=[3, 3], pads=[1] * 4)]
    m = _mm_model(nodes, [helper.make_tensor_value_info("cls", TensorProto.INT64, ["N", 6, 6])],
                  helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16, 6, 6]), inits)
    rep = pad(m, None, multiple=8)
    d, out = rep.to_dict(), rep.model
    onnx.checker.check_model(out, full_check=True)
    assert ("conv", "in_channels", 13, 16) in {(p["node"], p["dim"], p["old"], p["new"]) for p in d["padded"]}
    assert d["aligned_after"]["fraction"] == 1.0 and d["slice_nodes"] == 0
    assert numpy_helper.to_array(weight(out, node_by_name(out, "onehot").input[1])).tolist() == [16]
    for seed in range(2):     # off_value -0.5 fills the new channels too: only zero weights keep them out
        assert_same_outputs(m, out, {"cls": np.random.default_rng(seed).integers(-20, 20, (2, 6, 6)).astype(np.int64)})


def window_classifier(flatten: str):
    """bytes [B, 4] -> OneHot(257) [B, 4, 257] -> Flatten / Reshape [B, 1028] -> MatMul(1028 x 24)."""
    inits = [numpy_helper.from_array(np.array(257, np.int64), "depth"), _f32("onoff", [0.0, 1.0]),
             _f32("w", RNG.normal(0, 0.1, (4 * 257, 24))), numpy_helper.from_array(np.array([0, -1], np.int64), "shape")]
    flat = (helper.make_node("Flatten", ["oh"], ["f"], name="flat", axis=1) if flatten == "Flatten" else
            helper.make_node("Reshape", ["oh", "shape"], ["f"], name="flat"))
    nodes = [helper.make_node("OneHot", ["bytes", "depth", "onoff"], ["oh"], name="onehot"), flat,
             helper.make_node("MatMul", ["f", "w"], ["y"], name="mm")]
    return _mm_model(nodes, [helper.make_tensor_value_info("bytes", TensorProto.INT64, ["B", 4])],
                     helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 24]), inits)


def test_onehot_through_flatten_pads_a_window_of_bytes():
    d, out = assert_padded_ok(window_classifier("Flatten"), batches=(1, 3))
    assert ("mm", "K", 1028, 1056) in {(p["node"], p["dim"], p["old"], p["new"]) for p in d["padded"]}
    assert d["aligned_after"]["fraction"] == 1.0 and d["slice_nodes"] == 0


def test_onehot_not_padded_where_it_would_need_a_copy():
    """OneHot read by a MatMul and by a reduction, or reshaped before the MatMul: padding it would
    add a Slice back per run (or is not followed), so it is left and the K is reported as needing a copy."""
    m = byte_classifier()
    m.graph.node.append(helper.make_node("ReduceSum", ["oh"], ["count"], name="count", keepdims=0))
    m.graph.output.append(helper.make_tensor_value_info("count", TensorProto.FLOAT, []))
    for model, mm, source in ((m, "mm1", "OneHot 'onehot'"), (window_classifier("Reshape"), "mm", "Reshape 'flat'")):
        d, out = assert_padded_ok(model, batches=(2,), hw=5)
        assert not any(p["op_type"] == "OneHot" for p in d["padded"])
        assert [u["node"] for u in d["needs_copy"]] == [mm] and source in d["needs_copy"][0]["reason"]
        assert d["aligned_after"]["fraction"] < 0.95


def test_byte_classifier_converted_to_mixed_precision_then_padded():
    mp = graphmp.convert(byte_classifier(), None).model
    d, out = assert_padded_ok(mp, batches=(2,), hw=9)
    assert ("onehot", "depth", 257, 264) in {(p["node"], p["dim"], p["old"], p["new"]) for p in d["padded"]}
    assert d["aligned_after"]["fraction"] >= 0.95

"""Patterns of modern models (issue 34), one small torch export each, converted by default
through the CLI, loaded with ONNX Runtime's default options and computed FP16-faithfully
(graphmp.model_runs.run_reference) against the FP32 model:
  * Sin/Cos Fourier features of pixel coordinates stay FP32 (classify rule 12), a Snake
    activation on bounded inputs stays FP16, and generated inputs reach pixel/timestep ranges;
  * an attention mask built with finfo(float32).min keeps its arithmetic FP32 (rule 11): no
    NaN in a fully masked row where FP32 has none;
  * durations rounded and cast to int64 come out as in FP32 (rule 13);
  * an INT8 model's compute share counts its integer compute (graphmp.compute_share).
"""
from __future__ import annotations

import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from graphmp.cli import main
from graphmp.model_runs import run_reference

torch = pytest.importorskip("torch")
nn = torch.nn


class Fourier(nn.Module):
    """SAM-style random Fourier encoding of points in pixel units, then a linear layer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("B", torch.randn(2, 16) * 8.0)
        self.lin = nn.Linear(32, 8)

    def forward(self, coords):
        a = 2 * math.pi * ((coords / 1024.0 * 2 - 1) @ self.B)
        return self.lin(torch.cat([torch.sin(a), torch.cos(a)], -1))


class Snake(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv1d(4, 8, 3, padding=1), nn.Conv1d(8, 4, 3, padding=1)
        self.alpha = nn.Parameter(torch.ones(1, 8, 1))

    def forward(self, feats):
        h = self.c1(feats)
        return self.c2(h + 1 / self.alpha * torch.sin(self.alpha * h) ** 2)


class MaskedAttention(nn.Module):
    """T5-style: a position bias where the mask is 1, finfo.min where it is 0, added to the scores."""

    def __init__(self, s=12):
        super().__init__()
        self.emb, self.q, self.k, self.v = nn.Embedding(50, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.bias = nn.Parameter(torch.randn(1, s, s) * 0.1)

    def forward(self, input_ids, attention_mask):
        x = self.emb(input_ids)
        m = torch.where(attention_mask[:, None, :] > 0, self.bias, torch.finfo(torch.float32).min)
        sc = (self.q(x) / math.sqrt(32)) @ self.k(x).transpose(1, 2) + m
        return torch.softmax(sc, -1) @ self.v(x)


class Durations(nn.Module):
    """A duration predictor: frames per token, rounded and cast to int64."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 1)

    def forward(self, x):
        d = torch.nn.functional.softplus(self.l2(torch.tanh(self.l1(x)))).squeeze(-1) * 40.0
        return torch.round(d).to(torch.int64)


def _export(module, args, path, names, dynamic=None):
    torch.manual_seed(0)
    with torch.no_grad():
        torch.onnx.export(module.eval(), args, str(path), input_names=names, dynamic_axes=dynamic, dynamo=False,
                          opset_version=17)
    return str(path)


def _convert(src, out, *extra):
    rep = out + ".json"
    assert main(["convert", src, "-o", out, "--report", rep, *extra]) == 0
    ort.InferenceSession(out)  # default session options
    return {n["name"]: n["reason"] for n in json.load(open(rep))["fp32_nodes"]}


def _fp32(src, feeds):
    return ort.InferenceSession(src).run(None, feeds)


def _rel(a, b):
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(a).max())


def test_fourier_features_of_pixel_coordinates_stay_fp32(tmp_path):
    torch.manual_seed(0)
    model = Fourier()
    src = _export(model, (torch.rand(1, 8, 2) * 1024,), tmp_path / "f.onnx", ["coords"], {"coords": {1: "p"}})
    out = str(tmp_path / "f.mp.onnx")
    fp32 = _convert(src, out)
    sins = [n for n in fp32 if "Sin" in n or "Cos" in n]
    assert len(sins) == 2 and all(fp32[n].startswith("periodic:") and "reached |x|" in fp32[n] for n in sins)
    assert any("MatMul" in n for n in fp32)  # the projection computing the argument too
    feeds = {"coords": np.random.default_rng(1).uniform(0, 1024, (1, 8, 2)).astype(np.float32)}
    ref = _fp32(src, feeds)[0]
    got = list(run_reference(onnx.load(out), feeds).values())[0]
    assert _rel(ref, got) < 2e-3
    # the rule matters: the same plan with the encoding forced FP16 is off by far more
    forced = str(tmp_path / "f16.onnx")
    main(["convert", src, "-o", forced, "--fp16-nodes", "."])
    assert _rel(ref, list(run_reference(onnx.load(forced), feeds).values())[0]) > 10 * _rel(ref, got)


def test_generated_inputs_reach_pixel_and_timestep_ranges():
    from graphmp.inputs import generate, input_specs, value_hints
    torch.manual_seed(0)
    import io
    buf = io.BytesIO()
    torch.onnx.export(Fourier().eval(), (torch.rand(1, 8, 2),), buf, input_names=["coords"], dynamo=False,
                      opset_version=17)
    model = onnx.load_from_string(buf.getvalue())
    hints = value_hints(model)
    assert hints["coords"]["span"] == [0.0, 1024.0]
    feeds = generate(input_specs(model), {"coords": (1, 8, 2)}, 0, hints)
    assert feeds["coords"].max() > 100 and feeds["coords"].min() >= 0
    model.graph.input[0].name = "q"  # a name that says nothing: no span, a warning (test below)
    for n in model.graph.node:
        n.input[:] = ["q" if x == "coords" else x for x in n.input]
    assert value_hints(model)["q"] == {"periodic": "unknown"}


def test_snake_on_bounded_inputs_stays_fp16_and_its_input_is_named(tmp_path, capsys):
    src = _export(Snake(), (torch.randn(1, 4, 32),), tmp_path / "s.onnx", ["feats"])
    fp32 = _convert(src, str(tmp_path / "s.mp.onnx"))
    assert not any("Sin" in n for n in fp32) and not any(r.startswith("periodic") for r in fp32.values())
    cap = capsys.readouterr()
    assert "'feats' reach a Sin/Cos" in cap.out + cap.err  # the summary's warning line


def _masked_feeds():
    m = np.ones((2, 12), np.int64)
    m[0, 8:] = 0   # padding
    m[1, :] = 0    # a fully masked row
    return {"input_ids": np.random.default_rng(0).integers(0, 50, (2, 12)), "attention_mask": m}


@pytest.mark.parametrize("calibration", ["generated", "unpadded"])
def test_finfo_min_mask_keeps_fully_masked_rows_as_fp32(tmp_path, calibration):
    """Generated masks are padded, so the range rule sees finfo.min; calibration data whose
    masks mask nothing never shows it, and the sentinel rule keeps the mask path FP32."""
    src = _export(MaskedAttention(), (torch.randint(0, 50, (2, 12)), torch.ones(2, 12, dtype=torch.int64)),
                  tmp_path / "a.onnx", ["input_ids", "attention_mask"])
    out = str(tmp_path / "a.mp.onnx")
    extra = []
    if calibration == "unpadded":
        np.savez(tmp_path / "cal.npz", input_ids=np.arange(24).reshape(2, 12),
                 attention_mask=np.ones((2, 12), np.int64))
        extra = ["--calibration", str(tmp_path / "cal.npz")]
    fp32 = _convert(src, out, *extra)
    want = "mask sentinel:" if calibration == "unpadded" else "range:"
    assert "/Add" in {n for n, r in fp32.items() if r.startswith(want) and "3.403e+38" in r}  # scores + mask
    feeds = _masked_feeds()
    ref = _fp32(src, feeds)[0]
    got = list(run_reference(onnx.load(out), feeds).values())[0]
    assert not np.isnan(ref).any() and not np.isnan(got).any()
    assert _rel(ref, got) < 1e-2
    assert main(["check", src, out]) == 0


def test_generated_masks_have_padding():
    from graphmp.input_roles import padded_mask
    m = padded_mask((2, 16), np.int64)
    assert m[0].all() and m[1, :12].all() and not m[1, 12:].any()
    assert not padded_mask((1, 8), np.float32)[0, 6:].any()


def test_rounded_durations_come_out_as_in_fp32(tmp_path):
    src = _export(Durations(), (torch.randn(2, 64, 16),), tmp_path / "d.onnx", ["x"])
    out = str(tmp_path / "d.mp.onnx")
    fp32 = _convert(src, out)
    assert any(r.startswith("rounded to an integer") for r in fp32.values())
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 64, 16)).astype(np.float32)}
    ref = _fp32(src, feeds)[0]
    np.testing.assert_array_equal(list(run_reference(onnx.load(out), feeds).values())[0], ref)
    forced = str(tmp_path / "d16.onnx")  # the rule matters: all-FP16 flips some durations
    main(["convert", src, "-o", forced, "--fp16-nodes", "."])
    assert (list(run_reference(onnx.load(forced), feeds).values())[0] != ref).any()


def test_int8_compute_is_counted_as_int8(tmp_path, capsys):
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from graphmp.compute_share import precision_shares
    src = _export(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)), (torch.randn(4, 64),),
                  tmp_path / "m.onnx", ["x"])
    q = str(tmp_path / "q.onnx")
    quantize_dynamic(src, q, weight_type=QuantType.QInt8)
    capsys.readouterr()
    _convert(q, str(tmp_path / "q.mp.onnx"))
    out = capsys.readouterr().out
    assert "100.0% INT8" in out and "MatMulInteger 2" in out
    s = precision_shares(onnx.load(q), _inferred_shapes(q, {"x": [4, 64]}))
    assert s["share"]["int8"] == 1.0 and s["int8_ops"] == {"MatMulInteger": 2}
    s = precision_shares(onnx.load(src), _inferred_shapes(src, {"x": [4, 64]}))
    assert s["share"]["fp32"] == 1.0 and s["int8_ops"] == {}


def _inferred_shapes(path, inputs):
    """{tensor: dims} of the model at these input shapes (onnx shape inference)."""
    model = onnx.load(path)
    for v in model.graph.input:
        for d, n in zip(v.type.tensor_type.shape.dim, inputs[v.name]):
            d.dim_value = n
    model = onnx.shape_inference.infer_shapes(model)
    shapes = {v.name: [d.dim_value or 1 for d in v.type.tensor_type.shape.dim]
              for v in list(model.graph.value_info) + list(model.graph.output)}
    shapes.update({t.name: list(t.dims) for t in model.graph.initializer}, **inputs)
    return shapes


class UNetBlock(nn.Module):
    """A diffusion U-Net's pieces: a timestep Sin/Cos embedding, GroupNorm (exported as
    Reshape + InstanceNormalization) between convs, an Einsum attention."""

    def __init__(self, c=16):
        super().__init__()
        self.inp, self.out = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, 3, 3, padding=1)
        self.n1, self.n2 = nn.GroupNorm(4, c), nn.GroupNorm(4, c)
        self.c1, self.qkv = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, 3 * c, 1)
        self.t = nn.Linear(16, c)

    def forward(self, sample, timestep):
        a = timestep[:, None] * torch.exp(-math.log(10000) * torch.arange(8, dtype=torch.float32) / 8)[None]
        h = self.inp(sample)
        h = h + self.c1(nn.functional.silu(self.n1(h))) + self.t(torch.cat([a.sin(), a.cos()], -1))[:, :, None, None]
        b, c, hh, ww = h.shape
        q, k, v = self.qkv(self.n2(h)).reshape(b, 3, c, hh * ww).unbind(1)
        att = torch.softmax(torch.einsum("bci,bcj->bij", q, k) / math.sqrt(c), -1)
        return self.out(h + torch.einsum("bij,bcj->bci", att, v).reshape(b, c, hh, ww))


def test_unet_block_keeps_its_convs_fp16_and_its_timestep_encoding_fp32(tmp_path, capsys):
    torch.manual_seed(0)
    src = _export(UNetBlock(), (torch.randn(1, 3, 16, 16), torch.tensor([500.0])), tmp_path / "u.onnx",
                  ["sample", "timestep"])
    out = str(tmp_path / "u.mp.onnx")
    capsys.readouterr()
    fp32 = _convert(src, out)
    share = json.load(open(out + ".json"))["cast_traffic"]["compute_fp16_share"]
    assert share >= 0.9
    assert {"/Sin", "/Cos"} <= {n for n, r in fp32.items() if r.startswith("periodic:")}
    feeds = {"sample": np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32),
             "timestep": np.array([777.0], np.float32)}
    assert _rel(_fp32(src, feeds)[0], list(run_reference(onnx.load(out), feeds).values())[0]) < 1e-2


def _rope_like(tmp_path):
    """position_ids -> Cast -> Mul(inverse frequencies) -> Sin/Cos -> scale x: a rotary table."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper
    inv = numpy_helper.from_array((10000.0 ** (-np.arange(8) / 8)).astype(np.float32), "inv_freq")
    nodes = [helper.make_node("Unsqueeze", ["position_ids", "ax"], ["p3"]),
             helper.make_node("Cast", ["p3"], ["pf"], to=TP.FLOAT),
             helper.make_node("Mul", ["pf", "inv_freq"], ["arg"]),
             helper.make_node("Sin", ["arg"], ["s"]), helper.make_node("Cos", ["arg"], ["c"]),
             helper.make_node("Concat", ["s", "c"], ["sc"], axis=-1),
             helper.make_node("MatMul", ["x", "w"], ["xw"]),
             helper.make_node("Mul", ["xw", "sc"], ["y"])]
    g = helper.make_graph(nodes, "rope", [helper.make_tensor_value_info("position_ids", TP.INT64, [1, "s"]),
                                          helper.make_tensor_value_info("x", TP.FLOAT, [1, "s", 16])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, None)],
                          [inv, numpy_helper.from_array(np.array([-1], np.int64), "ax"),
                           numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32),
                                                   "w")])
    path = str(tmp_path / "rope.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_position_ids_count_up_so_a_rotary_table_is_measured(tmp_path):
    from graphmp.inputs import generate, input_specs, value_hints
    src = _rope_like(tmp_path)
    hints = value_hints(onnx.load(src))
    assert hints["position_ids"] == {"positions": True}
    feeds = generate(input_specs(onnx.load(src)), {"position_ids": (1, 16), "x": (1, 16, 16)}, 0, hints)
    np.testing.assert_array_equal(feeds["position_ids"], np.arange(16)[None])
    fp32 = _convert(src, str(tmp_path / "rope.mp.onnx"), "--shapes", "position_ids:1x16,x:1x16x16")
    periodic = [r for r in fp32.values() if r.startswith("periodic:")]
    assert any("Sin '" in r and "reached |x| 15" in r for r in periodic)  # positions 0..15, frequency 1

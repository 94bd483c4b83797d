"""KV-cache decoders (issue 34): the cache is found by structure; by default its inputs
and outputs stay FP32 at the model's boundary (Casts inside), `--cache-io fp16` declares
them FP16; either way a left-padded batch decodes step by step (each step's present fed
back as the next past) with every step's logits within check's yardstick, computed
FP16-faithfully (graphmp.emulate), and no NaN on ONNX Runtime with its default options."""
import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphmp
from graphmp.budget import errors, measure
from graphmp.cli import main
from graphmp.emulate import emulated_runner
from graphmp.model_runs import runner

# one long prompt and one short one: the short row is left-padded, so its first query rows
# attend to nothing (every key masked) and its padded keys stay masked at every step
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
STEPS = 5


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    pytest.importorskip("torch")
    from fixtures import kv_decoder
    path = kv_decoder.export(str(tmp_path_factory.mktemp("kv") / "decoder.onnx"))
    reference = kv_decoder.decode(runner(path), PROMPTS, STEPS)
    return kv_decoder, path, reference


def _io_types(path) -> dict:
    m = onnx.load(path)
    return {v.name: v.type.tensor_type.elem_type for v in list(m.graph.input) + list(m.graph.output)}


def _step_errors(src, reference, decoded) -> list:
    """Per decode step: (the logits' max-rel error against the FP32 decode, the yardstick
    of `graphmp check` measured on that step's FP32 feeds)."""
    out = []
    for (feeds, ref), (_, got) in zip(reference, decoded):
        budget = measure(src, [feeds], [{"logits": ref["logits"]}], "auto")
        err = errors([{"logits": ref["logits"]}], [{"logits": got["logits"]}], "max-rel")["logits"]
        out.append((err, budget.allowed["logits"]))
    return out


def _decodes_within_yardstick(kv, src, converted, reference, cache_dtype):
    """The converted model decodes PROMPTS from its own cache, fed the FP32 decode's tokens:
    FP16-faithfully (emulation) within the yardstick at every step; on ONNX Runtime CPU
    with its default session options with no NaN and within the yardstick too."""
    tokens = kv.fed_tokens(reference)
    emulated = kv.decode(emulated_runner(converted), PROMPTS, STEPS, cache_dtype=cache_dtype, tokens=tokens)
    assert len(emulated) == STEPS + 1
    for step, (err, allowed) in enumerate(_step_errors(src, reference, emulated)):
        assert err <= allowed, f"step {step}: logits max-rel {err:.3g} > yardstick {allowed:.3g}"
    assert not any(np.isnan(out["logits"]).any() for _, out in emulated)
    import onnxruntime as ort
    sess = ort.InferenceSession(converted)  # ONNX Runtime's default session options
    names = [o.name for o in sess.get_outputs()]
    on_ort = kv.decode(lambda feeds: dict(zip(names, sess.run(None, feeds))), PROMPTS, STEPS,
                       cache_dtype=cache_dtype, tokens=tokens)
    for (_, ref), (_, got) in zip(reference, on_ort):
        assert np.isnan(got["logits"]).sum() == np.isnan(ref["logits"]).sum() == 0  # padded rows too
    assert all(err <= allowed for err, allowed in _step_errors(src, reference, on_ort))


def test_default_keeps_the_cache_fp32_and_decodes_a_padded_batch(decoder, tmp_path):
    kv, src, reference = decoder
    out = str(tmp_path / "decoder.mp.onnx")
    rep = graphmp.convert(src, out)
    pairs = rep["kv_cache"]["pairs"]
    assert {p["input"]: p["outputs"] for p in pairs} == {
        f"past_{n}": [f"present_{n}"] for n in kv.cache_names(2)}
    assert rep["kv_cache"]["io"] == "fp32" and "KV cache: 4 cache input(s)" in rep.summary()
    types = _io_types(out)
    assert all(types[f"{end}_{n}"] == TensorProto.FLOAT for n in kv.cache_names(2) for end in ("past", "present"))
    m = onnx.load(out)
    # the cache's Concat runs FP16 behind Casts: FP16 inside, FP32 at the boundary
    casts_of_past = [n for n in m.graph.node if n.op_type == "Cast" and n.input[0].startswith("past_")]
    assert len(casts_of_past) == 4 and all(n.attribute[0].i == TensorProto.FLOAT16 for n in casts_of_past)
    _decodes_within_yardstick(kv, src, out, reference, np.float32)


def test_cache_io_fp16_declares_the_cache_fp16_and_still_decodes(decoder, tmp_path, capsys):
    kv, src, reference = decoder
    out, default_out = str(tmp_path / "decoder.f16cache.onnx"), str(tmp_path / "decoder.mp.onnx")
    report = str(tmp_path / "r.json")
    assert main(["convert", src, "-o", out, "--cache-io", "fp16", "--report", report]) == 0
    assert "declared FP16 at the boundary" in capsys.readouterr().out
    types = _io_types(out)
    assert all(types[f"{end}_{n}"] == TensorProto.FLOAT16 for n in kv.cache_names(2) for end in ("past", "present"))
    assert types["logits"] == TensorProto.FLOAT and types["input_ids"] == TensorProto.INT64
    # no Cast at the cache's boundary: fewer Casts than the FP32-cache default
    default = graphmp.convert(src, default_out)
    assert json.load(open(report))["casts_added"] < default["casts_added"]
    assert json.load(open(report))["kv_cache"]["io"] == "fp16"
    _decodes_within_yardstick(kv, src, out, reference, np.float16)


def test_cache_io_fp32_keeps_the_cache_fp32_without_keep_io_types(decoder, tmp_path):
    kv, src, _ = decoder
    out = str(tmp_path / "decoder.lowio.onnx")
    rep = graphmp.convert(src, out, keep_io_types=False, cache_io="fp32", calibration="off")
    types = _io_types(out)
    assert types["logits"] == TensorProto.FLOAT16
    assert all(types[f"{end}_{n}"] == TensorProto.FLOAT for n in kv.cache_names(2) for end in ("past", "present"))
    assert rep["kv_cache"]["io"] == "fp32"
    # without --cache-io the cache follows --no-keep-io-types
    rep = graphmp.convert(src, None, keep_io_types=False, calibration="off")
    assert rep["kv_cache"]["io"] == "fp16" and "--cache-io fp32 keeps it FP32" in rep.summary()


# ------------------------------------------------------------------ found by structure
def _cache_graph(name_in, name_out, through="Concat"):
    """One layer of a cache under any names: state [B, 2, P, 4] -> `through` with the new
    entries -> [B, 2, P+1, 4] as an output, next to a plain MatMul output."""
    new = helper.make_tensor_value_info("new", TensorProto.FLOAT, ["B", 2, 1, 4])
    past = helper.make_tensor_value_info(name_in, TensorProto.FLOAT, ["B", 2, "P", 4])
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4],
                           np.random.default_rng(2).standard_normal(16).astype(np.float32))
    nodes = [helper.make_node("MatMul", ["new", "w"], ["proj"]),
             helper.make_node("MatMul", [name_in, "w"], ["scores"])]
    if through == "Concat":
        nodes.append(helper.make_node("Concat", [name_in, "proj"], [name_out], axis=2))
    else:
        nodes.append(helper.make_node(through, [name_in], [name_out]))
    outs = [helper.make_tensor_value_info(name_out, TensorProto.FLOAT, ["B", 2, None, 4]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["B", 2, "P", 4])]
    g = helper.make_graph(nodes, "g", [new, past], outs, initializer=[w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _stacked_cache_graph():
    """A stacked cache as older GPT-2 exports have it: past_0 [2, B, 2, P, 4] (key and value)
    -> Gather 0 / Gather 1 -> Concat with the new entries -> Unsqueeze -> Concat axis 0."""
    new = helper.make_tensor_value_info("new", TensorProto.FLOAT, ["B", 2, 1, 4])
    past = helper.make_tensor_value_info("past_0", TensorProto.FLOAT, [2, "B", 2, "P", 4])
    inits = [helper.make_tensor(f"i{k}", TensorProto.INT64, [], [k]) for k in (0, 1)]
    inits.append(helper.make_tensor("ax0", TensorProto.INT64, [1], [0]))
    nodes = []
    for k in (0, 1):
        nodes += [helper.make_node("Gather", ["past_0", f"i{k}"], [f"half{k}"], axis=0),
                  helper.make_node("Concat", [f"half{k}", "new"], [f"cat{k}"], axis=2),
                  helper.make_node("Unsqueeze", [f"cat{k}", "ax0"], [f"u{k}"])]
    nodes.append(helper.make_node("Concat", ["u0", "u1"], ["present_0"], axis=0))
    out = helper.make_tensor_value_info("present_0", TensorProto.FLOAT, [2, "B", 2, None, 4])
    g = helper.make_graph(nodes, "g", [new, past], [out], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_stacked_cache_is_found_through_its_gathers():
    rep = graphmp.convert(_stacked_cache_graph(), None, calibration="off", cache_io="fp16")
    assert rep["kv_cache"]["pairs"] == [{"input": "past_0", "outputs": ["present_0"]}]
    assert rep.model.graph.input[1].type.tensor_type.elem_type == TensorProto.FLOAT16


@pytest.mark.parametrize("name_in, name_out", [("past_key_values.0.key", "present.0.key"), ("state", "next_state")])
def test_the_cache_is_found_by_structure_whatever_its_name(name_in, name_out):
    rep = graphmp.convert(_cache_graph(name_in, name_out), None, calibration="off", cache_io="fp16")
    assert rep["kv_cache"]["pairs"] == [{"input": name_in, "outputs": [name_out]}]
    types = {v.name: v.type.tensor_type.elem_type for v in list(rep.model.graph.input) + list(rep.model.graph.output)}
    assert types[name_in] == types[name_out] == TensorProto.FLOAT16
    assert types["scores"] == TensorProto.FLOAT  # not a cache output: no append on its way
    # FP32 data fed to the FP16 cache (check's --data, its ORT CUDA row) is rounded to it
    feeds = {"new": np.random.default_rng(0).standard_normal((1, 2, 1, 4)).astype(np.float32),
             name_in: np.random.default_rng(1).standard_normal((1, 2, 3, 4)).astype(np.float32)}
    for run in (runner(rep.model), emulated_runner(rep.model)):
        half = run({**feeds, name_in: feeds[name_in].astype(np.float16)})
        fed32 = run(feeds)
        assert np.array_equal(fed32[name_out], half[name_out]) and np.array_equal(fed32["scores"], half["scores"])
        assert not np.array_equal(half[name_out][:, :, :3], feeds[name_in])  # the data was rounded


def test_an_input_copied_to_an_output_is_no_cache():
    rep = graphmp.convert(_cache_graph("past_key", "present_key", through="Identity"), None, calibration="off",
                          cache_io="fp16")
    assert "kv_cache" not in rep.to_dict()
    assert all(v.type.tensor_type.elem_type == TensorProto.FLOAT for v in rep.model.graph.input)


def test_cache_io_other_than_the_target_is_a_one_line_error(tmp_path, capsys):
    src = str(tmp_path / "m.onnx")
    onnx.save(_cache_graph("past", "present"), src)
    rc = main(["convert", src, "-o", str(tmp_path / "o.onnx"), "--cache-io", "bf16"])
    err = capsys.readouterr().err
    assert rc == 2 and "--cache-io must be fp32 or the target type (fp16" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "o.onnx")

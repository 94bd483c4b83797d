"""graphmp.inputs: the one input-spec mechanism every command uses.

Real models whose dynamic dims cannot be filled with an arbitrary size (a stride-32
detector, a VAD with a minimum frame length and a sample-rate If, a GRU whose state
pins the batch) run with the shapes graphmp finds; where nothing runs, the error
names --shapes; user data is checked before anything runs.
"""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphmp.errors import GraphmpError
from graphmp.inputs import check_feeds, find_shapes, input_specs, parse_shapes, rebatch, value_hints
from graphmp.model_runs import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL = os.path.join(ROOT, "models", "real")


def _plan(name, shapes=None):
    path = os.path.join(REAL, name)
    model = onnx.load(path, load_external_data=False)
    run = runner(path)
    return find_shapes(model, run, shapes), run


def test_stride32_detector_gets_sizes_that_run():
    """PP-OCRv4 det: H and W must be multiples of 32 (16x16 fails to broadcast)."""
    plan, run = _plan("ppocrv4_det.onnx")
    n, c, h, w = plan.shapes["x"]
    assert (c, h % 32, w % 32) == (3, 0, 0) and h >= 64 and w >= 64
    out = run(plan.feeds())
    assert list(out.values())[0].shape[-2:] == (h, w)
    assert plan.batch_free and run(plan.feeds(seed=1, batch=2))
    with pytest.raises(Exception):
        run(plan.feeds() | {"x": np.zeros((1, 3, 16, 16), np.float32)})  # the old fill value fails


def test_vad_gets_its_sample_rate_branch_and_frame_length():
    """Silero VAD: `sr` selects the 16 kHz branch through Equal(sr, 16000) -> If; the
    state's middle axis is the batch; a 16-sample input is too short for its reflect pad."""
    model = onnx.load(os.path.join(REAL, "silero_vad.onnx"))
    assert value_hints(model) == {"sr": 16000}
    plan, run = _plan("silero_vad.onnx")
    feeds = plan.feeds()
    assert int(feeds["sr"]) == 16000
    assert feeds["state"].shape[1] == feeds["input"].shape[0]  # batch on the state's axis 1
    assert feeds["input"].shape[1] >= 192
    two = plan.feeds(seed=1, batch=2)
    assert two["input"].shape[0] == two["state"].shape[1] == 2
    run(two)


def test_gru_state_pins_the_batch():
    """AECMOS: h0 is [4, 1, 64], so only batch 1 runs; the plan says the batch is fixed."""
    plan, run = _plan("aecmos_gru.onnx")
    assert plan.shapes["input"][0] == 1 and not plan.batch_free
    assert plan.feeds(batch=4)["input"].shape[0] == 1  # nothing to rebatch
    run(plan.feeds())


def test_given_shapes_win_and_are_checked():
    plan, run = _plan("ppocrv4_det.onnx", "x:2x3x64x96")
    assert plan.shapes == {"x": (2, 3, 64, 96)} and plan.how == "given by --shapes"
    run(plan.feeds())
    model = onnx.load(os.path.join(REAL, "ppocrv4_det.onnx"), load_external_data=False)
    for bad, needle in [("y:1x3x64x64", "not an input of the model"),
                        ("x:1x3x64", "does not fit input 'x'"),
                        ("x:1x4x64x64", "does not fit input 'x'"),
                        ("x=1x3x64x64", "not NAME:DIMS")]:
        with pytest.raises(GraphmpError, match=needle):
            find_shapes(model, lambda f: None, bad)


def _fixed_size_model():
    """[N, S] -> Reshape to [N, 7, 7]: only S = 49 runs (not a size graphmp tries)."""
    g = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Relu", ["r"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "S"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 7, 7])],
        [onnx.numpy_helper.from_array(np.array([-1, 7, 7], np.int64), "shape")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_nothing_runs_names_shapes():
    m = _fixed_size_model()
    with pytest.raises(GraphmpError, match=r"--shapes NAME:DIMS.*x\[N,S\]") as e:
        find_shapes(m, runner(m), where="m.onnx")
    assert "m.onnx" in str(e.value) and "\n" not in str(e.value)
    plan = find_shapes(m, runner(m), "x:2x49")
    assert plan.shapes == {"x": (2, 49)}


def test_named_dims_are_shared_between_inputs():
    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"])], "g",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "seq"]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", "seq"])],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, ["batch", "seq"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    plan = find_shapes(m, runner(m), "a:3x5")
    assert plan.shapes == {"a": (3, 5), "b": (3, 5)}


def test_parse_shapes_trtexec_syntax():
    assert parse_shapes("x:1x3x640x640,mask:1x640") == {"x": (1, 3, 640, 640), "mask": (1, 640)}
    assert parse_shapes("sr:") == {"sr": ()}
    assert parse_shapes("ns:input:0:2x4") == {"ns:input:0": (2, 4)}
    assert parse_shapes(None) == {} and parse_shapes({}) == {}  # no --shapes: nothing given


@pytest.mark.parametrize("spec", ["", ",", " , "])
def test_an_empty_shapes_string_is_a_mistake_not_no_shapes(spec):
    with pytest.raises(GraphmpError, match="no NAME:DIMS given"):
        parse_shapes(spec)


def test_rebatch_touches_only_batch_dims():
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "h": np.zeros((4, 2, 5), np.float32),
             "sr": np.array(16000)}
    out = rebatch(feeds, [("x", 0), ("h", 1)], 3)
    assert out["x"].shape == (3, 3) and np.array_equal(out["x"][2], feeds["x"][0])
    assert out["h"].shape == (4, 3, 5) and out["sr"].shape == ()


@pytest.mark.parametrize("arrays, needle", [
    ({"input": np.zeros((1, 512), np.float32), "state": np.zeros((2, 1, 128), np.float32)},
     r"no array for model input\(s\) sr"),
    ({"inpt": np.zeros((1, 512), np.float32), "state": np.zeros((2, 1, 128), np.float32), "sr": np.array(16000)},
     "the file has inpt"),
    ({"input": np.zeros((1, 512), np.float64), "state": np.zeros((2, 1, 128), np.float32), "sr": np.array(16000)},
     "array 'input' is float64, the model input is float32"),
    ({"input": np.zeros((512,), np.float32), "state": np.zeros((2, 1, 128), np.float32), "sr": np.array(16000)},
     "rank 1"),
    ({"input": np.zeros((1, 512), np.float32), "state": np.zeros((3, 1, 128), np.float32), "sr": np.array(16000)},
     "axis 0 of input .* is fixed at 2"),
])
def test_bad_data_is_named(arrays, needle):
    specs = input_specs(onnx.load(os.path.join(REAL, "silero_vad.onnx"), load_external_data=False))
    with pytest.raises(GraphmpError, match=needle) as e:
        check_feeds(specs, arrays, "batch.npz")
    assert str(e.value).startswith("batch.npz: ") and "\n" not in str(e.value)


def _audio_model():
    """waveforms [B, N] float (N = samples: a reflect pad of 32 needs N > 32) and
    waveforms_lens [B] int64, the layout of ASR front ends (onnx-asr)."""
    g = helper.make_graph(
        [helper.make_node("Pad", ["waveforms", "pads"], ["p"], mode="reflect"),
         helper.make_node("ReduceSum", ["p"], ["s"], keepdims=0),
         helper.make_node("Cast", ["waveforms_lens"], ["lf"], to=TensorProto.FLOAT),
         helper.make_node("Div", ["s", "lf"], ["y"])], "g",
        [helper.make_tensor_value_info("waveforms", TensorProto.FLOAT, ["B", "N"]),
         helper.make_tensor_value_info("waveforms_lens", TensorProto.INT64, ["B"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B"])],
        [onnx.numpy_helper.from_array(np.array([0, 32, 0, 32], np.int64), "pads")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_short_batch_names_mean_the_batch_only_on_axis_0():
    """[B, N]: N is the number of samples here, not a second batch (it used to become
    1, so a reflect pad failed and the search gave up after one trial)."""
    m = _audio_model()
    plan = find_shapes(m, runner(m))
    assert plan.shapes["waveforms"][0] == 1 and plan.shapes["waveforms"][1] > 32
    feeds = plan.feeds()
    assert feeds["waveforms_lens"].tolist() == [feeds["waveforms"].shape[1]]  # lengths are full lengths
    assert np.isfinite(runner(m)(feeds)["y"]).all()


def test_nan_in_data_is_refused():
    specs = input_specs(_audio_model())
    arrays = {"waveforms": np.full((1, 64), np.nan, np.float32), "waveforms_lens": np.array([64])}
    with pytest.raises(GraphmpError, match="'waveforms' holds 64 NaN"):
        check_feeds(specs, arrays, "b.npz")


def test_image_sizes_from_model_metadata_come_first():
    """An Ultralytics-style export names its image size in metadata ('imgsz'); a model
    that only runs at that size (H*W must be 96*128 here) runs at the first trial."""
    g = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "h", "w"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 96 * 128])],
                          [onnx.numpy_helper.from_array(np.array([1, 3, 96 * 128], np.int64), "shape")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    with pytest.raises(GraphmpError, match="--shapes"):
        find_shapes(m, runner(m), max_trials=8)
    onnx.helper.set_model_props(m, {"imgsz": "[96, 128]", "stride": "32"})
    plan = find_shapes(m, runner(m))
    assert plan.shapes["x"][2] * plan.shapes["x"][3] == 96 * 128 and plan.trials <= 3

"""graphmp.trt against a recording stand-in of the TensorRT Python API (tests/trt_standin.py).

These tests use a TEST DOUBLE for what cannot run here (no GPU, no TensorRT wheel): they
check graphmp.trt's call sequence and that every failure value TensorRT can return gives
a clear GraphmpError or the documented fallback. They are not evidence that TensorRT
works; benchmarks/gpu_check.sh is the real check on a GPU machine. The stand-in engine
computes with ONNX Runtime (CPU) through the bound addresses, so the outputs checked here
prove the buffers, dtypes and shapes graphmp binds are the right ones.
"""
from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphmp import trt as gtrt
from graphmp.errors import GraphmpError
from trt_standin import make_standins


def _affine(path, batch_dim="N"):
    """y = x * 2 + 1, x: [N, 4] float."""
    g = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["t"], name="mul"), helper.make_node("Add", ["t", "one"], ["y"])],
        "affine", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch_dim, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch_dim, 4])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]), helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def _reshape(path):
    """y = Reshape(x, s): s is a shape tensor (its values set the output shape)."""
    g = helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["y"], name="reshape")], "reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6]),
         helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["A", "B"])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


@pytest.fixture
def standin(monkeypatch):
    def make(**switches):
        trt, torch = make_standins(**switches)
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        monkeypatch.setitem(sys.modules, "torch", torch)
        return trt
    return make


def _names(trt):
    return [c[0] for c in trt.calls]


def _in_order(names, expected):
    """expected is a subsequence of names."""
    it = iter(names)
    return all(any(n == e for n in it) for e in expected)


AFFINE_RANGE = dict(shapes={"x": (3, 4)}, min_shapes={"x": (0, 4)}, max_shapes={"x": (8, 4)})


def test_build_and_run_call_sequence(tmp_path, standin):
    trt = standin()
    model = _affine(tmp_path / "m.onnx")
    res = gtrt.build_engine(model, tmp_path / "m.plan", timing_cache=tmp_path / "t.cache", **AFFINE_RANGE)
    names = _names(trt)
    assert _in_order(names, ["init_libnvinfer_plugins", "Builder", "Builder.create_network",
                             "OnnxParser.parse", "Builder.create_builder_config", "IBuilderConfig.set_flag",
                             "IOptimizationProfile.set_shape", "IBuilderConfig.add_optimization_profile",
                             "IBuilderConfig.create_timing_cache", "IBuilderConfig.set_timing_cache",
                             "Builder.build_serialized_network", "IBuilderConfig.get_timing_cache",
                             "ITimingCache.serialize"]), names
    assert ("Builder.create_network", (1 << 1,)) in trt.calls  # STRONGLY_TYPED, no EXPLICIT_BATCH
    assert ("IBuilderConfig.set_flag", ("TF32",)) in trt.calls
    assert not any(c[0] == "IBuilderConfig.set_flag" and c[1][0] in ("FP16", "BF16", "INT8") for c in trt.calls)
    assert ("IOptimizationProfile.set_shape", ("x", (0, 4), (3, 4), (8, 4))) in trt.calls
    assert ("IBuilderConfig.set_timing_cache", ("H100", False)) in trt.calls
    assert (tmp_path / "m.plan").read_bytes() == res.engine
    assert (tmp_path / "t.cache").read_bytes() == b"STANDIN-CACHE H100 1"
    assert res.to_dict()["profile"] == {"x": {"min": [0, 4], "opt": [3, 4], "max": [8, 4]}}

    del trt.calls[:]
    x = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    r = gtrt.EngineRunner(res.engine, {"x": x})
    assert r.step() >= 0
    np.testing.assert_array_equal(r.outputs()["y"], x * 2 + 1)
    names = _names(trt)
    assert _in_order(names, ["init_libnvinfer_plugins", "Runtime", "Runtime.deserialize_cuda_engine",
                             "ICudaEngine.create_execution_context", "IExecutionContext.set_input_shape",
                             "IExecutionContext.infer_shapes", "IExecutionContext.set_tensor_address",
                             "IExecutionContext.execute_async_v3", "torch.cuda.graph",
                             "IExecutionContext.execute_async_v3", "CUDAGraph.replay"]), names
    assert ("torch.cuda.graph", ("thread_local",)) in trt.calls  # cudaStreamCaptureModeThreadLocal
    assert ("IExecutionContext.execute_async_v3", ("capture",)) in trt.calls
    assert {c[1] for c in trt.calls if c[0] == "IExecutionContext.set_tensor_address"} == {("x", "device"),
                                                                                         ("y", "device")}
    assert r.graph is not None and "captured" in r.cuda_graph_note
    # the replayed graph really recomputes: overwrite the output buffer, replay, read again
    r.buffers["y"].a[:] = 0
    r.step()
    np.testing.assert_array_equal(r.outputs()["y"], x * 2 + 1)
    r.close()


def test_tf32_off_clears_the_flag(tmp_path, standin):
    trt = standin()
    gtrt.build_engine(_affine(tmp_path / "m.onnx", batch_dim=2), tf32=False, workspace_mb=64)
    assert ("IBuilderConfig.clear_flag", ("TF32",)) in trt.calls
    assert ("IBuilderConfig.set_memory_pool_limit", ("WORKSPACE", 64 << 20)) in trt.calls
    assert "IOptimizationProfile.set_shape" not in _names(trt)  # static shapes: no profile


@pytest.mark.parametrize("blob", [b"STANDIN-CACHE A100 7", b"\x00garbage"])
def test_timing_cache_from_elsewhere_is_replaced_not_a_crash(tmp_path, standin, capsys, blob):
    standin()
    cache = tmp_path / "t.cache"
    cache.write_bytes(blob)
    res = gtrt.build_engine(_affine(tmp_path / "m.onnx"), timing_cache=cache, **AFFINE_RANGE)
    assert any("was not accepted" in n and str(cache) in n for n in res.to_dict()["notes"])
    assert "warning: timing cache" in capsys.readouterr().err
    assert cache.read_bytes() == b"STANDIN-CACHE H100 1"  # a fresh cache for this GPU replaced it
    assert res.to_dict()["timing_cache"] == str(cache)


def test_cache_for_this_gpu_is_reused(tmp_path, standin):
    trt = standin()
    cache = tmp_path / "t.cache"
    cache.write_bytes(b"STANDIN-CACHE H100 4")
    res = gtrt.build_engine(_affine(tmp_path / "m.onnx"), timing_cache=cache, **AFFINE_RANGE)
    assert cache.read_bytes() == b"STANDIN-CACHE H100 5" and not res.to_dict()["notes"][1:]
    assert [c for c in trt.calls if c[0] == "IBuilderConfig.set_timing_cache"] == [
        ("IBuilderConfig.set_timing_cache", ("H100", False))]


def test_shape_outside_profile_is_one_line_error(tmp_path, standin):
    standin()
    res = gtrt.build_engine(_affine(tmp_path / "m.onnx"), **AFFINE_RANGE)
    with pytest.raises(GraphmpError) as e:
        gtrt.EngineRunner(res.engine, {"x": np.zeros((9, 4), np.float32)})
    msg = str(e.value)
    assert "\n" not in msg
    assert "input 'x'" in msg and "9x4" in msg and "min 0x4, opt 3x4, max 8x4" in msg


def test_bf16_io_is_converted_here(tmp_path, standin):
    trt = standin(io_types={"x": "BF16", "y": "BF16"})
    with pytest.raises(TypeError):  # what the old code called: the real nptype raises for BF16
        trt.nptype(trt.DataType.BF16)
    res = gtrt.build_engine(_affine(tmp_path / "m.onnx"), **AFFINE_RANGE)
    x = np.array([[0.5, -1.25, 3.0, 100.0], [1 / 3, 2.0, -0.0078125, 7.0]], np.float32)
    r = gtrt.EngineRunner(res.engine, {"x": x})
    r.step()
    y = r.outputs()["y"]
    assert y.dtype == np.float32 and y.shape == (2, 4)
    xb = gtrt.from_bf16_bits(gtrt.to_bf16_bits(x))  # the engine sees x rounded to bfloat16
    assert xb[1, 0] != x[1, 0] and abs(xb[1, 0] - x[1, 0]) <= 2 ** -9
    expect = xb * 2 + 1  # exact in float32; the stand-in truncates it to bfloat16
    expect = ((expect.view(np.uint32) >> 16) << 16).view(np.float32)
    np.testing.assert_array_equal(y, expect)


def test_bf16_rounding_is_nearest_even():
    one = 1.0
    vals = np.array([one + 2 ** -8, one + 3 * 2 ** -8, -(one + 2 ** -8), np.inf, -np.inf, np.nan,
                     3.4028235e38, 1e-40], np.float32)
    back = gtrt.from_bf16_bits(gtrt.to_bf16_bits(vals))
    assert back[0] == 1.0                      # tie -> even (mantissa 0)
    assert back[1] == one + 2 ** -6            # tie -> even (round up)
    assert back[2] == -1.0
    assert back[3] == np.inf and back[4] == -np.inf and np.isnan(back[5])
    assert back[6] == np.inf                   # float32 max is above bfloat16 max + half an ulp
    assert back[7] > 0 and abs(back[7] - 1e-40) <= 2.0 ** -134  # subnormal kept: within half its ulp (2^-133)
    rng = np.random.default_rng(0)
    r = rng.standard_normal(1000).astype(np.float32)
    err = np.abs(gtrt.from_bf16_bits(gtrt.to_bf16_bits(r)) - r) / np.abs(r)
    assert err.max() <= 2 ** -8 * (1 + 1e-6)   # half an ulp of an 8-bit significand


def test_bf16_bits_are_ml_dtypes_with_one_nan():
    """graphmp.weight_rounding' BF16 conversion is ml_dtypes' rounding, except that every NaN
    (either sign, quiet or signalling, any payload) becomes 0x7FC0, without a warning;
    back to float32 is exact for all 65536 patterns."""
    import warnings

    import ml_dtypes
    u = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA00000, 0x7FFFFFFF,  # NaNs
                  0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000,              # inf, near max
                  0x3F808000, 0x3F818000, 0xBF808000, 0x00008000, 0x00018000, 0x00000001,  # ties, subnormals
                  0x80000000, 0x00000000, 0x3F807FFF, 0x3F808001], np.uint32)
    x = u.view(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bits = gtrt.to_bf16_bits(x)
    nan = np.isnan(x)
    assert bits.dtype == np.uint16 and (bits[nan] == 0x7FC0).all()
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(bits[~nan], want[~nan])
    assert list(bits[~nan][:5]) == [0x7F80, 0xFF80, 0x7F80, 0x7F7F, 0x7F80]  # max rounds to inf
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    back = gtrt.from_bf16_bits(every)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back.view(np.uint32), every.astype(np.uint32) << 16)


def test_shape_tensor_input_gets_host_memory_before_shapes_are_inferred(tmp_path, standin):
    trt = standin(shape_tensors=("s",))
    res = gtrt.build_engine(_reshape(tmp_path / "r.onnx"), shapes={"x": (2, 6)})
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    r = gtrt.EngineRunner(res.engine, {"x": x, "s": np.array([3, 4], np.int64)})
    r.step()
    np.testing.assert_array_equal(r.outputs()["y"], x.reshape(3, 4))
    names = _names(trt)
    assert ("IExecutionContext.set_tensor_address", ("s", "host")) in trt.calls
    s_bound = trt.calls.index(("IExecutionContext.set_tensor_address", ("s", "host")))
    assert s_bound < names.index("IExecutionContext.infer_shapes")


def test_zero_size_tensors_never_get_a_null_address(tmp_path, standin):
    trt = standin()
    res = gtrt.build_engine(_affine(tmp_path / "m.onnx"), **AFFINE_RANGE)
    r = gtrt.EngineRunner(res.engine, {"x": np.zeros((0, 4), np.float32)})
    r.step()
    assert r.outputs()["y"].shape == (0, 4)
    assert all(c[1][0] >= 1 for c in trt.calls if c[0] == "torch.empty")
    assert {c[1][0] for c in trt.calls if c[0] == "IExecutionContext.set_tensor_address"} == {"x", "y"}


def test_parser_errors_name_the_nodes(tmp_path, standin):
    standin(parse_errors=[("conv1", "Conv", "unsupported dilations"), ("", "", "graph has no outputs")])
    with pytest.raises(GraphmpError) as e:
        gtrt.build_engine(_affine(tmp_path / "m.onnx"), **AFFINE_RANGE)
    msg = str(e.value)
    assert "\n" not in msg and "m.onnx" in msg
    assert "node 'conv1' (Conv): unsupported dilations" in msg and "graph has no outputs" in msg


def test_failed_build_quotes_what_tensorrt_logged(tmp_path, standin, capsys):
    standin(build_fails=True)
    with pytest.raises(GraphmpError, match=r"could not build the engine: .*no implementation found for node 'conv1'"):
        gtrt.build_engine(_affine(tmp_path / "m.onnx"), **AFFINE_RANGE)
    assert "TensorRT: [standin] no implementation" in capsys.readouterr().err


def test_plugins_not_registered_is_a_note(tmp_path, standin):
    standin(plugins_ok=False)
    res = gtrt.build_engine(_affine(tmp_path / "m.onnx"), **AFFINE_RANGE)
    assert any("plugins not registered" in n for n in res.to_dict()["notes"])


@pytest.mark.parametrize("switch,match", [("deserialize_fails", "could not deserialize"),
                                          ("execute_fails", "execute_async_v3 failed")])
def test_runtime_failures_are_clear_errors(tmp_path, standin, switch, match):
    standin()
    res = gtrt.build_engine(_affine(tmp_path / "m.onnx"), **AFFINE_RANGE)
    standin(**{switch: True})
    with pytest.raises(GraphmpError, match=match):
        gtrt.EngineRunner(res.engine, {"x": np.ones((3, 4), np.float32)})


def test_uncapturable_engine_runs_without_a_graph(tmp_path, standin):
    trt = standin(capture_fails=True)
    res = gtrt.build_engine(_affine(tmp_path / "m.onnx"), **AFFINE_RANGE)
    x = np.ones((3, 4), np.float32)
    r = gtrt.EngineRunner(res.engine, {"x": x})
    assert r.graph is None and "not captured" in r.cuda_graph_note
    r.buffers["y"].a[:] = 0
    r.step()
    np.testing.assert_array_equal(r.outputs()["y"], x * 2 + 1)
    assert "CUDAGraph.replay" not in _names(trt)


def test_missing_feed_and_missing_library(tmp_path, standin, monkeypatch):
    standin()
    res = gtrt.build_engine(_affine(tmp_path / "m.onnx"), **AFFINE_RANGE)
    with pytest.raises(GraphmpError, match=r"no data for engine inputs \['x'\]"):
        gtrt.EngineRunner(res.engine, {})
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt raises ImportError
    with pytest.raises(GraphmpError, match="TensorRT is not available.*graphmp\\[gpu\\]"):
        gtrt.build_engine(_affine(tmp_path / "m.onnx"), **AFFINE_RANGE)


def test_the_parser_gets_the_checked_weights_inline_and_opens_no_file(tmp_path, standin):
    """A model whose weights are in a data file beside it: TensorRT's parser is given the bytes
    graphmp read through the descriptor it checked, every weight inline, and no path; it never
    opens the data file (one swapped or linked elsewhere after the check is never read)."""
    trt = standin()
    w = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "mm",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 256])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64])],
                          [onnx.numpy_helper.from_array(w, "w")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path),
              save_as_external_data=True, all_tensors_to_one_file=True, location="w.bin", size_threshold=0)
    assert (tmp_path / "w.bin").stat().st_size == w.nbytes
    res = gtrt.build_engine(str(path), shapes={"x": (2, 256)})
    parses = [c for c in trt.calls if c[0].startswith("OnnxParser.parse")]
    assert parses == [("OnnxParser.parse", (None, False))]  # bytes, no path, no external tensor left
    (tmp_path / "w.bin").write_bytes(np.zeros_like(w).tobytes())  # what a file swapped after the check holds
    x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    r = gtrt.EngineRunner(res.engine, {"x": x})
    r.step()
    np.testing.assert_allclose(r.outputs()["y"], x @ w, rtol=1e-5, atol=1e-5)
    r.close()

"""graphmp bench / graphmp build on the CPU: the harness end to end with real ONNX Runtime
sessions on committed models, the documented JSON schema, the plot, accuracy columns that
catch a broken conversion, batching, and the TensorRT / ORT CUDA paths where they cannot run.
Each piece of graphmp/bench/ alone: the row plan, the runners (provider read back, host-sync
timing), the judge (normalised error, TF32 yardstick), the FP32 baseline's cleanups."""
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import time

import graphmp
from graphmp.bench import PRECISIONS, BenchInterrupted, bench, latency_stats, timed_loop
from graphmp.bench import judge as bjudge
from graphmp.bench import plan as bplan
from graphmp.bench import run as brun
from graphmp.bench import runners as brunners
from graphmp.cli import main
from graphmp.errors import GraphmpError
from graphmp.model_runs import cuda_available
from graphmp.inputs import parse_shapes
from graphmp.progress import Progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESNET = os.path.join(ROOT, "models", "tiny", "resnet.onnx")      # logits [batch, 10], symbolic batch
MNIST = os.path.join(ROOT, "models", "real", "mnist_cntk.onnx")    # fixed input [1, 1, 28, 28]
FAST = dict(warmup=1, iterations=3, min_time=0.0, progress=False)


def _has_tensorrt():
    try:
        import tensorrt  # noqa: F401
        return True
    except Exception:
        return False


# --- the documented JSON schema (graphmp/bench/__init__.py docstring, benchmarks/README.md) -----------------

NUM = (int, float)


def _check_schema(d):
    assert d["schema_version"] == 2 and d["timing"] == "host-sync"
    env = d["environment"]
    for k in ("device", "gpus", "cpu", "cpu_count", "driver", "cuda", "cudnn", "tensorrt", "onnxruntime",
              "onnxruntime_package", "onnx", "numpy", "torch", "onnxconverter_common", "graphmp", "python",
              "platform", "command", "timestamp"):
        assert k in env, k
    assert isinstance(env["device"], str) and env["device"] and isinstance(env["command"], str)
    assert env["onnxruntime"] and env["onnx"] and env["numpy"] and env["graphmp"] == graphmp.__version__
    s = d["settings"]
    for k in ("backends", "precisions", "batches", "data", "shapes", "inputs", "seed", "warmup", "iterations", "min_time_s",
              "rounds", "atol", "rtol", "cudnn_conv_algo_search", "compare_occ", "compare", "oracle_max_mb",
              "max_error", "tf32_factor", "rule", "timing", "model_type"):
        assert k in s, k
    m = d["model"]
    assert "max(" in s["rule"] and "TF32" in s["rule"]
    for k in ("path", "fp32_baseline", "converted_path", "conversion", "compared", "fp32_available", "weight_bytes",
              "inputs", "fixed_batch"):
        assert k in m, k
    assert all(set(i) == {"name", "dtype", "shape"} for i in m["inputs"])
    for name, b in d["backends"].items():
        assert name in ("trt", "ort-cuda", "ort-cpu") and b["status"] in ("ok", "skipped", "fell-back")
        assert (b["reason"] is None) == (b["status"] == "ok")
    for r in d["rows"]:
        for k in ("backend", "precision", "variant", "provider", "label", "model", "batch", "tf32", "status",
                  "error", "settings",
                  "latency_ms", "iterations", "throughput_per_s", "speedup_vs_fp32", "speedup_vs_tf32",
                  "peak_device_memory_bytes", "memory_note", "engine_bytes", "build_s", "output_shapes",
                  "accuracy"):
            assert k in r, k
        assert r["precision"] in PRECISIONS and r["status"] in ("ok", "failed")
        assert r["variant"] in bplan.VARIANTS
        if r["status"] != "ok":
            assert isinstance(r["error"], str) and r["error"]
            continue
        lat = r["latency_ms"]
        assert 0 < lat["min"] <= lat["median"] <= lat["p90"] <= lat["p99"] <= lat["max"]
        assert r["iterations"] >= d["settings"]["iterations"]
        assert r["throughput_per_s"] == pytest.approx(r["batch"] / (lat["median"] / 1e3))
        assert isinstance(r["build_s"], NUM) and r["build_s"] >= 0
        # labelled by what ran: the provider read back from the session
        assert r["provider"] == {"ort-cpu": "CPUExecutionProvider", "ort-cuda": "CUDAExecutionProvider",
                                 "trt": "TensorRT"}[r["backend"]]
        assert r["settings"]["timing"] == "host-sync"
        acc = r["accuracy"]
        if acc is not None:
            assert isinstance(acc["passed"], bool) and isinstance(acc["max_abs"], NUM)
            assert isinstance(acc["error"], NUM) and isinstance(acc["cosine"], NUM)
            assert isinstance(acc["nonfinite"], int) and acc["outputs"] and acc["yardstick"]
    for f in d["fastest"]:
        assert f["variant"] in f["by_variant"] and f["median_ms"] == min(f["by_variant"].values())
    for o in d["oracle"]:
        assert o["status"] in ("ok", "skipped", "failed") and o["precision"] in ("fp16", "occ")
    assert all(isinstance(n, str) for n in d["notes"])
    assert d["partial"] in (True, False) and (d["interrupted"] is None) == (not d["partial"])
    json.dumps(d, allow_nan=False)  # strict JSON: no NaN/Infinity


# --- the harness --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def resnet_result():
    return bench(RESNET, backends="ort-cpu", batches=(1, 4), compare_occ=True, **FAST)


def test_bench_ort_cpu_end_to_end(resnet_result):
    d = resnet_result.to_dict()
    _check_schema(d)
    rows = {(r["precision"], r["batch"]): r for r in d["rows"]}
    # CPU: no TF32 rows; fp32, graphmp mixed and onnxconverter-common, at both batches
    assert set(rows) == {(p, b) for p in ("fp32", "fp16", "occ") for b in (1, 4)}
    assert all(r["status"] == "ok" and r["backend"] == "ort-cpu" for r in rows.values())
    for b in (1, 4):  # batch override: every output's first dim is the batch
        for r in (rows[("fp32", b)], rows[("fp16", b)]):
            assert r["output_shapes"] == {"logits": [b, 10]}
        assert rows[("fp32", b)]["speedup_vs_fp32"] == pytest.approx(1.0)
        assert rows[("fp16", b)]["speedup_vs_fp32"] == pytest.approx(
            rows[("fp32", b)]["latency_ms"]["median"] / rows[("fp16", b)]["latency_ms"]["median"])
        assert rows[("fp16", b)]["speedup_vs_tf32"] is None  # no TF32 on the CPU
        # the FP32 row computes what the reference does; the honest conversion passes with a small error
        assert rows[("fp32", b)]["accuracy"]["max_abs"] == 0.0 and rows[("fp32", b)]["accuracy"]["cosine"] == 1.0
        acc = rows[("fp16", b)]["accuracy"]
        assert acc["passed"] and 0 < acc["max_abs"] < 1e-2 and acc["argmax_agree"] == 1.0
        assert 0 < acc["error"] < 1e-2 and acc["cosine"] > 0.9999
        # no tf32 row on the CPU: the yardstick is TF32 emulated on ORT CPU, non-zero and small
        assert acc["yardstick"] == bjudge.EMULATED and 0 < acc["tf32_error"] < 1e-2
        assert acc["vs_tf32"] == pytest.approx(acc["error"] / acc["tf32_error"])
        assert all(r["variant"] == "default" for r in rows.values())
    assert d["model"]["conversion"]["nodes"]["low"] > 0
    # the FP16-faithful oracle ran on both mixed models (small model) and passed
    assert [(o["precision"], o["status"], o["passed"]) for o in d["oracle"]] == [("fp16", "ok", True),
                                                                                ("occ", "ok", True)]
    assert "FP16-faithful" in d["oracle"][0]["oracle"]
    assert any("computes almost every FP16 op in FP32" in n for n in d["notes"])


def test_table_lists_every_row_and_the_environment(resnet_result):
    t = resnet_result.table()
    for p in ("fp32", "fp16", "occ"):
        for b in (1, 4):
            assert any(line.startswith(f"| ort-cpu | {p}") and f"| {b} " in line for line in t.splitlines()), (p, b)
    assert "median ms" in t and "vs TF32" in t and "argmax" in t and "x TF32" in t and "cosine" in t
    assert "TF32 yardstick, batch 1" in t and "timing: host-sync" in t
    assert "FP16-faithful oracle, fp16" in t
    assert resnet_result.to_dict()["environment"]["device"] in t
    assert "command: graphmp.bench(" in t


def test_plot_is_a_png(resnet_result, tmp_path):
    out = resnet_result.plot(tmp_path / "b.png")
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_accuracy_columns_flag_a_broken_conversion(tmp_path):
    conv = graphmp.convert(RESNET).model
    gemm = next(n for n in conv.graph.node if n.op_type == "Gemm")
    w = next(t for t in conv.graph.initializer if t.name == gemm.input[1])
    w.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(w), w.name))  # classifier weights negated
    broken = str(tmp_path / "broken.mp.onnx")
    onnx.save(conv, broken)
    d = bench(RESNET, converted=broken, backends="ort-cpu", batches=(8,), precisions="fp32,fp16",
              oracle_max_mb=0, **FAST).to_dict()
    fp32, fp16 = (next(r for r in d["rows"] if r["precision"] == p) for p in ("fp32", "fp16"))
    assert fp32["accuracy"]["passed"] and fp32["accuracy"]["argmax_agree"] == 1.0
    assert not fp16["accuracy"]["passed"]
    assert fp16["accuracy"]["max_abs"] > 0.5 and fp16["accuracy"]["argmax_agree"] < 0.5
    assert fp16["accuracy"]["error"] > 1.0 and fp16["accuracy"]["cosine"] < 0  # negated logits point away
    assert d["model"]["converted_path"] == broken and d["model"]["conversion"] is None


def _unknown_to_ort(model):
    """Make one Relu an op of a custom domain: onnx's checker accepts it (no schema to
    check), ONNX Runtime has no kernel for it. (An unknown op of the ONNX domain is
    refused when the model loads, before any row.)"""
    n = next(n for n in model.graph.node if n.op_type == "Relu")
    n.op_type, n.domain = "NoSuchOp", "com.example"
    model.opset_import.append(onnx.helper.make_opsetid("com.example", 1))


def test_a_failing_row_is_recorded_and_the_run_goes_on(tmp_path):
    conv = graphmp.convert(RESNET).model
    _unknown_to_ort(conv)  # a valid model ONNX Runtime cannot load
    bad = str(tmp_path / "bad.mp.onnx")
    onnx.save(conv, bad)
    res = bench(RESNET, converted=bad, backends="ort-cpu", batches=(2,), precisions="fp32,fp16", oracle_max_mb=0,
                **FAST)
    d = res.to_dict()
    _check_schema(d)
    fp32, fp16 = (next(r for r in d["rows"] if r["precision"] == p) for p in ("fp32", "fp16"))
    assert fp32["status"] == "ok" and fp32["latency_ms"]["median"] > 0
    assert fp16["status"] == "failed" and "NoSuchOp" in fp16["error"] and fp16["latency_ms"] is None
    assert fp16["provider"] is None  # no session came up
    assert "FAILED" in res.table()


def test_data_npz_is_rebatched(tmp_path):
    x = np.random.default_rng(1).standard_normal((3, 3, 32, 32)).astype(np.float32)
    npz = tmp_path / "in.npz"
    np.savez(npz, pixel_values=x)
    d = bench(RESNET, backends="ort-cpu", batches=(5,), data=str(npz), precisions="fp32", oracle_max_mb=0,
              **FAST).to_dict()
    (row,) = d["rows"]
    assert row["output_shapes"] == {"logits": [5, 10]} and row["batch"] == 5
    assert d["settings"]["data"] == str(npz)
    # the rows 3 and 4 repeat samples 0 and 1: same inputs, same FP32 outputs
    from graphmp.inputs import rebatch
    xb = rebatch({"pixel_values": x}, [("pixel_values", 0)], 5)["pixel_values"]
    assert xb.shape == (5, 3, 32, 32) and np.array_equal(xb[3], x[0]) and np.array_equal(xb[4], x[1])


def test_fixed_batch_model_runs_its_own_batch_with_a_note():
    d = bench(MNIST, backends="ort-cpu", batches=(1, 8), precisions="fp32,fp16", oracle_max_mb=0, **FAST).to_dict()
    assert d["model"]["fixed_batch"] == 1
    assert {(r["precision"], r["batch"]) for r in d["rows"]} == {("fp32", 1), ("fp16", 1)}
    assert all(r["status"] == "ok" for r in d["rows"])
    assert any("batch cannot change" in n for n in d["notes"])


def test_already_converted_model_runs_only_its_rows(tmp_path):
    mp = str(tmp_path / "r.mp.onnx")
    graphmp.convert(RESNET, mp)
    d = bench(mp, backends="ort-cpu", **FAST).to_dict()
    assert [r["precision"] for r in d["rows"]] == ["fp16"]
    assert d["rows"][0]["accuracy"] is None and not d["model"]["fp32_available"]
    assert any("already converted" in n for n in d["notes"])


@pytest.mark.skipif(_has_tensorrt(), reason="TensorRT is installed here")
def test_missing_tensorrt_is_skipped_with_install_message_and_cpu_still_runs():
    d = bench(RESNET, backends="trt,ort-cpu", precisions="fp32", oracle_max_mb=0, **FAST).to_dict()
    assert d["backends"]["trt"]["status"] == "skipped"
    assert "pip install 'graphmp[gpu]'" in d["backends"]["trt"]["reason"]
    assert "NVIDIA GPU" in d["backends"]["trt"]["reason"]
    assert [r["backend"] for r in d["rows"]] == ["ort-cpu"] and d["rows"][0]["status"] == "ok"


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(GraphmpError, match="unknown backend"):
        bench(RESNET, backends="ort-gpu")
    with pytest.raises(GraphmpError, match="unknown precision"):
        bench(RESNET, precisions="int8")
    with pytest.raises(GraphmpError, match="--compare"):
        bench(RESNET, compare="tf-trt")
    with pytest.raises(GraphmpError, match="--model-type"):
        bench(RESNET, compare="ort-opt", model_type="resnet")
    with pytest.raises(GraphmpError, match="positive integers"):
        bench(RESNET, batches="1,x")
    with pytest.raises(GraphmpError, match="no such file"):
        bench(str(tmp_path / "missing.onnx"))
    np.savez(tmp_path / "wrong.npz", other=np.zeros((1, 3), np.float32))
    with pytest.raises(GraphmpError, match="pixel_values"):
        bench(RESNET, backends="ort-cpu", data=str(tmp_path / "wrong.npz"), **FAST)


# --- the row plan ---------------------------------------------------------------------------------

def test_plan_cpu_has_no_tf32_and_no_session_variants():
    rows = bplan.plan_rows(["ort-cpu"], ["fp32", "tf32", "fp16", "occ"], [1, 8])
    assert [(r.precision, r.batch, r.variant) for r in rows] == [
        (p, b, "default") for b in (1, 8) for p in ("fp32", "fp16", "occ")]


def test_plan_ort_cuda_runs_every_precision_with_nhwc_and_cuda_graph_when_static():
    rows = bplan.plan_rows(["ort-cuda", "trt"], ["fp32", "tf32", "fp16", "occ"], [32], static=True)
    cuda = [(r.precision, r.variant) for r in rows if r.backend == "ort-cuda"]
    assert cuda == [(p, v) for p in ("fp32", "tf32", "fp16", "occ") for v in ("default", "nhwc", "cuda-graph")]
    assert {r.variant for r in rows if r.backend == "trt"} == {"default"}
    opt = bplan.plan_rows(["trt", "ort-cpu"], ["fp16", "ort-opt"], [1])
    assert [(r.backend, r.precision) for r in opt] == [("trt", "fp16"), ("ort-cpu", "fp16"), ("ort-cpu", "ort-opt")]
    dyn = bplan.plan_rows(["ort-cuda"], ["tf32", "fp16"], [1], static=False)
    assert [(r.precision, r.variant) for r in dyn] == [("tf32", "default"), ("tf32", "nhwc"), ("fp16", "default"),
                                                       ("fp16", "nhwc")]
    with pytest.raises(GraphmpError, match="unknown backend"):
        bplan.plan_rows(["ort-gpu"], ["fp32"], [1])


def test_static_shapes_finds_data_dependent_ops():
    assert bplan.static_shapes(onnx.load(RESNET)) == (True, None)
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("NonZero", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, [1, None])])
    static, why = bplan.static_shapes(helper.make_model(g))
    assert not static and "NonZero" in why


def test_ort_cuda_options_per_precision_and_variant():
    o = brunners.ort_cuda_options
    assert o("fp32", "default", "EXHAUSTIVE")["use_tf32"] == "0"
    assert o("tf32", "default", "EXHAUSTIVE")["use_tf32"] == "1" and o("fp16", "default", "DEFAULT")["use_tf32"] == "1"
    assert o("fp16", "nhwc", "EXHAUSTIVE")["prefer_nhwc"] == "1" and "enable_cuda_graph" not in o("fp16", "nhwc", "X")
    assert o("occ", "cuda-graph", "EXHAUSTIVE")["enable_cuda_graph"] == "1" and "prefer_nhwc" not in o("occ", "cuda-graph", "X")
    assert "prefer_nhwc" not in o("fp32", "default", "X") and "enable_cuda_graph" not in o("fp32", "default", "X")


# --- rows labelled by what ran --------------------------------------------------------------------

@pytest.mark.skipif(cuda_available(), reason="this ONNX Runtime has a CUDA provider")
def test_ort_cuda_session_on_the_cpu_raises_fell_back_naming_the_provider():
    feeds = {"pixel_values": np.zeros((1, 3, 32, 32), np.float32)}
    with pytest.raises(brunners.FellBack, match="ran CPUExecutionProvider") as e:
        brunners.OrtRunner(RESNET, feeds, "cuda", brunners.ort_cuda_options("tf32", "default", "DEFAULT"))
    assert e.value.provider == "CPUExecutionProvider"
    r = brunners.OrtRunner(RESNET, feeds, "cpu")
    assert r.provider == "CPUExecutionProvider" and r.settings["providers"] == ["CPUExecutionProvider"]
    r.run()
    assert r.outputs()["logits"].shape == (1, 10)


@pytest.mark.skipif(cuda_available(), reason="this ONNX Runtime has a CUDA provider")
def test_ort_cuda_asked_but_cpu_ran_never_gives_a_cuda_row(monkeypatch):
    # as with an onnxruntime-gpu whose CUDA libraries do not load: the provider is listed, the
    # session comes up on the CPU. Real sessions of the CPU onnxruntime here.
    monkeypatch.setattr(brun, "ort_cuda_status", lambda: None)
    res = bench(RESNET, backends="ort-cuda,ort-cpu", precisions="fp32,fp16", oracle_max_mb=0, **FAST)
    d = res.to_dict()
    _check_schema(d)
    cuda = [r for r in d["rows"] if r["backend"] == "ort-cuda"]
    assert cuda and all(r["status"] == "failed" and r["latency_ms"] is None for r in cuda)
    assert all(r["provider"] == "CPUExecutionProvider" and "ran CPUExecutionProvider" in r["error"] for r in cuda)
    assert d["backends"]["ort-cuda"]["status"] == "fell-back"
    cpu = [r for r in d["rows"] if r["backend"] == "ort-cpu"]
    assert cpu and all(r["status"] == "ok" for r in cpu)
    table = res.table()
    assert "ort-cuda: fell-back" in table
    assert not any(line.startswith("| ort-cuda") and "| CUDA" in line for line in table.splitlines())


# --- timing parity -------------------------------------------------------------------------------

class _FakeEngineRunner:
    """Stand-in for graphmp.trt.EngineRunner (no TensorRT here): step() blocks ~5 ms on the
    host and claims a device time of 1000 s, which host-sync timing must not use."""

    def __init__(self, engine, feeds):
        self.graph, self.cuda_graph_note = None, "stand-in"
        self.closed = False

    def step(self):
        time.sleep(0.005)
        return 1000.0

    def outputs(self):
        return {"y": np.zeros(2, np.float32)}

    def close(self):
        self.closed = True


def test_tensorrt_rows_are_timed_on_the_host_like_ort_rows(monkeypatch):
    import graphmp.trt as gtrt

    class Built:
        engine, seconds = b"x" * 10, 0.5
    calls = {}

    def fake_build(path, out, *, shapes, tf32, timing_cache, workspace_mb):
        calls.update(shapes=shapes, tf32=tf32)
        return Built()
    monkeypatch.setattr(gtrt, "build_engine", fake_build)
    monkeypatch.setattr(gtrt, "EngineRunner", _FakeEngineRunner)
    feeds = {"x": np.zeros((2, 3), np.float32)}
    trt = brunners.TrtRunner("m.onnx", feeds, tf32=False, timing_cache=None, workspace_mb=None)
    assert calls == {"shapes": {"x": (2, 3)}, "tf32": False} and trt.engine_bytes == 10
    cpu = brunners.OrtRunner(RESNET, {"pixel_values": np.zeros((1, 3, 32, 32), np.float32)}, "cpu")
    times = brunners.time_interleaved([("trt", trt), ("cpu", cpu)], rounds=2, iterations=4, min_time=0.0)
    assert len(times["trt"]) == 4 and all(0.004 < t < 0.5 for t in times["trt"])  # host time, not 1000 s
    assert len(times["cpu"]) == 4 and all(0 < t < 0.5 for t in times["cpu"])
    trt.close()
    assert trt._runner.closed and trt.provider == "TensorRT"


def test_host_step_times_a_synchronized_run():
    class Slow:
        def run(self):
            time.sleep(0.02)
    t = brunners.host_step(Slow())()
    assert 0.019 < t < 0.5


def test_speedups_compare_the_same_variant_and_fastest_variant_is_named():
    def row(p, v, ms):
        return {"backend": "ort-cuda", "batch": 32, "precision": p, "variant": v, "status": "ok",
                "latency_ms": {"median": ms}, "speedup_vs_fp32": None, "speedup_vs_tf32": None}
    rows = [row("tf32", "default", 4.0), row("tf32", "nhwc", 3.0), row("fp16", "default", 2.0),
            row("fp16", "nhwc", 1.5), row("fp16", "cuda-graph", 1.0)]
    brun.add_speedups(rows)
    assert rows[2]["speedup_vs_tf32"] == pytest.approx(2.0) and rows[3]["speedup_vs_tf32"] == pytest.approx(2.0)
    assert rows[4]["speedup_vs_tf32"] is None  # no tf32 cuda-graph row: not compared across options
    fast = brun.fastest_variants(rows)
    assert [(f["precision"], f["variant"], f["median_ms"]) for f in fast] == [("tf32", "nhwc", 3.0),
                                                                             ("fp16", "cuda-graph", 1.0)]


def test_a_speedup_from_noisy_timings_is_marked_and_explained():
    """A p99 1000x the median (a busy CPU) made 1.45x or 20x 'speedups' out of nothing: such
    ratios are marked '?' in the table and the plot, flagged in the JSON and explained."""
    from graphmp.bench import report as breport
    from graphmp.bench import rows as brows

    def row(p, median, p90, p99):
        return {"backend": "ort-cpu", "batch": 1, "precision": p, "variant": "default", "status": "ok",
                "latency_ms": {"median": median, "p90": p90, "p99": p99}, "speedup_vs_fp32": None,
                "speedup_vs_tf32": None}
    steady = [row("fp32", 2.0, 2.1, 2.2), row("fp16", 1.0, 1.05, 1.1)]
    brun.add_speedups(steady)
    assert steady[1]["speedup_vs_fp32"] == pytest.approx(2.0) and not steady[1]["speedup_noisy"]
    assert not steady[0]["speedup_noisy"]  # the fp32 row against itself: no comparison to doubt
    assert brows.noise_note(steady) is None and breport._speedup(steady[1], "speedup_vs_fp32") == "2.00"
    busy = [row("fp32", 2.0, 2.1, 2000.0), row("fp16", 1.38, 1.4, 1.5)]
    brun.add_speedups(busy)
    assert busy[1]["speedup_noisy"] and breport._speedup(busy[1], "speedup_vs_fp32") == "1.45?"
    note = brows.noise_note(busy)
    assert "1 row(s)" in note and "worst: ort-cpu fp32 batch 1, p99 1000.0x its median" in note and "--iterations" in note
    assert brows.noisy(row("fp16", 1.0, 1.3, 1.4)) and not brows.noisy(row("fp16", 1.0, 1.2, 1.9))


def test_the_plot_title_is_wrapped_to_the_figure():
    from graphmp.bench import report as breport
    line = "bar labels: speedup vs FP32 strict (latency where there is no FP32 row); timing " + "x" * 150
    wrapped = breport._wrapped(["model.onnx on a CPU", line], 5.5, 9)
    chars = int(5.5 * 72 / (9 * 0.55))
    assert all(len(x) <= chars for x in wrapped.splitlines()) and len(wrapped.splitlines()) >= 3
    assert "".join(wrapped.split()) == "".join(("model.onnx on a CPU " + line).split())  # nothing lost


# --- the accuracy judge ---------------------------------------------------------------------------

def test_normalised_error_is_not_dominated_by_near_zero_references():
    ref = np.array([[1000.0, 1e-6, 5.0]], np.float32)
    got = np.array([[1000.1, 2e-6, 5.0]], np.float32)
    m = bjudge.output_metrics(ref, got)
    assert m["error"] == pytest.approx(0.1 / 1000, rel=1e-3)       # not 1.0 (= |2e-6 - 1e-6| / 1e-6)
    assert m["max_abs"] == pytest.approx(0.1, rel=1e-3) and m["argmax_agree"] == 1.0
    r, g = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    assert m["cosine"] == pytest.approx(r @ g / np.linalg.norm(r) / np.linalg.norm(g))
    s = bjudge.output_metrics(np.array([3.0, 4.0]), np.array([3.0, 4.5]))
    assert s["snr_db"] == pytest.approx(10 * np.log10(25 / 0.25)) and s["argmax_agree"] is None
    bad = bjudge.output_metrics(np.ones((2, 3)), np.array([[1, np.inf, 1], [1, 1, 1]]))
    assert bad["nonfinite"] == 1 and bad["error"] == float("inf")


def test_judge_allows_k_times_the_tf32_error():
    ref = {"y": np.linspace(-1, 1, 64).reshape(4, 16)}
    got = {"y": ref["y"] + 3e-3 * np.sign(ref["y"])}  # error 3e-3, argmax unchanged
    ok = bjudge.judge_outputs(ref, got, {"y": 2e-3}, max_error=1e-3, k=2.0)    # allowed max(1e-3, 4e-3)
    assert ok["passed"] and ok["error"] == pytest.approx(3e-3) and ok["vs_tf32"] == pytest.approx(1.5)
    assert ok["outputs"]["y"]["allowed"] == pytest.approx(4e-3)
    tight = bjudge.judge_outputs(ref, got, {"y": 1e-3}, max_error=1e-3, k=2.0)  # allowed 2e-3
    assert not tight["passed"]
    floor = bjudge.judge_outputs(ref, got, None, max_error=1e-2)                # no yardstick: the budget
    assert floor["passed"] and floor["tf32_error"] is None
    assert not bjudge.judge_outputs(ref, got, {"y": 2e-3}, 1e-3, 2.0, atol=1e-4, rtol=0)["passed"]
    missing = bjudge.judge_outputs(ref, {}, {"y": 1.0})
    assert not missing["passed"]
    assert "max(0.001, 2 x the TF32 error" in bjudge.rule_text(1e-3, 2.0)


# --- the FP32 baseline gets graphmp's cleanups ----------------------------------------------------

def _ir3_model(path):
    """MatMul by a weight that is also a graph input (IR < 4 style: ORT treats it as an input
    that could be fed, so it cannot fold it); prepare turns it into a constant."""
    from onnx import TensorProto, helper
    w = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 3
    onnx.save(m, path)


def test_fp32_baseline_has_the_cleanups_of_the_converted_model(tmp_path):
    src = str(tmp_path / "ir3.onnx")
    _ir3_model(src)
    keep = tmp_path / "keep"
    d = bench(src, backends="ort-cpu", precisions="fp32,fp16", keep=str(keep), oracle_max_mb=0, **FAST).to_dict()
    base = d["model"]["fp32_baseline"]
    assert base["prepare"]["initializers_removed_from_inputs"] == 1 and base["nodes_low"] == 0
    assert base["casts_added"] == 0
    m = onnx.load(base["path"])
    assert [i.name for i in m.graph.input] == ["x"] and [t.name for t in m.graph.initializer] == ["w"]
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in m.graph.initializer)
    assert "graphmp" not in {p.key for p in m.metadata_props}  # not marked as a converted model
    mixed = onnx.load(d["model"]["converted_path"])
    assert [i.name for i in mixed.graph.input] == ["x"]  # the same cleanup in the converted model
    fp32 = next(r for r in d["rows"] if r["precision"] == "fp32")
    assert fp32["status"] == "ok" and fp32["settings"]["model_file"] == os.path.basename(base["path"])
    assert fp32["accuracy"]["error"] < 1e-6  # same computation as the source


# --- --compare ort-opt ----------------------------------------------------------------------------

def _has(mod):
    try:
        __import__(mod)
        return True
    except ImportError:
        return False


BERT = os.path.join(ROOT, "models", "tiny", "bert.onnx")


@pytest.mark.skipif(not _has("sympy"), reason="ONNX Runtime's transformers optimizer needs sympy")
def test_compare_ort_opt_on_tiny_bert_is_a_judged_row():
    d = bench(BERT, backends="ort-cpu", precisions="fp32,fp16", compare="ort-opt", oracle_max_mb=0,
              **FAST).to_dict()
    _check_schema(d)
    info = d["model"]["compared"]["ort-opt"]
    assert info["model_type"] == "bert" and info["guessed"] and sum(info["fused"].values()) > 0
    row = next(r for r in d["rows"] if r["precision"] == "ort-opt")
    assert row["status"] == "ok", row["error"]
    m = onnx.load(os.path.join(os.path.dirname(BERT), "bert.onnx"))
    assert set(row["output_shapes"]) == {o.name for o in m.graph.output}
    acc = row["accuracy"]
    assert acc["error"] < 5e-2 and acc["cosine"] > 0.999 and acc["yardstick"] == bjudge.EMULATED


@pytest.mark.skipif(_has("sympy"), reason="sympy is installed here")
def test_compare_ort_opt_without_sympy_fails_its_row_and_says_how():
    d = bench(BERT, backends="ort-cpu", precisions="fp32", compare="ort-opt", oracle_max_mb=0, **FAST).to_dict()
    row = next(r for r in d["rows"] if r["precision"] == "ort-opt")
    assert row["status"] == "failed" and "pip install sympy" in row["error"]
    assert next(r for r in d["rows"] if r["precision"] == "fp32")["status"] == "ok"
    assert "pip install sympy" in d["model"]["compared"]["ort-opt"]["error"]


def test_model_type_is_guessed_from_the_graph():
    from graphmp.bench import guess_model_type
    tiny = os.path.join(ROOT, "models", "tiny")
    assert guess_model_type(onnx.load(os.path.join(tiny, "bert.onnx"))) == "bert"
    assert guess_model_type(onnx.load(os.path.join(tiny, "gpt2.onnx"))) == "gpt2"
    assert guess_model_type(onnx.load(os.path.join(tiny, "vit.onnx"))) == "vit"


def test_shapes_pin_other_dims_and_batch_sets_the_batch():
    shapes = "input_ids:1x16,attention_mask:1x16,token_type_ids:1x16"
    d = bench(BERT, backends="ort-cpu", precisions="fp32,fp16", shapes=shapes, batches=(3,), oracle_max_mb=0,
              **FAST).to_dict()
    assert d["model"]["fixed_batch"] is None and d["settings"]["shapes"]
    for r in d["rows"]:
        assert r["status"] == "ok" and r["batch"] == 3
        assert r["output_shapes"]["last_hidden_state"][:2] == [3, 16] and r["output_shapes"]["pooler_output"][0] == 3


def test_dynamic_hw_model_with_shapes_gives_finished_fp32_and_fp16_rows(tmp_path):
    from onnx import TensorProto, helper
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["y"])], "det",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, "H", "W"])], [w])
    src = str(tmp_path / "det.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    rc = main(["bench", src, "--backends", "ort-cpu", "--precisions", "fp32,fp16", "--shapes", "x:1x3x40x24",
               "--batch", "2", "--warmup", "0", "--iterations", "2", "--min-time", "0", "--oracle-max-mb", "0", "-q",
               "--json", str(tmp_path / "d.json")])
    d = json.load(open(tmp_path / "d.json"))
    assert rc == 0 and [(r["precision"], r["status"]) for r in d["rows"]] == [("fp32", "ok"), ("fp16", "ok")]
    assert all(r["output_shapes"] == {"y": [2, 8, 40, 24]} and r["accuracy"]["passed"] for r in d["rows"])


# --- timing helpers -----------------------------------------------------------------------------

def test_timed_loop_meets_both_count_and_time():
    calls = []

    def step():
        calls.append(1)
        return 0.125  # each step reports its own duration (exact in binary)

    ticks = []
    times = timed_loop(step, warmup=2, iterations=3, min_time=1.0, tick=lambda n, t: ticks.append((n, t)))
    assert len(times) == 8 and len(calls) == 10  # 1 s needs 8 steps of 0.125 s; warm-up untimed
    assert ticks == [(n, 0.125 * n) for n in range(1, 9)]  # after each timed step: steps and seconds so far
    assert len(timed_loop(step, warmup=0, iterations=5, min_time=0.0)) == 5
    s = latency_stats([0.001, 0.002, 0.003, 0.004, 0.100])
    assert s["median"] == pytest.approx(3.0) and s["min"] == pytest.approx(1.0) and s["max"] == pytest.approx(100.0)
    assert s["median"] <= s["p90"] <= s["p99"] <= s["max"]


def test_rows_are_timed_in_interleaved_rounds():
    d = bench(RESNET, backends="ort-cpu", precisions="fp32,fp16", warmup=0, iterations=4, min_time=0.0, rounds=3,
              oracle_max_mb=0, progress=False).to_dict()
    # ceil(4 / 3) = 2 steps per round and row, 3 rounds: 6 timed steps each, at least `iterations`
    assert [r["iterations"] for r in d["rows"]] == [6, 6] and d["settings"]["rounds"] == 3
    with pytest.raises(GraphmpError, match="rounds >= 1"):
        bench(RESNET, rounds=0)


# --- progress inside a row, and Ctrl-C (issue 22) --------------------------------------------------

BENCH_2 = ["bench", RESNET, "--backends", "ort-cpu", "--precisions", "fp32,fp16", "--warmup", "2",
           "--iterations", "3", "--min-time", "0", "--oracle-max-mb", "0"]


def test_progress_inside_a_row_goes_to_stderr_and_not_with_quiet(monkeypatch, capsys):
    """Progress lines: with -v (or on a terminal, as tests/test_cli_output.py checks), on
    stderr; none by default into a pipe or file (a log), none with -q."""
    monkeypatch.setattr(brun, "ROW_PROGRESS_S", 0.0)  # every warm-up and timed run may say how far it got
    assert main(BENCH_2 + ["--batch", "2"]) == 0
    out, err = capsys.readouterr()
    assert "warm-up" not in err and "s timed" not in err and "| ort-cpu | fp16" in out
    assert main(BENCH_2 + ["--batch", "2", "-v"]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    # 3 iterations in 5 rounds: ceil(3/5) = 1 run per round, 5 runs per row
    for p in ("fp32", "fp16"):
        assert f"  ort-cpu {p} batch 2: warm-up 2/2, " in err
        assert any(re.fullmatch(rf"  ort-cpu {p} batch 2: run 5/5, \d+\.\d s timed, round 5/5", ln) for ln in lines)
    assert "warm-up" not in out and "s timed" not in out and "| ort-cpu | fp16" in out  # stdout: the table only
    assert main(BENCH_2 + ["--batch", "2", "-q"]) == 0
    out, err = capsys.readouterr()
    assert "warm-up" not in err and "s timed" not in err and "| ort-cpu | fp16" in out
    # the helper: throttled, the line built only when drawn, nothing when disabled
    buf, built = io.StringIO(), []
    bar = Progress(total=1, stream=buf, status_interval=3600)
    bar.status(lambda: built.append(1) or "x")
    assert buf.getvalue() == "" and built == []
    bar.status_interval = 0.0
    bar.status("  now")
    assert buf.getvalue() == "  now\n"
    Progress(stream=buf, enabled=False, status_interval=0.0).status("  never")
    assert "never" not in buf.getvalue()


def _interrupt_on_row(monkeypatch, n):
    """Ctrl-C during the timed runs of the n-th row that is timed (the others time normally)."""
    seen, real = [], brunners.host_step

    def host_step(runner):
        if runner not in seen:
            seen.append(runner)
        if len(seen) >= n:
            raise KeyboardInterrupt
        return real(runner)
    monkeypatch.setattr(brunners, "host_step", host_step)


def test_ctrl_c_keeps_the_finished_rows_in_the_table_and_json_and_exits_130(monkeypatch, tmp_path, capsys):
    _interrupt_on_row(monkeypatch, 3)  # rows: fp32, fp16 at batch 1 (timed together), then batch 4: fp32 is cut
    js = tmp_path / "b.json"
    rc = main(BENCH_2 + ["--batch", "1,4", "--json", str(js)])
    out, err = capsys.readouterr()
    assert rc == 130
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    d = json.load(open(js))
    _check_schema(d)
    assert d["partial"] is True and [(r["precision"], r["batch"], r["status"]) for r in d["rows"]] == [
        ("fp32", 1, "ok"), ("fp16", 1, "ok")]
    assert all(r["latency_ms"]["median"] > 0 and r["iterations"] >= 3 for r in d["rows"])
    assert "while timing ort-cpu fp32 batch 4 (run 1/5, round 1/5)" in d["interrupted"]
    assert "2 of 4 planned rows finished" in d["interrupted"]
    assert os.listdir(tmp_path) == ["b.json"]  # written atomically: no temporary file left
    table = [[c.strip() for c in ln.split("|")[1:6]] for ln in out.splitlines() if ln.startswith("| ort-cpu")]
    assert table == [["ort-cpu", "fp32", "default", "CPU", "1"], ["ort-cpu", "fp16", "default", "CPU", "1"]]
    assert f"PARTIAL: {d['interrupted']}" in out
    assert f'graphmp: interrupted (Ctrl-C): 2 rows had finished (the table above; {js} with "partial": true)' in err


def test_ctrl_c_in_a_warm_up_raises_bench_interrupted_with_the_finished_rows(monkeypatch):
    runs, real = [], brunners.OrtRunner.run

    def run(self):  # Ctrl-C in the first warm-up run of the third row opened
        if self not in runs:
            runs.append(self)
        if len(runs) == 3:
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(brunners.OrtRunner, "run", run)
    with pytest.raises(BenchInterrupted) as e:
        bench(RESNET, backends="ort-cpu", precisions="fp32,fp16", batches=(1, 4), **FAST)
    assert isinstance(e.value, KeyboardInterrupt)  # a caller that does not catch it stops as on any Ctrl-C
    d = e.value.result.to_dict()
    _check_schema(d)
    assert d["partial"] and [(r["precision"], r["batch"]) for r in d["rows"]] == [("fp32", 1), ("fp16", 1)]
    assert "while warming up ort-cpu fp32 batch 4 (run 1/1)" in d["interrupted"]
    assert all(r["accuracy"] is None and "interrupted" in r["accuracy_note"] for r in d["rows"])
    assert [o["status"] for o in d["oracle"]] == ["skipped"] and "interrupted" in d["oracle"][0]["reason"]


def test_parse_shapes():
    assert parse_shapes("input:1x3x224x224,mask:8x128") == {"input": (1, 3, 224, 224), "mask": (8, 128)}
    assert parse_shapes(["a:1x2", "b:3"]) == {"a": (1, 2), "b": (3,)}
    assert parse_shapes("ns:input:0:2x4") == {"ns:input:0": (2, 4)}  # TF-style names keep their colons
    for bad in ("input=1x3", "input:1x", "input:ax3", ":1x3"):
        with pytest.raises(GraphmpError, match="NAME:DIMS"):
            parse_shapes(bad)


def test_import_graphmp_does_not_import_tensorrt_or_torch():
    code = "import sys, graphmp; print('tensorrt' in sys.modules or 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


# --- the command line ---------------------------------------------------------------------------

def test_bench_shapes_reach_the_conversion(tmp_path, capsys):
    """A model that runs only at a sequence length graphmp's shape search does not try (12):
    bench --shapes converts it with those shapes (before, the fp16 rows failed to find any)."""
    from onnx import TensorProto as T, helper
    shape = numpy_helper.from_array(np.array([0, 12, 16], np.int64), "shape")  # as an export that fixed the length
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["h"]),
                           helper.make_node("MatMul", ["h", "w"], ["y"])],
                          "seq12", [helper.make_tensor_value_info("x", T.FLOAT, ["b", "s", 16])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["b", 12, 16])], [shape, w])
    src = str(tmp_path / "seq12.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    js = tmp_path / "b.json"
    rc = main(["bench", src, "--backends", "ort-cpu", "--precisions", "fp32,fp16", "--shapes", "x:1x12x16",
               "--warmup", "1", "--iterations", "2", "--min-time", "0", "--json", str(js), "-q"])
    assert rc == 0, capsys.readouterr().err
    rows = {r["precision"]: r for r in json.load(open(js))["rows"]}
    assert rows["fp16"]["status"] == "ok" and rows["fp16"]["output_shapes"], rows["fp16"].get("error")


def test_cli_bench_writes_json_and_plot(tmp_path, capsys):
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(["bench", RESNET, "--backends", "ort-cpu", "--batch", "2", "--warmup", "1", "--iterations", "2",
               "--min-time", "0", "--oracle-max-mb", "0", "--json", str(js), "--plot", str(png), "-q",
               "--max-error", "0.05", "--tf32-factor", "3"])
    out = capsys.readouterr().out
    assert rc == 0
    d = json.load(open(js))
    _check_schema(d)
    assert {r["precision"] for r in d["rows"]} == {"fp32", "fp16"} and d["settings"]["batches"] == [2]
    assert d["environment"]["command"].startswith("graphmp bench ") and "--json" in d["environment"]["command"]
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "| ort-cpu | fp16" in out
    assert d["settings"]["max_error"] == 0.05 and d["settings"]["tf32_factor"] == 3.0
    assert "max(0.05, 3 x the TF32 error" in d["accuracy"]["rule"] and d["settings"]["atol"] is None
    assert d["partial"] is False and d["interrupted"] is None and "PARTIAL" not in out  # a complete run


def test_cli_bench_exits_1_when_no_row_finished(tmp_path, capsys):
    conv = graphmp.convert(RESNET).model
    _unknown_to_ort(conv)  # a valid model ONNX Runtime cannot load
    bad = str(tmp_path / "bad.mp.onnx")
    onnx.save(conv, bad)
    rc = main(["bench", RESNET, "--converted", bad, "--backends", "ort-cpu", "--precisions", "fp16", "--warmup", "0",
               "--iterations", "1", "--min-time", "0", "--oracle-max-mb", "0", "-q"])
    captured = capsys.readouterr()
    assert rc == 1 and "no benchmark row finished" in captured.err and "FAILED" in captured.out


def test_cli_bench_bad_input(tmp_path, capsys):
    assert main(["bench", str(tmp_path / "nope.onnx"), "--backends", "ort-cpu"]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", RESNET, "--batch", "0,8"])
    assert e.value.code == 2
    assert "positive integers" in capsys.readouterr().err


@pytest.mark.skipif(_has_tensorrt(), reason="TensorRT is installed here")
def test_cli_build_without_tensorrt_exits_2_and_says_how_to_install(tmp_path, capsys):
    out = tmp_path / "m.plan"
    assert main(["build", RESNET, "-o", str(out), "--shapes", "pixel_values:1x3x32x32"]) == 2
    err = capsys.readouterr().err
    assert "TensorRT is not available" in err and "pip install 'graphmp[gpu]'" in err
    assert not out.exists()


def test_cli_build_bad_input_exits_2_before_tensorrt(tmp_path, capsys):
    assert main(["build", str(tmp_path / "nope.onnx")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["build", RESNET, "--shapes", "pixel_values=1x3x32x32"]) == 2
    assert "NAME:DIMS" in capsys.readouterr().err
    assert main(["build", RESNET, "-o", str(tmp_path / "no" / "dir.plan")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_help_has_examples(capsys):
    for cmd in ("bench", "build"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        text = capsys.readouterr().out
        assert "examples:" in text and f"graphmp {cmd} " in text
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("err <= max(--max-error, --tf32-factor x TF32 err, --tf32-factor x the FP16-input floor",
                   "prefer_nhwc=1", "--compare",
                   "ort-opt", "fails its row", "same graph cleanups"):
        assert phrase in text, phrase


# --- GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs onnxruntime-gpu and a CUDA GPU")
def test_ort_cuda_rows_fp32_tf32_fp16():
    d = bench(RESNET, backends="ort-cuda", batches=(1, 8), warmup=2, iterations=10, min_time=0.0,
              progress=False).to_dict()
    _check_schema(d)
    assert d["backends"]["ort-cuda"]["status"] == "ok", d["backends"]["ort-cuda"]["reason"]
    rows = {(r["precision"], r["batch"]): r for r in d["rows"] if r["variant"] == "default"}
    assert set(rows) == {(p, b) for p in ("fp32", "tf32", "fp16") for b in (1, 8)}
    assert {r["variant"] for r in d["rows"]} == {"default", "nhwc", "cuda-graph"}
    assert all(r["provider"] == "CUDAExecutionProvider" for r in d["rows"] if r["status"] == "ok")
    for (p, b), r in rows.items():
        assert r["status"] == "ok", r["error"]
        assert r["settings"]["provider_options"]["use_tf32"] == ("0" if p == "fp32" else "1")
        assert r["output_shapes"] == {"logits": [b, 10]}
        assert r["accuracy"]["passed"], r["accuracy"]
    assert d["environment"]["gpus"]


def test_bench_judges_by_the_yardstick_of_check(tmp_path):
    """bench's allowance per output includes 2 x the FP16-input floor, as graphmp check's:
    basic_pitch's input rounding alone costs > 1e-2, and its fp16 row is in tolerance."""
    src = os.path.join(ROOT, "models", "real", "basic_pitch_nmp.onnx")
    d = bench(src, backends="ort-cpu", batches=(1,), precisions="fp32,fp16", oracle_max_mb=0, **FAST).to_dict()
    fp16 = next(r for r in d["rows"] if r["precision"] == "fp16")
    outs = fp16["accuracy"]["outputs"]
    assert any(o["input_floor"] > 1e-2 for o in outs.values())
    for o in outs.values():
        assert o["allowed"] >= 2 * o["input_floor"] and o["allowed"] >= 2 * (o["tf32_error"] or 0)
    assert fp16["accuracy"]["passed"]


def test_bench_says_when_the_fp16_rows_are_the_fp32_model(tmp_path):
    """A model graphmp converts nothing of: its fp16 rows are labelled as what they are."""
    g = onnx.helper.make_graph([onnx.helper.make_node("Softmax", ["x"], ["y"], axis=-1, name="sm")], "g",
                               [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
                               [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8])])
    src = tmp_path / "sm.onnx"
    onnx.save(onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)]), src)
    res = bench(str(src), backends="ort-cpu", batches=(1,), precisions="fp32,fp16", oracle_max_mb=0, **FAST)
    assert any("converted no node to FP16" in n for n in res.to_dict()["notes"]), res.to_dict()["notes"]

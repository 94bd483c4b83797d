"""graphmp bench / graphmp build on the CPU: the harness end to end with real ONNX Runtime
sessions on committed models, the documented JSON schema, the plot, accuracy columns that
catch a broken conversion, batching, and the TensorRT / ORT CUDA paths where they cannot run."""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import graphmp
from graphmp import bench
from graphmp.bench import PRECISIONS, latency_stats, timed_loop
from graphmp.cli import main
from graphmp.errors import GraphmpError
from graphmp.oracle import cuda_available
from graphmp.inputs import parse_shapes

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


# --- the documented JSON schema (graphmp/bench.py docstring, benchmarks/README.md) -----------------

NUM = (int, float)


def _check_schema(d):
    assert d["schema_version"] == 1
    env = d["environment"]
    for k in ("device", "gpus", "cpu", "cpu_count", "driver", "cuda", "cudnn", "tensorrt", "onnxruntime",
              "onnxruntime_package", "onnx", "numpy", "torch", "onnxconverter_common", "graphmp", "python",
              "platform", "command", "timestamp"):
        assert k in env, k
    assert isinstance(env["device"], str) and env["device"] and isinstance(env["command"], str)
    assert env["onnxruntime"] and env["onnx"] and env["numpy"] and env["graphmp"] == graphmp.__version__
    s = d["settings"]
    for k in ("backends", "precisions", "batches", "data", "shapes", "inputs", "seed", "warmup", "iterations", "min_time_s",
              "rounds", "atol", "rtol", "cudnn_conv_algo_search", "compare_occ", "oracle_max_mb"):
        assert k in s, k
    m = d["model"]
    for k in ("path", "converted_path", "conversion", "occ_path", "fp32_available", "weight_bytes", "inputs",
              "fixed_batch"):
        assert k in m, k
    assert all(set(i) == {"name", "dtype", "shape"} for i in m["inputs"])
    for name, b in d["backends"].items():
        assert name in ("trt", "ort-cuda", "ort-cpu") and b["status"] in ("ok", "skipped")
        assert (b["reason"] is None) == (b["status"] == "ok")
    for r in d["rows"]:
        for k in ("backend", "precision", "label", "model", "batch", "tf32", "status", "error", "settings",
                  "latency_ms", "iterations", "throughput_per_s", "speedup_vs_fp32", "speedup_vs_tf32",
                  "peak_device_memory_bytes", "memory_note", "engine_bytes", "build_s", "output_shapes",
                  "accuracy"):
            assert k in r, k
        assert r["precision"] in PRECISIONS and r["status"] in ("ok", "failed")
        if r["status"] != "ok":
            assert isinstance(r["error"], str) and r["error"]
            continue
        lat = r["latency_ms"]
        assert 0 < lat["min"] <= lat["median"] <= lat["p90"] <= lat["p99"] <= lat["max"]
        assert r["iterations"] >= d["settings"]["iterations"]
        assert r["throughput_per_s"] == pytest.approx(r["batch"] / (lat["median"] / 1e3))
        assert isinstance(r["build_s"], NUM) and r["build_s"] >= 0
        acc = r["accuracy"]
        if acc is not None:
            assert isinstance(acc["passed"], bool) and isinstance(acc["max_abs"], NUM)
            assert isinstance(acc["nonfinite"], int) and acc["outputs"]
    for o in d["oracle"]:
        assert o["status"] in ("ok", "skipped", "failed") and o["precision"] in ("fp16", "occ")
    assert all(isinstance(n, str) for n in d["notes"])
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
        # the FP32 row is the reference itself; the honest conversion passes with a small, non-zero error
        assert rows[("fp32", b)]["accuracy"]["max_abs"] == 0.0
        acc = rows[("fp16", b)]["accuracy"]
        assert acc["passed"] and 0 < acc["max_abs"] < 1e-2 and acc["argmax_agree"] == 1.0
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
    assert "median ms" in t and "vs TF32" in t and "argmax" in t
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
    assert d["model"]["converted_path"] == broken and d["model"]["conversion"] is None


def test_a_failing_row_is_recorded_and_the_run_goes_on(tmp_path):
    conv = graphmp.convert(RESNET).model
    next(n for n in conv.graph.node if n.op_type == "Relu").op_type = "NoSuchOp"  # ORT cannot load it
    bad = str(tmp_path / "bad.mp.onnx")
    onnx.save(conv, bad)
    res = bench(RESNET, converted=bad, backends="ort-cpu", batches=(2,), precisions="fp32,fp16", oracle_max_mb=0,
                **FAST)
    d = res.to_dict()
    _check_schema(d)
    fp32, fp16 = (next(r for r in d["rows"] if r["precision"] == p) for p in ("fp32", "fp16"))
    assert fp32["status"] == "ok" and fp32["latency_ms"]["median"] > 0
    assert fp16["status"] == "failed" and "NoSuchOp" in fp16["error"] and fp16["latency_ms"] is None
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
    with pytest.raises(GraphmpError, match="positive integers"):
        bench(RESNET, batches="1,x")
    with pytest.raises(GraphmpError, match="no such file"):
        bench(str(tmp_path / "missing.onnx"))
    np.savez(tmp_path / "wrong.npz", other=np.zeros((1, 3), np.float32))
    with pytest.raises(GraphmpError, match="pixel_values"):
        bench(RESNET, backends="ort-cpu", data=str(tmp_path / "wrong.npz"), **FAST)


# --- timing helpers -----------------------------------------------------------------------------

def test_timed_loop_meets_both_count_and_time():
    calls = []

    def step():
        calls.append(1)
        return 0.125  # each step reports its own duration (exact in binary)

    times = timed_loop(step, warmup=2, iterations=3, min_time=1.0)
    assert len(times) == 8 and len(calls) == 10  # 1 s needs 8 steps of 0.125 s; warm-up untimed
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

def test_cli_bench_writes_json_and_plot(tmp_path, capsys):
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(["bench", RESNET, "--backends", "ort-cpu", "--batch", "2", "--warmup", "1", "--iterations", "2",
               "--min-time", "0", "--oracle-max-mb", "0", "--json", str(js), "--plot", str(png), "-q"])
    out = capsys.readouterr().out
    assert rc == 0
    d = json.load(open(js))
    _check_schema(d)
    assert {r["precision"] for r in d["rows"]} == {"fp32", "fp16"} and d["settings"]["batches"] == [2]
    assert d["environment"]["command"].startswith("graphmp bench ") and "--json" in d["environment"]["command"]
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "| ort-cpu | fp16" in out


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


# --- GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs onnxruntime-gpu and a CUDA GPU")
def test_ort_cuda_rows_fp32_tf32_fp16():
    d = bench(RESNET, backends="ort-cuda", batches=(1, 8), warmup=2, iterations=10, min_time=0.0,
              progress=False).to_dict()
    _check_schema(d)
    assert d["backends"]["ort-cuda"]["status"] == "ok", d["backends"]["ort-cuda"]["reason"]
    rows = {(r["precision"], r["batch"]): r for r in d["rows"]}
    assert set(rows) == {(p, b) for p in ("fp32", "tf32", "fp16") for b in (1, 8)}
    for (p, b), r in rows.items():
        assert r["status"] == "ok", r["error"]
        assert r["settings"]["provider_options"]["use_tf32"] == ("0" if p == "fp32" else "1")
        assert r["output_shapes"] == {"logits": [b, 10]}
        assert r["accuracy"]["passed"], r["accuracy"]
    assert d["environment"]["gpus"]

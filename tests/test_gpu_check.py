"""benchmarks/gpu_check.sh (dry run, end to end on the CPU, so that it never rots), its wheel
installation path, and the CPU-testable parts of benchmarks/train.py (PYTHONPATH
prepending, rows labelled by the provider that ran, what runs on which device)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")


def _load(name, rel):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_check = _load("gpu_check_under_test", "benchmarks/gpu_check.py")
btrain = _load("train_bench_under_test", "benchmarks/train.py")


def _run(args, env_extra=None, timeout=170):
    env = dict(os.environ, PYTHON=sys.executable, **(env_extra or {}))
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_dry_run_end_to_end(tmp_path):
    out = tmp_path / "out"
    p = _run(["--dry-run", "--out", str(out)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "result: PASSED" in p.stdout
    res = json.loads((out / "gpu_check.json").read_text())
    assert [s["step"] for s in res["steps"]] == ["models", "convert", "numerics", "bench", "train", "tests"]
    assert all(s["passed"] for s in res["steps"])
    # numerics: four models, each output of the converted model differs from FP32 (it really is
    # FP16) but within the budget, no new inf/NaN, on the provider that was asked for
    assert [n["model"] for n in res["numerics"]] == ["resnet50", "bert-base", "detector", "gpt2"]
    for n in res["numerics"]:
        assert n["ran_on"] == "CPUExecutionProvider"
        for o, m in n["outputs"].items():
            assert 0 < m["error"] < 1e-2 and m["new_nonfinite"] == 0, (n["model"], o, m)
    assert res["numerics"][0]["outputs"]["logits"]["argmax_agree"] == 1.0
    # bench: FP32 and FP16 rows finished at both batches, judged in tolerance
    rows = {(b["model"], r["precision"], r["batch"]): r for b in res["bench"] for r in b["rows"]}
    for model in ("resnet50", "bert-base", "gpt2"):
        for prec in ("fp32", "fp16"):
            for batch in (1, 2):
                r = rows[(model, prec, batch)]
                assert r["status"] == "ok" and r["median_ms"] > 0 and r["in_tol"] is True, r
    assert rows[("detector", "fp16", 1)]["status"] == "ok"  # a fixed-batch model runs its own batch
    # train: both precisions ran, on the CPU, and say so
    assert {(r["engine"], r["precision"]) for r in res["train"]["rows"]} == {("ort-cpu", "fp32"), ("ort-cpu", "mixed")}
    assert all(r["ran_on"] == "CPUExecutionProvider" and r["median_ms"] > 0 for r in res["train"]["rows"])
    assert all(r["loss_last"] < r["loss_first"] for r in res["train"]["rows"]), res["train"]["rows"]
    assert "deselected" in res["tests"]["summary"]  # pytest -m gpu ran (its tests skip without a GPU)
    assert (out / "gpu_check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_training_row_whose_loss_rises_or_is_not_finite_fails_the_check():
    row = {"model": "tiny-cnn", "engine": "ort-cpu", "precision": "fp32"}
    assert gpu_check.loss_failures([dict(row, loss_first=1.59, loss_last=1.49)]) == []
    rose = gpu_check.loss_failures([dict(row, loss_first=1.59, loss_last=9.09)])
    assert len(rose) == 1 and "rose 1.59 -> 9.09" in rose[0] and "tiny-cnn ort-cpu fp32" in rose[0]
    assert "not finite" in gpu_check.loss_failures([dict(row, loss_first=1.59, loss_last=float("nan"))])[0]
    assert gpu_check.loss_failures([dict(row, loss_first=None, loss_last=None)]) == []  # did not run


def _wheel(path):
    """A minimal valid wheel (pip installs it offline)."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fakeortgpu/__init__.py", "VALUE = 42\n")
        z.writestr("fakeortgpu-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakeortgpu\nVersion: 0.1\n")
        z.writestr("fakeortgpu-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr("fakeortgpu-0.1.dist-info/RECORD", "fakeortgpu/__init__.py,,\nfakeortgpu-0.1.dist-info/METADATA,,\n"
                   "fakeortgpu-0.1.dist-info/WHEEL,,\nfakeortgpu-0.1.dist-info/RECORD,,\n")


def _parts(src, dest, n=5):
    """The layout of benchmarks/ortgpu_parts.sh --parts n (default 5): .ortgpu1/part.0 ..
    .ortgpu<n>/part.<n-1>, and .ortgpu<n>/NAME."""
    data = src.read_bytes()
    k = -(-len(data) // n)
    for i in range(n):
        d = dest / f".ortgpu{i + 1}"
        d.mkdir(parents=True)
        (d / f"part.{i}").write_bytes(data[i * k:(i + 1) * k])
    (dest / f".ortgpu{n}" / "NAME").write_text(src.name + "\n")


def test_gpu_mode_joins_and_installs_the_parts_then_refuses_without_cuda(tmp_path):
    wheel = tmp_path / "fakeortgpu-0.1-py3-none-any.whl"
    _wheel(wheel)
    _parts(wheel, tmp_path / "parts")
    env = {"GRAPHMP_ORTGPU_DIR": str(tmp_path / "parts"), "GRAPHMP_GPU_SITE": str(tmp_path / "site"),
           "GRAPHMP_WHEELS": str(tmp_path / "none")}
    p = _run(["--out", str(tmp_path / "out")], env)
    assert (tmp_path / "site" / "fakeortgpu" / "__init__.py").read_text() == "VALUE = 42\n"
    assert p.returncode == 2 and "has no CUDAExecutionProvider" in p.stderr, p.stdout + p.stderr

    (tmp_path / "parts" / ".ortgpu3" / "part.2").write_bytes(b"x" * 10)  # a damaged part
    p = _run(["--out", str(tmp_path / "out")], env)
    assert p.returncode == 2 and "do not make a valid wheel" in p.stderr
    (tmp_path / "parts" / ".ortgpu3" / "part.2").unlink()
    p = _run(["--out", str(tmp_path / "out")], env)
    assert p.returncode == 2 and ".ortgpu3/part.2 is missing" in p.stderr


@pytest.mark.parametrize("n", [1, 3, 8])
def test_gpu_mode_joins_any_number_of_parts(tmp_path, n):
    """N comes from the folder holding NAME; a stale .ortgpuK/NAME of an earlier, longer split
    (K > N) is ignored."""
    wheel = tmp_path / "fakeortgpu-0.1-py3-none-any.whl"
    _wheel(wheel)
    _parts(wheel, tmp_path / "parts", n)
    stale = tmp_path / "parts" / f".ortgpu{n + 2}"
    stale.mkdir()
    (stale / "NAME").write_text("stale.whl\n")
    env = {"GRAPHMP_ORTGPU_DIR": str(tmp_path / "parts"), "GRAPHMP_GPU_SITE": str(tmp_path / "site"),
           "GRAPHMP_WHEELS": str(tmp_path / "none")}
    p = _run(["--out", str(tmp_path / "out")], env)
    assert (tmp_path / "site" / "fakeortgpu" / "__init__.py").read_text() == "VALUE = 42\n", p.stdout + p.stderr
    assert p.returncode == 2 and "has no CUDAExecutionProvider" in p.stderr, p.stdout + p.stderr


def test_output_metrics_are_normalised():
    ref = np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [0.0, 1e-6, 0.0]])
    got = np.array([[1.0, 2.0, 3.3], [2.0, 2.5, 1.0], [0.0, 2e-6, np.inf]])
    m = gpu_check.output_metrics(ref, got, "logits")
    assert m["new_nonfinite"] == 1
    assert m["error"] == pytest.approx(1.0 / 3.0)           # max|a-b| (row 2: 1.0) / max|ref| (3.0)
    assert m["argmax_agree"] == pytest.approx(1 / 3)       # row 2 flips class 0 -> 1, row 3 to the inf
    assert gpu_check.output_metrics(ref, got, "last_hidden_state")["argmax_agree"] is None


# --- benchmarks/train.py ---------------------------------------------------------------------------

def test_children_prepend_the_repo_to_pythonpath():
    env = btrain.child_env({"PYTHONPATH": "/opt/ortgpu:/x", "HOME": "/h"})
    assert env["PYTHONPATH"].split(os.pathsep) == [btrain.REPO, "/opt/ortgpu", "/x"]
    assert btrain.child_env({})["PYTHONPATH"] == btrain.REPO


def _args(**kw):
    base = dict(models=None, device="auto", tiny=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_plan_puts_rows_where_they_can_run():
    names, eng = btrain.plan(_args(device="cpu"), torch_ok=False, torch_cuda=False, ort_cuda=True)
    assert names == ["tiny-cnn"] and eng == [("ort-cpu", "fp32"), ("ort-cpu", "mixed")]
    names, eng = btrain.plan(_args(), torch_ok=True, torch_cuda=True, ort_cuda=True)
    assert names == ["cnn", "block", "bert-base", "resnet50"]  # GPU-sized cases when CUDA runs
    assert ("ort-cuda", "mixed") in eng and ("torch-cuda", "mixed") in eng
    names, eng = btrain.plan(_args(), torch_ok=True, torch_cuda=False, ort_cuda=False)
    assert names == ["cnn", "block"] and not any("cuda" in e for e, _ in eng)  # never BERT-base b32 on a CPU
    names, _ = btrain.plan(_args(tiny=True), torch_ok=True, torch_cuda=False, ort_cuda=False)
    assert names[-2:] == ["bert-base", "resnet50"]
    assert btrain.model_specs(tiny=False)["bert-base"]["x"] == (32, 128, 768)
    assert btrain.model_specs(tiny=False)["resnet50"]["x"] == (32, 3, 224, 224)
    with pytest.raises(SystemExit) as e:
        btrain.plan(_args(device="cuda"), torch_ok=False, torch_cuda=False, ort_cuda=False)
    assert e.value.code == 2
    _, eng = btrain.plan(_args(device="cuda"), torch_ok=True, torch_cuda=True, ort_cuda=True)
    assert all("cuda" in e for e, _ in eng)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    import onnx
    from graphmp.train.step import build_step
    from fixtures import tiny
    work = tmp_path_factory.mktemp("trainrun")
    spec = btrain.model_specs()["tiny-cnn"]
    onnx.save(tiny.cnn(**spec["kw"]), str(work / "m.onnx"))
    build_step(str(work / "m.onnx"), str(work / "run"), precision="mixed", optimizer="adamw", lr=1e-3)
    return str(work / "run")


def _child_args(run_dir, device):
    return SimpleNamespace(model="tiny-cnn", engine="ort-cuda", precision="mixed", run_dir=run_dir, work=run_dir,
                           steps=1, warmup=0, device=device, tiny=False)


def test_ort_cuda_row_that_ran_on_the_cpu_says_so_or_fails(tiny_run, monkeypatch):
    import graphmp.model_runs
    from graphmp.errors import GraphmpError
    # this onnxruntime has no CUDA provider: auto runs on the CPU and the row says so
    r = btrain.child_ort(_child_args(tiny_run, "auto"))
    assert r["ran_on"] == "CPUExecutionProvider" and "no CUDA" in r["note"]
    assert np.isfinite(r["loss_first"]) and r["median_ms"] > 0
    # a CUDA provider that is listed but does not load: the session comes up on the CPU
    monkeypatch.setattr(graphmp.model_runs, "cuda_available", lambda: True)
    r = btrain.child_ort(_child_args(tiny_run, "auto"))
    assert r["ran_on"] == "CPUExecutionProvider" and "came up on CPUExecutionProvider" in r["note"]
    with pytest.raises(GraphmpError, match="--device cuda: the training step session came up on CPUExecutionProvider"):
        btrain.child_ort(_child_args(tiny_run, "cuda"))


def test_targets_use_only_rows_that_ran_on_cuda():
    rows = [dict(model="bert-base", engine="ort-cuda", precision="fp32", median_ms=30.0, ran_on="CUDAExecutionProvider"),
            dict(model="bert-base", engine="ort-cuda", precision="mixed", median_ms=15.0, ran_on="CUDAExecutionProvider"),
            dict(model="bert-base", engine="torch-cuda", precision="mixed", median_ms=12.0, ran_on="torch cuda"),
            dict(model="cnn", engine="ort-cuda", precision="mixed", median_ms=1.0, ran_on="CPUExecutionProvider")]
    t = btrain.targets(rows)
    assert [x["model"] for x in t] == ["bert-base"]  # the cnn row fell back to the CPU: no target claimed
    assert t[0]["mixed_vs_fp32"] == 2.0 and t[0]["meets_1_5x_fp32"] is True
    assert t[0]["mixed_vs_torch_amp"] == 1.25 and t[0]["within_1_2x_torch_amp"] is False


def test_numerics_with_given_shapes(tmp_path):
    import graphmp
    src = os.path.join(ROOT, "models", "tiny", "bert.onnx")
    conv = str(tmp_path / "bert.mp.onnx")
    graphmp.convert(src, conv)
    shapes = {"input_ids": (3, 8), "attention_mask": (3, 8), "token_type_ids": (3, 8)}
    res = gpu_check.numerics("bert-base", src, conv, 3, "CPUExecutionProvider", shapes)
    assert res["inputs"] == "input_ids:3x8, attention_mask:3x8, token_type_ids:3x8"
    assert res["passed"] and res["ran_on"] == "CPUExecutionProvider"
    assert 0 < res["outputs"]["last_hidden_state"]["error"] < 1e-2


def test_gpu_sized_cases_at_toy_size_match_torch(tmp_path):
    """The BERT-base stack and ResNet-50 (--tiny) export, build and step on the CPU; the
    first step's loss of ORT FP32 equals torch's (same weights, same batch)."""
    pytest.importorskip("torch")
    js = tmp_path / "train.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train.py"), "--tiny", "--device", "cpu",
                        "--models", "bert-base,resnet50", "--steps", "1", "--warmup", "1", "--no-curves",
                        "--json", str(js)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = {(r["model"], r["engine"], r["precision"]): r for r in json.loads(js.read_text())["results"]}
    for model in ("bert-base", "resnet50"):
        ort, torch_row = rows[(model, "ort-cpu", "fp32")], rows[(model, "torch-cpu", "fp32")]
        assert ort["ran_on"] == "CPUExecutionProvider" and torch_row["ran_on"] == "torch cpu"
        assert ort["loss_first"] == pytest.approx(torch_row["loss_first"], rel=1e-4)
        assert np.isfinite(rows[(model, "ort-cpu", "mixed")]["loss_last"])

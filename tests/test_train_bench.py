"""The training-speed benchmarks at toy size (benchmarks/train_cpu.py, train_heldout.py,
step_audit.py, train_gpu.sh --dry-run): they run, their JSON has the keys
benchmarks/README.md documents, both engines compute the same losses. No timing is asserted.

train_cpu.py and train_heldout.py flush denormals to zero (torch.set_flush_denormal, ONNX
Runtime's session.set_denormal_as_zero), which stays set on the thread that ran them: they run
in a child process here, so the rest of the suite keeps IEEE subnormals."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import step_audit  # noqa: E402
import train_cpu  # noqa: E402
import train_heldout  # noqa: E402
import train_interleave  # noqa: E402

ROW_KEYS = {"median_ms", "min_ms", "max_ms", "steps", "loss", "applied"}
AUDIT_KEYS = {"nodes", "nodes_by_op_phase", "non_gemm_mb", "non_gemm_mb_by_phase", "non_gemm_mb_by_op_phase",
              "cast_mb", "nodes_unknown_shapes", "batch"}


def _run(script: str, *args: str) -> None:
    """benchmarks/SCRIPT ARGS in a child process; it must exit 0."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]


def _check_audit(a: dict, run_dir: str):
    assert AUDIT_KEYS <= set(a)
    meta = json.load(open(os.path.join(run_dir, "train.json")))
    n = a["nodes"]
    assert n["forward"] == meta["nodes"]["forward"] and n["total"] == meta["nodes"]["total"]
    assert n["forward"] + n["backward"] + n["update"] == n["total"] and min(n.values()) > 0
    assert a["non_gemm_mb"] > 0
    assert abs(sum(a["non_gemm_mb_by_phase"].values()) - a["non_gemm_mb"]) < 0.5


def test_train_cpu_tiny_json(tmp_path):
    out = tmp_path / "cpu.json"
    _run("train_cpu.py", "--tiny", "--cases", "resnet18,bert", "--rounds", "2", "--work", str(tmp_path / "w"),
         "--json", str(out))
    res = json.loads(out.read_text())
    assert set(res["cases"]) == {"resnet18", "bert"} and res["threads"] == 1
    for name, case in res["cases"].items():
        assert set(case["rows"]) == {"torch-fp32", "graphmp-fp32", "graphmp-mixed"}
        for row in case["rows"].values():
            assert ROW_KEYS <= set(row) and row["steps"] == 2 and row["min_ms"] <= row["median_ms"] <= row["max_ms"]
        assert set(case["ratios"]) == {"graphmp_fp32_vs_torch", "graphmp_mixed_vs_torch", "graphmp_mixed_vs_fp32"}
        # the same first AdamW step from the same weights: the engines' losses agree
        assert case["losses"]["fp32"]["agree"] and case["losses"]["mixed"]["agree"], case["losses"]
        for prec in ("fp32", "mixed"):
            _check_audit(case["step_graph"][prec], os.path.join(res["work"], f"{name}-{prec}"))
        # mixed adds Casts; FP32 has none
        assert case["step_graph"]["fp32"]["cast_mb"] == 0 < case["step_graph"]["mixed"]["cast_mb"]


def test_audit_pins_the_batch(tmp_path):
    """The bytes moved grow with the pinned batch, and run-time shape values resolve every
    shape of a CNN step (strided convolutions' backward included)."""
    import torch
    import train_nets
    torch.manual_seed(0)
    spec = train_cpu.cases(tiny=True)["resnet18"]
    path = train_nets.export(spec["make"](), train_nets.make_batch(spec), str(tmp_path / "m.onnx"))
    run = str(tmp_path / "run")
    train_interleave.build(path, run, "fp32")
    small, big = step_audit.audit_run(run, 2), step_audit.audit_run(run, 8)
    _check_audit(small, run)
    assert small["nodes_unknown_shapes"] == 0 and big["nodes_unknown_shapes"] == 0
    assert big["non_gemm_mb_by_phase"]["forward"] > 3 * small["non_gemm_mb_by_phase"]["forward"]
    assert big["nodes"] == small["nodes"]
    assert step_audit.audit_run(run, 2, run_shapes=False)["nodes_unknown_shapes"] > 0  # what the run adds


def test_heldout_tiny_losses_agree(tmp_path):
    out = tmp_path / "heldout.json"
    _run("train_heldout.py", "--tiny", "--models", "tagger,resnext", "--steps", "3", "--rounds", "1",
         "--work", str(tmp_path / "w"), "--json", str(out))
    res = json.loads(out.read_text())
    assert res["failed"] == []
    for name in ("tagger", "resnext"):
        m = res["models"][name]
        for prec in ("fp32", "mixed"):
            a = m["losses"][prec]
            assert a["agree"] is True and {"after_1", "after_3", "skipped"} <= set(a), a
            assert len(a["graphmp_losses"]) == len(m["torch_losses"][prec]) == 4
            assert m["rows"][f"graphmp-{prec}"]["steps"] == 1
    # and the judgement would catch a step that drifts: 2% after the last update is not FP32 agreement
    assert train_heldout.loss_agreement([2.0, 1.9, 1.8], [2.0, 1.9, 1.8 * 1.02], 0, "fp32")["agree"] is False
    assert train_heldout.loss_agreement([2.0, 1.9, 1.8], [2.0, 1.9, 1.8 * 1.0001], 0, "fp32")["agree"] is True


def test_train_gpu_dry_run(tmp_path):
    out = tmp_path / "gpu"
    env = dict(os.environ, PYTHON=sys.executable)
    script = os.path.join(ROOT, "benchmarks", "train_gpu.sh")
    # as a GPU session runs it: the builds first (while the wheel parts travel), then the timing
    # run on those builds (--reuse: nothing built again)
    p = subprocess.run(["bash", script, "--dry-run", "--build-only", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert not (out / "train_gpu.json").exists()
    assert all((out / "runs" / f"{m}-{p}" / "train.json").is_file() for m in ("resnet50", "bert-base")
               for p in ("fp32", "mixed"))
    p = subprocess.run(["bash", script, "--dry-run", "--reuse", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    res = json.loads((out / "train_gpu.json").read_text())
    assert "build_seconds" not in res  # --reuse timed the builds it was given
    rows = {(r["model"], r["engine"], r["precision"]): r for r in res["results"]}
    for model in ("resnet50", "bert-base"):
        for key in (("ort-cpu", "fp32"), ("ort-cpu", "mixed"), ("torch-cpu", "fp32")):
            assert rows[(model,) + key]["median_ms"] > 0, rows.get((model,) + key)
    # the session variants of the mixed ResNet-50 step: on the CPU the same step (same loss), and
    # --cuda-graph refused in one line (no CUDA here), not a failure
    variants = json.loads((out / "train_session.json").read_text())["variants"]
    assert variants["ort-default"]["median_ms"] > 0 and variants["graphmp"]["median_ms"] > 0
    assert variants["graphmp"]["loss_first"] == variants["ort-default"]["loss_first"]
    assert "--cuda-graph needs" in variants["graphmp-cuda-graph"]["refused"]
    bert = json.loads((out / "train_session_bert.json").read_text())["variants"]  # the same for the BERT step
    assert bert["graphmp"]["median_ms"] > 0 and bert["graphmp"]["loss_first"] == bert["ort-default"]["loss_first"]
    # the profile: kernel time by phase for every step graph; on the CPU provider no node is
    # counted as a CPU fallback (that list is for CUDA sessions)
    prof = {r["run"]: r for r in json.loads((out / "profile.json").read_text())["results"]}
    assert set(prof) == {f"{m}-{p}" for m in ("resnet50", "bert-base") for p in ("fp32", "mixed")}
    for r in prof.values():
        assert r["kernel_ms"] > 0 and {"forward", "backward", "update"} <= set(r["phase_ms"]), r
        assert r["cpu_nodes_per_step"] == {} and r["launch_blocking"] is True
    audit = json.loads((out / "audit.json").read_text())
    assert set(audit) == {f"{m}-{p}" for m in ("resnet50", "bert-base") for p in ("fp32", "mixed")}
    for name, a in audit.items():
        _check_audit(a, str(out / "runs" / name))

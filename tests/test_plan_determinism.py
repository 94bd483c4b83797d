"""Plans that do not depend on the machine, and plans that compose (issue 35), through the
CLI: the same command writes the same bytes on an idle and on a loaded machine (the island
trials are bounded by work, not seconds); a --max-error plan is priced for its Casts as the
default plan is; --island-trials with --plan is refused in one line."""
import json
import os
import subprocess
import sys

import numpy as np
import onnx

from graphmp.cli import main
from test_islands import chain, free_island


def _run(args, capsys):
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _files(tmp_path, model):
    """(model path, calibration .npz paths) of `model` (input x [1,4,8,8]), three batches."""
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    cal = []
    for seed in (1, 2, 3):
        cal.append(str(tmp_path / f"b{seed}.npz"))
        np.savez(cal[-1], x=np.random.default_rng(seed).standard_normal((1, 4, 8, 8)).astype(np.float32))
    return str(src), cal


def _busy(n: int) -> list:
    """n processes that spin a CPU each until killed: a machine under heavy load."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_the_same_convert_under_heavy_cpu_load_writes_the_same_bytes(tmp_path, capsys):
    src, cal = _files(tmp_path, chain(12, buys={5}))
    idle, loaded = str(tmp_path / "idle.onnx"), str(tmp_path / "loaded.onnx")
    report = str(tmp_path / "idle.json")
    assert _run(["convert", src, "-o", idle, "--calibration", *cal, "--report", report, "-q"], capsys)[0] == 0
    spinners = _busy(min(8, 2 * (os.cpu_count() or 2)))
    try:
        assert _run(["convert", src, "-o", loaded, "--calibration", *cal, "-q"], capsys)[0] == 0
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    islands = json.load(open(report))["islands"]
    assert islands["runs"] >= 3 and any(t["decision"].startswith("FP16") for t in islands["trials"])  # trials ran
    assert open(idle, "rb").read() == open(loaded, "rb").read()


def test_max_error_auto_moves_no_more_cast_bytes_than_the_default(tmp_path, capsys):
    src, cal = _files(tmp_path, free_island())
    bytes_of = {}
    for name, extra in (("default", []), ("auto", ["--max-error", "auto"]),
                        ("auto_without_islands", ["--max-error", "auto", "--island-trials", "0"])):
        report = str(tmp_path / f"{name}.json")
        rc, _, _ = _run(["convert", src, "-o", str(tmp_path / f"{name}.onnx"), "--calibration", *cal,
                         "--report", report, "-q", *extra], capsys)
        assert rc == 0
        bytes_of[name] = json.load(open(report))["cast_traffic"]["bytes"]
    assert bytes_of["auto"] <= bytes_of["default"] < bytes_of["auto_without_islands"]


def test_island_trials_with_a_plan_is_refused_in_one_line(tmp_path, capsys):
    src, cal = _files(tmp_path, free_island())
    plan = str(tmp_path / "m.plan.json")
    assert _run(["convert", src, "-o", str(tmp_path / "a.onnx"), "--calibration", *cal, "--save-plan", plan,
                 "-q"], capsys)[0] == 0
    out = tmp_path / "b.onnx"
    rc, _, err = _run(["convert", src, "-o", str(out), "--calibration", *cal, "--plan", plan,
                       "--island-trials", "4", "-q"], capsys)
    assert rc == 2 and not out.exists()
    assert len(err.strip().splitlines()) == 1 and "--island-trials" in err and "--plan" in err


def test_search_time_is_said_to_make_the_plan_machine_dependent(tmp_path, capsys):
    src, cal = _files(tmp_path, free_island())
    rc, out, _ = _run(["convert", src, "-o", str(tmp_path / "a.onnx"), "--calibration", *cal,
                       "--search-time", "600"], capsys)
    assert rc == 0 and "plan: depends on this machine: --search-time 600 s did not run out here" in out
    rc, out, _ = _run(["convert", src, "-o", str(tmp_path / "b.onnx"), "--calibration", *cal], capsys)
    assert rc == 0 and "depends on this machine" not in out


def test_the_cast_bytes_a_budget_needs_are_named(tmp_path, capsys):
    """Where --max-error keeps nodes FP32 (the +-200 round trip that FP16 destroys), the
    report says which nodes the budget keeps, why, and what their Casts cost."""
    from test_search import _batches, cancellation_mlp
    src = tmp_path / "m.onnx"
    onnx.save(cancellation_mlp(), src)
    cal = []
    for i, b in enumerate(_batches()):
        cal.append(str(tmp_path / f"b{i}.npz"))
        np.savez(cal[-1], **b)
    report = tmp_path / "r.json"
    assert _run(["convert", str(src), "-o", str(tmp_path / "o.onnx"), "--calibration", *cal, "--max-error", "1e-3",
                 "--report", str(report), "-q"], capsys)[0] == 0
    d = json.load(open(report))
    kept = {n for r in d["search"]["fp32_regions"] for n in r["nodes"]}
    assert {"add200", "sub200"} & kept  # which nodes; why: the error each region causes alone in FP16
    assert max(r["error_alone"] for r in d["search"]["fp32_regions"]) > 1
    assert d["islands"]["search_kept_fp32"] == len(kept) and d["islands"]["cast_bytes_search_kept"] > 0

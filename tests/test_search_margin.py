"""--max-error where the calibration batches disagree: the plan is chosen on all but the
last batch, and how much larger its error is on the held-out ones (the margin) is the
headroom the final plan keeps on every batch (passes/search.py, step 8), so that unseen
inputs of the same kind stay within search.UNSEEN x the budget."""
import json

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as oh
from onnx import numpy_helper as nph

from graphmp.cli import main
from graphmp.emulate import emulated_runner
from graphmp.model_runs import runner
from graphmp.passes import search

BUDGET = 1e-2


def _chains(n: int = 8, seed: int = 2) -> onnx.ModelProto:
    """x[N,32] -> n chains MatMul -> +256 -> -256 -> MatMul, summed. In FP16 x + 256
    keeps steps of 0.25, an absolute error that does not shrink with the input: the
    quieter the input, the larger the relative error, so a quiet batch errs more than a
    loud one (the batches disagree). Chain i's output weighs 1.5^-i (unequal regions)."""
    rng = np.random.default_rng(seed)
    nodes, inits, outs = [], [oh.make_tensor("k", T.FLOAT, [], [256.0])], []
    for i in range(n):
        inits += [nph.from_array((rng.standard_normal((32, 16)) * 2 / np.sqrt(32)).astype(np.float32), f"W{i}"),
                  nph.from_array((rng.standard_normal((16, 8)) * 1.5 ** -i).astype(np.float32), f"V{i}")]
        nodes += [oh.make_node("MatMul", ["x", f"W{i}"], [f"h{i}"], name=f"mm{i}"),
                  oh.make_node("Add", [f"h{i}", "k"], [f"a{i}"], name=f"add{i}"),
                  oh.make_node("Sub", [f"a{i}", "k"], [f"b{i}"], name=f"sub{i}"),
                  oh.make_node("MatMul", [f"b{i}", f"V{i}"], [f"y{i}"], name=f"out{i}")]
        outs.append(f"y{i}")
    nodes.append(oh.make_node("Sum", outs, ["y"], name="sum"))
    g = oh.make_graph(nodes, "chains", [oh.make_tensor_value_info("x", T.FLOAT, ["N", 32])],
                      [oh.make_tensor_value_info("y", T.FLOAT, ["N", 8])], inits)
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _batch(scale: float, seed: int) -> dict:
    return {"x": (np.random.default_rng(seed).standard_normal((8, 32)) * scale).astype(np.float32)}


def _worst_error(src, converted, batches) -> float:
    """max-rel of the converted model (FP16-faithful emulation) over the batches, x budget."""
    ref, emu = runner(src, optimize=False), emulated_runner(converted)
    return max(float(np.abs(ref(b)["y"] - emu(b)["y"]).max() / np.abs(ref(b)["y"]).max()) for b in batches) / BUDGET


def _convert(tmp_path, capsys, name):
    src, cal = tmp_path / "chains.onnx", [tmp_path / "loud.npz", tmp_path / "quiet.npz"]
    onnx.save(_chains(), src)
    np.savez(cal[0], **_batch(1.0, 1))   # the search batch
    np.savez(cal[1], **_batch(0.5, 2))   # held out: half as loud, twice the relative error
    out, rep = tmp_path / f"{name}.onnx", tmp_path / f"{name}.json"
    rc = main(["convert", str(src), "-o", str(out), "--calibration", *map(str, cal), "--max-error", str(BUDGET),
               "--report", str(rep)])
    assert rc == 0, capsys.readouterr()
    return str(src), str(out), json.loads(rep.read_text())["search"], capsys.readouterr().out


def test_the_margin_keeps_unseen_inputs_within_the_goal(tmp_path, capsys, monkeypatch):
    unseen = [_batch(0.35, 100 + i) for i in range(4)]  # quieter pages/audio than both batches
    monkeypatch.setattr(search, "MAX_MARGIN", 1.0)  # the choice without a margin (before)
    src, old, s_old, _ = _convert(tmp_path, capsys, "old")
    monkeypatch.undo()
    _, new, s_new, out = _convert(tmp_path, capsys, "new")
    assert s_old["reached"] and s_new["reached"]
    # the plan chosen on the loud batch errs more on the quiet one: the batches disagree
    assert s_new["held_out_error"] > 1 and s_new["margin"] > 1.5
    assert s_new["refit_on_all_batches"] and s_new["error"] <= search.UNSEEN / s_new["margin"]
    assert s_old["error"] > search.UNSEEN / s_new["margin"]  # the old plan used the whole budget
    assert _worst_error(src, old, unseen) > search.UNSEEN        # and missed the goal on unseen inputs
    assert _worst_error(src, new, unseen) <= search.UNSEEN       # the margin holds it
    assert f"margin {s_new['margin']:.3g}" in out, out            # the summary says what it kept

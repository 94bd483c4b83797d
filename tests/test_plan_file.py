"""Plans you keep: `convert --save-plan` writes every float node's precision with keys that
survive a re-export; `convert --plan` applies it without the search (static rules that
make FP16 impossible still win), verifies the output against the plan's budget and names
whatever did not match; a bad plan file is a one-line error, exit 2."""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nph

import graphmp
from graphmp.budget import errors
from graphmp.cli import main
from graphmp.emulate import emulated_runner
from graphmp.errors import GraphmpError
from graphmp.model_io import iter_graphs
from graphmp.model_runs import runner
from graphmp.plan_read import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SILERO = os.path.join(ROOT, "models", "real", "silero_vad.onnx")
NAMES = ["mm1", "relu1", "mmA", "add200", "sub200", "mmB", "reluB", "sum", "mm_out"]


def _w(seed, shape):
    return (np.random.default_rng(seed).standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)


def branched(seed=0, names=None, b_first=False, extra=False):
    """x -> mm1 -> relu1 -> {A: mmA -> add200 -> sub200; B: mmB -> reluB} -> sum -> mm_out -> y.
    In FP16, x + 200 keeps 3 fractional bits, so branch A's +200/-200 destroys mmA's output:
    the search keeps those followers FP32. A re-export: other weights (seed), other node and
    tensor names (names), branch B stored first (b_first); extra: a Mul appended, reluB gone."""
    n = dict(zip(NAMES, names or NAMES))
    t = (lambda s: f"{n['mm1']}::{s}") if names else (lambda s: s)
    head = [oh.make_node("MatMul", ["x", "W1"], [t("a")], name=n["mm1"]),
            oh.make_node("Relu", [t("a")], [t("b")], name=n["relu1"])]
    a = [oh.make_node("MatMul", [t("b"), "WA"], [t("ca")], name=n["mmA"]),
         oh.make_node("Add", [t("ca"), "k"], [t("da")], name=n["add200"]),
         oh.make_node("Sub", [t("da"), "k"], [t("ea")], name=n["sub200"])]
    b = [oh.make_node("MatMul", [t("b"), "WB"], [t("cb")], name=n["mmB"])]
    b += [] if extra else [oh.make_node("Relu", [t("cb")], [t("eb")], name=n["reluB"])]
    tail = [oh.make_node("Add", [t("ea"), t("cb" if extra else "eb")], [t("s")], name=n["sum"]),
            oh.make_node("MatMul", [t("s"), "W4"], [t("y0") if extra else "y"], name=n["mm_out"])]
    tail += [oh.make_node("Mul", [t("y0"), "half"], ["y"], name="extra_scale")] if extra else []
    inits = [nph.from_array(_w(seed + i, [64, 64]), w) for i, w in enumerate(["W1", "WA", "WB", "W4"])]
    inits += [nph.from_array(np.array(200, np.float32), "k"), nph.from_array(np.array(0.5, np.float32), "half")]
    g = oh.make_graph(head + (b + a if b_first else a + b) + tail, "g",
                      [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 64])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["N", 64])], inits)
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _batches(n=3):
    return [{"x": np.random.default_rng(10 + i).standard_normal((16, 64)).astype(np.float32)} for i in range(n)]


def _sha(p):
    return hashlib.sha256(open(p, "rb").read()).hexdigest()


@pytest.fixture
def saved(tmp_path):
    """A plan saved from a --max-error search on `branched()`; (plan path, report)."""
    p = tmp_path / "plan.json"
    rep = graphmp.convert(branched(), None, calibration=_batches(), max_error=5e-3, save_plan=str(p))
    assert rep["search"]["evaluations"] > 1 and set(rep.fp32_nodes) == {"add200", "sub200", "sum"}
    return p, rep


def test_saved_plan_holds_every_float_node_and_the_search(saved):
    p, rep = saved
    d = json.load(open(p))
    assert (d["schema"], d["version"], d["target"]) == ("graphmp.plan", 1, "fp16")
    assert d["graphmp_version"] == graphmp.__version__ and d["onnx_version"] == onnx.__version__
    assert len(d["source_sha256"]) == 64 and d["budget"]["max_error"] == "0.005" and d["budget"]["metric"] == "max-rel"
    assert d["measured"]["by"] == "search" and d["measured"]["reached"] is True
    assert d["measured"]["verified"]["errors"]["y"] == pytest.approx(rep["search"]["verified"]["errors"]["y"])
    precision = {e["name"]: e["precision"] for e in d["nodes"]}
    assert precision == {n: "fp32" if n in ("add200", "sub200", "sum") else "low" for n in NAMES}
    assert {(e["op_type"], e["index"]) for e in d["nodes"]} >= {("MatMul", 3), ("Add", 1), ("Relu", 1)}
    assert load(str(p)).data == d  # what --save-plan writes, --plan reads


@pytest.mark.parametrize("renamed", [False, True], ids=["new-weights", "new-weights-renamed-reordered"])
def test_plan_applied_to_a_reexport_without_search(saved, renamed):
    """A re-export with other weights (and other names, branches stored in another order):
    the same nodes end up FP32, no search runs (not even with --max-error, given in the
    renamed case), the written model is verified."""
    p, _ = saved
    names = [f"/model/layers.{i}/op" for i in range(len(NAMES))] if renamed else None
    m2 = branched(seed=100, names=names, b_first=renamed)
    new = dict(zip(NAMES, names or NAMES))
    batches = _batches()
    rep = graphmp.convert(m2, None, calibration=batches, plan=str(p), max_error=5e-3 if renamed else None)
    assert "evaluations" not in rep.to_dict().get("search", {})  # no search ran
    assert set(rep.fp32_nodes) == {new["add200"], new["sub200"], new["sum"]}
    assert all(r.startswith("plan:") for r in rep.fp32_nodes.values())
    pl = rep["plan"]
    assert pl["matched"] == len(NAMES) and pl["matched_by_position"] == (len(NAMES) if renamed else 0)
    assert pl["same_structure"] and not pl["unmatched_nodes"] and not pl["unmatched_entries"]
    assert pl["budget_from"] == ("--max-error" if renamed else "the plan") and pl["budget"]["allowed"] == {"y": 5e-3}
    # the verification ran, on the model as written: the emulation of rep.model agrees
    assert pl["met"] is True and pl["verified"]["batches"] == 3
    ref, emu = runner(m2, optimize=False), emulated_runner(rep.model)
    err = errors([ref(b) for b in batches], [emu(b) for b in batches], "max-rel")["y"]
    assert err == pytest.approx(pl["verified"]["errors"]["y"]) and err <= 5e-3
    # and the model ONNX Runtime loads and runs (FP16 inside, FP32 I/O)
    sess = ort.InferenceSession(rep.model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, batches[0])
    assert y.dtype == np.float32 and np.abs(y - ref(batches[0])["y"]).max() < 0.05 * np.abs(y).max()
    assert f"plan {p.name}: 9 nodes matched" in rep.summary() and ": met," in rep.summary()


def test_max_error_sets_the_budget_with_plan_and_strict_fails(saved, tmp_path, capsys):
    """--plan with --max-error: the plan's precisions, --max-error's budget (here unreachable)."""
    p, _ = saved
    src = tmp_path / "m.onnx"
    onnx.save(branched(seed=7), src)
    for i, b in enumerate(_batches()):
        np.savez(tmp_path / f"b{i}.npz", **b)
    cal = [str(tmp_path / f"b{i}.npz") for i in range(3)]
    args = ["convert", str(src), "-o", str(tmp_path / "o.onnx"), "--plan", str(p), "--max-error", "1e-6",
            "--calibration", *cal, "--report", str(tmp_path / "r.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    rep = json.load(open(tmp_path / "r.json"))
    assert rep["plan"]["budget_from"] == "--max-error" and rep["plan"]["met"] is False
    assert "NOT met" in out and "evaluations" not in rep.get("search", {})
    assert {e["name"] for e in rep["fp32_nodes"]} == {"add200", "sub200", "sum"}
    assert main(args + ["--strict"]) == 1
    assert "budget of --plan" in capsys.readouterr().err


def test_unmatched_nodes_and_entries_are_named(saved, capsys):
    """A model with a node the plan lacks (extra_scale) and without one it has (reluB),
    and a plan entry for a node no model has: all named, one summary warning line."""
    p, _ = saved
    d = json.load(open(p))
    d["nodes"].append({"graph": "main", "scope": "main", "op_type": "Conv", "index": 0, "name": "ghost_conv",
                       "precision": "fp32", "reason": None})
    json.dump(d, open(p, "w"))
    rep = graphmp.convert(branched(extra=True), None, calibration=_batches(), plan=str(p))
    pl = rep["plan"]
    assert pl["unmatched_nodes"] == ["extra_scale"]
    assert sorted(pl["unmatched_entries"]) == ["ghost_conv", "reluB"]
    assert "extra_scale" not in rep.fp32_nodes  # an unmatched node keeps the static rules' precision
    lines = [x for x in rep.summary().splitlines() if "warning:" in x and "not in the plan" in x]
    assert len(lines) == 1
    assert all(s in lines[0] for s in ("1 node(s)", "'extra_scale'", "2 plan entries", "'ghost_conv'", "'reluB'"))
    assert "1 not in the plan, 2 entries matched nothing" in rep.summary()


def test_without_calibration_the_plan_applies_unverified(saved):
    p, _ = saved
    rep = graphmp.convert(branched(seed=3), None, calibration="off", plan=str(p))
    assert set(rep.fp32_nodes) == {"add200", "sub200", "sum"} and "met" not in rep["plan"]
    assert "not verified (no calibration batches)" in rep.summary()
    assert any(w.startswith("--plan: not verified") for w in rep["warnings"])


def hard_rule_model():
    """y = MatMul(x, W); n = Cast(Shape(x), FLOAT) * 0.5: the Cast is integer-derived."""
    nodes = [oh.make_node("MatMul", ["x", "W"], ["y"], name="mm"), oh.make_node("Shape", ["x"], ["s"], name="shape"),
             oh.make_node("Cast", ["s"], ["c"], to=TP.FLOAT, name="int_cast"),
             oh.make_node("Mul", ["c", "half"], ["n"], name="scale")]
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 64])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["N", 8]),
                       oh.make_tensor_value_info("n", TP.FLOAT, [2])],
                      [nph.from_array(_w(1, [64, 8]), "W"), nph.from_array(np.array(0.5, np.float32), "half")])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_hard_rules_win_over_the_plan(tmp_path):
    """A plan that says low for an integer-derived Cast and for a node --fp32-nodes names:
    both stay FP32 and are reported as overruled; the rest of the plan applies."""
    m, p = hard_rule_model(), tmp_path / "p.json"
    graphmp.convert(m, None, calibration=_batches(1), save_plan=str(p))
    d = json.load(open(p))
    assert {e["name"]: e["precision"] for e in d["nodes"]}["int_cast"] == "fp32"
    for e in d["nodes"]:
        e["precision"] = "low"
    json.dump(d, open(p, "w"))
    rep = graphmp.convert(m, None, calibration=_batches(1), plan=str(p), fp32_nodes="^mm$")
    over = {o["name"]: o for o in rep["plan"]["overruled"]}
    assert set(over) == {"int_cast", "mm"} and all(o["kept"] == "fp32" for o in over.values())
    assert "integer-derived" in over["int_cast"]["why"] and "--fp32-nodes" in over["mm"]["why"]
    assert set(rep.fp32_nodes) == {"int_cast", "mm"}
    (line,) = [w for w in rep["warnings"] if "overruled" in w]
    assert "2 entries overruled" in line


def _renamed_everywhere(src, dst):
    m = onnx.load(src)
    i = 0
    for g in iter_graphs(m.graph):
        for n in g.node:
            n.name = f"renamed_{i}"
            i += 1
    onnx.save(m, dst)


def test_subgraph_nodes_match_by_scope_after_renaming(tmp_path):
    """Silero VAD (nodes in nested If branches): every node renamed, including the Ifs that
    name the subgraphs; a plan entry inside a branch flipped to FP32 still finds its node."""
    cal = [{"input": (np.random.default_rng(0).standard_normal((1, 512)) * 0.1).astype(np.float32),
            "state": np.zeros((2, 1, 128), np.float32), "sr": np.array(16000, np.int64)}]
    p = tmp_path / "vad.plan.json"
    graphmp.convert(SILERO, None, calibration=cal, save_plan=str(p))
    d = json.load(open(p))
    flip = next(e for e in d["nodes"] if e["graph"] != "main" and e["precision"] == "low" and e["op_type"] == "Conv")
    flip["precision"] = "fp32"
    json.dump(d, open(p, "w"))
    _renamed_everywhere(SILERO, tmp_path / "vad2.onnx")
    rep = graphmp.convert(str(tmp_path / "vad2.onnx"), None, calibration=cal, plan=str(p))
    pl = rep["plan"]
    assert pl["matched"] == pl["matched_by_position"] == len(d["nodes"]) and pl["changed"] == 1
    assert not pl["unmatched_nodes"] and not pl["unmatched_entries"] and pl["same_structure"]
    (moved,) = [name for name, r in rep.fp32_nodes.items() if r.startswith("plan:")]
    assert moved.startswith("renamed_") and pl["met"] is True


# --------------------------------------------------------------------------- bad plan files
def _plan(**over):
    d = {"schema": "graphmp.plan", "version": 1, "nodes": [
        {"graph": "main", "scope": "main", "op_type": "MatMul", "index": 0, "name": "mm1", "precision": "low",
         "reason": None}]}
    for k, v in over.items():
        if k.startswith("node_"):
            d["nodes"][0][k[5:]] = v
        else:
            d[k] = v
    return json.dumps(d)


BAD = [
    ("not-json", "{not json", "not JSON"),
    ("top-level-list", "[1, 2]", "plan key '(top level)' must be an object"),
    ("wrong-schema", _plan(schema="onnx.model"), "plan key 'schema' is 'onnx.model'"),
    ("wrong-version", _plan(version=2), "plan key 'version' is 2"),
    ("version-bool", _plan(version=True), "plan key 'version' must be an integer"),
    ("nodes-not-list", _plan(nodes={"a": 1}), "plan key 'nodes' must be a list"),
    ("missing-nodes", json.dumps({"schema": "graphmp.plan", "version": 1}), "plan key 'nodes' is missing"),
    ("unknown-key", _plan(run="rm -rf /"), "plan key 'run' is not a key"),
    ("precision", _plan(node_precision="fp8"), "plan key 'nodes[0].precision' must be 'low' or 'fp32'"),
    ("index-string", _plan(node_index="3"), "plan key 'nodes[0].index' must be an integer"),
    ("index-negative", _plan(node_index=-1), "plan key 'nodes[0].index' must be >= 0"),
    ("name-huge", _plan(node_name="n" * 100000), "plan key 'nodes[0].name' is 100000 characters"),
    ("budget-bad", _plan(budget={"max_error": "lots", "metric": "max-rel"}), "plan key 'budget.max_error'"),
    ("metric-bad", _plan(budget={"max_error": 0.01, "metric": "cosine"}), "plan key 'budget.metric'"),
    ("nan", _plan().replace('"version": 1', '"version": NaN'), "holds NaN"),
    ("overflow", _plan(budget={"max_error": 1, "metric": "max-rel"}).replace('"max_error": 1', '"max_error": 1e999'),
     "beyond the float range"),
    ("duplicate-key", _plan().replace('"version": 1', '"version": 1, "version": 1'), "holds key 'version' twice"),
    ("deep", "[" * 200000 + "]" * 200000, "nested too deeply"),
    ("not-utf8", b"\xff\xfe{}", "not UTF-8"),
    ("huge", None, "larger than 64 MiB"),
]


@pytest.fixture
def model_file(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(branched(), src)
    return src


@pytest.mark.parametrize("label, content, needle", BAD, ids=[b[0] for b in BAD])
def test_bad_plan_is_one_line_exit_2(model_file, tmp_path, capsys, label, content, needle):
    p = tmp_path / "bad.json"
    if content is None:  # sparse: 65 MiB of nothing, no disk
        with open(p, "wb") as f:
            f.truncate(65 << 20)
    else:
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    before, out = _sha(model_file), tmp_path / "o.onnx"
    rc = main(["convert", str(model_file), "-o", str(out), "--plan", str(p), "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"graphmp: error: {p}") and needle in err, err
    assert not out.exists() and _sha(model_file) == before


def test_bad_plan_in_a_process_has_no_traceback(model_file, tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(_plan(node_precision=["low"]))
    r = subprocess.run([sys.executable, "-m", "graphmp.cli", "convert", str(model_file), "-o", str(tmp_path / "o.onnx"),
                        "--plan", str(p)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"graphmp: error: {p}: plan key 'nodes[0].precision' must be a string, "
                                             "not list (a plan is the JSON that graphmp convert --save-plan writes)"]


def test_plan_as_api_argument_is_checked():
    with pytest.raises(GraphmpError, match="plan key 'schema'"):
        graphmp.convert(branched(), None, plan={"schema": "x", "version": 1, "nodes": []})
    with pytest.raises(GraphmpError, match="must be a plan file path"):
        graphmp.convert(branched(), None, plan=42)


# --------------------------------------------------------------------------- --save-plan never replaces an input
def test_save_plan_naming_an_input_is_refused(model_file, saved, tmp_path, capsys):
    plan, _ = saved
    before, plan_before, out = _sha(model_file), _sha(plan), tmp_path / "o.onnx"
    for target, what in ((model_file, "the model"), (plan, "the --plan file")):
        rc = main(["convert", str(model_file), "-o", str(out), "--plan", str(plan), "--save-plan", str(target), "-q"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and f"--save-plan is the same file as {what}" in err, err
    assert main(["convert", str(model_file), "-o", str(out), "--save-plan", str(out), "-q"]) == 2
    assert "name the same file" in capsys.readouterr().err
    assert not out.exists() and _sha(model_file) == before and _sha(plan) == plan_before
    with pytest.raises(GraphmpError, match="--save-plan is the same file as the model"):  # the API, too
        graphmp.convert(str(model_file), str(out), save_plan=str(model_file), calibration=_batches(1))
    assert not out.exists() and _sha(model_file) == before

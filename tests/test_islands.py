"""The islands pass (issue 26, graphmp/passes/islands.py): an FP32 island whose Casts cost a
large share of the model's bytes is measured; it goes FP16 only where no output's error
grows, an island that buys accuracy stays, user-pinned nodes are never tried, and an FP16
group between FP32 work whose Casts cost more than its Tensor Core work joins the FP32."""
import re

import numpy as np
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nph

import graphmp
from fixtures import tiny
from graphmp.check import check


def _model(nodes, inputs, outputs, inits, opset=17):
    return tiny.checked_model(nodes, inputs, outputs, inits, "islands", opset)


def _w(seed, shape, scale=0.3):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _feeds(name, shape, seeds=(1, 2)):
    return [{name: np.random.default_rng(s).standard_normal(shape).astype(np.float32)} for s in seeds]


def _casts(model) -> int:
    return sum(n.op_type == "Cast" for n in model.graph.node)


def _trial(rep, kind):
    return next(t for t in rep.to_dict()["islands"]["trials"] if t["kind"] == kind)


def free_island():
    """x -> convA -> ReduceSum over the batch axis (size 1: exact) -> convB -> y. The
    ReduceSum is an FP32 island by its op class; in FP16 it computes the same values."""
    nodes = [oh.make_node("Conv", ["x", "wa"], ["a"], name="convA", pads=[1, 1, 1, 1]),
             oh.make_node("ReduceSum", ["a", "axes"], ["s"], name="rsum", keepdims=1),
             oh.make_node("Conv", ["s", "wb"], ["y"], name="convB", pads=[1, 1, 1, 1])]
    inits = [nph.from_array(_w(1, (4, 4, 3, 3)), "wa"), nph.from_array(_w(2, (4, 4, 3, 3)), "wb"),
             nph.from_array(np.array([0], np.int64), "axes")]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [1, 4, 8, 8])],
                  [oh.make_tensor_value_info("y", TP.FLOAT, [1, 4, 8, 8])], inits)


def test_an_island_that_buys_no_accuracy_goes_fp16_and_its_casts_go():
    m, data = free_island(), _feeds("x", (1, 4, 8, 8))
    kept = graphmp.convert(m, None, calibration=data, island_trials=0)
    rep = graphmp.convert(m, None, calibration=data)
    assert kept.fp32_nodes["rsum"].startswith("ReduceSum is range-sensitive")
    assert "rsum" not in rep.fp32_nodes and "rsum" not in rep.to_dict()["norm_io"]["lowered"]
    assert _casts(kept.model) == 4 and _casts(rep.model) == 2          # x in, y out: the island's two Casts went
    t = _trial(rep, "drop")
    assert t["seeds"] == ["rsum"] and t["decision"].startswith("FP16")
    assert t["errors_after"]["y"] <= t["errors_before"]["y"] + 2 ** -20
    d = rep.to_dict()
    assert d["islands"]["cast_bytes_after"] < d["islands"]["cast_bytes_before"]
    assert d["cast_traffic"]["bytes"] < kept.to_dict()["cast_traffic"]["bytes"]
    assert check(m, rep.model, data).passed


def test_user_pinned_fp32_nodes_are_never_tried():
    m, data = free_island(), _feeds("x", (1, 4, 8, 8))
    rep = graphmp.convert(m, None, calibration=data, fp32_nodes="^rsum$")
    assert rep.fp32_nodes["rsum"] == "user: --fp32-nodes" and _casts(rep.model) == 4
    assert not [t for t in rep.to_dict()["islands"]["trials"] if t["kind"] == "drop"]
    rep = graphmp.convert(m, None, calibration=data, fp32_ops=["ReduceSum"])
    assert rep.fp32_nodes["rsum"] == "user: --fp32-ops" and _casts(rep.model) == 4


def variance():
    """x -> MatMul -> +8 -> h; var = mean(h*h) - mean(h)^2 (a decomposed variance, as
    jax2tf exports it) is an output; y = MatMul(h) another. In FP16 the squares round to
    1/32 at ~100 and the difference (~1) keeps little of them: the island buys accuracy."""
    nodes = [oh.make_node("MatMul", ["x", "w1"], ["m"], name="mm1"),
             oh.make_node("Add", ["m", "eight"], ["h"], name="shift"),
             oh.make_node("ReduceMean", ["h"], ["mean"], name="mean", axes=[-1]),
             oh.make_node("Mul", ["h", "h"], ["sq"], name="square"),
             oh.make_node("ReduceMean", ["sq"], ["ms"], name="mean_sq", axes=[-1]),
             oh.make_node("Mul", ["mean", "mean"], ["m2"], name="mean2"),
             oh.make_node("Sub", ["ms", "m2"], ["var"], name="var"),
             oh.make_node("MatMul", ["h", "w2"], ["y"], name="mm2")]
    inits = [nph.from_array(_w(3, (16, 16)), "w1"), nph.from_array(_w(4, (16, 16)), "w2"),
             nph.from_array(np.array(8.0, np.float32), "eight")]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [4, 16])],
                  [oh.make_tensor_value_info("var", TP.FLOAT, [4, 1]), oh.make_tensor_value_info("y", TP.FLOAT, [4, 16])],
                  inits)


def test_an_island_that_buys_accuracy_stays_fp32():
    m, data = variance(), _feeds("x", (4, 16))
    rep = graphmp.convert(m, None, calibration=data)
    for name in ("mean", "square", "mean_sq", "var"):
        assert name in rep.fp32_nodes, (name, rep.fp32_nodes)
    t = _trial(rep, "drop")
    assert t["decision"].startswith("kept FP32: it buys accuracy")
    assert t["errors_after"]["var"] > t["errors_before"]["var"]
    assert _casts(rep.model) == _casts(graphmp.convert(m, None, calibration=data, island_trials=0).model)


def branch_into_fp32():
    """x -> convA (3->4, 1x1: few FLOPs) -> Tanh -> convB (kept FP32 by --fp32-nodes) -> y1
       x -> convC (3->8, 3x3: the model's Tensor Core work) -> y2
    convA/Tanh sit between the FP32 input and FP32 work: FP16 there costs the Cast of
    Tanh's output, more than convA's FLOPs are worth."""
    nodes = [oh.make_node("Conv", ["x", "wa"], ["a"], name="convA"),
             oh.make_node("Tanh", ["a"], ["t"], name="tanh"),
             oh.make_node("Conv", ["t", "wb"], ["y1"], name="convB"),
             oh.make_node("Conv", ["x", "wc"], ["y2"], name="convC", pads=[1, 1, 1, 1])]
    inits = [nph.from_array(_w(5, (4, 3, 1, 1)), "wa"), nph.from_array(_w(6, (4, 4, 1, 1)), "wb"),
             nph.from_array(_w(7, (8, 3, 3, 3)), "wc")]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [1, 3, 8, 8])],
                  [oh.make_tensor_value_info("y1", TP.FLOAT, [1, 4, 8, 8]),
                   oh.make_tensor_value_info("y2", TP.FLOAT, [1, 8, 8, 8])], inits)


def test_an_fp16_group_between_fp32_work_joins_it_when_its_casts_cost_more():
    m, data = branch_into_fp32(), _feeds("x", (1, 3, 8, 8))
    rep = graphmp.convert(m, None, calibration=data, fp32_nodes="^convB$")
    for name in ("convA", "tanh"):
        assert rep.fp32_nodes[name].startswith("islands: merged with its FP32 neighbours"), rep.fp32_nodes
    assert "convC" not in rep.fp32_nodes
    t = _trial(rep, "merge")
    assert t["nodes"] == ["convA", "tanh"] and t["cast_bytes_saved"] > t["flops_worth_bytes"]
    off = graphmp.convert(m, None, calibration=data, fp32_nodes="^convB$", island_trials=0)
    assert "convA" not in off.fp32_nodes and _casts(rep.model) == _casts(off.model) - 1
    assert check(m, rep.model, data).passed


def test_nothing_is_tried_without_batches():
    m = free_island()
    assert "islands" not in graphmp.convert(m, None, calibration="off").to_dict()


def test_with_a_budget_the_islands_run_on_the_searchs_plan_within_the_budget():
    """Issue 35: --max-error plans are priced for their Casts as the default is: the island
    that buys nothing goes FP16 after the search, judged by the budget, and the written
    model is verified against it."""
    m, data = free_island(), _feeds("x", (1, 4, 8, 8), seeds=(1, 2, 3))
    rep = graphmp.convert(m, None, calibration=data, max_error=0.05)
    d = rep.to_dict()
    assert "rsum" not in rep.fp32_nodes and _casts(rep.model) == 2
    t = _trial(rep, "drop")
    assert t["decision"].startswith("FP16: without it every output stays within 0.67 x --max-error")
    assert d["islands"]["yardstick"].startswith("the --max-error budget")
    assert d["search"]["verified"]["normalized"] <= 1 and d["search"]["reached"] is True
    assert d["search"]["error"] == d["search"]["verified"]["normalized"]  # the written model's error is the verdict
    assert "met (the written model, after the island trials)" in rep.summary()
    pinned = graphmp.convert(m, None, calibration=data, max_error=0.05, island_trials=0)
    assert pinned.fp32_nodes["rsum"].startswith("ReduceSum is range-sensitive")
    assert d["cast_traffic"]["bytes"] < pinned.to_dict()["cast_traffic"]["bytes"]


def test_with_a_budget_the_budget_decides_what_an_island_buys():
    """chain(2, buys={0}): island 0 buys accuracy (its +-300 round trip rounds to 0.25 in
    FP16: error ~0.06 against ~7e-4). Under --max-error 1e-3 it stays FP32, as by default;
    under 0.5 the budget allows its error, and it goes FP16 with its Casts."""
    m, data = chain(2, buys={0}), _feeds("x", (1, 4, 8, 8), seeds=(1, 2, 3))
    assert "rsum0" in graphmp.convert(m, None, calibration=data).fp32_nodes
    tight = graphmp.convert(m, None, calibration=data, max_error=1e-3, island_trials=4)
    assert "rsum0" in tight.fp32_nodes and tight.to_dict()["search"]["verified"]["normalized"] <= 1
    decision = _trial(tight, "drop")["decision"]
    assert re.match(r"kept FP32: it buys accuracy \(y: 0.000[0-9]+ allowed, 0.0[0-9]+ in this one\)", decision)
    loose = graphmp.convert(m, None, calibration=data, max_error=0.5, island_trials=4)
    assert "rsum0" not in loose.fp32_nodes and _casts(loose.model) < _casts(tight.model)
    assert loose.to_dict()["search"]["verified"]["normalized"] <= 1


def test_island_steps_are_those_its_docstring_lists():
    from graphmp.passes import islands
    listed = re.findall(r"^\s+(\d+)\. (\w+):", islands.__doc__, re.M)
    assert [int(i) for i, _ in listed] == list(range(1, len(islands.STEPS) + 1))
    assert [name for _, name in listed] == [name for name, _ in islands.STEPS]


def test_without_island_trials_a_model_over_the_weight_limit_is_not_measured(monkeypatch):
    """The default measures only models whose weights are at most AUTO_MAX_WEIGHT_BYTES (a
    trial runs an emulated copy of the model: BERT-base's 438 MB took 1.8 GB more); the report
    says why, and --island-trials N measures anyway."""
    from graphmp.passes import islands
    m, data = free_island(), _feeds("x", (1, 4, 8, 8))
    monkeypatch.setattr(islands, "AUTO_MAX_WEIGHT_BYTES", 100)      # the tiny model's 1.2 KB is over it
    big = graphmp.convert(m, None, calibration=data)
    assert big.fp32_nodes["rsum"].startswith("ReduceSum is range-sensitive")   # paint's plan, unmeasured
    assert "not measured" in big.to_dict()["islands"]["skipped"] and "--island-trials" in big.to_dict()["islands"]["skipped"]
    forced = graphmp.convert(m, None, calibration=data, island_trials=4)
    assert "rsum" not in forced.fp32_nodes and _trial(forced, "drop")["decision"].startswith("FP16")


def test_without_island_trials_the_trials_stop_when_the_work_budget_is_spent(monkeypatch):
    from graphmp.passes import islands
    m, data = free_island(), _feeds("x", (1, 4, 8, 8))
    monkeypatch.setattr(islands, "AUTO_WORK", 1.0)  # under one emulated run: paint's plan only
    rep = graphmp.convert(m, None, calibration=data)
    t = _trial(rep, "drop")
    assert t["decision"].startswith("not tried: the step's work budget is spent") and "rsum" in rep.fp32_nodes
    assert rep.to_dict()["islands"]["trials_allowed"] == 0
    assert "rsum" not in graphmp.convert(m, None, calibration=data, island_trials=4).fp32_nodes  # N forces


def test_the_work_budget_counts_runs_not_seconds(monkeypatch):
    """Issue 35: a machine where every clock reading is 1000 s after the last (a loaded or
    slow machine, exaggerated) gets the trials, decisions and bytes of an idle one; the budget
    sized for one trial allows one, whatever the clock says."""
    import itertools
    from graphmp.passes import islands
    m, data = chain(2), _feeds("x", (1, 4, 8, 8))
    work = graphmp.convert(m, None, calibration=data).to_dict()["islands"]["work_per_run"]
    monkeypatch.setattr(islands, "AUTO_WORK", 2 * work)  # paint's plan and one trial
    idle = graphmp.convert(m, None, calibration=data)
    clock = itertools.count(0.0, 1000.0)
    monkeypatch.setattr(islands.time, "perf_counter", lambda: float(next(clock)))
    slow = graphmp.convert(m, None, calibration=data)
    assert [t["decision"] for t in slow.to_dict()["islands"]["trials"]] == \
        [t["decision"] for t in idle.to_dict()["islands"]["trials"]]
    assert slow.to_dict()["islands"]["runs"] == idle.to_dict()["islands"]["runs"] == 2
    assert slow.model.SerializeToString() == idle.model.SerializeToString()


def test_search_time_stops_the_trials_and_says_the_plan_depends_on_the_machine(monkeypatch):
    import itertools
    from graphmp.passes import islands
    m, data = free_island(), _feeds("x", (1, 4, 8, 8))
    clock = itertools.count(0.0, 1000.0)
    monkeypatch.setattr(islands.time, "perf_counter", lambda: float(next(clock)))
    rep = graphmp.convert(m, None, calibration=data, search_time=5)
    assert _trial(rep, "drop")["decision"].startswith("not tried: --search-time 5 s ran out") and "rsum" in rep.fp32_nodes
    assert "stopped the island trials" in rep.to_dict()["plan_depends_on_machine"]
    assert "plan: depends on this machine: --search-time 5 s" in rep.summary()


def chain(k, buys=()):
    """x -> k x (conv -> ReduceSum over the batch axis) -> y: k islands of one op type, each
    moving about 1/k of the Cast bytes (under MIN_SHARE for k = 12) and computing the same
    values in FP16 (a sum over one element). An island in `buys` also adds and subtracts 300
    after its sum: in FP32 the round trip is exact, in FP16 it rounds to 0.25 -- that island
    buys accuracy."""
    nodes, x = [], "x"
    inits = [nph.from_array(np.array([0], np.int64), "axes"), nph.from_array(np.array(300.0, np.float32), "off")]
    for i in range(k):
        nodes.append(oh.make_node("Conv", [x, f"w{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]))
        inits.append(nph.from_array(_w(10 + i, (4, 4, 3, 3)), f"w{i}"))
        nodes.append(oh.make_node("ReduceSum", [f"c{i}", "axes"], [f"r{i}"], name=f"rsum{i}", keepdims=1))
        x = f"r{i}"
        if i in buys:
            nodes += [oh.make_node("Add", [x, "off"], [f"u{i}"], name=f"up{i}"),
                      oh.make_node("Sub", [f"u{i}", "off"], [f"d{i}"], name=f"down{i}")]
            x = f"d{i}"
    nodes.append(oh.make_node("Identity", [x], ["y"], name="out"))
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [1, 4, 8, 8])],
                  [oh.make_tensor_value_info("y", TP.FLOAT, [1, 4, 8, 8])], inits)


def test_islands_of_one_op_type_too_small_alone_are_tried_as_one_group():
    from graphmp.passes import islands
    m, data = chain(12), _feeds("x", (1, 4, 8, 8))
    kept = graphmp.convert(m, None, calibration=data, island_trials=0)
    assert _casts(kept.model) == 24                                    # each island: a Cast in, a Cast out
    rep = graphmp.convert(m, None, calibration=data)
    trials = rep.to_dict()["islands"]["trials"]
    assert len(trials) == 1, trials                                    # no island alone was worth a run
    t = trials[0]
    assert t["group"] == "ReduceSum" and t["islands"] == 12 and t["decision"].startswith("FP16")
    assert t["share_of_cast_bytes"] > islands.MIN_SHARE > 1 / 12
    assert not [n for n in rep.fp32_nodes if n.startswith("rsum")] and _casts(rep.model) == 2
    assert check(m, rep.model, data).passed


def test_a_refused_group_is_split_until_the_island_that_buys_accuracy_is_found():
    m, data = chain(12, buys=(5,)), _feeds("x", (1, 4, 8, 8))
    paint = graphmp.convert(m, None, calibration=data, island_trials=0)
    rep = graphmp.convert(m, None, calibration=data, island_trials=12)
    d = rep.to_dict()["islands"]
    groups = [t for t in d["trials"] if t.get("group")]
    assert groups[0]["islands"] == 12 and groups[0]["decision"].startswith("kept FP32: it buys accuracy")
    assert [t["islands"] for t in groups[:2]] == [12, 6]               # then its halves, graph order
    for name in ("rsum5", "up5", "down5"):                             # the island that buys accuracy stays
        assert name in rep.fp32_nodes, rep.fp32_nodes
    for i in (0, 1, 2, 6, 7, 8, 9, 10, 11):                            # the halves without it went FP16
        assert f"rsum{i}" not in rep.fp32_nodes
    assert _casts(rep.model) <= _casts(paint.model) - 14
    # the yardstick is paint's plan: no output's error above it, in every accepted trial and at the end
    for t in d["trials"]:
        if t["decision"].startswith("FP16"):
            assert t["errors_after"]["y"] <= d["errors_paint"]["y"]
    assert d["errors_after"]["y"] <= d["errors_paint"]["y"]
    assert check(m, rep.model, data).passed


def merge_then_drop():
    """x (1 + 1e-3 noise) -> convA (1x1 differences of channels: FP16 input loses them) -> Tanh
    -> rsum1 -> convB -> rsum2 -> convC -> y. convA/Tanh sit between the FP32 input and the
    island rsum1: merged into FP32 first (they also take error away); then the two free
    ReduceSum islands go FP16 as a group, and convA/Tanh in FP32 would cost the Cast of Tanh's
    4 channels where FP16 costs the input's 3."""
    nodes = [oh.make_node("Conv", ["x", "wa"], ["a"], name="convA"),
             oh.make_node("Tanh", ["a"], ["t"], name="tanh"),
             oh.make_node("ReduceSum", ["t", "axes"], ["r1"], name="rsum1", keepdims=1),
             oh.make_node("Conv", ["r1", "wb"], ["b"], name="convB", pads=[1, 1, 1, 1]),
             oh.make_node("ReduceSum", ["b", "axes"], ["r2"], name="rsum2", keepdims=1),
             oh.make_node("Conv", ["r2", "wc"], ["y"], name="convC", pads=[1, 1, 1, 1])]
    wa = np.array([[1, -1, 0], [0, 1, -1], [1, 0, -1], [1, 1, -2]], np.float32).reshape(4, 3, 1, 1) * 100
    inits = [nph.from_array(wa, "wa"), nph.from_array(_w(6, (4, 4, 3, 3)), "wb"),
             nph.from_array(_w(7, (4, 4, 3, 3)), "wc"), nph.from_array(np.array([0], np.int64), "axes")]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [1, 3, 8, 8])],
                  [oh.make_tensor_value_info("y", TP.FLOAT, [1, 4, 8, 8])], inits)


def test_a_drop_that_takes_a_merges_islands_undoes_the_merge():
    m = merge_then_drop()
    data = [{"x": (1 + 1e-3 * np.random.default_rng(s).standard_normal((1, 3, 8, 8))).astype(np.float32)} for s in (1, 2)]
    rep = graphmp.convert(m, None, calibration=data)
    d = rep.to_dict()["islands"]
    assert [(t["kind"], t["decision"].split(":")[0]) for t in d["trials"]] == \
        [("merge", "FP32, then undone"), ("drop", "FP16")], d["trials"]
    drop = d["trials"][1]
    assert drop["group"] == "ReduceSum" and drop["merges_undone"] == ["convA", "tanh"]
    assert drop["errors_after"]["y"] <= d["errors_paint"]["y"]
    assert "convA" not in rep.fp32_nodes and "tanh" not in rep.fp32_nodes and _casts(rep.model) == 2
    assert d["cast_bytes_after"] == d["cast_bytes_before"] - sum(
        t["cast_bytes_saved"] for t in d["trials"] if t["decision"].startswith(("FP16", "FP32")))  # each on the plan before it
    assert check(m, rep.model, data).passed


def two_branches_into_fp32():
    """branch_into_fp32 twice: x -> convAk (3->4, 1x1) -> Tanh -> convBk (pinned FP32) -> yk for
    k = 1, 2, beside x -> convC (3x3, the Tensor Core work) -> y3: two FP16 segments, each
    worth merging, measured as one group."""
    nodes, inits, outs = [], [], []
    for k in (1, 2):
        nodes += [oh.make_node("Conv", ["x", f"wa{k}"], [f"a{k}"], name=f"convA{k}"),
                  oh.make_node("Tanh", [f"a{k}"], [f"t{k}"], name=f"tanh{k}"),
                  oh.make_node("Conv", [f"t{k}", f"wb{k}"], [f"y{k}"], name=f"convB{k}")]
        inits += [nph.from_array(_w(5 + k, (4, 3, 1, 1)), f"wa{k}"), nph.from_array(_w(7 + k, (4, 4, 1, 1)), f"wb{k}")]
        outs.append(oh.make_tensor_value_info(f"y{k}", TP.FLOAT, [1, 4, 8, 8]))
    nodes.append(oh.make_node("Conv", ["x", "wc"], ["y3"], name="convC", pads=[1, 1, 1, 1]))
    inits.append(nph.from_array(_w(11, (8, 3, 3, 3)), "wc"))
    outs.append(oh.make_tensor_value_info("y3", TP.FLOAT, [1, 8, 8, 8]))
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [1, 3, 8, 8])], outs, inits)


def test_merges_worth_measuring_are_measured_as_one_group_first():
    m, data = two_branches_into_fp32(), _feeds("x", (1, 3, 8, 8))
    rep = graphmp.convert(m, None, calibration=data, fp32_nodes="^convB[12]$")
    d = rep.to_dict()["islands"]
    first = d["trials"][0]
    assert first["kind"] == "merge" and first["group"] == "merges" and first["segments"] == 2
    assert first["decision"].startswith("FP32") and d["runs"] == 2          # paint's plan, then the one group
    for name in ("convA1", "tanh1", "convA2", "tanh2"):
        assert rep.fp32_nodes[name].startswith("islands: merged with its FP32 neighbours"), rep.fp32_nodes
    assert "convC" not in rep.fp32_nodes
    assert check(m, rep.model, data).passed

"""The passes' contracts as data (graphmp/passes/__init__.py: Step, run_steps) and their
checks: the real PIPELINE keeps them on real models, a broken pipeline is caught with an
error that names the step and the field, and padding's PAD_STEPS do the same."""
from __future__ import annotations

import os

import onnx
import pytest

import graphmp
from graphmp.context import Ctx, Options
from graphmp.convert import PIPELINE, run_pipeline
from graphmp.pad import PAD_STEPS, PadState, pad, pad_model
from graphmp.passes import ContractError, PassResult, Step, checking, run_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(rel):
    return os.path.join(ROOT, "models", rel)


def _step(name):
    return next(s for s in PIPELINE if s.name == name)


@pytest.fixture
def debug(monkeypatch):
    monkeypatch.setenv("GRAPHMP_DEBUG", "1")


# ------------------------------------------------------------------ the real pipeline
@pytest.mark.parametrize("rel", ["tiny/bert.onnx", "tiny/resnet.onnx", "tiny/gpt2.onnx",
                                 "real/silero_vad.onnx",             # 51 graphs: If/Loop bodies
                                 "real/super_resolution_qdq.onnx"])  # Q/DQ
def test_pipeline_keeps_its_contracts(debug, rel):
    rep = graphmp.convert(_model(rel))
    assert rep["pipeline"]["contracts_checked"] is True
    changed = rep["pipeline"]["changed"]  # PassResult.changed, recorded
    assert "apply.run" in changed and "convert.sort" in changed
    assert "types.run" not in changed and "classify.run" not in changed
    assert {s.name for s in PIPELINE} <= set(rep["timings"])


def test_search_and_plan_steps_keep_their_contracts(debug, tmp_path):
    """The steps that do their job only with --max-error / --save-plan / --plan (`when`)."""
    plan = tmp_path / "p.plan.json"
    rep = graphmp.convert(_model("real/mnist_cntk.onnx"), max_error=1e-2, save_plan=str(plan))
    assert rep["pipeline"]["contracts_checked"] and "budget" in rep["search"] and plan.exists()
    rep = graphmp.convert(_model("real/mnist_cntk.onnx"), plan=str(plan))
    assert rep["pipeline"]["contracts_checked"] and "met" in rep["plan"]


def test_fuse_keeps_its_contract(debug):
    pytest.importorskip("sympy")
    pytest.importorskip("onnxruntime.transformers")
    rep = graphmp.convert(_model("tiny/bert.onnx"), fuse="ort")
    assert rep["pipeline"]["contracts_checked"] and rep["fuse"]["fused"]


def test_pipeline_declarations_are_consistent():
    """Every field named is a Ctx field, and every need is given by an earlier step (or is
    the model, which the context starts with)."""
    known = set(Ctx.__dataclass_fields__)
    given = {"model"}
    for s in PIPELINE:
        assert set(s.needs) | set(s.gives) <= known, s.name
        assert set(s.needs) <= given, (s.name, set(s.needs) - given)
        given |= set(s.gives)


def test_checks_are_on_in_tests_and_with_graphmp_debug(monkeypatch):
    assert checking()  # tests/conftest.py sets GRAPHMP_DEBUG=1
    monkeypatch.delenv("GRAPHMP_DEBUG", raising=False)
    assert not checking()
    monkeypatch.setenv("GRAPHMP_DEBUG", "1")
    assert checking()


# ------------------------------------------------------------------ broken pipelines
def _ctx(rel="tiny/resnet.onnx"):
    return Ctx(model=onnx.load(_model(rel)), options=Options.from_kwargs({}), path=rel)


def test_a_missing_need_names_the_step_and_the_field():
    ran = []

    def classify_spy(ctx):
        ran.append(True)
        return PassResult(changed=False)

    steps = [_step("prepare.run"), Step("classify", classify_spy, needs=_step("classify.run").needs)]
    with pytest.raises(ContractError, match=r"step test_pipeline_contracts\.classify_spy needs 'types', "
                                            r"which no earlier step gives"):
        run_pipeline(_ctx(), steps, check=True)
    assert not ran  # checked before the step runs
    # the real PIPELINE less a step: the first reader of what it gives is named
    with pytest.raises(ContractError, match=r"step prepare\.run_drop_redundant_casts needs 'types'"):
        run_pipeline(_ctx(), [s for s in PIPELINE if s.name != "types.run"], check=True)
    with pytest.raises(ContractError, match=r"step classify\.run needs 'ranges'"):
        run_pipeline(_ctx(), [s for s in PIPELINE if s.name != "calibrate.run"], check=True)


def test_a_field_not_given_names_the_step_and_the_field():
    def gives_nothing(ctx):
        return PassResult(changed=False)

    steps = [_step("prepare.run"), Step("plan", gives_nothing, needs=("root",), gives=("plan",))]
    with pytest.raises(ContractError, match=r"step test_pipeline_contracts\.gives_nothing declares it gives "
                                            r"'plan', but 'plan' is None after it"):
        run_pipeline(_ctx(), steps, check=True)
    # a container field is checked for what the pass guarantees (types: every graph)
    steps = [_step("prepare.run"), Step("types", gives_nothing, needs=("root",), gives=("types",))]
    with pytest.raises(ContractError, match=r"gives_nothing declares it gives 'types', but after it 'types' "
                                            r"does not hold an entry for every graph"):
        run_pipeline(_ctx("real/silero_vad.onnx"), steps, check=True)


def test_when_gates_the_contract_and_checks_off_cost_nothing():
    def gives_nothing(ctx):
        return PassResult(changed=False)

    broken = [Step("plan", gives_nothing, needs=("search_budget",), gives=("plan",))]
    run_pipeline(_ctx(), [Step("plan", gives_nothing, needs=("search_budget",), gives=("plan",),
                               when=lambda ctx: False)], check=True)  # not its job here: no check
    ctx = _ctx()
    assert run_pipeline(ctx, broken, check=False) and ctx.report["pipeline"]["contracts_checked"] is False
    with pytest.raises(ContractError, match=r"needs 'search_budget'"):
        run_pipeline(_ctx(), broken, check=True)


# ------------------------------------------------------------------ padding
def test_pad_steps_keep_their_contracts(debug, tmp_path):
    rep = pad(_model("tiny/resnet.onnx"), tmp_path / "p.onnx", multiple=8)
    assert rep["aligned_after"]["aligned"] >= rep["aligned_before"]["aligned"]
    rep = graphmp.convert(_model("tiny/resnet.onnx"), pad_channels=8)
    assert "padding" in rep.to_dict() and rep["pipeline"]["contracts_checked"]


def test_pad_steps_broken_names_the_step_and_the_field():
    st = PadState(onnx.load(_model("tiny/resnet.onnx")), None, 8)
    with pytest.raises(ContractError, match=r"step pad\._measure_before needs 'names'"):
        list(run_steps(st, PAD_STEPS[1:], check=True))
    st = PadState(onnx.load(_model("tiny/resnet.onnx")), None, 8)
    with pytest.raises(ContractError, match=r"step pad\._sort_model needs 'padding'"):
        list(run_steps(st, PAD_STEPS[:2] + PAD_STEPS[3:], check=True))
    pad_model(onnx.load(_model("tiny/resnet.onnx")), None, 8, check=True)  # the real steps keep them

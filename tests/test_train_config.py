"""StepConfig / TrainConfig (graphmp.train.config): the options of build_step and train, checked
once at the boundary. An unknown key is a TypeError naming it; a bad value a GraphmpError that
names the option and says what to pass (before any file is written); a checked config round-trips
and builds / trains exactly as the same keywords do."""
import dataclasses
import json
import os

import numpy as np
import onnx
import pytest

from fixtures import tiny as tm
from graphmp.cli import main
from graphmp.cli.train import STEP_FLAGS, TRAIN_FLAGS
from graphmp.errors import GraphmpError
from graphmp.train import StepConfig, TrainConfig, build_step, train


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("mlp") / "mlp.onnx")
    onnx.save(tm.mlp(), p)
    return p


# --- unknown keys ---------------------------------------------------------------------------------

def test_unknown_keys_are_named(mlp_path, tmp_path):
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['lrr'\]") as e:
        StepConfig.from_kwargs(lrr=0.1)
    assert "'lr'" in str(e.value)  # the options are listed
    with pytest.raises(TypeError, match=r"build_step\(\) got unknown option\(s\) \['lrr'\]"):
        build_step(mlp_path, str(tmp_path / "run"), lrr=0.1)
    assert not os.path.exists(tmp_path / "run")
    with pytest.raises(TypeError, match=r"train\(\) got unknown option\(s\) \['epoch'\]"):
        TrainConfig.from_kwargs(epoch=3)
    with pytest.raises(TypeError, match=r"\['epoch'\]"):
        train(str(tmp_path / "nope"), tm.blobs(16), epoch=3)  # before the run folder is looked at
    with pytest.raises(TypeError, match="must be a StepConfig"):
        build_step(mlp_path, str(tmp_path / "run"), {"lr": 0.1})
    with pytest.raises(TypeError, match="must be a TrainConfig"):
        train(str(tmp_path / "nope"), tm.blobs(16), {"epochs": 1})


# --- bad values -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,msg", [
    ({"lr": 0}, "lr must be > 0 (got 0.0)"),
    ({"lr": "fast"}, "lr must be a number (got 'fast')"),
    ({"optimizer": "adam"}, "optimizer must be one of ('adamw', 'sgd'), not 'adam'"),
    ({"precision": "fp8"}, "precision must be one of ('mixed', 'fp32', 'bf16'), not 'fp8'"),
    ({"loss": "hinge"}, "loss must be one of"),
    ({"loss_scale": -3}, "loss_scale must be 'dynamic' or a positive number (got -3)"),
    ({"grad_accum": 0}, "grad_accum must be >= 1 (got 0)"),
    ({"grad_accum": "two"}, "grad_accum must be an integer (got 'two')"),
    ({"total_steps": "many"}, "total_steps must be an integer or None (got 'many')"),
    ({"lr_schedule": "cosine"}, "needs total_steps (--total-steps N"),
    ({"min_scale": 0}, "need 0 < min_scale <= init_scale <= max_scale"),
    ({"betas": (0.9,)}, "betas must be two numbers (b1, b2)"),
    ({"label_shape": "N"}, "label_shape must be a list of dims"),
    ({"label_name": 3}, "label_name must be a string (got 3)"),
    ({"trainable": "("}, "trainable '(' is not a valid regular expression"),
    ({"class_weights": "1,x"}, "expected comma-separated numbers"),
    ({"label_smoothing": 1.0}, "label_smoothing must be in [0, 1)"),
    ({"loss": "mse", "ignore_index": -100}, "only apply to the cross-entropy loss"),
    ({"shapes": "x:8,3,48,192"}, "--shapes: '3' is not NAME:DIMS"),  # refused even where no phase reads it
])
def test_bad_step_values(kw, msg):
    with pytest.raises(GraphmpError) as e:
        StepConfig.from_kwargs(**kw)
    assert msg in str(e.value)
    with pytest.raises(GraphmpError) as e:
        StepConfig.from_kwargs("m.onnx", **kw)  # build_step's form: the message starts with the model path
    assert msg in str(e.value) and (str(e.value).startswith("m.onnx: ") or "class weights" in str(e.value))


def test_bad_step_value_writes_nothing(mlp_path, tmp_path, capsys):
    run = str(tmp_path / "run")
    with pytest.raises(GraphmpError, match=f"^{mlp_path}: lr must be > 0"):
        build_step(mlp_path, run, lr=-1)
    # a StepConfig built by hand (not checked) is checked by build_step
    with pytest.raises(GraphmpError, match=f"^{mlp_path}: grad_accum must be >= 1"):
        build_step(mlp_path, run, StepConfig(grad_accum=0))
    assert main(["train-graph", mlp_path, "-o", run, "--lr", "0"]) == 2
    assert capsys.readouterr().err == f"graphmp: error: {mlp_path}: lr must be > 0 (got 0.0)\n"
    assert not os.path.exists(run)


@pytest.mark.parametrize("kw,msg", [
    ({"batch_size": 0}, "batch_size must be >= 1 and epochs >= 0 (got 0, 1)"),
    ({"epochs": -1}, "batch_size must be >= 1 and epochs >= 0 (got 32, -1)"),
    ({"epochs": 2.5}, "epochs must be an integer (got 2.5)"),
    ({"max_steps": "10"}, "max_steps must be an integer or None (got '10')"),
    ({"max_steps": -1}, "max_steps must be >= 0 (None: no limit), not -1"),
    ({"checkpoint_every": -5}, "checkpoint_every must be >= 0 (0: only at the end), not -5"),
    ({"threads": -2}, "threads must be >= 0"),
    ({"resume": "no"}, "resume must be True or False (got 'no')"),
    ({"device_state": "yes"}, "device_state must be True or False or None"),
    ({"device": "gpu"}, "device must be one of ['auto', 'cpu', 'cuda'], not 'gpu'"),
    ({"providers": "CPUExecutionProvider"}, "providers must be a list of ONNX Runtime providers"),
])
def test_bad_train_values(kw, msg):
    with pytest.raises(GraphmpError) as e:
        TrainConfig.from_kwargs(**kw)
    assert msg in str(e.value)


# --- a good config: normalized, frozen, round-trips -------------------------------------------------

def test_step_config_round_trip():
    c = StepConfig.from_kwargs(lr="0.1", betas=[0.8, 0.9], class_weights="1,2,3", label_shape=["N"],
                               loss_scale="128", grad_accum=np.int64(2), clip_norm=1, optimizer="sgd")
    assert (c.lr, c.betas, c.class_weights, c.label_shape, c.loss_scale, c.grad_accum, c.clip_norm) == \
        (0.1, (0.8, 0.9), (1.0, 2.0, 3.0), ("N",), 128.0, 2, 1.0)
    assert type(c.grad_accum) is int and type(c.clip_norm) is float
    assert StepConfig.from_kwargs(**c.as_kwargs()) == c
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.lr = 1.0
    d = c.to_json_dict()  # train.json "config": lists, num_classes to be filled in, no build-only keys
    assert d["betas"] == [0.8, 0.9] and d["class_weights"] == [1.0, 2.0, 3.0] and d["label_shape"] == ["N"]
    assert "num_classes" in d and not {"calibration", "shapes", "force"} & set(d)
    assert StepConfig.from_kwargs(precision="bf16").loss_scale == 1.0  # BF16: no loss scaling
    assert StepConfig.from_kwargs() == StepConfig()


def test_train_config_round_trip():
    c = TrainConfig.from_kwargs(epochs=np.int64(3), batch_size=16, resume=np.bool_(False),
                                providers=("CPUExecutionProvider",), device="cpu", max_steps=0, threads=0)
    assert (c.epochs, c.batch_size, c.resume, c.providers) == (3, 16, False, ["CPUExecutionProvider"])
    assert type(c.epochs) is int and type(c.resume) is bool
    assert TrainConfig.from_kwargs(**c.as_kwargs()) == c
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.epochs = 1
    assert TrainConfig.from_kwargs() == TrainConfig()


def test_cli_flags_are_config_fields():
    """Every flag the CLI hands over by name is an option of the config it builds."""
    assert set(STEP_FLAGS) | {"output"} <= {f.name for f in dataclasses.fields(StepConfig)}
    assert set(TRAIN_FLAGS) | {"resume", "progress"} <= {f.name for f in dataclasses.fields(TrainConfig)}


# --- builds and trains with a config as with keywords --------------------------------------------------

def test_config_builds_and_trains_as_keywords(mlp_path, tmp_path):
    kw = dict(precision="fp32", optimizer="sgd", lr=0.05, momentum=0.5, clip_norm=1.0, lr_schedule="linear",
              warmup_steps=1, total_steps=20)
    by_kw, by_cfg = str(tmp_path / "kw"), str(tmp_path / "cfg")
    meta_kw = build_step(mlp_path, by_kw, **kw)
    meta_cfg = build_step(mlp_path, by_cfg, StepConfig.from_kwargs(**kw))
    assert meta_cfg == meta_kw and meta_cfg["config"]["lr"] == 0.05 and meta_cfg["config"]["optimizer"] == "sgd"
    assert json.load(open(os.path.join(by_cfg, "train.json")))["config"] == meta_kw["config"]
    assert open(os.path.join(by_cfg, "step.onnx"), "rb").read() == open(os.path.join(by_kw, "step.onnx"), "rb").read()
    # keywords on top of a config: force=True replaces the run built above
    meta = build_step(mlp_path, by_cfg, StepConfig.from_kwargs(**kw), force=True, momentum=0.0)
    assert meta["config"]["momentum"] == 0.0

    d = tm.blobs(64)
    tc = TrainConfig.from_kwargs(epochs=2, batch_size=16, checkpoint_every=0, progress=False)
    ref = train(by_kw, d, epochs=2, batch_size=16, checkpoint_every=0, progress=False)
    build_step(mlp_path, str(tmp_path / "kw2"), **kw)
    got = train(str(tmp_path / "kw2"), d, tc, eval_data=d)
    assert got.summary["steps"] == ref.summary["steps"] == 8 and got.summary["eval"] is not None
    assert all(np.array_equal(got.state[k], ref.state[k]) for k in ref.state)
    # keywords on top of a TrainConfig
    part = train(str(tmp_path / "kw2"), d, tc, resume=False, max_steps=3)
    assert part.summary["steps"] == 3

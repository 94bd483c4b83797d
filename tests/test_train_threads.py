"""`graphmp train --threads N`: the step session's ONNX Runtime intra-op threads."""
import numpy as np
import onnx
import pytest

from fixtures import tiny as tm
from graphmp.cli import main
from graphmp.train import loop
from graphmp.train.step import build_step


@pytest.fixture
def run_and_data(tmp_path):
    onnx.save(tm.mlp(), str(tmp_path / "mlp.onnx"))
    build_step(str(tmp_path / "mlp.onnx"), str(tmp_path / "run"), precision="fp32", optimizer="sgd", lr=0.1)
    np.savez(tmp_path / "train.npz", **tm.blobs(64))
    return str(tmp_path / "run"), str(tmp_path / "train.npz")


@pytest.mark.parametrize("flag,want", [([], 0), (["--threads", "1"], 1), (["--threads", "3"], 3)])
def test_threads_reach_the_step_session(run_and_data, monkeypatch, flag, want):
    """The session's intra_op_num_threads is N (0, ONNX Runtime's default, without the flag)."""
    got = []

    class Recording(loop.StepRunner):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            got.append(self.sess.get_session_options().intra_op_num_threads)
    monkeypatch.setattr(loop, "StepRunner", Recording)
    run, data = run_and_data
    assert main(["train", run, "--data", data, "--batch-size", "16", "-q", *flag]) == 0
    assert got == [want]


def test_bad_threads_are_refused_in_one_line(run_and_data, capsys):
    run, data = run_and_data
    assert main(["train", run, "--data", data, "--threads", "-1", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "threads must be >= 0" in err
    assert main(["train", run, "--data", data, "--threads", "2", "--nproc", "2", "-q"]) == 2
    assert "--threads is for one process" in capsys.readouterr().err


def test_help_teaches_threads(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--threads N" in out and "torch.set_num_threads" in out and "physical core" in out

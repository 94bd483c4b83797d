"""The CLI-only gradient check of tests/test_grad_cli.py for LSTM and GRU (unrolled by
graphmp/train/rnn.py before autodiff): train-graph, one full-batch SGD step, export, and
the weight change compared with central differences of the loss on the original model,
whose LSTM/GRU ONNX Runtime runs itself."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import test_grad_cli as cli_check
from test_grad_cli import BATCH, Op, _away

N = helper.make_node
SEQ, IN, HID = 3, 4, 3


def _rnn(op: str, direction: str, **attrs) -> Op:
    dirs = 2 if direction == "bidirectional" else 1
    gates = 4 if op == "LSTM" else 3
    key = f"{op}-{direction}-{attrs.get('linear_before_reset', '')}"
    w = {f"{op}.W": _away(key + "W", dirs, gates * HID, IN, scale=0.3),
         f"{op}.R": _away(key + "R", dirs, gates * HID, HID, scale=0.3),
         f"{op}.B": _away(key + "B", dirs, 2 * gates * HID, scale=0.1)}
    nodes = [N("Transpose", ["t"], ["t_sbi"], perm=[1, 0, 2]),         # [batch, seq, in] -> [seq, batch, in]
             N(op, ["t_sbi", f"{op}.W", f"{op}.R", f"{op}.B"], ["Y"], hidden_size=HID, direction=direction,
               name="rnn", **attrs),                                  # Y: [seq, dirs, batch, hidden]
             N("Transpose", ["Y"], ["y"], perm=[2, 0, 1, 3])]         # batch first for the labels
    return Op(key, nodes, _away(key + "x", BATCH, SEQ, IN), weights=w, opset=14)


RNNS = [_rnn("LSTM", "forward"), _rnn("LSTM", "bidirectional"),
        _rnn("GRU", "forward", linear_before_reset=0), _rnn("GRU", "reverse", linear_before_reset=1)]


@pytest.mark.parametrize("op", RNNS, ids=[o.id for o in RNNS])
def test_cli_sgd_step_matches_finite_differences_rnn(op, tmp_path):
    cli_check.test_cli_sgd_step_matches_finite_differences(op, tmp_path)

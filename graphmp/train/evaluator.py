"""Eval of a run: the inference graph with given weights, loss (and accuracy) in numpy.

Evaluator runs the run's infer.onnx (the source model, BN in inference mode) with the
weights and BN statistics of a state, in the training precision (mixed: converted by
graphmp.convert, calibrated on a sample batch; BF16 where ONNX Runtime has BF16 kernels,
else FP32 with a note). infer_model() is that graph with the weights as initializers
(export). Split from loop.py, which drives training and calls both.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import GraphmpError
from ..model_runs import ort_session
from .data import in_order, mse_mismatch, run_failure
from .device import check_session
from .runfiles import load_onnx, run_file


def infer_model(run_dir, meta, state: dict) -> onnx.ModelProto:
    """The source model with `state`'s weights and BN statistics as initializers (FP32)."""
    m = load_onnx(run_file(run_dir, meta, "infer_model"))
    trained = set(meta["weights"]) | set(meta["bn_stats"])
    keep = [v for v in m.graph.input if v.name not in trained]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    for n in meta["weights"] + meta["bn_stats"]:
        m.graph.initializer.append(numpy_helper.from_array(np.asarray(state[n], dtype=np.float32), n))
    return m


class Evaluator:
    """Inference-mode forward with given weights; loss (+ accuracy for cross-entropy) in numpy.

    Cross-entropy follows the run's config: classes on axis `class_axis` (default 1) of the
    output, labels equal to `ignore_index` left out of loss and accuracy (as the step graph's
    loss does). device: as for train(); .note says when CUDA was asked for but not got."""

    def __init__(self, run_dir, meta, state: dict, providers=None, sample_batch: dict | None = None,
                 device: str | None = None):
        self.meta = meta
        m = load_onnx(run_file(run_dir, meta, "infer_model"))
        out = meta["model_output"]
        if out not in {o.name for o in m.graph.output}:
            m.graph.output.append(onnx.helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None))
        self.trained = meta["weights"] + meta["bn_stats"]
        self.precision = meta["config"]["precision"]  # what eval runs in: the training precision
        fp32, bf16_note = m, None
        if self.precision in ("mixed", "bf16"):
            from ..convert import convert
            cal = {n: np.asarray(state[n]) for n in self.trained}
            cal.update({k: v for k, v in (sample_batch or {}).items() if k in meta["inputs"]})
            kw = {"target": "bf16"} if self.precision == "bf16" else {}
            # the plan the step graph's forward was trained in (train-graph converts without the
            # measured-islands step, island_trials=0)
            m = convert(m, calibration=[cal] if sample_batch else "off", keep_io_types=True, island_trials=0,
                        **kw).model
        try:
            self.sess = ort_session(m, providers)
        except Exception as e:  # noqa: BLE001  (only BF16 may lack kernels; mixed/FP32 errors are real)
            if self.precision != "bf16":
                raise
            # the step graph ran in BF16 (train-graph checked), the inference graph need not
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            self.sess, self.precision = ort_session(fp32, providers), "fp32"
            bf16_note = f"eval runs in FP32, not BF16 as trained: ONNX Runtime here has no BF16 kernel ({first})"
        notes = [n for n in (bf16_note, check_session(self.sess, providers, device, "eval")) if n]
        self.note = "; ".join(notes) or None

    def run(self, state: dict, source, batch_size: int) -> dict:
        lab = self.meta["label"]["name"]
        cfg = self.meta["config"]
        axis, ignore = int(cfg.get("class_axis", 1)), cfg.get("ignore_index")
        weights = {n: np.asarray(state[n], dtype=np.float32) for n in self.trained}
        total, correct, counted, n = 0.0, 0.0, 0, 0  # sums over the labelled elements
        where = getattr(source, "where", "eval data")
        label_whole = lab in getattr(source, "stacked", ())  # one sample's labels, no batch axis
        for b in in_order(source, batch_size):
            feeds = {k: v for k, v in b.items() if k in self.meta["inputs"]}
            try:
                y = self.sess.run([self.meta["model_output"]], dict(feeds, **weights))[0].astype(np.float64)
            except Exception as e:  # noqa: BLE001  (ORT raises several pybind types for a bad feed)
                raise run_failure(e, self.sess, feeds, where, "the inference model", self.meta) from None
            t = b[lab]
            n += 1 if label_whole else t.shape[0]  # samples, not output rows
            if cfg["loss"] == "cross-entropy":
                t = t.astype(np.int64)
                keep = np.ones(t.shape, bool) if ignore is None else t != ignore
                z = np.moveaxis(y, axis, -1)
                z = z - z.max(-1, keepdims=True)
                logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
                nll = -np.take_along_axis(logp, np.where(keep, t, 0)[..., None], -1)[..., 0]
                total += float(nll[keep].sum())
                correct += float((z.argmax(-1) == t)[keep].sum())
                counted += int(keep.sum())
            else:
                if t.size != y.size:  # as the step graph's loss: one target per output element
                    raise GraphmpError(mse_mismatch(where, lab, t.shape, self.meta, list(y.shape)))
                total += float(((y - t.reshape(y.shape)) ** 2).sum())
                counted += int(y.size)
        if not n:
            raise GraphmpError("eval data holds no samples")
        if not counted:
            raise GraphmpError(f"eval data: every label is the ignore index {ignore}; nothing to evaluate")
        res = {"loss": total / counted, "samples": int(n), "counted": counted, "precision": self.precision}
        if cfg["loss"] == "cross-entropy":
            res["accuracy"] = correct / counted
        return res

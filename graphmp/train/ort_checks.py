"""ONNX Runtime runs while a training step is built (build_step calls all three).

- calibration_batch(): the generated batch the mixed conversion of the step's forward is
  calibrated on (and every build's step is proved on), with labels shaped after what the
  output really is on it;
- check_runs(): the finished step graph loads in ONNX Runtime (with this machine's providers
  for BF16, whose kernels may be missing), so a run folder `graphmp train` cannot open is
  never written;
- prove_runs(): it also runs: one step, and one inference of the eval/export graph, on a
  generated batch of the build's shapes, so a graph that loads but cannot step (an op the
  rewrite gave a form ONNX Runtime's kernel refuses) fails the build, not the first step.
"""
from __future__ import annotations

import re

import numpy as np
from onnx import TensorProto, helper

from ..errors import GraphmpError, first_line
from . import losses


def calibration_batch(src, base_dir, shapes, path, cfg, label_dims, label_elem, state) -> dict:
    """One generated batch, for the mixed conversion of the step's forward and the proof of
    every build (prove_runs): the model's inputs (shapes that run, batch 2 where the model allows it), zero labels shaped after
    the output that this batch makes (exporters name output dims freely, so the labels'
    dim names need not be the inputs'), and the real weights and BatchNorm statistics
    (`state`). A label shape that contradicts the output (a fixed size, or an input's dim
    name, that differs) is a one-line error giving the --label-shape that fits."""
    from ..inputs import find_shapes
    from ..model_runs import runner
    # one session that also returns the loss's input tensor (an intermediate with
    # --model-output): the output is listed only while the session is made, so the
    # weights are not copied
    extra = cfg["output"] not in {o.name for o in src.graph.output}
    if extra:
        src.graph.output.append(helper.make_tensor_value_info(cfg["output"], TensorProto.FLOAT, None))
    try:
        run = runner(src, base_dir=base_dir)
    except Exception as e:  # noqa: BLE001 - ORT's load errors are many kinds
        raise GraphmpError(f"{path}: ONNX Runtime cannot load the model ({first_line(e)}); check that ONNX "
                           "Runtime runs it (an op it lacks, a custom domain), or build with --precision fp32, "
                           "which needs no calibration run") from None
    finally:
        if extra:
            src.graph.output.pop()
    plan = find_shapes(src, run, shapes, where=path)
    batch = 2 if plan.batch_free else None
    feeds = plan.feeds(0, batch=batch)
    sizes = {d: n for s in plan.specs for d, n in zip(s.dims, feeds[s.name].shape) if isinstance(d, str)}
    try:
        out = run(feeds)[cfg["output"]].shape
    except Exception as e:  # noqa: BLE001 - ORT's run errors are many kinds
        raise GraphmpError(f"{path}: ONNX Runtime cannot run the model on generated inputs of shapes "
                           f"{plan.describe()} ({first_line(e)}); give other --shapes, or precision='fp32' "
                           "(--precision fp32) to build without a calibration run.") from None
    want = list(out)
    if cfg["loss"] == "cross-entropy":
        del want[losses.class_axis(cfg, len(out), path)]
    expected = [d if isinstance(d, int) else sizes.get(d) for d in label_dims]
    shape = want
    if len(expected) != len(want) or any(e is not None and e != w for e, w in zip(expected, want)):
        # labels [N, 1] for an output [N]: the same values with a unit axis, which the loss reshapes
        unit_axes_only = None not in expected and [e for e in expected if e != 1] == [w for w in want if w != 1]
        if not unit_axes_only:
            raise losses.label_mismatch(path, cfg, label_dims, want)
        shape = expected
    feeds[cfg["label_name"]] = np.zeros(shape, dtype=helper.tensor_dtype_to_np_dtype(label_elem))
    feeds.update(state)
    return feeds


def check_runs(model, path, bf16: bool = False):
    """The step graph loads in ONNX Runtime (a run folder that `graphmp train` cannot open is
    not a build); for BF16 with this machine's providers, and a clear error (what to use
    instead) when one of its kernels is missing."""
    import onnxruntime as ort
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
                 if p in ort.get_available_providers() and (bf16 or p == "CPUExecutionProvider")]
    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=providers)
    except Exception as e:  # noqa: BLE001  (ORT raises several types; the message says which kernel)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        m = re.search(r"implementation for (\w+)\((\d+)\) node with name '([^']*)'", first)
        if not bf16:
            raise GraphmpError(f"{path}: ONNX Runtime cannot load the training step graph built from this model "
                               f"({first[:240]}). Check that ONNX Runtime runs the model itself; if it does, "
                               "this is a graphmp bug: please report it with the model.") from None
        what = f"no BF16 kernel for {m.group(1)}, node '{m.group(3)}'" if m else first[:200]
        raise GraphmpError(f"{path}: ONNX Runtime here ({', '.join(providers)}) cannot run the BF16 step graph "
                           f"({what}); use --precision mixed (FP16 with loss scaling) or fp32 on this machine, "
                           "bf16 with the CUDA provider on an Ampere or newer GPU.") from None


def prove_runs(step, infer, path, batch: dict, state: dict, weights: list, bf16: bool = False):
    """One step of the step graph and one run of the inference graph on `batch` (a generated
    batch with its labels: calibration_batch) and the initial `state`; an ONNX Runtime error
    is a one-line GraphmpError naming the graph and the node, and saying it is graphmp's
    graph (the user's data had no part in it)."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 4
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
                 if p in ort.get_available_providers() and (bf16 or p == "CPUExecutionProvider")]
    for what, model, extra in (("training step", step, state), ("inference (eval/export)", infer,
                                                                {w: state[w] for w in weights if w in state})):
        names = {i.name for i in model.graph.input}
        feeds = {k: v for k, v in {**batch, **extra}.items() if k in names}
        try:
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=providers)
            sess.run(None, feeds)
        except Exception as e:  # noqa: BLE001  (ORT raises several types)
            node = re.search(r"node(?: with)? name[: ]+'?([^'\s]+)'?", str(e))
            where = f" at node '{node.group(1)}'" if node else ""
            raise GraphmpError(f"{path}: the {what} graph graphmp built does not run in ONNX Runtime{where} on a "
                               f"generated batch of the build's shapes ({first_line(e, 200)}); this is graphmp's "
                               "graph, not your data: please report it with the model.") from None

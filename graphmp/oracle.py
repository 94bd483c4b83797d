"""Running models: ONNX Runtime (CPU, or CUDA when present) and an FP16-faithful oracle.

ONNX Runtime's CPU provider computes almost every FP16 op in FP32 and removes the
model's own round trips, so an FP16 overflow never shows there. `run_reference`
uses onnx.reference.ReferenceEvaluator, which computes each op in the dtype the graph
declares (as a GPU does), with two overrides where it departs from the spec:
BatchNormalization always runs in inference mode (the reference runs opset 9-13 BN in
training mode when the legacy `momentum` attribute is present), and Loop (see below).
`runner(model)` wraps one ONNX Runtime session as a function of the feeds.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_loop import Loop as _RefLoop


class BatchNormalization(OpRun):
    op_domain = ""

    def _run(self, x, scale, bias, mean, var, epsilon=None, momentum=None, training_mode=None,
             spatial=None, is_test=None, consumed_inputs=None):
        eps = 1e-5 if epsilon is None else epsilon
        shape = (1, -1) + (1,) * (x.ndim - 2)
        acc = np.float32 if x.dtype != np.float64 else np.float64
        y = (x.astype(acc) - mean.astype(acc).reshape(shape)) / np.sqrt(var.astype(acc).reshape(shape) + eps)
        y = y * scale.astype(acc).reshape(shape) + bias.astype(acc).reshape(shape)
        return (y.astype(x.dtype),)


class Loop(_RefLoop):
    """onnx.reference's Loop with the spec's semantics where it departs from them:
    an omitted `cond` input means "true" (it ran zero iterations), and scan outputs
    are stacked along a new first axis (it concatenated them with vstack, so [2, 4]
    per iteration came out [2k, 4] instead of [k, 2, 4])."""
    op_domain = ""

    def _run(self, M, cond, *args, context=None, body=None, attributes=None, bindings=None):
        body = self.body
        names_in, names_out = body.input_names, body.output_names
        inputs = dict(context or {})
        inputs.update(zip(names_in[2:], args))
        cond = True if cond is None else bool(np.asarray(cond).item())
        n_carried = len(names_in) - 2
        scans = [[] for _ in range(len(names_out) - 1 - n_carried)]
        it = 0
        while cond and (M is None or it < int(M)):
            inputs[names_in[0]] = np.array(it, dtype=np.int64)
            inputs[names_in[1]] = np.array(cond)
            outs = self._run_body(inputs, attributes=attributes, bindings=bindings)
            cond = bool(np.asarray(outs[0]).item())
            inputs.update(zip(names_in[2:], outs[1:1 + n_carried]))
            for k, v in enumerate(outs[1 + n_carried:]):
                scans[k].append(v)
            it += 1
        carried = [inputs[n] for n in names_in[2:]]
        stacked = [np.stack(s) if s else np.empty((0,), dtype=np.float32) for s in scans]
        return self._check_and_fix_outputs(tuple(carried + stacked))


ORACLE_OPS = [BatchNormalization, Loop]


def ort_session(model, providers=None, base_dir=None, optimize=True):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 4  # graphmp reports failures itself, in one line
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    providers = providers or ["CPUExecutionProvider"]
    if isinstance(model, onnx.ModelProto):
        if base_dir:
            so.add_session_config_entry("session.model_external_initializers_file_folder_path", base_dir)
        return ort.InferenceSession(model.SerializeToString(), so, providers=providers)
    return ort.InferenceSession(os.fspath(model), so, providers=providers)


def runner(model, providers=None, base_dir=None, optimize=True):
    """One ONNX Runtime session as a function feeds -> {output name: array} (arrays in
    `feeds` that are not inputs are ignored). `.session` is the session."""
    sess = ort_session(model, providers, base_dir, optimize=optimize)
    names = [o.name for o in sess.get_outputs()]
    wanted = [i.name for i in sess.get_inputs()]

    def run(feeds: dict) -> dict:
        return dict(zip(names, sess.run(names, {k: feeds[k] for k in wanted})))
    run.session = sess
    return run


def run_ort(model, feeds: dict, providers=None) -> dict:
    """Outputs by name from ONNX Runtime (CPU unless providers say otherwise)."""
    return runner(model, providers)(feeds)


def run_reference(model, feeds: dict) -> dict:
    """Outputs by name with every op computed in its declared dtype (FP16-faithful)."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(os.fspath(model))
    ev = ReferenceEvaluator(model, new_ops=ORACLE_OPS)
    wanted = set(ev.input_names)
    with np.errstate(all="ignore"):  # FP16 overflow is a result here, reported by the caller
        outs = ev.run(None, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip(ev.output_names, outs))


def cuda_available() -> bool:
    try:
        import onnxruntime as ort
        return "CUDAExecutionProvider" in ort.get_available_providers()
    except ImportError:
        return False

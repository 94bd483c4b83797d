"""graphmp.check: is a converted model valid, and how accurate is it against its FP32 source?

1. Validity first: the full onnx.checker (strict shape and type inference) and an
   ONNX Runtime session on the converted model. A failure of either is a FAIL with
   their message, and no numbers are compared: a model that ONNX Runtime refuses is
   never reported as passing. (Where the FP32 source itself fails the full checker,
   the converted model is held to the basic checker instead, and the report says so.)
2. Accuracy: the FP32 source runs in ONNX Runtime (CPU); the converted model runs
   FP16-faithfully, by one of two oracles, and where a GPU is present also in ONNX
   Runtime CUDA:
   - "emulation" (default): graphmp.emulate, FP16 storage with FP32 math on ONNX
     Runtime (what Tensor Cores do; the same measure --max-error uses), fast at any size;
   - "reference": onnx.reference, every arithmetic step in FP16 numpy (stricter on long
     reductions; slow on large activations). It is trusted only where it reproduces ONNX
     Runtime on the FP32 source; where it does not, or cannot run, the emulation judges
     and the report says so. ONNX Runtime CPU itself never judges: it computes most FP16
     ops in FP32 and hides overflow.
Inputs: the user's data (checked against the model's inputs), or generated inputs whose
shapes come from --shapes or graphmp.inputs.find_shapes.
"""
from __future__ import annotations

import os

import numpy as np
import onnx

from .errors import GraphmpError, first_line
from .emulate import emulated_runner
from .inputs import find_shapes, input_specs, user_batches
from .io import load_model
from .oracle import cuda_available, run_reference, runner

ORACLES = ("emulation", "reference")
EMULATION = "FP16-faithful emulation on ONNX Runtime (FP16 storage, FP32 math)"
REFERENCE = "onnx.reference (FP16-faithful: every op in FP16 arithmetic)"


def compare(ref: np.ndarray, got: np.ndarray, atol: float, rtol: float) -> dict:
    ref = np.asarray(ref)
    got = np.asarray(got)
    if ref.dtype.kind not in "fc":
        same = bool(np.array_equal(ref, got))
        return {"max_abs": 0.0 if same else float("inf"), "max_rel": 0.0 if same else float("inf"),
                "ref_max_abs": 0.0, "nonfinite": 0, "argmax_agree": None, "passed": same}
    r = ref.astype(np.float64)
    g = got.astype(np.float64)
    if r.shape != g.shape:
        return {"max_abs": float("inf"), "max_rel": float("inf"), "ref_max_abs": 0.0, "nonfinite": 0,
                "argmax_agree": None, "passed": False, "shape_mismatch": [list(r.shape), list(g.shape)]}
    new_nonfinite = int(np.count_nonzero(~np.isfinite(g) & np.isfinite(r)))
    ok = np.isfinite(r) & np.isfinite(g)
    diff = np.abs(g - r)[ok]
    rel = diff / np.maximum(np.abs(r[ok]), atol)
    agree = None
    if r.ndim in (2, 3) and r.shape[-1] > 1 and r.size:  # class scores [N, C] / [N, T, V], not image maps
        agree = float(np.mean(np.argmax(r, axis=-1) == np.argmax(np.nan_to_num(g), axis=-1)))
    passed = new_nonfinite == 0 and bool(np.all(diff <= atol + rtol * np.abs(r[ok])))
    return {"max_abs": float(diff.max()) if diff.size else 0.0, "max_rel": float(rel.max()) if rel.size else 0.0,
            "ref_max_abs": float(np.abs(r[ok]).max()) if ok.any() else 0.0,
            "nonfinite": new_nonfinite, "argmax_agree": agree, "passed": passed}


def _full_check(model) -> str | None:
    try:
        onnx.checker.check_model(model if isinstance(model, onnx.ModelProto) else os.fspath(model), full_check=True)
        return None
    except Exception as e:  # noqa: BLE001 - checker raises ValidationError / InferenceError / ...
        return first_line(e)


def validity(converted, reference=None) -> dict:
    """{"valid", "checker", "ort", "note"}: the full checker and an ONNX Runtime CPU
    session on `converted` (path or ModelProto)."""
    out = {"checker": "ok", "ort": "ok", "note": None}
    err = _full_check(converted)
    if err and reference is not None and _full_check(reference):
        out["note"] = ("the FP32 source fails the full checker too; the converted model was held to the "
                       "basic checker")
        try:
            onnx.checker.check_model(converted if isinstance(converted, onnx.ModelProto) else os.fspath(converted))
            err = None
        except Exception as e:  # noqa: BLE001
            err = first_line(e)
    if err:
        out["checker"] = err
    try:
        runner(converted)
    except Exception as e:  # noqa: BLE001 - any load failure means "ORT refuses it"
        out["ort"] = first_line(e)
    out["valid"] = out["checker"] == "ok" and out["ort"] == "ok"
    return out


class CheckReport:
    def __init__(self, data):
        self.data = data

    @property
    def passed(self) -> bool:
        return self.data["passed"]

    @property
    def outputs(self) -> dict:
        return self.data["outputs"]

    def to_dict(self):
        return self.data

    def summary(self) -> str:
        d = self.data
        lines = [f"{d['converted']} vs {d['reference']} ({d['oracle']}): {'PASS' if d['passed'] else 'FAIL'}"
                 f" (atol {d['atol']}, rtol {d['rtol']})"]
        v = d["validity"]
        if not v["valid"]:
            lines.append(f"  INVALID: onnx.checker: {v['checker']}; ONNX Runtime: {v['ort']}")
        if d.get("inputs"):
            lines.append(f"  inputs: {d['inputs']}")
        for name, o in d["outputs"].items():
            lines.append(f"  {name}: max abs {o['max_abs']:.4g}  max rel {o['max_rel']:.4g}"
                         + (f"  argmax agree {o['argmax_agree']:.4f}" if o["argmax_agree"] is not None else "")
                         + (f"  NON-FINITE x{o['nonfinite']}" if o["nonfinite"] else ""))
        for w in d["warnings"] + ([v["note"]] if v.get("note") else []):
            lines.append(f"  warning: {w}")
        return "\n".join(lines)


def _batches(ref, data, shapes, seed, run_ref):
    """[(feeds, description)] from the user's data or generated inputs."""
    specs = input_specs(ref)
    if data is None:
        plan = find_shapes(ref, run_ref, shapes, where="check")
        return [plan.feeds(seed)], f"generated ({plan.describe()}; shapes {plan.how})"
    out = [feeds for _, feeds in user_batches(data, specs, "--data")]
    return out, f"{len(out)} batch(es) of user data"


def check(ref, converted, data=None, *, shapes=None, atol: float = 1e-2, rtol: float = 1e-2,
          seed: int = 0, oracle: str = "emulation") -> CheckReport:
    """Compare `converted` against the FP32 `ref` (paths or ModelProtos) on `data` (an
    .npz path, a dict of inputs, a list of them, or None for generated inputs whose
    dynamic dims come from `shapes` ('x:1x3x640x640,...') or a trial run), judged by
    `oracle` ("emulation" or "reference", see the module docstring)."""
    if oracle not in ORACLES:
        raise GraphmpError(f"--oracle must be one of {', '.join(ORACLES)}, not '{oracle}'")
    ref_graph = ref if isinstance(ref, onnx.ModelProto) else load_model(ref)  # clear errors for bad files
    if not isinstance(converted, onnx.ModelProto):
        load_model(converted)
    names = {"reference": str(ref) if not isinstance(ref, onnx.ModelProto) else "<model>",
             "converted": str(converted) if not isinstance(converted, onnx.ModelProto) else "<model>",
             "atol": atol, "rtol": rtol}
    valid = validity(converted, ref)
    if not valid["valid"]:
        return CheckReport(dict(names, oracle="not run: the converted model is invalid", batches=0, outputs={},
                                passed=False, warnings=[], validity=valid, inputs=None))
    try:
        run_ref = runner(ref, optimize=False)  # as the emulation: ORT's fusions are not FP16 error
    except Exception as e:  # noqa: BLE001
        raise GraphmpError(f"{names['reference']}: ONNX Runtime cannot load the FP32 reference ({first_line(e)})") from None
    batches, described = _batches(ref_graph, data, shapes, seed, run_ref)
    run_emu = emulated_runner(converted)
    run_cuda = None
    warnings = []
    if cuda_available():
        try:
            run_cuda = runner(converted, providers=["CUDAExecutionProvider"])
            if "CUDAExecutionProvider" not in run_cuda.session.get_providers():
                warnings.append("ORT CUDA was asked for but the session runs on "
                                f"{run_cuda.session.get_providers()[0]}: no CUDA row")
                run_cuda = None
        except Exception as e:  # noqa: BLE001
            warnings.append(f"ORT CUDA could not load the model: {first_line(e)}")

    def full(m):  # the reference evaluator needs the weights in memory
        return m if isinstance(m, onnx.ModelProto) else onnx.load(os.fspath(m))
    judged_by = EMULATION if oracle == "emulation" else REFERENCE
    outputs: dict = {}
    for feeds in batches:
        want = run_ref(feeds)
        got = None
        if judged_by == REFERENCE:
            try:
                self_check = run_reference(full(ref), feeds)
                if all(compare(want[k], self_check[k], 1e-4, 1e-3)["passed"] for k in want):
                    got = run_reference(full(converted), feeds)
                else:
                    warnings.append("onnx.reference does not reproduce ONNX Runtime on the FP32 source; "
                                    "the FP16 emulation judged instead")
            except Exception as e:  # noqa: BLE001 - the reference evaluator lacks some ops/shapes
                warnings.append(f"onnx.reference cannot run this model ({first_line(e)[:120]}); "
                                "the FP16 emulation judged instead")
            if got is None:
                judged_by = EMULATION
        if got is None:
            got = run_emu(feeds)
        if run_cuda is not None:
            cuda = run_cuda(feeds)
            for k in want:
                outputs.setdefault(k + " [ORT CUDA]", []).append(compare(want[k], cuda[k], atol, rtol))
        for k in want:
            if k not in got:
                raise GraphmpError(f"{names['converted']}: output '{k}' of the reference is missing from the converted model")
            outputs.setdefault(k, []).append(compare(want[k], got[k], atol, rtol))
    merged = {}
    for k, rows in outputs.items():
        agrees = [r["argmax_agree"] for r in rows if r["argmax_agree"] is not None]
        merged[k] = {"max_abs": max(r["max_abs"] for r in rows), "max_rel": max(r["max_rel"] for r in rows),
                     "ref_max_abs": max(r.get("ref_max_abs", 0.0) for r in rows),
                     "nonfinite": sum(r["nonfinite"] for r in rows),
                     "argmax_agree": float(np.mean(agrees)) if agrees else None,
                     "passed": all(r["passed"] for r in rows)}
    return CheckReport(dict(names, oracle=judged_by, batches=len(batches), inputs=described, outputs=merged,
                            passed=all(o["passed"] for o in merged.values()), warnings=list(dict.fromkeys(warnings)),
                            validity=valid))

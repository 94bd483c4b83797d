"""graphmp.check: accuracy of a converted model against its FP32 source.

The FP32 reference runs in ONNX Runtime (CPU). The converted model runs in the
FP16-faithful oracle (onnx.reference: every op in its declared dtype) and, where a
GPU is present, in ONNX Runtime CUDA. The oracle is trusted only where it reproduces
ONNX Runtime on the FP32 source; otherwise the report says so and falls back to
ONNX Runtime CPU (which hides FP16 overflow) with a warning.
"""
from __future__ import annotations

import os

import numpy as np
import onnx

from .errors import GraphmpError
from .io import load_model
from .oracle import cuda_available, load_feeds, make_inputs, run_ort, run_reference


def compare(ref: np.ndarray, got: np.ndarray, atol: float, rtol: float) -> dict:
    ref = np.asarray(ref)
    got = np.asarray(got)
    if ref.dtype.kind not in "fc":
        same = bool(np.array_equal(ref, got))
        return {"max_abs": 0.0 if same else float("inf"), "max_rel": 0.0 if same else float("inf"),
                "ref_max_abs": 0.0, "nonfinite": 0, "argmax_agree": None, "passed": same}
    r = ref.astype(np.float64)
    g = got.astype(np.float64)
    new_nonfinite = int(np.count_nonzero(~np.isfinite(g) & np.isfinite(r)))
    ok = np.isfinite(r) & np.isfinite(g)
    diff = np.abs(g - r)[ok]
    rel = diff / np.maximum(np.abs(r[ok]), atol)
    agree = None
    if r.ndim >= 1 and r.shape[-1] > 1 and r.size:
        agree = float(np.mean(np.argmax(r, axis=-1) == np.argmax(np.nan_to_num(g), axis=-1)))
    passed = new_nonfinite == 0 and bool(np.all(diff <= atol + rtol * np.abs(r[ok])))
    return {"max_abs": float(diff.max()) if diff.size else 0.0, "max_rel": float(rel.max()) if rel.size else 0.0,
            "ref_max_abs": float(np.abs(r[ok]).max()) if ok.any() else 0.0,
            "nonfinite": new_nonfinite, "argmax_agree": agree, "passed": passed}


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
        for name, o in d["outputs"].items():
            lines.append(f"  {name}: max abs {o['max_abs']:.4g}  max rel {o['max_rel']:.4g}"
                         + (f"  argmax agree {o['argmax_agree']:.4f}" if o["argmax_agree"] is not None else "")
                         + (f"  NON-FINITE x{o['nonfinite']}" if o["nonfinite"] else ""))
        for w in d["warnings"]:
            lines.append(f"  warning: {w}")
        return "\n".join(lines)


def check(ref, converted, data=None, atol: float = 1e-2, rtol: float = 1e-2, seed: int = 0) -> CheckReport:
    """Compare `converted` against the FP32 `ref` (paths or ModelProtos) on `data`
    (an .npz path, a dict of inputs, a list of them, or None for generated inputs)."""
    def _load(m):
        if isinstance(m, onnx.ModelProto):
            return m
        return load_model(m)  # graph only (clear errors for bad files); weights stay on disk

    def _full(m):  # the oracle needs the weights in memory
        return m if isinstance(m, onnx.ModelProto) else onnx.load(os.fspath(m))
    # ONNX Runtime reads paths itself (models over 2 GB cannot be serialized in memory)
    ref_m, conv_m = ref, converted
    ref_graph = _load(ref)
    _load(converted)
    if data is None:
        batches = [make_inputs(ref_graph, seed=seed)]
    elif isinstance(data, dict):
        batches = [data]
    elif isinstance(data, (str, os.PathLike)):
        batches = load_feeds(data)
    else:
        batches = list(data)
    warnings = []
    oracle = "onnx.reference (FP16-faithful)"
    outputs: dict = {}
    for feeds in batches:
        want = run_ort(ref_m, feeds)
        try:
            self_check = run_reference(_full(ref_m), feeds)
            trusted = all(compare(want[k], self_check[k], 1e-4, 1e-3)["passed"] for k in want)
        except Exception as e:
            trusted = False
            warnings.append(f"the reference evaluator cannot run the FP32 source ({str(e)[:120]})")
        if trusted:
            got = run_reference(_full(conv_m), feeds)
        else:
            oracle = "onnxruntime CPU (NOT FP16-faithful: the oracle disagreed with ORT on the FP32 source)"
            warnings.append("oracle not trusted on this model; ORT CPU computes most FP16 ops in FP32 and can hide overflow")
            got = run_ort(conv_m, feeds)
        if cuda_available():
            try:
                cuda = run_ort(conv_m, feeds, providers=["CUDAExecutionProvider"])
                for k in want:
                    outputs.setdefault(k + " [ORT CUDA]", []).append(compare(want[k], cuda[k], atol, rtol))
            except Exception as e:
                warnings.append(f"ORT CUDA run failed: {str(e)[:120]}")
        for k in want:
            if k not in got:
                raise GraphmpError(f"{converted}: output '{k}' of the reference is missing from the converted model")
            outputs.setdefault(k, []).append(compare(want[k], got[k], atol, rtol))
    merged = {}
    for k, rows in outputs.items():
        agrees = [r["argmax_agree"] for r in rows if r["argmax_agree"] is not None]
        merged[k] = {"max_abs": max(r["max_abs"] for r in rows), "max_rel": max(r["max_rel"] for r in rows),
                     "ref_max_abs": max(r.get("ref_max_abs", 0.0) for r in rows),
                     "nonfinite": sum(r["nonfinite"] for r in rows),
                     "argmax_agree": float(np.mean(agrees)) if agrees else None,
                     "passed": all(r["passed"] for r in rows)}
    return CheckReport({"reference": str(ref) if not isinstance(ref, onnx.ModelProto) else "<model>",
                        "converted": str(converted) if not isinstance(converted, onnx.ModelProto) else "<model>",
                        "oracle": oracle, "atol": atol, "rtol": rtol, "batches": len(batches),
                        "outputs": merged, "passed": all(o["passed"] for o in merged.values()),
                        "warnings": warnings})

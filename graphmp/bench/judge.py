"""The accuracy judge: each row's outputs against ONNX Runtime CPU FP32 on the same inputs.

Per output (graphmp.budget.output_error where it fits):
  error        max |a - b| / max |ref|  (normalised by the output's scale, so near-zero
               reference values do not dominate as an element-wise |a-b|/|ref| does)
  max_abs      max |a - b|
  cosine       cosine similarity of the flattened outputs (1 = same direction)
  snr_db       10 log10(sum ref^2 / sum (a-b)^2)  (inf when equal)
  argmax_agree argmax agreement along the last axis, for class-score outputs ([N, C], [N, T, V])
  nonfinite    values that are finite in the reference and not in the row

The yardstick, per output, is the one `graphmp check` judges by (graphmp.budget, auto):
the error the GPU's default FP32 mode (TF32) makes on the same inputs (the measured tf32
row of the same backend, batch and variant where there is one, else TF32 emulated on ORT
CPU: graphmp.budget.tf32_model), and the FP16-input floor (the FP32 source on ORT CPU
with only its inputs rounded to FP16). rule_text() says when a row is within tolerance.
"""
from __future__ import annotations

import numpy as np

from ..budget import output_error

REFERENCE = "ONNX Runtime CPU, FP32 source, same inputs"
EMULATED = "TF32 emulated on ORT CPU (graphmp.budget.tf32_model)"
DEFAULT_MAX_ERROR, DEFAULT_TF32_FACTOR = 1e-2, 2.0


def rule_text(max_error: float, k: float, atol=None, rtol=None) -> str:
    extra = f"; and |a-b| <= {atol or 0} + {rtol or 0}*|ref| everywhere" if atol is not None or rtol is not None \
        else ""
    return (f"in tolerance: no new inf/NaN and, for every output, max|a-b|/max|ref| <= max({max_error:g}, "
            f"{k:g} x the TF32 error, {k:g} x the FP16-input floor of that output){extra}")


def output_metrics(ref, got) -> dict:
    """The metrics of one output (see the module docstring)."""
    ref, got = np.asarray(ref), np.asarray(got)
    out = {"error": output_error(ref, got, "max-rel"), "max_abs": output_error(ref, got, "max-abs"),
           "cosine": None, "snr_db": None, "argmax_agree": None, "nonfinite": 0, "shape_mismatch": None}
    if ref.shape != got.shape:
        out["shape_mismatch"] = [list(ref.shape), list(got.shape)]
        return out
    if ref.dtype.kind not in "fc":
        return out
    r, g = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    out["nonfinite"] = int(np.count_nonzero(np.isfinite(r) & ~np.isfinite(g)))
    ok = np.isfinite(r) & np.isfinite(g)
    r, g = r[ok], g[ok]
    nr, ng, noise = float(np.dot(r, r)), float(np.dot(g, g)), float(np.dot(r - g, r - g))
    out["cosine"] = float(np.dot(r, g) / np.sqrt(nr * ng)) if nr > 0 and ng > 0 else (1.0 if nr == ng else 0.0)
    out["snr_db"] = float("inf") if noise == 0 else (10 * np.log10(nr / noise) if nr > 0 else float("-inf"))
    agree = output_error(ref, got, "argmax")
    out["argmax_agree"] = None if agree is None else 1.0 - agree
    return out


def errors_of(ref: dict, got: dict) -> dict:
    """{output: normalised error} of `got` against `ref` (the yardstick's form)."""
    return {k: output_metrics(v, got[k])["error"] if k in got else float("inf") for k, v in ref.items()}


def judge_outputs(ref: dict, got: dict, yardstick: dict | None, max_error: float = DEFAULT_MAX_ERROR,
          k: float = DEFAULT_TF32_FACTOR, atol=None, rtol=None, floor: dict | None = None) -> dict:
    """The accuracy entry of one row: per-output metrics, the worst of each, the TF32
    yardstick and the verdict of rule_text(). `yardstick` is {output: TF32 error} and
    `floor` {output: FP16-input floor}, either None when not measured (the allowance is
    then max_error and whichever was)."""
    per = {}
    for name, r in ref.items():
        if name not in got:
            per[name] = {"error": float("inf"), "missing": True, "passed": False}
            continue
        m = output_metrics(r, got[name])
        tf32, low = (yardstick or {}).get(name), (floor or {}).get(name)
        m["tf32_error"], m["input_floor"] = tf32, low
        m["allowed"] = max([max_error] + [k * e for e in (tf32, low) if e is not None and np.isfinite(e)])
        m["vs_tf32"] = (m["error"] / tf32 if tf32 else None) if m["error"] is not None else None
        passed = m["nonfinite"] == 0 and m["error"] is not None and m["error"] <= m["allowed"]
        if passed and (atol is not None or rtol is not None):
            a, b = np.asarray(r, np.float64), np.asarray(got[name], np.float64)
            ok = np.isfinite(a) & np.isfinite(b)
            passed = bool(np.all(np.abs(a - b)[ok] <= (atol or 0.0) + (rtol or 0.0) * np.abs(a[ok])))
        m["passed"] = bool(passed)
        per[name] = m

    def worst(key, pick):
        vals = [m[key] for m in per.values() if m.get(key) is not None]
        return pick(vals) if vals else None
    errs = [m["error"] for m in per.values() if m.get("error") is not None]
    worst_ratio = worst("vs_tf32", max)
    return {"reference": REFERENCE, "passed": all(m["passed"] for m in per.values()),
            "error": max(errs) if errs else None, "max_abs": worst("max_abs", max),
            "cosine": worst("cosine", min), "snr_db": worst("snr_db", min),
            "argmax_agree": worst("argmax_agree", min), "nonfinite": sum(m.get("nonfinite", 0) for m in per.values()),
            "tf32_error": worst("tf32_error", max), "vs_tf32": worst_ratio, "outputs": per}

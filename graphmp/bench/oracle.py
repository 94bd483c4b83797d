"""The FP16-faithful oracle of a bench run: graphmp.check of each FP16 model against the FP32 source."""
from __future__ import annotations

from ..check import check
from ..errors import GraphmpError
from ..inputs import rebatch
from ..model_io import model_weight_bytes


def fp16_oracle(run) -> list:
    """FP16-faithful check (graphmp.check) of each FP16 model of a bench run (run.py's _Run)
    on one sample of the smallest batch: one entry per precision, with why it was skipped."""
    s, out = run.s, []
    one = rebatch(run.feeds[s.batches[0]], run.positions, 1)
    size_mb = model_weight_bytes(run.graph) / 1e6
    for p in (p for p in ("fp16", "occ") if p in s.precisions):
        entry = {"precision": p, "batch": 1 if run.positions else s.batches[0], "status": "ok", "reason": None,
                 "oracle": None, "passed": None, "max_abs": None, "max_rel": None, "argmax_agree": None,
                 "nonfinite": None}
        mixed = run.models.get(p)
        if run.interrupted is not None:
            entry.update(status="skipped", reason="the run was interrupted (Ctrl-C)")
        elif run.source is None:
            entry.update(status="skipped", reason="no FP32 source to compare with")
        elif mixed is not None and mixed == run.source:
            entry.update(status="skipped", reason="nothing was converted: the rows run the reference model itself")
        elif mixed is None:
            entry.update(status="skipped", reason=run.model_errors.get(p) or "no converted model")
        elif s.oracle_max_mb <= 0:
            entry.update(status="skipped", reason="off (oracle_max_mb 0)")
        elif size_mb > s.oracle_max_mb:
            entry.update(status="skipped", reason=f"FP32 weights {size_mb:.0f} MB > {s.oracle_max_mb:g} MB: the "
                         "oracle (graphmp check's FP16-faithful emulation) is skipped at this size; run graphmp "
                         "check on the model, or raise --oracle-max-mb")
        else:
            try:
                rep = check(run.source, mixed, data=one, max_error=s.max_error, atol=s.atol,
                            rtol=s.rtol).to_dict()
                acc = {k: v for k, v in rep["outputs"].items() if "[ORT CUDA]" not in k}
                if not acc:
                    raise GraphmpError("the check compared no output (does the model load? see its row)")
                agrees = [v["argmax_agree"] for v in acc.values() if v["argmax_agree"] is not None]
                entry.update(oracle=rep["oracle"], passed=all(v["passed"] for v in acc.values()),
                             max_abs=max(v["max_abs"] for v in acc.values()),
                             max_rel=max(v["max_rel"] for v in acc.values()),
                             argmax_agree=min(agrees) if agrees else None,
                             nonfinite=sum(v["nonfinite"] for v in acc.values()))
            except Exception as e:  # noqa: BLE001
                entry.update(status="failed", reason=f"{type(e).__name__}: {str(e)[:200]}")
        out.append(entry)
    return out

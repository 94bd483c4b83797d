"""The rows of a bench run: a planned row, speedups, the fastest variants, the notes under the table."""
from __future__ import annotations

from .plan import LABELS, PRECISIONS, SOURCES


# A row's timing is too noisy to compare by its median when its p90 is this far above it, or
# its p99 this far (a busy machine, a cold cache, too few runs): a ratio of two such medians
# can read 1.45x or 20x where nothing changed.
NOISY_P90 = 1.25
NOISY_P99 = 2.0


def noisy(row) -> bool:
    """The row's latency spread makes its median an unreliable basis for a ratio."""
    lat = row.get("latency_ms") or {}
    med = lat.get("median")
    if not med:
        return False
    return lat.get("p90", med) > NOISY_P90 * med or lat.get("p99", med) > NOISY_P99 * med


def add_speedups(rows: list) -> None:
    """speedup_vs_fp32 / speedup_vs_tf32 of every finished row: the fp32 / tf32 row of the same
    backend, batch and variant (same session options) over this row, by median latency;
    speedup_noisy: this row or a row it is compared with is noisy() (the table marks its
    ratios with '?', and says why under it)."""
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        r["speedup_noisy"] = False
        for base, key in (("fp32", "speedup_vs_fp32"), ("tf32", "speedup_vs_tf32")):
            ref = next((x for x in ok if (x["backend"], x["batch"], x["variant"], x["precision"])
                        == (r["backend"], r["batch"], r["variant"], base)), None)
            if ref:
                r[key] = ref["latency_ms"]["median"] / r["latency_ms"]["median"]
                r["speedup_noisy"] |= ref is not r and (noisy(r) or noisy(ref))


def fastest_variants(rows: list) -> list:
    """Per backend, batch and precision timed in more than one variant: the fastest variant."""
    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    keys = sorted({(r["backend"], r["batch"], r["precision"]) for r in ok},
                  key=lambda k: (k[0], k[1], PRECISIONS.index(k[2])))
    for b, batch, p in keys:
        by = {r["variant"]: r["latency_ms"]["median"] for r in ok
              if (r["backend"], r["batch"], r["precision"]) == (b, batch, p)}
        if len(by) > 1:
            best = min(by, key=by.get)
            out.append({"backend": b, "batch": batch, "precision": p, "variant": best, "median_ms": by[best],
                        "by_variant": by})
    return out


def row_name(row) -> str:
    """'ort-cpu fp16 batch 8' ('ort-cuda fp16 nhwc batch 8' for a variant): a row in progress lines."""
    variant = "" if row["variant"] == "default" else f" {row['variant']}"
    return f"{row['backend']} {row['precision']}{variant} batch {row['batch']}"


def kept(info, kept):
    """`info` with its path dropped when the work folder is temporary (gone after the run)."""
    return info if info is None or kept else dict(info, path=None)


def new_row(spec, labels=None) -> dict:
    """A planned row, not yet run; `labels`: {precision: (label, model)} where the source
    is not an FP32 model (graphmp/bench/source.py) and the defaults would misname the row."""
    b, p = spec.backend, spec.precision
    label, model = (labels or {}).get(p, (LABELS[p], SOURCES[p]))
    return {"backend": b, "precision": p, "variant": spec.variant, "label": label, "model": model,
            "batch": spec.batch, "provider": None, "tf32": None if b == "ort-cpu" else p != "fp32",
            "status": "ok", "error": None, "settings": {}, "latency_ms": None, "iterations": 0,
            "throughput_per_s": None, "speedup_vs_fp32": None, "speedup_vs_tf32": None,
            "peak_device_memory_bytes": None,
            "memory_note": "host memory: not measured per row" if b == "ort-cpu" else "",
            "engine_bytes": None, "build_s": None, "output_shapes": None, "accuracy": None}


def noise_note(rows: list) -> str | None:
    """The line under the table when some speedups are marked noisy."""
    marked = [r for r in rows if r.get("speedup_noisy")]
    if not marked:
        return None
    culprits = [r for r in rows if r["status"] == "ok" and noisy(r)]  # the marked rows or what they compare with
    worst = max(culprits, key=lambda r: max(r["latency_ms"]["p90"], r["latency_ms"]["p99"] / NOISY_P99 * NOISY_P90)
                / r["latency_ms"]["median"])
    return (f"'?': {len(marked)} row(s) compare medians whose spread is too wide to trust the ratio (p90 > "
            f"{NOISY_P90:g}x or p99 > {NOISY_P99:g}x the median; worst: {row_name(worst)}, p99 "
            f"{worst['latency_ms']['p99'] / worst['latency_ms']['median']:.1f}x its median): rerun on a quiet "
            "machine, with more --iterations or a longer --min-time")


def table_notes(s, status: dict) -> list:
    notes = []
    gpu = [b for b in ("trt", "ort-cuda") if b in s.backends and status[b]["status"] == "ok"]
    if gpu:
        notes.append("GPU rows: fp32 = TF32 off (strict FP32); tf32 = TF32 on (the default of TensorRT and ORT "
                     "CUDA); fp16/occ/ort-opt = TF32 on, which only affects their FP32 islands")
    if "ort-cuda" in gpu:
        notes.append(f"ORT CUDA: cudnn_conv_algo_search={s.cudnn_conv_algo_search}; TF32 via use_tf32; variants: "
                     "default, nhwc (prefer_nhwc=1), cuda-graph (enable_cuda_graph=1, static shapes only); speedups "
                     "compare rows of the same variant")
    if "trt" in gpu:
        notes.append("TensorRT: strongly typed (the graph's types and Casts set the precision), one engine per "
                     "precision and batch (profile min = opt = max); build_s uses a timing cache shared by the run")
    if "ort-cpu" in s.backends:
        notes.append("ORT CPU: no TF32 on the CPU (its yardstick is TF32 emulated on ORT CPU); ORT CPU computes "
                     "almost every FP16 op in FP32 (it inserts casts), so the mixed rows are not faster there and "
                     "their accuracy hides FP16 rounding and overflow: see the FP16-faithful oracle line")
    return notes

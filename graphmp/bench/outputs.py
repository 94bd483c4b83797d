"""What a bench run writes, and what it must never overwrite.

A kept run (`keep`) writes its compared models and engines under names of its own
(kept_model, kept_engine); before any work, refuse_overwrites checks every file the run
will write (those, the timing cache, the caller's --json / --plot) against every file it
reads (the model and --converted with their external data files, --data): an output that
is an input, or two outputs that are one file, is a one-line GraphmpError, and a kept
file or timing cache that is a device, FIFO or directory is refused.
"""
from __future__ import annotations

import os

from ..errors import GraphmpError
from ..model_io import model_inputs
from ..paths import check_target, refuse_clobber

KEPT_SUFFIX = {"fp32": "fp32", "fp16": "mp", "occ": "occ", "ort-opt": "ortopt"}  # work/STEM.SUFFIX.onnx


def kept_model(work: str, path: str, precision: str) -> str:
    """Where the run writes the `precision` model of the source `path` in its work folder."""
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(work, f"{stem}.{KEPT_SUFFIX[precision]}.onnx")


def kept_engine(work: str, src: str, precision: str, batch: int) -> str:
    """Where a kept run writes the TensorRT engine of model `src` at `precision` and `batch`."""
    return os.path.join(work, f"{os.path.splitext(os.path.basename(src))[0]}.{precision}.b{batch}.plan")


def input_files(model, converted=None, data=None) -> list:
    """(label, real path) of every file a run reads: the model and --converted with their
    external data files (graphmp.model_io.model_files), and --data."""
    out = model_inputs("the model", model) + (model_inputs("--converted", converted) if converted is not None else [])
    if data is not None:
        out.append(("--data", os.fspath(data)))
    return out


def _planned_outputs(s, path: str, graph, converted, keep) -> list:
    """(label, path) of the files a kept run writes into `keep` (see bench())."""
    if keep is None:
        return []
    keep = os.fspath(keep)
    models, written = {}, []  # precision -> the model its rows run; the models the run writes
    if "graphmp" in {p.key for p in graph.metadata_props}:  # already converted: its own fp16 rows only
        models["fp16"] = path
    else:
        models["fp32"] = models["tf32"] = kept_model(keep, path, "fp32")
        written.append(models["fp32"])
        if converted is not None:
            models["fp16"] = os.fspath(converted)
        else:
            models["fp16"] = kept_model(keep, path, "fp16")
            written.append(models["fp16"])
        for p in ("occ", "ort-opt"):
            if p in s.precisions:
                models[p] = kept_model(keep, path, p)
                written.append(models[p])
    out = [("--keep output", f) for f in written]
    if "trt" in s.backends:
        out += [("--keep output", kept_engine(keep, f, p, b)) for p, f in models.items() if p in s.precisions
                and p != "ort-opt" for b in s.batches]
        if s.timing_cache is None:
            out.append(("--keep output", os.path.join(keep, "timing.cache")))
    return out


def refuse_overwrites(s, path: str, graph, converted=None, keep=None, outputs=()) -> list:
    """Before any work: no file the run writes (kept models and engines, the timing cache,
    the caller's `outputs`) may be a file it reads, or another output; a kept file or the
    timing cache may not be a device, FIFO or directory. Returns the inputs (label, path)."""
    inputs = input_files(path, converted, s.data)
    if keep is not None and os.path.exists(keep) and not os.path.isdir(keep):
        raise GraphmpError(f"{os.fspath(keep)}: --keep names a file, not a folder; give a folder to keep the "
                           "compared models and engines in")
    planned = _planned_outputs(s, path, graph, converted, keep)
    cache = [("--timing-cache", os.fspath(s.timing_cache))] if s.timing_cache is not None else []
    refuse_clobber(list(outputs) + planned + cache, inputs)
    for what, f in planned + cache:
        check_target(f, what)
    return inputs

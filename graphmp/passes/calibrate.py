"""calibrate: one FP32 run over the calibration batches records max |x| of every float
tensor of the main graph (ctx.ranges); classify keeps nodes above the threshold FP32.
The same run proves the types of tensors that shape inference left unknown (outputs
of custom or experimental ops): ONNX Runtime returns them with their real dtype.

Without calibration data, generated inputs are used (two seeds, two batch sizes) and
the report says so. Models whose weights exceed AUTO_LIMIT are not calibrated
automatically (an extra FP32 copy of the weights in ONNX Runtime); pass
--calibration to do it anyway. Subgraph tensors are not observed.
"""
from __future__ import annotations

import os

import numpy as np
import onnx

from ..context import FLOAT
from ..errors import GraphmpError
from ..io import model_weight_bytes
from ..oracle import load_feeds, make_inputs, ort_session

AUTO_LIMIT = 1 << 30


def _batches(ctx):
    cal = ctx.options.calibration
    if cal in (None, "auto"):
        if model_weight_bytes(ctx.model) > AUTO_LIMIT:
            ctx.warn("model over 1 GB: no automatic calibration run (pass --calibration DATA to range-check it)")
            return [], "skipped (model over 1 GB)"
        try:
            return [make_inputs(ctx.model, seed=0, batch=1), make_inputs(ctx.model, seed=1, batch=2)], "generated inputs"
        except Exception as e:
            ctx.warn(f"calibration skipped: cannot generate inputs ({e}); pass --calibration DATA")
            return [], "skipped (cannot generate inputs)"
    if cal == "off":
        return [], "off"
    if isinstance(cal, (str, os.PathLike)):
        cal = [cal]
    batches = []
    for item in cal:
        batches.extend(load_feeds(item) if isinstance(item, (str, os.PathLike)) else [dict(item)])
    if not batches:
        raise GraphmpError("calibration: no batches given")
    return batches, f"{len(batches)} batch(es) of user data"


def calibrate(ctx):
    batches, source = _batches(ctx)
    ctx.report["calibration"] = {"source": source, "batches": len(batches)}
    if not batches:
        return
    types = ctx.types["main"]
    probe = onnx.ModelProto()
    probe.CopyFrom(ctx.model)
    have = {o.name for o in probe.graph.output}
    unknown = set()
    for n in probe.graph.node:
        for o in n.output:
            if o and o not in have and types.get(o) in (FLOAT, None):
                if types.get(o) == FLOAT:
                    probe.graph.output.append(onnx.helper.make_tensor_value_info(o, FLOAT, None))
                else:  # type not proven by shape inference: ONNX Runtime will tell
                    probe.graph.output.append(onnx.ValueInfoProto(name=o))
                    unknown.add(o)
                have.add(o)
    try:
        sess = ort_session(probe, base_dir=ctx.base_dir, optimize=False)
    except Exception as e:
        ctx.warn(f"calibration skipped: ONNX Runtime cannot load the model ({str(e).splitlines()[0][:160]})")
        ctx.report["calibration"]["source"] = "failed"
        return
    del probe
    names = [o.name for o in sess.get_outputs()]
    inputs = {i.name for i in sess.get_inputs()}
    ranges: dict = {}
    proven = 0
    for k, feeds in enumerate(batches):
        missing = inputs - set(feeds)
        if missing:
            raise GraphmpError(f"calibration batch {k}: no data for model input(s) {sorted(missing)}; "
                               "name the .npz arrays after the model inputs.")
        try:
            outs = sess.run(names, {n: feeds[n] for n in inputs})
        except Exception as e:
            ctx.warn(f"calibration batch {k} failed in ONNX Runtime ({str(e).splitlines()[0][:160]}); ranges from earlier batches only")
            continue
        for name, arr in zip(names, outs):
            if name in unknown and isinstance(arr, np.ndarray) and k == 0:
                types[name] = onnx.helper.np_dtype_to_tensor_dtype(arr.dtype)
                proven += 1
            if isinstance(arr, np.ndarray) and arr.dtype == np.float32 and arr.size:
                m = float(np.nanmax(np.abs(arr)))
                if m > ranges.get(name, -1.0):
                    ranges[name] = m
    ctx.ranges = ranges
    ctx.report["calibration"]["tensors_observed"] = len(ranges)
    ctx.report["calibration"]["types_proven_by_run"] = proven

"""attribute: where in a converted model the error comes from.

A FAIL that only says "output 'y' is 3x over its budget" leaves the user guessing. This
runs the FP32 source and the FP16 emulation of the converted model once more on one
batch with every intermediate tensor the two share (same name, main graph) as an
output, and measures each tensor's error against the source: max|a-b| / max|ref|, the
max-rel metric. A node's growth is its output's error minus the largest error among
its inputs: the error it adds itself (rounding its inputs, its weights, its result) on
top of what reaches it. The nodes with the largest growth are where FP16 hurts, and
the first node whose output turns inf/NaN from finite inputs is where it overflows.

Best effort and only on a FAIL: one extra run of each model, with every intermediate
held in memory once (the source's run always happens; the converted model's is skipped
when the source's intermediates exceed MAX_ELEMENTS, and nothing is blamed when either
run fails).
"""
from __future__ import annotations

import os
import re
import shlex

import numpy as np
import onnx

from .emulate import emulation_model
from .model_runs import runner

MAX_ELEMENTS = 200_000_000   # intermediates of both runs together (about 800 MB each in FP32)
TOP = 3


def _with_outputs(model: onnx.ModelProto, names: list) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.ValueInfoProto(name=x) for x in names if x not in have)  # ORT infers the type
    return m


def _shared_tensors(src: onnx.ModelProto, emu: onnx.ModelProto) -> list:
    """Main-graph node outputs present in both models (the converted model keeps the
    source's tensor names; its Casts add new ones)."""
    ours = {o for n in src.graph.node for o in n.output if o}
    return [o for n in emu.graph.node for o in n.output if o in ours]


def _error(ref, got) -> float:
    ref, got = np.asarray(ref), np.asarray(got)
    if ref.shape != got.shape or ref.dtype.kind != "f":
        return float("nan")
    if not np.all(np.isfinite(got)) and np.all(np.isfinite(ref)):
        return float("inf")
    with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN in both: compared as they are
        scale = float(np.max(np.abs(ref))) if ref.size else 0.0
        diff = float(np.max(np.abs(ref.astype(np.float64) - got.astype(np.float64)))) if ref.size else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def blame(src: onnx.ModelProto, converted: onnx.ModelProto, feeds: dict, *, src_dir=None, conv_dir=None,
          top: int = TOP) -> list[dict]:
    """The (at most) `top` nodes of the converted model's main graph whose own error growth
    is the largest on `feeds` (see the module doc), those with at least a tenth of the
    largest growth: [{"node", "op_type", "error", "growth", "low": whether it computes in
    FP16/BF16}], largest first; [] when nothing grew or the intermediates are too large."""
    emu = emulation_model(converted, conv_dir)
    names = _shared_tensors(src, emu)
    if not names:
        return []
    ref = runner(_with_outputs(src, names), base_dir=src_dir, optimize=False)(feeds)
    if sum(np.size(v) for v in ref.values()) * 2 > MAX_ELEMENTS:
        return []
    fp32 = {k: v.astype("float32") if getattr(v, "dtype", None) == np.float16 else v for k, v in feeds.items()}
    got = runner(_with_outputs(emu, names), base_dir=conv_dir, optimize=False)(fp32)
    err = {x: _error(ref[x], got[x]) for x in names if x in ref and x in got}
    err = {x: e for x, e in err.items() if not np.isnan(e)}
    low = _low_outputs(converted)
    rows = []
    for n, out, before in _node_errors(converted, err, {m.name for m in src.graph.node}):
        growth = float("inf") if np.isinf(out) and np.isfinite(before) else out - before
        if growth > 0:
            rows.append({"node": n.name, "op_type": n.op_type, "error": out, "growth": growth,
                         "low": any(o in low for o in n.output)})
    rows.sort(key=lambda r: -r["growth"])
    return [r for r in rows[:top] if r["growth"] >= 0.1 * rows[0]["growth"]]  # the few that matter


def _node_errors(converted, err: dict, source_nodes: set):
    """(node, error of its output, largest error reaching its inputs) for the source's
    nodes in the converted model, seen through the Casts graphmp added between them (a
    node whose output is a graph output writes it through a Cast that holds the name)."""
    prod = {o: n for n in converted.graph.node for o in n.output}
    cast_of: dict = {}
    for n in converted.graph.node:
        if n.name not in source_nodes and n.op_type == "Cast":
            cast_of.setdefault(n.input[0], []).append(n.output[0])

    def reaching(x, depth=0):
        if x in err:
            return err[x]
        p = prod.get(x)
        if p is None or p.name in source_nodes or p.op_type != "Cast" or depth > 4:
            return 0.0
        return reaching(p.input[0], depth + 1)

    def leaving(y):
        return [err[y]] if y in err else [e for c in cast_of.get(y, []) for e in leaving(c)]
    for n in converted.graph.node:
        if n.name not in source_nodes:
            continue
        outs = [e for y in n.output if y for e in leaving(y)]
        if outs:
            yield n, max(outs), max((reaching(x) for x in n.input if x), default=0.0)


def _low_outputs(model: onnx.ModelProto) -> set:
    """Main-graph tensors the converted model stores in FP16/BF16 (declared or inferred)."""
    try:
        m = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - the 'low' flag is a hint
        m = model
    low = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    return {v.name for v in list(m.graph.value_info) + list(m.graph.output) if v.type.tensor_type.elem_type in low}


def fix_hint(rows: list, reference: str, converted: str, data=None, flags: str = "--max-error auto") -> str:
    """One line: where the error grows, and the two commands that fix it (the search
    under `flags`, the same yardstick by default, or these nodes named FP32); the command
    writes a new file (verdict.fresh_output), never over the checked model or its source."""
    from .verdict import fresh_output

    def grew(r):
        return "first inf/NaN" if np.isinf(r["growth"]) else f"adds {r['growth']:.3g}"
    where = ", ".join(f"{r['op_type']} '{r['node']}' ({grew(r)})" for r in rows)
    nodes = "|".join(re.escape(r["node"]) for r in rows)
    paths = [data] if isinstance(data, (str, os.PathLike)) else [d for d in (data or []) if isinstance(d, (str, os.PathLike))]
    cal = " --calibration " + " ".join(shlex.quote(os.fspath(d)) for d in paths) if paths else ""
    out = shlex.quote(fresh_output(converted, reference))
    return (f"the error grows most at {where}: `graphmp convert {shlex.quote(reference)} -o {out}"
            f"{cal} {flags}` measures which nodes must stay FP32 to meet this yardstick (by hand: "
            f"--fp32-nodes {shlex.quote('^(' + nodes + ')$')}, with the nodes feeding them if they cancel)")

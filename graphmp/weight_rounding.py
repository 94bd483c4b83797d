"""Whole-weight passes run by ONNX Runtime: the facts of a weight (its range, and what
rounding it to FP16 changes) in one pass, and the FP16 conversion itself.

numpy converts float32 to float16 without SIMD (~5-7 ns per element on x86, most of a
conversion's time); ONNX Runtime's Cast kernel is vectorised and threaded (~0.5 ns)
and rounds the same way (to nearest even; overflow to inf; checked bit for bit in
tests/test_speed.py). The facts are one small ONNX graph run on blocks of BLOCK
elements, so the temporaries stay block-sized whatever the tensor. classify computes
them once per weight (graphmp.passes.classify.InitStats), and the write only casts.
BF16 goes through ml_dtypes (ONNX Runtime's FP32 -> BF16 rounding has varied by version):
to_bf16_bits / from_bf16_bits, the one FP32 <-> BF16 conversion of graphmp.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import TensorProto, helper

BLOCK = 1 << 16  # 256 kB of float32: each op's output stays in cache (measured best of 2^14..2^20)
FP16_TINY = 2.0 ** -24          # smallest FP16 subnormal
FP16_MAX = 65504.0
_SESSIONS: dict = {}


def to_bf16_bits(a) -> np.ndarray:
    """float values -> bfloat16 bit patterns (uint16), rounded to nearest even (ml_dtypes),
    every NaN as the one quiet NaN 0x7FC0 (ml_dtypes keeps a NaN's sign)."""
    with np.errstate(invalid="ignore"):  # a signalling NaN sets the invalid flag
        bits = np.ascontiguousarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    bits[(bits & 0x7FFF) > 0x7F80] = 0x7FC0
    return bits


def from_bf16_bits(bits) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return np.ascontiguousarray(bits, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


def _node(op, ins, outs, **kw):
    return helper.make_node(op, ins, outs, **kw)


def _facts_graph(tiny: float, fp16: bool):
    """Range facts of a block (max |x|, count of 0 < |x| < tiny) and, with fp16, what
    rounding to FP16 changes, in float ops only (bool ops and casts cost 5-10x more in
    ONNX Runtime): counts come from Sign and L1 sums, exact below 2^24 elements per
    block. Valid when the block is finite and below the FP16 range; `check` tells (NaN
    when some x is not finite, else the largest |x|), and other blocks go to numpy."""
    nodes = [_node("Abs", ["x"], ["ax"]),
             _node("ReduceMax", ["ax"], ["max_x"], keepdims=0),
             _node("Mul", ["x", "zero"], ["x0"]),                       # NaN where x is NaN or inf
             _node("ReduceSum", ["x0"], ["nan_if_nonfinite"], keepdims=0),
             _node("Add", ["max_x", "nan_if_nonfinite"], ["check"]),
             _node("Sign", ["x"], ["sx"]),
             _node("ReduceL1", ["sx"], ["nonzero_x"], keepdims=0),
             _node("Sub", ["tiny", "ax"], ["below"]),                   # > 0 where |x| < tiny (zeros too)
             _node("Relu", ["below"], ["below_pos"]),
             _node("Sign", ["below_pos"], ["below_1"]),
             _node("ReduceSum", ["below_1"], ["below_count"], keepdims=0)]  # tiny count = below - zeros
    outs = ["check", "nonzero_x", "below_count"]
    if fp16:
        nodes += [_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16),
                  _node("Cast", ["y"], ["back"], to=TensorProto.FLOAT),
                  _node("Sub", ["back", "x"], ["diff"]),
                  _node("Abs", ["diff"], ["d"]),
                  _node("ReduceMax", ["d"], ["max_abs"], keepdims=0),
                  _node("Max", ["ax", "eps"], ["ax_eps"]),
                  _node("Div", ["d", "ax_eps"], ["rel"]),
                  _node("ReduceMax", ["rel"], ["max_rel"], keepdims=0),
                  _node("Sign", ["d"], ["changed_1"]),
                  _node("ReduceSum", ["changed_1"], ["changed"], keepdims=0),
                  _node("Sign", ["back"], ["sb"]),
                  _node("ReduceL1", ["sb"], ["nonzero_back"], keepdims=0)]  # flushed = nonzero_x - nonzero_back
        outs += ["changed", "nonzero_back", "max_abs", "max_rel"]
    return nodes, [(k, TensorProto.FLOAT, []) for k in outs], tiny


def _cast_graph():
    return [_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16)], [("y", TensorProto.FLOAT16, ["n"])]


def _fp16_facts_numpy(x: np.ndarray, y: np.ndarray) -> tuple:
    """weight_facts' rounding facts (changed, flushed, overflowed, max abs/rel change) for
    a block holding NaN/inf or values beyond FP16's range, the slow and sure way."""
    back = y.astype(np.float32)
    finite = np.isfinite(x)
    d = np.abs(back[finite] - x[finite])
    ax = np.abs(x[finite])
    rel = d / np.maximum(ax, 1e-30)
    return (int(np.count_nonzero(back != x)), int(np.count_nonzero((back == 0) & (x != 0))),
            int(np.count_nonzero(np.isinf(back) & finite)), float(d.max()) if d.size else 0.0,
            float(rel.max()) if rel.size else 0.0)


def _session(key):
    """key: "cast", or ("facts", tiny, fp16)."""
    sess = _SESSIONS.get(key)
    if sess is not None:
        return sess
    import onnxruntime as ort
    consts = {"zero": 0.0, "eps": 1e-30}
    if key == "cast":
        nodes, outs = _cast_graph()
    else:
        nodes, outs, consts["tiny"] = _facts_graph(key[1], key[2])
    inits = [helper.make_tensor(k, TensorProto.FLOAT, [], [v]) for k, v in consts.items()]
    graph = helper.make_graph(nodes, "graphmp_" + (key if isinstance(key, str) else key[0]),
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 7
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = _SESSIONS[key] = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess


def _blocks(arr: np.ndarray):
    a = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
    for i in range(0, a.size, BLOCK):
        yield i, a[i:i + BLOCK]


def to_fp16(arr: np.ndarray) -> np.ndarray:
    """The array in float16 (flat), rounded to nearest even, overflow to inf."""
    a = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
    if a.size == 0:
        return np.empty(0, np.float16)
    return _session("cast").run(None, {"x": a})[0]


def weight_facts(arr: np.ndarray, tiny: float, fp16: bool = True) -> dict:
    """One pass over a float weight: {"max_abs": largest finite |x|, "tiny": count of
    nonzero |x| below `tiny`, "rounding": what rounding to FP16 changes (elements
    changed, largest absolute and relative change among finite values, nonzero values
    flushed to zero, finite values that overflowed to inf; None when nothing changes or
    fp16 is False)}."""
    sess = _session(("facts", float(tiny), bool(fp16)))
    max_abs, tiny_count = 0.0, 0
    r = {"changed": 0, "max_abs_change": 0.0, "max_rel_change": 0.0, "flushed_to_zero": 0, "overflowed": 0}
    for _, x in _blocks(arr):
        out = sess.run(None, {"x": x})
        check, nonzero_x, below = out[:3]
        if check <= FP16_MAX:  # finite, nothing to overflow: the fast answers hold
            max_abs = max(max_abs, float(check))
            tiny_count += int(below) - (x.size - int(nonzero_x))
            if fp16:
                changed, nonzero_back, ma, mr = out[3:]
                r["changed"] += int(changed)
                r["flushed_to_zero"] += int(nonzero_x) - int(nonzero_back)
                r["max_abs_change"] = max(r["max_abs_change"], float(ma))
                r["max_rel_change"] = max(r["max_rel_change"], float(mr))
            continue
        ax = np.abs(x[np.isfinite(x)])  # NaN/inf in x, or values that may overflow: the sure way
        max_abs = max(max_abs, float(ax.max()) if ax.size else 0.0)
        tiny_count += int(np.count_nonzero((ax > 0) & (ax < tiny)))
        if fp16:
            with np.errstate(over="ignore"):
                c, f, o, ma, mr = _fp16_facts_numpy(x, x.astype(np.float16))
            r["changed"] += c
            r["flushed_to_zero"] += f
            r["overflowed"] += o
            r["max_abs_change"] = max(r["max_abs_change"], ma)
            r["max_rel_change"] = max(r["max_rel_change"], mr)
    return {"max_abs": max_abs, "tiny": tiny_count, "rounding": r if fp16 and r["changed"] else None}


def to_fp16_noting(arr: np.ndarray) -> tuple[np.ndarray, dict]:
    """(the array in float16, weight_facts' rounding facts, zeros when nothing changed)."""
    facts = weight_facts(arr, FP16_TINY / 2)["rounding"]
    return to_fp16(arr), facts or {"changed": 0, "max_abs_change": 0.0, "max_rel_change": 0.0,
                                   "flushed_to_zero": 0, "overflowed": 0}

"""Whole-weight passes (FP32 -> FP16 with rounding facts; range facts) run by ONNX Runtime.

numpy converts float32 to float16 without SIMD (~6.6 ns per element on x86, most of a
conversion's time); ONNX Runtime's Cast kernel is vectorised and threaded (~0.5 ns)
and rounds the same way (to nearest even; overflow to inf; checked bit for bit in
tests/test_speed.py). So each pass over a weight is one small ONNX graph, run on
blocks of BLOCK elements: the temporaries stay block-sized whatever the tensor.
BF16 goes through numpy (ONNX Runtime's FP32 -> BF16 rounding has varied by version).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

BLOCK = 1 << 16  # 256 kB of float32: each op's output stays in cache (measured best of 2^14..2^20)
FP16_TINY = 2.0 ** -24          # smallest FP16 subnormal
FP16_MAX = 65504.0
_SESSIONS: dict = {}


def _node(op, ins, outs, **kw):
    return helper.make_node(op, ins, outs, **kw)


def _to_fp16_graph():
    """Float ops only (bool ops and casts cost 5-10x more in ONNX Runtime):
    counts come from Sign and L1 sums, exact below 2^24 elements per block. Valid when
    the block is finite and below the FP16 range; `check` tells (NaN when some x is not
    finite, the largest |x| otherwise), and such blocks go to numpy."""
    nodes = [_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16),
             _node("Cast", ["y"], ["back"], to=TensorProto.FLOAT),
             _node("Sub", ["back", "x"], ["diff"]),
             _node("Abs", ["diff"], ["d"]),
             _node("ReduceMax", ["d"], ["max_abs"], keepdims=0),
             _node("Abs", ["x"], ["ax"]),
             _node("Max", ["ax", "eps"], ["ax_eps"]),
             _node("Div", ["d", "ax_eps"], ["rel"]),
             _node("ReduceMax", ["rel"], ["max_rel"], keepdims=0),
             _node("Sign", ["d"], ["changed_1"]),
             _node("ReduceSum", ["changed_1"], ["changed"], keepdims=0),
             _node("Sign", ["x"], ["sx"]),
             _node("ReduceL1", ["sx"], ["nonzero_x"], keepdims=0),
             _node("Sign", ["back"], ["sb"]),
             _node("ReduceL1", ["sb"], ["nonzero_back"], keepdims=0),   # flushed = nonzero_x - nonzero_back
             _node("Mul", ["x", "zero"], ["x0"]),                       # NaN where x is NaN or inf
             _node("ReduceSum", ["x0"], ["nan_if_nonfinite"], keepdims=0),
             _node("ReduceMax", ["ax"], ["max_x"], keepdims=0),
             _node("Add", ["max_x", "nan_if_nonfinite"], ["check"])]
    outs = [("y", TensorProto.FLOAT16, ["n"])]
    outs += [(k, TensorProto.FLOAT, []) for k in ("changed", "nonzero_x", "nonzero_back", "max_abs", "max_rel", "check")]
    return nodes, outs


def _range_graph(tiny: float):
    """max |x| and the count of 0 < |x| < tiny; `check` as in _to_fp16_graph."""
    nodes = [_node("Abs", ["x"], ["ax"]),
             _node("ReduceMax", ["ax"], ["max_abs"], keepdims=0),
             _node("Sub", ["tiny", "ax"], ["below"]),        # > 0 where |x| < tiny
             _node("Relu", ["below"], ["below_pos"]),
             _node("Sign", ["below_pos"], ["small"]),
             _node("Sign", ["ax"], ["nonzero"]),
             _node("Mul", ["small", "nonzero"], ["tiny_1"]),
             _node("ReduceSum", ["tiny_1"], ["tiny_count"], keepdims=0),
             _node("Mul", ["x", "zero"], ["x0"]),
             _node("ReduceSum", ["x0"], ["check"], keepdims=0)]
    outs = [(k, TensorProto.FLOAT, []) for k in ("max_abs", "tiny_count", "check")]
    return nodes, outs, tiny


def _fp16_facts_numpy(x: np.ndarray, y: np.ndarray) -> tuple:
    """to_fp16_noting's facts for a block holding NaN/inf, the slow and sure way."""
    back = y.astype(np.float32)
    finite = np.isfinite(x)
    d = np.abs(back[finite] - x[finite])
    ax = np.abs(x[finite])
    rel = d / np.maximum(ax, 1e-30)
    return (int(np.count_nonzero(back != x)), int(np.count_nonzero((back == 0) & (x != 0))),
            int(np.count_nonzero(np.isinf(back) & finite)), float(d.max()) if d.size else 0.0,
            float(rel.max()) if rel.size else 0.0)


def _session(key):
    sess = _SESSIONS.get(key)
    if sess is not None:
        return sess
    import onnxruntime as ort
    consts = {"zero": 0.0, "eps": 1e-30}
    if key == "fp16":
        nodes, outs = _to_fp16_graph()
    else:
        nodes, outs, consts["tiny"] = _range_graph(key[1])
    inits = [helper.make_tensor(k, TensorProto.FLOAT, [], [v]) for k, v in consts.items()]
    graph = helper.make_graph(nodes, key if isinstance(key, str) else "range",
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


def to_fp16_noting(arr: np.ndarray) -> tuple[np.ndarray, dict]:
    """(the array in float16, facts of what rounding changed: elements changed, largest
    absolute and relative change among finite values, nonzero values flushed to zero,
    finite values that overflowed to inf)."""
    sess = _session("fp16")
    out = np.empty(arr.size, dtype=np.float16)
    changed = flushed = over = 0
    max_abs = max_rel = 0.0
    for i, x in _blocks(arr):
        y, c, nz_x, nz_back, ma, mr, check = sess.run(None, {"x": x})
        if not check <= FP16_MAX:  # NaN/inf in x, or values that may overflow: the sure way
            c, f, o, ma, mr = _fp16_facts_numpy(x, y)
        else:
            f, o = nz_x - nz_back, 0
        out[i:i + x.size] = y
        changed, flushed, over = changed + int(c), flushed + int(f), over + int(o)
        max_abs, max_rel = max(max_abs, float(ma)), max(max_rel, float(mr))
    return out, {"changed": changed, "max_abs_change": max_abs, "max_rel_change": max_rel,
                 "flushed_to_zero": flushed, "overflowed": over}


def range_facts(arr: np.ndarray, tiny: float) -> tuple[float, int]:
    """(largest finite |x|, count of nonzero |x| below `tiny`) of a float array."""
    sess = _session(("range", float(tiny)))
    max_abs, count = 0.0, 0
    for _, x in _blocks(arr):
        m, c, check = sess.run(None, {"x": x})
        if check != 0:  # NaN or inf in x
            ax = np.abs(x[np.isfinite(x)])
            m, c = (ax.max() if ax.size else 0.0), np.count_nonzero((ax > 0) & (ax < tiny))
        max_abs, count = max(max_abs, float(m)), count + int(c)
    return max_abs, count

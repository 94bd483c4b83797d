"""What the graph's structure says about an input's values, for generated inputs
(graphmp.inputs.generate; value_hints there merges these hints with its own).

  * An attention mask (an input named like 'mask') gets padding: its last row's last
    quarter is 0 (padded_mask), so calibration and check see masked positions, where a
    mask built with a sentinel (finfo.min) and its Softmax meet; N(0,1) or all-ones masks
    never mask anything.
  * A float (or integer) input whose values reach a Sin/Cos (through elementwise,
    data-movement, Cast and Tensor Core nodes) is an encoding's argument: coordinates,
    timesteps, positions. Its name says which: coordinates/points/boxes are drawn
    uniformly over [0, 1024) pixels, timesteps over [0, 1000), position ids (a rotary
    embedding's) count 0, 1, 2, ... along the last axis; N(0,1) or 0/1 would never reach
    the argument's real range, so the periodic rule (passes/value_rules.py) would not see
    it. An input of another name gets no values of its own, and calibration warns, naming it.
"""
from __future__ import annotations

import re

import numpy as np
import onnx
from onnx import TensorProto

PERIODIC = frozenset({"Sin", "Cos"})
# ops a value passes on its way to a Sin/Cos argument (elementwise, data movement, Tensor Core work, Casts)
_FORWARD = frozenset({
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze",
    "Concat", "Split", "Slice", "Gather", "Expand", "Tile", "Identity", "Cast", "MatMul", "Gemm", "Einsum",
    "Conv", "Clip", "Max", "Min", "Sum", "Mean", "Sqrt", "Pow",
})
WALK = 24
POSITIONS = re.compile(r"pos(ition)?_?ids?$", re.I)
SPANS = (
    (re.compile(r"coord|point|box|pixel|xy|pos(ition)?s?$", re.I), (0.0, 1024.0), "pixel coordinates"),
    (re.compile(r"time|step|(^|_)t$|sigma|noise_?level", re.I), (0.0, 1000.0), "timesteps"),
)
# element types an encoding's argument arrives in (integer timesteps are Cast to float first)
NUMERIC = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT64, TensorProto.INT32)


def _users(g) -> dict:
    users: dict = {}
    for n in g.node:
        for x in n.input:
            if x:
                users.setdefault(x, []).append(n)
    return users


def reaches_periodic(name: str, users: dict) -> bool:
    """The value `name` reaches a Sin/Cos input through _FORWARD ops within WALK nodes."""
    todo, seen = [(name, 0)], set()
    while todo:
        x, depth = todo.pop()
        for n in users.get(x, ()):
            if n.op_type in PERIODIC:
                return True
            if n.op_type in _FORWARD and depth < WALK and id(n) not in seen:
                seen.add(id(n))
                todo.extend((o, depth + 1) for o in n.output if o)
    return False


def periodic_hints(model: onnx.ModelProto) -> dict:
    """{input: {"span": [lo, hi], "as": what}} or {input: {"positions": True}} for float and
    int32/int64 inputs that reach a Sin/Cos and whose name says what they are; {input:
    {"periodic": "unknown"}} for the others that reach one (masks excluded)."""
    users = _users(model.graph)
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for i in model.graph.input:
        if i.name in inits or i.type.tensor_type.elem_type not in NUMERIC or "mask" in i.name.lower() \
                or not reaches_periodic(i.name, users):
            continue
        span = next(((lo_hi, what) for pat, lo_hi, what in SPANS if pat.search(i.name)), None)
        if POSITIONS.search(i.name):
            out[i.name] = {"positions": True}
        else:
            out[i.name] = {"span": list(span[0]), "as": span[1]} if span else {"periodic": "unknown"}
    return out


def unknown_periodic(hints: dict) -> list:
    """The inputs of `hints` that reach a Sin/Cos but whose range graphmp cannot know."""
    return [n for n, h in hints.items() if isinstance(h, dict) and h.get("periodic") == "unknown"]


def padded_mask(shape: tuple, dtype) -> np.ndarray:
    """Ones with padding: the last quarter of the last axis of the last row is 0 (of the
    whole array when the first axis has one row); all ones where the last axis is < 4."""
    m = np.ones(shape, dtype=dtype)
    if len(shape) == 0 or shape[-1] < 4:
        return m
    cut = shape[-1] - shape[-1] // 4
    if len(shape) >= 2 and shape[0] >= 2:
        m[-1, ..., cut:] = 0
    else:
        m[..., cut:] = 0
    return m


def positions(shape: tuple, dtype) -> np.ndarray:
    """0, 1, 2, ... along the last axis, the same in every row (position ids)."""
    if not shape:
        return np.zeros(shape, dtype=dtype)
    return np.broadcast_to(np.arange(shape[-1]), shape).astype(dtype)

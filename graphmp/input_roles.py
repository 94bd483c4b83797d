"""What the graph's structure says about an input's values, for generated inputs
(graphmp.inputs.generate, with structural_hints: graphmp.inputs.value_hints).

  * An integer input compared (Equal) with a one-element constant is a mode selector (a
    sample rate choosing an If branch): it gets that constant. An integer input that
    indexes a constant table (Gather) is drawn uniformly over the table's rows.
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

INT_ELEMS = (TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8,
             TensorProto.UINT64, TensorProto.UINT32, TensorProto.UINT16, TensorProto.UINT8)
# an integer input named like this holds lengths (generated as the full length), not indices
LENGTHS = re.compile(r"(^|_)(lens?|lengths?|seq_?lens?|num_frames)$", re.I)
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


_PASS_THROUGH = {"Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten"}
_COMPARE = {"Equal"}


def structural_hints(model: onnx.ModelProto, specs: list) -> dict:
    """specs: the model's graph inputs (graphmp.inputs.input_specs). {input: value} for integer inputs of at most one element that the main graph
    compares (Equal, through Cast/Reshape-like nodes) with a one-element constant:
    mode selectors such as a sample rate that chooses an If branch; and {input: {"below":
    rows}} for integer inputs that index a constant table (Gather's indices, through the same
    nodes): token ids into an embedding, drawn uniformly over its rows, so calibration sees
    many different rows, not only rows 0 and 1 (a vocabulary larger than the tokens
    generated is still only sampled: real data, --calibration, covers the real tokens)."""
    hints = periodic_hints(model)  # coordinates/timesteps that reach a Sin/Cos
    hints.update(_index_ranges(model, specs))
    hints.update(_selector_values(model, specs))
    return hints


def _consts_and_users(g):
    consts = {t.name: t for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = n.attribute[0].t
    users: dict = {}
    for n in g.node:
        for x in n.input:
            users.setdefault(x, []).append(n)
    return consts, users


def _index_ranges(model: onnx.ModelProto, specs: list) -> dict:
    consts, users = _consts_and_users(model.graph)
    out = {}
    for s in specs:
        if s.elem not in INT_ELEMS or "mask" in s.name.lower() or LENGTHS.search(s.name):
            continue
        frontier, seen, rows = [s.name], set(), []
        while frontier:
            x = frontier.pop()
            seen.add(x)
            for n in users.get(x, []):
                if n.op_type in _PASS_THROUGH:
                    frontier.extend(o for o in n.output[:1] if o not in seen)
                elif n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == x and n.input[0] in consts:
                    axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
                    dims = list(consts[n.input[0]].dims)
                    if -len(dims) <= axis < len(dims) and dims[axis] > 0:
                        rows.append(int(dims[axis]))
        if rows:
            out[s.name] = {"below": min(rows)}  # valid for every table it indexes
    return out


def _selector_values(model: onnx.ModelProto, specs: list) -> dict:
    consts, users = _consts_and_users(model.graph)
    hints = {}
    for s in specs:
        if s.elem not in INT_ELEMS or any(isinstance(d, int) and d > 1 for d in s.dims) or len(s.dims) > 1:
            continue
        frontier, seen = [s.name], set()
        while frontier and s.name not in hints:
            x = frontier.pop()
            seen.add(x)
            for n in users.get(x, []):
                if n.op_type in _PASS_THROUGH:
                    frontier.extend(o for o in n.output[:1] if o not in seen)
                elif n.op_type in _COMPARE:
                    other = next((i for i in n.input if i != x), None)
                    t = consts.get(other)
                    if t is not None and int(np.prod(t.dims)) == 1:
                        hints[s.name] = onnx.numpy_helper.to_array(t).reshape(()).item()
                        break
    return hints

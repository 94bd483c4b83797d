"""Reshape lengths that onnx's shape inference leaves open, worked out from the graph's shape
arithmetic.

Exporters write a reshape to lengths computed at run time: torch's TorchScript exporter turns
`q.view(b, t, self.h, c // self.h)` (nanoGPT, most hand-written attention) into
Reshape(q, Concat(Gather(Shape(x), 0), ..., Div(Gather(Shape(x), 2), h))), and Hugging Face's
Conv1D's `x.size()[:-1] + (nf,)` into a Concat of a Slice of a Shape. onnx's data
propagation follows Shape, Gather, Concat, Unsqueeze and Add/Sub/Mul, but not Div, so the
head length, and every shape after it, stays unknown. The training step then takes the slow,
general forms where a static shape would do (a gradient's unbroadcast axes found at run time
with NonZero, a host sync on CUDA), and `--cuda-graph` cannot fold the Shape nodes.

`declare_reshapes(model, dims_of)` evaluates the small int64 tensors that feed Reshape shapes
(each element an int, a symbolic dim name, or unknown) and declares a Reshape's output shape
where every length comes out known: an int, or a symbol read straight from an input's shape
(the batch `N`). Arithmetic runs on ints only (a symbol times 1 stays that symbol); -1 is
resolved only when the input's size and the other lengths are all ints. What is declared is
what the Reshape computes, so the declarations are exact, never guesses.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MAX_ELEMS = 16  # a shape tensor: longer int tensors are data, not shapes
ROUNDS = 8  # declare + inference rounds in infer() (a settled Reshape can settle the next)
_INTS = (TensorProto.INT64, TensorProto.INT32)
_FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE)
_UNKNOWN = None


def _const_values(model) -> dict:
    """{name: (is_scalar, [int, ...])} of the small initializers and Constants holding whole
    numbers (int, or float like the 2.0 of `n / 2.0`)."""
    out = {}
    tensors = list(model.graph.initializer) + [a.t for n in model.graph.node if n.op_type == "Constant"
                                               for a in n.attribute if a.name == "value"]
    names = [t.name for t in model.graph.initializer] + [n.output[0] for n in model.graph.node
                                                         if n.op_type == "Constant" and n.attribute
                                                         and n.attribute[0].name == "value"]
    for name, t in zip(names, tensors):
        if t.data_type in _INTS + _FLOATS and len(t.dims) <= 1 and int(np.prod(t.dims)) <= MAX_ELEMS:
            values = numpy_helper.to_array(t).ravel()
            if np.all(np.isfinite(values)) and np.all(values == np.round(values)):  # 2.0 in `n / 2.0`
                out[name] = (len(t.dims) == 0, [int(v) for v in values])
    return out


def _arith(op: str, a, b):
    """One element of Add/Sub/Mul/Div on ints (Div only where it divides exactly: then integer
    and float division, floor, ceil and truncation all agree); a symbol survives only the
    identities (x + 0, x - 0, x * 1, x / 1)."""
    if a is _UNKNOWN or b is _UNKNOWN:
        return _UNKNOWN
    if isinstance(a, int) and isinstance(b, int):
        if op == "Add":
            return a + b
        if op == "Sub":
            return a - b
        if op == "Mul":
            return a * b
        return a // b if b and a % b == 0 else _UNKNOWN
    if isinstance(b, int) and ((op in ("Add", "Sub") and b == 0) or (op in ("Mul", "Div") and b == 1)):
        return a
    if op in ("Add", "Mul") and isinstance(a, int) and ((op == "Add" and a == 0) or (op == "Mul" and a == 1)):
        return b
    return _UNKNOWN


def _eval(node, vals: dict, dims_of):
    """(is_scalar, elements) of the node's first output, or None when it is not a small integer
    tensor this knows how to follow."""
    ins = [vals.get(i) for i in node.input]
    op = node.op_type
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op == "Shape":
        dims = dims_of(node.input[0])
        if dims is None:
            return None
        start, end = attrs.get("start", 0), attrs.get("end", len(dims))
        return False, list(dims)[start:end]
    if op in ("Identity", "Floor", "Ceil") and ins[0] is not None:
        return ins[0]
    if op == "Cast" and ins[0] is not None and attrs.get("to") in _INTS + _FLOATS:
        return ins[0]
    if op == "Gather" and ins[0] is not None and ins[1] is not None and not ins[0][0] and attrs.get("axis", 0) == 0:
        data = ins[0][1]
        try:
            return ins[1][0], [data[i] for i in ins[1][1]]
        except IndexError:
            return None
    if op == "Slice" and ins[0] is not None and not ins[0][0] and all(v is not None for v in ins[1:]):
        starts, ends = ins[1][1], ins[2][1]
        axes = ins[3][1] if len(ins) > 3 and node.input[3] else [0]
        steps = ins[4][1] if len(ins) > 4 and node.input[4] else [1]
        if len(starts) == len(ends) == 1 and axes in ([0], [-1]) and steps == [1] and \
                all(isinstance(v, int) for v in starts + ends):
            return False, list(ins[0][1])[starts[0]:ends[0]]  # step 1: ONNX clamps as Python does
        return None
    if op == "Unsqueeze" and ins[0] is not None and ins[0][0]:
        return False, list(ins[0][1])
    if op == "Squeeze" and ins[0] is not None and len(ins[0][1]) == 1:
        return True, list(ins[0][1])
    if op == "Concat" and ins and all(v is not None and not v[0] for v in ins):
        return False, [e for v in ins for e in v[1]]
    if op in ("Add", "Sub", "Mul", "Div") and ins[0] is not None and ins[1] is not None:
        (sa, a), (sb, b) = ins[0], ins[1]
        if len(a) != len(b) and 1 not in (len(a), len(b)):
            return None
        n = max(len(a), len(b))
        a, b = (a * n if len(a) == 1 else a), (b * n if len(b) == 1 else b)
        return sa and sb, [_arith(op, x, y) for x, y in zip(a, b)]
    return None


def _reshape_dims(x_dims, target: list, allowzero: int):
    """The output dims of Reshape(x, target) where all are known (ints or symbols), else None."""
    out = []
    for i, t in enumerate(target):
        if t is _UNKNOWN:
            return None
        if t == 0 and not allowzero:
            if x_dims is None or i >= len(x_dims) or x_dims[i] is None:
                return None
            out.append(x_dims[i])
        else:
            out.append(t)
    if -1 in out:
        rest = [d for d in out if d != -1]
        if x_dims is None or not all(isinstance(d, int) for d in list(x_dims) + rest) or 0 in rest:
            return None
        out[out.index(-1)] = int(np.prod(x_dims)) // int(np.prod(rest))
    if any(isinstance(d, int) and d < 0 for d in out):
        return None
    return out


def _named(dims):
    """dims with onnx's placeholder names for unknown lengths (unk__N, renumbered on every
    inference run, so two of them may share a name and mean different lengths) as unknown."""
    if dims is None:
        return None
    return [None if isinstance(d, str) and d.startswith("unk__") else d for d in dims]


def declare_reshapes(model, dims_of) -> list:
    """value_info entries for the outputs of Reshape nodes of `model` whose lengths the shape
    arithmetic above determines where `dims_of` (tensor -> [int | str | None] or None: what
    shape inference knows) does not (the model is not changed). A declared shape can settle
    the next Reshape through inference: infer() runs rounds of both."""
    vals = _const_values(model)
    known_dims, settled = dims_of, {}  # settled: declared in this pass, for the Shapes after them
    dims_of = lambda t: _named(settled.get(t) or known_dims(t))  # noqa: E731
    declared = []
    elem = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.value_info) + list(model.graph.input)}
    outputs = {v.name for v in model.graph.output}
    for node in model.graph.node:
        if node.op_type == "Reshape" and len(node.input) > 1 and node.input[1] in vals \
                and node.output[0] not in outputs:
            attrs = {a.name: a.i for a in node.attribute}
            dims = _reshape_dims(dims_of(node.input[0]), vals[node.input[1]][1], attrs.get("allowzero", 0))
            known = dims_of(node.output[0])
            if known is not None and (len(known) != len(dims or known) or any(
                    k is not None and k != d for k, d in zip(known, dims or known))):
                continue  # inference knows it already (or disagrees: leave it be)
            et = elem.get(node.input[0]) or elem.get(node.output[0])
            if dims is not None and et and dims != known:
                declared.append(helper.make_tensor_value_info(node.output[0], et, dims))
                settled[node.output[0]] = dims
            continue
        if node.output and node.output[0] not in vals:
            got = _eval(node, vals, dims_of)
            if got is not None and len(got[1]) <= MAX_ELEMS:
                vals[node.output[0]] = got
    return declared


def dims_table(model) -> dict:
    """{tensor: [int | str | None] or None} of what `model` declares (initializers, inputs,
    value_info, outputs)."""
    g = model.graph
    out = {t.name: [int(d) for d in t.dims] for t in g.initializer}
    for v in list(g.input) + list(g.value_info) + list(g.output):
        tt = v.type.tensor_type
        if v.type.HasField("tensor_type") and v.name not in out:
            out[v.name] = None if not tt.HasField("shape") else \
                [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
    return out


def infer(model, data_prop: bool = False) -> onnx.ModelProto:
    """onnx shape inference of `model` (a new model), plus the Reshape lengths declare_reshapes
    works out, a few rounds until nothing new is declared. Each round infers the model as
    given plus every declaration so far (not the last round's result, whose placeholder
    names for unknown lengths would stick)."""
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=data_prop)
    decls = {}
    original = list(model.graph.value_info)
    try:
        for _ in range(ROUNDS):
            new = {v.name: v for v in declare_reshapes(inferred, dims_table(inferred).get)
                   if decls.get(v.name) != v}
            if not new:
                break
            decls.update(new)
            del model.graph.value_info[:]
            model.graph.value_info.extend([v for v in original if v.name not in decls] + list(decls.values()))
            inferred = onnx.shape_inference.infer_shapes(model, data_prop=data_prop)
    finally:
        del model.graph.value_info[:]
        model.graph.value_info.extend(original)
    return inferred

"""LSTM and GRU for training: unrolled into primitive ops that have gradient rules.

graphmp's autodiff has no rule for LSTM/GRU. `decompose_recurrent` rewrites every ONNX
LSTM and GRU node of the main graph (default domain, opset 7-22 attribute sets) into the
same computation written with MatMul, Add, Sub, Mul, Sigmoid, Tanh, Transpose, Split,
Concat and Unsqueeze, unrolled over the sequence length, so `add_backward` differentiates
it with the rules it already has (backpropagation through time falls out of the unrolled
graph). The rewritten nodes produce the original output names, so the rest of the graph
is untouched.

Supported: direction forward/reverse/bidirectional, layout 0 ([seq, batch, ...]) and 1
([batch, seq, ...]), optional B, initial_h, initial_c and peepholes P (LSTM), all outputs
(Y, Y_h, Y_c), GRU linear_before_reset 0 and 1. Refused with a GraphmpError naming the
node: non-default activations, clip, input_forget=1, a sequence_lens input that is not a
constant equal to the full length everywhere, and a sequence length that is not static.

The sequence length must be static: it comes from onnx shape inference (data propagation
on) with the input shapes pinned to `shapes` (--shapes syntax, graphmp.inputs), or, where
inference leaves it open, from one ONNX Runtime run at those shapes. The unrolled graph
therefore accepts only that sequence length (the batch may still vary): a recurrent
model's training step graph is built for one sequence length, e.g.
`graphmp train-graph gru.onnx ... --shapes x:1x50x40`, and the symbolic non-batch dims of
the inputs named in `shapes` are declared with those sizes in the unrolled model.

How one direction is written (h, c: the state, shape [1, batch, H] for layout 0 and
[batch, 1, H] for layout 1 -- the size-1 axis is where both the time axis of X and the
direction axis of initial_h/Y_h sit, so no Squeeze/Reshape is needed and the batch stays
symbolic):
    xw = X @ W_d^T + bias                    one MatMul for all time steps, then Split per step
    LSTM: gates = xw_t + h @ R_d^T; i, o, f = sigmoid, c~ = tanh; c = f*c + i*c~; h = o*tanh(c)
    GRU:  z, r = sigmoid(xw_zr + h @ R_zr^T [+ Rb_zr]);
          h~ = tanh(xw_h + (r*h) @ R_h^T)          (linear_before_reset=0, Rb_h folded into xw)
          h~ = tanh(xw_h + r*(h @ R_h^T + Rb_h))   (linear_before_reset=1)
          h = h~ + z*(h - h~)                      (= (1-z)*h~ + z*h without a constant 1)
An absent initial state is zero, so the first step simply omits the recurrent terms.
"""
from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import GraphmpError
from ..ir import Names
from ..opset import default_opset
from .measure import measured_dims

__all__ = ["decompose_recurrent", "pin_inputs"]

_DEFAULT_ACTS = {"LSTM": ("sigmoid", "tanh", "tanh"), "GRU": ("sigmoid", "tanh")}
_DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}


def decompose_recurrent(model: onnx.ModelProto, *, shapes=None, where: str = "<model>"):
    """Return (model', report): a copy of `model` whose main-graph LSTM/GRU nodes are unrolled
    into primitive ops, and one dict per rewritten node (node, op, direction, layout,
    sequence_length, hidden_size, nodes = how many nodes replace it).

    Needs: a model whose recurrent nodes' sequence length is static once the graph inputs
    named in `shapes` (--shapes syntax or {name: dims}) are pinned. Guarantees: the outputs
    of every rewritten node are computed with the same math as ONNX (checked against ONNX
    Runtime in tests/test_train_rnn.py) at that sequence length; every emitted op is valid at
    the model's opset; a model without LSTM/GRU is returned as is with an empty report.
    Raises GraphmpError (one line, naming the node) for the settings listed in the module
    docstring."""
    nodes = [n for n in model.graph.node if n.op_type in ("LSTM", "GRU") and n.domain in ("", "ai.onnx")]
    if not nodes:
        return model, []
    dims = _pinned_dims(model, shapes, nodes, where)
    model = copy.deepcopy(model)
    u = _Unroller(model)
    consts = _constants(model)
    report, new_nodes = [], []
    for node in model.graph.node:
        if node.op_type not in ("LSTM", "GRU") or node.domain not in ("", "ai.onnx"):
            new_nodes.append(node)
            continue
        u.nodes = []
        u.prefix = node.name or node.op_type
        entry = _rewrite(u, node, dims, consts, where)
        entry["nodes"] = len(u.nodes)
        report.append(entry)
        new_nodes.extend(u.nodes)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    model.graph.initializer.extend(u.inits)
    pin_inputs(model, shapes)
    return model, report


def pin_inputs(model, shapes) -> None:
    """Declare the --shapes sizes of the graph inputs' symbolic dims in `model` (in place),
    except the batch dims (graphmp.inputs.batch_positions): the unrolled graph is only valid
    at the sequence length those sizes gave (and a Resize gradient at the lengths it was
    built for), and ONNX Runtime then names the input and axis of a batch of another length
    instead of failing inside the unrolled Split."""
    from ..inputs import batch_positions, input_specs, parse_shapes
    given = parse_shapes(shapes)
    if not given:
        return
    specs = input_specs(model)
    free = set(batch_positions(specs))
    for v in model.graph.input:
        if v.name not in given:
            continue
        for axis, (d, size) in enumerate(zip(v.type.tensor_type.shape.dim, given[v.name])):
            if not d.HasField("dim_value") and (v.name, axis) not in free:
                d.Clear()
                d.dim_value = int(size)


# --- what the graph knows ------------------------------------------------------------------

def _pinned_dims(model, shapes, nodes, where) -> dict:
    """{tensor: [int | str | None]} with the graph inputs in `shapes` pinned: from onnx shape
    inference (data propagation on); where that leaves a recurrent node's input shape open
    (data propagation stops at initializers feeding a shape Concat, as torch exports write)
    and every graph input then has a static shape, from one ONNX Runtime run at those shapes."""
    from ..inputs import check_shapes, input_specs, parse_shapes
    given = parse_shapes(shapes)
    specs = input_specs(model)
    check_shapes(specs, given, where)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for v in m.graph.input:
        if v.name in given:
            shape = v.type.tensor_type.shape
            del shape.dim[:]
            for d in given[v.name]:
                shape.dim.add().dim_value = int(d)
    try:
        m = onnx.shape_inference.infer_shapes(m, data_prop=True)
    except Exception:  # noqa: BLE001 - best effort: declared shapes still count
        pass
    out = {}
    for t in m.graph.initializer:
        out[t.name] = list(t.dims)
    for v in list(m.graph.input) + list(m.graph.value_info) + list(m.graph.output):
        tt = v.type.tensor_type
        if v.type.HasField("tensor_type") and tt.HasField("shape"):
            out.setdefault(v.name, [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                    for d in tt.shape.dim])
    open_ = [n.input[0] for n in nodes if not all(isinstance(d, int) for d in out.get(n.input[0]) or [None])]
    if open_:
        out.update(measured_dims(model, specs, given, open_))
    return out


def _constants(model) -> dict:
    """{tensor: numpy value} of initializers and Constant nodes (for sequence_lens)."""
    vals = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    vals[n.output[0]] = a.t
    return vals


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            if isinstance(v, list):
                return [x.decode() if isinstance(x, bytes) else x for x in v]
            return v.decode() if isinstance(v, bytes) else v
    return default


# --- emitting ------------------------------------------------------------------------------

class _Unroller:
    """Emits nodes with unique names; int64 constants become (shared) initializers."""

    def __init__(self, model):
        self.opset = default_opset(model)
        self.names = Names(model, start=1)
        self.nodes, self.inits, self._ints = [], [], {}
        self.prefix = "rnn"

    def fresh(self, hint: str) -> str:
        return self.names.numbered(f"{self.prefix}/unrolled/{hint}")

    def op(self, op_type, inputs, out=None, n_out=1, **attrs):
        outs = [out] if out else [self.fresh(op_type) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh(op_type + "_node"),
                                           **attrs))
        return outs[0] if n_out == 1 else outs

    def ints(self, values) -> str:
        key = tuple(int(v) for v in values)
        if key not in self._ints:
            name = self.fresh("ints")
            self.inits.append(numpy_helper.from_array(np.array(key, dtype=np.int64), name))
            self._ints[key] = name
        return self._ints[key]

    def split(self, x, sizes, axis) -> list:
        if len(sizes) == 1:
            return [x]
        if self.opset >= 13:
            return self.op("Split", [x, self.ints(sizes)], n_out=len(sizes), axis=axis)
        return self.op("Split", [x], n_out=len(sizes), axis=axis, split=list(sizes))

    def unsqueeze(self, x, axis, out=None) -> str:
        if self.opset >= 13:
            return self.op("Unsqueeze", [x, self.ints([axis])], out=out)
        return self.op("Unsqueeze", [x], out=out, axes=[axis])

    def concat(self, xs, axis, out=None) -> str:
        if len(xs) == 1:
            return self.op("Identity", xs, out=out) if out else xs[0]
        return self.op("Concat", xs, out=out, axis=axis)

    def add(self, a, b):
        return a if b is None else b if a is None else self.op("Add", [a, b])


# --- one node ------------------------------------------------------------------------------

def _input(node, i):
    return node.input[i] if len(node.input) > i and node.input[i] else None


def _check(node, dims, consts, where):
    """(sequence length, hidden size, number of directions, time axis of X, direction), or a
    one-line GraphmpError naming the node, what it uses and what to do."""
    op = node.op_type

    def refuse(what, todo):
        raise GraphmpError(f"{where}: {op} node '{node.name}' {what}; {todo}")
    direction = _attr(node, "direction", "forward")
    if direction not in _DIRECTIONS:
        refuse(f"has direction '{direction}'", "ONNX allows forward, reverse or bidirectional")
    nd = _DIRECTIONS[direction]
    acts = _attr(node, "activations")
    if acts is not None and [a.lower() for a in acts] != list(_DEFAULT_ACTS[op]) * nd:
        refuse(f"uses activations {list(acts)}", "only the default ones (Sigmoid, Tanh) can be unrolled for "
               "training; re-export the layer with its default activations")
    if _attr(node, "clip") is not None:
        refuse("clips its cell input (clip attribute)", "cell clipping cannot be trained here; re-export the "
               "layer without clip")
    if op == "LSTM" and _attr(node, "input_forget", 0):
        refuse("couples the input and forget gates (input_forget=1)", "re-export the layer with "
               "input_forget=0")
    layout = int(_attr(node, "layout", 0))
    ax = 0 if layout == 0 else 1
    x = node.input[0]
    xd = dims.get(x)
    seq = xd[ax] if xd is not None and len(xd) == 3 else None
    if not isinstance(seq, int) or seq < 1:
        refuse(f"has a sequence length (axis {ax} of '{x}', shape {xd}) that is not static", "pin the model's "
               "input shapes with --shapes NAME:DIMS (the training step then accepts only that sequence length)")
    lens = _input(node, 4)
    if lens is not None:
        t = consts.get(lens)
        value = numpy_helper.to_array(t) if t is not None else None
        if value is None or not np.all(value == seq):
            refuse(f"has a sequence_lens input '{lens}' that is not a constant equal to the full length {seq}",
                   "variable-length batches cannot be unrolled; remove sequence_lens (pad and mask instead)")
    hidden = _attr(node, "hidden_size")
    if hidden is None:
        rd = dims.get(node.input[2])
        hidden = rd[-1] if rd and isinstance(rd[-1], int) else None
        if hidden is None:
            refuse("has no hidden_size attribute and R has no static shape", "re-export with hidden_size set")
    return seq, int(hidden), nd, ax, direction


def _rewrite(u: _Unroller, node, dims, consts, where) -> dict:
    """Emit (into u.nodes) the unrolled form of one LSTM/GRU node, writing its outputs' names;
    return its report entry."""
    seq, H, nd, ax, direction = _check(node, dims, consts, where)
    lstm = node.op_type == "LSTM"
    G = 4 if lstm else 3
    lbr = int(_attr(node, "linear_before_reset", 0)) if not lstm else 0
    X, W, R = node.input[:3]
    B, h0 = _input(node, 3), _input(node, 5)
    c0, P = (_input(node, 6), _input(node, 7)) if lstm else (None, None)
    # per direction: weights split on axis 0, states on the direction axis (0 or 1 by layout)
    per = {name: (u.split(t, [1] * nd, axis) if t else [None] * nd)
           for name, t, axis in (("W", W, 0), ("R", R, 0), ("B", B, 0), ("P", P, 0), ("h", h0, ax), ("c", c0, ax))}
    order = list(range(seq))
    ys, hs, cs = [], [], []
    for d in range(nd):
        rev = direction == "reverse" or d == 1
        wt = u.op("Transpose", [per["W"][d]], perm=[0, 2, 1])  # [1, I, G*H]
        rt = u.op("Transpose", [per["R"][d]], perm=[0, 2, 1])  # [1, H, G*H]
        wb = rb = None
        if B:
            wb, rb = u.split(per["B"][d], [G * H, G * H], 1)   # [1, G*H] each
        xw = u.op("MatMul", [X, wt])
        if lstm or lbr == 0:
            xw = u.add(xw, u.add(wb, rb))
        else:
            xw = u.add(xw, wb)
        steps = u.split(xw, [1] * seq, ax)
        times = order[::-1] if rev else order
        if lstm:
            pp = u.split(per["P"][d], [H, H, H], 1) if P else None
            y, h, c = _lstm(u, steps, times, rt, pp, per["h"][d], per["c"][d], H)
            cs.append(c)
        else:
            y, h = _gru(u, steps, times, rt, rb, per["h"][d], H, lbr)
        ys.append(y)
        hs.append(h)
    outs = list(node.output) + [""] * 3
    if outs[0]:
        if nd == 1:
            u.unsqueeze(u.concat([ys[0][t] for t in order], ax), ax + 1, out=outs[0])
        else:
            u.concat([u.unsqueeze(u.concat([y[t] for t in order], ax), ax + 1) for y in ys], ax + 1, out=outs[0])
    if outs[1]:
        u.concat(hs, ax, out=outs[1])
    if lstm and outs[2]:
        u.concat(cs, ax, out=outs[2])
    return {"node": node.name, "op": node.op_type, "direction": direction, "layout": ax,
            "sequence_length": seq, "hidden_size": H}


def _lstm(u, steps, times, rt, pp, h, c, H):
    """One direction of an LSTM (gate order i, o, f, c); returns ({t: h_t}, h_last, c_last)."""
    ys = {}
    for t in times:
        g = steps[t] if h is None else u.op("Add", [steps[t], u.op("MatMul", [h, rt])])
        if pp is None:
            iof, cg = u.split(g, [3 * H, H], 2)
            i, o, f = u.split(u.op("Sigmoid", [iof]), [H, H, H], 2)
        else:
            pi, po, pf = pp
            ig, og, fg, cg = u.split(g, [H] * 4, 2)
            if c is not None:
                ig = u.op("Add", [ig, u.op("Mul", [pi, c])])
                fg = u.op("Add", [fg, u.op("Mul", [pf, c])])
            i, f = u.op("Sigmoid", [ig]), u.op("Sigmoid", [fg])
        new_c = u.op("Mul", [i, u.op("Tanh", [cg])])
        if c is not None:
            new_c = u.op("Add", [u.op("Mul", [f, c]), new_c])
        c = new_c
        if pp is not None:
            o = u.op("Sigmoid", [u.op("Add", [og, u.op("Mul", [po, c])])])
        h = ys[t] = u.op("Mul", [o, u.op("Tanh", [c])])
    return ys, h, c


def _gru(u, steps, times, rt, rb, h, H, lbr):
    """One direction of a GRU (gate order z, r, h); returns ({t: h_t}, h_last)."""
    if lbr == 0:
        r_zr, r_h = u.split(rt, [2 * H, H], 2)
    ys = {}
    for t in times:
        x_zr, x_h = u.split(steps[t], [2 * H, H], 2)
        if lbr == 0:
            zr = x_zr if h is None else u.op("Add", [x_zr, u.op("MatMul", [h, r_zr])])
            z, r = u.split(u.op("Sigmoid", [zr]), [H, H], 2)
            hh = x_h if h is None else u.op("Add", [x_h, u.op("MatMul", [u.op("Mul", [r, h]), r_h])])
        else:
            rec = u.add(None if h is None else u.op("MatMul", [h, rt]), rb)  # h @ R^T + Rb
            if rec is None:  # no state and no bias: the recurrent part is zero
                z, r = u.split(u.op("Sigmoid", [x_zr]), [H, H], 2)
                hh = x_h
            else:
                rec_zr, rec_h = u.split(rec, [2 * H, H], 2 if h is not None else 1)  # rank 2 when rec = Rb
                z, r = u.split(u.op("Sigmoid", [u.op("Add", [x_zr, rec_zr])]), [H, H], 2)
                hh = u.op("Add", [x_h, u.op("Mul", [r, rec_h])])
        hh = u.op("Tanh", [hh])
        if h is None:
            h = u.op("Sub", [hh, u.op("Mul", [z, hh])])
        else:
            h = u.op("Add", [hh, u.op("Mul", [z, u.op("Sub", [h, hh])])])
        ys[t] = h
    return ys, h

"""Reverse-mode differentiation of ONNX graphs into standard ONNX ops.

`add_backward(model, loss, wrt)` appends to the graph the nodes computing d(loss)/d(w) for
every w in `wrt` and returns {w: gradient tensor name}. It guarantees:

- the gradient of a tensor has that tensor's dtype and shape (the gradient of a Cast is a
  Cast back, so FP16 regions are differentiated in FP16 and FP32 islands stay FP32);
  constants a rule creates take the dtype of the tensor they combine with;
- only nodes on a path from some w to `loss` get gradient nodes; integer/bool tensors and
  zero-derivative ops (Shape, comparisons, Floor, ...) carry no gradient;
- a node on the path without a rule raises GraphmpError naming the node, its op and the
  supported ops; existing nodes are untouched, new names are unique, the result is
  checker-clean; ops emitted are valid at the model's opset (>= 13).

`training_forward(model)` rewrites BatchNormalization (batch statistics, running-statistic
updates as new tensors) and Dropout (training mode, mask output) in place.

The `Emitter` and its helpers (unbroadcast, reshape_like, reductions at the right opset,
dtype-matched constants) are what the per-op rules in rules.py are written with.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import GraphmpError
from ..ops import FLOAT_TYPES
from ..opset import default_opset

MIN_OPSET = 13


def _dims(vtype) -> list | None:
    """[int | str | None] of a TypeProto's tensor shape; None when the rank is unknown."""
    tt = vtype.tensor_type
    if not tt.HasField("shape"):
        return None
    out = []
    for d in tt.shape.dim:
        out.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
    return out


def tensor_info(model: onnx.ModelProto) -> dict:
    """{tensor name: (elem_type, dims or None)} from the graph and onnx shape inference."""
    info = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # shape inference is best effort; declared types still count
        inferred = model
    g = inferred.graph
    for t in g.initializer:
        info[t.name] = (t.data_type, list(t.dims))
    for v in list(g.input) + list(g.value_info) + list(g.output):
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            info.setdefault(v.name, (v.type.tensor_type.elem_type, _dims(v.type)))
    for n in g.node:
        if n.op_type == "Constant" and n.output[0] not in info:
            for a in n.attribute:
                if a.name == "value":
                    info[n.output[0]] = (a.t.data_type, list(a.t.dims))
    return info


def attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


class Emitter:
    """Emits new nodes with unique names, and answers questions about existing tensors.

    Every method that creates nodes returns the name of the tensor it made."""

    def __init__(self, model: onnx.ModelProto, info: dict, prefix: str, active=frozenset()):
        self.graph = model.graph
        self.opset = default_opset(model)
        self.info = info
        self.prefix = prefix
        self.active = active
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0
        self._taken = {x for n in model.graph.node for x in list(n.input) + list(n.output)}
        self._taken |= {n.name for n in model.graph.node}
        self._taken |= {v.name for v in list(model.graph.input) + list(model.graph.output)}
        self._taken |= {t.name for t in model.graph.initializer}
        self._taken |= {v.name for v in model.graph.value_info}
        self._cache: dict = {}
        self._consts = {}
        for t in model.graph.initializer:
            self._consts[t.name] = t
        for n in model.graph.node:
            if n.op_type == "Constant" and attr(n, "value") is not None:
                self._consts[n.output[0]] = attr(n, "value")

    # --- names and nodes -------------------------------------------------------------
    def fresh(self, stem: str) -> str:
        while True:
            self._count += 1
            name = f"{self.prefix}/{stem}_{self._count}"
            if name not in self._taken:
                self._taken.add(name)
                return name

    def op(self, op_type: str, inputs, outputs: int = 1, name=None, **attrs):
        """Emit one node; returns its output name (a list when outputs > 1)."""
        outs = [self.fresh(op_type) for _ in range(outputs)] if name is None else [name]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh(op_type + "_node"),
                                           **attrs))
        return outs[0] if outputs == 1 else outs

    # --- facts about tensors -----------------------------------------------------------
    def dtype(self, x: str) -> int:
        if x not in self.info:
            raise GraphmpError(f"tensor '{x}': unknown element type (run onnx shape inference on the "
                               "model or declare its value_info)")
        return self.info[x][0]

    def dims(self, x: str) -> list | None:
        return self.info[x][1] if x in self.info else None

    def rank(self, x: str) -> int:
        d = self.dims(x)
        if d is None:
            raise GraphmpError(f"tensor '{x}': unknown rank; the gradient rule needs it (declare the "
                               "model's input shapes, or run onnx shape inference)")
        return len(d)

    def static_shape(self, x: str) -> list[int] | None:
        d = self.dims(x)
        return d if d is not None and all(isinstance(v, int) for v in d) else None

    def needs(self, x: str) -> bool:
        """Whether tensor x depends on a differentiated tensor (and so wants a gradient)."""
        return bool(x) and x in self.active

    def const_value(self, x: str):
        """numpy value of an initializer or Constant output, else None."""
        t = self._consts.get(x)
        return None if t is None else numpy_helper.to_array(t)

    # --- constants -----------------------------------------------------------------
    def const(self, value, dtype: int, shape=None) -> str:
        """A Constant of `dtype` (cached): scalar unless `shape` or a list value says otherwise."""
        arr = np.array(value, dtype=helper.tensor_dtype_to_np_dtype(dtype))
        if shape is not None:
            arr = arr.reshape(shape)
        key = ("const", dtype, arr.shape, arr.tobytes())
        if key not in self._cache:
            name = self.fresh("const")
            self.nodes.append(helper.make_node("Constant", [], [name], name=self.fresh("Constant_node"),
                                               value=numpy_helper.from_array(arr, name)))
            self._cache[key] = name
        return self._cache[key]

    def like(self, value, x: str) -> str:
        """Scalar constant in the dtype of tensor x."""
        return self.const(value, self.dtype(x))

    def ints(self, values) -> str:
        return self.const(list(values), TensorProto.INT64)

    # --- shape helpers ---------------------------------------------------------------
    def shape(self, x: str) -> str:
        key = ("shape", x)
        if key not in self._cache:
            self._cache[key] = self.op("Shape", [x])
        return self._cache[key]

    def shape_tensor(self, x: str) -> str:
        """The shape of x as an int64 tensor: a constant when static, else Shape(x)."""
        s = self.static_shape(x)
        return self.ints(s) if s is not None else self.shape(x)

    def dim(self, x: str, axis: int) -> str:
        """Size of axis `axis` of x as a 1-element int64 tensor."""
        d = self.dims(x)
        if d is not None and isinstance(d[axis], int):
            return self.ints([d[axis]])
        return self.op("Gather", [self.shape(x), self.ints([axis])], axis=0)

    def spatial_shape(self, x: str) -> str:
        """x's dims from axis 2 on (int64 tensor)."""
        s = self.static_shape(x)
        if s is not None:
            return self.ints(s[2:])
        return self.op("Slice", [self.shape(x), self.ints([2]), self.ints([np.iinfo(np.int64).max])])

    def reshape_like(self, g: str, x: str) -> str:
        """g reshaped to x's shape (same element count)."""
        return self.op("Reshape", [g, self.shape_tensor(x)])

    def expand_like(self, g: str, x: str) -> str:
        return self.op("Expand", [g, self.shape_tensor(x)])

    def cast(self, x: str, to: int, frm: int | None = None) -> str:
        if frm is not None and frm == to:
            return x
        return self.op("Cast", [x], to=to)

    def unsqueeze(self, x: str, axes) -> str:
        return self.op("Unsqueeze", [x, self.ints(axes)])

    def squeeze(self, x: str, axes) -> str:
        return self.op("Squeeze", [x, self.ints(axes)])

    def transpose(self, x: str, perm) -> str:
        perm = list(perm)
        return x if perm == sorted(perm) else self.op("Transpose", [x], perm=perm)

    def reduce(self, op_type: str, x: str, axes, keepdims: int = 1) -> str:
        """ReduceSum/ReduceMean/... over static `axes`, axes as input or attribute by opset."""
        axes = list(axes)
        if not axes:
            return x
        as_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        if as_input:
            return self.op(op_type, [x, self.ints(axes)], keepdims=keepdims)
        return self.op(op_type, [x], axes=axes, keepdims=keepdims)

    def sum(self, terms: list[str]) -> str:
        return terms[0] if len(terms) == 1 else self.op("Sum", terms)

    def unbroadcast(self, g: str, x: str, src) -> str:
        """Sum g (shaped like `src`: a tensor name or a dims list) over the axes along which x
        was broadcast (numpy rules), so the result has x's shape. Static axes where shape
        inference decides them, else computed at run time from Shape(g) and Shape(x)."""
        sd = src if isinstance(src, list) else self.dims(src)
        xd = self.dims(x)
        if sd is not None and xd is not None:
            lead = len(sd) - len(xd)
            axes, unknown = list(range(lead)), False
            for i, d in enumerate(xd):
                s = sd[lead + i]
                if (d is not None and d == s) or (d == 1 and s == 1):
                    continue
                if d == 1:
                    axes.append(lead + i)
                elif isinstance(d, int) and isinstance(s, int) and s != 1:
                    continue  # equal at run time by the broadcast rules (d != 1)
                elif isinstance(d, int) and d != 1:
                    continue  # x's dim is not 1, so it was not broadcast
                else:
                    unknown = True
            if not unknown:
                if not axes:
                    return g
                r = self.reduce("ReduceSum", g, axes, keepdims=1)
                return self.squeeze(r, range(lead)) if lead else r
        # dynamic: axes where the (left-padded) shape of x differs from that of g
        sg, sx = self.shape(g), self.shape(x)
        if sd is not None and xd is not None:
            lead = len(sd) - len(xd)
            padded = self.op("Concat", [self.ints([1] * lead), sx], axis=0) if lead else sx
        else:
            n = self.op("Sub", [self.op("Size", [sg]), self.op("Size", [sx])])
            ones = self.op("ConstantOfShape", [self.op("Reshape", [n, self.ints([1])])],
                           value=numpy_helper.from_array(np.array([1], np.int64), "one"))
            padded = self.op("Concat", [ones, sx], axis=0)
        differ = self.op("Not", [self.op("Equal", [padded, sg])])
        axes = self.op("Reshape", [self.op("NonZero", [differ]), self.ints([-1])])
        r = self.op("ReduceSum", [g, axes], keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", [r, sx])


class _Rule:
    def __init__(self, fn, outputs):
        self.fn, self.outputs, self.doc = fn, outputs, (fn.__doc__ or "").strip()


def add_backward(model: onnx.ModelProto, loss: str, wrt: Sequence[str], *, seed: str | None = None,
                 prefix: str = "grad") -> dict[str, str]:
    """Append the nodes computing d(loss)/d(w) for every w in `wrt`; return {w: gradient name}.

    See the module docstring for the guarantees (and /work/notes/train_interface.md).
    A w that does not reach `loss` gets a zero gradient of its own shape and dtype."""
    from .rules import RULES, ZERO_GRAD

    opset = default_opset(model)
    if opset < MIN_OPSET:
        raise GraphmpError(f"add_backward: the model's opset is {opset}; gradients need opset >= "
                           f"{MIN_OPSET} (convert it with onnx.version_converter first)")
    info = tensor_info(model)
    graph = model.graph
    known = set(info) | {o for n in graph.node for o in n.output}
    for name in [loss, *wrt] + ([seed] if seed else []):
        if name not in known:
            raise GraphmpError(f"add_backward: tensor '{name}' is not in the graph (give a graph input, "
                               "initializer or node output)")
    for w in wrt:
        if info.get(w, (0,))[0] not in FLOAT_TYPES:
            raise GraphmpError(f"add_backward: '{w}' is not a floating-point tensor; only float "
                               "tensors have gradients")

    # forward: tensors that depend on some w through float values
    active = set(wrt)
    for node in graph.node:
        if node.op_type in ZERO_GRAD or not any(i in active for i in node.input if i):
            continue
        for o in node.output:
            if o and info.get(o, (TensorProto.FLOAT,))[0] in FLOAT_TYPES:
                active.add(o)
    # backward: active tensors that reach the loss
    useful = {loss}
    for node in reversed(graph.node):
        if any(o in useful for o in node.output):
            useful.update(i for i in node.input if i in active)

    em = Emitter(model, info, prefix, active=frozenset(active & useful))
    grads: dict[str, list[str]] = defaultdict(list)
    if loss in active:
        grads[loss].append(seed or em.op("ConstantOfShape", [em.shape(loss)],
                                         value=helper.make_tensor("one", em.dtype(loss), [1], [1])))
    for node in reversed(graph.node):
        outs = [em.sum(grads.pop(o)) if o in grads else None for o in node.output]
        for o, go in zip(node.output, outs):
            if go is not None and o in info:
                em.info.setdefault(go, info[o])  # a gradient has its tensor's dtype and shape
        if all(g is None for g in outs) or not any(em.needs(i) for i in node.input):
            continue
        rule = RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if rule is None:
            raise GraphmpError(
                f"node '{node.name}' (op {node.domain + '.' if node.domain else ''}{node.op_type}) lies "
                f"between the differentiated tensors and the loss and has no gradient rule. Supported "
                f"ops: {', '.join(sorted(RULES))}. Make it non-differentiable (e.g. feed it a constant) "
                "or add a rule in graphmp/train/rules.py.")
        if rule.outputs is not None:
            extra = [i for i, g in enumerate(outs) if g is not None and i not in rule.outputs]
            if extra:
                raise GraphmpError(f"node '{node.name}' ({node.op_type}): its output {extra[0]} is used "
                                   "on the way to the loss, but the gradient rule only supports outputs "
                                   f"{list(rule.outputs)}")
        in_grads = rule.fn(em, node, outs)
        for i, gi in zip(node.input, in_grads):
            if gi is not None and em.needs(i):
                grads[i].append(gi)

    result = {}
    for w in wrt:
        name = em.fresh(w)
        if grads.get(w):
            em.op("Identity", [em.sum(grads[w])], name=name)
        else:
            em.op("ConstantOfShape", [em.shape(w)], name=name,
                  value=helper.make_tensor("zero", em.dtype(w), [1], [0]))
        result[w] = name
    graph.node.extend(em.nodes)
    return result


# --- training-mode forward -------------------------------------------------------------

def training_forward(model: onnx.ModelProto, *, momentum: float | None = None) -> dict[str, str]:
    """Rewrite BatchNormalization and Dropout to their training form, in place.

    BatchNormalization(X, scale, B, mean, var) -> Y normalised with the batch statistics
    (mean and biased variance over N and the spatial axes, computed in the dtype of `scale`,
    i.e. FP32 for a graphmp FP16 model), plus new tensors
    running' = momentum*running + (1-momentum)*batch (unbiased variance for var, as PyTorch);
    momentum: the argument, else the node's attribute, else 0.9.
    Dropout -> training_mode=True with a mask output (its gradient uses the mask).
    Returns {running mean/var name: updated tensor name}."""
    opset = default_opset(model)
    if opset < MIN_OPSET:
        raise GraphmpError(f"training_forward: opset {opset} < {MIN_OPSET}; convert the model first")
    info = tensor_info(model)
    em = Emitter(model, info, "train")
    new_nodes, updates = [], {}
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            em.nodes = []
            updates.update(_bn_training(em, node, momentum))
            new_nodes.extend(em.nodes)
        elif node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            em.nodes = []
            ratio = node.input[1] if len(node.input) > 1 and node.input[1] else em.const(0.5, TensorProto.FLOAT)
            mask = node.output[1] if len(node.output) > 1 and node.output[1] else em.fresh("dropout_mask")
            em.nodes.append(helper.make_node("Dropout", [node.input[0], ratio, em.const(True, TensorProto.BOOL)],
                                             [node.output[0], mask], name=node.name,
                                             **{a.name: helper.get_attribute_value(a) for a in node.attribute}))
            new_nodes.extend(em.nodes)
        else:
            new_nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return updates


def _bn_training(em: Emitter, node, momentum) -> dict[str, str]:
    x, scale, bias, mean, var = node.input[:5]
    y = node.output[0]
    eps = attr(node, "epsilon", 1e-5)
    mom = momentum if momentum is not None else attr(node, "momentum", 0.9)
    rank = em.rank(x)
    axes = [0] + list(range(2, rank))
    pdt, xdt = em.dtype(scale), em.dtype(x)
    xf = em.cast(x, pdt, xdt)
    bmean = em.reduce("ReduceMean", xf, axes, keepdims=1)
    centred = em.op("Sub", [xf, bmean])
    bvar = em.reduce("ReduceMean", em.op("Mul", [centred, centred]), axes, keepdims=1)
    inv = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [bvar, em.const(eps, pdt)])])])
    chan = [0] + list(range(2, rank))  # axes to unsqueeze a [C] vector to [1, C, 1, ...]
    s = em.unsqueeze(scale, chan)
    b = em.unsqueeze(bias, chan)
    yf = em.op("Add", [em.op("Mul", [em.op("Mul", [centred, inv]), s]), b])
    if pdt == xdt:
        em.op("Identity", [yf], name=y)
    else:
        em.op("Cast", [yf], name=y, to=xdt)
    # running statistics: unbiased variance, n = elements per channel
    n = em.op("Cast", [em.op("Div", [em.op("Size", [x]), em.dim(x, 1)])], to=pdt)
    unbiased = em.op("Div", [em.op("Mul", [em.squeeze(bvar, chan), n]),
                             em.op("Sub", [n, em.const(1.0, pdt)])])
    out = {}
    for run, batch in ((mean, em.squeeze(bmean, chan)), (var, unbiased)):
        rdt = em.dtype(run)
        upd = em.op("Add", [em.op("Mul", [run, em.const(mom, rdt)]),
                            em.op("Mul", [em.cast(batch, rdt, pdt), em.const(1.0 - mom, rdt)])])
        out[run] = upd
    # a BN exported in training form (opset 14+) may already name its updated statistics
    for extra, run in zip(list(node.output[1:3]), (mean, var)):
        if extra:
            em.op("Identity", [out[run]], name=extra)
            out[run] = extra
    return out

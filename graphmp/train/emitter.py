"""The bottom layer of graphmp's autodiff: the node Emitter and the gradient-rule registry.

Nothing here imports the rules or autodiff.py, so the import order is one way:
`emitter` <- `rules/*` (each family registers its rules with `@rule`) <- `autodiff`.

- `Emitter`: emits new nodes with unique names and answers questions about existing
  tensors (dtype, static shape, constant value); its helpers (unbroadcast, reshape_like,
  reductions with axes as input or attribute by opset, dtype-matched constants) are what
  rules are written with.
- `rule(*ops, outputs=(0,), opset=None)`: decorator registering a rule in `RULES` (and its
  opset in `NEEDS_OPSET`); `zero_grad(*ops)` adds ops to `ZERO_GRAD`.
- `RULES`: {op_type: Rule}; `ZERO_GRAD`: ops whose float outputs carry no gradient;
  `NEEDS_OPSET`: ops whose rule emits ops newer than opset 13 (train-graph upgrades the
  model to the largest opset needed).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import GraphmpError
from ..ir import Names
from ..opset import default_opset
from . import shape_values


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
        # with the Reshape lengths onnx's data propagation leaves open (a head length computed
        # with Div): static shapes keep the gradients in their static forms
        inferred = shape_values.infer(model, data_prop=True)
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
        elif any(o and o not in info for o in n.output) and all(i in info for i in n.input if i):
            _infer_node(model, n, info)
    return info


def _infer_node(model: onnx.ModelProto, node, info: dict) -> None:
    """Types of one node's outputs by inference on a model of that node alone, added to info.

    onnx's whole-graph inference leaves the output of some function ops (GroupNormalization-21)
    untyped when it is not a graph output, and with it everything downstream; alone, with the
    output declared as a graph output, the same node is inferred. Nodes are visited in graph
    order, so the types found here feed the next nodes' inference."""
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return
    ins = [helper.make_tensor_value_info(i, info[i][0], info[i][1]) for i in dict.fromkeys(node.input) if i]
    outs = [helper.make_value_info(o, onnx.TypeProto()) for o in node.output if o]
    one = helper.make_model(helper.make_graph([node], "one", ins, outs), opset_imports=model.opset_import,
                            ir_version=model.ir_version, functions=model.functions)
    try:
        got = onnx.shape_inference.infer_shapes(one, data_prop=True).graph.output
    except Exception:  # best effort, as above
        got = []
    for v in got:
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            info.setdefault(v.name, (v.type.tensor_type.elem_type, _dims(v.type)))
    # still untyped (onnx 1.23 does not infer GroupNormalization-21 at all): an output whose
    # schema type parameter is an input's has that input's element type (shape unknown)
    try:
        schema = onnx.defs.get_schema(node.op_type, default_opset(model), node.domain)
    except Exception:  # noqa: BLE001 - no schema (custom domain)
        return
    param_of = {}
    for i, formal in zip(node.input, schema.inputs):
        if i and i in info:
            param_of.setdefault(formal.type_str, info[i][0])
    for o, formal in zip(node.output, schema.outputs):
        if o and o not in info and formal.type_str in param_of:
            info[o] = (param_of[formal.type_str], None)


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
        self.names = Names(model, start=1)
        self._cache: dict = {}
        self._consts = {}
        for t in model.graph.initializer:
            self._consts[t.name] = t
        for n in model.graph.node:
            if n.op_type == "Constant" and attr(n, "value") is not None:
                self._consts[n.output[0]] = attr(n, "value")

    # --- names and nodes -------------------------------------------------------------
    def fresh(self, stem: str) -> str:
        return self.names.numbered(f"{self.prefix}/{stem}")

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
            raise GraphmpError(f"tensor '{x}': unknown rank (onnx shape inference loses it, e.g. after a "
                               "Reshape to a computed shape) and the gradient rule needs it; give the model's "
                               "dynamic input dims with --shapes NAME:DIMS (e.g. x:2x3x224x224) so train-graph "
                               "can measure it in one ONNX Runtime run")
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

    def reduce(self, op_type: str, x: str, axes, keepdims: int = 1, name: str | None = None) -> str:
        """ReduceSum/ReduceMean/... over static `axes`, axes as input or attribute by opset
        (output `name` when given)."""
        axes = list(axes)
        if not axes:
            return x
        as_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        if as_input:
            return self.op(op_type, [x, self.ints(axes)], keepdims=keepdims, name=name)
        return self.op(op_type, [x], axes=axes, keepdims=keepdims, name=name)

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


class Rule:
    """A registered gradient rule: fn(em, node, output_grads) -> one gradient (or None) per
    node input; `outputs`: the output indices whose gradient it handles (None: all)."""

    def __init__(self, fn, outputs):
        self.fn, self.outputs, self.doc = fn, outputs, (fn.__doc__ or "").strip()
        self.module = fn.__module__


#: {op_type: Rule} for the default ONNX domain, filled by the modules of graphmp.train.rules
RULES: dict[str, Rule] = {}

#: ops whose gradient rule emits ops of a newer opset than 13 (train-graph upgrades to it):
#: ScatterElements with reduction='add' (MaxPool, Gather, GatherElements, GatherND, Pad)
NEEDS_OPSET: dict[str, int] = {}

#: ops whose float outputs have zero derivative (or no derivative): never on a gradient path
ZERO_GRAD: set[str] = set()


def rule(*ops, outputs=(0,), opset: int | None = None):
    """Register fn as the gradient rule of `ops`; `outputs`: the outputs whose gradient it
    handles (None: all); `opset`: the opset the emitted gradient needs, when above 13."""
    def register(fn):
        for op in ops:
            if op in RULES or op in ZERO_GRAD:
                raise ValueError(f"gradient rule for {op} registered twice")
            RULES[op] = Rule(fn, outputs)
            if opset is not None:
                NEEDS_OPSET[op] = opset
        return fn
    return register


def zero_grad(*ops):
    """Declare `ops` as having zero (or no) derivative: they stop gradient paths."""
    for op in ops:
        if op in RULES:
            raise ValueError(f"{op} has a gradient rule and cannot be zero-grad")
        ZERO_GRAD.add(op)

"""pad.channels: pad Conv channels and GEMM dimensions to a multiple of N with zero weights.

What it guarantees (the model computes the same function, outputs bit-for-bit shaped
as before):
- Producers whose channel/feature count is not a multiple get zero rows: Conv and
  ConvTranspose output channels (weights and bias), Gemm and MatMul N (weight columns
  and bias). Their output is then "padded": a tensor with extra channels on one axis.
  So are producers that write their whole output anyway, where that reaches a weight
  layer's K: OneHot depth, embedding-table columns, a Concat's constant input
  (producers.py, which also explains each K left unaligned).
  A padded tensor is described by a Layout: its new name, the axis, its size and where
  the real channels sit (they need not be a prefix after a Concat or a Flatten).
- Padded channels flow through ops known to act per channel (elementwise, normalisation
  with zero scale, pooling, Concat, Transpose, Flatten with static inner dims, Cast, ...).
  The values there are finite (zero at the source; a per-channel op may make them
  0.5 or 1) but never read: every consumer either multiplies them by zero weights
  (Conv input channels, Gemm/MatMul K rows) or reads the original tensor.
- The original tensor name still exists wherever anything else reads it (graph outputs,
  Reshape, Softmax, reductions, subgraphs, any op not known to be channel-wise): a
  Slice (or a Gather, for scattered layouts) of the padded tensor produces it.
- A first Conv reading a graph input with 3 channels: the input is padded with one
  Pad node (to 4 channels with stride >= 2, else 8), which is what cuDNN's first-layer
  kernels want; `stem="off"` leaves it.
- Already aligned layers are left alone; every layer left unaligned is reported with
  the reason. Initializers shared with other readers are copied, never modified.
Works on FP32 and on converted mixed-precision graphs (weights keep their dtype).
Only the main graph is padded; subgraphs read the original names.

The work is split by job: layout.py (Layout, arithmetic, FLOPs), weights.py (the
Conv/ConvTranspose/Gemm/MatMul handlers), flow.py (per-channel ops), producers.py
(producers padded for free); this module holds the walk, the rewriting helpers, the
slicing back and the report.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...model_io import iter_graphs, tensor_array
from ...ir import Names
from ...policy import FLOAT_TYPES
from ...opset import default_opset
from .flow import BINARY_FILL, POOLS, UNARY, ChannelFlow
from .layout import Layout, model_flops, round_up, scatter
from .producers import ProducerPads
from .weights import WeightPads
from ...model_io import skeleton

__all__ = ["Layout", "Padder", "pad_channels", "round_up", "scatter"]


class Padder(WeightPads, ChannelFlow, ProducerPads):
    def __init__(self, model: onnx.ModelProto, base_dir: str | None, multiple: int, stem: str = "auto",
                 max_overhead: float = 0.5):
        self.model, self.g, self.base_dir = model, model.graph, base_dir
        self.m = multiple
        self.stem = stem
        self.max_overhead = max_overhead
        self.names = Names(model)
        self.opset = default_opset(model) or 13
        declared = {v.name for v in self.g.input}
        # an initializer that is also a graph input can be overridden by the caller: not a weight
        self.inits = {t.name: t for t in self.g.initializer if t.name not in declared}
        self.graph_inputs = declared - set(self.inits)
        self.layouts: dict[str, Layout] = {}
        self.producer: dict[str, onnx.NodeProto] = {o: n for n in self.g.node for o in n.output}
        self.readers: dict[str, list] = {}
        for g in iter_graphs(self.g):
            for n in g.node:
                for x in set(n.input):
                    self.readers.setdefault(x, []).append(n)
        self.output_names = {v.name for v in self.g.output}
        self.float_types, self.pools = FLOAT_TYPES, POOLS
        self.types: dict[str, int] = {}    # element types, where shape inference knows them
        self.shapes = self._shapes()
        self.flops_before = model_flops(model, self.shapes)
        self.padded, self.unaligned, self.sliced, self.stems = [], [], [], []
        self.new_nodes: dict[int, list] = {}       # index in graph.node -> nodes inserted before it
        self.replaced: set[str] = set()
        self.bypassed: set[str] = set()    # outputs of Transposes of weights now folded into copies
        self.reshaped: set[str] = set()    # tensors that keep their name but not their shape
        self.copies: dict = {}             # (weight, axis, size, positions, fill) -> its padded copy
        self.slice_nodes = 0

    # ---- facts about tensors ------------------------------------------------------
    def _shapes(self) -> dict:
        try:
            inf = onnx.shape_inference.infer_shapes(skeleton(self.model), strict_mode=False)
        except Exception:
            inf = self.model
        out = {}
        for v in list(inf.graph.value_info) + list(inf.graph.input) + list(inf.graph.output):
            tt = v.type.tensor_type
            if tt.elem_type:
                self.types[v.name] = tt.elem_type
            if tt.HasField("shape"):
                out[v.name] = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                               for d in tt.shape.dim]
        for t in self.g.initializer:
            out[t.name] = list(t.dims)
            self.types[t.name] = t.data_type
        return out

    def rank(self, name):
        s = self.shapes.get(name)
        return None if s is None else len(s)

    def dim(self, name, axis):
        s = self.shapes.get(name)
        if s is None or not -len(s) <= axis < len(s):
            return None
        return s[axis]

    def array(self, name):
        return tensor_array(self.inits[name], self.base_dir)

    def attr(self, n, key, default=None):
        for a in n.attribute:
            if a.name == key:
                return helper.get_attribute_value(a)
        return default

    def const_value(self, name):
        """Values of an initializer (or a Constant node's output), else None."""
        if name in self.inits:
            return self.array(name)
        p = self.producer.get(name)
        if p is not None and p.op_type == "Constant" and p.attribute and p.attribute[0].name == "value":
            return numpy_helper.to_array(p.attribute[0].t)
        if p is not None and p.op_type == "Transpose" and p.input[0] in self.inits:  # a tied LM head
            return np.transpose(self.array(p.input[0]), self.attr(p, "perm"))
        if p is not None and p.op_type == "Reshape" and p.input[0] in self.inits:
            a, shape = self.array(p.input[0]), self.const_value(p.input[1])
            if shape is None:
                return None
            shape = shape.astype(np.int64).tolist()
            if not self.attr(p, "allowzero", 0):  # a bias reshaped to [1, C, 1, 1] (Paddle, TF exports)
                shape = [a.shape[i] if d == 0 else d for i, d in enumerate(shape)]
            return a.reshape(shape)
        if p is not None and p.op_type == "Concat" and all(x in self.inits for x in p.input):
            return np.concatenate([self.array(x) for x in p.input], axis=self.attr(p, "axis"))
        return None

    # ---- rewriting helpers --------------------------------------------------------
    def new_init(self, base: str, arr: np.ndarray, old: str | None = None) -> str:
        name = self.names.fresh(base)
        t = numpy_helper.from_array(np.ascontiguousarray(arr).reshape(np.shape(arr)), name)  # keeps scalars 0-d
        if old is not None and old in self.inits and self.inits[old].data_type == TensorProto.BFLOAT16:
            t.data_type = TensorProto.BFLOAT16
        self.g.initializer.append(t)
        self.inits[name] = t
        self.shapes[name] = list(arr.shape)
        if old is not None:
            self.replaced.add(old)
        return name

    def repad(self, n, i, axis, size, real, fill=0.0):
        """Replace constant input i of node n by its copy scattered along `axis`."""
        old = n.input[i]
        if old not in self.inits:  # a Transpose/Reshape of a weight: folded into the copy
            self.bypassed.add(old)
            p = self.producer.get(old)
            for x in (p.input if p is not None else []):
                if x in self.inits and (p.op_type == "Concat" or x == p.input[0]):
                    self.replaced.add(x)  # dropped at the end if nothing else reads it
        key = (old, axis, size, np.asarray(real).tobytes(), fill)
        if key not in self.copies:  # a weight shared by several layers is padded once
            self.copies[key] = self.new_init(f"{old}.pad{size}",
                                             scatter(self.const_value(old), axis, size, real, fill),
                                             old if old in self.inits else None)
        n.input[i] = self.copies[key]

    def too_costly(self, n, what, old, new) -> bool:
        if (new - old) / old > self.max_overhead:
            self.leave(n, what, old, f"padding {old} -> {new} would add {100 * (new - old) / old:.0f}% to this "
                       f"layer (limit: max_overhead {self.max_overhead:g})")
            return True
        return False

    def pad_output(self, n, i, axis, size, real):
        old = n.output[i]
        new = self.names.fresh(f"{old}.padded")
        n.output[i] = new
        self.layouts[old] = Layout(new, axis, size, np.asarray(real, dtype=np.int64))
        self.shapes[new] = None

    def use(self, n, i):
        n.input[i] = self.layouts[n.input[i]].name

    def layout(self, name):
        return self.layouts.get(name)

    def record(self, n, what, old, new, flops_before, flops_after):
        self.padded.append({"node": n.name, "op_type": n.op_type, "dim": what, "old": int(old), "new": int(new),
                            "flops_before": int(flops_before), "flops_after": int(flops_after)})

    def leave(self, n, what, value, reason, **extra):
        self.unaligned.append({"node": n.name, "op_type": n.op_type, "dim": what, "value": value, "reason": reason,
                               **extra})

    # ---- the walk -----------------------------------------------------------------
    def run(self):
        for idx, n in enumerate(list(self.g.node)):
            ins = [self.layout(x) if x else None for x in n.input]
            handler = getattr(self, f"on_{n.op_type}", None)
            if handler is None:
                if n.op_type in UNARY:
                    handler = self.on_unary
                elif n.op_type in BINARY_FILL:
                    handler = self.on_binary
                elif n.op_type in POOLS:
                    handler = self.on_pool
            if n.domain not in ("", "ai.onnx"):
                handler = None
            if handler is not None:
                handler(idx, n, ins)
            for x, lay in zip(n.input, ins):
                if lay is not None and x in self.layouts and x != lay.name:  # still reads the original
                    self.sliced.append({"tensor": x, "before": n.name, "op_type": n.op_type})
        self.finish()

    def finish(self):
        """Slice padded tensors back wherever the original name is still read."""
        still = set()
        for g in iter_graphs(self.g):
            for n in g.node:
                still.update(n.input)
        still |= {v.name for v in self.g.output}
        nodes = []
        after = {}
        for orig, lay in self.layouts.items():
            if orig in still:
                after.setdefault(lay.name, []).append(self.slice_node(orig, lay))
                self.slice_nodes += 1
        for idx, n in enumerate(self.g.node):
            nodes.extend(self.new_nodes.get(idx, []))
            nodes.append(n)
            for o in n.output:
                nodes.extend(after.get(o, []))
        reads = {i for g in iter_graphs(self.g) for m in list(g.node) + nodes for i in m.input}
        reads |= {v.name for v in self.g.output}
        nodes = [m for m in nodes if not (m.output[0] in self.bypassed and m.output[0] not in reads)]
        del self.g.node[:]
        self.g.node.extend(nodes)
        used = {i for g in iter_graphs(self.g) for n in g.node for i in n.input}
        used |= {v.name for v in self.g.output}  # a weight that is also a graph output stays as it was
        keep = [t for t in self.g.initializer if t.name not in self.replaced or t.name in used]
        del self.g.initializer[:]
        self.g.initializer.extend(keep)
        produced = {o for n in self.g.node for o in n.output}
        vi = [v for v in self.g.value_info if v.name in produced and v.name not in self.reshaped]
        del self.g.value_info[:]
        self.g.value_info.extend(vi)

    def slice_node(self, orig, lay: Layout):
        n = len(lay.real)
        r = self.rank(orig)
        axis = lay.axis + r if r is not None and self.opset < 11 else lay.axis
        if lay.is_prefix and self.opset >= 10:
            ins = [lay.name] + [self.new_init(f"{orig}.slice_{k}", np.array([v], np.int64))
                                for k, v in (("starts", 0), ("ends", n), ("axes", axis))]
            return helper.make_node("Slice", ins, [orig], name=self.names.fresh(f"{orig}.unpad"))
        idx = self.new_init(f"{orig}.channels", lay.real.astype(np.int64))
        return helper.make_node("Gather", [lay.name, idx], [orig], axis=axis, name=self.names.fresh(f"{orig}.unpad"))

    def report(self) -> dict:
        fb = sum(p["flops_before"] for p in self.padded)
        fa = sum(p["flops_after"] for p in self.padded)
        return {"multiple": self.m, "padded": self.padded, "stem": self.stems, "unaligned": self.unaligned,
                "sliced_back": self.sliced, "slice_nodes": self.slice_nodes, "padded_tensors": len(self.layouts),
                "flops_padded_layers_before": fb, "flops_padded_layers_after": fa}


def pad_channels(model: onnx.ModelProto, base_dir: str | None, multiple: int, stem: str = "auto",
                 max_overhead: float = 0.5) -> dict:
    """Pad `model` (in place; main graph) and return the report (see the module docstring).
    A layer is padded only where that adds at most `max_overhead` (0.5 = 50%) to its size."""
    p = Padder(model, base_dir, multiple, stem, max_overhead)
    p.run()
    rep = p.report()
    rep["flops_model_before"] = p.flops_before
    return rep

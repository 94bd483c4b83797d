"""pad_channels: pad Conv channels and GEMM dimensions to a multiple of N with zero weights.

What it guarantees (the model computes the same function, outputs bit-for-bit shaped
as before):
- Producers whose channel/feature count is not a multiple get zero rows: Conv and
  ConvTranspose output channels (weights and bias), Gemm and MatMul N (weight columns
  and bias). Their output is then "padded": a tensor with extra channels on one axis.
  So are producers that write their whole output anyway, where that reaches a weight
  layer's K: OneHot depth, embedding-table columns, a Concat's constant input
  (pad_producers.py, which also explains each K left unaligned).
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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..io import iter_graphs, tensor_array
from ..ir import Names
from ..ops import FLOAT_TYPES
from ..opset import default_opset
from .pad_producers import ProducerPads
from .types import skeleton

UNARY = {"Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Elu", "Selu", "Celu",
         "Gelu", "Erf", "Softplus", "Softsign", "Clip", "Neg", "Abs", "Identity", "Cast", "Dropout",
         "ThresholdedRelu", "Sin", "Cos", "Floor", "Ceil", "Round", "Sign", "Mish"}
BINARY_FILL = {"Add": 0.0, "Sub": 0.0, "Mul": 0.0, "Max": 0.0, "Min": 0.0, "PRelu": 0.0, "Div": 1.0}
POOLS = {"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool", "GlobalLpPool"}


@dataclass
class Layout:
    name: str            # the padded tensor
    axis: int            # negative: counted from the last axis, so broadcasting keeps it
    size: int            # padded size of that axis
    real: np.ndarray     # positions of the original channels (int64, increasing)

    def same(self, o: "Layout") -> bool:
        return self.axis == o.axis and self.size == o.size and np.array_equal(self.real, o.real)

    @property
    def is_prefix(self) -> bool:
        return bool(np.array_equal(self.real, np.arange(len(self.real))))


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def scatter(arr: np.ndarray, axis: int, size: int, real: np.ndarray, fill: float = 0.0) -> np.ndarray:
    """`arr` placed at positions `real` of a new axis of length `size`, the rest `fill`."""
    moved = np.moveaxis(arr, axis, 0)
    out = np.full((size,) + moved.shape[1:], fill, dtype=arr.dtype)
    out[real] = moved
    return np.moveaxis(out, 0, axis)


def _flops(shape_out, per_output) -> int:
    return 2 * int(np.prod([d or 1 for d in shape_out], dtype=np.int64)) * int(per_output)


class Padder(ProducerPads):
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
        self.flops_before = _model_flops(model, self.shapes)
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

    # ---- producers and absorbers --------------------------------------------------
    def _stem_source(self, x) -> bool:
        while True:
            if x in self.graph_inputs:
                return True
            p = self.producer.get(x)
            if p is None or p.op_type != "Cast":
                return False
            x = p.input[0]

    def on_Conv(self, idx, n, ins):
        x, w = n.input[0], n.input[1]
        if w not in self.inits:
            return self.leave(n, "channels", None, "weights are not an initializer")
        wa = self.array(w)
        g = self.attr(n, "group", 1)
        m, cg = wa.shape[0], wa.shape[1]
        cin = cg * g
        r = wa.ndim
        kernel = int(np.prod(wa.shape[2:]))
        out_shape = self.shapes.get(n.output[0]) or [None] * r
        lay = ins[0]
        depthwise = g > 1 and cg == 1 and m == cin
        if lay is not None and lay.axis == 1 - r:
            cp = lay.size
            if g == 1:
                self.repad(n, 1, 1, cp, lay.real)
                self.use(n, 0)
                spatial = out_shape[:1] + out_shape[2:]
                self.record(n, "in_channels", cin, cp, _flops(spatial, m * cin * kernel), _flops(spatial, m * cp * kernel))
                cin = cp
            elif depthwise:
                self.repad(n, 1, 0, cp, lay.real)
                if len(n.input) > 2 and n.input[2]:
                    self.repad(n, 2, 0, cp, lay.real)
                self._set_attr(n, "group", cp)
                self.use(n, 0)
                self.pad_output(n, 0, 1 - r, cp, lay.real)
                spatial = out_shape[:1] + out_shape[2:]
                self.record(n, "channels (depthwise)", m, cp, _flops(spatial, m * kernel), _flops(spatial, cp * kernel))
                return
            else:
                return self.leave(n, "in_channels", cin, f"grouped conv (group={g}): padding would change "
                                  "which channels each group sees; its input is sliced back")
        elif cin % self.m and g == 1 and self._stem_source(x) and 3 <= cin < self.m:
            if self.stem == "off":
                self.leave(n, "in_channels", cin, "first-layer input channels (--stem off)")
            else:
                strides = self.attr(n, "strides", [1] * (r - 2))
                target = 4 if cin <= 4 and min(strides) >= 2 else round_up(cin, 8 if cin <= 8 else self.m)
                if target != cin:
                    self._stem_pad(idx, n, cin, target, r)
                    spatial = out_shape[:1] + out_shape[2:]
                    self.record(n, "in_channels (stem)", cin, target, _flops(spatial, m * cin * kernel),
                                _flops(spatial, m * target * kernel))
                    cin = target
        elif cin % self.m:
            if g > 1 and not depthwise:
                self.leave(n, "in_channels", cin, "grouped conv")
            elif not depthwise:
                why, copy = self.k_source(x)
                self.leave(n, "in_channels", cin, why.replace("K comes", "input channels come"), needs_copy=copy)
        if depthwise:
            return self.leave(n, "channels", m, "depthwise conv: follows its input's channels (input not "
                              "padded)") if m % self.m else None
        if g > 1:
            return self.leave(n, "out_channels", m, f"grouped conv (group={g}): padding would change the groups")
        self._pad_out_channels(n, 0, m, r, out_shape[:1] + out_shape[2:], cin * kernel)

    def _stem_pad(self, idx, n, cin, target, r):
        x = n.input[0]
        pads = [0] * (2 * r)
        pads[r + 1] = target - cin
        out = self.names.fresh(f"{x}.pad{target}")
        name = self.names.fresh(f"{n.name}.stem_pad")
        if self.opset >= 11:
            pin = self.new_init(f"{x}.pads", np.array(pads, np.int64))
            node = helper.make_node("Pad", [x, pin], [out], name=name)
        else:
            node = helper.make_node("Pad", [x], [out], name=name, pads=pads)
        self.new_nodes.setdefault(idx, []).append(node)
        self.repad(n, 1, 1, target, np.arange(cin))
        n.input[0] = out
        self.stems.append({"node": n.name, "input": x, "old": cin, "new": target,
                           "choice": f"one Pad node on '{x}' ({cin} -> {target} channels) and zero weight columns; "
                           + ("4 channels because the conv has stride >= 2" if target == 4 else
                              f"{target} channels (stride 1 or more than 4 channels)")})

    def _set_attr(self, n, key, value):
        for a in n.attribute:
            if a.name == key:
                n.attribute.remove(a)
                break
        n.attribute.append(helper.make_attribute(key, value))

    def on_ConvTranspose(self, idx, n, ins):
        w = n.input[1]
        if w not in self.inits:
            return self.leave(n, "channels", None, "weights are not an initializer")
        wa = self.array(w)
        g = self.attr(n, "group", 1)
        cin, mg = wa.shape[0], wa.shape[1]
        r = wa.ndim
        kernel = int(np.prod(wa.shape[2:]))
        in_shape = self.shapes.get(n.input[0]) or [None] * r
        spatial = in_shape[:1] + in_shape[2:]
        if g != 1:
            return self.leave(n, "channels", mg * g, f"grouped ConvTranspose (group={g})")
        lay = ins[0]
        if lay is not None and lay.axis == 1 - r:
            self.repad(n, 1, 0, lay.size, lay.real)
            self.use(n, 0)
            self.record(n, "in_channels", cin, lay.size, _flops(spatial, cin * mg * kernel), _flops(spatial, lay.size * mg * kernel))
            cin = lay.size
        elif cin % self.m:
            why, copy = self.k_source(n.input[0])
            self.leave(n, "in_channels", cin, why.replace("K comes", "input channels come"), needs_copy=copy)
        self._pad_out_channels(n, 1, mg, r, spatial, cin * kernel)

    def _pad_out_channels(self, n, w_axis, m, r, spatial, per_channel):
        """Conv/ConvTranspose (group 1): zero weight rows (axis w_axis) and bias up to the multiple."""
        mp = round_up(m, self.m)
        if m % self.m == 0 or self.too_costly(n, "out_channels", m, mp):
            return
        bias = n.input[2] if len(n.input) > 2 else ""
        if bias and bias not in self.inits:
            return self.leave(n, "out_channels", m, "bias is not an initializer")
        self.repad(n, 1, w_axis, mp, np.arange(m))
        if bias:
            self.repad(n, 2, 0, mp, np.arange(m))
        self.record(n, "out_channels", m, mp, _flops(spatial, m * per_channel), _flops(spatial, mp * per_channel))
        self.pad_output(n, 0, 1 - r, mp, np.arange(m))

    def _gemm_like(self, n, ins, k_axis_a, b_k_axis, b_n_axis, bias_index):
        """Shared by Gemm and MatMul: absorb a padded K, pad N. b_*_axis index the 2-D weight."""
        ba = self.const_value(n.input[1])
        k, nn = ba.shape[b_k_axis], ba.shape[b_n_axis]
        rows = int(np.prod([d or 1 for d in (self.shapes.get(n.output[0]) or [1])[:-1]], dtype=np.int64))
        lay = ins[0]
        kp = k
        if lay is not None and lay.axis == k_axis_a:
            kp = lay.size
            self.repad(n, 1, b_k_axis, kp, lay.real)
            self.use(n, 0)
            self.record(n, "K", k, kp, 2 * rows * k * nn, 2 * rows * kp * nn)
        elif k % self.m:
            why, copy = self.k_source(n.input[0])
            self.leave(n, "K", k, why, needs_copy=copy)
        if nn % self.m == 0 or self.too_costly(n, "N", nn, round_up(nn, self.m)):
            return
        np_ = round_up(nn, self.m)
        if bias_index is not None and len(n.input) > bias_index and n.input[bias_index]:
            c = n.input[bias_index]
            cs = self.shapes.get(c)
            if c not in self.inits:
                return self.leave(n, "N", nn, "bias C is not an initializer")
            if cs and len(cs) >= 1 and cs[-1] == nn:
                if len(cs) == 2 and cs[0] != 1:
                    return self.leave(n, "N", nn, "bias C is a full matrix")
                self.repad(n, bias_index, -1, np_, np.arange(nn))
        if not self._pad_tied(n, b_n_axis, np_, nn):
            self.repad(n, 1, b_n_axis, np_, np.arange(nn))
        self.record(n, "N", nn, np_, 2 * rows * kp * nn, 2 * rows * kp * np_)
        self.pad_output(n, 0, -1, np_, np.arange(nn))

    def _pad_tied(self, n, b_axis, size, count) -> bool:
        """B = Transpose(W), W also an embedding table read by Gather(axis 0) (a tied LM head):
        pad W's rows for every reader instead of storing a second, transposed copy. The
        lookups never index the new rows; the head gets zero columns. True if done."""
        p = self.producer.get(n.input[1])
        if p is None or p.op_type != "Transpose" or p.input[0] not in self.inits:
            return False
        w, t = p.input[0], p.output[0]
        if list(self.attr(p, "perm", [1, 0]))[b_axis] != 0 or t in {v.name for v in self.g.output}:
            return False
        nodes = [m for g in iter_graphs(self.g) for m in g.node]
        if [m.name for m in nodes if t in m.input] != [n.name]:
            return False
        readers = [m for m in nodes if w in m.input]
        if any(m.name != p.name and not (m.op_type == "Gather" and list(m.input) == [w, m.input[1]]
                                         and self.attr(m, "axis", 0) == 0) for m in readers):
            return False
        new = self.new_init(f"{w}.pad{size}", scatter(self.array(w), 0, size, np.arange(count)), w)
        for m in readers:
            m.input[list(m.input).index(w)] = new
        self.reshaped.add(t)
        return True

    def on_Gemm(self, idx, n, ins):
        if not self._is_weight(n.input[1]):
            return self.leave(n, "K,N", None, "B is not an initializer")
        ta, tb = self.attr(n, "transA", 0), self.attr(n, "transB", 0)
        self._gemm_like(n, ins, -2 if ta else -1, 1 if tb else 0, 0 if tb else 1, 2)

    def _is_weight(self, name) -> bool:
        return name in self.inits or (name in self.producer and self.const_value(name) is not None)

    def on_MatMul(self, idx, n, ins):
        b = n.input[1]
        if not self._is_weight(b) or len(self.shapes.get(b) or ()) != 2:
            return  # activation x activation (attention): nothing to pad here
        if self.rank(n.input[0]) is None:
            return self.leave(n, "K,N", None, "the input's rank is unknown (shape inference could not tell)")
        self._gemm_like(n, ins, -1, 0, 1, None)

    # ---- channel-wise ops ---------------------------------------------------------
    def on_unary(self, idx, n, ins):
        if ins[0] is None or any(o for o in n.output[1:]):
            return
        if n.op_type == "Cast" and self.attr(n, "to") not in FLOAT_TYPES:
            return
        lay = ins[0]
        self.use(n, 0)
        self.pad_output(n, 0, lay.axis, lay.size, lay.real)

    def on_binary(self, idx, n, ins):
        pads = [(i, lay) for i, lay in enumerate(ins[:2]) if lay is not None]
        if not pads or len(n.input) != 2:
            return
        lay = pads[0][1]
        if any(not lay.same(o) for _, o in pads):
            return
        out_rank = max(self.rank(x) or 0 for x in n.input)
        if out_rank < -lay.axis:
            return
        if n.op_type in ("Div", "PRelu") and ins[1] is not None:  # padded divisor / slope: not safe
            return
        fixes = []
        for i in range(2):
            if ins[i] is not None:
                continue
            other = n.input[i]
            r = self.rank(other)
            if r is None:
                return
            if r < -lay.axis:
                continue
            d = self.dim(other, lay.axis)
            if d == 1:
                continue
            if d == len(lay.real) and self.const_value(other) is not None:
                fixes.append(i)
                continue
            return  # a full-size unpadded activation: read the originals
        for i in fixes:
            self.repad(n, i, lay.axis, lay.size, lay.real, BINARY_FILL[n.op_type])
        for i, _ in pads:
            self.use(n, i)
        self.pad_output(n, 0, lay.axis, lay.size, lay.real)

    def _channel_axis(self, n, lay):
        r = self.rank(n.input[0])
        return r is not None and lay.axis == 1 - r

    def on_BatchNormalization(self, idx, n, ins):
        lay = ins[0]
        if lay is None or not self._channel_axis(n, lay) or any(o for o in n.output[1:]) \
                or self.attr(n, "training_mode", 0) or not all(x in self.inits for x in n.input[1:5]):
            return
        for i, fill in zip(range(1, 5), (0.0, 0.0, 0.0, 1.0)):
            self.repad(n, i, 0, lay.size, lay.real, fill)
        self.use(n, 0)
        self.pad_output(n, 0, lay.axis, lay.size, lay.real)

    def on_InstanceNormalization(self, idx, n, ins):
        lay = ins[0]
        if lay is None or not self._channel_axis(n, lay) or not all(x in self.inits for x in n.input[1:3]):
            return
        for i in (1, 2):
            self.repad(n, i, 0, lay.size, lay.real, 0.0)
        self.use(n, 0)
        self.pad_output(n, 0, lay.axis, lay.size, lay.real)

    def on_pool(self, idx, n, ins):
        lay = ins[0]
        if lay is None or not self._channel_axis(n, lay) or any(o for o in n.output[1:]):
            return
        self.use(n, 0)
        self.pad_output(n, 0, lay.axis, lay.size, lay.real)

    def on_Resize(self, idx, n, ins):
        lay = ins[0]
        if lay is None:
            return
        sizes = n.input[3] if len(n.input) > 3 else ""
        scales_name = n.input[2] if len(n.input) > 2 else (n.input[1] if n.op_type == "Upsample" else "")
        scales = self.const_value(scales_name) if scales_name else None
        if sizes or scales is None or scales.size == 0 or scales[lay.axis] != 1:
            return
        self.use(n, 0)
        self.pad_output(n, 0, lay.axis, lay.size, lay.real)

    on_Upsample = on_Resize

    def on_Pad(self, idx, n, ins):
        lay = ins[0]
        r = self.rank(n.input[0])
        if lay is None or r is None or (len(n.input) > 3 and n.input[3]):
            return
        pads = self.const_value(n.input[1]) if self.opset >= 11 else self.attr(n, "pads")
        if pads is None:
            return
        pads = list(np.asarray(pads).reshape(-1))
        a = lay.axis + r
        if pads[a] != 0 or pads[a + r] != 0:
            return
        self.use(n, 0)
        self.pad_output(n, 0, lay.axis, lay.size, lay.real)

    def on_Concat(self, idx, n, ins):
        r = self.rank(n.input[0])
        if r is None:
            return
        axis = self.attr(n, "axis") % r - r
        if all(lay is None or lay.axis == axis for lay in ins):
            parts = []
            for x, lay in zip(n.input, ins):
                if lay is not None:
                    parts.append((lay.size, lay.real))
                elif self.dim(x, axis):
                    parts.append((self.dim(x, axis), np.arange(self.dim(x, axis))))
                else:
                    return
            offset = sum(size for size, _ in parts)
            if offset % self.m:  # not aligned: a constant input may take zeros, else concatenate the originals
                self.pad_concat_constant(n, ins, axis, parts)
                return
            if all(lay is None for lay in ins):
                return
            real = [pos + sum(size for size, _ in parts[:i]) for i, (_, pos) in enumerate(parts)]
            for i, lay in enumerate(ins):
                if lay is not None:
                    self.use(n, i)
            return self.pad_output(n, 0, axis, offset, np.concatenate(real))
        first = ins[0]
        if all(lay is not None and lay.same(first) for lay in ins):
            for i in range(len(ins)):
                self.use(n, i)
            self.pad_output(n, 0, first.axis, first.size, first.real)

    def on_Transpose(self, idx, n, ins):
        lay, r = ins[0], self.rank(n.input[0])
        if lay is None or r is None:
            return
        perm = list(self.attr(n, "perm", list(range(r))[::-1]))
        self.use(n, 0)
        self.pad_output(n, 0, perm.index(lay.axis + r) - r, lay.size, lay.real)

    def on_Flatten(self, idx, n, ins):
        lay, shape = ins[0], self.shapes.get(n.input[0])
        if lay is None or shape is None:
            return
        r = len(shape)
        f = self.attr(n, "axis", 1) % (r or 1)
        p = lay.axis + r
        if p < f or any(d is None for d in shape[f:p] + shape[p + 1:]):
            return
        inner = int(np.prod(shape[p + 1:], dtype=np.int64))
        outer = int(np.prod(shape[f:p], dtype=np.int64))
        block = (lay.real[:, None] * inner + np.arange(inner)[None, :]).reshape(-1)
        real = (np.arange(outer)[:, None] * lay.size * inner + block[None, :]).reshape(-1)
        self.use(n, 0)
        self.pad_output(n, 0, -1, outer * lay.size * inner, real)

    def _axes(self, n):
        v = self.attr(n, "axes")
        if v is None and len(n.input) > 1 and n.input[1]:
            v = self.const_value(n.input[1])
        return None if v is None else [int(a) for a in np.asarray(v).reshape(-1)]

    def on_Squeeze(self, idx, n, ins):
        lay, r = ins[0], self.rank(n.input[0])
        axes = self._axes(n)
        if lay is None or r is None or axes is None:
            return
        axes = [a % r for a in axes]
        p = lay.axis + r
        if p in axes:
            return
        self.use(n, 0)
        self.pad_output(n, 0, p - sum(a < p for a in axes) - (r - len(axes)), lay.size, lay.real)

    def on_Unsqueeze(self, idx, n, ins):
        lay, r = ins[0], self.rank(n.input[0])
        axes = self._axes(n)
        if lay is None or r is None or axes is None:
            return
        ro = r + len(axes)
        kept = [i for i in range(ro) if i not in {a % ro for a in axes}]
        self.use(n, 0)
        self.pad_output(n, 0, kept[lay.axis + r] - ro, lay.size, lay.real)

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


def _model_flops(model, shapes) -> int:
    """FLOPs of the Conv/ConvTranspose/Gemm/MatMul layers before padding (symbolic dims = 1)."""
    total = 0
    inits = {t.name: list(t.dims) for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and len(n.input) > 1:
            w = inits.get(n.input[1]) or shapes.get(n.input[1])
            out = shapes.get(n.output[0])
            if not w or not out or None in w:
                continue
            if n.op_type in ("Conv", "ConvTranspose"):
                src = shapes.get(n.input[0]) if n.op_type == "ConvTranspose" else out
                if not src:
                    continue
                total += _flops(src[:1] + src[2:], int(np.prod(w, dtype=np.int64)))
            else:
                total += _flops(out[:-1], int(np.prod(w, dtype=np.int64)))
    return total

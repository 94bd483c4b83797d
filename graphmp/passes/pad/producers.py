"""pad.producers: pad activations at producers where padding costs nothing (used by channels.py).

A GEMM's K (or a Conv's input channels) can only be padded when the activation feeding
it arrives padded. Conv/Gemm/MatMul outputs are padded by channels.py itself; this mixin
adds the producers whose padded columns come for free, because the producer writes its
whole output anyway:
- OneHot: `depth` raised to the multiple. The new columns hold off_value (finite) and
  meet zero weight rows. Negative indices count from the end of `depth`, so for signed
  or float indices three small integer ops on the indices (Less, Sub, Where: 1/depth of
  the one-hot's size) shift them by the added depth and keep every index on its column.
- Gather (axis 0) from a constant embedding table: the table gets zero columns. Only
  when every reader of the table is such a Gather (so the table is replaced, not copied).
- Concat with a constant input on the concatenated axis: that constant gets zero
  entries so the total is a multiple (the Concat copies its inputs anyway).
Each is done only when the padded tensor reaches a Conv/Gemm/MatMul weight layer
through per-channel ops and is read by nothing else (`feeds_weight_layers`): a Slice
back to the original would be a copy per run. GEMMs/convs whose K is still unaligned
because their producer cannot be padded for free are reported with `needs_copy: True`
(padding them would need a runtime Pad node) and the producer's name.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

UNSIGNED = {TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64, TensorProto.BOOL}
INTS = {TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64}
PASS_UNARY = {"Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Elu", "Selu", "Celu", "Gelu",
              "Erf", "Softplus", "Softsign", "Clip", "Neg", "Abs", "Identity", "Cast", "Dropout", "Mish"}
PASS_BINARY = {"Add", "Sub", "Mul", "Max", "Min"}


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class ProducerPads:
    """Mixin for channels.Padder (uses its attr/const_value/repad/pad_output/leave)."""

    # ---- is padding here free? -----------------------------------------------------
    def feeds_weight_layers(self, name: str, axis: int, depth: int = 0) -> bool:
        """True if every reader of `name`, padded on `axis` (negative), following per-channel
        ops, is a Conv/Gemm/MatMul that reads it as the activation of a constant weight with
        that axis as its K / input channels, and at least one such layer exists.
        Conservative: a False only means "not padded here"."""
        if depth > 8 or name in self.output_names:
            return False
        readers = self.readers.get(name, [])
        if not readers:
            return False
        for n in readers:
            if n.domain not in ("", "ai.onnx") or list(n.input).count(name) != 1:
                return False
            i = list(n.input).index(name)
            if n.op_type == "MatMul" and i == 0:
                b = n.input[1]
                if axis != -1 or not self._is_weight(b) or len(self.shapes.get(b) or ()) != 2 \
                        or self.rank(name) is None:
                    return False
            elif n.op_type == "Gemm" and i == 0:
                if axis != -1 or self.attr(n, "transA", 0) or not self._is_weight(n.input[1]):
                    return False
            elif n.op_type == "Conv" and i == 0:
                r = self.rank(name)
                if r is None or axis != 1 - r or self.attr(n, "group", 1) != 1 or n.input[1] not in self.inits:
                    return False
            elif n.op_type in PASS_UNARY and i == 0:
                if n.op_type == "Cast" and self.attr(n, "to") not in self.float_types:
                    return False
                if any(o for o in n.output[1:]) or not self.feeds_weight_layers(n.output[0], axis, depth + 1):
                    return False
            elif n.op_type in ("Transpose", "Flatten") and i == 0:
                r = self.rank(name)
                if r is None or not self.feeds_weight_layers(n.output[0], self._moved_axis(n, name, axis, r), depth + 1):
                    return False
            elif n.op_type in PASS_BINARY and len(n.input) == 2:
                other = n.input[1 - i]
                if self.const_value(other) is None or not self.feeds_weight_layers(n.output[0], axis, depth + 1):
                    return False
            else:
                return False
        return True

    def _moved_axis(self, n, name, axis, r):
        """Where the padded `axis` of `name` lands in Transpose/Flatten `n`'s output (as
        Padder.on_Transpose/on_Flatten place it), or 0 (no axis: not followed)."""
        if n.op_type == "Transpose":
            return list(self.attr(n, "perm", list(range(r))[::-1])).index(axis + r) - r
        shape, f = self.shapes.get(name), self.attr(n, "axis", 1) % (r or 1)
        p = axis + r
        if p < f or any(d is None for d in shape[f:p] + shape[p + 1:]):
            return 0
        return -1

    # ---- producers -----------------------------------------------------------------
    def on_OneHot(self, idx, n, ins):
        depth_v = self.const_value(n.input[1])
        if depth_v is None or depth_v.size != 1:
            return
        depth = int(np.asarray(depth_v).reshape(-1)[0])
        r = self.rank(n.input[0])
        if depth <= 0 or depth % self.m == 0 or r is None:
            return
        new = _round_up(depth, self.m)
        axis = self.attr(n, "axis", -1) % (r + 1) - (r + 1)
        if not self.feeds_weight_layers(n.output[0], axis) or self.too_costly(n, "depth", depth, new):
            return
        dt = self.types.get(n.input[0])
        if dt is None:
            return self.leave(n, "depth", depth, "the indices' type is unknown (shape inference could not tell)")
        if not self._nonnegative(n.input[0]):
            self._shift_negative_indices(idx, n, dt, new - depth)
        self.repad_value(n, 1, np.asarray(new, dtype=np.asarray(depth_v).dtype).reshape(np.shape(depth_v)))
        self.record(n, "depth", depth, new, 0, 0)
        self.pad_output(n, 0, axis, new, np.arange(depth))

    def _nonnegative(self, x) -> bool:
        """An unsigned tensor, or a Cast of one to a float or wider signed int (bytes read as uint8)."""
        t = self.types.get(x)
        if t in UNSIGNED:
            return True
        p = self.producer.get(x)
        src = self.types.get(p.input[0]) if p is not None and p.op_type == "Cast" else None
        if src not in UNSIGNED or t is None:
            return False
        if t not in INTS:
            return t in self.float_types
        bits = lambda d: 1 if d == TensorProto.BOOL else np.iinfo(helper.tensor_dtype_to_np_dtype(d)).bits  # noqa: E731
        return bits(src) < bits(t)   # a same-width Cast may wrap to negative

    def _shift_negative_indices(self, idx, n, dt, shift):
        """indices < 0 -> indices - shift: with depth+shift they land on the same column
        (and below -depth they stay out of range, so the row stays all off)."""
        x = n.input[0]
        np_dt = helper.tensor_dtype_to_np_dtype(dt)
        zero = self.new_init(f"{x}.zero", np.zeros((), np_dt))
        k = self.new_init(f"{x}.depth_shift", np.asarray(shift, np_dt))
        neg, sub, out = (self.names.fresh(f"{x}.{s}") for s in ("negative", "shifted", "for_depth"))
        self.new_nodes.setdefault(idx, []).extend([
            helper.make_node("Less", [x, zero], [neg], name=self.names.fresh(f"{n.name}.is_negative")),
            helper.make_node("Sub", [x, k], [sub], name=self.names.fresh(f"{n.name}.shift")),
            helper.make_node("Where", [neg, sub, x], [out], name=self.names.fresh(f"{n.name}.indices"))])
        n.input[0] = out

    def repad_value(self, n, i, arr):
        """Replace constant input i of node n by a new initializer holding `arr`."""
        old = n.input[i]
        n.input[i] = self.new_init(f"{old}.padded", arr, old if old in self.inits else None)
        if old not in self.inits:
            self.bypassed.add(old)

    def on_Gather(self, idx, n, ins):
        table = n.input[0]
        shape = self.shapes.get(table)
        if self.attr(n, "axis", 0) != 0 or table not in self.inits or not shape or len(shape) != 2:
            return
        e = shape[1]
        if e % self.m == 0 or not self.feeds_weight_layers(n.output[0], -1):
            return
        new = _round_up(e, self.m)
        others = [m.name for m in self.readers.get(table, []) if not (m.op_type == "Gather" and m.input[0] == table
                                                                      and self.attr(m, "axis", 0) == 0)]
        if others:
            return self.leave(n, "embedding columns", e, f"the table '{table}' is also read by {others[0]} "
                              "(padding it would need a second copy)")
        if self.too_costly(n, "embedding columns", e, new):
            return
        self.repad(n, 0, 1, new, np.arange(e))
        self.record(n, "embedding columns", e, new, 0, 0)
        self.pad_output(n, 0, -1, new, np.arange(e))

    def pad_concat_constant(self, n, ins, axis, parts) -> bool:
        """parts: per input, its size on `axis` and its real positions. If one input is a
        constant (not padded), give it zero entries so the total is a multiple; pad the
        output. True if done."""
        total = sum(size for size, _ in parts)
        extra = _round_up(total, self.m) - total
        if not self.feeds_weight_layers(n.output[0], axis):
            return False
        for i, x in enumerate(n.input):
            v = self.const_value(x) if ins[i] is None else None
            if v is None or v.ndim < -axis:
                continue
            if self.too_costly(n, "concat axis", total, total + extra):
                return True  # reported; nothing changed
            d = parts[i][0]
            self.repad(n, i, axis, d + extra, np.arange(d))
            offset, real = 0, []
            for j, (size, pos) in enumerate(parts):
                real.append(offset + pos)
                offset += size + (extra if j == i else 0)
            for j, lay in enumerate(ins):
                if lay is not None:
                    self.use(n, j)
            self.record(n, "concat axis", total, total + extra, 0, 0)
            self.pad_output(n, 0, axis, total + extra, np.concatenate(real))
            return True
        return False

    # ---- what is left ----------------------------------------------------------------
    def k_source(self, x) -> tuple[str, bool]:
        """Why the activation `x` feeding a K dim (or input channels) is not padded:
        (reason, needs_copy). Walks back through per-channel ops to the producer that
        decided it: a weight layer left unpadded (its own entry says why; no copy would
        help) or an op whose output cannot be padded for free (a runtime Pad would)."""
        root, seen = x, 0
        while seen < 32:
            p = self.producer.get(root)
            if p is None or p.op_type not in PASS_UNARY | PASS_BINARY | {"BatchNormalization"} | self.pools:
                break
            data = [i for i in p.input[:2] if i and self.const_value(i) is None]
            if len(data) != 1:
                break
            root, seen = data[0], seen + 1
        p = self.producer.get(root)
        via = f" (through {self.producer[x].op_type} '{self.producer[x].name}')" if root != x else ""
        if p is None:
            what = "the graph input" if root in self.graph_inputs else "a value"
            return (f"K comes from {what} '{root}'{via}: padding it would need a runtime Pad node (a copy per run)",
                    True)
        if p.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and p.domain in ("", "ai.onnx"):
            return (f"K comes from {p.op_type} '{p.name}'{via}, whose output was left unpadded (see its entry)", False)
        return (f"K comes from {p.op_type} '{p.name}'{via}, whose output cannot be padded for free: padding it "
                "would need a runtime Pad node (a copy per run)", True)

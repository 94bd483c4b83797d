"""pad.flow: the ops padded channels flow through (a mixin for channels.Padder).

Each handler takes a node whose input arrives padded (a Layout) and, where the op is
known to act per channel on that axis, reads the padded tensor and marks its output
as padded with the Layout moved accordingly: elementwise unary ops, binary ops (a
constant other operand gets its channels scattered, filled with BINARY_FILL so the
padded channels stay finite), BatchNorm/InstanceNorm (zero scale), pooling, Resize with
scale 1 on that axis, Pad not touching it, Concat, Transpose, Flatten (static inner
dims), Squeeze/Unsqueeze. Where a handler returns without doing so, the node keeps
reading the original tensor, which channels.py slices back.
"""
from __future__ import annotations

import numpy as np

from ...policy import FLOAT_TYPES


UNARY = {"Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Elu", "Selu", "Celu",
         "Gelu", "Erf", "Softplus", "Softsign", "Clip", "Neg", "Abs", "Identity", "Cast", "Dropout",
         "ThresholdedRelu", "Sin", "Cos", "Floor", "Ceil", "Round", "Sign", "Mish"}
BINARY_FILL = {"Add": 0.0, "Sub": 0.0, "Mul": 0.0, "Max": 0.0, "Min": 0.0, "PRelu": 0.0, "Div": 1.0}
POOLS = {"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool", "GlobalLpPool"}


class ChannelFlow:
    """Mixin for channels.Padder: the handlers of per-channel ops (see the module docstring)."""

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

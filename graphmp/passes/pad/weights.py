"""pad.weights: the weight layers of channels.py (Conv, ConvTranspose, Gemm, MatMul).

A mixin for channels.Padder (uses its shapes/inits/attr/const_value/repad/pad_output/
record/leave and producers.py's k_source). For each layer it
- absorbs a padded input: zero weight columns / K rows where the activation arrives
  padded (a depthwise conv follows its input's channels instead);
- pads a first Conv's 3-channel graph input with one Pad node (the stem);
- pads the output channels / N with zero weight rows and bias, unless that costs more
  than max_overhead, and marks the output as padded (a Layout);
- reports every dimension it leaves unaligned, with the reason.
A tied LM head (B = Transpose(embedding table)) pads the table's rows once for all readers.
"""
from __future__ import annotations

import numpy as np
from onnx import helper

from ...model_io import iter_graphs
from .layout import flops, round_up, scatter


class WeightPads:
    """Mixin for channels.Padder: the on_Conv/on_ConvTranspose/on_Gemm/on_MatMul handlers."""


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
                self.record(n, "in_channels", cin, cp, flops(spatial, m * cin * kernel), flops(spatial, m * cp * kernel))
                cin = cp
            elif depthwise:
                self.repad(n, 1, 0, cp, lay.real)
                if len(n.input) > 2 and n.input[2]:
                    self.repad(n, 2, 0, cp, lay.real)
                self._set_attr(n, "group", cp)
                self.use(n, 0)
                self.pad_output(n, 0, 1 - r, cp, lay.real)
                spatial = out_shape[:1] + out_shape[2:]
                self.record(n, "channels (depthwise)", m, cp, flops(spatial, m * kernel), flops(spatial, cp * kernel))
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
                    self.record(n, "in_channels (stem)", cin, target, flops(spatial, m * cin * kernel),
                                flops(spatial, m * target * kernel))
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
            self.record(n, "in_channels", cin, lay.size, flops(spatial, cin * mg * kernel), flops(spatial, lay.size * mg * kernel))
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
        self.record(n, "out_channels", m, mp, flops(spatial, m * per_channel), flops(spatial, mp * per_channel))
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

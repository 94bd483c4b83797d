#!/usr/bin/env python
"""Synthetic FP32 models with the structure and size of real exports (random weights).

    python benchmarks/synth.py bert --layers 12 -o /tmp/bert_base.onnx     # 110 M params, ~440 MB
    python benchmarks/synth.py resnet50 -o /tmp/resnet50.onnx                # 25.6 M params, ~100 MB
    python benchmarks/synth.py gpt2 -o /tmp/gpt2.onnx                        # 124 M params, tied LM head
    python benchmarks/synth.py gpt2 --layers 36 --hidden 1280 -o /tmp/g.onnx # GPT-2-large size, external data

Used by benchmarks/convert_speed.py for the conversion speed / memory comparison and its
cost model (transformers of 2..48 layers): a converter's time depends on node count and
weight bytes, not on the weights' values, so random weights with the real layer layout
(what torch.onnx exports for HF BERT and torchvision ResNet-50) measure the same thing
without torch or a download. Activations stay in a realistic range (weights scaled by
1/sqrt(fan_in)), so calibration and the range checks see normal values.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _G:
    """A small graph builder: unique names, initializers from numpy, one node per call."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.n = [], [], 0

    def name(self, base):
        self.n += 1
        return f"{base}_{self.n}"

    def w(self, base, shape, scale=None):
        fan_in = shape[0] if len(shape) == 2 else int(np.prod(shape[1:]))
        scale = scale if scale is not None else 1.0 / np.sqrt(max(fan_in, 1))
        arr = (self.rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
        return self.const(base, arr)

    def const(self, base, arr):
        nm = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(arr), nm))
        return nm

    def op(self, op_type, inputs, n_out=1, **attrs):
        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(op_type), **attrs))
        return outs[0] if n_out == 1 else outs


def _layer_norm(g: _G, x, d):
    return g.op("LayerNormalization", [x, g.const("ln_g", np.ones(d, np.float32)),
                                       g.const("ln_b", np.zeros(d, np.float32))], axis=-1, epsilon=1e-12)


def _gelu(g: _G, x):
    # torch.onnx (TorchScript exporter) writes exact GELU as x * 0.5 * (1 + erf(x / sqrt(2)))
    e = g.op("Erf", [g.op("Div", [x, g.const("sqrt2", np.float32(np.sqrt(2.0)))])])
    return g.op("Mul", [g.op("Mul", [x, g.op("Add", [e, g.const("one", np.float32(1.0))])]),
                        g.const("half", np.float32(0.5))])


def bert(layers=12, hidden=768, heads=12, ffn=3072, vocab=30522, max_pos=512, seed=0, lm_head=False) -> onnx.ModelProto:
    """A BERT encoder as torch.onnx exports HF BertModel (opset 17): embeddings + LayerNorm,
    `layers` x (self-attention with an additive mask, residual + LayerNorm, GELU FFN,
    residual + LayerNorm), a tanh pooler. Inputs input_ids / attention_mask [batch, seq].
    lm_head: a GPT-2-style head instead of the pooler, logits = x @ word_embeddings^T (the
    embedding table is shared by the Gather and the head, as in tied exports). The mask
    stays bidirectional: the ops and sizes of GPT-2 are what a converter's cost depends on."""
    g = _G(seed)
    hd = hidden // heads
    ids, mask = "input_ids", "attention_mask"
    words = g.w("word_emb", [vocab, hidden], 0.02)
    pos = g.w("pos_emb", [max_pos, hidden], 0.02)
    shape = g.op("Shape", [ids])
    seq = g.op("Gather", [shape, g.const("i1", np.array(1, np.int64))], axis=0)
    pos_ids = g.op("Range", [g.const("z", np.array(0, np.int64)), seq, g.const("o", np.array(1, np.int64))])
    x = g.op("Add", [g.op("Gather", [words, ids], axis=0), g.op("Gather", [pos, pos_ids], axis=0)])
    x = _layer_norm(g, x, hidden)
    # additive mask: (1 - mask) * -10000, broadcast over heads and query positions
    m = g.op("Cast", [g.op("Unsqueeze", [mask, g.const("ax12", np.array([1, 2], np.int64))])], to=TensorProto.FLOAT)
    m = g.op("Mul", [g.op("Sub", [g.const("one", np.float32(1.0)), m]), g.const("neg", np.float32(-10000.0))])
    split_heads = g.const("shape_bshd", np.array([0, 0, heads, hd], np.int64))
    merge_heads = g.const("shape_bsh", np.array([0, 0, hidden], np.int64))
    scale = g.const("scale", np.float32(1.0 / np.sqrt(hd)))
    for _ in range(layers):
        def proj(inp, n_in, n_out):
            return g.op("Add", [g.op("MatMul", [inp, g.w("W", [n_in, n_out])]), g.w("b", [n_out], 0.02)])

        q, k, v = (g.op("Reshape", [proj(x, hidden, hidden), split_heads]) for _ in range(3))
        q = g.op("Transpose", [q], perm=[0, 2, 1, 3])
        k = g.op("Transpose", [k], perm=[0, 2, 3, 1])
        v = g.op("Transpose", [v], perm=[0, 2, 1, 3])
        s = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), scale]), m])
        a = g.op("MatMul", [g.op("Softmax", [s], axis=-1), v])
        a = g.op("Reshape", [g.op("Transpose", [a], perm=[0, 2, 1, 3]), merge_heads])
        x = _layer_norm(g, g.op("Add", [proj(a, hidden, hidden), x]), hidden)
        h = _gelu(g, proj(x, hidden, ffn))
        x = _layer_norm(g, g.op("Add", [proj(h, ffn, hidden), x]), hidden)
    g.nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"]))
    outputs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", hidden])]
    if lm_head:
        g.nodes.append(helper.make_node("MatMul", [x, g.op("Transpose", [words], perm=[1, 0])], ["logits"]))
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", vocab]))
    else:
        first = g.op("Gather", [x, g.const("i0", np.array(0, np.int64))], axis=1)
        pooled = g.op("Tanh", [g.op("Gemm", [first, g.w("pool_W", [hidden, hidden]), g.w("pool_b", [hidden], 0.02)])])
        g.nodes.append(helper.make_node("Identity", [pooled], ["pooler_output"]))
        outputs.append(helper.make_tensor_value_info("pooler_output", TensorProto.FLOAT, ["batch", hidden]))
    graph = helper.make_graph(
        g.nodes, f"{'decoder' if lm_head else 'bert'}_{layers}l",
        [helper.make_tensor_value_info(ids, TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info(mask, TensorProto.INT64, ["batch", "sequence"])],
        outputs, g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="graphmp-synth")


def resnet50(classes=1000, seed=0) -> onnx.ModelProto:
    """torchvision ResNet-50 as exported in eval mode with BatchNorm kept (opset 17):
    stem, 3-4-6-3 bottlenecks with projection shortcuts, global pool, Gemm classifier."""
    g = _G(seed)

    def conv_bn(x, cin, cout, k, stride=1, relu=True):
        y = g.op("Conv", [x, g.w("conv_W", [cout, cin, k, k])], kernel_shape=[k, k], strides=[stride, stride],
                 pads=[k // 2] * 4)
        bn = [g.const("bn_s", np.ones(cout, np.float32)), g.const("bn_b", np.zeros(cout, np.float32)),
              g.const("bn_m", (g.rng.standard_normal(cout) * 0.1).astype(np.float32)),
              g.const("bn_v", (1.0 + g.rng.random(cout)).astype(np.float32))]
        y = g.op("BatchNormalization", [y] + bn, epsilon=1e-5)
        return g.op("Relu", [y]) if relu else y

    x = conv_bn("input", 3, 64, 7, 2)
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, (blocks, width) in enumerate([(3, 64), (4, 128), (6, 256), (3, 512)]):
        for b in range(blocks):
            stride = 2 if b == 0 and stage > 0 else 1
            out = width * 4
            y = conv_bn(x, cin, width, 1)
            y = conv_bn(y, width, width, 3, stride)
            y = conv_bn(y, width, out, 1, relu=False)
            short = conv_bn(x, cin, out, 1, stride, relu=False) if b == 0 else x
            x = g.op("Relu", [g.op("Add", [y, short])])
            cin = out
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    g.nodes.append(helper.make_node("Gemm", [x, g.w("fc_W", [classes, cin]), g.w("fc_b", [classes], 0.02)],
                                    ["logits"], transB=1))
    graph = helper.make_graph(
        g.nodes, "resnet50",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])], g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="graphmp-synth")


def save(m: onnx.ModelProto, path: str) -> None:
    """onnx.save, with the weights in `<path>.data` when the model passes 2 GB."""
    big = sum(len(t.raw_data) for t in m.graph.initializer) > 1_900_000_000
    onnx.save(m, path, save_as_external_data=big, all_tensors_to_one_file=True,
              location=os.path.basename(path) + ".data" if big else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=["bert", "gpt2", "resnet50"])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--layers", type=int, default=12, help="encoder layers (bert)")
    ap.add_argument("--hidden", type=int, default=768, help="hidden size (bert)")
    a = ap.parse_args(argv)
    if a.kind == "resnet50":
        m = resnet50()
    else:
        m = bert(a.layers, a.hidden, heads=max(a.hidden // 64, 1), ffn=4 * a.hidden,
                 **(dict(vocab=50257, max_pos=1024, lm_head=True) if a.kind == "gpt2" else {}))
    save(m, a.output)
    print(f"{a.output}: {len(m.graph.node)} nodes, "
          f"{sum(int(np.prod(t.dims)) for t in m.graph.initializer) / 1e6:.1f} M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())

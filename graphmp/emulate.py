"""FP16 emulation at ONNX Runtime speed.

`emulation_model(mixed)` rewrites a mixed-precision model (FP16/BF16 tensors anywhere,
subgraphs included) as an all-FP32 graph in which every low-precision value is rounded
where it is produced: `y = Cast(Cast(y_fp32, to=FLOAT16), to=FLOAT)`. ONNX Runtime keeps
such explicit round trips (the Casts it inserts itself around FP16 ops on the CPU are
the ones it removes), so the emulated model shows FP16 rounding, overflow to inf and
underflow to zero, at the speed of an FP32 run. Its sessions run with graph
optimisations off: ORT_ENABLE_ALL's layout transforms (NCHWc convolutions) were seen to
drop some round trips, which made a PP-OCRv4 detector look 20% more accurate than it is;
unoptimised, an emulated run costs about what an optimised FP32 run does.

Semantics, "FP16 storage, FP32 math": each op reads the FP16-rounded values of its
inputs, computes in FP32 with ONNX Runtime's CPU kernel, and its FP16 outputs are rounded
once (FP16 inside an op never shows: no FP16 accumulation, no rounding between the steps
of a decomposed op such as HardSwish or LayerNormalization). That is what Tensor Cores do
for Conv/MatMul/Gemm (FP32 accumulation) and what most CUDA FP16 kernels do for
elementwise work, normalisations and reductions. Against an ideal kernel (the float64
result rounded once to FP16) it is within 1 FP16 ulp, except where FP32's own error is
larger than that: an FP32 sum that cancels (Gemm/Conv outputs near 0) and ONNX Runtime's
FP32 approximations of Sigmoid and Gelu near 0 (2 ulps of values below 2e-4); its RMS
error is within 1% of the ideal's. An op with FP32 outputs computes in FP32 as in the
source.
graphmp.model_runs.run_reference (`--oracle reference`) computes each op as the ideal kernel
itself (float64 math, one rounding: graphmp.reference_ops). tests/test_oracles.py holds
both to the ideal kernel op by op, and the two against each other on the committed
models (those onnx.reference runs in seconds).

Used where many evaluations are needed (the precision search) or where the reference
evaluator is too slow (large models).
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

from .model_io import CONVERT_MARK, attr_graphs, iter_graphs, load_model, tensor_array
from .ir import Names
from .weight_rounding import from_bf16_bits

LOW = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
FLOAT = TensorProto.FLOAT
# ops whose output type comes from an attribute: set it to FLOAT, round the output
_DTYPE_ATTR = {"RandomNormal": "dtype", "RandomUniform": "dtype", "RandomNormalLike": "dtype",
               "RandomUniformLike": "dtype", "EyeLike": "dtype", "Multinomial": None, "Bernoulli": "dtype"}


def _types(model) -> dict:
    """{graph key: {tensor: elem type}} for every graph, by onnx shape inference on a copy
    of the model without its large weights."""
    skel = onnx.ModelProto()
    skel.CopyFrom(model)
    for g in iter_graphs(skel.graph):
        for t in g.initializer:
            if t.data_location == TensorProto.EXTERNAL or len(t.raw_data) > 4096:
                dims, dt, name = list(t.dims), t.data_type, t.name
                t.Clear()
                t.name, t.data_type = name, dt
                t.dims.extend(dims)
                t.raw_data = b""
    try:
        skel = onnx.shape_inference.infer_shapes(skel, check_type=False, strict_mode=False)
    except Exception:  # noqa: BLE001 - fall back on the declared types only
        pass
    out: dict = {}

    def collect(g, key):
        types = {}
        for v in list(g.input) + list(g.output) + list(g.value_info):
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
                types[v.name] = v.type.tensor_type.elem_type
        types.update({t.name: t.data_type for t in g.initializer})
        for n in g.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                types[n.output[0]] = n.attribute[0].t.data_type
        out[key] = types
        for i, n in enumerate(g.node):
            for a in n.attribute:
                for j, sg in enumerate(attr_graphs(a)):
                    collect(sg, f"{key}/{i}.{a.name}{j or ''}")
    collect(skel.graph, "main")
    return out


class _Rewriter:
    def __init__(self, model, types, base_dir):
        self.names = Names(model)
        self.types = types
        self.base_dir = base_dir

    def round_node(self, x: str, y: str, low: int):
        """y = x rounded to `low` and back to FP32."""
        mid = self.names.fresh(f"{y}__emu_low")
        return [helper.make_node("Cast", [x], [mid], to=low, name=self.names.fresh("emu_cast_low")),
                helper.make_node("Cast", [mid], [y], to=FLOAT, name=self.names.fresh("emu_cast_up"))]

    def graph(self, g, key):
        types = self.types.get(key, {})
        nodes = []
        for t in g.initializer:
            if t.doc_string.startswith(CONVERT_MARK):
                # converted while the output is written (graphmp.save.save_model): round it in
                # the graph, so the FP32 bytes stay where they are (external or by reference)
                low = int(t.doc_string[len(CONVERT_MARK):])
                name, t.name = t.name, self.names.fresh(f"{t.name}__emu_fp32")
                t.ClearField("doc_string")
                nodes.extend(self.round_node(t.name, name, low))
            elif t.data_type in LOW:
                arr = tensor_array(t, self.base_dir)
                if t.data_type == TensorProto.BFLOAT16:
                    arr = from_bf16_bits(arr)
                t.CopyFrom(numpy_helper.from_array(arr.astype("float32"), t.name))
        for v in list(g.input) + list(g.output):
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type in LOW:
                v.type.tensor_type.elem_type = FLOAT
        del g.value_info[:]
        for i, n in enumerate(g.node):
            for a in n.attribute:
                for j, sg in enumerate(attr_graphs(a)):
                    self.graph(sg, f"{key}/{i}.{a.name}{j or ''}")
            nodes.extend(self.node(n, types))
        del g.node[:]
        g.node.extend(nodes)

    def node(self, n, types) -> list:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value" \
                and n.attribute[0].t.data_type in LOW:
            t = n.attribute[0].t
            arr = numpy_helper.to_array(t)
            if t.data_type == TensorProto.BFLOAT16:
                arr = from_bf16_bits(arr.view("uint16"))
            t.CopyFrom(numpy_helper.from_array(arr.astype("float32"), t.name))
            return [n]
        if n.op_type == "ConstantOfShape":
            for a in n.attribute:
                if a.name == "value" and a.t.data_type in LOW:
                    a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype("float32"), a.t.name))
        attr = _DTYPE_ATTR.get(n.op_type)
        for a in n.attribute:
            if attr and a.name == attr and a.i in LOW:
                a.i = FLOAT
        low_out = []
        if n.op_type == "Cast":
            to = next(a for a in n.attribute if a.name == "to")
            if to.i in LOW:
                low_out = [(0, to.i)]
        else:
            low_out = [(k, types[y]) for k, y in enumerate(n.output) if y and types.get(y) in LOW]
        if not low_out:
            return [n]
        extra = []
        for k, low in low_out:
            y = n.output[k]
            raw = self.names.fresh(f"{y}__emu_fp32")
            n.output[k] = raw
            if n.op_type == "Cast":  # the Cast to FP16 itself is the rounding
                n.attribute[0].i = low
                extra.append(helper.make_node("Cast", [raw], [y], to=FLOAT, name=self.names.fresh("emu_cast_up")))
            else:
                extra.extend(self.round_node(raw, y, low))
        return [n] + extra


def emulation_model(model: onnx.ModelProto, base_dir: str | None = None) -> onnx.ModelProto:
    """An all-FP32 copy of `model` whose FP16/BF16 values are rounded where produced (see
    the module docstring). Low-precision graph inputs become FP32 inputs (feed the same
    values); low-precision outputs come back as FP32 holding the rounded values."""
    types = _types(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _Rewriter(out, types, base_dir).graph(out.graph, "main")
    return out


def emulated_runner(model, base_dir: str | None = None):
    """feeds -> {output: array} for the emulation of `model` (a path or ModelProto) on ONNX
    Runtime CPU; FP16 feeds are passed as FP32 (their values are exact in FP32), and FP32
    feeds of an input the model declares FP16/BF16 (a KV cache of --cache-io fp16) are
    rounded to that type first, as the model's caller stores them."""
    from .model_runs import runner
    if not isinstance(model, onnx.ModelProto):
        import os
        base_dir = os.path.dirname(os.path.abspath(os.fspath(model)))
        model = load_model(os.fspath(model))  # checked, its small/attribute external tensors inline
    low_inputs = {v.name: v.type.tensor_type.elem_type for v in model.graph.input
                  if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type in LOW}
    run = runner(emulation_model(model, base_dir), base_dir=base_dir, optimize=False)

    def emulated(feeds: dict) -> dict:
        return run({k: _as_fed(v, low_inputs.get(k)) for k, v in feeds.items()})
    emulated.session = run.session
    return emulated


def _as_fed(value, low: int | None):
    """A feed as the emulation takes it: FP32, holding the value the converted model's input
    holds (FP32 data for a `low` input rounded to it)."""
    dtype = getattr(value, "dtype", None)
    if dtype == "float16":
        return value.astype("float32")
    if low is None or dtype != "float32":
        return value
    if low == TensorProto.BFLOAT16:
        from .weight_rounding import to_bf16_bits
        return from_bf16_bits(to_bf16_bits(value)).reshape(value.shape)
    return value.astype("float16").astype("float32")

"""fuse: ONNX Runtime's own transformer fusions (`graphmp convert --fuse ort`), run
before precisions are chosen.

Needs: ctx.model as loaded (the first pass), ctx.options.fuse / .model_type.
Guarantees: with --fuse ort, ctx.model is the graph ONNX Runtime's transformer optimizer
(`onnxruntime.transformers.optimizer.optimize_model`) makes of it: MatMul/Softmax/
LayerNorm/Gelu chains replaced by com.microsoft ops (SkipLayerNormalization, BiasGelu,
FastGelu, Attention, ...), every output of those ops typed in value_info (so the types
pass, apply and graphmp.emulate see their element types), the com.microsoft opset
imported. The report says which model type was used, why, and what was fused; a model
with no known fusion is left as it was, and the report and a warning say so. Without
--fuse nothing happens: the output stays standard ONNX (TensorRT's parser rejects
com.microsoft ops; fused models are for ONNX Runtime only).

The fusion code is ONNX Runtime's, not graphmp's: graphmp only picks the model type
(from the graph, or --model-type) and the head count and hidden size it can read from
the graph (0 lets ORT detect them). opt_level=0 (only the Python fusions): level 1 first
runs ORT's basic graph optimizer through an InferenceSession, which in onnxruntime 1.32
imports torch unconditionally, and on the tiny BERT/GPT-2/ViT exports found no fusion
that level 0 does not (measured). ORT's fusions need sympy (symbolic shape inference),
the `fuse` extra.
"""
from __future__ import annotations

import collections
import logging

import onnx
from onnx import TensorProto, numpy_helper

from .. import policy
from ..errors import GraphmpError
from ..model_io import is_external, iter_graphs, materialize
from . import PassResult

# op types a fusion creates (com.microsoft ones, and ONNX LayerNormalization from
# ReduceMean/Sub/Pow/Sqrt/Div chains)
FUSED_OPS = tuple(policy.MS_OP_CLASS) + ("LayerNormalization",)
NEEDS = "pip install 'graphmp[fuse]' (or: pip install sympy)"


def _nodes(model):
    for g in iter_graphs(model.graph):
        yield from g.node


def _producers(model) -> dict:
    return {o: n for n in model.graph.node for o in n.output if o}


def _from_range(name, prod, seen=None) -> bool:
    """Whether tensor `name` is computed from a Range (positions), through shape policy."""
    seen = seen if seen is not None else set()  # ids: a NodeProto is unhashable; prod keeps them alive
    n = prod.get(name)
    if n is None or id(n) in seen:
        return False
    seen.add(id(n))
    if n.op_type == "Range":
        return True
    if n.op_type not in ("Unsqueeze", "Reshape", "Squeeze", "Cast", "Add", "Sub", "Expand", "Slice", "Identity"):
        return False
    return any(_from_range(x, prod, seen) for x in n.input if x)


def detect_model_type(model) -> tuple:
    """(ORT model type or None, why). Causal decoder -> gpt2 (CLIP's text encoder when it
    outputs a pooled embedding), vision patch embedding -> vit, other encoders with
    attention or layer norms -> bert; None: nothing ORT fuses."""
    count = collections.Counter(n.op_type for n in _nodes(model))
    norm = count["LayerNormalization"] or count["SimplifiedLayerNormalization"] or \
        (count["ReduceMean"] and (count["Sqrt"] or count["Pow"]))
    attention = count["Softmax"] and count["MatMul"]
    if not (norm or attention):
        return None, "no attention (Softmax + MatMul) and no layer normalisation: no transformer fusion applies"
    names_in = {i.name for i in model.graph.input}
    if {"decoder_input_ids", "encoder_hidden_states", "encoder_outputs"} & names_in:
        return "t5", "encoder-decoder inputs (decoder_input_ids / encoder_hidden_states)"
    prod = _producers(model)
    causal = count["Trilu"] > 0 or any(
        n.op_type in ("Less", "LessOrEqual", "Greater", "GreaterOrEqual") and len(n.input) == 2
        and all(_from_range(x, prod) for x in n.input) for n in model.graph.node)
    if causal:
        outs = " ".join(o.name for o in model.graph.output)
        if "pooler" in outs or "text_embeds" in outs:
            return "clip", "causal attention mask with a pooled text output (CLIP text encoder)"
        return "gpt2", "causal attention mask (positions compared with positions): a decoder"
    inits = {t.name for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Conv" and n.input[0] in names_in and len(n.input) > 1 and n.input[1] in inits:
            a = {x.name: list(x.ints) for x in n.attribute}
            if a.get("strides") and a.get("strides") == a.get("kernel_shape"):
                return "vit", f"patch embedding (Conv '{n.name}' with stride = kernel) on an image input"
    return "bert", "encoder: attention / layer normalisation without a causal mask"


def _const(name, inits, prod):
    if name in inits:
        return numpy_helper.to_array(inits[name])
    n = prod.get(name)
    if n is not None and n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
        return numpy_helper.to_array(n.attribute[0].t)
    return None


def detect_dims(model) -> tuple:
    """(num_heads, hidden_size) read from the graph; 0 where not found (ORT then tries).
    Hidden: the most common LayerNormalization scale length. Heads: H of a Reshape to
    [.., .., H, D] with H*D = hidden, or hidden/D for [.., .., -1, D] (a constant shape,
    or a Concat whose last two pieces are constants)."""
    inits = {t.name: t for t in model.graph.initializer}
    prod = _producers(model)
    sizes = collections.Counter()
    for n in model.graph.node:
        if n.op_type in ("LayerNormalization", "SimplifiedLayerNormalization") and len(n.input) > 1:
            w = _const(n.input[1], inits, prod)
            if w is not None and w.ndim == 1:
                sizes[int(w.shape[0])] += 1
    if not sizes:
        return 0, 0
    hidden = sizes.most_common(1)[0][0]
    heads = collections.Counter()
    for n in model.graph.node:
        if n.op_type != "Reshape" or len(n.input) < 2:
            continue
        shape = _const(n.input[1], inits, prod)
        if shape is None and n.input[1] in prod and prod[n.input[1]].op_type == "Concat":
            pieces = [_const(x, inits, prod) for x in prod[n.input[1]].input]
            tail = [int(p.reshape(-1)[-1]) for p in pieces[-2:] if p is not None and p.size == 1]
            shape = tail if len(pieces) == 4 and len(tail) == 2 else None
        if shape is not None and len(shape) >= 2:
            h, d = int(shape[-2]), int(shape[-1])
            if h == -1 and 0 < d < hidden and hidden % d == 0:  # [B, S, -1, head_dim] (TorchScript)
                h = hidden // d
            if h > 0 and d > 0 and h * d == hidden and h < hidden:
                heads[h] += 1
    return (heads.most_common(1)[0][0] if heads else 0), hidden


def fused_counts(model) -> dict:
    """{op type: count} of the fused op types (FUSED_OPS) in the model's main graph."""
    c = collections.Counter(n.op_type for n in model.graph.node if n.op_type in FUSED_OPS)
    return dict(sorted(c.items()))


def _optimize(model, model_type, heads, hidden):
    try:
        import sympy  # noqa: F401  # pyflakes: ORT's fusions run its symbolic shape inference
    except ImportError:
        raise GraphmpError(f"--fuse ort needs sympy (ONNX Runtime's transformer optimizer uses it): {NEEDS}") from None
    from onnxruntime.transformers.optimizer import optimize_model
    if not heads:  # ORT takes both or neither (and then detects both itself)
        heads = hidden = 0
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    logging.disable(logging.WARNING)  # ORT's optimizer logs its guesses; graphmp reports what it did
    try:
        return optimize_model(copy, model_type=model_type, num_heads=heads, hidden_size=hidden, opt_level=0).model
    finally:
        logging.disable(logging.NOTSET)


def _try_optimize(model, model_type, heads, hidden) -> tuple:
    """(fused model, None) or (None, why ORT's fusion code failed)."""
    try:
        return _optimize(model, model_type, heads, hidden), None
    except GraphmpError:
        raise
    except Exception as e:  # noqa: BLE001 - ORT's fusion code failing is a finding, not a crash
        return None, f"ONNX Runtime's {model_type} fusions failed ({type(e).__name__}: {str(e)[:120]})"


def type_fused_outputs(model) -> int:
    """value_info with the element type of every output of a com.microsoft node that has
    none (from ORT's schema: T is the FP32 source's float, M/T1 their one int type)."""
    typed = {v.name for v in list(model.graph.value_info) + list(model.graph.output)}
    added = 0
    for n in model.graph.node:
        schema = policy.get_schema(n.op_type, n.domain, 1) if n.domain == policy.MS_DOMAIN else None
        if schema is None:
            continue
        _, outs = policy.bindings(schema, len(n.input), len(n.output))
        allowed = policy._constraints(schema)
        for y, ts in zip(n.output, outs):
            if not y or y in typed or ts is None:
                continue
            choices = allowed.get(ts, (ts,))
            elem = TensorProto.FLOAT if "tensor(float)" in choices else (
                policy.STR_TYPE.get(next(iter(choices))) if len(choices) == 1 else None)
            if elem:
                model.graph.value_info.append(onnx.helper.make_tensor_value_info(y, elem, None))
                typed.add(y)
                added += 1
    return added


def _materialize_external(ctx):
    """ORT's fusions read weights: bring external data (and the by-reference weights
    graphmp's loader leaves in the source file) into memory first."""
    for g in iter_graphs(ctx.model.graph):
        for t in g.initializer:
            if is_external(t):
                materialize(t, ctx.base_dir, None)


def run(ctx) -> PassResult | None:
    """The pass (see the module docstring); None without --fuse."""
    opt = ctx.options
    if opt.fuse is None:
        return None
    model = ctx.model
    why = "--model-type"
    model_type = opt.model_type
    if model_type is None:
        model_type, why = detect_model_type(model)
    before = fused_counts(model)
    details = {"fuser": opt.fuse, "model_type": model_type, "model_type_from": why}
    if model_type is None:
        ctx.warn(f"--fuse ort: no known fusion for this model ({why}); converted unfused")
        return PassResult(changed=False, details={**details, "fused": {}, "note": f"no known fusion: {why}"})
    _materialize_external(ctx)  # first: detect_dims reads weights with onnx's to_array, which reads no file
    heads, hidden = detect_dims(model)
    details.update(num_heads=heads, hidden_size=hidden)
    fused, failed = _try_optimize(model, model_type, heads, hidden)
    if failed and model_type != "bert":
        # bert's fusions (LayerNorm, SkipLayerNorm, Gelu, attention) apply to most transformers
        fused, failed2 = _try_optimize(model, "bert", heads, hidden)
        if not failed2:
            ctx.warn(f"--fuse ort: {failed}; used its bert fusions instead")
            details.update(model_type="bert", note=failed + "; used its bert fusions instead")
        failed = failed2
    if failed:
        ctx.warn(f"--fuse ort: {failed}; converted unfused")
        return PassResult(changed=False, details={**details, "fused": {}, "note": failed})
    after = fused_counts(fused)
    gained = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) > before.get(k, 0)}
    details.update(fused=gained, nodes_before=len(model.graph.node), nodes_after=len(fused.graph.node))
    if not gained:
        ctx.warn(f"--fuse ort: ONNX Runtime's {model_type} fusions found nothing to fuse; converted unfused")
        details["note"] = f"no known fusion: ONNX Runtime's {model_type} fusions matched nothing"
        return PassResult(changed=False, details=details)
    details["value_info_added"] = type_fused_outputs(fused)
    if not any(o.domain == policy.MS_DOMAIN for o in fused.opset_import):  # ORT adds it only when saving
        fused.opset_import.append(onnx.helper.make_opsetid(policy.MS_DOMAIN, 1))
    ctx.model = fused
    ctx.log(f"fused ({model_type}): " + ", ".join(f"{v} {k}" for k, v in gained.items()))
    return PassResult(changed=True, details=details)

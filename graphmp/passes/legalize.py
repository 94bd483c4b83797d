"""legalize: the experimental ops ONNX removed in opset 10, rewritten into the standard
ops that compute the same thing, before any other pass looks at the model.

Old exports (opset 1-9: onnxmltools/CoreML, CNTK, the model zoo's tiny-yolov2) use ops
ONNX only ever had as experiments. graphmp's op lists do not know them, so they stayed
FP32 "to be safe" behind Casts, shape inference stopped at them (Cast sizes needed an
extra run, FLOP shares were unknown), and onnx's version converter cannot carry them (an
opset < 7 model holding one could not be converted at all). As standard ops they follow
their neighbours' precision: style_mosaic's 7 Crops, ImageScaler and Affine, 25 -> 30
FP16 nodes; once the islands pass lets its InstanceNorms go FP16, its residual stream
follows them, and its Cast traffic at 720x720 goes 266 -> 40 MB. Each has an exact standard form (the ONNX 1.3 definitions, as ONNX Runtime's
kernels run them):
    Affine(alpha=1, beta=0)            y = alpha*x + beta                  Mul, Add
    Scale(scale=1)                     y = scale*x                         Mul
    ImageScaler(scale=1, bias[C])      y = scale*x + bias[c] (NCHW)        Mul, Add of bias as [1, C, 1, 1]
    Crop(border=[l, t, r, b])          y = x[:, :, t:H-b, l:W-r] (NCHW)    Slice-1
    Crop(border=[l, t, ..], scale=[h, w])  y = x[:, :, t:t+h, l:l+w]       Slice-1
    ScaledTanh(alpha, beta)            y = alpha*tanh(beta*x)              Mul, Tanh, Mul
    ParametricSoftplus(alpha, beta)    y = alpha*ln(exp(beta*x) + 1)       Mul, Softplus, Mul
A Mul by 1, an Add of 0 (or of no bias) and a Slice that cuts nothing are left out; with
nothing left, an Identity. ThresholdedRelu, experimental before opset 10 too, became a
standard op there and is left alone.

Needs: ctx.model as loaded (after fuse, before prepare, whose opset upgrade of an
opset < 7 model could not carry these ops).
Guarantees afterwards, in every graph (If/Loop/Scan bodies too) of a model whose default
opset is 1-9 (at 10 and above these names are no ONNX ops; nothing is done):
- no default-domain node of those six ops is left, except one the standard ops cannot
  express; that one stays as it was (so FP32, as before), and the report (legalize.kept:
  name, op_type, why) and a warning (not for --fp32-ops) name it: a Crop, or an ImageScaler with a bias, whose
  input is known not to be 4-D; a bias whose length is not the known channel count;
  malformed attributes; a ScaledTanh or ParametricSoftplus without alpha or beta (the spec
  gives no default; ONNX Runtime refuses those nodes too); an input type the ops do not take;
  an op that --fp32-ops names (kept FP32 in the form the user named, not as a Slice or Mul);
- each replacement writes the original output, so consumers and graph outputs are
  untouched; its last node keeps the original node's name; its constants are new
  initializers of the input's element type in the node's graph, uniquely named; below
  opset 7, Mul/Add take them in the legacy broadcast=1 form that prepare's upgrade converts;
- a model of IR < 4 that got initializers is raised to IR 4 (IR 3 wanted every
  initializer also listed as a graph input), as prepare does when it lifts constants;
- report: legalize.rewritten {op: count} (and .kept); nothing when there was nothing to do.
Nothing here changes what the model computes.
"""
from __future__ import annotations

import collections
import itertools
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..ir import Names
from ..model_io import iter_graphs, skeleton
from ..opset import default_opset
from . import PassResult

REMOVED_AT = 10         # the first opset without them
_INT64_MAX = 2 ** 63 - 1  # Slice-1's "to the end"
_NP = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64, TensorProto.FLOAT16: np.float16}


class _Op(NamedTuple):
    """One node of a replacement: op type, a constant second input (None: unary; named
    <node>.<tag>), attributes."""
    op_type: str
    const: object = None
    tag: str = ""
    attrs: dict = {}


def _float(attrs: dict, name: str, default):
    """The attribute as a float; `default` when absent; a str (why not) when it is no number."""
    v = attrs.get(name, default)
    if v is None or isinstance(v, (int, float)):
        return None if v is None else float(v)
    return f"attribute {name} is not a float"


def _mul(value, tag: str) -> list:
    return [] if value == 1.0 else [_Op("Mul", np.array(value), tag)]


def _affine(attrs, dims):
    alpha, beta = _float(attrs, "alpha", 1.0), _float(attrs, "beta", 0.0)
    bad = next((v for v in (alpha, beta) if isinstance(v, str)), None)
    return bad or _mul(alpha, "alpha") + ([_Op("Add", np.array(beta), "beta")] if beta != 0.0 else [])


def _scale(attrs, dims):
    scale = _float(attrs, "scale", 1.0)
    return scale if isinstance(scale, str) else _mul(scale, "scale")


def _around(unary: str):
    """alpha * unary(beta * x): ScaledTanh (Tanh), ParametricSoftplus (Softplus)."""
    def rewrite(attrs, dims):
        alpha, beta = _float(attrs, "alpha", None), _float(attrs, "beta", None)
        bad = next((v for v in (alpha, beta) if isinstance(v, str)), None)
        if bad or alpha is None or beta is None:
            return bad or "alpha and beta are both needed (the spec gives them no default)"
        return _mul(beta, "beta") + [_Op(unary)] + _mul(alpha, "alpha")
    return rewrite


def _image_scaler(attrs, dims):
    scale = _float(attrs, "scale", 1.0)
    if isinstance(scale, str):
        return scale
    bias = attrs.get("bias") or []
    if not isinstance(bias, list) or not all(isinstance(b, (int, float)) for b in bias):
        return "attribute bias is not a list of floats"
    if bias and dims is not None and len(dims) != 4:
        return f"its input is {len(dims)}-D; the per-channel bias needs NCHW"
    if bias and dims is not None and dims[1] not in (None, len(bias)):
        return f"{len(bias)} bias values for {dims[1]} channels"
    return _mul(scale, "scale") + ([_Op("Add", np.array(bias).reshape(1, -1, 1, 1), "bias")] if bias else [])


def _ints(attrs, name, length):
    v = attrs.get(name)
    ok = isinstance(v, list) and len(v) == length and all(isinstance(i, int) and i >= 0 for i in v)
    return v if ok else None


def _crop(attrs, dims):
    border, scale = _ints(attrs, "border", 4), _ints(attrs, "scale", 2)
    if border is None or ("scale" in attrs and scale is None):
        return (f"border {attrs.get('border')} and scale {attrs.get('scale')}: Crop takes border=[left, top, "
                "right, bottom] and optionally scale=[height, width], all >= 0")
    if dims is not None and len(dims) != 4:
        return f"its input is {len(dims)}-D; Crop crops NCHW"
    left, top, right, bottom = border
    if scale:
        spans = [(2, top, top + scale[0]), (3, left, left + scale[1])]
    else:  # Slice-1: a negative end counts from the back; the largest int64 is "to the end"
        spans = [(2, top, -bottom if bottom else _INT64_MAX), (3, left, -right if right else _INT64_MAX)]
    spans = [s for s in spans if s[1:] != (0, _INT64_MAX)]
    if not spans:
        return []
    return [_Op("Slice", attrs={"axes": [s[0] for s in spans], "starts": [s[1] for s in spans],
                                "ends": [s[2] for s in spans]})]


# op type -> rewrite(attributes, input dims or None) -> [_Op, ...] ([]: Identity) or why not (str)
_REWRITES = {"Affine": _affine, "Scale": _scale, "ImageScaler": _image_scaler, "Crop": _crop,
             "ScaledTanh": _around("Tanh"), "ParametricSoftplus": _around("Softplus")}
EXPERIMENTAL = tuple(sorted(_REWRITES))


def _is_experimental(n) -> bool:
    return n.op_type in _REWRITES and n.domain in ("", "ai.onnx")


def _value_infos(model) -> list:
    """{value: (element type, dims or None)} per graph of the model (iter_graphs order), from
    onnx's shape inference on a weightless copy in which each experimental op is an Identity
    (onnx has no schema for them, and inference would stop there): their ranks, element
    types and channels pass through (a Crop changes only H and W, which are not read).
    Empty dicts when inference fails: every input is then of unknown type and rank."""
    skel = skeleton(model)
    for g in iter_graphs(skel.graph):
        for n in g.node:
            if _is_experimental(n):
                n.op_type = "Identity"
                del n.attribute[:]
    graphs = list(iter_graphs(model.graph))
    try:
        inferred = onnx.shape_inference.infer_shapes(skel, check_type=False, strict_mode=False)
    except Exception:  # noqa: BLE001 - inference is a help here, not a requirement
        return [{} for _ in graphs]
    out = []
    for g in iter_graphs(inferred.graph):
        info = {t.name: (t.data_type, list(t.dims)) for t in g.initializer}
        for v in itertools.chain(g.input, g.value_info, g.output):
            if v.type.HasField("tensor_type"):
                tt = v.type.tensor_type
                dims = ([d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
                        if tt.HasField("shape") else None)
                info[v.name] = (tt.elem_type, dims)
        out.append(info)
    return out if len(out) == len(graphs) else [{} for _ in graphs]


class _Rewriter:
    """The rewrite of one model: fresh names, the legacy broadcast form below opset 7, and
    what was rewritten or kept."""

    def __init__(self, model, keep_ops):
        self.keep_ops = set(keep_ops)
        self.names = Names(model)
        self.legacy = default_opset(model) < 7
        self.rewritten = collections.Counter()
        self.kept = []
        self.initializers = 0

    def plan(self, n, info: dict):
        """[_Op, ...] for node n, or why it stays (str)."""
        if n.op_type in self.keep_ops:
            return f"--fp32-ops names {n.op_type}"
        if len(n.input) != 1 or not n.input[0] or len(n.output) != 1:
            return f"{len(n.input)} input(s) and {len(n.output)} output(s); the op has one of each"
        elem, dims = info.get(n.input[0], (0, None))
        if elem and elem not in _NP:
            return f"input of type {TensorProto.DataType.Name(elem)}; the op takes float16, float or double"
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        return _REWRITES[n.op_type](attrs, dims)

    def emit(self, g, n, ops: list, elem: int) -> list:
        """The nodes replacing n (its constants added to g): x -> ops[0] -> ... -> n's output."""
        x, base = n.input[0], n.name or n.output[0]
        ops = ops or [_Op("Identity")]
        nodes = []
        for i, op in enumerate(ops):
            last = i == len(ops) - 1
            inputs, attrs = [x], dict(op.attrs)
            if op.const is not None:
                value = np.asarray(op.const, _NP.get(elem, np.float32))
                if self.legacy:  # Mul-6/Add-6 broadcast only when told: B a scalar, or [C] from axis 1
                    attrs["broadcast"] = 1
                    if value.ndim == 4:
                        value, attrs["axis"] = value.reshape(-1), 1
                inputs.append(self.names.fresh(f"{base}.{op.tag}"))
                g.initializer.append(numpy_helper.from_array(value, inputs[-1]))
                self.initializers += 1
            x = n.output[0] if last else self.names.fresh(f"{base}.{op.op_type.lower()}")
            name = n.name if last and n.name else self.names.fresh(f"{base}/{op.op_type}")
            nodes.append(helper.make_node(op.op_type, inputs, [x], name=name, domain=n.domain, **attrs))
        return nodes

    def graph(self, g, info: dict):
        """Rewrite g's experimental nodes in place, each where it stood (the order stays sorted)."""
        i = 0
        while i < len(g.node):
            n = g.node[i]
            if not _is_experimental(n):
                i += 1
                continue
            ops = self.plan(n, info)
            if isinstance(ops, str):
                self.kept.append({"name": n.name, "op_type": n.op_type, "why": ops})
                i += 1
                continue
            new = self.emit(g, n, ops, info.get(n.input[0], (0, None))[0])
            self.rewritten[n.op_type] += 1
            del g.node[i]
            for k, m in enumerate(new):
                g.node.insert(i + k, m)
            i += len(new)


def legalize(model, keep_ops=()) -> tuple[dict, list]:
    """Rewrite `model` in place (see the module docstring); ops named in keep_ops stay.
    Returns ({op: count rewritten}, [{name, op_type, why} of the nodes kept as they were])."""
    if not 0 < default_opset(model) < REMOVED_AT:
        return {}, []
    graphs = list(iter_graphs(model.graph))
    if not any(_is_experimental(n) for g in graphs for n in g.node):
        return {}, []
    infos = _value_infos(model)
    outer = {}  # a subgraph may read its parents' values
    for info in infos:
        for k, v in info.items():
            outer.setdefault(k, v)
    r = _Rewriter(model, keep_ops)
    for g, info in reversed(list(zip(graphs, infos))):  # bodies before the graphs that hold them
        r.graph(g, collections.ChainMap(info, outer))
    if r.initializers and model.ir_version < 4:  # IR 3 would want each new initializer listed as an input
        model.ir_version = 4
    return dict(sorted(r.rewritten.items())), r.kept


def run(ctx) -> PassResult:
    """The pass on ctx.model (see the module docstring)."""
    fp32_ops = tuple(ctx.options.fp32_ops or ())
    rewritten, kept = legalize(ctx.model, fp32_ops)
    for k in kept:
        if k["op_type"] in fp32_ops:  # as asked
            continue
        ctx.warn(f"{k['op_type']} '{k['name']}' (an experimental op removed in opset {REMOVED_AT}) is left as it is: "
                 f"{k['why']}; it stays FP32")
    if rewritten:
        ctx.log("rewrote experimental ops into standard ONNX: " + ", ".join(f"{v} {k}" for k, v in rewritten.items()))
    details = {"rewritten": rewritten} if rewritten or kept else {}
    if kept:
        details["kept"] = kept
    return PassResult(changed=bool(rewritten), details=details)


def summary_line(d: dict) -> str:
    """The convert summary's line for report["legalize"]."""
    line = "  rewritten (experimental ops removed in opset 10 -> standard ONNX): " + (
        ", ".join(f"{v} {k}" for k, v in d["rewritten"].items()) or "none")
    return line + (f"; {len(d['kept'])} kept as they were (report: legalize.kept)" if d.get("kept") else "")

"""Accuracy budgets: how the error of a mixed model against its FP32 source is measured,
and how much of it is allowed (`--max-error auto[:K] | E | tf32 | floor[:K]`, `--metric`).

Metrics, per output, over every element of every batch:
  max-rel  max |a - b| / max |ref|   (scale-relative; the default)
  max-abs  max |a - b|
  argmax   1 - argmax agreement along the last axis, for class-score outputs ([N, C] or
           [N, T, V]); other outputs are not judged by it
A value that is finite in FP32 and not in the mixed model makes the error infinite.

Budgets:
  auto:K   the yardstick (the default of check, --validate and bench): per output,
           max(the metric's own tolerance (1e-2 for max-rel, 0 for max-abs and argmax),
           K x the TF32 error, K x the FP16-input floor), K = 2 by default: an FP16 model
           is judged against what the GPU's TF32 and the inputs' own FP16 rounding
           already cost, so a model whose input rounding alone exceeds 1e-2 can pass,
           and one that overflows or cancels in FP16 still fails;
  E        that error for every output;
  tf32     per output, the error of the FP32 model when Conv/MatMul/Gemm/Einsum inputs
           are rounded to TF32 (10-bit mantissa, the default of ORT CUDA, TensorRT and
           torch on Ampere and later): "no worse than what the GPU already does";
  floor:K  per output, K x (default 2) the error of the FP32 model when only its float
           inputs are rounded to FP16: the model's own FP16 noise floor.
The floor is measured either way and reported, so users see what is reachable. A
measured budget (auto, tf32, floor; not with --metric argmax) is never below one FP16 step
(2^-11): an output that input rounding does not move would otherwise allow no FP16
compute whatsoever.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import GraphmpError
from .model_io import attr_graphs, iter_graphs, skeleton
from .ir import Names

METRICS = ("max-rel", "max-abs", "argmax")
MIN_BUDGET = 2.0 ** -11
TF32_OPS = {"Conv": None, "ConvTranspose": None, "MatMul": None, "Gemm": (0, 1), "Einsum": None}


METRIC_FLOOR = {"max-rel": 1e-2, "max-abs": 0.0, "argmax": 0.0}  # auto's least budget per metric
DEFAULT = "auto"


def parse(spec) -> tuple[str, float]:
    """('abs', E) | ('tf32', 1.0) | ('floor', K) | ('auto', K) from --max-error's text (or a number)."""
    if isinstance(spec, (int, float)):
        kind, value = "abs", float(spec)
    else:
        text = str(spec).strip().lower()
        if text == "tf32":
            return "tf32", 1.0
        for name in ("floor", "auto"):
            if not text.startswith(name):
                continue
            k = text[len(name):]
            try:
                value = float(k[1:]) if k.startswith(":") else 2.0 if not k else float("nan")
            except ValueError:
                value = float("nan")
            if not value > 0:
                raise GraphmpError(f"--max-error '{spec}': write {name} or {name}:K with K > 0 (e.g. {name}:2)")
            return name, value
        try:
            kind, value = "abs", float(text)
        except ValueError:
            raise GraphmpError(f"--max-error '{spec}' is not a number, 'auto[:K]', 'tf32' or 'floor[:K]' "
                               "(e.g. --max-error 1e-2)") from None
    if not value > 0:
        raise GraphmpError(f"--max-error must be > 0, not {spec}")
    return kind, value


def as_tensor(value) -> np.ndarray:
    """An output as an array, ONNX Runtime's non-tensor outputs included: a sequence of maps
    (ZipMap: one {class: score} per sample, as scikit-learn exports return probabilities)
    becomes [samples, classes] in key order, a sequence of same-shaped tensors is stacked.
    (np.asarray makes an object array of them, compared for exact equality.)"""
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and value and all(isinstance(d, dict) for d in value):
        keys = sorted(value[0])
        if all(sorted(d) == keys for d in value):
            return np.array([[d[k] for k in keys] for d in value], dtype=np.float64)
    if isinstance(value, list) and value and all(isinstance(a, np.ndarray) for a in value) \
            and len({(a.shape, a.dtype) for a in value}) == 1:
        return np.stack(value)
    return np.asarray(value)


def output_error(ref: np.ndarray, got: np.ndarray, metric: str) -> float | None:
    """One output's error (see the module docstring); None: not judged by this metric."""
    ref, got = as_tensor(ref), as_tensor(got)
    if ref.dtype.kind not in "fc":
        return 0.0 if np.array_equal(ref, got) else float("inf")
    r, g = ref.astype(np.float64), got.astype(np.float64)
    if r.shape != g.shape:
        return float("inf")
    if np.any(np.isfinite(r) & ~np.isfinite(g)):
        return float("inf")
    if metric == "argmax":
        if r.ndim not in (2, 3) or r.shape[-1] < 2 or not r.size:
            return None
        return float(np.mean(np.argmax(r, axis=-1) != np.argmax(g, axis=-1)))
    ok = np.isfinite(r)
    if not ok.any():
        return 0.0
    diff = float(np.abs(g - r)[ok].max())
    if metric == "max-abs":
        return diff
    scale = float(np.abs(r[ok]).max())
    return diff / scale if scale > 0 else diff


def errors(refs: list, gots: list, metric: str) -> dict:
    """{output: error} over batches (the worst batch per output; None entries dropped)."""
    out: dict = {}
    for ref, got in zip(refs, gots):
        for k, v in ref.items():
            e = output_error(v, got[k], metric)
            if e is not None:
                out[k] = max(out.get(k, 0.0), e)
    return out


# --------------------------------------------------------------------------- TF32
def _not_fp32(model: onnx.ModelProto) -> set:
    """Tensors proven to be of another type than FP32 (declared, or by onnx's shape inference
    on the weightless skeleton): an FP16 or mixed source's Conv/MatMul operands, which TF32
    rounding must leave alone (Mul(fp16, fp32) is no valid node). Unknown types count as FP32."""
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton(model), check_type=False, strict_mode=False)
    except Exception:  # noqa: BLE001 - custom ops, broken annotations: the declared types then
        inferred = model
    out = set()
    for g in iter_graphs(inferred.graph):
        for v in list(g.input) + list(g.output) + list(g.value_info):
            elem = v.type.tensor_type.elem_type if v.type.HasField("tensor_type") else 0
            if elem and elem != onnx.TensorProto.FLOAT:
                out.add(v.name)
        out.update(t.name for t in g.initializer if t.data_type != onnx.TensorProto.FLOAT)
    return out


def tf32_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the FP32 model whose Conv/MatMul/Gemm/Einsum float inputs are rounded to
    TF32 first, with FP32 arithmetic only (Veltkamp: c = x * 8193; x' = c - (c - x) keeps
    11 significant bits, rounding to nearest even; bit-exact in ONNX Runtime)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = Names(out)
    other = _not_fp32(out)
    k = names.fresh("graphmp_tf32_split")
    out.graph.initializer.append(numpy_helper.from_array(np.array(8193, np.float32), k))

    def rewrite(g):
        nodes, done = [], {}
        for n in g.node:
            for a in n.attribute:
                for sg in attr_graphs(a):
                    rewrite(sg)
            slots = TF32_OPS.get(n.op_type, ()) if n.domain in ("", "ai.onnx") else ()
            for i in (range(len(n.input)) if slots is None else slots):
                x = n.input[i] if i < len(n.input) else ""
                if not x or (n.op_type in ("Conv", "ConvTranspose") and i == 2) or x in other:
                    continue  # biases are added in FP32; FP16/BF16 operands have no TF32 rounding
                if x not in done:
                    c, d, y = (names.fresh(f"{x}__tf32_{s}") for s in ("c", "d", "r"))
                    nodes += [helper.make_node("Mul", [x, k], [c], name=names.fresh("tf32_mul")),
                              helper.make_node("Sub", [c, x], [d], name=names.fresh("tf32_sub")),
                              helper.make_node("Sub", [c, d], [y], name=names.fresh("tf32_sub"))]
                    done[x] = y
                n.input[i] = done[x]
            nodes.append(n)
        del g.node[:]
        g.node.extend(nodes)
    rewrite(out.graph)
    return out


def round_float_inputs(feeds: dict) -> dict:
    """The feeds with FP32 arrays rounded to FP16 (and back): the FP16-input floor's inputs."""
    return {k: (v.astype(np.float16).astype(np.float32) if getattr(v, "dtype", None) == np.float32 else v)
            for k, v in feeds.items()}


@dataclass
class Budget:
    """The allowed error per output, and the yardsticks measured on the way."""
    spec: str
    metric: str
    allowed: dict = field(default_factory=dict)     # output -> allowed error
    floor: dict = field(default_factory=dict)       # output -> FP16-input floor
    tf32: dict = field(default_factory=dict)        # output -> TF32 error (when asked)
    runs: dict = field(default_factory=dict, repr=False)  # 'floor'/'tf32' -> their outputs per batch (keep=True)

    def normalized(self, errs: dict) -> float:
        """max over outputs of error / allowed (<= 1: within budget)."""
        def ratio(e, a):
            return e / a if a > 0 else (0.0 if e == 0 else float("inf"))
        return max((ratio(e, self.allowed[k]) for k, e in errs.items() if k in self.allowed), default=0.0)

    def to_dict(self) -> dict:
        return {"spec": self.spec, "metric": self.metric, "allowed": self.allowed, "floor": self.floor,
                "tf32": self.tf32 or None}


def measure(model, batches: list, refs: list, spec, metric: str = "max-rel",
            base_dir: str | None = None, keep: bool = False) -> Budget:
    """The budget for `model` (the FP32 source: ModelProto or path) on `batches`, whose
    FP32 outputs are `refs`. keep: also measure the TF32 error where the budget does not
    need it, and keep both yardsticks' outputs per batch in `runs` (graphmp.verdict reads
    what they predict and how far they move each output)."""
    from .model_runs import runner
    if metric not in METRICS:
        raise GraphmpError(f"--metric must be one of {', '.join(METRICS)}, not '{metric}'")
    kind, value = parse(spec)
    run32 = runner(model, base_dir=base_dir, optimize=False)  # as the references (graphmp.passes.search)
    floor_outputs = [run32(round_float_inputs(b)) for b in batches]
    floor = errors(refs, floor_outputs, metric)
    if not floor:
        raise GraphmpError("--metric argmax: no output of the model holds class scores ([N, C] or [N, T, V]); "
                           "use --metric max-rel or max-abs")
    b = Budget(str(spec), metric, floor=floor)
    if keep:
        b.runs["floor"] = floor_outputs
    if kind in ("tf32", "auto") or keep:
        if not isinstance(model, onnx.ModelProto):  # a path: the rewrite needs the graph and weights
            import os
            base_dir = os.path.dirname(os.path.abspath(os.fspath(model)))
            from .model_io import load_with_weights
            model = load_with_weights(model)
        run_tf32 = runner(tf32_model(model), base_dir=base_dir, optimize=False)
        tf32_outputs = [run_tf32(x) for x in batches]
        b.tf32 = errors(refs, tf32_outputs, metric)
        base = b.tf32
        if keep:
            b.runs["tf32"] = tf32_outputs
    if kind == "auto":  # the yardstick: what the metric tolerates, or K x what FP32 itself moves by
        base = {k: max(METRIC_FLOOR[metric], value * b.tf32.get(k, 0.0), value * f) for k, f in floor.items()}
    elif kind == "floor":
        base = {k: value * v for k, v in floor.items()}
    elif kind == "abs":
        base = {k: value for k in floor}
    measured = kind != "abs"  # a measured budget can be 0 (an output input rounding does not move)
    b.allowed = {k: max(v, MIN_BUDGET) if measured and metric != "argmax" else v for k, v in base.items()}
    return b


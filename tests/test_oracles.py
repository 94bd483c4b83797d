"""The two FP16-faithful oracles of graphmp.check, held against an ideal kernel.

An ideal kernel reads the FP16 inputs, computes the exact (float64) result and rounds it
once to FP16. Per op, on random inputs chosen so that FP16 accumulation or per-step
rounding would show (long sums, means of values near 100, function-bodied ops):
`--oracle emulation` (graphmp.emulate: FP32 math on ONNX Runtime) must be within 1 ulp
of it, or of FP32's own error at the output's scale, with an RMS error within 1% of the
ideal's; `--oracle reference` (onnx.reference with graphmp.reference_ops: float64 math)
must be the ideal exactly. The meta-test shows the measure flags plain onnx.reference,
which rounds at every step. Then, on the committed models, the two oracles must judge a
converted model alike.
"""
import glob
import math
import os
import time

import numpy as np
import onnx
import pytest
from numpy.lib.stride_tricks import sliding_window_view
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nph

import graphmp
from graphmp.check import EMULATION, REFERENCE, check
from graphmp.emulate import emulated_runner
from graphmp.model_runs import run_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F16 = np.float16
_erf = np.vectorize(math.erf, otypes=[np.float64])


# ---------------------------------------------------------------- ideal kernels (float64)
def _conv(x, w, b, pad):
    x = np.pad(x, [(0, 0), (0, 0), (pad, pad), (pad, pad)])
    win = sliding_window_view(x, w.shape[2:], axis=(2, 3))          # N, C, H, W, kh, kw
    return np.einsum("nchwij,ocij->nohw", win, w) + b.reshape(1, -1, 1, 1)


def _avgpool(x, k, s):
    return sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::s, ::s].mean(axis=(-2, -1))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _layernorm(x, g, b):
    m = x.mean(-1, keepdims=True)
    return (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


def _batchnorm(x, g, b, m, v):
    r = (1, -1, 1, 1)
    return (x - m.reshape(r)) / np.sqrt(v.reshape(r) + 1e-5) * g.reshape(r) + b.reshape(r)


def _hardsigmoid(x, alpha=float(np.float32(0.2)), beta=0.5):  # attributes are FP32
    return np.clip(alpha * x + beta, 0, 1)


def _rng_inputs(rng):
    """name -> FP16 input arrays of each case (drawn once, in this order, from `rng`)."""
    n = rng.standard_normal
    return {
        "Conv": [n((1, 16, 20, 20)), n((32, 16, 3, 3)), n(32)],
        "MatMul": [n((64, 512)), n((512, 48))],
        "Gemm": [n((32, 384)), n((64, 384)), n(64)],
        "Add": [n(8192) * 100, n(8192)],
        "Mul": [n(8192) * 10, n(8192) * 10],
        "AveragePool": [n((1, 8, 33, 33)) * 4],
        "BatchNormalization": [n((2, 16, 8, 8)) * 3, n(16), n(16), n(16), rng.uniform(0.1, 4, 16)],
        "HardSwish": [n(8192) * 4],
        "HardSigmoid": [n(8192) * 4],
        "Sigmoid": [n(8192) * 4],
        "Softmax": [n((32, 1000)) * 3],
        "ReduceMean(axis 0)": [100 + n((1000, 100))],
        "ReduceMean(axis 1)": [100 + n((100, 1000))],
        "ReduceSum(axis 0)": [n((1000, 100))],
        "ReduceSum(axis 1)": [n((100, 1000))],
        "LayerNormalization": [1 + 2 * n((64, 768)), 1 + n(768) / 4, n(768) / 4],
        "Erf": [n(8192)],
        "Gelu": [n(8192) * 3],
        "Tanh": [n(8192) * 2],
        "Exp": [rng.uniform(-10, 10, 8192)],
        "Pow": [rng.uniform(0.1, 4, 8192), rng.uniform(-2, 3, 8192)],
    }


# (op_type, attributes, extra int64 initializers, ideal(x64...) -> float64)
CASES = {
    "Conv": ("Conv", {"pads": [1, 1, 1, 1]}, {}, lambda x, w, b: _conv(x, w, b, 1)),
    "MatMul": ("MatMul", {}, {}, lambda a, b: a @ b),
    "Gemm": ("Gemm", {"transB": 1, "alpha": 0.5}, {}, lambda a, b, c: 0.5 * a @ b.T + c),
    "Add": ("Add", {}, {}, np.add),
    "Mul": ("Mul", {}, {}, np.multiply),
    "AveragePool": ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2]}, {}, lambda x: _avgpool(x, 3, 2)),
    "BatchNormalization": ("BatchNormalization", {}, {}, _batchnorm),
    "HardSwish": ("HardSwish", {}, {}, lambda x: x * _hardsigmoid(x, 1 / 6)),
    "HardSigmoid": ("HardSigmoid", {}, {}, _hardsigmoid),
    "Sigmoid": ("Sigmoid", {}, {}, lambda x: 1 / (1 + np.exp(-x))),
    "Softmax": ("Softmax", {}, {}, _softmax),
    "ReduceMean(axis 0)": ("ReduceMean", {}, {"axes": [0]}, lambda x: x.mean(0, keepdims=True)),
    "ReduceMean(axis 1)": ("ReduceMean", {}, {"axes": [1]}, lambda x: x.mean(1, keepdims=True)),
    "ReduceSum(axis 0)": ("ReduceSum", {}, {"axes": [0]}, lambda x: x.sum(0, keepdims=True)),
    "ReduceSum(axis 1)": ("ReduceSum", {}, {"axes": [1]}, lambda x: x.sum(1, keepdims=True)),
    "LayerNormalization": ("LayerNormalization", {}, {}, _layernorm),
    "Erf": ("Erf", {}, {}, _erf),
    "Gelu": ("Gelu", {}, {}, lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2)))),
    "Tanh": ("Tanh", {}, {}, np.tanh),
    "Exp": ("Exp", {}, {}, np.exp),
    "Pow": ("Pow", {}, {}, np.power),
}


def op_case(name, seed=0):
    """(one-node FP16 model at opset 20, FP16 feeds, exact float64 result) of CASES[name]."""
    op, attrs, ints, ideal = CASES[name]
    arrays = [np.asarray(a).astype(F16) for a in _rng_inputs(np.random.default_rng(seed))[name]]
    names = [f"x{i}" for i in range(len(arrays))]
    exact = np.asarray(ideal(*[a.astype(np.float64) for a in arrays]))
    node = oh.make_node(op, names + list(ints), ["y"], **attrs)
    g = oh.make_graph([node], "op", [oh.make_tensor_value_info(n, TP.FLOAT16, a.shape) for n, a in zip(names, arrays)],
                      [oh.make_tensor_value_info("y", TP.FLOAT16, None)],
                      [nph.from_array(np.array(v, np.int64), k) for k, v in ints.items()])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)])
    m.ir_version = 9
    return m, dict(zip(names, arrays)), exact


def against_ideal(got, exact) -> dict:
    """How `got` (FP16 values) departs from the ideal kernel (exact rounded once to FP16):
    fraction of differing outputs, the largest difference in FP16 ulps of the ideal value,
    and RMS error vs the exact result over the ideal's own (rounding) RMS error."""
    ideal = exact.astype(F16).astype(np.float64)
    got = np.asarray(got).astype(F16).astype(np.float64)
    assert got.shape == ideal.shape, (got.shape, ideal.shape)
    same = (got == ideal) | (np.isnan(got) & np.isnan(ideal))
    with np.errstate(invalid="ignore", over="ignore"):
        ulp = np.spacing(np.abs(ideal).astype(F16)).astype(np.float64)
        ulps = np.where(same, 0.0, np.abs(got - ideal) / ulp)
        base = math.sqrt(np.mean((ideal - exact) ** 2))
        rms = math.sqrt(np.mean((got - exact) ** 2))
    return {"differ": float(np.mean(~same)), "max_ulps": float(np.nan_to_num(ulps, nan=np.inf).max()),
            "rms_ratio": rms / base if base > 0 else (1.0 if rms == 0 else math.inf)}


def departures(got, exact) -> list[str]:
    """Why `got` is not an ideal kernel's output ([] if it is): every value within 1 FP16
    ulp of the ideal, or within FP32's own error at the output's scale (2^-20 max|y|:
    an FP32 sum that cancels, ORT's FP32 Sigmoid/Gelu approximations near 0), and an RMS
    error at most 1% above the ideal's own rounding error (a second rounding per value,
    as in an op that rounds at every step, adds 20% or more; FP16 accumulation far more)."""
    ideal = exact.astype(F16).astype(np.float64)
    g = np.asarray(got).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        tol = np.spacing(np.abs(ideal).astype(F16)).astype(np.float64) + 2.0 ** -20 * np.abs(exact).max()
        far = ~((g == ideal) | (np.abs(g - ideal) <= tol))
    out = [f"{int(far.sum())} of {far.size} values beyond 1 ulp (e.g. {g[far].ravel()[:3]} for "
           f"{ideal[far].ravel()[:3]})"] if far.any() else []
    m = against_ideal(got, exact)
    if not m["rms_ratio"] <= 1.01:
        out.append(f"RMS error {m['rms_ratio']:.3f}x the ideal's")
    return out


# ops where plain onnx.reference (numpy in FP16) rounds at every step or accumulates in FP16
PER_STEP = ["Conv", "Gemm", "BatchNormalization", "HardSwish", "Sigmoid", "Softmax", "ReduceMean(axis 0)",
            "ReduceMean(axis 1)", "ReduceSum(axis 0)", "LayerNormalization", "Gelu"]


@pytest.mark.parametrize("name", list(CASES))
def test_emulation_is_an_ideal_kernel(name):
    m, feeds, exact = op_case(name)
    got = emulated_runner(m)(feeds)["y"]
    assert got.dtype == np.float32 and np.array_equal(got.astype(F16).astype(np.float32), got, equal_nan=True), \
        "the emulation must store FP16 values (round each FP16 output)"
    assert departures(got, exact) == []


@pytest.mark.parametrize("name", list(CASES))
def test_reference_is_an_ideal_kernel(name):
    m, feeds, exact = op_case(name)
    got = run_reference(m, feeds)["y"]
    assert got.dtype == F16
    assert departures(got, exact) == []
    assert np.array_equal(got, exact.astype(F16), equal_nan=True)  # float64 math: the ideal exactly


@pytest.mark.parametrize("name", PER_STEP)
def test_the_measure_flags_per_step_rounding(name):
    """The measure above is not vacuous: plain onnx.reference (each step in FP16 numpy)
    fails it on these policy."""
    from onnx.reference import ReferenceEvaluator
    m, feeds, exact = op_case(name)
    with np.errstate(all="ignore"):
        got = ReferenceEvaluator(m).run(None, feeds)[0]
    assert departures(got, exact) != []


def test_reference_keeps_declared_types_and_fp32_models():
    """Outputs come back in their declared type (LayerNormalization's Mean/InvStdDev in
    the FP32 stash type, Y in FP16), and an FP32 op computes as plain onnx.reference."""
    from onnx.reference import ReferenceEvaluator
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(F16)
    g = oh.make_graph([oh.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"]),
                       oh.make_node("Cast", ["x"], ["x32"], to=TP.FLOAT),
                       oh.make_node("Softmax", ["x32"], ["p"])], "ln",
                      [oh.make_tensor_value_info("x", TP.FLOAT16, [4, 64])],
                      [oh.make_tensor_value_info(n, t, None) for n, t in
                       [("y", TP.FLOAT16), ("mean", TP.FLOAT), ("inv", TP.FLOAT), ("p", TP.FLOAT)]],
                      [nph.from_array(np.ones(64, F16), "s"), nph.from_array(np.zeros(64, F16), "b")])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    out = run_reference(m, {"x": x})
    assert [out[k].dtype for k in ("y", "mean", "inv", "p")] == [F16, np.float32, np.float32, np.float32]
    np.testing.assert_array_equal(out["p"], ReferenceEvaluator(m).run(["p"], {"x": x})[0])
    np.testing.assert_array_equal(out["mean"][:, 0], x.astype(np.float64).mean(-1).astype(np.float32))



def _node_model(node, inputs, opset, n_out=1, ints=None):
    """A one-node model: FP16 graph inputs `inputs` (name -> array), int64 or FP32
    initializers `ints` for the other inputs, outputs typed by shape inference (FP16
    where it cannot tell)."""
    g = oh.make_graph([node], "op", [oh.make_tensor_value_info(k, TP.FLOAT16, v.shape) for k, v in inputs.items()],
                      [oh.make_tensor_value_info(y, TP.UNDEFINED, None) for y in node.output[:n_out]],
                      [nph.from_array(np.asarray(v), k) for k, v in (ints or {}).items()])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", opset)])
    m.ir_version = 10
    inferred = onnx.shape_inference.infer_shapes(m)
    for v, w in zip(m.graph.output, inferred.graph.output):
        v.CopyFrom(w)
        if not v.type.tensor_type.elem_type:
            v.type.tensor_type.elem_type = TP.FLOAT16
    return m


def _signatures():
    """(node, FP16 inputs, opset, outputs, other initializers) of ops unlike CASES's:
    several outputs, optional and non-float inputs, variadic, int outputs, function
    bodies that depend on the input type."""
    r = np.random.default_rng(2)
    x = r.standard_normal((2, 4, 6, 6)).astype(F16)
    seq = r.standard_normal((5, 1, 8)).astype(F16)
    boxes = np.concatenate([r.uniform(0, 1, (1, 20, 2)), r.uniform(1, 2, (1, 20, 2))], -1).astype(F16)
    return {
        "GRU": (oh.make_node("GRU", ["s", "w", "u", "", "", ""], ["y", "yh"], hidden_size=3), {
            "s": seq, "w": r.standard_normal((1, 9, 8)).astype(F16), "u": r.standard_normal((1, 9, 3)).astype(F16)},
            17, 2, {}),
        "Resize": (oh.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear"), {"x": x}, 17, 1,
                   {"scales": np.array([1, 1, 1.5, 2], np.float32)}),
        "Sum": (oh.make_node("Sum", ["a", "b", "c"], ["y"]), {k: x for k in "abc"}, 17, 1, {}),
        "CumSum": (oh.make_node("CumSum", ["x", "axis"], ["y"]), {"x": x}, 17, 1, {"axis": np.array(3)}),
        "NonMaxSuppression": (oh.make_node("NonMaxSuppression", ["b", "s", "k", "iou"], ["y"]), {
            "b": boxes, "s": r.uniform(0, 1, (1, 1, 20)).astype(F16)}, 17, 1,
            {"k": np.array([5]), "iou": np.array([0.3], np.float32)}),
        "Gelu(tanh)": (oh.make_node("Gelu", ["x"], ["y"], approximate="tanh"), {"x": x}, 20, 1, {}),
        "GroupNormalization": (oh.make_node("GroupNormalization", ["x", "g", "b"], ["y"], num_groups=2), {
            "x": x, "g": r.standard_normal(4).astype(F16), "b": r.standard_normal(4).astype(F16)}, 21, 1, {}),
        "Mish": (oh.make_node("Mish", ["x"], ["y"]), {"x": x}, 18, 1, {}),
        "Einsum": (oh.make_node("Einsum", ["a", "b"], ["y"], equation="nchw,nchw->nc"), {"a": x, "b": x}, 17, 1, {}),
        "ConvTranspose": (oh.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2]), {
            "x": x, "w": r.standard_normal((4, 3, 3, 3)).astype(F16)}, 17, 1, {}),
        "InstanceNormalization": (oh.make_node("InstanceNormalization", ["x", "g", "b"], ["y"]), {
            "x": x, "g": r.standard_normal(4).astype(F16), "b": r.standard_normal(4).astype(F16)}, 17, 1, {}),
    }


@pytest.mark.parametrize("name", list(_signatures()))
def test_reference_ops_of_every_signature(name):
    """Each output in its declared type, and the values those of the emulation (FP32
    math, rounded once) up to FP32's error: one FP16 ulp, at most 2 at the output's scale."""
    node, inputs, opset, n_out, ints = _signatures()[name]
    m = _node_model(node, inputs, opset, n_out, ints)
    ref, emu = run_reference(m, inputs), emulated_runner(m)(inputs)
    for v in m.graph.output:
        want = onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)
        assert ref[v.name].dtype == want, (v.name, ref[v.name].dtype, want)
        got, e = ref[v.name].astype(np.float64), emu[v.name].astype(np.float64)
        scale = np.abs(e).max()
        assert np.abs(got - e).max() <= 2 * float(np.spacing(F16(scale))), v.name



def test_reference_is_an_ideal_kernel_in_bf16():
    """BF16 likewise: float64 math, one rounding to BF16 (Softmax: per step in BF16 it is
    off by more than an ulp; ReduceMean of 1000 rows of ~100)."""
    bf16 = onnx.helper.tensor_dtype_to_np_dtype(TP.BFLOAT16)
    for name in ("Softmax", "ReduceMean(axis 0)"):
        m, feeds, exact = op_case(name)
        for v in list(m.graph.input) + list(m.graph.output):
            v.type.tensor_type.elem_type = TP.BFLOAT16
        got = run_reference(m, {k: v.astype(np.float64).astype(bf16) for k, v in feeds.items()})["y"]
        want = np.asarray(CASES[name][3](*[v.astype(np.float64).astype(bf16).astype(np.float64)
                                           for v in feeds.values()]))
        assert got.dtype == bf16 and np.array_equal(got.astype(np.float64), want.astype(bf16).astype(np.float64))


# ops of graphmp.policy's lists the reference leaves to plain onnx.reference: exact in FP16
EXACT = {"Where", "Clip", "Neg", "Abs", "Max", "Min", "Floor", "Ceil", "Round", "Sign", "Equal", "Less", "Greater",
         "LessOrEqual", "GreaterOrEqual", "IsNaN", "IsInf", "Hardmax"}
NOT_IDEAL = {"Range": "its element count depends on the type it is computed in: runs in its declared type",
             "GlobalLpPool": "onnx.reference has no GlobalLpPool: check falls back to the emulation"}


def test_every_op_graphmp_may_lower_is_ideal_or_exact():
    """What graphmp.model_runs's docstring promises: each op graphmp may run in FP16 is an
    ideal kernel in the reference, exact in FP16 (graphmp's data-movement class, EXACT),
    or explained in NOT_IDEAL."""
    from graphmp import policy
    from graphmp.model_runs import oracle_ops
    ideal = {c.__name__ for c in oracle_ops() if c.op_domain == ""} - {"Loop"}
    lowered = policy.FP16_OPS | policy.FOLLOW_OPS | policy.FP32_OPS
    assert lowered - ideal - EXACT - set(NOT_IDEAL) == set()
    assert not (ideal | policy.CLEAR_OPS) & EXACT and not ideal & set(NOT_IDEAL)


# models the cross-test leaves out, and why (seconds measured on 2 CPU cores)
EXPLAINED = {
    "rivagan_encoder.onnx": "5-D Conv (Conv3d): onnx.reference needs ~45 s for check --oracle reference",
    "rivagan_decoder.onnx": "5-D Conv (Conv3d): onnx.reference needs ~35 s for check --oracle reference",
    "style_mosaic.onnx": "onnx.reference has no ImageScaler, Crop or Affine (opset-7 experimental ops): check "
                         "falls back to the emulation, so there is nothing to compare (and 720x720 takes ~27 s)",
    "super_resolution_qdq.onnx": "onnx.reference implements DequantizeLinear from opset 19 only (this model is "
                                 "opset 15): check falls back to the emulation, nothing to compare",
    "ppocrv4_det.onnx": "its Sigmoid probability map turns the oracles' 1-ulp differences (FP32 vs float64 math) "
                        "into max-rel differences of up to 2x on one batch: 0.49x-1.86x over seeds 0-3 and two "
                        "plans (the near-zero-constant rule moved 2 Casts); both are exact op by op (tests above)",
}
CANNOT_RUN = {"style_mosaic.onnx": "ImageScaler", "super_resolution_qdq.onnx": "DequantizeLinear"}
MODELS = sorted(glob.glob(os.path.join(ROOT, "models", "real", "*.onnx"))
                + glob.glob(os.path.join(ROOT, "models", "tiny", "*.onnx")))


def _model_params():
    out = []
    for p in MODELS:
        name = os.path.basename(p)
        marks = [pytest.mark.skip(reason=EXPLAINED[name])] if name in EXPLAINED else []
        out.append(pytest.param(p, id=os.path.relpath(p, os.path.join(ROOT, "models")), marks=marks))
    return out


@pytest.mark.parametrize("path", _model_params())
def test_the_two_oracles_judge_a_converted_model_alike(path):
    """Converted with the defaults, checked on the same generated inputs: each output's
    error under the emulation and under the reference within 1.5x of each other (or both
    below 1e-4), and the reference really judged (check falls back to the emulation when
    onnx.reference cannot run a model or does not reproduce ORT on the FP32 source)."""
    # max-rel over one batch is a noisy statistic where 1-ulp differences flip decisions
    # downstream (FP32 vs float64 math): over seeds 1-3, aecmos_gru, basic_pitch,
    # ppocrv4_det and silero_vad each leave 1.5x once (0.49x to 2.07x); at check's
    # default seed 0 every output here is within 1.24x, or both errors below 1e-4 (ppocrv4_det:
    # see EXPLAINED and the test below).
    t = time.perf_counter()
    conv = graphmp.convert(path, None).model
    emu = check(path, conv, oracle="emulation").to_dict()
    ref = check(path, conv, oracle="reference").to_dict()
    assert emu["oracle"] == EMULATION and ref["oracle"] == REFERENCE, ref["warnings"]
    assert emu["inputs"] == ref["inputs"] and set(emu["outputs"]) == set(ref["outputs"])
    for k, o in emu["outputs"].items():
        e, r = o["error"], ref["outputs"][k]["error"]
        assert max(e, r) < 1e-4 or (r <= 1.5 * e and e <= 1.5 * r), (k, e, r)
    assert time.perf_counter() - t < 30, "too slow for this file: list the model in EXPLAINED"


def test_explained_exceptions_are_models_and_still_hold():
    """Each exception names a committed model, and onnx.reference (with graphmp's ops)
    still refuses the ones said to be beyond it: when it learns them, test them."""
    from onnx.reference import ReferenceEvaluator
    from graphmp.model_runs import oracle_ops
    names = {os.path.basename(p): p for p in MODELS}
    assert set(EXPLAINED) <= set(names) and set(CANNOT_RUN) <= set(EXPLAINED)
    for name, op in CANNOT_RUN.items():
        with pytest.raises(Exception, match=op):
            ReferenceEvaluator(onnx.load(names[name]), new_ops=oracle_ops())


def test_the_two_oracles_agree_within_the_noise_on_a_probability_map():
    """ppocrv4_det (in EXPLAINED for 1.5x): its Sigmoid map amplifies 1-ulp differences,
    but the two oracles still judge it alike within the 2.5x that noise spans."""
    path = os.path.join(ROOT, "models", "real", "ppocrv4_det.onnx")
    conv = graphmp.convert(path, None).model
    emu = check(path, conv, oracle="emulation").to_dict()
    ref = check(path, conv, oracle="reference").to_dict()
    assert ref["oracle"] == REFERENCE, ref["warnings"]
    for k, o in emu["outputs"].items():
        e, r = o["error"], ref["outputs"][k]["error"]
        assert r <= 2.5 * e and e <= 2.5 * r, (k, e, r)

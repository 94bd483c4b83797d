"""FP32 models that reproduce the failure modes of FP16 converters.

One builder per case of docs/failure_modes.md: ``case_NN_short_name()``.
Every builder returns a valid FP32 ONNX model (opset 17, IR 8 unless said otherwise),
small enough for ``onnx.reference.ReferenceEvaluator``. A builder returns either

* an ``onnx.ModelProto`` (inputs from :func:`default_feeds` are fine), or
* a ``(model, feeds)`` pair where specific input values matter, or
* (cases 7 and 8, which are about files) a path to a model written with external data
  into the ``tmp_path`` directory given to the builder.

Node names are fixed so that tests can find the nodes in the converted model (a
converter is expected to keep the names of the nodes it does not create).
``test_failure_modes.py::test_builder_is_valid_fp32`` checks every builder with the
full checker, ONNX Runtime (CPU) and the ReferenceEvaluator.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nph
from onnx.reference.op_run import OpRun

OPSET = 17
IR_VERSION = 8
F32 = TP.FLOAT
F16 = TP.FLOAT16


# --------------------------------------------------------------------------- helpers
def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _w(seed: int, shape, scale: float | None = None) -> np.ndarray:
    """Gaussian weights with a fan-in scale (outputs stay O(1) for O(1) inputs)."""
    if scale is None:
        scale = 1.0 / np.sqrt(shape[0] if len(shape) == 2 else np.prod(shape[1:]))
    return (_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _init(name: str, value, dtype=np.float32) -> onnx.TensorProto:
    return nph.from_array(np.asarray(value, dtype=dtype), name)


def _vi(name: str, elem: int, shape) -> onnx.ValueInfoProto:
    return oh.make_tensor_value_info(name, elem, shape)


def _i64(name: str, values) -> onnx.TensorProto:
    return _init(name, values, np.int64)


def _model(nodes, inputs, outputs, inits=(), name="case", opsets=None, value_info=()):
    graph = oh.make_graph(list(nodes), name, list(inputs), list(outputs),
                          initializer=list(inits), value_info=list(value_info))
    imports = [oh.make_opsetid("", OPSET)]
    imports += [oh.make_opsetid(d, v) for d, v in (opsets or {}).items()]
    model = oh.make_model(graph, opset_imports=imports, producer_name="graphmp-tests")
    model.ir_version = IR_VERSION
    return model


def _fill_shape(vi: onnx.ValueInfoProto, batch: int):
    dims = []
    for d in vi.type.tensor_type.shape.dim:
        dims.append(d.dim_value if d.HasField("dim_value") else batch)
    return dims


_NP_OF = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16, TP.DOUBLE: np.float64,
          TP.INT64: np.int64, TP.INT32: np.int32, TP.BOOL: np.bool_}


def default_feeds(model: onnx.ModelProto, seed: int = 0, batch: int = 1) -> dict:
    """Deterministic inputs for a model: N(0, 1) floats, symbolic dims set to ``batch``."""
    rng = _rng(seed)
    init_names = {i.name for i in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in init_names:
            continue
        elem = vi.type.tensor_type.elem_type
        shape = _fill_shape(vi, batch)
        if elem == TP.BOOL:
            feeds[vi.name] = np.array(True) if not shape else np.ones(shape, bool)
        elif elem in (TP.INT64, TP.INT32):
            feeds[vi.name] = rng.integers(0, 4, size=shape).astype(_NP_OF[elem])
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(_NP_OF[elem])
    return feeds


# --------------------------------------------------------------------------- case 1
def case_01_resize_scales() -> onnx.ModelProto:
    """Resize whose roi/scales are an initializer (linear) and Constant nodes (nearest),
    plus a Resize with `sizes`, all between Convs so that a converter lowers the path.
    Spec: Resize `scales` is tensor(float) only; `roi` is T2 (float16/float/double)."""
    nodes = [
        oh.make_node("Conv", ["x", "W1", "B1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        oh.make_node("Resize", ["r1", "roi_init", "scales_init"], ["z1"], name="resize_init",
                     mode="linear"),
        oh.make_node("Conv", ["z1", "W2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        oh.make_node("Constant", [], ["roi_const"], name="roi_constant",
                     value=nph.from_array(np.array([0, 0, 0, 0, 1, 1, 1, 1], np.float32))),
        oh.make_node("Constant", [], ["scales_const"], name="scales_constant",
                     value=nph.from_array(np.array([1, 1, 2, 2], np.float32))),
        oh.make_node("Resize", ["c2", "roi_const", "scales_const"], ["z2"],
                     name="resize_const", mode="nearest"),
        oh.make_node("Conv", ["z2", "W3"], ["c3"], name="conv3", pads=[1, 1, 1, 1],
                     strides=[2, 2]),
        oh.make_node("Resize", ["c3", "", "", "sizes_init"], ["z3"], name="resize_sizes",
                     mode="linear"),
        oh.make_node("Conv", ["z3", "W4"], ["y"], name="conv4", pads=[1, 1, 1, 1]),
    ]
    inits = [
        _init("W1", _w(1, [4, 3, 3, 3])), _init("B1", _w(2, [4], 0.1)),
        _init("W2", _w(3, [4, 4, 3, 3])), _init("W3", _w(4, [2, 4, 3, 3])),
        _init("W4", _w(5, [2, 2, 3, 3])),
        _init("roi_init", np.array([0, 0, 0, 0, 1, 1, 1, 1], np.float32)),
        _init("scales_init", np.array([1, 1, 2, 2], np.float32)),
        _i64("sizes_init", [1, 2, 8, 8]),
    ]
    return _model(nodes, [_vi("x", F32, [1, 3, 8, 8])], [_vi("y", F32, [1, 2, 8, 8])],
                  inits, name="case01")


# --------------------------------------------------------------------------- case 2
def case_02_existing_cast_to_float() -> onnx.ModelProto:
    """Cast(to=FLOAT) nodes between MatMuls (no-op casts as exporters leave them) and a
    Cast(int64 -> FLOAT) feeding the float path."""
    nodes = [
        oh.make_node("MatMul", ["x", "W1"], ["m1"], name="mm1"),
        oh.make_node("Cast", ["m1"], ["m1f"], name="cast_f1", to=F32),
        oh.make_node("MatMul", ["m1f", "W2"], ["m2"], name="mm2"),
        oh.make_node("Relu", ["m2"], ["r2"], name="relu2"),
        oh.make_node("Cast", ["r2"], ["r2f"], name="cast_f2", to=F32),
        oh.make_node("MatMul", ["r2f", "W3"], ["m3"], name="mm3"),
        oh.make_node("Cast", ["k"], ["kf"], name="cast_k", to=F32),
        oh.make_node("Add", ["m3", "kf"], ["y"], name="add_k"),
    ]
    inits = [_init("W1", _w(11, [16, 16])), _init("W2", _w(12, [16, 16])),
             _init("W3", _w(13, [16, 8]))]
    return _model(nodes, [_vi("x", F32, [4, 16]), _vi("k", TP.INT64, [4, 1])],
                  [_vi("y", F32, [4, 8])], inits, name="case02")


# --------------------------------------------------------------------------- case 3
def case_03_shared_initializer() -> onnx.ModelProto:
    """One initializer W_shared read by an fp16-class MatMul, by Add->Exp->ReduceSum and
    directly by Pow (fp32 class)."""
    nodes = [
        oh.make_node("MatMul", ["x", "W_shared"], ["y_mm"], name="mm_w"),
        oh.make_node("Add", ["x", "W_shared"], ["a"], name="add_w"),
        oh.make_node("Exp", ["a"], ["e"], name="exp_w"),
        oh.make_node("ReduceSum", ["e", "axes1"], ["y_exp"], name="rsum_w", keepdims=1),
        oh.make_node("Abs", ["x"], ["ax"], name="abs_x"),
        oh.make_node("Add", ["ax", "one"], ["ax1"], name="add_one"),
        oh.make_node("Pow", ["ax1", "W_shared"], ["p"], name="pow_w"),
        oh.make_node("ReduceSum", ["p", "axes1"], ["y_pow"], name="rsum_pow", keepdims=1),
    ]
    inits = [_init("W_shared", _rng(21).uniform(-0.5, 0.5, [8, 8])),
             _i64("axes1", [1]), _init("one", 1.0)]
    return _model(nodes, [_vi("x", F32, [8, 8])],
                  [_vi("y_mm", F32, [8, 8]), _vi("y_exp", F32, [8, 1]),
                   _vi("y_pow", F32, [8, 1])], inits, name="case03")


# --------------------------------------------------------------------------- case 4
CASE_04_BLOCKED = "^(scale300|square|rsum)$"


def case_04_cascaded_casts() -> onnx.ModelProto:
    """MatMul -> Cast(to=FLOAT) -> x*300 -> square -> ReduceSum. Convert with
    fp32_nodes=CASE_04_BLOCKED: the island (scale300, square, rsum) must receive FP32
    values; square's input reaches ~1.4e6, so a round trip through FP16 gives inf."""
    nodes = [
        oh.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        oh.make_node("Cast", ["m"], ["mf"], name="noop_cast", to=F32),
        oh.make_node("Mul", ["mf", "c300"], ["s"], name="scale300"),
        oh.make_node("Mul", ["s", "s"], ["sq"], name="square"),
        oh.make_node("ReduceSum", ["sq", "axes1"], ["rs"], name="rsum", keepdims=1),
        oh.make_node("Mul", ["rs", "c_small"], ["y"], name="rescale"),
    ]
    inits = [_init("W", _w(31, [64, 64])), _init("c300", 300.0), _i64("axes1", [1]),
             _init("c_small", 1e-4)]
    return _model(nodes, [_vi("x", F32, [4, 64])], [_vi("y", F32, [4, 1])], inits,
                  name="case04")


# --------------------------------------------------------------------------- case 5
def _overflow_model(dtype: int, name: str) -> onnx.ModelProto:
    np_t = np.float16 if dtype == F16 else np.float32
    pre = [] if dtype == F32 else [oh.make_node("Cast", ["x"], ["x_h"], name="in_cast", to=F16)]
    xin = "x" if dtype == F32 else "x_h"
    out = "y" if dtype == F32 else "y_h"
    nodes = pre + [
        oh.make_node("MatMul", [xin, "W"], ["m"], name="mm"),
        oh.make_node("Mul", ["m", "c300"], ["s"], name="mul300"),
        oh.make_node("Mul", ["s", "s"], ["sq"], name="square"),
        oh.make_node("ReduceSum", ["sq", "axes1"], ["rs"], name="rsum", keepdims=1),
        oh.make_node("Add", ["rs", "bias"], [out], name="add_bias"),
    ]
    if dtype != F32:
        nodes.append(oh.make_node("Cast", ["y_h"], ["y"], name="out_cast", to=F32))
    inits = [_init("W", _w(51, [64, 64]), np_t), _init("c300", 300.0, np_t),
             _i64("axes1", [1]), _init("bias", 1.0, np_t)]
    return _model(nodes, [_vi("x", F32, [4, 64])], [_vi("y", F32, [4, 1])], inits, name=name)


def case_05_activation_overflow():
    """MatMul -> *300 -> square -> ReduceSum -> Add: |square| ~ 1e6 > 65504.
    Inputs are fixed so that every row overflows in FP16."""
    model = _overflow_model(F32, "case05")
    x = _rng(52).standard_normal([4, 64]).astype(np.float32)
    return model, {"x": x}


def case_05_naive_fp16() -> onnx.ModelProto:
    """The same graph computed entirely in FP16 (what a naive converter emits)."""
    return _overflow_model(F16, "case05_naive")


# --------------------------------------------------------------------------- case 6
def case_06_out_of_range_constants():
    """Initializers 20000 (exact in FP16), 70000 (> 65504: inf in FP16) and 1e-9 / -1e-9
    (below the smallest FP16 subnormal 6e-8: flush to (-)0)."""
    nodes = [
        # 70000: x + 70000 - 70000 == x in fp32; inf - inf = nan in fp16
        oh.make_node("Add", ["x", "c70000"], ["a_big"], name="add_big"),
        oh.make_node("Sub", ["a_big", "c70000"], ["y_big"], name="sub_big"),
        # 1e-9: x*1e-9 / (|y| + 1e-9) == x where y == 0; 0/0 = nan in fp16
        oh.make_node("Mul", ["x", "c1e_9"], ["xt"], name="mul_tiny"),
        oh.make_node("Abs", ["y"], ["ay"], name="abs_y"),
        oh.make_node("Add", ["ay", "c1e_9"], ["den"], name="add_tiny"),
        oh.make_node("Div", ["xt", "den"], ["y_ratio"], name="div_tiny"),
        # -1e-9: y - (-1e-9) > 0 where y == 0 in fp32, == 0 in fp16
        oh.make_node("Sub", ["y", "c_neg1e_9"], ["yp"], name="sub_negtiny"),
        oh.make_node("Greater", ["yp", "zero"], ["pos"], name="gt_zero"),
        oh.make_node("Neg", ["x"], ["nx"], name="neg_x"),
        oh.make_node("Where", ["pos", "x", "nx"], ["y_sign"], name="where_sign"),
        # 20000: representable in fp16; clamping it to 1e4 halves the result
        oh.make_node("Sub", ["c20000", "x"], ["y_20k"], name="sub_20k"),
    ]
    inits = [_init("c70000", 70000.0), _init("c1e_9", 1e-9), _init("c_neg1e_9", -1e-9),
             _init("zero", 0.0), _init("c20000", 20000.0)]
    model = _model(nodes, [_vi("x", F32, [4, 8]), _vi("y", F32, [4, 8])],
                   [_vi("y_big", F32, [4, 8]), _vi("y_ratio", F32, [4, 8]),
                    _vi("y_sign", F32, [4, 8]), _vi("y_20k", F32, [4, 8])],
                   inits, name="case06")
    rng = _rng(61)
    x = rng.uniform(0.5, 2.0, [4, 8]).astype(np.float32)
    y = rng.standard_normal([4, 8]).astype(np.float32)
    y[:, ::2] = 0.0  # exact zeros: where 1e-9 / -1e-9 decide the result
    return model, {"x": x, "y": y}


# --------------------------------------------------------------------------- case 7
CASE_07_LOCATION = "case07.weights"


def _mlp_softmax(seed: int, d_in=32, d_hid=64, d_out=16, name="mlp"):
    nodes = [
        oh.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        oh.make_node("Relu", ["h"], ["hr"], name="relu"),
        oh.make_node("MatMul", ["hr", "W2"], ["o"], name="mm2"),
        oh.make_node("Add", ["o", "b2"], ["ob"], name="add_b2"),
        oh.make_node("Softmax", ["ob"], ["y"], name="softmax", axis=-1),
    ]
    inits = [_init("W1", _w(seed, [d_in, d_hid])), _init("W2", _w(seed + 1, [d_hid, d_out])),
             _init("b2", _w(seed + 2, [d_out], 0.1))]
    return _model(nodes, [_vi("x", F32, [2, d_in])], [_vi("y", F32, [2, d_out])], inits,
                  name=name)


def case_07_external_data(tmp_path) -> str:
    """Writes ``tmp_path/src/case07.onnx`` with every initializer in one external file
    ``case07.weights``; returns the model path."""
    model = _mlp_softmax(71, name="case07")
    d = os.path.join(str(tmp_path), "src")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "case07.onnx")
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=CASE_07_LOCATION, size_threshold=0)
    return path


# --------------------------------------------------------------------------- case 8
#: Case 8 (model > 2 GB) is covered here by a SCALED-DOWN model with the same storage
#: layout (every initializer in its own external file); the real > 2 GB run lives
#: elsewhere (benchmarks / a dedicated large-model test).
CASE_08_SCALED_DOWN = True


def case_08_large_model_scaled(tmp_path, hidden: int = 256) -> str:
    """Writes ``tmp_path/src/case08.onnx``, one external file per initializer (the
    layout of big exported models); ``hidden`` scales it (weights = 3*hidden^2*4 bytes)."""
    nodes = [
        oh.make_node("MatMul", ["x", "W1"], ["h1"], name="mm1"),
        oh.make_node("Add", ["h1", "b1"], ["h1b"], name="add1"),
        oh.make_node("Relu", ["h1b"], ["r1"], name="relu1"),
        oh.make_node("MatMul", ["r1", "W2"], ["h2"], name="mm2"),
        oh.make_node("Relu", ["h2"], ["r2"], name="relu2"),
        oh.make_node("MatMul", ["r2", "W3"], ["h3"], name="mm3"),
        oh.make_node("Softmax", ["h3"], ["y"], name="softmax", axis=-1),
    ]
    inits = [_init("W1", _w(81, [hidden, hidden])), _init("b1", _w(82, [hidden], 0.1)),
             _init("W2", _w(83, [hidden, hidden])), _init("W3", _w(84, [hidden, hidden]))]
    model = _model(nodes, [_vi("x", F32, [2, hidden])], [_vi("y", F32, [2, hidden])], inits,
                   name="case08")
    d = os.path.join(str(tmp_path), "src")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "case08.onnx")
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=False,
                    size_threshold=0)
    return path


# --------------------------------------------------------------------------- case 9
class MyOp(OpRun):
    """ReferenceEvaluator kernel for com.example.MyOp: y = 2x + 1, records input dtypes."""
    op_domain = "com.example"
    seen_dtypes: list = []

    def _run(self, x):
        MyOp.seen_dtypes.append(x.dtype)
        return (x * x.dtype.type(2) + x.dtype.type(1),)


class Gelu(OpRun):
    """ReferenceEvaluator kernel for com.microsoft.Gelu (erf form), in the input dtype."""
    op_domain = "com.microsoft"
    seen_dtypes: list = []

    def _run(self, x, approximate=None):
        from math import erf
        Gelu.seen_dtypes.append(x.dtype)
        verf = np.vectorize(erf)
        y = 0.5 * x.astype(np.float64) * (1.0 + verf(x.astype(np.float64) / np.sqrt(2.0)))
        return (y.astype(x.dtype),)


class FusedMatMul(OpRun):
    """ReferenceEvaluator kernel for com.microsoft.FusedMatMul (alpha, transA/B)."""
    op_domain = "com.microsoft"
    seen_dtypes: list = []

    def _run(self, a, b, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):
        FusedMatMul.seen_dtypes.append(a.dtype)
        if transA:
            a = np.swapaxes(a, -1, -2)
        if transB:
            b = np.swapaxes(b, -1, -2)
        return ((np.matmul(a, b) * a.dtype.type(alpha)).astype(a.dtype),)


CUSTOM_OPS = [MyOp, Gelu, FusedMatMul]


def case_09a_custom_op_no_schema() -> onnx.ModelProto:
    """com.example.MyOp (no schema: inference stops there) between MatMuls, dynamic
    batch. ORT has no kernel: run with ReferenceEvaluator(new_ops=CUSTOM_OPS)."""
    nodes = [
        oh.make_node("MatMul", ["x", "W1"], ["m1"], name="mm_a"),
        oh.make_node("MyOp", ["m1"], ["u"], name="myop", domain="com.example"),
        oh.make_node("MatMul", ["u", "W2"], ["m2"], name="mm_b"),
        oh.make_node("Relu", ["m2"], ["y"], name="relu"),
    ]
    inits = [_init("W1", _w(91, [16, 16])), _init("W2", _w(92, [16, 8]))]
    return _model(nodes, [_vi("x", F32, ["N", 16])], [_vi("y", F32, ["N", 8])], inits,
                  name="case09a", opsets={"com.example": 1})


def case_09b_com_microsoft_ops() -> onnx.ModelProto:
    """com.microsoft FusedMatMul and Gelu (ORT CPU has FP32 kernels only; ONNX has no
    schema for them), dynamic [batch, seq, 16] input."""
    nodes = [
        oh.make_node("FusedMatMul", ["x", "W1"], ["f"], name="fused_mm", domain="com.microsoft",
                     alpha=0.5),
        oh.make_node("Gelu", ["f"], ["g"], name="gelu", domain="com.microsoft"),
        oh.make_node("MatMul", ["g", "W2"], ["m"], name="mm_c"),
        oh.make_node("Softmax", ["m"], ["y"], name="softmax", axis=-1),
    ]
    inits = [_init("W1", _w(93, [16, 16], 0.5)), _init("W2", _w(94, [16, 8]))]
    return _model(nodes, [_vi("x", F32, ["batch", "seq", 16])],
                  [_vi("y", F32, ["batch", "seq", 8])], inits, name="case09b",
                  opsets={"com.microsoft": 1})


# --------------------------------------------------------------------------- case 10
def case_10_control_flow():
    """If (then: MatMul->Softmax, else: MatMul->Exp->ReduceSum->Div) and Loop (body:
    MatMul->Add->Softmax, ReduceSum scan output); both read outer-scope tensors (t, W1,
    W2, Wl, bl) and the outer initializer W1 is also used by the outer graph."""
    then_g = oh.make_graph(
        [oh.make_node("MatMul", ["t", "W1"], ["ta"], name="then_mm"),
         oh.make_node("Softmax", ["ta"], ["then_out"], name="then_softmax", axis=-1)],
        "then_branch", [], [_vi("then_out", F32, [4, 8])])
    else_g = oh.make_graph(
        [oh.make_node("MatMul", ["t", "W2"], ["ec"], name="else_mm"),
         oh.make_node("Exp", ["ec"], ["ee"], name="else_exp"),
         oh.make_node("Constant", [], ["else_axes"], name="else_axes_const",
                      value=nph.from_array(np.array([1], np.int64))),
         oh.make_node("ReduceSum", ["ee", "else_axes"], ["es"], name="else_rsum", keepdims=1),
         oh.make_node("Div", ["ee", "es"], ["else_out"], name="else_div")],
        "else_branch", [], [_vi("else_out", F32, [4, 8])])
    body = oh.make_graph(
        [oh.make_node("MatMul", ["v_in", "Wl"], ["bh"], name="body_mm"),
         oh.make_node("Add", ["bh", "bl"], ["bh2"], name="body_add"),
         oh.make_node("Softmax", ["bh2"], ["bs"], name="body_softmax", axis=-1),
         oh.make_node("Add", ["v_in", "bs"], ["v_out"], name="body_residual"),
         oh.make_node("Constant", [], ["body_axes"], name="body_axes_const",
                      value=nph.from_array(np.array([1], np.int64))),
         oh.make_node("ReduceSum", ["bh2", "body_axes"], ["scan_out"], name="body_rsum",
                      keepdims=0),
         oh.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "loop_body",
        [_vi("iter", TP.INT64, []), _vi("cond_in", TP.BOOL, []), _vi("v_in", F32, [4, 8])],
        [_vi("cond_out", TP.BOOL, []), _vi("v_out", F32, [4, 8]), _vi("scan_out", F32, [4])])
    nodes = [
        oh.make_node("MatMul", ["x", "W0"], ["t"], name="outer_mm"),
        oh.make_node("If", ["cond"], ["if_out"], name="if_node",
                     then_branch=then_g, else_branch=else_g),
        oh.make_node("MatMul", ["if_out", "W1"], ["y_if"], name="post_mm"),
        oh.make_node("Loop", ["trip", "loop_cond", "t"], ["y_loop", "y_scan"], name="loop_node",
                     body=body),
    ]
    inits = [_init("W0", _w(101, [8, 8])), _init("W1", _w(102, [8, 8])),
             _init("W2", _w(103, [8, 8])), _init("Wl", _w(104, [8, 8])),
             _init("bl", _w(105, [8], 0.1)), _i64("trip", 3),
             _init("loop_cond", True, np.bool_)]
    model = _model(nodes, [_vi("x", F32, [4, 8]), _vi("cond", TP.BOOL, [])],
                   [_vi("y_if", F32, [4, 8]), _vi("y_loop", F32, [4, 8]),
                    _vi("y_scan", F32, [3, 4])], inits, name="case10")
    x = _rng(106).standard_normal([4, 8]).astype(np.float32)
    return model, {"x": x, "cond": np.array(True)}


# --------------------------------------------------------------------------- case 11
def case_11_sorted_reference() -> onnx.ModelProto:
    """The topologically sorted version of case 11 (a valid model)."""
    nodes = [
        oh.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        oh.make_node("Relu", ["h"], ["hr"], name="relu"),
        oh.make_node("MatMul", ["hr", "W2"], ["o"], name="mm2"),
        oh.make_node("Add", ["o", "h"], ["s"], name="add_skip"),
        oh.make_node("ReduceSum", ["s", "axes1"], ["rs"], name="rsum", keepdims=1),
        oh.make_node("Softmax", ["s"], ["sm"], name="softmax", axis=-1),
        oh.make_node("Mul", ["sm", "rs"], ["y"], name="mul_out"),
    ]
    inits = [_init("W1", _w(111, [8, 8])), _init("W2", _w(112, [8, 8])), _i64("axes1", [1])]
    return _model(nodes, [_vi("x", F32, [4, 8])], [_vi("y", F32, [4, 8])], inits,
                  name="case11")


def case_11_unsorted_nodes() -> onnx.ModelProto:
    """Same graph with the node list reversed: NOT valid ONNX (the checker rejects it;
    ORT sorts on load). A converter must emit a sorted model."""
    model = case_11_sorted_reference()
    nodes = list(model.graph.node)[::-1]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


# --------------------------------------------------------------------------- case 12
def case_12_dtype_attributes() -> onnx.ModelProto:
    """RandomNormalLike / RandomUniformLike (with and without dtype), RandomNormal /
    RandomUniform (dtype=FLOAT), EyeLike (dtype=FLOAT, and without dtype), ConstantOfShape
    with and without value, Cast(int64 -> FLOAT). Random values are multiplied by 0, so
    the outputs are deterministic."""
    nodes = [
        oh.make_node("RandomNormalLike", ["x"], ["rnl"], name="rand_normal_like", seed=1.0),
        oh.make_node("RandomUniformLike", ["x"], ["rul"], name="rand_uniform_like",
                     dtype=F32, seed=2.0),
        oh.make_node("RandomNormal", [], ["rn"], name="rand_normal", shape=[2, 4], dtype=F32,
                     seed=3.0),
        oh.make_node("RandomUniform", [], ["ru"], name="rand_uniform", shape=[2, 4],
                     dtype=F32, seed=4.0),
        oh.make_node("Add", ["rnl", "rul"], ["r1"], name="add_r1"),
        oh.make_node("Add", ["rn", "ru"], ["r2"], name="add_r2"),
        oh.make_node("Add", ["r1", "r2"], ["r3"], name="add_r3"),
        oh.make_node("Mul", ["r3", "zero"], ["r0"], name="mul_zero"),
        oh.make_node("Add", ["x", "r0"], ["x1"], name="add_noise"),
        oh.make_node("EyeLike", ["W_sq"], ["eye"], name="eye_like", dtype=F32),
        oh.make_node("MatMul", ["x1", "eye"], ["xe"], name="mm_eye"),
        oh.make_node("MatMul", ["xe", "W"], ["m"], name="mm_w"),
        oh.make_node("EyeLike", ["m"], ["eye2"], name="eye_like_nodtype"),
        oh.make_node("Add", ["m", "eye2"], ["m2"], name="add_eye2"),
        oh.make_node("Shape", ["x"], ["shp"], name="shape_x"),
        oh.make_node("ConstantOfShape", ["shp"], ["half"], name="cos_value",
                     value=nph.from_array(np.array([0.5], np.float32))),
        oh.make_node("ConstantOfShape", ["shp"], ["zeros"], name="cos_novalue"),
        oh.make_node("Mul", ["m2", "half"], ["m3"], name="mul_half"),
        oh.make_node("Add", ["m3", "zeros"], ["m4"], name="add_zeros"),
        oh.make_node("Cast", ["shp"], ["shpf"], name="cast_shape", to=F32),
        oh.make_node("ReduceSum", ["shpf"], ["nsum"], name="rsum_shape", keepdims=0),
        oh.make_node("Div", ["m4", "nsum"], ["y"], name="div_n"),
    ]
    inits = [_init("zero", 0.0), _init("W_sq", np.zeros([4, 4], np.float32)),
             _init("W", _w(121, [4, 4]))]
    return _model(nodes, [_vi("x", F32, [2, 4])], [_vi("y", F32, [2, 4])], inits,
                  name="case12")


# --------------------------------------------------------------------------- case 13
def case_13_output_consumed_and_empty():
    """Graph output y1 = MatMul(x, W1) is also consumed by Relu->MatMul (y2) and by
    Softmax (y3); a second input e has a 0-sized dim: MatMul -> Relu -> y_empty [0, 8]."""
    nodes = [
        oh.make_node("MatMul", ["x", "W1"], ["y1"], name="mm1"),
        oh.make_node("Relu", ["y1"], ["r"], name="relu"),
        oh.make_node("MatMul", ["r", "W2"], ["y2"], name="mm2"),
        oh.make_node("Softmax", ["y1"], ["y3"], name="softmax", axis=-1),
        oh.make_node("MatMul", ["e", "W1"], ["em"], name="mm_empty"),
        oh.make_node("Relu", ["em"], ["y_empty"], name="relu_empty"),
    ]
    inits = [_init("W1", _w(131, [8, 8])), _init("W2", _w(132, [8, 8]))]
    model = _model(nodes, [_vi("x", F32, [4, 8]), _vi("e", F32, [0, 8])],
                   [_vi("y1", F32, [4, 8]), _vi("y2", F32, [4, 8]), _vi("y3", F32, [4, 8]),
                    _vi("y_empty", F32, [0, 8])], inits, name="case13")
    feeds = {"x": _rng(133).standard_normal([4, 8]).astype(np.float32),
             "e": np.zeros([0, 8], np.float32)}
    return model, feeds


# --------------------------------------------------------------------------- case 14
#: tensor / node names a converter might generate for its own Casts
CASE_14_TRAP_NAMES = [
    "x_cast_fp16", "x_fp16", "x_to_fp16", "x_cast", "x_float16", "x_half", "x_f16",
    "Cast_0", "Cast_1", "Cast", "graphmp_cast_0", "graphmp_cast_1", "W_fp16", "W_half",
    "y_cast_fp32", "y_fp32", "graphmp/cast_0", "x__fp16",
    # graphmp.ir.Names bases fresh node names on the op type: "MatMul", "Relu_0", ...
    "MatMul", "MatMul_0", "Relu", "Relu_0",
]


def case_14_names() -> onnx.ModelProto:
    """Unnamed nodes and tensor/node names that collide with names a converter is likely
    to generate (CASE_14_TRAP_NAMES). No duplicate non-empty node names: ORT rejects
    those as invalid models."""
    nodes = [
        oh.make_node("MatMul", ["x", "W"], ["x_cast_fp16"]),                     # unnamed
        oh.make_node("Relu", ["x_cast_fp16"], ["Cast_0"]),                       # unnamed
        oh.make_node("MatMul", ["Cast_0", "W_fp16"], ["graphmp_cast_0"], name="Cast_0"),
        oh.make_node("Add", ["graphmp_cast_0", "x_fp16"], ["x_to_fp16"], name="graphmp_cast_0"),
        oh.make_node("Softmax", ["x_to_fp16"], ["Cast_1"], name="Cast", axis=-1),
        oh.make_node("MatMul", ["Cast_1", "W_half"], ["MatMul"], name="x_cast_fp16"),
        oh.make_node("Relu", ["MatMul"], ["x__fp16"]),                           # unnamed
        oh.make_node("ReduceSum", ["x__fp16", "axes1"], ["Relu_0"], name="Relu", keepdims=1),
        oh.make_node("Mul", ["x__fp16", "Relu_0"], ["y_cast_fp32"], name="MatMul_0"),
        oh.make_node("Identity", ["y_cast_fp32"], ["y"], name="graphmp_cast_1"),
    ]
    inits = [_init("W", _w(141, [8, 8])), _init("W_fp16", _w(142, [8, 8])),
             _init("x_fp16", _w(143, [8], 0.1)), _init("W_half", _w(144, [8, 8])),
             _i64("axes1", [1])]
    return _model(nodes, [_vi("x", F32, [4, 8])], [_vi("y", F32, [4, 8])], inits,
                  name="case14")


# --------------------------------------------------------------------------- case 15
def case_15_existing_fp16_parts():
    """An autocast-style export: x -> Cast(FLOAT16) -> MatMul(W16 fp16) -> Add(h fp16
    input) -> Cast(FLOAT) -> Softmax (a deliberate FP32 island) -> MatMul(W fp32) -> y."""
    nodes = [
        oh.make_node("Cast", ["x"], ["xh"], name="to_half", to=F16),
        oh.make_node("MatMul", ["xh", "W16"], ["mh"], name="mm_half"),
        oh.make_node("Add", ["mh", "h"], ["ah"], name="add_half"),
        oh.make_node("Cast", ["ah"], ["af"], name="to_float", to=F32),
        oh.make_node("Softmax", ["af"], ["sm"], name="softmax_island", axis=-1),
        oh.make_node("MatMul", ["sm", "W"], ["y"], name="mm_float"),
    ]
    inits = [_init("W16", _w(151, [8, 8]), np.float16), _init("W", _w(152, [8, 8]))]
    model = _model(nodes, [_vi("x", F32, [4, 8]), _vi("h", F16, [4, 8])],
                   [_vi("y", F32, [4, 8])], inits, name="case15")
    rng = _rng(153)
    return model, {"x": rng.standard_normal([4, 8]).astype(np.float32),
                   "h": rng.standard_normal([4, 8]).astype(np.float16)}


# --------------------------------------------------------------------------- case 16
def case_16_integer_count_cast():
    """Element count 90000 (> 65504) of a [1, 300, 300] input, via Shape->ReduceProd,
    Size and Shape->Gather*Gather, each Cast(to=FLOAT) and used by Div (mean) and by Mul
    with an fp16-class MatMul output."""
    nodes = [
        oh.make_node("ReduceSum", ["x"], ["sum_all"], name="rsum_all", keepdims=0),
        oh.make_node("Shape", ["x"], ["shp"], name="shape_x"),
        oh.make_node("ReduceProd", ["shp"], ["cnt"], name="rprod", keepdims=0),
        oh.make_node("Cast", ["cnt"], ["cnt_f"], name="count_cast", to=F32),
        oh.make_node("Div", ["sum_all", "cnt_f"], ["mean1"], name="mean_div"),
        oh.make_node("Size", ["x"], ["sz"], name="size_x"),
        oh.make_node("Cast", ["sz"], ["sz_f"], name="size_cast", to=F32),
        oh.make_node("Div", ["sum_all", "sz_f"], ["mean2"], name="mean_div2"),
        oh.make_node("Gather", ["shp", "i1"], ["d1"], name="gather1", axis=0),
        oh.make_node("Gather", ["shp", "i2"], ["d2"], name="gather2", axis=0),
        oh.make_node("Mul", ["d1", "d2"], ["d12"], name="mul_dims"),
        oh.make_node("Cast", ["d12"], ["d12_f"], name="gather_cast", to=F32),
        oh.make_node("Div", ["sum_all", "d12_f"], ["mean3"], name="mean_div3"),
        oh.make_node("MatMul", ["xs", "W"], ["hm"], name="mm_small"),
        oh.make_node("Mul", ["hm", "sz_f"], ["y_scaled"], name="mul_count"),
        oh.make_node("Unsqueeze", ["mean1", "ax0"], ["m1u"], name="unsq1"),
        oh.make_node("Unsqueeze", ["mean2", "ax0"], ["m2u"], name="unsq2"),
        oh.make_node("Unsqueeze", ["mean3", "ax0"], ["m3u"], name="unsq3"),
        oh.make_node("Concat", ["m1u", "m2u", "m3u"], ["y_means"], name="concat", axis=0),
    ]
    inits = [_i64("i1", 1), _i64("i2", 2), _i64("ax0", [0]), _init("W", _w(161, [16, 16]))]
    model = _model(nodes, [_vi("x", F32, [1, 300, 300]), _vi("xs", F32, [4, 16])],
                   [_vi("y_means", F32, [3]), _vi("y_scaled", F32, [4, 16])], inits,
                   name="case16")
    rng = _rng(162)
    return model, {"x": rng.uniform(0, 1, [1, 300, 300]).astype(np.float32),
                   "xs": rng.standard_normal([4, 16]).astype(np.float32)}


# --------------------------------------------------------------------------- case 17
CASE_17_RISKY = ("r_mm", "r_scale", "r_square", "r_rsum", "r_add")
CASE_17_BENIGN_FP16 = ("b_mm1", "b_relu", "b_mm2", "c_conv1", "c_conv2")


def _risky_and_benign(batch_dim, name):
    nodes = [
        # risky path (as case 5, scaled by 3000 so that r_scale (|.| ~ 6000) is far above
        # the 512 range threshold and r_square (~4e7) far above 65504 for any N(0,1) input)
        oh.make_node("MatMul", ["x", "Wr"], ["rm"], name="r_mm"),
        oh.make_node("Mul", ["rm", "c3000"], ["rs"], name="r_scale"),
        oh.make_node("Mul", ["rs", "rs"], ["rq"], name="r_square"),
        oh.make_node("ReduceSum", ["rq", "axes1"], ["rr"], name="r_rsum", keepdims=1),
        oh.make_node("Add", ["rr", "one"], ["y_risky"], name="r_add"),
        # benign MLP path
        oh.make_node("MatMul", ["x", "Wb1"], ["bm"], name="b_mm1"),
        oh.make_node("Relu", ["bm"], ["br"], name="b_relu"),
        oh.make_node("MatMul", ["br", "Wb2"], ["bo"], name="b_mm2"),
        oh.make_node("Add", ["bo", "bb"], ["y_benign"], name="b_add"),
        # benign conv path
        oh.make_node("Reshape", ["x", "img_shape"], ["img"], name="c_reshape"),
        oh.make_node("Conv", ["img", "Wc1"], ["cc1"], name="c_conv1", pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["cc1"], ["cr1"], name="c_relu"),
        oh.make_node("Conv", ["cr1", "Wc2"], ["y_conv"], name="c_conv2", pads=[1, 1, 1, 1]),
    ]
    inits = [_init("Wr", _w(171, [64, 64])), _init("c3000", 3000.0), _i64("axes1", [1]),
             _init("one", 1.0), _init("Wb1", _w(172, [64, 32])), _init("Wb2", _w(173, [32, 16])),
             _init("bb", _w(174, [16], 0.1)), _i64("img_shape", [-1, 4, 4, 4]),
             _init("Wc1", _w(175, [8, 4, 3, 3])), _init("Wc2", _w(176, [4, 8, 3, 3]))]
    return _model(nodes, [_vi("x", F32, [batch_dim, 64])],
                  [_vi("y_risky", F32, [batch_dim, 1]), _vi("y_benign", F32, [batch_dim, 16]),
                   _vi("y_conv", F32, [batch_dim, 4, 4, 4])], inits, name=name)


def case_17_search_robustness():
    """Case 5's overflow path next to benign MatMul and Conv paths: only the risky nodes
    (CASE_17_RISKY) may be kept FP32; CASE_17_BENIGN_FP16 must be FP16."""
    model = _risky_and_benign(4, "case17")
    return model, {"x": _rng(177).standard_normal([4, 64]).astype(np.float32)}


# --------------------------------------------------------------------------- case 18
#: APIs removed from onnx / numpy 2 that a converter must not use (regexes)
CASE_18_REMOVED_APIS = [
    r"onnx\.mapping", r"from onnx import mapping", r"np\.float_\b", r"np\.complex_\b",
    r"np\.bool8\b", r"np\.int0\b", r"np\.object\b(?!_)", r"np\.bool\b(?!_)",
    r"np\.int\b(?!_|\d)", r"np\.float\b(?!_|\d)", r"np\.product\b", r"np\.alltrue\b",
    r"np\.sometrue\b", r"np\.cumproduct\b", r"np\.NaN\b", r"np\.Inf\b", r"np\.PINF\b",
    r"np\.cast\b", r"np\.asfarray\b", r"np\.find_common_type\b", r"np\.round_\b",
    r"np\.string_\b", r"np\.unicode_\b", r"float32_to_float16\b",
    r"numpy_helper\.to_array\(.*\bbase_dir\b",
]


# --------------------------------------------------------------------------- case 19
def case_19_dynamic_batch():
    """Case 17's graph with a symbolic batch dim "batch". Returns (model, feeds_b1,
    feeds_b4): the batch-4 calibration contains the batch-1 row plus three rows with
    the same statistics, so a sound classification cannot depend on which one it saw."""
    model = _risky_and_benign("batch", "case19")
    x4 = _rng(191).standard_normal([4, 64]).astype(np.float32)
    return model, {"x": x4[:1].copy()}, {"x": x4}


# --------------------------------------------------------------------------- registry
#: in-memory cases: name -> builder returning a model or (model, feeds)
IN_MEMORY_CASES = {
    "01_resize_scales": case_01_resize_scales,
    "02_existing_cast_to_float": case_02_existing_cast_to_float,
    "03_shared_initializer": case_03_shared_initializer,
    "04_cascaded_casts": case_04_cascaded_casts,
    "05_activation_overflow": case_05_activation_overflow,
    "06_out_of_range_constants": case_06_out_of_range_constants,
    "09a_custom_op_no_schema": case_09a_custom_op_no_schema,
    "09b_com_microsoft_ops": case_09b_com_microsoft_ops,
    "10_control_flow": case_10_control_flow,
    "11_unsorted_nodes": case_11_unsorted_nodes,
    "12_dtype_attributes": case_12_dtype_attributes,
    "13_output_consumed_and_empty": case_13_output_consumed_and_empty,
    "14_names": case_14_names,
    "15_existing_fp16_parts": case_15_existing_fp16_parts,
    "16_integer_count_cast": case_16_integer_count_cast,
    "17_search_robustness": case_17_search_robustness,
    "19_dynamic_batch": lambda: case_19_dynamic_batch()[:2],
}
#: cases written to disk: name -> builder(tmp_path) returning a path
FILE_CASES = {
    "07_external_data": case_07_external_data,
    "08_large_model_scaled": case_08_large_model_scaled,
}
#: cases whose ops ORT / the plain ReferenceEvaluator cannot run or onnx cannot infer
CUSTOM_OP_CASES = {"09a_custom_op_no_schema", "09b_com_microsoft_ops"}
NO_ORT_CASES = {"09a_custom_op_no_schema"}
#: cases that are not valid ONNX on purpose (input checker must reject them)
INVALID_INPUT_CASES = {"11_unsorted_nodes"}


def build(name: str):
    """(model, feeds) for an in-memory case, feeds from default_feeds when not given."""
    out = IN_MEMORY_CASES[name]()
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, default_feeds(out)

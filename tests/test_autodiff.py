"""Gradient graphs of graphmp.train.autodiff checked against finite differences.

Every case is a tiny graph: op(s) -> loss = sum_k ReduceSum(y_k * R_k) with fixed random
R_k. add_backward() gives d(loss)/d(x) for every float graph input; ONNX Runtime (CPU) runs
that gradient graph and the result is compared with central differences of the forward
loss on a random subset of elements:

- in FP64 when ORT runs the forward and the gradient graph in double: h = 1e-5, so the
  truncation error is ~h^2 * |f'''| ~ 1e-10 and roundoff ~1e-16/h ~ 1e-11: rtol 1e-6;
- else the gradient graph runs in FP32 and the differences are taken on the FP64 model
  with onnx.reference (exact FP64 forward): the error is the FP32 gradient's own rounding,
  ~1e-7 relative per op times a few ops and sums of <= ~100 terms: rtol 1e-4 on the
  largest gradient (atol) and 1e-4 relative.
"""
from __future__ import annotations

import math
import os
import zlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from graphmp.errors import GraphmpError
from graphmp.model_runs import ort_session, run_reference
from graphmp.train.autodiff import add_backward, training_forward
from graphmp.train.rules import RULES

N = helper.make_node
F32, F16, F64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE
IR = 9


# --------------------------------------------------------------------------- harness
class Case:
    def __init__(self, id, nodes, feeds, inits=None, outs=("y",), opset=20, linear=False, prep=None,
                 fp32=False):
        self.id, self.nodes, self.feeds, self.inits = id, nodes, feeds, inits or {}
        self.fp32 = fp32  # ORT's double kernel computes in FP32 (Shrink): differentiate in FP32
        self.prep = prep  # applied to the loss model in place (e.g. training_forward)
        self.outs, self.opset = list(outs), opset
        # linear=True: the loss is linear in each single element (Conv, ConvTranspose), so
        # FP32 central differences with a large step are exact up to FP32 rounding of the loss
        self.linear = linear

    def __repr__(self):
        return self.id


def _rng(key: str):
    return np.random.default_rng(zlib.crc32(key.encode()))


def _cast(arrs: dict, dtype) -> dict:
    """Float64 arrays (the test data) to `dtype`; float32 ones are parameters that stay FP32."""
    return {k: (v.astype(dtype) if v.dtype == np.float64 else v) for k, v in arrs.items()}


def _vi(name, arr):
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape)


class Erf(OpRun):
    """onnx.reference's Erf computes in float32 whatever the input; this one keeps FP64."""
    op_domain = ""

    def _run(self, x):
        return (np.vectorize(math.erf, otypes=[x.dtype])(x),)


class Gelu(OpRun):
    """FP64 Gelu (onnx.reference expands the function with FP32 constants, ~1e-8 off)."""
    op_domain = ""

    def _run(self, x, approximate="none"):
        if approximate == "tanh":
            return (0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),)
        return (0.5 * x * (1 + np.vectorize(math.erf, otypes=[x.dtype])(x / math.sqrt(2))),)


def reference(model):
    return ReferenceEvaluator(model, new_ops=[Erf, Gelu])


def loss_model(case: Case, dtype) -> tuple[onnx.ModelProto, dict]:
    """Forward model of `case` in `dtype` whose one output is the scalar `loss`."""
    feeds = _cast(case.feeds, dtype)
    inits = _cast(case.inits, dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    f32, i32 = _cast(case.feeds, np.float32), _cast(case.inits, np.float32)
    probe = helper.make_model(
        helper.make_graph(case.nodes, "probe", [_vi(k, v) for k, v in f32.items()],
                          [helper.make_tensor_value_info(o, F32, None) for o in case.outs],
                          [numpy_helper.from_array(v, k) for k, v in i32.items()]),
        opset_imports=[helper.make_opsetid("", case.opset)], ir_version=IR)
    sess = ort_session(probe)
    shapes = {o: a.shape for o, a in zip(case.outs, sess.run(case.outs, f32))}
    rng = _rng(case.id + "R")
    extra, terms = [], []
    for o in case.outs:
        r = np.asarray(rng.standard_normal(shapes[o])).astype(dtype)
        inits[f"R_{o}"] = r
        extra += [N("Mul", [o, f"R_{o}"], [f"m_{o}"]), N("ReduceSum", [f"m_{o}"], [f"s_{o}"], keepdims=0)]
        terms.append(f"s_{o}")
    extra.append(N("Sum", terms, ["loss"]))
    graph = helper.make_graph(list(case.nodes) + extra, case.id, [_vi(k, v) for k, v in feeds.items()],
                              [helper.make_tensor_value_info("loss", elem, [])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)], ir_version=IR)
    if case.prep:
        case.prep(model)
    return model, feeds


def backward(model, wrt, **kw):
    """Copy of `model` with add_backward applied and the gradients as outputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    grads = add_backward(m, "loss", wrt, **kw)
    declared = {v.name: v.type for v in list(m.graph.input) + list(m.graph.value_info)}
    for t in m.graph.initializer:
        declared[t.name] = helper.make_tensor_type_proto(t.data_type, list(t.dims))
    for w, gname in grads.items():
        m.graph.output.append(helper.make_value_info(gname, declared[w]))  # same dtype and shape as w
    return m, grads


def float_inputs(feeds):
    return [k for k, v in feeds.items() if v.dtype.kind == "f"]


def finite_differences(run_loss, feeds, name, idx, h):
    out = []
    for i in idx:
        plus, minus = dict(feeds), dict(feeds)
        p, m = feeds[name].copy(), feeds[name].copy()
        p.flat[i] += h
        m.flat[i] -= h
        plus[name], minus[name] = p, m
        out.append((run_loss(plus) - run_loss(minus)) / (2 * h))
    return np.array(out)


def check_gradients(case: Case, n_check=8):
    """Gradient graph vs central differences; returns the dtype the gradient graph ran in."""
    m64, f64 = loss_model(case, np.float64)
    wrt = float_inputs(f64)
    try:
        if case.fp32:
            raise RuntimeError("NOT_IMPLEMENTED (in double precision)")
        b64, grads = backward(m64, wrt)
        sess, fsess = ort_session(b64), ort_session(m64)
        dtype = np.float64
    except Exception as e:  # ORT has no double kernel for some op: run the gradient in FP32
        if not any(s in str(e) for s in ("NOT_IMPLEMENTED", "Could not find an implementation",
                                         "Type 'tensor(double)' of input parameter")):
            raise  # the last one: an op whose schema has no double (Celu)
        dtype = np.float32
    if dtype == np.float32:
        m32, f32 = loss_model(case, np.float32)
        b32, grads = backward(m32, wrt)
        onnx.checker.check_model(b32, full_check=True)
        sess = ort_session(b32)
        got = dict(zip(grads.values(), sess.run(list(grads.values()), f32)))
        if case.linear:  # onnx.reference lacks some of these (grouped ConvTranspose)
            fsess32 = ort_session(m32)
            run_loss = lambda fd: float(fsess32.run(None, _cast(fd, np.float32))[0])  # noqa: E731
            h = 0.5
        else:
            ref = reference(m64)
            run_loss = lambda fd: float(ref.run(None, fd)[0])  # noqa: E731
            h = 1e-5
        rtol = 1e-4
    else:
        onnx.checker.check_model(b64, full_check=True)
        got = dict(zip(grads.values(), sess.run(list(grads.values()), f64)))
        run_loss = lambda fd: float(fsess.run(None, fd)[0])  # noqa: E731
        rtol = 1e-6
        h = 1e-5
    rng = _rng(case.id + "pick")
    for w in wrt:
        g = got[grads[w]]
        assert g.shape == f64[w].shape and g.dtype == dtype, (w, g.shape, g.dtype)
        size = f64[w].size
        idx = np.arange(size) if size <= n_check else rng.choice(size, n_check, replace=False)
        fd = finite_differences(run_loss, f64, w, idx, h)
        scale = max(np.abs(g).max(), np.abs(fd).max(), 1e-3)
        np.testing.assert_allclose(g.reshape(-1)[idx], fd, rtol=rtol, atol=rtol * scale,
                                   err_msg=f"{case.id}: d loss / d {w}")
    return dtype


# --------------------------------------------------------------------------- cases
def _r(key, *shape, lo=None):
    x = np.asarray(_rng(key).standard_normal(shape))
    if lo is not None:  # keep away from kinks / the domain edge: |x| >= lo
        x = np.sign(x) * (np.abs(x) + lo)
    return x


def _distinct(key, *shape):
    """Values with no ties (for max pooling / Max)."""
    n = int(np.prod(shape))
    return (_rng(key).permutation(n) / n * 4 - 2).reshape(shape) + 0.01


def _binary(op, sa, sb, positive_b=False):
    b = _r(op + str(sb), *sb)
    if positive_b:
        b = np.asarray(np.abs(b) + 0.5)
    return Case(f"{op}-{sa}-{sb}", [N(op, ["a", "b"], ["y"])], {"a": _r(op + str(sa), *sa), "b": b})


def _unary(op, x, **attrs):
    return Case(f"{op}{attrs or ''}", [N(op, ["x"], ["y"], **attrs)], {"x": x})


def _i64(v):
    return np.array(v, dtype=np.int64)


CASES = [
    *[_binary(op, sa, sb, positive_b=op == "Div")
      for op in ("Add", "Sub", "Mul", "Div")
      for sa, sb in [((2, 3, 4), (3, 1)), ((1, 3), (2, 1)), ((2, 3), ()), ((3,), (2, 3))]],
    # MatMul: plain, batched, broadcast batch, 1-D operands
    *[_binary("MatMul", sa, sb) for sa, sb in [((3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)), ((2, 1, 3, 4), (3, 4, 5)),
                                                ((2, 3, 4), (4, 5)), ((4,), (2, 4, 5)), ((2, 3, 4), (4,)), ((4,), (4,)),
                                                # a 2-D operand of a batched product: one Gemm over the flat batch
                                                ((2, 3, 2, 4), (4, 5)), ((3, 4), (2, 4, 5)), ((3, 4), (2, 2, 4, 5))]],
    *[Case(f"Gemm-tA{ta}-tB{tb}-C{cs}-a{al}", [N("Gemm", ["a", "b", "c"] if cs else ["a", "b"], ["y"],
                                                 transA=ta, transB=tb, alpha=al, beta=0.7)],
           {"a": _r("ga", *((4, 3) if ta else (3, 4))), "b": _r("gb", *((5, 4) if tb else (4, 5))),
            **({"c": _r("gc", *cs)} if cs else {})})
      for ta, tb, cs, al in [(0, 0, (5,), 1.0), (1, 0, (3, 5), 0.5), (0, 1, (1, 5), 2.0), (1, 1, (3, 1), 1.0),
                             (0, 0, None, 1.5)]],
    _unary("Relu", _r("relu", 3, 4, lo=0.05)),
    _unary("LeakyRelu", _r("lrelu", 3, 4, lo=0.05), alpha=0.2),
    _unary("Sigmoid", _r("sig", 3, 4)),
    _unary("Tanh", _r("tanh", 3, 4)),
    _unary("Erf", _r("erf", 3, 4)),
    _unary("Gelu", _r("gelu", 3, 4)),
    _unary("Gelu", _r("gelut", 3, 4), approximate="tanh"),
    _unary("Exp", _r("exp", 3, 4)),
    _unary("Log", np.abs(_r("log", 3, 4)) + 0.3),
    _unary("Sqrt", np.abs(_r("sqrt", 3, 4)) + 0.3),
    _unary("Neg", _r("neg", 3, 4)),
    _unary("Abs", _r("abs", 3, 4, lo=0.05)),
    _unary("Reciprocal", _r("rec", 3, 4, lo=0.3)),
    _unary("Identity", _r("id", 3, 4)),
    *[_unary("Softmax", _r("sm", 2, 3, 4), axis=a) for a in (-1, 1, 0)],
    *[_unary("LogSoftmax", _r("lsm", 2, 3, 4), axis=a) for a in (-1, 1)],
    _unary("Dropout", _r("drop", 3, 4)),  # inference mode: identity
    Case("Pow-const2", [N("Pow", ["x", "e"], ["y"])], {"x": _r("pow", 3, 4)}, {"e": np.array(2.0)}),
    Case("Pow-const3", [N("Pow", ["x", "e"], ["y"])], {"x": _r("pow3", 3, 4)}, {"e": np.array(3.0)}),
    Case("Pow-tensor", [N("Pow", ["x", "e"], ["y"])], {"x": np.abs(_r("powt", 3, 4)) + 0.5, "e": _r("powe", 4)}),
    Case("Where", [N("Where", ["c", "a", "b"], ["y"])],
         {"c": _rng("wc").random((3, 4)) > 0.5, "a": _r("wa", 3, 4), "b": _r("wb", 4)}),
    Case("Clip", [N("Clip", ["x", "lo", "hi"], ["y"])], {"x": _r("clip", 4, 5, lo=0.02)},
         {"lo": np.array(-0.5), "hi": np.array(0.8)}),
    Case("Max", [N("Max", ["a", "b"], ["y"])], {"a": _distinct("maxa", 3, 4), "b": _distinct("maxb", 4) + 0.003}),
    Case("Min", [N("Min", ["a", "b"], ["y"])], {"a": _distinct("mina", 3, 4), "b": _distinct("minb", 3, 4) + 0.003}),
    Case("Sum3", [N("Sum", ["a", "b", "c"], ["y"])], {"a": _r("sa", 2, 3), "b": _r("sb", 3), "c": _r("sc", 2, 1)}),
    Case("Expand", [N("Expand", ["x", "s"], ["y"])], {"x": _r("exp", 3, 1)}, {"s": _i64([2, 3, 4])}),
    # data movement
    Case("Reshape", [N("Reshape", ["x", "s"], ["y"])], {"x": _r("rs", 2, 3, 4)}, {"s": _i64([4, -1])}),
    Case("Flatten-axis2", [N("Flatten", ["x"], ["y"], axis=2)], {"x": _r("fl", 2, 3, 4, 2)}),
    Case("Transpose", [N("Transpose", ["x"], ["y"], perm=[2, 0, 1])], {"x": _r("tr", 2, 3, 4)}),
    Case("Transpose-default", [N("Transpose", ["x"], ["y"])], {"x": _r("trd", 2, 3, 4)}),
    Case("Squeeze", [N("Squeeze", ["x", "ax"], ["y"])], {"x": _r("sq", 2, 1, 4)}, {"ax": _i64([1])}),
    Case("Unsqueeze", [N("Unsqueeze", ["x", "ax"], ["y"])], {"x": _r("usq", 2, 4)}, {"ax": _i64([0, 3])}),
    Case("Concat", [N("Concat", ["a", "b", "c"], ["y"], axis=1)],
         {"a": _r("ca", 2, 3), "b": _r("cb", 2, 1), "c": _r("cc", 2, 4)}),
    Case("Split", [N("Split", ["x", "sp"], ["y", "z"], axis=1)], {"x": _r("split", 2, 5)}, {"sp": _i64([2, 3])},
         outs=("y", "z")),
    Case("Split-one-used", [N("Split", ["x", "sp"], ["y", "z"], axis=0)], {"x": _r("split1", 4, 3)},
         {"sp": _i64([1, 3])}, outs=("z",)),
    *[Case(f"Slice-{k}", [N("Slice", ["x", "st", "en", "ax", "stp"], ["y"])], {"x": _r("sl" + k, 4, 5, 6)},
           {"st": _i64(st), "en": _i64(en), "ax": _i64(ax), "stp": _i64(sp)})
      for k, st, en, ax, sp in [("step2", [1, 0], [4, 6], [0, 2], [2, 2]),
                                ("negstep", [-1], [-100], [1], [-2]),
                                ("clamp", [2, -3], [100, -1], [2, 0], [1, 1])]],
    Case("Gather-axis0-repeat", [N("Gather", ["x", "i"], ["y"], axis=0)], {"x": _r("ga0", 5, 3)},
         {"i": _i64([[0, 2], [2, -1], [0, 0]])}),
    Case("Gather-axis1", [N("Gather", ["x", "i"], ["y"], axis=1)], {"x": _r("ga1", 2, 5, 3)}, {"i": _i64([4, 1, 4])}),
    Case("Gather-scalar", [N("Gather", ["x", "i"], ["y"], axis=1)], {"x": _r("gas", 2, 5, 3)}, {"i": _i64(3)}),
    # reductions (opset 13: ReduceMean axes attribute; 18+: input)
    *[Case(f"ReduceSum-k{k}-{ax}", [N("ReduceSum", ["x", "ax"], ["y"], keepdims=k)], {"x": _r("rsum", 2, 3, 4)},
           {"ax": _i64(ax)}) for k in (0, 1) for ax in ([1], [0, 2], [-1])],
    Case("ReduceSum-all", [N("ReduceSum", ["x"], ["y"], keepdims=0)], {"x": _r("rsa", 2, 3)}),
    Case("ReduceSum-noop", [N("ReduceSum", ["x"], ["y"], noop_with_empty_axes=1)], {"x": _r("rsn", 2, 3)}),
    *[Case(f"ReduceMean-k{k}-{ax}", [N("ReduceMean", ["x", "ax"], ["y"], keepdims=k)], {"x": _r("rmean", 2, 3, 4)},
           {"ax": _i64(ax)}) for k in (0, 1) for ax in ([1], [0, 2])],
    Case("ReduceMean-opset13-attr", [N("ReduceMean", ["x"], ["y"], axes=[1, 2], keepdims=0)],
         {"x": _r("rm13", 2, 3, 4)}, opset=13),
    Case("ReduceSum-opset13", [N("ReduceSum", ["x", "ax"], ["y"], keepdims=0)], {"x": _r("rs13", 2, 3, 4)},
         {"ax": _i64([0])}, opset=13),
    Case("MSE", [N("Sub", ["p", "t"], ["d"]), N("Pow", ["d", "two"], ["d2"]), N("ReduceMean", ["d2"], ["y"], keepdims=0)],
         {"p": _r("msep", 4, 3), "t": _r("mset", 4, 3)}, {"two": np.array(2.0)}),
    Case("MSE-mul", [N("Sub", ["p", "t"], ["d"]), N("Mul", ["d", "d"], ["d2"]), N("ReduceMean", ["d2"], ["y"], keepdims=0)],
         {"p": _r("msem", 4, 3)}, {"t": _r("msemt", 4, 3)}),
    # normalisation
    *[Case(f"LayerNorm-axis{ax}-bias{b}", [N("LayerNormalization", ["x", "s", "b"] if b else ["x", "s"], ["y"],
                                             axis=ax, epsilon=1e-5)],
           {"x": _r("ln", 2, 3, 4), "s": _r("lns", *([4] if ax == -1 else [3, 4])),
            **({"b": _r("lnb", *([4] if ax == -1 else [3, 4]))} if b else {})}, opset=17)
      for ax, b in [(-1, True), (1, True), (-1, False)]],
    Case("LayerNorm-mean-out", [N("LayerNormalization", ["x", "s", "b"], ["y", "mu", "inv"], axis=-1)],
         {"x": _r("lnm", 3, 5), "s": _r("lnms", 5), "b": _r("lnmb", 5)}, opset=17),
    Case("BatchNorm-inference", [N("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-3)],
         {"x": _r("bn", 2, 3, 4, 4), "s": _r("bns", 3), "b": _r("bnb", 3)},
         {"m": _r("bnm", 3), "v": np.abs(_r("bnv", 3)) + 0.5}),
    # softmax cross-entropy / NLL (integer labels)
    *[Case(f"SCE-{red}-ign{ig}-w{w}", [N("SoftmaxCrossEntropyLoss", ["s", "lab"] + (["w"] if w else []), ["y"],
                                         reduction=red, **({"ignore_index": ig} if ig is not None else {}))],
           {"s": _r("sce", 4, 5)},
           {"lab": _i64([1, 4, 0, 4]), **({"w": np.abs(_r("scew", 5)) + 0.2} if w else {})})
      for red, ig, w in [("mean", None, False), ("sum", None, False), ("none", None, False),
                         ("mean", 4, False), ("mean", None, True), ("mean", 0, True), ("none", 4, True)]],
    Case("SCE-rank3-logprob", [N("SoftmaxCrossEntropyLoss", ["s", "lab"], ["y", "lp"])],
         {"s": _r("sce3", 2, 4, 3)}, {"lab": _i64([[0, 3, 1], [2, 2, 0]])}),
    Case("SCE-int32-labels", [N("SoftmaxCrossEntropyLoss", ["s", "lab"], ["y"])],
         {"s": _r("sce32", 3, 4)}, {"lab": np.array([3, 0, 1], np.int32)}),
    Case("NLL-mean-ign", [N("LogSoftmax", ["s"], ["lp"], axis=1),
                          N("NegativeLogLikelihoodLoss", ["lp", "lab"], ["y"], ignore_index=1)],
         {"s": _r("nll", 4, 5)}, {"lab": _i64([1, 4, 0, 3])}),
    # convolution and pooling
    *[Case(f"Conv-{k}", [N("Conv", ["x", "w", "b"] if bias else ["x", "w"], ["y"], **at)],
           {"x": _r("cx" + k, *xs), "w": _r("cw" + k, *ws), **({"b": _r("cb" + k, ws[0])} if bias else {})})
      for k, xs, ws, bias, at in [
          ("basic", (2, 3, 5, 5), (4, 3, 3, 3), True, {}),
          ("stride2-pad1", (2, 3, 6, 7), (4, 3, 3, 3), False, dict(strides=[2, 2], pads=[1, 1, 1, 1])),
          ("asympad-stride", (1, 2, 7, 6), (3, 2, 2, 3), True, dict(strides=[2, 3], pads=[0, 1, 2, 1])),
          ("dilation2", (1, 2, 7, 7), (3, 2, 3, 3), True, dict(dilations=[2, 2], pads=[1, 2, 1, 2])),
          ("group2", (2, 4, 5, 5), (6, 2, 3, 3), True, dict(group=2, pads=[1, 1, 1, 1])),
          ("depthwise", (2, 3, 6, 6), (3, 1, 3, 3), True, dict(group=3, strides=[2, 2], pads=[1, 1, 1, 1])),
          ("1d", (2, 3, 9), (4, 3, 3), True, dict(strides=[2], pads=[1, 0])),
          ("same-upper", (1, 2, 5, 6), (3, 2, 3, 3), False, dict(auto_pad="SAME_UPPER", strides=[2, 2])),
          ("1x1-stride2", (2, 4, 7, 6), (5, 4, 1, 1), False, dict(strides=[2, 2])),
          ("1x1-pad", (2, 3, 4, 4), (2, 3, 1, 1), True, dict(pads=[1, 0, 0, 1])),
          ("3x3-stride2-asympad", (2, 3, 8, 7), (4, 3, 3, 3), False, dict(strides=[2, 2], pads=[1, 0, 0, 1])),
          ("group2-stride2-dil", (2, 4, 9, 8), (6, 2, 3, 2), True,
           dict(group=2, strides=[2, 1], dilations=[1, 2], pads=[1, 1, 0, 1])),
          ("depthwise-mult2", (2, 2, 5, 5), (4, 1, 3, 3), False, dict(group=2, pads=[1, 1, 1, 1])),
          ("1d-dil-stride3", (2, 2, 11), (3, 2, 2), False, dict(strides=[3], dilations=[2], pads=[0, 2])),
          ("3d", (1, 2, 4, 5, 4), (3, 2, 2, 3, 2), True, dict(strides=[1, 2, 1], pads=[1, 0, 0, 0, 1, 1])),
          ("stride4-outpad3", (1, 2, 10, 9), (3, 2, 3, 3), False, dict(strides=[4, 4])),  # dX output_padding 3, 2
      ]],
    *[Case(f"ConvTranspose-{k}", [N("ConvTranspose", ["x", "w", "b"], ["y"], **at)],
           {"x": _r("tx" + k, *xs), "w": _r("tw" + k, *ws), "b": _r("tb" + k, ws[1] * at.get("group", 1))},
           linear=True)
      for k, xs, ws, at in [
          ("basic", (2, 3, 4, 4), (3, 2, 3, 3), {}),
          ("stride2-pad-outpad", (1, 2, 4, 3), (2, 3, 3, 3), dict(strides=[2, 2], pads=[1, 0, 1, 1],
                                                                   output_padding=[1, 1])),
          ("group2-dil", (2, 4, 3, 3), (4, 1, 2, 2), dict(group=2, dilations=[2, 1])),
          ("1d-stride3-pad", (2, 3, 4), (3, 2, 3), dict(strides=[3], pads=[1, 0])),
          ("3d-stride2", (1, 2, 2, 3, 2), (2, 2, 2, 2, 3), dict(strides=[2, 1, 2], pads=[0, 1, 0, 1, 0, 1])),
      ]],
    *[Case(f"MaxPool-{k}", [N("MaxPool", ["x"], ["y"], **at)], {"x": _distinct("mp" + k, 2, 2, 6, 7)})
      for k, at in [("k2s2", dict(kernel_shape=[2, 2], strides=[2, 2])),
                    ("overlap-pad", dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])),
                    ("k3s2-pad", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
                    ("dil-ceil", dict(kernel_shape=[2, 2], strides=[2, 2], dilations=[2, 1], ceil_mode=1))]],
    Case("MaxPool-with-indices", [N("MaxPool", ["x"], ["y", "i"], kernel_shape=[3], strides=[2])],
         {"x": _distinct("mpi", 2, 3, 9)}),
    *[Case(f"AveragePool-{k}", [N("AveragePool", ["x"], ["y"], **at)], {"x": _r("ap" + k, 2, 2, 6, 7)})
      for k, at in [("k2s2", dict(kernel_shape=[2, 2], strides=[2, 2])),
                    ("k3s2-pad-excl", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 0])),
                    ("k3s2-pad-incl", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 0],
                                           count_include_pad=1)),
                    ("k3s1-overlap", dict(kernel_shape=[3, 2], strides=[1, 1])),
                    ("k2s3-pad-uneven", dict(kernel_shape=[2, 3], strides=[3, 2], pads=[0, 1, 1, 0]))]],
    _unary("GlobalAveragePool", _r("gap", 2, 3, 4, 5)),
    Case("Mean3", [N("Mean", ["a", "b", "c"], ["y"])], {"a": _r("ma", 2, 3), "b": _r("mb", 3), "c": _r("mc", 2, 1)}),
    Case("CastLike-f64", [N("CastLike", ["x", "like"], ["y"])], {"x": _r("cl", 3, 4)}, {"like": np.array([1.0])}),
    # activations and trigonometric ops (inputs kept away from kinks)
    *[_unary("HardSigmoid", _r("hsig" + str(a), 3, 5, lo=0.05) * 3, **a)
      for a in ({}, {"alpha": 0.3, "beta": 0.4})],
    _unary("HardSwish", np.concatenate([_r("hsw", 3, 4) * 2, _r("hsw2", 1, 4, lo=3.1)])),
    *[_unary("Elu", _r("elu" + str(a), 3, 4, lo=0.05), **a) for a in ({}, {"alpha": 0.5})],
    _unary("Selu", _r("selu", 3, 4, lo=0.05)),
    _unary("Selu", _r("selu2", 3, 4, lo=0.05), alpha=1.2, gamma=0.9),
    *[_unary("Celu", _r("celu" + str(a), 3, 4, lo=0.05), **a) for a in ({}, {"alpha": 2.0})],
    _unary("ThresholdedRelu", _r("trelu", 3, 4, lo=0.05) + 0.5, alpha=0.7),
    _unary("Softplus", _r("splus", 3, 4) * 3),
    _unary("Softsign", _r("ssign", 3, 4) * 2),
    Case("Mish", [N("Mish", ["x"], ["y"])], {"x": _r("mish", 3, 4) * 2}, opset=18),
    _unary("Sin", _r("sin", 3, 4) * 3),
    _unary("Cos", _r("cos", 3, 4) * 3),
    _unary("Tan", _r("tan", 3, 4) * 0.5),
    _unary("Atan", _r("atan", 3, 4) * 2),
    _unary("Sinh", _r("sinh", 3, 4)),
    _unary("Cosh", _r("cosh", 3, 4)),
    *[Case(f"PRelu-slope{s}", [N("PRelu", ["x", "s"], ["y"])],
           {"x": _r("prx" + str(s), 2, 3, 4, 2, lo=0.05), "s": _r("prs" + str(s), *s)})
      for s in [(3, 1, 1), (1,), (2,), (4, 2), (2, 3, 4, 2)]],
    # InstanceNormalization (the decomposition of GroupNorm in torch exports)
    *[Case(f"InstanceNorm-{len(xs)}d", [N("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=eps)],
           {"x": _r("in" + str(xs), *xs), "s": _r("ins" + str(xs), xs[1]), "b": _r("inb" + str(xs), xs[1])})
      for xs, eps in [((2, 3, 4, 5), 1e-5), ((3, 2, 6), 1e-2)]],
    # GroupNormalization-21 (stash_type double: the FP64 forward must not round to FP32)
    *[Case(f"GroupNorm-G{gr}", [N("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=gr, epsilon=1e-3,
                                  stash_type=F64)],
           {"x": _r(f"gn{gr}", 2, 4, 3, 2), "s": _r(f"gns{gr}", 4), "b": _r(f"gnb{gr}", 4)}, opset=21)
      for gr in (2, 4, 1)],
    # reductions with a distinct extreme (ties: test_reduce_max_splits_ties_evenly)
    *[Case(f"{op}-k{k}-{ax}", [N(op, ["x", "ax"] if ax else ["x"], ["y"], keepdims=k)],
           {"x": _distinct(op + str(ax) + str(k), 2, 3, 4)}, {"ax": _i64(ax)} if ax else {}, opset=18)
      for op in ("ReduceMax", "ReduceMin") for k, ax in [(1, [1]), (0, [0, 2]), (0, None), (1, [-1])]],
    Case("ReduceMax-opset13-attr", [N("ReduceMax", ["x"], ["y"], axes=[2], keepdims=0)],
         {"x": _distinct("rmx13", 2, 3, 4)}, opset=13),
    *[Case(f"{op}-k{k}", [N(op, ["x", "ax"], ["y"], keepdims=k)], {"x": _r(op, 2, 3, 4, lo=0.1)},
           {"ax": _i64([1])}, opset=18)
      for op in ("ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSumExp") for k in (0, 1)],
    Case("ReduceLogSum", [N("ReduceLogSum", ["x", "ax"], ["y"], keepdims=0)], {"x": np.abs(_r("rls", 2, 3, 4)) + 0.5},
         {"ax": _i64([0, 2])}, opset=18),
    # CumSum: every (exclusive, reverse) pair, axis as a constant input
    *[Case(f"CumSum-ex{e}-rev{r}-ax{a}", [N("CumSum", ["x", "ax"], ["y"], exclusive=e, reverse=r)],
           {"x": _r("cs", 3, 4, 2)}, {"ax": _i64(a)})
      for e in (0, 1) for r in (0, 1) for a in (1, -1)],
    # Pad: pads (and axes) as inputs; negative pads crop; constant value gets a gradient
    *[Case(f"Pad-{m}-{p}", [N("Pad", ["x", "p"], ["y"], mode=m)], {"x": _r("pad" + m + str(p), 2, 3, 4)},
           {"p": _i64(p)}, opset=19 if m == "wrap" else 18)
      for m in ("constant", "reflect", "edge", "wrap")
      for p in ([0, 1, 2, 1, 0, 2], [1, 0, 1, 0, 2, 3])],
    Case("Pad-constant-negative", [N("Pad", ["x", "p"], ["y"])], {"x": _r("padn", 2, 5, 4)},
         {"p": _i64([0, -1, 2, 1, -2, 0])}, opset=13),
    Case("Pad-constant-value-axes", [N("Pad", ["x", "p", "v", "ax"], ["y"])], {"x": _r("padv", 2, 3, 4),
         "v": np.array(0.7)}, {"p": _i64([1, 2]), "ax": _i64([-1])}, opset=18),
    Case("Pad-reflect-axes", [N("Pad", ["x", "p", "", "ax"], ["y"], mode="reflect")], {"x": _r("padra", 2, 4, 5)},
         {"p": _i64([2, 1, 3, 0]), "ax": _i64([1, 2])}, opset=18),
    # Tile, DepthToSpace / SpaceToDepth, Trilu
    *[Case(f"Tile-{r}", [N("Tile", ["x", "r"], ["y"])], {"x": _r("tile" + str(r), 2, 3, 2)}, {"r": _i64(r)})
      for r in ([1, 2, 3], [3, 1, 1], [2, 2, 2])],
    *[Case(f"DepthToSpace-{m}-b{b}", [N("DepthToSpace", ["x"], ["y"], blocksize=b, mode=m)],
           {"x": _r("d2s" + m + str(b), 2, 4 * b * b // 2, 3, 2)}) for m in ("DCR", "CRD") for b in (2, 3)],
    *[Case(f"SpaceToDepth-b{b}", [N("SpaceToDepth", ["x"], ["y"], blocksize=b)],
           {"x": _r("s2d" + str(b), 2, 3, 2 * b, 3 * b)}) for b in (2, 3)],
    *[Case(f"Trilu-upper{u}-k{k}", [N("Trilu", ["x", "k"], ["y"], upper=u)], {"x": _r("tri", 2, 4, 5)},
           {"k": _i64(k)}) for u in (0, 1) for k in (0, 1)],
    # Resize: nearest / linear, scales or sizes, several coordinate transformations (linear
    # in X: compared with ORT's own FP32 forward, which onnx.reference does not match for
    # tf_half_pixel_for_nn)
    *[Case(f"Resize-{m}-{ct}-{nm}-{k}",
           [N("Resize", ["x", "", "sc"] if k.startswith("scales") else ["x", "", "", "sz"], ["y"], mode=m,
              coordinate_transformation_mode=ct, **({"nearest_mode": nm} if m == "nearest" else {}))],
           {"x": _r("rsz" + m + ct + nm + k, *xs)},
           {"sc": np.array(v, np.float32)} if k.startswith("scales") else {"sz": _i64(v)}, linear=True)
      for m, ct, nm, k, xs, v in [
          ("nearest", "asymmetric", "floor", "scales2", (1, 2, 3, 4), [1, 1, 2, 2]),
          ("nearest", "half_pixel", "round_prefer_floor", "scales-down", (1, 2, 6, 4), [1, 1, 0.5, 0.75]),
          ("nearest", "tf_half_pixel_for_nn", "round_prefer_ceil", "sizes", (2, 1, 3, 5), [2, 1, 7, 3]),
          ("nearest", "align_corners", "ceil", "scales3", (1, 2, 3, 2), [1, 1, 3, 1.5]),
          ("linear", "half_pixel", "", "scales2", (1, 2, 3, 4), [1, 1, 2, 2]),
          ("linear", "pytorch_half_pixel", "", "sizes", (2, 2, 4, 3), [2, 2, 7, 1]),
          ("linear", "align_corners", "", "sizes", (1, 3, 4, 5), [1, 3, 7, 9]),
          ("linear", "asymmetric", "", "scales-down", (1, 1, 6, 5), [1, 1, 0.5, 0.6]),
          ("linear", "half_pixel", "", "scales-3d", (1, 2, 3, 4, 2), [1, 1, 2, 1.5, 2]),
      ]],
    Case("Resize-sizes-from-shape", [N("Shape", ["x"], ["s"]), N("Slice", ["s", "z", "two"], ["nc"]),
                                     N("Concat", ["nc", "hw"], ["sz"], axis=0),
                                     N("Resize", ["x", "", "", "sz"], ["y"], mode="linear")],
         {"x": _r("rszdyn", 2, 1, 3, 4)}, {"z": _i64([0]), "two": _i64([2]), "hw": _i64([5, 7])}, linear=True),
    _unary("GlobalMaxPool", _distinct("gmp", 2, 3, 4, 5)),
    *[Case(f"Shrink{a}", [N("Shrink", ["x"], ["y"], **a)], {"x": _r("shr" + str(a), 3, 5, lo=0.05) * 1.5},
           fp32=True) for a in ({}, {"lambd": 0.2, "bias": 0.1})],
    Case("GatherElements-axis1", [N("GatherElements", ["x", "i"], ["y"], axis=1)], {"x": _r("ge", 3, 4)},
         {"i": _i64([[0, 3, 3], [1, -1, 1], [2, 0, -4]])}),
    Case("GatherElements-axis0", [N("GatherElements", ["x", "i"], ["y"], axis=0)], {"x": _r("ge0", 3, 2)},
         {"i": _i64([[2, 0], [2, 2], [0, 1], [1, 1]])}),
    Case("ScatterElements-axis1", [N("ScatterElements", ["x", "i", "u"], ["y"], axis=1)],
         {"x": _r("sce_x", 3, 4), "u": _r("sce_u", 3, 2)}, {"i": _i64([[0, 3], [1, 2], [3, 0]])}),
    Case("ScatterND", [N("ScatterND", ["x", "i", "u"], ["y"])],
         {"x": _r("snd_x", 4, 3), "u": _r("snd_u", 2, 3)}, {"i": _i64([[1], [3]])}),
    *[Case(f"Swish{a}", [N("Swish", ["x"], ["y"], **a)], {"x": _r("swish", 3, 4) * 2}, opset=24)
      for a in ({}, {"alpha": 1.7})],
    _unary("Asin", np.tanh(_r("asin", 3, 4)) * 0.9),
    _unary("Acos", np.tanh(_r("acos", 3, 4)) * 0.9),
    _unary("Atanh", np.tanh(_r("atanh", 3, 4)) * 0.9),
    _unary("Asinh", _r("asinh", 3, 4) * 2),
    _unary("Acosh", np.abs(_r("acosh", 3, 4)) + 1.2),
    *[Case(f"RMSNorm-axis{ax}", [N("RMSNormalization", ["x", "s"], ["y"], axis=ax, epsilon=1e-3, stash_type=F64)],
           {"x": _r("rms" + str(ax), 2, 3, 4), "s": _r("rmss" + str(ax), *([4] if ax == -1 else [3, 4]))}, opset=23)
      for ax in (-1, 1)],
    *[Case(f"ReduceProd-{k}", [N("ReduceProd", ["x", "ax"], ["y"], keepdims=1)], {"x": x}, {"ax": _i64([1])}, opset=18)
      for k, x in [("nonzero", _r("rp", 2, 3, 4, lo=0.3)),
                   ("zeros", np.where(np.arange(24).reshape(2, 3, 4) % 7 == 0, 0.0, _r("rpz", 2, 3, 4, lo=0.3)))]],
    Case("ReduceProd-all-k0", [N("ReduceProd", ["x"], ["y"], keepdims=0)], {"x": _r("rpa", 2, 3, lo=0.5)}, opset=18),
    *[Case(f"TopK-{k}", [N("TopK", ["x", "k"], ["y", "i"], **at)], {"x": _distinct("topk" + k, 3, 5)},
           {"k": _i64([2])}) for k, at in [("last", {}), ("axis0-smallest", {"axis": 0, "largest": 0})]],
    Case("GatherND", [N("GatherND", ["x", "i"], ["y"])], {"x": _r("gnd", 3, 4, 2)},
         {"i": _i64([[0, 1], [2, -1], [0, 1]])}),
    # Einsum: matmul-like, batched, with an index only in one operand, transposed output
    *[Case(f"Einsum-{eq}", [N("Einsum", ["a", "b"], ["y"], equation=eq)],
           {"a": _r("ea" + eq, *sa), "b": _r("eb" + eq, *sb)})
      for eq, sa, sb in [("ij,jk->ik", (3, 4), (4, 5)), ("bij,bjk->bki", (2, 3, 4), (2, 4, 5)),
                         ("ij,k->ik", (3, 4), (2,)), ("i,i->", (4,), (4,))]],
    # training mode: gradients through training_forward's decomposition (batch statistics)
    *[Case(f"BatchNorm-training-{k}", [N("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-3)],
           {"x": _r("bnt" + k, *xs), "s": _r("bnts" + k, xs[1]), "b": _r("bntb" + k, xs[1])},
           {"m": _r("bntm" + k, xs[1]), "v": np.abs(_r("bntv" + k, xs[1])) + 0.5}, prep=training_forward)
      for k, xs in [("4d", (3, 2, 3, 4)), ("2d", (5, 3))]],
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gradient_matches_finite_differences(case):
    check_gradients(case)


# Rules tested (also) by the dedicated tests below; the docs table lists them
TESTED_ELSEWHERE = {"Cast": "test_cast_gradient_returns_to_source_type, test_mixed_precision_contract",
                    "ReduceMax": "test_reduce_max_splits_ties_evenly",
                    "ReduceMin": "test_reduce_max_splits_ties_evenly"}


def test_every_rule_is_covered_by_a_case():
    tested = {n.op_type for c in CASES for n in c.nodes} | set(TESTED_ELSEWHERE)
    assert set(RULES) - tested == set()


# --------------------------------------------------------------------------- structure
def _graph_model(nodes, inputs, outputs, inits=(), opset=20):
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                             opset_imports=[helper.make_opsetid("", opset)], ir_version=IR)


def _emitted(before: onnx.ModelProto, after: onnx.ModelProto):
    return list(after.graph.node)[len(before.graph.node):]


def test_cast_gradient_returns_to_source_type():
    """FP32 x and FP64 z both enter an FP64 computation; an int64 i enters it by a Cast.
    The gradients come back in each input's own type; i gets none (and cannot be asked for)."""
    rng = _rng("cast")
    x = rng.standard_normal((3, 4)).astype(np.float32)
    z = rng.standard_normal((3, 4))
    i = rng.integers(-3, 4, (3, 4))
    r = rng.standard_normal((3, 4))
    nodes = [N("Cast", ["x"], ["x64"], to=F64), N("Cast", ["i"], ["i64f"], to=F64),
             N("CastLike", ["z", "x"], ["z32"]), N("Cast", ["z32"], ["z64"], to=F64),
             N("Mul", ["x64", "x64"], ["xx"]), N("Mul", ["z64", "i64f"], ["zi"]), N("Add", ["xx", "zi"], ["y"]),
             N("Mul", ["y", "r"], ["yr"]), N("ReduceSum", ["yr"], ["loss"], keepdims=0)]
    m = _graph_model(nodes, [_vi("x", x), _vi("z", z), _vi("i", i)], [helper.make_tensor_value_info("loss", F64, [])],
                     [numpy_helper.from_array(r, "r")])
    with pytest.raises(GraphmpError, match="not a floating-point"):
        add_backward(onnx.ModelProto.FromString(m.SerializeToString()), "loss", ["i"])
    b, grads = backward(m, ["x", "z"])
    onnx.checker.check_model(b, full_check=True)
    assert not any(n.op_type == "Cast" and helper.get_attribute_value(n.attribute[0]) == TensorProto.INT64
                   for n in _emitted(m, b))
    gx, gz = ort_session(b).run([grads["x"], grads["z"]], {"x": x, "z": z, "i": i})
    assert gx.dtype == np.float32 and gz.dtype == np.float64
    np.testing.assert_allclose(gx, (2 * x.astype(np.float64) * r).astype(np.float32), rtol=1e-6)
    np.testing.assert_array_equal(gz, (i * r).astype(np.float32).astype(np.float64))  # went through FP32


def test_accumulates_gradients_of_a_tensor_used_twice():
    """y = x*x + sin-free path x@W: dx = 2x*R + R@W^T; the two contributions are summed."""
    rng = _rng("acc")
    x, w, r = rng.standard_normal((3, 4)), rng.standard_normal((4, 4)), rng.standard_normal((3, 4))
    nodes = [N("Mul", ["x", "x"], ["sq"]), N("MatMul", ["x", "w"], ["xw"]), N("Add", ["sq", "xw"], ["y"]),
             N("Mul", ["y", "r"], ["yr"]), N("ReduceSum", ["yr"], ["loss"], keepdims=0)]
    m = _graph_model(nodes, [_vi("x", x)], [helper.make_tensor_value_info("loss", F64, [])],
                     [numpy_helper.from_array(w, "w"), numpy_helper.from_array(r, "r")])
    b, grads = backward(m, ["x"])
    (gx,) = ort_session(b).run([grads["x"]], {"x": x})
    np.testing.assert_allclose(gx, 2 * x * r + r @ w.T, rtol=1e-12)
    assert sum(n.op_type == "Sum" for n in _emitted(m, b)) >= 1


def test_only_nodes_on_the_path_get_gradients_and_names_are_fresh():
    """A branch that does not reach the loss, and one that does not depend on w, get no
    gradient nodes; a w that does not reach the loss gets zeros; existing nodes unchanged."""
    rng = _rng("path")
    x, w, u = rng.standard_normal((2, 3)), rng.standard_normal((3, 3)), rng.standard_normal((3, 3))
    nodes = [N("MatMul", ["x", "w"], ["h"], name="mm"), N("Tanh", ["h"], ["side"], name="side_tanh"),
             N("Exp", ["x"], ["ex"], name="no_w_exp"), N("Add", ["h", "ex"], ["y"], name="add"),
             N("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum")]
    m = _graph_model(nodes, [_vi("x", x), _vi("u", u)],
                     [helper.make_tensor_value_info("loss", F64, []), helper.make_tensor_value_info("side", F64, [2, 3])],
                     [numpy_helper.from_array(w, "w")])
    before = m.SerializeToString()
    b, grads = backward(m, ["w", "u"])
    assert m.SerializeToString() == before  # backward() worked on a copy; add_backward changes only its argument
    new = _emitted(m, b)
    assert [n.SerializeToString() for n in b.graph.node[:len(m.graph.node)]] == \
        [n.SerializeToString() for n in m.graph.node]
    assert not any(i in ("side", "ex") for n in new for i in n.input)  # Tanh, Exp branch untouched
    assert not any(n.op_type in ("Tanh", "Exp") for n in new)
    names = [o for n in b.graph.node for o in n.output] + [n.name for n in b.graph.node]
    assert len(names) == len(set(names))
    onnx.checker.check_model(b, full_check=True)
    gw, gu = ort_session(b).run([grads["w"], grads["u"]], {"x": x, "u": u})
    np.testing.assert_allclose(gw, x.T @ np.ones((2, 3)), rtol=1e-12)
    assert gu.shape == u.shape and not gu.any()


def test_seed_scales_the_gradient():
    """seed = dL/d(loss): the step graph passes the loss scale S; gradients scale by S exactly."""
    rng = _rng("seed")
    x = rng.standard_normal((2, 3))
    s = np.array(1024.0)
    nodes = [N("Mul", ["x", "x"], ["y"]), N("ReduceSum", ["y"], ["loss"], keepdims=0)]
    m = _graph_model(nodes, [_vi("x", x), _vi("S", s)], [helper.make_tensor_value_info("loss", F64, [])])
    b, grads = backward(m, ["x"], seed="S")
    (gx,) = ort_session(b).run([grads["x"]], {"x": x, "S": s})
    np.testing.assert_array_equal(gx, 1024.0 * 2 * x)


def test_missing_rule_names_node_op_and_supported_ops():
    x = np.zeros((3, 3))
    nodes = [N("Det", ["x"], ["y"], name="the_det"), N("ReduceSum", ["y"], ["loss"], keepdims=0)]
    m = _graph_model(nodes, [_vi("x", x)], [helper.make_tensor_value_info("loss", F64, [])])
    with pytest.raises(GraphmpError, match=r"the_det.*Det.*Supported ops: .*Conv.*MatMul"):
        add_backward(m, "loss", ["x"])


def test_integer_and_shape_paths_do_not_block():
    """Shape/ConstantOfShape/Range and integer ops sit next to the float path without rules."""
    rng = _rng("shape")
    x = rng.standard_normal((2, 3, 4))
    nodes = [N("Shape", ["x"], ["shp"]), N("Gather", ["shp", "zero_s"], ["n"], axis=0),
             N("Range", ["zero_s", "n", "one_s"], ["rng"]), N("Cast", ["rng"], ["rngf"], to=F64),
             N("Reshape", ["x", "shp2"], ["x2"]), N("ReduceMean", ["x2", "ax"], ["m"], keepdims=0),
             N("Mul", ["m", "rngf"], ["y"]), N("ReduceSum", ["y"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(_i64(0), "zero_s"),
             numpy_helper.from_array(_i64(1), "one_s"), numpy_helper.from_array(_i64([2, 12]), "shp2"),
             numpy_helper.from_array(_i64([1]), "ax")]
    m = _graph_model(nodes, [_vi("x", x)], [helper.make_tensor_value_info("loss", F64, [])], inits)
    b, grads = backward(m, ["x"])
    (gx,) = ort_session(b).run([grads["x"]], {"x": x})
    np.testing.assert_allclose(gx, np.broadcast_to(np.arange(2.0)[:, None, None] / 12, x.shape), rtol=1e-12)


def test_symbolic_batch_uses_dynamic_shapes():
    """With a symbolic batch the gradient graph runs for any batch size (broadcast bias of Add,
    Reshape, ReduceMean, Gemm)."""
    rng = _rng("dyn")
    w, bias = rng.standard_normal((4, 3)), rng.standard_normal((3,))
    nodes = [N("Gemm", ["x", "w"], ["h"]), N("Add", ["h", "bias"], ["y0"]), N("Relu", ["y0"], ["y1"]),
             N("Flatten", ["y1"], ["y2"]), N("ReduceMean", ["y2"], ["loss"], keepdims=0)]
    m = _graph_model(nodes, [helper.make_tensor_value_info("x", F64, ["batch", 4])],
                     [helper.make_tensor_value_info("loss", F64, [])],
                     [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "bias")])
    b, grads = backward(m, ["w", "bias"])
    onnx.checker.check_model(b, full_check=True)
    sess = ort_session(b)
    for n in (1, 5):
        x = rng.standard_normal((n, 4))
        gw, gb = sess.run([grads["w"], grads["bias"]], {"x": x})
        mask = ((x @ w + bias) > 0) / (n * 3)
        np.testing.assert_allclose(gw, x.T @ mask, rtol=1e-12)
        np.testing.assert_allclose(gb, mask.sum(0), rtol=1e-12)


# --------------------------------------------------------------------------- training mode
def _bn_model(x, scale, bias, mean, var, momentum=None, eps=1e-5):
    attrs = {"epsilon": eps} if momentum is None else {"epsilon": eps, "momentum": momentum}
    nodes = [N("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], **attrs)]
    inits = [numpy_helper.from_array(a, k) for k, a in zip("sbmv", (scale, bias, mean, var))]
    return _graph_model(nodes, [_vi("x", x)], [_vi("y", x)], inits)


@pytest.mark.parametrize("momentum", [None, 0.8])
def test_training_forward_batchnorm_statistics(momentum):
    rng = _rng("bnstat")
    x = (rng.standard_normal((4, 3, 5, 2)) * 2 + 1).astype(np.float32)
    scale, bias = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    mean, var = rng.standard_normal(3).astype(np.float32), (rng.random(3) + 0.5).astype(np.float32)
    m = _bn_model(x, scale, bias, mean, var, momentum=momentum)
    updates = training_forward(m, momentum=None)
    assert set(updates) == {"m", "v"}
    # the one BatchNormalization left normalises with the batch statistics, not the running ones
    assert [(n.input[3], n.input[4]) for n in m.graph.node if n.op_type == "BatchNormalization"] == \
        [("y__batch_mean", "y__batch_var")]
    for t in updates.values():
        m.graph.output.append(helper.make_tensor_value_info(t, F32, [3]))
    onnx.checker.check_model(m, full_check=True)
    y, new_m, new_v = ort_session(m).run(["y", updates["m"], updates["v"]], {"x": x})
    x64 = x.astype(np.float64)
    bm, bv = x64.mean(axis=(0, 2, 3)), x64.var(axis=(0, 2, 3))
    ref = (x64 - bm[:, None, None]) / np.sqrt(bv[:, None, None] + 1e-5) * scale[:, None, None] + bias[:, None, None]
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
    mom = 0.9 if momentum is None else momentum
    n = x.size / 3
    np.testing.assert_allclose(new_m, mom * mean + (1 - mom) * bm, rtol=1e-5)
    np.testing.assert_allclose(new_v, mom * var + (1 - mom) * bv * n / (n - 1), rtol=1e-5)


def test_training_forward_batchnorm_fp16_data_keeps_fp32_statistics():
    """graphmp's FP16 BN: X FP16, scale/bias/mean/var FP32 (BN-15). Statistics run in FP32,
    Y comes back FP16, and agrees with the FP32 computation within FP16 rounding."""
    rng = _rng("bn16")
    x = rng.standard_normal((8, 4, 3, 3)).astype(np.float16)
    p = [rng.standard_normal(4).astype(np.float32) for _ in range(3)] + [(rng.random(4) + 0.5).astype(np.float32)]
    m = _bn_model(x, *p)
    updates = training_forward(m)
    onnx.checker.check_model(m, full_check=True)
    y16 = run_reference(m, {"x": x})["y"]
    assert y16.dtype == np.float16
    m32 = _bn_model(x.astype(np.float32), *p)
    training_forward(m32)
    y32 = run_reference(m32, {"x": x.astype(np.float32)})["y"]
    np.testing.assert_allclose(y16.astype(np.float32), y32, rtol=2e-3, atol=2e-3)
    types = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(m).graph.value_info}
    assert types[updates["m"]] == F32 and types[updates["v"]] == F32


def test_training_forward_dropout_masks_and_gradient_uses_mask():
    rng = _rng("drop")
    x = rng.standard_normal((200, 50)).astype(np.float32)
    r = rng.standard_normal((200, 50)).astype(np.float32)
    nodes = [N("Dropout", ["x", "ratio"], ["y"], name="drop"), N("Mul", ["y", "r"], ["yr"]),
             N("ReduceSum", ["yr"], ["loss"], keepdims=0)]
    m = _graph_model(nodes, [_vi("x", x)], [helper.make_tensor_value_info("loss", F32, [])],
                     [numpy_helper.from_array(np.array(0.3, np.float32), "ratio"), numpy_helper.from_array(r, "r")])
    training_forward(m)
    drop = next(n for n in m.graph.node if n.op_type == "Dropout")
    mask = drop.output[1]
    grads = add_backward(m, "loss", ["x"])
    m.graph.output.extend([_vi("y", x), _vi(mask, x.astype(bool)), _vi(grads["x"], x)])
    onnx.checker.check_model(m, full_check=True)
    y, mk, gx = ort_session(m).run(["y", mask, grads["x"]], {"x": x})
    assert abs((~mk).mean() - 0.3) < 0.02  # 10000 Bernoulli(0.3): sd 0.0046
    np.testing.assert_allclose(y, np.where(mk, x / 0.7, 0), rtol=1e-6)
    np.testing.assert_allclose(gx, np.where(mk, r / 0.7, 0), rtol=1e-6)


# --------------------------------------------------------------------------- mixed precision
def _mp_model(mixed: bool):
    """x(FP32) [-> Cast FP16] -> MatMul with W (FP32 master [-> Cast FP16]) [-> Cast FP32]
    -> LayerNorm (FP32) -> Softmax (FP32) -> loss = sum(y * R)."""
    rng = _rng("mp")
    w = (rng.standard_normal((8, 6)) / 3).astype(np.float32)
    s, b = (1 + 0.1 * rng.standard_normal(6)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    r = rng.standard_normal((4, 6)).astype(np.float32)
    if mixed:
        nodes = [N("Cast", ["x"], ["x16"], to=F16), N("Cast", ["w"], ["w16"], to=F16),
                 N("MatMul", ["x16", "w16"], ["h16"]), N("Cast", ["h16"], ["h"], to=F32)]
    else:
        nodes = [N("MatMul", ["x", "w"], ["h"])]
    nodes += [N("LayerNormalization", ["h", "s", "b"], ["ln"], axis=-1), N("Softmax", ["ln"], ["y"], axis=-1),
              N("Mul", ["y", "r"], ["yr"]), N("ReduceSum", ["yr"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(a, k) for k, a in (("w", w), ("s", s), ("b", b), ("r", r))]
    return _graph_model(nodes, [helper.make_tensor_value_info("x", F32, [4, 8])],
                        [helper.make_tensor_value_info("loss", F32, [])], inits)


def test_mixed_precision_contract():
    """FP32 master weight and input, FP16 MatMul region, FP32 LayerNorm/Softmax island:
    gradients of x and W arrive FP32, the MatMul backward runs in FP16, the LayerNorm /
    Softmax backward in FP32, and the values agree with the all-FP32 gradients within FP16
    rounding, both FP16-faithfully (onnx.reference) and on ORT."""
    x = _rng("mpx").standard_normal((4, 8)).astype(np.float32)
    wrt = ["x", "w", "s", "b"]
    m32, mmp = _mp_model(False), _mp_model(True)
    b32, g32 = backward(m32, wrt)
    bmp, gmp = backward(mmp, wrt)
    onnx.checker.check_model(bmp, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(bmp)
    types = {v.name: v.type.tensor_type.elem_type for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    new = _emitted(mmp, bmp)
    assert all(types[gmp[w]] == F32 for w in wrt)
    matmuls = [n for n in new if n.op_type == "MatMul"]
    assert len(matmuls) == 2 and all(types[n.output[0]] == F16 for n in matmuls)
    reduces = [n for n in new if n.op_type in ("ReduceMean", "ReduceSum")]
    assert reduces and all(types[n.output[0]] == F32 for n in reduces)
    ref = dict(zip(g32.values(), ort_session(b32).run(list(g32.values()), {"x": x})))
    for name, got in (("reference", run_reference(bmp, {"x": x})),
                      ("ort", dict(zip(gmp.values(), ort_session(bmp).run(list(gmp.values()), {"x": x}))))):
        for w in wrt:
            g, r = got[gmp[w]], ref[g32[w]]
            assert g.dtype == np.float32
            # FP16 inputs/weights/products: relative rounding 2^-11 ~ 5e-4 per op, a few ops deep
            np.testing.assert_allclose(g, r, rtol=1e-2, atol=1e-2 * np.abs(r).max(), err_msg=f"{name}: {w}")


# --------------------------------------------------------------------------- real exports
def _to_double(model):
    """The same model computing in FP64 (initializers, declared types, Cast targets, constants)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if t.data_type == F32:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for v in list(m.graph.input) + list(m.graph.output) + list(m.graph.value_info):
        if v.type.tensor_type.elem_type == F32:
            v.type.tensor_type.elem_type = F64
    for n in m.graph.node:
        for a in n.attribute:
            if a.name == "to" and a.i == F32:
                a.i = F64
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == F32:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
    return m


def _real_loss_model(path, feeds, wrt, model=None):
    """The export (or `model`) + loss = sum_k ReduceSum(out_k * R_k), R_k fixed by `path`,
    with the `wrt` initializers made inputs."""
    m = model or onnx.load(path)
    outs = [o.name for o in m.graph.output if o.type.tensor_type.elem_type == F32]
    vals = dict(zip(outs, ort_session(m).run(outs, feeds)))
    rng = _rng(path)
    terms = []
    for o in outs:
        m.graph.initializer.append(numpy_helper.from_array(rng.standard_normal(vals[o].shape).astype(np.float32), "R_" + o))
        m.graph.node.extend([N("Mul", [o, "R_" + o], [o + "_r"]), N("ReduceSum", [o + "_r"], [o + "_s"], keepdims=0)])
        terms.append(o + "_s")
    m.graph.node.append(N("Sum", terms, ["loss"]))
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("loss", F32, []))
    params, keep = {}, []
    for t in m.graph.initializer:
        if t.name in wrt:
            params[t.name] = numpy_helper.to_array(t)
            m.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            keep.append(t)
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    return m, params


def _bert_feeds():
    rng = _rng("bert")
    feeds = {"input_ids": rng.integers(0, 1000, (2, 8)), "attention_mask": np.ones((2, 8), np.int64),
             "token_type_ids": rng.integers(0, 2, (2, 8))}
    feeds["attention_mask"][1, 6:] = 0
    return feeds


REAL = {
    # word/position embeddings: Gather; LayerNorm weight; FFN bias (Gelu); attention and FFN
    # weights (MatMul, Softmax, Where mask); pooler (Gemm, Tanh)
    "bert": (_bert_feeds, ["model.embeddings.word_embeddings.weight", "model.embeddings.position_embeddings.weight",
                           "model.embeddings.LayerNorm.weight", "model.encoder.layer.0.intermediate.dense.bias",
                           "val_87", "val_121", "val_162", "model.pooler.dense.weight"]),
    # stem conv (7x7 s2) before MaxPool, bottleneck convs, shortcut, classifier Gemm (BN folded in this export)
    "resnet": (lambda: {"pixel_values": _rng("resnet").standard_normal((2, 3, 32, 32)).astype(np.float32)},
               ["model.resnet.embedder.embedder.convolution.weight",
                "model.resnet.encoder.stages.0.layers.0.layer.1.convolution.weight",
                "model.resnet.encoder.stages.1.layers.0.shortcut.convolution.weight",
                "model.resnet.encoder.stages.1.layers.0.layer.2.convolution.weight_bias",
                "model.classifier.1.weight", "model.classifier.1.bias"]),
    # tied embedding (Gather + lm_head MatMul: two contributions), Split of c_attn, Pow/Tanh GELU
    "gpt2": (lambda: {"input_ids": _rng("gpt2").integers(0, 1001, (2, 6)), "attention_mask": np.ones((2, 6), np.int64)},
             ["model.lm_head.weight", "model.transformer.wpe.weight", "model.transformer.h.0.ln_1.bias",
              "model.transformer.h.0.attn.c_attn.weight", "model.transformer.h.1.mlp.c_fc.weight"]),
    # patch Conv (8x8 s8), cls token Concat, position embeddings Add, attention, classifier
    "vit": (lambda: {"pixel_values": _rng("vit").standard_normal((2, 3, 32, 32)).astype(np.float32)},
            ["model.vit.embeddings.cls_token", "model.vit.embeddings.position_embeddings",
             "model.vit.embeddings.patch_embeddings.projection.weight", "model.vit.layers.0.attention.q_proj.bias",
             "val_66", "model.classifier.weight"]),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_export_gradients_match_finite_differences(name):
    """Weight gradients of a real torch export (FP32, ORT) vs FP64 central differences of the
    same graph run in FP64 by onnx.reference (h = 1e-6: no ReLU/MaxPool kink is crossed
    in practice, truncation ~1e-12). Tolerance 1e-3 of the tensor's largest gradient: the
    FP32 gradient sums ~10^3 products (relative rounding ~1e-5)."""
    make_feeds, wrt = REAL[name]
    feeds = make_feeds()
    m, params = _real_loss_model(f"models/tiny/{name}.onnx", feeds, wrt)
    b, grads = backward(m, wrt)
    onnx.checker.check_model(b, full_check=True)
    got = dict(zip(wrt, ort_session(b).run([grads[w] for w in wrt], {**feeds, **params})))
    ev = reference(_to_double(m))
    f64 = {**feeds, **{k: v.astype(np.float64) for k, v in params.items()}}
    f64 = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in f64.items()}
    run_loss = lambda fd: float(ev.run(None, fd)[0])  # noqa: E731
    rng = _rng(name + "pick")
    for w in wrt:
        g = got[w]
        assert g.shape == params[w].shape and g.dtype == np.float32
        flat = np.abs(g).reshape(-1)
        assert flat.max() > 0, w
        idx = np.concatenate([np.argsort(flat)[-2:], rng.choice(flat.size, 2, replace=False)])
        fd = finite_differences(run_loss, f64, w, idx, 1e-6)
        np.testing.assert_allclose(g.reshape(-1)[idx], fd, rtol=1e-3, atol=1e-3 * flat.max(), err_msg=f"{name}: {w}")


def test_small_cnn_with_batchnorm_in_training_mode():
    """Conv -> BN (batch statistics) -> Relu -> MaxPool -> depthwise Conv -> GlobalAveragePool
    -> Flatten -> Gemm -> SoftmaxCrossEntropyLoss: training_forward, then gradients of every
    parameter vs FP64 central differences of the same training-mode graph."""
    rng = _rng("cnn")
    p = {"w1": rng.standard_normal((8, 3, 3, 3)) / 5, "c1": rng.standard_normal(8) / 5,
         "g": 1 + rng.standard_normal(8) / 5, "be": rng.standard_normal(8) / 5,
         "w2": rng.standard_normal((8, 1, 3, 3)) / 3, "wf": rng.standard_normal((5, 8)) / 3, "bf": rng.standard_normal(5) / 5}
    p = {k: v.astype(np.float32) for k, v in p.items()}
    stats = {"rm": np.zeros(8, np.float32), "rv": np.ones(8, np.float32)}
    nodes = [N("Conv", ["x", "w1", "c1"], ["h1"], pads=[1, 1, 1, 1]),
             N("BatchNormalization", ["h1", "g", "be", "rm", "rv"], ["h2"], momentum=0.9),
             N("Relu", ["h2"], ["h3"]), N("MaxPool", ["h3"], ["h4"], kernel_shape=[2, 2], strides=[2, 2]),
             N("Conv", ["h4", "w2"], ["h5"], group=8, pads=[1, 1, 1, 1]), N("GlobalAveragePool", ["h5"], ["h6"]),
             N("Flatten", ["h6"], ["h7"]), N("Gemm", ["h7", "wf", "bf"], ["logits"], transB=1),
             N("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"])]
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    labels = _i64([0, 3, 4, 1])
    m = _graph_model(nodes, [_vi("x", x), _vi("labels", labels)] + [_vi(k, v) for k, v in p.items()],
                     [helper.make_tensor_value_info("loss", F32, [])],
                     [numpy_helper.from_array(v, k) for k, v in stats.items()])
    updates = training_forward(m)
    assert set(updates) == {"rm", "rv"}
    b, grads = backward(m, list(p))
    onnx.checker.check_model(b, full_check=True)
    feeds = {"x": x, "labels": labels, **p}
    got = dict(zip(p, ort_session(b).run([grads[k] for k in p], feeds)))
    ev = reference(_to_double(m))
    f64 = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in feeds.items()}
    run_loss = lambda fd: float(ev.run(None, fd)[0])  # noqa: E731
    for k in p:
        g = got[k]
        idx = rng.choice(g.size, min(g.size, 6), replace=False)
        fd = finite_differences(run_loss, f64, k, idx, 1e-6)
        # c1 (conv bias before batch-statistics BN) has a true gradient of 0: atol floor 1e-6
        np.testing.assert_allclose(g.reshape(-1)[idx], fd, rtol=1e-3, atol=1e-3 * max(np.abs(g).max(), 1e-3), err_msg=k)


CONVERTED = {  # weights whose name means the same tensor after convert (it shares equal initializers)
    "resnet": ["model.resnet.embedder.embedder.convolution.weight",
               "model.resnet.encoder.stages.0.layers.0.layer.1.convolution.weight",
               "model.resnet.encoder.stages.1.layers.0.shortcut.convolution.weight", "model.classifier.1.weight"],
    "vit": ["model.vit.embeddings.cls_token", "model.vit.embeddings.patch_embeddings.projection.weight",
            "val_66", "model.classifier.weight"],
}


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_graphmp_converted_model_gradients(name):
    """add_backward on graphmp.convert's output (FP16 weights stored FP16, FP32 islands,
    Casts): FP16-stored weights get FP16 gradients, FP32 ones FP32, and the values agree
    with the FP32 model's gradients within FP16 rounding (onnx.reference, FP16-faithful)."""
    import graphmp

    make_feeds, wrt = REAL[name][0], CONVERTED[name]
    feeds = make_feeds()
    path = f"models/tiny/{name}.onnx"
    m32, _ = _real_loss_model(path, feeds, [])
    mmp, _ = _real_loss_model(path, feeds, [], model=graphmp.convert(path).model)
    stored = {t.name: t.data_type for t in mmp.graph.initializer}
    assert F16 in {stored[w] for w in wrt}
    b32, g32 = backward(m32, wrt)
    bmp, gmp = backward(mmp, wrt)
    onnx.checker.check_model(bmp, full_check=True)
    ref = dict(zip(wrt, ort_session(b32).run([g32[w] for w in wrt], feeds)))
    got = run_reference(bmp, feeds)
    for w in wrt:
        g = got[gmp[w]]
        assert g.dtype == helper.tensor_dtype_to_np_dtype(stored[w]), w
        r = ref[w]
        # FP16 activations and weights (2^-11 relative rounding) through a few layers; a
        # Relu or MaxPool decision that flips near a tie moves a few gradient elements by
        # more (resnet: 3 of 2352 of the first conv, one channel, under the ideal-kernel
        # oracle and the emulation alike), so 99.5% within the tolerance, all within 4x
        close = np.isclose(g.astype(np.float32), r, rtol=5e-2, atol=3e-2 * np.abs(r).max())
        assert close.mean() >= 0.995, (w, close.mean())
        np.testing.assert_allclose(g.astype(np.float32), r, rtol=0.2, atol=0.12 * np.abs(r).max(), err_msg=w)


def _sum_to(x, shape):
    """numpy: sum x over the axes along which an array of `shape` was broadcast to x.shape."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape) if d == 1 and x.shape[lead + i] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


def test_unbroadcast_decided_at_run_time():
    """Symbolic dims that may or may not be 1 (and an input of unknown rank): the broadcast
    axes of the gradient are found at run time from the shapes."""
    nodes = [N("Add", ["a", "b"], ["s"]), N("Mul", ["s", "c"], ["y"]), N("ReduceSum", ["y"], ["loss"], keepdims=0)]
    tin = helper.make_tensor_value_info
    m = _graph_model(nodes, [tin("a", F64, ["n", 3]), tin("b", F64, ["m", 3]), tin("c", F64, None)],
                     [tin("loss", F64, [])])
    b, grads = backward(m, ["a", "b", "c"])
    sess = ort_session(b)
    rng = _rng("unb")
    for bs, cs in [((1, 3), (4, 3)), ((4, 3), (3,)), ((4, 3), (2, 1, 1)), ((1, 3), ())]:
        a, bb, c = rng.standard_normal((4, 3)), rng.standard_normal(bs), np.asarray(rng.standard_normal(cs))
        ga, gb, gc = sess.run([grads["a"], grads["b"], grads["c"]], {"a": a, "b": bb, "c": c})
        shape = np.broadcast_shapes((4, 3), cs)
        cb, sb = np.broadcast_to(c, shape), np.broadcast_to(a + bb, shape)
        np.testing.assert_allclose(ga, _sum_to(cb, a.shape), rtol=1e-12)
        np.testing.assert_allclose(gb, _sum_to(cb, bs), rtol=1e-12)
        np.testing.assert_allclose(gc, _sum_to(sb, cs), rtol=1e-12)


@pytest.mark.parametrize("case_id", ["MaxPool-k2s2", "Gather-axis0-repeat", "Slice-step2", "Conv-depthwise",
                                     "AveragePool-k3s2-pad-excl", "LayerNorm-axis-1-biasTrue",
                                     "InstanceNorm-4d", "Pad-reflect-[0, 1, 2, 1, 0, 2]",
                                     "Resize-linear-half_pixel--scales2", "Resize-nearest-asymmetric-floor-scales2",
                                     "ReduceMax-k1-[1]", "PRelu-slope(3, 1, 1)", "HardSwish", "Mish"])
def test_fp16_graph_gradients_are_fp16_and_run_on_ort_cpu(case_id):
    """A whole FP16 graph: gradients are FP16, ORT CPU runs them (its FP16 scatter-add gap is
    covered by accumulating scatters in FP32), and they match the FP32 gradients within
    FP16 rounding, FP16-faithfully (onnx.reference) and on ORT. (MaxPool with pads is left
    out: onnx.reference's MaxPool Indices output is wrong there, -1 entries; ORT follows
    the spec, see MaxPool-overlap-pad in CASES.)"""
    case = next(c for c in CASES if c.id == case_id)
    m16, f16 = loss_model(case, np.float16)
    m32, f32 = loss_model(case, np.float32)
    wrt = float_inputs(f16)
    b16, g16 = backward(m16, wrt)
    b32, g32 = backward(m32, wrt)
    onnx.checker.check_model(b16, full_check=True)
    ref = dict(zip(wrt, ort_session(b32).run([g32[w] for w in wrt], f32)))
    outs = {"ort": dict(zip(wrt, ort_session(b16).run([g16[w] for w in wrt], f16)))}
    rr = run_reference(b16, f16)
    outs["reference"] = {w: rr[g16[w]] for w in wrt}
    for name, got in outs.items():
        for w in wrt:
            assert got[w].dtype == np.float16
            np.testing.assert_allclose(got[w].astype(np.float32), ref[w], rtol=1e-2,
                                       atol=1e-2 * np.abs(ref[w]).max(), err_msg=f"{name}: {w}")


# --------------------------------------------------------------------------- new rules: edge cases
def test_reduce_max_splits_ties_evenly():
    """Ties share dY equally (torch.amax semantics): a row [2, 5, 5, 1] gives [0, .5, .5, 0]
    times dY, and a column with three equal maxima gives 1/3 each."""
    x = np.array([[2.0, 5.0, 5.0, 1.0], [3.0, 3.0, 3.0, -1.0], [0.0, 1.0, 2.0, 7.0]])
    for op, axis, want in [
            ("ReduceMax", 1, [[0, .5, .5, 0], [1 / 3, 1 / 3, 1 / 3, 0], [0, 0, 0, 1]]),
            ("ReduceMin", 1, [[0, 0, 0, 1], [0, 0, 0, 1], [1, 0, 0, 0]])]:
        nodes = [N(op, ["x", "ax"], ["m"], keepdims=0), N("ReduceSum", ["m"], ["loss"], keepdims=0)]
        m = _graph_model(nodes, [_vi("x", x)], [helper.make_tensor_value_info("loss", F64, [])],
                         inits=[numpy_helper.from_array(_i64([axis]), "ax")])
        b, grads = backward(m, ["x"])
        got = ort_session(b).run([grads["x"]], {"x": x})[0]
        np.testing.assert_allclose(got, np.array(want), rtol=0, atol=1e-15, err_msg=op)


@pytest.mark.parametrize("nodes,inits,match", [
    ([N("Resize", ["x", "", "sc"], ["y"], mode="cubic", antialias=1, name="up")],
     {"sc": np.array([1, 1, 0.5, 0.5], np.float32)}, r"node 'up' \(Resize\): antialias=1 with downsampling"),
    ([N("Shape", ["x"], ["s"]), N("Mul", ["s", "two"], ["s2"]), N("Resize", ["x", "", "", "s2"], ["y"], name="up")],
     {"two": _i64(2)}, r"node 'up' \(Resize\): its scales/sizes are computed at run time"),
    ([N("Resize", ["x", "", "sc"], ["y"], coordinate_transformation_mode="tf_crop_and_resize", name="up")],
     {"sc": np.array([1, 1, 2, 2], np.float32)}, r"node 'up' \(Resize\): .*tf_crop_and_resize"),
    ([N("Pad", ["x", "p"], ["y"], mode="reflect", name="refl")], {"p": _i64([0, 0, 1, 1, 0, 0, 1, 1])},
     r"node 'refl' \(Pad mode=reflect\).*opset >= 16\); the model has opset 13"),
    ([N("GroupNormalization", ["x", "s", "s"], ["y"], num_groups=2, name="gn")], {"s": np.ones(2)},
     r"node 'gn' \(GroupNormalization\): the opset-18 form"),
    ([N("ScatterElements", ["x", "i", "x"], ["y"], reduction="mul", name="sc")], {"i": np.zeros((1, 2, 3, 3), np.int64)},
     r"node 'sc' \(ScatterElements\): reduction=mul is not differentiated"),
    ([N("Einsum", ["x", "x"], ["y"], equation="...ij,...jk->...ik", name="ein")], {},
     r"node 'ein' \(Einsum .*no ellipsis"),
])
def test_unsupported_settings_name_the_node(nodes, inits, match):
    x = np.ones((1, 2, 3, 3))
    nodes = nodes + [N("ReduceSum", ["y"], ["loss"], keepdims=0)]
    m = _graph_model(nodes, [_vi("x", x)], [helper.make_tensor_value_info("loss", F64, [])],
                     inits=[numpy_helper.from_array(v, k) for k, v in inits.items()], opset=13)
    with pytest.raises(GraphmpError, match=match):
        add_backward(m, "loss", ["x"])


def test_training_ops_table_is_current():
    """docs/training_ops.md is what `python -m graphmp.train.rules --table` prints now."""
    from graphmp.train.rules.table import render, tested_by
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(os.path.dirname(here), "docs", "training_ops.md")
    want = render(tested_by(here))
    got = open(path).read() if os.path.exists(path) else ""
    assert got == want, ("docs/training_ops.md is stale: regenerate it with "
                         "`python -m graphmp.train.rules --table > docs/training_ops.md`")
    for op in ("Pad", "Resize", "InstanceNormalization", "MaxPool", "CumSum"):  # the table is not vacuous
        assert f"| {op} | rule (" in got

"""onnx.reference op overrides for graphmp's oracle (graphmp.model_runs.run_reference).

Ideal kernels. Plain onnx.reference computes an FP16 (or BF16) op with numpy in that
dtype, so a decomposed op rounds at every step, and some sums accumulate in FP16:
Softmax, Sigmoid, LayerNormalization, BatchNormalization, Gelu and HardSwish (run by
its function body) round after each step, Conv and Gemm round before adding their bias,
ReduceMean accumulates in FP16 (the mean of 1000 values of 100 is inf), and so does
ReduceSum over any axis but the last (tests/test_oracles.py measures each). Each
op type in IDEAL_OPS is replaced here by the same onnx.reference implementation (the one
the model's opset selects, function bodies included) run on float64 copies of its FP16
and BF16 inputs, with each output rounded once to its declared type: the exact result
rounded once, what an ideal kernel stores. Ops that read no FP16/BF16 input run as
onnx.reference has them (an FP32 model is computed as before). Op types not listed run
in their declared dtype in numpy: those graphmp may lower to FP16 are exact in any
precision (data movement, Cast, comparisons, Relu/Clip/Max/Min/Abs/Neg, MaxPool,
ReduceMax/Min, Where, ...), except Range, whose element count depends on the type it is
computed in (tests/test_oracles.py holds graphmp.policy's lists to this); the rest are ops
outside graphmp's lists (the ML and training domains, sequences, STFT/DFT).

Also the spec where onnx.reference departs from it: BatchNormalization in inference mode
(the reference runs opset 9-13 BN in training mode when the legacy `momentum` attribute
is present; computed in float64, rounded once, like the ops above), and Loop.
"""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper
from onnx.defs import get_schema
from onnx.reference.op_run import OpRun, RuntimeContextError
from onnx.reference.ops import load_op
from onnx.reference.ops.op_loop import Loop as _RefLoop

LOW = (np.dtype(np.float16), helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16))
F64 = np.dtype(np.float64)

IDEAL_OPS = (
    # matrix products and convolutions
    "Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "DeformConv",
    # pooling, normalisations and reductions
    "AveragePool", "GlobalAveragePool", "LpPool", "InstanceNormalization", "LayerNormalization",
    "GroupNormalization", "MeanVarianceNormalization", "LpNormalization", "RMSNormalization",
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
    "ReduceProd", "CumSum", "Sum", "Mean", "LRN", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
    # activations
    "Sigmoid", "HardSigmoid", "HardSwish", "Softmax", "LogSoftmax", "Softplus", "Softsign", "Elu", "Selu",
    "Celu", "Mish", "Swish", "LeakyRelu", "PRelu", "ThresholdedRelu", "Shrink",
    # elementwise math (numpy already computes these in FP32 and rounds once: listed so that
    # every arithmetic op computes at one precision)
    "Add", "Sub", "Mul", "Div", "Pow", "Exp", "Log", "Sqrt", "Reciprocal", "Tanh", "Sin", "Cos", "Tan",
    "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh",
    # interpolation, recurrences, attention
    "Resize", "Upsample", "GridSample", "RoiAlign", "AffineGrid", "NonMaxSuppression", "RNN", "GRU", "LSTM",
    "Attention",
)


def _low_dtype(args):
    """The FP16/BF16 dtype of the first such input, or None."""
    return next((a.dtype for a in args if isinstance(a, np.ndarray) and a.dtype in LOW), None)


def _up(a):
    return a.astype(F64) if isinstance(a, np.ndarray) and a.dtype in LOW else a


class _Ideal(OpRun):
    """onnx.reference's implementation of the node's op (self._base), run in float64
    when an input is FP16/BF16, each float output rounded once to its declared type."""
    op_domain = ""

    def __init__(self, onnx_node, run_params):
        OpRun.__init__(self, onnx_node, run_params)
        version = run_params["opsets"][""]
        schema = get_schema(onnx_node.op_type, version, "")
        self._in_types = [p.type_str for p in schema.inputs]
        self._out_types = [p.type_str for p in schema.outputs]
        self._bases = {}
        try:
            self._base = self._make_base(None)
        except RuntimeContextError:  # a function body built for the input types (GroupNormalization)
            self._base = None

    def _make_base(self, input_types):
        version = self.run_params["opsets"][""]
        cls = load_op("", self.onnx_node.op_type, version, node=self.onnx_node, input_types=input_types,
                      evaluator_cls=self.run_params["evaluator_cls"])
        return cls(self.onnx_node, self.run_params)

    def _base_for(self, args):
        if self._base is not None:
            return self._base
        key = tuple((a.dtype, a.shape) if isinstance(a, np.ndarray) else None for a in args)
        if key not in self._bases:
            types = [helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                     for a in args if a is not None]
            self._bases[key] = self._make_base(types)
        return self._bases[key]

    def _out_dtype(self, k, args):
        """The declared type of float output k: that of the inputs sharing its type
        parameter; FP32 for tensor(float) or a parameter no input binds (the stash type
        of LayerNormalization's Mean and InvStdDev)."""
        t = self._out_types[min(k, len(self._out_types) - 1)]
        for i, a in enumerate(args):
            if self._in_types[min(i, len(self._in_types) - 1)] == t and isinstance(a, np.ndarray):
                return a.dtype
        return np.dtype(np.float32)

    def run(self, *args, **kwargs):
        if _low_dtype(args) is None:
            return self._base_for(args).run(*args, **kwargs)
        up = [_up(a) for a in args]
        with np.errstate(all="ignore"):
            ys = self._base_for(up).run(*up, **kwargs)
        return tuple(y.astype(self._out_dtype(k, args)) if isinstance(y, np.ndarray) and y.dtype.kind == "f" else y
                     for k, y in enumerate(ys))

    def _run(self, *args, **kwargs):  # never called: run() delegates
        raise NotImplementedError


def _ideal_ops() -> list:
    """One _Ideal subclass per IDEAL_OPS entry, named as the op (onnx.reference's new_ops
    key is (op_domain, class name))."""
    return [type(op, (_Ideal,), {"__doc__": f"{op} as an ideal kernel (see _Ideal).", "__module__": __name__})
            for op in IDEAL_OPS]


_erf = np.vectorize(math.erf, otypes=[np.float64])  # numpy has no erf, and scipy is no dependency


class Erf(OpRun):
    """Erf in float64, rounded once (onnx.reference rounds math.erf to FP32 first)."""
    op_domain = ""

    def _run(self, x):
        return (_erf(x.astype(F64)).astype(x.dtype),)


class Gelu(OpRun):
    """Gelu (opset 20) in float64, rounded once (onnx.reference runs its function body,
    step by step, with an FP32 Erf)."""
    op_domain = ""

    def _run(self, x, approximate=None):
        v = x.astype(F64)
        if approximate == "tanh":
            y = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
        else:
            y = 0.5 * v * (1 + _erf(v / math.sqrt(2)))
        return (y.astype(x.dtype),)


class BatchNormalization(OpRun):
    op_domain = ""

    def _run(self, x, scale, bias, mean, var, epsilon=None, momentum=None, training_mode=None,
             spatial=None, is_test=None, consumed_inputs=None):
        eps = 1e-5 if epsilon is None else epsilon
        shape = (1, -1) + (1,) * (x.ndim - 2)
        y = (x.astype(F64) - mean.astype(F64).reshape(shape)) / np.sqrt(var.astype(F64).reshape(shape) + eps)
        y = y * scale.astype(F64).reshape(shape) + bias.astype(F64).reshape(shape)
        return (y.astype(x.dtype),)


class Loop(_RefLoop):
    """onnx.reference's Loop with the spec's semantics where it departs from them:
    an omitted `cond` input means "true" (it ran zero iterations), and scan outputs
    are stacked along a new first axis (it concatenated them with vstack, so [2, 4]
    per iteration came out [2k, 4] instead of [k, 2, 4])."""
    op_domain = ""

    def _run(self, M, cond, *args, context=None, body=None, attributes=None, bindings=None):
        body = self.body
        names_in, names_out = body.input_names, body.output_names
        inputs = dict(context or {})
        inputs.update(zip(names_in[2:], args))
        cond = True if cond is None else bool(np.asarray(cond).item())
        n_carried = len(names_in) - 2
        scans = [[] for _ in range(len(names_out) - 1 - n_carried)]
        it = 0
        while cond and (M is None or it < int(M)):
            inputs[names_in[0]] = np.array(it, dtype=np.int64)
            inputs[names_in[1]] = np.array(cond)
            outs = self._run_body(inputs, attributes=attributes, bindings=bindings)
            cond = bool(np.asarray(outs[0]).item())
            inputs.update(zip(names_in[2:], outs[1:1 + n_carried]))
            for k, v in enumerate(outs[1 + n_carried:]):
                scans[k].append(v)
            it += 1
        carried = [inputs[n] for n in names_in[2:]]
        stacked = [np.stack(s) if s else np.empty((0,), dtype=np.float32) for s in scans]
        return self._check_and_fix_outputs(tuple(carried + stacked))


ORACLE_OPS = [BatchNormalization, Loop, Erf, Gelu] + _ideal_ops()

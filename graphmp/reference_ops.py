"""onnx.reference op overrides for graphmp's FP16-faithful oracle (graphmp.oracle.run_reference).

onnx.reference.ReferenceEvaluator computes each op in the dtype the graph declares (as
a GPU does); these classes replace its ops where it departs from the spec.
"""
from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_loop import Loop as _RefLoop


class BatchNormalization(OpRun):
    op_domain = ""

    def _run(self, x, scale, bias, mean, var, epsilon=None, momentum=None, training_mode=None,
             spatial=None, is_test=None, consumed_inputs=None):
        eps = 1e-5 if epsilon is None else epsilon
        shape = (1, -1) + (1,) * (x.ndim - 2)
        acc = np.float32 if x.dtype != np.float64 else np.float64
        y = (x.astype(acc) - mean.astype(acc).reshape(shape)) / np.sqrt(var.astype(acc).reshape(shape) + eps)
        y = y * scale.astype(acc).reshape(shape) + bias.astype(acc).reshape(shape)
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


ORACLE_OPS = [BatchNormalization, Loop]

"""The cross-entropy loss is built from ops with CUDA kernels: LogSoftmax, then the label's
log-probability by GatherElements (opset >= 16) or by a one-hot mask (below 16, where the
GatherElements gradient's ScatterElements(add) does not exist), never SoftmaxCrossEntropyLoss.
Both forms give torch's loss and gradient (float64 numpy reference of F.cross_entropy, every
option at once: class axis -1, ignore_index, label smoothing, class weights)."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphmp.train import flat
from graphmp.train.cuda_kernels import nodes_without_kernel
from graphmp.train.loop import StepRunner, latest_state, load_run
from graphmp.train.step import build_step
from test_train_losses import cross_entropy_ref

N, T, D, V = 3, 5, 4, 6
OPTS = dict(ignore_index=-100, label_smoothing=0.2, class_weights=[1.0, 2.0, 0.5, 1.5, 3.0, 0.25])


def _lm(path, opset, w, bias):
    """x [N, T, D] -> MatMul W -> Add b -> logits [N, T, V], at `opset`."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["logits"])]
    g = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", T, D])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", T, V])],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(bias, "b")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path


@pytest.mark.parametrize("opset,picks_with", [(13, "Mul"), (17, "GatherElements")])
def test_loss_ops_and_values_at_each_opset(tmp_path, opset, picks_with):
    r = np.random.default_rng(0)
    w, bias = r.normal(0, 1, (D, V)).astype(np.float32), r.normal(0, 0.1, V).astype(np.float32)
    x = r.normal(0, 1, (N, T, D)).astype(np.float32)
    y = r.integers(0, V, (N, T)).astype(np.int64)
    y[0, :3] = -100
    run = str(tmp_path / "run")
    build_step(_lm(str(tmp_path / "lm.onnx"), opset, w, bias), run, precision="fp32", optimizer="sgd", lr=0.1,
               loss_scale=1.0, expose_grads=True, class_axis=-1, **OPTS)
    meta = load_run(run)
    step = onnx.load(f"{run}/step.onnx")
    ops = [n.op_type for n in step.graph.node]
    assert "SoftmaxCrossEntropyLoss" not in ops and "LogSoftmax" in ops and picks_with in ops
    assert ("GatherElements" in ops) == (opset >= 16)
    assert nodes_without_kernel(step) == []  # every node has an ORT CUDA kernel
    state, _ = latest_state(run)
    runner = StepRunner(run, meta, state)
    feeds = {**flat.pack(meta, state), "x": x, "labels": y}
    out = dict(zip([o.name for o in runner.sess.get_outputs()], runner.sess.run(None, feeds)))

    def loss_of(wm):
        return cross_entropy_ref(x.astype(np.float64) @ wm + bias, y, axis=-1, ignore_index=-100,
                                 label_smoothing=0.2, weight=OPTS["class_weights"])
    w64 = w.astype(np.float64)
    np.testing.assert_allclose(float(out["loss"]), loss_of(w64), rtol=1e-6)
    fd = np.zeros_like(w64)
    for i in np.ndindex(w.shape):
        wp, wm = w64.copy(), w64.copy()
        wp[i] += 1e-6
        wm[i] -= 1e-6
        fd[i] = (loss_of(wp) - loss_of(wm)) / 2e-6
    np.testing.assert_allclose(out[meta["grads"]["W"]], fd, rtol=1e-4, atol=1e-6)

"""Tiny models and synthetic tasks for the training tests and benchmarks (onnx.helper, no torch)."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _model(nodes, inits, x_shape, y_shape, name):
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, y_shape)],
                          [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def mlp(n_in=4, hidden=16, classes=3, seed=0):
    """x[N,n_in] -> Gemm -> Relu -> Gemm -> logits[N,classes]."""
    r = np.random.default_rng(seed)
    inits = {"fc1.weight": r.normal(0, 1 / np.sqrt(n_in), (hidden, n_in)), "fc1.bias": np.zeros(hidden),
             "fc2.weight": r.normal(0, 1 / np.sqrt(hidden), (classes, hidden)), "fc2.bias": np.zeros(classes)}
    nodes = [helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"], name="fc1", transB=1),
             helper.make_node("Relu", ["h"], ["a"], name="relu"),
             helper.make_node("Gemm", ["a", "fc2.weight", "fc2.bias"], ["logits"], name="fc2", transB=1)]
    return _model(nodes, inits, ["N", n_in], ["N", classes], "mlp")


def cnn(channels=8, classes=4, size=8, seed=0, pool="MaxPool"):
    """x[N,1,size,size] -> Conv3x3 -> BatchNorm -> Relu -> MaxPool2 -> Flatten -> Gemm -> logits[N,classes]."""
    r = np.random.default_rng(seed)
    feat = channels * (size // 2) ** 2
    inits = {"conv.weight": r.normal(0, 1 / 3, (channels, 1, 3, 3)), "conv.bias": np.zeros(channels),
             "bn.weight": np.ones(channels), "bn.bias": np.zeros(channels),
             "bn.running_mean": np.zeros(channels), "bn.running_var": np.ones(channels),
             "fc.weight": r.normal(0, 1 / np.sqrt(feat), (classes, feat)), "fc.bias": np.zeros(classes)}
    nodes = [helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "bn.weight", "bn.bias", "bn.running_mean",
                                                     "bn.running_var"], ["b"], name="bn", epsilon=1e-5,
                              momentum=0.9),
             helper.make_node("Relu", ["b"], ["r"], name="relu"),
             helper.make_node(pool, ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten", axis=1),
             helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1)]
    return _model(nodes, inits, ["N", 1, size, size], ["N", classes], "cnn")


def blobs(n, n_in=4, classes=3, seed=0):
    """Gaussian clusters: an easy task for the MLP."""
    r = np.random.default_rng(seed)
    centers = np.random.default_rng(123).normal(0, 2, (classes, n_in))
    y = r.integers(0, classes, n)
    x = centers[y] + r.normal(0, 0.7, (n, n_in))
    return {"x": x.astype(np.float32), "labels": y.astype(np.int64)}


def bars(n, size=8, seed=0, noise=0.3):
    """8x8 images of one of 4 classes: a horizontal bar, a vertical bar, a diagonal, a 2x2 square,
    each at a random place, plus Gaussian noise. A small CNN learns it in a few hundred steps."""
    r = np.random.default_rng(seed)
    y = r.integers(0, 4, n)
    x = r.normal(0, noise, (n, 1, size, size))
    for i, c in enumerate(y):
        k = r.integers(0, size)
        if c == 0:
            x[i, 0, k, :] += 1.0
        elif c == 1:
            x[i, 0, :, k] += 1.0
        elif c == 2:
            d = np.arange(size)
            x[i, 0, d, (d + k) % size] += 1.0
        else:
            a, b = r.integers(0, size - 1, 2)
            x[i, 0, a:a + 2, b:b + 2] += 1.5
    return {"x": x.astype(np.float32), "labels": y.astype(np.int64)}

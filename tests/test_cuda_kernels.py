"""Every node of graphmp's step graphs has a kernel in ONNX Runtime's CUDA provider
(graphmp/train/cuda_kernels.py, transcribed from ORT's docs/OperatorKernels.md), so none falls
back to the CPU under CUDAExecutionProvider. The step graphs: a CNN with BatchNorm and MaxPool
(and the same at 128 channels, whose strided conv on a 2x2 map takes the GEMM forms of
rules/conv_gemm.py and lower.py), a pre-LN transformer block, an embedding bag (torch exports,
tests/fixtures), FP32 and mixed.
No GPU needed: the check reads the graph."""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphmp.train import cuda_kernels as ck

torch = pytest.importorskip("torch")

from fixtures.torch_embedding import Bag, export as export_bag  # noqa: E402
from fixtures.torch_models import CNN, Block, export  # noqa: E402
from graphmp.train.step import build_step  # noqa: E402


def _model(kind, path):
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    if kind in ("cnn", "cnn-wide"):
        return export(CNN(width=128 if kind == "cnn-wide" else 8), rng.standard_normal((8, 3, 8, 8)).astype(np.float32),
                      path)
    if kind == "block":
        return export(Block(), rng.standard_normal((4, 6, 16)).astype(np.float32), path)
    return export_bag(Bag(), rng.integers(0, 12, (8, 24)).astype(np.int64), path)


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
@pytest.mark.parametrize("kind", ["cnn", "cnn-wide", "block", "bag"])
def test_step_graph_has_a_cuda_kernel_for_every_node(tmp_path, kind, precision):
    path = _model(kind, str(tmp_path / f"{kind}.onnx"))
    run = str(tmp_path / "run")
    build_step(path, run, precision=precision, optimizer="adamw", lr=1e-3, ignore_index=-100,
               label_smoothing=0.1)
    step = onnx.load(os.path.join(run, "step.onnx"))
    ops = {n.op_type for n in step.graph.node}
    assert {"LogSoftmax", "GatherElements", "ScatterElements"} <= ops  # the loss and its gradient
    assert "SoftmaxCrossEntropyLoss" not in ops
    assert ck.nodes_without_kernel(step) == []


def test_the_check_names_nodes_without_a_kernel():
    """A SoftmaxCrossEntropyLoss (no CUDA kernel outside ORT's training builds) and an int8
    Softmax are reported with their since-version and type; a float Softmax is not."""
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["s", "y"], ["l"], name="sce"),
             helper.make_node("Cast", ["s"], ["s8"], to=TensorProto.INT8, name="to_int8"),
             helper.make_node("Softmax", ["s8"], ["p8"], name="soft8"),
             helper.make_node("Softmax", ["s"], ["p"], name="soft")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 3]),
                                       helper.make_tensor_value_info("y", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("l", "p")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert ck.nodes_without_kernel(m) == [("sce", "SoftmaxCrossEntropyLoss", 13, "FLOAT"),
                                          ("soft8", "Softmax", 13, "INT8")]


def test_version_ranges_decide():
    assert ck.has_kernel("ReduceMean", 13, TensorProto.FLOAT) and ck.has_kernel("ReduceMean", 18, TensorProto.FLOAT)
    assert ck.has_kernel("Where", 16, TensorProto.BFLOAT16) and not ck.has_kernel("Where", 9, TensorProto.BFLOAT16)
    assert ck.has_kernel("Conv", 22, TensorProto.BFLOAT16) and not ck.has_kernel("Conv", 11, TensorProto.BFLOAT16)
    assert not ck.has_kernel("Pad", 13, TensorProto.INT64)


def test_cuda_kernel_table_doc_is_current():
    doc = os.path.join(os.path.dirname(__file__), "..", "docs", "cuda_kernels.md")
    with open(doc) as f:
        current = f.read()
    assert current == ck.render(), "regenerate: python -m graphmp.train.cuda_kernels --table > docs/cuda_kernels.md"

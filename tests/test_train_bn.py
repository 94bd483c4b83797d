"""BatchNormalization in training: training_forward's form against torch.nn.BatchNorm (outputs,
running statistics, gradients), its size (one pass forward, a handful of full-size nodes
backward), the mixed plan around it (FP16 activations through BN, ReLU and Add), and the
step's precision cost (graphmp.train.step_cost)."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fixtures import tiny as tm
from graphmp.model_runs import ort_session
from graphmp.train.autodiff import add_backward, training_forward
from graphmp.train.step import build_step
from graphmp.train.step_cost import precision_cost

torch = pytest.importorskip("torch")

F64 = TensorProto.DOUBLE


def _bn_graph(x_shape, params, dtype=F64, momentum=0.9):
    """One BatchNormalization (ONNX momentum, torch's 1 - momentum), loss = sum(Y * G)."""
    c = x_shape[1]
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-5,
                              momentum=momentum),
             helper.make_node("Mul", ["y", "g"], ["yg"]),
             helper.make_node("ReduceSum", ["yg"], ["loss"], keepdims=0)]
    inputs = [helper.make_tensor_value_info(n, dtype, list(x_shape)) for n in ("x", "g")]
    inits = [numpy_helper.from_array(a, k) for k, a in zip("sbmv", params)]
    g = helper.make_graph(nodes, "bn", inputs, [helper.make_tensor_value_info("loss", dtype, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert len(params[0]) == c
    return m


def _torch_bn(x_shape, rng):
    c = x_shape[1]
    bn = (torch.nn.BatchNorm2d if len(x_shape) == 4 else torch.nn.BatchNorm1d)(c, momentum=0.1).double()
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, c)))
        bn.bias.copy_(torch.from_numpy(rng.uniform(-0.2, 0.2, c)))
        bn.running_mean.copy_(torch.from_numpy(rng.uniform(-0.5, 0.5, c)))
        bn.running_var.copy_(torch.from_numpy(rng.uniform(0.8, 1.2, c)))
    params = [t.detach().numpy().copy() for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var)]
    return bn, params


@pytest.mark.parametrize("x_shape", [(4, 3, 5, 2), (6, 3), (5, 2, 7)])
def test_training_bn_matches_torch_float64(x_shape):
    """Y, running mean, running var (torch: the UNBIASED batch variance) and the gradients of
    X, scale and B, all against torch.nn.BatchNorm in train mode, one forward, float64."""
    rng = np.random.default_rng(sum(x_shape))
    x = rng.standard_normal(x_shape) * 2 + 3  # a mean well away from 0
    gy = rng.standard_normal(x_shape)
    bn, params = _torch_bn(x_shape, rng)
    m = _bn_graph(x_shape, params)
    updates = training_forward(m)
    grads = add_backward(m, "loss", ["x", "s", "b"])
    names = ["y", updates["m"], updates["v"], grads["x"], grads["s"], grads["b"]]
    for n in names:
        m.graph.output.append(helper.make_tensor_value_info(n, F64, None))
    y_g, rm, rv, gx, gs, gb = ort_session(m).run(names, {"x": x, "g": gy})

    xt = torch.from_numpy(x).requires_grad_(True)
    bn.train()
    yt = bn(xt)
    (yt * torch.from_numpy(gy)).sum().backward()
    np.testing.assert_allclose(y_g, yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rm, bn.running_mean.numpy(), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(rv, bn.running_var.numpy(), rtol=1e-13, atol=1e-15)
    for got, ref in ((gx, xt.grad), (gs, bn.weight.grad), (gb, bn.bias.grad)):
        ref = ref.numpy()
        assert np.linalg.norm(got - ref) <= 1e-10 * np.linalg.norm(ref)


def test_training_bn_is_one_pass_forward_and_lean_backward():
    """Forward: the full-size tensor is read by the two statistics' reductions and one
    BatchNormalization; backward (FP32): a product and two reductions, then dX as one Mul,
    one BatchNormalization (the affine) and one Add: no Sum of several gradients of X."""
    shape = [8, 4, 6, 6]
    m = _bn_graph(shape, [np.ones(4, np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32),
                          np.ones(4, np.float32)], dtype=TensorProto.FLOAT)
    training_forward(m)
    n_fwd = len(m.graph.node)
    add_backward(m, "loss", ["x", "s", "b"])
    inferred = onnx.shape_inference.infer_shapes(m).graph
    full = {v.name for v in list(inferred.value_info) + list(inferred.input)
            if [d.dim_value for d in v.type.tensor_type.shape.dim] == shape}
    assert sorted(n.op_type for n in m.graph.node[:n_fwd] if "x" in n.input) == \
        ["BatchNormalization", "ReduceMean", "ReduceSumSquare"]
    bwd = [n.op_type for n in m.graph.node[n_fwd:] if any(i in full for i in n.input) and n.op_type != "Identity"]
    # one Mul is the loss's (dY = G); the rest is BatchNorm's (Identity: add_backward names dX)
    assert sorted(bwd) == ["Add", "BatchNormalization", "Mul", "Mul", "Mul", "ReduceSum", "ReduceSum"]
    assert "Sum" not in {n.op_type for n in m.graph.node[n_fwd:]}


def _residual_cnn(c=8, size=8, classes=4):
    """x -> Conv -> BN -> Relu -> Conv -> BN -> Add(skip) -> Relu -> GlobalAveragePool -> Gemm."""
    r = np.random.default_rng(1)
    inits = {"w1": r.normal(0, 0.5, (c, 1, 3, 3)), "w2": r.normal(0, 0.2, (c, c, 3, 3)),
             "fc.weight": r.normal(0, 0.3, (classes, c)), "fc.bias": np.zeros(classes)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1] * 4)]
    for i, src in ((1, "c1"), (2, "c2")):
        inits.update({f"bn{i}.s": np.ones(c), f"bn{i}.b": np.zeros(c), f"bn{i}.m": np.zeros(c),
                      f"bn{i}.v": np.ones(c)})
        nodes.append(helper.make_node("BatchNormalization", [src] + [f"bn{i}.{k}" for k in "sbmv"], [f"n{i}"]))
        if i == 1:
            nodes += [helper.make_node("Relu", ["n1"], ["r1"]),
                      helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1] * 4)]
    nodes += [helper.make_node("Add", ["n2", "r1"], ["a"]), helper.make_node("Relu", ["a"], ["r2"]),
              helper.make_node("GlobalAveragePool", ["r2"], ["p"]),
              helper.make_node("Flatten", ["p"], ["f"]),
              helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], transB=1)]
    return tm._model(nodes, inits, ["N", 1, size, size], ["N", classes], "rescnn")


@pytest.mark.parametrize("opset", [13, 17])
def test_mixed_plan_keeps_bn_relu_add_fp16(tmp_path, opset):
    """The mixed step keeps the activations FP16 through BN, ReLU and Add (torch AMP's plan);
    every BatchNormalization's parameters have its X's type (ONNX Runtime's CUDA kernel has no
    FP16-X, FP32-parameter form); the statistics stay FP32 (an opset-13 model is upgraded to
    15, whose BatchNormalization types them apart from X); train.json reports the FP16 share
    of the GEMM FLOPs and the Casts' bytes."""
    path = str(tmp_path / "rescnn.onnx")
    model = _residual_cnn()
    model.opset_import[0].version = opset
    onnx.save(model, path)
    meta = build_step(path, str(tmp_path / "run"), precision="mixed", optimizer="sgd", lr=0.1)
    step = onnx.load(str(tmp_path / "run" / "step.onnx"))
    g = onnx.shape_inference.infer_shapes(step).graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.value_info) + list(g.input) + list(g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    # the forward: the first nodes.forward nodes after the flat state's views (update/..., put first)
    fwd = [n for n in step.graph.node if not n.name.startswith("update/")][:meta["nodes"]["forward"]]
    bns = [n for n in fwd if n.op_type == "BatchNormalization"]
    assert len(bns) == 2
    for n in bns:
        assert types[n.input[0]] == types[n.output[0]] == TensorProto.FLOAT16, n.name
        assert {types[i] for i in n.input[1:]} == {TensorProto.FLOAT16}, n.name
    for op in ("Relu", "Add"):
        ops = [n for n in fwd if n.op_type == op and types.get(n.output[0]) in (TensorProto.FLOAT16,
                                                                                  TensorProto.FLOAT)]
        assert ops and all(types[n.output[0]] == TensorProto.FLOAT16 for n in ops if n.input[0] in
                           {b.output[0] for b in bns} | {"r1", "n2", "a"}), op
    # the BatchNorm statistics (the loss's ReduceMean, train_step/..., is the forward's too)
    stats = [n for n in fwd if n.op_type in ("ReduceMean", "ReduceSumSquare") and n.name.startswith("train/")]
    assert len(stats) == 4 and all(types[n.output[0]] == TensorProto.FLOAT for n in stats)
    cost = meta["precision_cost"]
    assert cost["gemm_low_share"] == 1.0 and cost["gemm_gflop"] > 0 and cost["cast_mb"] > 0
    assert cost == precision_cost(step, cost["shapes"])


def test_precision_cost_counts_gemm_flops_by_type_and_cast_bytes():
    """FLOPs: 2 x multiply-adds of each Conv/MatMul as written, by the type of its input;
    Casts: input + output bytes; at the shapes given for the free batch axis."""
    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    nodes = [helper.make_node("Cast", ["x"], ["x16"], to=f16),
             helper.make_node("Conv", ["x16", "w"], ["c"], pads=[1] * 4),
             helper.make_node("Cast", ["c"], ["c32"], to=f32),
             helper.make_node("Flatten", ["c32"], ["fl"]),
             helper.make_node("MatMul", ["fl", "m"], ["y"])]
    inits = [numpy_helper.from_array(np.zeros((6, 3, 3, 3), np.float16), "w"),
             numpy_helper.from_array(np.zeros((6 * 5 * 5, 2), np.float32), "m")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f32, ["N", 3, 5, 5])],
                          [helper.make_tensor_value_info("y", f32, ["N", 2])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    for n in (1, 4):
        cost = precision_cost(model, {"x": [n, 3, 5, 5]})
        conv = 2 * (n * 6 * 5 * 5) * (3 * 3 * 3)
        matmul = 2 * (n * 2) * (6 * 5 * 5)
        assert cost["gemm_gflop"] == float(f"{(conv + matmul) / 1e9:.4g}")
        assert cost["gemm_low_share"] == round(conv / (conv + matmul), 4)
        assert cost["cast_mb"] == float(f"{(n * 75 * (4 + 2) + n * 150 * (2 + 4)) / 1e6:.4g}")
        assert cost["casts"] == 2 and cost["unknown_shapes"] == 0


@pytest.mark.parametrize("low", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_batchnorm_params_to_x_type_computes_the_same_output(low):
    """FP16 X with FP32 parameters becomes a BatchNormalization whose inputs are all FP16 (BF16:
    Mul and Add, no BatchNormalization kernel takes BF16); the output agrees with the FP32
    formula on the same low-precision X within the output type's rounding."""
    from graphmp.model_runs import run_reference
    from graphmp.train.autodiff import batchnorm_params_to_x_type
    ml_dtypes = pytest.importorskip("ml_dtypes")
    r = np.random.default_rng(3)
    p = [r.uniform(0.5, 1.5, 3), r.uniform(-1, 1, 3), r.uniform(-1, 1, 3), r.uniform(0.5, 2, 3)]
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-3)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", low, [2, 3, 4])],
                          [helper.make_tensor_value_info("y", low, [2, 3, 4])],
                          [numpy_helper.from_array(a.astype(np.float32), k) for k, a in zip("sbmv", p)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)])
    assert batchnorm_params_to_x_type(m) == 1
    onnx.checker.check_model(m, full_check=True)
    types = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(m).graph.value_info}
    for n in m.graph.node:
        if n.op_type == "BatchNormalization":
            assert {types[i] for i in n.input[1:]} == {low}
    assert ("BatchNormalization" in {n.op_type for n in m.graph.node}) == (low == TensorProto.FLOAT16)
    x = r.standard_normal((2, 3, 4)).astype(np.float16 if low == TensorProto.FLOAT16 else ml_dtypes.bfloat16)
    y = run_reference(m, {"x": x})["y"].astype(np.float32)
    xr = x.astype(np.float32)
    ref = (xr - p[2][:, None]) / np.sqrt(p[3][:, None] + 1e-3) * p[0][:, None] + p[1][:, None]
    ulp = 2.0 ** -10 if low == TensorProto.FLOAT16 else 2.0 ** -7
    assert np.abs(y - ref).max() <= 4 * ulp * max(1.0, np.abs(ref).max())


def test_train_graph_summary_reports_the_precision_cost(tmp_path, capsys):
    """`train-graph` says, at its build's batch, the FP16 share of the GEMM FLOPs and the
    Casts' bytes, as train.json's precision_cost has them."""
    import json
    from graphmp.cli import main
    path = str(tmp_path / "rescnn.onnx")
    onnx.save(_residual_cnn(), path)
    assert main(["train-graph", path, "-o", str(tmp_path / "run"), "--precision", "mixed"]) == 0
    cost = json.load(open(tmp_path / "run" / "train.json"))["precision_cost"]
    out = capsys.readouterr().out
    assert f"{cost['gemm_low_share']:.0%} of {cost['gemm_gflop']:g} GFLOP" in out
    assert f"{cost['casts']} Casts moving {cost['cast_mb']:g} MB per step" in out
    assert str(cost["shapes"]) in out


def test_bn_momentum_is_onnx_convention_and_a_torch_looking_value_is_warned(tmp_path):
    """bn_momentum weights the OLD running statistics (ONNX): one step from running mean 0 moves
    it to (1 - bn_momentum) * batch mean; a value below 0.5 (torch's convention, likely a
    mistake) is built as given, with a train.json warning naming the ONNX value."""
    from graphmp.train.loop import StepRunner, latest_state, load_run
    path = str(tmp_path / "cnn.onnx")
    onnx.save(tm.cnn(), path)
    data = tm.bars(8, seed=2)
    for mom in (0.9, 0.1):
        run = str(tmp_path / f"m{mom}")
        meta = build_step(path, run, precision="fp32", optimizer="sgd", lr=0.1, bn_momentum=mom)
        assert any("bn_momentum 0.1" in w and "bn_momentum 0.9" in w for w in meta["warnings"]) == (mom < 0.5)
        state, _ = latest_state(run)
        r = StepRunner(run, load_run(run), state)
        r.step(data)  # the first step's statistics come from the initial weights, whatever lr
        got = r.state_numpy()["bn.running_mean"]
        if mom == 0.9:
            ref = got
            assert np.abs(ref).max() > 1e-3  # the batch moved it
        else:  # (1 - 0.1) / (1 - 0.9) = 9 times the 0.9 run's move from 0
            np.testing.assert_allclose(got, 9 * ref, rtol=1e-5, atol=1e-7)


def test_precision_cost_knows_every_shape_of_a_maxpool_cnn_step(tmp_path):
    """A step with MaxPool's backward (index math over the whole input) is measured without
    losing a shape: onnx's data propagation, which materialised those index tensors, failed
    on a ResNet-50 step after 13 GB and left every GEMM unknown."""
    path = str(tmp_path / "cnn.onnx")
    onnx.save(tm.cnn(), path)
    meta = build_step(path, str(tmp_path / "run"), precision="mixed", optimizer="sgd", lr=0.1)
    cost = meta["precision_cost"]
    assert cost["unknown_shapes"] == 0 and cost["gemm_gflop"] > 0 and cost["gemm_low_share"] == 1.0

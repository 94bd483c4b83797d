"""Convolution and MatMul gradients in their GEMM forms (graphmp/train/rules/conv_gemm.py,
nn.py, linalg.py): every dW form and the GEMM form of dX against finite differences on every
Conv / ConvTranspose case of test_autodiff, whichever form the shape rule would pick; and the
structure that makes them fast (no convolution whose kernel is the output map, no Pad/Slice
copies of dX, dX as one MatMul over the batch for wide convs on small maps, no per-batch
partials of a MatMul weight gradient, FP32 sums of FP16 partials)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphmp.model_runs import ort_session
from graphmp.train.autodiff import add_backward
from graphmp.train.rules import conv_gemm, nn
from tests.test_autodiff import CASES, F16, F32, N, _rng, backward, check_gradients, loss_model

CONV_CASES = [c for c in CASES if c.nodes[0].op_type in ("Conv", "ConvTranspose")]
FORMS = sorted(conv_gemm.WEIGHT_GRAD_FORMS)


def _force(monkeypatch, form):
    """Make _conv_weight_grad use `form` wherever the shapes allow it (per_tap: group 1)."""
    def pick(s):
        return None if form == "conv" or (form == "per_tap" and s["group"] != 1) else form
    monkeypatch.setattr(nn, "weight_grad_form", pick)


def _new_ops(case, dtype=np.float32):
    m, feeds = loss_model(case, dtype)
    b, _ = backward(m, [k for k, v in feeds.items() if v.dtype.kind == "f"])
    return list(b.graph.node[len(m.graph.node):])


@pytest.mark.parametrize("form", FORMS + ["conv"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[c.id for c in CONV_CASES])
def test_every_weight_grad_form_matches_finite_differences(monkeypatch, case, form):
    _force(monkeypatch, form)
    ops = {n.op_type for n in _new_ops(case)}
    # the forced form is the one emitted: a GEMM form has a Gemm/MatMul and no dW convolution
    # (ConvTranspose's dX is a Conv, so only the GEMM shows there)
    grouped = next((a.i for a in case.nodes[0].attribute if a.name == "group"), 1) != 1
    if form == "conv" or (form == "per_tap" and grouped):
        assert "Conv" in ops and not ops & {"Gemm", "MatMul"}, ops
    else:
        assert ops & {"Gemm", "MatMul"}, ops
        assert case.nodes[0].op_type == "ConvTranspose" or "Conv" not in ops, ops
    check_gradients(case)


@pytest.mark.parametrize("case", CONV_CASES, ids=[c.id for c in CONV_CASES])
def test_gemm_input_grad_matches_finite_differences(monkeypatch, case):
    """dX as MatMul + col2im (conv_gemm.input_grad_gemm) wherever it applies (group 1, static
    spatial sizes): strides, dilations, asymmetric pads, output rows no window reaches, 1-D
    and 3-D. A Conv's dX then has no ConvTranspose (a ConvTranspose's dX is a Conv anyway)."""
    monkeypatch.setattr(nn, "input_grad_form", lambda s: "gemm" if s["group"] == 1 else None)
    ops = [n.op_type for n in _new_ops(case)]
    grouped = next((a.i for a in case.nodes[0].attribute if a.name == "group"), 1) != 1
    if case.nodes[0].op_type == "Conv":
        assert ("ConvTranspose" in ops) == grouped, ops
        assert grouped or "MatMul" in ops, ops
    check_gradients(case)


def _conv_model(x_shape, w_shape, dtype=F32, **attrs):
    """Conv(x, w) -> loss = sum(y * R), with x's shape as given (ints or names)."""
    rng = _rng("cm" + str(w_shape))
    w = rng.standard_normal(w_shape).astype(np.float32)
    nodes = [N("Cast", ["w"], ["wc"], to=dtype), N("Cast", ["x"], ["xc"], to=dtype),
             N("Conv", ["xc", "wc"], ["yc"], **attrs), N("Cast", ["yc"], ["y"], to=F32),
             N("Mul", ["y", "y"], ["y2"]), N("ReduceSum", ["y2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", F32, x_shape)],
                          [helper.make_tensor_value_info("loss", F32, [])], [numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _grads(model, x, wrt=("x", "w")):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    grads = add_backward(m, "loss", list(wrt))
    for k in wrt:
        m.graph.output.append(helper.make_tensor_value_info(grads[k], F32, None))
    return m, grads, ort_session(m).run([grads[k] for k in wrt], {"x": x})


def test_resnet_3x3_weight_grad_is_a_gemm_not_a_conv_over_the_output_map():
    """The default rule on ResNet-like 3x3 convs (and strided and 1x1 cousins), the batch
    symbolic: dW has no Conv at all (the old form's kernel was the whole output map), only
    GEMMs: one per kernel tap (per_tap: Cin >= 16 on a map of more than 49 output positions)
    or one in all (a 7x7 output: one GEMM over the column matrix)."""
    for cin, w_shape, attrs, gemms in [(32, (16, 32, 3, 3), dict(pads=[1, 1, 1, 1]), 9),
                                       (32, (16, 32, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1]), 1),
                                       (8, (16, 8, 3, 3), dict(pads=[1, 1, 1, 1]), 1),
                                       (8, (16, 8, 1, 1), dict(strides=[2, 2]), 1)]:
        model = _conv_model(["n", cin, 14, 14], w_shape, **attrs)
        m, _, _ = _grads(model, _rng("x3").standard_normal((2, cin, 14, 14)).astype(np.float32), wrt=("w",))
        ops = [n.op_type for n in m.graph.node[len(model.graph.node):]]
        assert "Conv" not in ops and ops.count("Gemm") + ops.count("MatMul") == gemms, (w_shape, attrs, ops)


def test_input_grad_has_no_pad_or_slice_copies_and_symbolic_spatial_sizes_agree():
    """With static spatial sizes dX is one ConvTranspose (pads + output_padding) with no Pad or
    Slice after it, and dW a GEMM; with symbolic ones the convolution forms stay (ConvTranspose
    + Pad + Slice, dW as a Conv); both give the same numbers."""
    attrs = dict(strides=[2, 2], pads=[1, 0, 0, 1])  # (7 + 1 - 2 - 1) mod 2 = 1: output_padding used
    x = _rng("xsym").standard_normal((2, 3, 7, 6)).astype(np.float32)
    static = _conv_model([2, 3, 7, 6], (4, 3, 3, 3), **attrs)
    symbolic = _conv_model(["n", 3, "h", "w"], (4, 3, 3, 3), **attrs)
    ms, _, (gx_s, gw_s) = _grads(static, x)
    md, _, (gx_d, gw_d) = _grads(symbolic, x)
    for m, copies in ((ms, set()), (md, {"Pad"})):
        ct = [n for n in m.graph.node if n.op_type == "ConvTranspose"]
        assert len(ct) == 1
        assert {n.op_type for n in m.graph.node if ct[0].output[0] in n.input} & {"Pad", "Slice"} == copies
    assert [list(a.ints) for a in ct[0].attribute if a.name == "output_padding"] == []
    assert [list(a.ints) for n in ms.graph.node if n.op_type == "ConvTranspose"
            for a in n.attribute if a.name == "output_padding"] == [[1, 0]]
    assert "Conv" not in [n.op_type for n in ms.graph.node[len(static.graph.node):]]  # dW: a GEMM
    assert "Conv" in [n.op_type for n in md.graph.node[len(symbolic.graph.node):]]   # dW: the conv form
    np.testing.assert_allclose(gx_s, gx_d, rtol=1e-5, atol=1e-5 * np.abs(gx_d).max())
    np.testing.assert_allclose(gw_s, gw_d, rtol=1e-5, atol=1e-5 * np.abs(gw_d).max())


def test_fp16_per_sample_partials_are_summed_in_fp32(monkeypatch):
    """An FP16 conv whose dW uses per-sample partials: the GEMM runs in FP16, the partials
    are widened to FP32 before the ReduceSum over the batch, and dW matches the FP32 graph's
    within FP16 rounding."""
    _force(monkeypatch, "per_sample")
    x = _rng("x16").standard_normal((4, 8, 10, 10)).astype(np.float32)
    m16, _, (_, gw16) = _grads(_conv_model([4, 8, 10, 10], (8, 8, 3, 3), F16, pads=[1, 1, 1, 1]), x, ("x", "w"))
    _, _, (_, gw32) = _grads(_conv_model([4, 8, 10, 10], (8, 8, 3, 3), F32, pads=[1, 1, 1, 1]), x, ("x", "w"))
    inferred = onnx.shape_inference.infer_shapes(m16)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    matmul = [n for n in m16.graph.node if n.op_type == "MatMul"]
    assert len(matmul) == 1 and types[matmul[0].output[0]] == F16
    batch_sums = [n for n in m16.graph.node if n.op_type == "ReduceSum" and n.input[0] != "y2"]
    assert len(batch_sums) == 1 and all(types[n.input[0]] == TensorProto.FLOAT for n in batch_sums)
    np.testing.assert_allclose(gw16, gw32, rtol=2e-2, atol=2e-3 * np.abs(gw32).max())


def test_wide_conv_on_a_small_map_has_a_gemm_input_grad_equal_to_conv_transpose(monkeypatch):
    """The default rule: a 128-channel 3x3 conv on a 4x4 map (ResNet's last stages) gets dX as
    one MatMul over the batch, no ConvTranspose; a 3-channel one keeps ConvTranspose; the GEMM
    form's dX equals the ConvTranspose form's (forced) within FP32 rounding, in FP32 and, with
    the taps summed in FP32, in FP16."""
    x = _rng("xw").standard_normal((2, 128, 4, 4)).astype(np.float32)
    narrow = _conv_model([2, 3, 4, 4], (4, 3, 3, 3), pads=[1, 1, 1, 1])
    m, _, _ = _grads(narrow, x[:, :3], wrt=("x",))
    assert "ConvTranspose" in [n.op_type for n in m.graph.node]
    for dtype, tol in ((F32, 1e-5), (F16, 2e-2)):
        wide = _conv_model(["n", 128, 4, 4], (128, 128, 3, 3), dtype, pads=[1, 1, 1, 1], strides=[1, 1])
        m, _, (gemm_dx,) = _grads(wide, x, wrt=("x",))
        new = m.graph.node[len(wide.graph.node):]
        assert "ConvTranspose" not in [n.op_type for n in new] and [n.op_type for n in new].count("MatMul") == 1
        if dtype == F16:
            inferred = onnx.shape_inference.infer_shapes(m)
            types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
            assert all(types[t] == TensorProto.FLOAT for n in new if n.op_type == "Sum" for t in n.input)
        with monkeypatch.context() as mp:
            mp.setattr(nn, "input_grad_form", lambda s: None)
            m, _, (conv_t_dx,) = _grads(wide, x, wrt=("x",))
            assert "ConvTranspose" in [n.op_type for n in m.graph.node]
        np.testing.assert_allclose(gemm_dx, conv_t_dx, rtol=tol, atol=tol * np.abs(conv_t_dx).max())


@pytest.mark.parametrize("a_shape,b_shape,flat", [((2, 3, 4), (4, 5), "b"), ((2, 3, 2, 4), (4, 5), "b"),
                                                  ((3, 4), (2, 4, 5), "a"), ((3, 4), (2, 2, 4, 5), "a")])
def test_matmul_weight_grad_is_one_gemm_without_partials(a_shape, b_shape, flat):
    """The 2-D operand of a batched MatMul gets its gradient from one Gemm over the flattened
    batch: no ReduceSum of per-batch partials; the values are checked in test_autodiff."""
    rng = _rng("mm" + str(a_shape))
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    nodes = [N("MatMul", ["a", "b"], ["y"]), N("ReduceSum", ["y"], ["loss"], keepdims=0)]
    vi = helper.make_tensor_value_info
    m = helper.make_model(helper.make_graph(nodes, "mm", [vi("a", F32, a.shape), vi("b", F32, b.shape)],
                                            [vi("loss", F32, [])]),
                          opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    before = len(m.graph.node)
    add_backward(m, "loss", [flat])
    ops = [n.op_type for n in m.graph.node[before:]]
    assert ops.count("Gemm") == 1 and "ReduceSum" not in ops and "MatMul" not in ops, ops

"""Gradient rules of the loss ops (SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss)."""
from __future__ import annotations

from onnx import TensorProto

from ...errors import GraphmpError
from ..emitter import Emitter, attr, rule
from .common import _inputs


def _nll_grad(em: Emitter, node, g: str, probs: str | None, logits_like: str) -> str:
    """Gradient of the weighted negative log-likelihood w.r.t. its log-probability input
    (probs None) or, for softmax cross-entropy, w.r.t. the scores (probs = softmax):
    (probs - onehot) * coeff, or -onehot * coeff; coeff = dY * w_i [/ sum w]."""
    labels, weights = _inputs(node, 3)[1:3]
    if weights and em.needs(weights):
        raise GraphmpError(f"node '{node.name}' ({node.op_type}): the class weights '{weights}' depend on "
                           "a differentiated tensor; they get no gradient (make them a constant)")
    dt = em.dtype(logits_like)
    rank = em.rank(logits_like)
    reduction = attr(node, "reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    ignore = attr(node, "ignore_index")
    lab = em.cast(labels, TensorProto.INT64, em.dtype(labels))
    valid = None
    if ignore is not None:
        valid = em.op("Not", [em.op("Equal", [lab, em.const(ignore, TensorProto.INT64)])])
        lab = em.op("Where", [valid, lab, em.const(0, TensorProto.INT64)])
    classes = em.op("Range", [em.const(0, TensorProto.INT64),
                              em.op("Reshape", [em.dim(logits_like, 1), em.ints([])]),
                              em.const(1, TensorProto.INT64)])
    classes = em.op("Reshape", [classes, em.ints([1, -1] + [1] * (rank - 2))])
    onehot = em.op("Cast", [em.op("Equal", [em.unsqueeze(lab, [1]), classes])], to=dt)
    w = em.op("Gather", [weights, lab], axis=0) if weights else None
    if valid is not None:
        vf = em.op("Cast", [valid], to=dt)
        w = vf if w is None else em.op("Mul", [w, vf])
    coeff = g
    if reduction == "mean":
        denom = (em.op("ReduceSum", [w], keepdims=0) if w is not None
                 else em.op("Cast", [em.op("Size", [lab])], to=dt))
        coeff = em.op("Div", [coeff, denom])
    elif reduction not in ("sum", "none"):
        raise GraphmpError(f"node '{node.name}' ({node.op_type}): unknown reduction '{reduction}'")
    if w is not None:
        coeff = em.op("Mul", [coeff, w])
    if w is not None or reduction == "none":
        coeff = em.unsqueeze(coeff, [1])
    base = em.op("Sub", [probs, onehot]) if probs else em.op("Neg", [onehot])
    return em.op("Mul", [base, coeff])


@rule("SoftmaxCrossEntropyLoss", outputs=(0,))
def softmax_cross_entropy(em, node, g):
    """L = -w_y log softmax(S, axis=1)_y (reduced mean/sum/none): dS = (softmax(S) - onehot(y))
    * dL * w_y [/ sum of w]; ignore_index rows get 0; no gradient to labels or weights."""
    scores = node.input[0]
    logp = node.output[1] if len(node.output) > 1 and node.output[1] else \
        em.op("LogSoftmax", [scores], axis=1)
    probs = em.op("Exp", [logp])
    return [_nll_grad(em, node, g[0], probs, scores), None, None]


@rule("NegativeLogLikelihoodLoss")
def nll_loss(em, node, g):
    """L = -w_y X_y (reduced mean/sum/none): dX = -onehot(y) * dL * w_y [/ sum of w]."""
    return [_nll_grad(em, node, g[0], None, node.input[0]), None, None]

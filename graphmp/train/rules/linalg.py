"""Gradient rules of MatMul, Gemm and Einsum."""
from __future__ import annotations

from ...errors import GraphmpError
from ..emitter import attr, rule
from .common import _cat, _inputs, _swap_last2


# --- linear algebra ----------------------------------------------------------------------------

@rule("MatMul")
def matmul(em, node, g):
    """Y = A @ B (numpy batching, 1-D operands promoted): dA = dY @ B^T, dB = A^T @ dY,
    summed over broadcast batch axes; a 2-D operand (a weight) of a batched product gets its
    gradient as one Gemm over the flattened batch instead of per-batch partials + ReduceSum."""
    a, b = node.input
    gy = g[0]
    ra, rb = em.rank(a), em.rank(b)
    ad, bd, yd = em.dims(a), em.dims(b), em.dims(node.output[0])
    ga = gb = None
    if ra == 1 and rb == 1:
        ga = em.op("Mul", [gy, b]) if em.needs(a) else None
        gb = em.op("Mul", [gy, a]) if em.needs(b) else None
    elif ra == 1:  # a [K], b [..., K, N], y [..., N]
        g2 = em.unsqueeze(gy, [-2])
        if em.needs(a):
            ga = em.unbroadcast(em.op("MatMul", [g2, _swap_last2(em, b, rb)]), a,
                                _cat(yd[:-1] if yd else None, [1, ad[0]]))
        if em.needs(b):
            gb = em.unbroadcast(em.op("MatMul", [em.unsqueeze(a, [-1]), g2]), b,
                                _cat(yd[:-1] if yd else None, [ad[0], yd[-1] if yd else None]))
    elif rb == 1:  # a [..., M, K], b [K], y [..., M]
        g2 = em.unsqueeze(gy, [-1])
        if em.needs(a):
            ga = em.unbroadcast(em.op("MatMul", [g2, em.unsqueeze(b, [0])]), a, _cat(yd, [bd[0]]))
        if em.needs(b):
            gb = em.unbroadcast(em.squeeze(em.op("MatMul", [_swap_last2(em, a, ra), g2]), [-1]), b,
                                _cat(yd[:-1] if yd else None, [bd[0]]))
    else:
        if em.needs(a):
            ga = (_flat_lhs_grad(em, gy, b, rb, ad) if ra == 2 < rb and _static(ad) else
                  em.unbroadcast(em.op("MatMul", [gy, _swap_last2(em, b, rb)]), a,
                                 _cat(yd[:-1] if yd else None, [ad[-1]])))
        if em.needs(b):
            gb = (_flat_rhs_grad(em, a, gy, bd) if rb == 2 < ra and _static(bd) else
                  em.unbroadcast(em.op("MatMul", [_swap_last2(em, a, ra), gy]), b,
                                 _cat(yd[:-2] if yd else None, [ad[-1], yd[-1] if yd else None])))
    return [ga, gb]


def _static(dims) -> bool:
    return dims is not None and all(isinstance(v, int) for v in dims)


def _flat_rhs_grad(em, a: str, gy: str, b_dims: list[int]) -> str:
    """dB [K, M] of A [..., T, K] @ B [K, M] (B 2-D, A batched) as one GEMM whose reduction
    runs over the batch and T together: A and dY viewed as [-1, K] and [-1, M],
    dB = Gemm(A', dY', transA=1). No per-batch partials [..., K, M] summed afterwards (so no
    FP16 partials in mixed precision: the GEMM accumulates as its kernel does)."""
    k, m = b_dims
    return em.op("Gemm", [em.op("Reshape", [a, em.ints([-1, k])]), em.op("Reshape", [gy, em.ints([-1, m])])],
                 transA=1)


def _flat_lhs_grad(em, gy: str, b: str, rank: int, a_dims: list[int]) -> str:
    """dA [T, K] of A [T, K] @ B [..., K, M] (A 2-D, B batched, rank > 2) as one GEMM over
    the batch and M together: dY [..., T, M] with T moved first as [T, -1], B with K moved
    first as [K, -1], dA = Gemm(dY', B', transB=1) (no per-batch partials)."""
    t, k = a_dims
    lead = list(range(rank - 2))
    gy2 = em.op("Reshape", [em.transpose(gy, [rank - 2] + lead + [rank - 1]), em.ints([t, -1])])
    b2 = em.op("Reshape", [em.transpose(b, [rank - 2] + lead + [rank - 1]), em.ints([k, -1])])
    return em.op("Gemm", [gy2, b2], transB=1)


@rule("Gemm")
def gemm(em, node, g):
    """Y = alpha * A' @ B' + beta * C (A' = A^T if transA ...): dA' = alpha dY B'^T,
    dB' = alpha A'^T dY, dC = beta dY summed over broadcast axes."""
    a, b, c = _inputs(node, 3)
    gy = g[0]
    alpha, beta = attr(node, "alpha", 1.0), attr(node, "beta", 1.0)
    ta, tb = attr(node, "transA", 0), attr(node, "transB", 0)
    out = [None, None, None]
    if em.needs(a):
        out[0] = (em.op("Gemm", [gy, b], alpha=alpha, transB=1 - tb) if not ta
                  else em.op("Gemm", [b, gy], alpha=alpha, transA=tb, transB=1))
    if em.needs(b):
        out[1] = (em.op("Gemm", [a, gy], alpha=alpha, transA=1 - ta) if not tb
                  else em.op("Gemm", [gy, a], alpha=alpha, transA=1, transB=ta))
    if c and em.needs(c):
        gc = gy if beta == 1.0 else em.op("Mul", [gy, em.like(beta, c)])
        out[2] = em.unbroadcast(gc, c, node.output[0])
    return out


@rule("Einsum")
def einsum(em, node, g):
    """Y = einsum(eq, X1..Xn) with an explicit output ('->'), no ellipsis, no index repeated
    within one operand: dXi = einsum of dY and the other operands onto Xi's indices; an index
    that only Xi has (summed out) is broadcast back with Unsqueeze + Expand."""
    eq = attr(node, "equation")
    eq = (eq.decode() if isinstance(eq, bytes) else eq).replace(" ", "")
    terms = eq.split("->")[0].split(",") if "->" in eq else []
    if "->" not in eq or "." in eq or any(len(set(t)) != len(t) for t in terms):
        raise GraphmpError(f"node '{node.name}' (Einsum '{eq}'): only equations with an explicit output "
                           "('->'), no ellipsis and no index repeated within an operand are differentiated")
    out = eq.split("->")[1]
    grads = []
    for i, (x, term) in enumerate(zip(node.input, terms)):
        if not em.needs(x):
            grads.append(None)
            continue
        others = [(node.input[j], terms[j]) for j in range(len(terms)) if j != i]
        avail = set(out).union(*[set(t) for _, t in others])
        keep = "".join(c for c in term if c in avail)
        if out:
            r = em.op("Einsum", [g[0]] + [o for o, _ in others],
                      equation=",".join([out] + [t for _, t in others]) + "->" + keep)
        elif others:  # scalar output: dY is a scalar factor
            r = em.op("Mul", [em.op("Einsum", [o for o, _ in others],
                                    equation=",".join(t for _, t in others) + "->" + keep), g[0]])
        else:
            r = g[0]
        missing = [k for k, c in enumerate(term) if c not in avail]
        if missing:
            r = em.expand_like(em.unsqueeze(r, missing) if keep else r, x)
        grads.append(r)
    return grads

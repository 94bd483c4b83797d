"""Graph patterns that crash ONNX Runtime when they run in FP16, found by bisecting real
crashes, and the rule that keeps them FP32 (classify's first rule).

A rule here is a fact about a runtime, not about precision: the model is correct in FP16,
but the runtime cannot open it. Each pattern names what ONNX Runtime does with it, so the
rule can go when the runtime is fixed. The post-write load check (graphmp/load_check.py)
is the safety net for patterns not listed here.

TRANSPOSE_INTO_MATMUL (measured on ONNX Runtime 1.32, x86-64 CPU provider, default session
options; graph_optimization_level ORT_ENABLE_EXTENDED loads the same file): a Transpose
whose permutation moves the leading (batch) axis, as FusedMatMul's transBatchA absorbs it
([1, 0, 2], [1, 2, 0]; [1, 2, 0, 3], [1, 2, 3, 0]; ...), feeding input A of a MatMul whose
B is a constant matrix, through Casts or scalings by a constant. In FP16 the CPU provider
has no MatMul kernel, so the runtime puts a Cast between them; its MatMul+Transpose fusion
then builds FusedMatMul around that Cast, and the NCHWc layout pass that runs after it
dereferences a node with no schema and kills the process (SIGSEGV, at session creation;
onnxruntime issue 28392). torch's nn.MultiheadAttention exports exactly this for a
batch_first nn.TransformerEncoder: Transpose(perm [1, 0, 2]) into the in_proj MatMul.
Other permutations ([0, 2, 1], [2, 0, 1], [1, 0, 2, 3]), a 3-D or computed B, and the FP32
pattern load. Keeping the Transpose FP32 (it reads FP32, and a Cast feeds the FP16
MatMul) loads, and the MatMul still runs in FP16.
"""
from __future__ import annotations

TRANSPOSE_INTO_MATMUL = ("kept FP32 so ONNX Runtime can open the model: in FP16 a Transpose that moves the batch "
                         "axis into a MatMul with a constant weight crashes ONNX Runtime's CPU session at its "
                         "default options (onnxruntime issue 28392)")

# ops between the Transpose and the MatMul that ONNX Runtime's fusions look through
_PASS_THROUGH = ("Cast", "Identity")
_SCALINGS = ("Mul", "Div")
_MAX_HOPS = 4


def batch_moving(perm) -> bool:
    """perm moves axis 0 to just before the last axis, or to the last with the last two
    swapped: the permutations FusedMatMul's transBatchA (with or without transA) absorbs."""
    if perm is None or len(perm) < 3:
        return False
    r = len(perm)
    middle = list(range(1, r - 1))
    return list(perm) in (middle + [0, r - 1], middle + [r - 1, 0])


def _constant(g, name: str, producers: dict):
    """The initializer `name` is (directly or through Casts and Identities), or None."""
    for _ in range(_MAX_HOPS):
        owner = g.owner_of(name) if name else None
        if owner is not None and name in owner.initializers:
            return owner.initializers[name]
        p = producers.get(name)
        if p is None or p.op_type not in _PASS_THROUGH or not p.inputs:
            return None
        name = p.inputs[0]
    return None


def _scalar_constant(g, name: str, producers: dict) -> bool:
    t = _constant(g, name, producers)
    return t is not None and all(d == 1 for d in t.dims)


def _reaches_matmul(g, start: str, consumers: dict, producers: dict) -> bool:
    """A MatMul reads `start` (through pass-through ops and constant scalings) as input A,
    with a constant 2-D B."""
    frontier, seen = [start], set()
    for _ in range(_MAX_HOPS):
        nxt = []
        for x in frontier:
            for m in consumers.get(x, ()):
                if m.domain not in ("", "ai.onnx") or m in seen:
                    continue
                seen.add(m)
                if m.op_type == "MatMul" and len(m.inputs) == 2 and m.inputs[0] == x:
                    b = _constant(g, m.inputs[1], producers)
                    if b is not None and len(b.dims) == 2:
                        return True
                elif m.op_type in _PASS_THROUGH or (
                        m.op_type in _SCALINGS and m.inputs[0] == x and _scalar_constant(g, m.inputs[1], producers)):
                    nxt.extend(o for o in m.outputs[:1] if o)
        frontier = nxt
    return False


def reason(g, n, consumers: dict, producers: dict) -> str | None:
    """The FP32 reason for node n of graph g when it is a Transpose that crashes ONNX Runtime
    in FP16 (TRANSPOSE_INTO_MATMUL), else None. consumers/producers: g's maps."""
    if n.op_type != "Transpose" or n.domain not in ("", "ai.onnx") or not n.outputs:
        return None
    if not batch_moving(n.attr("perm")):
        return None
    return TRANSPOSE_INTO_MATMUL if _reaches_matmul(g, n.outputs[0], consumers, producers) else None

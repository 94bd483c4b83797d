"""onnx.reference implementations of ONNX Runtime's fused com.microsoft ops, for
graphmp's FP16-faithful oracle (graphmp.model_runs.run_reference) on `--fuse ort` models.

Semantics are those of ORT's CUDA kernels, which the oracle stands for: inputs are read
in their declared type (FP16 when lowered), the math (sums, layer-norm statistics,
softmax) runs in FP32, and each output is rounded once to its declared type. Each class
is tested against ONNX Runtime CPU in FP32 on random inputs (tests/test_fuse.py).
Supported forms: what ORT's transformer optimizer emits for encoders and decoders
without a KV cache (Attention and MultiHeadAttention without past / present state).
"""
from __future__ import annotations

import math

import numpy as np
from onnx.reference.op_run import OpRun

F32 = np.float32


def _f(x):
    return None if x is None else np.asarray(x).astype(F32)


def _layer_norm(x, gamma, beta, eps, simplified=False):
    """(y, mean, inv_std) over the last axis, in FP32."""
    mean = np.zeros(x.shape[:-1] + (1,), F32) if simplified else x.mean(-1, keepdims=True)
    xc = x - mean
    inv_std = 1.0 / np.sqrt((xc * xc).mean(-1, keepdims=True) + F32(eps))
    y = xc * inv_std * gamma
    if beta is not None:
        y = y + beta
    return y, mean, inv_std


_erf = np.vectorize(math.erf, otypes=[F32])  # as onnx.reference's Erf (no scipy dependency)


def _gelu(x):
    return 0.5 * x * (1.0 + _erf(x / F32(math.sqrt(2.0))))


def _fast_gelu(x):
    return 0.5 * x * (1.0 + np.tanh(F32(0.7978845608028654) * (x + F32(0.044715) * x * x * x)))


class _Fused(OpRun):
    # onnx.reference also passes the default attributes of a same-named ONNX op (Gelu,
    # Attention): each _run takes them as **_onnx_defaults and ignores them.
    op_domain = "com.microsoft"

    def _out(self, dtype, *ys):
        """The node's outputs, each float one rounded once to `dtype` (the op's T),
        except positions in _fp32_outputs (typed tensor(float) by the schema)."""
        keep = getattr(self, "_fp32_outputs", ())
        ys = [np.asarray(y) for y in ys[:len(self.output)]]
        return tuple(y if i in keep or y.dtype.kind != "f" else y.astype(dtype) for i, y in enumerate(ys))


class SkipLayerNormalization(_Fused):
    _fp32_outputs = (1, 2)  # mean, inv_std_var are tensor(float)

    def _run(self, x, skip, gamma, beta=None, bias=None, epsilon=None, **_onnx_defaults):
        s = _f(x) + _f(skip) + (_f(bias) if bias is not None else F32(0))
        y, mean, inv_std = _layer_norm(s, _f(gamma), _f(beta), 1e-12 if epsilon is None else epsilon)
        return self._out(x.dtype, y, mean, inv_std, s)


class SkipSimplifiedLayerNormalization(_Fused):
    _fp32_outputs = (1, 2)

    def _run(self, x, skip, gamma, bias=None, epsilon=None, **_onnx_defaults):
        s = _f(x) + _f(skip) + (_f(bias) if bias is not None else F32(0))
        y, mean, inv_std = _layer_norm(s, _f(gamma), None, 1e-12 if epsilon is None else epsilon, simplified=True)
        return self._out(x.dtype, y, mean, inv_std, s)


class BiasGelu(_Fused):
    def _run(self, a, b, **_onnx_defaults):
        return self._out(a.dtype, _gelu(_f(a) + _f(b)))


class Gelu(_Fused):
    def _run(self, x, **_onnx_defaults):
        return self._out(x.dtype, _gelu(_f(x)))


class FastGelu(_Fused):
    def _run(self, x, bias=None, **_onnx_defaults):
        return self._out(x.dtype, _fast_gelu(_f(x) + (_f(bias) if bias is not None else F32(0))))


class QuickGelu(_Fused):
    def _run(self, x, alpha=None, **_onnx_defaults):
        a = F32(1.702 if alpha is None else alpha)
        v = _f(x)
        return self._out(x.dtype, v / (1.0 + np.exp(-a * v)))


class EmbedLayerNormalization(_Fused):
    def _run(self, input_ids, segment_ids, word_embedding, position_embedding, segment_embedding=None,
             gamma=None, beta=None, mask=None, position_ids=None, epsilon=None, mask_index_type=None, **_onnx_defaults):
        b, s = input_ids.shape
        pos = np.broadcast_to(np.arange(s), (b, s)) if position_ids is None else np.broadcast_to(position_ids, (b, s))
        e = _f(word_embedding)[input_ids] + _f(position_embedding)[pos]
        if segment_embedding is not None and segment_ids is not None:
            e = e + _f(segment_embedding)[segment_ids]
        y, _, _ = _layer_norm(e, _f(gamma), _f(beta), 1e-12 if epsilon is None else epsilon)
        mask_index = (mask.sum(axis=1) if mask is not None else np.zeros(b)).astype(np.int32)
        return self._out(word_embedding.dtype, y, mask_index, e)


def _attend(q, k, v, heads, scale, bias_add, causal):
    """Scaled dot-product attention in FP32. q [B,S,H*dq], k [B,L,H*dq], v [B,L,H*dv];
    bias_add broadcastable to [B,H,S,L] (masks as large negatives) or None."""
    b, s, _ = q.shape
    big_l = k.shape[1]
    split = lambda t: t.reshape(b, t.shape[1], heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
    qh, kh, vh = split(q), split(k), split(v)
    scores = (qh @ kh.transpose(0, 1, 3, 2)) * F32(scale if scale else 1.0 / np.sqrt(qh.shape[-1]))
    if bias_add is not None:
        scores = scores + bias_add
    if causal:
        past = big_l - s
        allowed = np.arange(big_l)[None, :] <= (np.arange(s)[:, None] + past)
        scores = np.where(allowed, scores, F32(-np.inf))
    scores = scores - scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p = p / p.sum(-1, keepdims=True)
    return (p @ vh).transpose(0, 2, 1, 3).reshape(b, s, -1)


def _additive(mask, attention_bias, b, big_l, mask_filter_value):
    """What Attention and MultiHeadAttention add to the scores: the key mask as a bias
    (-10000 at masked keys unless mask_filter_value says otherwise) plus attention_bias."""
    filt = -10000.0 if mask_filter_value is None else mask_filter_value
    add = _key_mask(mask, b, big_l, filt)
    if attention_bias is not None:
        add = _f(attention_bias) if add is None else add + _f(attention_bias)
    return add


def _key_mask(mask, b, big_l, filt):
    """A key padding mask (ORT: 1-D lengths [B] or raw 0/1 [B, L]) as an additive
    [B, 1, 1, L] bias of `filt` at masked keys."""
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.ndim == 1 and mask.shape[0] == b:
        keep = np.arange(big_l)[None, :] < mask[:, None]
    elif mask.ndim == 2:
        keep = mask != 0
    else:
        raise NotImplementedError(f"graphmp's reference Attention: mask_index of shape {mask.shape}")
    return np.where(keep, F32(0), F32(filt))[:, None, None, :]


class Attention(_Fused):
    def _run(self, x, weights, bias=None, mask_index=None, past=None, attention_bias=None,
             past_sequence_length=None, num_heads=None, unidirectional=None, qkv_hidden_sizes=None,
             mask_filter_value=None, scale=None, do_rotary=None, past_present_share_buffer=None,
             rotary_embedding_dim=None, **_onnx_defaults):
        if past is not None or do_rotary:
            raise NotImplementedError("graphmp's reference Attention has no past state or rotary embedding")
        h = _f(x) @ _f(weights)
        if bias is not None:
            h = h + _f(bias)
        dq, dk, _ = qkv_hidden_sizes if qkv_hidden_sizes is not None else [h.shape[-1] // 3] * 3
        q, k, v = h[..., :dq], h[..., dq:dq + dk], h[..., dq + dk:]
        add = _additive(mask_index, attention_bias, x.shape[0], x.shape[1], mask_filter_value)
        out = _attend(q, k, v, num_heads, scale, add, bool(unidirectional))
        return self._out(x.dtype, out)


class MultiHeadAttention(_Fused):
    def _run(self, query, key=None, value=None, bias=None, key_padding_mask=None, attention_bias=None,
             past_key=None, past_value=None, past_sequence_length=None, cache_indirection=None,
             num_heads=None, mask_filter_value=None, scale=None, unidirectional=None, output_qk=None, **_onnx_defaults):
        if key is None or value is None or query.ndim != 3 or key.ndim != 3 or past_key is not None:
            raise NotImplementedError("graphmp's reference MultiHeadAttention takes 3-D query, key and value "
                                      "without past state (ORT's packed forms are not implemented)")
        q, k, v = _f(query), _f(key), _f(value)
        if bias is not None:
            bb = _f(bias)
            dq, dk = q.shape[-1], k.shape[-1]
            q, k, v = q + bb[:dq], k + bb[dq:dq + dk], v + bb[dq + dk:]
        add = _additive(key_padding_mask, attention_bias, q.shape[0], k.shape[1], mask_filter_value)
        out = _attend(q, k, v, num_heads, scale, add, bool(unidirectional))
        return self._out(query.dtype, out)


FUSED_OPS = [SkipLayerNormalization, SkipSimplifiedLayerNormalization, BiasGelu, Gelu, FastGelu, QuickGelu,
             EmbedLayerNormalization, Attention, MultiHeadAttention]

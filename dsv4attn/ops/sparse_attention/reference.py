"""Reference sparse MQA attention with a per-head sink (spec decision 5, ALGORITHM.md sections 3.6 and 6.1).

For query row t and head h, over the key rows ``S_t = {indices[t, k] : indices[t, k] >= 0}`` of the single shared
KV head (K == V)::

    z_k   = softmax_scale * <q[t, h], kv[k]>                      (fp32, or fp64 for fp64 inputs)
    lse   = logsumexp_k z_k                                        (returned; excludes the sink; -inf if S_t empty)
    p_k   = exp(z_k - logaddexp(lse, attn_sink[h]))                (the sink is in the denominator only, value 0)
    out   = sum_k p_k * kv[k]                                      (0 when S_t is empty; never NaN)

Forward and backward run over query chunks, so memory is O(T * K * D / chunks) transient plus the saved inputs
and outputs; the backward recomputes the probabilities from the saved ``lse`` (the kernels do the same):
``dz = p * (dO.v - Delta)``, ``Delta = dO.out = sum_k p_k dO.v_k`` (in fp32), ``dq = scale * dz @ K``, ``dkv[k] += scale * dz^T q + p^T dO``,
``d attn_sink[h] = -sum_t p_sink(t, h) * Delta(t, h)``. ``lse`` is not differentiable.
"""
from __future__ import annotations

import torch

from ..index_sets import IndexSet, chunk_rows, gather_rows


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _chunk_probs(q_c, kv, idx, sink, scale, cd):
    """Gathered keys (c, K, D), validity (c, K), scores (c, H, K) with -inf holes, in compute dtype ``cd``."""
    valid = idx >= 0
    keys = gather_rows(kv, idx).to(cd)
    scores = torch.einsum("chd,ckd->chk", q_c.to(cd), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return keys, valid, scores


def _denominator(lse, sink):
    """log(sum exp z + exp sink); 0 where both are -inf (empty row, sink -inf) so that p = 0, never NaN."""
    denom = torch.logaddexp(lse, sink[None, :])
    return torch.where(denom == float("-inf"), torch.zeros_like(denom), denom)


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, attn_sink, index_set: IndexSet, scale: float):
        T, H, D = q.shape
        cd = _compute_dtype(q)
        out = torch.empty_like(q)
        lse = torch.empty(T, H, dtype=cd, device=q.device)
        sink = attn_sink.to(cd)
        for s, e in chunk_rows(T, index_set.width * (H + D), device=q.device):
            keys, _, scores = _chunk_probs(q[s:e], kv, index_set.rows(s, e), sink, scale, cd)
            lse_c = torch.logsumexp(scores, dim=-1)                       # -inf for an empty set
            denom = _denominator(lse_c, sink)
            p = torch.exp(scores - denom[..., None])
            out[s:e] = torch.einsum("chk,ckd->chd", p, keys).to(q.dtype)
            lse[s:e] = lse_c
        ctx.save_for_backward(q, kv, attn_sink, lse)
        ctx.index_set, ctx.scale = index_set, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, kv, attn_sink, lse = ctx.saved_tensors
        index_set, scale = ctx.index_set, ctx.scale
        T, H, D = q.shape
        cd = _compute_dtype(q)
        sink = attn_sink.to(cd)
        dq = torch.zeros(T, H, D, dtype=cd, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=cd, device=kv.device)
        dsink = torch.zeros(H, dtype=cd, device=q.device)
        if grad_out is None:
            grad_out = torch.zeros_like(q)
        for s, e in chunk_rows(T, index_set.width * (H + D), device=q.device):
            idx = index_set.rows(s, e)
            keys, valid, scores = _chunk_probs(q[s:e], kv, idx, sink, scale, cd)
            denom = _denominator(lse[s:e], sink)
            p = torch.exp(scores - denom[..., None])
            do = grad_out[s:e].to(cd)
            dp = torch.einsum("chd,ckd->chk", do, keys)
            # Delta = dO . out, from the fp32 probabilities rather than the saved (possibly bf16-rounded) out.
            delta = (p * dp).sum(-1)                                        # (c, H)
            dz = p * (dp - delta[..., None])
            dq[s:e] = scale * torch.einsum("chk,ckd->chd", dz, keys)
            dkeys = scale * torch.einsum("chk,chd->ckd", dz, q[s:e].to(cd)) + torch.einsum("chk,chd->ckd", p, do)
            dkv.index_add_(0, idx[valid], dkeys[valid])
            dsink -= (torch.exp(sink[None, :] - denom) * delta).sum(0)
        return dq.to(q.dtype), dkv.to(kv.dtype), dsink.to(attn_sink.dtype), None, None


def sparse_attention_reference(q: torch.Tensor, kv: torch.Tensor, index_set: IndexSet, attn_sink: torch.Tensor,
                               softmax_scale: float):
    """Reference implementation behind :func:`dsv4attn.ops.sparse_attention` (arguments already checked)."""
    return _SparseAttention.apply(q, kv, attn_sink, index_set, softmax_scale)


def sparse_attention_naive(q, kv, indices, attn_sink, softmax_scale):
    """Plain-autograd, unchunked version of the same formula (tests compare the custom backward against it)."""
    cd = _compute_dtype(q)
    idx = indices.long()
    valid = idx >= 0
    keys = kv[idx.clamp(min=0)].to(cd)
    scores = torch.einsum("thd,tkd->thk", q.to(cd), keys) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = attn_sink.to(cd)[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)
    return out, torch.logsumexp(scores, dim=-1)

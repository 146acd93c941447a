"""Reference sparse MQA attention with a per-head sink (docs/semantics.md, decision 5).

For query row t and head h, over the key rows ``S_t = {indices[t, k] : indices[t, k] >= 0}`` of the single shared
KV head (K == V)::

    z_k   = softmax_scale * <q[t, h], kv[k]>                      (fp32, or fp64 for fp64 inputs)
    lse   = logsumexp_k z_k                                        (returned; excludes the sink; -inf if S_t empty)
    p_k   = exp(z_k - logaddexp(lse, attn_sink[h]))                (the sink is in the denominator only, value 0)
    out   = sum_k p_k * kv[k]                                      (0 when S_t is empty; never NaN)

Forward and backward run over query chunks, so memory is O(T * K * D / chunks) transient plus the saved inputs
and outputs; the backward recomputes the probabilities from the saved ``lse`` (the kernels do the same):
``dz = p * (dO.v - Delta)``, ``Delta = dO.out = sum_k p_k dO.v_k`` (in fp32), ``dq = scale * dz @ K``,
``dkv[k] += scale * dz^T q + p^T dO``, ``d attn_sink[h] = -sum_t p_sink(t, h) * Delta(t, h)``. ``lse`` is not
differentiable.

Always deterministic: every result is written once or summed in a fixed order. The dKV scatter is the only sum
over an index: on the CPU ``index_add_`` adds sequentially; on CUDA (where ``index_add_`` uses float atomics) it is
``index_put_(accumulate=True)``, which sorts the indices and sums each key's rows in order (PyTorch lists it as
deterministic on CUDA). No step reads a device value on the host, so the functions below can run inside a CUDA
graph or a compiled op.
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


def _scatter_add_rows(dkv: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> None:
    """``dkv[idx[i]] += rows[i]`` in a fixed order (see the module docstring); ``idx`` has no -1 entries."""
    if dkv.shape[0] == 0:                       # an empty key table: every slot was empty, nothing to add
        return
    if dkv.is_cuda:
        dkv.index_put_((idx,), rows, accumulate=True)
    else:
        dkv.index_add_(0, idx, rows)


def reference_forward(q, kv, index_set: IndexSet, attn_sink, scale: float):
    """out (T, H, D) ``q.dtype``, lse (T, H) fp32 (fp64 for fp64 ``q``); no autograd."""
    T, H, D = q.shape
    cd = _compute_dtype(q)
    out = q.new_empty(q.shape)
    lse = torch.empty(T, H, dtype=cd, device=q.device)
    sink = attn_sink.to(cd)
    for s, e in chunk_rows(T, index_set.width * (H + D), device=q.device):
        keys, _, scores = _chunk_probs(q[s:e], kv, index_set.rows(s, e), sink, scale, cd)
        lse_c = torch.logsumexp(scores, dim=-1)                       # -inf for an empty set
        denom = _denominator(lse_c, sink)
        p = torch.exp(scores - denom[..., None])
        out[s:e] = torch.einsum("chk,ckd->chd", p, keys).to(q.dtype)
        lse[s:e] = lse_c
    return out, lse


def reference_lse(q, kv, index_set: IndexSet, scale: float):
    """The lse of :func:`reference_forward` alone (no probabilities or output formed); no autograd."""
    T, H, D = q.shape
    cd = _compute_dtype(q)
    lse = torch.empty(T, H, dtype=cd, device=q.device)
    for s, e in chunk_rows(T, index_set.width * (H + D), device=q.device):
        lse[s:e] = torch.logsumexp(_chunk_probs(q[s:e], kv, index_set.rows(s, e), None, scale, cd)[2], dim=-1)
    return lse


def check_mass_slots(mass_slots: tuple[int, int], width: int) -> None:
    """``mass_slots = (offset, width)`` of the backwards' teacher mass: a range within the ``width`` slots a row has."""
    offset, count = mass_slots
    if offset < 0 or count < 0 or offset + count > width:
        raise ValueError(f"mass_slots (offset, width) must lie within the {width} slots of the index set, got "
                         f"{tuple(mass_slots)}")


def reference_backward(grad_out, q, kv, index_set: IndexSet, attn_sink, lse, scale: float, out=None,
                       delta_grad_out=None, mass_slots: tuple[int, int] | None = None):
    """dq (T, H, D) ``q.dtype``, dkv (N, D) ``kv.dtype``, d_sink (H,) ``attn_sink.dtype`` from the saved ``lse``.

    ``mass_slots = (offset, width)``: also returns, fourth, the (T, width) head-summed probabilities
    ``sum_h p[t, h, offset + j]`` of slots ``offset .. offset + width`` (compute dtype, 0 at empty slots): the sparse
    indexer KL's teacher mass when those slots are the top-k (the window's come first in the layer's index sets),
    normalised with the same full denominator as the attention, so the backward can hand it to the loss.

    ``out`` given (the forward's output in its dtype): Delta = rowsum(dO * out) in the compute dtype, the way the
    one-pass GPU backward forms it (and FlashAttention, cuDNN). The low-precision error bounds of that kernel compare
    it with this mode, so both run the same algorithm. Otherwise Delta comes from the compute-dtype probabilities.
    ``delta_grad_out``: the gradient that pairs with ``out`` in Delta when the two are in another frame than
    ``grad_out`` (the output rotation: the kernels form Delta from the rotated output and its gradient as given).
    """
    T, H, D = q.shape
    cd = _compute_dtype(q)
    sink = attn_sink.to(cd)
    lse = lse.to(cd)
    dq = torch.zeros(T, H, D, dtype=cd, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=cd, device=kv.device)
    dsink = torch.zeros(H, dtype=cd, device=q.device)
    mass = None
    if mass_slots is not None:
        check_mass_slots(mass_slots, index_set.width)
        mass = torch.zeros(T, mass_slots[1], dtype=cd, device=q.device)
    if grad_out is None:
        grad_out = torch.zeros_like(q)
    for s, e in chunk_rows(T, index_set.width * (H + D), device=q.device):
        idx = index_set.rows(s, e)
        keys, valid, scores = _chunk_probs(q[s:e], kv, idx, sink, scale, cd)
        denom = _denominator(lse[s:e], sink)
        p = torch.exp(scores - denom[..., None])
        if mass is not None:
            mass[s:e] = p[:, :, mass_slots[0]:mass_slots[0] + mass_slots[1]].sum(1)
        do = grad_out[s:e].to(cd)
        dp = torch.einsum("chd,ckd->chk", do, keys)
        if out is None:
            delta = (p * dp).sum(-1)                                    # (c, H): dO . out from the probabilities
        else:
            paired = do if delta_grad_out is None else delta_grad_out[s:e].to(cd)
            delta = (paired * out[s:e].to(cd)).sum(-1)
        dz = p * (dp - delta[..., None])
        dq[s:e] = scale * torch.einsum("chk,ckd->chd", dz, keys)
        dkeys = scale * torch.einsum("chk,chd->ckd", dz, q[s:e].to(cd)) + torch.einsum("chk,chd->ckd", p, do)
        # Empty slots add an exact 0 to row 0 instead of being selected out: a boolean selection would need the
        # number of valid slots on the host (a sync), which CUDA graphs and compiled graphs cannot have.
        dkeys = dkeys.masked_fill(~valid[..., None], 0.0)
        _scatter_add_rows(dkv, idx.clamp(min=0).flatten(), dkeys.flatten(0, 1))
        dsink -= (torch.exp(sink[None, :] - denom) * delta).sum(0)
    grads = dq.to(q.dtype), dkv.to(kv.dtype), dsink.to(attn_sink.dtype)
    return grads if mass is None else (*grads, mass)


class _SparseAttention(torch.autograd.Function):
    """Autograd for lazy :class:`IndexSet` inputs (tensor indices go through the registered op instead)."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, index_set: IndexSet, scale: float, mass_probe, mass_offset: int):
        out, lse = reference_forward(q, kv, index_set, attn_sink, scale)
        ctx.save_for_backward(q, kv, attn_sink, lse)
        ctx.index_set, ctx.scale = index_set, scale
        wanted = mass_probe is not None and ctx.needs_input_grad[5]
        ctx.mass_slots = (mass_offset, mass_probe.shape[1]) if wanted else None
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, kv, attn_sink, lse = ctx.saved_tensors
        dq, dkv, dsink, *mass = reference_backward(grad_out, q, kv, ctx.index_set, attn_sink, lse, ctx.scale,
                                                   mass_slots=ctx.mass_slots)
        return dq, dkv, dsink, None, None, mass[0] if mass else None, None


def sparse_attention_reference(q: torch.Tensor, kv: torch.Tensor, index_set: IndexSet, attn_sink: torch.Tensor,
                               softmax_scale: float, mass_probe: torch.Tensor | None = None, mass_offset: int = 0):
    """Reference implementation behind :func:`dsv4attn.ops.sparse_attention` (arguments already checked);
    ``mass_probe`` gets the teacher mass of slots ``mass_offset ..`` as its gradient (the op's ``mass_probe``)."""
    return _SparseAttention.apply(q, kv, attn_sink, index_set, softmax_scale, mass_probe, mass_offset)


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

"""Reference indexer KL loss (docs/semantics.md, decision 7), per query row.

For row t with candidate set S_t (compressed entries: all visible ones for the dense teacher of the warm-up
phase, the selected top-k for the sparse phase)::

    s_h(j)   = softmax_scale * <q[t, h], C_j>                           teacher logits (q, C detached)
    L_h      = logaddexp(outside_lse[t, h], logsumexp_{j in S_t} s_h(j))  the *full* attention denominator
    T(j)     = sum_h exp(s_h(j) - L_h) / max(sum_{j', h} ..., FLT_MIN)    head-summed, L1-normalised
    Q(j)     = softmax_{j in S_t} I(t, j)                                  student, I = indexer score
    KL_t     = sum_{j in S_t} T(j) (log T(j) - log Q(j))                   0 when S_t is empty

``outside_lse`` is the log of the attention mass outside S_t: window keys plus the sink. When S_t is exactly the
main attention's compressed candidates (the sparse phase), L_h is the attention's own ``logaddexp(lse, sink)`` and
can be passed instead (``full=True`` / ``indexer_kl(..., full_lse=...)``). Everything is computed in
fp32 (fp64 for fp64 inputs). Only the student is differentiable (``index_q``, ``index_k``, ``index_weights``);
the backward uses the closed form ``dKL/dI(j) = Q(j) * sum(T) - T(j)`` on S_t and recomputes chunk by chunk; the
gradient of the student dots enters the index_q / index_k products rounded to their common dtype (bf16 / fp16 when
both are; mixed dtypes widen to fp32, no rounding), as the kernels do.
Invalid slots (-1) contribute neither loss nor gradient.
"""
from __future__ import annotations

import torch

from ..index_sets import IndexSet, chunk_rows, gather_rows
from ..indexer.reference import index_scores

FLT_MIN = torch.finfo(torch.float32).tiny


def _chunk(index_q, index_k, index_weights, q, compressed_kv, outside_lse, cand, scale, full=False, head_sum=None,
           student_scores=None):
    """Student log-probabilities, normalised teacher and what the backward needs, for one chunk of rows.
    ``head_sum``: applied to the (rows, C) mass of the heads in ``q`` before it is normalised (the sum over the
    other tensor-parallel ranks' heads). ``student_scores``: the chunk's (rows, C) student logits I(j) as the
    indexer's top-k formed them, used instead of forming them again."""
    cd = torch.promote_types(index_q.dtype, torch.float32)
    valid = cand >= 0
    keys_i = gather_rows(index_k, cand).to(cd)
    if student_scores is None:
        scores = index_scores(index_q, keys_i, index_weights, valid)
    else:
        scores = student_scores.to(cd).masked_fill(~valid, float("-inf"))
    log_q = student_log_probs(scores, valid)

    logits = torch.einsum("chd,ckd->chk", q.to(cd), gather_rows(compressed_kv, cand).to(cd)) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    if full:                                  # outside_lse already is L_h, the full denominator
        full_lse = outside_lse.to(cd)
    else:
        full_lse = torch.logaddexp(outside_lse.to(cd), torch.logsumexp(logits, dim=-1))
    probs = torch.where(valid[:, None, :], torch.exp(logits - full_lse[..., None]), torch.zeros_like(logits))
    mass = probs.sum(dim=1)                                               # (c, C) summed over heads
    if head_sum is not None:
        mass = head_sum(mass)
    kl, target = kl_from_mass(mass, log_q)
    return kl, target, log_q, valid, keys_i


def student_log_probs(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log Q(j) (rows, C): the log-softmax of the student logits ``scores`` (-inf at the empty slots) over each row's
    valid slots; 0 at empty slots and on rows without a valid one."""
    has_any = valid.any(dim=-1, keepdim=True)
    log_q = torch.log_softmax(torch.where(has_any, scores, torch.zeros_like(scores)), dim=-1)
    return torch.where(valid, log_q, torch.zeros_like(log_q))


def kl_from_mass(mass: torch.Tensor, log_q: torch.Tensor):
    """(KL_t (rows,), T (rows, C)): the teacher ``T`` = ``mass`` (the head-summed attention probabilities of each
    row's candidates, (rows, C), 0 at empty slots) L1-normalised with the FLT_MIN floor, and ``KL_t = sum_j T(j)
    (log T(j) - log Q(j))`` for the student's ``log_q`` (0 at empty slots)."""
    target = mass / mass.sum(dim=-1, keepdim=True).clamp(min=FLT_MIN)
    return (torch.xlogy(target, target) - target * log_q).sum(dim=-1), target


def student_backward(d_scores, index_q, index_weights, keys_i, valid, operand_dtype):
    """(d index_q (rows, Hi, Di), d keys (rows, C, Di), d index_weights (rows, Hi)) of one chunk of rows, from
    ``d_scores`` = dL/dI(j) (rows, C) and the gathered indexer keys ``keys_i`` of the candidates, in the compute dtype
    of ``d_scores``. d keys is 0 at empty slots (the caller adds it to index_k's rows)."""
    cd = d_scores.dtype
    qi = index_q.to(cd)
    dots = torch.einsum("chd,ckd->chk", qi, keys_i)
    d_w = (d_scores[:, None, :] * torch.relu(dots)).sum(-1)
    d_dots = d_scores[:, None, :] * index_weights.to(cd)[..., None] * (dots > 0)
    # Half-precision operands: dx is rounded to their common dtype before the two gradient products, as autograd of
    # a bf16 matmul hands it its incoming gradient and as the kernels feed their tensor cores (the products
    # themselves are exact, the sums fp32), so the reference's own error counts the same rounding. Mixed dtypes
    # promote to fp32 (no rounding), as the kernels widen them.
    d_dots = d_dots.to(operand_dtype).to(cd)
    d_q = torch.einsum("chk,ckd->chd", d_dots, keys_i)
    d_keys = torch.einsum("chk,chd->ckd", d_dots, qi)
    # Empty slots add an exact 0 to row 0 instead of being selected out: a boolean selection needs the number of
    # valid slots on the host (a sync), which compiled graphs and CUDA graphs cannot have.
    return d_q, d_keys.masked_fill(~valid[..., None], 0.0), d_w


def kl_grads_from_mass_reference(mass, index_q, index_k, index_weights, candidates: IndexSet, student_scores,
                                 weight):
    """The sparse KL from a teacher mass formed elsewhere (the attention backward's, ``mass`` (T, C): the head-summed
    probabilities of the candidates with the attention's full denominator) and the student logits the top-k formed
    (``student_scores`` (T, C)), with its gradients for the loss ``weight * sum_t KL_t``: returns kl (T,), d index_q,
    d index_k, d index_weights, all in the compute dtype (fp32, fp64 for fp64 ``index_q``), chunk by chunk of rows.
    The same formulas as :func:`indexer_kl_reference`'s full form, with the mass given instead of formed."""
    T = index_q.shape[0]
    cd = torch.promote_types(index_q.dtype, torch.float32)
    operand_dtype = torch.promote_types(index_q.dtype, index_k.dtype)
    kl = torch.zeros(T, dtype=cd, device=index_q.device)
    d_q = torch.zeros(index_q.shape, dtype=cd, device=index_q.device)
    d_k = torch.zeros(index_k.shape, dtype=cd, device=index_k.device)
    d_w = torch.zeros(index_weights.shape, dtype=cd, device=index_q.device)
    for s, e in chunk_rows(T, candidates.width * (index_q.shape[1] + index_q.shape[2]), device=index_q.device):
        cand = candidates.rows(s, e)
        valid = cand >= 0
        log_q = student_log_probs(student_scores[s:e].to(cd).masked_fill(~valid, float("-inf")), valid)
        kl[s:e], target = kl_from_mass(mass[s:e].to(cd), log_q)
        student = torch.where(valid, log_q.exp(), torch.zeros_like(log_q))
        d_scores = weight.to(cd) * (student * target.sum(-1, keepdim=True) - target)
        keys_i = gather_rows(index_k, cand).to(cd)
        d_q[s:e], d_keys, d_w[s:e] = student_backward(d_scores, index_q[s:e], index_weights[s:e], keys_i, valid,
                                                      operand_dtype)
        if d_k.shape[0]:
            d_k.index_add_(0, cand.clamp(min=0).flatten(), d_keys.flatten(0, 1))
    return kl, d_q, d_k, d_w


class _IndexerKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, index_q, index_k, index_weights, q, compressed_kv, outside_lse, candidates: IndexSet,
                scale: float, full: bool, head_sum=None, student_scores=None):
        T = index_q.shape[0]
        cd = torch.promote_types(index_q.dtype, torch.float32)
        kl = torch.zeros(T, dtype=cd, device=index_q.device)
        per_row = candidates.width * (index_q.shape[1] + q.shape[1] + q.shape[2])
        for s, e in chunk_rows(T, per_row, device=index_q.device):
            kl[s:e] = _chunk(index_q[s:e], index_k, index_weights[s:e], q[s:e], compressed_kv,
                             outside_lse[s:e], candidates.rows(s, e), scale, full, head_sum,
                             None if student_scores is None else student_scores[s:e])[0]
        ctx.save_for_backward(index_q, index_k, index_weights, q, compressed_kv, outside_lse)
        ctx.candidates, ctx.scale, ctx.per_row, ctx.full = candidates, scale, per_row, full
        ctx.head_sum, ctx.student_scores = head_sum, student_scores
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        index_q, index_k, index_weights, q, compressed_kv, outside_lse = ctx.saved_tensors
        cd = torch.promote_types(index_q.dtype, torch.float32)
        operand_dtype = torch.promote_types(index_q.dtype, index_k.dtype)
        d_q = torch.zeros(index_q.shape, dtype=cd, device=index_q.device)
        d_k = torch.zeros(index_k.shape, dtype=cd, device=index_k.device)
        d_w = torch.zeros(index_weights.shape, dtype=cd, device=index_q.device)
        for s, e in chunk_rows(index_q.shape[0], ctx.per_row, device=index_q.device):
            cand = ctx.candidates.rows(s, e)
            given = None if ctx.student_scores is None else ctx.student_scores[s:e]
            _, target, log_q, valid, keys_i = _chunk(index_q[s:e], index_k, index_weights[s:e], q[s:e],
                                                     compressed_kv, outside_lse[s:e], cand, ctx.scale, ctx.full,
                                                     ctx.head_sum, given)
            student = torch.where(valid, log_q.exp(), torch.zeros_like(log_q))
            d_scores = grad_kl[s:e, None].to(cd) * (student * target.sum(-1, keepdim=True) - target)
            d_q[s:e], d_keys, d_w[s:e] = student_backward(d_scores, index_q[s:e], index_weights[s:e], keys_i, valid,
                                                          operand_dtype)
            if d_k.shape[0]:                # an empty key table: every slot was empty, nothing to add
                d_k.index_add_(0, cand.clamp(min=0).flatten(), d_keys.flatten(0, 1))
        return (d_q.to(index_q.dtype), d_k.to(index_k.dtype), d_w.to(index_weights.dtype),
                None, None, None, None, None, None, None, None)


def indexer_kl_reference(index_q, index_k, index_weights, q, compressed_kv, outside_lse, candidates: IndexSet,
                         softmax_scale: float, full: bool = False, head_sum=None,
                         student_scores: torch.Tensor | None = None) -> torch.Tensor:
    """``full``: ``outside_lse`` holds each head's full denominator L_h itself (window + sink + S_t).
    ``head_sum``: see :func:`dsv4attn.ops.indexer_kl` (called once per row chunk forward, again in the backward).
    ``student_scores``: (T, C) student logits I(j) of the candidates as the top-k formed them (the forward's
    student and the closed-form gradient's softmax use them; the backward forms the dots again for the gradients
    of index_q, index_k and index_weights)."""
    return _IndexerKL.apply(index_q, index_k, index_weights, q.detach(), compressed_kv.detach(),
                            outside_lse.detach(), candidates, softmax_scale, bool(full), head_sum,
                            None if student_scores is None else student_scores.detach())


def indexer_kl_naive(index_q, index_k, index_weights, q, compressed_kv, outside_lse, candidates: torch.Tensor,
                     softmax_scale: float) -> torch.Tensor:
    """Plain-autograd, unchunked version (tests compare the closed-form backward against it)."""
    return _chunk(index_q, index_k, index_weights, q.detach(), compressed_kv.detach(), outside_lse.detach(),
                  candidates.long(), softmax_scale)[0]

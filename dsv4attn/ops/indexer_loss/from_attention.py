"""The sparse phase's indexer KL with its teacher taken from the attention's backward.

In the sparse phase the teacher's candidates are exactly the attention's top-k slots, normalised by the attention's
own full denominator, so the teacher mass ``sum_h p[t, h, j]`` is a column sum of the probabilities the attention
backward forms anyway. Forming it there spares a kernel that gathers the same compressed rows again. The two meet
through autograd:

- :func:`indexer_kl_from_attention` returns a *probe*, a (T, K) zero tensor (no memory: one element expanded) that
  depends on ``index_q``, ``index_k`` and ``index_weights``;
- ``sparse_attention(..., mass_probe=probe, mass_offset=window width)`` hands the probe, as its gradient, the mass
  of the slots ``offset .. offset + K`` (the top-k part of the layer's index sets);
- the probe's backward (here) turns that mass into the KL: ``T = mass / max(sum mass, FLT_MIN)``, the student
  ``Q = softmax(student_scores)``, ``KL_t = sum_j T (log T - log Q)``, and the gradients of ``weight * sum_t KL_t``
  to the three indexer tensors (``dKL/dI = Q sum T - T``, then the student's own backward). It writes
  ``weight * sum_t KL_t`` into ``kl_value`` (a () tensor the caller owns), since no loss tensor carries it.

The result equals ``weight * indexer_kl(index_q, index_k, index_weights, q, compressed_kv, topk,
full_lse=logaddexp(lse, sink), student_scores=topk_scores).sum()`` and its gradients, up to summation order.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ... import backend, checks
from ..index_sets import Explicit
from .reference import kl_grads_from_mass_reference


def _kernels_take(index_q, index_k, candidates) -> bool:
    from .triton import KERNEL_DTYPES
    return (index_q.dtype in KERNEL_DTYPES and index_k.dtype in KERNEL_DTYPES and index_q.shape[0] > 0
            and candidates.shape[1] > 0)


@torch.library.custom_op("dsv4attn::indexer_kl_from_mass", mutates_args=("kl_value",))
def indexer_kl_from_mass_op(mass: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
                            index_weights: torch.Tensor, candidates: torch.Tensor, student_scores: torch.Tensor,
                            weight: torch.Tensor, kl_value: torch.Tensor, impl: str
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``weight * sum_t KL_t`` to index_q, index_k, index_weights (their dtypes) from the teacher
    ``mass`` (T, K); writes ``weight * sum_t KL_t`` into ``kl_value``. ``impl``: "triton" or "reference"."""
    if impl == "triton" and _kernels_take(index_q, index_k, candidates):
        from .triton import kl_grads_from_mass_triton
        kl, d_q, d_k, d_w = kl_grads_from_mass_triton(mass, index_q, index_k, index_weights, candidates,
                                                      student_scores, weight)
    else:
        with backend.exact_math(index_q.device):
            kl, d_q, d_k, d_w = kl_grads_from_mass_reference(mass, index_q, index_k, index_weights,
                                                             Explicit(candidates), student_scores, weight)
    kl_value.copy_(weight * kl.sum())
    return d_q.to(index_q.dtype), d_k.to(index_k.dtype), d_w.to(index_weights.dtype)


@indexer_kl_from_mass_op.register_fake
def _indexer_kl_from_mass_fake(mass, index_q, index_k, index_weights, candidates, student_scores, weight, kl_value,
                               impl):
    return index_q.new_empty(index_q.shape), index_k.new_empty(index_k.shape), \
        index_weights.new_empty(index_weights.shape)


class _Channel(torch.autograd.Function):
    """Forward: the probe. Backward: the probe's gradient (the teacher mass) -> the KL's gradients."""

    @staticmethod
    def forward(ctx, index_q, index_k, index_weights, candidates, student_scores, weight, kl_value, probe_dtype,
                head_sum, impl):
        ctx.save_for_backward(index_q, index_k, index_weights, candidates, student_scores, weight)
        # kl_value is written by the backward: kept as an attribute, not saved (saving checks its version).
        ctx.kl_value, ctx.head_sum, ctx.impl = kl_value, head_sum, impl
        return index_q.new_zeros((), dtype=probe_dtype).expand(candidates.shape)

    @staticmethod
    def backward(ctx, mass):
        index_q, index_k, index_weights, candidates, student_scores, weight = ctx.saved_tensors
        if ctx.head_sum is None:
            mass = mass.contiguous()
        else:                                   # tensor parallelism: every rank's heads make the teacher
            mass = mass.clone(memory_format=torch.contiguous_format)     # ours to reduce in place
            ctx.head_sum(mass)
        d_q, d_k, d_w = indexer_kl_from_mass_op(mass, index_q, index_k, index_weights, candidates, student_scores,
                                                weight, ctx.kl_value, ctx.impl)
        return d_q, d_k, d_w, None, None, None, None, None, None, None


def indexer_kl_from_attention(index_q: torch.Tensor, index_k: torch.Tensor, index_weights: torch.Tensor,
                              candidates: torch.Tensor, student_scores: torch.Tensor, weight: torch.Tensor,
                              kl_value: torch.Tensor, *, probe_dtype: torch.dtype = torch.float32,
                              head_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """The probe that turns the attention backward's teacher mass into the sparse indexer KL's gradients (module doc).

    Args:
        index_q: (T, Hi, Di) indexer queries; index_k: (Nc, Di) indexer keys; index_weights: (T, Hi) head weights;
            fp16/bf16/fp32/fp64. These three get the gradients of ``weight * sum_t KL_t``.
        candidates: (T, K) int32/int64 rows of ``index_k``, -1 = empty: the top-k, in the order of the attention's
            slots ``mass_offset ..`` (the layer's top-k part of its index sets). Rows outside ``[0, Nc)`` are empty
            slots (as everywhere; the debug mode raises on them).
        student_scores: (T, K) float, the student logits I(j) the top-k formed (any value at empty slots), detached.
        weight: () float tensor on ``index_q``'s device, dL/dKL_t of every row (the layer's ``coeff / real rows``).
        kl_value: () fp32 / fp64 tensor on the same device; the backward writes ``weight * sum_t KL_t`` into it.
        probe_dtype: the attention's compute dtype (fp32; fp64 for fp64 attention inputs).
        head_sum: None, or applied in place to the (T, K) mass before it is normalised (tensor parallelism: the
            all-reduce over the group's heads).
    Returns:
        the (T, K) probe (``probe_dtype``), to pass as ``sparse_attention(..., mass_probe=probe, mass_offset=...)``.
        If the attention's backward does not run, neither does this one (no gradient, ``kl_value`` unchanged).

    Empty slots contribute neither loss nor gradient; a row without a valid slot has KL 0. On the Triton backend the
    KL forward kernel takes the mass and the logits as given and the saved-gradient backward (the Gluon kernel on
    SM90) forms the gradients; float64 and empty problems run the reference. Under tensor parallelism every rank
    must call the backward (``head_sum`` is a collective).
    """
    F = checks.FLOATS
    checks.check_tensor("index_q", index_q, dim=3, dtypes=F)
    T, Hi, Di = index_q.shape
    device = index_q.device
    checks.check_tensor("index_k", index_k, shape=(None, Di), dtypes=F, device=device)
    checks.check_tensor("index_weights", index_weights, shape=(T, Hi), dtypes=F, device=device)
    checks.check_tensor("candidates", candidates, shape=(T, None), dtypes=(torch.int32, torch.int64), device=device)
    checks.check_index_range("candidates", candidates, index_k.shape[0])
    checks.check_tensor("student_scores", student_scores, shape=tuple(candidates.shape), dtypes=F, device=device)
    checks.check_tensor("weight", weight, shape=(), dtypes=F, device=device)
    checks.check_tensor("kl_value", kl_value, shape=(), dtypes=(torch.float32, torch.float64), device=device)
    if kl_value.requires_grad:
        raise ValueError("kl_value must not require grad: the backward writes the loss value into it in place")
    if probe_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"probe_dtype must be torch.float32 or torch.float64, got {probe_dtype}")
    if head_sum is not None and not callable(head_sum):
        raise TypeError(f"head_sum must be None or a callable, got {type(head_sum).__name__}")
    cand = checks.mask_out_of_range(candidates, index_k.shape[0])
    impl = "triton" if backend.choose("indexer_kl", device) == "triton" else "reference"
    return _Channel.apply(index_q, index_k, index_weights, cand, student_scores.detach(), weight.detach(), kl_value,
                          probe_dtype, head_sum, impl)


__all__ = ["indexer_kl_from_attention", "indexer_kl_from_mass_op"]

"""Indexer KL loss: teacher = the main attention's head-summed probabilities on the candidate set."""
from __future__ import annotations

import torch

from ... import backend, checks
from ..index_sets import IndexSet, as_index_set, within
from .from_attention import indexer_kl_from_attention
from .reference import FLT_MIN, indexer_kl_naive, indexer_kl_reference


def indexer_kl(index_q: torch.Tensor, index_k: torch.Tensor, index_weights: torch.Tensor, q: torch.Tensor,
               compressed_kv: torch.Tensor, candidates: torch.Tensor | IndexSet,
               outside_lse: torch.Tensor | None = None, softmax_scale: float | None = None, *,
               full_lse: torch.Tensor | None = None, head_sum=None,
               student_scores: torch.Tensor | None = None, select_topk: int | None = None):
    """Per-row KL(teacher || student) of the indexer (see ``reference.py`` for the formula).

    Args:
        index_q: (T, Hi, Di) indexer queries; index_k: (Nc, Di) indexer compressed keys;
        index_weights: (T, Hi) indexer head weights (scales folded in). These three get gradients.
        q: (T, H, D) main-attention queries; compressed_kv: (Nc, D) main compressed KV (both detached here).
        candidates: (T, C) int rows of ``index_k``/``compressed_kv`` forming S_t, -1 = empty (or an IndexSet).
            A row outside ``[0, Nc)`` is an empty slot, never read (no host read; an IndexSet whose ``bound`` is
            <= Nc costs nothing); in the debug mode (``dsv4attn.set_checks("values")``) it raises instead.
        outside_lse: (T, H) log attention mass outside S_t (window keys + sink), detached.
        softmax_scale: main attention scale, default ``D ** -0.5``.
        full_lse: instead of ``outside_lse`` (give exactly one), each head's full attention denominator L_h =
            log(window + sink + S_t mass), fp32/fp64, detached: when S_t is exactly the main attention's compressed
            candidates (the sparse phase) this is its ``logaddexp(lse, sink)``, and the kernel then forms the
            teacher logits once instead of twice. It includes the candidates' mass, so it must be finite wherever
            S_t has a valid entry (-inf there makes the reference NaN; the kernel does not check it).
        head_sum: None, or a function applied in place to each row chunk's (rows, C) teacher mass
            ``sum_{h in q} exp(s_h(j) - L_h)`` before it is normalised; under tensor parallelism ``q`` holds this
            rank's heads and ``head_sum`` all-reduces the mass over the group, so the teacher sums over every head
            (docs/tensor_parallel.md). It is called once per chunk in the forward and again in the backward, the
            same number of times on every rank. Given, the PyTorch reference runs on every device (the fused
            kernels form the mass inside one launch).
        student_scores: with ``full_lse`` (the sparse phase), the (T, C) student logits I(j) of the candidates as
            the indexer's top-k formed them (``indexer_topk(..., return_scores=True)``), float, any value at empty
            slots, detached: the forward takes them instead of forming I(j) again (on CUDA it then reads no
            indexer key; the backward still forms the dots, which the gradients need).
        select_topk: k > 0 to also take the indexer's top-k over the candidates (the warm-up, whose attention uses
            the top-k while its teacher spans every visible entry): what ``indexer_topk(index_q, index_k,
            index_weights, candidates, k, return_scores=True)`` returns, bit for bit (candidates past ``Nc`` are
            empty slots here, as everywhere in this op), not differentiable. On SM90 over the warm-up's ranges it
            is selected from the student's scores the loss forms anyway (one pass of the indexer's score kernel
            instead of two).
    Returns:
        (T,) fp32 (fp64 for fp64 inputs) KL per row; 0 for rows with an empty S_t (incl. padding rows).
        The layer loss is ``coeff * kl.sum() / number_of_real_rows``. With ``select_topk``: (kl, indices, scores),
        the last two as :func:`dsv4attn.ops.indexer_topk` gives them.
    """
    F = checks.FLOATS
    checks.check_tensor("index_q", index_q, dim=3, dtypes=F)
    T, Hi, Di = index_q.shape
    checks.check_tensor("index_k", index_k, shape=(None, Di), dtypes=F, device=index_q.device)
    checks.check_tensor("index_weights", index_weights, shape=(T, Hi), dtypes=F, device=index_q.device)
    checks.check_tensor("q", q, shape=(T, None, None), dtypes=F, device=index_q.device)
    checks.check_tensor("compressed_kv", compressed_kv, shape=(index_k.shape[0], q.shape[2]), dtypes=F,
                        device=q.device)
    if (outside_lse is None) == (full_lse is None):
        raise ValueError("indexer_kl needs exactly one of outside_lse (mass outside S_t) and full_lse (each head's "
                         f"full denominator); got {'both' if outside_lse is not None else 'neither'}")
    full = full_lse is not None
    lse = full_lse if full else outside_lse
    # full_lse in fp32/fp64: bf16 would round L by ~0.4% and shift every teacher weight. It includes the
    # candidates' own mass, so -inf (or NaN) is only meaningful where a row has no valid candidate.
    checks.check_tensor("full_lse" if full else "outside_lse", lse, shape=(T, q.shape[1]), device=q.device,
                        dtypes=(torch.float32, torch.float64) if full else None)
    if full:
        checks.check_finite("full_lse", lse, allow_inf=True)
    if isinstance(candidates, torch.Tensor):
        checks.check_tensor("candidates", candidates, shape=(T, None), dtypes=(torch.int32, torch.int64),
                            device=q.device)
        checks.check_index_range("candidates", candidates, index_k.shape[0])
    elif not isinstance(candidates, IndexSet):
        raise TypeError(f"candidates must be a (T, C) int torch.Tensor or an IndexSet, got {type(candidates).__name__}")
    elif candidates.total_rows != T:
        raise ValueError(f"candidates must cover the {T} rows of index_q, got {candidates.total_rows} rows")
    for name, t in (("index_q", index_q), ("index_k", index_k), ("index_weights", index_weights), ("q", q),
                    ("compressed_kv", compressed_kv)):
        checks.check_finite(name, t)
    if student_scores is not None:
        if not full:
            raise ValueError("student_scores needs full_lse: they are the top-k's own scores, for the sparse "
                             "phase's teacher over exactly the attention's candidates")
        width = candidates.shape[1] if isinstance(candidates, torch.Tensor) else candidates.width
        checks.check_tensor("student_scores", student_scores, shape=(T, width), dtypes=F, device=index_q.device)
    if select_topk is not None and (isinstance(select_topk, bool) or not isinstance(select_topk, int)
                                    or select_topk <= 0):
        raise ValueError(f"select_topk must be None or a positive int, got {select_topk!r}")
    scale = checks.check_scale(softmax_scale, q.shape[2])
    cand = within(as_index_set(candidates), index_k.shape[0])    # no kernel ever sees a row >= Nc (negative rows
                                                                  # are empty slots in all of them)
    with backend.exact_math(index_q.device):
        if head_sum is None and backend.choose("indexer_kl", index_q.device) == "triton":
            return backend.kernel("indexer_kl")(index_q, index_k, index_weights, q, compressed_kv, lse, cand, scale,
                                                full=full, student_scores=student_scores, select_topk=select_topk)
        kl = indexer_kl_reference(index_q, index_k, index_weights, q, compressed_kv, lse, cand, scale, full=full,
                                  head_sum=head_sum, student_scores=student_scores)
    if select_topk is None:
        return kl
    from ..indexer import indexer_topk       # the op's own dispatch (a top-k kernel may run where this loss cannot)
    return (kl, *indexer_topk(index_q.detach(), index_k.detach(), index_weights.detach(), cand, select_topk,
                              return_scores=True))


try:  # registers the Triton kernels with the backend (used on CUDA); CPU-only installs run the reference
    from . import triton as _triton_kernels
except ImportError:
    _triton_kernels = None

__all__ = ["indexer_kl", "indexer_kl_from_attention", "indexer_kl_reference", "indexer_kl_naive", "FLT_MIN"]

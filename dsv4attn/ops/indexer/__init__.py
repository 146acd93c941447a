"""Lightning-indexer scores and deterministic top-k over visible compressed entries."""
from __future__ import annotations

import torch

from ... import backend, checks
from ...packing import CompressedLayout
from ..index_sets import IndexSet, VisibleCompressed
from .reference import index_scores, indexer_topk_reference


def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, layout: CompressedLayout | IndexSet,
                 topk: int, *, return_scores: bool = False):
    """Top-k compressed entries per query row by indexer score.

    Args:
        q: (T, Hi, Di) indexer queries (RoPE applied).
        k: (Nc, Di) indexer compressed keys (``layout.capacity`` rows, RoPE applied).
        weights: (T, Hi) per-head weights, scales folded in.
        layout: the ratio-4 :class:`CompressedLayout` (candidates = visible entries of the row's document), or
            any :class:`IndexSet` of candidate rows of ``k`` listed in increasing order.
        topk: k > 0.
        return_scores: also return the selected entries' scores.
    Returns:
        (T, min(topk, min(max_seqlen, T) // 4)) int32 rows of ``k`` (global compressed index), best first, ties to the
        lower index, -1 for empty slots; with ``return_scores`` the pair (rows, scores), scores of the same shape in
        fp32 (fp64 for fp64 inputs), -inf at empty slots: the values the selection ranked, which are the indexer
        KL's student logits of those slots (``indexer_kl(..., student_scores=)``).
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if not isinstance(return_scores, bool):
        raise ValueError(f"return_scores must be a bool, got {return_scores!r}")
    checks.check_tensor("q", q, dim=3, dtypes=checks.FLOATS)
    T, H, Di = q.shape
    checks.check_tensor("k", k, shape=(None, Di), dtypes=checks.FLOATS, device=q.device)
    checks.check_tensor("weights", weights, shape=(T, H), dtypes=checks.FLOATS, device=q.device)
    if isinstance(layout, CompressedLayout):
        checks.check_layout_rows(layout, T, "q")
        if k.shape[0] < layout.capacity:
            raise ValueError(f"k must have at least layout.capacity={layout.capacity} rows (one per compressed "
                             f"entry), got {k.shape[0]}")
        candidates = VisibleCompressed(layout, T)
    elif not isinstance(layout, IndexSet):
        raise TypeError(f"layout must be a CompressedLayout (pack.compressed(4)) or an IndexSet of candidate rows, "
                        f"got {type(layout).__name__}")
    else:
        if layout.total_rows != T:
            raise ValueError(f"layout must cover the {T} rows of q, got an index set of {layout.total_rows} rows")
        candidates = layout
    for name, t in (("q", q), ("k", k), ("weights", weights)):
        checks.check_finite(name, t)
    with backend.exact_math(q.device):
        if backend.choose("indexer_topk", q.device) == "triton":
            return backend.kernel("indexer_topk")(q, k, weights, candidates, topk, return_scores=return_scores)
        return indexer_topk_reference(q, k, weights, candidates, topk, return_scores=return_scores)


try:  # registers the Triton kernel with the backend (used on CUDA); CPU-only installs run the reference
    from . import triton as _triton_kernels  # noqa: F401
except ImportError:
    _triton_kernels = None

__all__ = ["indexer_topk", "indexer_topk_reference", "index_scores"]

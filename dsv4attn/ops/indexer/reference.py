"""Reference lightning-indexer scores and top-k (docs/semantics.md, decision 6).

``score(t, j) = sum_h weights[t, h] * ReLU(<q[t, h], k[j]>)`` in fp32 (fp64 for fp64 inputs), where ``weights``
already carries ``index_n_heads ** -0.5 * index_head_dim ** -0.5``. Candidates are the compressed entries of the
row's own document that it may see (``j < floor((t+1)/4)``); the top-k keeps the ``min(k, visible)`` highest,
ties broken by the lower index (a stable sort over candidates listed in increasing index order; a NaN score ranks
above every number, so it is selected and propagates), and fills the remaining slots with -1. Top-k indices are not
differentiable.
"""
from __future__ import annotations

import torch

from ..index_sets import IndexSet, chunk_rows, gather_rows


def index_scores(q_c: torch.Tensor, keys: torch.Tensor, w_c: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(c, C) scores of c query rows against their gathered candidate keys (c, C, Di); -inf where not valid."""
    cd = torch.promote_types(q_c.dtype, torch.float32)
    dots = torch.einsum("chd,ckd->chk", q_c.to(cd), keys.to(cd))
    scores = (torch.relu(dots) * w_c.to(cd)[..., None]).sum(dim=1)
    return scores.masked_fill(~valid, float("-inf"))


def indexer_topk_reference(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, candidates: IndexSet,
                           topk: int, return_scores: bool = False):
    """(T, min(topk, width)) int32 top-k rows (see the module docstring); with ``return_scores`` also their scores
    (fp32, fp64 for fp64 inputs; -inf at empty slots)."""
    T, H, Di = q.shape
    width = min(topk, candidates.width)
    out = torch.full((T, width), -1, dtype=torch.int32, device=q.device)
    chosen_scores = torch.full((T, width), float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32),
                               device=q.device)
    if width == 0:
        return (out, chosen_scores) if return_scores else out
    with torch.no_grad():
        for s, e in chunk_rows(T, candidates.width * (H + Di), device=q.device):
            cand = candidates.rows(s, e)
            valid = cand >= 0
            scores = index_scores(q[s:e], gather_rows(k, cand), weights[s:e], valid)
            order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :width]
            chosen = cand.gather(1, order)
            # A NaN score sorts first and stays selected (its NaN then reaches the attention), as the kernels do.
            picked = scores.gather(1, order)
            chosen_valid = picked != float("-inf")
            out[s:e] = torch.where(chosen_valid, chosen, torch.full_like(chosen, -1)).to(torch.int32)
            chosen_scores[s:e] = picked.to(chosen_scores.dtype)
    return (out, chosen_scores) if return_scores else out

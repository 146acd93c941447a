"""Sparse MQA attention over a per-row index list, with a per-head attention sink."""
from __future__ import annotations

import torch

from ... import backend, checks
from ..index_sets import IndexSet, as_index_set
from .reference import sparse_attention_naive, sparse_attention_reference

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor | IndexSet, attn_sink: torch.Tensor,
                     softmax_scale: float | None = None):
    """One softmax per (row, head) over the keys ``indices[t]`` plus the sink logit (spec decision 5).

    Args:
        q: (T, H, D) queries, fp16/bf16/fp32/fp64.
        kv: (N, D) the single shared KV head, same dtype as ``q`` (keys and values are the same rows).
        indices: (T, K) int32 rows of ``kv`` per query, ``-1`` = empty slot (or an :class:`IndexSet`).
            A repeated index counts once per occurrence.
        attn_sink: (H,) per-head sink logit, fp32 (fp64 allowed for float64 checks); value 0, denominator only.
        softmax_scale: defaults to ``D ** -0.5``.
    Returns:
        out: (T, H, D) in ``q.dtype``; rows without a valid index give 0.
        lse: (T, H) fp32 (fp64 for fp64 inputs), natural log, **excluding** the sink; ``-inf`` for empty rows.
        The full softmax denominator is ``logaddexp(lse, attn_sink)``.
    """
    checks.check_tensor("q", q, dim=3, dtypes=FLOATS)
    T, H, D = q.shape
    checks.check_tensor("kv", kv, shape=(None, D), dtypes=(q.dtype,), device=q.device)
    checks.check_tensor("attn_sink", attn_sink, shape=(H,), dtypes=(torch.float32, torch.float64), device=q.device)
    if isinstance(indices, torch.Tensor):
        checks.check_tensor("indices", indices, shape=(T, None), dtypes=(torch.int32, torch.int64), device=q.device)
        checks.check_index_range("indices", indices, kv.shape[0])
    elif indices.total_rows != T:
        raise ValueError(f"indices must cover the {T} rows of q, got an index set of {indices.total_rows} rows")
    checks.check_finite("q", q)
    checks.check_finite("kv", kv)
    checks.check_finite("attn_sink", attn_sink, allow_inf=True)
    scale = checks.check_scale(softmax_scale, D)
    index_set = as_index_set(indices)
    with backend.exact_math(q.device):
        if backend.choose("sparse_attention", q.device) == "triton":
            return backend.kernel("sparse_attention")(q, kv, index_set, attn_sink, scale)
        return sparse_attention_reference(q, kv, index_set, attn_sink, scale)


try:  # registers the Triton kernel with the backend (used on CUDA); CPU-only installs run the reference
    from . import triton as _triton_kernels  # noqa: F401
except ImportError:
    _triton_kernels = None

__all__ = ["sparse_attention", "sparse_attention_reference", "sparse_attention_naive"]

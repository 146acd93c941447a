"""Reference (readable PyTorch, any device, float64-capable) for the query norm + RoPE and the output inverse RoPE.

These *are* the layer's former code paths, unchanged (docs/semantics.md, "Query path" steps 4-5 and "Output" step 1):

* ``qnorm_rope_reference``: per-head unweighted RMSNorm (statistics in fp32, one rounding to ``x.dtype``), then
  interleaved partial RoPE of the last ``2 * len(inv_freq)`` channels (rotation in fp32 with cos/sin rounded to
  fp32 from float64 angles, a second rounding to ``x.dtype``). Backward: autograd of the two steps.
* ``rope_rotate_reference``: RoPE by ``+angle`` (the indexer's queries), out of place.
* ``inverse_rope_reference``: RoPE by ``-angle``, out of place (docs/semantics.md, invariant 9.1).

Same signatures as the Triton versions; the public functions in ``__init__`` check the arguments.
"""
from __future__ import annotations

import torch

from ...norms import rms_norm_unweighted, row_chunks
from ...rope import apply_rope


def qnorm_rope_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float
                         ) -> torch.Tensor:
    """``apply_rope(rms_norm_unweighted(x, eps), positions, inv_freq)``: (T, H, D) -> (T, H, D) in ``x.dtype``."""
    return apply_rope(rms_norm_unweighted(x, eps), positions, inv_freq)


def rstd_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(T, H) ``1 / sqrt(mean(x^2) + eps)`` over each head's channels, in fp32 (fp64 for fp64 ``x``): the statistic
    :func:`dsv4attn.norms.rms_norm_unweighted` forms, in the same chunks of rows (bounded fp32 temporaries)."""
    cd = torch.promote_types(x.dtype, torch.float32)
    rstd = torch.empty(x.shape[:-1], dtype=cd, device=x.device)
    for s, e in row_chunks(x):
        rstd[s:e] = torch.rsqrt(x[s:e].to(cd).pow(2).mean(-1) + eps)
    return rstd


def qnorm_rope_input_grad_reference(grad: torch.Tensor, q: torch.Tensor, rstd: torch.Tensor, positions: torch.Tensor,
                                    inv_freq: torch.Tensor) -> torch.Tensor:
    """d x of ``qnorm_rope_reference`` from its output ``q``, the output's gradient ``grad`` and ``rstd`` (T, H):
    ``rstd * (dy - y * mean(dy * y))`` with ``dy`` and ``y = x * rstd`` rotated back by ``-angle`` from ``grad`` and
    ``q``, in ``rstd``'s dtype (chunks of rows), rounded once to ``q.dtype``."""
    cd = rstd.dtype
    dx = torch.empty_like(q)
    for s, e in row_chunks(q):
        dy = apply_rope(grad[s:e].to(cd), positions[s:e], inv_freq, inverse=True)
        y = apply_rope(q[s:e].to(cd), positions[s:e], inv_freq, inverse=True)
        r = rstd[s:e, ..., None]
        dx[s:e] = r * (dy - y * (dy * y).mean(-1, keepdim=True))
    return dx


def rope_rotate_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``apply_rope(x, positions, inv_freq)``: a new (T, H, D) tensor."""
    return apply_rope(x, positions, inv_freq)


def inverse_rope_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``apply_rope(x, positions, inv_freq, inverse=True)``: a new (T, H, D) tensor, never a view of ``x``."""
    return apply_rope(x, positions, inv_freq, inverse=True)


__all__ = ["qnorm_rope_reference", "rope_rotate_reference", "inverse_rope_reference", "rstd_reference",
           "qnorm_rope_input_grad_reference"]

"""Query RMSNorm + RoPE, plain RoPE and the output inverse RoPE of the attention layer, as fused elementwise ops.

``qnorm_rope`` is steps 4-5 of the query path (docs/semantics.md, "Query path"): per-head unweighted RMSNorm, then
interleaved partial RoPE on the last ``rope_dim`` channels. ``rope_rotate`` is that RoPE alone (the indexer's
queries). ``inverse_rope`` is step 1 of "Output" in docs/semantics.md: the attention output rotated back by ``-angle``
at the query's position, out of place (docs/semantics.md, invariant 9.1). On CUDA each is one pass over the (T, H, D)
tensor in the forward and one in the backward (``triton.py``); elsewhere, and for float64, the reference
(``reference.py``: the layer's former code) runs.
"""
from __future__ import annotations

import torch

from ... import backend, checks
from .reference import (inverse_rope_reference, qnorm_rope_input_grad_reference, qnorm_rope_reference,
                        rope_rotate_reference, rstd_reference)

_INTEGERS = (torch.int32, torch.int64)


def _check(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    checks.check_tensor("x", x, dim=3, dtypes=checks.FLOATS)
    checks.check_tensor("positions", positions, shape=(x.shape[0],), dtypes=_INTEGERS, device=x.device)
    checks.check_tensor("inv_freq", inv_freq, dim=1, dtypes=(torch.float32, torch.float64))
    rope_dim = 2 * inv_freq.shape[0]
    if rope_dim > x.shape[-1]:
        raise ValueError(f"inv_freq of length {inv_freq.shape[0]} rotates {rope_dim} channels, more than x's last "
                         f"dimension {x.shape[-1]}")


def qnorm_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> torch.Tensor:
    """``q = rope(x * rsqrt(mean(x^2) + eps))``: the per-head query RMSNorm (unweighted) followed by RoPE.

    Args:
        x: (T, H, D) fp16 / bf16 / fp32 / fp64 queries after ``q_b_proj``, one row of H heads per packed token.
        positions: (T,) int32 / int64 in-document position of each row (``pack.row_position``), on ``x``'s device.
        inv_freq: (rope_dim // 2,) fp64 (fp32 allowed) frequencies of the layer (``layer_rope_frequencies``); the
            last ``rope_dim`` channels of each head rotate in interleaved pairs, ``rope_dim`` may be 0.
        eps: the RMSNorm epsilon (``config.rms_norm_eps``).
    Returns:
        (T, H, D) in ``x.dtype``, a new tensor; differentiable in ``x``. On the kernel path it is saved for the
        backward (not ``x``): modifying it in place before the backward makes autograd raise.

    Statistics, normalisation and rotation run in fp32 (fp64 for fp64 input) with cos/sin rounded to fp32 from
    float64 angles (:func:`dsv4attn.rope.rope_cos_sin`). The kernel rounds to ``x.dtype`` once, the reference twice
    (after the norm and after the rotation); the kernel's backward also keeps the un-rotated gradient in fp32 where
    the reference rounds it to ``x.dtype`` before the norm backward, and recovers the normalised rows by rotating
    its own (rounded) output back, with rstd from the forward, where the reference's autograd uses ``x``.
    """
    _check(x, positions, inv_freq)
    eps = checks.check_eps(eps)
    with backend.exact_math(x.device):
        if backend.choose("qnorm_rope", x.device) == "triton":
            return backend.kernel("qnorm_rope")(x, positions, inv_freq, eps)
        return qnorm_rope_reference(x, positions, inv_freq, eps)


@torch.no_grad()
def qnorm_rope_stats(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, rstd): :func:`qnorm_rope`'s output without a gradient, and each (row, head)'s ``rstd = 1 / sqrt(mean(x^2)
    + eps)``, (T, H) fp32 (fp64 for fp64 ``x``). What ``sparse_attention(..., query_norm=(x, rstd))`` takes: the
    attention's backward then returns the gradient of ``x`` itself (:func:`qnorm_rope_input_grad`), and no pass of
    its own runs for the query norm's backward. Arguments as :func:`qnorm_rope`."""
    _check(x, positions, inv_freq)
    eps = checks.check_eps(eps)
    with backend.exact_math(x.device):
        if backend.choose("qnorm_rope", x.device) == "triton":
            return _triton_kernels.qnorm_rope_stats_triton(x, positions, inv_freq, eps)
        return qnorm_rope_reference(x, positions, inv_freq, eps), rstd_reference(x, eps)


def qnorm_rope_input_grad(grad: torch.Tensor, q: torch.Tensor, rstd: torch.Tensor, positions: torch.Tensor,
                          inv_freq: torch.Tensor) -> torch.Tensor:
    """d x of :func:`qnorm_rope` from the gradient ``grad`` of its output ``q`` (both (T, H, D)) and ``rstd`` (T, H)
    of :func:`qnorm_rope_stats`: ``rstd * (dy - y * mean(dy * y))`` with ``dy``, ``y`` the gradient and the output
    rotated back by ``-angle`` (the normalised rows, recovered from ``q``). In ``q.dtype``; no graph. For
    ``sparse_attention(..., query_norm=...)`` where its kernel does not apply the norm's backward itself."""
    with backend.exact_math(q.device):
        if backend.choose("qnorm_rope", q.device) == "triton":
            return _triton_kernels.qnorm_rope_input_grad_triton(grad, q, rstd, positions, inv_freq)
        return qnorm_rope_input_grad_reference(grad, q, rstd, positions, inv_freq)


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``2 * len(inv_freq)`` channels of every head by ``+positions * inv_freq``. Out of place.

    Args:
        x: (T, H, D) fp16 / bf16 / fp32 / fp64 rows (the indexer's queries after ``q_b_proj``).
        positions: (T,) int32 / int64 in-document positions of the rows, on ``x``'s device.
        inv_freq: (rope_dim // 2,) fp64 (fp32 allowed) frequencies of the layer.
    Returns:
        A new (T, H, D) tensor in ``x.dtype`` (never a view of ``x``), differentiable in ``x`` (the backward is the
        rotation by ``-angle``). Rotation in fp32 (fp64 for fp64 input) with cos/sin rounded to fp32 from float64
        angles, one rounding to ``x.dtype``: the formula of :func:`dsv4attn.rope.apply_rope` (the reference; the
        kernel may fuse its multiply-adds).
    """
    return _rotate("rope_rotate", x, positions, inv_freq)


def inverse_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``2 * len(inv_freq)`` channels of every head by ``-positions * inv_freq``. Out of place.

    Args:
        x: (T, H, D) float attention output.
        positions: (T,) int32 / int64 positions of the query rows, on ``x``'s device.
        inv_freq: (rope_dim // 2,) fp64 (fp32 allowed) frequencies of the layer.
    Returns:
        A new (T, H, D) tensor in ``x.dtype`` -- never ``x`` or a view of it, also for ``rope_dim == 0`` (invariant
        9.1: the attention backward keeps its output; rotating that in place would corrupt dq / dkv).
        Differentiable in ``x``: the backward is the rotation by ``+angle``.
    """
    return _rotate("inverse_rope", x, positions, inv_freq)


_ROTATION_REFERENCES = {"rope_rotate": rope_rotate_reference, "inverse_rope": inverse_rope_reference}


def _rotate(op: str, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    _check(x, positions, inv_freq)
    with backend.exact_math(x.device):
        if backend.choose(op, x.device) == "triton":
            return backend.kernel(op)(x, positions, inv_freq)
        return _ROTATION_REFERENCES[op](x, positions, inv_freq)


try:  # registers the Triton kernels with the backend (used on CUDA); CPU-only installs run the reference
    from . import triton as _triton_kernels  # noqa: F401
except ImportError:
    _triton_kernels = None

__all__ = ["qnorm_rope", "qnorm_rope_stats", "qnorm_rope_input_grad", "rope_rotate", "inverse_rope",
           "qnorm_rope_reference", "rope_rotate_reference", "inverse_rope_reference"]

"""Interleaved partial RoPE (plain and YaRN) and its inverse (docs/semantics.md, "RoPE and YaRN").

RoPE acts on the *last* ``rope_dim`` channels of a vector; channel pairs ``(2i, 2i+1)`` of that slice rotate like a
complex number by ``position * theta_i``; the leading channels pass through unchanged. The inverse rotates by
``-position * theta_i``. Which table a layer uses depends only on its compress ratio (docs/semantics.md, invariant 9.2):
ratio 0 is plain RoPE at ``rope_theta``; ratios 4 and 128 use ``compress_rope_theta`` with YaRN when ``rope_scaling`` is
set, with the YaRN attention factor forced to 1 (cos/sin are never scaled).

Angles are computed in float64 (positions up to millions stay exact), the rotation in
``promote(x.dtype, float32)`` and the result is cast back to ``x.dtype`` (Hugging Face's convention).
"""
from __future__ import annotations

import math

import torch

from .config import AttentionConfig


def rope_frequencies(rope_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """(rope_dim // 2,) float64 angular frequencies theta_i, YaRN-blended when ``scaling`` is a yarn dict."""
    i = torch.arange(rope_dim // 2, dtype=torch.float64)
    theta = base ** (-2.0 * i / rope_dim)
    if scaling is None or scaling.get("type", scaling.get("rope_type", "yarn")) == "default":
        return theta
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32.0)
    beta_slow = float(scaling.get("beta_slow") or 1.0)

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    gamma = ((i - low) / (high - low)).clamp(0.0, 1.0)   # 0: keep (high frequency), 1: divide by factor
    return theta * ((1.0 - gamma) + gamma / factor)


def layer_rope_frequencies(config: AttentionConfig, compress_ratio: int) -> torch.Tensor:
    """The table of a layer, chosen by its ratio and never by anything else (docs/semantics.md, invariant 9.2)."""
    if compress_ratio == 0:
        return rope_frequencies(config.qk_rope_head_dim, config.rope_theta, None)
    return rope_frequencies(config.qk_rope_head_dim, config.compress_rope_theta, config.rope_scaling)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin of shape (len(positions), rope_dim // 2) in ``dtype``, from float64 angles."""
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(device=positions.device)[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
               ) -> torch.Tensor:
    """Rotate the trailing ``2 * len(inv_freq)`` channels of ``x`` at ``positions``. Out of place.

    Args:
        x: (T, ..., D) any float dtype; middle dims (heads) share the row's position.
        positions: (T,) integer positions (in-document).
        inv_freq: (rope_dim // 2,) frequencies from :func:`rope_frequencies`.
        inverse: rotate by -angle (the output inverse RoPE: docs/semantics.md, "Output").
    Returns a new tensor (never a view of ``x``: docs/semantics.md, invariant 9.1) of the shape and dtype of ``x``.
    """
    rope_dim = 2 * inv_freq.shape[0]
    if rope_dim == 0:
        return x.clone()
    compute = torch.promote_types(x.dtype, torch.float32)
    cos, sin = rope_cos_sin(positions, inv_freq, compute)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    rot = x[..., -rope_dim:].to(compute)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    out_even = even * cos - odd * sin
    out_odd = odd * cos + even * sin
    rotated = torch.stack((out_even, out_odd), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rope_dim], rotated], dim=-1)

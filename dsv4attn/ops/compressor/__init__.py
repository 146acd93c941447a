"""Compressor gated pooling: ratio-4 overlapping and ratio-128 groups of a packed batch."""
from __future__ import annotations

import torch

from ... import backend, checks
from ...packing import CompressedLayout
from .reference import compress_pool_reference


def compress_pool(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor,
                  layout: CompressedLayout) -> torch.Tensor:
    """Gated pooling of every complete group of every document.

    Args:
        kv: (T, c*d) compressor value projection of the packed rows (c = 2 for ratio 4, else 1).
        gate: (T, c*d) compressor gate projection, same dtype as ``kv``.
        position_bias: (ratio, c*d) fp32 (fp64 allowed) absolute positional bias, added to the gate.
        layout: ``pack_batch(cu_seqlens, T, max_seqlen).compressed(ratio)``.
    Returns:
        (layout.capacity, d) in ``kv.dtype``; entry rows in document order, padding entries 0.
    """
    checks.check_tensor("kv", kv, dim=2, dtypes=checks.FLOATS)
    T, width = kv.shape
    checks.check_tensor("gate", gate, shape=(T, width), dtypes=(kv.dtype,), device=kv.device)
    checks.check_layout_rows(layout, T, "kv")
    if layout.ratio == 4 and width % 2:
        raise ValueError(f"kv must have an even width (2*d) for ratio 4, got {width}")
    checks.check_tensor("position_bias", position_bias, shape=(layout.ratio, width),
                        dtypes=(torch.float32, torch.float64), device=kv.device)
    checks.check_finite("kv", kv)
    checks.check_finite("gate", gate)
    with backend.exact_math(kv.device):
        if backend.choose("compress_pool", kv.device) == "triton":
            return backend.kernel("compress_pool")(kv, gate, position_bias, layout)
        return compress_pool_reference(kv, gate, position_bias, layout)


try:  # registers the Triton kernels with the backend (used on CUDA); CPU-only installs run the reference
    from . import triton as _triton_kernels  # noqa: F401
except ImportError:
    _triton_kernels = None

__all__ = ["compress_pool", "compress_pool_reference"]

"""Input checks with errors that name the argument and the expectation.

Shape, dtype and device checks are free and always run. Value checks (``cu_seqlens`` monotonic and within the
batch, ``max_seqlen`` large enough, no NaN/Inf in inputs) read device values, i.e. cost a device->host sync; they
are on by default and can be switched off for CUDA graphs / the hot path with ``set_checks(False)`` or the
environment variable ``DSV4ATTN_CHECKS=0``.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_enabled = os.environ.get("DSV4ATTN_CHECKS", "1") not in ("0", "false", "False", "off")


def set_checks(enabled: bool) -> None:
    """Turn value checks (those that need a device->host sync) on or off."""
    global _enabled
    _enabled = bool(enabled)


def checks_enabled() -> bool:
    return _enabled


def values_readable() -> bool:
    """Value checks on, and reading device values is allowed here: never inside a ``torch.compile`` trace or a
    CUDA-graph capture (a device->host read would break the graph or the capture); every value check uses it."""
    if not _enabled or torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@contextmanager
def checks(enabled: bool):
    """Context manager form of :func:`set_checks`."""
    global _enabled
    before, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = before


def check_cu_seqlens(cu_seqlens: torch.Tensor, total_rows: int) -> None:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of dtype int32, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must have dtype torch.int32 (flash-attn convention), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be 1-D of shape (N+1,), got shape {tuple(cu_seqlens.shape)}")
    if not values_readable():
        return
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {values[0]}")
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{b + 1}]={values[b + 1]} < "
                             f"cu_seqlens[{b}]={values[b]}")
    if values[-1] > total_rows:
        raise ValueError(f"cu_seqlens[-1]={values[-1]} exceeds the number of rows of the packed batch "
                         f"({total_rows}); rows after cu_seqlens[-1] are padding, never the other way round")


def check_max_seqlen(max_seqlen: int, cu_seqlens: torch.Tensor) -> None:
    if isinstance(max_seqlen, torch.Tensor) or isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen must be a host int (no device tensor, to avoid a sync), "
                        f"got {type(max_seqlen).__name__}")
    if max_seqlen < 0:
        raise ValueError(f"max_seqlen must be >= 0, got {max_seqlen}")
    if not values_readable() or cu_seqlens.shape[0] < 2:
        return
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    if longest > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest document in cu_seqlens "
                         f"({longest})")


def check_tensor(name: str, t: torch.Tensor, *, dim: int | None = None, shape: tuple | None = None,
                 dtypes: tuple | None = None, device: torch.device | None = None) -> None:
    """Check rank, shape (None entries are free), dtype and device of one argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + (",)" if len(shape) == 1 else ")")
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def check_finite(name: str, t: torch.Tensor, allow_inf: bool = False) -> None:
    """Raise if ``t`` holds NaN (or +-Inf unless ``allow_inf``); only when value checks are on."""
    if not (t.is_floating_point() and values_readable()):
        return
    bad = torch.isnan(t).any() if allow_inf else ~torch.isfinite(t).all()
    if bool(bad):
        what = "NaN" if allow_inf else "NaN or Inf"
        raise ValueError(f"{name} contains {what} (value checks are on; see dsv4attn.set_checks)")


def check_index_range(name: str, indices: torch.Tensor, rows: int) -> None:
    """Indices must lie in [-1, rows); -1 marks an empty slot. One sync, only when value checks are on."""
    if indices.numel() == 0 or not values_readable():
        return
    lo, hi = int(indices.min()), int(indices.max())
    if lo < -1 or hi >= rows:
        raise ValueError(f"{name} must hold row numbers in [0, {rows}) or -1 for an empty slot, "
                         f"got values in [{lo}, {hi}]")


def check_scale(softmax_scale, head_dim: int) -> float:
    """``softmax_scale`` (None = head_dim ** -0.5) as a positive finite float."""
    if softmax_scale is None:
        return head_dim ** -0.5
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return scale


def check_layout_rows(layout, rows: int, name: str) -> None:
    if layout.row_visible.shape[0] != rows:
        raise ValueError(f"layout was built for {layout.row_visible.shape[0]} rows, {name} has {rows}")

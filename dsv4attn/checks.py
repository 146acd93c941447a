"""Input checks with errors that name the argument and the expectation.

Three kinds, by what they cost:

- **Free checks** (types, ranks, shapes, dtypes, devices, host ints such as ``max_seqlen``): always on.
- **Batch metadata** (``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] <= rows``, ``max_seqlen`` >= the
  longest document): validated by :func:`dsv4attn.pack_batch` once per batch, **always** (:func:`check_batch`: one
  host read of the small ``(N+1,)`` tensor, never switched off). Everything the library derives from a pack --
  positions, windows, compressed layouts and capacities, index sets, top-k rows -- is then in range by construction,
  so a layer given a prebuilt pack checks no value at all. Inside a ``torch.compile`` trace or a CUDA-graph capture
  no value can be read: build the pack outside (it is once per batch) and pass ``pack=`` to the layers.
- **Value scans** (NaN/Inf in activations and parameters; the range of indices a caller passes to an op): a debug
  mode, **off by default**. ``set_checks("values")`` (or ``set_checks(True)``, or the environment variable
  ``DSV4ATTN_CHECKS=values``) turns them on; each costs a full pass over a tensor and a device->host read.
  ``set_checks("default")`` (``set_checks(False)``, ``DSV4ATTN_CHECKS=0``, or leaving the variable unset) is the
  fast default. Scans are skipped while compiling or capturing (they would break the graph).

Index safety does not depend on the mode: an index an op is given that is >= the number of key rows counts as an
empty slot (like -1, and like every negative index already does) instead of being read, without a host read (one
elementwise pass over a caller's index tensor; the library's own index sets carry a host bound and skip it). In
``"values"`` mode such an index raises instead.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

MODES = ("default", "values")
_ENV_MODES = {"": "default", "0": "default", "false": "default", "off": "default", "no": "default",
              "default": "default", "1": "values", "true": "values", "on": "values", "yes": "values",
              "values": "values"}


def _mode_of(mode, name: str) -> str:
    if mode is True or mode is False:          # the former on / off switch: True = the scans, False = the default
        return "values" if mode else "default"
    if isinstance(mode, str) and mode in MODES:
        return mode
    raise ValueError(f"{name} must be one of {list(MODES)} (or True = 'values', False = 'default'), got {mode!r}")


def _mode_from_env() -> str:
    raw = os.environ.get("DSV4ATTN_CHECKS", "")
    mode = _ENV_MODES.get(raw.strip().lower())
    if mode is None:
        raise ValueError(f"environment variable DSV4ATTN_CHECKS must be 'values' (debug value scans; also 1, true, "
                         f"on) or 'default' (also 0, false, off, or unset), got {raw!r}")
    return mode


_mode = _mode_from_env()


def set_checks(mode) -> None:
    """Pick the check mode: ``"default"`` (fast: free checks and the per-batch metadata validation only) or
    ``"values"`` (debug: also NaN/Inf scans of activations and parameters and range checks of given indices, each a
    device->host read). ``True`` means ``"values"`` and ``False`` means ``"default"``. Batch metadata is validated
    in both modes."""
    global _mode
    _mode = _mode_of(mode, "set_checks mode")


def checks_mode() -> str:
    """The current mode, ``"default"`` or ``"values"``."""
    return _mode


def checks_enabled() -> bool:
    """Whether the debug value scans are on (``"values"`` mode)."""
    return _mode == "values"


def reads_possible() -> bool:
    """Whether a device value may be read on the host here: never inside a ``torch.compile`` trace or a CUDA-graph
    capture (a device->host read would break the graph or the capture)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def values_readable() -> bool:
    """Value scans on (``"values"`` mode) and reading device values possible here; every value scan uses it."""
    return _mode == "values" and reads_possible()


@contextmanager
def checks(mode):
    """Context manager form of :func:`set_checks` (the mode is restored on exit)."""
    global _mode
    before, _mode = _mode, _mode_of(mode, "checks mode")
    try:
        yield
    finally:
        _mode = before


# ------------------------------------------------------------------------------------------------ batch metadata
def check_cu_seqlens(cu_seqlens: torch.Tensor) -> None:
    """Type, dtype and rank of ``cu_seqlens`` (free)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of dtype int32, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must have dtype torch.int32 (flash-attn convention), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be 1-D of shape (N+1,), got shape {tuple(cu_seqlens.shape)}")


def check_max_seqlen(max_seqlen: int) -> None:
    """``max_seqlen`` is a host int >= 0 (free)."""
    if isinstance(max_seqlen, torch.Tensor) or isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen must be a host int (no device tensor, to avoid a sync), "
                        f"got {type(max_seqlen).__name__}")
    if max_seqlen < 0:
        raise ValueError(f"max_seqlen must be >= 0, got {max_seqlen}")


def check_batch(cu_seqlens: torch.Tensor, total_rows: int, max_seqlen: int | None, keep: list | None = None) -> int:
    """Validate a batch's metadata and return ``max_seqlen`` (the longest document when ``None``).

    Always runs, whatever the mode: one host read of ``cu_seqlens`` (N+1 ints) checks ``cu_seqlens[0] == 0``,
    non-decreasing boundaries, ``cu_seqlens[-1] <= total_rows`` and ``max_seqlen >= `` every document's length.
    Where no value can be read (a ``torch.compile`` trace, a CUDA-graph capture) only the free checks run and
    ``max_seqlen`` must be given.
    """
    check_cu_seqlens(cu_seqlens)
    if max_seqlen is not None:
        check_max_seqlen(max_seqlen)
    if not reads_possible():
        if max_seqlen is None:
            raise ValueError("max_seqlen must be given (a host int) inside torch.compile or a CUDA-graph capture: "
                             "computing it reads cu_seqlens on the host; better, build the pack outside with "
                             "dsv4attn.pack_batch and pass pack=")
        return max_seqlen
    values = cu_seqlens.tolist()                     # the batch's one host read
    if keep is not None:                             # the caller keeps the values (CP digests them: no 2nd read)
        keep.extend(values)
    if values[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {values[0]}")
    longest = 0
    for b in range(len(values) - 1):
        length = values[b + 1] - values[b]
        if length < 0:
            raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{b + 1}]={values[b + 1]} < "
                             f"cu_seqlens[{b}]={values[b]}")
        longest = max(longest, length)
    if values[-1] > total_rows:
        raise ValueError(f"cu_seqlens[-1]={values[-1]} exceeds the number of rows of the packed batch "
                         f"({total_rows}); rows after cu_seqlens[-1] are padding, never the other way round")
    if max_seqlen is None:
        return longest
    if longest > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest document in cu_seqlens "
                         f"({longest}); it must be >= every document length")
    return max_seqlen


# ------------------------------------------------------------------------------------------------ tensors
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
    """Raise if ``t`` holds NaN (or +-Inf unless ``allow_inf``); only in ``"values"`` mode (a scan and a read)."""
    if not (t.is_floating_point() and values_readable()):
        return
    bad = torch.isnan(t).any() if allow_inf else ~torch.isfinite(t).all()
    if bool(bad):
        what = "NaN" if allow_inf else "NaN or Inf"
        raise ValueError(f"{name} contains {what}; it must be finite (found by the debug value checks, "
                         f"dsv4attn.set_checks('values'))")


def check_index_range(name: str, indices: torch.Tensor, rows: int) -> None:
    """Indices must lie in [-1, rows); -1 marks an empty slot. Only in ``"values"`` mode: one fused min/max read."""
    if indices.numel() == 0 or not values_readable():
        return
    lo, hi = torch.aminmax(indices)
    lo, hi = torch.stack([lo, hi]).tolist()
    if lo < -1 or hi >= rows:
        raise ValueError(f"{name} must hold row numbers in [0, {rows}) or -1 for an empty slot, "
                         f"got values in [{lo}, {hi}]")


def mask_out_of_range(indices: torch.Tensor, rows: int) -> torch.Tensor:
    """``indices`` with every value >= ``rows`` set to -1 (an empty slot), without reading anything: what makes an
    out-of-range index safe in every kernel (they skip negative indices and would read row ``rows`` and beyond)."""
    return torch.where(indices < rows, indices, -1)


def check_scale(softmax_scale, head_dim: int) -> float:
    """``softmax_scale`` (None = head_dim ** -0.5) as a positive finite float."""
    if softmax_scale is None:
        return head_dim ** -0.5
    scale = _host_float(softmax_scale)
    if scale is None or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return scale


def check_eps(eps) -> float:
    """An RMSNorm ``eps`` as a finite float >= 0 (a negative one makes ``mean(x^2) + eps`` negative: NaN)."""
    value = _host_float(eps)
    if value is None or not math.isfinite(value) or value < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return value


def _host_float(value) -> float | None:
    """``float(value)`` for a real number (or a one-element tensor); None for anything else (a string, None, a
    bool, a tensor of several elements), so that the caller's error names its argument."""
    if isinstance(value, (bool, str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def check_layout_rows(layout, rows: int, name: str) -> None:
    from .packing import CompressedLayout            # packing imports this module
    if not isinstance(layout, CompressedLayout):
        raise TypeError(f"layout must be a CompressedLayout (pack_batch(...).compressed(ratio)), "
                        f"got {type(layout).__name__}")
    if layout.row_visible.shape[0] != rows:
        raise ValueError(f"layout was built for {layout.row_visible.shape[0]} rows, {name} has {rows}")

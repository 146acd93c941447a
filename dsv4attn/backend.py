"""The one place that decides which implementation of an op runs.

``"reference"``: the readable PyTorch implementation (any device, float64-capable).
``"triton"``: fused kernels, used on CUDA when Triton is importable and the op has a kernel registered.
Override with ``set_backend("reference")`` / ``set_backend("triton")``, or ``DSV4ATTN_BACKEND``; ``None``/``"auto"``
restores the automatic choice. Within the Triton backend, which kernel runs each pass (the SM90 Gluon kernels or the
Triton ones) is decided by :mod:`dsv4attn.variants`: ``set_kernels("triton")`` or ``DSV4ATTN_KERNELS=triton``
keeps every Gluon kernel out.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Callable

import torch

from .variants import set_kernels  # noqa: F401  (the one setter of the kernel choice, next to set_backend)

BACKENDS = ("reference", "triton")
_forced: str | None = os.environ.get("DSV4ATTN_BACKEND") or None
_kernels: dict[str, Callable] = {}


_TRITON_FOUND = importlib.util.find_spec("triton") is not None   # once, at import: torch.compile traces choose()


def triton_available() -> bool:
    return _TRITON_FOUND


def forced() -> str | None:
    return _forced


def set_backend(name: str | None) -> None:
    global _forced
    if name in (None, "auto"):
        _forced = None
        return
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or 'auto', got {name!r}")
    _forced = name


def register_kernel(op: str, fn: Callable) -> None:
    """Called by an op's ``triton.py`` module to make its kernel eligible."""
    _kernels[op] = fn


def choose(op: str, device: torch.device) -> str:
    """Backend for ``op`` on ``device``: forced choice, else triton on CUDA when a kernel exists."""
    if _forced == "triton" and op not in _kernels:
        raise RuntimeError(f"backend 'triton' was forced but op {op!r} has no Triton kernel in this version")
    if _forced is not None:
        return _forced
    if device.type == "cuda" and op in _kernels and triton_available():
        return "triton"
    return "reference"


def kernel(op: str) -> Callable:
    return _kernels[op]


def exact_math(device: torch.device):
    """Ops choose their own precision (fp32 softmaxes, LSEs, scores): autocast must not downcast inside them."""
    return torch.autocast(device_type=device.type, enabled=False)


def registered_kernels() -> tuple[str, ...]:
    return tuple(sorted(_kernels))

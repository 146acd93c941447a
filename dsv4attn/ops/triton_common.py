"""Pieces every Triton kernel of the package shares: the dot modes and the CPU interpreter's bf16 workarounds."""
from __future__ import annotations

import os

from typing import Callable, TypeVar

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

C = TypeVar("C")


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (the CPU interpreter the tests run the kernels through)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launch_fitting(launch: Callable[[C], object], config: C, smaller: Callable[[C], C | None]) -> C:
    """``launch(config)``, retried with ``smaller(config)`` while this GPU's shared memory or registers are too
    small for it (``OutOfResources``) until ``smaller`` returns None; returns the configuration that launched."""
    while True:
        try:
            launch(config)
            return config
        except OutOfResources:
            config = smaller(config)
            if config is None:
                raise


def dot_mode(dtype: torch.dtype) -> int:
    """The ``DOT_MODE`` of :func:`dot` for operands of ``dtype``."""
    if dtype == torch.float32:
        return 1
    return 2 if dtype == torch.bfloat16 and interpreting() else 0


@triton.jit
def dot(a, b, DOT_MODE: tl.constexpr):
    # DOT_MODE 0: native tensor-core dot (fp16/bf16 operands, fp32 accumulation).
    # DOT_MODE 1: fp32 operands in true fp32 (never silently tf32: the fp32 paths promise ~1e-5 relative).
    # DOT_MODE 2: bf16 under the CPU interpreter (TRITON_INTERPRET=1), which mis-multiplies bf16 tiles (Triton 3.9):
    #             operands are widened to fp32 first; bf16 x bf16 products are exact in fp32, as on tensor cores.
    if DOT_MODE == 1:
        return tl.dot(a, b, input_precision="ieee")
    elif DOT_MODE == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def round_to(x, PTR, BY_HAND: tl.constexpr):
    """fp32 tile -> the element dtype of ``PTR`` (a dot operand or a store), rounding to nearest even as GPUs do.

    ``BY_HAND`` (bf16 under the CPU interpreter, which truncates fp32 -> bf16, a biased error GPUs do not make):
    round the bits here and return fp32 holding the bf16 value, which a store or a widening dot then keeps exactly.
    """
    if BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(PTR.dtype.element_ty)

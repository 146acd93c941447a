"""Deterministic ``dkv[idx[r, k]] += sum over head blocks of buf[hb, r, k]``: the reduction of the deterministic
sparse-attention backward (see :mod:`.triton`).

Why not a PyTorch scatter: ``index_add_`` on CUDA uses float atomics; ``index_put_(accumulate=True)`` is
deterministic on CUDA but would first need the (rows * K, D) buffer summed over head blocks and copied into sorted
order. Here the flattened indices are sorted once per chunk (a stable sort: its permutation is unique, hence
repeatable), ``searchsorted`` finds each key's run of buffer rows, and one program per (key, column block) adds its
run in sorted order, ``BLOCK_I`` rows at a time, into ``dkv`` with a plain load and store: every key row of ``dkv``
has one owner, so nothing races. All shapes are fixed by the inputs' shapes (no host sync): it runs inside CUDA
graphs. Slots with index -1 sort first and belong to no key.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _segment_sum_kernel(BUF, ORDER, BOUNDS, DKV, M, D: tl.constexpr, NUM_HB: tl.constexpr,
                        BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
    key = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(BOUNDS + key)
    end = tl.load(BOUNDS + key + 1)
    if end > start:
        acc = tl.zeros([BLOCK_D], tl.float32)
        for i0 in range(start, end, BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            in_run = i < end
            src = tl.load(ORDER + i, mask=in_run, other=0)
            for hb in tl.static_range(NUM_HB):
                tile = tl.load(BUF + (hb * M + src)[:, None] * D + offs_d[None, :], mask=in_run[:, None], other=0.0)
                acc += tl.sum(tile, 0)
        row = DKV + key * D + offs_d
        tl.store(row, tl.load(row) + acc)


def add_rows_by_key(dkv: torch.Tensor, idx: torch.Tensor, buf: torch.Tensor, num_hb: int) -> None:
    """``dkv`` (N, D) fp32 += the rows of ``buf`` grouped by ``idx``, in a fixed order.

    Args:
        dkv: (N, D) fp32, contiguous; updated in place.
        idx: (R, K) int32/int64 key rows in [0, N) or -1 (ignored).
        buf: fp32 holding at least ``num_hb * R * K * D`` elements, laid out (num_hb, R * K, D).
        num_hb: number of head blocks summed per buffer row.
    """
    N, D = dkv.shape
    keys = idx.reshape(-1)
    if N == 0 or keys.numel() == 0:
        return
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.searchsorted(sorted_keys, torch.arange(N + 1, device=keys.device, dtype=keys.dtype))
    block_d = min(D, 128)
    grid = (N, triton.cdiv(D, block_d))
    _segment_sum_kernel[grid](buf, order, bounds, dkv, keys.numel(), D=D, NUM_HB=num_hb, BLOCK_I=16,
                              BLOCK_D=block_d, num_warps=4)

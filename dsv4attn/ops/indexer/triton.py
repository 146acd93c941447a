"""Triton lightning-indexer scores + deterministic top-k (spec decision 6) over contiguous candidate ranges.

Same contract as :func:`.reference.indexer_topk_reference`. The fast path covers the candidate sets the layers
use, where query row t sees the contiguous range of layout entries ``[first[t], first[t] + visible[t])``:
:class:`VisibleCompressed` and a :class:`Rows` view of one (how the layer and context parallelism address it;
an optional ``table`` maps layout entries to key rows, ``shift`` is added after). Any other index set, float64
inputs and empty outputs go to the reference.

Two stages per chunk of query rows (the chunk bounds the working set to ``chunk x width`` int64 keys, so memory
is O(T * topk + chunk), not O(T^2)):

1. ``_indexer_keys_kernel``: one program per (block of ``BLOCK_T`` query rows, block of ``BLOCK_E`` layout
   entries). Entries are counted from the first entry of the block's first row, so a block whose rows all belong
   to one document (the common case) loads one shared key tile and every head is one ``tl.dot``; a block that
   straddles documents uses the same tile, masked per row (it spans at most ``width + BLOCK_T / 4`` entries, so
   the grid covers ``2 * width + BLOCK_T`` entries). For each index head h it adds ``w[t, h] * relu(q_h . k)`` to
   a fp32 accumulator, then writes, in row-relative coordinates ``j = entry - first[t]``, an int64 sort key

       key = order(score) << 32 | (2^32 - 1 - j)        (score = -inf where j >= visible[t])

   where ``order`` maps the fp32 bits to an int32 with the same order. Larger key = higher score, and among equal scores the lower j.
2. ``torch.topk`` of the keys, ``sorted=True``: keys in a row are distinct, so the result is unique and
   deterministic, and equals the reference's stable descending sort. Slots whose score is -inf become -1.

No device->host sync: widths are host ints of the layout, the per-row ranges stay on the device.

The tensor part is the registered custom op ``torch.ops.dsv4attn.indexer_topk_ranges`` (``register_fake`` gives
the output shape, ``(T, min(topk, width))`` int32, from host ints only), so ``torch.compile(fullgraph=True)`` sees
one opaque node and CUDA graphs can capture it. The op has no gradient (indices). It runs the kernels, so it needs
a CUDA device, or the CPU interpreter (``TRITON_INTERPRET=1``). :func:`indexer_topk_triton` keeps the Python
around it: picking the fast path from the :class:`IndexSet`, the reference fallbacks, and the parts of a
:class:`Stack` one by one.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ... import backend
from ..triton_common import dot, dot_mode
from ..index_sets import IndexSet, Rows, Stack, VisibleCompressed, chunk_rows
from .reference import indexer_topk_reference

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# BLOCK_T query rows x BLOCK_E entries per program; benchmarks may pass another config.
CONFIG = dict(BLOCK_T=64, BLOCK_E=128, num_warps=8, num_stages=3)
# The order in which the op's ``tiles`` argument lists a config (a custom op's schema takes no dicts).
TILE_KEYS = ("BLOCK_T", "BLOCK_E", "num_warps", "num_stages")
# Elements (int64 keys) of one chunk's score buffer: 2^26 keys = 512 MiB.
KEY_BUDGET = 1 << 26
# order(-inf): the high half of every empty slot's key (0xFF800000 with the low 31 bits flipped, as int32).
NEG_INF_ORDER = -2139095041
LOW_MASK = 0xFFFFFFFF


@triton.jit
def _indexer_keys_kernel(
    Q, K, W, FIRST, VISIBLE, TABLE, KEYS,
    rows_c, H: tl.constexpr, Di, width, shift,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, HAS_TABLE: tl.constexpr,
    DOT_MODE: tl.constexpr,
):
    # Entry blocks vary fastest: neighbouring programs reuse the same query rows (the larger operand) from L2.
    eb = tl.program_id(0)
    tb = tl.program_id(1)
    rows = (tb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < rows_c
    first = tl.load(FIRST + rows, mask=row_ok, other=0)
    visible = tl.load(VISIBLE + rows, mask=row_ok, other=0)
    block_first = tl.load(FIRST + tb * BLOCK_T)
    entries = block_first + eb * BLOCK_E + tl.arange(0, BLOCK_E).to(tl.int64)
    j = entries[None, :] - first[:, None]                                  # (BLOCK_T, BLOCK_E) row-relative
    valid = (j >= 0) & (j < visible[:, None]) & row_ok[:, None]
    in_buffer = (j >= 0) & (j < width) & row_ok[:, None]

    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    needed = tl.max(valid.to(tl.int32), axis=1)                            # any valid slot in this tile?
    if tl.max(needed, axis=0) > 0:
        col_ok = tl.max(valid.to(tl.int32), axis=0) > 0
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < Di
        key_rows = entries
        if HAS_TABLE:
            key_rows = tl.load(TABLE + entries, mask=col_ok, other=0)
        key_rows = tl.where(col_ok, key_rows + shift, 0)
        k_tile = tl.load(K + key_rows[:, None] * Di + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :],
                         other=0.0)
        k_t = tl.trans(k_tile)
        q_rows = Q + rows[:, None] * H * Di + offs_d[None, :]
        for h in range(H):
            q_h = tl.load(q_rows + h * Di, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            w_h = tl.load(W + rows * H + h, mask=row_ok, other=0.0).to(tl.float32)
            s = dot(q_h, k_t, DOT_MODE)
            acc += w_h[:, None] * tl.maximum(s, 0.0)

    # acc starts at +0.0 and x + (-0.0) or x - x never gives -0.0, so a zero score is +0.0: equal scores have
    # equal bits, as the order map needs (the reference compares floats, where -0.0 == +0.0).
    score = tl.where(valid, acc, float("-inf"))
    bits = score.to(tl.int32, bitcast=True)
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)                   # signed order == float order
    # order << 32 | (2^32 - 1 - j), written with small int64 literals only (2^32 - 1 would be typed uint32).
    keys = ((order.to(tl.int64) + 1) << 32) - 1 - tl.where(in_buffer, j, 0)
    tl.store(KEYS + rows[:, None] * width + j, keys, mask=in_buffer)


def contiguous_ranges(candidates: IndexSet):
    """``(first, visible, table, shift)`` if row t's candidates are ``map(first[t] + j), j < visible[t]`` in
    increasing j with ``map(e) = (table[e] if table is not None else e) + shift``; ``None`` for other sets."""
    T = candidates.total_rows
    base, row_offset, table, shift = candidates, 0, None, 0
    if isinstance(candidates, Rows):
        base, row_offset, table, shift = candidates.base, candidates.row_offset, candidates.table, candidates.shift
    if not isinstance(base, VisibleCompressed):
        return None
    lay = base.layout
    first = lay.row_first_entry[row_offset:row_offset + T]
    visible = lay.row_visible[row_offset:row_offset + T]
    if first.shape[0] != T:
        return None
    if base.offset:
        first = first + base.offset
    return first.contiguous(), visible.contiguous(), table, int(shift)


def _score_keys(q, k, w, first, visible, table, shift: int, width: int, config: dict) -> torch.Tensor:
    """(rows, width) int64 sort keys of the query rows in ``q`` (see the module docstring)."""
    rows_c, H, Di = q.shape
    keys = torch.empty(rows_c, width, dtype=torch.int64, device=q.device)
    if rows_c == 0:
        return keys
    cfg = dict(config)
    launch = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
    block_t, block_e = cfg["BLOCK_T"], cfg["BLOCK_E"]
    # A block of rows spans at most width + BLOCK_T / 4 entries past its first row's first entry (module doc).
    grid = (triton.cdiv(2 * width + block_t, block_e), triton.cdiv(rows_c, block_t))
    mode = dot_mode(q.dtype)
    table_arg = table if table is not None else first                     # any pointer; unused without a table
    while True:
        try:
            _indexer_keys_kernel[grid](
                q, k, w, first, visible, table_arg, keys, rows_c, H, Di, width, shift,
                BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_D=max(16, triton.next_power_of_2(Di)),
                HAS_TABLE=table is not None, DOT_MODE=mode, **launch)
            return keys
        except OutOfResources:   # shared memory of this GPU (e.g. fp32 tiles): fewer stages, then fewer entries
            if launch["num_stages"] > 1:
                launch["num_stages"] -= 1
            elif block_e > 16:
                block_e //= 2
                grid = (triton.cdiv(2 * width + block_t, block_e), grid[1])
            else:
                raise


def _select(keys: torch.Tensor, first: torch.Tensor, table, shift: int, topk: int) -> torch.Tensor:
    """Best ``topk`` keys per row -> int32 key rows, -1 for empty slots."""
    best = torch.topk(keys, topk, dim=1, largest=True, sorted=True).values
    j = LOW_MASK - (best & LOW_MASK)
    found = (best >> 32) != NEG_INF_ORDER
    entry = first[:, None] + j
    if table is not None:
        entry = table[torch.where(found, entry, torch.zeros_like(entry))]
    return torch.where(found, entry + shift, torch.full_like(entry, -1)).to(torch.int32)


@torch.library.custom_op("dsv4attn::indexer_topk_ranges", mutates_args=())
def indexer_topk_ranges_op(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, first: torch.Tensor,
                           visible: torch.Tensor, table: Optional[torch.Tensor], shift: int, width: int, topk: int,
                           tiles: list[int], budget: int) -> torch.Tensor:
    """Top-k over per-row contiguous candidate ranges (the output of :func:`contiguous_ranges`).

    Args:
        q: (T, Hi, Di) fp16/bf16/fp32; k: (Nk, Di) fp16/bf16/fp32 (a dtype differing from ``q``'s widens both to
            fp32); weights: (T, Hi), read in fp32.
        first, visible: (T,) int row t's candidates are layout entries ``first[t] + j`` for ``j < visible[t]``.
        table: optional (entries,) int map from layout entries to rows of ``k``; shift: added after the map.
        width: the widest row's candidate count (a host int: the buffer width; ``visible <= width``).
        topk: k > 0. tiles: the config's values in :data:`TILE_KEYS` order; budget: int64 keys per query chunk.
    Returns:
        (T, min(topk, width)) int32 rows of ``k``, best first, ties to the lower entry, -1 = empty.
    """
    T = q.shape[0]
    out_width = min(topk, width)
    out = torch.full((T, out_width), -1, dtype=torch.int32, device=q.device)
    if out_width == 0 or T == 0:
        return out
    if q.dtype != k.dtype:       # the reference multiplies in fp32 then: both widen exactly
        q, k = q.float(), k.float()
    q, k, w = q.contiguous(), k.contiguous(), weights.float().contiguous()
    first, visible = first.contiguous(), visible.contiguous()
    table = None if table is None else table.contiguous()
    config = dict(zip(TILE_KEYS, tiles))
    with backend.exact_math(q.device):
        for s, e in chunk_rows(T, width, budget=budget):
            keys = _score_keys(q[s:e], k, w[s:e], first[s:e], visible[s:e], table, shift, width, config)
            out[s:e] = _select(keys, first[s:e], table, shift, out_width)
    return out


@indexer_topk_ranges_op.register_fake
def _indexer_topk_ranges_fake(q, k, weights, first, visible, table, shift, width, topk, tiles, budget):
    return q.new_empty((q.shape[0], min(topk, width)), dtype=torch.int32)


def indexer_topk_triton(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, candidates: IndexSet,
                        topk: int, config: dict | None = None, budget: int | None = None) -> torch.Tensor:
    """Triton implementation behind :func:`dsv4attn.ops.indexer_topk` (arguments already checked).

    Args:
        q: (T, Hi, Di) indexer queries, fp16/bf16/fp32.
        k: (Nc, Di) indexer keys (fp16/bf16/fp32; cast to fp32 with ``q`` if the dtypes differ).
        weights: (T, Hi) per-head weights (read in fp32).
        candidates: an :class:`IndexSet`; :class:`VisibleCompressed`, a :class:`Rows` view of one, or a
            :class:`Stack` of those runs the kernel (the registered op, once per part), anything else the reference.
        topk: k > 0.
        config: tile configuration (default :data:`CONFIG`); budget: int64 keys per chunk (default
            :data:`KEY_BUDGET`).
    Returns:
        (T, min(topk, candidates.width)) int32 rows of ``k``, best first, ties to the lower index, -1 = empty.

    float64 inputs **fall back to the reference** (no fp64 kernel), as do index sets without contiguous ranges.
    """
    if isinstance(candidates, Stack):     # e.g. the two chunks of a head-tail context-parallel rank: one by one
        out = torch.full((q.shape[0], min(topk, candidates.width)), -1, dtype=torch.int32, device=q.device)
        start = 0
        for part in candidates.parts:
            end = start + part.total_rows
            chosen = indexer_topk_triton(q[start:end], k, weights[start:end], part, topk, config, budget)
            out[start:end, :chosen.shape[1]] = chosen
            start = end
        return out
    ranges = contiguous_ranges(candidates)
    if ranges is None or torch.float64 in (q.dtype, k.dtype, weights.dtype) or q.dtype not in KERNEL_DTYPES:
        return indexer_topk_reference(q, k, weights, candidates, topk)
    first, visible, table, shift = ranges
    config = dict(CONFIG, **(config or {}))
    return indexer_topk_ranges_op(q, k, weights, first, visible, table, shift, candidates.width, topk,
                                  [int(config[key]) for key in TILE_KEYS], budget or KEY_BUDGET)


backend.register_kernel("indexer_topk", indexer_topk_triton)

__all__ = ["indexer_topk_triton", "indexer_topk_ranges_op", "contiguous_ranges", "TILE_KEYS"]

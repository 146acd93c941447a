"""Triton lightning-indexer scores + deterministic top-k (docs/semantics.md, decision 6) over contiguous
candidate ranges.

Same contract as :func:`.reference.indexer_topk_reference`. The fast path covers the candidate sets the layers
use, where query row t sees the contiguous range of layout entries ``[first[t], first[t] + visible[t])``:
:class:`VisibleCompressed` and a :class:`Rows` view of one (how the layer and context parallelism address it;
an optional ``table`` maps layout entries to key rows, ``shift`` is added after). Any other index set, float64
inputs and empty outputs go to the reference.

Two kernels per chunk of query rows (the chunk bounds the working set to ``chunk x (width + 4 KP)`` int32 words, so
memory is O(T * topk + chunk), not O(T^2)):

1. ``_indexer_orders_kernel``: one program per (block of ``BLOCK_T`` query rows, block of ``BLOCK_E`` layout
   entries). Entries are counted from the first entry of the block's first row, so a block whose rows all belong
   to one document (the common case) loads one shared key tile and every head is one ``tl.dot``; a block that
   straddles documents uses the same tile, masked per row (it spans at most ``width + BLOCK_T / 4`` entries, so
   the grid covers ``2 * width + BLOCK_T`` entries). For each index head h it adds ``w[t, h] * relu(q_h . k)`` to
   a fp32 accumulator, then writes, in row-relative coordinates ``j = entry - first[t] < visible[t]``, the int32
   ``order(score)``: the fp32 bits mapped to an int32 with the same order. Columns ``j >= visible[t]`` are not
   written (the select kernel never reads them). On SM90, for bf16/fp16 and the Flash indexer geometry, the
   warp-specialised Gluon kernel of :mod:`.gluon_hopper` writes the same orders (config ``KERNEL``).
2. ``_topk_select_kernel``: streams over each query row's ``visible[t]`` orders in tiles of ``TILE`` columns (one
   row per program when rows are long; several, as (rows, TILE) tiles, when they are short). The best K of a row are
   the K largest sort keys ``order << 32 | (2^32 - 1 - j)`` (distinct in a row: larger = higher score, and among
   equal scores the lower j), so the result is unique and equals the reference's stable descending sort. KP is K
   rounded up to a power of two (at least 2); ``TILE >= 2 KP``.

   A program whose rows hold at most 2 KP orders each (short documents, a document's early rows) skips a and c:
   every order fits the scratch, so step b takes them all (tau = the least int32).
   a. One pass: the column maxima of the row's tiles (TILE of them). Each is an element of the row, so at least K
      elements are >= tau, the K-th largest column maximum (by halving [least int32, max] on counts, at most 32
      steps): the best K are among them. For random scores about 1.4 K elements are >= tau (TILE = 2 KP; a short
      row is its own column maxima, so tau is exact there).
   b. One pass: the keys of the elements >= tau, in j order, into a per-row scratch of 2 KP slots.
   c. Only for rows with more than 2 KP elements >= tau (many equal scores, or an adversarial row): the exact K-th
      largest order v by a 16-way search on counts over ``[tau, max]`` (one pass per step, at most 8; none when
      every element >= tau is equal), then the scratch is refilled with the elements > v (fewer than K) and the
      first K equal to v in j order: the best K are among them.
   d. Where a row of the program kept more than KP keys: the exact K-th largest order among each row's keys
      (halving on counts again), and the best K (the orders above it, then the first equal to it in j order)
      moved to the scratch's front. Then each row's <= KP keys sorted descending by a bitonic network of KP;
      decode j, map ``first[t] + j`` through ``table``, add ``shift``; slots past the row's candidates, or of
      score -inf, become -1.

   The selection runs on counts and the one sort left is a bitonic network written here, the one ``tl.sort``
   builds, with the compare-exchange's "keep the larger" predicate formed as int1 (Triton 3.6 / 3.7's own network
   compares it as int32, a select and a compare more per element; 3.9's has the cast). Counting in place of the
   networks that found tau and took the best KP of 2 KP: the select pass 1.46x at 32K in one document, 1.42x in
   packs of 8 x 4096, 1.38x at 8K (H100, Triton 3.6.0, BENCHMARKS.md). Launches whose rows hold at most
   ``SELECT_SHORT_WIDTH`` candidates (and k <= 512) run one warp a program, so no exchange of the network crosses
   warps (1.09-1.24x at 1024-2048 candidates a row with the networks; at 8192 one warp was slower, 0.92x: the
   passes over the orders need the warps).

   (A 4-pass radix select with ``tl.histogram`` was not faster than ``torch.topk`` on an H200: the leading digit
   is the same for most scores, so the histogram's shared-memory atomics serialise; see BENCHMARKS.md.)

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
from ... import backend, variants
from ..gluon_common import sm90
from ..triton_common import dot, dot_mode, interpreting, launch_fitting
from ..index_sets import IndexSet, Stack, chunk_rows, contiguous_ranges
from .reference import indexer_topk_reference
from . import gluon_hopper as gluon_scores

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Score kernel: BLOCK_T query rows x BLOCK_E entries per program. Select kernel: at most SELECT_TILE columns per tile,
# (rows x columns) tiles of SELECT_BLOCK elements (several rows per program when rows are short), SELECT_WARPS, or
# one warp where the widest row of a launch has at most SELECT_SHORT_WIDTH candidates (0: never) and k <= 512.
# Benchmarks may pass another config.
CONFIG = dict(BLOCK_T=64, BLOCK_E=128, num_warps=8, num_stages=3, SELECT_TILE=1024, SELECT_BLOCK=1024,
              SELECT_WARPS=4, SELECT_SHORT_WIDTH=2048, KERNEL="auto")
# KERNEL: the score kernel, "auto" (:mod:`dsv4attn.variants`: the Gluon score kernel of :mod:`.gluon_hopper` on SM90
# where it applies, else the Triton one), "gluon" or "triton"; passed to the custom op as its variants.MODES index.
# The order in which the op's ``tiles`` argument lists a config (a custom op's schema takes no dicts).
TILE_KEYS = ("BLOCK_T", "BLOCK_E", "num_warps", "num_stages", "SELECT_TILE", "SELECT_BLOCK", "SELECT_WARPS",
             "SELECT_SHORT_WIDTH", "KERNEL")
# int32 words of one chunk's buffers (the orders, and the select kernel's int64 scratch): 2^27 words = 512 MiB.
ORDER_BUDGET = 1 << 27
INT32_MIN = tl.constexpr(-2**31)
INT64_MIN = tl.constexpr(-2**63)
NEG_INF_ORDER = tl.constexpr(-2139095041)      # order(-inf): 0xFF800000 with the low 31 bits flipped, as int32


@triton.jit
def _indexer_orders_kernel(
    Q, K, W, FIRST, VISIBLE, TABLE, ORDERS,
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
            acc += w_h[:, None] * tl.where(s < 0, 0.0, s)        # ReLU that keeps a NaN (maximum drops it)

    # acc starts at +0.0 and x + (-0.0) or x - x never gives -0.0, so a zero score is +0.0: equal scores have
    # equal bits, as the order map needs (the reference compares floats, where -0.0 == +0.0).
    bits = acc.to(tl.int32, bitcast=True)
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)                   # signed order == float order
    # Every NaN (either sign) ranks above +inf, as in the reference's sort: a NaN score is selected and propagates.
    order = tl.where(acc != acc, 0x7FFFFFFF, order)
    tl.store(ORDERS + rows[:, None] * width + j, order, mask=valid)


# The select kernel works on ROWS query rows at once, as (ROWS, TILE) tiles: ``row`` is a (ROWS, 1) tensor of
# pointers to their orders, ``n`` (ROWS,) their lengths (0 for rows to skip), and loops run to the longest.
@triton.jit
def _column_max(row, n, TILE: tl.constexpr):
    """(ROWS, TILE): elementwise max of each row's tiles of TILE orders; INT32_MIN in columns a row lacks."""
    offs = tl.arange(0, TILE)[None, :]
    best = tl.full([n.shape[0], TILE], INT32_MIN, tl.int32)
    for start in range(0, tl.max(n, 0), TILE):
        best = tl.maximum(best, tl.load(row + start + offs, mask=start + offs < n[:, None], other=INT32_MIN))
    return best


@triton.constexpr_function
def _log2_exact(n):
    """log2 of a power of two, at compile time."""
    return int(n).bit_length() - 1


@triton.jit
def _axis_bit(cube, a: tl.constexpr):
    """0/1 along innermost axis ``a`` of the hypercube ``cube`` (bit ``a`` of an element's position in its row),
    shaped to broadcast against it."""
    dims: tl.constexpr = len(cube.shape)
    return tl.reshape(tl.arange(0, 2), [1] * (dims - 1 - a) + [2] + [1] * a)


@triton.jit
def _exchange(cube, descending, a: tl.constexpr):
    """One compare-exchange step of a bitonic network on the integer hypercube ``cube``: each element meets its
    partner across innermost axis ``a`` (the xor of the pair, reduced along that axis, recovers the partner from
    either side); the pair's lower position keeps the larger where ``descending`` (0/1, broadcast) is 1. The
    keep-the-larger predicate is formed as int1 before the compare: as an int32 comparison against the compare's
    result, Triton 3.6 / 3.7 lower it to a select and a compare more per element (Triton 3.9's own network has the
    cast)."""
    dims: tl.constexpr = len(cube.shape)
    partner = cube ^ tl.xor_sum(cube, dims - 1 - a, keep_dims=True)
    keep_larger = (descending ^ _axis_bit(cube, a)).to(tl.int1)
    return tl.where((partner > cube) == keep_larger, partner, cube)


@triton.jit
def _bitonic_merge(cube, width_log2: tl.constexpr, last: tl.constexpr):
    """Sort each bitonic run of 2^width_log2 innermost elements: descending if ``last``, else runs alternate in
    direction (bit width_log2 of the position picks it), so neighbouring runs form the next stage's bitonic run."""
    if last:
        descending = 1
    else:
        descending = _axis_bit(cube, width_log2)
    for i in tl.static_range(width_log2):
        cube = _exchange(cube, descending, width_log2 - 1 - i)
    return cube


@triton.jit
def _sorted_descending(x):
    """Each row of the (R, N) integer ``x`` (R, N powers of two) sorted in descending order, by a bitonic network."""
    n_log2: tl.constexpr = _log2_exact(x.shape[1])
    cube = tl.reshape(x, [2] * _log2_exact(x.numel))
    for s in tl.static_range(1, n_log2 + 1):
        cube = _bitonic_merge(cube, s, s == n_log2)
    return tl.reshape(cube, x.shape)


@triton.jit
def _kth_largest(x, valid, K):
    """(ROWS,): the K-th largest of each row's ``valid`` elements of the int32 ``x`` (INT32_MIN where a row has fewer
    than K), by halving [INT32_MIN, max] on counts: at most 32 steps of one compare and one add an element. (It
    replaced a bitonic network, ~55 exchange steps over the same elements: BENCHMARKS.md, thirty-eighth session.)"""
    lo = tl.full([x.shape[0]], INT32_MIN, tl.int64)   # invariant: count(>= lo) >= K > count(>= hi), or lo = INT32_MIN
    hi = tl.max(tl.where(valid, x, INT32_MIN), 1).to(tl.int64) + 1
    while tl.max(hi - lo, 0) > 1:
        mid = lo + ((hi - lo) >> 1)                   # < hi <= INT32_MAX + 1: exact as int32
        enough = tl.sum((valid & (x >= mid.to(tl.int32)[:, None])).to(tl.int32), 1) >= K
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    return lo.to(tl.int32)


@triton.jit
def _descending(keys, BY_RANK: tl.constexpr):
    """Each row of the int64 ``keys`` sorted in descending order. Keys must be distinct in a row, except INT64_MIN
    padding. BY_RANK (the CPU interpreter): each key placed by its rank, a count of pairwise comparisons."""
    if BY_RANK:
        above = tl.sum((keys[:, None, :] > keys[:, :, None]).to(tl.int32), 2)  # the rank of keys[r, i]
        slots = tl.arange(0, keys.shape[1])[None, :, None]
        return tl.max(tl.where(above[:, None, :] == slots, keys[:, None, :], INT64_MIN), 2)
    else:
        return _sorted_descending(keys)


@triton.jit
def _count_at_least(row, n, probes, TILE: tl.constexpr):
    """(ROWS, P): how many of each row's orders are >= ``probes[r, p]`` ((ROWS, P) int32)."""
    offs = tl.arange(0, TILE)[None, :]
    counts = tl.zeros(probes.shape, tl.int32)
    for start in range(0, tl.max(n, 0), TILE):
        ok = start + offs < n[:, None]
        x = tl.load(row + start + offs, mask=ok, other=INT32_MIN)
        counts += tl.sum(((x[:, :, None] >= probes[:, None, :]) & ok[:, :, None]).to(tl.int32), 1)
    return counts


@triton.jit
def _kth_order(row, n, lo, top, K, TILE: tl.constexpr):
    """(ROWS,): the K-th largest order of each row, given count(>= lo) >= K and the row maximum ``top`` (rows with
    n = 0 stop at once, with a meaningless result). A 16-way search on counts: each pass over the rows divides
    ``hi - lo`` by 16."""
    lo = lo.to(tl.int64)
    hi = top.to(tl.int64) + 1                 # invariant: count(>= lo) >= K > count(>= hi)
    steps = tl.arange(0, 16).to(tl.int64)[None, :]
    while tl.max(hi - lo, 0) > 1:
        probes = lo[:, None] + (((hi - lo)[:, None] * steps) >> 4)   # probes[:, 0] = lo; probes[:, 8] inside
        enough = _count_at_least(row, n, probes.to(tl.int32), TILE) >= K
        hi = tl.min(tl.where(enough, hi[:, None], probes), 1)
        lo = tl.max(tl.where(enough, probes, lo[:, None]), 1)
    return lo.to(tl.int32)


@triton.jit
def _compact(row, n, threshold, ties, scratch, CAP: tl.constexpr, TILE: tl.constexpr, ALL_TIES: tl.constexpr):
    """Write the sort keys of each row's orders > threshold, and of its first ``ties`` (all of them if ALL_TIES)
    == threshold in j order, to ``scratch[r, 0:CAP]`` in j order. Returns (ROWS,) how many were taken: those past
    CAP are counted, not written."""
    offs = tl.arange(0, TILE)[None, :]
    taken = tl.zeros_like(n)
    seen = tl.zeros_like(n)                                     # elements == threshold in earlier tiles
    for start in range(0, tl.max(n, 0), TILE):
        j = start + offs
        ok = j < n[:, None]
        x = tl.load(row + j, mask=ok, other=INT32_MIN)
        equal = ok & (x == threshold[:, None])
        take = ok & (x > threshold[:, None])
        if ALL_TIES:
            take = take | equal
        else:
            rank = seen[:, None] + tl.cumsum(equal.to(tl.int32), 1)
            take = take | (equal & (rank <= ties))
            seen += tl.sum(equal.to(tl.int32), 1)
        pos = taken[:, None] + tl.cumsum(take.to(tl.int32), 1) - 1
        # order << 32 | (2^32 - 1 - j), written with small int64 literals only (2^32 - 1 would be typed uint32).
        keys = ((x.to(tl.int64) + 1) << 32) - 1 - j
        tl.store(scratch + pos, keys, mask=take & (pos < CAP))
        taken += tl.sum(take.to(tl.int32), 1)
    return taken


@triton.jit
def _write_rows(scratch, taken, first, TABLE, out, scores, live, shift, K, KP: tl.constexpr, HAS_TABLE: tl.constexpr,
                BY_RANK: tl.constexpr):
    """Store the best K of each row's ``taken`` (>= min(K, row length), <= 2 KP) scratch keys to ``out[r, 0:K]``
    (rows where ``live``) as key rows, -1 where empty, and their scores (fp32, decoded from the orders: the exact
    values the score kernel formed) to ``scores[r, 0:K]``, -inf where empty. Where a row of the program has more than
    KP keys, every row's best K are first moved to its scratch's front (rows at most K long keep their keys)."""
    # .cg reads L2, where the other threads' scratch stores are (the caller's barrier orders them before this).
    if tl.max(taken, 0) > KP:
        # The best K of a row's <= 2 KP keys to the scratch's front, in j order: the keys of orders above the K-th
        # largest order v, then the first (lowest j: the scratch is in j order) of those equal to v. Then one sort
        # of KP keys, where the best KP of 2 KP took a network of about twice the exchanges.
        slots = tl.arange(0, 2 * KP)[None, :]
        real = slots < taken[:, None]
        keys = tl.load(scratch + slots, mask=real, other=INT64_MIN, cache_modifier=".cg")
        order = (keys >> 32).to(tl.int32)
        v = _kth_largest(order, real, K)
        above = real & (order > v[:, None])
        equal = real & (order == v[:, None])
        need = K - tl.sum(above.to(tl.int32), 1)
        take = above | (equal & (tl.cumsum(equal.to(tl.int32), 1) <= need[:, None]))
        pos = tl.cumsum(take.to(tl.int32), 1) - 1
        tl.debug_barrier()                     # every thread's loads of the scratch before its rewrite
        tl.store(scratch + pos, keys, mask=take)
        tl.debug_barrier()
        taken = tl.minimum(taken, K)
    # At most KP keys a row now (K <= KP).
    few = tl.arange(0, KP)[None, :]
    best = _descending(tl.load(scratch + few, mask=few < taken[:, None], other=INT64_MIN, cache_modifier=".cg"),
                       BY_RANK)
    order = best >> 32
    j = ((order + 1) << 32) - 1 - best
    rank = tl.arange(0, KP)[None, :]
    found = (rank < taken[:, None]) & (order != NEG_INF_ORDER)
    entry = first[:, None] + j
    if HAS_TABLE:
        entry = tl.load(TABLE + entry, mask=found, other=0)
    tl.store(out + rank, tl.where(found, entry + shift, -1).to(tl.int32), mask=(rank < K) & live[:, None])
    bits = tl.where(order >= 0, order, order ^ 0x7FFFFFFF).to(tl.int32)      # the order's inverse
    score = tl.where(found, bits.to(tl.float32, bitcast=True), float("-inf"))
    tl.store(scores + rank, score, mask=(rank < K) & live[:, None])


@triton.jit
def _topk_select_kernel(ORDERS, FIRST, VISIBLE, TABLE, SCRATCH, OUT, SCORES, rows_c, width, shift, K,
                        KP: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr, HAS_TABLE: tl.constexpr,
                        BY_RANK: tl.constexpr):
    # ROWS query rows per program; the steps a-d of the module docstring. BY_RANK (the CPU interpreter, where a
    # bitonic network costs a fraction of a second per call) orders by pairwise comparison counts, not a network.
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = t < rows_c
    n = tl.load(VISIBLE + t, mask=live, other=0).to(tl.int32)
    row = ORDERS + t[:, None] * width
    scratch = SCRATCH + t[:, None] * (2 * KP)
    if tl.max(n, 0) <= 2 * KP:
        # Every row's orders fit the scratch (rows of short documents, early rows): all of them are candidates, so
        # neither the column maxima nor tau's search is needed (and no refill follows).
        tau = tl.full(n.shape, INT32_MIN, tl.int32)
    else:
        maxima = _column_max(row, n, TILE)
        tau = _kth_largest(maxima, maxima == maxima, K)     # every column counts, INT32_MIN fill too
    taken = _compact(row, n, tau, 0, scratch, 2 * KP, TILE, True)
    refill = taken > 2 * KP
    if tl.max(refill.to(tl.int32), 0) > 0:
        tl.debug_barrier()                     # the first pass's scratch stores before the refill's
        n_refill = tl.where(refill, n, 0)
        # Fewer than K orders are > v, so these are at most 2 K - 1 <= 2 KP keys, the best K among them. (The row
        # maxima come from one more pass over the refilled rows: rare rows, so the common path keeps no column
        # maxima past tau.)
        top = tl.max(_column_max(row, n_refill, TILE), 1)
        v = _kth_order(row, n_refill, tau, top, K, TILE)
        taken = tl.where(refill, _compact(row, n_refill, v, K, scratch, 2 * KP, TILE, False), taken)
    tl.debug_barrier()                         # every thread's scratch stores before the loads of _write_rows
    first = tl.load(FIRST + t, mask=live, other=0)
    _write_rows(scratch, taken, first, TABLE, OUT + t[:, None] * K, SCORES + t[:, None] * K, live, shift, K, KP,
                HAS_TABLE, BY_RANK)


def _score_orders(q, k, w, first, visible, table, shift: int, width: int, config: dict,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, width) int32 score orders of the query rows in ``q``, written where ``j < visible`` (module doc), into
    ``out`` if given."""
    rows_c, H, Di = q.shape
    orders = out if out is not None else torch.empty(rows_c, width, dtype=torch.int32, device=q.device)
    if rows_c == 0:
        return orders
    if _use_gluon_scores(q, k, config):
        try:
            gluon_scores.launch_orders(q, k, w, first, visible, table, shift, width, orders)
            return orders
        except Exception as exc:
            if variants.strict(config.get("KERNEL")):      # "gluon" asked for: raise
                raise
            variants.note_gluon_build_failure(exc, "indexer_topk", "scores", (q.shape[2], q.dtype),
                                              "using the Triton kernel")
    block_t = config["BLOCK_T"]
    mode = dot_mode(q.dtype)
    table_arg = table if table is not None else first                     # any pointer; unused without a table

    def launch(fit):
        num_stages, block_e = fit
        # A block of rows spans at most width + BLOCK_T / 4 entries past its first row's first entry (module doc).
        grid = (triton.cdiv(2 * width + block_t, block_e), triton.cdiv(rows_c, block_t))
        _indexer_orders_kernel[grid](
            q, k, w, first, visible, table_arg, orders, rows_c, H, Di, width, shift,
            BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_D=max(16, triton.next_power_of_2(Di)),
            HAS_TABLE=table is not None, DOT_MODE=mode, num_warps=config["num_warps"], num_stages=num_stages)

    def smaller(fit):   # shared memory of this GPU (e.g. fp32 tiles): fewer stages, then fewer entries
        num_stages, block_e = fit
        if num_stages > 1:
            return num_stages - 1, block_e
        return (num_stages, block_e // 2) if block_e > 16 else None

    launch_fitting(launch, (config["num_stages"], config["BLOCK_E"]), smaller)
    return orders


def _use_gluon_scores(q, k, config: dict) -> bool:
    """The Gluon score kernel (:mod:`.gluon_hopper`) as :mod:`dsv4attn.variants` chooses under ``config["KERNEL"]``:
    "auto" where it applies and has not failed to build (``DSV4ATTN_KERNELS=triton`` keeps it out), always under
    "gluon" (raising where it cannot run), never under "triton"."""
    return variants.choose("indexer_topk", "scores", (q.shape[2], q.dtype), q, k,
                           request=config.get("KERNEL", "auto")) == "gluon"


def _select_width(topk: int) -> int:
    """KP of the select kernel: topk rounded up to a power of two, at least 2 (the network's smallest run is a
    pair)."""
    return max(2, triton.next_power_of_2(topk))


# The largest KP for which a select program may be one warp: its 2 KP int64 keys then sit in 32 threads' registers
# (KP 512: 255 registers; at KP 1024 ptxas spills ~1-2 KB a thread on Triton 3.9.0, offline).
ONE_WARP_MAX_KP = 512


def _select_warps(width: int, kp: int, config: dict) -> int:
    """Warps of a select program: one where no row of the launch has more than ``SELECT_SHORT_WIDTH`` candidates
    and KP <= ONE_WARP_MAX_KP (the network's exchanges then stay in a warp: measured faster up to 2048 at k = 512,
    slower at 8192, where the passes over the orders need more warps), else ``SELECT_WARPS``."""
    short = width <= config.get("SELECT_SHORT_WIDTH", 0) and kp <= ONE_WARP_MAX_KP
    return 1 if short else config["SELECT_WARPS"]


def query_chunks(T: int, width: int, topk: int, budget: int):
    """The (start, end) query chunks of :func:`indexer_topk_ranges_op`: per row, ``width`` int32 orders and the
    select kernel's ``2 KP`` int64 scratch keys, ``budget`` int32 words per chunk."""
    return chunk_rows(T, width + 4 * _select_width(topk), budget=budget)


def _select(orders, first, visible, table, shift: int, out: torch.Tensor, scores: torch.Tensor, config: dict,
            by_rank: bool | None = None) -> None:
    """Write the best ``out.shape[1]`` candidates of each row of ``orders`` to ``out`` as int32 key rows, best first,
    ties to the lower j, -1 for empty slots (module doc, step 2), and their fp32 scores to ``scores`` (-inf where
    empty). ``by_rank``: order by pairwise counts instead of the bitonic network (default: under the CPU
    interpreter only; quadratic in KP)."""
    rows_c, width = orders.shape
    topk = out.shape[1]
    select_tile = config["SELECT_TILE"]
    if select_tile < 1 or select_tile & (select_tile - 1):
        raise ValueError(f"indexer top-k config: SELECT_TILE must be a power of two, got {select_tile}")
    kp = _select_width(topk)
    # Tiles of at most SELECT_TILE columns (at least 2 KP: tau needs K columns), SELECT_BLOCK elements per program.
    tile = max(min(config["SELECT_TILE"], triton.next_power_of_2(width)), 2 * kp)
    rows = max(1, triton.next_power_of_2(config["SELECT_BLOCK"]) // tile)
    scratch = torch.empty(rows_c, 2 * kp, dtype=torch.int64, device=orders.device)
    _topk_select_kernel[(triton.cdiv(rows_c, rows),)](
        orders, first, visible, table if table is not None else first, scratch, out, scores, rows_c, width, shift,
        topk,
        KP=kp, TILE=tile, ROWS=rows, HAS_TABLE=table is not None,
        BY_RANK=interpreting() if by_rank is None else by_rank, num_warps=_select_warps(width, kp, config))


@torch.library.custom_op("dsv4attn::indexer_topk_ranges", mutates_args=())
def indexer_topk_ranges_op(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, first: torch.Tensor,
                           visible: torch.Tensor, table: Optional[torch.Tensor], shift: int, width: int, topk: int,
                           tiles: list[int], budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over per-row contiguous candidate ranges (the output of :func:`contiguous_ranges`).

    Args:
        q: (T, Hi, Di) fp16/bf16/fp32; k: (Nk, Di) fp16/bf16/fp32 (a dtype differing from ``q``'s widens both to
            fp32); weights: (T, Hi), read in fp32.
        first, visible: (T,) int row t's candidates are layout entries ``first[t] + j`` for ``j < visible[t]``.
        table: optional (entries,) int map from layout entries to rows of ``k``; shift: added after the map.
        width: the widest row's candidate count (a host int: the buffer width; ``visible <= width``).
        topk: k > 0. tiles: the config's values in :data:`TILE_KEYS` order; budget: int32 words per query chunk
            (:func:`query_chunks`).
    Returns:
        (T, min(topk, width)) int32 rows of ``k``, best first, ties to the lower entry, -1 = empty; and their
        scores, (T, min(topk, width)) fp32, -inf at empty slots.
    """
    T = q.shape[0]
    out_width = min(topk, width)
    # Not filled: the select kernel writes every slot of every row (each chunk of rows is selected below).
    out = torch.empty((T, out_width), dtype=torch.int32, device=q.device)
    scores = torch.empty((T, out_width), dtype=torch.float32, device=q.device)
    if out_width == 0 or T == 0:
        return out, scores
    if q.dtype != k.dtype:       # the reference multiplies in fp32 then: both widen exactly
        q, k = q.float(), k.float()
    q, k, w = q.contiguous(), k.contiguous(), weights.float().contiguous()
    first, visible = first.contiguous(), visible.contiguous()
    table = None if table is None else table.contiguous()
    config = dict(zip(TILE_KEYS, tiles), KERNEL=variants.MODES[tiles[TILE_KEYS.index("KERNEL")]])
    with backend.exact_math(q.device):
        for s, e in query_chunks(T, width, out_width, budget):
            orders = _score_orders(q[s:e], k, w[s:e], first[s:e], visible[s:e], table, shift, width, config)
            _select(orders, first[s:e], visible[s:e], table, shift, out[s:e], scores[s:e], config)
            del orders                         # freed before the next chunk's buffer is allocated
    return out, scores


@indexer_topk_ranges_op.register_fake
def _indexer_topk_ranges_fake(q, k, weights, first, visible, table, shift, width, topk, tiles, budget):
    shape = (q.shape[0], min(topk, width))
    return q.new_empty(shape, dtype=torch.int32), q.new_empty(shape, dtype=torch.float32)


def _tile_list(config: dict) -> list[int]:
    """The op's ``tiles`` argument: the config's values in TILE_KEYS order (KERNEL as its variants.MODES index)."""
    return [variants.mode_index(config[key]) if key == "KERNEL" else int(config[key]) for key in TILE_KEYS]


def indexer_topk_triton(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, candidates: IndexSet,
                        topk: int, config: dict | None = None, budget: int | None = None,
                        return_scores: bool = False):
    """Triton implementation behind :func:`dsv4attn.ops.indexer_topk` (arguments already checked).

    Args:
        q: (T, Hi, Di) indexer queries, fp16/bf16/fp32.
        k: (Nc, Di) indexer keys (fp16/bf16/fp32; cast to fp32 with ``q`` if the dtypes differ).
        weights: (T, Hi) per-head weights (read in fp32).
        candidates: an :class:`IndexSet`; :class:`VisibleCompressed`, a :class:`Rows` view of one, or a
            :class:`Stack` of those runs the kernel (the registered op, once per part), anything else the reference.
        topk: k > 0.
        config: tile configuration (default :data:`CONFIG`); budget: int32 words per query chunk (default
            :data:`ORDER_BUDGET`).
    Returns:
        (T, min(topk, candidates.width)) int32 rows of ``k``, best first, ties to the lower index, -1 = empty;
        with ``return_scores`` also their scores (the fp32 values the kernel ranked; -inf at empty slots).

    float64 inputs **fall back to the reference** (no fp64 kernel), as do index sets without contiguous ranges.
    """
    if isinstance(candidates, Stack):     # e.g. the two chunks of a head-tail context-parallel rank: one by one
        width = min(topk, candidates.width)
        out = torch.full((q.shape[0], width), -1, dtype=torch.int32, device=q.device)
        scores = torch.full((q.shape[0], width), float("-inf"), device=q.device,
                            dtype=torch.promote_types(q.dtype, torch.float32))   # fp64 parts take the reference
        start = 0
        for part in candidates.parts:
            end = start + part.total_rows
            chosen, chosen_scores = indexer_topk_triton(q[start:end], k, weights[start:end], part, topk, config,
                                                        budget, return_scores=True)
            out[start:end, :chosen.shape[1]] = chosen
            scores[start:end, :chosen.shape[1]] = chosen_scores
            start = end
        return (out, scores) if return_scores else out
    ranges = contiguous_ranges(candidates)
    if ranges is None or torch.float64 in (q.dtype, k.dtype, weights.dtype) or q.dtype not in KERNEL_DTYPES:
        return indexer_topk_reference(q, k, weights, candidates, topk, return_scores=return_scores)
    first, visible, table, shift = ranges
    config = dict(CONFIG, **(config or {}))
    out, scores = indexer_topk_ranges_op(q, k, weights, first, visible, table, shift, candidates.width, topk,
                                         _tile_list(config), budget or ORDER_BUDGET)
    return (out, scores) if return_scores else out


variants.register(
    "indexer_topk", "scores",
    variants.Variant("gluon", "indexer score kernel (_indexer_orders_gluon)", lambda q, k: gluon_scores.check(q, k),
                     sm90),
    variants.Variant("triton", "indexer score kernel (_indexer_orders_kernel)", variants.always, variants.always))
variants.register("indexer_topk", "select", variants.Variant("triton", "top-k select kernel (_topk_select_kernel)",
                                                             variants.always, variants.always))
backend.register_kernel("indexer_topk", indexer_topk_triton)

__all__ = ["indexer_topk_triton", "indexer_topk_ranges_op", "query_chunks", "TILE_KEYS"]

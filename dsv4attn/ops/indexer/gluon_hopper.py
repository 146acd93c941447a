"""Lightning-indexer score orders for Hopper (SM90) in Gluon: the first kernel of the Triton top-k, warp-specialised.

Contract (that of ``triton._indexer_orders_kernel``): ``q (rows, 64, 128)`` bf16/fp16, ``k (Nk, 128)`` in q's dtype,
``w (rows, 64)`` fp32, ``first``, ``visible (rows,)`` int, optional ``table`` and ``shift`` (row t's candidates are
layout entries ``first[t] + j``, ``j < visible[t]``, key row ``(table[e] if table else e) + shift``) -> writes
``orders[t, j]`` (int32, the signed order of the fp32 score ``sum_h w[t, h] * relu(q[t, h] . k[row])``, heads summed
in increasing order) for every ``j < visible[t]``; other columns are not written.

Layout: one program per (64 query rows, 384 layout entries), the grid of the Triton kernel (entries counted from
the block's first row's first entry). Before the split the program gathers its 384 key rows (cp.async), then:

- producer (one warp): streams the 64 heads' query tiles (64 rows x 128, a box of the (rows, 64 * 128) query
  matrix) through a ring of STAGES shared-memory stages, one TMA copy per tile (rows past the end read as zeros);
- consumer W (W = 0, 1, 2) owns entries [128 W, 128 W + 128): for every head, s = Q_h K_W^T (wgmma, M = 64 rows,
  N = 128 entries, K = 128), then acc += w[:, h] * relu(s) (fp32); the three consumers read each query stage, which
  is released when all three are done (count 3). Each consumer's product is synchronous: while one sums its tile,
  the other two keep the tensor cores busy (with two consumers, only one did: 1.18x at 32K, BENCHMARKS.md). Each
  consumer loads its rows' weight of head h from global memory before waiting for the head's query tile (the
  block's 16 KiB of weights stay in L1), so the load's latency hides behind the wait and the product. (Staging them
  in shared memory first, one head at a time, serialised 64 global loads with a barrier each in every program's
  prologue.)

Unlike the Triton kernel, which masks its key loads per needed column, this one gathers the key rows of every entry
from e0 below the block's largest ``first + visible``, gaps between documents included: ``table`` (if any) must be
defined there, as the layouts' lowering tables are (every entry below the capacity).

Why: the Triton kernel loads each head's query tile synchronously between its dots, so its tensor cores wait on
every load; here a producer keeps query tiles in flight (TMA copies, measured faster than a warpgroup of
cp.async: BENCHMARKS.md, seventh session) and the weights come from global memory (faster than staging them in
shared memory; BENCHMARKS.md, "Indexer scores").
Not done: issuing head h + 1's product before head h's ReLU-weight-sum (a second 64-register accumulator): ptxas
spilled it at 216-240 registers per consumer; a third consumer needs no second accumulator and fits in 160.
"""
from __future__ import annotations

import torch

from ..gluon_common import (IMPORTED, TensorDescriptor, async_copy, async_load, fence_async_shared, gl, gluon,
                            half_precision, mbarrier, mbarriers, sm90, thread_barrier, tma_load, warpgroup_mma)

# CONSUMERS wgmma warpgroups of 128 entries each (the partition list of _indexer_orders_gluon names all three).
CONSUMERS = 3
BLOCK_T, BLOCK_E, HEADS, HEAD_DIM = 64, 128 * CONSUMERS, 64, 128
# STAGES: query tiles in flight (16 KiB each; more than 4 measured no faster); REGS: registers per thread of the two
# worker consumers and of the producer warp: 3 x 128 x 160 + 128 x 24 of the SM's 65536 (the orders' column offsets
# are int32 from per-row pointers: as int64 they spilled at 160).
CONFIG = dict(STAGES=4, REGS=(160, 24))


def check(q: torch.Tensor, k: torch.Tensor) -> tuple[bool, str]:
    """(usable, reason) of :func:`launch_orders`: Gluon imported, SM90, bf16/fp16 q and k of one dtype, the Flash
    indexer geometry (64 heads of 128), 16-byte aligned bases (the TMA descriptor of q, 16-byte cp.async copies of
    k)."""
    for usable, reason in (sm90(q.device), half_precision(q, k)):
        if not usable:
            return usable, reason
    if tuple(q.shape[1:]) != (HEADS, HEAD_DIM):
        return False, f"needs {HEADS} index heads of {HEAD_DIM}, got {tuple(q.shape[1:])}"
    if q.data_ptr() % 16 or k.data_ptr() % 16:
        return False, "needs 16-byte aligned q and k"
    return True, ""


def available(q: torch.Tensor, k: torch.Tensor) -> bool:
    return check(q, k)[0]


if IMPORTED:
    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
    BLOCK_T_C = gl.constexpr(BLOCK_T)
    CONSUMER_E = gl.constexpr(128)              # entries per consumer
    CONSUMERS_C = gl.constexpr(CONSUMERS)
    BLOCK_E_C = gl.constexpr(BLOCK_E)
    HEADS_C = gl.constexpr(HEADS)
    HEAD_DIM_C = gl.constexpr(HEAD_DIM)

    @gluon.jit
    def _gather_keys(K, TABLE, shift, e0, needed, k_smem, HAS_TABLE: gl.constexpr):
        # cp.async of the key rows of layout entries e0 .. e0 + 384 (16 at a time) into k_smem (3 x 128 rows; not
        # waited for).
        # Entries no row of the block sees (from ``needed`` on) are not read (zeros; their scores are never stored).
        io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        cols = gl.arange(0, HEAD_DIM_C, layout=gl.SliceLayout(0, io))
        for r in gl.static_range(0, BLOCK_E_C, 16):
            offs = r + gl.arange(0, 16, layout=gl.SliceLayout(1, io)).to(gl.int64)
            ok = offs < needed
            e = gl.where(ok, e0 + offs, 0)
            if HAS_TABLE:
                e = gl.load(TABLE + e, mask=ok, other=0).to(gl.int64)
            key_rows = gl.where(ok, e + shift, 0) * HEAD_DIM_C
            dst = k_smem.index(r // CONSUMER_E).slice(r % CONSUMER_E, 16, dim=0)     # consumer r // 128's keys
            async_load(dst, K + key_rows[:, None] + cols[None, :], mask=ok[:, None])

    @gluon.jit
    def _score_producer(q_desc, tb, n_heads, ring, full, empty, STAGES: gl.constexpr):
        # The query tiles of the block's heads (n_heads: 64, or 0 for a block no row sees) through the ring, one TMA
        # copy per (64 rows x 128) tile; rows past the end read as zeros.
        for h in range(n_heads):
            stage = h % STAGES
            mbarrier.wait(empty.index(stage), ((h // STAGES) + 1) & 1, pred=h >= STAGES)
            mbarrier.expect(full.index(stage), q_desc.block_type.nbytes)
            tma_load(q_desc, [tb * BLOCK_T_C, h * HEAD_DIM_C], full.index(stage), ring.index(stage))

    @gluon.jit
    def _score_consumer(W_, FIRST, VISIBLE, ORDERS, rows_c, width, tb, e0, n_heads, k_all, ring, full, empty,
                        W: gl.constexpr, STAGES: gl.constexpr):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, CONSUMER_E, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        zero = gl.zeros([BLOCK_T_C, CONSUMER_E], gl.float32, layout=s_layout)
        acc = gl.zeros([BLOCK_T_C, CONSUMER_E], gl.float32, layout=s_layout)
        rows = (tb * BLOCK_T_C + gl.arange(0, BLOCK_T_C, layout=row_layout)).to(gl.int64)
        row_ok = rows < rows_c
        w_rows = W_ + rows * HEADS_C
        for h in range(n_heads):
            stage = h % STAGES
            w_h = gl.load(w_rows + h, mask=row_ok, other=0.0)
            # A head-dependent zero index on every shared-memory operand keeps the wgmma descriptors inside the
            # loop (see the attention forward: hoisted, they were spilled); n_heads is a runtime value, so it is
            # not folded to a constant.
            z = (h + 1) // (n_heads + 1)
            mbarrier.wait(full.index(stage), (h // STAGES) & 1)
            fence_async_shared()
            k_t = k_all.index(W + z).permute((1, 0))     # (128 dims, 128 entries)
            s = warpgroup_mma(ring.index(stage + z), k_t, zero, use_acc=False)
            mbarrier.arrive(empty.index(stage))
            acc += w_h[:, None] * gl.where(s < 0, 0.0, s)        # ReLU that keeps a NaN (maximum drops it)
        # acc starts at +0.0 and the sums never give -0.0: equal scores have equal bits (see the Triton kernel).
        bits = acc.to(gl.int32, bitcast=True)
        order = gl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        order = gl.where(acc != acc, 0x7FFFFFFF, order)        # every NaN above +inf, as in the reference's sort
        first = gl.load(FIRST + rows, mask=row_ok, other=0).to(gl.int64)
        visible = gl.load(VISIBLE + rows, mask=row_ok, other=0)
        j0 = (e0 + W * CONSUMER_E - first).to(gl.int32)
        j = j0[:, None] + gl.arange(0, CONSUMER_E, layout=gl.SliceLayout(0, s_layout))[None, :]
        valid = (j >= 0) & (j < visible[:, None]) & row_ok[:, None]
        gl.store((ORDERS + rows * width)[:, None] + j, order, mask=valid)

    @gluon.jit
    def _indexer_orders_gluon(Q_DESC, K, W_, FIRST, VISIBLE, TABLE, ORDERS, rows_c, width, shift,
                              HAS_TABLE: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
                              REGS: gl.constexpr):
        # Entry blocks vary fastest (as in the Triton kernel): neighbouring programs share query rows in L2.
        eb = gl.program_id(0)
        tb = gl.program_id(1)
        dtype: gl.constexpr = K.dtype.element_ty
        # How many entries from e0 on some row of the block sees.
        rows = tb * BLOCK_T_C + gl.arange(0, BLOCK_T_C, layout=gl.BlockedLayout([1], [32], [4], [0]))
        row_ok = rows < rows_c
        e0 = gl.load(FIRST + tb * BLOCK_T_C).to(gl.int64) + eb * BLOCK_E_C
        ends = gl.load(FIRST + rows, mask=row_ok, other=0).to(gl.int64) + \
            gl.load(VISIBLE + rows, mask=row_ok, other=0).to(gl.int64)
        needed = gl.minimum(gl.maximum(gl.max(ends, 0) - e0, 0), BLOCK_E_C)
        # A block that no row sees (most of the grid's upper triangle) skips its products: nothing is stored there.
        n_heads = gl.where(needed > 0, HEADS_C, 0)
        k_all = gl.allocate_shared_memory(dtype, [CONSUMERS_C, CONSUMER_E, HEAD_DIM_C],
                                          gl.NVMMASharedLayout.get_default_for([CONSUMER_E, HEAD_DIM_C], dtype))
        ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_T_C, HEAD_DIM_C],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_T_C, HEAD_DIM_C], dtype))
        full = mbarriers(STAGES, 1)          # one expect-tx arrival per TMA copy
        empty = mbarriers(STAGES, CONSUMERS_C)
        # The keys by this partition, before the split (a 40-register cp.async producer warpgroup spilled on these
        # addresses).
        _gather_keys(K, TABLE, shift, e0, needed, k_all, HAS_TABLE)
        async_copy.commit_group()
        async_copy.wait_group(0)
        thread_barrier()
        gl.warp_specialize([
            (_score_consumer, (W_, FIRST, VISIBLE, ORDERS, rows_c, width, tb, e0, n_heads, k_all, ring, full, empty,
                               gl.constexpr(0), STAGES)),
            (_score_consumer, (W_, FIRST, VISIBLE, ORDERS, rows_c, width, tb, e0, n_heads, k_all, ring, full, empty,
                               gl.constexpr(1), STAGES)),
            (_score_consumer, (W_, FIRST, VISIBLE, ORDERS, rows_c, width, tb, e0, n_heads, k_all, ring, full, empty,
                               gl.constexpr(2), STAGES)),
            (_score_producer, (Q_DESC, tb, n_heads, ring, full, empty, STAGES))],
            [4, 4, 1], [REGS[0], REGS[0], REGS[1]])


def launch_orders(q, k, w, first, visible, table, shift: int, width: int, orders, config=None) -> None:
    """Fills ``orders`` (rows, width) int32 where ``j < visible`` (module docstring); arguments as
    ``triton._score_orders`` takes them (contiguous, w fp32)."""
    unknown = sorted(set(config or {}) - set(CONFIG))
    if unknown:
        raise ValueError(f"Gluon indexer score config: unknown keys {unknown}; expected some of {sorted(CONFIG)}")
    cfg = dict(CONFIG, **(config or {}))
    rows_c = q.shape[0]
    grid = ((2 * width + BLOCK_T + BLOCK_E - 1) // BLOCK_E, (rows_c + BLOCK_T - 1) // BLOCK_T)
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_T, HEAD_DIM], _GL_DTYPES[q.dtype])
    q_desc = TensorDescriptor.from_tensor(q.view(rows_c, HEADS * HEAD_DIM), [BLOCK_T, HEAD_DIM], layout)
    _indexer_orders_gluon[grid](
        q_desc, k, w, first, visible, table if table is not None else first, orders, rows_c, width, shift,
        HAS_TABLE=table is not None, STAGES=cfg["STAGES"], num_warps=4, REGS=tuple(cfg["REGS"]))

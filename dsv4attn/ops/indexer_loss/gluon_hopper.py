"""Backward of the indexer KL loss for Hopper (SM90) in Gluon, for the saved-gradient form (any K: the sparse phase,
and the warm-up's chunks once dKL/dI is formed for them).

Contract (that of ``triton._indexer_kl_bwd_kernel`` with ``HAS_G``): ``qi (T, 64, 128)``, ``ki (Nk, 128)`` bf16/fp16
of one dtype, ``w (T, 64)`` fp32, ``idx (T, K)`` int32 (-1 = empty), ``n_end (T,)`` int32 (a row's last valid slot
+ 1), ``grad (T,)`` fp32, ``g (T, K)`` fp32 = dKL/dI per slot. With ``x = qi[t] ki[idx]^T`` (64 heads x slots) and
``d = g[t] * grad[t]``: ``dw[t] = sum_slots relu(x) d`` (fp32), ``dx = (x > 0) w d``, ``dqi[t] = dx ki`` (rounded to
qi's dtype) and ``dki[idx] += dx^T qi[t]`` (fp32 atomics, relaxed). dx enters both products rounded to the input
dtype (as in the Triton kernel and the reference).

Layout: one program per query row, three warpgroups: a producer gathers BLOCK_N = 64 key rows per tile into a ring
(qi resident); consumer W takes tiles W, W + 2, ... on its own: x (wgmma, M = 64 heads, N = 64 slots, K = 128), dx
rounded to its shared-memory buffer, dq += dx ki (M = 64 heads, N = 128, K = 64 slots) and the
tile's dki rows dx^T qi (M = 64 slots, N = 128 dims, K = 64 heads), added to an fp32 accumulator with 16-byte
reductions over whole 128-byte lines (``gluon_common.add_reduced``; its column permutation is undone after the
kernel); at the end consumer 1 hands its dq and dw partial sums to consumer 0 through shared memory, which stores
the sums.

Row pairs (``launch_bwd_pairs``, the warm-up's ranges): the backward is bound by the d index_k reductions (one per
row and slot: 69 GB at 32K over every visible entry), and neighbouring rows of one range start see the same keys in
the same slots. A program then owns rows 2p and 2p + 1: the producer gathers each tile's keys once, consumer W forms
row W's x, dx and dq on every tile, and the tile's d index_k = [dx0; dx1]^T [qi0; qi1] (K = 128 heads) is formed and
reduced once, by consumer (tile % 2): half the reductions, the same products. dx goes through a double buffer in
shared memory that the other consumer may overwrite only after the owner's product (``dx_free``). The owner forms
a tile's d index_k one tile late, after its score and dq of the next tile: the other consumer's dx of that tile is
written by then, so the two consumers do not wait on each other's step of the same tile.

The default on SM90 (``BWD_CONFIG["KERNEL"]`` "auto"): about half the Triton kernel's time at the V4 shapes
(BENCHMARKS.md, "Indexer KL loss"); the GPU tests check both against float64.
"""
from __future__ import annotations

import torch

from ..gluon_common import (IMPORTED, add_reduced, add_unpermuted, async_copy, async_load, fence_async_shared,
                            gather_rows, gl, gluon, half_precision, loop_zero, mbarrier, mbarriers, reduction_layout,
                            release, sm90, warpgroup_mma, warpgroup_mma_wait)

HEADS, HEAD_DIM = 64, 128
BLOCK_N = 64        # key rows per tile: the d index_k product's M (one warpgroup's wgmma has M = 64)
# STAGES: ring depth (even: each consumer owns the stages of its parity); REGS: registers per thread of the worker
# consumer and the producer.
CONFIG = dict(STAGES=4, REGS=(216, 40))


def check(qi: torch.Tensor, ki: torch.Tensor) -> tuple[bool, str]:
    """(usable, reason) of :func:`launch_bwd`: Gluon, SM90, bf16/fp16 qi and ki of one dtype, 64 heads of 128."""
    for usable, reason in (sm90(qi.device), half_precision(qi, ki)):
        if not usable:
            return usable, reason
    if tuple(qi.shape[1:]) != (HEADS, HEAD_DIM):
        return False, f"needs {HEADS} index heads of {HEAD_DIM}, got {tuple(qi.shape[1:])}"
    return True, ""


def available(qi: torch.Tensor, ki: torch.Tensor) -> bool:
    return check(qi, ki)[0]


if IMPORTED:
    HEADS_C = gl.constexpr(HEADS)
    HEAD_DIM_C = gl.constexpr(HEAD_DIM)
    # One warpgroup's wgmma accumulators: a tile's scores (64 heads x BLOCK_N slots) and a 128-column product.
    X_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16]))
    Q_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HEAD_DIM, 16]))

    @gluon.jit
    def _kl_producer(QI, KI, IDX, K, t, n_end, qi_smem, ring, full, empty, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr):
        # qi, then the key rows of every tile before n_end, 16 at a time (the attention's gather: empty slots are
        # masked copies, zero-filled without a read; their products are masked later).
        io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        cols = gl.arange(0, HEAD_DIM_C, layout=gl.SliceLayout(0, io))
        for r in gl.static_range(0, HEADS_C, 16):
            heads = r + gl.arange(0, 16, layout=gl.SliceLayout(1, io))
            src = QI + (t * HEADS_C + heads.to(gl.int64))[:, None] * HEAD_DIM_C + cols[None, :]
            async_load(qi_smem.slice(r, 16, dim=0), src)
        async_copy.commit_group()                 # covered by the first full[] arrival
        for b in range(gl.cdiv(n_end, BLOCK_N)):
            stage = b % STAGES
            mbarrier.wait(empty.index(stage), ((b // STAGES) + 1) & 1, pred=b >= STAGES)
            for r in gl.static_range(0, BLOCK_N, 16):
                n = b * BLOCK_N + r + gl.arange(0, 16, layout=gl.SliceLayout(1, io))
                idx = gl.load(IDX + t * K + n, mask=n < K, other=-1)
                gather_rows(ring.index(stage), r, idx, KI, cols, HEAD_DIM_C)
            async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
            async_copy.commit_group()
        async_copy.wait_group(0)

    @gluon.jit
    def _kl_consumer(W_, IDX, G, GRAD, DQI, DKI, DW, K, t, n_end, qi_all, ring, dx_smem, dq_part, dw_part,
                     full, empty, handed, W: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        x_layout: gl.constexpr = X_LAYOUT
        q_layout: gl.constexpr = Q_LAYOUT
        row_layout: gl.constexpr = gl.SliceLayout(1, x_layout)
        slot_layout: gl.constexpr = gl.SliceLayout(0, x_layout)
        red_slots: gl.constexpr = gl.SliceLayout(1, reduction_layout(BLOCK_N, HEAD_DIM_C))
        heads = gl.arange(0, HEADS_C, layout=row_layout)
        w = gl.load(W_ + t * HEADS_C + heads)
        grad = gl.load(GRAD + t)
        x_zero = gl.zeros([HEADS_C, BLOCK_N], gl.float32, layout=x_layout)
        dk_zero = gl.zeros([BLOCK_N, HEAD_DIM_C], gl.float32, layout=q_layout)
        dq = gl.zeros([HEADS_C, HEAD_DIM_C], gl.float32, layout=q_layout)
        dw = gl.zeros([HEADS_C], gl.float32, layout=row_layout)
        nb = gl.cdiv(n_end, BLOCK_N)
        for b in range(W, nb, 2):
            stage = b % STAGES
            z = (b + 1) // (nb + 1)                # 0: keeps the wgmma descriptors in the loop (attention forward)
            n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=slot_layout)
            idx = gl.load(IDX + t * K + n, mask=n < K, other=-1)
            valid = idx >= 0
            d = gl.load(G + t * K + n, mask=valid, other=0.0) * grad
            # The same slots' rows in the reductions' layout (an L1 hit): dki's rows as element offsets.
            n_red = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=red_slots)
            idx_red = gl.load(IDX + t * K + n_red, mask=n_red < K, other=-1)
            mbarrier.wait(full.index(stage), (b // STAGES) & 1)
            fence_async_shared()
            keys = ring.index(stage + z)
            x = warpgroup_mma(qi_all.index(z), keys.permute((1, 0)), x_zero, use_acc=False)
            relu = gl.maximum(x, 0.0)
            dw += gl.sum(relu * d[None, :], 1)
            dx = gl.where(x > 0, w[:, None] * d[None, :], 0.0)
            dx_smem.index(W + z).store(dx.to(dx_smem.dtype))
            fence_async_shared()
            # dki rows = dx^T qi: M = the tile's 64 slots, so that the result is whole dki rows (line-wide
            # reductions; as (dims, slots) each warp's reductions were 4-byte pieces of eight rows).
            dq = warpgroup_mma(dx_smem.index(W + z), keys, dq)
            dk = warpgroup_mma(dx_smem.index(W + z).permute((1, 0)), qi_all.index(z), dk_zero, use_acc=False)
            mbarrier.arrive(empty.index(stage))
            ok = idx_red >= 0
            add_reduced(dk, DKI, gl.where(ok, idx_red, 0).to(gl.int64) * HEAD_DIM_C, ok, 0)
        # Consumer 1 hands its partial dq and dw over; consumer 0 adds them and stores.
        if W == 1:
            dq_part.store(dq)
            dw_part.store(dw)
            mbarrier.arrive(handed.index(0))
        else:
            mbarrier.wait(handed.index(0), 0)
            dq += dq_part.load(q_layout)
            dw += dw_part.load(row_layout)
            q_heads = gl.arange(0, HEADS_C, layout=gl.SliceLayout(1, q_layout))
            q_dims = gl.arange(0, HEAD_DIM_C, layout=gl.SliceLayout(0, q_layout))
            gl.store(DQI + (t * HEADS_C + q_heads.to(gl.int64))[:, None] * HEAD_DIM_C + q_dims[None, :],
                     dq.to(DQI.dtype.element_ty))
            gl.store(DW + t * HEADS_C + heads, dw)

    @gluon.jit
    def _indexer_kl_bwd_gluon(QI, KI, W_, IDX, NEND, G, GRAD, DQI, DKI, DW, K,
                              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr, REGS: gl.constexpr):
        t = gl.program_id(0).to(gl.int64)
        n_end = gl.load(NEND + t)
        dtype: gl.constexpr = QI.dtype.element_ty
        qi_all = gl.allocate_shared_memory(dtype, [1, HEADS_C, HEAD_DIM_C],
                                           gl.NVMMASharedLayout.get_default_for([HEADS_C, HEAD_DIM_C], dtype))
        ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM_C],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM_C], dtype))
        dx_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS_C, BLOCK_N], dtype)
        dx_smem = gl.allocate_shared_memory(dtype, [2, HEADS_C, BLOCK_N], dx_layout)     # one per consumer
        dq_part = gl.allocate_shared_memory(gl.float32, [HEADS_C, HEAD_DIM_C],
                                            gl.NVMMASharedLayout.get_default_for([HEADS_C, HEAD_DIM_C], gl.float32))
        dw_part = gl.allocate_shared_memory(gl.float32, [HEADS_C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        full = mbarriers(STAGES, 128)
        empty = mbarriers(STAGES, 1)
        handed = mbarriers(1, 1)
        gl.warp_specialize([
            (_kl_consumer, (W_, IDX, G, GRAD, DQI, DKI, DW, K, t, n_end, qi_all, ring, dx_smem, dq_part, dw_part,
                            full, empty, handed, gl.constexpr(0), BLOCK_N, STAGES)),
            (_kl_consumer, (W_, IDX, G, GRAD, DQI, DKI, DW, K, t, n_end, qi_all, ring, dx_smem, dq_part, dw_part,
                            full, empty, handed, gl.constexpr(1), BLOCK_N, STAGES)),
            (_kl_producer, (QI, KI, IDX, K, t, n_end, qi_all.index(0), ring, full, empty, BLOCK_N, STAGES))],
            [4, 4], [REGS[0], REGS[1]])


    @gluon.jit
    def _pair_producer(QI, KI, IDX, K, r0, r1, n_end, qi_smem, ring, full, empty, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr):
        # Both rows' qi (an absent row's copies are masked: zeros), then each tile's keys: a slot's key is row 0's
        # where valid, else row 1's (the rows agree wherever both are valid; launch_bwd_pairs pairs only those).
        io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        cols = gl.arange(0, HEAD_DIM_C, layout=gl.SliceLayout(0, io))
        sixteen = gl.arange(0, 16, layout=gl.SliceLayout(1, io))
        for r in gl.static_range(0, 2 * HEADS_C, 16):
            row = r0 if r < HEADS_C else r1
            heads = (r % HEADS_C) + sixteen
            src = QI + (gl.maximum(row, 0).to(gl.int64) * HEADS_C + heads)[:, None] * HEAD_DIM_C + cols[None, :]
            async_load(qi_smem.slice(r, 16, dim=0), src, mask=((heads >= 0) & (row >= 0))[:, None])
        async_copy.commit_group()                 # covered by the first full[] arrival
        base0 = gl.maximum(r0, 0).to(gl.int64) * K
        base1 = gl.maximum(r1, 0).to(gl.int64) * K
        for b in range(gl.cdiv(n_end, BLOCK_N)):
            stage = b % STAGES
            mbarrier.wait(empty.index(stage), ((b // STAGES) + 1) & 1, pred=b >= STAGES)
            for r in gl.static_range(0, BLOCK_N, 16):
                n = b * BLOCK_N + r + sixteen
                i0 = gl.load(IDX + base0 + n, mask=(n < K) & (r0 >= 0), other=-1)
                i1 = gl.load(IDX + base1 + n, mask=(n < K) & (r1 >= 0), other=-1)
                gather_rows(ring.index(stage), r, gl.where(i0 >= 0, i0, i1), KI, cols, HEAD_DIM_C)
            async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
            async_copy.commit_group()
        async_copy.wait_group(0)

    @gluon.jit
    def _pair_dk(b, K, IDX, base0, base1, r0, r1, DKI, dx_smem, qi_all, dx_ready, dx_free, dk_zero,
                 BLOCK_N: gl.constexpr):
        """d index_k rows of tile b's slots: both rows' heads as the product's K, then freed for tile b + 2."""
        red_slots: gl.constexpr = gl.SliceLayout(1, reduction_layout(BLOCK_N, HEAD_DIM_C))
        u = b % 2
        z = loop_zero(b, K)
        mbarrier.wait(dx_ready.index(u), (b // 2) & 1)
        dk = warpgroup_mma(dx_smem.index(u + z).permute((1, 0)), qi_all.index(z), dk_zero, use_acc=False)
        release(dx_free.index(u))
        n_red = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=red_slots)
        i0 = gl.load(IDX + base0 + n_red, mask=(n_red < K) & (r0 >= 0), other=-1)
        i1 = gl.load(IDX + base1 + n_red, mask=(n_red < K) & (r1 >= 0), other=-1)
        key = gl.where(i0 >= 0, i0, i1)
        ok = key >= 0
        add_reduced(dk, DKI, gl.where(ok, key, 0).to(gl.int64) * HEAD_DIM_C, ok, 0)

    @gluon.jit
    def _pair_consumer(W_, IDX, G, GRAD, DQI, DKI, DW, K, r0, r1, n_end, qi_all, ring, dx_smem, full, empty,
                       dx_ready, dx_free, W: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        x_layout: gl.constexpr = X_LAYOUT
        q_layout: gl.constexpr = Q_LAYOUT
        row_layout: gl.constexpr = gl.SliceLayout(1, x_layout)
        slot_layout: gl.constexpr = gl.SliceLayout(0, x_layout)
        row = r0 if W == 0 else r1
        active = row >= 0
        base = gl.maximum(row, 0).to(gl.int64)
        base0 = gl.maximum(r0, 0).to(gl.int64) * K
        base1 = gl.maximum(r1, 0).to(gl.int64) * K
        heads = gl.arange(0, HEADS_C, layout=row_layout)
        w = gl.load(W_ + base * HEADS_C + heads)
        grad = gl.load(GRAD + base)
        x_zero = gl.zeros([HEADS_C, BLOCK_N], gl.float32, layout=x_layout)
        dk_zero = gl.zeros([BLOCK_N, HEAD_DIM_C], gl.float32, layout=q_layout)
        dq = gl.zeros([HEADS_C, HEAD_DIM_C], gl.float32, layout=q_layout)
        dw = gl.zeros([HEADS_C], gl.float32, layout=row_layout)
        for b in range(gl.cdiv(n_end, BLOCK_N)):
            stage = b % STAGES
            u = b % 2                              # the tile's dx buffer, and the consumer that reduces its d index_k
            use = b // 2
            z = loop_zero(b, K)
            n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=slot_layout)
            idx = gl.load(IDX + base * K + n, mask=(n < K) & active, other=-1)
            d = gl.load(G + base * K + n, mask=idx >= 0, other=0.0) * grad
            mbarrier.wait(full.index(stage), (b // STAGES) & 1)
            fence_async_shared()
            keys = ring.index(stage + z)
            qi_mine = qi_all.index(z).slice(W * HEADS_C, HEADS_C, dim=0)
            x = warpgroup_mma(qi_mine, keys.permute((1, 0)), x_zero, use_acc=False)
            dw += gl.sum(gl.maximum(x, 0.0) * d[None, :], 1)
            dx = gl.where(x > 0, w[:, None] * d[None, :], 0.0)
            # Buffer u is consumer u's: the other one writes its half again only once u's previous product read it.
            mbarrier.wait(dx_free.index(u), (use + 1) & 1, pred=(use >= 1) & (u != W))
            dx_mine = dx_smem.index(u + z).slice(W * HEADS_C, HEADS_C, dim=0)
            dx_mine.store(dx.to(dx_smem.dtype))
            fence_async_shared()
            mbarrier.arrive(dx_ready.index(u))
            # d index_q is issued without a wait: tile b - 1's d index_k (formed by its owner only now, after this
            # tile's score, so neither consumer waits on the other's step of one tile) queues behind it and its wait
            # covers both; the stage is released after that step (the producer runs up to four stages ahead). dq is
            # never in flight across the loop's back edge (that made ptxas serialize the score kernel's wgmma).
            dq = warpgroup_mma(dx_mine, keys, dq, is_async=True)
            if (b >= 1) & ((b - 1) % 2 == W):
                _pair_dk(b - 1, K, IDX, base0, base1, r0, r1, DKI, dx_smem, qi_all, dx_ready, dx_free, dk_zero,
                         BLOCK_N)
            dq = warpgroup_mma_wait(0, deps=[dq])
            release(empty.index(stage))
        nb = gl.cdiv(n_end, BLOCK_N)
        if (nb >= 1) & ((nb - 1) % 2 == W):
            _pair_dk(nb - 1, K, IDX, base0, base1, r0, r1, DKI, dx_smem, qi_all, dx_ready, dx_free, dk_zero, BLOCK_N)
        q_heads = gl.arange(0, HEADS_C, layout=gl.SliceLayout(1, q_layout))
        q_dims = gl.arange(0, HEAD_DIM_C, layout=gl.SliceLayout(0, q_layout))
        gl.store(DQI + (base * HEADS_C + q_heads.to(gl.int64))[:, None] * HEAD_DIM_C + q_dims[None, :],
                 dq.to(DQI.dtype.element_ty), mask=((q_heads >= 0) & active)[:, None])
        gl.store(DW + base * HEADS_C + heads, dw, mask=(heads >= 0) & active)

    @gluon.jit
    def _indexer_kl_bwd_pairs_gluon(QI, KI, W_, IDX, NEND, ROW0, ROW1, G, GRAD, DQI, DKI, DW, K,
                                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
                                    REGS: gl.constexpr):
        p = gl.program_id(0)
        r0 = gl.load(ROW0 + p)
        r1 = gl.load(ROW1 + p)
        n_end = gl.maximum(gl.load(NEND + gl.maximum(r0, 0), mask=r0 >= 0, other=0),
                           gl.load(NEND + gl.maximum(r1, 0), mask=r1 >= 0, other=0))
        dtype: gl.constexpr = QI.dtype.element_ty
        qi_all = gl.allocate_shared_memory(dtype, [1, 2 * HEADS_C, HEAD_DIM_C],
                                           gl.NVMMASharedLayout.get_default_for([2 * HEADS_C, HEAD_DIM_C], dtype))
        ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM_C],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM_C], dtype))
        dx_smem = gl.allocate_shared_memory(dtype, [2, 2 * HEADS_C, BLOCK_N],
                                            gl.NVMMASharedLayout.get_default_for([2 * HEADS_C, BLOCK_N], dtype))
        full = mbarriers(STAGES, 128)
        empty = mbarriers(STAGES, 256)
        dx_ready = mbarriers(2, 2)
        dx_free = mbarriers(2, 128)
        gl.warp_specialize([
            (_pair_consumer, (W_, IDX, G, GRAD, DQI, DKI, DW, K, r0, r1, n_end, qi_all, ring, dx_smem, full, empty,
                              dx_ready, dx_free, gl.constexpr(0), BLOCK_N, STAGES)),
            (_pair_consumer, (W_, IDX, G, GRAD, DQI, DKI, DW, K, r0, r1, n_end, qi_all, ring, dx_smem, full, empty,
                              dx_ready, dx_free, gl.constexpr(1), BLOCK_N, STAGES)),
            (_pair_producer, (QI, KI, IDX, K, r0, r1, n_end, qi_all.index(0), ring, full, empty, BLOCK_N, STAGES))],
            [4, 4], [REGS[0], REGS[1]])


def _config(config) -> dict:
    unknown = sorted(set(config or {}) - set(CONFIG))
    if unknown:
        raise ValueError(f"Gluon KL backward config: unknown keys {unknown}; expected some of {sorted(CONFIG)}")
    cfg = dict(CONFIG, **(config or {}))
    if cfg["STAGES"] < 2 or cfg["STAGES"] % 2:
        raise ValueError(f"Gluon KL backward config: STAGES must be even and >= 2, got {cfg['STAGES']}")
    return cfg


def launch_bwd(qi, ki, w, idx, n_end, g, grad, dqi, dki, dw, config=None) -> None:
    """Fills ``dqi`` (T, 64, 128) in qi's dtype and ``dw`` (T, 64) fp32, adds to ``dki`` (Nk, 128) fp32 (module
    docstring; contiguous arguments, T >= 1)."""
    cfg = _config(config)
    acc = torch.zeros_like(dki)                 # d index_k with each 16-column group permuted (add_reduced)
    _indexer_kl_bwd_gluon[(qi.shape[0],)](
        qi, ki, w, idx, n_end, g, grad, dqi, acc, dw, idx.shape[1],
        BLOCK_N=BLOCK_N, STAGES=cfg["STAGES"], num_warps=4, REGS=tuple(cfg["REGS"]))
    add_unpermuted(dki, acc)


def row_pairs(first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row0, row1, alone) int32, one entry per pair p of rows (2p, 2p + 1) of ranges starting at ``first`` (T,):
    rows with one start see the same key in each slot both hold, so one program takes both (row1 = 2p + 1), else
    row1 = -1 and ``alone`` names row 2p + 1 for a second launch (-1 where it has no row: paired, or past T).
    Device tensors only: no host read."""
    T = first.shape[0]
    row0 = torch.arange(0, T, 2, dtype=torch.int32, device=first.device)
    second = row0 + 1
    exists = second < T
    nxt = first[second.clamp(max=max(T - 1, 0)).long()]
    together = exists & (first[row0.long()] == nxt)
    minus = torch.full_like(row0, -1)
    return row0, torch.where(together, second, minus), torch.where(exists & ~together, second, minus)


def launch_bwd_pairs(qi, ki, w, idx, n_end, g, grad, dqi, dki, dw, first, config=None) -> None:
    """:func:`launch_bwd` for candidates that are ranges (``index_sets.contiguous_ranges``) starting at ``first``
    (T,): row pairs with one start in one program (half the d index_k reductions), the other rows one per program
    in a second launch. Same outputs (d index_k's fp32 sums in another order)."""
    cfg = _config(config)
    acc = torch.zeros_like(dki)
    row0, row1, alone = row_pairs(first)
    meta = dict(BLOCK_N=BLOCK_N, STAGES=cfg["STAGES"], num_warps=4, REGS=tuple(cfg["REGS"]))
    for a, b in ((row0, row1), (alone, torch.full_like(alone, -1))):
        _indexer_kl_bwd_pairs_gluon[(row0.shape[0],)](qi, ki, w, idx, n_end, a, b, g, grad, dqi, acc, dw,
                                                      idx.shape[1], **meta)
    add_unpermuted(dki, acc)

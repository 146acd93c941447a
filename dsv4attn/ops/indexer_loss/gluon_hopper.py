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

The default on SM90 (``BWD_CONFIG["KERNEL"]`` "auto"): about half the Triton kernel's time at the V4 shapes
(BENCHMARKS.md, "Indexer KL loss"); the GPU tests check both against float64.
"""
from __future__ import annotations

import torch

from ..gluon_common import (IMPORTED, add_reduced, add_unpermuted, async_copy, async_load, fence_async_shared,
                            gather_rows, gl, gluon, half_precision, mbarrier, mbarriers, reduction_layout, sm90,
                            warpgroup_mma)

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
        x_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM_C, 16])
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


def launch_bwd(qi, ki, w, idx, n_end, g, grad, dqi, dki, dw, config=None) -> None:
    """Fills ``dqi`` (T, 64, 128) in qi's dtype and ``dw`` (T, 64) fp32, adds to ``dki`` (Nk, 128) fp32 (module
    docstring; contiguous arguments, T >= 1)."""
    unknown = sorted(set(config or {}) - set(CONFIG))
    if unknown:
        raise ValueError(f"Gluon KL backward config: unknown keys {unknown}; expected some of {sorted(CONFIG)}")
    cfg = dict(CONFIG, **(config or {}))
    if cfg["STAGES"] < 2 or cfg["STAGES"] % 2:
        raise ValueError(f"Gluon KL backward config: STAGES must be even and >= 2, got {cfg['STAGES']}")
    acc = torch.zeros_like(dki)                 # d index_k with each 16-column group permuted (add_reduced)
    _indexer_kl_bwd_gluon[(qi.shape[0],)](
        qi, ki, w, idx, n_end, g, grad, dqi, acc, dw, idx.shape[1],
        BLOCK_N=BLOCK_N, STAGES=cfg["STAGES"], num_warps=4, REGS=tuple(cfg["REGS"]))
    add_unpermuted(dki, acc)

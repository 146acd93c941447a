"""Sparse MQA attention forward for Hopper (SM90) written in Gluon: asynchronous row gathers into a shared-memory ring.

Same contract as the Triton forward (:func:`.triton._sparse_attn_fwd`, which launches this one): ``q (T, H, D)`` bf16/fp16 with H a multiple
of 64, ``kv (N, D)`` (K = V), ``idx (T, K)`` int32 (-1 = empty slot), ``sink (H,)`` fp32 -> ``out (T, H, D)``,
``lse (T, H)`` fp32 (natural log, sink excluded; -inf and a zero output for rows without a valid slot).

Why a second forward: Triton's pipeliner does not make the row gather asynchronous (its addresses come from the index
load of the same iteration), so the plain-Triton kernel loads every 64 x 512 kv tile synchronously through registers
and the tensor cores wait for L2 on every block (ttgir of the Triton 3.6 build: ``tt.load`` + ``local_alloc``, no
``async_copy``). Here every thread issues ``cp.async`` copies of the next blocks' rows straight into a ring of
NVMMA-swizzled shared-memory tiles (no registers), STAGES - 1 blocks ahead of the block being multiplied.

One program per (query row, 64-head block), 8 warps = two warpgroups. Scores ``S = Q K^T`` (64 x BLOCK_N) and the
output accumulator (64 x D, fp32) are both split between the warpgroups along their columns (wgmma layout
``warps_per_cta = [4, 2]``): each warpgroup owns half of the value columns, the row max and P cross between them
through shared memory (the compiler's layout conversion). Q stays in shared memory for the whole row.

Gluon kernels run only on the GPU (no interpreter): the tests compare this kernel with the float64 reference on the
H200; CPU runs use the Triton kernel or the reference. :func:`available` says whether this path can run here.
"""
from __future__ import annotations

import torch

try:  # Gluon is experimental: any import problem (older or newer Triton) just disables this path.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    _IMPORTED = True
except Exception:  # pragma: no cover - depends on the installed Triton
    _IMPORTED = False

LOG2E = 1.4426950408889634
BLOCK_H = 64
# BLOCK_N: gathered rows per step; STAGES: shared-memory ring depth (copies run STAGES - 1 blocks ahead).
FWD_CONFIG = dict(BLOCK_N=64, STAGES=2, num_warps=8)


def available(q: torch.Tensor) -> bool:
    """True when this kernel can run for ``q``: Gluon imported, q on an SM90 GPU, bf16/fp16, H % 64 == 0."""
    if not _IMPORTED or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return q.shape[1] % BLOCK_H == 0 and q.shape[2] in (128, 256, 512)


if _IMPORTED:

    @gluon.jit
    def _gather(kv_ring, stage, KV, IDX, row_base, K, block, col0, BLOCK_N: gl.constexpr, WIDTH: gl.constexpr,
                D: gl.constexpr, layout: gl.constexpr):
        # cp.async of columns [col0, col0 + WIDTH) of the kv rows of slots [block * BLOCK_N, +BLOCK_N) into ring
        # stage ``stage``. Empty slots and slots past K copy row 0 (kv has >= 1 row): their scores are masked to
        # -inf, so p = 0 for them.
        n = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
        rows = gl.where(idx >= 0, idx, 0).to(gl.int64) * D
        cols = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
        async_copy.async_copy_global_to_shared(kv_ring.index(stage), KV + rows[:, None] + cols[None, :])

    @gluon.jit
    def _land(outstanding: gl.constexpr):
        # The oldest copy groups (all but ``outstanding``) have landed for every thread and are visible to wgmma.
        async_copy.wait_group(outstanding)
        gl.thread_barrier()
        fence_async_shared()

    @gluon.jit
    def _softmax_step(s, IDX, row_base, K, block, m_i, l_i, qk_scale_log2, BLOCK_N: gl.constexpr,
                      o_layout: gl.constexpr, p_layout: gl.constexpr, dtype: gl.constexpr):
        # Online softmax of one block's scores (log2 domain): returns P as the next wgmma's A operand, the factor
        # that rescales the accumulator before P V is added, and the new running max and sum.
        n = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
        s = gl.where((idx >= 0)[None, :], s * qk_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # An all-empty block keeps m at -inf: shift by 0 instead so that no -inf - -inf NaN appears.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_new = l_i * alpha + gl.sum(p, 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        return p_op, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), m_new, l_new

    @gluon.jit
    def _finish(acc, m_i, l_i, SINK, OUT, LSE, t, H, hb, col0, D: gl.constexpr, WRITE_LSE: gl.constexpr):
        # Sink in the denominator only: out = acc / (l + 2^(sink log2e - m)); rows without keys (l == 0) give 0.
        # ``acc`` holds output columns [col0, col0 + its width) of the 64 heads of head block ``hb``.
        row_layout: gl.constexpr = m_i.type.layout
        o_layout: gl.constexpr = acc.type.layout
        h_s = hb * 64 + gl.arange(0, 64, layout=row_layout)
        sink = gl.load(SINK + h_s)
        m_safe = gl.where(m_i == float("-inf"), 0.0, m_i)
        denom = l_i + gl.exp2(sink * 1.4426950408889634 - m_safe)
        has_keys = l_i > 0
        if WRITE_LSE:
            lse = gl.where(has_keys, (m_safe + gl.log2(gl.where(has_keys, l_i, 1.0))) * 0.6931471805599453,
                           float("-inf"))
            gl.store(LSE + t * H + h_s, lse)
        scale_o = gl.where(has_keys, 1.0 / denom, 0.0)
        out = acc * gl.convert_layout(scale_o, gl.SliceLayout(1, o_layout))[:, None]
        h_o = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
        c_o = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, o_layout))
        gl.store(OUT + t * H * D + h_o.to(gl.int64)[:, None] * D + c_o[None, :], out.to(OUT.dtype.element_ty))

    @gluon.jit
    def _split_d_half(Q, KV, IDX, SINK, OUT, LSE, H, K, qk_scale_log2, t, hb, q_smem, ring, exch, ready, free,
                      W: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # Warpgroup W of the split-D schedule: owns columns [W * D/2, (W+1) * D/2) of q, of every gathered kv row
        # and of the output. Per block: partial scores over its half of the contraction, exchanged with the other
        # warpgroup through shared memory (mbarrier handshake), summed in the same order by both (fp32 addition
        # commutes, so both hold bitwise-equal scores and softmax states), then P V for its own value columns.
        HALF: gl.constexpr = D // 2
        dtype: gl.constexpr = Q.dtype.element_ty
        io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_base = t * K
        col0 = W * HALF
        num_blocks = gl.cdiv(K, BLOCK_N)
        for b in gl.static_range(STAGES - 1):
            if b < num_blocks:
                _gather(ring, W * STAGES + b, KV, IDX, row_base, K, b, col0, BLOCK_N, HALF, D, io)
            async_copy.commit_group()
        heads = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, io))
        cols = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, io))
        q_half = q_smem.index(W)
        q_half.store(gl.load(Q + t * H * D + heads.to(gl.int64)[:, None] * D + cols[None, :]))

        m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([64, HALF], gl.float32, layout=o_layout)
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
        mine = exch.index(W)
        theirs = exch.index(1 - W)
        for block in range(num_blocks):
            gl.thread_barrier()                  # this warpgroup is past block - 1's P V: refill its stage
            ahead = block + STAGES - 1
            if ahead < num_blocks:
                _gather(ring, W * STAGES + ahead % STAGES, KV, IDX, row_base, K, ahead, col0, BLOCK_N, HALF, D, io)
            async_copy.commit_group()
            _land(STAGES - 1)
            kv = ring.index(W * STAGES + block % STAGES)
            s_part = warpgroup_mma(q_half, kv.permute((1, 0)), s_zero, use_acc=False)
            # The other warpgroup has read my previous partial (not needed before the first block).
            mbarrier.wait(free.index(W), (block + 1) & 1, pred=block > 0)
            mine.store(s_part)
            mbarrier.arrive(ready.index(W))
            mbarrier.wait(ready.index(1 - W), block & 1)
            if W == 0:
                s = s_part + theirs.load(s_layout)
            else:
                s = theirs.load(s_layout) + s_part
            mbarrier.arrive(free.index(1 - W))
            p_op, alpha, m_i, l_i = _softmax_step(s, IDX, row_base, K, block, m_i, l_i, qk_scale_log2, BLOCK_N,
                                                  o_layout, p_layout, dtype)
            acc = acc * alpha[:, None]
            acc = warpgroup_mma(p_op, kv, acc)
        async_copy.wait_group(0)
        _finish(acc, m_i, l_i, SINK, OUT, LSE, t, H, hb, col0, D, W == 0)

    @gluon.jit
    def _sparse_attn_fwd_gluon_split_d(Q, KV, IDX, SINK, OUT, LSE, H, K, qk_scale_log2,
                                       D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                       num_warps: gl.constexpr):
        # Two warpgroups as warp-specialised partitions (this one plus one worker), each running _split_d_half.
        NUM_HB = H // 64
        pid = gl.program_id(0)
        hb = pid % NUM_HB
        t = (pid // NUM_HB).to(gl.int64)
        dtype: gl.constexpr = Q.dtype.element_ty
        HALF: gl.constexpr = D // 2
        q_smem = gl.allocate_shared_memory(dtype, [2, 64, HALF],
                                           gl.NVMMASharedLayout.get_default_for([64, HALF], dtype))
        ring = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_N, HALF],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], dtype))
        exch = gl.allocate_shared_memory(gl.float32, [2, 64, BLOCK_N], gl.SwizzledSharedLayout(2, 1, 8, [1, 0]))
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=1)
        gl.warp_specialize([
            (_split_d_half, (Q, KV, IDX, SINK, OUT, LSE, H, K, qk_scale_log2, t, hb, q_smem, ring, exch, ready, free,
                             gl.constexpr(0), D, BLOCK_N, STAGES)),
            (_split_d_half, (Q, KV, IDX, SINK, OUT, LSE, H, K, qk_scale_log2, t, hb, q_smem, ring, exch, ready, free,
                             gl.constexpr(1), D, BLOCK_N, STAGES))], [4], [240])


    @gluon.jit
    def _pp_producer(Q, KV, IDX, H, K, t, hb, q_smem, ring, full, empty, D: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr):
        # Ping-pong schedule, producer warpgroup: q, then every block's rows into ring stage b % STAGES once both
        # consumers have released it; each thread's cp.async completions arrive on full[stage] (count 128).
        io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        row_base = t * K
        heads = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, io))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        async_copy.async_copy_global_to_shared(q_smem, Q + t * H * D + heads.to(gl.int64)[:, None] * D + cols[None, :])
        for b in range(gl.cdiv(K, BLOCK_N)):
            stage = b % STAGES
            mbarrier.wait(empty.index(stage), ((b // STAGES) + 1) & 1, pred=b >= STAGES)
            for r in gl.static_range(0, BLOCK_N, 16):        # 16 rows at a time: few registers per thread
                n = b * BLOCK_N + r + gl.arange(0, 16, layout=gl.SliceLayout(1, io))
                idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
                rows = gl.where(idx >= 0, idx, 0).to(gl.int64) * D
                async_copy.async_copy_global_to_shared(ring.index(stage).slice(r, 16, dim=0),
                                                       KV + rows[:, None] + cols[None, :])
            async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
            async_copy.commit_group()
        async_copy.wait_group(0)

    @gluon.jit
    def _pp_consumer(IDX, SINK, OUT, LSE, H, K, qk_scale_log2, t, hb, q_smem, ring, p_buf, stats, full, empty,
                     pready, pfree, W: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # Ping-pong schedule, consumer warpgroup W: owns output columns [W * D/2, (W+1) * D/2). Blocks b with
        # b % 2 == W: scores over the full contraction, online softmax from the running max the other warpgroup
        # left, P (bf16) and the row statistics published through shared memory. Every block: both warpgroups
        # rescale and add P V for their columns. Scores of one block run on the tensor cores while the other
        # warpgroup does its softmax.
        HALF: gl.constexpr = D // 2
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_base = t * K
        m_i = gl.full([64], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([64], gl.float32, layout=row_layout)
        acc = gl.zeros([64, HALF], gl.float32, layout=o_layout)
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
        for b in range(gl.cdiv(K, BLOCK_N)):
            stage = b % STAGES
            half = b % 2
            kv = ring.index(stage)
            mbarrier.wait(full.index(stage), (b // STAGES) & 1)
            if half == W:
                fence_async_shared()
                s = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False)
                n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
                s = gl.where((idx >= 0)[None, :], s * qk_scale_log2, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1))
                # An all-empty block keeps m at -inf: shift by 0 instead so that no -inf - -inf NaN appears.
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(s - m_safe[:, None])
                row_sum = gl.sum(p, 1)
                mbarrier.wait(pfree.index(half), ((b // 2) + 1) & 1, pred=b >= 2)   # both used P of block b - 2
                p_buf.index(half).store(p.to(dtype))
                stats.index(3 * half).store(alpha)
                stats.index(3 * half + 1).store(row_sum)
                stats.index(3 * half + 2).store(m_new)
                fence_async_shared()
                mbarrier.arrive(pready.index(half))
            else:
                mbarrier.wait(pready.index(half), (b // 2) & 1)
                fence_async_shared()
                alpha = stats.index(3 * half).load(row_layout)
                row_sum = stats.index(3 * half + 1).load(row_layout)
                m_new = stats.index(3 * half + 2).load(row_layout)
            l_i = l_i * alpha + row_sum
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            acc = warpgroup_mma(p_buf.index(half), kv.slice(W * HALF, HALF, dim=1), acc)
            mbarrier.arrive(pfree.index(half))
            mbarrier.arrive(empty.index(stage))
        _finish(acc, m_i, l_i, SINK, OUT, LSE, t, H, hb, W * HALF, D, W == 0)

    @gluon.jit
    def _sparse_attn_fwd_gluon_pingpong(Q, KV, IDX, SINK, OUT, LSE, H, K, qk_scale_log2,
                                        D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                        num_warps: gl.constexpr):
        # Three warpgroups: this partition and a worker are the consumers (_pp_consumer), a worker gathers.
        NUM_HB = H // 64
        pid = gl.program_id(0)
        hb = pid % NUM_HB
        t = (pid // NUM_HB).to(gl.int64)
        dtype: gl.constexpr = Q.dtype.element_ty
        q_smem = gl.allocate_shared_memory(dtype, [64, D], gl.NVMMASharedLayout.get_default_for([64, D], dtype))
        ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))
        p_buf = gl.allocate_shared_memory(dtype, [2, 64, BLOCK_N],
                                          gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], dtype))
        stats = gl.allocate_shared_memory(gl.float32, [6, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        pready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        pfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=128)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(pready.index(i), count=1)
            mbarrier.init(pfree.index(i), count=2)
        gl.warp_specialize([
            (_pp_consumer, (IDX, SINK, OUT, LSE, H, K, qk_scale_log2, t, hb, q_smem, ring, p_buf, stats, full, empty,
                            pready, pfree, gl.constexpr(0), D, BLOCK_N, STAGES)),
            (_pp_consumer, (IDX, SINK, OUT, LSE, H, K, qk_scale_log2, t, hb, q_smem, ring, p_buf, stats, full, empty,
                            pready, pfree, gl.constexpr(1), D, BLOCK_N, STAGES)),
            (_pp_producer, (Q, KV, IDX, H, K, t, hb, q_smem, ring, full, empty, D, BLOCK_N, STAGES))],
            [4, 4], [232, 24])


    @gluon.jit
    def _sparse_attn_fwd_gluon(Q, KV, IDX, SINK, OUT, LSE, H, K, qk_scale_log2,
                               D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                               num_warps: gl.constexpr, OVERLAP: gl.constexpr = False, SKIP: gl.constexpr = 0):
        # OVERLAP: issue block b + 1's Q K^T and block b's P V together and run block b + 1's softmax while P V is
        # on the tensor cores (ring refilled only after P V, so copies run STAGES - 2 blocks ahead).
        # SKIP (measurement only, wrong results; benchmarks/sparse_attention.py --sweep fwd): leave out one stage
        # of every block to time what it costs: 1 the softmax (p = s), 2 the P V product, 3 the Q K^T product,
        # 4 the gathers after the first STAGES - 1 blocks.
        NUM_HB = H // 64
        pid = gl.program_id(0)
        hb = pid % NUM_HB
        t = (pid // NUM_HB).to(gl.int64)
        dtype: gl.constexpr = Q.dtype.element_ty

        # Register layouts: 16-byte vectors along D for the gathers; wgmma accumulators split over 2 warpgroups.
        io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, BLOCK_N // 2, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, D // 2, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
        q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, D], dtype)

        row_base = t * K
        kv_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], smem)
        num_blocks = gl.cdiv(K, BLOCK_N)
        PROLOGUE: gl.constexpr = STAGES if OVERLAP else STAGES - 1
        for b in gl.static_range(PROLOGUE):
            if b < num_blocks:
                _gather(kv_ring, b, KV, IDX, row_base, K, b, 0, BLOCK_N, D, D, io)
            async_copy.commit_group()

        heads = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, io))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        q_tile = gl.load(Q + t * H * D + heads.to(gl.int64)[:, None] * D + cols[None, :])
        q_smem = gl.allocate_shared_memory(dtype, [64, D], q_smem_layout, q_tile)

        m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([64, D], gl.float32, layout=o_layout)
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
        if OVERLAP:
            # num_blocks >= 1 (the launcher sends K == 0 to the other schedule).
            _land(STAGES - 1)
            s = warpgroup_mma(q_smem, kv_ring.index(0).permute((1, 0)), s_zero, use_acc=False)
            p_op, alpha, m_i, l_i = _softmax_step(s, IDX, row_base, K, 0, m_i, l_i, qk_scale_log2, BLOCK_N,
                                                  o_layout, p_layout, dtype)
            for block in range(num_blocks - 1):
                acc = acc * alpha[:, None]
                _land(STAGES - 2)                # block + 1 is in its ring stage
                s_tok = warpgroup_mma(q_smem, kv_ring.index((block + 1) % STAGES).permute((1, 0)), s_zero,
                                      use_acc=False, is_async=True)
                acc_tok = warpgroup_mma(p_op, kv_ring.index(block % STAGES), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=(s_tok,))
                p_op, alpha, m_i, l_i = _softmax_step(s, IDX, row_base, K, block + 1, m_i, l_i, qk_scale_log2,
                                                      BLOCK_N, o_layout, p_layout, dtype)
                acc = warpgroup_mma_wait(0, deps=(acc_tok,))
                gl.thread_barrier()              # every warp's P V of this block is done: refill its stage
                if block + STAGES < num_blocks:
                    _gather(kv_ring, block % STAGES, KV, IDX, row_base, K, block + STAGES, 0, BLOCK_N, D, D, io)
                async_copy.commit_group()
            acc = acc * alpha[:, None]
            acc = warpgroup_mma(p_op, kv_ring.index((num_blocks - 1) % STAGES), acc)
        else:
            for block in range(num_blocks):
                # Every warp is past block - 1's MMAs: its ring stage may be refilled with block + STAGES - 1.
                gl.thread_barrier()
                ahead = block + STAGES - 1
                if (ahead < num_blocks) and (SKIP != 4):
                    _gather(kv_ring, ahead % STAGES, KV, IDX, row_base, K, ahead, 0, BLOCK_N, D, D, io)
                async_copy.commit_group()
                _land(STAGES - 1)                # this block's copies
                kv = kv_ring.index(block % STAGES)
                if SKIP == 3:
                    s = s_zero
                else:
                    s = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False)
                if SKIP == 1:
                    p_op = gl.convert_layout(s.to(dtype), p_layout)
                else:
                    p_op, alpha, m_i, l_i = _softmax_step(s, IDX, row_base, K, block, m_i, l_i, qk_scale_log2,
                                                          BLOCK_N, o_layout, p_layout, dtype)
                    acc = acc * alpha[:, None]
                if SKIP != 2:
                    acc = warpgroup_mma(p_op, kv, acc)
        async_copy.wait_group(0)

        _finish(acc, m_i, l_i, SINK, OUT, LSE, t, H, hb, 0, D, True)


def launch_fwd(q, kv, idx, sink, out, lse, scale, config=None):
    """Fills ``out`` (T, H, D) and ``lse`` (T, H) for T >= 1 rows and a kv of >= 1 row (the caller,
    :func:`.triton._sparse_attn_fwd`, allocates them and handles the empty cases)."""
    T, H, D = q.shape
    cfg = dict(FWD_CONFIG, **(config or {}))
    if cfg.get("PINGPONG"):
        _sparse_attn_fwd_gluon_pingpong[(T * (H // BLOCK_H),)](
            q, kv, idx, sink, out, lse, H, idx.shape[1], scale * LOG2E,
            D=D, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], num_warps=4)
        return
    if cfg.get("SPLIT_D"):
        _sparse_attn_fwd_gluon_split_d[(T * (H // BLOCK_H),)](
            q, kv, idx, sink, out, lse, H, idx.shape[1], scale * LOG2E,
            D=D, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], num_warps=4)
        return
    _sparse_attn_fwd_gluon[(T * (H // BLOCK_H),)](
        q, kv, idx, sink, out, lse, H, idx.shape[1], scale * LOG2E,
        D=D, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], num_warps=cfg["num_warps"],
        OVERLAP=bool(cfg.get("OVERLAP", False)) and idx.shape[1] > 0, SKIP=cfg.get("SKIP", 0))

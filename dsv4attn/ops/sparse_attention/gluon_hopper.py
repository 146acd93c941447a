"""Sparse MQA attention forward for Hopper (SM90) in Gluon: a producer warpgroup gathers rows, two consumer
warpgroups alternate blocks (ping-pong).

Same contract as the Triton forward (:func:`.triton._sparse_attn_fwd`, which launches this one): ``q (T, H, D)``
bf16/fp16 with H a multiple of 64, ``kv (N, D)`` (K = V), ``idx (T, K)`` int32 (-1 = empty slot), ``sink (H,)``
fp32 -> ``out (T, H, D)``, ``lse (T, H)`` fp32 (natural log, sink excluded; -inf and a zero output for rows without
a valid slot).

Why not Triton: one Triton program runs its blocks in order, scores -> softmax -> P V, with the tensor cores idle
during each block's softmax. Its pipeliner does make the row gather asynchronous (ttgir of the D = 512 forward on
Triton 3.6.0, 3.7.1 and 3.9.0: ``async_copy_global_to_local`` of the kv tile, the next block's slot indices loaded
one iteration ahead; two buffers on sm_90, one on sm_80, where the next copy only starts at the end of an
iteration); what it cannot do is split a program into a producer and consumers that overlap one block's softmax with
another's products. At T = 32K, H = 64, K = 640 on an H100 the Triton forward takes 10.3 ms (BENCHMARKS.md, the
thirtieth session's LSE_ONLY note), this kernel 6.4 (the twenty-seventh session's release table).

Each row's blocks end at its last valid slot (``index_sets.row_ends``, computed by the launcher): the empty slots of
a row's last part (a document's early rows in the top-k, the visible compressed entries of a dense or HCA row) trail
it, and the kernel skips their blocks (BENCHMARKS.md, fourteenth session: the dense CSA layer at 32K 298 -> 195 ms).

Layout: one program per (query row, 64-head block), three warpgroups (``gl.warp_specialize``):

- producer (40 registers per thread, ``REGS``): copies q, then the kv rows of every BLOCK_N slots into a ring of
  STAGES NVMMA-swizzled shared-memory tiles with ``cp.async``, each thread's completions arriving on
  ``full[stage]``; refills a stage once its consumers have arrived on ``empty[stage]`` (both consumers in the
  attention forward, the one that used it in the teacher-mass kernel). The next block's slot indices are loaded
  while it waits. (The producer's pieces are shared with the other Gluon kernels: :mod:`..gluon_common`.)
- consumer W (W = 0, 1) owns output columns [W * D/2, (W+1) * D/2) (a 64 x D/2 fp32 accumulator) and the softmax of
  blocks b = W, W + 2, ...: S = Q K^T over the full contraction (wgmma, N = BLOCK_N), the online softmax from the
  running max left by block b - 1, then P (bf16) and the row statistics (rescale factor, row sum, new max) go to
  shared memory (``pready[b % 2]``). For every block both consumers rescale and add P V for their columns (P read
  by the wgmma from shared memory) and release P's buffer (``pfree``) and the ring stage (``empty``). A consumer
  issues P V of the other's block and Q K^T of its own next block back to back (asynchronous wgmma), releasing the
  first's stage as soon as it is done. Each consumer loads its next block's slot indices (the validity mask) one
  block ahead. The output goes out through the consumer's (free by then) half of q's shared memory, for
  whole-sector stores.

:func:`teacher_mass` reuses the producer and ring for the indexer KL's teacher mass (two independent consumers), and
:func:`teacher_lse` for each head's LSE over the candidates (the warm-up teacher's full denominators: two consumer
parts combined by logaddexp). Given ``first`` (each row's candidates consecutive kv rows: the warm-up's every
visible entry on one device) both take their range form: one program per pair of rows (2p, 2p + 1) and head
block, whose rows share their kv blocks when their ranges start at one row (within a document); a TMA producer
streams the blocks once for both, and each consumer takes one row, with its q as the products' register operand.
The one-row kernels it replaced read every block from L2 once per row (by estimate near the L2 -> SM rate), and
their products re-read q from shared memory (BENCHMARKS.md). Where this Triton cannot build it: one warning, then the
gathering kernels (:func:`_launch_teacher`).

No cross-warpgroup reductions: each block's softmax lives in one warpgroup (rows reduce inside a quad of threads).
Gluon kernels run only on the GPU (no interpreter): the tests compare this kernel with the float64 reference on the
H200; CPU runs use the Triton kernel or the reference. :func:`available` says whether this path can run here.
"""
from __future__ import annotations

import warnings

import torch

from ..gluon_common import (BLOCK_H, IMPORTED, TensorDescriptor, async_copy, copy_heads, fence_async_shared, gl, gluon,
                            half_precision, mbarrier, mbarriers, program_row, release, ring_gather,
                            rotate_channel_pairs, row_blocks, sm90, store_heads, tma_load, warpgroup_mma,
                            warpgroup_mma_wait)
from ... import variants
from ..index_sets import row_ends

LOG2E = 1.4426950408889634
# BLOCK_N: gathered rows per block; STAGES: ring depth; REGS: registers per thread of the worker consumer and the
# producer (setmaxnreg; the first consumer gets the rest of the 64K). Fewer consumer registers spill; the other
# splits, smaller blocks and deeper rings measured slower or no faster (BENCHMARKS.md, the Gluon forward sections).
FWD_CONFIG = dict(BLOCK_N=64, STAGES=2, REGS=(216, 40))


def check(q: torch.Tensor) -> tuple[bool, str]:
    """(usable, reason) of this kernel for ``q``: Gluon imported, q on an SM90 GPU, bf16/fp16, H % 64 == 0 and
    D in (128, 256, 512)."""
    for usable, reason in (sm90(q.device), half_precision(q)):
        if not usable:
            return usable, reason
    if q.shape[1] % BLOCK_H:
        return False, f"needs H % {BLOCK_H} == 0, got H = {q.shape[1]}"
    if q.shape[2] not in (128, 256, 512):
        return False, f"needs D in (128, 256, 512), got D = {q.shape[2]}"
    return True, ""


def available(q: torch.Tensor) -> bool:
    return check(q)[0]


if IMPORTED:
    # Module-level numbers a jit function reads must be constexpr.
    LOG2E_C = gl.constexpr(LOG2E)
    LN2_C = gl.constexpr(0.6931471805599453)
    BLOCK_H_C = gl.constexpr(BLOCK_H)

    @gluon.jit
    def _finish(acc, m_i, l_i, SINK, OUT, LSE, COS, SIN, t, H, hb, col0: gl.constexpr, staging, D: gl.constexpr,
                WRITE_LSE: gl.constexpr, ROPE: gl.constexpr):
        # Sink in the denominator only: out = acc / (l + 2^(sink log2e - m)); rows without keys (l == 0) give 0.
        # ``acc`` holds output columns [col0, col0 + its width) of the 64 heads of head block ``hb``; it goes out
        # through ``staging`` (store_heads), rotated back first where those columns hold RoPE channels (ROPE > 0:
        # the layer's inverse RoPE, one rounding after it).
        row_layout: gl.constexpr = m_i.type.layout
        o_layout: gl.constexpr = acc.type.layout
        h_s = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=row_layout)
        sink = gl.load(SINK + h_s)
        m_safe = gl.where(m_i == float("-inf"), 0.0, m_i)
        denom = l_i + gl.exp2(sink * LOG2E_C - m_safe)
        has_keys = (l_i > 0) | (l_i != l_i)          # a NaN score propagates (as in the reference)
        if WRITE_LSE:
            lse = gl.where(has_keys, (m_safe + gl.log2(gl.where(has_keys, l_i, 1.0))) * LN2_C,
                           float("-inf"))
            gl.store(LSE + t * H + h_s, lse)
        scale_o = gl.where(has_keys, 1.0 / denom, 0.0)
        out = acc * gl.convert_layout(scale_o, gl.SliceLayout(1, o_layout))[:, None]
        if ROPE > 0 and col0 + acc.shape[1] > D - 2 * ROPE:
            out = rotate_channel_pairs(out, COS, SIN, t, col0, D, ROPE, -1)
        store_heads(out, OUT, t, H, hb, col0, staging, D)

    @gluon.jit
    def _pp_producer(Q, KV, IDX, H, K, nb, t, hb, q_smem, ring, full, empty, D: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr):
        # Producer warpgroup of the attention forward and the teacher mass: q, then the ring's nb blocks
        # (ring_gather).
        copy_heads(Q, H, t, hb, q_smem, D)
        async_copy.commit_group()           # waited for below even when K == 0 (no block arrives on full[])
        ring_gather(KV, IDX, K, nb, t, ring, full, empty, D, BLOCK_N, STAGES)

    @gluon.jit
    def _fwd_producer(Q, KV, IDX, NEND, H, K, t, hb, q_smem, ring, full, empty, D: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        _pp_producer(Q, KV, IDX, H, K, row_blocks(NEND, t, BLOCK_N), t, hb, q_smem, ring, full, empty, D, BLOCK_N,
                     STAGES)

    @gluon.jit
    def _pp_publish(s, m_i, b, p_buf, stats, pready, pfree):
        # Owner's softmax of block b (scaled scores s, log2 units, -inf at empty slots) from the running max m_i:
        # P (bf16) and the row statistics (rescale factor, row sum, new max) go to shared memory for both consumers
        # (pready[b % 2]) once both have released P of block b - 2 (pfree). Returns the statistics.
        half = b % 2
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # An all-empty block keeps m at -inf: shift by 0 instead so that no -inf - -inf NaN appears.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        row_sum = gl.sum(p, 1)
        mbarrier.wait(pfree.index(half), ((b // 2) + 1) & 1, pred=b >= 2)
        p_buf.index(half).store(p.to(p_buf.dtype))
        stats.index(3 * half).store(alpha)
        stats.index(3 * half + 1).store(row_sum)
        stats.index(3 * half + 2).store(m_new)
        fence_async_shared()
        mbarrier.arrive(pready.index(half))
        return alpha, row_sum, m_new

    @gluon.jit
    def _pp_take_over(b, l_i, acc, stats, full, pready, STAGES: gl.constexpr, row_layout: gl.constexpr):
        # The other consumer's block b, once its P is published: the running sum and max it left, and acc rescaled
        # to that max. Returns (l, m, acc).
        mbarrier.wait(full.index(b % STAGES), (b // STAGES) & 1)
        mbarrier.wait(pready.index(b % 2), (b // 2) & 1)
        fence_async_shared()
        alpha = stats.index(3 * (b % 2)).load(row_layout)
        l_i = l_i * alpha + stats.index(3 * (b % 2) + 1).load(row_layout)
        m_i = stats.index(3 * (b % 2) + 2).load(row_layout)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
        return l_i, m_i, acc

    @gluon.jit
    def _pp_consumer(IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, q_all, ring, p_buf, stats,
                     full, empty, pready, pfree, W: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, ROPE: gl.constexpr):
        # Ping-pong schedule, consumer warpgroup W: owns output columns [W * D/2, (W+1) * D/2) and the softmax of
        # blocks b with b % 2 == W (_pp_publish); every block, both warpgroups rescale and add P V for their columns.
        # The softmaxes run one after the other (block b's needs block b - 1's running max): the pace is set by
        # hand-over -> P V of b -> Q K^T of b + 1 -> softmax of b + 1 -> hand-over. So each iteration takes the
        # other's block b and this consumer's block c = b + 1 together: P V of b and Q K^T of c are issued back to
        # back (asynchronously, no idle tensor cores between them), b's stage is released once its P V is done
        # (waiting for all but the newest product), c's softmax starts once its Q K^T is (faster than P V, then
        # Q K^T, each waited for: BENCHMARKS.md, fifth session). The row's blocks end at its last valid slot
        # (row_blocks): every partition derives the count itself.
        # mbarrier.arrive is issued by one thread; Triton puts a barrier of the warpgroup before it (an arrive
        # counts as touching all shared memory), so every thread's stores are done when the other side wakes.
        HALF: gl.constexpr = D // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_base = t * K
        nb = row_blocks(NEND, t, BLOCK_N)
        m_i = gl.full([BLOCK_H_C], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([BLOCK_H_C], gl.float32, layout=row_layout)
        acc = gl.zeros([BLOCK_H_C, HALF], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_H_C, BLOCK_N], gl.float32, layout=s_layout)
        # The slot indices of this consumer's next block are loaded one block ahead: their global-load latency then
        # passes during the softmax and the hand-over instead of between the scores and the softmax, the chain that
        # sets the pace (BENCHMARKS.md, tenth session).
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        n = W * BLOCK_N + cols
        idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
        for b in range(W - 1, nb - 1, 2):          # b = -1: consumer 0's block 0 has no block before it
            c = b + 1
            c_stage = c % STAGES
            # Shared-memory operands through a block-dependent zero index z: with loop-invariant bases the compiler
            # hoisted the per-k-step wgmma descriptors out of the loop and spilled them (sm_90 compile: up to 205
            # spill instructions with q alone invariant, 48 with q made variant, 0 with every operand).
            z = (b + 1) // (nb + 1)     # 0 under truncating and flooring division alike
            q_smem = q_all.index(z)
            if b >= 0:
                l_i, m_i, acc = _pp_take_over(b, l_i, acc, stats, full, pready, STAGES, row_layout)
                acc = warpgroup_mma(p_buf.index(b % 2 + z), ring.index(b % STAGES + z).slice(W * HALF, HALF, dim=1),
                                    acc, is_async=True)
                mbarrier.wait(full.index(c_stage), (c // STAGES) & 1)
                fence_async_shared()
                s = warpgroup_mma(q_smem, ring.index(c_stage + z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
                mbarrier.arrive(pfree.index(b % 2))
                mbarrier.arrive(empty.index(b % STAGES))
                s = warpgroup_mma_wait(0, deps=[s])
            else:
                mbarrier.wait(full.index(c_stage), (c // STAGES) & 1)
                fence_async_shared()
                s = warpgroup_mma(q_smem, ring.index(c_stage + z).permute((1, 0)), s_zero, use_acc=False)
            s = gl.where((idx >= 0)[None, :], s * qk_scale_log2, float("-inf"))
            n = (c + 2) * BLOCK_N + cols
            idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
            alpha, row_sum, m_i = _pp_publish(s, m_i, c, p_buf, stats, pready, pfree)
            l_i = l_i * alpha + row_sum
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            acc = warpgroup_mma(p_buf.index(c % 2 + z), ring.index(c_stage + z).slice(W * HALF, HALF, dim=1), acc)
            mbarrier.arrive(pfree.index(c % 2))
            mbarrier.arrive(empty.index(c_stage))
        last = nb - 1
        if last % 2 != W:       # the other consumer's last block: no block of this one after it
            l_i, m_i, acc = _pp_take_over(last, l_i, acc, stats, full, pready, STAGES, row_layout)
            acc = warpgroup_mma(p_buf.index(last % 2), ring.index(last % STAGES).slice(W * HALF, HALF, dim=1), acc)
            mbarrier.arrive(pfree.index(last % 2))
            mbarrier.arrive(empty.index(last % STAGES))
        # Every Q K^T is done once either consumer gets here, so this consumer's half of q is free to stage its
        # output columns: the owner of the last block ran that Q K^T itself and, for the block before, waited for
        # the other's P (after the other's Q K^T); the other consumer waited for the last block's P. (nb >= 1: with
        # no block, both consumers would take "block -1" over and wait on barriers out of range; launch_fwd handles
        # K = 0.)
        _finish(acc, m_i, l_i, SINK, OUT, LSE, COS, SIN, t, H, hb, W * HALF,
                q_all.index(0).slice(W * HALF, HALF, dim=1), D, W == 0, ROPE)

    @gluon.jit
    def _sparse_attn_fwd_gluon(Q, KV, IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2,
                               D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                               num_warps: gl.constexpr, REGS: gl.constexpr, ROPE: gl.constexpr):
        # Three warpgroups: this partition and a worker are the consumers (_pp_consumer), a worker gathers.
        t, hb = program_row(H)
        dtype: gl.constexpr = Q.dtype.element_ty
        q_all = gl.allocate_shared_memory(dtype, [1, BLOCK_H_C, D],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_H_C, D], dtype))
        ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))
        p_buf = gl.allocate_shared_memory(dtype, [2, BLOCK_H_C, BLOCK_N],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_H_C, BLOCK_N], dtype))
        stats = gl.allocate_shared_memory(gl.float32, [6, BLOCK_H_C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        full = mbarriers(STAGES, 128)          # the producer's 128 threads' cp.async completions
        empty = mbarriers(STAGES, 2)           # both consumers done with the stage
        pready = mbarriers(2, 1)
        pfree = mbarriers(2, 2)
        gl.warp_specialize([
            (_pp_consumer, (IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, q_all, ring, p_buf,
                            stats, full, empty, pready, pfree, gl.constexpr(0), D, BLOCK_N, STAGES, ROPE)),
            (_pp_consumer, (IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, q_all, ring, p_buf,
                            stats, full, empty, pready, pfree, gl.constexpr(1), D, BLOCK_N, STAGES, ROPE)),
            (_fwd_producer, (Q, KV, IDX, NEND, H, K, t, hb, q_all.index(0), ring, full, empty, D, BLOCK_N,
                             STAGES))],
            [4, 4], [REGS[0], REGS[1]])

    @gluon.jit
    def _mass_producer(Q, CKV, IDX, NEND, H, K, q_smem, ring, full, empty, D: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr):
        t, hb = program_row(H)
        _pp_producer(Q, CKV, IDX, H, K, row_blocks(NEND, t, BLOCK_N), t, hb, q_smem, ring, full, empty, D, BLOCK_N,
                     STAGES)

    @gluon.jit
    def _teacher_scores(IDX, row_base, K, b, q_smem, ring, full, empty, s_zero, s_layout: gl.constexpr,
                        STAGES: gl.constexpr):
        # Block b of a teacher consumer: its slot numbers n, candidate rows idx (-1 past K) and s = Q C^T from the
        # ring stage, which is released right after the product.
        n = b * s_zero.shape[1] + gl.arange(0, s_zero.shape[1], layout=gl.SliceLayout(0, s_layout))
        idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
        mbarrier.wait(full.index(b % STAGES), (b // STAGES) & 1)
        fence_async_shared()
        s = warpgroup_mma(q_smem, ring.index(b % STAGES).permute((1, 0)), s_zero, use_acc=False)
        release(empty.index(b % STAGES))
        return n, idx, s

    @gluon.jit
    def _mass_consumer(IDX, NEND, FULL_LSE, MASS, H, K, qk_scale, q_smem, ring, full, empty,
                       W: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # Teacher mass, consumer warpgroup W: blocks b = W, W + 2, ... up to the row's last valid slot (independent:
        # no hand-over between the consumers): s = Q C^T, then m(j) = sum over this head block of
        # exp(scale s_h(j) - L_h) for the valid slots j, stored to MASS[hb, t, j]; the ring stage is released right
        # after the product. The difference is formed in natural units before the change to base 2: its rounding
        # then scales with |scale s - L|, small for the slots that carry the mass, not with |L|.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        t, hb = program_row(H)
        plane = MASS + hb.to(gl.int64) * (gl.num_programs(0) // (H // BLOCK_H_C)) * K    # this head block's (T, K)
        heads = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=gl.SliceLayout(1, s_layout))
        full_lse = gl.load(FULL_LSE + t * H + heads)
        full_lse = gl.where(full_lse == float("-inf"), 0.0, full_lse)    # a head without valid slots: p all 0
        s_zero = gl.zeros([BLOCK_H_C, BLOCK_N], gl.float32, layout=s_layout)
        row_base = t * K
        for b in range(W, row_blocks(NEND, t, BLOCK_N), 2):
            n, idx, s = _teacher_scores(IDX, row_base, K, b, q_smem, ring, full, empty, s_zero, s_layout, STAGES)
            p = gl.exp2((s * qk_scale - full_lse[:, None]) * LOG2E_C)
            mass = gl.sum(gl.where((idx >= 0)[None, :], p, 0.0), 0)
            gl.store(plane + row_base + n, mass, mask=n < K)

    @gluon.jit
    def _lse_consumer(IDX, NEND, LSE, H, K, qk_scale_log2, q_smem, ring, full, empty,
                      W: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # Teacher LSE, consumer warpgroup W: blocks b = W, W + 2, ... up to the row's last valid slot; per head the
        # online log2-sum-exp2 of scale log2(e) s_h(j) over this consumer's valid slots, stored (natural log, -inf
        # for none) to LSE[W, t, h]: the caller adds the two consumers' parts. Rows reduce inside a quad of threads.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        t, hb = program_row(H)
        heads = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=row_layout)
        # A finite floor for the running max: exp2(-inf - m) is then 0 for empty slots and never NaN.
        m_i = gl.full([BLOCK_H_C], -1.0e30, gl.float32, layout=row_layout)
        l_i = gl.zeros([BLOCK_H_C], gl.float32, layout=row_layout)
        s_zero = gl.zeros([BLOCK_H_C, BLOCK_N], gl.float32, layout=s_layout)
        row_base = t * K
        for b in range(W, row_blocks(NEND, t, BLOCK_N), 2):
            n, idx, s = _teacher_scores(IDX, row_base, K, b, q_smem, ring, full, empty, s_zero, s_layout, STAGES)
            s = gl.where((idx >= 0)[None, :], s * qk_scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            l_i = l_i * gl.exp2(m_i - m_new) + gl.sum(gl.exp2(s - m_new[:, None]), 1)
            m_i = m_new
        lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_i)) / LOG2E_C, float("-inf"))
        gl.store(LSE + (W * (gl.num_programs(0) // (H // BLOCK_H_C)) + t) * H + heads, lse)

    @gluon.jit
    def _teacher_buffers(dtype: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # The gathering teacher kernels' shared memory: q of the head block, the ring of STAGES blocks, and its
        # barriers (full: the producer's 128 threads; empty: each stage is used by one consumer warpgroup, whose 128
        # threads each arrive).
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H_C, D],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_H_C, D], dtype))
        ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))
        return q_smem, ring, mbarriers(STAGES, 128), mbarriers(STAGES, 128)

    @gluon.jit
    def _teacher_mass_gluon(Q, CKV, IDX, NEND, FULL_LSE, MASS, H, K, qk_scale,
                            D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
                            REGS: gl.constexpr):
        # MASS: (H // 64, T, K) fp32, one plane per head block (summed by the caller). Every partition derives its
        # row, head block and plane itself: values formed here before gl.warp_specialize reach the partitions
        # through a shared-memory slot, and Triton 3.9 placed that slot inside the first consumer's reduction
        # scratch (its head sum reduces across warps), so the other partitions could read a clobbered pointer
        # (wrong masses on the GPU; tests/ops/test_gluon_builds.py checks every kernel for such an overlap).
        q_smem, ring, full, empty = _teacher_buffers(Q.dtype.element_ty, D, BLOCK_N, STAGES)
        gl.warp_specialize([
            (_mass_consumer, (IDX, NEND, FULL_LSE, MASS, H, K, qk_scale, q_smem, ring, full, empty,
                              gl.constexpr(0), BLOCK_N, STAGES)),
            (_mass_consumer, (IDX, NEND, FULL_LSE, MASS, H, K, qk_scale, q_smem, ring, full, empty,
                              gl.constexpr(1), BLOCK_N, STAGES)),
            (_mass_producer, (Q, CKV, IDX, NEND, H, K, q_smem, ring, full, empty, D, BLOCK_N, STAGES))],
            [4, 4], [REGS[0], REGS[1]])

    @gluon.jit
    def _teacher_lse_gluon(Q, CKV, IDX, NEND, LSE, H, K, qk_scale_log2,
                           D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
                           REGS: gl.constexpr):
        # LSE: (2, T, H) fp32, one part per consumer (added by the caller). Same producer, ring and partition
        # rules as _teacher_mass_gluon.
        q_smem, ring, full, empty = _teacher_buffers(Q.dtype.element_ty, D, BLOCK_N, STAGES)
        gl.warp_specialize([
            (_lse_consumer, (IDX, NEND, LSE, H, K, qk_scale_log2, q_smem, ring, full, empty, gl.constexpr(0),
                             BLOCK_N, STAGES)),
            (_lse_consumer, (IDX, NEND, LSE, H, K, qk_scale_log2, q_smem, ring, full, empty, gl.constexpr(1),
                             BLOCK_N, STAGES)),
            (_mass_producer, (Q, CKV, IDX, NEND, H, K, q_smem, ring, full, empty, D, BLOCK_N, STAGES))],
            [4, 4], [REGS[0], REGS[1]])

    @gluon.jit
    def _pair_program(FIRST, NEND, T, H, BLOCK_N: gl.constexpr):
        # The range form's program: (pair p, head block hb), pairs in descending order (the warm-up's ranges grow
        # with the row: the longest pairs start first and the grid ends on short ones). Row 0 is 2p, row 1 2p + 1
        # (absent past T: has1 false). shared: both ranges start at one kv row, so one stream of blocks serves both
        # rows (max(nb0, nb1) blocks from first0); otherwise (a document starting at the odd row) the stream is row
        # 0's nb0 blocks from first0, then row 1's nb1 blocks from first1. nb = cdiv(NEND, BLOCK_N): none for a row
        # without a valid slot.
        nhb = H // BLOCK_H_C
        pid = gl.program_id(0)
        r0 = (2 * (gl.num_programs(0) // nhb - 1 - pid // nhb)).to(gl.int64)
        hb = pid % nhb
        has1 = r0 + 1 < T
        first0 = gl.load(FIRST + r0)
        first1 = gl.load(FIRST + r0 + 1, mask=has1, other=0)
        nb0 = gl.cdiv(gl.load(NEND + r0), BLOCK_N)
        nb1 = gl.cdiv(gl.load(NEND + r0 + 1, mask=has1, other=0), BLOCK_N)
        shared = has1 & (first0 == first1)
        stream = gl.where(shared, gl.maximum(nb0, nb1), nb0 + nb1)
        return r0, hb, has1, first0, first1, nb0, shared, stream

    @gluon.jit
    def _pair_producer(KV_DESC, FIRST, NEND, T, H, ring, full, empty, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr):
        # The stream's blocks by TMA copies into the ring; a stage is refilled once both consumers released it.
        # kv rows past the tensor read as zeros (the consumers mask the slots past each row's count).
        r0, hb, has1, first0, first1, nb0, shared, stream = _pair_program(FIRST, NEND, T, H, BLOCK_N)
        for b in range(stream):
            stage = b % STAGES
            mbarrier.wait(empty.index(stage), ((b // STAGES) + 1) & 1, pred=b >= STAGES)
            mbarrier.expect(full.index(stage), KV_DESC.block_type.nbytes)
            second = (b >= nb0) & (first0 != first1)       # row 1's own blocks (never when has1 is false)
            start = gl.where(second, first1 + (b - nb0) * BLOCK_N, first0 + b * BLOCK_N)
            tma_load(KV_DESC, [start, 0], full.index(stage), ring.index(stage))

    @gluon.jit
    def _pair_row(Q, FIRST, NEND, T, H, W: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                  q_layout: gl.constexpr):
        # Consumer W's row (r0 + W), whether it exists, its first stream block, the stream's length and the row's
        # 64 heads of q, loaded straight into registers as the products' A operand: the ring takes the shared
        # memory, and each product then reads only its kv tile from it.
        r0, hb, has1, first0, first1, nb0, shared, stream = _pair_program(FIRST, NEND, T, H, BLOCK_N)
        row = r0 + W
        if W == 0:
            ok = r0 >= 0
            lo = nb0 * 0
        else:
            ok = has1
            lo = gl.where(shared, 0, nb0)
        heads = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=gl.SliceLayout(1, q_layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
        q = gl.load(Q + (row * H + heads)[:, None] * D + cols[None, :], mask=(heads >= 0)[:, None] & ok, other=0.0)
        return row, hb, ok, lo, stream, q

    @gluon.jit
    def _pair_scores(q, IDX, row, ok, K, j, b, ring, full, empty, s_zero, s_layout: gl.constexpr,
                     STAGES: gl.constexpr):
        # Stream block b as the row's block j (a block of the other row's range, or past this row's blocks, has no
        # valid slot here: j outside [0, K / BLOCK_N) or IDX -1): slot numbers n, candidate rows idx and s = Q C^T,
        # the stage released right after the product.
        n = j * s_zero.shape[1] + gl.arange(0, s_zero.shape[1], layout=gl.SliceLayout(0, s_layout))
        idx = gl.load(IDX + row * K + n, mask=(n >= 0) & (n < K) & ok, other=-1)
        mbarrier.wait(full.index(b % STAGES), (b // STAGES) & 1)
        s = warpgroup_mma(q, ring.index(b % STAGES).permute((1, 0)), s_zero, use_acc=False)
        release(empty.index(b % STAGES))
        return n, idx, s

    @gluon.jit
    def _lse_pair_consumer(Q, FIRST, IDX, NEND, LSE, T, H, K, qk_scale_log2, ring, full, empty, W: gl.constexpr,
                           D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # Teacher LSE of row r0 + W over every block of the stream that holds its slots: the online log2-sum-exp2
        # of each head in two parts, the row's even and odd blocks (the parts the gathering kernel's two consumers
        # form, so the two forms agree bit for bit), stored to LSE[part, row, h] for the caller's logaddexp. A
        # block without a valid slot of the row leaves both parts unchanged (exp2(-inf - m) = 0, max unchanged).
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        row, hb, ok, lo, stream, q = _pair_row(Q, FIRST, NEND, T, H, W, D, BLOCK_N, q_layout)
        heads = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=row_layout)
        m_even = gl.full([BLOCK_H_C], -1.0e30, gl.float32, layout=row_layout)    # finite: exp2(-inf - m) = 0
        l_even = gl.zeros([BLOCK_H_C], gl.float32, layout=row_layout)
        m_odd = m_even
        l_odd = l_even
        s_zero = gl.zeros([BLOCK_H_C, BLOCK_N], gl.float32, layout=s_layout)
        for b in range(stream):
            j = b - lo
            n, idx, s = _pair_scores(q, IDX, row, ok, K, j, b, ring, full, empty, s_zero, s_layout, STAGES)
            s = gl.where((idx >= 0)[None, :], s * qk_scale_log2, float("-inf"))
            even = (j % 2) == 0
            m_i = gl.where(even, m_even, m_odd)
            l_i = gl.where(even, l_even, l_odd)
            m_new = gl.maximum(m_i, gl.max(s, 1))
            l_i = l_i * gl.exp2(m_i - m_new) + gl.sum(gl.exp2(s - m_new[:, None]), 1)
            m_even = gl.where(even, m_new, m_even)
            l_even = gl.where(even, l_i, l_even)
            m_odd = gl.where(even, m_odd, m_new)
            l_odd = gl.where(even, l_odd, l_i)
        lse_even = gl.where(l_even > 0.0, (m_even + gl.log2(l_even)) / LOG2E_C, float("-inf"))
        lse_odd = gl.where(l_odd > 0.0, (m_odd + gl.log2(l_odd)) / LOG2E_C, float("-inf"))
        gl.store(LSE + (row * H + heads), lse_even, mask=(heads >= 0) & ok)
        gl.store(LSE + ((T + row) * H + heads), lse_odd, mask=(heads >= 0) & ok)

    @gluon.jit
    def _mass_pair_consumer(Q, FIRST, IDX, NEND, FULL_LSE, MASS, T, H, K, qk_scale, ring, full, empty,
                            W: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # Teacher mass of row r0 + W: for each block of the stream that holds its slots, as _mass_consumer forms it,
        # stored to MASS[hb, row, j] (the same values as the gathering kernel).
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        row, hb, ok, lo, stream, q = _pair_row(Q, FIRST, NEND, T, H, W, D, BLOCK_N, q_layout)
        plane = MASS + hb.to(gl.int64) * T * K
        heads = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=gl.SliceLayout(1, s_layout))
        full_lse = gl.load(FULL_LSE + row * H + heads, mask=(heads >= 0) & ok, other=0.0)
        full_lse = gl.where(full_lse == float("-inf"), 0.0, full_lse)    # a head without valid slots: p all 0
        s_zero = gl.zeros([BLOCK_H_C, BLOCK_N], gl.float32, layout=s_layout)
        for b in range(stream):
            j = b - lo
            n, idx, s = _pair_scores(q, IDX, row, ok, K, j, b, ring, full, empty, s_zero, s_layout, STAGES)
            p = gl.exp2((s * qk_scale - full_lse[:, None]) * LOG2E_C)
            mass = gl.sum(gl.where((idx >= 0)[None, :], p, 0.0), 0)
            gl.store(plane + row * K + n, mass, mask=(n >= 0) & (n < K) & ok)

    @gluon.jit
    def _pair_ring(dtype: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # The range form's shared memory: the ring (the kv descriptor's layout) and its barriers (full: one
        # expect-bytes arrival per TMA block; empty: both consumers' 128 threads each).
        ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))
        return ring, mbarriers(STAGES, 1), mbarriers(STAGES, 256)

    @gluon.jit
    def _teacher_mass_ranges_gluon(Q, KV_DESC, FIRST, IDX, NEND, FULL_LSE, MASS, T, H, K, qk_scale,
                                   D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                   num_warps: gl.constexpr, REGS: gl.constexpr):
        # _teacher_mass_gluon's values for candidates that are ranges, two rows a program (_pair_program): each kv
        # block is read once for both rows, half the L2 traffic of the one-row kernel (1.19-1.28x at 32K).
        ring, full, empty = _pair_ring(KV_DESC.dtype, D, BLOCK_N, STAGES)
        gl.warp_specialize([
            (_mass_pair_consumer, (Q, FIRST, IDX, NEND, FULL_LSE, MASS, T, H, K, qk_scale, ring, full, empty,
                                   gl.constexpr(0), D, BLOCK_N, STAGES)),
            (_mass_pair_consumer, (Q, FIRST, IDX, NEND, FULL_LSE, MASS, T, H, K, qk_scale, ring, full, empty,
                                   gl.constexpr(1), D, BLOCK_N, STAGES)),
            (_pair_producer, (KV_DESC, FIRST, NEND, T, H, ring, full, empty, BLOCK_N, STAGES))],
            [4, 4], [REGS[0], REGS[1]])

    @gluon.jit
    def _teacher_lse_ranges_gluon(Q, KV_DESC, FIRST, IDX, NEND, LSE, T, H, K, qk_scale_log2,
                                  D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                  num_warps: gl.constexpr, REGS: gl.constexpr):
        # _teacher_lse_gluon's values (LSE: (2, T, H), the even and odd blocks' parts) for ranges, two rows a
        # program as _teacher_mass_ranges_gluon.
        ring, full, empty = _pair_ring(KV_DESC.dtype, D, BLOCK_N, STAGES)
        gl.warp_specialize([
            (_lse_pair_consumer, (Q, FIRST, IDX, NEND, LSE, T, H, K, qk_scale_log2, ring, full, empty,
                                  gl.constexpr(0), D, BLOCK_N, STAGES)),
            (_lse_pair_consumer, (Q, FIRST, IDX, NEND, LSE, T, H, K, qk_scale_log2, ring, full, empty,
                                  gl.constexpr(1), D, BLOCK_N, STAGES)),
            (_pair_producer, (KV_DESC, FIRST, NEND, T, H, ring, full, empty, BLOCK_N, STAGES))],
            [4, 4], [REGS[0], REGS[1]])


def checked_config(config, what: str, defaults: dict = FWD_CONFIG, block_ns: tuple = (16, 32, 64)) -> dict:
    """``defaults`` updated with ``config``; unknown keys and a BLOCK_N outside ``block_ns`` (the producer gathers
    16 rows at a time; a kernel may allow fewer sizes) are refused."""
    unknown = sorted(set(config or {}) - set(defaults))
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown}; expected some of {sorted(defaults)}")
    cfg = dict(defaults, **(config or {}))
    if cfg["BLOCK_N"] not in block_ns:
        allowed = ", ".join(map(str, block_ns[:-1])) + f" or {block_ns[-1]}"
        raise ValueError(f"{what}: BLOCK_N must be {allowed} (rows gathered 16 at a time), got {cfg['BLOCK_N']}")
    return cfg


def launch_fwd(q, kv, idx, sink, out, lse, scale, config=None, rope=None):
    """Fills ``out`` (T, H, D) and ``lse`` (T, H) for T >= 1 rows and a kv of >= 1 row (the caller,
    :func:`.triton._sparse_attn_fwd`, allocates them and handles the empty cases). ``config``: FWD_CONFIG keys.
    ``rope``: None or the (T, R/2) fp32 (cos, sin) tables: ``out`` rotated back by -angle on its last R channels."""
    cfg = checked_config(config, "Gluon forward config")
    T, H, D = q.shape
    if idx.shape[1] == 0:       # every row empty (the kernel's consumers need at least one block)
        out.zero_()
        lse.fill_(float("-inf"))
        return
    cos, sin = rope if rope is not None else (q, q)        # never read without RoPE channels (ROPE = 0)
    _sparse_attn_fwd_gluon[(T * (H // BLOCK_H),)](
        q, kv, idx, row_ends(idx), sink, out, lse, cos, sin, H, idx.shape[1], scale * LOG2E,
        D=D, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], num_warps=4, REGS=tuple(cfg["REGS"]),
        ROPE=0 if rope is None else cos.shape[1])


def _teacher_config(config, what: str) -> dict:
    cfg = checked_config(config, what)
    if cfg["STAGES"] < 2 or cfg["STAGES"] % 2:
        # Each consumer takes every other block, so with an even ring each owns its stages; with an odd one a
        # consumer's parity wait on a stage it skipped a use of would rely on the order the copies complete.
        raise ValueError(f"{what}: STAGES must be even and >= 2, got {cfg['STAGES']}")
    return cfg


# The range form's ring: as many stages of BLOCK_N kv rows as fit in this many bytes, 2 to 4 (three 64-row stages
# at D = 512; q lives in the consumers' registers, not in shared memory).
PAIR_RING_BYTES = 192 * 1024
# Registers per thread of the range form's worker consumer and producer (setmaxnreg): each consumer holds its row's
# 64 x D q as the products' register operand (128 registers at D = 512); the TMA producer needs few.
PAIR_REGS = (232, 24)


def _pair_stages(block_n: int, D: int) -> int:
    return max(2, min(4, PAIR_RING_BYTES // (block_n * D * 2)))


def _kv_desc(compressed_kv, block_n: int):
    """TMA descriptor of the kv in blocks of ``block_n`` rows, with the layout of the range form's ring."""
    D = compressed_kv.shape[1]
    dt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[compressed_kv.dtype]   # half_precision: one of two
    return TensorDescriptor.from_tensor(compressed_kv, [block_n, D],
                                        gl.NVMMASharedLayout.get_default_for([block_n, D], dt))


# (D, dtype) -> why this process's Triton could not build the teacher kernels' range form: the gathering kernels
# (the same values, by cp.async gathers instead of TMA copies) serve those shapes from then on.
RANGE_FORM_FAILED: dict = {}


def _launch_teacher(gathering, ranges, q, compressed_kv, candidates, cfg: dict, first, n_end, out, K: int,
                    scale: float, full_lse=None):
    """One teacher kernel (``out``: the mass planes, or the LSE parts) over q's rows. Given ``first``, its range
    form (two rows a program, kv blocks by TMA) unless the kv's base is not 16-byte aligned (TMA needs it) or the
    shape's range form failed to build; else the gathering kernel. A range form this Triton cannot build (Gluon's
    TMA API moves between releases) warns once for the shape and falls back to gathering; other errors, and any
    error with the Gluon kernels asked for (``DSV4ATTN_KERNELS=gluon``), propagate."""
    q, compressed_kv = q.contiguous(), compressed_kv.contiguous()
    T, H, D = q.shape
    lead = () if full_lse is None else (full_lse,)
    if not (first is None or compressed_kv.data_ptr() % 16
            or (D, q.dtype) in RANGE_FORM_FAILED):
        try:
            ranges[((T + 1) // 2 * (H // BLOCK_H),)](
                q, _kv_desc(compressed_kv, cfg["BLOCK_N"]), first.to(torch.int32).contiguous(), candidates, n_end,
                *lead, out, T, H, K, scale, D=D, BLOCK_N=cfg["BLOCK_N"], STAGES=_pair_stages(cfg["BLOCK_N"], D),
                num_warps=4, REGS=PAIR_REGS)
            return
        except Exception as exc:
            if not variants.gluon_build_error(exc) or variants.strict():
                raise
            import triton
            RANGE_FORM_FAILED[(D, q.dtype)] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"dsv4attn: the Gluon teacher kernels' range form (TMA) could not be built for D={D} "
                          f"{q.dtype} by Triton {triton.__version__} ({type(exc).__name__}: {str(exc)[:500]}); "
                          "the gathering teacher kernels serve it", RuntimeWarning, stacklevel=3)
    gathering[(T * (H // BLOCK_H),)](q, compressed_kv, candidates, n_end, *lead, out, H, K, scale, D=D,
                                     BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], num_warps=4,
                                     REGS=tuple(cfg["REGS"]))


def teacher_mass(q, compressed_kv, candidates, full_lse, scale, config=None, n_end=None, first=None):
    """Indexer-KL teacher mass m(t, j) = sum_h exp(scale q[t, h] . C[candidates[t, j]] - full_lse[t, h]) for the
    valid slots (0 for -1 slots): q (T, H, D) bf16/fp16 with :func:`available`, compressed_kv (N >= 1, D) in q's
    dtype, candidates (T, K) int32, full_lse (T, H) fp32 natural log -> (T, K) fp32. The KL's teacher logits, on the
    attention forward's producer + ring; what ``indexer_kl(..., full_lse=...)`` would otherwise form in Triton.
    ``n_end``: the candidates' row ends (``index_sets.row_ends``) if the caller has them (never below a row's last
    valid slot + 1: the range form scores the stream's other blocks against the row only where its slots are -1);
    each row's blocks stop at its last valid slot. ``first``: (T,) int, given when row t's candidates are the kv
    rows ``first[t] + j`` for its valid slots j < its count (slots past it -1; the warm-up's every visible entry on
    one device): the kv blocks then come by TMA copies, two rows a program, q in registers (the same values)."""
    cfg = _teacher_config(config, "teacher_mass config")
    T, H, D = q.shape
    K = candidates.shape[1]
    # Zeros: the slots past a row's last valid one are not written.
    planes = torch.zeros(H // BLOCK_H, T, K, dtype=torch.float32, device=q.device)
    if T and K:
        _launch_teacher(_teacher_mass_gluon, _teacher_mass_ranges_gluon, q, compressed_kv, candidates, cfg, first,
                        row_ends(candidates) if n_end is None else n_end, planes, K, scale,
                        full_lse=full_lse.float().contiguous())
    return planes[0] if planes.shape[0] == 1 else planes.sum(0)


def teacher_lse(q, compressed_kv, candidates, scale, config=None, n_end=None, first=None):
    """Per head, the natural-log sum of exp(scale q[t, h] . C[candidates[t, j]]) over the valid slots j (-inf for a
    row without one): (T, H) fp32, for q / compressed_kv / candidates as :func:`teacher_mass` takes them. The
    teacher's mass over its candidates, for a full denominator that is not the attention's own (the warm-up's
    every visible entry). ``first``: as :func:`teacher_mass` takes it."""
    cfg = _teacher_config(config, "teacher_lse config")
    T, H, D = q.shape
    K = candidates.shape[1]
    if T == 0 or K == 0:
        return torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    parts = torch.empty(2, T, H, dtype=torch.float32, device=q.device)
    _launch_teacher(_teacher_lse_gluon, _teacher_lse_ranges_gluon, q, compressed_kv, candidates, cfg, first,
                    row_ends(candidates) if n_end is None else n_end, parts, K, scale * LOG2E)
    return torch.logaddexp(parts[0], parts[1])

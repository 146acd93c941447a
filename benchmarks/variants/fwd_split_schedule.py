"""Probe: the attention forward with both consumers forming scores at once (each its own block of a pair), the row
max handed from consumer 0 to consumer 1, each P V of its own block from registers, the other's P from shared
memory. Same contract as gluon_hopper.launch_fwd. SPLIT_HALVES: ring stages filled and released in 256-column
halves (producer order: own-left of block 0, right of block 1, right of block 0, left of block 1)."""
from __future__ import annotations

import torch

from dsv4attn.ops.gluon_common import (BLOCK_H, async_copy, copy_heads, fence_async_shared, gather_rows, gl, gluon,
                                       mbarrier, mbarriers, program_row, ring_gather, row_blocks, slot_rows,
                                       warpgroup_mma, warpgroup_mma_wait)
from dsv4attn.ops.sparse_attention.gluon_hopper import LOG2E, _finish, checked_config
from dsv4attn.ops.index_sets import row_ends

BLOCK_H_C = gl.constexpr(BLOCK_H)


@gluon.jit
def _gather_tile(ring, tile, half, i0, i1, i2, i3, KV, cols, D: gl.constexpr):
    # Columns [half * D/2, (half + 1) * D/2) of a block's 64 rows (slot indices i0..i3, 16 each) into ring tile
    # ``tile`` (64 x D/2).
    dst = ring.index(tile)
    base = KV + half * (D // 2)
    gather_rows(dst, 0, i0, base, cols, D)
    gather_rows(dst, 16, i1, base, cols, D)
    gather_rows(dst, 32, i2, base, cols, D)
    gather_rows(dst, 48, i3, base, cols, D)


@gluon.jit
def _split_producer(Q, KV, IDX, NEND, H, K, t, hb, q_smem, ring, full, empty, D: gl.constexpr,
                    BLOCK_N: gl.constexpr, HALVES: gl.constexpr):
    # Ring: 4 tiles of 64 rows x D/2 columns, tile 2 s + h = stage s (block 2i + s of pair i), column half h.
    # HALVES: each tile filled and released on its own (the order FlashMLA's producer uses: block 2i's left half,
    # block 2i+1's right half, 2i's right, 2i+1's left: each consumer's own P V half first); else per stage.
    nb = row_blocks(NEND, t, BLOCK_N)
    npair = (nb + 1) // 2
    copy_heads(Q, H, t, hb, q_smem, D)
    async_copy.commit_group()
    io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    n_layout: gl.constexpr = gl.SliceLayout(1, io)
    cols = gl.arange(0, D // 2, layout=gl.SliceLayout(0, io))
    row_base = t * K
    # One set of slot indices live at a time, loaded right after the part before is issued (their latency passes
    # during the next wait).
    i0 = slot_rows(IDX, row_base, 0, 0, K, BLOCK_N, n_layout)
    i1 = slot_rows(IDX, row_base, 0, 16, K, BLOCK_N, n_layout)
    i2 = slot_rows(IDX, row_base, 0, 32, K, BLOCK_N, n_layout)
    i3 = slot_rows(IDX, row_base, 0, 48, K, BLOCK_N, n_layout)
    for i in range(npair):
        ph = (i + 1) & 1
        for part in range(4):
            if HALVES:
                stage = part % 2
                half = (part + part // 2) % 2
                nxt = 2 * i + (part + 1) % 2 + 2 * ((part + 1) // 4)
                mbarrier.wait(empty.index(2 * stage + half), ph, pred=i >= 1)
            else:
                stage = part // 2
                half = part % 2
                nxt = 2 * i + (part + 1) // 2
                if half == 0:
                    mbarrier.wait(empty.index(stage), ph, pred=i >= 1)
            _gather_tile(ring, 2 * stage + half, half, i0, i1, i2, i3, KV, cols, D)
            if HALVES:
                async_copy.mbarrier_arrive(full.index(2 * stage + half), increment_count=False)
            elif half == 1:
                async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
            async_copy.commit_group()
            if (part % 2 == 1) or HALVES:
                i0 = slot_rows(IDX, row_base, nxt, 0, K, BLOCK_N, n_layout)
                i1 = slot_rows(IDX, row_base, nxt, 16, K, BLOCK_N, n_layout)
                i2 = slot_rows(IDX, row_base, nxt, 32, K, BLOCK_N, n_layout)
                i3 = slot_rows(IDX, row_base, nxt, 48, K, BLOCK_N, n_layout)
    async_copy.wait_group(0)


@gluon.jit
def _split_consumer(IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, q_all, ring, s_buf, m_buf,
                    l_buf, full, empty, mx, sready, done, W: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                    ROPE: gl.constexpr, HALVES: gl.constexpr, PIPE: gl.constexpr):
    HALF: gl.constexpr = D // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = ring.dtype
    row_base = t * K
    nb = row_blocks(NEND, t, BLOCK_N)
    npair = (nb + 1) // 2
    m_i = gl.full([BLOCK_H_C], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_H_C], gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_H_C, HALF], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_H_C, BLOCK_N], gl.float32, layout=s_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    n = W * BLOCK_N + cols
    idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
    mine = 2 * W + W                  # this consumer's P V tile of its own block
    if PIPE and W == 0:                # consumer 0 issues each next block's scores behind its last P V
        mbarrier.wait(full.index(0), 0)
        fence_async_shared()
        s = warpgroup_mma(q_all.index(0).slice(0, HALF, dim=1), ring.index(0).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        if HALVES:
            mbarrier.wait(full.index(1), 0)
            fence_async_shared()
        s = warpgroup_mma(q_all.index(0).slice(HALF, HALF, dim=1), ring.index(1).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
    for i in range(npair):
        b = 2 * i + W
        ph = i & 1
        z = b // (K + 1)
        q_smem = q_all.index(z)
        if not (PIPE and W == 0):
            if HALVES:
                mbarrier.wait(full.index(mine), ph)
            else:
                mbarrier.wait(full.index(W), ph)
            fence_async_shared()
            s = warpgroup_mma(q_smem.slice(W * HALF, HALF, dim=1), ring.index(mine + z).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            if HALVES:
                mbarrier.wait(full.index(2 * W + 1 - W), ph)
                fence_async_shared()
            s = warpgroup_mma(q_smem.slice((1 - W) * HALF, HALF, dim=1),
                              ring.index(2 * W + 1 - W + z).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
        s = gl.where((idx >= 0)[None, :], s * qk_scale_log2, float("-inf"))
        n = (b + 2) * BLOCK_N + cols
        idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
        if W == 0:
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_buf.index(0).store(m_new)
            mbarrier.arrive(mx.index(0))
        else:
            mbarrier.wait(mx.index(0), ph)
            m_new = gl.maximum(m_buf.index(0).load(row_layout), gl.max(s, 1))
            m_buf.index(1).store(m_new)
            mbarrier.arrive(mx.index(1))
        # An all-empty block keeps m at -inf: shift by 0 instead so that no -inf - -inf NaN appears.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p_op, ring.index(mine + z), acc, is_async=True)
        if W == 0:
            mbarrier.wait(mx.index(1), ph)
            m_fin = m_buf.index(1).load(row_layout)
            factor = gl.exp2(m_new - gl.where(m_fin == float("-inf"), 0.0, m_fin))
            s_buf.index(0).store((p * factor[:, None]).to(dtype))
            fence_async_shared()
            mbarrier.arrive(sready.index(0))
            acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            if HALVES or PIPE:
                mbarrier.arrive(empty.index(0))              # tile (0, L) / stage 0: own Q K^T and P V done
            acc = acc * gl.convert_layout(factor, o_rows)[:, None]
            l_i = l_i * factor
            m_i = m_fin
            mbarrier.wait(sready.index(1), ph)
            if PIPE:
                if i + 1 < npair:
                    acc = warpgroup_mma(s_buf.index(1 + z), ring.index(2 + z), acc, is_async=True)
                    # Block b + 2's scores queue behind this P V: no idle tensor cores between them.
                    mbarrier.wait(full.index(0), ph ^ 1)
                    fence_async_shared()
                    s = warpgroup_mma(q_smem.slice(0, HALF, dim=1), ring.index(0 + z).permute((1, 0)), s_zero,
                                      use_acc=False, is_async=True)
                    acc = warpgroup_mma_wait(1, deps=[acc])
                    mbarrier.arrive(empty.index(2 if HALVES else 1))     # tile (1, L) / stage 1 done here
                    if HALVES:
                        mbarrier.wait(full.index(1), ph ^ 1)
                        fence_async_shared()
                    s = warpgroup_mma(q_smem.slice(HALF, HALF, dim=1), ring.index(1 + z).permute((1, 0)), s,
                                      is_async=True)
                    s = warpgroup_mma_wait(0, deps=[s])
                else:
                    acc = warpgroup_mma(s_buf.index(1 + z), ring.index(2 + z), acc)
                    mbarrier.arrive(empty.index(2 if HALVES else 1))
            else:
                acc = warpgroup_mma(s_buf.index(1 + z), ring.index(2 + z), acc)
                if HALVES:
                    mbarrier.arrive(empty.index(2))              # tile (1, L): the other's block, left half
                else:
                    mbarrier.arrive(empty.index(0))
                    mbarrier.arrive(empty.index(1))
        else:
            m_i = m_new
            s_buf.index(1).store(p.to(dtype))
            fence_async_shared()
            mbarrier.arrive(sready.index(1))
            mbarrier.wait(sready.index(0), ph)
            acc = warpgroup_mma(s_buf.index(0 + z), ring.index(1 + z), acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(1, deps=[acc, p_op])
            if HALVES:
                mbarrier.arrive(empty.index(3))              # tile (1, R): own Q K^T and P V done
            acc = warpgroup_mma_wait(0, deps=[acc])
            if HALVES:
                mbarrier.arrive(empty.index(1))              # tile (0, R): the other's block, right half
            else:
                mbarrier.arrive(empty.index(0))
                mbarrier.arrive(empty.index(1))
    # Each consumer summed the exponentials of its own blocks: exchange the sums.
    l_buf.index(W).store(l_i)
    mbarrier.arrive(done.index(W))
    mbarrier.wait(done.index(1 - W), 0)
    l_all = l_i + l_buf.index(1 - W).load(row_layout)
    _finish(acc, m_i, l_all, SINK, OUT, LSE, COS, SIN, t, H, hb, W * HALF,
            q_all.index(0).slice(W * HALF, HALF, dim=1), D, W == 0, ROPE)


@gluon.jit
def _split_fwd(Q, KV, IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, D: gl.constexpr,
               BLOCK_N: gl.constexpr, num_warps: gl.constexpr, REGS: gl.constexpr, ROPE: gl.constexpr,
               HALVES: gl.constexpr, PIPE: gl.constexpr):
    t, hb = program_row(H)
    dtype: gl.constexpr = Q.dtype.element_ty
    q_all = gl.allocate_shared_memory(dtype, [1, BLOCK_H_C, D],
                                      gl.NVMMASharedLayout.get_default_for([BLOCK_H_C, D], dtype))
    ring = gl.allocate_shared_memory(dtype, [4, BLOCK_N, D // 2],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_N, D // 2], dtype))
    s_buf = gl.allocate_shared_memory(dtype, [2, BLOCK_H_C, BLOCK_N],
                                      gl.NVMMASharedLayout.get_default_for([BLOCK_H_C, BLOCK_N], dtype))
    m_buf = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H_C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    l_buf = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H_C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if HALVES:
        full = mbarriers(4, 128)       # (stage, half) = 2 stage + half
        empty = mbarriers(4, 1)        # each half-stage is last used by one consumer
    else:
        full = mbarriers(2, 128)
        empty = mbarriers(2, 2)
    mx = mbarriers(2, 1)
    sready = mbarriers(2, 1)
    done = mbarriers(2, 1)
    gl.warp_specialize([
        (_split_consumer, (IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, q_all, ring, s_buf, m_buf,
                           l_buf, full, empty, mx, sready, done, gl.constexpr(0), D, BLOCK_N, ROPE, HALVES, PIPE)),
        (_split_consumer, (IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, q_all, ring, s_buf, m_buf,
                           l_buf, full, empty, mx, sready, done, gl.constexpr(1), D, BLOCK_N, ROPE, HALVES, PIPE)),
        (_split_producer, (Q, KV, IDX, NEND, H, K, t, hb, q_all.index(0), ring, full, empty, D, BLOCK_N, HALVES))],
        [4, 4], [REGS[0], REGS[1]])


def make_launch(halves: bool, regs=(216, 40), pipe=False):
    def launch_fwd(q, kv, idx, sink, out, lse, scale, config=None, rope=None):
        T, H, D = q.shape
        cos, sin = rope if rope is not None else (q, q)
        _split_fwd[(T * (H // BLOCK_H),)](
            q, kv, idx, row_ends(idx), sink, out, lse, cos, sin, H, idx.shape[1], scale * LOG2E,
            D=D, BLOCK_N=64, num_warps=4, REGS=tuple(regs), ROPE=0 if rope is None else cos.shape[1],
            HALVES=halves, PIPE=pipe)
    return launch_fwd

"""The attention forward with several (row, head block) items a program (ITEMS), to be timed beside the shipped
kernel (one item a program) and FlashMLA. The fixed cost of a program (q in, output out, start-up) is ~1.1 of the
6.2 ms at T = 32K, H = 64, the same in FlashMLA (BENCHMARKS.md, eleventh session's K sweep). With ITEMS rows a
program the next item's q is copied while the last item's output goes out (through the last block's ring stage,
whose release waits for the stores), and the ring runs on across items: part of that cost is hidden.

The items loop is a runtime loop: unrolled (``gl.static_range``), ptxas spilled 692 / 952 bytes on Triton 3.9.0;
as a loop 116 / 140 on 3.9.0 and none on 3.6.0 / 3.7.1 (offline, sm_90, the output rotation on).

    python benchmarks/kernel_variants.py benchmarks/variants/fwd_items.py --T 32768 8192 1001 --H 64 128 \
        --flashmla .peers/flashmla --rounds 5

Below 4096 rows the inputs are ragged (``inputs``: rows of 0 to K valid slots, scattered empty slots, every
seventh row empty) and each call runs the kernel with and without the output rotation: items of 1 to 10 blocks
side by side in one program, compared bitwise with the shipped kernel.

``items2_early`` / ``items4_early`` gather an item's first kv block before its q (as soon as the block's stage
is free, during the previous item's last blocks); the 40-register producer then spills (below).

Offline sm_90 builds (spill stores / loads, bytes; the output rotation on):

| variant | Triton 3.6.0 | 3.7.1 | 3.9.0 |
|---|---|---|---|
| shipped | 0 / 0 | 0 / 0 | 12 / 44 |
| items2, items4 | 0 / 0 | 0 / 0 | 116 / 140, 104 / 128 |
| items2_unrolled | 120 / 144 | 208 / 232 | 692 / 952 |
| items2_early, items4_early | 184 / 184 | 212 / 212, 180 / 180 | 328 / 352 |

A runtime loop over items around the consumers' block loop is what the fourteenth session's persistent forward had
when it faulted (a Q K^T reading shared memory out of range, cause not found; BENCHMARKS.md): should ``items2``
fault, ``items2_unrolled`` (the same items as straight-line code; 120 / 144 bytes of spills on 3.6.0, 208 / 232 on
3.7.1, offline) tells whether the loop is what the compiler gets wrong. Run them under compute-sanitizer on a small
shape first.
"""
BUILD_SIGNATURE = {"n_items": "i32"}

# The shipped text each change replaces, and its replacement.
_OLD_KERNEL = r'''    @gluon.jit
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

'''

_NEW_KERNEL = r'''    @gluon.jit
    def _program_item(r, ITEMS: gl.constexpr, n_items, H):
        # (query row t as int64, head block hb) of this program's item r: items pid * ITEMS + r, the last program's
        # past the end clamped to the last item (computed again: the same outputs written twice).
        item = gl.minimum(gl.program_id(0).to(gl.int64) * ITEMS + r, n_items - 1)
        return item // (H // BLOCK_H_C), item % (H // BLOCK_H_C)

    @gluon.jit
    def _fwd_producer(Q, KV, IDX, NEND, H, K, n_items, q_smem, ring, full, empty, q_free, D: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ITEMS: gl.constexpr):
        # Item by item: q once both consumers are past the previous item's last Q K^T (q_free), then its blocks
        # through the ring, which runs on across items (g0: blocks of the earlier items).
        g0 = 0
        for r in range(ITEMS):
            t, hb = _program_item(r, ITEMS, n_items, H)
            nb = row_blocks(NEND, t, BLOCK_N)
            mbarrier.wait(q_free, (r + 1) & 1, pred=r > 0)
            copy_heads(Q, H, t, hb, q_smem, D)
            async_copy.commit_group()           # covered by the item's first block's arrival on full[]
            ring_gather(KV, IDX, K, nb, t, ring, full, empty, D, BLOCK_N, STAGES, g0)
            g0 += nb

    @gluon.jit
    def _pp_publish(s, m_i, g, p_buf, stats, pready, pfree):
        # Owner's softmax of the program's block g (scaled scores s, log2 units, -inf at empty slots) from the
        # running max m_i: P (bf16) and the row statistics (rescale factor, row sum, new max) go to shared memory for
        # both consumers (pready[g % 2]) once both have released P of block g - 2 (pfree). Returns the statistics.
        half = g % 2
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # An all-empty block keeps m at -inf: shift by 0 instead so that no -inf - -inf NaN appears.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        row_sum = gl.sum(p, 1)
        mbarrier.wait(pfree.index(half), ((g // 2) + 1) & 1, pred=g >= 2)
        p_buf.index(half).store(p.to(p_buf.dtype))
        stats.index(3 * half).store(alpha)
        stats.index(3 * half + 1).store(row_sum)
        stats.index(3 * half + 2).store(m_new)
        fence_async_shared()
        mbarrier.arrive(pready.index(half))
        return alpha, row_sum, m_new

    @gluon.jit
    def _pp_take_over(g, l_i, acc, stats, full, pready, STAGES: gl.constexpr, row_layout: gl.constexpr):
        # The other consumer's block (the program's block g), once its P is published: the running sum and max it
        # left, and acc rescaled to that max. Returns (l, m, acc).
        mbarrier.wait(full.index(g % STAGES), (g // STAGES) & 1)
        mbarrier.wait(pready.index(g % 2), (g // 2) & 1)
        fence_async_shared()
        alpha = stats.index(3 * (g % 2)).load(row_layout)
        l_i = l_i * alpha + stats.index(3 * (g % 2) + 1).load(row_layout)
        m_i = stats.index(3 * (g % 2) + 2).load(row_layout)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
        return l_i, m_i, acc

    @gluon.jit
    def _pp_item(IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, g0, q_all, ring, p_buf, stats,
                 full, empty, pready, pfree, q_free, W: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, ROPE: gl.constexpr, ITEMS: gl.constexpr):
        # Ping-pong schedule, consumer warpgroup W, one item (row t, head block hb) whose blocks are the program's
        # blocks g0, g0 + 1, ... (ring stages, P buffers and their barriers count blocks across items): owns output
        # columns [W * D/2, (W+1) * D/2) and the softmax of the item's blocks b with b % 2 == W (_pp_publish);
        # every block, both warpgroups rescale and add P V for their columns.
        # The softmaxes run one after the other (block b's needs block b - 1's running max): the pace is set by
        # hand-over -> P V of b -> Q K^T of b + 1 -> softmax of b + 1 -> hand-over. So each iteration takes the
        # other's block b and this consumer's block c = b + 1 together: P V of b and Q K^T of c are issued back to
        # back (asynchronously, no idle tensor cores between them), b's stage is released once its P V is done
        # (waiting for all but the newest product), c's softmax starts once its Q K^T is (faster than P V, then
        # Q K^T, each waited for: BENCHMARKS.md, fifth session). The row's blocks end at its last valid slot
        # (row_blocks): every partition derives the count itself. Returns the item's block count.
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
        last = nb - 1
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
            gb = g0 + b
            gc = g0 + c
            c_stage = gc % STAGES
            # Shared-memory operands through a block-dependent zero index z: with loop-invariant bases the compiler
            # hoisted the per-k-step wgmma descriptors out of the loop and spilled them (sm_90 compile: up to 205
            # spill instructions with q alone invariant, 48 with q made variant, 0 with every operand).
            z = (b + 1) // (K + 2)      # 0 under truncating and flooring division alike (b + 1 < nb <= K + 1)
            q_smem = q_all.index(z)
            if b >= 0:
                l_i, m_i, acc = _pp_take_over(gb, l_i, acc, stats, full, pready, STAGES, row_layout)
                acc = warpgroup_mma(p_buf.index(gb % 2 + z), ring.index(gb % STAGES + z).slice(W * HALF, HALF, dim=1),
                                    acc, is_async=True)
                mbarrier.wait(full.index(c_stage), (gc // STAGES) & 1)
                fence_async_shared()
                s = warpgroup_mma(q_smem, ring.index(c_stage + z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
                mbarrier.arrive(pfree.index(gb % 2))
                mbarrier.arrive(empty.index(gb % STAGES))       # b < last: the last block's stage is released below
                s = warpgroup_mma_wait(0, deps=[s])
            else:
                mbarrier.wait(full.index(c_stage), (gc // STAGES) & 1)
                fence_async_shared()
                s = warpgroup_mma(q_smem, ring.index(c_stage + z).permute((1, 0)), s_zero, use_acc=False)
            s = gl.where((idx >= 0)[None, :], s * qk_scale_log2, float("-inf"))
            n = (c + 2) * BLOCK_N + cols
            idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
            alpha, row_sum, m_i = _pp_publish(s, m_i, gc, p_buf, stats, pready, pfree)
            l_i = l_i * alpha + row_sum
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            acc = warpgroup_mma(p_buf.index(gc % 2 + z), ring.index(c_stage + z).slice(W * HALF, HALF, dim=1), acc)
            mbarrier.arrive(pfree.index(gc % 2))
            if ITEMS == 1:
                mbarrier.arrive(empty.index(c_stage))
            else:
                mbarrier.arrive(empty.index(c_stage), pred=c < last)
        if last % 2 != W:       # the other consumer's last block: no block of this one after it
            g_last = g0 + last
            l_i, m_i, acc = _pp_take_over(g_last, l_i, acc, stats, full, pready, STAGES, row_layout)
            acc = warpgroup_mma(p_buf.index(g_last % 2), ring.index(g_last % STAGES).slice(W * HALF, HALF, dim=1),
                                acc)
            mbarrier.arrive(pfree.index(g_last % 2))
            if ITEMS == 1:
                mbarrier.arrive(empty.index(g_last % STAGES))
        # Every Q K^T of the item is done once either consumer gets here: the owner of the last block ran that
        # Q K^T itself and, for the block before, waited for the other's P (after the other's Q K^T); the other
        # consumer waited for the last block's P. (nb >= 1: with no block, both consumers would take "block -1"
        # over and wait on barriers out of range; launch_fwd handles K = 0.)
        if ITEMS == 1:
            # This consumer's half of q is free to stage its output columns.
            _finish(acc, m_i, l_i, SINK, OUT, LSE, COS, SIN, t, H, hb, W * HALF,
                    q_all.index(0).slice(W * HALF, HALF, dim=1), D, W == 0, ROPE)
        else:
            # q is handed to the producer for the next item, which it copies while the output goes out through this
            # consumer's columns of the last block's stage (each consumer's P V reads only its own columns; the
            # stage is released once both have stored).
            mbarrier.arrive(q_free)
            g_last = g0 + last
            _finish(acc, m_i, l_i, SINK, OUT, LSE, COS, SIN, t, H, hb, W * HALF,
                    ring.index(g_last % STAGES).slice(W * HALF, HALF, dim=1), D, W == 0, ROPE)
            mbarrier.arrive(empty.index(g_last % STAGES))
        return nb

    @gluon.jit
    def _pp_consumer(IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, n_items, q_all, ring, p_buf, stats,
                     full, empty, pready, pfree, q_free, W: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, ROPE: gl.constexpr, ITEMS: gl.constexpr):
        g0 = 0
        for r in range(ITEMS):
            t, hb = _program_item(r, ITEMS, n_items, H)
            g0 += _pp_item(IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, g0, q_all, ring, p_buf,
                           stats, full, empty, pready, pfree, q_free, W, D, BLOCK_N, STAGES, ROPE, ITEMS)

    @gluon.jit
    def _sparse_attn_fwd_gluon(Q, KV, IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, n_items,
                               D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                               num_warps: gl.constexpr, REGS: gl.constexpr, ROPE: gl.constexpr,
                               ITEMS: gl.constexpr):
        # Three warpgroups: this partition and a worker are the consumers (_pp_consumer), a worker gathers. Each
        # program takes ITEMS (row, head block) items in turn.
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
        q_free = mbarriers(1, 2).index(0)      # both consumers past an item's last Q K^T
        gl.warp_specialize([
            (_pp_consumer, (IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, n_items, q_all, ring, p_buf,
                            stats, full, empty, pready, pfree, q_free, gl.constexpr(0), D, BLOCK_N, STAGES, ROPE,
                            ITEMS)),
            (_pp_consumer, (IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, n_items, q_all, ring, p_buf,
                            stats, full, empty, pready, pfree, q_free, gl.constexpr(1), D, BLOCK_N, STAGES, ROPE,
                            ITEMS)),
            (_fwd_producer, (Q, KV, IDX, NEND, H, K, n_items, q_all.index(0), ring, full, empty, q_free, D, BLOCK_N,
                             STAGES, ITEMS))],
            [4, 4], [REGS[0], REGS[1]])

'''

_OLD_CONFIG = r'''FWD_CONFIG = dict(BLOCK_N=64, STAGES=2, REGS=(216, 40))'''

_NEW_CONFIG = r'''FWD_CONFIG = dict(BLOCK_N=64, STAGES=2, REGS=(216, 40), ITEMS=2)'''

_OLD_LAUNCH = r'''    cos, sin = rope if rope is not None else (q, q)        # never read without RoPE channels (ROPE = 0)
    _sparse_attn_fwd_gluon[(T * (H // BLOCK_H),)](
        q, kv, idx, row_ends(idx), sink, out, lse, cos, sin, H, idx.shape[1], scale * LOG2E,
        D=D, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], num_warps=4, REGS=tuple(cfg["REGS"]),
        ROPE=0 if rope is None else cos.shape[1])
'''

_NEW_LAUNCH = r'''    items = cfg["ITEMS"]
    if items < 1 or (items > 1 and cfg["BLOCK_N"] != BLOCK_H):
        # Several items a program stage the output through a ring stage, which must hold the 64 heads' rows.
        raise ValueError(f"Gluon forward config: ITEMS must be 1, or more with BLOCK_N = {BLOCK_H}; got "
                         f"ITEMS={items}, BLOCK_N={cfg['BLOCK_N']}")
    cos, sin = rope if rope is not None else (q, q)        # never read without RoPE channels (ROPE = 0)
    n_items = T * (H // BLOCK_H)
    _sparse_attn_fwd_gluon[(triton.cdiv(n_items, items),)](
        q, kv, idx, row_ends(idx), sink, out, lse, cos, sin, H, idx.shape[1], scale * LOG2E, n_items,
        D=D, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], num_warps=4, REGS=tuple(cfg["REGS"]),
        ROPE=0 if rope is None else cos.shape[1], ITEMS=items)
'''

_OLD_IMPORT = r'''import torch
'''

_NEW_IMPORT = r'''import torch
import triton
'''

_PAIRS = [(_OLD_KERNEL, _NEW_KERNEL), (_OLD_CONFIG, _NEW_CONFIG), (_OLD_LAUNCH, _NEW_LAUNCH), (_OLD_IMPORT, _NEW_IMPORT)]


def _items(n):
    return [(a, b.replace("ITEMS=2)", f"ITEMS={n})")) if a.startswith("FWD_CONFIG") else (a, b) for a, b in _PAIRS]


def _unrolled(pairs):
    # The items as straight-line code (gl.static_range) instead of a runtime loop.
    out = []
    for a, b in pairs:
        b = b.replace("for r in range(ITEMS):", "for r in gl.static_range(ITEMS):")
        b = b.replace("def _program_item(r, ITEMS", "def _program_item(r: gl.constexpr, ITEMS")
        b = b.replace("            mbarrier.wait(q_free, (r + 1) & 1, pred=r > 0)\n",
                      "            if r > 0:\n                mbarrier.wait(q_free, (r - 1) & 1)\n")
        out.append((a, b))
    return out


_PRODUCER = """    @gluon.jit
    def _fwd_producer(Q, KV, IDX, NEND, H, K, n_items, q_smem, ring, full, empty, q_free, D: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ITEMS: gl.constexpr):
        # Item by item: q once both consumers are past the previous item's last Q K^T (q_free), then its blocks
        # through the ring, which runs on across items (g0: blocks of the earlier items).
        g0 = 0
        for r in range(ITEMS):
            t, hb = _program_item(r, ITEMS, n_items, H)
            nb = row_blocks(NEND, t, BLOCK_N)
            mbarrier.wait(q_free, (r + 1) & 1, pred=r > 0)
            copy_heads(Q, H, t, hb, q_smem, D)
            async_copy.commit_group()           # covered by the item's first block's arrival on full[]
            ring_gather(KV, IDX, K, nb, t, ring, full, empty, D, BLOCK_N, STAGES, g0)
            g0 += nb
"""

_EARLY_PRODUCER = """    @gluon.jit
    def _fwd_producer(Q, KV, IDX, NEND, H, K, n_items, q_smem, ring, full, empty, q_free, D: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ITEMS: gl.constexpr):
        # Item by item, the ring running on across items (g0: blocks of the earlier items). An item's first block is
        # gathered as soon as its stage is free, during the previous item's last blocks; q follows once both
        # consumers are past that item's last Q K^T (q_free), and the block's arrival on full[] covers both.
        io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        n_layout: gl.constexpr = gl.SliceLayout(1, io)
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        g0 = 0
        for r in range(ITEMS):
            t, hb = _program_item(r, ITEMS, n_items, H)
            nb = row_blocks(NEND, t, BLOCK_N)
            row_base = t * K
            i0 = slot_rows(IDX, row_base, 0, 0, K, BLOCK_N, n_layout)
            i1 = slot_rows(IDX, row_base, 0, 16, K, BLOCK_N, n_layout)
            i2 = slot_rows(IDX, row_base, 0, 32, K, BLOCK_N, n_layout)
            i3 = slot_rows(IDX, row_base, 0, 48, K, BLOCK_N, n_layout)
            for b in range(nb):
                g = g0 + b
                stage = g % STAGES
                mbarrier.wait(empty.index(stage), ((g // STAGES) + 1) & 1, pred=g >= STAGES)
                kv_stage = ring.index(stage)
                gather_rows(kv_stage, 0, i0, KV, cols, D)
                if BLOCK_N > 16:
                    gather_rows(kv_stage, 16, i1, KV, cols, D)
                if BLOCK_N > 32:
                    gather_rows(kv_stage, 32, i2, KV, cols, D)
                    gather_rows(kv_stage, 48, i3, KV, cols, D)
                if b == 0:
                    mbarrier.wait(q_free, (r + 1) & 1, pred=r > 0)
                    copy_heads(Q, H, t, hb, q_smem, D)
                async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
                async_copy.commit_group()
                i0 = slot_rows(IDX, row_base, b + 1, 0, K, BLOCK_N, n_layout)
                if BLOCK_N > 16:
                    i1 = slot_rows(IDX, row_base, b + 1, 16, K, BLOCK_N, n_layout)
                if BLOCK_N > 32:
                    i2 = slot_rows(IDX, row_base, b + 1, 32, K, BLOCK_N, n_layout)
                    i3 = slot_rows(IDX, row_base, b + 1, 48, K, BLOCK_N, n_layout)
            g0 += nb
        async_copy.wait_group(0)
"""
_IMPORTS = ("copy_heads, fence_async_shared, gl, gluon,",
            "copy_heads, fence_async_shared, gather_rows, gl, gluon, slot_rows,")


def _early(pairs):
    # The first block of an item gathered before its q (above), so its gather overlaps the previous item's end.
    out = []
    for a, b in pairs:
        assert b.count(_PRODUCER) <= 1
        out.append((a, b.replace(_PRODUCER, _EARLY_PRODUCER)))
    assert any(_EARLY_PRODUCER in b for _, b in out)
    return out + [_IMPORTS]


VARIANTS = {"items2": _items(2), "items4": _items(4), "items2_unrolled": _unrolled(_items(2)),
            "items2_early": _early(_items(2)), "items4_early": _early(_items(4))}
VARIANT_CONSTEXPRS = {name: {"ITEMS": int(name[5])} for name in VARIANTS}


def inputs(T: int, H: int, device):
    """The benchmark's inputs from 4096 rows up; below, ragged rows and the output rotation's tables (module doc)."""
    import sys
    from pathlib import Path
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sparse_attention import D, make_inputs
    if T >= 4096:
        q, kv, idx, sink, _ = make_inputs(T, device, heads=H)
        return dict(q=q, kv=kv, idx=idx, sink=sink.float(), scale=D ** -0.5)
    K, N = 640, 3000
    gen = torch.Generator(device=device).manual_seed(T)
    q = torch.randn(T, H, D, device=device, generator=gen).to(torch.bfloat16)
    kv = torch.randn(N, D, device=device, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, N, (T, K), device=device, generator=gen, dtype=torch.int32)
    valid = torch.randint(0, K + 1, (T,), device=device, generator=gen)
    valid[::7] = 0
    keep = (torch.arange(K, device=device)[None, :] < valid[:, None]) & \
        (torch.rand(T, K, device=device, generator=gen) >= 0.1)
    angle = torch.rand(T, 32, device=device, generator=gen) * 6
    return dict(q=q, kv=kv, idx=torch.where(keep, idx, -1), sink=torch.randn(H, device=device, generator=gen),
                scale=D ** -0.5, rope=(angle.cos().contiguous(), angle.sin().contiguous()))


def call(module, inp):
    """(out, lse), and with the ragged inputs also (out, lse) with the output rotation."""
    import torch
    results = []
    for rope in (None, inp.get("rope")) if "rope" in inp else (None,):
        q = inp["q"]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        module.launch_fwd(q, inp["kv"], inp["idx"], inp["sink"], out, lse, inp["scale"], rope=rope)
        results += [out, lse]
    return tuple(results)

"""Warm-up teacher LSE: two neighbouring query rows per program, sharing every gathered block.

The warm-up's teacher kernels (``teacher_lse``, ``teacher_mass``: three passes over every visible compressed entry,
71 of the warm-up CSA layer's 203 ms at 32K, BENCHMARKS.md, twentieth session) gather each candidate's 1 KB row
for 2 H D = 64 KFLOP of one row's 64 heads: half the attention forward's work per gathered byte. They gather at
~6 TB/s out of L2 (137 GB in 22.7 ms), 1.8x the attention forward's rate. Hypothesis: the L2 -> shared-memory
gather sets their pace. Rows t and t + 1 of one document see the same entries in the same slots (t + 1 sees at
most one more), so a program can own both rows: the producer gathers row t + 1's blocks once, and each consumer
computes one row's 64 heads over every block (their stages are released by both), halving the gathered bytes per
FLOP. Shared memory: both rows' q (2 x 64 KB) and a ring of 2 x 32-slot stages (64 KB).

A timing probe, not the kernel: it assumes row 2p's slots are row 2p + 1's first ones (true inside one document of
the warm-up's every visible entry; a pair across a document boundary would need its own gather). Outputs differ
from the shipped kernel's within fp32 rounding (one online LSE per row instead of two halves joined by logaddexp).
``shipped_bn32`` times the shipped kernel with 32-slot blocks, to separate the block size from the pairing.

Offline sm_90 builds: 168 registers on Triton 3.6.0 / 3.7.1 / 3.9.0 as shipped, spills 16 / 16 / 0 bytes (shipped
0 / 4 / 0), 192 KB of shared memory as shipped.

Build offline: ``python benchmarks/kernel_variants.py benchmarks/variants/teacher_lse_pairs.py --build-only``.
Time on the GPU: ``... --T 32768 --rounds 5`` (one document, every visible entry: K = T / 4).
"""
import torch

MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper"
KERNEL = "_teacher_lse_gluon"
BUILD_SIGNATURE = {"T": "i32"}

_KERNEL_OLD = '''    @gluon.jit
    def _teacher_lse_gluon(Q, CKV, IDX, NEND, LSE, H, K, qk_scale_log2,
                           D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
                           REGS: gl.constexpr):'''

# Shared with teacher_mass_pairs.py: the pair's rows, and a producer that gathers the second row's blocks.
PAIR_HELPERS = '''    @gluon.jit
    def _pair_rows(H, T, W):
        # (row 2p + W, capped at T - 1, as int64; the pair's second row, capped; head block) of this program.
        p, hb = program_row(H)
        return gl.minimum(2 * p + W, T - 1), gl.minimum(2 * p + 1, T - 1), hb

    @gluon.jit
    def _pair_buffers(dtype: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # Both rows' q, a ring of STAGES blocks, full (the producer's 128 threads) and empty (both consumers).
        q_all = gl.allocate_shared_memory(dtype, [2, BLOCK_H_C, D],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_H_C, D], dtype))
        ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))
        return q_all, ring, mbarriers(STAGES, 128), mbarriers(STAGES, 2)

    @gluon.jit
    def _pair_producer(Q, CKV, IDX, NEND, H, K, T, q_all, ring, full, empty, D: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # Both rows' q, then the second row's blocks (its slots cover the first row's).
        r0, r1, hb = _pair_rows(H, T, 0)
        copy_heads(Q, H, r0, hb, q_all.index(0), D)
        copy_heads(Q, H, r1, hb, q_all.index(1), D)
        async_copy.commit_group()
        ring_gather(CKV, IDX, K, row_blocks(NEND, r1, BLOCK_N), r1, ring, full, empty, D, BLOCK_N, STAGES)

'''

_KERNEL_NEW = PAIR_HELPERS + '''    @gluon.jit
    def _pair_lse_consumer(IDX, NEND, LSE, H, K, T, qk_scale_log2, q_all, ring, full, empty,
                           W: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # Row 2p + W over every block of the pair (masked by its own slots); releases each stage (count 2).
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        r, r1, hb = _pair_rows(H, T, W)
        heads = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=row_layout)
        m_i = gl.full([BLOCK_H_C], -1.0e30, gl.float32, layout=row_layout)
        l_i = gl.zeros([BLOCK_H_C], gl.float32, layout=row_layout)
        s_zero = gl.zeros([BLOCK_H_C, BLOCK_N], gl.float32, layout=s_layout)
        q_smem = q_all.index(W)
        for b in range(row_blocks(NEND, r1, BLOCK_N)):
            n, idx, s = _teacher_scores(IDX, r * K, K, b, q_smem, ring, full, empty, s_zero, s_layout, STAGES)
            s = gl.where((idx >= 0)[None, :], s * qk_scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            l_i = l_i * gl.exp2(m_i - m_new) + gl.sum(gl.exp2(s - m_new[:, None]), 1)
            m_i = m_new
        lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_i)) / LOG2E_C, float("-inf"))
        gl.store(LSE + r * H + heads, lse)                                      # part 0: the row's whole LSE
        gl.store(LSE + (T + r) * H + heads, gl.full_like(lse, float("-inf")))   # part 1: nothing

    @gluon.jit
    def _teacher_lse_gluon(Q, CKV, IDX, NEND, LSE, H, K, T, qk_scale_log2,
                           D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
                           REGS: gl.constexpr):
        # One program per (pair of rows, head block); stages of BLOCK_N // 2 slots (the default 64 only: the
        # producer gathers 16 rows at a time).
        PAIR_N: gl.constexpr = BLOCK_N // 2
        q_all, ring, full, empty = _pair_buffers(Q.dtype.element_ty, D, PAIR_N, STAGES)
        gl.warp_specialize([
            (_pair_lse_consumer, (IDX, NEND, LSE, H, K, T, qk_scale_log2, q_all, ring, full, empty,
                                  gl.constexpr(0), PAIR_N, STAGES)),
            (_pair_lse_consumer, (IDX, NEND, LSE, H, K, T, qk_scale_log2, q_all, ring, full, empty,
                                  gl.constexpr(1), PAIR_N, STAGES)),
            (_pair_producer, (Q, CKV, IDX, NEND, H, K, T, q_all, ring, full, empty, D, PAIR_N, STAGES))],
            [4, 4], [REGS[0], REGS[1]])

    @gluon.jit
    def _teacher_lse_shipped(Q, CKV, IDX, NEND, LSE, H, K, qk_scale_log2,
                             D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
                             REGS: gl.constexpr):'''

_LAUNCH_OLD = '''    _teacher_lse_gluon[(T * (H // BLOCK_H),)](
        q, compressed_kv, candidates, row_ends(candidates) if n_end is None else n_end, parts, H, K, scale * LOG2E,'''
_LAUNCH_NEW = '''    _teacher_lse_gluon[((T + 1) // 2 * (H // BLOCK_H),)](
        q, compressed_kv, candidates, row_ends(candidates) if n_end is None else n_end, parts, H, K, T,
        scale * LOG2E,'''

VARIANTS = {
    "pairs": [(_KERNEL_OLD, _KERNEL_NEW), (_LAUNCH_OLD, _LAUNCH_NEW)],
    "shipped_bn32": [('''    cfg = _teacher_config(config, "teacher_lse config")''',
                      '''    cfg = _teacher_config(dict(config or {}, BLOCK_N=32), "teacher_lse config")''')],
}


# One document of T rows, every visible compressed entry (K = T / 4), V4-Flash shapes, bf16.
def inputs(T, H, device):
    import dsv4attn
    from dsv4attn.ops.index_sets import VisibleCompressed, contiguous_ranges, range_rows
    gen = torch.Generator(device=device).manual_seed(0)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    cand = VisibleCompressed(dsv4attn.pack_batch(cu, T, T).compressed(4), T)
    first, visible, table, shift = contiguous_ranges(cand)
    idx = range_rows(first, visible, table, shift, cand.width, 0, T, dtype=torch.int32)
    # What the pairs assume: row 2p's slots are row 2p + 1's first ones (the last row of an odd T pairs itself).
    second = idx[1::2] if T % 2 == 0 else torch.cat([idx[1::2], idx[-1:]])
    assert ((idx[0::2] < 0) | (idx[0::2] == second)).all(), "a pair of rows whose slots differ"
    q = torch.randn(T, H, 512, device=device, generator=gen).to(torch.bfloat16)
    ckv = torch.randn(cand.layout.capacity, 512, device=device, generator=gen).to(torch.bfloat16)
    return dict(q=q, ckv=ckv, idx=idx, n_end=visible.to(torch.int32), scale=512 ** -0.5)


def call(module, inp):
    return (module.teacher_lse(inp["q"], inp["ckv"], inp["idx"], inp["scale"], n_end=inp["n_end"]),)

"""Indexer KL backward, row pairs (Gluon, SM90; the warm-up): two ways to raise the rate of its products.

Why: the pair backward at 32K spends 14.0 of its 20.3 ms (H100, Triton 3.6.0) in the x and d index_q products of
both rows with their epilogues (BENCHMARKS.md, thirtieth session).

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/kl_pairs_products.py --T 32768 8192 --H 64`` (run
the ``wide`` forms with ``--only NAME`` under ``timeout 120``: a new hand-over scheme that may deadlock);
offline: ``... --build-only`` (registers, spills and whether ptxas serializes the kernel's wgmma).

1. ``async_dq``: each consumer's d index_q product issued asynchronously. Each consumer's tile is x (wait) -> ReLU /
weights -> dx to shared memory -> d index_q (wait) -> release -> [every other tile] d index_k of the tile before (wait)
-> its reductions. Here d index_q is issued without a wait; the d index_k product (where the tile has one) follows it in
the queue and its own wait covers both; the ring stage is released after the whole d index_k step (its product and
reductions) instead of before it (the producer runs up to four stages ahead). d index_q is not in flight across the
loop's back edge, which is what made ptxas serialize the score kernel's wgmma in the seventh session.

- ``async_dq``: as above. Outputs must be bitwise the shipped kernel's (the same products in the same order per
  accumulator; d index_k's fp32 atomics aside).

2. ``wide`` / ``wide_232``: both rows' scores as one N = 128 product per tile.

Here the tile's owner (consumer b % 2) forms x^T = K [qi0; qi1]^T for both rows at once (M = 64 slots, N = 128 =
both rows' heads), dx^T in registers, stores it once to shared memory for both consumers' d index_q products (each
reads its row's 64 columns, transposed) and feeds it to the d index_k product as the register A operand (no
shared-memory read for it). Each consumer keeps its row's d index_q over every tile in order; the owner does its
next tile's scores before the d index_q products of the other's tile, so neither waits for the other's step of the
same tile. dw: each consumer sums its owned tiles for both rows; consumer 1 hands its part over at the end.

- ``wide``: as above. d index_q and d index_k must be bitwise the shipped kernel's (the same products in the same
  order; d index_k's fp32 atomics aside); dw differs in fp32 rounding (partial sums of alternate tiles, added at the
  end; the sum over a tile's slots runs over the accumulator's rows instead of its columns).

- ``wide_232``: the same with 232 registers a consumer thread and 24 for the producer. Spill stores offline on
  3.6.0 / 3.7.1 / 3.9.0: ``wide`` 148 / 160 / 440 bytes, ``wide_232`` 72 / 84 / 372 (the shipped kernel none): a
  first cut, to see whether the wider products pay before tuning its registers.

Not measured, a cost this form adds: dw's per-tile sum runs over the accumulator's rows (slots), which span the
four warps, so each owned tile ends with a cross-warp reduction through shared memory (35 bar.sync against 29).
"""
import importlib.util
from pathlib import Path

import torch

MODULE = "dsv4attn.ops.indexer_loss.gluon_hopper"
KERNEL = "_indexer_kl_bwd_pairs_gluon"

_DQ_OLD = """            dq = warpgroup_mma(dx_mine, keys, dq)
            release(empty.index(stage))
            # Tile b - 1's owner forms its d index_k only now, after this tile's score and dq: the other consumer's
            # dx of b - 1 is long written, so neither consumer waits on the other's step of the same tile.
            if (b >= 1) & ((b - 1) % 2 == W):
                _pair_dk(b - 1, K, IDX, base0, base1, r0, r1, DKI, dx_smem, qi_all, dx_ready, dx_free, dk_zero,
                         BLOCK_N)
"""
_DQ_NEW = """            dq = warpgroup_mma(dx_mine, keys, dq, is_async=True)
            if (b >= 1) & ((b - 1) % 2 == W):
                _pair_dk(b - 1, K, IDX, base0, base1, r0, r1, DKI, dx_smem, qi_all, dx_ready, dx_free, dk_zero,
                         BLOCK_N)
            dq = warpgroup_mma_wait(0, deps=[dq])
            release(empty.index(stage))
"""
_IMPORT_OLD = "                            release, sm90, warpgroup_mma)"
_IMPORT_NEW = "                            release, sm90, warpgroup_mma, warpgroup_mma_wait)"



_SOURCE = Path(importlib.util.find_spec(MODULE).origin).read_text()
_START = "    @gluon.jit\n    def _pair_dk("
_END = "def _config(config) -> dict:"
_OLD = _SOURCE[_SOURCE.index(_START):_SOURCE.index(_END)]

_NEW = '''    @gluon.jit
    def _wide_owner(b, K, IDX, G, W_, DKI, r0, r1, grad0, grad1, qi_all, ring, dx_smem, full, dx_ready, dx_free,
                    dw, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Tile b's scores of both rows (x^T: slots x both rows' heads), dx^T to shared memory for the d index_q
        products, d index_k from dx^T in registers; returns dw plus this tile's part (both rows' heads)."""
        q_layout: gl.constexpr = Q_LAYOUT
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=q_layout, k_width=2)
        red_slots: gl.constexpr = gl.SliceLayout(1, reduction_layout(BLOCK_N, HEAD_DIM_C))
        stage = b % STAGES
        u = b % 2
        z = loop_zero(b, K)
        base0 = gl.maximum(r0, 0).to(gl.int64)
        base1 = gl.maximum(r1, 0).to(gl.int64)
        n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, q_layout))
        i0 = gl.load(IDX + base0 * K + n, mask=(n < K) & (r0 >= 0), other=-1)
        i1 = gl.load(IDX + base1 * K + n, mask=(n < K) & (r1 >= 0), other=-1)
        d0 = gl.load(G + base0 * K + n, mask=i0 >= 0, other=0.0) * grad0
        d1 = gl.load(G + base1 * K + n, mask=i1 >= 0, other=0.0) * grad1
        cols = gl.arange(0, 2 * HEADS_C, layout=gl.SliceLayout(0, q_layout))
        first = cols < HEADS_C
        w2 = gl.load(W_ + gl.where(first, base0, base1) * HEADS_C + (cols % HEADS_C))
        mbarrier.wait(full.index(stage), (b // STAGES) & 1)
        fence_async_shared()
        keys = ring.index(stage + z)
        xt_zero = gl.zeros([BLOCK_N, 2 * HEADS_C], gl.float32, layout=q_layout)
        xt = warpgroup_mma(keys, qi_all.index(z).permute((1, 0)), xt_zero, use_acc=False)
        d = gl.where(first[None, :], d0[:, None], d1[:, None])
        dw += gl.sum(gl.maximum(xt, 0.0) * d, 0)
        dxt = gl.where(xt > 0, w2[None, :] * d, 0.0).to(dx_smem.dtype)
        # Buffer u was last read by both consumers' d index_q products of tile b - 2.
        mbarrier.wait(dx_free.index(u), ((b // 2) + 1) & 1, pred=b >= 2)
        dx_smem.index(u + z).store(dxt)
        fence_async_shared()
        mbarrier.arrive(dx_ready.index(u))
        dk_zero = gl.zeros([BLOCK_N, HEAD_DIM_C], gl.float32, layout=q_layout)
        dk = warpgroup_mma(gl.convert_layout(dxt, a_layout), qi_all.index(z), dk_zero, use_acc=False)
        n_red = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=red_slots)
        j0 = gl.load(IDX + base0 * K + n_red, mask=(n_red < K) & (r0 >= 0), other=-1)
        j1 = gl.load(IDX + base1 * K + n_red, mask=(n_red < K) & (r1 >= 0), other=-1)
        key = gl.where(j0 >= 0, j0, j1)
        ok = key >= 0
        add_reduced(dk, DKI, gl.where(ok, key, 0).to(gl.int64) * HEAD_DIM_C, ok, 0)
        return dw

    @gluon.jit
    def _wide_dq(b, K, dq, ring, dx_smem, full, empty, dx_ready, dx_free, W: gl.constexpr, STAGES: gl.constexpr):
        """This consumer's row's d index_q += dx (its 64 columns of tile b's dx^T, transposed) K."""
        stage = b % STAGES
        u = b % 2
        z = loop_zero(b, K)
        mbarrier.wait(full.index(stage), (b // STAGES) & 1)
        mbarrier.wait(dx_ready.index(u), (b // 2) & 1)
        fence_async_shared()
        dx_mine = dx_smem.index(u + z).slice(W * HEADS_C, HEADS_C, dim=1).permute((1, 0))
        dq = warpgroup_mma(dx_mine, ring.index(stage + z), dq)
        release(empty.index(stage))
        release(dx_free.index(u))
        return dq

    @gluon.jit
    def _wide_consumer(W_, IDX, G, GRAD, DQI, DKI, DW, K, r0, r1, n_end, qi_all, ring, dx_smem, dw_part, full, empty,
                       dx_ready, dx_free, handed, W: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        q_layout: gl.constexpr = Q_LAYOUT
        row = r0 if W == 0 else r1
        active = row >= 0
        base = gl.maximum(row, 0).to(gl.int64)
        grad0 = gl.load(GRAD + gl.maximum(r0, 0), mask=r0 >= 0, other=0.0)
        grad1 = gl.load(GRAD + gl.maximum(r1, 0), mask=r1 >= 0, other=0.0)
        dq = gl.zeros([HEADS_C, HEAD_DIM_C], gl.float32, layout=q_layout)
        dw = gl.zeros([2 * HEADS_C], gl.float32, layout=gl.SliceLayout(0, q_layout))
        nb = gl.cdiv(n_end, BLOCK_N)
        # Owned tile b first, then the other's tile b - 1 and b: each consumer's d index_q runs over the tiles in
        # order.
        for b in range(W, nb + 1, 2):
            if b < nb:
                dw = _wide_owner(b, K, IDX, G, W_, DKI, r0, r1, grad0, grad1, qi_all, ring, dx_smem, full, dx_ready,
                                 dx_free, dw, BLOCK_N, STAGES)
            if b >= 1:
                dq = _wide_dq(b - 1, K, dq, ring, dx_smem, full, empty, dx_ready, dx_free, W, STAGES)
            if b < nb:
                dq = _wide_dq(b, K, dq, ring, dx_smem, full, empty, dx_ready, dx_free, W, STAGES)
        q_heads = gl.arange(0, HEADS_C, layout=gl.SliceLayout(1, q_layout))
        q_dims = gl.arange(0, HEAD_DIM_C, layout=gl.SliceLayout(0, q_layout))
        gl.store(DQI + (base * HEADS_C + q_heads.to(gl.int64))[:, None] * HEAD_DIM_C + q_dims[None, :],
                 dq.to(DQI.dtype.element_ty), mask=((q_heads >= 0) & active)[:, None])
        if W == 1:
            dw_part.store(dw)
            mbarrier.arrive(handed.index(0))
        else:
            mbarrier.wait(handed.index(0), 0)
            dw += dw_part.load(gl.SliceLayout(0, q_layout))
            cols = gl.arange(0, 2 * HEADS_C, layout=gl.SliceLayout(0, q_layout))
            first = cols < HEADS_C
            rows = gl.where(first, gl.maximum(r0, 0), gl.maximum(r1, 0)).to(gl.int64)
            gl.store(DW + rows * HEADS_C + (cols % HEADS_C), dw, mask=gl.where(first, r0 >= 0, r1 >= 0))

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
        dx_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, 2 * HEADS_C],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_N, 2 * HEADS_C], dtype))
        dw_part = gl.allocate_shared_memory(gl.float32, [2 * HEADS_C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        full = mbarriers(STAGES, 128)
        empty = mbarriers(STAGES, 256)
        dx_ready = mbarriers(2, 1)
        dx_free = mbarriers(2, 256)
        handed = mbarriers(1, 1)
        gl.warp_specialize([
            (_wide_consumer, (W_, IDX, G, GRAD, DQI, DKI, DW, K, r0, r1, n_end, qi_all, ring, dx_smem, dw_part, full,
                              empty, dx_ready, dx_free, handed, gl.constexpr(0), BLOCK_N, STAGES)),
            (_wide_consumer, (W_, IDX, G, GRAD, DQI, DKI, DW, K, r0, r1, n_end, qi_all, ring, dx_smem, dw_part, full,
                              empty, dx_ready, dx_free, handed, gl.constexpr(1), BLOCK_N, STAGES)),
            (_pair_producer, (QI, KI, IDX, K, r0, r1, n_end, qi_all.index(0), ring, full, empty, BLOCK_N, STAGES))],
            [4, 4], [REGS[0], REGS[1]])


'''

_REGS_OLD = "CONFIG = dict(STAGES=4, REGS=(216, 40))"
VARIANTS = {"async_dq": [(_DQ_OLD, _DQ_NEW), (_IMPORT_OLD, _IMPORT_NEW)],
            "wide": [(_OLD, _NEW)],
            "wide_232": [(_OLD, _NEW), (_REGS_OLD, "CONFIG = dict(STAGES=4, REGS=(232, 24))")]}
VARIANT_CONSTEXPRS = {"wide_232": {"REGS": (232, 24)}}        # as its launcher passes them


def inputs(T, H, device):
    gen = torch.Generator(device=device).manual_seed(0)
    t = torch.arange(T, device=device)
    K = nk = T // 4
    idx = torch.arange(K, device=device, dtype=torch.int32)[None, :].expand(T, K)
    idx = torch.where(idx <= (t // 4)[:, None], idx, -1).contiguous()
    n_end = (idx >= 0).sum(1).int()
    qi = torch.randn(T, 64, 128, device=device, generator=gen).bfloat16()
    ki = torch.randn(nk, 128, device=device, generator=gen).bfloat16()
    w = torch.randn(T, 64, device=device, generator=gen) / 90.0
    g = torch.randn(T, K, device=device, generator=gen) / K
    grad = torch.full((T,), 1.0 / T, device=device)
    first = torch.zeros(T, dtype=torch.int32, device=device)
    return dict(args=(qi, ki, w, idx, n_end, g, grad), nk=nk, first=first)


def call(module, inp):
    from dsv4attn.ops.index_sets import chunk_rows
    from dsv4attn.ops.indexer_loss import triton as klt
    qi, ki, w, idx, n_end, g, grad = inp["args"]
    dqi, dw = torch.empty_like(qi), torch.empty_like(w)
    dki = torch.zeros(inp["nk"], 128, device=qi.device)
    for s, e in chunk_rows(qi.shape[0], idx.shape[1], budget=klt.INDEX_BUDGET):    # the op's chunks
        module.launch_bwd_pairs(qi[s:e], ki, w[s:e], idx[s:e], n_end[s:e], g[s:e], grad[s:e], dqi[s:e], dki,
                                dw[s:e], inp["first"][s:e])
    return dqi, dki, dw

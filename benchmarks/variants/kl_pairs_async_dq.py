"""Indexer KL backward, row pairs (Gluon, SM90; the warm-up): each consumer's d index_q product issued
asynchronously, so that it and the previous tile's d index_k product run back to back.

Why: the pair backward at 32K spends 14.0 of its 20.3 ms (H100, Triton 3.6.0) in the x and d index_q products of both
rows with their epilogues (BENCHMARKS.md, thirtieth session): each consumer's tile is x (wait) -> ReLU / weights ->
dx to shared memory -> d index_q (wait) -> release -> [every other tile] d index_k of the tile before (wait) -> its
reductions. Here d index_q is issued without a wait; the d index_k product (where the tile has one) follows it in the
queue and its own wait covers both; the ring stage is released after the whole d index_k step (its product and
reductions) instead of before it (the producer runs up to four stages ahead). d index_q is not in flight across the
loop's back edge, which is what made ptxas serialize the score kernel's wgmma in the seventh session.

- ``async_dq``: as above. Outputs must be bitwise the shipped kernel's (the same products in the same order per
  accumulator; d index_k's fp32 atomics aside).

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/kl_pairs_async_dq.py --T 32768 8192 --H 64``;
offline: ``... --build-only`` (registers, spills and whether ptxas serializes the kernel's wgmma).
"""
import torch

MODULE = "dsv4attn.ops.indexer_loss.gluon_hopper"
KERNEL = "_indexer_kl_bwd_pairs_gluon"

_OLD = """            dq = warpgroup_mma(dx_mine, keys, dq)
            release(empty.index(stage))
            # Tile b - 1's owner forms its d index_k only now, after this tile's score and dq: the other consumer's
            # dx of b - 1 is long written, so neither consumer waits on the other's step of the same tile.
            if (b >= 1) & ((b - 1) % 2 == W):
                _pair_dk(b - 1, K, IDX, base0, base1, r0, r1, DKI, dx_smem, qi_all, dx_ready, dx_free, dk_zero,
                         BLOCK_N)
"""
_NEW = """            dq = warpgroup_mma(dx_mine, keys, dq, is_async=True)
            if (b >= 1) & ((b - 1) % 2 == W):
                _pair_dk(b - 1, K, IDX, base0, base1, r0, r1, DKI, dx_smem, qi_all, dx_ready, dx_free, dk_zero,
                         BLOCK_N)
            dq = warpgroup_mma_wait(0, deps=[dq])
            release(empty.index(stage))
"""
_IMPORT_OLD = "                            release, sm90, warpgroup_mma)"
_IMPORT_NEW = "                            release, sm90, warpgroup_mma, warpgroup_mma_wait)"

VARIANTS = {"async_dq": [(_OLD, _NEW), (_IMPORT_OLD, _IMPORT_NEW)]}


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

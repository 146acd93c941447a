"""Indexer KL backward, row pairs (Gluon, SM90; the warm-up): each consumer's next score product issued before
this tile's epilogue.

Why: the pair backward at 32K spends 14.0 of its 20.3 ms (H100, Triton 3.6.0) in the x and d index_q products of
both rows with their epilogues, ~315 TFLOP/s (BENCHMARKS.md, thirtieth session). Within a consumer every tile runs
x (wait) -> ReLU / weights / G -> dx to shared memory -> d index_q: its tensor cores idle while it forms dx, and
only the other consumer's products fill that time. Here the consumer issues x of tile b + 1 (its stage waited for
first) right after x of tile b is complete, so the product runs under tile b's epilogue; the iteration's final wait
covers x of b + 1 and d index_q of b together, so no product is in flight across the loop's back edge (what made
ptxas serialize the score kernel's wgmma, seventh session). The last tile's "next" product is the last tile again
(b + 1 clamped to nb - 1: its stage is still held; one extra 64 x 64 x 128 product a row), so the loop body has
no branch around an asynchronous product.

- ``x_ahead``: as above, the shipped registers (216 / 40).
- ``x_ahead_232``: the same with 232 registers a consumer thread and 24 for the producer.

Offline sm_90 builds: no spills on Triton 3.6.0 and 3.7.1 (both forms), 60 / 120 bytes (stores / loads) on 3.9.0,
56 / 112 with 232 registers (the shipped kernel: none); ptxas does not serialize the wgmma on any of the three.

Outputs must be bitwise the shipped kernel's (the same products in the same order per accumulator; d index_k's fp32
atomics aside: within ~1e-13).

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/kl_pairs_x_ahead.py --T 32768 8192 --H 64``;
offline: ``... --build-only`` (registers, spills and whether ptxas serializes the kernel's wgmma).
"""
import importlib.util
from pathlib import Path

import torch

MODULE = "dsv4attn.ops.indexer_loss.gluon_hopper"
KERNEL = "_indexer_kl_bwd_pairs_gluon"

# The consumer loop's head, from the shipped source: the tile's wait and its x product move (below).
_SOURCE = Path(importlib.util.find_spec(MODULE).origin).read_text()
_HEAD = "        for b in range(gl.cdiv(n_end, BLOCK_N)):\n"
_X = "            x = warpgroup_mma(qi_mine, keys.permute((1, 0)), x_zero, use_acc=False)\n"
_START = _SOURCE.index(_HEAD, _SOURCE.index("    def _pair_consumer("))
_LOOP_OLD = _SOURCE[_START:_SOURCE.index(_X, _START) + len(_X)]
_WAIT_FULL = ("            mbarrier.wait(full.index(stage), (b // STAGES) & 1)\n"
              "            fence_async_shared()\n")
_LOOP_NEW = ("""        nb = gl.cdiv(n_end, BLOCK_N)
        # x of tile 0 (for a row pair with no tile, a product over an unfilled stage whose result is never used).
        mbarrier.wait(full.index(0), 0, pred=nb >= 1)
        fence_async_shared()
        x = warpgroup_mma(qi_all.index(0).slice(W * HEADS_C, HEADS_C, dim=0), ring.index(0).permute((1, 0)), x_zero,
                          use_acc=False)
        for b in range(nb):
""" + _LOOP_OLD[len(_HEAD):].replace(_WAIT_FULL, "").replace(_X, """            # x of tile b is complete; the next tile's (this one's again on the last) runs under this epilogue.
            a = gl.minimum(b + 1, nb - 1)
            mbarrier.wait(full.index(a % STAGES), (a // STAGES) & 1)
            fence_async_shared()
            x_next = warpgroup_mma(qi_mine, ring.index(a % STAGES + z).permute((1, 0)), x_zero, use_acc=False,
                                   is_async=True)
"""))
_WAIT_OLD = "            dq = warpgroup_mma_wait(0, deps=[dq])\n"
_WAIT_NEW = "            x, dq = warpgroup_mma_wait(0, deps=[x_next, dq])\n"
_CHANGES = [(_LOOP_OLD, _LOOP_NEW), (_WAIT_OLD, _WAIT_NEW)]
_REGS_OLD = "CONFIG = dict(STAGES=4, REGS=(216, 40))"

VARIANTS = {"x_ahead": _CHANGES,
            "x_ahead_232": _CHANGES + [(_REGS_OLD, "CONFIG = dict(STAGES=4, REGS=(232, 24))")]}
VARIANT_CONSTEXPRS = {"x_ahead_232": {"REGS": (232, 24)}}        # as its launcher passes them


def inputs(T, H, device):
    """One causal document at ratio 4, every visible entry a slot (the warm-up's candidates)."""
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

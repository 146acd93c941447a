"""The indexer KL backward releases its key tile and its dx buffer without a warpgroup barrier.

As ``fwd_release_per_thread.py`` for the attention forward: ``mbarrier.arrive`` lowers to a ``bar.sync`` of the
warpgroup and one thread's arrive. ``empty`` (the tile's products are done) and ``dx_free`` (the owner's d index_k
product has read the pair's dx) only order reads by synchronous wgmma, so every thread arrives itself
(``async_copy.mbarrier_arrive(..., increment_count=False)``; the consumers issue no cp.async): 128 arrivals per
consumer. ``dx_ready`` keeps its barrier (it publishes dx). The pair kernel only (the one timed), over one
document's every visible entry, as the warm-up runs it.

    python benchmarks/kernel_variants.py benchmarks/variants/kl_release_per_thread.py --build-only
    python benchmarks/kernel_variants.py benchmarks/variants/kl_release_per_thread.py --T 8192 32768 --rounds 5

Inputs: one document of T rows, every visible compressed entry (K = T / 4), a random dKL/dI; H is not used.
"""
import torch

MODULE = "dsv4attn.ops.indexer_loss.gluon_hopper"
KERNEL = "_indexer_kl_bwd_pairs_gluon"


def inputs(T, H, device):
    import dsv4attn
    from dsv4attn.ops.index_sets import VisibleCompressed, contiguous_ranges
    from dsv4attn.ops.indexer_loss import triton as klt
    gen = torch.Generator(device=device).manual_seed(0)
    lay = dsv4attn.pack_batch(torch.tensor([0, T], dtype=torch.int32, device=device), T, T).compressed(4)
    cand = VisibleCompressed(lay, T)
    first, visible, table, shift = contiguous_ranges(cand)
    idx = klt.range_rows_triton(first, visible, table, shift, cand.width, 0, T)
    qi = torch.randn(T, 64, 128, device=device, generator=gen).to(torch.bfloat16)
    ki = torch.randn(lay.capacity, 128, device=device, generator=gen).to(torch.bfloat16)
    w = torch.randn(T, 64, device=device, generator=gen) * (64 * 128) ** -0.5
    g = torch.randn(T, cand.width, device=device, generator=gen) * (idx >= 0)
    grad = torch.rand(T, device=device, generator=gen) + 0.5
    return dict(qi=qi, ki=ki, w=w, idx=idx, n_end=visible.to(torch.int32), g=g, grad=grad, first=first)


def call(module, inp):
    qi = inp["qi"]
    dq, dk = torch.empty_like(qi), torch.zeros(inp["ki"].shape, device=qi.device)
    dw = torch.empty_like(inp["w"])
    module.launch_bwd_pairs(qi, inp["ki"], inp["w"], inp["idx"], inp["n_end"], inp["g"], inp["grad"], dq, dk, dw,
                            inp["first"])
    return dq, dk, dw


VARIANTS = {
    "tile and dx released per thread": [
        ("        mbarrier.arrive(dx_free.index(u))\n",
         "        async_copy.mbarrier_arrive(dx_free.index(u), increment_count=False)\n"),
        ("            dq = warpgroup_mma(dx_mine, keys, dq)\n            mbarrier.arrive(empty.index(stage))\n",
         "            dq = warpgroup_mma(dx_mine, keys, dq)\n"
         "            async_copy.mbarrier_arrive(empty.index(stage), increment_count=False)\n"),
        ("        empty = mbarriers(STAGES, 2)\n", "        empty = mbarriers(STAGES, 256)\n"),
        ("        dx_free = mbarriers(2, 1)\n", "        dx_free = mbarriers(2, 128)\n"),
    ],
}

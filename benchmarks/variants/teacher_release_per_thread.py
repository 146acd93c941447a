"""The warm-up teacher's consumers release their ring stage without a warpgroup barrier.

As ``fwd_release_per_thread.py`` for the attention forward: ``mbarrier.arrive`` lowers to a ``bar.sync`` of the
warpgroup and one thread's arrive, where the stage only needs each thread past the (synchronous) wgmma that read
it. Here every thread arrives itself through ``async_copy.mbarrier_arrive(..., increment_count=False)`` (consumers
issue no cp.async, so it arrives at once); ``empty`` counts 128 arrivals (one consumer uses each stage). All four
teacher kernels share the consumers; timed here: the range form's LSE then mass over one document's every visible
entry, as the warm-up runs them on one device.

    python benchmarks/kernel_variants.py benchmarks/variants/teacher_release_per_thread.py --build-only
    python benchmarks/kernel_variants.py benchmarks/variants/teacher_release_per_thread.py --T 8192 32768 --rounds 5

Inputs: one document of T rows (q (T, 64, 512), T / 4 compressed entries, K = T / 4 slots a row); the mass takes the
LSE as its full denominator.
"""
import torch

KERNEL = "_teacher_lse_ranges_gluon"


def inputs(T, H, device):
    """The KL benchmark's warm-up inputs (``benchmarks/indexer_loss.py``; it takes H = 64), its candidates as ranges."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from indexer_loss import make_inputs
    from dsv4attn.ops.index_sets import contiguous_ranges
    from dsv4attn.ops.indexer_loss import triton as klt
    (_, _, _, q, ck, _, cand, _), _ = make_inputs(T, "warmup")
    first, visible, table, shift = contiguous_ranges(cand)
    idx = klt.range_rows_triton(first, visible, table, shift, cand.width, 0, T)
    return dict(q=q, ck=ck, idx=idx, n_end=visible.to(torch.int32), first=first)


def call(module, inp):
    scale = 512 ** -0.5
    lse = module.teacher_lse(inp["q"], inp["ck"], inp["idx"], scale, n_end=inp["n_end"], first=inp["first"])
    mass = module.teacher_mass(inp["q"], inp["ck"], inp["idx"], lse, scale, n_end=inp["n_end"], first=inp["first"])
    return lse, mass


VARIANTS = {
    "stage released per thread": [
        ("        s = warpgroup_mma(q_smem, ring.index(b % STAGES).permute((1, 0)), s_zero, use_acc=False)\n"
         "        mbarrier.arrive(empty.index(b % STAGES))\n",
         "        s = warpgroup_mma(q_smem, ring.index(b % STAGES).permute((1, 0)), s_zero, use_acc=False)\n"
         "        async_copy.mbarrier_arrive(empty.index(b % STAGES), increment_count=False)\n"),
        ("return q_smem, ring, mbarriers(STAGES, ARRIVALS), mbarriers(STAGES, 1)",
         "return q_smem, ring, mbarriers(STAGES, ARRIVALS), mbarriers(STAGES, 128)"),
    ],
}

"""Indexer KL backward, one row a program (Gluon, SM90; the sparse phase's top-k): each consumer's d index_q and
d index_k products of a tile issued back to back without a wait between them.

Why: the sparse-phase KL backward (3.8 ms at 32K on an H100, against the issue's 4 ms target for the whole sparse KL
with its forward) runs each consumer's tile as x (wait) -> ReLU / weights -> dx to shared memory -> d index_q (wait)
-> d index_k (wait) -> release -> reductions. Both products read dx and are independent: issued together, the second
need not wait for the first to drain. Neither accumulator is in flight across the loop's back edge (the case that
made ptxas serialize the score kernel's wgmma in the seventh session); `--build-only` shows ptxas's verdict.

- ``async_products``: as above. Outputs must be bitwise the shipped kernel's (the same products; d index_k's fp32
  atomics aside).
- ``no_dk_reduction`` and ``no_dk`` (wrong d index_k on purpose): what the d index_k reductions, and the d index_k
  product with them, cost. The twenty-sixth session's arithmetic (8.6 GB of reductions in 3.6 ms) says the kernel is
  bound by them; a sparse-phase row pair (two rows' contributions to a shared slot summed before one reduction)
  would pay only if they are.

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/kl_async_products.py --T 32768 8192 --H 64`` (the
sparse phase's shape: 512 top-k slots a row of the T / 4 compressed entries, one document); offline: ``...
--build-only``.
"""
import torch

MODULE = "dsv4attn.ops.indexer_loss.gluon_hopper"
KERNEL = "_indexer_kl_bwd_gluon"

_OLD = """            dq = warpgroup_mma(dx_smem.index(W + z), keys, dq)
            dk = warpgroup_mma(dx_smem.index(W + z).permute((1, 0)), qi_all.index(z), dk_zero, use_acc=False)
            mbarrier.arrive(empty.index(stage))
"""
_NEW = """            dq = warpgroup_mma(dx_smem.index(W + z), keys, dq, is_async=True)
            dk = warpgroup_mma(dx_smem.index(W + z).permute((1, 0)), qi_all.index(z), dk_zero, use_acc=False,
                               is_async=True)
            dq, dk = warpgroup_mma_wait(0, deps=[dq, dk])
            mbarrier.arrive(empty.index(stage))
"""
_IMPORT_OLD = "                            release, sm90, warpgroup_mma)"
_IMPORT_NEW = "                            release, sm90, warpgroup_mma, warpgroup_mma_wait)"

_RED_OLD = "            ok = idx_red >= 0\n            add_reduced(dk, DKI"
_DK_OLD = ("            dk = warpgroup_mma(dx_smem.index(W + z).permute((1, 0)), qi_all.index(z), dk_zero, use_acc=False)\n"
           "            mbarrier.arrive(empty.index(stage))\n"
           "            ok = idx_red >= 0\n"
           "            add_reduced(dk, DKI, gl.where(ok, idx_red, 0).to(gl.int64) * HEAD_DIM_C, ok, 0)\n")

VARIANTS = {
    "async_products": [(_OLD, _NEW), (_IMPORT_OLD, _IMPORT_NEW)],
    # Bounds (wrong d index_k on purpose): the reductions predicated off at run time (n_end >= 0 always), the
    # products kept; then neither the d index_k product nor its reductions.
    "no_dk_reduction": [(_RED_OLD, "            ok = (idx_red >= 0) & (n_end < 0)\n            add_reduced(dk, DKI")],
    "no_dk": [(_DK_OLD, "            mbarrier.arrive(empty.index(stage))\n")],
}


def inputs(T, H, device):
    """The sparse phase: each row's 512 slots drawn from its visible compressed entries (T / 4 keys), -1 where a row
    sees fewer; dKL/dI random, as the forward saves it."""
    gen = torch.Generator(device=device).manual_seed(0)
    K, nk = 512, T // 4
    visible = (torch.arange(T, device=device) // 4 + 1)[:, None]
    idx = (torch.rand(T, K, device=device, generator=gen) * visible).long()
    idx = torch.where(torch.arange(K, device=device)[None, :] < visible, idx, -1).int().contiguous()
    n_end = torch.minimum(visible[:, 0], torch.tensor(K, device=device)).int()
    qi = torch.randn(T, 64, 128, device=device, generator=gen).bfloat16()
    ki = torch.randn(nk, 128, device=device, generator=gen).bfloat16()
    w = torch.randn(T, 64, device=device, generator=gen) / 90.0
    g = torch.randn(T, K, device=device, generator=gen) / K
    grad = torch.full((T,), 1.0 / T, device=device)
    return dict(args=(qi, ki, w, idx, n_end, g, grad), nk=nk)


def call(module, inp):
    qi, ki, w, idx, n_end, g, grad = inp["args"]
    dqi, dw = torch.empty_like(qi), torch.empty_like(w)
    dki = torch.zeros(inp["nk"], 128, device=qi.device)
    module.launch_bwd(qi, ki, w, idx, n_end, g, grad, dqi, dki, dw)
    return dqi, dki, dw

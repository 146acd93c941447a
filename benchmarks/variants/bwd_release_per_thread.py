"""The attention backward releases its kv tile and its P / dS buffers without a warpgroup barrier.

As ``fwd_release_per_thread.py`` for the forward: ``mbarrier.arrive`` lowers to a ``bar.sync`` of the warpgroup and
one thread's arrive. ``empty`` (both warpgroups' dq products have read the tile) and ``pfree`` (the dKV
warpgroup's last products have read P and dS) only order reads by wgmma that each thread has waited for, so every
thread arrives itself (``async_copy.mbarrier_arrive(..., increment_count=False)``; the consumers issue no
cp.async): ``empty`` counts 256 arrivals, ``pfree`` 128. ``pready`` keeps its barrier (it publishes P and dS).

    python benchmarks/kernel_variants.py benchmarks/variants/bwd_release_per_thread.py --build-only
    python benchmarks/kernel_variants.py benchmarks/variants/bwd_release_per_thread.py --T 32768 8192 --H 64 128 \
        --rounds 7
"""
import torch

MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper_bwd"
KERNEL = "_sparse_attn_bwd_gluon"

VARIANTS = {
    "tile and P / dS released per thread": [
        ("            dq = warpgroup_mma(ds_buf.index(buf + z), ring.index(z).slice(0, HALF, dim=1), dq)\n"
         "            mbarrier.arrive(empty.index(0))\n",
         "            dq = warpgroup_mma(ds_buf.index(buf + z), ring.index(z).slice(0, HALF, dim=1), dq)\n"
         "            gluon_common.async_copy.mbarrier_arrive(empty.index(0), increment_count=False)\n"),
        ("            dq = warpgroup_mma(ds_buf.index(buf + z), ring.index(z).slice(HALF, HALF, dim=1), dq)\n"
         "            mbarrier.arrive(empty.index(0))\n",
         "            dq = warpgroup_mma(ds_buf.index(buf + z), ring.index(z).slice(HALF, HALF, dim=1), dq)\n"
         "            gluon_common.async_copy.mbarrier_arrive(empty.index(0), increment_count=False)\n"),
        ("                    mbarrier.arrive(pfree.index(buf))",
         "                    gluon_common.async_copy.mbarrier_arrive(pfree.index(buf), increment_count=False)"),
        ("empty = mbarriers(1, 2)  ", "empty = mbarriers(1, 256)"),
        ("pfree = mbarriers(2, 1)", "pfree = mbarriers(2, 128)"),
    ],
}


def inputs(T, H, device):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sparse_attention import D, make_inputs
    q, kv, idx, sink, grad_out = make_inputs(T, device, heads=H)
    gen = torch.Generator(device=device).manual_seed(1)
    denom2 = torch.randn(T, H, device=device, generator=gen) + 12.0      # log2 denominators of plausible size
    delta = torch.randn(T, H, device=device, generator=gen) * 0.1
    return dict(q=q, kv=kv, idx=idx, do=grad_out, denom2=denom2, delta=delta, scale=D ** -0.5)


def call(module, inp):
    dq = torch.empty_like(inp["q"])
    dkv = torch.zeros(inp["kv"].shape, dtype=torch.float32, device=inp["q"].device)
    module.launch(inp["q"], inp["do"], inp["kv"], inp["idx"], inp["denom2"], inp["delta"], dq, dkv, inp["scale"])
    return dq, dkv

"""Gluon attention backward: the producer asks L2 for the next blocks' kv rows before the one stage is free.

``fwd_kv_prefetch.py`` states the hypothesis for the forward. The backward's ring has one stage (q, dO and the tile
take 192 KiB), so every block's refill starts only after the consumers release the previous one, and its gather
latency is all exposed; prefetching block b + AHEAD's rows into L2 right after block b's copies are issued should
shorten it. Outputs must equal the shipped kernel's up to the order of the fp32 dKV reductions.

Build offline: ``python benchmarks/kernel_variants.py benchmarks/variants/bwd_kv_prefetch.py --build-only``.
Time on the GPU: ``... --T 32768 --H 64 128 --rounds 5``.
"""
import runpy
from pathlib import Path

import torch

_FWD = runpy.run_path(str(Path(__file__).with_name("fwd_kv_prefetch.py")))
MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper_bwd"
KERNEL = "_sparse_attn_bwd_gluon"
_ANCHOR = "    @gluon.jit\n    def _bwd_producer("
_CALL = "        ring_gather(KV, IDX, K, nb, t, ring, full, empty, D, BLOCK_N, 1)\n"
VARIANTS = {f"kv_prefetch_{a}": _FWD["changes"](a, _ANCHOR, _CALL, "gluon_common.") for a in (1, 2)}


# The backward alone on benchmarks/sparse_attention.py's inputs (denominators and Delta of plausible size).
def inputs(T, H, device):
    import sys
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

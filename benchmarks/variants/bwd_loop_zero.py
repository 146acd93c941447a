"""Gluon backward: the block-dependent zero index that keeps the wgmma descriptors inside the loops.

``z = (b + 1) // (nb + 1)`` inside ``for b in range(nb)``: Triton 3.9's LLVM proves it is 0 (b < nb) and hoists
every descriptor out of the loops; ptxas then spills 608 bytes (60 on 3.6 and 3.7.1). ``b // (K + 1)`` is 0 as well
(b < nb <= ceil(K / 64) <= K) but K is not related to the trip count. Variants: the new index, and the new index with
8 more registers for the dKV warpgroup (taken from the producer).
"""
import torch

MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper_bwd"
KERNEL = "_sparse_attn_bwd_gluon"
OLD = "z = (b + 1) // (nb + 1)\n            buf = b % 2\n            n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout({}"
NEW = "z = b // (K + 1)\n            buf = b % 2\n            n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout({}"
ZERO = [(OLD.format("0, s_layout"), NEW.format("0, s_layout")), (OLD.format("1, red_layout"), NEW.format("1, red_layout"))]
REGS = [("[4, 4], [REGS[0], REGS[1]])", "[4, 4], [232, 32])")]
VARIANTS = {"loop_zero": ZERO, "loop_zero_regs_232_32": ZERO + REGS, "regs_232_32": REGS}


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

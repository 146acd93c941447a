"""Gluon attention backward: the producer prefetches into L2 the q and dO rows of a program that starts later.

The backward's prologue reads 64 heads of q and of dO (128 KiB) that no other program reads, from HBM. Programs
run in row order, about one per SM at a time, so the program AHEAD rows further starts about one program-duration
later; a prefetch (``prefetch.global.L2::evict_last``, 8 lines of 128 bytes per producer thread) issued at this
program's start should make its q and dO L2 hits. Cost: AHEAD x 128 KiB of L2 (16.9 MB at 132) beside the kv rows
the gathers reuse and the dKV lines the reductions touch. Outputs must equal the shipped kernel's up to the order
of the fp32 dKV reductions (a prefetch changes no value). Built offline (sm_90, Triton 3.6.0 / 3.7.1 / 3.9.0);
not timed yet: ``python benchmarks/kernel_variants.py benchmarks/variants/bwd_q_prefetch.py --T 32768 --H 64 128``.
"""
import torch

MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper_bwd"
KERNEL = "_sparse_attn_bwd_gluon"
OLD = """        copy_heads(Q, H, t, hb, q_smem, D)
        copy_heads(DO, H, t, hb, do_smem, D)
"""
NEW = """        pf: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        lines = gl.arange(0, BLOCK_H_C * D // 64, layout=pf)          # 128-byte lines of the 64 heads' rows
        rows = gl.num_programs(0) // (H // BLOCK_H_C)
        t2 = t + AHEAD
        offs = (t2 * H + hb * BLOCK_H_C) * D + lines.to(gl.int64) * 64
        live = gl.zeros_like(lines) + (t2 < rows).to(gl.int32)
        gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [Q + offs, live], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [DO + offs, live], dtype=gl.int32, is_pure=False, pack=1)
        copy_heads(Q, H, t, hb, q_smem, D)
        copy_heads(DO, H, t, hb, do_smem, D)
"""
VARIANTS = {f"ahead_{n}": [(OLD, NEW.replace("AHEAD", str(n)))] for n in (132, 264)}


# The backward alone on benchmarks/sparse_attention.py's inputs (denominators and Delta of plausible size).
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

"""Indexer KL backward, row pairs (Gluon, SM90; the warm-up): each consumer's score product x = qi K^T with its row's
qi (64 x 128) as the register operand instead of re-read from shared memory by every product.

Why: the warm-up teacher's range form gained 1.19-1.28x with q as the register operand beside row pairs
(BENCHMARKS.md, twenty-eighth session), where every product had re-read q's slice from shared memory. The pair
backward's consumers do three products a tile from shared memory (x = qi K^T, dq += dx K, the owner's
d index_k = dx^T qi) besides the producer's gathered writes; qi in registers costs 32 registers a thread and
removes the A-operand reads of the first. The d index_k product still takes both rows' qi from shared memory.
(The same change in the gathering teacher mass, whose rows share nothing, was slower or no faster: there the
gathers set the pace. This kernel's limit is not measured.)

- ``qi_regs``: as above (outputs must be bitwise equal to the shipped kernel's).

Inputs: the warm-up (one document, every visible entry: row t's slots are entries 0 .. t // 4, K = T / 4), with
the rows' ranges' starts (all 0) for the pairs. GPU:
``python benchmarks/kernel_variants.py benchmarks/variants/kl_pairs_qi_regs.py --T 32768 8192 --H 64``; offline:
``... --build-only``.
"""
import torch

MODULE = "dsv4attn.ops.indexer_loss.gluon_hopper"
KERNEL = "_indexer_kl_bwd_pairs_gluon"

_SIG = ("    def _pair_consumer(W_, IDX, G, GRAD, DQI, DKI, DW, K, r0, r1, n_end, qi_all, ring, dx_smem, full, "
        "empty,\n")
_INIT = ("        dw = gl.zeros([HEADS_C], gl.float32, layout=row_layout)\n"
         "        for b in range(gl.cdiv(n_end, BLOCK_N)):\n")
_LOAD = ("        qi_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=x_layout, k_width=2)\n"
         "        qi_heads = gl.arange(0, HEADS_C, layout=gl.SliceLayout(1, qi_layout))\n"
         "        qi_dims = gl.arange(0, HEAD_DIM_C, layout=gl.SliceLayout(0, qi_layout))\n"
         "        qi_regs = gl.load(QI + (base * HEADS_C + qi_heads.to(gl.int64))[:, None] * HEAD_DIM_C\n"
         "                          + qi_dims[None, :], mask=((qi_heads >= 0) & active)[:, None], other=0.0)\n")
_X = "            x = warpgroup_mma(qi_mine, keys.permute((1, 0)), x_zero, use_acc=False)\n"
_CALLS = [("            (_pair_consumer, (W_, IDX, G, GRAD, DQI, DKI, DW, K, r0, r1, n_end, qi_all, ring, dx_smem, "
           "full, empty,\n"
           f"                              dx_ready, dx_free, gl.constexpr({w}), BLOCK_N, STAGES)),\n",
           "            (_pair_consumer, (QI, W_, IDX, G, GRAD, DQI, DKI, DW, K, r0, r1, n_end, qi_all, ring, dx_smem, "
           "full,\n"
           f"                              empty, dx_ready, dx_free, gl.constexpr({w}), BLOCK_N, STAGES)),\n")
          for w in (0, 1)]

VARIANTS = {
    "qi_regs": [
        (_SIG, _SIG.replace("(W_, IDX,", "(QI, W_, IDX,")),
        (_INIT, _INIT.replace("        for b", _LOAD + "        for b")),
        (_X, _X.replace("qi_mine, keys", "qi_regs, keys")),
        *_CALLS,
    ],
}


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
    qi, ki, w, idx, n_end, g, grad = inp["args"]
    dqi, dw = torch.empty_like(qi), torch.empty_like(w)
    dki = torch.zeros(inp["nk"], 128, device=qi.device)
    module.launch_bwd_pairs(qi, ki, w, idx, n_end, g, grad, dqi, dki, dw, inp["first"])
    return dqi, dki, dw

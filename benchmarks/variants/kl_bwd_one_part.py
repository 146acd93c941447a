"""Indexer KL backward (Gluon, SM90): the shipped one rounded dx against the hi + lo pair it replaced, and ring
depths now that the pair's second buffer is gone.

- ``hi_plus_lo``: dx enters dq and dk as two parts in the input dtype (5 products a tile instead of 3; the kernel
  before this change, outputs differ in rounding);
- ``stages_2`` / ``stages_6``: ring depth 2 / 6 instead of 4 (outputs bitwise equal).

Inputs by ``--H`` (the main heads do not enter this kernel): 64 = the warm-up (one document, every visible entry:
row t's slots are entries 0 .. t // 4, K = T / 4); 512 = the sparse phase (512 random visible entries a row).
Time on the GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/kl_bwd_one_part.py --T 32768 --H 64 512``.
"""
import torch

MODULE = "dsv4attn.ops.indexer_loss.gluon_hopper"
KERNEL = "_indexer_kl_bwd_gluon"

_STORE = "            dx_smem.index(W + z).store(dx.to(dx_smem.dtype))\n"
_DK = "            dk = warpgroup_mma(dx_smem.index(W + z).permute((1, 0)), qi_all.index(z), dk_zero, use_acc=False)\n"
_ALLOC = "dx_smem = gl.allocate_shared_memory(dtype, [2, HEADS_C, BLOCK_N], dx_layout)"
_CONFIG = "CONFIG = dict(STAGES=4,"

VARIANTS = {
    "hi_plus_lo": [
        (_ALLOC, _ALLOC.replace("[2, HEADS_C", "[4, HEADS_C")),
        (_STORE, "            hi = dx.to(dx_smem.dtype)\n            dx_smem.index(W + z).store(hi)\n"
                 "            dx_smem.index(W + 2 + z).store((dx - hi.to(gl.float32)).to(dx_smem.dtype))\n"),
        (_DK, _DK + "            dq = warpgroup_mma(dx_smem.index(W + 2 + z), keys, dq)\n"
                    "            dk = warpgroup_mma(dx_smem.index(W + 2 + z).permute((1, 0)), qi_all.index(z), dk)\n"),
    ],
    "stages_2": [(_CONFIG, _CONFIG.replace("STAGES=4", "STAGES=2"))],
    "stages_6": [(_CONFIG, _CONFIG.replace("STAGES=4", "STAGES=6"))],
}


def inputs(T, H, device):
    gen = torch.Generator(device=device).manual_seed(0)
    t = torch.arange(T, device=device)
    if H == 512:
        K, nk = 512, T // 4
        visible = (t // 4 + 1)[:, None]
        idx = (torch.rand(T, K, device=device, generator=gen) * visible).long()
        idx = torch.where(torch.arange(K, device=device)[None, :] < visible, idx, -1).int()
    else:
        K = nk = T // 4
        idx = torch.arange(K, device=device, dtype=torch.int32)[None, :].expand(T, K)
        idx = torch.where(idx <= (t // 4)[:, None], idx, -1).contiguous()
    n_end = (idx >= 0).sum(1).int()
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

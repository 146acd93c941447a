"""Indexer KL backward (Gluon, SM90): what its time is made of, by variants that skip a stage.

The hypothesis: the saved-gradient backward is bound by its d index_k reductions. Every slot of every row adds a
128-float row (512 bytes) to the fp32 accumulator: 68.7 GB at the warm-up's every visible entry (T = 32768, 4096
slots a row on average), 8.6 GB at the sparse phase's 512, which at the measured 29.0 / 4.4 ms is 2.4 / 2.0 TB/s of
reductions. Its tensor work is 5 products a tile (x, and dq / dk each as hi + lo parts): 11 TFLOP in the warm-up.

- ``no_split``: dx enters dq and dk as one rounded part (3 products a tile; outputs differ in rounding);
- ``no_dk_add``: the tile's d index_k rows are formed but not added (a branch no row takes keeps the products);
- ``no_split_no_dk_add``: both.

Inputs by ``--H`` (the main heads do not enter this kernel): 64 = the warm-up (one document, every visible entry:
row t's slots are entries 0 .. t // 4, K = T / 4); 512 = the sparse phase (512 random visible entries a row).
Time on the GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/kl_bwd_stages.py --T 32768 --H 64 512``.
"""
import torch

MODULE = "dsv4attn.ops.indexer_loss.gluon_hopper"
KERNEL = "_indexer_kl_bwd_gluon"

_LAUNCH = "BLOCK_N=BLOCK_N, STAGES=cfg[\"STAGES\"], SPLIT=split,"
_ADD = "            add_reduced(dk, DKI, gl.where(ok, idx_red, 0).to(gl.int64) * HEAD_DIM_C, ok, 0)\n"
_NO_ADD = "            if n_end < 0:\n    " + _ADD
_NO_SPLIT = (_LAUNCH, _LAUNCH.replace("SPLIT=split", "SPLIT=False"))

VARIANTS = {"no_split": [_NO_SPLIT], "no_dk_add": [(_ADD, _NO_ADD)],
            "no_split_no_dk_add": [_NO_SPLIT, (_ADD, _NO_ADD)]}


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
    module.launch_bwd(qi, ki, w, idx, n_end, g, grad, dqi, dki, dw, split=True)
    return dqi, dki, dw

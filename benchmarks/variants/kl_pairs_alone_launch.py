"""Indexer KL backward, row pairs (Gluon, SM90; the warm-up): what the second launch costs, the one for rows whose
partner starts elsewhere (``launch_bwd_pairs``: one program per pair again, all but those rows exiting at once).

Why: in one document every pair shares its start, so that launch is T / 2 programs per chunk of rows that each
allocate the kernel's shared memory and barriers and exit; the warm-up at 32K runs it once per KL chunk (8 chunks of
4096 rows). If it costs more than noise, the next step is a launch over the unpaired rows only (a device-side
compaction with a host bound, e.g. ``torch.nonzero_static`` sized by the document count: no host read).

- ``no_alone_launch``: the pairs' launch only. Wrong where a pair is split (a document starting at an odd row); on
  these inputs (one document, every pair shares its start) the outputs must be bitwise equal to the shipped ones.
- ``no_dk_reduction`` (wrong d index_k on purpose): the d index_k products formed, their reductions predicated off
  at run time (a mask the compiler cannot fold). What the reductions themselves cost.
- ``no_dk`` (wrong d index_k on purpose): no d index_k products or reductions (and no wait for a dx buffer's
  release, which only they give). What the dq side costs alone: the floor of a split backward whose d index_k is
  formed by key blocks without reductions (the keys of a range are consecutive rows).

Inputs: the warm-up (one document, every visible entry: row t's slots are entries 0 .. t // 4, K = T / 4), in the
KL op's chunks of rows (``indexer_loss.triton.INDEX_BUDGET`` slots each). GPU:
``python benchmarks/kernel_variants.py benchmarks/variants/kl_pairs_alone_launch.py --T 32768 8192 --H 64``;
offline: ``... --build-only`` (the kernel's source is unchanged: the launcher differs).
"""
import torch

MODULE = "dsv4attn.ops.indexer_loss.gluon_hopper"
KERNEL = "_indexer_kl_bwd_pairs_gluon"

VARIANTS = {
    "no_alone_launch": [
        ("    for a, b in ((row0, row1), (alone, torch.full_like(alone, -1))):\n",
         "    for a, b in ((row0, row1),):\n"),
    ],
    "no_dk_reduction": [
        ("        add_reduced(dk, DKI, gl.where(ok, key, 0).to(gl.int64) * HEAD_DIM_C, ok, 0)\n",
         "        add_reduced(dk, DKI, gl.where(ok, key, 0).to(gl.int64) * HEAD_DIM_C, ok & (r0 < -1), 0)\n"),
    ],
    "no_dk": [
        ("            mbarrier.wait(dx_free.index(u), (use + 1) & 1, pred=(use >= 1) & (u != W))\n", ""),
        ("                _pair_dk(b - 1, K, IDX, base0, base1, r0, r1, DKI, dx_smem, qi_all, dx_ready, dx_free, dk_zero,\n"
         "                         BLOCK_N)\n", "                pass\n"),
        ("            _pair_dk(nb - 1, K, IDX, base0, base1, r0, r1, DKI, dx_smem, qi_all, dx_ready, dx_free, dk_zero, BLOCK_N)\n",
         "            pass\n"),
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
    from dsv4attn.ops.index_sets import chunk_rows
    from dsv4attn.ops.indexer_loss import triton as klt
    qi, ki, w, idx, n_end, g, grad = inp["args"]
    dqi, dw = torch.empty_like(qi), torch.empty_like(w)
    dki = torch.zeros(inp["nk"], 128, device=qi.device)
    for s, e in chunk_rows(qi.shape[0], idx.shape[1], budget=klt.INDEX_BUDGET):    # the op's chunks
        module.launch_bwd_pairs(qi[s:e], ki, w[s:e], idx[s:e], n_end[s:e], g[s:e], grad[s:e], dqi[s:e], dki,
                                dw[s:e], inp["first"][s:e])
    return dqi, dki, dw

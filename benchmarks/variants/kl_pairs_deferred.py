"""The pair KL backward (``_indexer_kl_bwd_pairs_gluon``) with each tile's d index_k deferred by one tile.

Hypothesis (BENCHMARKS.md, "the KL backward takes the warm-up's rows in pairs"): the shipped pair kernel runs its two
consumers in lockstep, 323 TFLOP/s at 32K. Tile b's owner forms d index_k right after its own dq, so it first waits
for the other consumer's dx of the same tile, and the other consumer's next tile waits in turn for the owner's next
dx, which comes after that product and its reductions: per tile the pair pays score + dq + d index_k + reductions
one after another. Deferred, the owner of tile b forms its d index_k after its score and dq of tile b + 1, when the
other consumer's dx of tile b has long been written; every wait then refers to an earlier step of the other
consumer, which is already done unless it lags by a whole tile. Same products, same reductions, same outputs up to
the order of fp32 sums.

    python benchmarks/kernel_variants.py benchmarks/variants/kl_pairs_deferred.py --build-only
    python benchmarks/kernel_variants.py benchmarks/variants/kl_pairs_deferred.py --T 8192 32768 --rounds 5

Inputs: one document of T rows, every visible compressed entry (K = T / 4), a random dKL/dI; H is not used.
"""
import torch

MODULE = "dsv4attn.ops.indexer_loss.gluon_hopper"
KERNEL = "_indexer_kl_bwd_pairs_gluon"


def inputs(T, H, device):
    import dsv4attn
    from dsv4attn.ops.index_sets import VisibleCompressed, contiguous_ranges
    from dsv4attn.ops.indexer_loss import triton as klt
    gen = torch.Generator(device=device).manual_seed(0)
    lay = dsv4attn.pack_batch(torch.tensor([0, T], dtype=torch.int32, device=device), T, T).compressed(4)
    cand = VisibleCompressed(lay, T)
    first, visible, table, shift = contiguous_ranges(cand)
    idx = klt.range_rows_triton(first, visible, table, shift, cand.width, 0, T)
    qi = torch.randn(T, 64, 128, device=device, generator=gen).to(torch.bfloat16)
    ki = torch.randn(lay.capacity, 128, device=device, generator=gen).to(torch.bfloat16)
    w = torch.randn(T, 64, device=device, generator=gen) * (64 * 128) ** -0.5
    g = torch.randn(T, cand.width, device=device, generator=gen) * (idx >= 0)
    grad = torch.rand(T, device=device, generator=gen) + 0.5
    return dict(qi=qi, ki=ki, w=w, idx=idx, n_end=visible.to(torch.int32), g=g, grad=grad, first=first)


def call(module, inp):
    qi = inp["qi"]
    dq, dk = torch.empty_like(qi), torch.zeros(inp["ki"].shape, device=qi.device)
    dw = torch.empty_like(inp["w"])
    module.launch_bwd_pairs(qi, inp["ki"], inp["w"], inp["idx"], inp["n_end"], inp["g"], inp["grad"], dq, dk, dw,
                            inp["first"])
    return dq, dk, dw


_HELPER = '''    @gluon.jit
    def _pair_dk(b, K, IDX, base0, base1, r0, r1, DKI, dx_smem, qi_all, dx_ready, dx_free, dk_zero,
                 BLOCK_N: gl.constexpr):
        red_slots: gl.constexpr = gl.SliceLayout(1, reduction_layout(BLOCK_N, HEAD_DIM_C))
        u = b % 2
        z = loop_zero(b, K)
        mbarrier.wait(dx_ready.index(u), (b // 2) & 1)
        dk = warpgroup_mma(dx_smem.index(u + z).permute((1, 0)), qi_all.index(z), dk_zero, use_acc=False)
        mbarrier.arrive(dx_free.index(u))
        n_red = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=red_slots)
        i0 = gl.load(IDX + base0 + n_red, mask=(n_red < K) & (r0 >= 0), other=-1)
        i1 = gl.load(IDX + base1 + n_red, mask=(n_red < K) & (r1 >= 0), other=-1)
        key = gl.where(i0 >= 0, i0, i1)
        ok = key >= 0
        add_reduced(dk, DKI, gl.where(ok, key, 0).to(gl.int64) * HEAD_DIM_C, ok, 0)

    @gluon.jit
    def _pair_consumer('''

_OWNER_NOW = '''            if u == W:
                # d index_k rows of the tile's 64 slots, both rows' 128 heads as the product's K.
                mbarrier.wait(dx_ready.index(u), use & 1)
                dk = warpgroup_mma(dx_smem.index(u + z).permute((1, 0)), qi_all.index(z), dk_zero, use_acc=False)
                mbarrier.arrive(dx_free.index(u))
                n_red = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=red_slots)
                i0 = gl.load(IDX + base0 + n_red, mask=(n_red < K) & (r0 >= 0), other=-1)
                i1 = gl.load(IDX + base1 + n_red, mask=(n_red < K) & (r1 >= 0), other=-1)
                key = gl.where(i0 >= 0, i0, i1)
                ok = key >= 0
                add_reduced(dk, DKI, gl.where(ok, key, 0).to(gl.int64) * HEAD_DIM_C, ok, 0)
        q_heads'''

_OWNER_LATER = '''            if (b >= 1) & ((b - 1) % 2 == W):   # the previous tile's, after this tile's score and dq
                _pair_dk(b - 1, K, IDX, base0, base1, r0, r1, DKI, dx_smem, qi_all, dx_ready, dx_free, dk_zero,
                         BLOCK_N)
        nb = gl.cdiv(n_end, BLOCK_N)
        if (nb >= 1) & ((nb - 1) % 2 == W):             # the last tile's
            _pair_dk(nb - 1, K, IDX, base0, base1, r0, r1, DKI, dx_smem, qi_all, dx_ready, dx_free, dk_zero,
                     BLOCK_N)
        q_heads'''

VARIANTS = {
    "d index_k one tile later": [("    @gluon.jit\n    def _pair_consumer(", _HELPER),
                                 (_OWNER_NOW, _OWNER_LATER)],
}

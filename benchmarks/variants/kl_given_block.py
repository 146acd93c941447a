"""Indexer KL forward kernel, its GEMM-free form: wider blocks when the teacher mass and the student logits are given.

With both given (the warm-up on SM90: the Gluon teacher's mass and the score kernel's orders; the sparse phase: the
mass and the top-k's scores), ``_full_denominator_given_pass`` only loads, per block of BLOCK_N slots, the slot
numbers, I(j) and m(j), and updates per-lane LSEs and sums: no dot. BLOCK_N stays the dot form's 64 with 8 warps, so
most of the program's 256 threads hold copies of the same 64 values and a row of 8192 slots takes 2 x 128 short
steps. By ``benchmarks/indexer_loss.py --split`` (twentieth session) this pass costs ~4.4 ms per direction of the
warm-up at 32K (9.8 ms with the score kernel's 5.4) against ~1 ms to stream its (T, K) fp32 inputs twice at 4 TB/s.
The variants raise BLOCK_N for this form only (KL sums change in their fp32 order: outputs within rounding).

Time on the GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/kl_given_block.py --T 32768 --rounds 5``
(the warm-up's 8 row chunks of one 32K document, K = 8192, through ``_kl_forward`` with the mass given; the score
kernel's orders are part of both timings).

Checked under the CPU interpreter (T = 1024, K = 256): KL within 9e-7 of the shipped kernel's (fp32 order), full2
equal, rowstat within 1e-6. Not built offline (``--build-only`` covers the Gluon kernels only).
"""
import torch

MODULE = "dsv4attn.ops.indexer_loss.triton"

_META = '''                SCORES_GIVEN=scores_given or orders, SCORE_ORDERS=orders)
'''


def _wider(block: int):
    return [(_META, _META + f'''    if meta["SCORES_GIVEN"] and meta["MASS_GIVEN"]:      # no dot: wider blocks
        meta["BLOCK_N"] = min({block}, _pow2(K))
''')]


VARIANTS = {"given_block_256": _wider(256), "given_block_1024": _wider(1024)}


# One document of T rows, every visible compressed entry (K = T / 4), Flash indexer shapes (64 x 128), 64 main heads
# of 512; a random positive teacher mass (the values do not change the work), each head's L = 0.
def inputs(T, H, device):
    from dsv4attn.ops.index_sets import VisibleCompressed, contiguous_ranges
    import dsv4attn
    gen = torch.Generator(device=device).manual_seed(0)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    cand = VisibleCompressed(dsv4attn.pack_batch(cu, T, T).compressed(4), T)
    n = cand.layout.capacity

    def randn(*shape, std=1.0):
        return (std * torch.randn(*shape, device=device, generator=gen)).to(torch.bfloat16)
    operands = (randn(T, 64, 128), randn(n, 128), randn(T, 64, std=64 ** -0.5 * 128 ** -0.5).float(),
                randn(T, H, 512), randn(n, 512))
    mass = torch.rand(T, cand.width, device=device, generator=gen) / cand.width
    return dict(operands=operands, mass=mass, full_lse=torch.zeros(T, H, device=device),
                ranges=contiguous_ranges(cand), K=cand.width)


def call(module, inp):
    first, visible, table, shift = inp["ranges"]
    kl, full2, rowstat, _ = module._kl_forward(
        inp["operands"], inp["full_lse"], module._range_chunks(first, visible, table, shift, inp["K"]), inp["K"],
        512 ** -0.5, False, dict(module.FWD_CONFIG), True, inp["mass"],
        ranges=module._student_ranges(first, visible, table, shift, []))
    return kl, full2, rowstat

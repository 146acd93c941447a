"""Warm-up teacher mass: two neighbouring query rows per program, sharing every gathered block.

The companion of ``teacher_lse_pairs.py`` (read its docstring for the hypothesis) for ``teacher_mass``, which the
warm-up runs twice (forward, and again per chunk in the backward): the producer gathers row 2p + 1's 32-slot blocks
once, consumer W forms row 2p + W's mass m(j) = sum_h exp(scale s_h(j) - L_h) over every block (masked by its own
slots) and both release each stage. Same assumption (row 2p's slots are row 2p + 1's first ones: one document of
the warm-up's every visible entry); outputs expected bitwise equal to the shipped kernel's where it holds (the same
products and the same head sum per slot). ``shipped_bn32``: the shipped kernel with 32-slot blocks, the control.

Offline sm_90 builds: 168 registers on Triton 3.6.0 / 3.7.1 / 3.9.0 as shipped, spills 8 bytes on each (shipped
0 / 4 / 8), 193 KB of shared memory (shipped 194).

Build offline: ``python benchmarks/kernel_variants.py benchmarks/variants/teacher_mass_pairs.py --build-only``.
Time on the GPU: ``... --T 32768 --rounds 5``.
"""
import runpy
from pathlib import Path

import torch

_LSE_PAIRS = runpy.run_path(str(Path(__file__).with_name("teacher_lse_pairs.py")))
MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper"
KERNEL = "_teacher_mass_gluon"
BUILD_SIGNATURE = {"T": "i32"}

_KERNEL_OLD = '''    @gluon.jit
    def _teacher_mass_gluon(Q, CKV, IDX, NEND, FULL_LSE, MASS, H, K, qk_scale,
                            D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
                            REGS: gl.constexpr):'''

_KERNEL_NEW = _LSE_PAIRS["PAIR_HELPERS"] + '''    @gluon.jit
    def _pair_mass_consumer(IDX, NEND, FULL_LSE, MASS, H, K, T, qk_scale, q_all, ring, full, empty,
                            W: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # Row 2p + W's mass over every block of the pair (masked by its own slots); releases each stage (count 2).
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        r, r1, hb = _pair_rows(H, T, W)
        plane = MASS + hb.to(gl.int64) * T * K
        heads = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=gl.SliceLayout(1, s_layout))
        full_lse = gl.load(FULL_LSE + r * H + heads)
        full_lse = gl.where(full_lse == float("-inf"), 0.0, full_lse)
        s_zero = gl.zeros([BLOCK_H_C, BLOCK_N], gl.float32, layout=s_layout)
        q_smem = q_all.index(W)
        for b in range(row_blocks(NEND, r1, BLOCK_N)):
            n, idx, s = _teacher_scores(IDX, r * K, K, b, q_smem, ring, full, empty, s_zero, s_layout, STAGES)
            p = gl.exp2((s * qk_scale - full_lse[:, None]) * LOG2E_C)
            mass = gl.sum(gl.where((idx >= 0)[None, :], p, 0.0), 0)
            gl.store(plane + r * K + n, mass, mask=n < K)

    @gluon.jit
    def _teacher_mass_gluon(Q, CKV, IDX, NEND, FULL_LSE, MASS, H, K, T, qk_scale,
                            D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
                            REGS: gl.constexpr):
        # One program per (pair of rows, head block); stages of BLOCK_N // 2 slots (the default 64 only: the
        # producer gathers 16 rows at a time).
        PAIR_N: gl.constexpr = BLOCK_N // 2
        q_all, ring, full, empty = _pair_buffers(Q.dtype.element_ty, D, PAIR_N, STAGES)
        gl.warp_specialize([
            (_pair_mass_consumer, (IDX, NEND, FULL_LSE, MASS, H, K, T, qk_scale, q_all, ring, full, empty,
                                   gl.constexpr(0), PAIR_N, STAGES)),
            (_pair_mass_consumer, (IDX, NEND, FULL_LSE, MASS, H, K, T, qk_scale, q_all, ring, full, empty,
                                   gl.constexpr(1), PAIR_N, STAGES)),
            (_pair_producer, (Q, CKV, IDX, NEND, H, K, T, q_all, ring, full, empty, D, PAIR_N, STAGES))],
            [4, 4], [REGS[0], REGS[1]])

    @gluon.jit
    def _teacher_mass_shipped(Q, CKV, IDX, NEND, FULL_LSE, MASS, H, K, qk_scale,
                              D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
                              REGS: gl.constexpr):'''

_LAUNCH_OLD = '''        _teacher_mass_gluon[(T * (H // BLOCK_H),)](
            q, compressed_kv, candidates, row_ends(candidates) if n_end is None else n_end,
            full_lse.float().contiguous(), planes, H, K, scale,'''
_LAUNCH_NEW = '''        _teacher_mass_gluon[((T + 1) // 2 * (H // BLOCK_H),)](
            q, compressed_kv, candidates, row_ends(candidates) if n_end is None else n_end,
            full_lse.float().contiguous(), planes, H, K, T, scale,'''

VARIANTS = {
    "pairs": [(_KERNEL_OLD, _KERNEL_NEW), (_LAUNCH_OLD, _LAUNCH_NEW)],
    "shipped_bn32": [('''    cfg = _teacher_config(config, "teacher_mass config")''',
                      '''    cfg = _teacher_config(dict(config or {}, BLOCK_N=32), "teacher_mass config")''')],
}


# One document of T rows, every visible compressed entry (K = T / 4), V4-Flash shapes, bf16; each head's full
# denominator from the shipped teacher LSE and a window + sink mass of 2.
def inputs(T, H, device):
    from dsv4attn.ops.sparse_attention import gluon_hopper
    inp = _LSE_PAIRS["inputs"](T, H, device)
    inp["full_lse"] = torch.logaddexp(
        gluon_hopper.teacher_lse(inp["q"], inp["ckv"], inp["idx"], inp["scale"], n_end=inp["n_end"]),
        torch.full((T, H), 2.0, device=device))
    return inp


def call(module, inp):
    return (module.teacher_mass(inp["q"], inp["ckv"], inp["idx"], inp["full_lse"], inp["scale"],
                                n_end=inp["n_end"]),)

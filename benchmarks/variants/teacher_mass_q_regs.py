"""Gathering teacher mass (Gluon, SM90; the sparse phase's KL teacher, and the warm-up's under context parallelism):
q as the products' register operand instead of re-read from shared memory by every product.

Why: each 64 x 64 x 16 product of the shipped kernel reads q's 64 x 16 slice and the kv tile's 16 x 64 from shared
memory (4 KiB per 32 tensor-core clocks: the SM's 128 B/clock), while the producer's cp.async writes the next tiles
into the same memory. The warm-up's range form gained 1.19-1.28x from q in registers together with row pairs
(BENCHMARKS.md, twenty-eighth session); this isolates the register operand for the gathering form, where rows share
no blocks. Outputs must be bitwise equal to the shipped kernel's (the products' sums do not depend on where the
A operand comes from: the range form's pair kernel matched the gathering kernel bit for bit).

- ``q_loop_zero``: q stays in shared memory, its products index it with ``loop_zero`` (the shipped kernel spills 484 /
  444 bytes on Triton 3.6.0 / 3.7.1, the variant none: hoisted wgmma descriptors, as the other kernels had);
- ``q_regs``: each consumer loads its 64 x D q straight into registers (DotOperandLayout); the producer still copies
  q to shared memory (unused), ring unchanged (2 x 64 rows);
- ``q_regs_ring6_n32``: no q in shared memory at all (the producer gathers only the ring), blocks of 32 rows in a ring
  of 6 (192 KiB; the mass of a slot does not depend on the block size);
- ``q_regs_ring4_n32``: the same with 4 stages (128 KiB).

Inputs: the sparse phase (512 random visible compressed entries a row, T / 4 entries, H heads of D = 512).
GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/teacher_mass_q_regs.py --T 32768 8192 --H 64``;
offline: ``... --build-only``.
"""
import torch

MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper"
KERNEL = "_teacher_mass_gluon"

_SIG = ("    def _mass_consumer(IDX, NEND, FULL_LSE, MASS, H, K, qk_scale, q_smem, ring, full, empty,\n")
_LOOP = ("        for b in range(W, row_blocks(NEND, t, BLOCK_N), 2):\n"
         "            n, idx, s = _teacher_scores(IDX, row_base, K, b, q_smem, ring, full, empty, s_zero, s_layout, STAGES)\n"
         "            p = gl.exp2(")
_LOAD_Q = ("        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)\n"
           "        q_heads = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=gl.SliceLayout(1, q_layout))\n"
           "        q_cols = gl.arange(0, ring.shape[2], layout=gl.SliceLayout(0, q_layout))\n"
           "        q_regs = gl.load(Q + (t * H + q_heads)[:, None] * ring.shape[2] + q_cols[None, :])\n")
_CALLS = [("            (_mass_consumer, (IDX, NEND, FULL_LSE, MASS, H, K, qk_scale, q_smem, ring, full, empty,\n"
           f"                              gl.constexpr({w}), BLOCK_N, STAGES)),\n",
           "            (_mass_consumer, (Q, IDX, NEND, FULL_LSE, MASS, H, K, qk_scale, q_smem, ring, full, empty,\n"
           f"                              gl.constexpr({w}), BLOCK_N, STAGES)),\n") for w in (0, 1)]
_Q_REGS = [
    (_SIG, _SIG.replace("(IDX,", "(Q, IDX,")),
    (_LOOP, _LOAD_Q + _LOOP.replace("b, q_smem, ring", "b, q_regs, ring")),
    *_CALLS,
]
# The mass kernel's own buffers without q (the lse kernel keeps _teacher_buffers), and a producer without q's copy.
_BUFFERS = ("        # (wrong masses on the GPU; tests/ops/test_gluon_builds.py checks every kernel for such an overlap).\n"
            "        q_smem, ring, full, empty = _teacher_buffers(Q.dtype.element_ty, D, BLOCK_N, STAGES)\n")
_NO_Q_SMEM = ("        # (wrong masses on the GPU; tests/ops/test_gluon_builds.py checks every kernel for such an overlap).\n"
              "        ring = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, BLOCK_N, D],\n"
              "                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, D],\n"
              "                                                                              Q.dtype.element_ty))\n"
              "        full = mbarriers(STAGES, 128)\n"
              "        empty = mbarriers(STAGES, 128)\n"
              "        q_smem = ring\n")
_PRODUCER = ("        _pp_producer(Q, CKV, IDX, H, K, row_blocks(NEND, t, BLOCK_N), t, hb, q_smem, ring, full, empty, D, BLOCK_N,\n"
             "                     STAGES)\n")
_GATHER_ONLY = ("        ring_gather(CKV, IDX, K, row_blocks(NEND, t, BLOCK_N), t, ring, full, empty, D, BLOCK_N, STAGES)\n")
_CFG = '    cfg = _teacher_config(config, "teacher_mass config")\n'


def _ring(stages: int, block_n: int):
    return [(_BUFFERS, _NO_Q_SMEM), (_PRODUCER, _GATHER_ONLY),
            (_CFG, _CFG.rstrip("\n") + f"\n    cfg = dict(cfg, STAGES={stages}, BLOCK_N={block_n})\n")]


# q stays in shared memory, indexed by loop_zero inside the loop (as the other kernels index their loop-invariant
# operands): the shipped kernel's products take q_smem itself, whose wgmma descriptors the compiler may hoist out of
# the loop and spill (ptxas: 484 / 444 bytes of spills on Triton 3.6.0 / 3.7.1, none on 3.9.0).
_Q_LOOP_ZERO = [
    ("half_precision, mbarrier, mbarriers, program_row,", "half_precision, loop_zero, mbarrier, mbarriers, program_row,"),
    ("        s = warpgroup_mma(q_smem, ring.index(b % STAGES).permute((1, 0)), s_zero, use_acc=False)\n",
     "        s = warpgroup_mma(q_smem.index(loop_zero(b, K)), ring.index(b % STAGES).permute((1, 0)), s_zero,\n"
     "                          use_acc=False)\n"),
    ("        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H_C, D],\n",
     "        q_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H_C, D],\n"),
    ("        _pp_producer(Q, CKV, IDX, H, K, row_blocks(NEND, t, BLOCK_N), t, hb, q_smem, ring,",
     "        _pp_producer(Q, CKV, IDX, H, K, row_blocks(NEND, t, BLOCK_N), t, hb, q_smem.index(0), ring,"),
]

VARIANTS = {
    "q_loop_zero": _Q_LOOP_ZERO,
    "q_regs": _Q_REGS,
    "q_regs_ring6_n32": _Q_REGS + _ring(6, 32),
    "q_regs_ring4_n32": _Q_REGS + _ring(4, 32),
}


def inputs(T, H, device):
    gen = torch.Generator(device=device).manual_seed(0)
    K, D, nk = 512, 512, T // 4
    t = torch.arange(T, device=device)
    visible = (t // 4 + 1)[:, None]
    idx = (torch.rand(T, K, device=device, generator=gen) * visible).long()
    idx = torch.where(torch.arange(K, device=device)[None, :] < visible, idx, -1).int()
    q = torch.randn(T, H, D, device=device, generator=gen).bfloat16()
    ckv = torch.randn(nk, D, device=device, generator=gen).bfloat16()
    full = torch.randn(T, H, device=device, generator=gen) + 12.0
    return dict(q=q, ckv=ckv, idx=idx, full=full, scale=D ** -0.5)


def call(module, inp):
    return (module.teacher_mass(inp["q"], inp["ckv"], inp["idx"], inp["full"], inp["scale"]),)

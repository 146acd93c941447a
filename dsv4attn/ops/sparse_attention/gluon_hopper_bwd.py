"""dKV of the sparse MQA attention backward for Hopper (SM90) in Gluon.

Contract (the dKV part of :func:`.triton._sparse_attn_bwd`): ``q``, ``do (T, H, D)`` bf16/fp16 with H a multiple of
64, ``kv (N >= 1, D)``, ``idx (T, K)`` int32 (-1 = empty slot), ``denom2 (T, H)`` fp32 = log2 of each head's full
denominator logaddexp(lse, sink), ``delta (T, H)`` fp32 = sum_k p_k dO.v_k -> adds to ``dkv (N, D)`` fp32, for every
valid slot k of row t, ``scale * dz[:, k]^T q[t] + p[:, k]^T dO[t]`` with ``p = exp2(scale log2e q.kv - denom2)``
and ``dz = p * (dO.kv - delta)``; the operands of the two products are rounded to the input dtype (fp32 sums), as
in the Triton kernels. fp32 atomic adds, relaxed order (nothing reads dKV before the kernel ends).

Why: the best Triton dKV pass takes 39.3 ms at T = 32768, H = 64, K = 640 (H200), and not because of its atomics
(plain stores in their place take the same time, BENCHMARKS.md, sixth session): it loads each gathered tile
synchronously and runs its GEMMs one after the other in one warpgroup set. Here a producer gathers asynchronously
and two consumers overlap one's GEMMs with the other's softmax-side work and atomics: 22.7 ms.

Layout: one program per (query row, 64-head block), three warpgroups (``gl.warp_specialize``):

- producer: q and dO of the head block, then the kv rows of every BLOCK_N slots into a ring (the forward's
  producer, :func:`dsv4attn.ops.gluon_common.ring_gather`);
- consumer W (W = 0, 1) takes the tiles b = W, W + 2, ... on its own: s = Q K^T and dp = dO K^T (wgmma, M = 64
  heads), releases the ring stage, forms p (fp32, zero at empty slots) and ``scale * dz`` in registers, stores them
  (bf16/fp16) to its shared-memory buffers and forms the tile's dKV^T = q^T dz + dO^T p (M = D columns,
  N = BLOCK_N slots, K = 64 heads), which it adds to dKV.

Gluon kernels run only on the GPU: the GPU tests compare the backward with the float64 reference.
"""
from __future__ import annotations

import torch

from .. import gluon_common
from ..gluon_common import BLOCK_H, IMPORTED, fence_async_shared, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait
from . import gluon_hopper
from .gluon_hopper import LOG2E

# BLOCK_N gathered rows per tile, STAGES ring depth (even; shared memory at D = 512: q + dO 128 KiB, ring 64 KiB,
# p / dz buffers 16 KiB), REGS registers per thread of the worker consumer and of the producer. H200, T = 32768,
# H = 64, K = 640: 22.7 ms; REGS (232, 24) 22.7; 16-row tiles 26.7.
DKV_CONFIG = dict(BLOCK_N=32, STAGES=2, REGS=(216, 40))
SHARED_MEMORY_BYTES = 232448                   # the most one SM90 thread block may allocate


def available(q: torch.Tensor) -> bool:
    """True when :func:`launch_dkv` can run for ``q`` (SM90, bf16/fp16, H % 64 == 0, D = 512)."""
    return gluon_hopper.available(q) and q.shape[2] == 512


if IMPORTED:
    BLOCK_H_C = gl.constexpr(BLOCK_H)

    @gluon.jit
    def _dkv_producer(Q, DO, KV, IDX, H, K, t, hb, q_smem, do_smem, ring, full, empty, D: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        gluon_common.copy_heads(Q, H, t, hb, q_smem, D)
        gluon_common.copy_heads(DO, H, t, hb, do_smem, D)
        gluon_common.async_copy.commit_group()      # the first full[] arrival covers these copies too
        gluon_common.ring_gather(KV, IDX, K, t, ring, full, empty, D, BLOCK_N, STAGES)

    @gluon.jit
    def _dkv_consumer(IDX, DKV, DENOM2, DELTA, H, K, qk_scale_log2, scale, t, hb, q_all, do_all, ring, p_buf, dz_buf,
                      full, empty, W: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # Consumer W: tiles b = W, W + 2, ... (ring stages of its parity: STAGES is even), each on its own: s and dp
        # (asynchronous wgmma, back to back), the stage released, p and scale * dz in registers, then through its
        # shared-memory buffers into dKV^T = q^T dz + dO^T p (M = D, N = BLOCK_N, K = 64 heads) and the atomics.
        # No hand-over between the consumers: while one forms p and dz or adds its tile, the other's GEMMs run
        # (a version that split s / dp and the dKV columns between them, with hand-overs, took 25.4 ms, this one
        # 22.7 ms at T = 32768, H = 64, K = 640).
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        row_base = t * K
        nb = gl.cdiv(K, BLOCK_N)
        heads = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=gl.SliceLayout(1, s_layout))
        denom2 = gl.load(DENOM2 + t * H + heads)
        delta = gl.load(DELTA + t * H + heads)
        s_zero = gl.zeros([BLOCK_H_C, BLOCK_N], gl.float32, layout=s_layout)
        o_zero = gl.zeros([D, BLOCK_N], gl.float32, layout=s_layout)
        cols = gl.arange(0, D, layout=gl.SliceLayout(1, s_layout))
        for b in range(W, nb, 2):
            stage = b % STAGES
            # Operands through a block-dependent zero index (see gluon_hopper._pp_consumer: loop-invariant
            # shared-memory bases get their wgmma descriptors hoisted and spilled).
            z = (b + 1) // (nb + 1)
            n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
            valid = idx >= 0
            mbarrier.wait(full.index(stage), (b // STAGES) & 1)
            fence_async_shared()
            kv_t = ring.index(stage + z).permute((1, 0))
            s = warpgroup_mma(q_all.index(z), kv_t, s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_all.index(z), kv_t, s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s])
            dp = warpgroup_mma_wait(0, deps=[dp])
            mbarrier.arrive(empty.index(stage))
            p = gl.where(valid[None, :], gl.exp2(s * qk_scale_log2 - denom2[:, None]), 0.0)
            dz = p * (dp - delta[:, None]) * scale
            p_buf.index(W + z).store(p.to(p_buf.dtype))
            dz_buf.index(W + z).store(dz.to(dz_buf.dtype))
            fence_async_shared()
            acc = warpgroup_mma(q_all.index(z).permute((1, 0)), dz_buf.index(W + z), o_zero, use_acc=False)
            acc = warpgroup_mma(do_all.index(z).permute((1, 0)), p_buf.index(W + z), acc)
            rows = gl.where(valid, idx, 0).to(gl.int64) * D
            gl.atomic_add(DKV + rows[None, :] + cols[:, None], acc, mask=valid[None, :], sem="relaxed")

    @gluon.jit
    def _sparse_attn_dkv_gluon(Q, DO, KV, IDX, DENOM2, DELTA, DKV, H, K, qk_scale_log2, scale,
                               D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                               num_warps: gl.constexpr, REGS: gl.constexpr):
        t, hb = gluon_common.program_row(H)
        dtype: gl.constexpr = Q.dtype.element_ty
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H_C, D], dtype)
        q_all = gl.allocate_shared_memory(dtype, [1, BLOCK_H_C, D], x_layout)
        do_all = gl.allocate_shared_memory(dtype, [1, BLOCK_H_C, D], x_layout)
        ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))
        t_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H_C, BLOCK_N], dtype)
        p_buf = gl.allocate_shared_memory(dtype, [2, BLOCK_H_C, BLOCK_N], t_layout)    # one per consumer
        dz_buf = gl.allocate_shared_memory(dtype, [2, BLOCK_H_C, BLOCK_N], t_layout)
        full = gluon_common.mbarriers(STAGES, 128)
        empty = gluon_common.mbarriers(STAGES, 1)
        gl.warp_specialize([
            (_dkv_consumer, (IDX, DKV, DENOM2, DELTA, H, K, qk_scale_log2, scale, t, hb, q_all, do_all, ring, p_buf,
                             dz_buf, full, empty, gl.constexpr(0), D, BLOCK_N, STAGES)),
            (_dkv_consumer, (IDX, DKV, DENOM2, DELTA, H, K, qk_scale_log2, scale, t, hb, q_all, do_all, ring, p_buf,
                             dz_buf, full, empty, gl.constexpr(1), D, BLOCK_N, STAGES)),
            (_dkv_producer, (Q, DO, KV, IDX, H, K, t, hb, q_all.index(0), do_all.index(0), ring, full, empty, D,
                             BLOCK_N, STAGES))],
            [4, 4], [REGS[0], REGS[1]])


def launch_dkv(q, do, kv, idx, denom2, delta, dkv, scale, config=None):
    """Adds the dKV contributions of all T rows to ``dkv`` (N, D) fp32 (module docstring; T >= 1, N >= 1).
    ``config``: :data:`DKV_CONFIG` keys."""
    # 64-row tiles: two ring stages no longer fit beside q and dO.
    cfg = gluon_hopper.checked_config(config, "Gluon dKV config", DKV_CONFIG, (16, 32))
    if cfg["STAGES"] < 2 or cfg["STAGES"] % 2:  # each consumer waits only on the stages of its tiles' parity
        raise ValueError(f"Gluon dKV config: STAGES must be even and >= 2, got {cfg['STAGES']}")
    D = q.shape[2]
    # 2-byte elements of q and dO, the ring, and both consumers' p and dz tiles.
    smem = 2 * (2 * BLOCK_H * D + cfg["STAGES"] * cfg["BLOCK_N"] * D + 4 * BLOCK_H * cfg["BLOCK_N"])
    if smem > SHARED_MEMORY_BYTES:              # refused here: under "auto" a launch failure would switch Gluon off
        raise ValueError(f"Gluon dKV config: STAGES={cfg['STAGES']} x BLOCK_N={cfg['BLOCK_N']} needs {smem} bytes of "
                         f"shared memory at D={D}, more than the {SHARED_MEMORY_BYTES} of an SM90 block")
    T, H = q.shape[:2]
    if idx.shape[1] == 0:
        return
    _sparse_attn_dkv_gluon[(T * (H // BLOCK_H),)](
        q, do, kv, idx, denom2, delta, dkv, H, idx.shape[1], scale * LOG2E, scale,
        D=D, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], num_warps=4, REGS=tuple(cfg["REGS"]))

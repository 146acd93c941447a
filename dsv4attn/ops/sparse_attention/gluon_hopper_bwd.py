"""dKV of the sparse MQA attention backward for Hopper (SM90) in Gluon.

Contract (the dKV part of :func:`.triton._sparse_attn_bwd`): ``q``, ``do (T, H, D)`` bf16/fp16 with H a multiple of
64, ``kv (N >= 1, D)``, ``idx (T, K)`` int32 (-1 = empty slot), ``denom2 (T, H)`` fp32 = log2 of each head's full
denominator logaddexp(lse, sink), ``delta (T, H)`` fp32 = sum_k p_k dO.v_k -> adds to ``dkv (N, D)`` fp32, for every
valid slot k of row t, ``scale * dz[:, k]^T q[t] + p[:, k]^T dO[t]`` with ``p = exp2(scale log2e q.kv - denom2)``
and ``dz = p * (dO.kv - delta)``; the operands of the two products are rounded to the input dtype (fp32 sums), as
in the Triton kernels. fp32 atomic adds, relaxed order (nothing reads dKV before the kernel ends).

Why: the Triton dKV pass runs at 131 TFLOP/s, and not because of its atomics (the same pass with plain stores takes
the same time, BENCHMARKS.md, sixth session) but because its GEMMs carry a BLOCK_N x D fp32 accumulator through
registers and load each gathered tile synchronously.

Layout: one program per (query row, 64-head block), three warpgroups (``gl.warp_specialize``):

- producer: q and dO of the head block, then the kv rows of every BLOCK_N slots into a ring (the forward's
  producer, :func:`.gluon_hopper._ring_gather`);
- consumer 0: s = Q K^T (wgmma, M = 64 heads), releases the ring stage, forms p (fp32, zero at empty slots) and
  publishes it (fp32 for the other consumer, bf16 as a GEMM operand) on ``pready``;
- consumer 1: dp = dO K^T, releases the stage, waits for p, forms ``scale * dz`` and publishes it (bf16) on
  ``dzready``;
- then each consumer W forms its half of the columns of the transposed tile, dKV^T[W D/2 : (W+1) D/2, :] =
  q^T dz + dO^T p (M = D/2 columns, N = BLOCK_N slots, K = 64 heads: a 64-register accumulator at BLOCK_N 32),
  frees the tile's buffers (``tfree``) and adds it to dKV.

Gluon kernels run only on the GPU: the GPU tests compare the backward with the float64 reference.
"""
from __future__ import annotations

import torch

from . import gluon_hopper
from .gluon_hopper import BLOCK_H, LOG2E

if gluon_hopper._IMPORTED:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

# BLOCK_N gathered rows per tile, STAGES ring depth (shared memory at D = 512: q + dO 128 KiB, ring 64 KiB, p / dz
# buffers 32 KiB), REGS registers per thread of the worker consumer and of the producer.
DKV_CONFIG = dict(BLOCK_N=32, STAGES=2, REGS=(216, 40))


def available(q: torch.Tensor) -> bool:
    """True when :func:`launch_dkv` can run for ``q`` (SM90, bf16/fp16, H % 64 == 0, D = 512)."""
    return gluon_hopper.available(q) and q.shape[2] == 512


if gluon_hopper._IMPORTED:
    BLOCK_H_C = gl.constexpr(BLOCK_H)

    @gluon.jit
    def _dkv_producer(Q, DO, KV, IDX, H, K, t, hb, q_smem, do_smem, ring, full, empty, D: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        gluon_hopper._copy_heads(Q, H, t, hb, q_smem, D)
        gluon_hopper._copy_heads(DO, H, t, hb, do_smem, D)
        gluon_hopper.async_copy.commit_group()      # the first full[] arrival covers these copies too
        gluon_hopper._ring_gather(KV, IDX, K, t, ring, full, empty, D, BLOCK_N, STAGES)

    @gluon.jit
    def _dkv_consumer(IDX, DKV, DENOM2, DELTA, H, K, qk_scale_log2, scale, t, hb, q_all, do_all, ring, p32, p16, dz16,
                      full, empty, pready, dzready, tfree, W: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr):
        # Consumer W of every tile b (module docstring). Tile buffers alternate by b % 2; tfree[b % 2] (count 2)
        # says both consumers are done with tile b - 2's p / dz, which consumer 0 waits for before publishing
        # tile b's p (consumer 1 writes dz only after that p, so it needs no wait of its own).
        HALF: gl.constexpr = D // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        row_base = t * K
        nb = gl.cdiv(K, BLOCK_N)
        heads = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=gl.SliceLayout(1, s_layout))
        if W == 0:
            denom2 = gl.load(DENOM2 + t * H + heads)
        else:
            delta = gl.load(DELTA + t * H + heads)
        s_zero = gl.zeros([BLOCK_H_C, BLOCK_N], gl.float32, layout=s_layout)
        o_zero = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
        cols = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
        for b in range(nb):
            stage = b % STAGES
            half = b % 2
            # Operands through a block-dependent zero index (see gluon_hopper._pp_consumer: loop-invariant
            # shared-memory bases get their wgmma descriptors hoisted and spilled).
            z = (b + 1) // (nb + 1)
            n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
            valid = idx >= 0
            mbarrier.wait(full.index(stage), (b // STAGES) & 1)
            fence_async_shared()
            if W == 0:
                s = warpgroup_mma(q_all.index(z), ring.index(stage + z).permute((1, 0)), s_zero, use_acc=False)
                mbarrier.arrive(empty.index(stage))
                p = gl.where(valid[None, :], gl.exp2(s * qk_scale_log2 - denom2[:, None]), 0.0)
                mbarrier.wait(tfree.index(half), ((b // 2) + 1) & 1, pred=b >= 2)
                p32.index(half + z).store(p)
                p16.index(half + z).store(p.to(p16.dtype))
                fence_async_shared()
                mbarrier.arrive(pready.index(half))
                mbarrier.wait(dzready.index(half), (b // 2) & 1)
            else:
                dp = warpgroup_mma(do_all.index(z), ring.index(stage + z).permute((1, 0)), s_zero, use_acc=False)
                mbarrier.arrive(empty.index(stage))
                mbarrier.wait(pready.index(half), (b // 2) & 1)
                p = p32.index(half + z).load(s_layout)
                dz = p * (dp - delta[:, None]) * scale
                dz16.index(half + z).store(dz.to(dz16.dtype))
                fence_async_shared()
                mbarrier.arrive(dzready.index(half))
            # dKV^T for columns [W * HALF, (W + 1) * HALF): q^T dz + dO^T p (M = HALF, N = BLOCK_N, K = 64 heads).
            acc = warpgroup_mma(q_all.index(z).slice(W * HALF, HALF, dim=1).permute((1, 0)), dz16.index(half + z),
                                o_zero, use_acc=False)
            acc = warpgroup_mma(do_all.index(z).slice(W * HALF, HALF, dim=1).permute((1, 0)), p16.index(half + z),
                                acc)
            mbarrier.arrive(tfree.index(half))
            rows = gl.where(valid, idx, 0).to(gl.int64) * D
            gl.atomic_add(DKV + rows[None, :] + cols[:, None], acc, mask=valid[None, :], sem="relaxed")

    @gluon.jit
    def _sparse_attn_dkv_gluon(Q, DO, KV, IDX, DENOM2, DELTA, DKV, H, K, qk_scale_log2, scale,
                               D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                               num_warps: gl.constexpr, REGS: gl.constexpr):
        t, hb = gluon_hopper._program_row(H)
        dtype: gl.constexpr = Q.dtype.element_ty
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H_C, D], dtype)
        q_all = gl.allocate_shared_memory(dtype, [1, BLOCK_H_C, D], x_layout)
        do_all = gl.allocate_shared_memory(dtype, [1, BLOCK_H_C, D], x_layout)
        ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))
        t_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H_C, BLOCK_N], dtype)
        p16 = gl.allocate_shared_memory(dtype, [2, BLOCK_H_C, BLOCK_N], t_layout)
        dz16 = gl.allocate_shared_memory(dtype, [2, BLOCK_H_C, BLOCK_N], t_layout)
        p32 = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H_C, BLOCK_N],
                                        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        full = gluon_hopper._mbarriers(STAGES, 128)
        empty = gluon_hopper._mbarriers(STAGES, 2)
        pready = gluon_hopper._mbarriers(2, 1)
        dzready = gluon_hopper._mbarriers(2, 1)
        tfree = gluon_hopper._mbarriers(2, 2)
        gl.warp_specialize([
            (_dkv_consumer, (IDX, DKV, DENOM2, DELTA, H, K, qk_scale_log2, scale, t, hb, q_all, do_all, ring, p32,
                             p16, dz16, full, empty, pready, dzready, tfree, gl.constexpr(0), D, BLOCK_N, STAGES)),
            (_dkv_consumer, (IDX, DKV, DENOM2, DELTA, H, K, qk_scale_log2, scale, t, hb, q_all, do_all, ring, p32,
                             p16, dz16, full, empty, pready, dzready, tfree, gl.constexpr(1), D, BLOCK_N, STAGES)),
            (_dkv_producer, (Q, DO, KV, IDX, H, K, t, hb, q_all.index(0), do_all.index(0), ring, full, empty, D,
                             BLOCK_N, STAGES))],
            [4, 4], [REGS[0], REGS[1]])


def launch_dkv(q, do, kv, idx, denom2, delta, dkv, scale, config=None):
    """Adds the dKV contributions of all T rows to ``dkv`` (N, D) fp32 (module docstring; T >= 1, N >= 1).
    ``config``: :data:`DKV_CONFIG` keys."""
    unknown = sorted(set(config or {}) - set(DKV_CONFIG))
    if unknown:
        raise ValueError(f"Gluon dKV config: unknown keys {unknown}; expected some of {sorted(DKV_CONFIG)}")
    cfg = dict(DKV_CONFIG, **(config or {}))
    if cfg["BLOCK_N"] not in (16, 32):         # 64-row tiles: two ring stages no longer fit beside q and dO
        raise ValueError(f"Gluon dKV config: BLOCK_N must be 16 or 32, got {cfg['BLOCK_N']}")
    T, H, D = q.shape
    if idx.shape[1] == 0:
        return
    _sparse_attn_dkv_gluon[(T * (H // BLOCK_H),)](
        q, do, kv, idx, denom2, delta, dkv, H, idx.shape[1], scale * LOG2E, scale,
        D=D, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], num_warps=4, REGS=tuple(cfg["REGS"]))

"""Sparse MQA attention backward for Hopper (SM90) in Gluon: one pass over the slots, nothing recomputed.

Contract (called by :func:`.triton._sparse_attn_bwd`): ``q``, ``do (T, H, D)`` bf16/fp16 with H a multiple of 64 and
D = 512, ``kv (N >= 1, D)`` in q's dtype, ``idx (T, K)`` int32 (-1 = empty slot), ``denom2 (T, H)`` fp32 = log2 of
each head's full denominator logaddexp(lse, sink), ``delta (T, H)`` fp32 = rowsum(dO * out) ->

- ``dq (T, H, D)`` in q's dtype: ``dq[t] = sum_k ds[:, k] kv[idx[t, k]]``, written once;
- adds to ``dkv (N, D)`` fp32, for every valid slot k of row t, ``ds[:, k]^T q[t] + p[:, k]^T dO[t]`` (float
  atomics; in the deterministic mode stored per slot and summed in a fixed order afterwards, :func:`launch`);

with ``p = exp2(scale log2e q.kv - denom2)`` (0 at empty slots) and ``ds = scale p (dO.kv - delta)``; the operands of
every product are rounded to the input dtype, sums are fp32. Delta comes from the bf16/fp16 output (the caller's
elementwise pre-pass), as FlashAttention and cuDNN form it, so each 64-slot tile costs exactly the five products of
the gradient: S = Q KV^T, dP = dO KV^T, dQ += dS KV, dKV = P^T dO + dS^T Q.

Layout: one program per (query row, 64-head block), three warpgroups (``gl.warp_specialize``):

- producer: q and dO of the head block (cp.async), then the kv rows of each 64-slot tile up to the row's last valid
  slot (:func:`dsv4attn.ops.gluon_common.row_blocks`; loaded once and handed to the partitions: loaded in each, it
  took the dKV warpgroup from 60 to 540 bytes of spills, ptxas of Triton 3.6) into a one-stage ring
  (:func:`dsv4attn.ops.gluon_common.ring_gather`; q, dO and the tile take 192 KiB, so one stage is all that fits);
- softmax warpgroup (the default partition): with the forward's output rotation (``output_rope``), first rotates the
  RoPE columns of dO forward in shared memory; then per tile S and dP (asynchronous wgmma, back to back), P and dS
  in registers, stored to the tile's P / dS buffers (two of each, alternating by tile) for the dKV warpgroup, then
  dQ[:, :D/2] += dS KV[:, :D/2]; releases the kv stage;
- dKV warpgroup: dQ[:, D/2:] += dS KV[:, D/2:], releases the kv stage (the producer's next gather then runs under
  this warpgroup's dKV products), then dKV in eight 64-column chunks, each P^T dO + dS^T Q in one accumulator
  (M = 64 slots), added to an fp32 accumulator with 16-byte reductions over whole 128-byte lines (each thread's four
  values of a 16-column group stored adjacently, a column permutation the post-pass undoes); releases P / dS.

With ``mass_slots`` (the sparse indexer KL's teacher, :func:`launch`) the softmax warpgroup also stores each tile's
column sums of P over the requested slots into its head block's plane (a ``DO_MASS`` form of the kernel).

The tensor-core work splits evenly: 2.5 of the tile's five products per consumer. dq stays in fp32 registers for the
whole loop (each consumer holds its 64 x 256 half) and leaves through the kv stage's shared memory (free after the
last tile) for whole-row stores. Gluon kernels run only on the GPU: the GPU tests compare this backward with the
float64 reference.
"""
from __future__ import annotations

import torch

from .. import gluon_common
from ..gluon_common import (BLOCK_H, IMPORTED, add_reduced, add_unpermuted, copy_heads, fence_async_shared, gl, gluon,
                            loop_zero, mbarrier, mbarriers, program_row, reduction_layout, release,
                            ring_gather, rotate_channel_pairs, row_blocks, store_heads, warpgroup_mma,
                            warpgroup_mma_wait)
from ..index_sets import row_ends
from .segment_sum import add_rows_by_key
from . import gluon_hopper
from .gluon_hopper import LOG2E

BLOCK_N = 64          # slots per tile: the dKV products need M = 64 slots per wgmma
# REGS: registers per thread of the dKV warpgroup and of the producer (setmaxnreg); the softmax warpgroup gets 240
# (what Triton's PTX sets for it). (232, 32) is 2-3% faster than (224, 40) on Triton 3.6 and, with loop_zero, 14-15% on
# 3.9 (BENCHMARKS.md). CHUNK: dKV columns per accumulator (its products are pipelined two deep).
BWD_CONFIG = dict(REGS=(232, 32), CHUNK=64)
SHARED_MEMORY_BYTES = 232448                   # the most one SM90 thread block may allocate


def rotated_width(pairs: int) -> int:
    """Columns of dO's tail that the kernel rotates for ``pairs`` RoPE pairs: a power of two (a register tile),
    at least 64 (128 bytes, one swizzle row of the shared-memory layout); the non-RoPE columns among them pass."""
    return max(64, 1 << max(0, 2 * pairs - 1).bit_length())


def check(q: torch.Tensor) -> tuple[bool, str]:
    """(usable, reason) of :func:`launch` for ``q`` (SM90, Gluon, bf16/fp16, H % 64 == 0, D = 512)."""
    usable, reason = gluon_hopper.check(q)
    if usable and q.shape[2] != 512:
        return False, f"needs D = 512, got D = {q.shape[2]}"
    return usable, reason


def available(q: torch.Tensor) -> bool:
    return check(q)[0]


if IMPORTED:
    BLOCK_H_C = gl.constexpr(BLOCK_H)

    @gluon.jit
    def _bwd_producer(Q, DO, KV, IDX, NEND, H, K, q_smem, do_smem, ring, full, empty, D: gl.constexpr,
                      BLOCK_N: gl.constexpr):
        t, hb = program_row(H)
        nb = row_blocks(NEND, t, BLOCK_N)
        copy_heads(Q, H, t, hb, q_smem, D)
        copy_heads(DO, H, t, hb, do_smem, D)
        gluon_common.async_copy.commit_group()      # the first full[] arrival covers these copies too
        ring_gather(KV, IDX, K, nb, t, ring, full, empty, D, BLOCK_N, 1)

    @gluon.jit
    def _rotate_do(do_smem, COS, SIN, t, D: gl.constexpr, ROPE: gl.constexpr, RW: gl.constexpr):
        # The last RW columns of dO (64 heads) in shared memory, rotated forward (+angle) in place where they are
        # RoPE channels (the last 2 * ROPE of D; COS / SIN: (T, ROPE) fp32 tables), rounded back to dO's dtype:
        # the gradient of the attention's own output when the forward rotated it back (output_rope).
        layout: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0])
        x = do_smem.load(layout).to(gl.float32)
        do_smem.store(rotate_channel_pairs(x, COS, SIN, t, D - RW, D, ROPE, 1).to(do_smem.dtype))

    @gluon.jit
    def _bwd_softmax(IDX, NEND, DQ, DENOM2, DELTA, COS, SIN, MASS, H, K, KT, OFF, qk_scale_log2, scale, q_all,
                     do_all, ring, p_buf, ds_buf, full, empty, pready, pfree, D: gl.constexpr, BLOCK_N: gl.constexpr,
                     ROPE: gl.constexpr, RW: gl.constexpr, DO_MASS: gl.constexpr):
        # DO_MASS: also stores sum_h p of each slot OFF .. OFF + KT into this head block's plane of MASS (T, H / 64,
        # KT) fp32 (the sparse indexer KL's teacher); tiles past the row's last valid slot are not visited (the
        # caller's zeros stay).
        t, hb = program_row(H)
        nb = row_blocks(NEND, t, BLOCK_N)
        HALF: gl.constexpr = D // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        heads = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=gl.SliceLayout(1, s_layout))
        denom2 = gl.load(DENOM2 + t * H + heads)
        delta = gl.load(DELTA + t * H + heads)
        s_zero = gl.zeros([BLOCK_H_C, BLOCK_N], gl.float32, layout=s_layout)
        dq = gl.zeros([BLOCK_H_C, HALF], gl.float32, layout=q_layout)
        row_base = t * K
        if ROPE > 0:
            # dO has arrived with the first tile. Rotated before this warpgroup's first dP product; the dKV
            # warpgroup reads dO only after this one's first P / dS (pready), so it sees the rotated values.
            mbarrier.wait(full.index(0), 0)
            _rotate_do(do_all.index(0).slice(D - RW, RW, dim=1), COS, SIN, t, D, ROPE, RW)
            fence_async_shared()
            gluon_common.thread_barrier()
        for b in range(nb):
            z = loop_zero(b, K)          # shared-memory operands through it: their descriptors stay in the loop
            buf = b % 2
            n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
            mbarrier.wait(full.index(0), b & 1)
            fence_async_shared()
            kv_t = ring.index(z).permute((1, 0))
            s = warpgroup_mma(q_all.index(z), kv_t, s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_all.index(z), kv_t, s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s])
            p = gl.where((idx >= 0)[None, :], gl.exp2(s * qk_scale_log2 - denom2[:, None]), 0.0)
            if DO_MASS:
                j = n - OFF
                gl.store(MASS + (t * (H // BLOCK_H_C) + hb) * KT + j, gl.sum(p, 0), mask=(j >= 0) & (j < KT))
            dp = warpgroup_mma_wait(0, deps=[dp])
            ds = p * (dp - delta[:, None]) * scale
            # The dKV warpgroup is done with this buffer pair's tile b - 2.
            mbarrier.wait(pfree.index(buf), ((b // 2) + 1) & 1, pred=b >= 2)
            p_buf.index(buf + z).store(p.to(p_buf.dtype))
            ds_buf.index(buf + z).store(ds.to(ds_buf.dtype))
            fence_async_shared()
            mbarrier.arrive(pready.index(buf))
            dq = warpgroup_mma(ds_buf.index(buf + z), ring.index(z).slice(0, HALF, dim=1), dq)
            release(empty.index(0))
        # The producer gathers nothing more and this warpgroup's last read of kv columns [0, HALF) is done.
        store_heads(dq, DQ, t, H, hb, 0, ring.index(0).slice(0, HALF, dim=1), D)

    @gluon.jit
    def _bwd_dkv(IDX, NEND, DQ, DKV, H, K, q_all, do_all, ring, p_buf, ds_buf, full, empty, pready, pfree,
                 D: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr, DETERMINISTIC: gl.constexpr):
        t, hb = program_row(H)
        nb = row_blocks(NEND, t, BLOCK_N)
        HALF: gl.constexpr = D // 2
        CHUNKS: gl.constexpr = D // CHUNK
        q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        c_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, CHUNK, 16])
        dq = gl.zeros([BLOCK_H_C, HALF], gl.float32, layout=q_layout)
        c_zero = gl.zeros([BLOCK_N, CHUNK], gl.float32, layout=c_layout)
        red_layout: gl.constexpr = reduction_layout(BLOCK_N, CHUNK)
        row_base = t * K
        if DETERMINISTIC:       # DKV: the launch's per-(head block, row, slot) buffer
            row_base_out = (hb * (gl.num_programs(0) // (H // BLOCK_H_C)) + t) * K
        for b in range(nb):
            z = loop_zero(b, K)
            buf = b % 2
            if DETERMINISTIC:   # plain stores straight from the accumulator's layout, one writer per element
                n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, c_layout))
                idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
                valid = idx >= 0
                rows = (row_base_out + n).to(gl.int64) * D
            else:
                n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, red_layout))
                idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
                valid = idx >= 0
                rows = gl.where(valid, idx, 0).to(gl.int64) * D
            mbarrier.wait(full.index(0), b & 1)
            mbarrier.wait(pready.index(buf), (b // 2) & 1)
            fence_async_shared()
            dq = warpgroup_mma(ds_buf.index(buf + z), ring.index(z).slice(HALF, HALF, dim=1), dq)
            release(empty.index(0))
            p_t = p_buf.index(buf + z).permute((1, 0))          # (slots, heads)
            ds_t = ds_buf.index(buf + z).permute((1, 0))
            do_z = do_all.index(z)
            q_z = q_all.index(z)
            # Chunk c + 1's two products are issued before chunk c's reductions, so the tensor cores work while
            # this warpgroup issues them.
            acc = warpgroup_mma(p_t, do_z.slice(0, CHUNK, dim=1), c_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(ds_t, q_z.slice(0, CHUNK, dim=1), acc, is_async=True)
            for c in gl.static_range(CHUNKS):
                if c + 1 < CHUNKS:
                    nxt = warpgroup_mma(p_t, do_z.slice((c + 1) * CHUNK, CHUNK, dim=1), c_zero, use_acc=False,
                                        is_async=True)
                    nxt = warpgroup_mma(ds_t, q_z.slice((c + 1) * CHUNK, CHUNK, dim=1), nxt, is_async=True)
                    acc = warpgroup_mma_wait(2, deps=[acc])
                else:
                    acc = warpgroup_mma_wait(0, deps=[acc])
                    release(pfree.index(buf))           # the last products have read P and dS
                # Whole 128-byte lines per warp, columns permuted (the post-pass undoes it): the reductions are this
                # kernel's largest cost (BENCHMARKS.md).
                if DETERMINISTIC:
                    cols = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, c_layout))
                    gl.store(DKV + rows[:, None] + cols[None, :], acc, mask=valid[:, None])
                else:
                    add_reduced(acc, DKV, rows, valid, c * CHUNK)
                if c + 1 < CHUNKS:
                    acc = nxt
        store_heads(dq, DQ, t, H, hb, HALF, ring.index(0).slice(HALF, HALF, dim=1), D)

    @gluon.jit
    def _sparse_attn_bwd_gluon(Q, DO, KV, IDX, NEND, DENOM2, DELTA, DQ, DKV, COS, SIN, MASS, H, K, KT, OFF,
                               qk_scale_log2, scale, D: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr,
                               num_warps: gl.constexpr, REGS: gl.constexpr, ROPE: gl.constexpr, RW: gl.constexpr,
                               DETERMINISTIC: gl.constexpr, DO_MASS: gl.constexpr):
        # Each partition derives its row, head block and tile count (up to the row's last valid slot) itself: handed
        # over from here they took registers in all three (spills 44 -> 28 bytes on Triton 3.6).
        dtype: gl.constexpr = Q.dtype.element_ty
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H_C, D], dtype)
        q_all = gl.allocate_shared_memory(dtype, [1, BLOCK_H_C, D], x_layout)
        do_all = gl.allocate_shared_memory(dtype, [1, BLOCK_H_C, D], x_layout)
        ring = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))
        t_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H_C, BLOCK_N], dtype)
        p_buf = gl.allocate_shared_memory(dtype, [2, BLOCK_H_C, BLOCK_N], t_layout)
        ds_buf = gl.allocate_shared_memory(dtype, [2, BLOCK_H_C, BLOCK_N], t_layout)
        full = mbarriers(1, 128)        # the producer's 128 threads' cp.async completions
        empty = mbarriers(1, 256)       # both consumers' dq products have read the tile (every thread arrives)
        pready = mbarriers(2, 1)
        pfree = mbarriers(2, 128)       # the dKV warpgroup's threads
        gl.warp_specialize([
            (_bwd_softmax, (IDX, NEND, DQ, DENOM2, DELTA, COS, SIN, MASS, H, K, KT, OFF, qk_scale_log2, scale, q_all,
                            do_all, ring, p_buf, ds_buf, full, empty, pready, pfree, D, BLOCK_N, ROPE, RW, DO_MASS)),
            (_bwd_dkv, (IDX, NEND, DQ, DKV, H, K, q_all, do_all, ring, p_buf, ds_buf, full, empty, pready, pfree, D,
                        BLOCK_N, CHUNK, DETERMINISTIC)),
            (_bwd_producer, (Q, DO, KV, IDX, NEND, H, K, q_all.index(0), do_all.index(0), ring, full, empty, D,
                             BLOCK_N))],
            [4, 4], [REGS[0], REGS[1]])


def launch(q, do, kv, idx, denom2, delta, dq, dkv, scale, config=None, rope=None, deterministic_rows=None,
           mass_slots=None):
    """Fills ``dq`` (T, H, D) and adds to ``dkv`` (N, D) fp32 (module docstring; T >= 1, N >= 1).
    ``config``: :data:`BWD_CONFIG` keys. ``rope``: None or the (T, R/2) fp32 (cos, sin) tables of the forward's
    output rotation: ``do`` is in that frame and is rotated forward once it is in shared memory.
    ``deterministic_rows``: None adds dKV with float atomics (their order varies between runs); a row count makes
    dKV bitwise repeatable: the kernel runs over chunks of that many query rows, stores each (head block, row, slot)
    contribution to a buffer (``H / 64 * rows * K * D`` fp32) and :func:`.segment_sum.add_rows_by_key` adds the
    buffer into dKV key by key in a fixed order, chunk after chunk. dq is the same in both modes.
    ``mass_slots = (offset, width)``: also returns the (T, width) fp32 head-summed probabilities of those slots (the
    sparse indexer KL's teacher), one plane per 64-head block summed in a fixed order; None without."""
    unknown = sorted(set(config or {}) - set(BWD_CONFIG))
    if unknown:
        raise ValueError(f"Gluon backward config: unknown keys {unknown}; expected some of {sorted(BWD_CONFIG)}")
    cfg = dict(BWD_CONFIG, **(config or {}))
    T, H, D = q.shape
    K = idx.shape[1]
    offset, width = mass_slots if mass_slots is not None else (0, 0)
    num_hb = H // BLOCK_H
    # Zeros: tiles past a row's last valid slot store nothing. Without the mass, never touched.
    planes = denom2 if mass_slots is None else torch.zeros(T, num_hb, width, dtype=torch.float32, device=q.device)
    if K == 0:                  # no slot anywhere: zero gradients (the consumers need at least one tile)
        dq.zero_()
        return None if mass_slots is None else planes.sum(1)
    cos, sin = rope if rope is not None else (q, q)        # never read without RoPE channels (ROPE = 0)
    pairs = 0 if rope is None else cos.shape[1]
    n_end = row_ends(idx)

    def rows(s, e, out, deterministic):
        # Row slices are views: the kernel sees chunk-local row numbers.
        _sparse_attn_bwd_gluon[((e - s) * num_hb,)](
            q[s:e], do[s:e], kv, idx[s:e], n_end[s:e], denom2[s:e], delta[s:e], dq[s:e], out, cos[s:e], sin[s:e],
            planes[s:e], H, K, width, offset, scale * LOG2E, scale, D=D, BLOCK_N=BLOCK_N, CHUNK=cfg["CHUNK"],
            num_warps=4, REGS=tuple(cfg["REGS"]), ROPE=pairs, RW=rotated_width(pairs), DETERMINISTIC=deterministic,
            DO_MASS=mass_slots is not None)

    if deterministic_rows is None:
        acc = torch.zeros_like(dkv)             # dKV with each 16-column group permuted (see _bwd_dkv)
        rows(0, T, acc, False)
        add_unpermuted(dkv, acc)
        return None if mass_slots is None else planes.sum(1)
    step = max(1, min(T, int(deterministic_rows)))
    buf = torch.empty(num_hb * step * K * D, dtype=torch.float32, device=q.device)     # columns in natural order
    for s in range(0, T, step):
        e = min(s + step, T)
        rows(s, e, buf, True)
        add_rows_by_key(dkv, idx[s:e], buf, num_hb)
    return None if mass_slots is None else planes.sum(1)

"""Gluon (SM90) building blocks shared by the kernels, and the one module that imports Triton's Gluon.

Gluon is experimental and renames things between Triton releases. The kernels keep one code path each and call the
names below; where releases differ, a name is bound here to whichever builtin this Triton has (no wrapper around it,
so a kernel traces the same operations on every release; tests/ops/test_gluon_builds.py builds every kernel for
sm_90 with the installed Triton). Triton 3.6, 3.7 and 3.9 build them all:

- ``async_load(smem, pointers, mask=None)``, cp.async into shared memory: ``async_copy.async_load`` from 3.9,
  ``async_copy.async_copy_global_to_shared`` in 3.6 and 3.7;
- ``tma_load(desc, coord, barrier, smem)``, a TMA copy: ``tma.async_load`` from 3.9,
  ``tma.async_copy_global_to_shared`` in 3.6 and 3.7;
- ``thread_barrier()``, a barrier of the CTA's threads: ``gl.barrier`` from 3.7, ``gl.thread_barrier`` in 3.6.

3.9 keeps the old copy names only to raise "has been removed", so the new names are looked up first.
``gl.warp_specialize([(default, args), (worker, args), ...], worker_num_warps, worker_num_regs)`` takes the same
arguments in all three and needs no shim. A value a kernel forms before ``gl.warp_specialize`` reaches the
partitions through a shared-memory slot, and Triton 3.9 may place that slot inside a partition's reduction
scratch, where the partition overwrites it (the teacher-mass kernel was laid out so): a partition whose code
reduces across warps derives such values itself, and tests/ops/test_gluon_builds.py checks every kernel's layout
for the overlap.

:data:`IMPORTED` is False where this Triton has no usable Gluon (or lacks one of the names): the package still
imports (the names a kernel module imports from here exist, as None), the kernel modules define no kernels, and
their ``available()`` says no.

The building blocks: one program per (query row, 64-head block) (:func:`program_row`), mbarrier arrays, and the
producer warpgroup's cp.async gathers of rows into a ring of shared-memory stages (:func:`ring_gather`, from
:func:`slot_rows` and :func:`gather_rows`; :func:`copy_heads`) and the RoPE rotation of a register tile
(:func:`rotate_channel_pairs`: the attention's output rotation and its gradient), used by the attention forward and
teacher mass (:mod:`.sparse_attention.gluon_hopper`), the attention backward dKV
(:mod:`.sparse_attention.gluon_hopper_bwd`) and the indexer KL backward (:mod:`.indexer_loss.gluon_hopper`).
"""
from __future__ import annotations

# Bound whether or not Gluon imports, so that the kernel modules' imports of them always work.
gluon = gl = async_copy = mbarrier = tma = fence_async_shared = warpgroup_mma = warpgroup_mma_wait = None
TensorDescriptor = async_load = tma_load = thread_barrier = None
program_row = row_blocks = loop_zero = mbarriers = release = slot_rows = gather_rows = None
copy_heads = store_heads = ring_gather = None
rotate_channel_pairs = None
reduction_layout = add_reduced = None

try:  # any import problem (older or newer Triton) just disables the Gluon paths
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    IMPORTED = True
except Exception:  # pragma: no cover - depends on the installed Triton
    IMPORTED = False

# Heads per program of the attention kernels (the wgmma M of their products).
BLOCK_H = 64


def add_unpermuted(dst, acc) -> None:
    """``dst += acc`` for (N, D) rows ``acc`` accumulated by :func:`add_reduced` in its permuted column order (column
    16a + 4q + 2b + e of ``acc`` is column 16a + 8b + 2q + e of ``dst``), without a copy of ``acc``."""
    N, D = acc.shape
    dst.view(N, D // 16, 2, 4, 2).add_(acc.view(N, D // 16, 4, 2, 2).permute(0, 1, 3, 2, 4))


def sm90(device) -> tuple[bool, str]:
    """(usable, reason) of the SM90 Gluon kernels on ``device``: Gluon imported and a GPU of compute capability 9."""
    import torch
    device = torch.device(device)
    if not IMPORTED:
        return False, "this Triton has no usable Gluon"
    if device.type != "cuda":
        return False, "no SM90 GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return False, f"no SM90 GPU (sm_{major}{minor})"
    return True, ""


def half_precision(*tensors) -> tuple[bool, str]:
    """(usable, reason): every tensor bf16 or fp16, all of one dtype (the Gluon kernels' operand types)."""
    import torch
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or not dtypes <= {torch.bfloat16, torch.float16}:
        return False, f"needs bf16/fp16 operands of one dtype, got {sorted(map(str, dtypes))}"
    return True, ""


if IMPORTED:
    import triton

    BLOCK_H_C = gl.constexpr(BLOCK_H)

    @triton.constexpr_function
    def reduction_layout(block_n, chunk):
        # A (block_n = 64 rows, chunk columns) fp32 tile laid out for reductions into global memory (add_reduced):
        # each thread's four adjacent values in consecutive registers (one 16-byte reduction) and eight lanes on one
        # row, so a warp's reductions cover whole 128-byte lines of four rows.
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0]] + [[0, 32 << i] for i in range(chunk.bit_length() - 6)],
            lane_bases=[[0, 4], [0, 8], [0, 16], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
            shape=[block_n, chunk])

    @gluon.jit
    def add_reduced(acc, DST, rows, valid, col0):
        # Adds the (64, CHUNK) fp32 wgmma accumulator ``acc`` (M = 64 rows of one warpgroup) to columns
        # [col0, col0 + CHUNK) of the fp32 rows of DST at element offsets ``rows`` (int64), where ``valid`` (both
        # in SliceLayout(1, reduction_layout) of acc's shape), with relaxed 16-byte reductions. Column
        # 16a + 8b + 2q + e of the chunk lands at 16a + 4q + 2b + e, so that each thread's four values of a
        # 16-column group are adjacent: add_unpermuted adds them in the natural order once all reductions are done (the
        # wgmma layout's pairs gave 8-byte reductions over half lines; the reductions are the backward kernels'
        # largest cost).
        BLOCK_N: gl.constexpr = acc.shape[0]
        CHUNK: gl.constexpr = acc.shape[1]
        layout: gl.constexpr = reduction_layout(BLOCK_N, CHUNK)
        acc = gl.permute(gl.reshape(acc, [BLOCK_N, CHUNK // 16, 2, 4, 2]), [0, 1, 3, 2, 4])
        acc = gl.convert_layout(gl.reshape(acc, [BLOCK_N, CHUNK]), layout)
        cols = col0 + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
        gl.atomic_add(DST + rows[:, None] + cols[None, :], acc, mask=valid[:, None], sem="relaxed")

    @gluon.jit
    def row_blocks(NEND, t, BLOCK_N: gl.constexpr):
        # Blocks of BLOCK_N slots that row t's kernels process: up to its last valid slot (NEND[t], from
        # index_sets.row_ends), at least one (a row without a valid slot runs one all-empty block, which gives its
        # zero output / gradients through the kernels' ordinary masking).
        return gl.maximum(gl.cdiv(gl.load(NEND + t), BLOCK_N), 1)

    @gluon.jit
    def loop_zero(b, K):
        # 0 for every block b of a row_blocks loop over K slots (b < max(cdiv(K, BLOCK_N), 1) <= K + 1), in a form
        # the compiler cannot prove constant. Shared-memory operands indexed by it keep their wgmma descriptors inside
        # the loop; with loop-invariant operands they are hoisted out of it and spilled. The older form
        # (b + 1) // (nb + 1) ties the bound to the trip count, which Triton 3.9's LLVM sees through (the attention
        # backward then spilled 608 bytes, BENCHMARKS.md).
        return b // (K + 1)

    @gluon.jit
    def program_row(H):
        # (query row t as int64, head block hb) of this program: one program per (row, 64-head block).
        pid = gl.program_id(0)
        return (pid // (H // BLOCK_H_C)).to(gl.int64), pid % (H // BLOCK_H_C)

    @gluon.jit
    def mbarriers(n: gl.constexpr, count: gl.constexpr):
        # n mbarriers in shared memory, each completing a phase after ``count`` arrivals.
        bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(n):
            mbarrier.init(bars.index(i), count=count)
        return bars

    @gluon.jit
    def release(bar):
        # Every thread of the calling warpgroup arrives on ``bar`` itself, so its count takes 128 per warpgroup.
        # ``mbarrier.arrive`` lowers to a bar.sync of the warpgroup and one thread's arrive; a buffer read only by
        # wgmma products that each thread has already waited for needs no such barrier (measured: the warm-up
        # teacher 1.02-1.06x, BENCHMARKS.md). Callers issue no cp.async of their own, so the arrival is immediate.
        # Use it only to hand back a buffer that was read, never to publish writes: this arrive form has no
        # documented release ordering for the thread's earlier stores.
        async_copy.mbarrier_arrive(bar, increment_count=False)

    @gluon.jit
    def slot_rows(IDX, row_base, b, r: gl.constexpr, K, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        # Slot indices of rows r .. r + 16 of block b (-1 past K).
        n = b * BLOCK_N + r + gl.arange(0, 16, layout=layout)
        return gl.load(IDX + row_base + n, mask=n < K, other=-1)

    @gluon.jit
    def gather_rows(stage_smem, r: gl.constexpr, idx, KV, cols, D: gl.constexpr):
        # cp.async of kv rows idx into rows r .. r + 16. Empty slots (-1) are masked copies (zero-filled, never read
        # unmasked by the consumers) that read no memory: as reads of row 0 they made every program of a pack with
        # many empty slots (short documents) hammer the same L2 lines.
        ok = idx >= 0
        rows = gl.where(ok, idx, 0).to(gl.int64) * D
        async_load(stage_smem.slice(r, 16, dim=0), KV + rows[:, None] + cols[None, :], mask=ok[:, None])

    @gluon.jit
    def store_heads(x, OUT, t, H, hb, col0: gl.constexpr, staging, D: gl.constexpr):
        # Columns [col0, col0 + x's width) of the 64 heads of head block hb of row t of OUT (T, H, D), from the
        # register tile x through ``staging`` (shared memory of x's shape, free by now): read back 8 columns per
        # thread, so each warp writes whole 512-byte row segments (the wgmma layout's 4-byte pieces filled half of
        # every 32-byte sector: ncu counted twice the output's bytes reaching L2).
        staging.store(x.to(OUT.dtype.element_ty))
        thread_barrier()
        st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        h_o = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=gl.SliceLayout(1, st_layout))
        c_o = col0 + gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, st_layout))
        gl.store(OUT + t * H * D + h_o.to(gl.int64)[:, None] * D + c_o[None, :], staging.load(st_layout))

    @gluon.jit
    def rotate_channel_pairs(x, COS, SIN, t, col0: gl.constexpr, D: gl.constexpr, ROPE: gl.constexpr,
                             SIGN: gl.constexpr):
        # x (M, W) fp32: columns [col0, col0 + W) of D-wide vectors of query row t. The interleaved pairs of the last
        # 2 * ROPE channels rotate by SIGN * angle (COS / SIN: (T, ROPE) fp32 tables), the others pass (``where``:
        # an infinite partner cannot leak into them). The attention forward rotates its output back (SIGN = -1),
        # the backward dO forward (+1). In the wgmma layout a pair's two channels are neighbours in one thread's
        # registers, so the split and join move no data.
        M: gl.constexpr = x.shape[0]
        W: gl.constexpr = x.shape[1]
        even, odd = gl.split(gl.reshape(x, [M, W // 2, 2]))
        j = col0 // 2 - (D // 2 - ROPE) + gl.arange(0, W // 2, layout=gl.SliceLayout(0, even.type.layout))
        rot = j >= 0
        cos = gl.load(COS + t * ROPE + gl.where(rot, j, 0), mask=rot, other=1.0)[None, :]
        sin = gl.load(SIN + t * ROPE + gl.where(rot, j, 0), mask=rot, other=0.0)[None, :]
        if SIGN < 0:
            even_r = gl.where(rot[None, :], even * cos + odd * sin, even)
            odd_r = gl.where(rot[None, :], odd * cos - even * sin, odd)
        else:
            even_r = gl.where(rot[None, :], even * cos - odd * sin, even)
            odd_r = gl.where(rot[None, :], odd * cos + even * sin, odd)
        return gl.reshape(gl.join(even_r, odd_r), [M, W])

    @gluon.jit
    def copy_heads(X, H, t, hb, x_smem, D: gl.constexpr):
        # cp.async of the 64 heads of head block hb of row t of X (T, H, D) into x_smem (not committed).
        io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        heads = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=gl.SliceLayout(1, io))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        async_load(x_smem, X + t * H * D + heads.to(gl.int64)[:, None] * D + cols[None, :])

    @gluon.jit
    def ring_gather(KV, IDX, K, nb, t, ring, full, empty, D: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr):
        # The producers' loop (attention forward, teacher mass, backward dKV): the rows of blocks 0 .. nb - 1 of row
        # t's K slots, each into ring stage b % STAGES once the consumers have released it (empty[stage]); each
        # thread's cp.async completions arrive on full[stage] (count 128; the first arrival also covers copies
        # committed before the loop, e.g. q).
        # Block b + 1's slot indices are loaded right after block b's copies are issued, so their global-load
        # latency passes while the producer waits for the next free stage (profiled on the H200: the index loads
        # issued after the wait were the producer's main stall). BLOCK_N is 16, 32 or 64.
        io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        n_layout: gl.constexpr = gl.SliceLayout(1, io)
        row_base = t * K
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        i0 = slot_rows(IDX, row_base, 0, 0, K, BLOCK_N, n_layout)
        i1 = slot_rows(IDX, row_base, 0, 16, K, BLOCK_N, n_layout)
        i2 = slot_rows(IDX, row_base, 0, 32, K, BLOCK_N, n_layout)
        i3 = slot_rows(IDX, row_base, 0, 48, K, BLOCK_N, n_layout)
        for b in range(nb):
            stage = b % STAGES
            mbarrier.wait(empty.index(stage), ((b // STAGES) + 1) & 1, pred=b >= STAGES)
            kv_stage = ring.index(stage)
            gather_rows(kv_stage, 0, i0, KV, cols, D)
            if BLOCK_N > 16:
                gather_rows(kv_stage, 16, i1, KV, cols, D)
            if BLOCK_N > 32:
                gather_rows(kv_stage, 32, i2, KV, cols, D)
                gather_rows(kv_stage, 48, i3, KV, cols, D)
            async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
            async_copy.commit_group()
            i0 = slot_rows(IDX, row_base, b + 1, 0, K, BLOCK_N, n_layout)
            if BLOCK_N > 16:
                i1 = slot_rows(IDX, row_base, b + 1, 16, K, BLOCK_N, n_layout)
            if BLOCK_N > 32:
                i2 = slot_rows(IDX, row_base, b + 1, 32, K, BLOCK_N, n_layout)
                i3 = slot_rows(IDX, row_base, b + 1, 48, K, BLOCK_N, n_layout)
        async_copy.wait_group(0)

"""Attention forward (Gluon, SM90): the producer's gather with four rows of a block per thread instead of sixteen.

Why: ``gluon_common.ring_gather`` copies each 16-row slice of a block with the layout ``[1, 8] x [1, 32] x [4, 1]``:
a warp covers one row's 512 columns, so every producer thread handles 16 rows x 2 chunks of a 64-row block (16 slot
indices to load, 16 address computations and predicates, 32 cp.async). FlashMLA's SM90 sparse prefill gives each of
its 8-thread groups 4 rows x 8 chunks of 16 bytes (4 index loads a block); built offline, its producer loop is about
134 SASS instructions a block against our 269. With threads ``[4, 8]`` a warp covers four rows x 128 bytes, each
thread one row of each 16-row slice (4 indices a block); each warp instruction still fills whole 128-byte lines.
The eleventh session's "16 of 64 rows" probe (8% faster, BENCHMARKS.md) also cut the producer's instructions ~4x.

- ``rows4``: that layout in the forward's producer (and the teacher mass's, which shares ``_pp_producer``); offline it
  spills 8 bytes outside the loop on 3.6.0 (12 on 3.7.1). Outputs must be bitwise.
- ``rows4_one_call``: the same thread mapping, each block's 64 rows by one ``async_load`` of a (64, 512) tile from
  one (64,) index vector: Triton puts a producer ``bar.sync`` before each of the four 16-row copies of a block (its
  shared-memory analysis sees four writes to one buffer), here one. Offline: no spills on 3.6.0, 12 bytes on 3.7.1,
  44 on 3.9.0 (the shipped kernel: 0, 0, 12). Outputs must be bitwise.
- ``no_reader_fence``: the consumers' ``fence.proxy.async`` after each wait for a ring stage removed (FlashMLA fences
  only where its threads write what wgmma reads); a bound, not a candidate, until the memory model says cp.async
  data needs no reader-side fence.

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/fwd_gather_rows4.py --T 32768 8192 --H 64 128
--flashmla .peers/flashmla --rounds 7``; offline: ``... --build-only``.
"""
from pathlib import Path

_COMMON = (Path(__file__).resolve().parents[2] / "dsv4attn/ops/gluon_common.py").read_text()
_START = "    @gluon.jit\n    def ring_gather("
_BODY = _COMMON[_COMMON.index(_START):]
_BODY = _BODY[:_BODY.index("        async_copy.wait_group(0)\n") + len("        async_copy.wait_group(0)\n")]
_OLD_IO = "        io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])\n"
assert _BODY.count(_OLD_IO) == 1
_ROWS4 = (_BODY.replace("def ring_gather(", "def _ring_gather_rows4(")
          .replace(_OLD_IO, "        io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])\n"))

_PRODUCER = "    @gluon.jit\n    def _pp_producer("
_CALL_OLD = "        ring_gather(KV, IDX, K, nb, t, ring, full, empty, D, BLOCK_N, STAGES)\n"
_CALL_NEW = "        _ring_gather_rows4(KV, IDX, K, nb, t, ring, full, empty, D, BLOCK_N, STAGES)\n"
_IMPORT_OLD = "program_row, release, ring_gather,"
_IMPORT_NEW = "program_row, release, ring_gather, gather_rows, slot_rows,"
_R4 = [(_IMPORT_OLD, _IMPORT_NEW), (_PRODUCER, _ROWS4 + "\n" + _PRODUCER), (_CALL_OLD, _CALL_NEW)]

_FENCE_C = ("                mbarrier.wait(full.index(c_stage), (c // STAGES) & 1)\n                fence_async_shared()\n"
            "                s = warpgroup_mma(q_smem, ring.index(c_stage + z).permute((1, 0)), s_zero, use_acc=False, "
            "is_async=True)\n")
_FENCE_0 = ("                mbarrier.wait(full.index(c_stage), (c // STAGES) & 1)\n                fence_async_shared()\n"
            "                s = warpgroup_mma(q_smem, ring.index(c_stage + z).permute((1, 0)), s_zero, use_acc=False)\n")
_NO_FENCE = [(old, old.replace("                fence_async_shared()\n", "")) for old in (_FENCE_C, _FENCE_0)]

_ONE_CALL = """    @gluon.jit
    def _ring_gather_one_call(KV, IDX, K, nb, t, ring, full, empty, D: gl.constexpr, BLOCK_N: gl.constexpr,
                              STAGES: gl.constexpr):
        io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        n_layout: gl.constexpr = gl.SliceLayout(1, io)
        row_base = t * K
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        slots = gl.arange(0, BLOCK_N, layout=n_layout)
        idx = gl.load(IDX + row_base + slots, mask=slots < K, other=-1)
        for b in range(nb):
            stage = b % STAGES
            mbarrier.wait(empty.index(stage), ((b // STAGES) + 1) & 1, pred=b >= STAGES)
            ok = idx >= 0
            rows = gl.where(ok, idx, 0).to(gl.int64) * D
            async_load(ring.index(stage), KV + rows[:, None] + cols[None, :], mask=ok[:, None])
            async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
            async_copy.commit_group()
            n = (b + 1) * BLOCK_N + slots
            idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
        async_copy.wait_group(0)

"""
_ONE = [(_PRODUCER, _ONE_CALL + _PRODUCER),
        (_CALL_OLD, "        _ring_gather_one_call(KV, IDX, K, nb, t, ring, full, empty, D, BLOCK_N, STAGES)\n")]
_ASYNC_OLD = "from ..gluon_common import (BLOCK_H, IMPORTED, TensorDescriptor, async_copy,"
_ASYNC_NEW = "from ..gluon_common import (BLOCK_H, IMPORTED, TensorDescriptor, async_copy, async_load,"

VARIANTS = {"rows4": _R4, "rows4_one_call": _ONE + [(_ASYNC_OLD, _ASYNC_NEW)], "no_reader_fence": _NO_FENCE}

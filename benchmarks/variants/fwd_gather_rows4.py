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

VARIANTS = {"rows4": _R4, "no_reader_fence": _NO_FENCE}

"""Attention forward (Gluon, SM90): a bound, the consumers' reader-side fence removed.

- ``no_reader_fence``: the consumers' ``fence.proxy.async`` after each wait for a ring stage removed (FlashMLA fences
  only where its threads write what wgmma reads); a bound, not a candidate, until the memory model says cp.async
  data needs no reader-side fence.

(The same file held the gather with four rows a thread, ``rows4`` and ``rows4_one_call``: measured and refuted in
the thirty-seventh session, BENCHMARKS.md; their text is in commit bfc4a03.)

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/fwd_no_reader_fence.py --T 32768 8192 --H 64 128
--flashmla .peers/flashmla --rounds 7``; offline: ``... --build-only``.
"""

_WAIT = "                mbarrier.wait(full.index(c_stage), (c // STAGES) & 1)\n                fence_async_shared()\n"
_QK = "                s = warpgroup_mma(q_smem, ring.index(c_stage + z).permute((1, 0)), s_zero, use_acc=False"
_FENCE_C = _WAIT + _QK + ", is_async=True)\n"
_FENCE_0 = _WAIT + _QK + ")\n"
_NO_FENCE = [(old, old.replace("                fence_async_shared()\n", "")) for old in (_FENCE_C, _FENCE_0)]

VARIANTS = {"no_reader_fence": _NO_FENCE}

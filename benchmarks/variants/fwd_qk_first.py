"""Attention forward (Gluon, SM90): each consumer issues its next block's Q K^T before taking over the other's P.

Why: today a consumer waits for the other consumer's P of block b, rescales, issues P V of b and only then the Q K^T
of its own block c = b + 1, so that product waits on the other's softmax. FlashMLA's SM90 sparse prefill issues a
warpgroup's next Q K^T at its loop top, independent of the other's softmax (an offline SASS count, thirty-seventh
session, BENCHMARKS.md). The fifth session tried this order once and refuted it for 99-134 spill instructions,
since gone with the block-dependent zero index of every shared-memory operand ("not tried" again since).

- ``qk_first``: wait for c's stage, issue Q K^T of c, take b over (wait for its P, rescale), issue P V of b, wait for
  Q K^T only; c's softmax and publish run while P V of b is on the tensor cores; then wait for P V of b and release
  b's P and stage (later than today: the producer's refill of that stage waits for c's softmax). The softmax is
  written in both branches of the loop's first-block test: an accumulator in flight cannot leave the branch that
  issued it. Offline (3.6.0): 12 bytes spilled.
- ``qk_first_early_release``: the same order of issue, both products waited for before c's softmax (b's stage
  released as early as today). Offline (3.6.0): no spills.

Outputs must be bitwise (the same products and the same arithmetic). GPU (a wrong phase deadlocks: run it under
``timeout``): ``timeout 150 python benchmarks/kernel_variants.py benchmarks/variants/fwd_qk_first.py --T 32768 8192
--H 64 128 --flashmla .peers/flashmla --rounds 7``; offline: ``... --build-only``.
"""
from pathlib import Path

_SOURCE = (Path(__file__).resolve().parents[2] / "dsv4attn/ops/sparse_attention/gluon_hopper.py").read_text()
_PUBLISH = "            alpha, row_sum, m_i = _pp_publish(s, m_i, c, p_buf, stats, pready, pfree)\n"
# The shipped loop body from the first-block test to c's publish, quoted as the change's ``old``.
_START = _SOURCE.index("            if b >= 0:\n                l_i, m_i, acc = _pp_take_over(b,")
_OLD = _SOURCE[_START:_SOURCE.index(_PUBLISH, _START) + len(_PUBLISH)]
_ELSE = _OLD[_OLD.index("            else:\n"):_OLD.index("            s = gl.where(")]
_TAIL = _OLD[_OLD.index("            s = gl.where("):]

_ISSUE = '''            if b >= 0:
                mbarrier.wait(full.index(c_stage), (c // STAGES) & 1)
                fence_async_shared()
                s = warpgroup_mma(q_smem, ring.index(c_stage + z).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                l_i, m_i, acc = _pp_take_over(b, l_i, acc, stats, full, pready, STAGES, row_layout)
                acc = warpgroup_mma(p_buf.index(b % 2 + z), ring.index(b % STAGES + z).slice(W * HALF, HALF, dim=1),
                                    acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=[s])
'''
_RELEASE_B = '''                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(pfree.index(b % 2))
                mbarrier.arrive(empty.index(b % STAGES))
'''

# c's softmax and publish, in each branch (an in-flight accumulator cannot leave the branch that issued it).
_SOFTMAX = "".join("    " + line for line in _TAIL.splitlines(True))

VARIANTS = {"qk_first": [(_OLD, _ISSUE + _SOFTMAX + _RELEASE_B + _ELSE + _SOFTMAX)],
            "qk_first_early_release": [(_OLD, _ISSUE + _RELEASE_B + _ELSE + _TAIL)]}

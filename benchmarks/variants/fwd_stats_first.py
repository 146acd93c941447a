"""Attention forward (Gluon, SM90): the ping-pong's running max handed over before P, and the softmax's scale folded
into the exponent's FFMA.

Why (an offline SASS count of both consumer loops, Triton 3.6.0, beside FlashMLA's SM90 sparse prefill kernel,
thirty-seventh session): per block ours issues ~7% fewer instructions than FlashMLA's, but between the wait for the
other consumer's P and our next wgmma lie ~171 instructions (a fence, the statistics' loads and the 128 FMUL that
rescale the accumulator), against ~23 in FlashMLA, which publishes the new row max before P, so that the receiver
rescales its accumulator while the sender still forms P. And FlashMLA forms ``exp2(s * scale - m)`` with one FFMA
per element where we scale the scores first (an FMUL more per element of the owner's block).

- ``stats_first``: the owner stores alpha and the new max and arrives on a barrier of their own (``mready``, one
  per P buffer) right after the max; then forms P and its row sum and publishes them (``pready``) as before. The
  receiver waits for ``mready``, rescales its accumulator, and only then waits for the stage and for P. Outputs must
  be bitwise (the same operations in another order).
- ``ffma_exp2``: the scores stay unscaled (-inf at empty slots) until the softmax: the max is ``max(s) * scale``
  (the same value: rounding is monotonic and scale > 0) and P is ``exp2(s * scale - m)``, fused. Outputs may differ
  in the last bits of P's fp32 (one rounding less).
- ``both``.

GPU: ``timeout 150 python benchmarks/kernel_variants.py benchmarks/variants/fwd_stats_first.py --T 32768 8192
--H 64 128 --flashmla .peers/flashmla --rounds 7`` (a wrong barrier phase deadlocks: run it under ``timeout``);
offline: ``... --build-only``.
"""
from pathlib import Path

_SOURCE = (Path(__file__).resolve().parents[2] / "dsv4attn/ops/sparse_attention/gluon_hopper.py").read_text()


def _function(name: str) -> str:
    """The shipped text of jit function ``name`` (its def line to the next decorator), quoted as a change's ``old``."""
    start = _SOURCE.index(f"    def {name}(")
    return _SOURCE[start:_SOURCE.index("    @gluon.jit\n", start)]


_PUBLISH_OLD = _function("_pp_publish")


def _publish(stats_first: bool, ffma: bool) -> str:
    head = "    def _pp_publish(s, m_i, b, p_buf, stats, pready, pfree, mready, scale):\n"
    body = ["        half = b % 2\n",
            "        m_new = gl.maximum(m_i, gl.max(s, 1) * scale)\n" if ffma else
            "        m_new = gl.maximum(m_i, gl.max(s, 1))\n",
            "        m_safe = gl.where(m_new == float(\"-inf\"), 0.0, m_new)\n",
            "        alpha = gl.exp2(m_i - m_safe)\n"]
    p = ("        p = gl.exp2(s * scale - m_safe[:, None])\n" if ffma else
         "        p = gl.exp2(s - m_safe[:, None])\n")
    wait = "        mbarrier.wait(pfree.index(half), ((b // 2) + 1) & 1, pred=b >= 2)\n"
    if stats_first:
        body += [wait,
                 "        stats.index(3 * half).store(alpha)\n",
                 "        stats.index(3 * half + 2).store(m_new)\n",
                 "        mbarrier.arrive(mready.index(half))\n",
                 p,
                 "        row_sum = gl.sum(p, 1)\n",
                 "        p_buf.index(half).store(p.to(p_buf.dtype))\n",
                 "        stats.index(3 * half + 1).store(row_sum)\n"]
    else:
        body += [p,
                 "        row_sum = gl.sum(p, 1)\n",
                 wait,
                 "        p_buf.index(half).store(p.to(p_buf.dtype))\n",
                 "        stats.index(3 * half).store(alpha)\n",
                 "        stats.index(3 * half + 1).store(row_sum)\n",
                 "        stats.index(3 * half + 2).store(m_new)\n"]
    body += ["        fence_async_shared()\n",
             "        mbarrier.arrive(pready.index(half))\n",
             "        return alpha, row_sum, m_new\n\n"]
    return head + "".join(body)


_TAKE_OLD = _function("_pp_take_over")
_TAKE_FIRST = '''    def _pp_take_over(b, l_i, acc, stats, full, pready, mready, STAGES: gl.constexpr,
                      row_layout: gl.constexpr):
        mbarrier.wait(mready.index(b % 2), (b // 2) & 1)
        alpha = stats.index(3 * (b % 2)).load(row_layout)
        m_i = stats.index(3 * (b % 2) + 2).load(row_layout)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
        mbarrier.wait(full.index(b % STAGES), (b // STAGES) & 1)
        mbarrier.wait(pready.index(b % 2), (b // 2) & 1)
        fence_async_shared()
        l_i = l_i * alpha + stats.index(3 * (b % 2) + 1).load(row_layout)
        return l_i, m_i, acc

'''
_TAKE_PLAIN = _TAKE_OLD.replace("full, pready, STAGES", "full, pready, mready, STAGES")

# Plumbing shared by every variant: mready allocated and passed down, the scale passed to _pp_publish.
_PLUMB = [
    ("        pfree = mbarriers(2, 2)\n        gl.warp_specialize([\n            (_pp_consumer,",
     "        pfree = mbarriers(2, 2)\n        mready = mbarriers(2, 1)\n        gl.warp_specialize([\n"
     "            (_pp_consumer,"),
    ("stats, full, empty, pready, pfree, gl.constexpr(0), D, BLOCK_N, STAGES, ROPE)",
     "stats, full, empty, pready, pfree, mready, gl.constexpr(0), D, BLOCK_N, STAGES, ROPE)"),
    ("stats, full, empty, pready, pfree, gl.constexpr(1), D, BLOCK_N, STAGES, ROPE)",
     "stats, full, empty, pready, pfree, mready, gl.constexpr(1), D, BLOCK_N, STAGES, ROPE)"),
    ("                     full, empty, pready, pfree, W: gl.constexpr,",
     "                     full, empty, pready, pfree, mready, W: gl.constexpr,"),
    ("_pp_take_over(b, l_i, acc, stats, full, pready, STAGES, row_layout)",
     "_pp_take_over(b, l_i, acc, stats, full, pready, mready, STAGES, row_layout)"),
    ("_pp_take_over(last, l_i, acc, stats, full, pready, STAGES, row_layout)",
     "_pp_take_over(last, l_i, acc, stats, full, pready, mready, STAGES, row_layout)"),
]
_SCALED = '            s = gl.where((idx >= 0)[None, :], s * qk_scale_log2, float("-inf"))\n            n = (c + 2)'
_UNSCALED = '            s = gl.where((idx >= 0)[None, :], s, float("-inf"))\n            n = (c + 2)'
_CALL_OLD = "_pp_publish(s, m_i, c, p_buf, stats, pready, pfree)"


def _variant(stats_first: bool, ffma: bool):
    changes = _PLUMB + [(_PUBLISH_OLD, _publish(stats_first, ffma)),
                        (_TAKE_OLD, _TAKE_FIRST if stats_first else _TAKE_PLAIN),
                        (_CALL_OLD, "_pp_publish(s, m_i, c, p_buf, stats, pready, pfree, mready, "
                                    + ("qk_scale_log2)" if ffma else "1.0)"))]
    if ffma:
        changes.append((_SCALED, _UNSCALED))
    return changes


VARIANTS = {"stats_first": _variant(True, False), "ffma_exp2": _variant(False, True), "both": _variant(True, True)}

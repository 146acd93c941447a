"""Warm-up teacher, range form (Gluon, SM90): each consumer's next score product issued before this block's
epilogue.

Why: the warm-up's teacher LSE and mass kernels run two rows a program, each consumer one row's 64 heads over
every kv block of the stream: s = Q C^T (wait), the stage released, then the block's epilogue (the LSE's online
log-sum-exp; the mass's exp2 and its sum over the 64 heads, which crosses the four warps through shared memory).
The tensor cores idle during a consumer's epilogue unless the other consumer's product fills it. At 32K (one
document, H100, Triton 3.6.0) the LSE ran at 639 TFLOP/s and the mass at 555 (13.9 and 16.0 ms; BENCHMARKS.md,
twenty-eighth session): the mass's heavier epilogue shows. Here block b + 1's product (its stage waited for
first) is issued once block b's is complete and runs under b's epilogue; the iteration's final wait completes it,
so no product is in flight across the loop's back edge. Block b's stage is released at the start of its
iteration (its product is complete there). The last block's "next" product is the last block again (b + 1
clamped: no copy refills that stage after the stream's last block), so the loop has no branch around an
asynchronous product; one extra 64 x 64 x 512 product a row.

- ``s_ahead``: both kernels (LSE and mass) so changed.

Outputs must be bitwise the shipped kernels' (the same products, the same epilogues in the same order).

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/teacher_s_ahead.py --T 32768 8192 --H 64``;
offline: ``... --build-only`` (the mass kernel; the LSE kernel with ``KERNEL`` edited).
"""
import importlib.util
from pathlib import Path

import torch

KERNEL = "_teacher_mass_ranges_gluon"

_SOURCE = Path(importlib.util.find_spec("dsv4attn.ops.sparse_attention.gluon_hopper").origin).read_text()
_SCORES = "    @gluon.jit\n    def _pair_scores("
_SCORES_OLD = _SOURCE[_SOURCE.index(_SCORES):_SOURCE.index("    @gluon.jit\n    def _lse_pair_consumer(")]
_SCORES_NEW = _SCORES_OLD + '''    @gluon.jit
    def _pair_first(q, ring, full, stream, s_zero, STAGES: gl.constexpr):
        # The stream's block 0 product (for a stream without blocks, over an unfilled stage; never used).
        mbarrier.wait(full.index(0), 0, pred=stream >= 1)
        return warpgroup_mma(q, ring.index(0).permute((1, 0)), s_zero, use_acc=False)

    @gluon.jit
    def _pair_scores_ahead(q, IDX, row, ok, K, j, b, stream, ring, full, empty, s_zero, s_layout: gl.constexpr,
                           STAGES: gl.constexpr):
        # Block b (its product complete) as the row's block j: slot numbers n and candidate rows idx as
        # _pair_scores forms them; its stage released; block b + 1's product issued (the last block's again), to
        # be waited for after block b's epilogue.
        n = j * s_zero.shape[1] + gl.arange(0, s_zero.shape[1], layout=gl.SliceLayout(0, s_layout))
        idx = gl.load(IDX + row * K + n, mask=(n >= 0) & (n < K) & ok, other=-1)
        release(empty.index(b % STAGES))
        a = gl.minimum(b + 1, stream - 1)
        mbarrier.wait(full.index(a % STAGES), (a // STAGES) & 1)
        s_next = warpgroup_mma(q, ring.index(a % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return n, idx, s_next

'''
_CALL = "            n, idx, s = _pair_scores(q, IDX, row, ok, K, j, b, ring, full, empty, s_zero, s_layout, STAGES)\n"
_CALL_NEW = ("            n, idx, s_next = _pair_scores_ahead(q, IDX, row, ok, K, j, b, stream, ring, full, empty, "
             "s_zero, s_layout,\n                                                STAGES)\n")
_LOOP = "        for b in range(stream):\n"
_FIRST = "        s = _pair_first(q, ring, full, stream, s_zero, STAGES)\n"
_LSE_TAIL = "            l_odd = gl.where(even, l_odd, l_i)\n"
_MASS_TAIL = "            gl.store(plane + row * K + n, mass, mask=(n >= 0) & (n < K) & ok)\n"
_WAIT = "            s = warpgroup_mma_wait(0, deps=[s_next])\n"


def _consumer(name: str, tail: str):
    """The change to one pair consumer: block 0's product before the loop, the ahead form in it, the wait last."""
    start = _SOURCE.index(f"    def {name}(")
    old = _SOURCE[_SOURCE.index(_LOOP, start):_SOURCE.index(tail, start) + len(tail)]
    return old, _FIRST + old.replace(_CALL, _CALL_NEW) + _WAIT


VARIANTS = {"s_ahead": [(_SCORES_OLD, _SCORES_NEW), _consumer("_lse_pair_consumer", _LSE_TAIL),
                        _consumer("_mass_pair_consumer", _MASS_TAIL)]}


def inputs(T, H, device):
    """The KL benchmark's warm-up inputs (``benchmarks/indexer_loss.py``; it takes H = 64), its candidates as ranges."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from indexer_loss import make_inputs
    from dsv4attn.ops.index_sets import contiguous_ranges
    from dsv4attn.ops.indexer_loss import triton as klt
    (_, _, _, q, ck, _, cand, _), _ = make_inputs(T, "warmup")
    first, visible, table, shift = contiguous_ranges(cand)
    idx = klt.range_rows_triton(first, visible, table, shift, cand.width, 0, T)
    return dict(q=q, ck=ck, idx=idx, n_end=visible.to(torch.int32), first=first)


def call(module, inp):
    scale = 512 ** -0.5
    lse = module.teacher_lse(inp["q"], inp["ck"], inp["idx"], scale, n_end=inp["n_end"], first=inp["first"])
    mass = module.teacher_mass(inp["q"], inp["ck"], inp["idx"], lse, scale, n_end=inp["n_end"], first=inp["first"])
    return lse, mass

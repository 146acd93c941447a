"""Top-k select kernel (Triton): the K-th largest found by halving on counts instead of by a sorting network.

Why (offline SASS of the sm_90 builds at KP = 512, TILE = 1024, thirty-eighth session): the select is
instruction-bound, and its instructions are mostly the networks' compare-exchanges. Per row a program runs two
networks of 2 KP = 1024 keys: tau (the K-th largest column maximum, int32) and the best KP of the <= 2 KP compacted
keys, sorted (int64). The one-warp build is 56,480 SASS instructions on Triton 3.6.0 (~900 KB of code, 3,988
shuffles with ptxas's fallback for divergent warps), the four-warp build 8,760.

- ``tau_counts``: tau by halving [INT32_MIN, max] on counts (<= 32 steps of a compare and an add per element and a
  row sum) instead of the network; the same value.
- ``exact_sort_k``: where a row kept more than KP keys, the exact K-th largest order among them by halving on
  counts, the best K (ties to the lower j: the scratch is in j order) compacted to the scratch's front, and only
  those sorted, by a network of KP keys instead of the best KP of 2 KP; the 2 KP network is then compiled only for
  the interpreter's BY_RANK form. The same keys in the same order.
- ``both``.
- ``bound_unsorted``: ``both`` without the final sort (the best K in j order: the same set, another order, so its
  outputs differ on purpose): what the descending order costs, for a decision on the output's order.

Offline, Triton 3.6.0, SASS instructions (one warp / four warps): shipped 56,480 / 8,760, ``tau_counts`` 52,392 /
7,136, ``exact_sort_k`` 31,856 / 6,416, ``both`` 27,696 / 4,784 (no spills). What runs per row changes less than
the code size: by estimate, halving costs about what the int32 network does (~2-3K instructions a row on one warp)
and ``exact_sort_k`` saves ~10% of step d's dynamic count, so the question for the GPU is whether the halved code
(instruction-cache misses) and the removed cross-warp exchanges pay.

Outputs must be bitwise. ``python benchmarks/kernel_variants.py benchmarks/variants/select_counts.py --T 32768 8192
--H 0 4096`` (H: the document length, 0 = one document of T rows). Checked bitwise against the shipped kernel under
Triton 3.9's CPU interpreter (networks, not BY_RANK) on this machine; not yet timed on a GPU.
"""

MODULE = "dsv4attn.ops.indexer.triton"
KERNEL = "_topk_select_kernel"

_COUNTS = '''

@triton.jit
def _kth_by_counts(x, valid, K):
    """(ROWS,): the K-th largest of each row's ``valid`` elements of the int32 ``x`` (INT32_MIN where a row has fewer
    than K), by halving [INT32_MIN, max] on counts: at most 32 steps of one compare and add an element."""
    lo = tl.full([x.shape[0]], INT32_MIN, tl.int64)       # invariant: count(>= lo) >= K > count(>= hi), or lo alone
    hi = tl.max(tl.where(valid, x, INT32_MIN), 1).to(tl.int64) + 1
    while tl.max(hi - lo, 0) > 1:
        mid = lo + ((hi - lo) >> 1)                       # in [INT32_MIN, INT32_MAX]: exact as int32
        enough = tl.sum((valid & (x >= mid.to(tl.int32)[:, None])).to(tl.int32), 1) >= K
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    return lo.to(tl.int32)


@triton.jit
def _kth_largest(x, K, KP: tl.constexpr, BY_RANK: tl.constexpr):'''

_TAU = [("\n\n@triton.jit\ndef _kth_largest(x, K, KP: tl.constexpr, BY_RANK: tl.constexpr):", _COUNTS),
        ("        return tl.sum(tl.where(tl.arange(0, KP)[None, :] == K - 1, _largest_descending(x, KP), 0), 1)",
         "        return _kth_by_counts(x, x == x, K)")]
# _kth_by_counts is defined by _TAU's first change; exact_sort_k alone needs it too.
_TAU_DEF_ONLY = _TAU[:1]

_WRITE_OLD = '''    if tl.max(taken, 0) <= KP:
        # At most KP keys a row (rows of at most KP candidates: half of a 4096-token document's at k = 512): one
        # sort of KP keys instead of the best KP of 2 KP, half the network's width.
        # (Names local to each branch: a compiled Triton branch may not give a variable another shape.)
        few = tl.arange(0, KP)[None, :]
        best = _descending(tl.load(scratch + few, mask=few < taken[:, None], other=INT64_MIN, cache_modifier=".cg"),
                           BY_RANK)
    else:'''
_WRITE_NEW = '''    if not BY_RANK:
        if tl.max(taken, 0) > KP:
            # The best K of the <= 2 KP keys to the scratch's front, in j order: the keys of orders above the K-th
            # largest order v, and the first of those equal to v (the scratch is in j order); then one sort of KP.
            slots = tl.arange(0, 2 * KP)[None, :]
            real = slots < taken[:, None]
            keys = tl.load(scratch + slots, mask=real, other=INT64_MIN, cache_modifier=".cg")
            order = (keys >> 32).to(tl.int32)
            v = _kth_by_counts(order, real, K)
            above = real & (order > v[:, None])
            equal = real & (order == v[:, None])
            need = K - tl.sum(above.to(tl.int32), 1)
            take = above | (equal & (tl.cumsum(equal.to(tl.int32), 1) <= need[:, None]))
            pos = tl.cumsum(take.to(tl.int32), 1) - 1
            tl.debug_barrier()                 # every thread's loads of the scratch before its rewrite
            tl.store(scratch + pos, keys, mask=take)
            tl.debug_barrier()
            taken = tl.minimum(taken, K)
        few = tl.arange(0, KP)[None, :]
        best = _descending(tl.load(scratch + few, mask=few < taken[:, None], other=INT64_MIN, cache_modifier=".cg"),
                           BY_RANK)
    elif tl.max(taken, 0) <= KP:
        few = tl.arange(0, KP)[None, :]
        best = _descending(tl.load(scratch + few, mask=few < taken[:, None], other=INT64_MIN, cache_modifier=".cg"),
                           BY_RANK)
    else:'''
_EXACT = [(_WRITE_OLD, _WRITE_NEW)]
# The bound: the best K left in j order, unsorted (the same set; the order differs on purpose).
_SORTED = """            taken = tl.minimum(taken, K)
        few = tl.arange(0, KP)[None, :]
        best = _descending(tl.load(scratch + few, mask=few < taken[:, None], other=INT64_MIN, cache_modifier=".cg"),
                           BY_RANK)"""
# (Every row trimmed to K first, also where K < its keys <= KP.)
_UNSORTED = [(_WRITE_OLD, _WRITE_NEW.replace("        if tl.max(taken, 0) > KP:", "        if tl.max(taken, 0) > K:")
              .replace(_SORTED, _SORTED.replace(
    'best = _descending(tl.load(scratch + few, mask=few < taken[:, None], other=INT64_MIN, cache_modifier=".cg"),\n'
    '                           BY_RANK)',
    'best = tl.load(scratch + few, mask=few < taken[:, None], other=INT64_MIN, cache_modifier=".cg")')))]

VARIANTS = {"tau_counts": _TAU, "exact_sort_k": _TAU_DEF_ONLY + _EXACT, "both": _TAU + _EXACT,
            "bound_unsorted": _TAU + _UNSORTED}


# The select's own inputs and call (H: the document length, 0 = one document of T rows).
from indexer import run_select as call, select_inputs as inputs  # noqa: E402,F401

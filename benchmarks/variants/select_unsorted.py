"""Indexer top-k select kernel: the best K of each row written in candidate (j) order, with no final sort.

The seventeenth session measured the final bitonic ``tl.topk`` of the 2 KP scratch keys as 53-57% of the select
pass. If the output order were the candidates' order instead of descending score (the set is the same, ties still
to the lower j), that sort would go: this variant finds the exact K-th largest order v of the scratch in registers
(a 4-way search on counts, 16 steps over the 32-bit range), takes the orders > v and the first K - count(> v) equal
to v in j order (the scratch is in j order), and stores each at its prefix-count position. Finite scores only: a
row with fewer than K finite candidates gets -1 / -inf after them, as the shipped kernel does.

This is a timing probe for that contract change (outputs differ in order from the shipped kernel's; the sets are
equal: checked under the CPU interpreter). Built offline for sm_90: 163 registers on Triton 3.6.0, 128 on 3.9.0
(shipped: 72, 64), no spills. Not timed yet:
``python benchmarks/kernel_variants.py benchmarks/variants/select_unsorted.py --T 8192 32768 65536``.
"""
import runpy
from pathlib import Path

MODULE = "dsv4attn.ops.indexer.triton"
KERNEL = "_topk_select_kernel"
OLD = """    best = _largest_first(keys, KP, BY_RANK)
    order = best >> 32
    j = ((order + 1) << 32) - 1 - best
    rank = tl.arange(0, KP)[None, :]
    found = (rank < taken[:, None]) & (order != NEG_INF_ORDER)
    entry = first[:, None] + j
    if HAS_TABLE:
        entry = tl.load(TABLE + entry, mask=found, other=0)
    tl.store(out + rank, tl.where(found, entry + shift, -1).to(tl.int32), mask=(rank < K) & live[:, None])
    bits = tl.where(order >= 0, order, order ^ 0x7FFFFFFF).to(tl.int32)      # the order's inverse
    score = tl.where(found, bits.to(tl.float32, bitcast=True), float("-inf"))
    tl.store(scores + rank, score, mask=(rank < K) & live[:, None])
"""
NEW = """    order = (keys >> 32).to(tl.int32)
    j = ((order.to(tl.int64) + 1) << 32) - 1 - keys
    valid = (slots < taken[:, None]) & (order != NEG_INF_ORDER)
    lo = tl.min(tl.where(valid, order, 2147483647), 1).to(tl.int64)
    hi = tl.max(tl.where(valid, order, INT32_MIN), 1).to(tl.int64) + 1
    steps = tl.arange(0, 4).to(tl.int64)[None, :]
    for _ in tl.static_range(16):                   # count(>= lo) >= K > count(>= hi) where count(valid) >= K
        probes = lo[:, None] + (((hi - lo)[:, None] * steps) >> 2)
        counts = tl.sum(((order[:, :, None] >= probes.to(tl.int32)[:, None, :]) & valid[:, :, None]).to(tl.int32), 1)
        enough = counts >= K
        hi = tl.min(tl.where(enough, hi[:, None], probes), 1)
        lo = tl.max(tl.where(enough, probes, lo[:, None]), 1)
    v = lo.to(tl.int32)
    above = valid & (order > v[:, None])
    equal = valid & (order == v[:, None])
    need = K - tl.sum(above.to(tl.int32), 1)
    chosen = above | (equal & (tl.cumsum(equal.to(tl.int32), 1) <= need[:, None]))
    chosen = tl.where(tl.sum(valid.to(tl.int32), 1)[:, None] > K, chosen, valid)
    pos = tl.cumsum(chosen.to(tl.int32), 1) - 1
    entry = first[:, None] + j
    if HAS_TABLE:
        entry = tl.load(TABLE + entry, mask=chosen, other=0)
    put = chosen & live[:, None]
    tl.store(out + pos, (entry + shift).to(tl.int32), mask=put)
    bits = tl.where(order >= 0, order, order ^ 0x7FFFFFFF).to(tl.int32)      # the order's inverse
    tl.store(scores + pos, bits.to(tl.float32, bitcast=True), mask=put)
    count = tl.sum(chosen.to(tl.int32), 1)
    rank = tl.arange(0, KP)[None, :]
    empty = (rank >= count[:, None]) & (rank < K) & live[:, None]
    tl.store(out + rank, tl.full(rank.shape, -1, tl.int32) + 0 * count[:, None], mask=empty)
    tl.store(scores + rank, tl.full(rank.shape, float("-inf"), tl.float32) + 0 * count[:, None], mask=empty)
"""
VARIANTS = {"j_order_no_sort": [(OLD, NEW)]}
_shared = runpy.run_path(str(Path(__file__).with_name("select_tau_search.py")))
inputs, call = _shared["inputs"], _shared["call"]

"""Indexer top-k select kernel: tau (the K-th largest column maximum) by a 16-way counting search in registers
instead of a bitonic ``tl.topk`` of the column maxima.

The seventeenth session measured the select's two bitonic top-k calls as most of its time (BENCHMARKS.md, indexer).
This variant gives the same tau, so the outputs must be bitwise equal to the shipped kernel's. The search keeps
count(>= lo) >= K > count(>= hi) over [min, max + 1] of the row's column maxima; each pass splits the range in 16,
so 8 passes close a 32-bit range (hi - lo <= ceil((hi - lo) / 16) per pass).

Checked offline: indices equal to the shipped kernel's under the CPU interpreter (``_select(..., by_rank=False)`` on
random, tied and short rows); sm_90 builds with Triton 3.6.0: 255 registers (the (rows, TILE, 16) comparison) and
156 (one reduction per probe) against the shipped 72, no spills. Not timed yet:
``python benchmarks/kernel_variants.py benchmarks/variants/select_tau_search.py --T 8192 32768 65536``.
"""
import torch

MODULE = "dsv4attn.ops.indexer.triton"
KERNEL = "_topk_select_kernel"
SEARCH = [("""    else:
        return tl.sum(tl.where(tl.arange(0, KP)[None, :] == K - 1, tl.topk(x, KP), 0), 1)""",
           """    else:
        lo = tl.min(x, 1).to(tl.int64)
        hi = tl.max(x, 1).to(tl.int64) + 1
        steps = tl.arange(0, 16).to(tl.int64)[None, :]
        for _ in tl.static_range(8):
            probes = lo[:, None] + (((hi - lo)[:, None] * steps) >> 4)
            counts = tl.sum((x[:, :, None] >= probes.to(tl.int32)[:, None, :]).to(tl.int32), 1)
            enough = counts >= K
            hi = tl.min(tl.where(enough, hi[:, None], probes), 1)
            lo = tl.max(tl.where(enough, probes, lo[:, None]), 1)
        return lo.to(tl.int32)""")]
# The same search with one reduction per probe (fewer registers than the (rows, TILE, 16) comparison above).
SEARCH_LOOP = [(SEARCH[0][0], """    else:
        lo = tl.min(x, 1).to(tl.int64)
        hi = tl.max(x, 1).to(tl.int64) + 1
        for _ in tl.static_range(8):
            new_lo, new_hi = lo, hi
            for s in tl.static_range(1, 16):
                p = lo + (((hi - lo) * s) >> 4)
                enough = tl.sum((x >= p.to(tl.int32)[:, None]).to(tl.int32), 1) >= K
                new_lo = tl.where(enough, p, new_lo)
                new_hi = tl.where(enough, new_hi, tl.minimum(new_hi, p))
            lo, hi = new_lo, new_hi
        return lo.to(tl.int32)""")]
VARIANTS = {"tau_by_search": SEARCH, "tau_by_search_loop": SEARCH_LOOP}


# The select kernel alone, on the orders the shipped score kernel writes for benchmarks/indexer.py's inputs.
def inputs(T, H, device):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from indexer import make_inputs
    import dsv4attn
    from dsv4attn.ops.indexer import triton as shipped
    cfg = dsv4attn.AttentionConfig.flash()
    q, k, w, cand, _ = make_inputs(T, 0, cfg)
    first, visible, table, shift = shipped.contiguous_ranges(cand)
    orders = shipped._score_orders(q, k, w, first, visible, table, shift, cand.width, dict(shipped.CONFIG))
    return dict(orders=orders, first=first, visible=visible, topk=min(cfg.index_topk, cand.width))


def call(module, inp):
    rows = inp["orders"].shape[0]
    out = torch.empty(rows, inp["topk"], dtype=torch.int32, device=inp["orders"].device)
    scores = torch.empty(rows, inp["topk"], dtype=torch.float32, device=inp["orders"].device)
    module._select(inp["orders"], inp["first"], inp["visible"], None, 0, out, scores, dict(module.CONFIG),
                   by_rank=False)
    return out, scores

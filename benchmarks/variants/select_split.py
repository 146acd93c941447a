"""Indexer top-k select kernel (``_topk_select_kernel``): what its time is made of at the V4 shapes.

The select pass is the gap to cuDNN's indexer (2.65 of our 8.04 ms at T = 32K, BENCHMARKS.md, twelfth session).
Variants: the final bitonic top-k of the 2 KP scratch keys replaced by a pairwise max (wrong outputs on purpose:
what the sort costs), and the launch's warps and tile width.
"""
import torch

MODULE = "dsv4attn.ops.indexer.triton"
KERNEL = "_topk_select_kernel"
PAIRMAX = [("    else:\n        return tl.topk(keys, KP)",
            "    else:\n        return tl.max(tl.reshape(keys, [keys.shape[0], KP, 2]), 2)")]
VARIANTS = {
    "final_sort_skipped": PAIRMAX,
    "warps_8": [("SELECT_WARPS=4,", "SELECT_WARPS=8,")],
    "warps_2": [("SELECT_WARPS=4,", "SELECT_WARPS=2,")],
    "warps_1": [("SELECT_WARPS=4,", "SELECT_WARPS=1,")],
    "tile_2048": [("SELECT_TILE=1024, SELECT_BLOCK=1024,", "SELECT_TILE=2048, SELECT_BLOCK=2048,")],
}


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
    width = cand.width
    orders = shipped._score_orders(q, k, w, first, visible, table, shift, width, dict(shipped.CONFIG))
    return dict(orders=orders, first=first, visible=visible, topk=min(cfg.index_topk, width))


def call(module, inp):
    rows = inp["orders"].shape[0]
    out = torch.empty(rows, inp["topk"], dtype=torch.int32, device=inp["orders"].device)
    scores = torch.empty(rows, inp["topk"], dtype=torch.float32, device=inp["orders"].device)
    module._select(inp["orders"], inp["first"], inp["visible"], None, 0, out, scores, dict(module.CONFIG))
    return out, scores

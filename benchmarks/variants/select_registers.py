"""Indexer top-k select kernel: the bitonic sorts' busiest rounds in registers.

``tl.topk`` runs a bitonic network over the index bits of its input; a compare-and-swap on bit b is a register
swap, a warp shuffle or a shared-memory exchange with a barrier, depending on whether the layout puts bit b of the
index in a thread's registers, its lane or its warp. A bitonic sort of 2^n elements runs n - b rounds on bit b, so
the low bits carry most rounds. The select kernel's tensors are laid out with lanes on the low bits (the loads'
layout), so 40 of the final sort's 55 rounds over 1024 keys were shuffles and 9 were shared-memory exchanges. A sort
does not care where its inputs sit, so this variant relabels the columns before each sort ((ROWS, R, N / R) ->
permute -> (ROWS, N)): no data moves, and a thread's R registers become the index's low bits. Outputs must equal the
shipped kernel's bitwise (the sorted result depends only on the set of keys).

Offline sm_90 builds (4 warps, KP = 512, TILE = 1024): shuffles / barriers / shared loads in the PTX, shipped ->
both sorts with R = 8: Triton 3.6.0 1265 / 81 / 327 -> 820 / 53 / 160; 3.7.1 1265 / 81 / 292 -> 820 / 53 / 145;
3.9.0 1255 / 215 / 159 -> 824 / 101 / 100; registers 72 / 72 / 64 -> 72 / 80 / 80, no spills.

Timed on the H200 (torch 2.11.0+cu130), 2026-12-03, the select kernel alone, 5 alternating rounds, ms, shipped ->
R = 8: Triton 3.6.0 T = 8K 0.627 -> 2.820, 32K 2.659 -> 11.383, 64K 5.958 -> 23.264 (0.22-0.26x); R = 4 about
half R = 8's time (1.445 / 5.756 / 12.095 ms, so 0.43-0.49x); 3.7.1 32K 2.662 -> 11.318, 64K 6.111 -> 23.500.
Outputs bitwise equal. Refuted: fewer shuffles in the PTX, 4x the time.
"""
import torch

MODULE = "dsv4attn.ops.indexer.triton"
KERNEL = "_topk_select_kernel"
HELPER = ("""@triton.jit
def _kth_largest(x, K, KP: tl.constexpr, BY_RANK: tl.constexpr):""", """@triton.jit
def _registers_low(x, R: tl.constexpr):
    \"\"\"``x`` (ROWS, N) with its columns permuted so that each thread's R registers hold the low bits of the
    result's column index: a relabelling (no data moves) that puts a sort's busiest rounds in registers.\"\"\"
    return tl.reshape(tl.permute(tl.reshape(x, [x.shape[0], R, x.shape[1] // R]), (0, 2, 1)), x.shape)


@triton.jit
def _kth_largest(x, K, KP: tl.constexpr, BY_RANK: tl.constexpr):""")


def _both(r):
    return [HELPER, ("""tl.topk(x, KP), 0), 1)""", f"""tl.topk(_registers_low(x, {r}), KP), 0), 1)"""),
            ("""        return tl.topk(keys, KP)""", f"""        return tl.topk(_registers_low(keys, {r}), KP)""")]


VARIANTS = {"both_r8": _both(8), "both_r4": _both(4)}


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

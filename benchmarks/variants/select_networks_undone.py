"""Top-k select kernel (Triton): the shipped select with one of its two latest changes undone, to time each change on
its own.

The shipped kernel sorts with its own bitonic networks (the compare-exchange's predicate as int1, where Triton 3.6 /
3.7's ``tl.topk`` / ``tl.sort`` compare it as int32) and runs one warp a program where a launch's rows hold at most
``SELECT_SHORT_WIDTH`` = 2048 candidates. Measured as variants of the kernel before them (H100, 2026-12-07, Triton
3.6.0 and 3.7.1; the variant file was ``select_int1_network.py``, commit 825fded): the networks 1.02-1.11x, the
networks with one warp 1.09-1.24x at 1024-2048 candidates a row and 0.92x at 8192 (hence the width bound).

- ``tl_sorts``: ``tl.topk`` / ``tl.sort`` again (one warp kept where rows are short);
- ``warps4``: the networks, four warps at every width;
- ``both``: the kernel before (``tl.topk`` / ``tl.sort``, four warps).

Outputs must be bitwise. ``python benchmarks/kernel_variants.py benchmarks/variants/select_networks_undone.py
--T 32768 8192 --H 0 4096`` (H: the document length, 0 = one document of T rows) on each Triton. Timed on 3.6.0 and
3.7.1 (BENCHMARKS.md, thirty-seventh session); kept for a run on 3.9.0, whose own sorts already have the int1
predicate and whose one-warp build spills 124 bytes (offline): there the two changes may gain nothing or lose.
"""

MODULE = "dsv4attn.ops.indexer.triton"
KERNEL = "_topk_select_kernel"

_SORTS = [
    ("tl.sum(tl.where(tl.arange(0, KP)[None, :] == K - 1, _largest_descending(x, KP), 0), 1)",
     "tl.sum(tl.where(tl.arange(0, KP)[None, :] == K - 1, tl.topk(x, KP), 0), 1)"),
    ("        return _largest_descending(keys, KP)\n", "        return tl.topk(keys, KP)\n"),
    ("        return _sorted_descending(keys)\n", "        return tl.sort(keys, 1, descending=True)\n"),
]
_WARPS = [("SELECT_WARPS=4, SELECT_SHORT_WIDTH=2048,", "SELECT_WARPS=4, SELECT_SHORT_WIDTH=0,")]
VARIANTS = {"tl_sorts": _SORTS, "warps4": _WARPS, "both": _SORTS + _WARPS}


# The select's own inputs and call (H: the document length, 0 = one document of T rows).
from indexer import run_select as call, select_inputs as inputs  # noqa: E402,F401

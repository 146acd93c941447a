"""Top-k select kernel (Triton): what its two short-row paths save.

The shipped kernel (1) takes every order of a program whose rows hold at most 2 KP orders each (1024 at k = 512: the
rows of documents up to 4096 tokens at ratio 4, and a long document's first 4096 rows) without the column maxima
and the sort that finds tau, and (2) where no row of a program has more than KP candidates (rows of at most 512
entries), sorts KP keys instead of taking the best KP of 2 KP. The variants below undo one change each, so their
"x shipped" column is below 1 by what the change saves.

- ``threshold_always``: the column maxima and tau for every row, as before (except that the rare refill now takes
  its rows' maxima by one more pass instead of from the kept column maxima). Outputs must be bitwise.
- ``full_width_sort``: the best KP of 2 KP scratch keys for every row, as before. Outputs must be bitwise.
- ``both``: the kernel before the two changes.

Inputs: random int32 orders (distinct almost surely: about 1.4 K candidates a long row, as random scores give),
k = 512, T rows; the ``H`` column is the document length (0: one document of T rows), row t seeing (t mod doc + 1) / 4
entries. GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/select_short_rows.py --T 32768 8192 --H 0
4096``.
"""
from pathlib import Path

import torch

MODULE = "dsv4attn.ops.indexer.triton"
KERNEL = "_topk_select_kernel"


def _branch_to_else(first_line: str, after: str):
    """(old, new): the kernel's ``if``/``else`` block that starts at ``first_line`` and ends before ``after``, and its
    else branch dedented (the code before the change)."""
    source = (Path(__file__).resolve().parents[2] / "dsv4attn/ops/indexer/triton.py").read_text()
    block = source[source.index(first_line):source.index(after)]
    body = block[block.index("    else:\n") + len("    else:\n"):]
    return block, "".join(line[4:] for line in body.splitlines(keepends=True))


_ALWAYS = _branch_to_else("    if tl.max(n, 0) <= 2 * KP:\n", "    taken = _compact(row, n, tau,")
_WIDE = _branch_to_else("    if tl.max(taken, 0) <= KP:\n", "    order = best >> 32\n")

VARIANTS = {"threshold_always": [_ALWAYS], "full_width_sort": [_WIDE], "both": [_ALWAYS, _WIDE]}


def inputs(T, H, device):
    gen = torch.Generator(device=device).manual_seed(0)
    doc = H or T
    t = torch.arange(T, device=device)
    width = doc // 4
    orders = torch.randint(-2**31, 2**31 - 1, (T, width), device=device, generator=gen, dtype=torch.int64).int()
    visible = ((t % doc + 1) // 4).int()
    first = ((t // doc) * width).int()
    return dict(orders=orders, first=first, visible=visible)


def call(module, inp):
    T = inp["orders"].shape[0]
    out = torch.empty(T, 512, dtype=torch.int32, device=inp["orders"].device)
    scores = torch.empty(T, 512, dtype=torch.float32, device=out.device)
    module._select(inp["orders"], inp["first"], inp["visible"], None, 0, out, scores, module.CONFIG)
    return out, scores

"""Indexer score kernel (Gluon, SM90): the head weights read head-major, one sector per warp load.

Why: ncu (thirty-third session, T = 16384) counts 43% of the kernel's global sectors as excess. Each consumer loads
its 64 rows' weight of head h from ``w (rows, 64)`` fp32 before each head's product: a warp's load touches 8 rows
256 bytes apart, so 8 sectors for 32 useful bytes (L1 hits, but L1 wavefronts all the same, in the loop that sets
the pace). Read from ``w.t()`` (64, rows), a head's weights of 64 consecutive rows are 256 contiguous bytes and a
warp's load is one sector. The transposed copy (8 MiB at 32K) is made by the launcher, inside the timing.

- ``w_head_major``: as above. Orders must be bitwise.

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/scores_w_head_major.py --T 32768 8192 --H 64``.
"""
import torch

MODULE = "dsv4attn.ops.indexer.gluon_hopper"
KERNEL = "_indexer_orders_gluon"

_ROWS_OLD = "        w_rows = W_ + rows * HEADS_C\n"
_ROWS_NEW = "        w_rows = W_ + rows                   # w.t(): head h's weights of consecutive rows are adjacent\n"
_LOAD_OLD = "            w_h = gl.load(w_rows + h, mask=row_ok, other=0.0)\n"
_LOAD_NEW = "            w_h = gl.load(w_rows + h * rows_c, mask=row_ok, other=0.0)\n"
_CALL_OLD = "        q_desc, k, w, first, visible, table if table is not None else first, orders, rows_c, width, shift,\n"
_CALL_NEW = ("        q_desc, k, w.t().contiguous(), first, visible, table if table is not None else first, orders, rows_c,"
             " width, shift,\n")

VARIANTS = {"w_head_major": [(_ROWS_OLD, _ROWS_NEW), (_LOAD_OLD, _LOAD_NEW), (_CALL_OLD, _CALL_NEW)]}


def inputs(T, H, device):
    """One causal document at compress ratio 4: row t sees entries [0, t / 4)."""
    gen = torch.Generator(device=device).manual_seed(0)
    nk = T // 4
    q = torch.randn(T, 64, 128, device=device, generator=gen).bfloat16()
    k = torch.randn(nk, 128, device=device, generator=gen).bfloat16()
    w = torch.randn(T, 64, device=device, generator=gen) / 90.0
    first = torch.zeros(T, dtype=torch.int32, device=device)
    visible = ((torch.arange(T, device=device) + 1) // 4).int()
    return dict(args=(q, k, w, first, visible), width=nk)


def call(module, inp):
    q, k, w, first, visible = inp["args"]
    orders = torch.full((q.shape[0], inp["width"]), -7, dtype=torch.int32, device=q.device)
    module.launch_orders(q, k, w, first, visible, None, 0, inp["width"], orders)
    return (orders,)

"""Indexer score kernel (Gluon, SM90) with three consumers: its bounds again, and deeper query rings.

Why: with a third consumer the kernel ran 1.18x faster at 32K (4.43 ms on an H100; BENCHMARKS.md, thirty-first
session), so what bounds it has moved. Before, without products it still took 53-59% of its time (the query ring's
waits and the ReLU-weight epilogue). The third consumer drains the ring 1.5x as fast per program, so four 16 KiB
query stages may no longer cover a TMA copy's latency; shared memory holds eight now (384 key rows: 96 KiB, plus the
ring).

- ``no_epilogue`` and ``no_product`` (wrong orders on purpose): the two bounds, as in the thirty-first session.
- ``stages6`` / ``stages8``: six / eight query stages in flight. Orders must be bitwise.
- ``relu_max``: the ReLU as one NaN-keeping max (two instructions an element instead of three); 1.05x on two
  consumers, inconclusive on three (compared across rounds only). Orders must be bitwise.

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/scores_three.py --T 32768 8192 --H 64``; offline:
``... --build-only``.
"""
import torch

MODULE = "dsv4attn.ops.indexer.gluon_hopper"
KERNEL = "_indexer_orders_gluon"

_EPI_OLD = "            acc += w_h[:, None] * gl.where(s < 0, 0.0, s)        # ReLU that keeps a NaN (maximum drops it)\n"
_PRODUCT_OLD = "            s = warpgroup_mma(ring.index(stage + z), k_t, zero, use_acc=False)\n"
_STAGES_OLD = "CONFIG = dict(STAGES=4, REGS=(160, 24))\n"
_IMPORT_OLD = "from __future__ import annotations\n"
_IMPORT_NEW = "from __future__ import annotations\nimport triton.language as tl\n"
_RELU_MAX = "            acc += w_h[:, None] * gl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL)\n"

VARIANTS = {
    "no_epilogue": [(_EPI_OLD, "            acc += s\n")],
    "no_product": [(_PRODUCT_OLD, "            s = zero + z\n")],
    "stages6": [(_STAGES_OLD, "CONFIG = dict(STAGES=6, REGS=(160, 24))\n")],
    "stages8": [(_STAGES_OLD, "CONFIG = dict(STAGES=8, REGS=(160, 24))\n")],
    "relu_max": [(_IMPORT_OLD, _IMPORT_NEW), (_EPI_OLD, _RELU_MAX)],
}
VARIANT_CONSTEXPRS = {"stages6": {"STAGES": 6}, "stages8": {"STAGES": 8}}


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

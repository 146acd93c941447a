"""Indexer score kernel (Gluon, SM90): per-head synchronisation of its consumers, two candidates.

Why: each consumer runs ``fence_async_shared()`` (``fence.proxy.async``) before every head's product. The ring's
query tiles arrive by TMA (the async proxy; the mbarrier's completion makes them visible to wgmma), so only the key
rows, written by cp.async before the partitions split, need a fence before the first product. The three-consumer
kernel spends about twice its products' tensor-core time (4.44 ms at 32K on an H100 against ~2.1 ms of products,
BENCHMARKS.md, thirty-second session); a fence per head in each of the three consumers is one candidate stall.

- ``fence_once``: the fence before the head loop. Orders must be bitwise.
- ``release``: each consumer hands a query stage back with ``gluon_common.release`` (every thread arrives itself,
  the empty barrier's count 3 x 128) instead of ``mbarrier.arrive``, which Triton lowers to a warpgroup bar.sync and
  one thread's arrive (1.02-1.06x on the warm-up teacher, twenty-seventh session). Orders must be bitwise.
- ``fence_once_release``: both.

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/scores_fence.py --T 32768 8192 --H 64``; offline:
``... --build-only``.
"""
import torch

MODULE = "dsv4attn.ops.indexer.gluon_hopper"
KERNEL = "_indexer_orders_gluon"

_LOOP_OLD = "        for h in range(n_heads):\n            stage = h % STAGES\n            w_h = gl.load("
_LOOP_NEW = ("        fence_async_shared()                 # the key rows (cp.async, before the split) for the products\n"
             "        for h in range(n_heads):\n            stage = h % STAGES\n            w_h = gl.load(")
_FENCE_OLD = "            mbarrier.wait(full.index(stage), (h // STAGES) & 1)\n            fence_async_shared()\n"
_FENCE_NEW = "            mbarrier.wait(full.index(stage), (h // STAGES) & 1)\n"

_IMPORT_OLD = "half_precision, mbarrier, mbarriers, sm90,"
_IMPORT_NEW = "half_precision, mbarrier, mbarriers, release, sm90,"
_ARRIVE_OLD = "            mbarrier.arrive(empty.index(stage))\n"
_ARRIVE_NEW = "            release(empty.index(stage))\n"
_COUNT_OLD = "        empty = mbarriers(STAGES, CONSUMERS_C)\n"
_COUNT_NEW = "        empty = mbarriers(STAGES, CONSUMERS_C * 128)\n"
_FENCE = [(_LOOP_OLD, _LOOP_NEW), (_FENCE_OLD, _FENCE_NEW)]
_RELEASE = [(_IMPORT_OLD, _IMPORT_NEW), (_ARRIVE_OLD, _ARRIVE_NEW), (_COUNT_OLD, _COUNT_NEW)]

VARIANTS = {"fence_once": _FENCE, "release": _RELEASE, "fence_once_release": _FENCE + _RELEASE}


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

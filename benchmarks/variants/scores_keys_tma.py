"""Indexer score kernel (Gluon, SM90): the key rows by TMA from the producer instead of cp.async before the split.

Why: each program first gathers its 384 key rows (96 KiB) with cp.async from the four warps that become consumer 0,
waits for them and synchronises, and only then do the partitions start: the producer cannot bring in the first
query tiles meanwhile, and with 164 KB of shared memory a program has the SM to itself, so nothing else overlaps
that prologue. Without a lowering table (one device: ``HAS_TABLE`` false) a block's keys are consecutive rows
``e0 + shift ...`` of k, so the producer can load them as three 128-row TMA boxes (rows past the end read as zeros,
as the masked gathers gave) on a barrier of their own, then stream the query tiles; each consumer waits for the keys
once, before its first head. With a table the kernel gathers as before.

- ``keys_tma``: as above. Orders must be bitwise.

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/scores_keys_tma.py --T 32768 8192 --H 64``; offline:
``... --build-only`` (the form without a table).
"""
import runpy
from pathlib import Path

import torch

MODULE = "dsv4attn.ops.indexer.gluon_hopper"
KERNEL = "_indexer_orders_gluon"

_PRODUCER_OLD = """    def _score_producer(q_desc, tb, n_heads, ring, full, empty, STAGES: gl.constexpr):
        # The query tiles of the block's heads (n_heads: 64, or 0 for a block no row sees) through the ring, one TMA
        # copy per (64 rows x 128) tile; rows past the end read as zeros.
        for h in range(n_heads):
"""
_PRODUCER_NEW = """    def _score_producer(q_desc, k_desc, k_all, k_ready, key_row, tb, n_heads, ring, full, empty,
                        HAS_TABLE: gl.constexpr, STAGES: gl.constexpr):
        # Without a table the block's key rows first (three 128-row boxes on k_ready), then the query tiles of the
        # block's heads (n_heads: 64, or 0 for a block no row sees) through the ring, one TMA copy per (64 rows x 128)
        # tile; rows past the end read as zeros.
        if not HAS_TABLE:
            if n_heads > 0:
                mbarrier.expect(k_ready.index(0), CONSUMERS_C * k_desc.block_type.nbytes)
                for i in gl.static_range(CONSUMERS_C):
                    tma_load(k_desc, [key_row + i * CONSUMER_E, 0], k_ready.index(0), k_all.index(i))
        for h in range(n_heads):
"""
_CONSUMER_SIG_OLD = """    def _score_consumer(W_, FIRST, VISIBLE, ORDERS, rows_c, width, tb, e0, n_heads, k_all, ring, full, empty,
                        W: gl.constexpr, STAGES: gl.constexpr):
"""
_CONSUMER_SIG_NEW = """    def _score_consumer(W_, FIRST, VISIBLE, ORDERS, rows_c, width, tb, e0, n_heads, k_all, k_ready, ring, full, empty,
                        W: gl.constexpr, HAS_TABLE: gl.constexpr, STAGES: gl.constexpr):
"""
_LOOP_OLD = "        w_rows = W_ + rows * HEADS_C\n        for h in range(n_heads):\n"
_LOOP_NEW = ("        w_rows = W_ + rows * HEADS_C\n"
             "        if not HAS_TABLE:\n"
             "            mbarrier.wait(k_ready.index(0), 0, pred=n_heads > 0)\n"
             "        for h in range(n_heads):\n")
_KERNEL_SIG_OLD = "    def _indexer_orders_gluon(Q_DESC, K, W_, FIRST,"
_KERNEL_SIG_NEW = "    def _indexer_orders_gluon(Q_DESC, K_DESC, K, W_, FIRST,"
_SPLIT_OLD = """        _gather_keys(K, TABLE, shift, e0, needed, k_all, HAS_TABLE)
        async_copy.commit_group()
        async_copy.wait_group(0)
        thread_barrier()
"""
_SPLIT_NEW = """        k_ready = mbarriers(1, 1)            # the producer's expect-tx arrival for the keys' three boxes
        if HAS_TABLE:
            _gather_keys(K, TABLE, shift, e0, needed, k_all, HAS_TABLE)
            async_copy.commit_group()
            async_copy.wait_group(0)
        thread_barrier()
"""
_CALLS = [(f"""            (_score_consumer, (W_, FIRST, VISIBLE, ORDERS, rows_c, width, tb, e0, n_heads, k_all, ring, full, empty,
                               gl.constexpr({w}), STAGES)),
""", f"""            (_score_consumer, (W_, FIRST, VISIBLE, ORDERS, rows_c, width, tb, e0, n_heads, k_all, k_ready, ring,
                               full, empty, gl.constexpr({w}), HAS_TABLE, STAGES)),
""") for w in range(3)]
_PRODUCER_CALL_OLD = "            (_score_producer, (Q_DESC, tb, n_heads, ring, full, empty, STAGES))],\n"
_PRODUCER_CALL_NEW = ("            (_score_producer, (Q_DESC, K_DESC, k_all, k_ready, (e0 + shift).to(gl.int32), tb, n_heads, ring,\n"
                      "                               full, empty, HAS_TABLE, STAGES))],\n")
_LAUNCH_OLD = """    _indexer_orders_gluon[grid](
        q_desc, k, w,"""
_LAUNCH_NEW = """    k_desc = TensorDescriptor.from_tensor(k, [128, HEAD_DIM], gl.NVMMASharedLayout.get_default_for(
        [128, HEAD_DIM], _GL_DTYPES[q.dtype]))
    _indexer_orders_gluon[grid](
        q_desc, k_desc, k, w,"""

VARIANTS = {"keys_tma": [(_PRODUCER_OLD, _PRODUCER_NEW), (_CONSUMER_SIG_OLD, _CONSUMER_SIG_NEW), (_LOOP_OLD, _LOOP_NEW),
                         (_KERNEL_SIG_OLD, _KERNEL_SIG_NEW), (_SPLIT_OLD, _SPLIT_NEW), *_CALLS,
                         (_PRODUCER_CALL_OLD, _PRODUCER_CALL_NEW), (_LAUNCH_OLD, _LAUNCH_NEW)]}
BUILD_CONSTEXPRS = {"HAS_TABLE": False}


def _k_desc_type():
    from triton.runtime.jit import mangle_type
    from dsv4attn.ops import gluon_common
    k = torch.empty(128, 128, dtype=torch.bfloat16)
    layout = gluon_common.gl.NVMMASharedLayout.get_default_for([128, 128], gluon_common.gl.bfloat16)
    return mangle_type(gluon_common.TensorDescriptor.from_tensor(k, [128, 128], layout))


try:
    BUILD_SIGNATURE = {"K_DESC": _k_desc_type()}
except Exception:           # no Gluon in this Triton: the GPU run needs no build signature
    BUILD_SIGNATURE = {}


# The inputs and the call of scores_fence.py (one causal document at ratio 4).
_fence = runpy.run_path(str(Path(__file__).with_name("scores_fence.py")))
inputs, call = _fence["inputs"], _fence["call"]

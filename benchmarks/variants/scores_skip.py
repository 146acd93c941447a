"""Indexer score kernel (Gluon, SM90): a consumer whose 128 entries no row of the block sees forms no products.

Why: a program covers 384 entries (three consumers of 128) from its block's first entry; on a causal document the
last entry block of every 64-row block is only partly seen, so its upper consumers multiply keys nobody reads (the
orders they would store are masked out). Counted at compress ratio 4, one document (a row t sees (t + 1) / 4
entries): of the 408 programs with products at T = 8192, 88 have an idle consumer, and idle ranges are 11.1% of all
consumer ranges; 3.0% at 32K, 1.5% at 64K, 0.8% at 128K. The three consumers share the tensor cores, so an idle
one hands its share to the other two (the gain is at most that share, at short T where the indexer trails cuDNN
most: 0.40x at 8K). The variant's idle consumer still waits for each query stage and releases it (the producer's ring
counts three releases a stage), and stores nothing (its orders would all be masked).

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/scores_skip.py --T 8192 32768 --H 64`` (orders
must be bitwise); offline: ``... --build-only``.
"""
import torch

MODULE = "dsv4attn.ops.indexer.gluon_hopper"
KERNEL = "_indexer_orders_gluon"

_LOOP_OLD = """        w_rows = W_ + rows * HEADS_C
        for h in range(n_heads):
"""
_LOOP_NEW = """        w_rows = W_ + rows * HEADS_C
        first = gl.load(FIRST + rows, mask=row_ok, other=0).to(gl.int64)
        visible = gl.load(VISIBLE + rows, mask=row_ok, other=0)
        # Entries [e0 + 128 W, e0 + 128 W + 128) that no row of the block sees (the diagonal blocks of a causal
        # document): no products; the query stages are still waited for and released (below).
        idle = gl.max(first + visible.to(gl.int64) - (e0 + W * CONSUMER_E), 0) <= 0
        n_mine = gl.where(idle, 0, n_heads)
        for h in range(n_mine):
"""
_EPILOGUE_OLD = """        # acc starts at +0.0 and the sums never give -0.0: equal scores have equal bits (see the Triton kernel).
        bits = acc.to(gl.int32, bitcast=True)
        order = gl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        order = gl.where(acc != acc, 0x7FFFFFFF, order)        # every NaN above +inf, as in the reference's sort
        first = gl.load(FIRST + rows, mask=row_ok, other=0).to(gl.int64)
        visible = gl.load(VISIBLE + rows, mask=row_ok, other=0)
"""
_EPILOGUE_NEW = """        for h in range(n_mine, n_heads):       # an idle consumer's releases
            stage = h % STAGES
            mbarrier.wait(full.index(stage), (h // STAGES) & 1)
            mbarrier.arrive(empty.index(stage))
        # acc starts at +0.0 and the sums never give -0.0: equal scores have equal bits (see the Triton kernel).
        bits = acc.to(gl.int32, bitcast=True)
        order = gl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        order = gl.where(acc != acc, 0x7FFFFFFF, order)        # every NaN above +inf, as in the reference's sort
"""

VARIANTS = {"skip_idle_consumers": [(_LOOP_OLD, _LOOP_NEW), (_EPILOGUE_OLD, _EPILOGUE_NEW)]}


def inputs(T, H, device):
    """One causal document at compress ratio 4: row t sees entries [0, (t + 1) / 4)."""
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

"""Indexer score kernel (Gluon, SM90): each consumer's 128 entries as two 64-entry halves, software-pipelined, so
that a product is always in flight while the consumer adds the other half's ReLU-weighted scores.

The shipped consumer runs, per head, one synchronous wgmma (64 rows x 128 entries x 128) and then the ReLU-weight
sum over its 64 x 128 fp32 tile: its tensor cores wait during the sum (the two consumers overlap only as far as their
timing drifts apart). A second full accumulator spilled. Here the scores of head h are formed as two N = 64
products: the right half of h is in flight while the left half is summed, the left half of h + 1 while the right
half of h is summed (two 32-register accumulators and two 32-register score tiles: the same 128 registers as the
shipped tile pair). Each score element sees the same operations in the same order, so the orders must be bitwise
equal to the shipped kernel's.

Time on the GPU (one causal document of T rows, T / 4 compressed entries; ``--H`` is ignored):
``python benchmarks/kernel_variants.py benchmarks/variants/scores_pipelined.py --T 32768 8192``.
"""
import torch

MODULE = "dsv4attn.ops.indexer.gluon_hopper"
KERNEL = "_indexer_orders_gluon"

_OLD = '''        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF_E, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        zero = gl.zeros([BLOCK_T_C, HALF_E], gl.float32, layout=s_layout)
        acc = gl.zeros([BLOCK_T_C, HALF_E], gl.float32, layout=s_layout)
        rows = (tb * BLOCK_T_C + gl.arange(0, BLOCK_T_C, layout=row_layout)).to(gl.int64)
        row_ok = rows < rows_c
        w_rows = W_ + rows * HEADS_C
        for h in range(n_heads):
            stage = h % STAGES
            w_h = gl.load(w_rows + h, mask=row_ok, other=0.0)
            # A head-dependent zero index on every shared-memory operand keeps the wgmma descriptors inside the
            # loop (see the attention forward: hoisted, they were spilled); n_heads is a runtime value, so it is
            # not folded to a constant.
            z = (h + 1) // (n_heads + 1)
            mbarrier.wait(full.index(stage), (h // STAGES) & 1)
            fence_async_shared()
            k_t = k_all.index(z).slice(W * HALF_E, HALF_E, dim=0).permute((1, 0))   # (128 dims, 128 entries)
            s = warpgroup_mma(ring.index(stage + z), k_t, zero, use_acc=False)
            mbarrier.arrive(empty.index(stage))
            acc += w_h[:, None] * gl.where(s < 0, 0.0, s)        # ReLU that keeps a NaN (maximum drops it)
        # acc starts at +0.0 and the sums never give -0.0: equal scores have equal bits (see the Triton kernel).
        bits = acc.to(gl.int32, bitcast=True)
        order = gl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        order = gl.where(acc != acc, 0x7FFFFFFF, order)        # every NaN above +inf, as in the reference's sort
        first = gl.load(FIRST + rows, mask=row_ok, other=0).to(gl.int64)
        visible = gl.load(VISIBLE + rows, mask=row_ok, other=0).to(gl.int64)
        entries = e0 + W * HALF_E + gl.arange(0, HALF_E, layout=gl.SliceLayout(0, s_layout)).to(gl.int64)
        j = entries[None, :] - first[:, None]
        valid = (j >= 0) & (j < visible[:, None]) & row_ok[:, None]
        gl.store(ORDERS + rows[:, None] * width + j, order, mask=valid)
'''

_NEW = '''        QUARTER: gl.constexpr = HALF_E // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, QUARTER, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        zero = gl.zeros([BLOCK_T_C, QUARTER], gl.float32, layout=s_layout)
        acc_a = gl.zeros([BLOCK_T_C, QUARTER], gl.float32, layout=s_layout)
        acc_b = gl.zeros([BLOCK_T_C, QUARTER], gl.float32, layout=s_layout)
        rows = (tb * BLOCK_T_C + gl.arange(0, BLOCK_T_C, layout=row_layout)).to(gl.int64)
        row_ok = rows < rows_c
        w_rows = W_ + rows * HEADS_C
        s_a = zero
        if n_heads > 0:
            mbarrier.wait(full.index(0), 0)
            fence_async_shared()
            s_a = warpgroup_mma(ring.index(0), k_all.index(0).slice(W * HALF_E, QUARTER, dim=0).permute((1, 0)),
                                zero, use_acc=False)
        for h in range(n_heads):
            stage = h % STAGES
            w_h = gl.load(w_rows + h, mask=row_ok, other=0.0)
            z = (h + 1) // (n_heads + 1)
            k_b = k_all.index(z).slice(W * HALF_E + QUARTER, QUARTER, dim=0).permute((1, 0))
            s_b = warpgroup_mma(ring.index(stage + z), k_b, zero, use_acc=False, is_async=True)
            acc_a += w_h[:, None] * gl.where(s_a < 0, 0.0, s_a)     # under the right half's product
            s_b = warpgroup_mma_wait(0, deps=[s_b])
            mbarrier.arrive(empty.index(stage))
            if h + 1 < n_heads:
                nxt = (h + 1) % STAGES
                mbarrier.wait(full.index(nxt), ((h + 1) // STAGES) & 1)
                fence_async_shared()
                k_a = k_all.index(z).slice(W * HALF_E, QUARTER, dim=0).permute((1, 0))
                s_a = warpgroup_mma(ring.index(nxt + z), k_a, zero, use_acc=False, is_async=True)
                acc_b += w_h[:, None] * gl.where(s_b < 0, 0.0, s_b)     # under head h + 1's left half
                s_a = warpgroup_mma_wait(0, deps=[s_a])
            else:
                acc_b += w_h[:, None] * gl.where(s_b < 0, 0.0, s_b)
        first = gl.load(FIRST + rows, mask=row_ok, other=0).to(gl.int64)
        visible = gl.load(VISIBLE + rows, mask=row_ok, other=0).to(gl.int64)
        _store_orders(acc_a, ORDERS, rows, row_ok, first, visible, width, e0 + W * HALF_E)
        _store_orders(acc_b, ORDERS, rows, row_ok, first, visible, width, e0 + W * HALF_E + QUARTER)

    @gluon.jit
    def _store_orders(acc, ORDERS, rows, row_ok, first, visible, width, e_start):
        # acc starts at +0.0 and the sums never give -0.0: equal scores have equal bits (see the Triton kernel).
        bits = acc.to(gl.int32, bitcast=True)
        order = gl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        order = gl.where(acc != acc, 0x7FFFFFFF, order)        # every NaN above +inf, as in the reference's sort
        entries = e_start + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout)).to(gl.int64)
        j = entries[None, :] - first[:, None]
        valid = (j >= 0) & (j < visible[:, None]) & row_ok[:, None]
        gl.store(ORDERS + rows[:, None] * width + j, order, mask=valid)
'''

_IMPORT = "mbarrier, mbarriers, sm90, thread_barrier, tma_load, warpgroup_mma)"
VARIANTS = {"pipelined_halves": [(_OLD, _NEW), (_IMPORT, _IMPORT[:-1] + ", warpgroup_mma_wait)")]}


def inputs(T, H, device):
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

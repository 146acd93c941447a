"""Indexer score kernel (Gluon, SM90): what bounds it, and a third consumer.

Why: the score kernel runs at ~0.55 of the matmul peak (5.1-5.2 ms at 32K, 80.7 at 128K; it is ~30% of the CSA
layer at 256K, whose target it misses by 5.7%). Each consumer's head is a synchronous 64 x 128 x 128 product, then a
ReLU-weighted add over its 64 x 128 fp32 tile; only the two consumers' interleaving overlaps a product with an
epilogue. Which of the two bounds the kernel is not known.

- ``no_epilogue`` (wrong orders on purpose): ``acc += s`` instead of ``acc += w_h * relu(s)`` (one add, not a
  compare, select and fma per element; the weights' loads stay). Its time is the kernel with a third of the epilogue.
- ``relu_max``: the ReLU as one NaN-keeping maximum (``max.NaN.f32``) instead of a compare and a select: two
  instructions an element instead of three. Orders must be bitwise (NaN stays NaN; -0.0 may become +0.0, which adds
  nothing to the sum either way).
- ``no_product`` (wrong orders on purpose): the product replaced by a copy of the zero tile; the ring, the waits and
  the epilogue stay. Its time is what the kernel costs without its tensor cores.
- ``three_consumers``: 384 entries a program, a third consumer warpgroup owning the last 128 (the query tile's
  stage released by three arrivals); two products can queue while the third consumer sums; the orders' column
  offsets as int32 from per-row pointers (as int64 they spilled at 160 registers). Orders must be bitwise.
- ``three_relu_max``: both.

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/scores_bounds.py --T 32768 8192 --H 64`` (one causal
document, ``first`` 0, ``visible`` t / 4: the CSA layer's top-k at ratio 4); offline: ``... --build-only``.
"""
import torch

MODULE = "dsv4attn.ops.indexer.gluon_hopper"
KERNEL = "_indexer_orders_gluon"

_EPI_OLD = "            acc += w_h[:, None] * gl.where(s < 0, 0.0, s)        # ReLU that keeps a NaN (maximum drops it)\n"
_PRODUCT_OLD = "            s = warpgroup_mma(ring.index(stage + z), k_t, zero, use_acc=False)\n"

# three_consumers: BLOCK_E 256 -> 384 (the grid and e0's stride), the gather and the keys' buffer over 384 rows, the
# ring's stages released by 3 arrivals, a third consumer (REGS gives every worker consumer its registers).
_CONSTS_OLD = "BLOCK_T, BLOCK_E, HEADS, HEAD_DIM = 64, 256, 64, 128\n"
_CONSTS_NEW = "BLOCK_T, BLOCK_E, HEADS, HEAD_DIM = 64, 384, 64, 128\n"
_HALF_OLD = "    HALF_E = gl.constexpr(BLOCK_E // 2)\n"
_HALF_NEW = "    HALF_E = gl.constexpr(128)\n    BLOCK_E_C = gl.constexpr(BLOCK_E)\n"
_GATHER_OLD = "        for r in gl.static_range(0, 2 * HALF_E, 16):\n"
_GATHER_NEW = "        for r in gl.static_range(0, BLOCK_E_C, 16):\n"
_ASYNC_OLD = "            async_load(k_smem.slice(r, 16, dim=0), K + key_rows[:, None] + cols[None, :], mask=ok[:, None])\n"
_ASYNC_NEW = ("            async_load(k_smem.index(r // HALF_E).slice(r % HALF_E, 16, dim=0), K + key_rows[:, None] + "
              "cols[None, :],\n                       mask=ok[:, None])\n")
_KT_OLD = "            k_t = k_all.index(z).slice(W * HALF_E, HALF_E, dim=0).permute((1, 0))   # (128 dims, 128 entries)\n"
_KT_NEW = "            k_t = k_all.index(W + z).permute((1, 0))\n"
_CALL_OLD = "        _gather_keys(K, TABLE, shift, e0, needed, k_all.index(0), HAS_TABLE)\n"
_CALL_NEW = "        _gather_keys(K, TABLE, shift, e0, needed, k_all, HAS_TABLE)\n"
_E0_OLD = "    e0 = gl.load(FIRST + tb * BLOCK_T_C).to(gl.int64) + eb * (2 * HALF_E)\n"
_E0_NEW = "    e0 = gl.load(FIRST + tb * BLOCK_T_C).to(gl.int64) + eb * BLOCK_E_C\n"
_NEEDED_OLD = "        needed = gl.minimum(gl.maximum(gl.max(ends, 0) - e0, 0), 2 * HALF_E)\n"
_NEEDED_NEW = "        needed = gl.minimum(gl.maximum(gl.max(ends, 0) - e0, 0), BLOCK_E_C)\n"
_KALL_OLD = """        k_all = gl.allocate_shared_memory(dtype, [1, 2 * HALF_E, HEAD_DIM_C],
                                          gl.NVMMASharedLayout.get_default_for([2 * HALF_E, HEAD_DIM_C], dtype))
"""
_KALL_NEW = """        k_all = gl.allocate_shared_memory(dtype, [3, HALF_E, HEAD_DIM_C],
                                          gl.NVMMASharedLayout.get_default_for([HALF_E, HEAD_DIM_C], dtype))
"""
_EMPTY_OLD = "        empty = mbarriers(STAGES, 2)\n"
_EMPTY_NEW = "        empty = mbarriers(STAGES, 3)\n"
_WS_OLD = """            (_score_consumer, (W_, FIRST, VISIBLE, ORDERS, rows_c, width, tb, e0, n_heads, k_all, ring, full, empty,
                               gl.constexpr(1), STAGES)),
            (_score_producer, (Q_DESC, tb, n_heads, ring, full, empty, STAGES))],
            [4, 1], [REGS[0], REGS[1]])
"""
_WS_NEW = """            (_score_consumer, (W_, FIRST, VISIBLE, ORDERS, rows_c, width, tb, e0, n_heads, k_all, ring, full, empty,
                               gl.constexpr(1), STAGES)),
            (_score_consumer, (W_, FIRST, VISIBLE, ORDERS, rows_c, width, tb, e0, n_heads, k_all, ring, full, empty,
                               gl.constexpr(2), STAGES)),
            (_score_producer, (Q_DESC, tb, n_heads, ring, full, empty, STAGES))],
            [4, 4, 1], [REGS[0], REGS[0], REGS[1]])
"""
_REGS_OLD = "CONFIG = dict(STAGES=4, REGS=(216, 24))\n"


# The epilogue's column offsets as int32 from per-row base pointers (int64 per element spilled at 160 registers).
_STORE_OLD = """        first = gl.load(FIRST + rows, mask=row_ok, other=0).to(gl.int64)
        visible = gl.load(VISIBLE + rows, mask=row_ok, other=0).to(gl.int64)
        entries = e0 + W * HALF_E + gl.arange(0, HALF_E, layout=gl.SliceLayout(0, s_layout)).to(gl.int64)
        j = entries[None, :] - first[:, None]
        valid = (j >= 0) & (j < visible[:, None]) & row_ok[:, None]
        gl.store(ORDERS + rows[:, None] * width + j, order, mask=valid)
"""
_STORE_NEW = """        first = gl.load(FIRST + rows, mask=row_ok, other=0).to(gl.int64)
        visible = gl.load(VISIBLE + rows, mask=row_ok, other=0)
        j0 = (e0 + W * HALF_E - first).to(gl.int32)
        j = j0[:, None] + gl.arange(0, HALF_E, layout=gl.SliceLayout(0, s_layout))[None, :]
        valid = (j >= 0) & (j < visible[:, None]) & row_ok[:, None]
        gl.store((ORDERS + rows * width)[:, None] + j, order, mask=valid)
"""


def _three(regs):
    return [(_CONSTS_OLD, _CONSTS_NEW), (_HALF_OLD, _HALF_NEW), (_GATHER_OLD, _GATHER_NEW), (_ASYNC_OLD, _ASYNC_NEW),
            (_KT_OLD, _KT_NEW), (_CALL_OLD, _CALL_NEW), (_E0_OLD, _E0_NEW),
            (_NEEDED_OLD, _NEEDED_NEW), (_KALL_OLD, _KALL_NEW), (_EMPTY_OLD, _EMPTY_NEW), (_WS_OLD, _WS_NEW),
            (_REGS_OLD, f"CONFIG = dict(STAGES=4, REGS=({regs}, 24))\n")]


_IMPORT_OLD = "from __future__ import annotations\n"
_IMPORT_NEW = "from __future__ import annotations\nimport triton.language as tl\n"

_RELU_MAX = "            acc += w_h[:, None] * gl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL)\n"

VARIANTS = {
    "relu_max": [(_IMPORT_OLD, _IMPORT_NEW), (_EPI_OLD, _RELU_MAX)],
    "no_epilogue": [(_EPI_OLD, "            acc += s\n")],
    "no_product": [(_PRODUCT_OLD, "            s = zero + z\n")],
    "three_consumers": _three(160) + [(_STORE_OLD, _STORE_NEW)],
    "three_relu_max": _three(160) + [(_STORE_OLD, _STORE_NEW), (_IMPORT_OLD, _IMPORT_NEW), (_EPI_OLD, _RELU_MAX)],
}
# 3 x 128 x 160 + 128 x 24 registers: the most the three consumers can share. With the shipped epilogue ptxas spilled
# 780 bytes (Triton 3.6.0), all after the head loop (SASS: the orders' int64 offsets); int32 offsets: none.
VARIANT_CONSTEXPRS = {"three_consumers": {"REGS": (160, 24)}, "three_relu_max": {"REGS": (160, 24)}}


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

"""Indexer score kernel (Gluon, SM90): fewer entries a program, against the last wave's idle SMs at short T.

Why: a program takes 64 rows x 384 entries (three consumers of 128) and fills an SM (160 KiB of shared memory), so
programs run in waves of 132 on an H100. One causal document at ratio 4 gives 408 programs with products at
T = 8192: 3.09 waves, the fourth nearly empty but as long as the others. Register tensors and shared-memory
tiles take power-of-two shapes, so a consumer's entries go from 128 to 64:

- ``e64``: three consumers of 64 entries (192 a program): 748 programs at 8K (5.67 waves), 2860 at 16K (21.7),
  11180 at 32K (84.7), against 408 / 1496 / 5720 (3.09 / 11.3 / 43.3 waves).
- ``e64x4``: four consumers of 64 (256 a program): 576 / 2176 / 8448 programs (4.36 / 16.5 / 64.0 waves). Triton
  pads the one-warp producer to a warpgroup (640 threads), so the worker consumers take 112 registers a thread and
  the default partition (consumer 0) what is left, 120 (the PTX's setmaxnreg; with 120 for the workers it had 96).

Counted in whole waves times a program's entries, the work falls 1.33x / 1.20x at 8K, 1.09x / 1.06x at 16K and
1.035x / 1.03x at 32K, if a product of N = 64 entries runs at N = 128's rate per FLOP: the open question, since
each head's query tile (the product's A operand) is then read from shared memory for half the FLOPs (the
thirty-second session's two consumers of 128 ran 1.18x slower per FLOP than three). Shared memory 115 / 131 KB
(shipped 164 KB); no spills on Triton 3.6.0, 3.7.1, 3.9.0 (offline). The orders must stay bitwise (each (row, entry)
is formed alone).

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/scores_entries.py --T 8192 16384 32768 --H 64``;
offline: ``... --build-only``.
"""
import torch

MODULE = "dsv4attn.ops.indexer.gluon_hopper"
KERNEL = "_indexer_orders_gluon"

_SIZES = "BLOCK_T, BLOCK_E, HEADS, HEAD_DIM = 64, 128 * CONSUMERS, 64, 128"
_CONSUMER = "    CONSUMER_E = gl.constexpr(128)              # entries per consumer"


def _entries(n: int):
    return [(_SIZES, _SIZES.replace("128 * CONSUMERS", f"{n} * CONSUMERS")),
            (_CONSUMER, _CONSUMER.replace("(128)", f"({n})"))]


# A fourth consumer: one more partition; workers at 112 registers a thread (the padded producer warpgroup at 24),
# the default partition gets the rest.
_THIRD = """            (_score_consumer, (W_, FIRST, VISIBLE, ORDERS, rows_c, width, tb, e0, n_heads, k_all, ring, full, empty,
                               gl.constexpr(2), STAGES)),
"""
_FOUR = [("CONSUMERS = 3\n", "CONSUMERS = 4\n"),
         ("CONFIG = dict(STAGES=4, REGS=(160, 24))", "CONFIG = dict(STAGES=4, REGS=(112, 24))"),
         (_THIRD, _THIRD + _THIRD.replace("gl.constexpr(2)", "gl.constexpr(3)")),
         ("[4, 4, 1], [REGS[0], REGS[0], REGS[1]])", "[4, 4, 4, 1], [REGS[0], REGS[0], REGS[0], REGS[1]])")]

VARIANTS = {"e64": _entries(64), "e64x4": _entries(64) + _FOUR}
VARIANT_CONSTEXPRS = {"e64x4": {"REGS": (112, 24)}}        # as its launcher passes them


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

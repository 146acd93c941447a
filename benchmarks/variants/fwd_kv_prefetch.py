"""Gluon attention forward: the producer asks L2 for a later block's kv rows before that block's stage is free.

The eleventh session measured that the gather sets the forward's pace (a quarter of its bytes closed the gap to
FlashMLA) although L2 is not saturated (ncu: 39.8% of L2 throughput, hit rate 78.9% against FlashMLA's 82.0%), and
read the limit as the latency from a stage's release to its refilled rows. FlashMLA's gathers carry 256-byte L2
prefetch hints, which Gluon's cp.async cannot express. Here the producer, right after issuing block b's copies,
issues one bulk L2 prefetch (``cp.async.bulk.prefetch.L2.global``, 512 bytes: half a kv row at D = 512, bf16) per
thread for the rows of block b + AHEAD, so that the rows missing from L2 are on their way while the producer waits
for the stage. A prefetch changes no value: outputs must equal the shipped kernel's bitwise. Variants: AHEAD = 1
and 2. The helper is the shipped ``gluon_common.ring_gather`` with the prefetch added (generated from its text).

Build offline: ``python benchmarks/kernel_variants.py benchmarks/variants/fwd_kv_prefetch.py --build-only``.
Time on the GPU: ``... --T 32768 --H 64 128 --rounds 5 --flashmla .peers/flashmla`` (bwd_kv_prefetch.py: the same for
the backward, whose one-stage ring waits for every refill).
"""
from pathlib import Path

MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper"
_COMMON = (Path(__file__).resolve().parents[2] / "dsv4attn" / "ops" / "gluon_common.py").read_text()

_PREFETCH = '''    @gluon.jit
    def _prefetch_block(KV, IDX, row_base, b, K, BLOCK_N: gl.constexpr, D: gl.constexpr):
        # One bulk L2 prefetch per half kv row of block b (one per producer thread at BLOCK_N = 64; D = 512, bf16).
        pf: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        k = gl.arange(0, 2 * BLOCK_N, layout=pf)
        n = b * BLOCK_N + k // 2
        idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
        ptrs = KV + gl.where(idx >= 0, idx, 0).to(gl.int64) * D + (k % 2) * (D // 2)
        gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ge.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], 512; mov.u32 $0, 0; }",
            "=r,l,r", [ptrs, idx], dtype=gl.int32, is_pure=False, pack=1)

'''


def ring_gather_text(ahead: int, prefix: str) -> str:
    """gluon_common.ring_gather as ``_ring_gather_pf`` with the prefetches, its helpers named through ``prefix``."""
    start = _COMMON.index("    @gluon.jit\n    def ring_gather(")
    end = _COMMON.index("        async_copy.wait_group(0)\n", start) + len("        async_copy.wait_group(0)\n")
    text = _COMMON[start:end].replace("def ring_gather(", "def _ring_gather_pf(")
    for name in ("slot_rows(", "gather_rows(", "async_copy.", "mbarrier."):
        text = text.replace(name, prefix + name)
    loop = "        for b in range(nb):\n"
    first = "".join(f"        if {a} < nb:\n            _prefetch_block(KV, IDX, row_base, {a}, K, BLOCK_N, D)\n"
                    for a in range(1, ahead))
    text = text.replace(loop, first + loop, 1)
    commit = f"            {prefix}async_copy.commit_group()\n"
    assert text.count(commit) == 1
    text = text.replace(commit, commit + f"            if b + {ahead} < nb:\n"
                        f"                _prefetch_block(KV, IDX, row_base, b + {ahead}, K, BLOCK_N, D)\n")
    return _PREFETCH + text + "\n"


def changes(ahead: int, anchor: str, call_old: str, prefix: str):
    return [(anchor, ring_gather_text(ahead, prefix) + anchor), (call_old, call_old.replace("ring_gather(",
                                                                                         "_ring_gather_pf("))]


_ANCHOR = "    @gluon.jit\n    def _pp_producer("
_CALL = "        ring_gather(KV, IDX, K, nb, t, ring, full, empty, D, BLOCK_N, STAGES)\n"
_IMPORT = ("from ..index_sets import row_ends\n", "from .. import gluon_common\nfrom ..index_sets import row_ends\n")
VARIANTS = {f"kv_prefetch_{a}": [_IMPORT] + changes(a, _ANCHOR, _CALL, "gluon_common.") for a in (1, 2)}

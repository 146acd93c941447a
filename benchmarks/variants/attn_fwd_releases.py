# Forward kernel variants for benchmarks/kernel_variants.py: fewer warpgroup barriers (per-thread releases of the
# ring stage and P buffer; one gather call per block).
MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper"
KERNEL = "_sparse_attn_fwd_gluon"

# Per-thread releases of the ring stage and the P buffer: cp.async.mbarrier.arrive.noinc by all 128 threads of each
# consumer (counts 2 -> 256) instead of a warpgroup bar.sync + one elected thread's mbarrier.arrive per release.
_NOINC = [
    ("                mbarrier.arrive(pfree.index(b % 2))\n                mbarrier.arrive(empty.index(b % STAGES))\n",
     "                async_copy.mbarrier_arrive(pfree.index(b % 2), increment_count=False)\n"
     "                async_copy.mbarrier_arrive(empty.index(b % STAGES), increment_count=False)\n"),
    ("            mbarrier.arrive(pfree.index(c % 2))\n            mbarrier.arrive(empty.index(c_stage))\n",
     "            async_copy.mbarrier_arrive(pfree.index(c % 2), increment_count=False)\n"
     "            async_copy.mbarrier_arrive(empty.index(c_stage), increment_count=False)\n"),
    ("            mbarrier.arrive(pfree.index(last % 2))\n            mbarrier.arrive(empty.index(last % STAGES))\n",
     "            async_copy.mbarrier_arrive(pfree.index(last % 2), increment_count=False)\n"
     "            async_copy.mbarrier_arrive(empty.index(last % STAGES), increment_count=False)\n"),
    ("        empty = mbarriers(STAGES, 2)           # both consumers done with the stage\n",
     "        empty = mbarriers(STAGES, 256)\n"),
    ("        pfree = mbarriers(2, 2)\n", "        pfree = mbarriers(2, 256)\n"),
]

# The producer's block gathered by one cp.async call over its 64 rows instead of four 16-row calls: Triton 3.6 and
# 3.7 put a warpgroup bar.sync before every call (PTX), so one call per block leaves one barrier instead of four
# (no spills at the producer's 40 registers, offline ptxas).
_RING = '''
    @gluon.jit
    def _ring_gather_whole(KV, IDX, K, t, ring, full, empty, D: gl.constexpr, BLOCK_N: gl.constexpr,
                           STAGES: gl.constexpr):
        io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        n_layout: gl.constexpr = gl.SliceLayout(1, io)
        row_base = t * K
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        n = gl.arange(0, BLOCK_N, layout=n_layout)
        idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
        for b in range(gl.cdiv(K, BLOCK_N)):
            stage = b % STAGES
            mbarrier.wait(empty.index(stage), ((b // STAGES) + 1) & 1, pred=b >= STAGES)
            ok = idx >= 0
            rows = gl.where(ok, idx, 0).to(gl.int64) * D
            async_load(ring.index(stage), KV + rows[:, None] + cols[None, :], mask=ok[:, None])
            async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
            async_copy.commit_group()
            n = (b + 1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=n_layout)
            idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
        async_copy.wait_group(0)

    @gluon.jit
    def _pp_producer('''
_ONE = [
    ("                            mbarrier, mbarriers, program_row, ring_gather, sm90, store_heads, warpgroup_mma,\n",
     "                            mbarrier, mbarriers, program_row, ring_gather, sm90, store_heads, warpgroup_mma,\n"
     "                            async_load,\n"),
    ("\n    @gluon.jit\n    def _pp_producer(", _RING),
    ("        ring_gather(KV, IDX, K, t, ring, full, empty, D, BLOCK_N, STAGES)\n\n    @gluon.jit\n    def _pp_publish",
     "        _ring_gather_whole(KV, IDX, K, t, ring, full, empty, D, BLOCK_N, STAGES)\n\n    @gluon.jit\n"
     "    def _pp_publish"),
]

VARIANTS = {
    "noinc_releases": _NOINC,
    "one_gather_per_block": _ONE,
    "one_gather_per_block+noinc_releases": _ONE + _NOINC,
}

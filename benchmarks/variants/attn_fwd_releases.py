# Forward kernel variants for benchmarks/kernel_variants.py: per-thread releases of the ring stage and P buffer.
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

VARIANTS = {
    "noinc_releases": _NOINC,
}

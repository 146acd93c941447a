"""The attention forward's consumers release their ring stage without a warpgroup barrier.

Hypothesis (BENCHMARKS.md, eleventh session's ncu profile, twenty-third session's open question): ours stalls 1.89
cycles per issued instruction on barriers against FlashMLA's 1.43. Triton lowers ``mbarrier.arrive`` to a
``bar.sync`` of the warpgroup and one thread's arrive (PTX of the sm_90 build: two back-to-back bar.sync / arrive
pairs after every P V, pfree then empty). The stage's release only orders reads: the ring stage was read by a
wgmma that each thread has already waited for, so every thread may arrive for itself, with no barrier. Gluon has no
barrier-free thread arrive, but ``async_copy.mbarrier_arrive(bar, increment_count=False)``
(``cp.async.mbarrier.arrive.noinc``) is one: it arrives once the thread's earlier cp.async are done, and consumers
issue none. ``empty`` then counts 128 arrivals per consumer (256). ``pready`` keeps its barrier (it publishes P and
the row statistics), and so does ``pfree``: it also releases the statistics, which the other consumer reads with
plain shared-memory loads, and this arrive has no release semantics (a review found that hazard in a first version
that released P per thread too).

    python benchmarks/kernel_variants.py benchmarks/variants/fwd_release_per_thread.py --build-only
    python benchmarks/kernel_variants.py benchmarks/variants/fwd_release_per_thread.py --T 32768 8192 --H 64 128 \
        --flashmla .peers/flashmla --rounds 7
"""

_PAIRS = [
    ("                mbarrier.arrive(empty.index(b % STAGES))\n",
     "                async_copy.mbarrier_arrive(empty.index(b % STAGES), increment_count=False)\n"),
    ("            mbarrier.arrive(empty.index(c_stage))\n",
     "            async_copy.mbarrier_arrive(empty.index(c_stage), increment_count=False)\n"),
    ("            mbarrier.arrive(empty.index(last % STAGES))\n",
     "            async_copy.mbarrier_arrive(empty.index(last % STAGES), increment_count=False)\n"),
    ("empty = mbarriers(STAGES, 2)           # both consumers done with the stage",
     "empty = mbarriers(STAGES, 256)         # every thread of both consumers done with the stage"),
]

VARIANTS = {
    "stage released per thread": _PAIRS,
}

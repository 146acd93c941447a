"""Attention forward (Gluon, SM90): the ping-pong's P hand-over through a hardware named barrier, not an mbarrier.

Why: the owner of a block publishes its P and row statistics with ``mbarrier.arrive(pready)`` (Triton puts a
warpgroup ``bar.sync`` before the one thread's arrive) and the other consumer waits with an mbarrier try-wait loop
plus a fence. FlashMLA's SM90 sparse prefill hands its P over with named barriers: the writer's threads
``bar.arrive`` (no wait), the reader's ``bar.sync`` on the same id with count 256, so each side pays one barrier
instruction and the writer never blocks. The eleventh session's profile found extra barrier and long-scoreboard
stalls around the mbarrier waits (BENCHMARKS.md). Ids 4 and 5 (one per P buffer): Triton uses 0, 1 and one per
partition (2, 3 here). The pairing holds because the owner publishes block c + 2 (same id) only after taking over
block c + 1, which the other consumer publishes after its own sync on block c.

- ``named``: as above; the writer keeps its ``fence.proxy.async`` before the arrive (P is read by wgmma), the reader
  keeps its fence after the ring stage's wait. Outputs must be bitwise.

GPU (a wrong pairing deadlocks: run it alone under ``timeout``): ``timeout 120 python benchmarks/kernel_variants.py
benchmarks/variants/fwd_named_handover.py --T 32768 8192 --H 64 128 --flashmla .peers/flashmla --rounds 7``.
"""

_HELPERS = '''    @gluon.jit
    def _named_arrive(bar_id):
        # Every thread of the calling warpgroup arrives on named barrier bar_id (count 256) without waiting.
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        ids = gl.full([128], 0, gl.int32, layout=one) + bar_id
        gl.inline_asm_elementwise("bar.arrive $1, 256;\\n mov.b32 $0, 0;", "=r,r", [ids], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _named_sync(bar_id):
        # Every thread of the calling warpgroup waits on named barrier bar_id (count 256) for the other's arrive.
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        ids = gl.full([128], 0, gl.int32, layout=one) + bar_id
        gl.inline_asm_elementwise("bar.sync $1, 256;\\n mov.b32 $0, 0;", "=r,r", [ids], dtype=gl.int32,
                                  is_pure=False, pack=1)

'''
_PUBLISH = "    @gluon.jit\n    def _pp_publish("
_ARRIVE_OLD = "        fence_async_shared()\n        mbarrier.arrive(pready.index(half))\n"
_ARRIVE_NEW = "        fence_async_shared()\n        _named_arrive(4 + half)\n"
_WAIT_OLD = "        mbarrier.wait(pready.index(b % 2), (b // 2) & 1)\n"
_WAIT_NEW = "        _named_sync(4 + b % 2)\n"

VARIANTS = {"named": [(_PUBLISH, _HELPERS + _PUBLISH), (_ARRIVE_OLD, _ARRIVE_NEW), (_WAIT_OLD, _WAIT_NEW)]}

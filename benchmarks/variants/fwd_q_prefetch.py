"""Gluon attention forward: the producer prefetches into L2 the q rows of a program that starts later.

Each program's prologue reads its 64 heads of q (64 KiB) from HBM: q is read once (2 GiB at T = 32K, H = 64), so
none of it is in L2, and "producer skips q" made the kernel 6% faster (BENCHMARKS.md, eleventh session). Programs
run in row order, about one per SM at a time, so the program AHEAD rows further starts about one program-duration
later on some SM; a prefetch (``prefetch.global.L2::evict_last``, 4 lines of 128 bytes per producer thread) issued
at this program's start should make that q an L2 hit. Cost: AHEAD x 64 KiB of L2 held for q (8.4 MB at 132), beside
the kv rows the gathers reuse. Variants: AHEAD = 132 (one wave of programs on the H200) and 264. Outputs must equal
the shipped kernel's bitwise (a prefetch changes no value). Built offline (sm_90, Triton 3.6.0 / 3.7.1 / 3.9.0: no
spills, 4 prefetches per producer thread); not timed yet:
``python benchmarks/kernel_variants.py benchmarks/variants/fwd_q_prefetch.py --T 32768 --H 64 128 --flashmla ...``.
"""
OLD = """    def _fwd_producer(Q, KV, IDX, NEND, H, K, t, hb, q_smem, ring, full, empty, D: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
"""
NEW = OLD + """        pf: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        lines = gl.arange(0, BLOCK_H_C * D // 64, layout=pf)          # 128-byte lines of the 64 heads' q rows
        rows = gl.num_programs(0) // (H // BLOCK_H_C)
        t2 = t + AHEAD
        ptrs = Q + (t2 * H + hb * BLOCK_H_C) * D + lines.to(gl.int64) * 64
        live = gl.zeros_like(lines) + (t2 < rows).to(gl.int32)
        gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [ptrs, live], dtype=gl.int32, is_pure=False, pack=1)
"""
VARIANTS = {f"ahead_{n}": [(OLD, NEW.replace("AHEAD", str(n)))] for n in (132, 264)}

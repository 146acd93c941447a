"""Attention forward (Gluon, SM90) taking the raw query: its per-head RMSNorm and RoPE done inside the kernel, a probe
of what that costs the forward.

Why: the layer forms q = RoPE(RMSNorm(q_b_proj(qr))) in its own pass over (T, H, D) (``qnorm_rope``: 2 GiB read and
2 GiB written at T = 32K in the Flash geometry, ~1.2 ms on an H100 at its bandwidth), and the attention then reads q
again. The kernel loads q once per (row, 64-head block) into shared memory anyway, so the normalisation could happen
there, leaving the pass out; with the backward doing the same (and the RMSNorm's backward in its dq epilogue) the
q-norm + RoPE column of the CSA layer (1.9 / 4.8 ms fwd / fwd + bwd, H100, fortieth session) would mostly go. What
is not known is the forward's cost: this measures it.

- ``qnorm_producer``: the producer copies the raw q as now, issues the ring's first STAGES blocks, then waits for
  its q copies, normalises the 64 heads in shared memory (eight heads a step, a column quarter of 8 channels a
  thread at a time, each read twice;
  rstd = 1 / sqrt(mean(x^2) + eps) in fp32, the last 2 * ROPE channels rotated by +angle with the output rotation's
  own cos / sin tables, one rounding to bf16), fences, and arrives on a ``qready`` barrier that both consumers wait
  for before their first product; then the rest of the ring. So the normalisation overlaps the first blocks' gathers.

The outputs differ from the shipped kernel's by design (that one is handed the same tensor as an already normalised
q); the call here checks the variant against the shipped kernel fed ``qnorm_rope(q)`` on the side, printed as the
largest difference (a rounding-level one means the in-kernel normalisation is right). Timed: shipped kernel on q
against the variant on q (the shipped layer would add the ``qnorm_rope`` pass: ``benchmarks/qnorm_rope.py`` times it).

``qnorm_producer_r56``: the same with 56 producer registers (the worker consumer 200, from 216 / 40).
``qnorm_consumers``: the consumers do it instead, each 32 heads (whole rows, 32 channels a thread) once q has
landed with block 0, then meet on ``qready`` before their first product: in the critical path, but no spills.

Offline sm_90 builds (ROPE = 32, the Flash geometry's rotation), spill stores / loads in bytes: shipped 0/0 on
Triton 3.6.0 and 3.7.1, 12/44 on 3.9.0; ``qnorm_producer`` 168/160, 148/84, 184/216; ``_r56`` 84/72, 84/72, 188/212.
More producer registers than 56 spilled more (the consumers' share shrinks: 160/108 at (192, 72) on 3.6.0), fewer
columns a step than a quarter are not possible (a slice of fewer than 8 rows would split the 128-byte swizzle). So
the figure this gives is an upper bound of the cost. ``qnorm_consumers``: 0/0 on 3.6.0 and 3.7.1, 8/64 on 3.9.0.

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/fwd_qnorm.py --T 32768 8192 --H 64 --rounds 5``;
offline: ``... --build-only``.
"""
import torch

EPS = 1e-6

_PRODUCER_OLD = """    @gluon.jit
    def _fwd_producer(Q, KV, IDX, NEND, H, K, t, hb, q_smem, ring, full, empty, D: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        _pp_producer(Q, KV, IDX, H, K, row_blocks(NEND, t, BLOCK_N), t, hb, q_smem, ring, full, empty, D, BLOCK_N,
                     STAGES)
"""

_PRODUCER_NEW = """    @gluon.jit
    def _norm_heads(q_smem, COS, SIN, t, D: gl.constexpr, ROPE: gl.constexpr):
        # The 64 raw heads in q_smem, eight a step (the swizzle pattern's rows; two heads a warp), a quarter of the
        # columns at a time (8 channels a thread: the producer has 40 registers): the sums of squares, then a second
        # read for x * rstd with the last 2 * ROPE channels rotated by +angle, one rounding.
        io: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        QW: gl.constexpr = D // 4
        for h0 in gl.static_range(0, BLOCK_H_C, 8):
            rows = q_smem.slice(h0, 8, dim=0)
            sq = gl.zeros([8], gl.float32, layout=gl.SliceLayout(1, io))
            for c in gl.static_range(4):
                x = rows.slice(c * QW, QW, dim=1).load(io).to(gl.float32)
                sq += gl.sum(x * x, 1)
            rstd = 1.0 / gl.sqrt_rn(sq / D + EPS_C)
            for c in gl.static_range(4):
                x = rows.slice(c * QW, QW, dim=1).load(io).to(gl.float32)
                y = x * rstd[:, None]
                if ROPE > 0 and (c + 1) * QW > D - 2 * ROPE:
                    y = rotate_channel_pairs(y, COS, SIN, t, c * QW, D, ROPE, 1)
                rows.slice(c * QW, QW, dim=1).store(y.to(q_smem.dtype))

    @gluon.jit
    def _fwd_producer(Q, KV, IDX, NEND, COS, SIN, H, K, t, hb, q_smem, ring, full, empty, qready, D: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ROPE: gl.constexpr):
        nb = row_blocks(NEND, t, BLOCK_N)
        copy_heads(Q, H, t, hb, q_smem, D)
        async_copy.commit_group()
        io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        n_layout: gl.constexpr = gl.SliceLayout(1, io)
        row_base = t * K
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        i0 = slot_rows(IDX, row_base, 0, 0, K, BLOCK_N, n_layout)
        i1 = slot_rows(IDX, row_base, 0, 16, K, BLOCK_N, n_layout)
        i2 = slot_rows(IDX, row_base, 0, 32, K, BLOCK_N, n_layout)
        i3 = slot_rows(IDX, row_base, 0, 48, K, BLOCK_N, n_layout)
        first = gl.minimum(nb, STAGES)
        for b in range(nb):
            stage = b % STAGES
            mbarrier.wait(empty.index(stage), ((b // STAGES) + 1) & 1, pred=b >= STAGES)
            kv_stage = ring.index(stage)
            gather_rows(kv_stage, 0, i0, KV, cols, D)
            if BLOCK_N > 16:
                gather_rows(kv_stage, 16, i1, KV, cols, D)
            if BLOCK_N > 32:
                gather_rows(kv_stage, 32, i2, KV, cols, D)
                gather_rows(kv_stage, 48, i3, KV, cols, D)
            async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
            async_copy.commit_group()
            i0 = slot_rows(IDX, row_base, b + 1, 0, K, BLOCK_N, n_layout)
            if BLOCK_N > 16:
                i1 = slot_rows(IDX, row_base, b + 1, 16, K, BLOCK_N, n_layout)
            if BLOCK_N > 32:
                i2 = slot_rows(IDX, row_base, b + 1, 32, K, BLOCK_N, n_layout)
                i3 = slot_rows(IDX, row_base, b + 1, 48, K, BLOCK_N, n_layout)
            if b == first - 1:
                # q's group and these first blocks' groups are in flight: wait for q's only (all of them in a row
                # of fewer blocks than stages: wait_group takes a constant).
                if first == STAGES:
                    async_copy.wait_group(STAGES)
                else:
                    async_copy.wait_group(0)
                thread_barrier()                 # every producer thread's part of q has landed
                _norm_heads(q_smem, COS, SIN, t, D, ROPE)
                fence_async_shared()             # the generic stores before the consumers' wgmma reads
                mbarrier.arrive(qready.index(0))
        async_copy.wait_group(0)
"""

_KERNEL_OLD = """        pready = mbarriers(2, 1)
        pfree = mbarriers(2, 2)
        gl.warp_specialize([
            (_pp_consumer, (IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, q_all, ring, p_buf,
                            stats, full, empty, pready, pfree, gl.constexpr(0), D, BLOCK_N, STAGES, ROPE)),
            (_pp_consumer, (IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, q_all, ring, p_buf,
                            stats, full, empty, pready, pfree, gl.constexpr(1), D, BLOCK_N, STAGES, ROPE)),
            (_fwd_producer, (Q, KV, IDX, NEND, H, K, t, hb, q_all.index(0), ring, full, empty, D, BLOCK_N,
                             STAGES))],"""

_KERNEL_NEW = """        pready = mbarriers(2, 1)
        pfree = mbarriers(2, 2)
        qready = mbarriers(1, 1)
        gl.warp_specialize([
            (_pp_consumer, (IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, q_all, ring, p_buf,
                            stats, full, empty, pready, pfree, qready, gl.constexpr(0), D, BLOCK_N, STAGES, ROPE)),
            (_pp_consumer, (IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, q_all, ring, p_buf,
                            stats, full, empty, pready, pfree, qready, gl.constexpr(1), D, BLOCK_N, STAGES, ROPE)),
            (_fwd_producer, (Q, KV, IDX, NEND, COS, SIN, H, K, t, hb, q_all.index(0), ring, full, empty, qready, D,
                             BLOCK_N, STAGES, ROPE))],"""

_CONSUMER_SIG_OLD = """    def _pp_consumer(IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, q_all, ring, p_buf, stats,
                     full, empty, pready, pfree, W: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, ROPE: gl.constexpr):"""
_CONSUMER_SIG_NEW = """    def _pp_consumer(IDX, NEND, SINK, OUT, LSE, COS, SIN, H, K, qk_scale_log2, t, hb, q_all, ring, p_buf, stats,
                     full, empty, pready, pfree, qready, W: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, ROPE: gl.constexpr):"""

_CONSUMER_START_OLD = """        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        n = W * BLOCK_N + cols
        idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
        for b in range(W - 1, nb - 1, 2):"""
_CONSUMER_START_NEW = """        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        n = W * BLOCK_N + cols
        idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)
        mbarrier.wait(qready.index(0), 0)          # q normalised by the producer
        for b in range(W - 1, nb - 1, 2):"""

_IMPORTS_OLD = "                            rotate_channel_pairs, row_blocks, sm90, store_heads, tma_load, warpgroup_mma,"
_IMPORTS_NEW = ("                            rotate_channel_pairs, row_blocks, sm90, store_heads, tma_load, warpgroup_mma,"
                "\n                            slot_rows, gather_rows, thread_barrier,")
_CONST_OLD = "    BLOCK_H_C = gl.constexpr(BLOCK_H)\n"
_CONST_NEW = f"    BLOCK_H_C = gl.constexpr(BLOCK_H)\n    EPS_C = gl.constexpr({EPS})\n"

_QNORM = [(_IMPORTS_OLD, _IMPORTS_NEW), (_CONST_OLD, _CONST_NEW),
                               (_PRODUCER_OLD, _PRODUCER_NEW), (_KERNEL_OLD, _KERNEL_NEW),
                               (_CONSUMER_SIG_OLD, _CONSUMER_SIG_NEW), (_CONSUMER_START_OLD, _CONSUMER_START_NEW)]
# The same with 16 more producer registers (taken from the worker consumer).
_REGS = ("FWD_CONFIG = dict(BLOCK_N=64, STAGES=2, REGS=(216, 40))",
         "FWD_CONFIG = dict(BLOCK_N=64, STAGES=2, REGS=(200, 56))")
VARIANTS = {"qnorm_producer": _QNORM, "qnorm_producer_r56": _QNORM + [_REGS]}
VARIANT_CONSTEXPRS = {"qnorm_producer_r56": {"REGS": (200, 56)}}

# qnorm_consumers: each consumer warpgroup normalises 32 of the heads once q has landed (with block 0, full[0]),
# whole rows at a time (32 channels a thread: the consumers have the registers before their accumulators are
# live), then both meet on qready (count 2) before their first product. Not overlapped with a gather, but no
# producer registers needed.
_CONSUMER_NORM = """    @gluon.jit
    def _norm_half(q_smem, COS, SIN, t, W: gl.constexpr, D: gl.constexpr, ROPE: gl.constexpr):
        # Heads [32 W, 32 W + 32) of q_smem, eight a step: x * rstd, the last 2 * ROPE channels rotated by +angle.
        io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        for h0 in gl.static_range(0, BLOCK_H_C // 2, 8):
            rows = q_smem.slice(W * (BLOCK_H_C // 2) + h0, 8, dim=0)
            x = rows.load(io).to(gl.float32)
            rstd = 1.0 / gl.sqrt_rn(gl.sum(x * x, 1) / D + EPS_C)
            y = x * rstd[:, None]
            if ROPE > 0:
                y = rotate_channel_pairs(y, COS, SIN, t, 0, D, ROPE, 1)
            rows.store(y.to(q_smem.dtype))

    @gluon.jit
    def _pp_consumer("""
_C_START_OLD = """        row_base = t * K
        nb = row_blocks(NEND, t, BLOCK_N)
        m_i = gl.full([BLOCK_H_C], float("-inf"), gl.float32, layout=row_layout)"""
_C_START_NEW = """        row_base = t * K
        nb = row_blocks(NEND, t, BLOCK_N)
        mbarrier.wait(full.index(0), 0)            # q has landed (with block 0)
        _norm_half(q_all.index(0), COS, SIN, t, W, D, ROPE)
        fence_async_shared()
        mbarrier.arrive(qready.index(0))
        mbarrier.wait(qready.index(0), 0)          # and the other consumer's half
        m_i = gl.full([BLOCK_H_C], float("-inf"), gl.float32, layout=row_layout)"""
_C_KERNEL_NEW = (_KERNEL_NEW.replace("qready = mbarriers(1, 1)", "qready = mbarriers(1, 2)")
                 .replace("""            (_fwd_producer, (Q, KV, IDX, NEND, COS, SIN, H, K, t, hb, q_all.index(0), ring, full, empty, qready, D,
                             BLOCK_N, STAGES, ROPE))],""", """            (_fwd_producer, (Q, KV, IDX, NEND, H, K, t, hb, q_all.index(0), ring, full, empty, D, BLOCK_N,
                             STAGES))],"""))
VARIANTS["qnorm_consumers"] = [(_CONST_OLD, _CONST_NEW), ("    @gluon.jit\n    def _pp_consumer(", _CONSUMER_NORM),
                               (_KERNEL_OLD, _C_KERNEL_NEW), (_CONSUMER_SIG_OLD, _CONSUMER_SIG_NEW),
                               (_C_START_OLD, _C_START_NEW)]

# The offline builds take the Flash geometry's rotation (32 channel pairs), as the layer launches it.
BUILD_CONSTEXPRS = {"ROPE": 32}


def inputs(T, H, device):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sparse_attention import D, make_inputs
    from dsv4attn.rope import rope_cos_sin
    q, kv, idx, sink, _ = make_inputs(T, device, heads=H)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64, device=device) / 64))
    cos, sin = rope_cos_sin(torch.arange(T, device=device), inv_freq, torch.float32)
    return dict(q=q * 3.0 + 0.5, kv=kv, idx=idx, sink=sink.float(), scale=D ** -0.5, rope=(cos.contiguous(),
                                                                                         sin.contiguous()))


def call(module, inp):
    q = inp["q"]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    module.launch_fwd(q, inp["kv"], inp["idx"], inp["sink"], out, lse, inp["scale"], rope=inp["rope"])
    checked = inp.setdefault("checked", set())
    if (hasattr(module, "_norm_heads") or hasattr(module, "_norm_half")) and module.__name__ not in checked:
        # Once a variant: against the shipped kernel fed the normalised q (the layer's qnorm_rope).
        from dsv4attn.ops import qnorm_rope
        from dsv4attn.ops.sparse_attention import gluon_hopper
        checked.add(module.__name__)
        T = q.shape[0]
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64, device=q.device) / 64))
        qn = qnorm_rope(q, torch.arange(T, device=q.device), inv_freq, EPS)
        ref = torch.empty_like(q)
        ref_lse = torch.empty_like(lse)
        gluon_hopper.launch_fwd(qn, inp["kv"], inp["idx"], inp["sink"], ref, ref_lse, inp["scale"], rope=inp["rope"])
        print(f"{module.__name__.rsplit('__', 1)[-1]} vs shipped(qnorm_rope(q)): out max abs diff "
              f"{(out.float() - ref.float()).abs().max().item():.3e} (|out| max {ref.float().abs().max().item():.2f}), "
              f"lse {(lse - ref_lse).abs().max().item():.3e}", flush=True)
    return out, lse

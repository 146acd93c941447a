"""Attention backward (Gluon, SM90): the query norm's backward in the dq epilogue (``sparse_attention``'s
``query_norm``), in place of the pass of its own that runs after this kernel today.

Why: with ``query_norm`` the layer wants d x = rstd * R(-angle)(g - q * mean(g * q)) for g the gradient of q (the
normalised, rotated queries). The Triton backward applies it in its dq epilogue; after this kernel a separate pass
reads dq and q again and writes d x (6 GiB at T = 32K, 64 heads of 512: ~2.9 ms of the CSA layer's 74.6 ms on an
H100, BENCHMARKS.md). Here each consumer, after its loop, loads its half of q (bf16, from the shared memory it already
holds), 16 heads at a time beside its dq staged in shared memory (as the store path stages it today, rounded to bf16),
forms its partial dot g . q per head, and the two consumers exchange the (64,) partials through shared memory (one
mbarrier, an arrival per warpgroup); both add them in one order, so each half is corrected with the same mean; the
RoPE pairs (only in the dKV warpgroup's half at D = 512, rope 64) rotate by -angle before the one rounding. A first
form corrected the fp32 dq in the accumulator's layout with all of q's half loaded beside it: 500 / 572 bytes of
spills on Triton 3.6.0 and 3.7.1 (shipped: 28 / 28), 736 / 876 on 3.9.0 (shipped 244 / 284).

- ``qnorm``: the epilogue; d x compared with the shipped kernel followed by the norm's backward pass (the same
  algorithm on the same bf16 g: equal up to fp32 rounding of the dot's order); dkv must be the shipped kernel's (up to
  the order of the fp32 atomics). The shipped side is timed with the pass included (``call``).

Offline sm_90 builds (``--build-only``, the layer's form: ROPE 32, QNORM): registers 168 as shipped; spills 28 / 28
bytes on Triton 3.6.0 and 3.7.1 (shipped 28 / 28), 252 / 308 on 3.9.0 (shipped 244 / 284); shared memory 230288 bytes
(shipped 229712; the limit 232448); wgmma not serialized; two more mbarrier arrivals and waits.

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/bwd_qnorm.py --T 32768 8192 --H 64 128``; offline:
``--build-only``.
"""
import torch

MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper_bwd"
KERNEL = "_sparse_attn_bwd_gluon"

_HELPER_OLD = """    @gluon.jit
    def _bwd_softmax("""
_HELPER_NEW = """    @gluon.jit
    def _store_dx(dq, OUT, t, H, hb, col0: gl.constexpr, W: gl.constexpr, staging, q_half, part, xbar, RSTD, COS,
                  SIN, D: gl.constexpr, ROPE: gl.constexpr):
        # Columns [col0, col0 + D/2) of d x = rstd * R(-angle)(g - q * mean(g * q)), g = dq, stored as store_heads
        # stores dq: g goes through ``staging`` (rounded to the output dtype, as the norm's own pass reads it), then
        # 16 heads at a time in the store layout (8 columns a thread: few registers after the loop's), two passes:
        # this consumer's partial dots into part[W], the exchange (one arrival per warpgroup on ``xbar``), then the
        # correction, the RoPE pairs' rotation by -angle, the one rounding and the store.
        staging.store(dq.to(OUT.dtype.element_ty))
        gluon_common.thread_barrier()
        st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        rows: gl.constexpr = gl.SliceLayout(1, st_layout)
        WIDTH: gl.constexpr = D // 2
        for r in gl.static_range(0, BLOCK_H_C, 16):
            g = staging.slice(r, 16, dim=0).load(st_layout).to(gl.float32)
            q = q_half.slice(r, 16, dim=0).load(st_layout).to(gl.float32)
            part.index(W).slice(r, 16, dim=0).store(gl.sum(g * q, 1))
        mbarrier.arrive(xbar.index(0))
        mbarrier.wait(xbar.index(0), 0)
        c_o = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, st_layout))
        for r in gl.static_range(0, BLOCK_H_C, 16):
            mean = (part.index(0).slice(r, 16, dim=0).load(rows) + part.index(1).slice(r, 16, dim=0).load(rows)) / D
            h_o = hb * BLOCK_H_C + r + gl.arange(0, 16, layout=rows)
            rstd = gl.load(RSTD + t * H + h_o)
            g = staging.slice(r, 16, dim=0).load(st_layout).to(gl.float32)
            q = q_half.slice(r, 16, dim=0).load(st_layout).to(gl.float32)
            dx = rstd[:, None] * (g - q * mean[:, None])
            if ROPE > 0 and col0 + WIDTH > D - 2 * ROPE:
                dx = rotate_channel_pairs(dx, COS, SIN, t, col0, D, ROPE, -1)
            gl.store(OUT + t * H * D + h_o.to(gl.int64)[:, None] * D + c_o[None, :], dx.to(OUT.dtype.element_ty))

    @gluon.jit
    def _bwd_softmax("""
_SOFTMAX_SIG_OLD = """                     do_all, ring, p_buf, ds_buf, full, empty, pready, pfree, D: gl.constexpr, BLOCK_N: gl.constexpr,
                     ROPE: gl.constexpr, RW: gl.constexpr, DO_MASS: gl.constexpr):"""
_SOFTMAX_SIG_NEW = """                     do_all, ring, p_buf, ds_buf, full, empty, pready, pfree, part, xbar, RSTD, D: gl.constexpr,
                     BLOCK_N: gl.constexpr, ROPE: gl.constexpr, RW: gl.constexpr, DO_MASS: gl.constexpr,
                     QNORM: gl.constexpr):"""
_SOFTMAX_END_OLD = """        # The producer gathers nothing more and this warpgroup's last read of kv columns [0, HALF) is done.
        store_heads(dq, DQ, t, H, hb, 0, ring.index(0).slice(0, HALF, dim=1), D)"""
_SOFTMAX_END_NEW = """        # The producer gathers nothing more and this warpgroup's last read of kv columns [0, HALF) is done.
        if QNORM:
            _store_dx(dq, DQ, t, H, hb, 0, 0, ring.index(0).slice(0, HALF, dim=1), q_all.index(0).slice(0, HALF, dim=1),
                      part, xbar, RSTD, COS, SIN, D, ROPE)
        else:
            store_heads(dq, DQ, t, H, hb, 0, ring.index(0).slice(0, HALF, dim=1), D)"""
_DKV_SIG_OLD = """    def _bwd_dkv(IDX, NEND, DQ, DKV, H, K, q_all, do_all, ring, p_buf, ds_buf, full, empty, pready, pfree,
                 D: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr, DETERMINISTIC: gl.constexpr):"""
_DKV_SIG_NEW = """    def _bwd_dkv(IDX, NEND, DQ, DKV, H, K, q_all, do_all, ring, p_buf, ds_buf, full, empty, pready, pfree,
                 part, xbar, RSTD, COS, SIN, D: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr,
                 DETERMINISTIC: gl.constexpr, ROPE: gl.constexpr, QNORM: gl.constexpr):"""
_DKV_END_OLD = """        store_heads(dq, DQ, t, H, hb, HALF, ring.index(0).slice(HALF, HALF, dim=1), D)"""
_DKV_END_NEW = """        if QNORM:
            _store_dx(dq, DQ, t, H, hb, HALF, 1, ring.index(0).slice(HALF, HALF, dim=1),
                      q_all.index(0).slice(HALF, HALF, dim=1), part, xbar, RSTD, COS, SIN, D, ROPE)
        else:
            store_heads(dq, DQ, t, H, hb, HALF, ring.index(0).slice(HALF, HALF, dim=1), D)"""
_KERNEL_OLD = """    def _sparse_attn_bwd_gluon(Q, DO, KV, IDX, NEND, DENOM2, DELTA, DQ, DKV, COS, SIN, MASS, H, K, KT, OFF,
                               qk_scale_log2, scale, D: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr,
                               num_warps: gl.constexpr, REGS: gl.constexpr, ROPE: gl.constexpr, RW: gl.constexpr,
                               DETERMINISTIC: gl.constexpr, DO_MASS: gl.constexpr):"""
_KERNEL_NEW = """    def _sparse_attn_bwd_gluon(Q, DO, KV, IDX, NEND, DENOM2, DELTA, DQ, DKV, COS, SIN, MASS, RSTD, H, K, KT, OFF,
                               qk_scale_log2, scale, D: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr,
                               num_warps: gl.constexpr, REGS: gl.constexpr, ROPE: gl.constexpr, RW: gl.constexpr,
                               DETERMINISTIC: gl.constexpr, DO_MASS: gl.constexpr, QNORM: gl.constexpr = False):"""
_ALLOC_OLD = """        pfree = mbarriers(2, 128)       # the dKV warpgroup's threads
"""
_ALLOC_NEW = """        pfree = mbarriers(2, 128)       # the dKV warpgroup's threads
        part = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H_C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        xbar = mbarriers(1, 2)          # each consumer's partial dot of the norm's mean, one arrival each
"""
_PARTITIONS_OLD = """            (_bwd_softmax, (IDX, NEND, DQ, DENOM2, DELTA, COS, SIN, MASS, H, K, KT, OFF, qk_scale_log2, scale, q_all,
                            do_all, ring, p_buf, ds_buf, full, empty, pready, pfree, D, BLOCK_N, ROPE, RW, DO_MASS)),
            (_bwd_dkv, (IDX, NEND, DQ, DKV, H, K, q_all, do_all, ring, p_buf, ds_buf, full, empty, pready, pfree, D,
                        BLOCK_N, CHUNK, DETERMINISTIC)),"""
_PARTITIONS_NEW = """            (_bwd_softmax, (IDX, NEND, DQ, DENOM2, DELTA, COS, SIN, MASS, H, K, KT, OFF, qk_scale_log2, scale, q_all,
                            do_all, ring, p_buf, ds_buf, full, empty, pready, pfree, part, xbar, RSTD, D, BLOCK_N,
                            ROPE, RW, DO_MASS, QNORM)),
            (_bwd_dkv, (IDX, NEND, DQ, DKV, H, K, q_all, do_all, ring, p_buf, ds_buf, full, empty, pready, pfree,
                        part, xbar, RSTD, COS, SIN, D, BLOCK_N, CHUNK, DETERMINISTIC, ROPE, QNORM)),"""
_LAUNCH_DEF_OLD = """def launch(q, do, kv, idx, denom2, delta, dq, dkv, scale, config=None, rope=None, deterministic_rows=None,
           mass_slots=None):"""
_LAUNCH_DEF_NEW = """def launch(q, do, kv, idx, denom2, delta, dq, dkv, scale, config=None, rope=None, deterministic_rows=None,
           mass_slots=None, query_rstd=None):"""
_LAUNCH_OLD = """            planes[s:e], H, K, width, offset, scale * LOG2E, scale, D=D, BLOCK_N=BLOCK_N, CHUNK=cfg["CHUNK"],
            num_warps=4, REGS=tuple(cfg["REGS"]), ROPE=pairs, RW=rotated_width(pairs), DETERMINISTIC=deterministic,
            DO_MASS=mass_slots is not None)"""
_LAUNCH_NEW = """            planes[s:e], (denom2 if query_rstd is None else query_rstd)[s:e], H, K, width, offset, scale * LOG2E,
            scale, D=D, BLOCK_N=BLOCK_N, CHUNK=cfg["CHUNK"], num_warps=4, REGS=tuple(cfg["REGS"]), ROPE=pairs,
            RW=rotated_width(pairs), DETERMINISTIC=deterministic, DO_MASS=mass_slots is not None,
            QNORM=query_rstd is not None)"""

VARIANTS = {"qnorm": [(_HELPER_OLD, _HELPER_NEW), (_SOFTMAX_SIG_OLD, _SOFTMAX_SIG_NEW),
                      (_SOFTMAX_END_OLD, _SOFTMAX_END_NEW), (_DKV_SIG_OLD, _DKV_SIG_NEW), (_DKV_END_OLD, _DKV_END_NEW),
                      (_KERNEL_OLD, _KERNEL_NEW), (_ALLOC_OLD, _ALLOC_NEW), (_PARTITIONS_OLD, _PARTITIONS_NEW),
                      (_LAUNCH_DEF_OLD, _LAUNCH_DEF_NEW), (_LAUNCH_OLD, _LAUNCH_NEW)]}
BUILD_SIGNATURE = {"RSTD": "*fp32"}
# The offline build: the layer's form (the output rotation's 32 pairs, the norm's epilogue).
VARIANT_CONSTEXPRS = {"qnorm": {"QNORM": True}}
BUILD_CONSTEXPRS = {"ROPE": 32, "RW": 64}


def inputs(T, H, device):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sparse_attention import D, make_inputs
    from dsv4attn.ops.qnorm_rope import qnorm_rope_stats
    from dsv4attn.ops.sparse_attention import gluon_hopper
    from dsv4attn.ops.sparse_attention.triton import LOG2E, _delta_from_out, rope_tables
    from dsv4attn.rope import rope_frequencies
    x, kv, idx, sink, _ = make_inputs(T, device, heads=H)
    positions = torch.arange(T, device=device)
    inv_freq = rope_frequencies(64, 10000.0).to(device)
    q, rstd = qnorm_rope_stats(x * 3, positions, inv_freq, 1e-6)
    sink, scale = sink.float(), D ** -0.5
    rope = rope_tables(positions, inv_freq)
    out = torch.empty_like(q)
    lse = torch.empty(T, H, dtype=torch.float32, device=device)
    gluon_hopper.launch_fwd(q, kv, idx, sink, out, lse, scale, rope=rope)
    do = torch.randn_like(q)
    denom2 = (torch.logaddexp(lse, sink[None, :]) * LOG2E).contiguous()
    return dict(q=q, kv=kv, idx=idx, do=do, denom2=denom2, delta=_delta_from_out(out, do), scale=scale, rope=rope,
                rstd=rstd)


def call(module, inp):
    import inspect
    from dsv4attn.ops.qnorm_rope.triton import _qnorm_rope_bwd
    q = inp["q"]
    dq = torch.empty_like(q)
    dkv = torch.zeros(inp["kv"].shape, dtype=torch.float32, device=q.device)
    args = (q, inp["do"], inp["kv"], inp["idx"], inp["denom2"], inp["delta"], dq, dkv, inp["scale"])
    if "query_rstd" in inspect.signature(module.launch).parameters:     # the variant: d x from the kernel
        module.launch(*args, rope=inp["rope"], query_rstd=inp["rstd"])
        return dq, dkv
    module.launch(*args, rope=inp["rope"])                              # shipped: dq, then the norm's pass
    return _qnorm_rope_bwd(dq, q, inp["rstd"], *inp["rope"]), dkv

"""Attention backward (Gluon, SM90): what the indexer KL's teacher mass costs when the one-pass backward forms it.

Why: the sparse phase's KL teacher is sum_h p[t, h, j] over the top-k slots j, normalised with the attention's own
denominator; today a teacher-mass kernel forms it in the forward by gathering the same kv rows again (3.3 of the
sparse KL's 8.0 ms at 32K, H100). The one-pass backward already forms P = exp2(s - denom2) per (row, 64 heads, 64
slots) with the final denominator, so the mass is a column sum of each P tile and a (T, heads / 64, K_top) fp32
store. Moving the KL's gradient into the backward (the plan in the thirty-third session's note) only pays if this
costs well under 3.3 ms.

- ``mass``: the softmax warpgroup stores ``sum_h P`` of each tile's slots past ``OFF`` (the window's width; here
  128 of the benchmark's 640 slots) into one plane per head block; every partition derives its row, head block and
  tile count itself (handed from the kernel's prologue, the values' slots overlapped the new reduction's scratch).
  dq and dkv must match the shipped kernel's (dkv up to fp32 atomics' order). Offline sm_90 builds: spills 216 /
  200 / 312 bytes on Triton 3.6.0 / 3.7.1 / 3.9.0 (the shipped kernel 44 on 3.6.0), shared memory 230464 bytes
  (3.9.0: 229712), no handed-over value in a reduction's scratch, wgmma not serialized (the deterministic form on
  3.9.0 is, as shipped).

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/bwd_teacher_mass.py --T 32768 8192 --H 64 128``.
"""
import torch

MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper_bwd"
KERNEL = "_sparse_attn_bwd_gluon"
OFF = 128           # slots of the window before the top-k in the layer's index sets

_PRODUCER_OLD = ("    def _bwd_producer(Q, DO, KV, IDX, nb, H, K, t, hb, q_smem, do_smem, ring, full, empty, "
                 "D: gl.constexpr,\n")
_PRODUCER_NEW = ("    def _bwd_producer(Q, DO, KV, IDX, NEND, H, K, q_smem, do_smem, ring, full, empty, "
                 "D: gl.constexpr,\n")
_PRODUCER_BODY_OLD = """                      BLOCK_N: gl.constexpr):
        copy_heads(Q, H, t, hb, q_smem, D)
"""
_PRODUCER_BODY_NEW = """                      BLOCK_N: gl.constexpr):
        t, hb = program_row(H)
        nb = row_blocks(NEND, t, BLOCK_N)
        copy_heads(Q, H, t, hb, q_smem, D)
"""
_MASS_OLD = """            p = gl.where((idx >= 0)[None, :], gl.exp2(s * qk_scale_log2 - denom2[:, None]), 0.0)
"""
_MASS_NEW = """            p = gl.where((idx >= 0)[None, :], gl.exp2(s * qk_scale_log2 - denom2[:, None]), 0.0)
            j = n - OFF
            gl.store(MASS + (t * (H // BLOCK_H_C) + hb) * KT + j, gl.sum(p, 0), mask=(j >= 0) & (j < KT))
"""
_SOFTMAX_OLD = """    def _bwd_softmax(IDX, nb, DQ, DENOM2, DELTA, COS, SIN, H, K, qk_scale_log2, scale, t, hb, q_all, do_all, ring,
                     p_buf, ds_buf, full, empty, pready, pfree, D: gl.constexpr, BLOCK_N: gl.constexpr,
                     ROPE: gl.constexpr, RW: gl.constexpr):
"""
_SOFTMAX_NEW = """    def _bwd_softmax(IDX, NEND, DQ, DENOM2, DELTA, COS, SIN, H, K, qk_scale_log2, scale, q_all, do_all, ring,
                     p_buf, ds_buf, full, empty, pready, pfree, MASS, KT, OFF, D: gl.constexpr, BLOCK_N: gl.constexpr,
                     ROPE: gl.constexpr, RW: gl.constexpr):
        t, hb = program_row(H)
        nb = row_blocks(NEND, t, BLOCK_N)
"""
_DKV_OLD = "    def _bwd_dkv(IDX, nb, DQ, DKV, H, K, t, hb, q_all, do_all, ring, p_buf, ds_buf, full, empty, pready, pfree,\n"
_DKV_NEW = "    def _bwd_dkv(IDX, NEND, DQ, DKV, H, K, q_all, do_all, ring, p_buf, ds_buf, full, empty, pready, pfree,\n"
_DKV_BODY_OLD = """                 D: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr, DETERMINISTIC: gl.constexpr):
        HALF: gl.constexpr = D // 2
        CHUNKS: gl.constexpr = D // CHUNK
"""
_DKV_BODY_NEW = """                 D: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr, DETERMINISTIC: gl.constexpr):
        t, hb = program_row(H)
        nb = row_blocks(NEND, t, BLOCK_N)
        HALF: gl.constexpr = D // 2
        CHUNKS: gl.constexpr = D // CHUNK
"""
_KERNEL_OLD = """    def _sparse_attn_bwd_gluon(Q, DO, KV, IDX, NEND, DENOM2, DELTA, DQ, DKV, COS, SIN, H, K, qk_scale_log2, scale,
"""
_KERNEL_NEW = """    def _sparse_attn_bwd_gluon(Q, DO, KV, IDX, NEND, DENOM2, DELTA, DQ, DKV, COS, SIN, MASS, H, K, KT, OFF,
                               qk_scale_log2, scale,
"""
_PROLOGUE_OLD = """        t, hb = program_row(H)
        nb = row_blocks(NEND, t, BLOCK_N)       # up to the row's last valid slot
        dtype: gl.constexpr = Q.dtype.element_ty
"""
_PROLOGUE_NEW = """        dtype: gl.constexpr = Q.dtype.element_ty
"""
_PARTITIONS_OLD = """            (_bwd_softmax, (IDX, nb, DQ, DENOM2, DELTA, COS, SIN, H, K, qk_scale_log2, scale, t, hb, q_all, do_all,
                            ring, p_buf, ds_buf, full, empty, pready, pfree, D, BLOCK_N, ROPE, RW)),
            (_bwd_dkv, (IDX, nb, DQ, DKV, H, K, t, hb, q_all, do_all, ring, p_buf, ds_buf, full, empty, pready,
"""
_PARTITIONS_NEW = """            (_bwd_softmax, (IDX, NEND, DQ, DENOM2, DELTA, COS, SIN, H, K, qk_scale_log2, scale, q_all, do_all,
                            ring, p_buf, ds_buf, full, empty, pready, pfree, MASS, KT, OFF, D, BLOCK_N, ROPE, RW)),
            (_bwd_dkv, (IDX, NEND, DQ, DKV, H, K, q_all, do_all, ring, p_buf, ds_buf, full, empty, pready,
"""
_PRODUCER_CALL_OLD = "            (_bwd_producer, (Q, DO, KV, IDX, nb, H, K, t, hb, q_all.index(0), do_all.index(0), ring, full, empty, D,\n"
_PRODUCER_CALL_NEW = "            (_bwd_producer, (Q, DO, KV, IDX, NEND, H, K, q_all.index(0), do_all.index(0), ring, full, empty, D,\n"
_LAUNCH_OLD = """            q[s:e], do[s:e], kv, idx[s:e], n_end[s:e], denom2[s:e], delta[s:e], dq[s:e], out, cos[s:e], sin[s:e],
            H, K, scale * LOG2E, scale,"""
_LAUNCH_NEW = """            q[s:e], do[s:e], kv, idx[s:e], n_end[s:e], denom2[s:e], delta[s:e], dq[s:e], out, cos[s:e], sin[s:e],
            MASS_OUT[0][s:e], H, K, MASS_OUT[0].shape[2], MASS_OFF, scale * LOG2E, scale,"""
_LAUNCH_DEF_OLD = "def launch(q, do, kv, idx, denom2, delta, dq, dkv, scale, config=None, rope=None, deterministic_rows=None):\n"
_LAUNCH_DEF_NEW = ("MASS_OFF = " + str(OFF) + "\nMASS_OUT = [None]\n\n\n" + _LAUNCH_DEF_OLD)


_VARIANT = [(_PRODUCER_OLD, _PRODUCER_NEW), (_PRODUCER_BODY_OLD, _PRODUCER_BODY_NEW), (_SOFTMAX_OLD, _SOFTMAX_NEW),
            (_MASS_OLD, _MASS_NEW), (_DKV_OLD, _DKV_NEW), (_DKV_BODY_OLD, _DKV_BODY_NEW),
            (_KERNEL_OLD, _KERNEL_NEW), (_PROLOGUE_OLD, _PROLOGUE_NEW), (_PARTITIONS_OLD, _PARTITIONS_NEW),
            (_PRODUCER_CALL_OLD, _PRODUCER_CALL_NEW), (_LAUNCH_OLD, _LAUNCH_NEW), (_LAUNCH_DEF_OLD, _LAUNCH_DEF_NEW)]
VARIANTS = {"mass": _VARIANT}
BUILD_SIGNATURE = {"MASS": "*fp32", "KT": "i32", "OFF": "i32"}


def inputs(T, H, device):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sparse_attention import D, make_inputs
    from dsv4attn.ops.sparse_attention import gluon_hopper
    from dsv4attn.ops.sparse_attention.triton import LOG2E, _delta_from_out
    q, kv, idx, sink, _ = make_inputs(T, device, heads=H)
    sink, scale = sink.float(), D ** -0.5
    out = torch.empty_like(q)
    lse = torch.empty(T, H, dtype=torch.float32, device=device)
    gluon_hopper.launch_fwd(q, kv, idx, sink, out, lse, scale)
    do = torch.randn_like(q)
    denom2 = (torch.logaddexp(lse, sink[None, :]) * LOG2E).contiguous()
    return dict(q=q, kv=kv, idx=idx, do=do, denom2=denom2, delta=_delta_from_out(out, do), scale=scale)


def call(module, inp):
    q = inp["q"]
    T, H, _ = q.shape
    if hasattr(module, "MASS_OUT"):
        module.MASS_OUT[0] = torch.empty(T, H // 64, inp["idx"].shape[1] - OFF, dtype=torch.float32, device=q.device)
    dq = torch.empty_like(q)
    dkv = torch.zeros(inp["kv"].shape, dtype=torch.float32, device=q.device)
    module.launch(q, inp["do"], inp["kv"], inp["idx"], inp["denom2"], inp["delta"], dq, dkv, inp["scale"])
    return dq, dkv

"""The one-pass Gluon backward forming Delta = rowsum(dO * out) itself, instead of the elementwise pre-pass.

Why: the pre-pass reads the (T, H, 512) output and dO from HBM (4.3 GB at T = 32K, H = 64: ~1.0 ms, 5-6% of the
backward, its largest part outside the kernel). The kernel loads dO anyway; formed by its softmax warpgroup before
the first tile, Delta costs one read of the output (and a second read of dO, from L2 where the producer's copy of it
is), and the launch of the pre-pass goes. The kernel writes Delta (T, H) for d_sink.

- ``delta_in_kernel``: the softmax warpgroup loads the head block's output and dO from global memory in 64-column
  chunks, in the products' accumulator layout (so the row sums land in the layout its softmax uses, with no
  conversion through shared memory, which the kernel has no room for), sums dO * out in fp32 and stores Delta. Same
  value as the pre-pass's up to the order of the fp32 sum: dq / dkv / d_sink agree to rounding, not bitwise.

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/bwd_delta_in_kernel.py --T 32768 8192 --H 64`` (the
whole backward as ``triton._sparse_attn_bwd`` runs it: the shipped form with its pre-pass, the variant without);
offline: ``... --build-only``.
"""
import sys
from pathlib import Path

import torch

MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper_bwd"
KERNEL = "_sparse_attn_bwd_gluon"
BUILD_SIGNATURE = {"OUT": "*bf16"}

_FLAG_OLD = "BLOCK_N = 64          # slots per tile: the dKV products need M = 64 slots per wgmma\n"
_FLAG_NEW = _FLAG_OLD + "DELTA_IN_KERNEL = True\n"
_HELPER_OLD = "    @gluon.jit\n    def _rotate_do("
_HELPER_NEW = '''    @gluon.jit
    def _delta_rows(OUT, DO, t, H, hb, D: gl.constexpr, layout: gl.constexpr):
        # rowsum(dO * out) of the head block's heads in fp32, in the row slice of ``layout``.
        heads = hb * BLOCK_H_C + gl.arange(0, BLOCK_H_C, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        offs = (t * H + heads.to(gl.int64))[:, None] * D + cols[None, :]
        acc = gl.zeros([BLOCK_H_C, 64], gl.float32, layout=layout)
        for c in gl.static_range(0, D, 64):
            acc += gl.load(OUT + offs + c).to(gl.float32) * gl.load(DO + offs + c).to(gl.float32)
        return gl.sum(acc, 1)

    @gluon.jit
    def _rotate_do('''
_SIG_OLD = "    def _bwd_softmax(IDX, nb, DQ, DENOM2, DELTA, COS, SIN,"
_SIG_NEW = "    def _bwd_softmax(IDX, nb, DQ, DENOM2, DELTA, OUT, DO, COS, SIN,"
_DELTA_OLD = "        delta = gl.load(DELTA + t * H + heads)\n"
_DELTA_NEW = ("        delta = _delta_rows(OUT, DO, t, H, hb, D, s_layout)\n"
              "        gl.store(DELTA + t * H + heads, delta)\n")
_KSIG_OLD = "    def _sparse_attn_bwd_gluon(Q, DO, KV, IDX, NEND, DENOM2, DELTA, DQ,"
_KSIG_NEW = "    def _sparse_attn_bwd_gluon(Q, DO, KV, IDX, NEND, DENOM2, DELTA, OUT, DQ,"
_WS_OLD = "            (_bwd_softmax, (IDX, nb, DQ, DENOM2, DELTA, COS,"
_WS_NEW = "            (_bwd_softmax, (IDX, nb, DQ, DENOM2, DELTA, OUT, DO, COS,"
_LSIG_OLD = "def launch(q, do, kv, idx, denom2, delta, dq, dkv, scale, config=None, rope=None, deterministic_rows=None):\n"
_LSIG_NEW = ("def launch(q, do, kv, idx, denom2, delta, dq, dkv, scale, config=None, rope=None, deterministic_rows=None,\n"
             "           attn_out=None):\n")
_LCALL_OLD = "denom2[s:e], delta[s:e], dq[s:e], out,"
_LCALL_NEW = "denom2[s:e], delta[s:e], attn_out[s:e], dq[s:e], out,"

VARIANTS = {"delta_in_kernel": [(_FLAG_OLD, _FLAG_NEW), (_HELPER_OLD, _HELPER_NEW), (_SIG_OLD, _SIG_NEW),
                                (_DELTA_OLD, _DELTA_NEW), (_KSIG_OLD, _KSIG_NEW), (_WS_OLD, _WS_NEW),
                                (_LSIG_OLD, _LSIG_NEW), (_LCALL_OLD, _LCALL_NEW)]}


def inputs(T, H, device):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sparse_attention import D, make_inputs
    q, kv, idx, sink, _ = make_inputs(T, device, heads=H)
    gen = torch.Generator(device=device).manual_seed(1)
    do = torch.randn(q.shape, device=device, generator=gen).to(q.dtype)
    return dict(q=q, kv=kv, idx=idx, sink=sink.float(), do=do, scale=D ** -0.5)


def call(module, inp):
    """The backward as ``triton._sparse_attn_bwd`` runs it (default mode): (dq, dkv, d_sink). The variant's path is
    that function without the pre-pass."""
    from dsv4attn.ops.sparse_attention import triton as sat
    q, kv, idx, sink, do, scale = (inp[k] for k in ("q", "kv", "idx", "sink", "do", "scale"))
    if "out" not in inp:
        inp["out"], inp["lse"] = sat._sparse_attn_fwd(q, kv, idx, sink, scale)
    out, lse = inp["out"], inp["lse"]
    if not getattr(module, "DELTA_IN_KERNEL", False):
        saved = sat.gluon_hopper_bwd
        sat.gluon_hopper_bwd = module
        try:
            return sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, do, scale)
        finally:
            sat.gluon_hopper_bwd = saved
    T, H, D = q.shape
    denom = torch.logaddexp(lse, sink[None, :])
    denom2 = (denom * sat.LOG2E).contiguous()
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    delta = torch.empty(T, H, dtype=torch.float32, device=q.device)
    module.launch(q, do, kv, idx, denom2, delta, dq, dkv, scale, attn_out=out)
    p_sink = torch.where(denom == float("-inf"), 0.0, torch.exp(sink[None, :] - denom))
    return dq, dkv, -(p_sink * delta).sum(0)

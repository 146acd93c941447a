"""Triton kernels for sparse MQA attention with a per-head sink (docs/semantics.md, decision 5), forward and backward.

Same contract as :func:`.reference.sparse_attention_reference`: for query row t and head h over the key rows
``S_t = {idx[t, k] >= 0}`` of the single shared KV head (K == V),
``z = scale * q.kv``, ``lse = logsumexp(z)`` (fp32, excludes the sink, -inf when S_t is empty),
``p = exp(z - logaddexp(lse, sink))``, ``out = p @ kv`` (0 when S_t is empty).

Forward layout (see docs/kernels.md and docs/performance.md): one program per (query row, head block, value-column
slice). The heads of a block are the M dimension of every ``tl.dot`` tile (MQA: all heads share the gathered rows), the
row's K indices are walked in blocks of ``BLOCK_N`` gathered kv rows. Scores need the full D contraction, so they are
accumulated over ``BLOCK_DK`` column chunks; the value / gradient columns are split over ``D // BLOCK_DV`` programs so
the fp32 accumulator stays ``BLOCK_H x BLOCK_DV`` (a 64 x 512 fp32 accumulator does not fit in registers). The
price is that each value slice recomputes the scores. At D = 512 one program owns all columns instead (FWD_CONFIGS).
On SM90 GPUs the forward runs the warp-specialised Gluon kernel of :mod:`.gluon_hopper` by default (a producer
warpgroup gathers the rows while two consumers overlap one block's softmax with another's products; here the
pipeliner makes the gather asynchronous too, but each program's blocks run one after another);
:mod:`dsv4attn.variants` (or a config's ``KERNEL`` key) chooses.

Backward: first an elementwise pre-pass (:func:`_delta_from_out`) forms Delta = rowsum(dO * out) in fp32 from the
saved output (in its own dtype), as FlashAttention and cuDNN do; d_sink follows from Delta in PyTorch. Then, on SM90
GPUs (bf16/fp16, H % 64 == 0, D = 512), the one-pass Gluon kernel of :mod:`.gluon_hopper_bwd`;
elsewhere the Triton kernel :func:`_sparse_attn_bwd_rows_kernel`, one program per (row, head block) over all D
columns: q and dO loaded once, each gathered kv tile loaded once and used as keys and values; p recomputed from the
saved lse, ``dz = p * (dO.v - Delta)``, ``dq = scale * dz kv`` and the dKV rows ``scale * dz^T q + p^T dO`` (fp32,
atomically added: T * K * D fp32 adds per head block in every layout). ``LAYOUT`` in the config (a
:class:`BwdLayout`) picks its launches: ``FUSED``, one pass with dq and dKV together (5 GEMM-tiles per kv tile:
s, dp, dq, and the two dKV terms), or ``SPLIT``, a dq launch then a dKV launch (7: s and dp formed twice), for
D = 512 where no program can hold the 64 x 512 fp32 dq accumulator beside a dKV tile.

Deterministic backward (``deterministic=True``): the launches that produce dKV (the Gluon kernel's, or the Triton
kernel's) store each (row, slot) contribution to a fp32 buffer instead (no atomics), over chunks of query rows that
bound the buffer to ``DETERMINISTIC_BUFFER_ELEMENTS``; :mod:`.segment_sum` then adds the buffer rows into dKV key
by key in a fixed order. dq (one owner per element), Delta (one program per row) and d_sink (a PyTorch reduction)
have no atomics in either mode, and the mode does not change them. The forward has none.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ... import backend, variants
from ..gluon_common import sm90
from ...rope import rope_cos_sin
from ..triton_common import dot, dot_mode, launch_fitting, round_to
from ..index_sets import IndexSet, row_ends
from .op import register_triton, run
from .reference import check_mass_slots
from .segment_sum import add_rows_by_key
from . import gluon_hopper, gluon_hopper_bwd
from ..qnorm_rope import triton as qnorm_rope_kernels

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Tile sizes per head_dim D; keys: BLOCK_N (gathered rows per step), BLOCK_DK (score contraction chunk),
# BLOCK_DV (value / gradient columns per program), num_warps, num_stages. Benchmarks may override them.
FWD_CONFIGS = {
    64: dict(BLOCK_N=64, BLOCK_DK=64, BLOCK_DV=64, num_warps=4, num_stages=2),
    128: dict(BLOCK_N=64, BLOCK_DK=128, BLOCK_DV=128, num_warps=4, num_stages=2),
    256: dict(BLOCK_N=64, BLOCK_DK=128, BLOCK_DV=256, num_warps=8, num_stages=2),
    # One program owns all 512 value columns (64 x 512 fp32 accumulator over 8 warps) and loads each gathered
    # 64 x 512 kv tile once for scores and values: the fastest of the layouts tried (BENCHMARKS.md, "Forward
    # variants").
    512: dict(BLOCK_N=64, BLOCK_DK=512, BLOCK_DV=512, num_warps=8, num_stages=2),
}
PARTS = ("DQ", "DKV")


@dataclass(frozen=True)
class BwdLayout:
    """The launches of the Triton backward, in order; each is the set of :data:`PARTS` its program computes
    (:func:`_sparse_attn_bwd_rows_kernel`). GEMMs of BLOCK_H x BLOCK_N x D per kv tile: dq alone 3 (s, dp, dz kv),
    dKV alone 4 (s, dp, dz^T q, p^T dO), dq + dKV together 5."""
    passes: tuple[frozenset[str], ...]

    def names(self) -> tuple[str, ...]:
        """Each launch as "DQ+DKV" etc.: the config key of its overrides."""
        return tuple("+".join(p for p in PARTS if p in parts) for parts in self.passes)


FUSED = BwdLayout((frozenset(PARTS),))                         # 5 GEMMs, 1 launch: the one-pass structure
SPLIT = BwdLayout((frozenset({"DQ"}), frozenset({"DKV"})))      # 7 GEMMs, 2 launches: dq and dKV tiles apart
# Triton backward tiles per D: ``LAYOUT`` picks the launches; keys BLOCK_N, num_warps, num_stages, RELAXED (relaxed-
# order dKV atomics), optional BLOCK_H and DKV_BLOCK_D. A key named after a launch ("DQ", "DKV") holds overrides
# for that launch. The deterministic mode changes only how dKV is added, so dq and d_sink are the same bits in both.
BWD_CONFIGS = {
    64: dict(LAYOUT=FUSED, BLOCK_N=32, num_warps=4, num_stages=2, RELAXED=True),
    128: dict(LAYOUT=FUSED, BLOCK_N=32, num_warps=4, num_stages=2, RELAXED=True),
    256: dict(LAYOUT=SPLIT, BLOCK_N=32, num_warps=8, num_stages=2, RELAXED=True),
    # The dKV launch's tile in two column halves: the whole 32 x 512 one needs 288 KiB of shared memory.
    512: dict(LAYOUT=SPLIT, BLOCK_N=64, num_warps=8, num_stages=1, RELAXED=True,
              DKV=dict(BLOCK_N=32, num_warps=4, num_stages=1, DKV_BLOCK_D=256)),
}
SUPPORTED_D = tuple(FWD_CONFIGS)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# fp32 elements of the deterministic backward's per-(row, slot) dKV buffer (512 MiB): T = 4096, K = 640, D = 512
# runs in 10 chunks of 409 rows.
DETERMINISTIC_BUFFER_ELEMENTS = 1 << 27


@triton.jit
def rotate_pairs(x, cos, sin, rot):
    """The interleaved channel pairs of ``x`` (M, W) fp32 rotated where ``rot`` (1, W/2): ``(e, o) -> (e cos - o sin,
    o cos + e sin)`` with cos / sin of shape (1 or M, W/2) (a rotation by -angle passes -sin). Pairs outside ``rot``
    pass untouched (``where``, so that an infinite partner cannot leak into them)."""
    M: tl.constexpr = x.shape[0]
    W: tl.constexpr = x.shape[1]
    even, odd = tl.split(tl.reshape(x, [M, W // 2, 2]))
    even_r = tl.where(rot, even * cos - odd * sin, even)
    odd_r = tl.where(rot, odd * cos + even * sin, odd)
    return tl.reshape(tl.join(even_r, odd_r), [M, W])


@triton.jit
def rope_pairs(col0, W: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr):
    """(W/2,) index into a RoPE table row of the channel pairs of columns [col0, col0 + W) of a D-wide vector whose
    last 2 * ROPE channels rotate, and whether each pair rotates."""
    j = col0 // 2 + tl.arange(0, W // 2) - (D // 2 - ROPE)
    return tl.where(j >= 0, j, 0), j >= 0


@triton.jit
def _sparse_attn_fwd_kernel(
    Q, KV, IDX, NEND, SINK, OUT, LSE, COS, SIN,
    H, K, qk_scale_log2, ROPE: tl.constexpr,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, NUM_HB: tl.constexpr, DOT_MODE: tl.constexpr, LSE_ONLY: tl.constexpr = False,
):
    # ROPE > 0: the output's last 2 * ROPE channels are rotated back by -angle (COS / SIN: (T, ROPE) fp32 tables of
    # the query rows) before the store: the layer's inverse RoPE, fused. LSE_ONLY (sparse_attention_lse): the scores
    # and the lse alone, no P V products and no output (launched without value slices: BLOCK_DV = D).
    # Program order: the value slices and head blocks of one row are adjacent, so they hit the same gathered
    # rows in L2; neighbouring rows (which share most of their window) follow.
    NUM_DV: tl.constexpr = D // BLOCK_DV
    pid = tl.program_id(0)
    vb = pid % NUM_DV
    hb = (pid // NUM_DV) % NUM_HB
    t = (pid // (NUM_DV * NUM_HB)).to(tl.int64)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = vb * BLOCK_DV + tl.arange(0, BLOCK_DV)
    q_rows = Q + t * H * D + offs_h[:, None] * D

    # SHARED_KV (one program per row and head block owns all D columns): each gathered kv tile is loaded once
    # and used as the keys (scores) and the values; the queries are loaded once, before the loop.
    SHARED_KV: tl.constexpr = (BLOCK_DK == D) and (BLOCK_DV == D)
    if SHARED_KV:
        q_all = tl.load(q_rows + offs_dk[None, :], mask=h_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)          # running max, log2 domain
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    # Up to the row's last valid slot (NEND, index_sets.row_ends): the empty slots that trail a row are skipped.
    for start in tl.range(0, tl.load(NEND + t), BLOCK_N):
        n = start + offs_n
        idx = tl.load(IDX + t * K + n, mask=n < K, other=-1)
        valid = idx >= 0
        kv_rows = KV + tl.where(valid, idx, 0).to(tl.int64)[:, None] * D
        if SHARED_KV:
            # No load mask: empty slots read row 0 (kv has >= 1 row), their scores are -inf and p = 0 below.
            kv_tile = tl.load(kv_rows + offs_dk[None, :])
            s = dot(q_all, tl.trans(kv_tile), DOT_MODE)
        else:
            s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
            for d0 in tl.static_range(0, D, BLOCK_DK):
                q_c = tl.load(q_rows + d0 + offs_dk[None, :], mask=h_mask[:, None], other=0.0)
                k_c = tl.load(kv_rows + d0 + offs_dk[None, :], mask=valid[:, None], other=0.0)
                s += dot(q_c, tl.trans(k_c), DOT_MODE)
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # An all-invalid block keeps m at -inf: shift by 0 instead so that no -inf - -inf NaN appears.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if not LSE_ONLY:
            if SHARED_KV:
                v = kv_tile
            else:
                v = tl.load(kv_rows + offs_dv[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + dot(round_to(p, KV, DOT_MODE == 2), v, DOT_MODE)
        m_i = m_new

    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    # l != l: a NaN score (NaN in q or kv) reaches out and lse as it does in the reference, not hidden as "no keys".
    has_keys = (l_i > 0) | (l_i != l_i)
    if not LSE_ONLY:
        # Sink in the denominator only: out = acc / (l + 2^(sink*log2e - m)); empty rows (l == 0) give exactly 0.
        sink = tl.load(SINK + offs_h, mask=h_mask, other=0.0)
        denom = l_i + tl.exp2(sink * 1.4426950408889634 - m_safe)
        out = tl.where(has_keys[:, None], acc / denom[:, None], 0.0)
        if ROPE > 0:
            j, rot = rope_pairs(vb * BLOCK_DV, BLOCK_DV, D, ROPE)
            cos = tl.load(COS + t * ROPE + j, mask=rot, other=1.0)
            sin = tl.load(SIN + t * ROPE + j, mask=rot, other=0.0)
            out = rotate_pairs(out, cos[None, :], -sin[None, :], rot[None, :])
        tl.store(OUT + t * H * D + offs_h[:, None] * D + offs_dv[None, :], round_to(out, OUT, DOT_MODE == 2),
                 mask=h_mask[:, None])
    if vb == 0:
        lse = tl.where(has_keys, (m_safe + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(LSE + t * H + offs_h, lse, mask=h_mask)


@triton.jit
def _put_dkv(DKV, dkv, row_off, slot, valid, in_row, offs_c, D: tl.constexpr, DETERMINISTIC: tl.constexpr,
             RELAXED: tl.constexpr):
    """Columns ``offs_c`` of a tile's dKV rows: atomics into (N, D) at ``row_off``, or stores to buffer ``slot``."""
    if DETERMINISTIC:
        # Empty slots store their exact zeros too; the reduction never reads them.
        tl.store(DKV + slot[:, None] * D + offs_c[None, :], dkv, mask=in_row[:, None])
    elif RELAXED:
        # Nothing reads dKV before the kernel ends: relaxed order suffices (the default, acq_rel, also orders
        # each add against the program's other memory operations).
        tl.atomic_add(DKV + row_off + offs_c[None, :], dkv, mask=valid[:, None], sem="relaxed")
    else:
        tl.atomic_add(DKV + row_off + offs_c[None, :], dkv, mask=valid[:, None])


@triton.jit
def _load_do(DO, offs, h_mask, COS, SIN, t, col0, D: tl.constexpr, ROPE: tl.constexpr, DOT_MODE: tl.constexpr):
    """dO (BLOCK_H, W) at ``DO + offs`` (columns [col0, col0 + W) of row t), rotated forward where ROPE > 0 and
    rounded back to dO's dtype."""
    do = tl.load(DO + offs, mask=h_mask[:, None], other=0.0)
    if ROPE > 0:
        j, rot = rope_pairs(col0, do.shape[1], D, ROPE)
        cos = tl.load(COS + t * ROPE + j, mask=rot, other=1.0)
        sin = tl.load(SIN + t * ROPE + j, mask=rot, other=0.0)
        do = round_to(rotate_pairs(do.to(tl.float32), cos[None, :], sin[None, :], rot[None, :]), DO, DOT_MODE == 2)
    return do


@triton.jit
def _norm_backward_rows(Q, DQ, RSTD, COS, SIN, t, H, offs_h, h_mask, D: tl.constexpr, ROPE: tl.constexpr,
                        DOT_MODE: tl.constexpr):
    """The program's heads of row t of DQ, g (the gradient of q, as stored), replaced in place by the gradient of
    the query norm's input: ``rstd * R(-angle)(g - q * mean(g * q))`` (the mean is the same in either frame: a
    rotation keeps dot products; the RoPE channels turn by the output's angle, COS / SIN). In 64-column chunks read
    back from DQ and Q (this program's own rows, just written and read: cache hits), so the (heads, D) dq accumulator
    is no longer live (at D = 512 the whole tile corrected in registers added ~900 bytes of spills to the dq launch,
    offline sm_90 builds); g as stored (rounded), as the norm's own backward pass reads it."""
    CHUNK: tl.constexpr = 64 if D >= 64 else D
    row = t * H * D + offs_h[:, None] * D
    gq = tl.zeros([offs_h.shape[0]], tl.float32)
    for c0 in tl.static_range(0, D, CHUNK):
        offs = row + (c0 + tl.arange(0, CHUNK))[None, :]
        g = tl.load(DQ + offs, mask=h_mask[:, None], other=0.0).to(tl.float32)
        q = tl.load(Q + offs, mask=h_mask[:, None], other=0.0).to(tl.float32)
        gq += tl.sum(g * q, axis=1)
    mean = gq / D
    rstd = tl.load(RSTD + t * H + offs_h, mask=h_mask, other=0.0)
    for c0 in tl.static_range(0, D, CHUNK):
        offs = row + (c0 + tl.arange(0, CHUNK))[None, :]
        g = tl.load(DQ + offs, mask=h_mask[:, None], other=0.0).to(tl.float32)
        q = tl.load(Q + offs, mask=h_mask[:, None], other=0.0).to(tl.float32)
        dx = rstd[:, None] * (g - q * mean[:, None])
        if ROPE > 0 and c0 + CHUNK > D - 2 * ROPE:
            j, rot = rope_pairs(c0, CHUNK, D, ROPE)
            cos = tl.load(COS + t * ROPE + j, mask=rot, other=1.0)
            sin = tl.load(SIN + t * ROPE + j, mask=rot, other=0.0)
            dx = rotate_pairs(dx, cos[None, :], -sin[None, :], rot[None, :])
        tl.store(DQ + offs, round_to(dx, DQ, DOT_MODE == 2), mask=h_mask[:, None])


@triton.jit
def _sparse_attn_bwd_rows_kernel(
    Q, KV, IDX, NEND, DO, DENOM2, DELTA, DQ, DKV, COS, SIN, MASS, RSTD,
    H, K, ROWS, KT, OFF, scale, qk_scale_log2, ROPE: tl.constexpr,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_HB: tl.constexpr, DOT_MODE: tl.constexpr,
    DO_DQ: tl.constexpr, DO_DKV: tl.constexpr, DETERMINISTIC: tl.constexpr,
    RELAXED: tl.constexpr, DKV_BLOCK_D: tl.constexpr, DO_MASS: tl.constexpr = False, QNORM: tl.constexpr = False,
):
    # One program per (query row, head block) over all D columns: q, dO and Delta (rowsum(dO * out), formed by
    # the pre-pass) are loaded once, before the loop, and each gathered BLOCK_N x D kv tile is loaded once and serves
    # as the keys (s = q kv^T, dp = dO kv^T) and the values (dq += dz kv); its dKV rows get scale * dz^T q + p^T dO.
    # Which parts run is fixed per launch:
    #   DO_DQ       the loop accumulates dq (BLOCK_H x D fp32) and stores it.
    #   DO_DKV      the loop adds each tile's dKV rows: atomics into the (N, D) fp32 gradient, or with
    #               DETERMINISTIC plain stores into the (NUM_HB, ROWS, K, D) per-slot buffer (segment_sum.py).
    #               DKV_BLOCK_D < D forms the BLOCK_N x D dKV tile in column chunks, reading q and dO chunks
    #               again (L1 / L2 hits) instead of the hoisted tiles: fewer registers and less shared memory.
    # ROPE > 0 (the forward rotated its output back, output_rope): dO arrives in that frame and is rotated forward
    # (+angle) as it is loaded, rounded to its dtype (COS / SIN: (ROWS, ROPE) fp32 tables of these rows).
    # DO_MASS: also stores the head block's sum of p over slots OFF .. OFF + KT (the sparse indexer KL's teacher
    # mass) into its plane of MASS (ROWS, NUM_HB, KT) fp32; tiles past the row's last valid slot are not visited
    # (the caller's zeros stay there).
    # QNORM (the query_norm of the op): q is qnorm_rope(x) with RSTD (ROWS, H) fp32 its rstd, and DQ receives the
    # gradient of x: after dq is stored, the program applies the norm's backward to its own rows
    # (:func:`_norm_backward_rows`) instead of a pass of its own over all of dq and q after the kernel.
    pid = tl.program_id(0)
    hb = pid % NUM_HB
    t = (pid // NUM_HB).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    head_off = t * H * D + offs_h[:, None] * D + offs_d[None, :]
    q_all = tl.load(Q + head_off, mask=h_mask[:, None], other=0.0)
    do_all = _load_do(DO, head_off, h_mask, COS, SIN, t, 0, D, ROPE, DOT_MODE)
    # log2 of the full denominator logaddexp(lse, sink); padded heads get p = 0 through the mask below.
    denom2 = tl.load(DENOM2 + t * H + offs_h, mask=h_mask, other=0.0)

    delta = tl.load(DELTA + t * H + offs_h, mask=h_mask, other=0.0)

    if DO_DQ or DO_DKV:
        if DO_DQ:
            dq = tl.zeros([BLOCK_H, D], tl.float32)
        # Up to the tile of the row's last valid slot (NEND): in the deterministic mode the buffer's slots of the tiles
        # after it stay unwritten, and the key-by-key reduction reads valid slots only.
        for start in range(0, tl.load(NEND + t), BLOCK_N):
            n = start + offs_n
            idx = tl.load(IDX + t * K + n, mask=n < K, other=-1)
            valid = idx >= 0
            row_off = tl.where(valid, idx, 0).to(tl.int64)[:, None] * D
            # No load mask: empty slots read row 0 (kv has >= 1 row) and get p = 0.
            kv_tile = tl.load(KV + row_off + offs_d[None, :])
            s = dot(q_all, tl.trans(kv_tile), DOT_MODE)
            dp = dot(do_all, tl.trans(kv_tile), DOT_MODE)
            live = h_mask[:, None] & valid[None, :]
            p = tl.where(live, tl.exp2(s * qk_scale_log2 - denom2[:, None]), 0.0)
            if DO_MASS:
                j = n - OFF
                tl.store(MASS + (t * NUM_HB + hb) * KT + j, tl.sum(p, 0), mask=(j >= 0) & (j < KT))
            dz = p * (dp - delta[:, None])
            if DO_DQ:
                dq += dot(round_to(dz, KV, DOT_MODE == 2), kv_tile, DOT_MODE)
            if DO_DKV:
                # Operands rounded to the input dtype: bf16(scale * dz)^T q + bf16(p)^T dO, fp32 sums.
                dz_t = round_to(tl.trans(dz * scale), KV, DOT_MODE == 2)
                p_t = round_to(tl.trans(p), KV, DOT_MODE == 2)
                slot = (hb * ROWS + t) * K + n
                if DKV_BLOCK_D == D:
                    dkv = dot(dz_t, q_all, DOT_MODE)
                    dkv += dot(p_t, do_all, DOT_MODE)
                    _put_dkv(DKV, dkv, row_off, slot, valid, n < K, offs_d, D, DETERMINISTIC, RELAXED)
                else:
                    for c0 in tl.static_range(0, D, DKV_BLOCK_D):
                        offs_c = c0 + tl.arange(0, DKV_BLOCK_D)
                        chunk_off = t * H * D + offs_h[:, None] * D + offs_c[None, :]
                        q_c = tl.load(Q + chunk_off, mask=h_mask[:, None], other=0.0)
                        do_c = _load_do(DO, chunk_off, h_mask, COS, SIN, t, c0, D, ROPE, DOT_MODE)
                        dkv = dot(dz_t, q_c, DOT_MODE)
                        dkv += dot(p_t, do_c, DOT_MODE)
                        _put_dkv(DKV, dkv, row_off, slot, valid, n < K, offs_c, D, DETERMINISTIC, RELAXED)
        if DO_DQ:
            tl.store(DQ + head_off, round_to(dq * scale, DQ, DOT_MODE == 2), mask=h_mask[:, None])
            if QNORM:
                tl.debug_barrier()              # the other threads' dq columns, read back below
                _norm_backward_rows(Q, DQ, RSTD, COS, SIN, t, H, offs_h, h_mask, D, ROPE, DOT_MODE)


def _block_h(H: int) -> int:
    # tl.dot needs M >= 16; 64 heads per block matches the V4 case (H = 64) and FlashMLA's tiles.
    return min(64, max(16, triton.next_power_of_2(H)))


def _launch_args(q: torch.Tensor, config: dict):
    T, H, D = q.shape
    cfg = dict(config)
    launch = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
    block_h = cfg.pop("BLOCK_H", None) or _block_h(H)      # benchmarks may force it (e.g. 128 heads per block)
    num_hb = triton.cdiv(H, block_h)
    grid = (T * num_hb * (D // cfg.get("BLOCK_DV", D)),)       # row layouts have no value slices
    mode = dot_mode(q.dtype)
    meta = dict(D=D, BLOCK_H=block_h, NUM_HB=num_hb, DOT_MODE=mode, **cfg)
    return grid, meta, launch


def _smaller(config: dict) -> dict | None:
    """Next configuration to try after a shared-memory overflow: fewer stages first, then (backward row kernel)
    narrower dKV column chunks, then fewer rows per step."""
    if config["num_stages"] > 1:
        return dict(config, num_stages=config["num_stages"] - 1)
    if config.get("DO_DKV") and config["DKV_BLOCK_D"] > 128:       # backward row kernel: chunk the dKV tile
        return dict(config, DKV_BLOCK_D=config["DKV_BLOCK_D"] // 2)
    if config["BLOCK_N"] > 16:
        return dict(config, BLOCK_N=config["BLOCK_N"] // 2)
    return None


# Launches that ran with a smaller configuration than requested on this GPU: label -> (requested, launched).
# Benchmarks print it, so that a timed configuration is never mistaken for the one that actually ran.
SHRUNK: dict = {}
# (kernel, requested config, dtype, H, D) -> the configuration that fitted, so a later call skips failed attempts
# (each costs a launch attempt; the deterministic backward launches once per row chunk).
_FITTED: dict = {}


def _launch(kernel, grid_of, q, config: dict, args: tuple):
    """Launch ``kernel``, shrinking ``config`` if this GPU's shared memory is too small for it."""
    key = (id(kernel), tuple(sorted(config.items())), q.dtype, q.shape[1], q.shape[2])

    def launch(cfg):
        grid, meta, launch_kw = _launch_args(q, cfg)
        kernel[grid_of(grid, meta)](*args, **meta, **launch_kw)

    fitted = launch_fitting(launch, _FITTED.get(key, config), _smaller)
    if fitted is not config:
        _FITTED[key] = fitted
        passes = "+".join(k for k in ("DO_DQ", "DO_DKV") if fitted.get(k))
        SHRUNK[f"{getattr(getattr(kernel, 'fn', kernel), '__name__', type(kernel).__name__)} {passes}"] = (
            config, fitted)


def forward_kernel(q: torch.Tensor, config: dict | None = None) -> str:
    """Which forward runs for ``q``: ``config["KERNEL"]`` if given; a config without that key is a Triton tile
    config (FWD_CONFIGS keys); with no config, :mod:`dsv4attn.variants` ("auto": the Gluon Hopper kernel where
    :func:`.gluon_hopper.check` allows and it has not failed to build for this D and dtype, the Triton kernel
    elsewhere)."""
    request = config.get("KERNEL", "triton") if config else None
    return variants.choose("sparse_attention", "forward", (q.shape[2], q.dtype), q, request=request)


def _tables(q: torch.Tensor, rope):
    """(COS, SIN, ROPE) kernel arguments of the output rotation ``rope`` ((T, R/2) fp32 cos and sin, or None):
    with none, q stands in for the tables (never read: ROPE = 0), so no empty tensor's null pointer is handed over."""
    return (q, q, 0) if rope is None else (rope[0], rope[1], rope[0].shape[1])


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor):
    """(T, R/2) fp32 cos and sin of the output rotation, from float64 angles (the reference's values)."""
    cos, sin = rope_cos_sin(positions, inv_freq, torch.float32)
    return cos.contiguous(), sin.contiguous()


def _sparse_attn_fwd(q, kv, idx, sink, scale, config=None, rope=None):
    """q (T, H, D), kv (N, D), idx (T, K) int32, sink (H,) fp32 -> out (T, H, D) q.dtype, lse (T, H) fp32.
    ``rope``: None or the (T, R/2) fp32 (cos, sin) tables of the output's inverse RoPE (:func:`rope_tables`)."""
    T, H, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    if kv.shape[0] == 0:                       # every slot is empty; the kernels still read row 0 of kv
        kv = kv.new_zeros(1, D)
    rest = {k: v for k, v in (config or {}).items() if k != "KERNEL"}
    if forward_kernel(q, config) == "gluon":
        try:
            gluon_hopper.launch_fwd(q, kv, idx, sink, out, lse, scale, rest, rope)
            return out, lse
        except Exception as exc:
            if variants.strict(config.get("KERNEL") if config else None):   # "gluon" asked for: raise
                raise
            variants.note_gluon_build_failure(exc, "sparse_attention", "forward", (D, q.dtype),
                                              "using the Triton kernel")
            rest = {}
    cos, sin, pairs = _tables(q, rope)
    _launch(_sparse_attn_fwd_kernel, lambda grid, meta: grid, q, rest or FWD_CONFIGS[D],
            (q, kv, idx, row_ends(idx), sink, out, lse, cos, sin, H, idx.shape[1], scale * LOG2E, pairs))
    return out, lse


@triton.jit
def _delta_from_out_kernel(OUT, DO, DELTA, ROWS, D: tl.constexpr, BLOCK_R: tl.constexpr):
    # Delta = rowsum(dO * out) in fp32 over BLOCK_R of the T * H (row, head) vectors. With the output rotation
    # (output_rope) out and dO are both in the rotated frame: a rotation keeps dot products, so Delta is the same.
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    mask = (r < ROWS)[:, None]
    o = tl.load(OUT + r[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(DO + r[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + r, tl.sum(o * g, 1), mask=r < ROWS)


def _delta_from_out(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """(T, H) fp32 rowsum(dO * out) over D, from the output the forward saved, in its dtype (one read of each)."""
    T, H, D = out.shape
    delta = torch.empty(T, H, dtype=torch.float32, device=out.device)
    rows = T * H
    if rows:
        block_r = max(1, min(64, 8192 // D))
        _delta_from_out_kernel[(triton.cdiv(rows, block_r),)](out, grad_out, delta, rows, D=D, BLOCK_R=block_r,
                                                              num_warps=4)
    return delta


def backward_kernel(q: torch.Tensor) -> str:
    """Which backward runs for ``q``: "gluon" (the one-pass SM90 kernel, Delta from the saved output) where
    :func:`.gluon_hopper_bwd.check` allows, :mod:`dsv4attn.variants` does not keep Gluon out and the kernel has not
    failed to build for this D and dtype; "triton" (the Triton passes) elsewhere. Both have a deterministic mode."""
    return variants.choose("sparse_attention", "backward", (q.shape[2], q.dtype), q)


def _sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, config=None, deterministic=False, rope=None,
                     mass_slots=None, query_rstd=None):
    """Returns dq (T, H, D) q.dtype, dkv (N, D) fp32, d_sink (H,) fp32; with ``mass_slots = (offset, width)`` also,
    fourth, the (T, width) fp32 head-summed probabilities of slots offset .. offset + width (the sparse indexer KL's
    teacher mass, :func:`.reference.reference_backward`'s), formed by either backward kernel from its probabilities.

    ``out``: the forward's output (T, H, D), in its dtype: Delta = rowsum(dO * out) comes from it in both backwards.
    ``rope``: the (cos, sin) tables when the forward rotated its output (``out`` and ``grad_out`` in that frame):
    the kernels rotate dO forward as they load it (the gradient of the attention's own output, rounded to its dtype).
    ``config``: a BWD_CONFIGS-style dict (its ``LAYOUT`` picks the Triton launches; a config forces the Triton
    kernel); ``deterministic``: no float atomics, bitwise-identical results for identical inputs (module docstring).
    ``query_rstd``: (T, H) fp32, q is ``qnorm_rope(x)`` with that rstd and the rotation of ``rope`` (none without):
    the first result is then the gradient of x (the Triton kernel's dq epilogue applies the norm's backward; after
    the Gluon kernel, :func:`dsv4attn.ops.qnorm_rope.triton._qnorm_rope_bwd` on its dq, a pass of its own).
    """
    T, H, D = q.shape
    gluon = T > 0 and config is None and backward_kernel(q) == "gluon"
    mass = None
    if mass_slots is not None:                  # checked before any work
        check_mass_slots(mass_slots, idx.shape[1])
    denom = torch.logaddexp(lse, sink[None, :])                 # full denominator, includes the sink
    denom2 = (denom * LOG2E).contiguous()
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    delta = _delta_from_out(out, grad_out)
    if T > 0:
        ran_gluon, mass = _gluon_bwd(q, kv, idx, grad_out, denom2, delta, dq, dkv, scale, rope, deterministic,
                                     mass_slots) if gluon else (False, None)
        if not ran_gluon:
            config = dict(config or BWD_CONFIGS[D])
            layout = config.pop("LAYOUT", None)
            if not isinstance(layout, BwdLayout):
                raise TypeError(f"backward config LAYOUT must be a BwdLayout (FUSED or SPLIT), got {layout!r}")
            mass = _rows_bwd(q, kv, idx, grad_out, denom2, delta, dq, dkv, scale, config, deterministic, layout,
                             rope, mass_slots, query_rstd)
        elif query_rstd is not None:
            # The Gluon kernel has no norm epilogue yet: the norm's backward as a pass of its own.
            cos, sin = rope if rope is not None else (q.new_empty(T, 0, dtype=torch.float32),) * 2
            dq = qnorm_rope_kernels._qnorm_rope_bwd(dq, q, query_rstd, cos, sin)
    # d_sink = -sum_t p_sink * Delta; p_sink = 0 where the sink is -inf (also on empty rows, where denom = -inf).
    p_sink = torch.where(denom == float("-inf"), 0.0, torch.exp(sink[None, :] - denom))
    d_sink = -(p_sink * delta).sum(0)
    if mass_slots is None:
        return dq, dkv, d_sink
    if mass is None:                            # T = 0: no launch, the empty result
        mass = torch.zeros(T, mass_slots[1], dtype=torch.float32, device=q.device)
    return dq, dkv, d_sink, mass


def _gluon_bwd(q, kv, idx, grad_out, denom2, delta, dq, dkv, scale, rope=None, deterministic=False,
               mass_slots=None) -> tuple[bool, torch.Tensor | None]:
    """The one-pass Gluon backward into ``dq`` and ``dkv``: (True, the teacher mass of ``mass_slots`` or None), or
    (False, None) if this Triton cannot build the kernel (warned once per D and dtype; the caller then runs the
    Triton kernel). ``deterministic``: dKV through the per-slot buffer, in chunks of rows sized as the Triton
    kernel's."""
    kv_read = kv if kv.shape[0] > 0 else kv.new_zeros(1, q.shape[2])   # empty slots are never read
    T, H, D = q.shape
    rows = _deterministic_rows(T, H // gluon_hopper_bwd.BLOCK_H, idx.shape[1], D) if deterministic else None
    try:
        mass = gluon_hopper_bwd.launch(q, grad_out, kv_read, idx, denom2, delta, dq, dkv, scale, rope=rope,
                                       deterministic_rows=rows, mass_slots=mass_slots)
    except Exception as exc:
        if variants.strict():
            raise
        # Keyed by (D, dtype) only: the deterministic and mass forms are the same source with plain stores in place
        # of the reductions or one more store, so a build failure of any form is taken as this Triton not building
        # the kernel (the offline build tests cover each form on every supported Triton).
        variants.note_gluon_build_failure(exc, "sparse_attention", "backward", (q.shape[2], q.dtype),
                                          "using the Triton backward")
        dkv.zero_()
        return False, None
    return True, mass


def _deterministic_rows(T: int, num_hb: int, K: int, D: int) -> int:
    """Query rows per launch of a deterministic dKV pass: the per-slot buffer stays within the budget."""
    return max(1, min(T, DETERMINISTIC_BUFFER_ELEMENTS // max(1, num_hb * K * D)))


def _rows_bwd(q, kv, idx, grad_out, denom2, delta, dq, dkv, scale, config, deterministic, layout: BwdLayout,
              rope=None, mass_slots=None, query_rstd=None):
    """The launches of ``layout`` (:func:`_sparse_attn_bwd_rows_kernel`), in order. ``mass_slots = (offset,
    width)``: the launch that forms dq also stores each head block's sum of p over those slots; returns their sum
    over head blocks, (T, width) fp32 (None without ``mass_slots``). ``query_rstd``: that launch writes the gradient
    of the normalised query's input instead of dq (the kernel's QNORM)."""
    T, H, D = q.shape
    cos, sin, pairs = _tables(q, rope)
    K = idx.shape[1]
    kv_read = kv if kv.shape[0] > 0 else kv.new_zeros(1, D)    # empty slots read row 0 (never used, never written)
    n_end = row_ends(idx)
    overrides = {name: config.pop(name) for name in list(config) if isinstance(config[name], dict)}
    planes = None
    offset, width = mass_slots if mass_slots is not None else (0, 0)
    for parts, name in zip(layout.passes, layout.names()):
        cfg = dict(config, **overrides.get(name, {}))
        cfg.update(DO_DQ="DQ" in parts, DO_DKV="DKV" in parts,
                   RELAXED=bool(cfg.get("RELAXED", False)), DKV_BLOCK_D=min(D, cfg.get("DKV_BLOCK_D", D)))
        num_hb = triton.cdiv(H, cfg.get("BLOCK_H") or _block_h(H))         # as _launch_args computes it
        if mass_slots is not None and "DQ" in parts:
            # One plane per head block (plain stores, no atomics: the sum over blocks below is in a fixed order);
            # zeros where the loop stops early (past a row's last valid slot).
            planes = torch.zeros(T, num_hb, width, dtype=torch.float32, device=q.device)
            cfg.update(DO_MASS=True)
        mass_arg = planes if cfg.get("DO_MASS") else denom2       # never touched without DO_MASS
        if query_rstd is not None and "DQ" in parts:
            cfg.update(QNORM=True)
        rstd_arg = query_rstd if cfg.get("QNORM") else denom2      # never touched without QNORM

        def launch(s, e, buf, det):
            cfg_det = dict(cfg, DETERMINISTIC=det)
            _launch(_sparse_attn_bwd_rows_kernel, lambda grid, meta: grid, q[s:e], cfg_det,
                    (q[s:e], kv_read, idx[s:e], n_end[s:e], grad_out[s:e], denom2[s:e], delta[s:e], dq[s:e], buf,
                     cos[s:e], sin[s:e], mass_arg[s:e], rstd_arg[s:e], H, K, e - s, width, offset, scale,
                     scale * LOG2E, pairs))

        if "DKV" in parts and deterministic:
            rows = _deterministic_rows(T, num_hb, K, D)
            buf = torch.empty(max(1, num_hb * rows * K * D), dtype=torch.float32, device=q.device)
            # Chunks run in row order and each adds its per-key sums in a fixed order: the result depends on the
            # inputs and on ``rows`` only. Row slices are views, so the kernel sees chunk-local row numbers.
            for s in range(0, T, rows):
                e = min(s + rows, T)
                launch(s, e, buf, True)
                add_rows_by_key(dkv, idx[s:e], buf, num_hb)
        else:
            launch(0, T, dkv, False)
    return None if planes is None else planes.sum(1)


def kernel_supports(q: torch.Tensor) -> bool:
    """Whether the kernels take ``q``'s dtype and head dim (otherwise the reference runs: see below)."""
    return q.dtype in KERNEL_DTYPES and q.shape[-1] in SUPPORTED_D


def triton_forward(q, kv, idx, attn_sink, scale: float, rope=None):
    """The registered op's forward on this backend: idx (T, K) int (-1 = empty) -> out (T, H, D), lse (T, H) fp32.
    ``rope``: None or (positions, inv_freq) of the output's inverse RoPE."""
    q, kv = q.contiguous(), kv.contiguous()
    idx = idx.to(torch.int32).contiguous()
    tables = None if rope is None else rope_tables(*rope)
    return _sparse_attn_fwd(q, kv, idx, attn_sink.float().contiguous(), scale, rope=tables)


def triton_backward(grad_out, q, kv, idx, attn_sink, out, lse, scale: float, deterministic: bool, rope=None,
                    mass_slots=None, query_rstd=None):
    """The registered op's backward on this backend: dq ``q.dtype``, dkv ``kv.dtype``, d_sink ``attn_sink.dtype``;
    with ``mass_slots = (offset, width)`` also the (T, width) fp32 teacher mass (:func:`_sparse_attn_bwd`); with
    ``query_rstd`` (T, H) fp32 the first result is the gradient of the query norm's input (:func:`_sparse_attn_bwd`)."""
    q, kv = q.contiguous(), kv.contiguous()
    idx = idx.to(torch.int32).contiguous()
    grad_out = torch.zeros_like(q) if grad_out is None else grad_out.to(q.dtype).contiguous()
    tables = None if rope is None else rope_tables(*rope)
    dq, dkv, d_sink, *mass = _sparse_attn_bwd(q, kv, idx, attn_sink.float().contiguous(), out.contiguous(),
                                              lse.contiguous(), grad_out, scale, deterministic=deterministic,
                                              rope=tables, mass_slots=mass_slots,
                                              query_rstd=None if query_rstd is None else query_rstd.contiguous())
    return (dq, dkv.to(kv.dtype), d_sink.to(attn_sink.dtype), *mass)


def triton_lse(q, kv, idx, scale: float) -> torch.Tensor:
    """The registered lse op on this backend: idx (T, K) int (-1 = empty) -> lse (T, H) fp32, scores only (no P V, no
    output): on SM90 the Gluon teacher-LSE kernel where :mod:`dsv4attn.variants` chooses it; otherwise, or where it
    cannot be built (warned once), the Triton forward kernel in its LSE_ONLY form."""
    q, kv = q.contiguous(), kv.contiguous()
    idx = idx.to(torch.int32).contiguous()
    T, H, D = q.shape
    if T == 0 or kv.shape[0] == 0:             # no key anywhere: every row is empty
        return torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    key = (D, q.dtype)
    if variants.choose("sparse_attention", "lse", key, q) == "gluon":
        try:
            return gluon_hopper.teacher_lse(q, kv, idx, scale)
        except Exception as exc:
            if variants.strict():
                raise
            variants.note_gluon_build_failure(exc, "sparse_attention", "lse", key,
                                              "using the Triton forward kernel's LSE_ONLY form")
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    cos, sin, pairs = _tables(q, None)
    # q stands in for the output and the sink, never touched (LSE_ONLY); one program per row and head block.
    _launch(_sparse_attn_fwd_kernel, lambda grid, meta: grid, q, dict(FWD_CONFIGS[D], BLOCK_DV=D, LSE_ONLY=True),
            (q, kv, idx, row_ends(idx), q, q, lse, cos, sin, H, idx.shape[1], scale * LOG2E, pairs))
    return lse


def sparse_attention_triton(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor | IndexSet,
                            attn_sink: torch.Tensor, scale: float, *, topk_length: torch.Tensor | None = None,
                            deterministic: bool = False, output_rope=None, mass_probe=None, mass_offset: int = 0,
                            query_norm=None):
    """Triton implementation behind :func:`dsv4attn.ops.sparse_attention` (arguments already checked).

    Args:
        q: (T, H, D) queries, fp16/bf16/fp32; D in {64, 128, 256, 512}; any H.
        kv: (N, D) the single shared KV head, same dtype as ``q`` (keys == values).
        indices: (T, K) int rows of ``kv`` (-1 = empty) or an :class:`IndexSet` of width K (materialised one chunk
            of query rows at a time).
        attn_sink: (H,) per-head sink logit, fp32 (fp64 accepted; its gradient keeps its dtype).
        scale: softmax scale.
        topk_length: optional (T,) slot counts per row (FlashMLA's ``topk_length``).
        deterministic: backward without float atomics (bitwise repeatable).
        output_rope: None or (positions, inv_freq): the output's inverse RoPE, in the forward's epilogue.
        mass_probe, mass_offset: the teacher mass's channel (:func:`dsv4attn.ops.sparse_attention`).
        query_norm: None or (x, rstd): the gradient goes to the query norm's input x
            (:func:`dsv4attn.ops.sparse_attention`).
    Returns:
        out (T, H, D) ``q.dtype`` (0 for rows without a valid index) and lse (T, H) fp32, natural log, excluding
        the sink, ``-inf`` for empty rows. Differentiable in q, kv and attn_sink.

    float64 inputs (the kernels have no fp64 path), head dims outside {64, 128, 256, 512} and an empty ``kv``
    **fall back to the reference implementation** rather than raising, so float64 checks keep working on any
    backend.
    """
    impl = "triton" if kernel_supports(q) and kv.shape[0] > 0 else "reference"
    return run(q, kv, indices, attn_sink, float(scale), topk_length, deterministic, impl, output_rope, mass_probe,
               mass_offset, query_norm)


variants.register(
    "sparse_attention", "forward",
    variants.Variant("gluon", "sparse-attention forward kernel (_sparse_attn_fwd_gluon)",
                     lambda q: gluon_hopper.check(q), sm90),
    variants.Variant("triton", "sparse-attention forward kernel (_sparse_attn_fwd_kernel)", variants.always,
                     variants.always))
variants.register(
    "sparse_attention", "backward",
    variants.Variant("gluon", "sparse-attention backward kernel (_sparse_attn_bwd_gluon)",
                     lambda q: gluon_hopper_bwd.check(q), sm90),
    variants.Variant("triton", "sparse-attention backward kernel (_sparse_attn_bwd_rows_kernel)", variants.always,
                     variants.always))
variants.register(
    "sparse_attention", "lse",
    variants.Variant("gluon", "teacher LSE kernel (_teacher_lse_gluon: scores only)", lambda q: gluon_hopper.check(q),
                     sm90),
    variants.Variant("triton", "sparse-attention forward kernel, scores and lse only (_sparse_attn_fwd_kernel "
                     "LSE_ONLY)", variants.always, variants.always))
register_triton(kernel_supports, triton_forward, triton_backward, triton_lse)
backend.register_kernel("sparse_attention", sparse_attention_triton)

__all__ = ["sparse_attention_triton", "kernel_supports", "triton_forward", "triton_backward", "triton_lse", "BwdLayout",
           "FUSED", "SPLIT"]

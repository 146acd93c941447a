"""Triton kernels for the indexer KL loss (docs/semantics.md, decision 7), forward and backward.

Same contract as :func:`.reference.indexer_kl_reference`. For query row t, candidate slots j (``S_t``, -1 = empty),
main heads h and index heads g::

    s_h(j) = scale * <q[t, h], C_j>                 L_h = logaddexp(outside_lse[t, h], logsumexp_j s_h(j))
    mass(j) = sum_h exp(s_h(j) - L_h)               Z = sum_j mass(j) = sum_h exp(logsumexp_j s_h(j) - L_h)
    T(j) = mass(j) / max(Z, FLT_MIN)                I(j) = sum_g w[t, g] relu(<qi[t, g], ki_j>)
    KL_t = sum_j T(j) (log T(j) - log softmax_j I(j))
    dKL_t / dI(j) = Q(j) * sum_j T - T(j)           (the reference's closed form; sum_j T = Z / max(Z, FLT_MIN))

Z needs only the per-head LSEs (second form), so it is known before any T(j) is formed.

Forward, one program per query row (programs in row order: neighbouring rows share most candidates, in L2):

- *Two-pass form* (``outside_lse`` given): candidates in blocks of ``BLOCK_N``, all main heads in one tile, the
  index heads in blocks of ``BLOCK_HI``; pass 1 keeps online per-head LSEs (teacher) and per-lane online LSEs
  (student), pass 2 recomputes the logits and forms T, the KL terms and dKL/dI (the teacher mass from natural-log
  logits and L, as the full form and the recomputing backward form it: saved and recomputed dKL/dI agree). Memory
  stays linear in T (the candidate rows are handled one chunk of query rows at a time, see
  :func:`indexer_kl_triton`).

*Full-denominator form* (``full``: each head's L_h is given, e.g. the attention's logaddexp(lse, sink)): one
program per row, one pass forming I(j) with its online LSE and mass(j) from natural-log logits with Z, storing
mass(j) and I(j) to (rows, K) fp32 rows (scratch unless saved; one chunk's worth), then a GEMM-free pass summing
the KL terms with the LSE and Z known; on SM90 mass(j) can come from a Gluon kernel (``gluon_hopper.teacher_mass``).

*Gluon teacher* (SM90, both paths below, :func:`_teacher_forward`): per chunk of rows, with ``outside_lse`` given (the
warm-up's every visible entry) ``gluon_hopper.teacher_lse`` forms each head's LSE over the candidates, ``logaddexp``
with ``outside_lse`` gives L_h, and ``teacher_mass`` the mass; with ``full`` only the mass. The full-denominator form
then runs on them (tensor cores for the H x D teacher logits instead of the two-pass form's two Triton passes: 457 ->
241 ms for a warm-up CSA layer at 32K, BENCHMARKS.md). Through the ranges ops (the warm-up) the student's logits
come from the indexer's score kernel (:class:`StudentRanges`; its int32 orders, decoded by the KL kernel as it loads
them, ``SCORE_ORDERS``) instead of the KL kernel's per-row dots. Where dKL/dI is not saved (below) the backward
forms the mass (and those logits) again per chunk (then dKL/dI from the forward kernel, then the saved-gradient
backward), whichever form the forward ran.
Only a Gluon kernel's own error falls back to the Triton teacher (a build failure warns once; other errors
propagate); an error of the Triton KL kernels is never taken for one.

The forward saves dKL/dI per slot, ``G(j) = Q(j) sum T - T(j)`` (fp32, (T, K)), when K <= ``SAVE_G_MAX_WIDTH`` or T K
4 <= ``SAVE_G_BUDGET`` bytes, so that the backward does not recompute the teacher (the bulk of the work: H x D per
candidate against Hi x Di for the student). Otherwise it saves per-row statistics (each head's full denominator as the
natural-log L, whichever form ran; the student's LSE, the floored Z and sum T) and the backward forms T(j) again: on
SM90 per chunk with the Gluon teacher (as above), elsewhere block by block in the Triton backward kernel (the same
mass formula as the forward).

Backward, one program per query row: recompute the student dots x[g, j] = <qi[t, g], ki_j>, take
``dI = grad_kl[t] * G``, then ``d index_weights[t, g] = sum_j dI relu(x)``, ``dx = dI w[t, g] 1[x > 0]``,
``d index_q[t] = dx @ ki`` (registers) and ``d index_k[j] += dx^T qi[t]`` with **fp32 atomic adds** into a fp32
(Nc, Di) buffer (first version: simple, but the order of the adds varies, so d index_k differs from run to run in
its last bits, and atomics are likely what bounds the backward at long T).

Precision: logits, scores, LSEs and KL in fp32. bf16/fp16 operands feed the tensor cores with fp32 accumulation;
fp32 operands are multiplied in true fp32 (``input_precision="ieee"``, never tf32). In the backward the fp32 ``dx``
enters the two gradient matmuls rounded to the input dtype, as flash-attention rounds dS and as the reference does
(a hi + lo pair of bf16 parts cost the Gluon backward 1.18-1.23x; BENCHMARKS.md). float64 inputs fall back to the
reference. No device->host sync: widths are host ints, per-row bounds stay on the device.

Two pairs of registered custom ops (``register_fake`` + ``register_autograd``: gradients to index_q, index_k and
index_weights only), so that ``torch.compile(fullgraph=True)`` sees one opaque node per direction, in eager and
compiled code alike, and CUDA graphs can capture them:

- ``torch.ops.dsv4attn.indexer_kl`` / ``indexer_kl_backward`` take materialised (T, K) candidates
  (:class:`Explicit`: the sparse phase's top-k);
- ``torch.ops.dsv4attn.indexer_kl_ranges`` / ``indexer_kl_ranges_backward`` take the warm-up's every visible entry
  (:class:`VisibleCompressed`, or the :class:`Rows` / :class:`Stack` views context parallelism makes of it: up to
  ``max_seqlen // 4`` slots a row) as per-row contiguous ranges (``index_sets.contiguous_ranges``: (T,) first entry
  and count, an optional entry table, a shift). Each direction materialises the slots one chunk of query rows at a
  time and the op saves only the (T,) ranges, so memory stays linear in T (a (T, K) int32 candidate tensor would be
  T^2 / 4 bytes: 1 GiB at T = 32K, 64 GiB at 256K).

Other lazy index sets are materialised whole and take the first pair. Both pairs run the same helpers over row chunks
of the same size; where the Gluon teacher runs, the ranges pair takes the student's logits from the indexer's score
kernel and the other pair forms them in the KL kernel, so the two agree up to fp32 rounding (bit for bit otherwise).
The kernels need a CUDA device, or the CPU interpreter (``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from ... import backend, variants
from ..gluon_common import sm90
from ..sparse_attention import gluon_hopper
from . import gluon_hopper as gluon_kl
from ..triton_common import dot, dot_mode, launch_fitting, round_to
from ..index_sets import Explicit, IndexSet, chunk_rows, contiguous_ranges, range_part_starts, row_ends
from ..indexer import triton as indexer_triton
from .reference import FLT_MIN, indexer_kl_reference

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Forward tiles. BLOCK_N: candidates per step; BLOCK_HI: index heads per student tile (every main head is in one
# tile); BLOCK_D: contraction chunk of the teacher logits.
# GIVEN_BLOCK_N: BLOCK_N of the full form when both the teacher mass and the student logits are given (no dot then:
# the kernel only streams I(j) and m(j)), wide so that each of the program's 256 threads holds its own slots (with
# 64, a warm-up row of 8192 slots took 2 x 128 short steps; BENCHMARKS.md, twenty-first session).
FWD_CONFIG = dict(BLOCK_N=64, BLOCK_HI=64, BLOCK_D=64, GIVEN_BLOCK_N=1024, num_warps=8, num_stages=2)
# Backward tiles: every index head in one tile (d index_q accumulates in registers), BLOCK_N candidates per step.
# KERNEL: the saved-gradient backward (the sparse phase), "auto" (:mod:`dsv4attn.variants`: the SM90 Gluon kernel of
# :mod:`.gluon_hopper` where it applies, bf16/fp16, 64 index heads of 128), "gluon" or "triton" (the Triton kernel).
BWD_CONFIG = dict(BLOCK_N=64, BLOCK_D=64, num_warps=8, num_stages=2, KERNEL="auto")
# The forward saves dKL/dI (fp32, 4 bytes per slot) for the backward when its rows are at most SAVE_G_MAX_WIDTH
# wide (the sparse phase's top-k: linear in T) or the whole (T, K) buffer takes at most SAVE_G_BUDGET bytes (the
# warm-up's every visible entry of a document up to 32K tokens: 1 GiB); otherwise the backward forms the teacher
# mass and the student's logits again, chunk by chunk (memory linear in T; at 32K ~25 ms more, BENCHMARKS.md).
SAVE_G_MAX_WIDTH = 1024
SAVE_G_BUDGET = 1 << 30
# The Gluon backward takes the warm-up's rows in pairs (gluon_hopper.launch_bwd_pairs: half the d index_k reductions)
# where rows are at least PAIRS_MIN_WIDTH slots wide (documents of 4096 tokens and longer); at 512 slots the pairs'
# per-tile hand-over between the consumers costs more than the reductions it saves (BENCHMARKS.md).
PAIRS_MIN_WIDTH = 1024
# int32 candidate slots materialised per chunk of query rows (the sparse phase at T = 32K, K = 512: one chunk).
INDEX_BUDGET = 1 << 25
# int64 keys of the select kernel's scratch held at once when the KL forward selects the warm-up's top-k
# (``select_topk``): 64 MiB at most, beside the chunk's own (rows, K) buffers.
SELECT_SCRATCH = 1 << 23
# The order in which the ops' ``fwd_tiles`` / ``bwd_tiles`` arguments list a config (custom op schemas take no dicts).
FWD_KEYS = ("BLOCK_N", "BLOCK_HI", "BLOCK_D", "GIVEN_BLOCK_N", "num_warps", "num_stages")
BWD_KEYS = ("BLOCK_N", "BLOCK_D", "num_warps", "num_stages", "KERNEL")


@triton.jit
def _load_slots(IDX, t, K, start, BLOCK_N: tl.constexpr):
    """Slots start .. start+BLOCK_N of row t: (slot numbers, valid mask, key rows with empty slots at row 0)."""
    n = start + tl.arange(0, BLOCK_N)
    idx = tl.load(IDX + t * K + n, mask=n < K, other=-1)
    valid = idx >= 0
    return n, valid, tl.where(valid, idx, 0).to(tl.int64)


@triton.jit
def _load_keys(KI, rows, valid, Di: tl.constexpr, BLOCK_DI: tl.constexpr):
    offs_di = tl.arange(0, BLOCK_DI)
    return tl.load(KI + rows[:, None] * Di + offs_di[None, :], mask=valid[:, None] & (offs_di < Di)[None, :],
                   other=0.0)


@triton.jit
def _student_scores2(QI, W, ki, t, valid, Hi: tl.constexpr, Di: tl.constexpr, BLOCK_HI: tl.constexpr,
                     BLOCK_DI: tl.constexpr, BLOCK_N: tl.constexpr, DOT_S: tl.constexpr):
    """log2(e) * I(j) for the gathered keys ``ki`` (BLOCK_N, BLOCK_DI), index heads in blocks; -inf where empty."""
    offs_di = tl.arange(0, BLOCK_DI)
    ki_t = tl.trans(ki)
    score = tl.zeros([BLOCK_N], tl.float32)
    for g0 in tl.static_range(0, Hi, BLOCK_HI):
        offs_g = g0 + tl.arange(0, BLOCK_HI)
        g_ok = offs_g < Hi
        qi = tl.load(QI + (t * Hi + offs_g[:, None]) * Di + offs_di[None, :],
                     mask=g_ok[:, None] & (offs_di < Di)[None, :], other=0.0)
        w = tl.load(W + t * Hi + offs_g, mask=g_ok, other=0.0)
        x = dot(qi, ki_t, DOT_S)
        score += tl.sum(tl.maximum(x, 0.0) * w[:, None], 0)
    return tl.where(valid, score * 1.4426950408889634, float("-inf"))


@triton.jit
def _teacher_logits2(Q, CKV, t, h0, rows, valid, factor, H: tl.constexpr, D: tl.constexpr,
                     BLOCK_HT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_T: tl.constexpr):
    """factor * <q[t, h], C_j> for heads h0 .. h0+BLOCK_HT and the gathered rows (factor = scale * log2(e): the
    logits in base 2, log2(e) s_h(j); factor = scale: s_h(j)); -inf for empty slots and padded heads."""
    offs_h = h0 + tl.arange(0, BLOCK_HT)
    h_ok = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    s = tl.zeros([BLOCK_HT, BLOCK_N], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d_ok = (d0 + offs_d) < D
        q_c = tl.load(Q + (t * H + offs_h[:, None]) * D + d0 + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                      other=0.0)
        c_c = tl.load(CKV + rows[:, None] * D + d0 + offs_d[None, :], mask=valid[:, None] & d_ok[None, :],
                      other=0.0)
        s += dot(q_c, tl.trans(c_c), DOT_T)
    return tl.where(h_ok[:, None] & valid[None, :], s * factor, float("-inf"))


@triton.jit
def _full_denominator2(OUTSIDE, t, h0, m, l, H: tl.constexpr, BLOCK_HT: tl.constexpr):
    """From a head block's running max ``m`` (finite; 0 for heads without keys) and sum ``l`` of exp2(s - m):
    log2 of the full denominator logaddexp(outside, lse_S) (-inf only if both are empty) and exp(lse_S - L),
    the head's attention mass on S_t (0 without keys)."""
    offs_h = h0 + tl.arange(0, BLOCK_HT)
    h_ok = offs_h < H
    has = l > 0
    lse_s = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
    out2 = tl.load(OUTSIDE + t * H + offs_h, mask=h_ok, other=float("-inf")) * 1.4426950408889634
    big = tl.maximum(out2, lse_s)
    big = tl.where(big == float("-inf"), 0.0, big)
    full = big + tl.log2(tl.exp2(out2 - big) + tl.exp2(lse_s - big))
    inside = tl.where(has & h_ok, tl.exp2(lse_s - full), 0.0)
    return full, inside


@triton.jit
def _kl_terms(mass, score2, valid, lse_i2, z_floor, sum_t):
    """Per-slot KL terms T (log T - log Q) and dKL/dI = Q sum T - T, both 0 on empty slots."""
    target = mass / z_floor
    log_q = (score2 - lse_i2) * 0.6931471805599453
    xlogx = tl.where(target > 0, target * tl.log(tl.where(target > 0, target, 1.0)), 0.0)   # xlogy(T, T)
    terms = tl.where(valid, xlogx - target * log_q, 0.0)
    d_score = tl.where(valid, tl.exp2(score2 - lse_i2) * sum_t - target, 0.0)
    return terms, d_score


@triton.jit
def _student_block(QI, KI, W, IDX, t, K, start, Hi: tl.constexpr, Di: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr, DOT_S: tl.constexpr):
    """Slots start .. start+BLOCK_N of row t and their student scores: (slots, valid, key rows, log2(e) * I)."""
    n, valid, rows = _load_slots(IDX, t, K, start, BLOCK_N)
    ki = _load_keys(KI, rows, valid, Di, BLOCK_DI)
    return n, valid, rows, _student_scores2(QI, W, ki, t, valid, Hi, Di, BLOCK_HI, BLOCK_DI, BLOCK_N, DOT_S)


@triton.jit
def _given_scores2(G, t, K, n, valid, SCORE_ORDERS: tl.constexpr):
    """log2(e) I(j) of slots n as given in G (-inf where empty): the fp32 values themselves, or with SCORE_ORDERS
    the indexer score kernel's int32 orders of I(j) (the fp32 bits with the low 31 bits of negatives flipped; a NaN
    was written as the largest order and reads back as a NaN)."""
    if SCORE_ORDERS:
        order = tl.load(G + t * K + n, mask=valid, other=0.0).to(tl.int32, bitcast=True)
        score = tl.where(order >= 0, order, order ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        return tl.where(valid, score * 1.4426950408889634, float("-inf"))
    return tl.load(G + t * K + n, mask=valid, other=float("-inf"))


@triton.jit
def _lane_lse_update(m_v, l_v, score2):
    """One block of the per-lane online LSE (log2 domain) of the student scores."""
    v_new = tl.maximum(m_v, score2)
    v_safe = tl.where(v_new == float("-inf"), 0.0, v_new)
    return v_new, l_v * tl.exp2(m_v - v_safe) + tl.exp2(score2 - v_safe)


@triton.jit
def _lane_lse_finish(m_v, l_v):
    """log2 of the student's LSE from the per-lane online state (-inf without any valid slot)."""
    m_i = tl.max(m_v, 0)
    m_i = tl.where(m_i == float("-inf"), 0.0, m_i)
    l_i = tl.sum(l_v * tl.exp2(m_v - m_i), 0)
    return tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))


@triton.jit
def _both_blocks(QI, KI, W, Q, CKV, IDX, t, K, start, teacher_scale, H: tl.constexpr, D: tl.constexpr,
                 Hi: tl.constexpr, Di: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HT: tl.constexpr,
                 BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_D: tl.constexpr, DOT_T: tl.constexpr,
                 DOT_S: tl.constexpr):
    """A block of slots with the student scores (log2 units) and all heads' teacher logits scaled by
    ``teacher_scale``: (slots, valid, score2, s)."""
    n, valid, rows, score2 = _student_block(QI, KI, W, IDX, t, K, start, Hi, Di, BLOCK_N, BLOCK_HI, BLOCK_DI, DOT_S)
    s = _teacher_logits2(Q, CKV, t, 0, rows, valid, teacher_scale, H, D, BLOCK_HT, BLOCK_N, BLOCK_D, DOT_T)
    return n, valid, score2, s


@triton.jit
def _mass_natural(s, full_lse):
    """sum_h exp(s_h(j) - L_h) over all heads ((BLOCK_N,)) from natural-log logits s (-inf where empty) and L: the
    difference is formed before the change to base 2, so its rounding scales with |s - L| (small for the slots that
    carry the mass) rather than with |L| and |s| as exp2(log2(e) s - log2(e) L) would."""
    full_lse = tl.where(full_lse == float("-inf"), 0.0, full_lse)   # heads without any key: all their s are -inf
    return tl.sum(tl.exp2((s - full_lse[:, None]) * 1.4426950408889634), 0)


@triton.jit
def _full_denominator_given_pass(QI, KI, W, Q, CKV, FULL_LSE, IDX, NEND, FULL2, G, MASS, t, K, qk_scale,
                                 flt_min, H: tl.constexpr, D: tl.constexpr, Hi: tl.constexpr, Di: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_HT: tl.constexpr, BLOCK_HI: tl.constexpr,
                                 BLOCK_DI: tl.constexpr, BLOCK_D: tl.constexpr, SAVE_G: tl.constexpr,
                                 DOT_T: tl.constexpr, DOT_S: tl.constexpr, MASS_GIVEN: tl.constexpr,
                                 SCORES_GIVEN: tl.constexpr, SCORE_ORDERS: tl.constexpr):
    """One row when each head's full denominator L_h is given (the main attention's logaddexp(lse, sink) when S_t
    is exactly its compressed candidates): one pass forming the student scores I(j) with their online LSE and the
    teacher mass m(j) = sum_h exp(s_h(j) - L_h) with Z = sum_j m(j), storing m(j) to MASS and log2(e) I(j) to G
    (scratch rows unless SAVE_G), then a GEMM-free loop over the stored values with the LSE and Z known:
    KL = sum_j T (ln T - ln Q), T = m / Zf, Zf = max(Z, FLT_MIN), term by term as in the two-pass form (the
    one-pass identity (sum m ln m - sum m ln Q) / Zf - ln Zf cancels terms ~20x larger than KL in fp32), and with
    SAVE_G dKL/dI = Q (Z/Zf) - T in place of I. MASS_GIVEN: m(j) was formed beforehand (the Gluon teacher-mass kernel).
    SCORES_GIVEN: G already holds log2(e) I(j) (the top-k's scores), or with SCORE_ORDERS the indexer score
    kernel's orders of I(j) (the warm-up on SM90), so no indexer key is read here.
    Returns (kl, log2 of the student LSE, Zf, Z/Zf)."""
    n_end = tl.load(NEND + t)
    offs_h = tl.arange(0, BLOCK_HT)
    full = tl.load(FULL_LSE + t * H + offs_h, mask=offs_h < H, other=float("-inf"))
    tl.store(FULL2 + t * H + offs_h, full, mask=offs_h < H)       # L itself: a recomputing backward forms m alike
    m_v = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l_v = tl.zeros([BLOCK_N], tl.float32)
    z_acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_N):
        if start < n_end:
            if SCORES_GIVEN:
                n, valid, rows = _load_slots(IDX, t, K, start, BLOCK_N)
                score2 = _given_scores2(G, t, K, n, valid, SCORE_ORDERS)
            else:
                n, valid, rows, score2 = _student_block(QI, KI, W, IDX, t, K, start, Hi, Di, BLOCK_N, BLOCK_HI,
                                                        BLOCK_DI, DOT_S)
                tl.store(G + t * K + n, score2, mask=n < K)
            m_v, l_v = _lane_lse_update(m_v, l_v, score2)
            if MASS_GIVEN:
                mass = tl.load(MASS + t * K + n, mask=valid, other=0.0)
            else:
                s = _teacher_logits2(Q, CKV, t, 0, rows, valid, qk_scale, H, D, BLOCK_HT, BLOCK_N, BLOCK_D, DOT_T)
                mass = tl.where(valid, _mass_natural(s, full), 0.0)
                tl.store(MASS + t * K + n, mass, mask=n < K)
            z_acc += mass
    lse_i2 = _lane_lse_finish(m_v, l_v)
    z = tl.sum(z_acc, 0)
    z_floor = tl.maximum(z, flt_min)
    sum_t = z / z_floor
    tl.debug_barrier()                      # every thread's I(j), m(j) stores are visible to the loads below
    kl_acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_N):
        if start < n_end:
            n, valid, _ = _load_slots(IDX, t, K, start, BLOCK_N)
            score2 = _given_scores2(G, t, K, n, valid, SCORE_ORDERS)
            mass = tl.load(MASS + t * K + n, mask=valid, other=0.0)
            terms, d_score = _kl_terms(mass, score2, valid, lse_i2, z_floor, sum_t)
            kl_acc += terms
            if SAVE_G:
                # G[n] turns from I(j) into dKL/dI here. A slot's value is held by several warps (BLOCK_N is below
                # the program's thread count), so without this barrier one warp's store could reach G[n] before
                # another warp's load of I(j): a wrong KL on the H200 with Triton 3.9 (GPU test, 2026-12-02).
                tl.debug_barrier()
                tl.store(G + t * K + n, d_score, mask=n < K)
    return tl.sum(kl_acc, 0), lse_i2, z_floor, sum_t


@triton.jit
def _indexer_kl_fwd_kernel(
    QI, KI, W, Q, CKV, OUTSIDE, IDX, NEND, KL, FULL2, ROWSTAT, G, MASS,
    K, qk_scale_log2, qk_scale, flt_min,
    H: tl.constexpr, D: tl.constexpr, Hi: tl.constexpr, Di: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_HT: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_D: tl.constexpr, SAVE_G: tl.constexpr, DOT_T: tl.constexpr,
    DOT_S: tl.constexpr, FULL: tl.constexpr = False, MASS_GIVEN: tl.constexpr = False,
    SCORES_GIVEN: tl.constexpr = False, SCORE_ORDERS: tl.constexpr = False,
):
    # FULL2 (rows, H): each head's full denominator, the natural-log L (both forms). ROWSTAT (rows, 3):
    # log2 of the student's LSE, max(Z, FLT_MIN), sum_j T(j). G (rows, K): dKL/dI per slot (SAVE_G; slots past NEND, the
    # row's last valid slot + 1 (a range's count), are not written: the backward never reads them, the launcher
    # zero-fills G).
    # FULL: OUTSIDE holds each head's full denominator L itself (natural log), so the teacher logits are formed
    # once (see _full_denominator_given_pass); MASS (rows, K) fp32 holds the teacher mass (scratch, or formed
    # beforehand with MASS_GIVEN) and G is scratch for the student scores even without SAVE_G (given beforehand,
    # log2(e) I(j), with SCORES_GIVEN; their int32 orders from the indexer score kernel with SCORE_ORDERS).
    t = tl.program_id(0).to(tl.int64)
    if FULL:
        kl, lse_i2, z_floor, sum_t = _full_denominator_given_pass(
            QI, KI, W, Q, CKV, OUTSIDE, IDX, NEND, FULL2, G, MASS, t, K, qk_scale, flt_min, H, D, Hi, Di,
            BLOCK_N, BLOCK_HT, BLOCK_HI, BLOCK_DI, BLOCK_D, SAVE_G, DOT_T, DOT_S, MASS_GIVEN, SCORES_GIVEN,
            SCORE_ORDERS)
    else:
        # Pass 1: online per-head LSE of the teacher logits (all heads in one tile: BLOCK_HT >= H) and per-lane
        # online LSE of the student scores. Blocks past the row's last valid slot are skipped.
        n_end = tl.load(NEND + t)
        m_h = tl.full([BLOCK_HT], float("-inf"), tl.float32)
        l_h = tl.zeros([BLOCK_HT], tl.float32)
        m_v = tl.full([BLOCK_N], float("-inf"), tl.float32)
        l_v = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, K, BLOCK_N):
            if start < n_end:
                n, valid, score2, s2 = _both_blocks(QI, KI, W, Q, CKV, IDX, t, K, start, qk_scale_log2, H, D, Hi, Di,
                                                    BLOCK_N, BLOCK_HT, BLOCK_HI, BLOCK_DI, BLOCK_D, DOT_T, DOT_S)
                m_new = tl.maximum(m_h, tl.max(s2, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_h = l_h * tl.exp2(m_h - m_safe) + tl.sum(tl.exp2(s2 - m_safe[:, None]), 1)
                m_h = m_new
                m_v, l_v = _lane_lse_update(m_v, l_v, score2)
        m_h = tl.where(m_h == float("-inf"), 0.0, m_h)
        full, inside = _full_denominator2(OUTSIDE, t, 0, m_h, l_h, H, BLOCK_HT)
        # From here on the natural-log L, as the full form has it: pass 2 forms the mass as the full form and the
        # recomputing backward do (_mass_natural), so a saved and a recomputed dKL/dI are the same values.
        full = full * 0.6931471805599453
        offs_h = tl.arange(0, BLOCK_HT)
        tl.store(FULL2 + t * H + offs_h, full, mask=offs_h < H)
        lse_i2 = _lane_lse_finish(m_v, l_v)
        z = tl.sum(inside, 0)
        z_floor = tl.maximum(z, flt_min)
        sum_t = z / z_floor
        # Pass 2: recompute both score blocks (the teacher's in natural-log units), form T(j), the KL terms and dKL/dI.
        acc = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, K, BLOCK_N):
            if start < n_end:
                n, valid, score2, s = _both_blocks(QI, KI, W, Q, CKV, IDX, t, K, start, qk_scale, H, D, Hi, Di,
                                                   BLOCK_N, BLOCK_HT, BLOCK_HI, BLOCK_DI, BLOCK_D, DOT_T, DOT_S)
                terms, d_score = _kl_terms(tl.where(valid, _mass_natural(s, full), 0.0), score2, valid, lse_i2,
                                           z_floor, sum_t)
                acc += terms
                if SAVE_G:
                    tl.store(G + t * K + n, d_score, mask=n < K)
        kl = tl.sum(acc, 0)
    tl.store(KL + t, kl)
    tl.store(ROWSTAT + t * 3, lse_i2)
    tl.store(ROWSTAT + t * 3 + 1, z_floor)
    tl.store(ROWSTAT + t * 3 + 2, sum_t)


@triton.jit
def _indexer_kl_bwd_kernel(
    QI, KI, W, Q, CKV, IDX, NEND, GRAD, G, FULL2, ROWSTAT, DQI, DKI, DW,
    K, qk_scale,
    H: tl.constexpr, D: tl.constexpr, Hi: tl.constexpr, Di: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_HT: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_G: tl.constexpr, DOT_T: tl.constexpr, DOT_S: tl.constexpr,
):
    # Recomputing (not HAS_G): FULL2 holds the natural-log L and the teacher mass is formed as the full form's
    # forward forms it (_mass_natural).
    # DKI: (Nc, Di) fp32, atomic adds. DQI: (rows, Hi, Di) in the dtype of QI. DW: (rows, Hi) fp32.
    t = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_HI)
    g_ok = offs_g < Hi
    offs_di = tl.arange(0, BLOCK_DI)
    di_ok = offs_di < Di
    qi = tl.load(QI + (t * Hi + offs_g[:, None]) * Di + offs_di[None, :], mask=g_ok[:, None] & di_ok[None, :],
                 other=0.0)
    w = tl.load(W + t * Hi + offs_g, mask=g_ok, other=0.0)
    grad = tl.load(GRAD + t)
    n_end = tl.load(NEND + t)
    if not HAS_G:
        offs_h = tl.arange(0, BLOCK_HT)
        full = tl.load(FULL2 + t * H + offs_h, mask=offs_h < H, other=float("-inf"))
        lse_i2 = tl.load(ROWSTAT + t * 3)
        z_floor = tl.load(ROWSTAT + t * 3 + 1)
        sum_t = tl.load(ROWSTAT + t * 3 + 2)
    dq = tl.zeros([BLOCK_HI, BLOCK_DI], tl.float32)
    dw = tl.zeros([BLOCK_HI], tl.float32)
    for start in range(0, K, BLOCK_N):
        if start < n_end:
            n, valid, rows = _load_slots(IDX, t, K, start, BLOCK_N)
            ki = _load_keys(KI, rows, valid, Di, BLOCK_DI)
            x = dot(qi, tl.trans(ki), DOT_S)                                  # (BLOCK_HI, BLOCK_N)
            if HAS_G:
                d_score = tl.load(G + t * K + n, mask=valid, other=0.0)
            else:
                score2 = tl.where(valid, tl.sum(tl.maximum(x, 0.0) * w[:, None], 0) * 1.4426950408889634,
                                  float("-inf"))
                s = _teacher_logits2(Q, CKV, t, 0, rows, valid, qk_scale, H, D, BLOCK_HT, BLOCK_N, BLOCK_D, DOT_T)
                mass = _mass_natural(s, full)
                _, d_score = _kl_terms(mass, score2, valid, lse_i2, z_floor, sum_t)
            d_score = d_score * grad
            dw += tl.sum(tl.maximum(x, 0.0) * d_score[None, :], 1)
            dx = tl.where(x > 0, w[:, None] * d_score[None, :], 0.0)
            dx = round_to(dx, KI, DOT_S == 2)
            dq += dot(dx, ki, DOT_S)
            dk = dot(tl.trans(dx), qi, DOT_S)                                # (BLOCK_N, BLOCK_DI)
            # Repeated key rows in a block are fine: every element is its own atomic add. Nothing reads DKI before
            # the kernel ends, so relaxed order suffices (the default, acq_rel, also orders each add against the
            # program's other memory operations: 30-45% of the attention backward's time when it was on).
            tl.atomic_add(DKI + rows[:, None] * Di + offs_di[None, :], dk, mask=valid[:, None] & di_ok[None, :],
                          sem="relaxed")
    tl.store(DQI + (t * Hi + offs_g[:, None]) * Di + offs_di[None, :], round_to(dq, DQI, DOT_S == 2),
             mask=g_ok[:, None] & di_ok[None, :])
    tl.store(DW + t * Hi + offs_g, dw, mask=g_ok)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))      # tl.dot needs every tile dimension >= 16


def _launch(kernel, rows: int, args: tuple, meta: dict, launch: dict, shrink) -> None:
    """Launch ``kernel`` on one program per row, shrinking the tiles if this GPU's shared memory is too small."""
    def smaller(fit):
        fit_meta, fit_launch = fit
        if fit_launch["num_stages"] > 1:
            return fit_meta, dict(fit_launch, num_stages=fit_launch["num_stages"] - 1)
        fit_meta = shrink(fit_meta)
        return None if fit_meta is None else (fit_meta, fit_launch)

    launch_fitting(lambda fit: kernel[(rows,)](*args, **fit[0], **fit[1]), (meta, launch), smaller)


def _fwd_meta(H: int, D: int, Hi: int, Di: int, cfg: dict) -> dict:
    return dict(H=H, D=D, Hi=Hi, Di=Di, BLOCK_N=cfg["BLOCK_N"], BLOCK_HT=_pow2(H),
                BLOCK_HI=min(cfg["BLOCK_HI"], _pow2(Hi)), BLOCK_DI=_pow2(Di), BLOCK_D=min(cfg["BLOCK_D"], _pow2(D)))


def _fwd_shrink(meta: dict) -> dict | None:
    if meta["BLOCK_N"] > 16:
        return dict(meta, BLOCK_N=meta["BLOCK_N"] // 2)
    return None


def _bwd_shrink(meta: dict) -> dict | None:
    return dict(meta, BLOCK_N=meta["BLOCK_N"] // 2) if meta["BLOCK_N"] > 16 else None


@triton.jit
def _range_rows_kernel(FIRST, VISIBLE, TABLE, OUT, shift, width, HAS_TABLE: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of OUT (rows, width) int32, slots [BLOCK * program 1, + BLOCK): map(FIRST[r] + j) for j < VISIBLE[r]
    (map(e) = TABLE[e] + shift, or e + shift without a table), -1 elsewhere."""
    r = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = j < tl.load(VISIBLE + r)
    entry = tl.load(FIRST + r) + j
    if HAS_TABLE:
        entry = tl.load(TABLE + entry, mask=valid, other=0)
    tl.store(OUT + r.to(tl.int64) * width + j, tl.where(valid, entry + shift, -1).to(tl.int32), mask=j < width)


def range_rows_triton(first: torch.Tensor, visible: torch.Tensor, table: torch.Tensor | None, shift: int, width: int,
                      start: int, end: int) -> torch.Tensor:
    """:func:`index_sets.range_rows` (its reference twin) in int32 by one kernel: the torch form makes four passes
    over the (rows, width) slots (the entries, the mask, the shift, the select), this one writes them once."""
    first, visible = first.contiguous(), visible.contiguous()           # the kernel reads them with stride 1
    table = None if table is None else table.contiguous()
    out = torch.empty(end - start, width, dtype=torch.int32, device=first.device)
    if out.numel():
        block = min(1024, triton.next_power_of_2(width))
        _range_rows_kernel[(end - start, triton.cdiv(width, block))](
            first[start:end], visible[start:end], first if table is None else table, out, shift, width,
            HAS_TABLE=table is not None, BLOCK=block)
    return out


def _range_chunks(first: torch.Tensor, visible: torch.Tensor, table: torch.Tensor | None, shift: int, width: int):
    """``(start, end, idx (rows, width) int32, n_end (rows,) int32)`` of each chunk of query rows (:data:`INDEX_BUDGET`
    slots each) of the ranges ``(first, visible, table, shift)`` (``index_sets.contiguous_ranges``), materialised one
    chunk at a time."""
    n_end = visible.to(torch.int32)          # a range's slots are all valid: it ends at its count
    for s, e in chunk_rows(first.shape[0], width, budget=INDEX_BUDGET):
        yield s, e, range_rows_triton(first, visible, table, shift, width, s, e), n_end[s:e]


class StudentRanges(NamedTuple):
    """The candidates of :func:`_range_chunks` again, for the student's logits: on the Gluon teacher's path the
    forward kernel reads I(j) as the indexer's score kernel writes them (``indexer.triton._score_orders``: the
    Gluon kernel on SM90 at ~0.53 of the matmul peak, against the KL kernel's own per-row dots at ~0.10, BENCHMARKS.md)
    instead of forming them. ``starts``: the rows after 0 where a Stack's parts begin (``range_part_starts``): the
    score kernels take each part on its own."""
    first: torch.Tensor
    visible: torch.Tensor
    table: Optional[torch.Tensor]
    shift: int
    starts: tuple

    def rows(self, s: int, e: int) -> "StudentRanges":
        """Rows s .. e - 1, as ranges of their own (part starts counted from s)."""
        return StudentRanges(self.first[s:e], self.visible[s:e], self.table, self.shift,
                             tuple(p - s for p in self.starts if s < p < e))

    def first_rows(self) -> torch.Tensor | None:
        """Each row's first candidate as a row of the keys when its candidates are consecutive rows (no entry
        table: one device), for the Gluon teacher's range form (TMA copies instead of gathers); else None."""
        return None if self.table is not None else self.first + self.shift


def _student_ranges(first, visible, table, shift: int, parts) -> StudentRanges:
    return StudentRanges(first.contiguous(), visible.contiguous(), None if table is None else table.contiguous(),
                         shift, tuple(parts or ()))


def _student_orders(qi, ki, w, ranges: StudentRanges, K: int, out: torch.Tensor) -> None:
    """The indexer score kernel's int32 orders of I(j) for the rows of ``qi`` (those of ``ranges``) into ``out``
    (rows, K) int32, where ``j < visible``: part by part (:class:`StudentRanges`). ``w`` fp32 (rows, Hi)."""
    cuts = (0, *ranges.starts, qi.shape[0])
    for a, b in zip(cuts[:-1], cuts[1:]):
        indexer_triton._score_orders(qi[a:b], ki, w[a:b], ranges.first[a:b], ranges.visible[a:b], ranges.table,
                                     ranges.shift, K, indexer_triton.CONFIG, out=out[a:b])


class Selection:
    """The indexer's top-k of every row over the ranges' candidates, asked of the ranges op (``select_topk``): on
    the Gluon teacher's path the KL forward selects each chunk from the int32 score orders it has the indexer's
    score kernel write for the student (:meth:`from_orders`), so the warm-up forms those scores once, not once for
    the top-k and again for the loss; otherwise :meth:`finish` runs the top-k op on its own. Either way the result
    is ``indexer_topk(index_q, index_k, index_weights, candidates, topk, return_scores=True)`` bit for bit: the same
    score kernel and select kernel with the same configuration, row by row."""

    def __init__(self, T: int, K: int, topk: int, device):
        self.K, self.width = K, min(topk, K)
        self.out = torch.empty(T, self.width, dtype=torch.int32, device=device)
        self.scores = torch.empty(T, self.width, dtype=torch.float32, device=device)
        self.done = False

    def from_orders(self, orders: torch.Tensor, ranges: StudentRanges, s: int, e: int) -> None:
        """Rows s .. e - 1 from their (rows, K) orders; in pieces whose select scratch (2 KP int64 keys a row, up to
        4x the orders at narrow widths) stays within :data:`SELECT_SCRATCH`, beside the KL chunk's own buffers."""
        step = max(1, SELECT_SCRATCH // (2 * indexer_triton._select_width(self.width)))
        for a in range(0, e - s, step):
            b = min(a + step, e - s)
            indexer_triton._select(orders[a:b], ranges.first[a:b], ranges.visible[a:b], ranges.table, ranges.shift,
                                   self.out[s + a:s + b], self.scores[s + a:s + b], indexer_triton.CONFIG)

    def finish(self, qi, ki, w, ranges: StudentRanges) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, scores); the top-k op part by part (a Stack's parts, as ``indexer_topk``) unless done."""
        if not self.done and self.width:
            tiles = indexer_triton._tile_list(indexer_triton.CONFIG)
            cuts = (0, *ranges.starts, qi.shape[0])
            for a, b in zip(cuts[:-1], cuts[1:]):
                part = ranges.rows(a, b)
                self.out[a:b], self.scores[a:b] = indexer_triton.indexer_topk_ranges_op(
                    qi[a:b], ki, w[a:b], part.first, part.visible, part.table, part.shift, self.K, self.width, tiles,
                    indexer_triton.ORDER_BUDGET)
        return self.out, self.scores


def _common_dtype(a: torch.Tensor, b: torch.Tensor):
    """Both operands of one product in one dtype: mixed inputs are widened to fp32 (exact, as the reference)."""
    return (a, b) if a.dtype == b.dtype else (a.float(), b.float())


def _operands(index_q, index_k, index_weights, q, compressed_kv):
    """What the kernels read: (qi, ki, w, qm, ckv), contiguous, one dtype per product, weights in fp32. Empty key
    tensors become one zero row: every slot is then -1, the kernels never read a key but want a real pointer."""
    qi, ki = (x.contiguous() for x in _common_dtype(index_q, index_k))
    qm, ckv = (x.contiguous() for x in _common_dtype(q, compressed_kv))
    if ki.shape[0] == 0:
        ki, ckv = ki.new_zeros(1, ki.shape[1]), ckv.new_zeros(1, ckv.shape[1])
    return qi, ki, index_weights.float().contiguous(), qm, ckv


def _saves_g(rows: int, width: int) -> bool:
    """Whether the forward keeps dKL/dI, (rows, width) fp32, for the backward (see :data:`SAVE_G_BUDGET`)."""
    return width <= SAVE_G_MAX_WIDTH or rows * width * 4 <= SAVE_G_BUDGET


def _split_launch(config: dict) -> tuple[dict, dict]:
    cfg = dict(config)
    return cfg, dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))


def _kl_forward(operands, outside_lse, chunks, K: int, scale: float, save_g: bool, config: dict, full: bool = False,
                mass: torch.Tensor | None = None, scores: torch.Tensor | None = None, gluon_teacher: bool = False,
                ranges: StudentRanges | None = None, select: Selection | None = None):
    """The forward kernel over ``chunks``, ``(start, end, idx (rows, K) int32, n_end (rows,) int32)`` each;
    ``full``: ``outside_lse`` holds each head's full denominator (see :func:`indexer_kl_triton`); ``mass``: with
    ``full``, the teacher mass (T, K) fp32 formed beforehand; ``scores``: with ``full``, the student logits I(j)
    (T, K) formed beforehand (the top-k's). ``gluon_teacher``: the Gluon teacher kernels form each chunk's teacher
    mass (with ``full``) or its full denominators and mass (without: :func:`_gluon_full_and_mass`), then the kernel
    runs the full-denominator form on them. ``ranges``: the chunks' candidates as ranges (given on the Gluon
    teacher's path of the ranges ops): the full form then reads the student logits from the indexer's score kernel
    (:class:`StudentRanges`). ``full2`` holds each head's natural-log L in every form. A Gluon kernel's error is
    raised as :class:`GluonTeacherFailed` (its cause). ``select``: where the indexer's score kernel forms the
    student's logits (the orders above), each chunk's top-k is selected from them too (:class:`Selection`).

    Returns kl (T,), full2 (T, H), rowstat (T, 3) and G (T, K) (None unless ``save_g``), all fp32.
    """
    qi, ki, w, qm, ckv = operands
    T, Hi, Di = qi.shape
    H, D = qm.shape[1:]
    outside = outside_lse.float().contiguous()
    kl = torch.empty(T, dtype=torch.float32, device=qi.device)
    full2 = torch.empty(T, H, dtype=torch.float32, device=qi.device)
    rowstat = torch.empty(T, 3, dtype=torch.float32, device=qi.device)
    # Zeros, not empty: the kernel skips the slots past a row's last valid one, and the op's outputs must be
    # defined everywhere (the backward never reads them; one memset of T x K fp32).
    g_buf = torch.zeros(T, K, dtype=torch.float32, device=qi.device) if save_g else None
    mass_given = mass is not None
    scratch = {}

    def rows_of(name, saved, s, e):
        """Rows s..e of ``saved`` if given, else of a (rows, K) fp32 scratch reused by the chunks (the full form
        keeps m(j) and I(j) per slot until Z is known; memory stays that of one chunk)."""
        if saved is not None:
            return saved[s:e]
        if name not in scratch or scratch[name].shape[0] < e - s:
            scratch[name] = torch.empty(e - s, K, dtype=torch.float32, device=qi.device)
        return scratch[name][:e - s]
    cfg, launch = _split_launch(config)
    scores_given = full and scores is not None
    orders = ranges is not None and (full or gluon_teacher) and not scores_given
    meta = dict(_fwd_meta(H, D, Hi, Di, cfg), SAVE_G=save_g, DOT_T=dot_mode(qm.dtype), DOT_S=dot_mode(qi.dtype),
                FULL=full or gluon_teacher, MASS_GIVEN=mass_given or gluon_teacher,
                SCORES_GIVEN=scores_given or orders, SCORE_ORDERS=orders)
    if meta["SCORES_GIVEN"] and meta["MASS_GIVEN"]:
        meta["BLOCK_N"] = min(cfg["GIVEN_BLOCK_N"], _pow2(K))
    for s, e, idx, n_end in chunks:
        g_rows = rows_of("g", g_buf, s, e) if full or save_g or gluon_teacher else kl
        chunk_ranges = None if ranges is None else ranges.rows(s, e)
        if scores_given:     # log2(e) I(j) where the kernel reads them; 0 at empty slots, as if never written
            g_rows.copy_(scores[s:e]).mul_(1.4426950408889634).masked_fill_(idx < 0, 0.0)     # in place, no temporary
        elif orders:         # the kernel reads them where j < visible, which the score kernel writes
            _student_orders(qi[s:e], ki, w[s:e], chunk_ranges, K, g_rows.view(torch.int32))
            if select is not None:          # before the KL kernel writes dKL/dI over them
                select.from_orders(g_rows.view(torch.int32), chunk_ranges, s, e)
        if gluon_teacher:
            first = None if chunk_ranges is None else chunk_ranges.first_rows()
            try:
                if full:
                    outside_rows = outside[s:e]
                    mass_rows = gluon_hopper.teacher_mass(qm[s:e], ckv, idx, outside_rows, scale, n_end=n_end,
                                                          first=first)
                else:
                    outside_rows, mass_rows = _gluon_full_and_mass(qm[s:e], ckv, outside[s:e], idx, n_end, scale,
                                                                   first)
            except Exception as exc:
                raise GluonTeacherFailed() from exc
        else:
            outside_rows, mass_rows = outside[s:e], rows_of("mass", mass, s, e) if full else kl
        _launch(_indexer_kl_fwd_kernel, e - s,
                (qi[s:e], ki, w[s:e], qm[s:e], ckv, outside_rows, idx, n_end, kl[s:e], full2[s:e], rowstat[s:e],
                 g_rows, mass_rows, K, scale * 1.4426950408889634, scale, FLT_MIN),
                meta, launch, _fwd_shrink)
        del outside_rows, mass_rows              # one chunk's (rows, K) buffers at a time, not two
    if select is not None and orders:
        select.done = True
    return kl, full2, rowstat, g_buf


def _kl_backward(grad_kl, operands, full2, rowstat, g_buf, chunks, K: int, scale: float, config: dict,
                 ranges: StudentRanges | None = None):
    """The backward kernel over ``chunks`` (as :func:`_kl_forward`'s); ``g_buf`` None recomputes the teacher
    from ``full2`` (each head's natural-log L, as both forward forms save it) and ``rowstat``. ``ranges``: the
    chunks' candidates are these ranges (the warm-up), so the Gluon kernel takes rows with one start in pairs (from
    :data:`PAIRS_MIN_WIDTH` slots).

    Returns d index_q in ``qi``'s dtype, d index_k fp32 with ``ki``'s rows, d index_weights fp32.
    """
    qi, ki, w, qm, ckv = operands
    T, Hi, Di = qi.shape
    H, D = qm.shape[1:]
    grad = grad_kl.float().contiguous()
    d_qi = torch.empty_like(qi)
    d_ki = torch.zeros(ki.shape, dtype=torch.float32, device=ki.device)
    d_w = torch.empty(T, Hi, dtype=torch.float32, device=qi.device)
    cfg, launch = _split_launch(config)
    has_g = g_buf is not None
    meta = dict(H=H, D=D, Hi=Hi, Di=Di, BLOCK_N=cfg["BLOCK_N"], BLOCK_HT=_pow2(H), BLOCK_HI=_pow2(Hi),
                BLOCK_DI=_pow2(Di), BLOCK_D=min(cfg["BLOCK_D"], _pow2(D)), HAS_G=has_g,
                DOT_T=dot_mode(qm.dtype), DOT_S=dot_mode(qi.dtype))
    request = cfg.get("KERNEL", "auto")
    gluon = has_g and variants.choose("indexer_kl", "backward", (Di, qi.dtype), qi, ki, request=request) == "gluon"
    key = (Di, qi.dtype)
    pairs = (gluon and ranges is not None and K >= PAIRS_MIN_WIDTH
             and variants.choose("indexer_kl", "backward_pairs", key, qi, ki, request=request) == "gluon")
    for s, e, idx, n_end in chunks:
        if gluon and e > s:
            args = (qi[s:e], ki, w[s:e], idx, n_end, g_buf[s:e], grad[s:e], d_qi[s:e], d_ki, d_w[s:e])
            if pairs:
                try:
                    gluon_kl.launch_bwd_pairs(*args, ranges.first[s:e])
                    continue
                except Exception as exc:         # d_ki is added to only once both launches ran
                    if variants.strict(request):
                        raise
                    variants.note_gluon_build_failure(exc, "indexer_kl", "backward_pairs", key,
                                                      "using the one-row Gluon kernel")
                    pairs = False
            try:
                gluon_kl.launch_bwd(*args)
                continue
            except Exception as exc:
                if variants.strict(request):
                    raise
                variants.note_gluon_build_failure(exc, "indexer_kl", "backward", key, "using the Triton kernel")
                gluon = False
        _launch(_indexer_kl_bwd_kernel, e - s,
                (qi[s:e], ki, w[s:e], qm[s:e], ckv, idx, n_end, grad[s:e], g_buf[s:e] if has_g else grad,
                 full2[s:e], rowstat[s:e], d_qi[s:e], d_ki, d_w[s:e], K, scale),
                meta, launch, _bwd_shrink)
    return d_qi, d_ki, d_w


class GluonTeacherFailed(Exception):
    """A Gluon teacher kernel (``teacher_lse`` / ``teacher_mass``) raised; the error is the ``__cause__``. Only
    this is a reason to fall back to the Triton teacher: an error of the Triton KL kernels propagates as it is."""


def _note_teacher_failure(failed: GluonTeacherFailed, qm: torch.Tensor) -> None:
    """Fall back from a failed Gluon teacher: re-raises the kernel's error unless it is a build failure (or the
    Gluon kernels were asked for), else records it and warns once."""
    if variants.strict():
        raise failed.__cause__
    variants.note_gluon_build_failure(failed.__cause__, "indexer_kl", "teacher_mass", (qm.shape[2], qm.dtype),
                                      "the Triton KL kernel forms the teacher")


def _gluon_teacher(qm: torch.Tensor, K: int) -> bool:
    """Whether the Gluon teacher kernels apply to main queries ``qm`` and K candidates (SM90; bf16/fp16, incl. not
    for mixed q / C dtypes widened to fp32; H % 64; D; T and K > 0) and are not switched off (DSV4ATTN_KERNELS)."""
    T, H, D = qm.shape
    return T > 0 and K > 0 and variants.choose("indexer_kl", "teacher_mass", (D, qm.dtype), qm) == "gluon"


def _backward_from_saved(grad_kl, operands, full2, rowstat, g_buf, chunks, K: int, scale: float, config: dict,
                         bwd_config: dict, ranges: StudentRanges | None = None):
    """The backward from the forward's saved state, whichever form the forward ran (both save the natural-log L):
    with a saved dKL/dI its backward kernels; without, on SM90 the Gluon teacher per chunk
    (:func:`_kl_backward_gluon_teacher`), elsewhere (or if a Gluon teacher kernel cannot be built) the Triton kernel
    recomputing the teacher. ``chunks()`` gives the row chunks (a fresh iterator per call). Same returns as
    :func:`_kl_backward`."""
    if g_buf is None and _gluon_teacher(operands[3], K):
        try:
            return _kl_backward_gluon_teacher(grad_kl, operands, full2, chunks(), K, scale, config, bwd_config,
                                              ranges)
        except GluonTeacherFailed as failed:
            _note_teacher_failure(failed, operands[3])
    return _kl_backward(grad_kl, operands, full2, rowstat, g_buf, chunks(), K, scale, bwd_config, ranges)


def _gluon_full_and_mass(qm, ckv, outside: torch.Tensor, idx: torch.Tensor, n_end: torch.Tensor, scale: float,
                         first: torch.Tensor | None = None):
    """(full denominators L (rows, H), teacher mass (rows, K)), fp32, of one chunk of rows from the Gluon teacher
    kernels: L = logaddexp(outside, the candidates' own LSE) (natural log), then the mass normalised by it.
    ``first``: the rows' first key rows when their candidates are consecutive (:meth:`StudentRanges.first_rows`)."""
    full_lse = torch.logaddexp(outside, gluon_hopper.teacher_lse(qm, ckv, idx, scale, n_end=n_end, first=first))
    return full_lse, gluon_hopper.teacher_mass(qm, ckv, idx, full_lse, scale, n_end=n_end, first=first)


def _row_chunks(idx: torch.Tensor, n_end: torch.Tensor):
    """Materialised candidates in chunks of rows (:data:`INDEX_BUDGET` slots each), as :func:`_kl_forward` takes
    them: the (rows, K) fp32 buffers of the Gluon teacher path exist for one chunk at a time."""
    return [(s, e, idx[s:e], n_end[s:e]) for s, e in chunk_rows(idx.shape[0], idx.shape[1], budget=INDEX_BUDGET)]


def _teacher_forward(operands, outside_lse, chunks, K: int, scale: float, save_g: bool, config: dict, full: bool,
                     scores: torch.Tensor | None = None, ranges: StudentRanges | None = None,
                     select: Selection | None = None):
    """The forward of both op pairs: on SM90 the Gluon teacher kernels form
    each chunk's teacher mass (``full``) or full denominators and mass (the outside-mass form: the warm-up), and the
    full form runs on them; elsewhere, or if a Gluon teacher kernel cannot be built, the Triton kernel forms the
    teacher itself. ``chunks()`` gives the row chunks (a fresh iterator per call). Same returns as
    :func:`_kl_forward`."""
    qm = operands[3]
    if _gluon_teacher(qm, K):
        try:
            return _kl_forward(operands, outside_lse, chunks(), K, scale, save_g, config, full, scores=scores,
                               gluon_teacher=True, ranges=ranges, select=select)
        except GluonTeacherFailed as failed:
            _note_teacher_failure(failed, qm)
            if select is not None:
                select.done = False             # the Triton teacher forms no orders: the top-k op selects
    return _kl_forward(operands, outside_lse, chunks(), K, scale, save_g, config, full, scores=scores)


# ------------------------------------------------------------------------------------------- the custom ops
def _forward_op(index_q, index_k, index_weights, q, compressed_kv, outside_lse, chunks, K: int, scale: float,
                save_g: bool, fwd_tiles: list[int], full: bool, student_scores=None, ranges=None, select_topk: int = 0):
    """The body of both forward ops: ``chunks()`` gives the row chunks; ``ranges`` (the ranges op): the candidates
    as :class:`StudentRanges`. Returns kl, full2, rowstat and G ((0, K) unless ``save_g``); with ``select_topk``
    (the ranges op) also the top-k's indices and scores (:class:`Selection`)."""
    operands = _operands(index_q, index_k, index_weights, q, compressed_kv)
    select = Selection(index_q.shape[0], K, select_topk, index_q.device) if select_topk else None
    with backend.exact_math(index_q.device):
        kl, full2, rowstat, g_buf = _teacher_forward(operands, outside_lse, chunks, K, scale, save_g,
                                                     dict(zip(FWD_KEYS, fwd_tiles)), full, student_scores, ranges,
                                                     select)
        chosen = () if select is None else select.finish(*operands[:3], ranges)
    return (kl, full2, rowstat, (kl.new_empty(0, K) if g_buf is None else g_buf)) + chosen


def _forward_fake(index_q, q, K: int, save_g: bool):
    T, f32 = index_q.shape[0], dict(dtype=torch.float32)
    return (index_q.new_empty(T, **f32), index_q.new_empty(T, q.shape[1], **f32), index_q.new_empty(T, 3, **f32),
            index_q.new_empty(T if save_g else 0, K, **f32))


def _backward_op(grad_kl, index_q, index_k, index_weights, q, compressed_kv, full2, rowstat, g, chunks, K: int,
                 scale: float, bwd_tiles: list[int], fwd_tiles: Optional[list[int]], ranges=None):
    """The body of both backward ops: ``g`` with T rows is the saved dKL/dI; with 0 rows the teacher is formed again
    (:func:`_backward_from_saved`; the forward's config ``fwd_tiles``, default :data:`FWD_CONFIG`, serves the Gluon
    teacher path's dKL/dI). d index_k is accumulated with fp32 atomics (its last bits vary from run to run on a
    GPU)."""
    with backend.exact_math(index_q.device):
        d_qi, d_ki, d_w = _backward_from_saved(
            grad_kl, _operands(index_q, index_k, index_weights, q, compressed_kv), full2, rowstat,
            g if g.shape[0] == index_q.shape[0] else None, chunks, K, scale,
            dict(zip(FWD_KEYS, fwd_tiles)) if fwd_tiles is not None else FWD_CONFIG, _bwd_config(bwd_tiles), ranges)
    return d_qi.to(index_q.dtype), d_ki[:index_k.shape[0]].to(index_k.dtype), d_w.to(index_weights.dtype)


def _backward_fake(index_q, index_k, index_weights):
    return (index_q.new_empty(index_q.shape), index_k.new_empty(index_k.shape),
            index_weights.new_empty(index_weights.shape))


def _zero_grad_if_none(grad_kl, index_q):
    return index_q.new_zeros(index_q.shape[0], dtype=torch.float32) if grad_kl is None else grad_kl


@torch.library.custom_op("dsv4attn::indexer_kl", mutates_args=())
def indexer_kl_op(index_q: torch.Tensor, index_k: torch.Tensor, index_weights: torch.Tensor, q: torch.Tensor,
                  compressed_kv: torch.Tensor, outside_lse: torch.Tensor, candidates: torch.Tensor, scale: float,
                  save_g: bool, fwd_tiles: list[int], bwd_tiles: list[int], full: bool = False,
                  student_scores: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of :func:`indexer_kl_triton` for (T, K) int32 candidates (-1 = empty, K >= 1), arguments checked.

    Returns kl (T,) fp32 and what the backward reads: full2 (T, H) and rowstat (T, 3) fp32 (see
    ``_indexer_kl_fwd_kernel``), G = dKL/dI (T, K) fp32 when ``save_g`` (else (0, K)) and each row's last valid
    slot + 1, (T,) int32. ``fwd_tiles`` / ``bwd_tiles``: the configs' values in :data:`FWD_KEYS` /
    :data:`BWD_KEYS` order; both are kept for the backward. ``full``: ``outside_lse`` is each head's
    full denominator. ``student_scores`` (with ``full``): the (T, K) student logits formed by the top-k.
    """
    if student_scores is not None and not full:
        raise ValueError("indexer_kl op: student_scores needs full=True (the full-denominator form reads them)")
    idx = candidates.to(torch.int32).contiguous()
    n_end = row_ends(idx)
    return (*_forward_op(index_q, index_k, index_weights, q, compressed_kv, outside_lse,
                         lambda: _row_chunks(idx, n_end), idx.shape[1], scale, save_g, fwd_tiles, full,
                         student_scores), n_end)


@indexer_kl_op.register_fake
def _indexer_kl_fake(index_q, index_k, index_weights, q, compressed_kv, outside_lse, candidates, scale, save_g,
                     fwd_tiles, bwd_tiles, full=False, student_scores=None):
    T, K = candidates.shape
    return (*_forward_fake(index_q, q, K, save_g), index_q.new_empty(T, dtype=torch.int32))


@torch.library.custom_op("dsv4attn::indexer_kl_backward", mutates_args=())
def indexer_kl_backward_op(grad_kl: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
                           index_weights: torch.Tensor, q: torch.Tensor, compressed_kv: torch.Tensor,
                           candidates: torch.Tensor, n_end: torch.Tensor, full2: torch.Tensor, rowstat: torch.Tensor,
                           g: torch.Tensor, scale: float, bwd_tiles: list[int], full: bool = False,
                           fwd_tiles: Optional[list[int]] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d index_q, d index_k, d index_weights (in their own dtypes) from :func:`indexer_kl_op`'s saved state
    (:func:`_backward_op`). ``full`` is not read (``full2`` holds the natural-log L in either form): it stays in the
    schema so that graphs that ``torch.compile`` cached with an earlier version, which pass it, still call this op
    (PyTorch's compile caches are not keyed by a custom op's schema: pytorch/pytorch#144344)."""
    idx = candidates.to(torch.int32).contiguous()
    return _backward_op(grad_kl, index_q, index_k, index_weights, q, compressed_kv, full2, rowstat, g,
                        lambda: _row_chunks(idx, n_end.contiguous()), idx.shape[1], scale, bwd_tiles, fwd_tiles)


@indexer_kl_backward_op.register_fake
def _indexer_kl_backward_fake(grad_kl, index_q, index_k, index_weights, q, compressed_kv, candidates, n_end, full2,
                              rowstat, g, scale, bwd_tiles, full=False, fwd_tiles=None):
    return _backward_fake(index_q, index_k, index_weights)


def _setup_context(ctx, inputs, output):
    index_q, index_k, index_weights, q, compressed_kv, _, candidates, scale, _, fwd_tiles, bwd_tiles, _, _ = inputs
    _, full2, rowstat, g, n_end = output
    ctx.save_for_backward(index_q, index_k, index_weights, q, compressed_kv, candidates, n_end, full2, rowstat, g)
    ctx.scale, ctx.fwd_tiles, ctx.bwd_tiles = scale, fwd_tiles, bwd_tiles
    ctx.mark_non_differentiable(full2, rowstat, g, n_end)


def _backward(ctx, grad_kl, *_grad_state):
    d_qi, d_ki, d_w = indexer_kl_backward_op(_zero_grad_if_none(grad_kl, ctx.saved_tensors[0]), *ctx.saved_tensors,
                                             ctx.scale, ctx.bwd_tiles, fwd_tiles=ctx.fwd_tiles)
    # No gradient to q, compressed_kv, outside_lse (the teacher is detached), candidates, the student scores
    # (values only: the gradients of index_q, index_k and index_weights come from the dots formed again) or the
    # host arguments.
    return d_qi, d_ki, d_w, None, None, None, None, None, None, None, None, None, None


indexer_kl_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("dsv4attn::indexer_kl_ranges", mutates_args=())
def indexer_kl_ranges_op(index_q: torch.Tensor, index_k: torch.Tensor, index_weights: torch.Tensor, q: torch.Tensor,
                         compressed_kv: torch.Tensor, outside_lse: torch.Tensor, first: torch.Tensor,
                         visible: torch.Tensor, table: Optional[torch.Tensor], shift: int, width: int, scale: float,
                         save_g: bool, fwd_tiles: list[int], bwd_tiles: list[int], full: bool = False,
                         parts: Optional[list[int]] = None, select_topk: int = 0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor]:
    """Forward of :func:`indexer_kl_triton` for the candidates ``map(first[t] + j), j < visible[t]`` of each row,
    ``width`` (>= 1) slots wide (``index_sets.contiguous_ranges``: ``first``, ``visible`` (T,) int, ``table`` None or
    the entry -> row map, ``shift``). ``parts``: the rows after 0 where a Stack's parts begin
    (``index_sets.range_part_starts``; None or [] for one set). Returns kl, full2, rowstat and G as
    :func:`indexer_kl_op` (no row ends: the backward materialises the slots again from the ranges, one chunk at a
    time), then the indexer's top-k over the same candidates, (T, min(select_topk, width)) int32 rows of
    ``index_k`` and their fp32 scores ((T, 0) each without ``select_topk``; :class:`Selection`)."""
    out = _forward_op(index_q, index_k, index_weights, q, compressed_kv, outside_lse,
                      lambda: _range_chunks(first, visible, table, shift, width), width, scale, save_g, fwd_tiles,
                      full, ranges=_student_ranges(first, visible, table, shift, parts), select_topk=select_topk)
    if not select_topk:
        out += (index_q.new_empty(index_q.shape[0], 0, dtype=torch.int32),
                index_q.new_empty(index_q.shape[0], 0, dtype=torch.float32))
    return out


@indexer_kl_ranges_op.register_fake
def _indexer_kl_ranges_fake(index_q, index_k, index_weights, q, compressed_kv, outside_lse, first, visible, table,
                            shift, width, scale, save_g, fwd_tiles, bwd_tiles, full=False, parts=None, select_topk=0):
    chosen = (index_q.shape[0], min(select_topk, width))
    return _forward_fake(index_q, q, width, save_g) + (index_q.new_empty(chosen, dtype=torch.int32),
                                                        index_q.new_empty(chosen, dtype=torch.float32))


@torch.library.custom_op("dsv4attn::indexer_kl_ranges_backward", mutates_args=())
def indexer_kl_ranges_backward_op(grad_kl: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
                                  index_weights: torch.Tensor, q: torch.Tensor, compressed_kv: torch.Tensor,
                                  first: torch.Tensor, visible: torch.Tensor, table: Optional[torch.Tensor],
                                  full2: torch.Tensor, rowstat: torch.Tensor, g: torch.Tensor, shift: int, width: int,
                                  scale: float, fwd_tiles: list[int], bwd_tiles: list[int],
                                  parts: Optional[list[int]] = None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d index_q, d index_k, d index_weights (in their own dtypes) from :func:`indexer_kl_ranges_op`'s saved state
    (:func:`_backward_op`)."""
    return _backward_op(grad_kl, index_q, index_k, index_weights, q, compressed_kv, full2, rowstat, g,
                        lambda: _range_chunks(first, visible, table, shift, width), width, scale, bwd_tiles,
                        fwd_tiles, ranges=_student_ranges(first, visible, table, shift, parts))


@indexer_kl_ranges_backward_op.register_fake
def _indexer_kl_ranges_backward_fake(grad_kl, index_q, index_k, index_weights, q, compressed_kv, first, visible,
                                     table, full2, rowstat, g, shift, width, scale, fwd_tiles, bwd_tiles, parts=None):
    return _backward_fake(index_q, index_k, index_weights)


def _setup_ranges_context(ctx, inputs, output):
    (index_q, index_k, index_weights, q, compressed_kv, _, first, visible, table, shift, width, scale, _, fwd_tiles,
     bwd_tiles, _, parts, _) = inputs
    _, full2, rowstat, g, chosen, chosen_scores = output
    ctx.save_for_backward(index_q, index_k, index_weights, q, compressed_kv, first, visible, table, full2, rowstat,
                          g)
    ctx.shift, ctx.width, ctx.scale, ctx.fwd_tiles, ctx.bwd_tiles = shift, width, scale, fwd_tiles, bwd_tiles
    ctx.parts = parts
    ctx.mark_non_differentiable(full2, rowstat, g, chosen, chosen_scores)


def _ranges_backward(ctx, grad_kl, *_grad_state):
    d_qi, d_ki, d_w = indexer_kl_ranges_backward_op(_zero_grad_if_none(grad_kl, ctx.saved_tensors[0]),
                                                    *ctx.saved_tensors, ctx.shift, ctx.width, ctx.scale,
                                                    ctx.fwd_tiles, ctx.bwd_tiles, ctx.parts)
    return (d_qi, d_ki, d_w) + (None,) * 15


indexer_kl_ranges_op.register_autograd(_ranges_backward, setup_context=_setup_ranges_context)


def _kl_backward_gluon_teacher(grad_kl, operands, full_lse, chunks, K: int, scale: float, config: dict,
                               bwd_config: dict, ranges: StudentRanges | None = None):
    """The backward without a saved dKL/dI, on the Gluon teacher kernels: per chunk the teacher mass again
    (Gluon, from the saved full denominators ``full_lse``, natural log), dKL/dI from the forward kernel (full form,
    mass given, the student's logits formed again: by the indexer's score kernel with ``ranges``), then the
    backward kernels with it. Memory: one chunk's (rows, K) mass and dKL/dI. Same returns as :func:`_kl_backward`."""
    qi, ki, w, qm, ckv = operands
    d_qi = torch.empty_like(qi)
    d_ki = torch.zeros(ki.shape, dtype=torch.float32, device=ki.device)
    d_w = torch.empty(qi.shape[0], qi.shape[1], dtype=torch.float32, device=qi.device)
    for s, e, idx, n_end in chunks:
        rows = (qi[s:e], ki, w[s:e], qm[s:e], ckv)
        chunk = [(0, e - s, idx, n_end)]
        chunk_ranges = None if ranges is None else ranges.rows(s, e)
        try:
            mass = gluon_hopper.teacher_mass(qm[s:e], ckv, idx, full_lse[s:e], scale, n_end=n_end,
                                             first=None if chunk_ranges is None else chunk_ranges.first_rows())
        except Exception as exc:
            raise GluonTeacherFailed() from exc
        _, full2, rowstat, g = _kl_forward(rows, full_lse[s:e], chunk, K, scale, True, config, True, mass,
                                           ranges=chunk_ranges)
        dq, dk, dw = _kl_backward(grad_kl[s:e], rows, full2, rowstat, g, chunk, K, scale, bwd_config,
                                  chunk_ranges)
        d_qi[s:e], d_w[s:e] = dq, dw
        d_ki += dk
    return d_qi, d_ki, d_w


def _tiles(config: dict | None, default: dict, keys: tuple[str, ...], what: str) -> list[int]:
    unknown = sorted(set(config or {}) - set(keys))
    if unknown:          # e.g. a key a release removed: it would otherwise do nothing, silently
        raise ValueError(f"indexer_kl {what}: unknown keys {unknown}; expected some of {list(keys)}")
    merged = dict(default, **(config or {}))
    return [variants.mode_index(merged[key]) if key == "KERNEL" else int(merged[key]) for key in keys]


def indexer_kl_triton(index_q: torch.Tensor, index_k: torch.Tensor, index_weights: torch.Tensor, q: torch.Tensor,
                      compressed_kv: torch.Tensor, outside_lse: torch.Tensor, candidates: IndexSet, scale: float,
                      config: dict | None = None, bwd_config: dict | None = None, full: bool = False,
                      student_scores: torch.Tensor | None = None, select_topk: int | None = None):
    """Triton implementation behind :func:`dsv4attn.ops.indexer_kl` (arguments already checked).

    Args:
        index_q: (T, Hi, Di) indexer queries; index_k: (Nc, Di) indexer keys; index_weights: (T, Hi) head weights
            (read in fp32). fp16/bf16/fp32; these three get gradients (in their own dtypes).
        q: (T, H, D) main queries; compressed_kv: (Nc, D) main compressed KV (detached; a dtype differing from
            ``q``'s widens both to fp32, likewise for ``index_q`` / ``index_k``).
        outside_lse: (T, H) log attention mass outside S_t (window + sink; -inf allowed), detached, read in fp32;
            with ``full`` each head's full denominator L_h instead (window + sink + S_t), which spares the pass that
            forms the teacher logits only for their LSE.
        candidates: an :class:`IndexSet` of width K (rows of ``index_k`` / ``compressed_kv``, -1 = empty).
            :class:`Explicit` runs ``indexer_kl``; :class:`VisibleCompressed`, a :class:`Rows` view of one or a
            :class:`Stack` of those views (``index_sets.contiguous_ranges``) runs ``indexer_kl_ranges``
            (materialised one chunk of query rows at a time, in both directions); any other set is materialised
            whole.
        scale: main attention softmax scale.
        config / bwd_config: tile configurations (default :data:`FWD_CONFIG` / :data:`BWD_CONFIG`).
        student_scores: with ``full``, the (T, K) student logits the top-k formed (the forward reads them instead of
            the indexer keys; a lazy index set is then materialised, as the scores are (T, K) already).
        select_topk: also the indexer's top-k over the candidates (:func:`dsv4attn.ops.indexer_kl`); over ranges on
            the Gluon teacher's path it is selected from the score pass the forward makes for the student anyway.
    Returns:
        (T,) fp32 KL per row, 0 for rows with an empty S_t; with ``select_topk`` the triple (kl, indices, scores).

    float64 inputs, and empty problems (T = 0 or K = 0), **fall back to the reference**. Eager and compiled code
    take the same ops (module doc).
    """
    fwd_tiles = _tiles(config, FWD_CONFIG, FWD_KEYS, "config")            # checked on every path
    bwd_tiles = _tiles(bwd_config, BWD_CONFIG, BWD_KEYS, "bwd_config")
    tensors = (index_q, index_k, index_weights, q, compressed_kv, outside_lse)
    given = candidates

    def with_topk(kl):
        """``kl``, or (kl, indices, scores) with the top-k op's selection (every path but the fused one)."""
        if not select_topk:
            return kl
        chosen = indexer_triton.indexer_topk_triton(index_q.detach(), index_k.detach(), index_weights.detach(),
                                                    given, select_topk, return_scores=True)
        return (kl, *chosen)

    if (any(t.dtype not in KERNEL_DTYPES for t in tensors) or index_q.shape[0] == 0 or candidates.width == 0):
        return with_topk(indexer_kl_reference(index_q, index_k, index_weights, q, compressed_kv, outside_lse,
                                              candidates, scale, full=full, student_scores=student_scores))
    q, compressed_kv, outside_lse = q.detach(), compressed_kv.detach(), outside_lse.detach()
    if student_scores is not None:
        if not full:
            raise ValueError("student_scores needs full=True (the sparse phase's teacher over the top-k)")
        student_scores = student_scores.detach()
        if not isinstance(candidates, Explicit):
            candidates = Explicit(candidates.materialize())
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (index_q, index_k, index_weights))
    ranges = None if isinstance(candidates, Explicit) else contiguous_ranges(candidates)
    if ranges is not None and ranges[3] < 0:   # the score kernels would read key rows below 0 (never built so)
        ranges = None
    if ranges is not None:                     # the warm-up's every visible entry
        first, visible, table, shift = ranges
        out = indexer_kl_ranges_op(index_q, index_k, index_weights, q, compressed_kv, outside_lse, first, visible,
                                   table, shift, candidates.width, float(scale),
                                   _saves_g(index_q.shape[0], candidates.width) and grads, fwd_tiles, bwd_tiles,
                                   bool(full), range_part_starts(candidates), int(select_topk or 0))
        return (out[0], out[4], out[5]) if select_topk else out[0]
    if not isinstance(candidates, Explicit):   # no ranges: materialised whole, as int32 one chunk of rows at a time
        idx = torch.empty(index_q.shape[0], candidates.width, dtype=torch.int32, device=index_q.device)
        for s, e in chunk_rows(index_q.shape[0], candidates.width, budget=INDEX_BUDGET):
            idx[s:e] = candidates.rows(s, e, torch.int32)
        candidates = Explicit(idx)
    idx = candidates.rows(0, candidates.total_rows, torch.int32) if candidates.offset else candidates.indices
    # Given student scores always save dKL/dI (G is their size): a backward recomputing the teacher would form the
    # student from the dots again, not from the given scores its forward used.
    save_g = (_saves_g(index_q.shape[0], candidates.width) or student_scores is not None) and grads
    return with_topk(indexer_kl_op(index_q, index_k, index_weights, q, compressed_kv, outside_lse,
                                   idx.to(torch.int32), float(scale), save_g, fwd_tiles, bwd_tiles, bool(full),
                                   student_scores)[0])


def kl_grads_from_mass_triton(mass, index_q, index_k, index_weights, candidates: torch.Tensor, student_scores,
                              weight):
    """:func:`.reference.kl_grads_from_mass_reference` on the kernels: kl (T,) fp32, d index_q in ``index_q``'s
    dtype (fp32 for mixed index dtypes), d index_k (Nc, Di) fp32, d index_weights fp32. ``candidates`` (T, K) int,
    ``mass`` and ``student_scores`` (T, K) float, ``weight`` a () tensor. The full-denominator forward runs with
    both the mass and the student logits given (it then reads no teacher operand and no indexer key: one-row stand-ins
    serve as the teacher's pointers, and a (T, 1) zero stands for the denominators it copies to its unread
    ``full2``), keeping dKL/dI for the saved-gradient backward (the Gluon kernel on SM90)."""
    qi, ki = (x.contiguous() for x in _common_dtype(index_q, index_k))
    T, K = candidates.shape
    if ki.shape[0] == 0:                        # every slot empty: the kernels want a real pointer
        ki = ki.new_zeros(1, ki.shape[1])
    stand_in = qi.new_zeros(1, 1, 16)
    operands = (qi, ki, index_weights.float().contiguous(), stand_in.expand(T, 1, 16), stand_in[0])
    idx = candidates.to(torch.int32).contiguous()
    chunks = _row_chunks(idx, row_ends(idx))
    with backend.exact_math(index_q.device):
        kl, full2, rowstat, g = _kl_forward(operands, qi.new_zeros(T, 1, dtype=torch.float32), chunks, K, 1.0, True,
                                            FWD_CONFIG, full=True, mass=mass.float().contiguous(),
                                            scores=student_scores)
        grad = weight.float().expand(T).contiguous()
        d_qi, d_ki, d_w = _kl_backward(grad, operands, full2, rowstat, g, chunks, K, 1.0, dict(BWD_CONFIG))
    return kl, d_qi, d_ki[:index_k.shape[0]], d_w


def _bwd_config(bwd_tiles) -> dict:
    config = dict(zip(BWD_KEYS, bwd_tiles))
    return dict(config, KERNEL=variants.MODES[config["KERNEL"]])


variants.register("indexer_kl", "forward", variants.Variant("triton", "KL forward kernel (_indexer_kl_fwd_kernel)",
                                                            variants.always, variants.always))
variants.register(
    "indexer_kl", "teacher_mass",
    variants.Variant("gluon", "teacher kernels (_teacher_mass_gluon, _teacher_lse_gluon; _ranges forms)",
                     lambda qm: gluon_hopper.check(qm), sm90),
    variants.Variant("triton", "teacher mass inside the KL forward kernel (_indexer_kl_fwd_kernel)",
                     variants.always, variants.always))
variants.register(
    "indexer_kl", "backward",
    variants.Variant("gluon", "KL backward kernel (_indexer_kl_bwd_gluon)", lambda qi, ki: gluon_kl.check(qi, ki),
                     sm90),
    variants.Variant("triton", "KL backward kernel (_indexer_kl_bwd_kernel)", variants.always, variants.always))
variants.register(
    "indexer_kl", "backward_pairs",
    variants.Variant("gluon", "KL backward, the warm-up's rows in pairs (_indexer_kl_bwd_pairs_gluon)",
                     lambda qi, ki: gluon_kl.check(qi, ki), sm90),
    variants.Variant("triton", "KL backward, one row a program (the backward pass's kernel)", variants.always,
                     variants.always))
backend.register_kernel("indexer_kl", indexer_kl_triton)

__all__ = ["indexer_kl_triton", "kl_grads_from_mass_triton", "indexer_kl_op", "indexer_kl_backward_op",
           "indexer_kl_ranges_op",
           "indexer_kl_ranges_backward_op", "FWD_CONFIG", "BWD_CONFIG", "FWD_KEYS",
           "BWD_KEYS", "SAVE_G_MAX_WIDTH", "SAVE_G_BUDGET"]

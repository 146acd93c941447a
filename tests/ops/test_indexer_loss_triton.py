"""Triton indexer KL loss (forward + backward) vs the float64 reference: CPU interpreter at small shapes, GPU at V4.

The interpreter must be switched on before Triton is first imported, and pytest may already have imported it through
other test modules, so every kernel run happens in one subprocess (``_worker``) that sets TRITON_INTERPRET=1 first
and prints its measurements as JSON; the parametrised tests only judge those numbers.

Bounds, per output (KL per row, d index_q, d index_k, d index_weights), max abs error against the float64 reference
on the same (rounded) inputs:
- fp32 inputs: within 1e-5 of the largest magnitude (the kernels multiply fp32 in true fp32, never tf32);
- bf16 / fp16 / mixed inputs: <= 2x (KL) / 3x (gradients) the error of the reference run on the same low-precision
  inputs, plus 1e-6 of the largest magnitude (fp32 summation-order noise where the reference's own error is ~0).

Every case draws fresh inputs from its own seed: ragged packs (tests/packs.py) for the warm-up candidate sets
(VisibleCompressed), random top-k rows with -1 holes, repeated slots (each occurrence counts, as in the reference)
and empty rows for the sparse ones, some rows with outside_lse = -inf. Both forward modes (one candidate tile; two
passes over candidate blocks), both backward modes (saved dKL/dI; teacher recomputed) and several query-row chunks
are exercised.

Explicit candidates run the registered ops ``dsv4attn::indexer_kl`` / ``indexer_kl_backward``, the warm-up's lazy sets
``indexer_kl_ranges`` / ``indexer_kl_ranges_backward``: the worker checks which ops run, that both pairs give the same
bits on the same candidates, and runs ``torch.library.opcheck`` and ``torch.compile(fullgraph=True)`` on both (they
run the kernels, so here too).
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from dsv4attn import variants
from dsv4attn.ops.index_sets import Explicit, row_ends

from tests.ops.interpreter import run_worker
from tests.ops.kernel_checks import OpLog, assert_error_within, low_precision_bound

NAMES = ("kl", "d_index_q", "d_index_k", "d_index_weights")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

MULTI_BLOCK = dict(BLOCK_N=16, GIVEN_BLOCK_N=16)  # several candidate blocks per row (the defaults: 64 and 1024)


def _never(rows: int, width: int) -> bool:
    """Stands in for ``_saves_g``: the forward keeps no dKL/dI, so the backward forms the teacher again."""
    return False


def _case(dtype, kind="explicit", T=16, H=5, D=32, Hi=3, Di=16, Nc=40, K=20, fwd=None, bwd_n=None,
          save_g=True, budget=None, lengths=None, teacher_dtype=None, full=False, scores=False, keys_dtype=None):
    # full: the kernel is given each head's full denominator (full_lse) instead of the outside mass. scores (with
    # full): the student logits are given too, formed beforehand in fp32 (as the indexer's top-k forms them), and the
    # low-precision reference is given the same ones.
    return dict(dtype=dtype, kind=kind, T=T, H=H, D=D, Hi=Hi, Di=Di, Nc=Nc, K=K, fwd=fwd or {},
                bwd_n=bwd_n, save_g=save_g, budget=budget, lengths=lengths, teacher_dtype=teacher_dtype, full=full,
                scores=scores, keys_dtype=keys_dtype)


# tests/packs.py's ragged lengths (length 1, < 4, == 4, 4 + 1, not divisible, an empty document) and one document
# long enough for 17 visible entries, wider than one 16-slot candidate block.
RAGGED = (1, 3, 4, 0, 5, 9, 30)
RAGGED_WIDE = (1, 3, 4, 0, 5, 9, 70)
# The GPU failures' inputs, scaled down (see flash_inputs): one causal document with a top-k of its visible compressed
# entries (-1 filled at the END of the early rows' candidate lists), and the ragged pack T/8, 3, T/2, rest.
CAUSAL_T = 96
RAGGED_GPU = (20, 3, 80, 57)          # T = 160: width 80 // 4 = 20, more than one 16-slot block in multi-block mode
CASES = {
    "fp32-topk-default-tiles": _case("fp32"),
    "bf16-topk-default-tiles": _case("bf16"),
    "fp32-topk-multi-block": _case("fp32", K=36, Nc=50, fwd=MULTI_BLOCK),
    "bf16-topk-multi-block": _case("bf16", K=36, Nc=50, fwd=MULTI_BLOCK),
    "fp32-topk-head-blocks": _case("fp32", H=20, Hi=20, fwd=dict(BLOCK_HI=16)),
    "fp32-topk-recompute-bwd": _case("fp32", save_g=False, bwd_n=16, K=36, Nc=50),
    "bf16-topk-recompute-bwd": _case("bf16", save_g=False, bwd_n=16, K=36, Nc=50),
    "fp32-visible-default-tiles": _case("fp32", kind="visible", lengths=RAGGED),
    "bf16-visible-multi-block-recompute-chunks": _case("bf16", kind="visible", lengths=RAGGED_WIDE, fwd=MULTI_BLOCK,
                                                    save_g=False, bwd_n=16, budget=9 * 17),
    "mixed-q-bf16-compressed-kv-fp32": _case("bf16", teacher_dtype="fp32"),
    "bf16-causal-topk-default-tiles": _case("bf16", kind="causal", T=CAUSAL_T, K=20),
    "bf16-causal-topk-multi-block": _case("bf16", kind="causal", T=CAUSAL_T, K=20, fwd=MULTI_BLOCK),
    "bf16-ragged-like-h200-test-default-tiles": _case("bf16", kind="visible", lengths=RAGGED_GPU),
    "bf16-ragged-like-h200-test-multi-block-recompute": _case("bf16", kind="visible", lengths=RAGGED_GPU,
                                                     fwd=MULTI_BLOCK, save_g=False, bwd_n=16),
    "fp32-topk-full-denominator": _case("fp32", K=36, Nc=50, fwd=MULTI_BLOCK, full=True),
    "bf16-topk-full-denominator": _case("bf16", K=36, Nc=50, fwd=MULTI_BLOCK, full=True),
    "bf16-topk-full-denominator-recompute-bwd": _case("bf16", save_g=False, bwd_n=16, K=36, Nc=50, fwd=MULTI_BLOCK,
                                                      full=True),
    "bf16-causal-topk-full-denominator-default-config": _case("bf16", kind="causal", T=CAUSAL_T, K=20, fwd={},
                                                              full=True),
    "bf16-visible-full-denominator-chunks": _case("bf16", kind="visible", lengths=RAGGED_WIDE, fwd=MULTI_BLOCK,
                                                  budget=9 * 17, full=True),
    "fp32-topk-scores-given": _case("fp32", K=36, Nc=50, fwd=MULTI_BLOCK, full=True, scores=True),
    "bf16-topk-scores-given": _case("bf16", K=36, Nc=50, fwd=MULTI_BLOCK, full=True, scores=True),
    # Scores other than the dots (x1.5): the forward and the gradients must both follow the given ones, also when
    # narrow rows would otherwise recompute the teacher (save_g=False: given scores always save dKL/dI).
    "fp32-topk-scores-given-scaled-no-save": _case("fp32", save_g=False, bwd_n=16, K=36, Nc=50, fwd=MULTI_BLOCK,
                                                   full=True, scores="scaled"),
    "bf16-causal-topk-scores-given-default-config": _case("bf16", kind="causal", T=CAUSAL_T, K=20, full=True,
                                                          scores=True),
    "bf16-visible-scores-given-chunks": _case("bf16", kind="visible", lengths=RAGGED_WIDE, fwd=MULTI_BLOCK,
                                              budget=9 * 17, full=True, scores=True),
    # fp16: the backward's dx rounded to fp16, in the kernel and the reference alike.
    "fp16-topk-default-tiles": _case("fp16"),
    # index_q bf16, index_k fp32: both products widen to fp32 (no rounding of dx), in the kernel and the reference.
    "mixed-index-q-bf16-index-k-fp32": _case("bf16", keys_dtype="fp32"),
}


def _student_scores(inputs, dtype=torch.float32) -> torch.Tensor:
    """(T, K) student logits of the candidates from the rounded inputs, as the indexer's top-k forms them (fp32 sums
    of the input-dtype products, or float64 with ``dtype``; -inf at empty slots)."""
    from dsv4attn.ops.index_sets import gather_rows
    from dsv4attn.ops.indexer.reference import index_scores
    index_q, index_k, index_w, _, _, _, cand, _ = inputs
    idx = cand.rows(0, cand.total_rows).long()
    return index_scores(index_q.to(dtype), gather_rows(index_k, idx).to(dtype), index_w.to(dtype), idx >= 0)


def _inputs(c, seed):
    """index_q, index_k, index_weights, q, compressed_kv, outside_lse (float64 values rounded to the case dtypes),
    candidates (an IndexSet), grad_kl."""
    from dsv4attn.ops.index_sets import Explicit, VisibleCompressed
    from tests.packs import build_pack, random_indices

    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[c["dtype"]]
    tdt = DTYPES[c["teacher_dtype"] or c["dtype"]]
    if c["kind"] == "visible":
        pack = build_pack(c["lengths"], padding=3)
        lay = pack.compressed(4)
        T, Nc = pack.total_rows, lay.capacity
        cand = VisibleCompressed(lay, T)
    elif c["kind"] == "causal":                                 # as flash_inputs(mode="sparse"), scaled down
        pack = build_pack((c["T"],))
        lay = pack.compressed(4)
        T, Nc = pack.total_rows, lay.capacity
        score = torch.rand(T, Nc, generator=gen, dtype=torch.float64)
        score = score.masked_fill(torch.arange(Nc)[None, :] >= lay.row_visible[:, None], -1.0)
        top = torch.topk(score, min(c["K"], Nc), dim=1)
        cand = Explicit(torch.where(top.values >= 0, top.indices, -1).to(torch.int32))
    else:
        T, Nc = c["T"], c["Nc"]
        idx = random_indices(gen, T, Nc, c["K"], hole_frac=0.3, empty_rows=(1, T - 1), dtype=torch.int64)
        idx[:, 1] = idx[:, 0]                                  # repeated slots: each occurrence counts
        idx[4:, -3:] = -1                                      # trailing holes (the top-k's -1 fill)
        cand = Explicit(idx.to(torch.int32))
    H, D, Hi, Di = c["H"], c["D"], c["Hi"], c["Di"]

    def randn(*shape, std=1.0):
        return std * torch.randn(*shape, generator=gen, dtype=torch.float64)
    index_q = randn(T, Hi, Di).to(dt)
    index_k = randn(Nc, Di).to(DTYPES[c["keys_dtype"] or c["dtype"]])     # another dtype: both widen to fp32
    index_w = randn(T, Hi, std=0.5).to(dt)
    q = randn(T, H, D, std=2.0).to(dt)
    ckv = randn(Nc, D).to(tdt)                                 # another dtype than q: both widen to fp32
    outside = (randn(T, H) + 1.0).float()
    outside[2] = -math.inf                                     # no window / sink mass at all
    outside[5, :2] = -math.inf
    grad_kl = torch.rand(T, generator=gen, dtype=torch.float64) + 0.5
    return index_q, index_k, index_w, q, ckv, outside, cand, grad_kl


def _with_full_lse(inputs, dtype=torch.float32):
    """The inputs with the outside mass replaced by each head's full denominator L = logaddexp(outside, lse_S),
    computed in float64 from the rounded inputs, then stored in fp32 (what a caller would pass as full_lse; float64
    with ``dtype``)."""
    index_q, index_k, index_w, q, ckv, outside, cand, grad_kl = inputs
    full = torch.empty_like(outside, dtype=torch.float64)
    for s in range(0, q.shape[0], 256):                                       # rows in chunks: (256, K, D) gathers
        e = min(s + 256, q.shape[0])
        idx = cand.rows(s, e).long()
        logits = torch.einsum("thd,tkd->thk", q[s:e].double(), ckv.double()[idx.clamp(min=0)]) * q.shape[-1] ** -0.5
        logits = logits.masked_fill(~(idx >= 0)[:, None, :], float("-inf"))
        full[s:e] = torch.logaddexp(outside[s:e].double(), torch.logsumexp(logits, dim=-1))
    return index_q, index_k, index_w, q, ckv, full.to(dtype), cand, grad_kl


def _run(fn, inputs, widen=False):
    index_q, index_k, index_w, q, ckv, outside, cand, grad_kl = inputs
    leaves = [t.detach().clone() for t in (index_q, index_k, index_w)]
    rest = [q, ckv, outside]
    if widen:
        leaves, rest = [t.double() for t in leaves], [t.double() for t in rest]
    leaves = [t.requires_grad_(True) for t in leaves]
    kl = fn(*leaves, *rest, cand, q.shape[-1] ** -0.5)
    (kl.double() * grad_kl).sum().backward()
    return [kl.detach().double()] + [t.grad.double() for t in leaves]


def _compare(kernel, ref_low, exact):
    result = {}
    for name, k, r, e in zip(NAMES, kernel, ref_low, exact):
        result[name] = dict(err_kernel=(k - e).abs().max().item(), err_ref=(r - e).abs().max().item(),
                            magnitude=e.abs().max().item(), finite=bool(torch.isfinite(k).all()))
    return result


def _worker() -> None:
    """Runs in the subprocess (TRITON_INTERPRET=1 already set): every case, printed as one JSON object."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from dsv4attn import backend
    from dsv4attn.ops import indexer_kl
    from dsv4attn.ops.index_sets import Explicit
    from dsv4attn.ops.indexer_loss import triton as klt
    from dsv4attn.ops.indexer_loss.reference import indexer_kl_reference

    _empty = torch.empty

    def poisoned_empty(*args, **kwargs):       # outputs / saved buffers the kernels must fully write start as NaN
        t = _empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2 ** 30))
    _empty_like = torch.empty_like

    def poisoned_empty_like(*args, **kwargs):
        t = _empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2 ** 30))
    torch.empty, torch.empty_like = poisoned_empty, poisoned_empty_like

    results = {}
    for seed, (case_id, c) in enumerate(CASES.items()):
        inputs = _inputs(c, 100 + seed)
        fwd = dict(klt.FWD_CONFIG, **c["fwd"])
        bwd = dict(klt.BWD_CONFIG, **({"BLOCK_N": c["bwd_n"]} if c["bwd_n"] else {}))
        saved = klt._saves_g, klt.INDEX_BUDGET
        klt._saves_g = klt._saves_g if c["save_g"] else _never
        klt.INDEX_BUDGET = c["budget"] or klt.INDEX_BUDGET
        full = c["full"]
        given = _with_full_lse(inputs) if full else inputs
        student = _student_scores(inputs) if c["scores"] else None
        if c["scores"] == "scaled":
            student = student * 1.5
        kernel = _run(lambda *a: klt.indexer_kl_triton(*a, config=fwd, bwd_config=bwd, full=full,
                                                       student_scores=student), given)
        klt._saves_g, klt.INDEX_BUDGET = saved
        ref_low = _run(lambda *a: indexer_kl_reference(*a, full=full, student_scores=student), given)
        if c["scores"] == "scaled":     # ground truth with the same (scaled) student, in float64
            student64 = _student_scores(inputs, torch.float64) * 1.5
            exact = _run(lambda *a: indexer_kl_reference(*a, full=True, student_scores=student64),
                         _with_full_lse(inputs, torch.float64), widen=True)
        else:
            exact = _run(indexer_kl_reference, inputs, widen=True)     # the outside-mass form: ground truth
        results[case_id] = _compare(kernel, ref_low, exact)
        results[case_id]["width"] = inputs[6].width

    # Edge cases, fp32, one tile: teacher mass ~1e-30 (renormalised), teacher mass below FLT_MIN (exact zeros),
    # and no compressed entry at all (Nc = 0, every slot -1).
    edge = {}
    base = _inputs(CASES["fp32-topk-default-tiles"], 7)
    for name, value in (("tiny_mass", 70.0), ("underflow", 200.0)):
        for full in (False, True):
            inputs = list(base)
            inputs[5] = torch.full_like(base[5], value)
            given = _with_full_lse(inputs) if full else inputs
            kernel = _run(lambda *a: klt.indexer_kl_triton(*a, full=full), given)
            exact = _run(indexer_kl_reference, inputs, widen=True)
            low = _run(lambda *a: indexer_kl_reference(*a, full=full), given)
            edge[name + ("_full" if full else "")] = dict(
                bounds=_compare(kernel, low, exact), all_zero=all(bool((t == 0).all()) for t in kernel),
                max_kl=kernel[0].max().item())
    inputs = list(base)
    inputs[1], inputs[4] = base[1][:0], base[4][:0]
    inputs[6] = Explicit(torch.full((base[0].shape[0], 3), -1, dtype=torch.int32))
    kernel = _run(klt.indexer_kl_triton, inputs)
    edge["no_keys"] = dict(all_zero=all(bool((t == 0).all()) for t in kernel), dk_shape=list(kernel[2].shape))
    results["edge"] = edge

    # Plumbing: registration, dispatch of the public op, the documented float64 fallback.
    inputs = _inputs(CASES["bf16-topk-default-tiles"], 1)
    direct = _run(klt.indexer_kl_triton, inputs)
    backend.set_backend("triton")
    index_q, index_k, index_w, q, ckv, outside, cand, grad_kl = inputs
    public = _run(lambda a, b, c_, q_, k_, o_, s_, sc: indexer_kl(a, b, c_, q_, k_, s_, o_, sc), inputs)
    full_inputs = _with_full_lse(inputs)
    public_full = _run(lambda a, b, c_, q_, k_, o_, s_, sc: indexer_kl(a, b, c_, q_, k_, s_, softmax_scale=sc,
                                                                       full_lse=o_), full_inputs)
    widened = [t.double() if t.is_floating_point() else t for t in inputs[:6]] + list(inputs[6:])
    fallback = _run(klt.indexer_kl_triton, widened)
    backend.set_backend(None)
    reference = _run(indexer_kl_reference, widened)
    results["plumbing"] = dict(
        registered=backend.registered_kernels().count("indexer_kl") == 1
        and backend.kernel("indexer_kl") is klt.indexer_kl_triton,
        public_matches_direct=all(torch.equal(a, b) for a, b in zip(public, direct)),
        public_full_lse_matches_direct=all(torch.equal(a, b) for a, b in zip(
            public_full, _run(lambda *a: klt.indexer_kl_triton(*a, full=True), full_inputs))),
        fp64_fallback_is_reference=all(torch.equal(a, b) for a, b in zip(fallback, reference)),
    )
    results["op"] = _op_checks(klt, inputs)
    results["range_rows"] = _range_rows_twin(klt)
    results["mass_given"] = _mass_given_check(klt)
    results["from_mass"] = _from_mass_check(klt)
    results["gluon_teacher"] = _gluon_teacher_check(klt)
    print("RESULTS " + json.dumps(results))


def _gluon_teacher_check(klt) -> dict:
    """The Gluon-teacher path (outside mass given, as in the warm-up, and full_lse given; several chunks; the lazy
    Function and the registered ops) with its two Gluon kernels stood in for by float64 torch versions: the dataflow
    around them (per-chunk full denominators and mass, the full form, the backward's mass again) against the float64
    reference, the two paths bit for bit (here: the ranges pair takes the student's logits from the indexer's score
    kernel and the other pair forms them in the KL kernel; with 3 heads of 16 dims and the index operands on grids
    that make every product and sum exact in fp32, they agree bit for bit in any summation order, on a GPU with
    inputs of full precision only up to fp32 rounding); and its fallbacks: a build failure of a Gluon kernel in the
    forward or the backward warns and falls back, a bug in one (not a build failure) and every error of the Triton
    kernels propagate."""
    import warnings

    from triton.runtime.errors import PTXASError

    from dsv4attn.ops.index_sets import Explicit
    from dsv4attn.ops.indexer_loss.reference import indexer_kl_reference
    from dsv4attn.ops.sparse_attention import gluon_hopper

    def logits(qm, ckv, idx, scale):
        valid = idx >= 0
        s = torch.einsum("thd,tkd->thk", qm.double(), ckv.double()[idx.long().clamp(min=0)]) * scale
        return s.masked_fill(~valid[:, None, :], float("-inf")), valid

    def ranges_form(idx, first):
        # The range form (TMA copies of consecutive kv rows) is asked for only where the valid slots are first + j.
        if first is not None:
            calls["ranges"] += 1
            j = torch.arange(idx.shape[1])
            assert torch.equal(idx[idx >= 0].long(), (first.long()[:, None] + j)[idx >= 0])

    def teacher_lse(qm, ckv, idx, scale, config=None, n_end=None, first=None):
        ranges_form(idx, first)
        return torch.logsumexp(logits(qm, ckv, idx, scale)[0], -1).float()

    def teacher_mass(qm, ckv, idx, full_lse, scale, config=None, n_end=None, first=None):
        ranges_form(idx, first)
        s, valid = logits(qm, ckv, idx, scale)
        full = full_lse.double().masked_fill(full_lse == float("-inf"), 0.0)   # such heads have only -inf logits
        return torch.where(valid, torch.exp(s - full[..., None]).sum(1), 0.0).float().contiguous()

    calls = {"lse": 0, "mass": 0, "scores": 0, "ranges": 0}
    fail = {"lse": None, "mass": None}
    real_scores = klt.indexer_triton._score_orders

    def counted_scores(*a, **k):                           # the indexer's score kernels (not stubbed: they run)
        calls["scores"] += 1
        return real_scores(*a, **k)

    def stub(name, fn):
        def run(*a, **k):
            calls[name] += 1
            if fail[name] is not None:
                raise fail[name]
            return fn(*a, **k)
        return run

    real = (klt._gluon_teacher, gluon_hopper.teacher_lse, gluon_hopper.teacher_mass, klt.INDEX_BUDGET,
            klt.indexer_triton._score_orders)
    c = CASES["bf16-visible-multi-block-recompute-chunks"]
    inputs = list(_inputs(c, 23))
    # The index operands on grids (q and k: 1/8, the weights: 1/16, all within [-2, 2]): every product and sum of a
    # student logit is then exact in fp32, so the two paths' logits are equal whatever order a CPU's BLAS sums them
    # in under the interpreter (bf16 inputs of full precision gave different last bits on an AMD EPYC).
    for i, step in ((0, 8), (1, 8), (2, 16)):
        inputs[i] = (inputs[i].double() * step).round().clamp(-2 * step, 2 * step).div(step).to(inputs[i].dtype)
    inputs = tuple(inputs)
    exact = _run(indexer_kl_reference, inputs, widen=True)
    low = _run(indexer_kl_reference, inputs)
    fwd = dict(klt.FWD_CONFIG, **c["fwd"])

    def kernel(save_g=True, given=inputs):
        saved = klt._saves_g
        klt._saves_g = saved if save_g else _never
        try:
            return _run(lambda *a: klt.indexer_kl_triton(*a, config=fwd), given)
        finally:
            klt._saves_g = saved
    explicit = list(inputs)
    explicit[6] = Explicit(inputs[6].materialize())        # the registered ops (what torch.compile runs)

    def full_form(save_g, given):                          # the full-denominator form, its mass per chunk
        saved = klt._saves_g
        klt._saves_g = saved if save_g else _never
        try:
            return _run(lambda *a: klt.indexer_kl_triton(*a, config=fwd, full=True), _with_full_lse(given))
        finally:
            klt._saves_g = saved

    out = {}
    klt.INDEX_BUDGET = c["budget"]
    plain = kernel(save_g=False)                                # the two-pass form (no SM90 here)
    klt._gluon_teacher = lambda qm, K: not variants.FAILED          # as on SM90: until a build failure is recorded
    gluon_hopper.teacher_lse, gluon_hopper.teacher_mass = stub("lse", teacher_lse), stub("mass", teacher_mass)
    klt.indexer_triton._score_orders = counted_scores
    try:
        bounds = list(klt.chunk_rows(inputs[0].shape[0], inputs[6].width, budget=klt.INDEX_BUDGET))
        chunks = len(bounds)
        for save_g in (True, False):
            calls.update(lse=0, mass=0, scores=0, ranges=0)
            lazy = kernel(save_g)
            out[f"stubbed-save-{save_g}"] = _compare(lazy, low, exact)
            out[f"calls-save-{save_g}"] = [calls["lse"], calls["mass"], chunks, calls["scores"], calls["ranges"]]
            calls.update(lse=0, mass=0, ranges=0)
            op = kernel(save_g, explicit)
            out[f"op-save-{save_g}"] = dict(equals_lazy=all(torch.equal(a, b) for a, b in zip(op, lazy)),
                                            calls=[calls["lse"], calls["mass"]], ranges=calls["ranges"])
            calls.update(lse=0, mass=0)
            lazy_full = full_form(save_g, inputs)
            lazy_calls = calls["mass"]
            op_full = full_form(save_g, explicit)
            out[f"full-save-{save_g}"] = dict(
                equals_lazy=all(torch.equal(a, b) for a, b in zip(op_full, lazy_full)),
                mass_calls=[lazy_calls, calls["mass"] - lazy_calls], bounds=_compare(lazy_full, low, exact))
        # A context-parallel rank's two segments (a Stack of Rows views with a table and shift): the score kernels
        # take each part on its own, so a chunk holding the parts' boundary makes two calls. In row order a block
        # across the boundary stays within what the score kernels cover, so only the call count shows the split;
        # with the later rows first (entries drop across the boundary: rows 20 and 21 see entries 2 and 3, below the
        # first entry of their chunk's first row) a missing split leaves their scores unwritten and changes the loss
        # (by 1.5 in KL, checked by hand).
        from dsv4attn.ops.index_sets import Rows, Stack
        stacked = dict(_range_sets(inputs, torch.Generator().manual_seed(7)))["rank-view"]
        T, view = inputs[0].shape[0], stacked[6].parts[0]
        back = 2 * T // 3
        perm = torch.cat([torch.arange(back, T), torch.arange(20, back)])
        index_q, moved_k, index_w, q, moved_ckv, outside, _, grad_kl = stacked       # query rows permuted, keys not
        swapped = (index_q[perm], moved_k, index_w[perm], q[perm], moved_ckv, outside[perm],
                   Stack(*(Rows(inputs[6], a, n, shift=view.shift, table=view.table, bound=view.bound - view.shift)
                           for a, n in ((back, T - back), (20, back - 20)))), grad_kl[perm])
        for name, given in (("stack", stacked), ("stack-reversed", swapped)):
            split = given[6].parts[0].total_rows
            given_chunks = list(klt.chunk_rows(given[0].shape[0], given[6].width, budget=klt.INDEX_BUDGET))
            explicit_given = list(given)
            explicit_given[6] = Explicit(given[6].materialize())
            calls.update(scores=0, ranges=0)
            lazy_stack = kernel(True, given)
            out[name] = dict(
                scores_calls=calls["scores"], ranges=calls["ranges"],
                expected=len(given_chunks) + sum(1 for s, e in given_chunks if s < split < e),
                equals_explicit=all(torch.equal(a, b) for a, b in zip(lazy_stack, kernel(True, explicit_given))),
                bounds=_compare(lazy_stack, _run(indexer_kl_reference, given),
                                _run(indexer_kl_reference, given, widen=True)))
        variants.FAILED.clear()
        fail["lse"] = PTXASError("cannot build")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fell_back = kernel(save_g=False)
        out["forward_fallback"] = dict(
            equals_two_pass=all(torch.equal(a, b) for a, b in zip(fell_back, plain)),
            warned=any("could not be built" in str(w.message) for w in caught),
            recorded=any(key[:2] == ("indexer_kl", "teacher_mass") for key in variants.FAILED))
        variants.FAILED.clear()
        fail["lse"] = None
        real_bwd = klt._kl_backward_gluon_teacher

        def failing_bwd(*a, **k):                               # the forward's kernels work, the backward's fail
            fail["mass"] = PTXASError("cannot build")
            return real_bwd(*a, **k)
        klt._kl_backward_gluon_teacher = failing_bwd
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["backward_fallback"] = _compare(kernel(save_g=False), low, exact)
        out["backward_fallback_warned"] = any("could not be built" in str(w.message) for w in caught)
        klt._kl_backward_gluon_teacher = real_bwd
        variants.FAILED.clear()
        fail["mass"] = ValueError("a bug")
        try:
            kernel()
            out["bug_propagates"] = False
        except ValueError as exc:
            out["bug_propagates"] = str(exc) == "a bug" and not variants.FAILED
        fail["mass"] = None
        real_launch = klt._launch

        def failing_launch(*a, **k):
            raise PTXASError("a Triton KL kernel")
        klt._launch = failing_launch
        try:
            kernel()
            out["triton_error_propagates"] = False
        except PTXASError as exc:
            out["triton_error_propagates"] = "a Triton KL kernel" in str(exc) and not variants.FAILED
        klt._launch = real_launch
    finally:
        (klt._gluon_teacher, gluon_hopper.teacher_lse, gluon_hopper.teacher_mass, klt.INDEX_BUDGET,
         klt.indexer_triton._score_orders) = real
        variants.FAILED.clear()
    return out


def _mass_given_check(klt) -> dict:
    """The forward fed a teacher mass formed outside the kernel (as the Gluon teacher-mass kernel does on SM90)
    equals the forward that forms it itself: the mass is computed here in float64 from the same full_lse."""
    c = CASES["fp32-topk-full-denominator"]
    index_q, index_k, index_w, q, ckv, full, cand, _ = _with_full_lse(_inputs(c, 11))
    idx = cand.rows(0, cand.total_rows).to(torch.int32).contiguous()
    valid = idx >= 0
    logits = torch.einsum("thd,tkd->thk", q.double(), ckv.double()[idx.long().clamp(min=0)]) * q.shape[-1] ** -0.5
    mass = torch.where(valid, torch.exp(logits - full.double()[..., None]).sum(1), 0.0).float().contiguous()
    operands = klt._operands(index_q, index_k, index_w, q, ckv)
    chunks = [(0, idx.shape[0], idx, row_ends(idx))]
    fwd = dict(klt.FWD_CONFIG, **c["fwd"])
    scale = q.shape[-1] ** -0.5
    result = {}
    for save_g in (True, False):
        own = klt._kl_forward(operands, full, chunks, idx.shape[1], scale, save_g, fwd, True)
        given = klt._kl_forward(operands, full, chunks, idx.shape[1], scale, save_g, fwd, True, mass)
        names = ("kl", "full2", "rowstat", "g") if save_g else ("kl", "full2", "rowstat")
        # Equal infinities (the student LSE of an empty row is -inf) count as equal; magnitudes over finite entries.
        for name, a, b in zip(names, own, given):
            result[f"{name}-{'g' if save_g else 'no-g'}"] = dict(
                diff=torch.where(a == b, 0.0, a - b).abs().max().item(),
                magnitude=a[torch.isfinite(a)].abs().max().item())
    # The given mass is really what the kernel uses: a different one changes the loss.
    doubled = klt._kl_forward(operands, full, chunks, idx.shape[1], scale, True, fwd, True, mass * mass)[0]
    result["other_mass_changes_kl"] = bool((doubled - own[0]).abs().max() > 1e-3)
    return result


FROM_MASS_CASES = ("fp32-topk-scores-given", "bf16-topk-scores-given", "bf16-causal-topk-scores-given-default-config",
                   "mixed-index-q-bf16-index-k-fp32")


def _from_mass_check(klt) -> dict:
    """``kl_grads_from_mass_triton`` (the sparse KL from the attention backward's teacher mass and the top-k's scores:
    the KL kernel with both given, then the saved-gradient backward) against the reference from the same rounded
    inputs, both measured against float64 (the mass and the scores formed in float64 from the rounded inputs)."""
    from dsv4attn.ops.index_sets import Explicit
    from dsv4attn.ops.indexer_loss.reference import kl_grads_from_mass_reference
    result = {}
    for seed, case_id in enumerate(FROM_MASS_CASES):
        inputs = _inputs(CASES[case_id], 300 + seed)
        index_q, index_k, index_w, q, ckv, full, cand, _ = _with_full_lse(inputs, torch.float64)
        idx = cand.rows(0, cand.total_rows).to(torch.int32)
        valid = idx >= 0
        logits = torch.einsum("thd,tkd->thk", q.double(), ckv.double()[idx.long().clamp(min=0)]) * q.shape[-1] ** -0.5
        mass64 = torch.where(valid, torch.exp(logits - full[..., None]).sum(1), 0.0)
        weight = torch.tensor(0.37)
        scores, scores64 = _student_scores(inputs), _student_scores(inputs, torch.float64)
        kernel = klt.kl_grads_from_mass_triton(mass64.float(), index_q, index_k, index_w, idx, scores, weight)
        low = kl_grads_from_mass_reference(mass64.float(), index_q, index_k, index_w, Explicit(idx), scores, weight)
        exact = kl_grads_from_mass_reference(mass64, index_q.double(), index_k.double(), index_w.double(),
                                             Explicit(idx), scores64, weight.double())
        result[case_id] = _compare([t.double() for t in kernel], [t.double() for t in low], exact)
    return result


# The registered ops, on the small cases: which op runs, bitwise agreement of the two op pairs on the same candidates,
# torch.library's checks and torch.compile. Each case once with the saved dKL/dI and once with the backward
# recomputing the teacher.
# (case, the candidate views _range_sets makes of it)
RANGE_CASES = (("fp32-visible-default-tiles", ("visible",)),
               ("bf16-topk-full-denominator", ("visible", "rank-view")),
               ("mixed-q-bf16-compressed-kv-fp32", ("rank-view",)))


def _range_sets(inputs, gen):
    """The warm-up candidates of ``inputs`` (a VisibleCompressed) as the layers address them: as they are, and as a
    context-parallel rank would (a Stack of two Rows views with an entry table and a shift, the keys moved to the
    rows the table and shift name). Yields (name, inputs with that set)."""
    from dsv4attn.ops.index_sets import Rows, Stack, VisibleCompressed

    index_q, index_k, index_w, q, ckv, outside, cand, grad_kl = inputs
    if not isinstance(cand, VisibleCompressed):       # a top-k case: its pack's every visible entry instead
        from tests.packs import build_pack
        pack = build_pack((5, 3, index_q.shape[0] - 8))
        cand = VisibleCompressed(pack.compressed(4), index_q.shape[0])
        index_k, ckv = index_k[:cand.layout.capacity], ckv[:cand.layout.capacity]
    yield "visible", (index_q, index_k, index_w, q, ckv, outside, cand, grad_kl)
    n, shift, T = index_k.shape[0], 3, index_q.shape[0]
    table = torch.randperm(n, generator=gen)
    moved = [torch.cat([x[:shift], torch.empty_like(x)]) for x in (index_k, ckv)]
    for x, src in zip(moved, (index_k, ckv)):
        x[shift + table] = src                          # row table[e] + shift holds entry e
    split = T // 3
    stacked = Stack(Rows(cand, 0, split, shift=shift, table=table, bound=n),
                    Rows(cand, split, T - split, shift=shift, table=table, bound=n))
    yield "rank-view", (index_q, moved[0], index_w, q, moved[1], outside, stacked, grad_kl)


def _range_rows_twin(klt) -> dict:
    """The warm-up slots as the ranges ops materialise them (one kernel, int32) against the reference twin
    ``index_sets.range_rows``: ragged documents with padding rows, an offset base, a Rows view with an entry table and
    a shift, a context-parallel rank's Stack of such views; whole and in chunks, a width past one kernel block."""
    from dsv4attn.ops.index_sets import Rows, Stack, VisibleCompressed, contiguous_ranges, range_rows
    from tests.packs import build_pack
    equal = {}
    for lengths, padding in (((9, 0, 21, 7), 3), ((3, 2), 1), ((4100, 37), 5)):     # (3, 2): no entry, width 0
        pack = build_pack(lengths, padding)
        T, layout = pack.total_rows, pack.compressed(4)
        visible = VisibleCompressed(layout, T)
        table = torch.randperm(layout.capacity, generator=torch.Generator().manual_seed(0))
        half = T // 2
        sets = {"visible": visible, "offset": VisibleCompressed(layout, T, offset=6),
                "rows": Rows(visible, 3, T - 3, shift=11, table=table, bound=layout.capacity),
                "shifted": Rows(visible, 2, T - 2, shift=5),
                "stack": Stack(Rows(visible, 0, half, shift=11, table=table),
                               Rows(visible, half, T - half, shift=11, table=table))}
        if T > 4096:                     # the wide rows (two kernel blocks) once: the interpreter runs every program
            sets = {"stack": sets["stack"]}
        for name, index_set in sets.items():
            first, count, tbl, shift = contiguous_ranges(index_set)
            rows = index_set.total_rows
            chunks = ((0, rows), (0, 4), (4, 11), (11, rows), (5, 5)) if T <= 4096 else ((4090, 4110),)
            for start, end in [(a, b) for a, b in chunks if a <= b <= rows]:
                want = range_rows(first, count, tbl, shift, index_set.width, start, end, dtype=torch.int32)
                got = klt.range_rows_triton(first, count, tbl, shift, index_set.width, start, end)
                equal[f"{T}-{name}-{start}:{end}"] = got.dtype == torch.int32 and torch.equal(got, want)
    return equal


def _op_checks(klt, plumbing_inputs) -> dict:
    """Explicit candidates run the ops ``dsv4attn::indexer_kl`` / ``indexer_kl_backward``; the warm-up's every visible
    entry (and the Rows / Stack views context parallelism makes of it) runs ``indexer_kl_ranges`` /
    ``indexer_kl_ranges_backward``; other lazy sets are materialised and run the first pair. Both pairs launch the
    same kernels on the same row chunks, so every output is bitwise equal (the interpreter runs the programs, hence
    the d index_k atomics, in one order)."""
    from dsv4attn.ops.index_sets import Explicit, Rows

    out = {}
    explicit_ops = {"dsv4attn.indexer_kl.default", "dsv4attn.indexer_kl_backward.default"}
    ranges_ops = {"dsv4attn.indexer_kl_ranges.default", "dsv4attn.indexer_kl_ranges_backward.default"}
    with OpLog() as log:
        _run(klt.indexer_kl_triton, plumbing_inputs)
    out["explicit_runs_ops"] = explicit_ops <= log.names and not ranges_ops & log.names
    other = list(plumbing_inputs)
    other[6] = Rows(plumbing_inputs[6], 0, plumbing_inputs[6].total_rows)      # lazy, but not ranges
    with OpLog() as log:
        _run(klt.indexer_kl_triton, other)
    out["other_lazy_sets_run_explicit_ops"] = explicit_ops <= log.names and not ranges_ops & log.names
    visible = _inputs(CASES["fp32-visible-default-tiles"], 299)
    with OpLog() as log:
        _run(klt.indexer_kl_triton, visible)
    out["visible_runs_ranges_ops"] = ranges_ops <= log.names and not explicit_ops & log.names

    saved = klt._saves_g, klt.INDEX_BUDGET
    equal = {}
    gen = torch.Generator().manual_seed(5)
    for seed, (case_id, views) in enumerate(RANGE_CASES):
        c = CASES[case_id]
        fwd = dict(klt.FWD_CONFIG, **c["fwd"])
        for name, inputs in _range_sets(_inputs(c, 300 + seed), gen):
            if name not in views:
                continue
            if c["full"]:
                inputs = _with_full_lse(inputs)
            explicit = list(inputs)
            explicit[6] = Explicit(inputs[6].materialize())
            for save_g in (True, False):
                klt._saves_g = saved[0] if save_g else _never
                klt.INDEX_BUDGET = 6 * inputs[6].width                 # chunks of 6 query rows
                got = _run(lambda *a: klt.indexer_kl_triton(*a, config=fwd, full=c["full"]), inputs)
                want = _run(lambda *a: klt.indexer_kl_triton(*a, config=fwd, full=c["full"]), explicit)
                equal[f"{case_id}-{name}-{'saved' if save_g else 'recompute'}"] = all(
                    torch.equal(a, b) for a, b in zip(got, want))
    klt._saves_g, klt.INDEX_BUDGET = saved
    out["ranges_equal_explicit_bitwise"] = equal

    # torch.library.opcheck: schema, fake kernels, autograd registration, AOT dispatch with dynamic shapes (the
    # forward's check runs the backward op with the saved dKL/dI; the backward op is checked with the recompute).
    index_q, index_k, index_w, q, ckv, outside, cand, grad_kl = plumbing_inputs
    leaves = [t.detach().clone().requires_grad_(True) for t in (index_q, index_k, index_w)]
    fwd_tiles = [int(klt.FWD_CONFIG[key]) for key in klt.FWD_KEYS]
    bwd_tiles = klt._tiles(None, klt.BWD_CONFIG, klt.BWD_KEYS, "bwd_config")
    args = (*leaves, q, ckv, outside, cand.indices, 0.25, True, fwd_tiles, bwd_tiles)
    student = _student_scores(plumbing_inputs)
    checks = [torch.library.opcheck(klt.indexer_kl_op, args),
              torch.library.opcheck(klt.indexer_kl_op, (*args, True)),           # full_lse form
              torch.library.opcheck(klt.indexer_kl_op, (*args, True, student))]  # and the student's logits given
    _, full2, rowstat, g, n_end = klt.indexer_kl_op(*args[:7], 0.25, False, fwd_tiles, bwd_tiles)
    checks.append(torch.library.opcheck(klt.indexer_kl_backward_op,
                                        (grad_kl.float(), *(t.detach() for t in leaves), q, ckv, cand.indices, n_end,
                                         full2, rowstat, g, 0.25, bwd_tiles, False, fwd_tiles)))
    from dsv4attn.ops.index_sets import contiguous_ranges
    index_q, index_k, index_w, q, ckv, outside, cand, grad_kl = visible
    leaves = [t.detach().clone().requires_grad_(True) for t in (index_q, index_k, index_w)]
    first, vis, table, shift = contiguous_ranges(cand)
    args = (*leaves, q, ckv, outside, first, vis, table, shift, cand.width, 0.25, True, fwd_tiles, bwd_tiles)
    checks.append(torch.library.opcheck(klt.indexer_kl_ranges_op, args))
    checks.append(torch.library.opcheck(klt.indexer_kl_ranges_op, (*args, False, [5])))      # a Stack's part start
    checks.append(torch.library.opcheck(klt.indexer_kl_ranges_op, (*args, False, None, 3)))  # and its top-k
    _, full2, rowstat, g, _, _ = klt.indexer_kl_ranges_op(*args[:12], False, fwd_tiles, bwd_tiles)  # the recompute
    # The top-k it selects (here the top-k op's own: no Gluon teacher under the interpreter) is the indexer's.
    chosen = klt.indexer_kl_ranges_op(*args, False, None, 3)[4:]
    want = klt.indexer_triton.indexer_topk_triton(index_q, index_k, index_w, cand, 3, return_scores=True)
    out["select_topk_is_the_indexer_topk"] = all(torch.equal(a, b) for a, b in zip(chosen, want))
    backward_args = (grad_kl.float(), *(t.detach() for t in leaves), q, ckv, first, vis, table, full2, rowstat, g,
                     shift, cand.width, 0.25, fwd_tiles, bwd_tiles)
    checks.append(torch.library.opcheck(klt.indexer_kl_ranges_backward_op, backward_args))
    checks.append(torch.library.opcheck(klt.indexer_kl_ranges_backward_op, (*backward_args, [5])))
    out["opcheck"] = all(v == "SUCCESS" for check in checks for v in check.values())

    # torch.compile(fullgraph=True) of the Triton path with Explicit candidates: one node per direction, same bits.
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: klt.indexer_kl_triton(*a), fullgraph=True)
    eager = _run(klt.indexer_kl_triton, plumbing_inputs)
    out["compile_fullgraph_matches_eager"] = all(torch.equal(a, b)
                                                 for a, b in zip(_run(compiled, plumbing_inputs), eager))
    # ... and with the warm-up's lazy set: the ranges ops, the same bits as eager.
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: klt.indexer_kl_triton(*a), fullgraph=True)
    out["compile_fullgraph_ranges_matches_eager"] = all(
        torch.equal(a, b) for a, b in zip(_run(compiled, visible), _run(klt.indexer_kl_triton, visible)))
    return out


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_worker("tests.ops.test_indexer_loss_triton")


def _assert_within_bounds(case_id, measured, low_precision):
    for name in NAMES:
        m = measured[name]
        assert m["finite"], f"{case_id} {name}: NaN/inf in the kernel's result"
        if low_precision:
            bound = low_precision_bound(m, 3.0 if name != "kl" else 2.0)
        else:
            bound = 1e-5 * max(m["magnitude"], 1e-30)
        assert_error_within(f"{case_id} {name}", m, bound)


@pytest.mark.parametrize("case_id", list(CASES))
def test_kernel_matches_float64_reference(interpreted, case_id):
    _assert_within_bounds(case_id, interpreted[case_id], CASES[case_id]["dtype"] != "fp32")


def test_multi_block_cases_span_several_blocks(interpreted):
    for case_id, c in CASES.items():
        if c["fwd"] is MULTI_BLOCK:
            assert interpreted[case_id]["width"] > MULTI_BLOCK["BLOCK_N"], case_id


@pytest.mark.parametrize("form", ["", "_full"], ids=["outside-mass", "full-denominator"])
def test_tiny_teacher_mass_is_renormalised(interpreted, form):
    m = interpreted["edge"]["tiny_mass" + form]
    assert m["max_kl"] > 1e-2, "the ~1e-30 teacher was normalised to sum 1"
    _assert_within_bounds("tiny_mass" + form, m["bounds"], low_precision=False)


@pytest.mark.parametrize("form", ["", "_full"], ids=["outside-mass", "full-denominator"])
def test_teacher_mass_below_flt_min_gives_exact_zeros(interpreted, form):
    assert interpreted["edge"]["underflow" + form]["all_zero"]


@pytest.mark.parametrize("what", ["kl-g", "rowstat-g", "g-g", "kl-no-g", "rowstat-no-g"])
def test_forward_with_the_teacher_mass_given_equals_forming_it(interpreted, what):
    m = interpreted["mass_given"][what]
    assert m["magnitude"] > 0 and m["diff"] <= 1e-5 * m["magnitude"], m
    assert interpreted["mass_given"]["other_mass_changes_kl"]


@pytest.mark.parametrize("case_id", FROM_MASS_CASES)
def test_kl_from_a_given_mass_matches_float64(interpreted, case_id):
    """The sparse KL and its gradients from the attention backward's teacher mass (the channel's Triton path): within
    the kernel bounds of the other cases (2x the reference's own error for the loss, 3x for the gradients)."""
    _assert_within_bounds(f"{case_id} from-mass", interpreted["from_mass"][case_id],
                          low_precision=CASES[case_id]["dtype"] != "fp32")


@pytest.mark.parametrize("save_g", [True, False], ids=["saved", "mass-again-in-backward"])
def test_gluon_teacher_dataflow_matches_float64(interpreted, save_g):
    """The warm-up's Gluon-teacher path over several chunks, its Gluon kernels stood in for by float64 torch versions
    (the GPU tests run the real ones): the bounds of the kernels' own tests; teacher_lse once per chunk, the mass
    once per chunk in the forward and, without a saved dKL/dI, once more in the backward."""
    m = interpreted["gluon_teacher"]
    _assert_within_bounds(f"gluon-teacher-save-{save_g}", m[f"stubbed-save-{save_g}"], low_precision=True)
    lse, mass, chunks, scores, ranges = m[f"calls-save-{save_g}"]
    assert chunks > 1 and lse == chunks and mass == (chunks if save_g else 2 * chunks), (lse, mass, chunks)
    # The student's logits come from the indexer's score kernels, per chunk, as the mass does; every teacher call
    # takes the range form (one device: each row's candidates are consecutive kv rows; the stubs check them).
    assert scores == mass and ranges == lse + mass, (scores, mass, ranges)
    # The registered op pair for materialised candidates: the same teacher path in the same chunks (its student
    # logits from the KL kernel's dots: equal here, see _gluon_teacher_check), on the gathering kernels.
    assert m[f"op-save-{save_g}"] == dict(equals_lazy=True, calls=[lse, mass], ranges=0), m[f"op-save-{save_g}"]
    # The full-denominator form (full_lse given): the mass per chunk, in both paths alike.
    full = m[f"full-save-{save_g}"]
    assert full["equals_lazy"] and full["mass_calls"] == [mass] * 2, full
    _assert_within_bounds(f"gluon-teacher-full-save-{save_g}", full["bounds"], low_precision=True)


def test_gluon_teacher_student_scores_per_stack_part(interpreted):
    """On the Gluon teacher's path the student's logits come from the indexer's score kernels, which assume
    neighbouring rows of one layout: a Stack's parts (a context-parallel rank's segments) go to them one by one,
    and the result is that of the materialised candidates (the KL kernel's own dots), within the bounds."""
    for name in ("stack", "stack-reversed"):
        m = interpreted["gluon_teacher"][name]
        assert m["scores_calls"] == m["expected"] and m["equals_explicit"], (name, m)
        assert m["ranges"] == 0, (name, m)           # entries through a table: the gathering teacher kernels
        _assert_within_bounds(f"gluon-teacher-{name}", m["bounds"], low_precision=True)


@pytest.mark.parametrize("check", ["forward_fallback", "backward_fallback", "bug_propagates",
                                   "triton_error_propagates"])
def test_gluon_teacher_fallbacks(interpreted, check):
    """A Gluon teacher kernel that cannot be built falls back (forward: the two-pass form, bit for bit; backward:
    the Triton recompute, within the bounds) and warns; a bug in one, or an error of a Triton KL kernel, propagates
    and records no build failure."""
    m = interpreted["gluon_teacher"]
    if check == "forward_fallback":
        assert all(m[check].values()), m[check]
    elif check == "backward_fallback":
        assert m["backward_fallback_warned"]
        _assert_within_bounds("gluon-teacher-backward-fallback", m[check], low_precision=True)
    else:
        assert m[check]


def test_dkl_di_is_saved_for_narrow_rows_and_within_the_byte_budget():
    """The sparse phase's top-k always keeps dKL/dI (linear in T); the warm-up's every visible entry keeps it up to
    SAVE_G_BUDGET bytes (a 32K document: 32768 x 8192 fp32 = 1 GiB) and forms the teacher again past that."""
    from dsv4attn.ops.indexer_loss import triton as klt

    assert klt._saves_g(1 << 20, 512) and klt._saves_g(1 << 20, klt.SAVE_G_MAX_WIDTH)
    assert klt._saves_g(32768, 8192) and klt.SAVE_G_BUDGET == 32768 * 8192 * 4
    assert not klt._saves_g(65536, 16384) and not klt._saves_g(32769, 8192)


def test_no_compressed_entries(interpreted):
    m = interpreted["edge"]["no_keys"]
    assert m["all_zero"] and m["dk_shape"][0] == 0


@pytest.mark.parametrize("check", ["registered", "public_matches_direct", "public_full_lse_matches_direct",
                                   "fp64_fallback_is_reference"])
def test_plumbing(interpreted, check):
    assert interpreted["plumbing"][check]


@pytest.mark.parametrize("check", ["explicit_runs_ops", "other_lazy_sets_run_explicit_ops",
                                   "visible_runs_ranges_ops", "opcheck", "compile_fullgraph_matches_eager",
                                   "compile_fullgraph_ranges_matches_eager", "select_topk_is_the_indexer_topk"])
def test_registered_ops(interpreted, check):
    assert interpreted["op"][check]


@pytest.mark.parametrize("variant", [f"{c}-{v}-{g}" for c, views in RANGE_CASES for v in views
                                     for g in ("saved", "recompute")])
def test_ranges_ops_equal_explicit_ops_bitwise(interpreted, variant):
    assert interpreted["op"]["ranges_equal_explicit_bitwise"][variant]


def test_range_rows_kernel_equals_its_reference_twin(interpreted):
    results = interpreted["range_rows"]
    assert results and all(results.values()), [k for k, v in results.items() if not v]


# ----------------------------------------------------------------------------------------------- GPU (V4-Flash)
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def flash_inputs(T: int, mode: str, seed: int = 0, device="cuda"):
    """V4-Flash geometry (H = 64 x D = 512, Hi = 64 x Di = 128), bf16. ``mode`` "sparse": one causal document,
    candidates = a random top-512 of the visible compressed entries (-1 filled at the end); "warmup": a ragged pack,
    candidates = every visible entry (VisibleCompressed)."""
    import dsv4attn
    from dsv4attn.ops.index_sets import Explicit, VisibleCompressed

    gen = torch.Generator(device=device).manual_seed(seed)
    if mode == "sparse":
        lengths = (T,)
    else:
        lengths = (T // 8, 3, T // 2, T - T // 8 - 3 - T // 2)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    pack = dsv4attn.pack_batch(cu, T, max(lengths))
    lay = pack.compressed(4)
    Nc = lay.capacity
    if mode == "sparse":
        visible = lay.row_visible
        score = torch.rand(T, Nc, device=device, generator=gen)
        score = score.masked_fill(torch.arange(Nc, device=device)[None, :] >= visible[:, None], -1.0)
        top = torch.topk(score, min(512, Nc), dim=1)
        cand = Explicit(torch.where(top.values >= 0, top.indices, -1).to(torch.int32))
    else:
        cand = VisibleCompressed(lay, T)

    def randn(*shape, std=1.0):
        return (std * torch.randn(*shape, device=device, generator=gen)).to(torch.bfloat16)
    index_q, index_k = randn(T, 64, 128), randn(Nc, 128)
    index_w = randn(T, 64, std=64 ** -0.5 * 128 ** -0.5)
    q, ckv = randn(T, 64, 512), randn(Nc, 512)
    outside = torch.randn(T, 64, device=device, generator=gen) + 2.0
    grad_kl = torch.rand(T, device=device, generator=gen, dtype=torch.float64) + 0.5
    return index_q, index_k, index_w, q, ckv, outside, cand, grad_kl


@GPU
@pytest.mark.parametrize("mode,save_g,fwd,full,scores", [
    ("sparse", True, None, False, False), ("warmup", True, None, False, False), ("warmup", False, None, False, False),
    ("sparse", True, None, "gluon", False), ("sparse", False, None, "gluon", False),
    ("sparse", True, None, "triton", False), ("sparse", True, None, "gluon", True),
    ("sparse", False, None, "gluon", True),
], ids=["sparse-T4096", "warmup-T4096", "warmup-T4096-recompute-bwd", "sparse-T4096-full-lse",
        "sparse-T4096-full-lse-recompute-bwd", "sparse-T4096-full-lse-triton-teacher", "sparse-T4096-scores-given",
        "sparse-T4096-scores-given-recompute-bwd"])
def test_gpu_flash_shapes_match_float64_reference(mode, save_g, fwd, full, scores, monkeypatch):
    """full: the full_lse form, its teacher mass from the Gluon kernel where it applies ("gluon": on SM90; other
    GPUs form it in the Triton KL kernel, and the test checks that this is what ran) or forced into the Triton KL
    kernel ("triton"). scores: the student logits given (fp32, as the top-k forms them), to the reference too.
    Without full (outside_lse given: the warm-up, and the sparse case through the registered ops): on SM90 the Gluon
    kernels form the full denominators and the mass (in the backward again when dKL/dI is not saved)."""
    from dsv4attn.ops.indexer_loss import gluon_hopper as gluon_kl
    from dsv4attn.ops.indexer_loss import triton as klt
    from dsv4attn.ops.indexer_loss.reference import indexer_kl_reference

    from dsv4attn.ops.sparse_attention import gluon_hopper

    inputs = flash_inputs(4096, mode)
    given = _with_full_lse(inputs) if full else inputs
    # The outside-mass form (the warm-up's teacher, also through the registered ops) takes the Gluon teacher kernels
    # too; only the case that forces them off does not.
    gluon_expected = full != "triton" and gluon_hopper.available(inputs[3])
    if full == "triton":
        monkeypatch.setattr(variants, "FAILED",
                            {("indexer_kl", "teacher_mass", (512, torch.bfloat16)): "forced off by the test"})
    calls, pairs = [], []
    real_mass = gluon_hopper.teacher_mass
    monkeypatch.setattr(gluon_hopper, "teacher_mass", lambda *a, **k: calls.append(1) or real_mass(*a, **k))
    real_pairs = gluon_kl.launch_bwd_pairs
    monkeypatch.setattr(gluon_kl, "launch_bwd_pairs", lambda *a, **k: pairs.append(1) or real_pairs(*a, **k))
    saved = klt._saves_g
    klt._saves_g = saved if save_g else _never
    try:
        student = _student_scores(inputs) if scores else None
        kernel = _run(lambda *a: klt.indexer_kl_triton(*a, config=dict(klt.FWD_CONFIG, **(fwd or {})),
                                                       full=bool(full), student_scores=student), given)
    finally:
        klt._saves_g = saved
    # The Gluon teacher ran exactly where it applies (a build failure would only warn and fall back), and only there.
    assert bool(calls) == gluon_expected and not (gluon_expected and variants.FAILED), variants.FAILED
    assert not pairs                    # rows of 512 slots at most: narrower than PAIRS_MIN_WIDTH
    measured = _compare(kernel, _run(lambda *a: indexer_kl_reference(*a, full=bool(full), student_scores=student),
                                     given),
                        _run(indexer_kl_reference, inputs, widen=True))
    _assert_within_bounds(f"{mode}-T4096", measured, low_precision=True)


@GPU
def test_gpu_kl_from_a_given_mass_matches_float64_reference():
    """The sparse KL from a teacher mass formed elsewhere (the attention backward's) and the top-k's scores, at the
    Flash shapes (T = 4096, top-512): the KL kernel with both given, then the saved-gradient backward (the Gluon
    kernel on SM90), within 2x / 3x the reference's own error against float64."""
    from dsv4attn.ops.indexer_loss import triton as klt
    from dsv4attn.ops.indexer_loss.reference import kl_grads_from_mass_reference

    inputs = flash_inputs(4096, "sparse", seed=3)
    index_q, index_k, index_w, q, ckv, full, cand, _ = _with_full_lse(inputs, torch.float64)
    idx = cand.rows(0, cand.total_rows).to(torch.int32)
    mass64 = torch.zeros(idx.shape, dtype=torch.float64, device="cuda")
    for s in range(0, idx.shape[0], 256):
        e = min(s + 256, idx.shape[0])
        rows = idx[s:e].long()
        logits = torch.einsum("thd,tkd->thk", q[s:e].double(), ckv.double()[rows.clamp(min=0)]) * 512 ** -0.5
        mass64[s:e] = torch.where(rows >= 0, torch.exp(logits - full[s:e, :, None]).sum(1), 0.0)
    weight = torch.tensor(1 / 4096, device="cuda")
    scores, scores64 = _student_scores(inputs), _student_scores(inputs, torch.float64)
    kernel = klt.kl_grads_from_mass_triton(mass64.float(), index_q, index_k, index_w, idx, scores, weight)
    low = kl_grads_from_mass_reference(mass64.float(), index_q, index_k, index_w, Explicit(idx), scores, weight)
    exact = kl_grads_from_mass_reference(mass64, index_q.double(), index_k.double(), index_w.double(), Explicit(idx),
                                         scores64, weight.double())
    measured = _compare([t.double() for t in kernel], [t.double() for t in low], exact)
    _assert_within_bounds("from-mass-T4096", measured, low_precision=True)


@GPU
@pytest.mark.parametrize("window", [0, 128])
def test_gpu_kl_from_the_attention_backward_matches_float64_reference(window):
    """The sparse phase's whole KL path on the GPU kernels (T = 2048, Flash shapes, top-512 after ``window`` window
    slots): the attention's backward forms the teacher mass into the probe (on SM90 the one-pass Gluon kernel), the
    probe's backward forms the KL and the indexer's gradients. Loss value and gradients within 2x / 3x the
    reference's own error against float64 (the reference: the reference attention's mass of the same slots, then
    ``kl_grads_from_mass_reference``, from the same rounded inputs)."""
    from dsv4attn.ops import indexer_kl_from_attention, sparse_attention
    from dsv4attn.ops.indexer_loss.reference import kl_grads_from_mass_reference
    from dsv4attn.ops.sparse_attention.reference import reference_backward, reference_forward

    inputs = flash_inputs(2048, "sparse", seed=4)
    index_q, index_k, index_w, q, ckv, _, cand, _ = inputs
    T, scale = q.shape[0], 512 ** -0.5
    topk = cand.rows(0, T).to(torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(4)
    raw = torch.randn(T, 512, device="cuda", generator=gen).to(torch.bfloat16)       # the window's raw keys
    rows = torch.arange(T, device="cuda")[:, None] - torch.arange(window, device="cuda")[None, :]
    slots = torch.cat([torch.where(rows >= 0, rows, -1), torch.where(topk >= 0, topk + T, -1)], 1).to(torch.int32)
    keys = torch.cat([raw, ckv])
    sink = torch.randn(64, device="cuda", generator=gen)
    grad_out = torch.randn(q.shape, device="cuda", generator=gen).to(torch.bfloat16)
    scores, scores64 = _student_scores(inputs), _student_scores(inputs, torch.float64)
    weight, kl_value = torch.tensor(1 / T, device="cuda"), torch.zeros((), device="cuda")

    leaves = [x.detach().clone().requires_grad_(True) for x in (index_q, index_k, index_w)]
    probe = indexer_kl_from_attention(*leaves, topk, scores, weight, kl_value)
    out, _ = sparse_attention(q.detach().clone().requires_grad_(True), keys, slots, sink, mass_probe=probe,
                              mass_offset=window)
    out.backward(grad_out)
    kernel = [kl_value.double()] + [x.grad.double() for x in leaves]

    def reference(dtype):
        q_, keys_, sink_, g_ = (x.to(dtype) if dtype == torch.float64 else x for x in (q, keys, sink, grad_out))
        lse = reference_forward(q_, keys_, Explicit(slots), sink_, scale)[1]
        mass = reference_backward(g_, q_, keys_, Explicit(slots), sink_, lse, scale,
                                  mass_slots=(window, topk.shape[1]))[3]
        student = [x.to(dtype) if dtype == torch.float64 else x for x in (index_q, index_k, index_w)]
        kl, *grads = kl_grads_from_mass_reference(mass, *student, Explicit(topk),
                                                  scores64 if dtype == torch.float64 else scores,
                                                  weight.to(mass.dtype))
        # In the inputs' dtypes, as autograd hands the kernels' gradients to the leaves.
        return [(weight.double() * kl.double().sum())] + [g.to(x.dtype).double() for g, x in zip(grads, student)]

    measured = _compare(kernel, reference(torch.bfloat16), reference(torch.float64))
    _assert_within_bounds(f"from-attention-window{window}", measured, low_precision=True)


@GPU
@pytest.mark.parametrize("save_g", [True, False], ids=["saved", "mass-again-in-backward"])
def test_gpu_warmup_teacher_over_several_chunks_wider_than_1024(save_g, monkeypatch):
    """The warm-up's teacher at a width past SAVE_G_MAX_WIDTH's default (2048 candidates per row at the end of the
    pack's 8192-row document) over several row chunks: on SM90 the Gluon teacher kernels per chunk and the Gluon KL
    backward on each chunk's dKL/dI; elsewhere the two-pass form. Bounds as in the other GPU cases."""
    from dsv4attn.ops.indexer_loss import gluon_hopper as gluon_kl
    from dsv4attn.ops.indexer_loss import triton as klt
    from dsv4attn.ops.indexer_loss.reference import indexer_kl_reference

    inputs = flash_inputs(16384, "warmup", seed=2)
    width = inputs[6].width
    monkeypatch.setattr(klt, "INDEX_BUDGET", 4096 * width)        # 4096 rows per chunk: 4 chunks
    monkeypatch.setattr(klt, "_saves_g", (lambda rows, w: True) if save_g else _never)
    assert width > 1024 and len(list(klt.chunk_rows(16384, width, budget=klt.INDEX_BUDGET))) > 1
    pairs = []
    real_pairs = gluon_kl.launch_bwd_pairs
    monkeypatch.setattr(gluon_kl, "launch_bwd_pairs", lambda *a, **k: pairs.append(1) or real_pairs(*a, **k))
    kernel = _run(klt.indexer_kl_triton, inputs)
    # On SM90 each chunk's backward takes the rows in pairs (width >= PAIRS_MIN_WIDTH), in both forms.
    assert len(pairs) == (4 if gluon_kl.available(inputs[0], inputs[1]) else 0), pairs
    measured = _compare(kernel, _run(indexer_kl_reference, inputs), _run(indexer_kl_reference, inputs, widen=True))
    _assert_within_bounds(f"warmup-T16384-chunks-save-{save_g}", measured, low_precision=True)


@GPU
def test_gpu_compile_fullgraph_and_cuda_graph_match_eager():
    """The registered ops on the GPU (sparse-phase candidates): torch.compile(fullgraph=True) forward + backward
    equals eager (bitwise but for d index_k, whose fp32 atomics add in a varying order), and the no-grad forward
    can be captured in a CUDA graph (no host sync)."""
    from dsv4attn.ops.indexer_loss import triton as klt

    inputs = flash_inputs(4096, "sparse", seed=1)
    eager = _run(klt.indexer_kl_triton, inputs)
    torch._dynamo.reset()
    compiled = _run(torch.compile(lambda *a: klt.indexer_kl_triton(*a), fullgraph=True), inputs)
    for name, a, b in zip(NAMES, compiled, eager):
        if name == "d_index_k":
            torch.testing.assert_close(a.to(torch.bfloat16), b.to(torch.bfloat16), msg=name)
        else:
            assert torch.equal(a, b), name
    index_q, index_k, index_w, q, ckv, outside, cand, _ = inputs
    with torch.no_grad():
        args = (index_q, index_k, index_w, q, ckv, outside, cand, 512 ** -0.5)
        want = klt.indexer_kl_triton(*args)        # also compiles the no-grad kernel variant (SAVE_G off)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = klt.indexer_kl_triton(*args)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, want)


@GPU
@pytest.mark.parametrize("save_g", [True, False], ids=["saved", "mass-again-in-backward"])
def test_gpu_warmup_stack_of_far_apart_segments(save_g, monkeypatch):
    """A context-parallel rank's warm-up candidates: a Stack of two Rows views of one pack of 16 documents of 256
    rows, the first document's early rows and the last one's (960 entries further on). The indexer's score kernels
    assume neighbouring rows a short stretch of entries apart (they cover 2 x 64 + 64 entries from a block's first
    row here); a block across the parts spans ~990, so the parts must reach them one by one (on SM90, where the Gluon
    teacher takes the student's logits from them; elsewhere the two-pass form runs). Bounds as in the other GPU
    cases."""
    import dsv4attn
    from dsv4attn.ops.index_sets import Rows, Stack, VisibleCompressed
    from dsv4attn.ops.indexer_loss import triton as klt
    from dsv4attn.ops.indexer_loss.reference import indexer_kl_reference

    T, device = 4096, "cuda"
    cu = torch.arange(0, T + 1, 256, dtype=torch.int32, device=device)
    lay = dsv4attn.pack_batch(cu, T, 256).compressed(4)
    base = VisibleCompressed(lay, T)
    rows = torch.cat([torch.arange(0, 100), torch.arange(3850, 3950)]).to(device)
    cand = Stack(Rows(base, 0, 100), Rows(base, 3850, 100))
    gen = torch.Generator(device=device).manual_seed(3)

    def randn(*shape, std=1.0):
        return (std * torch.randn(*shape, device=device, generator=gen)).to(torch.bfloat16)
    Nc = lay.capacity
    inputs = (randn(T, 64, 128)[rows], randn(Nc, 128), randn(T, 64, std=64 ** -0.5 * 128 ** -0.5)[rows],
              randn(T, 64, 512)[rows], randn(Nc, 512), (torch.randn(T, 64, device=device, generator=gen) + 2.0)[rows],
              cand, torch.rand(200, device=device, generator=gen, dtype=torch.float64) + 0.5)
    monkeypatch.setattr(klt, "_saves_g", klt._saves_g if save_g else _never)
    calls = []
    real = klt.indexer_triton._score_orders
    monkeypatch.setattr(klt.indexer_triton, "_score_orders", lambda *a, **k: calls.append(a[0].shape[0]) or
                        real(*a, **k))
    kernel = _run(klt.indexer_kl_triton, inputs)
    if klt._gluon_teacher(inputs[3], cand.width):          # the forward's, and the backward's when it forms them
        assert calls == [100, 100] * (1 if save_g else 2), calls
    measured = _compare(kernel, _run(indexer_kl_reference, inputs), _run(indexer_kl_reference, inputs, widen=True))
    _assert_within_bounds(f"warmup-stack-save-{save_g}", measured, low_precision=True)


@GPU
@pytest.mark.parametrize("case", ["pack", "chunks", "stack", "triton-teacher", "teacher-fails-late"])
def test_gpu_warmup_selects_the_indexer_topk(case, monkeypatch):
    """``select_topk`` over the warm-up's ranges: the loss's top-k equals ``indexer_topk``'s bit for bit (indices
    and scores) and the loss itself is unchanged; on SM90 the top-k comes from the score pass of the student (the
    score kernel runs once per KL chunk, no top-k op of its own). Cases: a ragged pack in one chunk, the same in
    four chunks of the KL (the top-k op chunks its rows otherwise), a Stack of two far-apart parts, the Gluon
    teacher off (the Triton KL kernel forms the student itself: the top-k op selects), and the Gluon teacher failing
    to build at the second of four chunks (after one chunk's selection: the Triton path runs again and the top-k op
    selects every row)."""
    import dsv4attn
    from dsv4attn.ops.index_sets import Rows, Stack, VisibleCompressed
    from dsv4attn.ops.indexer_loss import triton as klt

    inputs = list(flash_inputs(4096, "warmup", seed=4))
    if case in ("chunks", "teacher-fails-late"):
        monkeypatch.setattr(klt, "INDEX_BUDGET", 1024 * inputs[6].width)
        monkeypatch.setattr(klt, "SELECT_SCRATCH", 2 * 512 * 300)     # the select in pieces of 300 rows
    if case == "stack":
        cu = torch.arange(0, 4097, 256, dtype=torch.int32, device="cuda")
        base = VisibleCompressed(dsv4attn.pack_batch(cu, 4096, 256).compressed(4), 4096)
        rows = torch.cat([torch.arange(0, 100), torch.arange(3850, 3950)]).cuda()
        inputs = [t[rows] if i in (0, 2, 3, 5) else t for i, t in enumerate(inputs)]
        inputs[6], inputs[7] = Stack(Rows(base, 0, 100), Rows(base, 3850, 100)), inputs[7][:200]
    if case == "triton-teacher":
        monkeypatch.setattr(variants, "FAILED",
                            {("indexer_kl", "teacher_mass", (512, torch.bfloat16)): "forced off by the test"})
    index_q, index_k, index_w, q, ckv, outside, cand, _ = inputs
    args = (index_q, index_k, index_w, q, ckv, outside, cand, 512 ** -0.5)
    want_idx, want_scores = klt.indexer_triton.indexer_topk_triton(index_q, index_k, index_w, cand, 512,
                                                                   return_scores=True)
    want_kl = klt.indexer_kl_triton(*args)
    calls = []
    real = klt.indexer_triton.indexer_topk_ranges_op
    monkeypatch.setattr(klt.indexer_triton, "indexer_topk_ranges_op", lambda *a, **k: calls.append(1) or real(*a, **k))
    if case == "teacher-fails-late" and klt._gluon_teacher(q, cand.width):
        from triton.runtime.errors import PTXASError
        monkeypatch.setattr(variants, "FAILED", {})
        monkeypatch.setattr(variants, "_mode", "auto")
        mass_calls = []
        real_mass = klt.gluon_hopper.teacher_mass

        def failing_mass(*a, **k):
            mass_calls.append(1)
            if len(mass_calls) == 2:
                raise PTXASError("this Triton cannot build the teacher mass kernel (test)")
            return real_mass(*a, **k)
        monkeypatch.setattr(klt.gluon_hopper, "teacher_mass", failing_mass)
        with pytest.warns(RuntimeWarning, match="could not be built"):
            kl, idx, scores = klt.indexer_kl_triton(*args, select_topk=512)
        assert len(mass_calls) == 2 and calls
        assert torch.equal(idx, want_idx) and torch.equal(scores, want_scores)
        # The loss is the Triton teacher's from then on (the Gluon kernel is marked as failed): the same bits again.
        assert torch.equal(kl, klt.indexer_kl_triton(*args))
        return
    kl, idx, scores = klt.indexer_kl_triton(*args, select_topk=512)
    assert torch.equal(idx, want_idx) and torch.equal(scores, want_scores)
    assert torch.equal(kl, want_kl)
    assert (not calls) == klt._gluon_teacher(q, cand.width), calls    # fused exactly where the teacher is Gluon's


@GPU
def test_gpu_pair_backward_equals_the_one_row_kernel():
    """gluon_hopper.launch_bwd_pairs against launch_bwd (the one-row kernel, checked against float64 above) on the
    same materialised ranges and dKL/dI: ragged documents of odd lengths (pairs across document boundaries, rows
    with no visible entry), an odd row count, a width that is not a multiple of the 64-slot tile, a chunk of one row,
    and a context-parallel rank's view (an entry table, a shift, a Stack whose parts meet inside a pair). Equal up to
    the order of fp32 sums: d index_q within one bf16 rounding, d index_k and d index_weights within fp32 sums."""
    from dsv4attn.ops.index_sets import Rows, Stack, VisibleCompressed, contiguous_ranges
    from dsv4attn.ops.indexer_loss import gluon_hopper as gluon_kl
    from dsv4attn.ops.indexer_loss import triton as klt

    if not gluon_kl.available(torch.zeros(1, 64, 128, dtype=torch.bfloat16, device="cuda"),
                              torch.zeros(1, 128, dtype=torch.bfloat16, device="cuda")):
        pytest.skip("the Gluon KL backward needs SM90")
    import dsv4attn
    from tests.packs import cu_seqlens_of

    device, gen = "cuda", torch.Generator(device="cuda").manual_seed(5)
    lengths = (1001, 2, 517, 1, 6)
    pack = dsv4attn.pack_batch(cu_seqlens_of(lengths).to(device), sum(lengths) + 2, max(lengths))
    T, layout = pack.total_rows, pack.compressed(4)
    visible = VisibleCompressed(layout, T)
    n = layout.capacity
    table = torch.randperm(n, generator=gen, device=device)
    split = T // 2 + 1                                             # odd: the parts meet inside a pair
    sets = {"visible": visible,
            "rank-view": Stack(Rows(visible, 0, split, shift=3, table=table, bound=n),
                               Rows(visible, split, T - split, shift=3, table=table, bound=n))}
    for name, cand in sets.items():
        first, vis, tab, shift = contiguous_ranges(cand)
        K, rows = cand.width, cand.total_rows
        assert rows % 2 == 1 and K % 64, (rows, K)
        keys = n + 3
        qi = torch.randn(rows, 64, 128, device=device, generator=gen).to(torch.bfloat16)
        ki = torch.randn(keys, 128, device=device, generator=gen).to(torch.bfloat16)
        w = torch.randn(rows, 64, device=device, generator=gen) * (64 * 128) ** -0.5
        grad = torch.rand(rows, device=device, generator=gen) + 0.5
        for s, e in ((0, rows), (1000, 1001)):                    # the whole set, and a chunk of one row
            idx = klt.range_rows_triton(first, vis, tab, shift, K, s, e)
            n_end = vis[s:e].to(torch.int32).contiguous()
            g = torch.randn(e - s, K, device=device, generator=gen) * (idx >= 0)
            out = {}
            for how in ("one row", "pairs"):
                dq, dk, dw = torch.empty_like(qi[s:e]), torch.zeros(keys, 128, device=device), torch.empty_like(w[s:e])
                args = (qi[s:e], ki, w[s:e], idx, n_end, g, grad[s:e], dq, dk, dw)
                if how == "pairs":
                    gluon_kl.launch_bwd_pairs(*args, first[s:e])
                else:
                    gluon_kl.launch_bwd(*args)
                out[how] = (dq.float(), dk, dw)
            for what, a, b in zip(("d_index_q", "d_index_k", "d_index_w"), out["one row"], out["pairs"]):
                scale = a.abs().max().item()
                tol = 2 ** -8 * scale if what == "d_index_q" else 1e-5 * scale
                assert scale > 0, (name, s, e, what)
                assert (a - b).abs().max().item() <= tol, (name, s, e, what, (a - b).abs().max().item(), scale)


def test_gluon_teacher_dispatch(monkeypatch):
    """Where the Gluon teacher kernels apply, the forward of both paths asks for them; DSV4ATTN_KERNELS=triton keeps
    them out; a build failure of one warns once per (D, dtype), is recorded (not tried again) and leaves the teacher
    to the Triton kernel; other errors propagate. (The kernel runs are stubbed: dispatch logic only.)"""
    from triton.runtime.errors import PTXASError

    from dsv4attn.ops.indexer_loss import triton as klt
    from dsv4attn.ops.sparse_attention import gluon_hopper

    monkeypatch.setattr(gluon_hopper, "check", lambda q: (True, "stubbed"))
    monkeypatch.setattr(variants, "FAILED", {})
    monkeypatch.setattr(variants, "_mode", "auto")
    operands = (None, None, None, torch.zeros(3, 64, 128, dtype=torch.bfloat16), None)
    asked, failure = [], [None]

    def kl_forward(*args, gluon_teacher=False, **kwargs):
        asked.append(gluon_teacher)
        if gluon_teacher and failure[0] is not None:
            failed = klt.GluonTeacherFailed()
            failed.__cause__ = failure[0]
            raise failed
        return "forward"
    monkeypatch.setattr(klt, "_kl_forward", kl_forward)

    def run():
        asked.clear()
        return klt._teacher_forward(operands, None, lambda: [], 4, 0.1, False, {}, True)
    assert run() == "forward" and asked == [True]
    monkeypatch.setattr(variants, "_mode", "triton")
    assert run() == "forward" and asked == [False]
    monkeypatch.setattr(variants, "_mode", "auto")
    failure[0] = PTXASError("cannot build")
    built = r"teacher kernels \(_teacher_mass_gluon, _teacher_lse_gluon; _ranges forms\) could not be built for D=128"
    with pytest.warns(RuntimeWarning, match=built):
        assert run() == "forward" and asked == [True, False]
    assert ("indexer_kl", "teacher_mass", (128, torch.bfloat16)) in variants.FAILED
    assert run() == "forward" and asked == [False]
    monkeypatch.setattr(variants, "FAILED", {})
    failure[0] = ValueError("a bug")
    with pytest.raises(ValueError, match="a bug"):
        run()


@GPU
@pytest.mark.parametrize("gluon", [1, 0], ids=["gluon-bwd", "triton-bwd"])
def test_gpu_sparse_backward_kernels_match_float64_reference(gluon, monkeypatch):
    """The saved-gradient backward (sparse phase) by the Gluon kernel where it applies (KERNEL="auto" on SM90; the test
    checks that it ran exactly there) and by the Triton kernel (KERNEL="triton"): both within the bounds against
    float64."""
    from dsv4attn.ops.indexer_loss import gluon_hopper as gluon_kl
    from dsv4attn.ops.indexer_loss import triton as klt
    from dsv4attn.ops.indexer_loss.reference import indexer_kl_reference

    from dsv4attn.ops.index_sets import Explicit

    inputs = list(flash_inputs(4096, "sparse", seed=2))
    idx = inputs[6].indices                             # empty slots inside the rows too, not only at their ends
    holes = torch.rand(idx.shape, device=idx.device, generator=torch.Generator(device=idx.device).manual_seed(3))
    inputs[6] = Explicit(idx.masked_fill(holes < 0.2, -1))
    expected = bool(gluon) and gluon_kl.available(inputs[0], inputs[1])
    calls = []
    real = gluon_kl.launch_bwd
    monkeypatch.setattr(gluon_kl, "launch_bwd", lambda *a, **k: calls.append(1) or real(*a, **k))
    kernel = _run(lambda *a: klt.indexer_kl_triton(*a, bwd_config=dict(klt.BWD_CONFIG,
                                                                       KERNEL="auto" if gluon else "triton")),
                  inputs)
    assert bool(calls) == expected and not variants.FAILED, variants.FAILED
    measured = _compare(kernel, _run(indexer_kl_reference, inputs), _run(indexer_kl_reference, inputs, widen=True))
    _assert_within_bounds("sparse-T4096", measured, low_precision=True)


def test_gluon_backward_dispatch(monkeypatch):
    """Which backward runs (kernel launches stubbed, any machine): the Gluon kernel for the saved-gradient form
    where it applies under KERNEL="auto"; the Triton kernel with KERNEL="triton", under DSV4ATTN_KERNELS=triton, for the
    recomputing form (no saved gradient), and after a build failure (one warning, not tried again)."""
    import warnings

    from triton.runtime.errors import PTXASError

    from dsv4attn.ops.indexer_loss import gluon_hopper as gluon_kl
    from dsv4attn.ops.indexer_loss import triton as klt
    from dsv4attn.ops.sparse_attention import triton as sparse_triton

    launched, failure = [], []

    def gluon(*args, **kwargs):
        launched.append("gluon")
        if failure:
            raise failure[0]

    monkeypatch.setattr(gluon_kl, "check", lambda qi, ki: (True, "stubbed"))
    monkeypatch.setattr(gluon_kl, "launch_bwd", gluon)
    pairs_failure = []

    def gluon_pairs(*args, **kwargs):
        launched.append("gluon pairs")
        if pairs_failure:
            raise pairs_failure[0]
    monkeypatch.setattr(gluon_kl, "launch_bwd_pairs", gluon_pairs)
    monkeypatch.setattr(klt, "_launch", lambda *args: launched.append("triton"))
    monkeypatch.setattr(variants, "FAILED", {})
    monkeypatch.setattr(variants, "_mode", "auto")
    T, K = 2, 4
    operands = (torch.zeros(T, 64, 128, dtype=torch.bfloat16), torch.zeros(3, 128, dtype=torch.bfloat16),
                torch.zeros(T, 64), torch.zeros(T, 64, 512, dtype=torch.bfloat16),
                torch.zeros(3, 512, dtype=torch.bfloat16))
    chunks = [(0, T, torch.zeros(T, K, dtype=torch.int32), torch.full((T,), K, dtype=torch.int32))]
    g_buf = torch.zeros(T, K)

    def run(config=None, g=g_buf, ranges=None):
        launched.clear()
        klt._kl_backward(torch.ones(T), operands, torch.zeros(T, 64), torch.zeros(T, 3), g, chunks, K, 0.1,
                         dict(klt.BWD_CONFIG, **(config or {})), ranges)
        return list(launched)

    assert run() == ["gluon"]
    ranges = klt.StudentRanges(torch.zeros(T, dtype=torch.int64), torch.full((T,), K), None, 0, ())
    assert run(ranges=ranges) == ["gluon"]                # ranges narrower than PAIRS_MIN_WIDTH: one row a program
    monkeypatch.setattr(klt, "PAIRS_MIN_WIDTH", K)
    assert run(ranges=ranges) == ["gluon pairs"]          # wider: rows with one start share a program
    assert run(ranges=ranges, g=None) == ["triton"]
    # A Triton that cannot build the pair kernel: one warning, the one-row Gluon kernel, not tried again.
    pairs_failure.append(PTXASError("this Triton cannot build the pair kernel"))
    with pytest.warns(RuntimeWarning, match=r"rows in pairs .* could not be built for D=128"):
        assert run(ranges=ranges) == ["gluon pairs", "gluon"]
    assert run(ranges=ranges) == ["gluon"]
    pairs_failure.clear()
    variants.FAILED.clear()
    assert run(dict(KERNEL="triton")) == ["triton"]
    assert run(g=None) == ["triton"]
    monkeypatch.setattr(variants, "_mode", "triton")
    assert run() == ["triton"]
    monkeypatch.setattr(variants, "_mode", "auto")
    failure.append(PTXASError("this Triton cannot build the Gluon kernel"))
    built = r"KL backward kernel \(_indexer_kl_bwd_gluon\) could not be built for D=128"
    with pytest.warns(RuntimeWarning, match=built):
        assert run() == ["gluon", "triton"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run() == ["triton"]


def test_row_pairs_pair_rows_with_one_start_and_leave_each_other_row_to_a_second_launch():
    """The Gluon backward's row pairs for ranges (gluon_hopper.row_pairs): rows 2p and 2p + 1 share a program when
    their ranges start at one entry (so each slot both hold is one key); every row is taken exactly once."""
    from dsv4attn.ops.indexer_loss import gluon_hopper as gluon_kl

    first = torch.tensor([0, 0, 0, 5, 5, 5, 9])           # (0, 1) and (4, 5) share a start, (2, 3) not, 6 is last
    row0, row1, alone = gluon_kl.row_pairs(first)
    assert row0.tolist() == [0, 2, 4, 6] and row1.tolist() == [1, -1, 5, -1] and alone.tolist() == [-1, 3, -1, -1]
    assert all(t.dtype == torch.int32 for t in (row0, row1, alone))
    for T in (1, 2, 9):
        first = torch.randint(0, 3, (T,))
        taken = torch.cat(gluon_kl.row_pairs(first))
        assert sorted(taken[taken >= 0].tolist()) == list(range(T))


def test_unknown_config_keys_name_the_argument():
    """A key the op does not know (e.g. one a release removed, as SPLIT_DX) is an error, also where the reference
    runs (float64), not silently ignored."""
    from dsv4attn.ops.index_sets import Explicit
    from dsv4attn.ops.indexer_loss import triton as klt
    T, Nc = 2, 3
    args = (torch.zeros(T, 2, 4, dtype=torch.float64), torch.zeros(Nc, 4, dtype=torch.float64),
            torch.zeros(T, 2, dtype=torch.float64), torch.zeros(T, 2, 8, dtype=torch.float64),
            torch.zeros(Nc, 8, dtype=torch.float64), torch.zeros(T, 2, dtype=torch.float64),
            Explicit(torch.zeros(T, 1, dtype=torch.int32)), 0.5)
    with pytest.raises(ValueError, match=r"bwd_config: unknown keys \['SPLIT_DX'\]"):
        klt.indexer_kl_triton(*args, bwd_config=dict(SPLIT_DX=False))
    with pytest.raises(ValueError, match=r"config: unknown keys \['BLOCK_Q'\]"):
        klt.indexer_kl_triton(*args, config=dict(BLOCK_Q=64))


def test_gluon_backward_config_is_checked():
    from dsv4attn.ops.indexer_loss import gluon_hopper as gluon_kl
    for bad, match in ((dict(BLOCK_D=64), r"unknown keys \['BLOCK_D'\]"),
                       (dict(BLOCK_N=32), r"unknown keys \['BLOCK_N'\]"),      # fixed at 64 (the dki product's M)
                       (dict(STAGES=3), "STAGES must be even and >= 2, got 3")):
        with pytest.raises(ValueError, match=match):
            gluon_kl.launch_bwd(*([None] * 10), config=bad)

"""indexer_kl (closed-form custom backward, chunked) vs indexer_kl_naive (plain autograd) vs a loop oracle of the
formula in dsv4attn/ops/indexer_loss/reference.py (docs/semantics.md, decision 7).

teacher(j) = sum_h exp(s_h(j) - logaddexp(outside_lse_h, lse_{S_t} s_h)) / max(sum_{j,h} ..., FLT_MIN),
student = softmax over S_t of the indexer scores, KL(teacher || student); an empty S_t gives 0.
"""
from __future__ import annotations

import math

import pytest
import torch

import dsv4attn
from dsv4attn.ops import VisibleCompressed, indexer_kl
from dsv4attn.ops.indexer_loss import indexer_kl_naive
from dsv4attn.ops.indexer_loss import reference as kl_ref
from tests.packs import RAGGED_R4, build_pack, random_indices, wrap_chunk_rows

FLT_MIN = torch.finfo(torch.float32).tiny
FP64 = dict(rtol=1e-10, atol=1e-12)


def make_case(seed, T=10, Hi=2, Di=4, H=3, D=8, Nc=12, C=5, empty_rows=(1, 6), dtype=torch.float64,
              outside_shift=0.0):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    f = dict(dtype=torch.float64)
    index_q = torch.randn(T, Hi, Di, **f).to(dtype)
    index_k = torch.randn(Nc, Di, **f).to(dtype)
    index_w = torch.randn(T, Hi, **f).to(dtype)
    q = (2.0 * torch.randn(T, H, D, **f)).to(dtype)
    ckv = torch.randn(Nc, D, **f).to(dtype)
    outside = (torch.randn(T, H, **f) + 1.0 + outside_shift).to(dtype)
    cand = random_indices(gen, T, Nc, C, hole_frac=0.3, empty_rows=empty_rows)
    return index_q, index_k, index_w, q, ckv, cand, outside


def kl_oracle(index_q, index_k, index_w, q, ckv, cand, outside, scale):
    """Loop over rows (and heads), float64, autograd-capable."""
    T, Hi, _ = index_q.shape
    H = q.shape[1]
    rows = []
    for t in range(T):
        S = [int(c) for c in cand[t].tolist() if c >= 0]
        if not S:
            rows.append(torch.zeros((), dtype=torch.float64) + 0.0 * (index_q[t].sum() + index_w[t].sum()))
            continue
        mass = torch.zeros(len(S), dtype=torch.float64)
        for h in range(H):
            s_h = torch.stack([scale * torch.dot(q[t, h].double(), ckv[j].double()) for j in S])
            full = torch.logaddexp(outside[t, h].double(), torch.logsumexp(s_h, 0))
            mass = mass + torch.exp(s_h - full)
        teacher = mass / torch.clamp(mass.sum(), min=FLT_MIN)
        scores = torch.stack([sum(index_w[t, g].double() * torch.relu(torch.dot(index_q[t, g].double(),
                                                                                 index_k[j].double()))
                                  for g in range(Hi)) for j in S])
        log_student = torch.log_softmax(scores, 0)
        rows.append((torch.xlogy(teacher, teacher) - teacher * log_student).sum())
    return torch.stack(rows)


def run_with_grads(fn, index_q, index_k, index_w, rest, grad_kl):
    leaves = [t.detach().clone().requires_grad_(True) for t in (index_q, index_k, index_w)]
    kl = fn(*leaves, *rest)
    (kl.to(torch.float64) * grad_kl).sum().backward()
    return [kl.detach()] + [t.grad for t in leaves]


CASES = [
    pytest.param(dict(), id="T10-Hi2-H3-C5"),
    pytest.param(dict(T=8, Hi=1, Di=3, H=1, D=4, Nc=6, C=6, empty_rows=(0,)), id="T8-one-head-C=Nc"),
    pytest.param(dict(T=6, Hi=4, Di=6, H=4, D=16, Nc=20, C=8, empty_rows=()), id="T6-Hi4-no-empty"),
    pytest.param(dict(outside_shift=-6.0), id="small-outside-mass"),
]


@pytest.mark.parametrize("case", CASES)
def test_forward_and_grads_vs_naive_and_oracle(case):
    index_q, index_k, index_w, q, ckv, cand, outside = make_case(0, **case)
    scale = q.shape[-1] ** -0.5
    grad_kl = torch.rand(q.shape[0], dtype=torch.float64) + 0.5
    got = run_with_grads(lambda a, b, c, *r: indexer_kl(a, b, c, *r), index_q, index_k, index_w,
                         (q, ckv, cand, outside), grad_kl)
    naive = run_with_grads(lambda a, b, c, *r: indexer_kl_naive(a, b, c, *r, scale), index_q, index_k, index_w,
                           (q, ckv, outside, cand), grad_kl)
    ref = run_with_grads(lambda a, b, c, *r: kl_oracle(a, b, c, *r, scale), index_q, index_k, index_w,
                         (q, ckv, cand, outside), grad_kl)
    for name, a, b, c in zip(("kl", "d_index_q", "d_index_k", "d_index_weights"), got, naive, ref):
        assert a.dtype == torch.float64, name
        torch.testing.assert_close(a, b, **FP64, msg=lambda m: f"{name} vs naive: {m}")
        torch.testing.assert_close(a, c, **FP64, msg=lambda m: f"{name} vs oracle: {m}")
    assert (got[0] >= -1e-12).all(), "KL is non-negative"


def test_custom_softmax_scale():
    index_q, index_k, index_w, q, ckv, cand, outside = make_case(1)
    got = indexer_kl(index_q, index_k, index_w, q, ckv, cand, outside, softmax_scale=0.21)
    torch.testing.assert_close(got, kl_oracle(index_q, index_k, index_w, q, ckv, cand, outside, 0.21), **FP64)


def test_empty_rows_are_exactly_zero_with_zero_grads():
    index_q, index_k, index_w, q, ckv, cand, outside = make_case(2, empty_rows=(0, 4, 9))
    grad_kl = torch.rand(q.shape[0], dtype=torch.float64) + 0.5
    kl, dq, dk, dw = run_with_grads(lambda a, b, c, *r: indexer_kl(a, b, c, *r), index_q, index_k, index_w,
                                    (q, ckv, cand, outside), grad_kl)
    for r in (0, 4, 9):
        assert kl[r].item() == 0.0
        assert torch.equal(dq[r], torch.zeros_like(dq[r])) and torch.equal(dw[r], torch.zeros_like(dw[r]))
    for name, t in (("kl", kl), ("dq", dq), ("dk", dk), ("dw", dw)):
        assert torch.isfinite(t).all(), name
    # Keys outside every candidate set get exactly zero gradient.
    used = set(c for c in cand.flatten().tolist() if c >= 0)
    for n in range(index_k.shape[0]):
        if n not in used:
            assert torch.equal(dk[n], torch.zeros_like(dk[n])), n


def test_all_rows_empty():
    index_q, index_k, index_w, q, ckv, cand, outside = make_case(3, empty_rows=range(10))
    scale = q.shape[-1] ** -0.5
    grad_kl = torch.ones(10, dtype=torch.float64)
    for fn in (lambda a, b, c: indexer_kl(a, b, c, q, ckv, cand, outside),
               lambda a, b, c: indexer_kl_naive(a, b, c, q, ckv, outside, cand, scale)):
        kl, dq, dk, dw = run_with_grads(fn, index_q, index_k, index_w, (), grad_kl)
        assert torch.equal(kl, torch.zeros_like(kl))
        for name, g in (("dq", dq), ("dk", dk), ("dw", dw)):
            assert torch.equal(g, torch.zeros_like(g)), name


def test_gradcheck_float64():
    index_q, index_k, index_w, q, ckv, cand, outside = make_case(4, T=5, Hi=2, Di=3, H=2, D=4, Nc=6, C=4,
                                                                 empty_rows=(2,))
    inputs = tuple(t.requires_grad_(True) for t in (index_q, index_k, index_w))
    assert torch.autograd.gradcheck(lambda a, b, c: indexer_kl(a, b, c, q, ckv, cand, outside), inputs,
                                    eps=1e-6, atol=1e-8, rtol=1e-6)


def test_teacher_operands_get_no_gradient():
    index_q, index_k, index_w, q, ckv, cand, outside = make_case(5)
    for t in (index_q, index_k, index_w, q, ckv, outside):
        t.requires_grad_(True)
    indexer_kl(index_q, index_k, index_w, q, ckv, cand, outside).sum().backward()
    assert q.grad is None and ckv.grad is None and outside.grad is None
    assert all(t.grad is not None for t in (index_q, index_k, index_w))
    index_q.grad = index_k.grad = index_w.grad = None
    indexer_kl_naive(index_q, index_k, index_w, q, ckv, outside, cand, 0.5).sum().backward()
    assert q.grad is None and ckv.grad is None and outside.grad is None


def test_tiny_mass_teacher_still_normalised():
    """Outside mass e^70 makes every teacher probability ~1e-30 (still above FLT_MIN in total): the teacher is
    renormalised to sum 1, so the KL is O(1) and matches the float64 oracle (fp32 inputs, fp32 math)."""
    index_q, index_k, index_w, q, ckv, cand, outside = make_case(6, empty_rows=(3,), dtype=torch.float32)
    outside = torch.full_like(outside, 70.0)
    got = indexer_kl(index_q, index_k, index_w, q, ckv, cand, outside)
    assert got.dtype == torch.float32
    want = kl_oracle(index_q.double(), index_k.double(), index_w.double(), q.double(), ckv.double(), cand,
                     outside.double(), q.shape[-1] ** -0.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    assert want.max() > 1e-2, "the KL is O(1), i.e. the ~1e-30 teacher was normalised"
    # Only the teacher's scale changed against a moderate outside mass (equal across heads): same KL.
    moderate = indexer_kl(index_q, index_k, index_w, q, ckv, cand, torch.full_like(outside, 30.0))
    torch.testing.assert_close(got, moderate, rtol=1e-5, atol=1e-6)


def test_teacher_mass_below_flt_min_gives_finite_zero():
    """exp(-200) underflows fp32: the teacher is 0 (floor FLT_MIN avoids 0/0), KL and gradients are 0, no NaN."""
    index_q, index_k, index_w, q, ckv, cand, outside = make_case(7, dtype=torch.float32)
    outside = torch.full_like(outside, 200.0)
    kl, dq, dk, dw = run_with_grads(lambda a, b, c, *r: indexer_kl(a, b, c, *r), index_q, index_k, index_w,
                                    (q, ckv, cand, outside), torch.ones(q.shape[0], dtype=torch.float64))
    for name, t in (("kl", kl), ("dq", dq), ("dk", dk), ("dw", dw)):
        assert torch.equal(t, torch.zeros_like(t)), name


def test_index_set_candidates_and_chunking(monkeypatch):
    """Candidates given as an IndexSet (all visible entries: the warm-up teacher) equal the materialised tensor,
    and running one row per chunk changes nothing."""
    torch.manual_seed(8)
    pack = build_pack(RAGGED_R4 + (21,), padding=4)
    lay = pack.compressed(4)
    T, Nc = pack.total_rows, lay.capacity
    index_q, index_k, index_w = torch.randn(T, 2, 4), torch.randn(Nc, 4), torch.randn(T, 2)
    q, ckv, outside = torch.randn(T, 3, 8), torch.randn(Nc, 8), torch.randn(T, 3)
    index_q, index_k, index_w, q, ckv, outside = (t.double() for t in (index_q, index_k, index_w, q, ckv, outside))
    visible = VisibleCompressed(lay, T)
    grad_kl = torch.rand(T, dtype=torch.float64)

    def fn(cands):
        return lambda a, b, c: indexer_kl(a, b, c, q, ckv, cands, outside)
    by_set = run_with_grads(fn(visible), index_q, index_k, index_w, (), grad_kl)
    by_tensor = run_with_grads(fn(visible.materialize()), index_q, index_k, index_w, (), grad_kl)
    ref = run_with_grads(lambda a, b, c: kl_oracle(a, b, c, q, ckv, visible.materialize(), outside, 8 ** -0.5),
                         index_q, index_k, index_w, (), grad_kl)
    chunks = wrap_chunk_rows(kl_ref, monkeypatch, budget=1)
    one_row = run_with_grads(fn(visible), index_q, index_k, index_w, (), grad_kl)
    assert len(chunks) == 2 * T, "forward and backward ran one row per chunk"
    for name, a, b, c, d in zip(("kl", "dq", "dk", "dw"), by_set, by_tensor, one_row, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{name} set vs tensor: {m}")
        torch.testing.assert_close(a, c, rtol=0, atol=0, msg=lambda m: f"{name} one row per chunk: {m}")
        torch.testing.assert_close(a, d, **FP64, msg=lambda m: f"{name} vs oracle: {m}")
    pad = ~pack.row_is_real
    assert torch.equal(by_set[0][pad], torch.zeros_like(by_set[0][pad]))
    # Rows that see no compressed entry yet (position < 3) contribute 0.
    blind = pack.row_is_real & (lay.row_visible == 0)
    assert blind.sum() > 0 and torch.equal(by_set[0][blind], torch.zeros_like(by_set[0][blind]))
    assert not math.isnan(by_set[0].sum().item())


def test_no_compressed_entry_with_static_max_seqlen():
    """max_seqlen 8 for a 3-row batch: capacity 0, candidate width min(8, 3) // 4 = 0 (it was 8 // 4 = 2, every
    slot -1; no document is longer than the batch): KL 0 and zero gradients."""
    torch.manual_seed(9)
    pack = dsv4attn.pack_batch(torch.tensor([0, 3], dtype=torch.int32), 3, 8)
    lay = pack.compressed(4)
    assert lay.capacity == 0 and lay.max_per_doc == 0
    index_q, index_k, index_w = torch.randn(3, 2, 4), torch.randn(0, 4), torch.randn(3, 2)
    kl, dq, dk, dw = run_with_grads(
        lambda a, b, c: indexer_kl(a, b, c, torch.randn(3, 2, 8), torch.randn(0, 8), VisibleCompressed(lay, 3),
                                   torch.randn(3, 2)), index_q, index_k, index_w, (), torch.ones(3))
    assert torch.equal(kl, torch.zeros(3)) and torch.equal(dq, torch.zeros_like(dq))
    assert dk.shape == (0, 4) and torch.equal(dw, torch.zeros_like(dw))


def test_full_lse_form_equals_outside_form():
    """Given each head's full denominator L = logaddexp(outside, lse_S) instead of the outside mass, the loss and
    its gradients are the same (float64)."""
    index_q, index_k, index_w, q, ckv, cand, outside = make_case(6, empty_rows=(3,))
    scale = q.shape[-1] ** -0.5
    valid = cand >= 0
    logits = torch.einsum("thd,tkd->thk", q, ckv[cand.clamp(min=0)]) * scale
    full = torch.logaddexp(outside, torch.logsumexp(logits.masked_fill(~valid[:, None, :], float("-inf")), -1))
    grad_kl = torch.randn(q.shape[0], dtype=q.dtype, generator=torch.Generator().manual_seed(6))
    got = run_with_grads(lambda a, b, c: indexer_kl(a, b, c, q, ckv, cand, full_lse=full), index_q, index_k,
                         index_w, (), grad_kl)
    want = run_with_grads(lambda a, b, c: indexer_kl(a, b, c, q, ckv, cand, outside), index_q, index_k, index_w,
                          (), grad_kl)
    for name, g, w in zip(("kl", "d_index_q", "d_index_k", "d_index_weights"), got, want):
        torch.testing.assert_close(g, w, **FP64, msg=lambda m: f"{name}: {m}")
    assert got[0].abs().max() > 1e-3 and got[0][3] == 0                 # a real loss; the empty row gives 0


def test_exactly_one_denominator_form():
    index_q, index_k, index_w, q, ckv, cand, outside = make_case(7)
    with pytest.raises(ValueError, match="exactly one of outside_lse .* got both"):
        indexer_kl(index_q, index_k, index_w, q, ckv, cand, outside, full_lse=outside)
    with pytest.raises(ValueError, match="got neither"):
        indexer_kl(index_q, index_k, index_w, q, ckv, cand)
    with pytest.raises(ValueError, match=r"full_lse must have dtype in \['torch.float32', 'torch.float64'\]"):
        indexer_kl(index_q, index_k, index_w, q, ckv, cand, full_lse=outside.to(torch.bfloat16))
    nan = outside.clone()
    nan[0, 0] = float("nan")
    with dsv4attn.checks.checks("values"), pytest.raises(ValueError, match="full_lse contains NaN"):
        indexer_kl(index_q, index_k, index_w, q, ckv, cand, full_lse=nan)      # a debug value check


def _full_lse(q, ckv, cand, outside):
    valid = cand >= 0
    logits = torch.einsum("thd,tkd->thk", q, ckv[cand.clamp(min=0)]) * q.shape[-1] ** -0.5
    return torch.logaddexp(outside, torch.logsumexp(logits.masked_fill(~valid[:, None, :], float("-inf")), -1))


def test_student_scores_given_as_the_top_k_forms_them():
    """The sparse phase hands the KL the scores its top-k ranked (indexer_topk(..., return_scores=True)): given the
    values it would form itself, the loss and every gradient are bitwise unchanged (float64); other values change
    the loss (they are what the forward uses) and not the way gradients flow (to index_q, index_k, weights)."""
    from dsv4attn.ops import Explicit, indexer_topk
    index_q, index_k, index_w, q, ckv, cand, outside = make_case(8, C=12, empty_rows=(2,))
    visible = Explicit(cand)
    chosen, scores = indexer_topk(index_q, index_k, index_w, visible, 6, return_scores=True)
    full = _full_lse(q, ckv, chosen.long(), outside)
    grad_kl = torch.rand(q.shape[0], dtype=q.dtype, generator=torch.Generator().manual_seed(8)) + 0.5

    def run(student):
        return run_with_grads(lambda a, b, c: indexer_kl(a, b, c, q, ckv, Explicit(chosen), full_lse=full,
                                                         student_scores=student), index_q, index_k, index_w, (),
                              grad_kl)
    own, given = run(None), run(scores)
    for name, g, w in zip(("kl", "d_index_q", "d_index_k", "d_index_weights"), given, own):
        assert torch.equal(g, w), name
    assert torch.isinf(scores[2]).all() and (chosen[2] == -1).all()     # the empty row: -inf scores, -1 slots
    shifted = run(scores * 1.5)
    assert (shifted[0] - own[0]).abs().max() > 1e-3
    assert all(t.abs().max() > 0 for t in shifted[1:])


def test_attention_backward_mass_is_the_sparse_teacher():
    """The attention backward's head-summed probabilities of the top-k slots (``reference_backward(...,
    mass_slots=...)``: the window's slots first, as the layers lay them out), normalised by ``kl_from_mass`` against
    the student's log-probabilities, give the sparse KL of ``indexer_kl``'s full-denominator form (float64): the
    teacher the backward forms anyway, without a gathering kernel of its own."""
    from dsv4attn.ops import Explicit, indexer_topk
    from dsv4attn.ops.sparse_attention.reference import reference_backward, reference_forward
    index_q, index_k, index_w, q, ckv, cand, outside = make_case(10, C=12, empty_rows=(2,))
    T, H, D = q.shape
    chosen, scores = indexer_topk(index_q, index_k, index_w, Explicit(cand), 6, return_scores=True)
    gen = torch.Generator().manual_seed(10)
    raw = torch.randn(7, D, dtype=q.dtype, generator=gen)                      # the window's keys
    window = torch.randint(-1, raw.shape[0], (T, 3), generator=gen)
    keys = torch.cat([raw, ckv])
    slots = Explicit(torch.cat([window, torch.where(chosen >= 0, chosen + raw.shape[0], -1)], 1))
    sink = torch.randn(H, dtype=q.dtype, generator=gen)
    scale = D ** -0.5
    _, lse = reference_forward(q, keys, slots, sink, scale)
    *_, mass = reference_backward(torch.randn_like(q), q, keys, slots, sink, lse, scale, mass_slots=(3, 6))
    valid = chosen >= 0
    kl, _ = kl_ref.kl_from_mass(mass, kl_ref.student_log_probs(scores, valid))
    want = indexer_kl(index_q, index_k, index_w, q, ckv, Explicit(chosen), full_lse=torch.logaddexp(lse, sink),
                      student_scores=scores)
    torch.testing.assert_close(kl, want, **FP64)
    assert kl.abs().max() > 1e-3 and kl[2] == 0                         # a real loss; the empty row gives 0
    with pytest.raises(ValueError, match=r"mass_slots \(offset, width\) must lie within the 9 slots"):
        reference_backward(torch.randn_like(q), q, keys, slots, sink, lse, scale, mass_slots=(4, 6))


def _attention_channel_case(seed, top=6):
    """A sparse-phase case: the indexer's top-k over random candidates, attention slots = 3 window keys then the
    top-k (as the layers lay them out), the attention's inputs (float64)."""
    from dsv4attn.ops import Explicit, indexer_topk
    index_q, index_k, index_w, q, ckv, cand, _ = make_case(seed, C=12, empty_rows=(2,))
    T, H, D = q.shape
    chosen, scores = indexer_topk(index_q, index_k, index_w, Explicit(cand), top, return_scores=True)
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(7, D, dtype=q.dtype, generator=gen)                      # the window's keys
    window = torch.randint(-1, raw.shape[0], (T, 3), generator=gen)
    keys = torch.cat([raw, ckv])
    slots = torch.cat([window, torch.where(chosen >= 0, chosen + raw.shape[0], -1)], 1)
    sink = torch.randn(H, dtype=q.dtype, generator=gen)
    return (index_q, index_k, index_w), chosen, scores, (q, keys, slots, sink, ckv)


def _grads_through_the_channel(student, chosen, scores, attention, weight, grad_out, *, compiled=False,
                               kl_value=None):
    """(kl_value, d index_q, d index_k, d index_weights) after one backward of the attention with the channel's
    probe (the indexer gets gradients only through the probe)."""
    from dsv4attn.ops import indexer_kl_from_attention, sparse_attention
    leaves = [t.detach().clone().requires_grad_(True) for t in student]
    q, keys, slots, sink, _ = attention
    q = q.detach().clone().requires_grad_(True)
    kl_value = torch.full((), float("nan"), dtype=torch.float64) if kl_value is None else kl_value

    def step(index_q, index_k, index_w, q_):
        probe = indexer_kl_from_attention(index_q, index_k, index_w, chosen, scores, weight, kl_value,
                                          probe_dtype=torch.float64)
        out, _ = sparse_attention(q_, keys, slots, sink, mass_probe=probe, mass_offset=3)
        return (out * grad_out).sum()

    fn = torch.compile(step, fullgraph=True) if compiled else step
    fn(*leaves, q).backward()
    return (kl_value.clone(), *(t.grad for t in leaves))


@pytest.mark.parametrize("mode", ["eager", "row-chunks", "compiled"])
def test_kl_from_attention_equals_indexer_kl(mode, monkeypatch):
    """The channel's loss value and gradients (teacher mass from the attention backward) equal weight * the sum of
    indexer_kl's full-denominator form and its gradients (float64; summation order only): the sparse phase's loss
    without a teacher kernel. "row-chunks": the KL one row per chunk."""
    student, chosen, scores, attention = _attention_channel_case(12)
    q, keys, slots, sink, ckv = attention
    weight = torch.tensor(0.37, dtype=torch.float64)
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    if mode == "row-chunks":
        chunks = wrap_chunk_rows(kl_ref, monkeypatch, budget=1)
    if mode == "compiled":
        torch._dynamo.reset()
    got = _grads_through_the_channel(student, chosen, scores, attention, weight, grad_out,
                                     compiled=mode == "compiled")
    if mode == "row-chunks":
        assert len(chunks) == q.shape[0]
        monkeypatch.undo()
    from dsv4attn.ops import Explicit, sparse_attention
    lse = sparse_attention(q, keys, slots, sink)[1]
    leaves = [t.detach().clone().requires_grad_(True) for t in student]
    kl = indexer_kl(*leaves, q, ckv, Explicit(chosen), full_lse=torch.logaddexp(lse, sink), student_scores=scores)
    (weight * kl.sum()).backward()
    want = (weight * kl.sum().detach(), *(t.grad for t in leaves))
    for name, a, b in zip(("kl_value", "d_index_q", "d_index_k", "d_index_weights"), got, want):
        torch.testing.assert_close(a, b, **FP64, msg=lambda m: f"{name}: {m}")
        assert b.abs().max() > 1e-4, name


def test_kl_from_attention_without_the_attention_backward_changes_nothing():
    """The probe's backward runs only with the attention's: an output that is never differentiated leaves
    ``kl_value`` as it was and gives the indexer no gradient; a probe outside autograd (no_grad) is a plain zero."""
    from dsv4attn.ops import indexer_kl_from_attention, sparse_attention
    (index_q, index_k, index_w), chosen, scores, (q, keys, slots, sink, _) = _attention_channel_case(13)
    index_q.requires_grad_(True)
    kl_value = torch.full((), 5.0, dtype=torch.float64)
    probe = indexer_kl_from_attention(index_q, index_k, index_w, chosen, scores, torch.tensor(1.0).double(),
                                      kl_value, probe_dtype=torch.float64)
    assert probe.shape == chosen.shape and probe.dtype == torch.float64 and (probe == 0).all()
    out, _ = sparse_attention(q.requires_grad_(True), keys, slots, sink, mass_probe=probe, mass_offset=3)
    out.detach().sum()
    assert kl_value.item() == 5.0 and index_q.grad is None


CHANNEL_BAD = {
    "candidates_dtype": (dict(candidates=lambda c: c.float()), ValueError, r"candidates must have dtype in"),
    "scores_shape": (dict(student_scores=lambda s: s[:, :-1]), ValueError, r"student_scores must have shape"),
    "weight_shape": (dict(weight=lambda w: w.reshape(1)), ValueError, r"weight must have shape \(\)"),
    "kl_value_dtype": (dict(kl_value=lambda v: v.half()), ValueError, r"kl_value must have dtype in"),
    "probe_dtype": (dict(probe_dtype=lambda d: torch.bfloat16), ValueError, r"probe_dtype must be torch.float32"),
    "head_sum": (dict(head_sum=lambda h: 3), TypeError, r"head_sum must be None or a callable"),
    "kl_value_grad": (dict(kl_value=lambda v: v.requires_grad_(True)), ValueError,
                      r"kl_value must not require grad: the backward writes"),
}


@pytest.mark.parametrize("case", list(CHANNEL_BAD))
def test_kl_from_attention_bad_input(case):
    from dsv4attn.ops import indexer_kl_from_attention
    (index_q, index_k, index_w), chosen, scores, _ = _attention_channel_case(14)
    args = dict(candidates=chosen, student_scores=scores, weight=torch.tensor(1.0).double(),
                kl_value=torch.zeros((), dtype=torch.float64), probe_dtype=torch.float64, head_sum=None)
    change, error, pattern = CHANNEL_BAD[case]
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises(error, match=pattern):
        indexer_kl_from_attention(index_q, index_k, index_w, args.pop("candidates"), args.pop("student_scores"),
                                  args.pop("weight"), args.pop("kl_value"), **args)


def test_kl_from_mass_opcheck():
    from dsv4attn.ops.indexer_loss.from_attention import indexer_kl_from_mass_op
    (index_q, index_k, index_w), chosen, scores, _ = _attention_channel_case(15)
    mass = torch.rand(chosen.shape, dtype=torch.float64) * (chosen >= 0)
    torch.library.opcheck(indexer_kl_from_mass_op, (mass, index_q, index_k, index_w, chosen, scores,
                                                    torch.tensor(0.5).double(), torch.zeros((), dtype=torch.float64),
                                                    "reference"))


def test_student_scores_are_checked():
    index_q, index_k, index_w, q, ckv, cand, outside = make_case(9)
    full = _full_lse(q, ckv, cand, outside)
    scores = torch.zeros(cand.shape, dtype=torch.float64)
    with pytest.raises(ValueError, match="student_scores needs full_lse"):
        indexer_kl(index_q, index_k, index_w, q, ckv, cand, outside, student_scores=scores)
    with pytest.raises(ValueError, match=r"student_scores must have shape \(10, 5\)"):
        indexer_kl(index_q, index_k, index_w, q, ckv, cand, full_lse=full, student_scores=scores[:, :4])
    with pytest.raises(ValueError, match="student_scores must have dtype"):
        indexer_kl(index_q, index_k, index_w, q, ckv, cand, full_lse=full, student_scores=scores.long())


def test_select_topk_returns_the_indexer_topk():
    """``select_topk``: (kl, indices, scores), the kl unchanged and the other two what indexer_topk gives on the same
    candidates (the warm-up's every visible entry, and a tensor of candidates); the value is checked."""
    from dsv4attn.ops import indexer_topk
    torch.manual_seed(9)
    pack = build_pack(RAGGED_R4 + (21,), padding=4)
    lay = pack.compressed(4)
    T, Nc = pack.total_rows, lay.capacity
    index_q, index_k, index_w = (torch.randn(T, 2, 4).double(), torch.randn(Nc, 4).double(),
                                 torch.randn(T, 2).double())
    q, ckv, outside = torch.randn(T, 3, 8).double(), torch.randn(Nc, 8).double(), torch.randn(T, 3).double()
    visible = VisibleCompressed(lay, T)
    for cands in (visible, visible.materialize()):
        kl, idx, scores = indexer_kl(index_q, index_k, index_w, q, ckv, cands, outside, select_topk=3)
        assert torch.equal(kl, indexer_kl(index_q, index_k, index_w, q, ckv, cands, outside))
        want_idx, want_scores = indexer_topk(index_q, index_k, index_w, visible, 3, return_scores=True)
        assert torch.equal(idx, want_idx) and torch.equal(scores, want_scores)
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="select_topk must be None or a positive int"):
            indexer_kl(index_q, index_k, index_w, q, ckv, visible, outside, select_topk=bad)

"""sparse_attention (custom autograd, chunked) vs sparse_attention_naive (plain autograd) vs a scalar-loop oracle.

docs/semantics.md, decision 5: one softmax per (row, head) over the listed keys plus the sink logit (denominator only,
value 0), ``lse`` excludes the sink, a row with no valid key outputs 0 (never NaN).
"""
from __future__ import annotations

import math

import pytest
import torch

import dsv4attn
from dsv4attn.ops import Concat, VisibleCompressed, Window, sparse_attention
from dsv4attn.ops.sparse_attention import reference as sa_ref
from dsv4attn.ops.sparse_attention import sparse_attention_naive
from tests.packs import RAGGED_R4, build_pack, random_indices, wrap_chunk_rows

# float64 everywhere: the three implementations sum in different orders, nothing else differs.
FP64 = dict(rtol=1e-10, atol=1e-12)


def make_case(seed, T=12, H=3, D=8, N=15, K=6, empty_rows=(2, 7), dtype=torch.float64, scale_q=1.0):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, D, dtype=torch.float64) * scale_q).to(dtype)
    kv = torch.randn(N, D, dtype=torch.float64).to(dtype)
    sink = torch.randn(H, dtype=torch.float64).to(torch.float64 if dtype == torch.float64 else torch.float32)
    idx = random_indices(gen, T, N, K, hole_frac=0.3, empty_rows=empty_rows)
    return q, kv, idx, sink


def oracle(q, kv, idx, sink, scale):
    """Scalar loop over (row, head), float64, autograd-capable: softmax over [scores, sink] with a zero value."""
    T, H, D = q.shape
    outs, lses = [], []
    for t in range(T):
        keys = [int(k) for k in idx[t].tolist() if k >= 0]
        row_out, row_lse = [], []
        for h in range(H):
            if not keys:
                row_out.append(torch.zeros(D, dtype=torch.float64) + 0.0 * (q[t, h].sum() + sink[h]))
                row_lse.append(torch.tensor(-math.inf, dtype=torch.float64))
                continue
            vals = torch.stack([kv[k] for k in keys])                      # (n, D)
            z = torch.stack([scale * torch.dot(q[t, h], kv[k]) for k in keys])
            full = torch.cat([z, sink[h].reshape(1)])
            m = full.max().detach()
            e = torch.exp(full - m)
            p = e[:-1] / e.sum()
            row_out.append(p @ vals)
            mz = z.max().detach()
            row_lse.append(mz + torch.log(torch.exp(z - mz).sum()))
        outs.append(torch.stack(row_out))
        lses.append(torch.stack(row_lse))
    return torch.stack(outs), torch.stack(lses)


def run_with_grads(fn, q, kv, sink, grad_out):
    q, kv, sink = (t.detach().clone().requires_grad_(True) for t in (q, kv, sink))
    out, lse = fn(q, kv, sink)
    (out.to(torch.float64) * grad_out).sum().backward()
    return out.detach(), lse.detach(), q.grad, kv.grad, sink.grad


def ops_fn(idx, scale=None):
    return lambda q, kv, sink: sparse_attention(q, kv, idx, sink, scale)


def naive_fn(idx, scale):
    return lambda q, kv, sink: sparse_attention_naive(q, kv, idx, sink, scale)


def oracle_fn(idx, scale):
    return lambda q, kv, sink: oracle(q, kv, idx, sink, scale)


CASES = [
    pytest.param(dict(), id="T12-H3-D8-K6"),
    pytest.param(dict(T=9, H=1, D=4, N=5, K=5, empty_rows=(0,)), id="T9-H1-K=N"),
    pytest.param(dict(T=10, H=4, D=16, N=30, K=3, empty_rows=()), id="T10-H4-no-empty"),
    pytest.param(dict(scale_q=6.0), id="large-logits"),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["idx32", "idx64"])
def test_forward_backward_vs_naive_and_oracle(case, index_dtype):
    torch.manual_seed(0)
    q, kv, idx, sink = make_case(0, **case)
    idx = idx.to(index_dtype)
    scale = q.shape[-1] ** -0.5
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    got = run_with_grads(ops_fn(idx), q, kv, sink, grad_out)
    naive = run_with_grads(naive_fn(idx, scale), q, kv, sink, grad_out)
    ref = run_with_grads(oracle_fn(idx, scale), q, kv, sink, grad_out)
    names = ("out", "lse", "dq", "dkv", "dsink")
    for name, a, b, c in zip(names, got, naive, ref):
        assert a.dtype == torch.float64, name
        torch.testing.assert_close(a, b, **FP64, msg=lambda m: f"{name} vs naive: {m}")
        torch.testing.assert_close(a, c, **FP64, msg=lambda m: f"{name} vs oracle: {m}")


def test_custom_softmax_scale():
    q, kv, idx, sink = make_case(1)
    got = sparse_attention(q, kv, idx, sink, 0.37)
    want = oracle(q, kv, idx, sink, 0.37)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **FP64)


def test_empty_rows_give_zero_and_no_nan():
    q, kv, idx, sink = make_case(2, empty_rows=(0, 5, 11))
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    out, lse, dq, dkv, dsink = run_with_grads(ops_fn(idx), q, kv, sink, grad_out)
    for name, t in (("out", out), ("dq", dq), ("dkv", dkv), ("dsink", dsink)):
        assert not torch.isnan(t).any(), name
    for r in (0, 5, 11):
        assert torch.equal(out[r], torch.zeros_like(out[r]))
        assert torch.equal(lse[r], torch.full_like(lse[r], -math.inf))
        assert torch.equal(dq[r], torch.zeros_like(dq[r]))
    assert torch.isfinite(lse[[1, 2, 3]]).all()


def test_all_rows_empty_gives_zero_gradients():
    q, kv, idx, sink = make_case(3, empty_rows=range(12))
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    for fn in (ops_fn(idx), naive_fn(idx, q.shape[-1] ** -0.5)):
        out, lse, dq, dkv, dsink = run_with_grads(fn, q, kv, sink, grad_out)
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.isneginf(lse).all()
        for name, g in (("dq", dq), ("dkv", dkv), ("dsink", dsink)):
            assert torch.equal(g, torch.zeros_like(g)), name


def test_keys_referenced_only_by_empty_rows_get_zero_grad():
    q, kv, idx, sink = make_case(4, N=20, K=4)
    used = set(i for i in idx.flatten().tolist() if i >= 0)
    _, _, _, dkv, _ = run_with_grads(ops_fn(idx), q, kv, sink, torch.randn(q.shape, dtype=torch.float64))
    for n in range(20):
        if n not in used:
            assert torch.equal(dkv[n], torch.zeros_like(dkv[n])), n


def test_lse_not_differentiable():
    q, kv, idx, sink = make_case(5)
    q.requires_grad_(True)
    out, lse = sparse_attention(q, kv, idx, sink)
    assert out.requires_grad and not lse.requires_grad


@pytest.mark.parametrize("case", [
    pytest.param(dict(empty_rows=(1,)), id="holes+empty-row"),
    pytest.param(dict(empty_rows=()), id="holes"),
])
def test_gradcheck_float64(case):
    q, kv, idx, sink = make_case(6, T=5, H=2, D=4, N=7, K=3, **case)
    inputs = tuple(t.detach().clone().requires_grad_(True) for t in (q, kv, sink))
    assert torch.autograd.gradcheck(lambda a, b, c: sparse_attention(a, b, idx, c)[0], inputs, eps=1e-6,
                                    atol=1e-8, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Sink semantics

def test_lse_excludes_sink_and_full_denominator():
    q, kv, idx, sink = make_case(7, empty_rows=(3,))
    scale = q.shape[-1] ** -0.5
    out, lse = sparse_attention(q, kv, idx, sink)
    T, H, D = q.shape
    for t in range(T):
        keys = [k for k in idx[t].tolist() if k >= 0]
        if not keys:
            continue
        vals = kv[keys]
        for h in range(H):
            z = scale * (vals @ q[t, h])
            torch.testing.assert_close(lse[t, h], torch.logsumexp(z, 0), **FP64)
            denom = torch.logaddexp(lse[t, h], sink[h])
            p = torch.exp(z - denom)
            torch.testing.assert_close(out[t, h], p @ vals, **FP64)
            # The rest of the mass went to the sink: exp(sink - denominator).
            torch.testing.assert_close(1.0 - p.sum(), torch.exp(sink[h] - denom), **FP64)
            # Softmax with one extra column: logit sink, value 0.
            probs = torch.softmax(torch.cat([z, sink[h].reshape(1)]), 0)
            torch.testing.assert_close(out[t, h], probs @ torch.cat([vals, vals.new_zeros(1, D)]), **FP64)


def test_sink_minus_inf_is_plain_softmax_and_large_sink_absorbs_mass():
    q, kv, idx, sink = make_case(8, empty_rows=())
    scale = q.shape[-1] ** -0.5
    out_plain, lse = sparse_attention(q, kv, idx, torch.full_like(sink, -math.inf))
    for t in range(q.shape[0]):
        keys = [k for k in idx[t].tolist() if k >= 0]
        vals = kv[keys]
        p = torch.softmax(scale * (q[t] @ vals.T), dim=-1)
        torch.testing.assert_close(out_plain[t], p @ vals, **FP64)
    out_big, lse_big = sparse_attention(q, kv, idx, torch.full_like(sink, 200.0))
    torch.testing.assert_close(lse_big, lse, rtol=0, atol=0)
    assert out_big.abs().max() < 1e-60


# ---------------------------------------------------------------------------------------------------------------
# Chunking and index sets

def ragged_sets(seed, window=5, ratio=4, H=2, D=8, padding=3):
    torch.manual_seed(seed)
    pack = build_pack(RAGGED_R4, padding=padding)
    lay = pack.compressed(ratio)
    T = pack.total_rows
    kv_full = torch.randn(T + lay.capacity, D, dtype=torch.float64)
    q = torch.randn(T, H, D, dtype=torch.float64)
    sink = torch.randn(H, dtype=torch.float64)
    index_set = Concat(Window(pack, window), VisibleCompressed(lay, T, offset=T))
    return pack, q, kv_full, sink, index_set


def test_index_set_equals_materialized_and_padding_rows_are_zero():
    pack, q, kv, sink, index_set = ragged_sets(9)
    explicit = index_set.materialize()
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    got = run_with_grads(ops_fn(index_set), q, kv, sink, grad_out)
    mat = run_with_grads(ops_fn(explicit.to(torch.int32)), q, kv, sink, grad_out)
    naive = run_with_grads(naive_fn(explicit, q.shape[-1] ** -0.5), q, kv, sink, grad_out)
    for name, a, b, c in zip(("out", "lse", "dq", "dkv", "dsink"), got, mat, naive):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{name} set vs tensor: {m}")
        torch.testing.assert_close(a, c, **FP64, msg=lambda m: f"{name} vs naive: {m}")
    pad = ~pack.row_is_real
    assert pad.sum() == 3
    assert torch.equal(got[0][pad], torch.zeros_like(got[0][pad]))
    assert torch.isneginf(got[1][pad]).all()
    assert torch.equal(got[2][pad], torch.zeros_like(got[2][pad]))


@pytest.mark.parametrize("indices", ["explicit", "index-set"])
def test_chunking_invariance(monkeypatch, indices):
    pack, q, kv, sink, index_set = ragged_sets(10)
    if indices == "explicit":
        index_set = index_set.materialize().to(torch.int32)
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    whole = run_with_grads(ops_fn(index_set), q, kv, sink, grad_out)
    chunks = wrap_chunk_rows(sa_ref, monkeypatch, budget=1)
    one_row = run_with_grads(ops_fn(index_set), q, kv, sink, grad_out)
    T = pack.total_rows
    assert chunks.count((0, 1)) == 2 and len(chunks) == 2 * T, "forward and backward ran one row per chunk"
    # Row-local results are bit-identical; d attn_sink sums over rows chunk by chunk, so only its rounding moves.
    for name, a, b in zip(("out", "lse", "dq", "dkv"), whole, one_row):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(whole[4], one_row[4], rtol=1e-13, atol=1e-15)


# ---------------------------------------------------------------------------------------------------------------
# Low precision: error of the op <= 2x (outputs) / 3x (gradients) the error of the naive version in the same
# precision, both measured against float64 on the same (rounded) inputs.

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_low_precision_error_vs_naive(dtype):
    torch.manual_seed(11)
    gen = torch.Generator().manual_seed(11)
    T, H, D, N, K = 48, 4, 64, 96, 32
    q = torch.randn(T, H, D, dtype=torch.float64).to(dtype)
    kv = torch.randn(N, D, dtype=torch.float64).to(dtype)
    sink = torch.randn(H, dtype=torch.float32)
    idx = random_indices(gen, T, N, K, hole_frac=0.25, empty_rows=(3,))
    grad_out = torch.randn(T, H, D, dtype=torch.float64).to(dtype).to(torch.float64)
    scale = D ** -0.5
    ref = run_with_grads(naive_fn(idx, scale), q.double(), kv.double(), sink.double(), grad_out)
    got = run_with_grads(ops_fn(idx), q, kv, sink, grad_out)
    naive = run_with_grads(naive_fn(idx, scale), q, kv, sink, grad_out)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert got[2].dtype == dtype and got[3].dtype == dtype and got[4].dtype == torch.float32
    failures = []
    for i, (name, factor) in enumerate((("out", 2), ("lse", 2), ("dq", 3), ("dkv", 3), ("dsink", 3))):
        finite = torch.isfinite(ref[i])
        assert torch.equal(torch.isfinite(got[i]), finite), name
        err = (got[i].double() - ref[i])[finite].abs().max().item()
        err_naive = (naive[i].double() - ref[i])[finite].abs().max().item()
        # fp32 results (lse, dsink, and every result at fp32) carry no low-precision rounding, only fp32 summation
        # order, which the CPU's matmul kernels set (AVX-512 vs AVX2 machines order the sums differently): both
        # errors are then ~1e-7 relative and their ratio means nothing, so 1e-6 of the largest float64 magnitude
        # bounds that noise, as in the GPU tests.
        floor = 1e-6 * ref[i][finite].abs().max().item()
        if not err <= factor * err_naive + floor:
            failures.append(f"{name}: error {err:.3e} > {factor} x naive error {err_naive:.3e}")
    assert not failures, "; ".join(failures)


def test_deterministic():
    pack, q, kv, sink, index_set = ragged_sets(12)
    q, kv, sink = q.float(), kv.float(), sink.float()
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    first = run_with_grads(ops_fn(index_set), q, kv, sink, grad_out)
    second = run_with_grads(ops_fn(index_set), q, kv, sink, grad_out)
    for name, a, b in zip(("out", "lse", "dq", "dkv", "dsink"), first, second):
        assert torch.equal(a, b), name


def test_empty_row_with_minus_inf_sink_gives_zero_not_nan():
    """docs/semantics.md, decision 5: a row with no valid key outputs 0, even when the sink is -inf (0/0 must not
    leak)."""
    torch.manual_seed(11)
    q = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 1], [-1, -1], [2, -1]], dtype=torch.int32)
    sink = torch.tensor([float("-inf"), 0.3], dtype=torch.float64, requires_grad=True)
    out, lse = dsv4attn.ops.sparse_attention(q, kv, idx, sink)
    out.square().sum().backward()
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()
    assert (q.grad[1] == 0).all()
    for g in (q.grad, kv.grad, sink.grad):
        assert torch.isfinite(g).all()
    assert sink.grad[0] == 0


# ---------------------------------------------------------------------------------------------------------------
# topk_length: row t uses only its first topk_length[t] slots (FlashMLA's convention); the rest count as -1.

def _first_slots(idx, lengths):
    return torch.where(torch.arange(idx.shape[1])[None, :] < lengths[:, None].long(), idx, -1).to(idx.dtype)


@pytest.mark.parametrize("lengths", ["random", "zero", "full"])
@pytest.mark.parametrize("indices", ["tensor", "index-set"])
def test_topk_length_equals_masked_indices(lengths, indices):
    q, kv, idx, sink = make_case(13, K=6)
    gen = torch.Generator().manual_seed(13)
    T, K = idx.shape
    length = {"random": torch.randint(0, K + 1, (T,), generator=gen),
              "zero": torch.zeros(T, dtype=torch.int64),
              "full": torch.full((T,), K)}[lengths].to(torch.int32)
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    arg = idx if indices == "tensor" else Concat(dsv4attn.ops.Explicit(idx))
    fn = lambda q_, kv_, s_: sparse_attention(q_, kv_, arg, s_, topk_length=length)       # noqa: E731
    got = run_with_grads(fn, q, kv, sink, grad_out)
    masked = run_with_grads(ops_fn(_first_slots(idx, length)), q, kv, sink, grad_out)
    ref = run_with_grads(oracle_fn(_first_slots(idx, length), q.shape[-1] ** -0.5), q, kv, sink, grad_out)
    for name, a, b, c in zip(("out", "lse", "dq", "dkv", "dsink"), got, masked, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{name} vs masked indices: {m}")
        c = torch.zeros_like(a) if c is None else c        # the oracle never touches kv when every row is empty
        torch.testing.assert_close(a, c, **FP64, msg=lambda m: f"{name} vs oracle: {m}")
    if lengths == "zero":
        assert torch.equal(got[0], torch.zeros_like(got[0])) and torch.isneginf(got[1]).all()


def test_topk_length_int64_and_gradcheck():
    q, kv, idx, sink = make_case(14, T=5, H=2, D=4, N=7, K=3, empty_rows=())
    length = torch.tensor([0, 1, 2, 3, 2], dtype=torch.int64)
    inputs = tuple(t.detach().clone().requires_grad_(True) for t in (q, kv, sink))
    assert torch.autograd.gradcheck(lambda a, b, c: sparse_attention(a, b, idx, c, topk_length=length)[0], inputs,
                                    eps=1e-6, atol=1e-8, rtol=1e-6)


TOPK_LENGTH_BAD = {
    "float": (lambda T, K: torch.ones(T), r"topk_length must have dtype"),
    "2d": (lambda T, K: torch.ones(T, 1, dtype=torch.int32), r"topk_length must have shape \(12,\)"),
    "wrong_rows": (lambda T, K: torch.ones(T - 1, dtype=torch.int32), r"topk_length must have shape \(12,\)"),
    "meta_device": (lambda T, K: torch.ones(T, dtype=torch.int32, device="meta"), r"topk_length must be on cpu"),
    "negative": (lambda T, K: torch.full((T,), -1, dtype=torch.int32),
                 r"topk_length must hold slot counts in \[0, 6\]"),
    "above_k": (lambda T, K: torch.full((T,), K + 1, dtype=torch.int32), r"got values in \[7, 7\]"),
}


@pytest.mark.parametrize("case", list(TOPK_LENGTH_BAD))
def test_topk_length_bad_input(case):
    make, pattern = TOPK_LENGTH_BAD[case]
    q, kv, idx, sink = make_case(15)
    with dsv4attn.checks.checks("values"), pytest.raises(ValueError, match=pattern):   # ranges: debug checks
        sparse_attention(q, kv, idx, sink, topk_length=make(*idx.shape))


def test_topk_length_range_is_a_value_check():
    """Out-of-range lengths need a device read to detect: in the default mode they just clamp (no sync)."""
    q, kv, idx, sink = make_case(16)
    too_long = torch.full((idx.shape[0],), idx.shape[1] + 3, dtype=torch.int32)
    with dsv4attn.checks.checks("default"):
        out, lse = sparse_attention(q, kv, idx, sink, topk_length=too_long)
    want = sparse_attention(q, kv, idx, sink)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_bad_deterministic_and_indices_types():
    q, kv, idx, sink = make_case(17)
    with pytest.raises(TypeError, match=r"deterministic must be a bool"):
        sparse_attention(q, kv, idx, sink, deterministic=1)
    with pytest.raises(TypeError, match=r"indices must be a \(T, K\) int32 torch.Tensor or an IndexSet"):
        sparse_attention(q, kv, idx.tolist(), sink)


# ---------------------------------------------------------------------------------------------------------------
# output_rope: the output's inverse RoPE inside the op equals the attention followed by apply_rope(inverse=True).

@pytest.mark.parametrize("indices", ["tensor", "index-set"])
@pytest.mark.parametrize("pairs", [0, 2, 4])
def test_output_rope_equals_attention_then_inverse_rope(indices, pairs):
    from dsv4attn.rope import apply_rope
    pack, q, kv, sink, index_set = ragged_sets(24)
    arg = index_set.materialize().to(torch.int32) if indices == "tensor" else index_set
    positions = pack.row_position
    inv_freq = 10000.0 ** (-torch.arange(pairs, dtype=torch.float64) / max(pairs, 1))
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    fused = run_with_grads(lambda q_, kv_, s_: sparse_attention(q_, kv_, arg, s_, output_rope=(positions, inv_freq)),
                           q, kv, sink, grad_out)

    def composed(q_, kv_, s_):
        out, lse = sparse_attention(q_, kv_, arg, s_)
        return apply_rope(out, positions, inv_freq, inverse=True), lse

    want = run_with_grads(composed, q, kv, sink, grad_out)
    for name, a, b in zip(("out", "lse", "dq", "dkv", "dsink"), fused, want):
        torch.testing.assert_close(a, b, **FP64, msg=lambda m: f"{name}: {m}")


OUTPUT_ROPE_BAD = {
    "not_a_pair": (lambda T, pos, inv: pos, TypeError, r"output_rope must be a \(positions, inv_freq\) pair"),
    "float_positions": (lambda T, pos, inv: (pos.double(), inv), ValueError,
                        r"output_rope positions must have dtype in"),
    "short_positions": (lambda T, pos, inv: (pos[:-1], inv), ValueError, r"output_rope positions must have shape"),
    "2d_inv_freq": (lambda T, pos, inv: (pos, inv[None]), ValueError, r"output_rope inv_freq must be 1-D"),
    "meta_inv_freq": (lambda T, pos, inv: (pos, inv.to("meta")), ValueError, r"output_rope inv_freq must be on cpu"),
    "too_many_pairs": (lambda T, pos, inv: (pos, torch.ones(5, dtype=torch.float64)), ValueError,
                       r"rotates 10 channels, more than q's head dim 8"),
}


@pytest.mark.parametrize("case", list(OUTPUT_ROPE_BAD))
def test_output_rope_bad_input(case):
    make, error, pattern = OUTPUT_ROPE_BAD[case]
    q, kv, idx, sink = make_case(25)
    pos, inv = torch.arange(q.shape[0]), torch.ones(2, dtype=torch.float64)
    with pytest.raises(error, match=pattern):
        sparse_attention(q, kv, idx, sink, output_rope=make(q.shape[0], pos, inv))


# ---------------------------------------------------------------------------------------------------------------
# query_norm: the attention's backward gives the gradient of the query norm's input; equal (float64) to qnorm_rope
# followed by the attention through autograd.

@pytest.mark.parametrize("indices", ["tensor", "index-set"])
@pytest.mark.parametrize("pairs", [0, 2])
@pytest.mark.parametrize("output_rope", [True, False])
def test_query_norm_equals_qnorm_rope_then_attention(indices, pairs, output_rope):
    from dsv4attn.ops.qnorm_rope import qnorm_rope, qnorm_rope_stats
    pack, x, kv, sink, index_set = ragged_sets(26)
    x = x * 3
    arg = index_set.materialize().to(torch.int32) if indices == "tensor" else index_set
    positions = pack.row_position
    inv_freq = 10000.0 ** (-torch.arange(pairs if output_rope else 0, dtype=torch.float64) / max(pairs, 1))
    rope = (positions, inv_freq) if output_rope else None
    grad_out = torch.randn(x.shape, dtype=torch.float64)

    def in_op(x_, kv_, s_):
        q, rstd = qnorm_rope_stats(x_, positions, inv_freq, 1e-6)
        assert not q.requires_grad
        return sparse_attention(q, kv_, arg, s_, output_rope=rope, query_norm=(x_, rstd))

    def composed(x_, kv_, s_):
        return sparse_attention(qnorm_rope(x_, positions, inv_freq, 1e-6), kv_, arg, s_, output_rope=rope)

    got, want = run_with_grads(in_op, x, kv, sink, grad_out), run_with_grads(composed, x, kv, sink, grad_out)
    assert got[2].abs().max() > 0.01
    for name, a, b in zip(("out", "lse", "dx", "dkv", "dsink"), got, want):
        torch.testing.assert_close(a, b, **FP64, msg=lambda m: f"{name}: {m}")


QUERY_NORM_BAD = {
    "not_a_pair": (lambda q, x, r: x, TypeError, r"query_norm must be an \(x, rstd\) pair"),
    "x_shape": (lambda q, x, r: (x[:, :1], r), ValueError, r"query_norm x must have shape"),
    "x_dtype": (lambda q, x, r: (x.float(), r), ValueError, r"query_norm x must have dtype"),
    "rstd_shape": (lambda q, x, r: (x, r[:, :1]), ValueError, r"query_norm rstd must have shape"),
    "rstd_dtype": (lambda q, x, r: (x, r.float()), ValueError, r"query_norm rstd must have dtype"),
}


@pytest.mark.parametrize("case", list(QUERY_NORM_BAD))
def test_query_norm_bad_input(case):
    make, error, pattern = QUERY_NORM_BAD[case]
    x, kv, idx, sink = make_case(27)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6)
    with pytest.raises(error, match=pattern):
        sparse_attention(x * rstd[..., None], kv, idx, sink, query_norm=make(x, x, rstd))


def test_query_norm_refuses_a_query_with_a_gradient_of_its_own():
    x, kv, idx, sink = make_case(28)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6)
    q = (x * rstd[..., None]).requires_grad_(True)
    with pytest.raises(ValueError, match=r"q must not require grad when query_norm is given"):
        sparse_attention(q, kv, idx, sink, query_norm=(x, rstd))


# ---------------------------------------------------------------------------------------------------------------
# Determinism: the reference is deterministic in both modes (fixed-order sums only), so the flag changes nothing.

@pytest.mark.parametrize("indices", ["tensor", "index-set"])
def test_reference_deterministic_flag_is_bitwise_identical(indices):
    pack, q, kv, sink, index_set = ragged_sets(18)
    q, kv, sink = q.float(), kv.float(), sink.float()
    arg = index_set.materialize().to(torch.int32) if indices == "tensor" else index_set
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    runs = [run_with_grads(lambda q_, kv_, s_: sparse_attention(q_, kv_, arg, s_, deterministic=det), q, kv, sink,
                           grad_out) for det in (True, True, False)]
    for i, name in enumerate(("out", "lse", "dq", "dkv", "dsink")):
        assert torch.equal(runs[0][i], runs[1][i]) and torch.equal(runs[0][i], runs[2][i]), name


# ---------------------------------------------------------------------------------------------------------------
# The registered op: torch.compile(fullgraph=True) and opcheck (reference backend on the CPU).

def _compile_inputs(seed, dtype=torch.float32):
    q, kv, idx, sink = make_case(seed, T=16, H=4, D=16, N=20, K=8, empty_rows=(3,))
    length = torch.randint(0, 9, (16,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    return q.to(dtype), kv.to(dtype), idx, sink.float(), length


@pytest.mark.parametrize("with_length", [False, True], ids=["indices", "indices+topk_length"])
def test_torch_compile_fullgraph_matches_eager(with_length):
    q, kv, idx, sink, length = _compile_inputs(19)
    length = length if with_length else None
    grad_out = torch.randn(q.shape, dtype=torch.float64)

    def step(q_, kv_, s_):
        out, lse = sparse_attention(q_, kv_, idx, s_, topk_length=length, deterministic=True)
        return out, lse

    torch._dynamo.reset()
    eager = run_with_grads(step, q, kv, sink, grad_out)
    compiled = run_with_grads(torch.compile(step, fullgraph=True), q, kv, sink, grad_out)
    # Same op, same backend, same inputs: bitwise equal (the compiled graph only adds the cast of grad_out).
    for name, a, b in zip(("out", "lse", "dq", "dkv", "dsink"), eager, compiled):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_torch_compile_with_value_checks_on_has_no_graph_break():
    """Debug value checks (which sync) are skipped while compiling, so fullgraph=True does not break on them."""
    q, kv, idx, sink, length = _compile_inputs(20)
    with dsv4attn.checks.checks("values"):
        torch._dynamo.reset()
        fn = torch.compile(lambda a, b, c, d, e: sparse_attention(a, b, c, d, topk_length=e), fullgraph=True)
        out, lse = fn(q, kv, idx, sink, length)
    want = sparse_attention(q, kv, idx, sink, topk_length=length)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@pytest.mark.parametrize("with_length", [False, True], ids=["indices", "indices+topk_length"])
def test_opcheck(with_length):
    from dsv4attn.ops.sparse_attention.op import sparse_attention_backward_op, sparse_attention_op

    q, kv, idx, sink, length = _compile_inputs(21, dtype=torch.float64)
    sink = sink.double()
    length = length if with_length else None
    q, kv, sink = (t.requires_grad_(True) for t in (q, kv, sink))
    torch.library.opcheck(sparse_attention_op, (q, kv, idx, sink, 0.3, length, False, "reference"))
    out, lse = sparse_attention_op(q, kv, idx, sink, 0.3, length, False, "reference")
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    torch.library.opcheck(sparse_attention_backward_op, (grad_out, q.detach(), kv.detach(), idx, sink.detach(),
                                                         out.detach(), lse, 0.3, length, True, "reference"))
    # With the output rotation (its positions and frequencies are op arguments too).
    rope = (torch.arange(q.shape[0]), torch.tensor([1.0, 0.01], dtype=torch.float64))
    torch.library.opcheck(sparse_attention_op, (q, kv, idx, sink, 0.3, length, False, "reference", *rope))
    torch.library.opcheck(sparse_attention_backward_op, (grad_out, q.detach(), kv.detach(), idx, sink.detach(),
                                                         out.detach(), lse, 0.3, length, True, "reference", *rope))


# ---------------------------------------------------------------------------------------------------------------
# mass_probe: the backward hands the head-summed probabilities of a slot range to a probe as its gradient.

def _probe_run(fn, q, kv, sink, grad_out, width):
    """(grads of q, kv, sink, probe) after one backward of ``fn(q, kv, sink, probe)`` -> out with a (T, width)
    probe."""
    q, kv, sink = (t.detach().clone().requires_grad_(True) for t in (q, kv, sink))
    probe = torch.zeros(q.shape[0], width, dtype=q.dtype, requires_grad=True)
    (fn(q, kv, sink, probe) * grad_out).sum().backward()
    return q.grad, kv.grad, sink.grad, probe.grad


@pytest.mark.parametrize("indices", ["tensor", "index-set", "index-set-chunks", "topk_length", "output_rope"])
def test_mass_probe_gets_the_teacher_mass(indices, monkeypatch):
    """The probe's gradient is reference_backward's mass of the same slots (float64, bitwise where the computation is
    the same), summed over heads and 0 at empty slots; the other gradients are those of a run without a probe. The
    kernels' row chunks ("index-set-chunks": one row per op call, the probe split alike) only concatenate."""
    from dsv4attn.ops.index_sets import Explicit
    from dsv4attn.ops.sparse_attention import op as sa_op

    pack, q, kv, sink, index_set = ragged_sets(26)
    T, K = pack.total_rows, index_set.width
    offset, width = 5, K - 7                                 # past the window's 5 slots, short of the last 2
    idx = index_set.materialize().to(torch.int32)
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    kwargs, arg = {}, idx
    if indices == "topk_length":
        kwargs["topk_length"] = torch.randint(0, K + 1, (T,), generator=torch.Generator().manual_seed(3),
                                              dtype=torch.int32)
    if indices == "output_rope":
        kwargs["output_rope"] = (pack.row_position, torch.tensor([1.0, 0.1], dtype=torch.float64))
    if indices.startswith("index-set"):
        arg = index_set

    def fn(q_, kv_, s_, probe):
        return sparse_attention(q_, kv_, arg, s_, mass_probe=probe, mass_offset=offset, **kwargs)[0]

    if indices == "index-set-chunks":                # the kernels' path: one op call per chunk of rows
        chunks = wrap_chunk_rows(sa_op, monkeypatch, budget=1)
        monkeypatch.setattr(sa_op, "sparse_attention_reference", None)           # must not be reached

        def fn(q_, kv_, s_, probe):                  # noqa: F811: fp64 runs the reference inside the op
            return sa_op.run(q_, kv_, arg, s_, q.shape[2] ** -0.5, None, False, "triton", mass_probe=probe,
                             mass_offset=offset)[0]
    got = _probe_run(fn, q, kv, sink, grad_out, width)
    if indices == "index-set-chunks":
        assert len(chunks) == T
        monkeypatch.undo()
    plain = run_with_grads(lambda q_, kv_, s_: sparse_attention(q_, kv_, arg, s_, **kwargs), q, kv, sink, grad_out)
    for name, a, b in zip(("dq", "dkv", "dsink"), got[:3], plain[2:]):
        if indices == "index-set-chunks" and name != "dq":     # summed over rows chunk by chunk
            torch.testing.assert_close(a, b, **FP64)
        else:
            assert torch.equal(a, b), name
    limited = idx if "topk_length" not in kwargs else torch.where(
        torch.arange(K)[None, :] < kwargs["topk_length"][:, None], idx, -1)
    lse = sparse_attention(q, kv, limited, sink)[1]
    rope_grad = grad_out
    if "output_rope" in kwargs:
        from dsv4attn.rope import apply_rope
        rope_grad = apply_rope(grad_out, *kwargs["output_rope"])
    want = sa_ref.reference_backward(rope_grad, q, kv, Explicit(limited), sink, lse, q.shape[2] ** -0.5,
                                     mass_slots=(offset, width))[3]
    assert got[3].shape == (T, width) and got[3].dtype == torch.float64
    torch.testing.assert_close(got[3], want, **FP64)
    assert got[3].abs().max() > 0.1
    assert (got[3][limited[:, offset:offset + width] < 0] == 0).all()


def test_mass_probe_without_grad_and_compiled():
    """A probe that does not require grad gets none (and costs the backward nothing); under
    torch.compile(fullgraph=True) the probe's gradient is the eager one, bit for bit."""
    q, kv, idx, sink, _ = _compile_inputs(27)
    grad_out = torch.randn(q.shape)
    probe = torch.zeros(q.shape[0], 5)
    out, _ = sparse_attention(q.requires_grad_(True), kv, idx, sink, mass_probe=probe, mass_offset=2)
    (out * grad_out).sum().backward()
    assert probe.grad is None

    def step(q_, probe_):
        return sparse_attention(q_, kv, idx, sink, mass_probe=probe_, mass_offset=2)[0]

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        torch._dynamo.reset()
        q_, probe_ = q.detach().clone().requires_grad_(True), torch.zeros(q.shape[0], 5, requires_grad=True)
        (fn(q_, probe_) * grad_out).sum().backward()
        results.append((q_.grad, probe_.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[0][1].abs().max() > 0


MASS_PROBE_BAD = {
    "not_a_tensor": (lambda T: ([0.0] * T, 0), TypeError, r"mass_probe must be a torch.Tensor"),
    "rows": (lambda T: (torch.zeros(T - 1, 3, dtype=torch.float64), 0), ValueError,
             r"mass_probe must have shape \(12, \*\)"),
    "dtype": (lambda T: (torch.zeros(T, 3), 0), ValueError, r"mass_probe must have dtype in \['torch.float64'\]"),
    "offset_type": (lambda T: (torch.zeros(T, 3, dtype=torch.float64), 1.0), TypeError,
                    r"mass_offset must be an int"),
    "past_the_slots": (lambda T: (torch.zeros(T, 3, dtype=torch.float64), 4), ValueError,
                       r"must lie within the 6 slots of indices, got slots 4 \.\. 7"),
    "negative_offset": (lambda T: (torch.zeros(T, 3, dtype=torch.float64), -1), ValueError,
                        r"must lie within the 6 slots"),
}


@pytest.mark.parametrize("case", list(MASS_PROBE_BAD))
def test_mass_probe_bad_input(case):
    make, error, pattern = MASS_PROBE_BAD[case]
    q, kv, idx, sink = make_case(28)
    probe, offset = make(q.shape[0])
    with pytest.raises(error, match=pattern):
        sparse_attention(q, kv, idx, sink, mass_probe=probe, mass_offset=offset)


def test_mass_opcheck():
    from dsv4attn.ops.sparse_attention.op import sparse_attention_backward_op, sparse_attention_op

    q, kv, idx, sink, length = _compile_inputs(29, dtype=torch.float64)
    sink = sink.double()
    probe = torch.zeros(q.shape[0], 4, dtype=torch.float64, requires_grad=True)
    q, kv, sink = (t.requires_grad_(True) for t in (q, kv, sink))
    args = (q, kv, idx, sink, 0.3, length, False, "reference", None, None, probe, 3)
    torch.library.opcheck(sparse_attention_op, args)
    out, lse = sparse_attention_op(*args)
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    torch.library.opcheck(sparse_attention_backward_op, (grad_out, q.detach(), kv.detach(), idx, sink.detach(),
                                                         out.detach(), lse, 0.3, length, True, "reference", None,
                                                         None, 3, 4))


# ---------------------------------------------------------------------------------------------------------------
# sparse_attention_lse: the lse of sparse_attention without its output.

@pytest.mark.parametrize("indices", ["tensor", "index-set"])
def test_lse_alone_equals_the_attention_lse(indices):
    from dsv4attn.ops import sparse_attention_lse
    pack, q, kv, sink, index_set = ragged_sets(12)
    idx = index_set if indices == "index-set" else index_set.materialize().to(torch.int32)
    _, want = sparse_attention(q, kv, idx, sink)
    got = sparse_attention_lse(q.requires_grad_(True), kv, idx)
    assert got.dtype == torch.float64 and not got.requires_grad
    torch.testing.assert_close(got, want, rtol=0, atol=0)        # the same chunked reference sums
    assert torch.isneginf(got[~pack.row_is_real]).all()
    # The reference's own arithmetic against the scalar oracle (holes, empty rows), and the scale argument.
    q2, kv2, idx2, sink2 = make_case(23)
    torch.testing.assert_close(sparse_attention_lse(q2, kv2, idx2, 0.3), oracle(q2, kv2, idx2, sink2, 0.3)[1],
                               **FP64)


def test_lse_alone_bad_input_and_out_of_range_rows():
    from dsv4attn.ops import sparse_attention_lse
    q, kv, idx, sink = make_case(24)
    with pytest.raises(ValueError, match=r"kv"):
        sparse_attention_lse(q, kv[:, :3], idx)
    with pytest.raises(TypeError, match=r"indices must be a \(T, K\) int32 torch.Tensor or an IndexSet"):
        sparse_attention_lse(q, kv, idx.tolist())
    # A row index >= N is an empty slot (as in sparse_attention); the debug mode raises instead.
    wide = idx.clone()
    wide[0, 0] = kv.shape[0] + 5
    torch.testing.assert_close(sparse_attention_lse(q, kv, wide), sparse_attention(q, kv, wide, sink)[1],
                               rtol=0, atol=0)
    with dsv4attn.checks.checks("values"), pytest.raises(ValueError, match=r"indices"):
        sparse_attention_lse(q, kv, wide)


def test_lse_alone_opcheck_and_compile():
    from dsv4attn.ops import sparse_attention_lse
    from dsv4attn.ops.sparse_attention.op import sparse_attention_lse_op
    q, kv, idx, sink, _ = _compile_inputs(25, dtype=torch.float64)
    torch.library.opcheck(sparse_attention_lse_op, (q, kv, idx, 0.3, "reference"))
    grads = (q.detach().requires_grad_(True), kv.detach().requires_grad_(True))
    assert not sparse_attention_lse_op(*grads, idx, 0.3, "reference").requires_grad        # not differentiable
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: sparse_attention_lse(a, b, idx), fullgraph=True)(q, kv)
    torch.testing.assert_close(compiled, sparse_attention_lse(q, kv, idx), rtol=0, atol=0)

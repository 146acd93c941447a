"""Interleaved partial RoPE, YaRN frequencies and the inverse rotation (docs/semantics.md, "RoPE and YaRN")."""
from __future__ import annotations

import math

import pytest
import torch

from dsv4attn.rope import apply_rope, rope_frequencies

ROPE_DIM = 64


def plain_reference(rope_dim, base):
    return [base ** (-2.0 * i / rope_dim) for i in range(rope_dim // 2)]


def yarn_low_high(rope_dim, base, original, beta_fast=32.0, beta_slow=1.0):
    """docs/semantics.md ("RoPE and YaRN"): D(n) = d_r ln(L_orig / (2 pi n)) / (2 ln B); low = floor(D(b_fast)),
    high = ceil(D(b_slow))."""
    def dim_of(n):
        return rope_dim * math.log(original / (2 * math.pi * n)) / (2 * math.log(base))
    low = max(math.floor(dim_of(beta_fast)), 0)
    high = min(math.ceil(dim_of(beta_slow)), rope_dim - 1)
    return low, high


def yarn_reference(rope_dim, base, factor, original, beta_fast=32.0, beta_slow=1.0):
    """theta_i = B^(-2i/d) ((1 - g_i) + g_i / s), g_i = clamp((i - low) / (high - low), 0, 1), scalar python."""
    low, high = yarn_low_high(rope_dim, base, original, beta_fast, beta_slow)
    if low == high:
        high += 0.001
    out = []
    for i in range(rope_dim // 2):
        g = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(base ** (-2.0 * i / rope_dim) * ((1.0 - g) + g / factor))
    return out


def yarn(factor, original, **extra):
    return {"type": "yarn", "factor": factor, "original_max_position_embeddings": original, **extra}


@pytest.mark.parametrize("base", [10000.0, 160000.0], ids=["base10000", "base160000"])
@pytest.mark.parametrize("rope_dim", [64, 8], ids=["d64", "d8"])
def test_plain_frequencies(base, rope_dim):
    got = rope_frequencies(rope_dim, base, None)
    assert got.dtype == torch.float64 and got.shape == (rope_dim // 2,)
    torch.testing.assert_close(got, torch.tensor(plain_reference(rope_dim, base), dtype=torch.float64),
                               rtol=1e-14, atol=0)
    default = rope_frequencies(rope_dim, base, {"rope_type": "default", "factor": 16.0})
    torch.testing.assert_close(default, got, rtol=0, atol=0)


@pytest.mark.parametrize("base, factor, low, high", [(160000.0, 16.0, 15, 25), (40000.0, 4.0, 17, 28)],
                         ids=["released-160000x16", "megatron-40000x4"])
def test_yarn_low_high_as_in_docs(base, factor, low, high):
    assert yarn_low_high(ROPE_DIM, base, 65536) == (low, high)
    got = rope_frequencies(ROPE_DIM, base, yarn(factor, 65536, beta_fast=32, beta_slow=1)).tolist()
    plain = plain_reference(ROPE_DIM, base)
    # i <= low: high-frequency pairs untouched; i >= high: divided by the factor; strictly between: blended.
    for i in range(ROPE_DIM // 2):
        if i <= low:
            assert got[i] == pytest.approx(plain[i], rel=1e-14), i
        elif i >= high:
            assert got[i] == pytest.approx(plain[i] / factor, rel=1e-14), i
        else:
            assert plain[i] / factor < got[i] < plain[i], i


@pytest.mark.parametrize("scaling", [
    pytest.param(yarn(16.0, 65536), id="160000x16-defaults"),
    pytest.param(yarn(16.0, 65536, beta_fast=32, beta_slow=1), id="160000x16-explicit-betas"),
    pytest.param(yarn(16.0, 65536, beta_fast=None, beta_slow=None), id="160000x16-null-betas"),
    pytest.param({"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536}, id="rope_type-key"),
    pytest.param(yarn(4.0, 65536, beta_fast=16, beta_slow=2), id="160000x4-other-betas"),
    pytest.param(yarn(2.0, 4096, beta_fast=32, beta_slow=1), id="160000x2-orig4096"),
])
def test_yarn_frequencies_match_formula(scaling):
    beta_fast = scaling.get("beta_fast") or 32.0
    beta_slow = scaling.get("beta_slow") or 1.0
    want = yarn_reference(ROPE_DIM, 160000.0, float(scaling["factor"]),
                          float(scaling["original_max_position_embeddings"]), beta_fast, beta_slow)
    got = rope_frequencies(ROPE_DIM, 160000.0, scaling)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=0)


def test_yarn_low_equals_high_gets_epsilon():
    # original 5: D(beta_slow) in (-1, 0] and D(beta_fast) < 0, so low == high == 0 and docs/semantics.md ("RoPE and
    # YaRN") uses high = 0.001: pair 0 keeps its frequency, every other pair is divided by the factor (no division by
    # zero).
    assert yarn_low_high(ROPE_DIM, 160000.0, 5) == (0, 0)
    got = rope_frequencies(ROPE_DIM, 160000.0, yarn(8.0, 5))
    plain = torch.tensor(plain_reference(ROPE_DIM, 160000.0), dtype=torch.float64)
    torch.testing.assert_close(got[0], plain[0], rtol=1e-14, atol=0)
    torch.testing.assert_close(got[1:], plain[1:] / 8.0, rtol=1e-14, atol=0)
    torch.testing.assert_close(got, torch.tensor(yarn_reference(ROPE_DIM, 160000.0, 8.0, 5), dtype=torch.float64),
                               rtol=1e-14, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# apply_rope

def make_inputs(seed, shape, rope_dim, dtype, max_position=5000):
    torch.manual_seed(seed)
    x = torch.randn(shape, dtype=torch.float64).to(dtype)
    positions = torch.randint(0, max_position, (shape[0],))
    inv_freq = rope_frequencies(rope_dim, 160000.0, yarn(16.0, 65536))
    return x, positions, inv_freq


DTYPES = [pytest.param(torch.float64, id="fp64"), pytest.param(torch.float32, id="fp32"),
          pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_nope_channels_bit_exact(dtype, inverse):
    x, pos, inv = make_inputs(0, (7, 3, 24), 8, dtype)
    y = apply_rope(x, pos, inv, inverse=inverse)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y[..., :16], x[..., :16])


@pytest.mark.parametrize("shape", [(11, 24), (11, 4, 24)], ids=["2d", "3d"])
def test_inverse_undoes_forward(shape):
    x, pos, inv = make_inputs(1, shape, 8, torch.float64, max_position=1_000_000)
    back = apply_rope(apply_rope(x, pos, inv), pos, inv, inverse=True)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-12)
    back2 = apply_rope(apply_rope(x, pos, inv, inverse=True), pos, inv)
    torch.testing.assert_close(back2, x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_matches_complex_multiplication(inverse):
    """Pairs (x[2i], x[2i+1]) of the trailing slice rotate like x[2i] + i x[2i+1] times exp(+-i p theta_i)."""
    x, pos, inv = make_inputs(2, (9, 2, 20), 12, torch.float64)
    y = apply_rope(x, pos, inv, inverse=inverse)
    sign = -1.0 if inverse else 1.0
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            for i in range(6):
                z = complex(x[t, h, 8 + 2 * i].item(), x[t, h, 8 + 2 * i + 1].item())
                w = z * complex(math.cos(sign * pos[t].item() * inv[i].item()),
                                math.sin(sign * pos[t].item() * inv[i].item()))
                assert y[t, h, 8 + 2 * i].item() == pytest.approx(w.real, abs=1e-12)
                assert y[t, h, 8 + 2 * i + 1].item() == pytest.approx(w.imag, abs=1e-12)


@pytest.mark.parametrize("rope_dim", [0, 8, 24], ids=["rope0", "rope8", "rope=all"])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_returns_new_storage(rope_dim, inverse):
    """Invariant 9.1 (fix #5526): out of place, never a view of the input."""
    x, pos, inv = make_inputs(3, (5, 2, 24), rope_dim, torch.float32)
    before = x.clone()
    y = apply_rope(x, pos, inv, inverse=inverse)
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    y.add_(1.0)
    assert torch.equal(x, before), "writing to the output changed the input"


@pytest.mark.parametrize("dtype", DTYPES)
def test_3d_equals_per_head_2d(dtype):
    x, pos, inv = make_inputs(4, (6, 5, 16), 8, dtype)
    y = apply_rope(x, pos, inv)
    for h in range(x.shape[1]):
        assert torch.equal(y[:, h], apply_rope(x[:, h].contiguous(), pos, inv)), f"head {h}"


def test_position_zero_is_identity():
    x, _, inv = make_inputs(5, (4, 3, 16), 8, torch.float32)
    assert torch.equal(apply_rope(x, torch.zeros(4, dtype=torch.long), inv), x)


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_matches_hugging_face(inverse):
    """HF transformers' DeepSeek-V4 apply_rotary_pos_emb (half-size cos/sin, repeat_interleave, trailing slice).

    HF rotates in ``rope.float()``, so float64 inputs lose precision to float32 there: tolerance 1e-6.
    """
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb
    x, pos, inv = make_inputs(6, (13, 3, 32), 16, torch.float64, max_position=70000)
    angles = pos.to(torch.float64)[:, None] * inv[None, :]
    sign = -1.0 if inverse else 1.0
    cos, sin = angles.cos(), sign * angles.sin()
    # HF layout: x (B, H, S, D), cos/sin (B, S, rope_dim // 2), unsqueeze_dim=1 broadcasts over heads.
    hf = apply_rotary_pos_emb(x.permute(1, 0, 2)[None], cos[None], sin[None], unsqueeze_dim=1)[0].permute(1, 0, 2)
    ours = apply_rope(x, pos, inv, inverse=inverse)
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=1e-6)
    assert torch.equal(ours[..., :16], hf[..., :16])


@pytest.mark.parametrize("inverse", [False, True], ids=["rope", "inverse"])
def test_apply_rope_gradcheck_float64(inverse):
    """float64 gradcheck of the rotation on a small (T, H, D) tensor with ragged in-document positions."""
    torch.manual_seed(5)
    x = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([0, 1, 2, 0, 7])
    inv_freq = rope_frequencies(4, 160000.0, {"type": "yarn", "factor": 16.0,
                                              "original_max_position_embeddings": 65536})
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, positions, inv_freq, inverse=inverse), (x,))

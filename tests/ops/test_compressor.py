"""compress_pool vs a per-document loop oracle (docs/semantics.md, decision 4; docs/packing.md).

Ratio 4 (width 2d, overlapping): entry j pools tokens 4j-4 .. 4j-1 through the first channel half and 4j .. 4j+3
through the second; entry 0 pools only its own group. Ratio 128: entry j pools tokens 128j .. 128j+127. Per channel
softmax over slots of ``gate + position_bias[slot]``; tails shorter than the ratio make no entry.
"""
from __future__ import annotations

import pytest
import torch

from dsv4attn.ops import compress_pool
from tests.packs import RAGGED_R4, RAGGED_R128, build_pack, doc_spans

FP64 = dict(rtol=1e-12, atol=1e-13)


def pool_oracle(kv, gate, bias, lengths, ratio, capacity):
    """Loop over documents and entries, float64, autograd-capable; padding entries 0."""
    width = kv.shape[1]
    d = width // 2 if ratio == 4 else width
    entries = []
    for start, length in doc_spans(lengths):
        for j in range(length // ratio):
            slot_kv, slot_gate = [], []
            if ratio == 4 and j > 0:
                for i in range(ratio):                                  # previous group, first channel half
                    row = start + ratio * (j - 1) + i
                    slot_kv.append(kv[row, :d])
                    slot_gate.append(gate[row, :d] + bias[i, :d])
            for i in range(ratio):                                      # own group, (second) channel half
                row = start + ratio * j + i
                slot_kv.append(kv[row, width - d:])
                slot_gate.append(gate[row, width - d:] + bias[i, width - d:])
            w = torch.softmax(torch.stack(slot_gate).double(), dim=0)  # per channel, over slots
            entries.append((w * torch.stack(slot_kv).double()).sum(0))
    assert len(entries) <= capacity
    pad = [torch.zeros(d, dtype=torch.float64)] * (capacity - len(entries))
    return torch.stack(entries + pad) if entries or pad else torch.zeros(0, d, dtype=torch.float64)


def make_inputs(seed, pack, ratio, d, dtype=torch.float64, gate_scale=2.0):
    torch.manual_seed(seed)
    c = 2 if ratio == 4 else 1
    T = pack.total_rows
    kv = torch.randn(T, c * d, dtype=torch.float64).to(dtype)
    gate = (gate_scale * torch.randn(T, c * d, dtype=torch.float64)).to(dtype)
    bias_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    bias = torch.randn(ratio, c * d, dtype=torch.float64).to(bias_dtype)
    return kv, gate, bias


PACKS = [
    pytest.param(4, RAGGED_R4, 5, 3, id="r4-ragged-pad5"),
    pytest.param(4, RAGGED_R4, 0, 3, id="r4-ragged-no-pad"),
    pytest.param(4, (4,), 3, 2, id="r4-single-group"),
    pytest.param(128, RAGGED_R128, 7, 3, id="r128-ragged-pad7"),
    pytest.param(128, (300,), 0, 2, id="r128-single-300"),
]


@pytest.mark.parametrize("ratio, lengths, padding, d", PACKS)
def test_forward_and_grads_vs_loop_oracle(ratio, lengths, padding, d):
    pack = build_pack(lengths, padding)
    lay = pack.compressed(ratio)
    kv, gate, bias = make_inputs(0, pack, ratio, d)
    leaves = [t.clone().requires_grad_(True) for t in (kv, gate, bias)]
    got = compress_pool(*leaves, lay)
    leaves_ref = [t.clone().requires_grad_(True) for t in (kv, gate, bias)]
    want = pool_oracle(*leaves_ref, lengths, ratio, lay.capacity)
    assert got.shape == (lay.capacity, d) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, **FP64)
    n_real = sum(L // ratio for L in lengths)
    assert torch.equal(got[n_real:], torch.zeros_like(got[n_real:])), "padding entries must be exactly 0"
    if n_real == 0:
        return
    grad = torch.randn(got.shape, dtype=torch.float64)
    (got * grad).sum().backward()
    (want * grad).sum().backward()
    for name, a, b in zip(("dkv", "dgate", "dbias"), leaves, leaves_ref):
        torch.testing.assert_close(a.grad, b.grad, **FP64, msg=lambda m: f"{name}: {m}")
    # Rows no entry pools (tails, capacity padding) get exactly zero gradient.
    pooled = torch.zeros(pack.total_rows, dtype=torch.bool)
    for start, length in doc_spans(lengths):
        pooled[start:start + (length // ratio) * ratio] = True
    assert torch.equal(leaves[0].grad[~pooled], torch.zeros_like(leaves[0].grad[~pooled]))
    assert torch.equal(leaves[1].grad[~pooled], torch.zeros_like(leaves[1].grad[~pooled]))


def test_ratio4_entry0_uses_only_own_group_second_half():
    """Entry 0: the first channel half of its own tokens and everything of other rows is irrelevant."""
    pack = build_pack((8,))
    lay = pack.compressed(4)
    kv, gate, bias = make_inputs(1, pack, 4, 3)
    base = compress_pool(kv, gate, bias, lay)
    kv2, gate2 = kv.clone(), gate.clone()
    kv2[:4, :3] += 100.0          # first half of group 0: only a *previous* group for entry 1
    gate2[:4, :3] -= 7.0
    moved = compress_pool(kv2, gate2, bias, lay)
    torch.testing.assert_close(moved[0], base[0], rtol=0, atol=0)
    assert (moved[1] - base[1]).abs().min() > 1e-3, "entry 1 pools group 0 through the first channel half"
    # Entry 0 with equal gates is the plain mean of its own 4 tokens (second half).
    flat = compress_pool(kv, torch.zeros_like(gate), torch.zeros_like(bias), lay)
    torch.testing.assert_close(flat[0], kv[:4, 3:].mean(0), **FP64)
    torch.testing.assert_close(flat[1], torch.cat([kv[:4, :3], kv[4:8, 3:]]).mean(0), **FP64)


@pytest.mark.parametrize("ratio, lengths", [pytest.param(4, RAGGED_R4, id="r4"),
                                            pytest.param(128, RAGGED_R128, id="r128")])
def test_document_boundary_never_borrowed(ratio, lengths):
    """Perturbing document b-1 (and capacity padding, and doc b's tail) leaves document b's entries unchanged."""
    pack = build_pack(lengths, padding=6)
    lay = pack.compressed(ratio)
    kv, gate, bias = make_inputs(2, pack, ratio, 2)
    base = compress_pool(kv, gate, bias, lay)
    cu_comp = lay.cu_compressed.tolist()
    spans = doc_spans(lengths)
    for b in range(1, len(lengths)):
        if lengths[b] // ratio == 0:
            continue
        prev_start, prev_len = spans[b - 1]
        start, length = spans[b]
        kv2, gate2 = kv.clone(), gate.clone()
        kv2[:start] += 50.0 * torch.randn_like(kv2[:start])                   # every earlier document
        gate2[:start] += 5.0 * torch.randn_like(gate2[:start])
        tail = start + (length // ratio) * ratio
        kv2[tail:start + length] += 50.0                                       # doc b's own tail
        kv2[start + length:] -= 50.0                                           # later docs and padding
        moved = compress_pool(kv2, gate2, bias, lay)
        own = slice(cu_comp[b], cu_comp[b + 1])
        torch.testing.assert_close(moved[own], base[own], rtol=0, atol=0, msg=lambda m: f"doc {b}: {m}")


@pytest.mark.parametrize("ratio, lengths, padding", [pytest.param(4, (3, 8, 0, 5), 2, id="r4-3,8,0,5-pad2"),
                                                     pytest.param(128, (1, 130), 1, id="r128-1,130-pad1")])
def test_gradcheck_float64(ratio, lengths, padding):
    pack = build_pack(lengths, padding)
    lay = pack.compressed(ratio)
    d = 2 if ratio == 4 else 1
    inputs = tuple(t.requires_grad_(True) for t in make_inputs(3, pack, ratio, d))
    assert torch.autograd.gradcheck(lambda a, b, c: compress_pool(a, b, c, lay), inputs, eps=1e-6, atol=1e-8,
                                    rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("ratio, lengths", [pytest.param(4, RAGGED_R4, id="r4"),
                                            pytest.param(128, RAGGED_R128, id="r128")])
def test_low_precision_rounds_once(dtype, ratio, lengths):
    """fp32 softmax (the fp32 bias promotes the gate) and fp32 accumulation, one rounding to ``kv.dtype``: the
    error against float64 on the same rounded inputs is at most the unit roundoff of the output plus fp32 noise."""
    pack = build_pack(lengths, padding=4)
    lay = pack.compressed(ratio)
    kv, gate, bias = make_inputs(4, pack, ratio, 8, dtype=dtype)
    got = compress_pool(kv, gate, bias, lay)
    assert got.dtype == dtype
    want = pool_oracle(kv.double(), gate.double(), bias.double(), lengths, ratio, lay.capacity)
    unit_roundoff = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}[dtype]
    # + 1e-5 absolute: fp32 accumulation over up to 128 slots of O(1) values (cancellation makes |want| small).
    bound = unit_roundoff * want.abs() * 1.01 + 1e-5
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"max error {err.max():.3e}"


def test_deterministic():
    pack = build_pack(RAGGED_R4, padding=3)
    lay = pack.compressed(4)
    kv, gate, bias = make_inputs(5, pack, 4, 4, dtype=torch.float32)
    assert torch.equal(compress_pool(kv, gate, bias, lay), compress_pool(kv, gate, bias, lay))


def test_rejects_bad_shapes():
    pack = build_pack(RAGGED_R4)
    lay = pack.compressed(4)
    kv, gate, bias = make_inputs(6, pack, 4, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="even width"):
        compress_pool(kv[:, :3], gate[:, :3], bias[:, :3], lay)
    with pytest.raises(ValueError, match="position_bias"):
        compress_pool(kv, gate, bias[:3], lay)
    with pytest.raises(ValueError, match="position_bias"):
        compress_pool(kv, gate, bias.bfloat16(), lay)
    with pytest.raises(ValueError, match="layout"):
        compress_pool(kv[:-1], gate[:-1], bias, lay)

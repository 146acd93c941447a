"""Forward parity with Hugging Face transformers' DeepseekV4Attention (the independent oracle,
docs/semantics.md, decision 1).

HF runs one document at a time (batch 1, positions from 0, eager attention with a sliding-window causal mask of the
configured window); dsv4attn runs the whole ragged pack in one call. Both in float64.
Tolerance: HF computes RMSNorm statistics, the compressor gate softmax, the indexer scores and RoPE angles in
fp32 even for float64 inputs, so agreement is at fp32 level: |diff| <= 2e-6 * max|HF output| (measured ~1.5e-7).
Top-k ties: with few indexer heads, scores of exactly 0 (every head's ReLU is 0) tie often, and HF's torch.topk
breaks ties arbitrarily while dsv4attn keeps the lower index (docs/semantics.md, decision 6). The sparse parity runs
therefore use 16 indexer heads, where an exact tie at the top-k cut has probability ~2^-16 per pair; tie order itself is
tested in tests/ops.
"""
from __future__ import annotations

import pytest
import torch

import dsv4attn
from layer_helpers import HF_LAYER_INDEX, doc_slices, hf_config, ragged_pack, randomize_

modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def hf_document_forward(hf_layer, rotary, x_doc: torch.Tensor, window: int) -> torch.Tensor:
    L = x_doc.shape[0]
    x = x_doc[None]
    pos = torch.arange(L)[None]
    emb = {kind: rotary(x, pos, layer_type=kind) for kind in ("main", "compress")}
    t = torch.arange(L)
    allowed = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    mask = torch.zeros(L, L, dtype=x.dtype).masked_fill(~allowed, float("-inf"))[None, None]
    return hf_layer(x, emb, pos, mask)[0][0]


def hf_packed_forward(hf_layer, rotary, x: torch.Tensor, cu: torch.Tensor, window: int) -> torch.Tensor:
    """HF run document by document over a pack; padding rows stay 0."""
    out = torch.zeros_like(x)
    for doc in doc_slices(cu):
        if doc.stop > doc.start:
            out[doc] = hf_document_forward(hf_layer, rotary, x[doc], window)
    return out


@pytest.mark.parametrize("yarn", [True, False], ids=["yarn", "plain-rope"])
@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["window", "csa", "hca"])
def test_packed_forward_matches_hf_per_document(ratio, yarn):
    torch.manual_seed(1)
    config = hf_config(yarn=yarn, index_n_heads=16)
    hf_layer = randomize_(modeling.DeepseekV4Attention(config, HF_LAYER_INDEX[ratio]), seed=ratio).double().eval()
    rotary = modeling.DeepseekV4RotaryEmbedding(config).double()
    cfg = dsv4attn.AttentionConfig.from_hf(config)
    assert (cfg.rope_scaling is not None) == yarn
    layer = dsv4attn.HybridAttention(cfg, ratio).double().eval()
    layer.load_hf_state_dict(hf_layer.state_dict())

    cu, T, max_len = ragged_pack(lengths=(1, 3, 4, 5, 0, 17, 131, 42, 300, 9))
    x = torch.randn(T, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        ours = layer(x, cu_seqlens=cu, max_seqlen=max_len, phase="sparse")
        theirs = hf_packed_forward(hf_layer, rotary, x, cu, cfg.sliding_window)
    scale = theirs.abs().max()
    assert scale > 0.1
    assert (ours[int(cu[-1]):] == 0).all()
    err = (ours - theirs).abs().max()
    assert err <= 2e-6 * scale, f"max |diff| {err:.3e} vs scale {scale:.3e}"


def test_dense_phase_matches_hf_with_every_entry_selected():
    """Dense CSA (every visible entry) equals HF CSA with a top-k wider than any document's entry count."""
    config = hf_config(index_topk=4096)
    hf_layer = randomize_(modeling.DeepseekV4Attention(config, 1), seed=7).double().eval()
    rotary = modeling.DeepseekV4RotaryEmbedding(config).double()
    cfg = dsv4attn.AttentionConfig.from_hf(config, index_topk=8)
    layer = dsv4attn.HybridAttention(cfg, 4).double().eval()
    layer.load_hf_state_dict(hf_layer.state_dict())
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        ours = layer(x, cu_seqlens=cu, max_seqlen=max_len, phase="dense")
        theirs = hf_packed_forward(hf_layer, rotary, x, cu, cfg.sliding_window)
    err = (ours - theirs).abs().max()
    assert err <= 2e-6 * theirs.abs().max(), f"max |diff| {err:.3e}"

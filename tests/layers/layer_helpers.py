"""Shared helpers of the layer tests: ragged packs and HF reference layers."""
from __future__ import annotations

import torch

import dsv4attn

# Lengths every ragged pack of the layer tests contains (STYLE.md): 1, < r, = r, r + 1, not divisible by r,
# an empty document, longer than the window and than 128, plus capacity padding.
RAGGED = (1, 3, 4, 5, 0, 17, 131, 42, 9)


def ragged_pack(lengths=RAGGED, padding: int = 6):
    """(cu_seqlens int32, total rows T, max_seqlen) of documents ``lengths`` followed by ``padding`` rows."""
    cu = torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0).to(torch.int32)
    return cu, int(cu[-1]) + padding, max(lengths)


def spread_parameters_(layer) -> None:
    """Moves sinks, positional biases and norm weights away from their constant init (and redraws the other
    parameters), in place, so that every parameter of ``layer`` matters to a parity test."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "sinks" or name.endswith("position_bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)


def forward_backward(layer, x, g, phase, **kw):
    """(output, input grad, {name: grad}, indexer loss) of ``layer(x, phase=phase, **kw)`` and the backward of
    ``(y * g).sum()`` (a fresh leaf copy of x; the layer's gradients zeroed first)."""
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x, phase=phase, **kw)
    (y * g).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    loss = layer.indexer_loss
    return y.detach(), x.grad.detach(), grads, (None if loss is None else loss.clone())


def doc_slices(cu: torch.Tensor):
    return [slice(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]


def randomize_(module: torch.nn.Module, seed: int = 0, std: float = 0.08) -> torch.nn.Module:
    """Non-trivial random values for every parameter (norm weights around 1, sinks and biases spread)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name in ("sinks",) or name.endswith("position_bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(std * noise)
    return module


def hf_config(yarn: bool = True, **overrides):
    """A transformers DeepseekV4Config with the values of AttentionConfig.tiny(); layer i has type i of
    (sliding, CSA, HCA)."""
    from transformers import DeepseekV4Config

    tiny = dsv4attn.AttentionConfig.tiny()
    rope = ({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
             "beta_fast": 32.0, "beta_slow": 1.0} if yarn else None)
    values = dict(hidden_size=tiny.hidden_size, num_attention_heads=tiny.num_attention_heads, num_key_value_heads=1,
                  head_dim=tiny.head_dim, partial_rotary_factor=tiny.qk_rope_head_dim / tiny.head_dim,
                  q_lora_rank=tiny.q_lora_rank, o_groups=tiny.o_groups, o_lora_rank=tiny.o_lora_rank,
                  sliding_window=tiny.sliding_window, index_n_heads=tiny.index_n_heads,
                  index_head_dim=tiny.index_head_dim, index_topk=tiny.index_topk, rope_theta=10000.0,
                  compress_rope_theta=160000.0, num_hidden_layers=3, vocab_size=64, n_routed_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32,
                  layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                  rope_parameters=rope)
    values.update(overrides)
    config = DeepseekV4Config(**values)
    config._attn_implementation = "eager"
    return config


HF_LAYER_INDEX = {0: 0, 4: 1, 128: 2}

"""Lightning indexer module (ratio-4 layers): queries, its own compressor, head weights."""
from __future__ import annotations

import torch
from torch import nn

from ..ops import rope_rotate
from ..packing import CompressedLayout
from .compressor import Compressor


class Indexer(nn.Module):
    """Produces what the indexer scores are made of; the caller passes *detached* inputs
    (docs/semantics.md, invariant 9.9).

    Returns ``(index_q (T, Hi, Di), index_k (capacity, Di), index_weights (T, Hi))``: queries from the normalised
    low-rank query ``qr`` with RoPE at the row position, keys from its own ratio-4 compressor at ``Di``, weights
    ``weights_proj(x) * Hi**-0.5 * Di**-0.5`` in fp32. The Hadamard rotation of Megatron's indexer is orthonormal
    and leaves every score unchanged, so this bf16/fp32 path omits it (docs/semantics.md, decision 6).
    Parameters: ``q_b_proj``, ``weights_proj``, ``compressor.*``.
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)
        self.compressor = Compressor(hidden_size, head_dim, ratio=4, eps=eps)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, x_keys: torch.Tensor,
                layout: CompressedLayout, inv_freq: torch.Tensor):
        """x, qr: (T, .) query rows at ``positions``; x_keys: the rows ``layout`` (ratio 4) describes -- the same
        rows on one device, with a left halo under context parallelism."""
        T = x.shape[0]
        index_q = rope_rotate(self.q_b_proj(qr).view(T, self.n_heads, self.head_dim), positions, inv_freq)
        index_k = self.compressor(x_keys, layout, inv_freq)
        cd = torch.promote_types(x.dtype, torch.float32)
        index_weights = self.weights_proj(x).to(cd) * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        return index_q, index_k, index_weights

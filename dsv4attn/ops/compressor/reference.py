"""Reference gated pooling of the compressor (docs/semantics.md, decision 4), per document.

Ratio 128 (``kv``/``gate`` of width d): entry j of a document pools its tokens 128j .. 128j+127.
Ratio 4 (width 2d, overlapping): entry j pools 8 slots, tokens 4j-4 .. 4j-1 through the *first* channel half
(the previous group) and 4j .. 4j+3 through the *second* half (its own group); for j = 0 the previous-group
slots have weight exactly 0 (gate -inf, kv 0) -- never borrowed from the previous document.

Per channel: ``w = softmax_over_slots(gate + position_bias[slot])`` in fp32 (the fp32 bias promotes the sum),
``pooled = sum_slots w * kv`` accumulated in fp32 (fp64 for fp64 inputs) and rounded once to ``kv.dtype``.
Padding entries (past the last real one) are 0. RMSNorm and RoPE are applied by the layer afterwards.
"""
from __future__ import annotations

import torch

from ...packing import CompressedLayout


def compress_pool_reference(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor,
                            layout: CompressedLayout) -> torch.Tensor:
    r = layout.ratio
    overlap = r == 4
    d = kv.shape[1] // 2 if overlap else kv.shape[1]
    cd = torch.promote_types(torch.promote_types(kv.dtype, torch.float32), position_bias.dtype)
    slot = torch.arange(r, device=kv.device)
    real = layout.entry_is_real[:, None]
    own_rows = torch.where(real, layout.entry_first_row[:, None] + slot, torch.zeros_like(slot))  # (Nc, r)
    own_kv = kv[own_rows, -d:].to(cd)
    own_gate = gate[own_rows, -d:].to(cd) + position_bias[:, -d:].to(cd)
    if overlap:
        has_prev = real & (layout.entry_index[:, None] > 0)
        prev_rows = torch.where(has_prev, own_rows - r, torch.zeros_like(own_rows))
        prev_kv = kv[prev_rows, :d].to(cd).masked_fill(~has_prev[..., None], 0.0)
        prev_gate = (gate[prev_rows, :d].to(cd) + position_bias[:, :d].to(cd)).masked_fill(
            ~has_prev[..., None], float("-inf"))
        slots_kv = torch.cat([prev_kv, own_kv], dim=1)          # (Nc, 2r, d)
        slots_gate = torch.cat([prev_gate, own_gate], dim=1)
    else:
        slots_kv, slots_gate = own_kv, own_gate
    weights = torch.softmax(slots_gate, dim=1)                  # per channel, over slots
    pooled = (weights * slots_kv).sum(dim=1)
    return pooled.masked_fill(~layout.entry_is_real[:, None], 0.0).to(kv.dtype)

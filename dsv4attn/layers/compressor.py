"""Compressor module: projections, gated pooling, RMSNorm and RoPE of compressed KV entries."""
from __future__ import annotations

import torch
from torch import nn

from ..ops import compress_pool
from ..packing import CompressedLayout, PackedBatch
from .common import KeepFp32Params, RMSNorm, rope_rows


class Compressor(KeepFp32Params):
    """Turns the packed rows ``x`` (T, hidden) into compressed entries (capacity, head_dim).

    Ratio 4 overlaps (projections of width 2 * head_dim, previous group through the first half); ratio 128 does
    not. Entry j of a document is RMS-normalised and RoPE'd at position ``j * ratio`` with the layer's table.
    Groups never cross a document boundary and tails shorter than the ratio make no entry. Padding entries are 0.
    Parameters (HF names): ``kv_proj``, ``gate_proj``, ``position_bias`` (fp32), ``kv_norm``.
    """

    _fp32_params = ("position_bias",)

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, eps: float = 1e-6):
        super().__init__()
        if ratio not in (4, 128):
            raise ValueError(f"ratio must be 4 or 128 for a Compressor, got {ratio!r}")
        width = (2 if ratio == 4 else 1) * head_dim
        self.ratio, self.head_dim = ratio, head_dim
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, layout: PackedBatch | CompressedLayout, inv_freq: torch.Tensor
                ) -> torch.Tensor:
        """x (T, hidden) -> (layout.capacity, head_dim); ``layout`` is the ratio's CompressedLayout of x's rows
        (or the PackedBatch to take it from)."""
        return self.from_projections(self.kv_proj(x), self.gate_proj(x), layout, inv_freq)

    def from_projections(self, kv: torch.Tensor, gate: torch.Tensor, layout: PackedBatch | CompressedLayout,
                         inv_freq: torch.Tensor) -> torch.Tensor:
        """The rest of :meth:`forward` given ``kv_proj(x)`` and ``gate_proj(x)`` (T, width): for a caller that
        forms them together with other projections of the same rows (``layers.common.project_together``)."""
        if isinstance(layout, PackedBatch):
            layout = layout.compressed(self.ratio)
        pooled = compress_pool(kv, gate, self.position_bias, layout)
        return rope_rows(self.kv_norm(pooled), layout.entry_position, inv_freq)

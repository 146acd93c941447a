"""A small decoder LM built from dsv4attn layers (the model of the training job).

token embedding -> n x [RMSNorm -> HybridAttention -> residual, RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> head

The per-layer compress ratio comes from ``AttentionConfig.compress_ratios`` (one layer per entry). MoE, hash
routing, multi-token prediction and mHC (the V4 residual hyper-connections) are out of scope: plain residuals and
one dense MLP per block.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..config import AttentionConfig
from ..layers import HybridAttention
from ..layers.common import RMSNorm
from ..packing import PackedBatch, pack_batch
from ..parallel import halo_rows
from .distributed import local_rows

DEFAULT_RATIOS = (0, 4, 128, 4)


@dataclass
class ModelConfig:
    """Shape of the LM; the attention hyper-parameters (and the layer count) live in ``attention``."""

    attention: AttentionConfig          # one layer per entry of attention.compress_ratios
    vocab_size: int = 256               # byte-level
    mlp_hidden: int = 384               # SwiGLU inner width

    def __post_init__(self) -> None:
        if isinstance(self.attention, dict):
            self.attention = AttentionConfig(**self.attention)
        for name in ("vocab_size", "mlp_hidden"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not self.attention.compress_ratios:
            raise ValueError("attention.compress_ratios must name at least one layer, got ()")

    @property
    def num_layers(self) -> int:
        return len(self.attention.compress_ratios)

    def to_dict(self) -> dict:
        return {"attention": self.attention.to_dict(), "vocab_size": self.vocab_size,
                "mlp_hidden": self.mlp_hidden}


# Model presets: "tiny" runs on a laptop CPU in minutes; "small" is the GPU throughput preset. The tiny model
# differs from AttentionConfig.tiny() in two places, both for a CPU-minutes budget: a window of 8 (the retrieval
# filler must outrun layers x (window - 1) rows, so a short window keeps documents short and answers dense), and a
# wide init (0.2 instead of Megatron's 0.02: at width 128 the small init leaves the attention to compressed
# entries nearly uniform for thousands of steps; measured, not derived).
PRESETS = {
    "tiny": lambda: dict(attention=AttentionConfig.tiny(sliding_window=8, initializer_range=0.2), mlp_hidden=384),
    "small": lambda: dict(attention=AttentionConfig.tiny(
        hidden_size=512, num_attention_heads=8, head_dim=128, qk_rope_head_dim=32, q_lora_rank=256, o_groups=4,
        o_lora_rank=128, sliding_window=128, index_n_heads=8, index_head_dim=64, index_topk=64), mlp_hidden=1536),
}


def model_config(preset: str, ratios=DEFAULT_RATIOS, indexer_loss_coeff: float = 0.01) -> ModelConfig:
    """The ``preset`` model with the per-layer ``ratios`` and the indexer-loss coefficient."""
    if preset not in PRESETS:
        raise ValueError(f"model preset must be one of {sorted(PRESETS)}, got {preset!r}")
    values = PRESETS[preset]()
    values["attention"] = dataclasses.replace(values["attention"], compress_ratios=tuple(ratios),
                                              indexer_loss_coeff=indexer_loss_coeff)
    return ModelConfig(**values)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, compress_ratio: int, tp_group=None):
        super().__init__()
        a = config.attention
        self.attn_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.attn = HybridAttention(a, compress_ratio, tp_group=tp_group)
        self.mlp_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = SwiGLU(a.hidden_size, config.mlp_hidden)

    def forward(self, x, pack, phase: str, captured: list | None = None) -> torch.Tensor:
        h = self.attn_norm(x)
        if captured is not None:
            captured.append((self.attn, h))
        x = x + self.attn(h, pack=pack, phase=phase)          # a CP pack carries its group and partition
        return x + self.mlp(self.mlp_norm(x))


class DecoderLM(nn.Module):
    """``model(tokens (T,), cu_seqlens (N+1,) int32, max_seqlen, phase) -> logits (T, vocab)``.

    The packed metadata (under CP with the group's agreement and frames) is built once per forward and shared
    by every layer. With ``captured`` (a list), each
    block appends ``(attention_layer, attention_input)`` for evaluation probes.

    Context parallelism (``cp_group``, ``cp_partition``; docs/semantics.md, decision 10): every rank of the group passes
    the same *global* batch (``tokens`` of all T rows, global ``cu_seqlens``) and gets the logits of its own rows (T /
    cp of them, in the order of :func:`dsv4attn.train.distributed.local_rows`). Embedding, norms, MLP and head are
    per row; the attention layers exchange what they need. ``captured`` then holds this rank's attention inputs.
    ``cp_compressed`` is :func:`dsv4attn.pack_batch`'s (how CSA layers reach other ranks' compressed KV).

    Tensor parallelism (``tp_group``, docs/tensor_parallel.md): the attention layers hold their rank's heads; every
    rank of the group passes the same batch and gets the same, full logits. Built after the same
    ``torch.manual_seed`` as a one-process model, the layers hold exactly its slices (the random draws are those of
    the full tensors).
    """

    def __init__(self, config: ModelConfig, tp_group=None):
        super().__init__()
        self.config = config
        a = config.attention
        self.embed = nn.Embedding(config.vocab_size, a.hidden_size)
        self.blocks = nn.ModuleList(Block(config, r, tp_group) for r in a.compress_ratios)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.head = nn.Linear(a.hidden_size, config.vocab_size, bias=False)
        std = a.initializer_range
        # Unit-scale embeddings keep each row's own token identity strong in the residual stream; with small ones
        # the first attention outputs swamp it and the compressed entries pool mixtures too blurred to retrieve
        # from (the tiny model then needs several times more steps to find the retrieval task).
        nn.init.normal_(self.embed.weight, std=1.0)
        nn.init.normal_(self.head.weight, std=std)
        residual_std = std / (2 * config.num_layers) ** 0.5
        for block in self.blocks:
            nn.init.normal_(block.mlp.gate_up.weight, std=std)
            # Residual-branch outputs start small (GPT-2 style) so the stack begins near the identity.
            nn.init.normal_(block.mlp.down.weight, std=residual_std)
            _normal_full(block.attn, "o_b_proj.weight", residual_std)

    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int | None, phase: str,
                captured: list | None = None, cp_group=None, cp_partition: str = "contiguous",
                cp_compressed: str = "gather", pack: PackedBatch | None = None) -> torch.Tensor:
        # Of the global batch, also under CP: built once per batch, so the ranks' agreement on it runs once, not
        # once per layer (with NCCL each agreement is a device->host sync). A prebuilt single-device ``pack``
        # (--cuda-graphs: refilled in place per batch) stands for cu_seqlens and max_seqlen.
        if pack is None:
            pack = pack_batch(cu_seqlens, tokens.shape[0], max_seqlen, cp_group=cp_group,
                              cp_partition=None if cp_group is None else cp_partition, cp_compressed=cp_compressed)
        elif cp_group is not None or pack.cp_group is not None or pack.total_rows != tokens.shape[0]:
            raise ValueError(f"pack= takes a single-device pack of the batch's {tokens.shape[0]} rows and no "
                             f"cp_group (got a pack of {pack.total_rows} rows"
                             f"{', built with a cp_group' if pack.cp_group is not None else ''}"
                             f"{', and cp_group' if cp_group is not None else ''})")
        x = self.embed(local_rows(tokens, cp_group, cp_partition))
        for block in self.blocks:
            x = block(x, pack, phase, captured)
        return self.head(self.norm(x))

    def attention_layers(self) -> list[HybridAttention]:
        return [b.attn for b in self.blocks]

    def indexer_loss(self) -> torch.Tensor | None:
        """Sum of the layers' detached indexer losses of the last training forward (None when no layer has one)."""
        losses = [l.indexer_loss for l in self.attention_layers() if l.indexer_loss is not None]
        return torch.stack(losses).sum() if losses else None


def _normal_full(layer: HybridAttention, name: str, std: float) -> None:
    """``nn.init.normal_`` of a layer parameter as if it were whole: under tensor parallelism the full tensor is
    drawn (the RNG advances as on one process) and this rank keeps its slice."""
    p = layer.get_parameter(name)
    dim = layer.tp_sharded.get(name) if layer.tp.world > 1 else None
    if dim is None:
        nn.init.normal_(p, std=std)
        return
    full = nn.init.normal_(p.new_empty(layer.tp.full_shape(p.shape, dim)), std=std)
    with torch.no_grad():
        p.copy_(layer.tp.shard(full, dim))


def largest_halo(config: ModelConfig) -> int:
    """Rows a context-parallel chunk needs from the chunk left of it for the model's widest layer."""
    return max(halo_rows(config.attention, r) for r in config.attention.compress_ratios)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, num_targets: int | torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy summed over rows with a target, divided by ``num_targets`` (a host int, or a 0-d
    integer tensor where it must stay on the device, as in a CUDA graph; 0 gives a zero loss). With ``num_targets``
    the count of the whole batch, a context-parallel rank's ``logits`` and ``targets`` (its rows) give its share:
    the shares of a CP group add up to the single-device mean."""
    total = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets,
                            ignore_index=-100, reduction="sum")           # fp32 (fp64 in float64 checks)
    if isinstance(num_targets, torch.Tensor):
        return total / num_targets.clamp(min=1).to(total.dtype)
    return total / max(num_targets, 1)

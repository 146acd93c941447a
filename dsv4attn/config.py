"""AttentionConfig: the hyper-parameters of one DeepSeek-V4 hybrid attention stack.

Field names follow Hugging Face ``transformers.DeepseekV4Config`` so that a config can be read from a released
``config.json`` (see :meth:`AttentionConfig.from_hf`). Presets mirror the released models
(docs/semantics.md, decision 2): ``flash()`` (V4-Flash), ``pro()`` (V4-Pro) and ``tiny()`` (CPU tests and the small
training job).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

COMPRESS_RATIOS = (0, 4, 128)
PHASES = ("dense", "warmup", "sparse")
Phase = Literal["dense", "warmup", "sparse"]

# HF layer-type names <-> compress ratios (configuration_deepseek_v4.py).
LAYER_TYPE_TO_RATIO = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}
RATIO_TO_LAYER_TYPE = {r: t for t, r in LAYER_TYPE_TO_RATIO.items()}


def _yarn(factor: float = 16.0, original: int = 65536) -> dict:
    return {"type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": 32.0, "beta_slow": 1.0}


def _flash_schedule() -> tuple[int, ...]:
    # Megatron's Flash recipe: W, W, C, then (H, C) x 20 -> 43 layers.
    return (0, 0, 4) + (128, 4) * 20


def _pro_schedule(n_layers: int = 61) -> tuple[int, ...]:
    # HF DeepseekV4Config default for a config without layer_types: 2 HCA, then HCA/CSA interleaved.
    return (128,) * 2 + tuple(4 if i % 2 else 128 for i in range(n_layers - 2))


def check_phase(phase: str) -> Phase:
    """Return ``phase`` if it is one of ``dense``/``warmup``/``sparse``, else raise a ValueError naming it."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    return phase  # type: ignore[return-value]


def check_ratio(compress_ratio: int) -> int:
    if isinstance(compress_ratio, bool) or not isinstance(compress_ratio, int) or compress_ratio not in COMPRESS_RATIOS:
        raise ValueError(f"compress_ratio must be one of {COMPRESS_RATIOS}, got {compress_ratio!r}")
    return compress_ratio


@dataclass
class AttentionConfig:
    """Hyper-parameters shared by every hybrid attention layer of a model (HF ``DeepseekV4Config`` names)."""

    hidden_size: int = 4096            # model width D
    num_attention_heads: int = 64      # query heads H (one shared KV head: MQA)
    head_dim: int = 512                # q / k / v / output head dim (K == V)
    qk_rope_head_dim: int = 64         # RoPE'd channels at the *end* of each head (and of each indexer head)
    q_lora_rank: int = 1024            # low-rank query width (also the indexer's query input)
    o_groups: int = 8                  # head groups of the grouped output projection
    o_lora_rank: int = 1024            # per-group width of the grouped output projection
    sliding_window: int = 128          # query t sees raw keys t-window+1 .. t of its own document
    index_n_heads: int = 64            # lightning-indexer heads
    index_head_dim: int = 128          # lightning-indexer head dim
    index_topk: int = 512              # compressed entries each query attends to in sparse phases
    rope_theta: float = 10000.0        # RoPE base of window-only (ratio 0) layers, always plain RoPE
    compress_rope_theta: float = 160000.0  # RoPE base of ratio 4 / 128 layers (with rope_scaling if set)
    rope_scaling: dict | None = field(default_factory=_yarn)  # YaRN for ratio 4/128 layers; None = plain RoPE
    rms_norm_eps: float = 1e-6
    compress_ratios: tuple[int, ...] = field(default_factory=_flash_schedule)  # per-layer ratio in {0, 4, 128}
    initializer_range: float = 0.02    # std of the normal init of every projection and positional bias
    indexer_loss_coeff: float = 0.01   # lambda of the indexer KL loss (training only; not an HF field)

    def __post_init__(self) -> None:
        ratios = self.compress_ratios
        if isinstance(ratios, (str, bytes)) or not hasattr(ratios, "__iter__"):
            raise ValueError(f"compress_ratios must be a sequence of ints in {COMPRESS_RATIOS}, got {ratios!r}")
        self.compress_ratios = tuple(ratios)
        self.validate()

    # ------------------------------------------------------------------ presets
    @classmethod
    def flash(cls, **overrides: Any) -> "AttentionConfig":
        """DeepSeek-V4-Flash (HF defaults and the released config.json)."""
        return cls(**overrides)

    @classmethod
    def pro(cls, **overrides: Any) -> "AttentionConfig":
        """DeepSeek-V4-Pro: hidden 7168, 128 heads, q_lora 1536, 16 output groups, top-k 1024."""
        values = dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
                      index_topk=1024, compress_ratios=_pro_schedule())
        values.update(overrides)
        return cls(**values)

    @classmethod
    def tiny(cls, **overrides: Any) -> "AttentionConfig":
        """Small enough for CPU tests: hidden 128, 4 heads x 64 (16 RoPE dims), window 16, indexer 4x32, top-k 8."""
        values = dict(hidden_size=128, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64,
                      o_groups=2, o_lora_rank=32, sliding_window=16, index_n_heads=4, index_head_dim=32,
                      index_topk=8, compress_ratios=(0, 4, 128, 4))
        values.update(overrides)
        return cls(**values)

    # --------------------------------------------------------------- from HF
    @classmethod
    def from_hf(cls, hf_config: Any, **overrides: Any) -> "AttentionConfig":
        """Build from a ``transformers.DeepseekV4Config`` or a config.json dict (modern or legacy field names).

        Modern: ``layer_types`` + ``compress_rates``, ``partial_rotary_factor``, ``rope_parameters`` with
        ``main``/``compress`` sub-dicts. Legacy: ``compress_ratios``, ``qk_rope_head_dim``, ``rope_scaling``,
        ``compress_rate_csa``/``compress_rate_hca``.
        """
        get = _getter(hf_config)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in ("qk_rope_head_dim", "rope_scaling", "compress_ratios", "compress_rope_theta"):
                continue
            v = get(f.name)
            if v is not None:
                values[f.name] = v
        head_dim = values.get("head_dim", cls.head_dim)

        rope_dim = get("qk_rope_head_dim")
        if rope_dim is None and get("partial_rotary_factor") is not None:
            rope_dim = int(round(head_dim * float(get("partial_rotary_factor"))))
        if rope_dim is not None:
            values["qk_rope_head_dim"] = int(rope_dim)

        values["compress_ratios"] = _ratios_from_hf(get)
        theta, scaling = _compress_rope_from_hf(get)
        if theta is not None:
            values["compress_rope_theta"] = theta
        values["rope_scaling"] = scaling
        main = (get("rope_parameters") or {}).get("main") if isinstance(get("rope_parameters"), Mapping) else None
        if isinstance(main, Mapping) and main.get("rope_theta") is not None:
            values["rope_theta"] = main["rope_theta"]
        values.update(overrides)
        return cls(**values)

    # -------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range or inconsistent."""
        positive = ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                    "sliding_window", "index_n_heads", "index_head_dim", "index_topk")
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        r = self.qk_rope_head_dim
        if isinstance(r, bool) or not isinstance(r, int) or r < 0 or r % 2:
            raise ValueError(f"qk_rope_head_dim must be an even int >= 0, got {r!r}")
        if r > self.head_dim or r > self.index_head_dim:
            raise ValueError(f"qk_rope_head_dim ({r}) must not exceed head_dim ({self.head_dim}) "
                             f"or index_head_dim ({self.index_head_dim})")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"o_groups ({self.o_groups}) must divide num_attention_heads "
                             f"({self.num_attention_heads})")
        for name in ("rope_theta", "compress_rope_theta", "rms_norm_eps"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive finite number, got {v!r}")
        if not isinstance(self.initializer_range, (int, float)) or self.initializer_range < 0:
            raise ValueError(f"initializer_range must be >= 0, got {self.initializer_range!r}")
        c = self.indexer_loss_coeff
        if not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"indexer_loss_coeff must be a finite number >= 0, got {c!r}")
        for i, ratio in enumerate(self.compress_ratios):
            if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio not in COMPRESS_RATIOS:
                raise ValueError(f"compress_ratios[{i}] must be one of {COMPRESS_RATIOS}, got {ratio!r}")
        _check_rope_scaling(self.rope_scaling)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        return d

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5


def _check_rope_scaling(s: dict | None) -> None:
    if s is None:
        return
    if not isinstance(s, Mapping):
        raise ValueError(f"rope_scaling must be a dict or None, got {type(s).__name__}")
    kind = s.get("type", s.get("rope_type", "yarn"))
    if kind == "default":
        return
    if kind != "yarn":
        raise ValueError(f"rope_scaling['type'] must be 'yarn' (or absent), got {kind!r}")
    for key in ("factor", "original_max_position_embeddings"):
        v = s.get(key)
        if not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"rope_scaling['{key}'] must be a positive number, got {v!r}")


def _getter(obj: Any):
    if isinstance(obj, Mapping):
        return lambda name: obj.get(name)
    return lambda name: getattr(obj, name, None)


def _ratios_from_hf(get) -> tuple[int, ...]:
    layer_types = get("layer_types")
    if layer_types is not None:
        rates = dict(LAYER_TYPE_TO_RATIO)
        hf_rates = get("compress_rates") or {}
        rates.update({k: v for k, v in hf_rates.items() if k in rates})
        for legacy, key in (("compress_rate_csa", "compressed_sparse_attention"),
                            ("compress_rate_hca", "heavily_compressed_attention")):
            if get(legacy) is not None:
                rates[key] = get(legacy)
        bad = [t for t in layer_types if t not in rates]
        if bad:
            raise ValueError(f"layer_types entries must be one of {tuple(rates)}, got {bad}")
        return tuple(int(rates[t]) for t in layer_types)
    if get("compress_ratios") is not None:
        return tuple(int(r) for r in get("compress_ratios"))
    return _flash_schedule()


def _compress_rope_from_hf(get) -> tuple[float | None, dict | None]:
    """(compress_rope_theta, rope_scaling) from either rope_parameters['compress'] or rope_scaling."""
    params = get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get("compress"), Mapping):
        comp = dict(params["compress"])
        theta = comp.get("rope_theta", get("compress_rope_theta"))
    else:
        comp = dict(get("rope_scaling") or {})
        if isinstance(params, Mapping):
            comp.update({k: v for k, v in params.items() if k not in ("main", "compress")})
        theta = get("compress_rope_theta")
    kind = comp.get("rope_type", comp.get("type", "default"))
    if kind != "yarn":
        return theta, None
    scaling = {"type": "yarn", "factor": float(comp["factor"]),
               "original_max_position_embeddings": int(comp["original_max_position_embeddings"]),
               "beta_fast": float(comp.get("beta_fast") or 32.0), "beta_slow": float(comp.get("beta_slow") or 1.0)}
    return theta, scaling

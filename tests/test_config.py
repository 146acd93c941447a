"""AttentionConfig: presets, overrides, from_hf (transformers.DeepseekV4Config and config.json dicts),
validation messages and the to_dict round trip (docs/semantics.md, decision 2; the API in README.md "Use a layer")."""
from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

import dsv4attn
from dsv4attn import AttentionConfig

from transformers import DeepseekV4Config

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
YARN_16 = {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32.0,
           "beta_slow": 1.0}


# ------------------------------------------------------------------------------------------------------ presets
def test_flash_preset_values():
    cfg = AttentionConfig.flash()
    assert cfg.hidden_size == 4096
    assert cfg.num_attention_heads == 64
    assert cfg.head_dim == 512
    assert cfg.qk_rope_head_dim == 64
    assert cfg.q_lora_rank == 1024
    assert cfg.o_groups == 8
    assert cfg.o_lora_rank == 1024
    assert cfg.sliding_window == 128
    assert (cfg.index_n_heads, cfg.index_head_dim) == (64, 128)
    assert cfg.index_topk == 512
    assert cfg.rope_theta == 10000.0
    assert cfg.compress_rope_theta == 160000.0
    assert cfg.rope_scaling["type"] == "yarn"
    assert cfg.rope_scaling["factor"] == 16
    assert cfg.rope_scaling["original_max_position_embeddings"] == 65536
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.indexer_loss_coeff == 0.01
    assert cfg.softmax_scale == pytest.approx(512 ** -0.5)


def test_flash_schedule():
    ratios = AttentionConfig.flash().compress_ratios
    assert isinstance(ratios, tuple)
    assert len(ratios) == 43
    assert ratios[:3] == (0, 0, 4)
    assert ratios[3:] == (128, 4) * 20
    assert set(ratios) <= {0, 4, 128}


def test_flash_is_the_default_constructor():
    assert AttentionConfig.flash() == AttentionConfig()


def test_pro_preset_values():
    cfg = AttentionConfig.pro()
    assert cfg.hidden_size == 7168
    assert cfg.num_attention_heads == 128
    assert cfg.q_lora_rank == 1536
    assert cfg.o_groups == 16
    assert cfg.index_topk == 1024
    # shared with Flash
    assert cfg.head_dim == 512
    assert cfg.qk_rope_head_dim == 64
    assert cfg.o_lora_rank == 1024
    assert cfg.sliding_window == 128
    assert cfg.compress_rope_theta == 160000.0
    assert cfg.rope_scaling["type"] == "yarn"
    # HF's default schedule: 2 HCA, then HCA/CSA interleaved, 61 layers
    assert len(cfg.compress_ratios) == 61
    assert cfg.compress_ratios[:2] == (128, 128)
    assert cfg.compress_ratios[2:6] == (128, 4, 128, 4)
    assert set(cfg.compress_ratios) == {4, 128}


def test_tiny_preset_values():
    cfg = AttentionConfig.tiny()
    assert cfg.hidden_size == 128
    assert cfg.num_attention_heads == 4
    assert cfg.head_dim == 64
    assert cfg.qk_rope_head_dim == 16
    assert cfg.sliding_window == 16
    assert (cfg.index_n_heads, cfg.index_head_dim) == (4, 32)
    assert cfg.index_topk == 8
    assert cfg.q_lora_rank == 64
    assert cfg.o_groups == 2
    assert cfg.o_lora_rank == 32
    assert set(cfg.compress_ratios) == {0, 4, 128}
    assert cfg.num_attention_heads % cfg.o_groups == 0


def test_presets_do_not_share_mutable_state():
    a, b = AttentionConfig.flash(), AttentionConfig.flash()
    assert a.rope_scaling is not b.rope_scaling
    a.rope_scaling["factor"] = 2.0
    assert AttentionConfig.flash().rope_scaling["factor"] == 16


# ---------------------------------------------------------------------------------------------------- overrides
@pytest.mark.parametrize("preset", ["flash", "pro", "tiny"])
@pytest.mark.parametrize("field,value", [
    ("index_topk", 4),
    ("sliding_window", 8),
    ("rope_scaling", None),
    ("compress_ratios", (4, 4)),
    ("indexer_loss_coeff", 0.0),
    ("compress_rope_theta", 40000.0),
], ids=["index_topk", "sliding_window", "no_rope_scaling", "compress_ratios", "zero_loss_coeff",
        "compress_rope_theta"])
def test_override_changes_only_that_field(preset, field, value):
    base = getattr(AttentionConfig, preset)()
    cfg = getattr(AttentionConfig, preset)(**{field: value})
    assert getattr(cfg, field) == value
    for name, v in base.to_dict().items():
        if name != field:
            assert cfg.to_dict()[name] == v, name


def test_override_list_of_ratios_becomes_tuple():
    cfg = AttentionConfig.tiny(compress_ratios=[0, 128])
    assert cfg.compress_ratios == (0, 128)


def test_override_is_validated():
    with pytest.raises(ValueError, match="o_groups"):
        AttentionConfig.tiny(o_groups=3)


def test_unknown_override_is_rejected():
    with pytest.raises(TypeError, match="no_such_field"):
        AttentionConfig.tiny(no_such_field=1)


# ------------------------------------------------------------------------------------------------------ from_hf
def _small_hf(**kw) -> DeepseekV4Config:
    """A small, cheap DeepseekV4Config (only attention fields matter here)."""
    values = dict(num_hidden_layers=3, layer_types=list(LAYER_TYPES), hidden_size=256, num_attention_heads=8,
                  head_dim=64, partial_rotary_factor=0.25, q_lora_rank=96, o_groups=4, o_lora_rank=48,
                  sliding_window=32, index_n_heads=6, index_head_dim=48, index_topk=16, rope_theta=5000.0,
                  compress_rope_theta=40000.0, rms_norm_eps=1e-5, initializer_range=0.01, vocab_size=64,
                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    values.update(kw)
    return DeepseekV4Config(**values)


def _assert_small_fields(cfg: AttentionConfig):
    assert cfg.hidden_size == 256
    assert cfg.num_attention_heads == 8
    assert cfg.head_dim == 64
    assert cfg.qk_rope_head_dim == 16          # 64 * 0.25
    assert cfg.q_lora_rank == 96
    assert cfg.o_groups == 4
    assert cfg.o_lora_rank == 48
    assert cfg.sliding_window == 32
    assert cfg.index_n_heads == 6
    assert cfg.index_head_dim == 48
    assert cfg.index_topk == 16
    assert cfg.rope_theta == 5000.0
    assert cfg.compress_rope_theta == 40000.0
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.initializer_range == 0.01
    assert cfg.compress_ratios == (0, 4, 128)
    assert cfg.indexer_loss_coeff == 0.01      # not an HF field: our default


def test_from_hf_modern_fields_without_yarn():
    cfg = AttentionConfig.from_hf(_small_hf())
    _assert_small_fields(cfg)
    assert cfg.rope_scaling is None            # HF: no rope scaling -> plain RoPE at compress_rope_theta


def test_from_hf_modern_yarn_in_rope_parameters():
    hf = _small_hf(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                    "beta_fast": 16.0, "beta_slow": 2.0})
    assert hf.rope_parameters["compress"]["rope_type"] == "yarn"   # what HF made of it
    cfg = AttentionConfig.from_hf(hf)
    _assert_small_fields(cfg)
    assert cfg.rope_scaling == {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                "beta_fast": 16.0, "beta_slow": 2.0}


def test_from_hf_yarn_defaults_for_missing_betas():
    hf = _small_hf(rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536})
    cfg = AttentionConfig.from_hf(hf)
    assert cfg.rope_scaling == YARN_16


def test_from_hf_legacy_rope_scaling_kwarg():
    hf = _small_hf(rope_scaling=dict(YARN_16))
    cfg = AttentionConfig.from_hf(hf)
    _assert_small_fields(cfg)
    assert cfg.rope_scaling == YARN_16


def test_from_hf_nested_rope_parameters_take_precedence():
    """rope_parameters with main/compress sub-dicts: the thetas come from the sub-dicts (what HF's rotary uses)."""
    hf = _small_hf(rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 7000.0, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "yarn", "rope_theta": 90000.0, "factor": 8.0,
                     "original_max_position_embeddings": 8192, "partial_rotary_factor": 0.25}})
    cfg = AttentionConfig.from_hf(hf)
    assert cfg.rope_theta == 7000.0
    assert cfg.compress_rope_theta == 90000.0
    assert cfg.rope_scaling["type"] == "yarn"
    assert cfg.rope_scaling["factor"] == 8.0
    assert cfg.rope_scaling["original_max_position_embeddings"] == 8192


@pytest.mark.parametrize("layer_types,ratios", [
    (["sliding_attention"] * 3, (0, 0, 0)),
    (["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"], (128, 4, 0)),
    (["compressed_sparse_attention"] * 3, (4, 4, 4)),
], ids=["all_window", "hca_csa_window", "all_csa"])
def test_from_hf_layer_types_map_to_ratios(layer_types, ratios):
    assert AttentionConfig.from_hf(_small_hf(layer_types=layer_types)).compress_ratios == ratios


def test_from_hf_legacy_names_passed_to_hf_config():
    """compress_ratios / qk_rope_head_dim / compress_rate_csa are legacy kwargs HF folds into its modern fields."""
    hf = _small_hf(layer_types=None, partial_rotary_factor=None, compress_ratios=[0, 4, 128], qk_rope_head_dim=16,
                   compress_rate_csa=4, compress_rate_hca=128)
    assert hf.layer_types == LAYER_TYPES
    assert hf.partial_rotary_factor == 0.25
    cfg = AttentionConfig.from_hf(hf)
    _assert_small_fields(cfg)
    assert cfg.rope_scaling is None


def test_from_hf_legacy_rope_dim_other_value():
    hf = _small_hf(partial_rotary_factor=None, qk_rope_head_dim=32)
    assert AttentionConfig.from_hf(hf).qk_rope_head_dim == 32


def test_from_hf_partial_rotary_factor_in_a_dict():
    cfg = AttentionConfig.from_hf({"head_dim": 64, "partial_rotary_factor": 0.5, "index_head_dim": 64,
                                   "compress_ratios": [0]})
    assert cfg.qk_rope_head_dim == 32


def test_from_hf_round_trips_through_hf_to_dict():
    hf = _small_hf(rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536})
    assert AttentionConfig.from_hf(hf.to_dict()) == AttentionConfig.from_hf(hf)


def _released_flash_config_json() -> dict:
    """A dict shaped like DeepSeek-V4-Flash's released config.json (legacy names)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
        "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
        "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
        "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "compress_ratios": [0, 0, 4] + [128, 4] * 20, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "rms_norm_eps": 1e-6, "initializer_range": 0.02, "torch_dtype": "bfloat16",
    }


def test_from_hf_released_config_json_dict_equals_flash():
    cfg = AttentionConfig.from_hf(_released_flash_config_json())
    assert cfg == AttentionConfig.flash()
    assert isinstance(cfg.rope_scaling["original_max_position_embeddings"], int)


def test_from_hf_released_config_json_survives_json():
    text = json.dumps(_released_flash_config_json())
    assert AttentionConfig.from_hf(json.loads(text)) == AttentionConfig.flash()


def test_from_hf_released_config_json_through_hf_config():
    """The same dict, given to DeepseekV4Config (legacy kwargs), maps to the same AttentionConfig."""
    d = _released_flash_config_json()
    for k in ("architectures", "model_type", "torch_dtype"):
        d.pop(k)
    hf = DeepseekV4Config(**d)
    assert AttentionConfig.from_hf(hf) == AttentionConfig.flash()


def test_from_hf_dict_without_rope_scaling_is_plain_rope():
    d = _released_flash_config_json()
    del d["rope_scaling"]
    assert AttentionConfig.from_hf(d).rope_scaling is None


def test_from_hf_dict_with_default_rope_type_is_plain_rope():
    d = _released_flash_config_json()
    d["rope_scaling"] = {"type": "default"}
    assert AttentionConfig.from_hf(d).rope_scaling is None


def test_from_hf_overrides():
    cfg = AttentionConfig.from_hf(_small_hf(), index_topk=4, indexer_loss_coeff=0.0)
    assert cfg.index_topk == 4
    assert cfg.indexer_loss_coeff == 0.0
    assert cfg.hidden_size == 256


def test_from_hf_bad_layer_type_names_layer_types():
    d = _released_flash_config_json()
    d["layer_types"] = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        AttentionConfig.from_hf(d)


def test_from_hf_bad_legacy_ratio_names_compress_ratios():
    d = _released_flash_config_json()
    d["compress_ratios"] = [0, 3]
    with pytest.raises(ValueError, match=re.escape("compress_ratios[1]")):
        AttentionConfig.from_hf(d)


def test_from_hf_odd_rope_dim_names_field():
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        AttentionConfig.from_hf({"head_dim": 64, "partial_rotary_factor": 15 / 64, "compress_ratios": [0]})


# --------------------------------------------------------------------------------------------------- validation
BAD_FIELDS = [
    # (id, overrides, field named in the message)
    ("o_groups_not_dividing_heads", dict(o_groups=3), "o_groups"),
    ("o_groups_zero", dict(o_groups=0), "o_groups"),
    ("hidden_size_negative", dict(hidden_size=-128), "hidden_size"),
    ("hidden_size_float", dict(hidden_size=128.0), "hidden_size"),
    ("hidden_size_bool", dict(hidden_size=True), "hidden_size"),
    ("hidden_size_str", dict(hidden_size="128"), "hidden_size"),
    ("num_attention_heads_zero", dict(num_attention_heads=0), "num_attention_heads"),
    ("head_dim_negative", dict(head_dim=-64), "head_dim"),
    ("q_lora_rank_negative", dict(q_lora_rank=-1), "q_lora_rank"),
    ("o_lora_rank_zero", dict(o_lora_rank=0), "o_lora_rank"),
    ("sliding_window_zero", dict(sliding_window=0), "sliding_window"),
    ("index_n_heads_negative", dict(index_n_heads=-4), "index_n_heads"),
    ("index_head_dim_zero", dict(index_head_dim=0), "index_head_dim"),
    ("index_topk_zero", dict(index_topk=0), "index_topk"),
    ("index_topk_negative", dict(index_topk=-8), "index_topk"),
    ("compress_ratios_contains_3", dict(compress_ratios=(0, 3, 128)), re.escape("compress_ratios[1]")),
    ("compress_ratios_contains_64", dict(compress_ratios=(64,)), re.escape("compress_ratios[0]")),
    ("compress_ratios_contains_str", dict(compress_ratios=(0, "4")), re.escape("compress_ratios[1]")),
    ("compress_ratios_contains_float", dict(compress_ratios=(0, 4.0, 128)), "compress_ratios"),
    ("compress_ratios_not_a_sequence", dict(compress_ratios=4), "compress_ratios"),
    ("compress_ratios_none", dict(compress_ratios=None), "compress_ratios"),
    ("rope_dim_odd", dict(qk_rope_head_dim=15), "qk_rope_head_dim"),
    ("rope_dim_negative", dict(qk_rope_head_dim=-2), "qk_rope_head_dim"),
    ("rope_dim_above_head_dim", dict(qk_rope_head_dim=128), "qk_rope_head_dim"),
    ("rope_dim_above_index_head_dim", dict(qk_rope_head_dim=48), "qk_rope_head_dim"),
    ("rope_dim_float", dict(qk_rope_head_dim=16.0), "qk_rope_head_dim"),
    ("rope_scaling_str", dict(rope_scaling="yarn"), "rope_scaling"),
    ("rope_scaling_list", dict(rope_scaling=[("type", "yarn")]), "rope_scaling"),
    ("rope_scaling_unknown_type", dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    ("rope_scaling_factor_zero", dict(rope_scaling={**YARN_16, "factor": 0}), "rope_scaling.*factor"),
    ("rope_scaling_factor_str", dict(rope_scaling={**YARN_16, "factor": "16"}), "rope_scaling.*factor"),
    ("rope_scaling_missing_original", dict(rope_scaling={"type": "yarn", "factor": 16.0}),
     "rope_scaling.*original_max_position_embeddings"),
    ("indexer_loss_coeff_negative", dict(indexer_loss_coeff=-0.01), "indexer_loss_coeff"),
    ("indexer_loss_coeff_nan", dict(indexer_loss_coeff=math.nan), "indexer_loss_coeff"),
    ("indexer_loss_coeff_str", dict(indexer_loss_coeff="0.01"), "indexer_loss_coeff"),
    ("rope_theta_zero", dict(rope_theta=0.0), "rope_theta"),
    ("rope_theta_inf", dict(rope_theta=math.inf), "rope_theta"),
    ("compress_rope_theta_negative", dict(compress_rope_theta=-1.0), "compress_rope_theta"),
    ("rms_norm_eps_zero", dict(rms_norm_eps=0.0), "rms_norm_eps"),
    ("initializer_range_negative", dict(initializer_range=-0.02), "initializer_range"),
]


@pytest.mark.parametrize("overrides,field", [(o, f) for _, o, f in BAD_FIELDS], ids=[i for i, _, _ in BAD_FIELDS])
def test_bad_field_raises_value_error_naming_it(overrides, field):
    with pytest.raises(ValueError, match=field):
        AttentionConfig.tiny(**overrides)


def test_validate_can_be_called_again_after_mutation():
    cfg = AttentionConfig.tiny()
    cfg.validate()
    cfg.o_groups = 3
    with pytest.raises(ValueError, match="o_groups"):
        cfg.validate()


@pytest.mark.parametrize("overrides", [
    dict(qk_rope_head_dim=0),
    dict(qk_rope_head_dim=32, index_head_dim=32),
    dict(rope_scaling={"type": "default"}),
    dict(rope_scaling={"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 4096}),
    dict(indexer_loss_coeff=0),
    dict(initializer_range=0.0),
    dict(compress_ratios=()),
    dict(o_groups=4),
    dict(o_groups=1),
], ids=["no_rope", "rope_equal_to_index_head_dim", "rope_default_type", "rope_type_key", "zero_coeff",
        "zero_init_std", "no_layers", "one_head_per_group", "one_group"])
def test_edge_values_are_accepted(overrides):
    AttentionConfig.tiny(**overrides)


# ---------------------------------------------------------------------------------------------------- to_dict
@pytest.mark.parametrize("make", [
    AttentionConfig.flash, AttentionConfig.pro, AttentionConfig.tiny,
    lambda: AttentionConfig.tiny(rope_scaling=None, indexer_loss_coeff=0.0),
    lambda: AttentionConfig.from_hf(_small_hf()),
    lambda: AttentionConfig.from_hf(_released_flash_config_json()),
], ids=["flash", "pro", "tiny", "tiny_no_scaling", "from_hf_config", "from_config_json"])
def test_to_dict_round_trip(make):
    cfg = make()
    d = cfg.to_dict()
    assert AttentionConfig(**d) == cfg
    assert AttentionConfig(**json.loads(json.dumps(d))) == cfg    # JSON-serialisable too
    d["rope_scaling"] = "mutated" if d["rope_scaling"] is not None else None
    assert cfg.rope_scaling != "mutated"                        # to_dict is a copy


def test_to_dict_has_every_field_and_plain_types():
    d = AttentionConfig.flash().to_dict()
    assert set(d) == {f.name for f in dataclasses.fields(AttentionConfig)}
    assert isinstance(d["compress_ratios"], list)


def test_top_level_exports():
    assert dsv4attn.AttentionConfig is AttentionConfig
    for name in ("flash", "pro", "tiny", "from_hf"):
        assert callable(getattr(AttentionConfig, name))

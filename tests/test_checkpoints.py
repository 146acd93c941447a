"""Checkpoint loading (docs/semantics.md, decisions 11 and 12): Hugging Face ``DeepseekV4Attention`` names and
DeepSeek's released names load every tensor; missing / unexpected keys, shape mismatches and unloadable values (not a
tensor, not floating point, on the meta device) are reported by name, all before anything is copied; fp32
parameters (sinks, compressor positional biases) stay fp32 and keep their values under a bf16 cast."""
from __future__ import annotations

import re

import pytest
import torch

from dsv4attn import AttentionConfig, HybridAttention
from dsv4attn.checkpoints import name_tables, to_hf_state_dict

from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

RATIOS = (0, 4, 128)
RATIO_IDS = {0: "window", 4: "csa", 128: "hca"}
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
LAYER_IDX = {0: 0, 4: 1, 128: 2}
FP32_PARAMS = {0: ["sinks"], 4: ["sinks", "compressor.position_bias", "indexer.compressor.position_bias"],
               128: ["sinks", "compressor.position_bias"]}


def _hf_config() -> DeepseekV4Config:
    """HF config with AttentionConfig.tiny()'s attention values, one layer of each type."""
    return DeepseekV4Config(
        num_hidden_layers=3, layer_types=list(LAYER_TYPES), hidden_size=128, num_attention_heads=4, head_dim=64,
        partial_rotary_factor=16 / 64, q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=16,
        index_n_heads=4, index_head_dim=32, index_topk=8, vocab_size=64, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def hf_config():
    return _hf_config()


@pytest.fixture(scope="module")
def cfg(hf_config) -> AttentionConfig:
    cfg = AttentionConfig.from_hf(hf_config)
    tiny = AttentionConfig.tiny()
    for name in ("hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups",
                 "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk"):
        assert getattr(cfg, name) == getattr(tiny, name), name
    assert cfg.compress_ratios == RATIOS
    return cfg


@pytest.fixture(scope="module")
def hf_state_dicts(hf_config) -> dict[int, dict[str, torch.Tensor]]:
    """ratio -> state_dict of a DeepseekV4Attention filled with random values (norms and sinks included)."""
    g = torch.Generator().manual_seed(1234)
    out = {}
    for ratio in RATIOS:
        hf_layer = DeepseekV4Attention(hf_config, LAYER_IDX[ratio])
        with torch.no_grad():
            for p in hf_layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
        out[ratio] = {k: v.detach().clone() for k, v in hf_layer.state_dict().items()}
    return out


def _fresh(cfg, ratio, seed=0) -> HybridAttention:
    torch.manual_seed(seed)
    return HybridAttention(cfg, ratio)


def _to_ds(hf_sd: dict, ratio: int) -> dict:
    """Rename an HF state dict to DeepSeek's released names via name_tables."""
    to_hf, to_ds = name_tables(ratio)
    return {to_ds[native]: hf_sd[to_hf[native]] for native in to_hf}


def _named(hf_sd: dict, ratio: int, naming: str) -> dict:
    if naming == "hf":
        return dict(hf_sd)
    if naming == "deepseek":
        return _to_ds(hf_sd, ratio)
    to_hf, _ = name_tables(ratio)
    return {native: hf_sd[ext] for native, ext in to_hf.items()}


def _assert_loaded(layer, hf_sd):
    got = to_hf_state_dict(layer)
    assert set(got) == set(hf_sd)
    for k, v in hf_sd.items():
        assert got[k].dtype == torch.float32, k
        assert torch.equal(got[k], v.to(torch.float32)), k


# ------------------------------------------------------------------------------------------------ name tables
@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS.get)
def test_name_tables_cover_the_layer_and_hf(cfg, hf_state_dicts, ratio):
    to_hf, to_ds = name_tables(ratio)
    layer = _fresh(cfg, ratio)
    assert set(to_hf) == set(layer.state_dict())
    assert set(to_ds) == set(to_hf)
    assert set(to_hf.values()) == set(hf_state_dicts[ratio])        # exactly HF DeepseekV4Attention's keys
    assert len(set(to_ds.values())) == len(to_ds)                  # no two tensors share a DeepSeek name


@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS.get)
def test_shapes_match_hf(cfg, hf_state_dicts, ratio):
    ours = to_hf_state_dict(_fresh(cfg, ratio))
    for k, v in hf_state_dicts[ratio].items():
        assert tuple(ours[k].shape) == tuple(v.shape), k


def test_deepseek_names_follow_the_release():
    _, ds4 = name_tables(4)
    expected = {"wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv.weight", "kv_norm.weight", "wo_a.weight",
                "wo_b.weight", "attn_sink", "compressor.wkv.weight", "compressor.wgate.weight", "compressor.ape",
                "compressor.norm.weight", "indexer.wq_b.weight", "indexer.weights_proj.weight",
                "indexer.compressor.wkv.weight", "indexer.compressor.wgate.weight", "indexer.compressor.ape",
                "indexer.compressor.norm.weight"}
    assert set(ds4.values()) == expected
    _, ds0 = name_tables(0)
    assert not any(k.startswith(("compressor.", "indexer.")) for k in ds0.values())
    _, ds128 = name_tables(128)
    assert not any(k.startswith("indexer.") for k in ds128.values())


# -------------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("naming", ["hf", "deepseek", "native"])
@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS.get)
def test_load_copies_every_tensor(cfg, hf_state_dicts, ratio, naming):
    hf_sd = hf_state_dicts[ratio]
    layer = _fresh(cfg, ratio)
    missing, unexpected = layer.load_hf_state_dict(_named(hf_sd, ratio, naming))
    assert missing == [] and unexpected == []
    _assert_loaded(layer, hf_sd)


@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS.get)
def test_load_directly_from_hf_module(cfg, hf_config, ratio):
    """state_dict() of a live HF module (parameters, not clones) loads and is copied, not aliased."""
    hf_layer = DeepseekV4Attention(hf_config, LAYER_IDX[ratio])
    with torch.no_grad():
        for i, p in enumerate(hf_layer.parameters()):
            p.fill_(0.125 * (i + 1))
    layer = _fresh(cfg, ratio)
    layer.load_hf_state_dict(hf_layer.state_dict())
    _assert_loaded(layer, hf_layer.state_dict())
    with torch.no_grad():
        hf_layer.sinks.add_(1.0)
    assert not torch.equal(layer.sinks, hf_layer.sinks)


@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS.get)
def test_loaded_layer_runs(cfg, hf_state_dicts, ratio):
    layer = _fresh(cfg, ratio).eval()
    layer.load_hf_state_dict(hf_state_dicts[ratio])
    x = torch.randn(24, cfg.hidden_size)
    y = layer(x, cu_seqlens=torch.tensor([0, 24], dtype=torch.int32), max_seqlen=24)
    assert y.shape == x.shape


# ----------------------------------------------------------------------------------------- missing / unexpected
def _key_cases():
    cases = []
    for ratio in RATIOS:
        to_hf, to_ds = name_tables(ratio)
        for naming, table in (("hf", to_hf), ("deepseek", to_ds)):
            for key in table.values():
                cases.append(pytest.param(ratio, naming, key, id=f"{RATIO_IDS[ratio]}-{naming}-{key}"))
    return cases


@pytest.mark.parametrize("ratio,naming,key", _key_cases())
def test_missing_key_raises_naming_it(cfg, hf_state_dicts, ratio, naming, key):
    sd = _named(hf_state_dicts[ratio], ratio, naming)
    del sd[key]
    layer = _fresh(cfg, ratio)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ValueError, match=rf"missing.*{re.escape(repr(key))}"):
        layer.load_hf_state_dict(sd)
    for k, v in layer.state_dict().items():          # a failed strict load changes nothing
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("naming", ["hf", "deepseek"])
@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS.get)
@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.q_a_proj.weight", "bogus", "compressor.indexer.foo",
                                   "rotary_emb.inv_freq"])
def test_unexpected_key_raises_naming_it(cfg, hf_state_dicts, ratio, naming, extra):
    sd = _named(hf_state_dicts[ratio], ratio, naming)
    sd[extra] = torch.zeros(3)
    layer = _fresh(cfg, ratio)
    with pytest.raises(ValueError, match=rf"unexpected.*{re.escape(repr(extra))}"):
        layer.load_hf_state_dict(sd)


def test_window_layer_rejects_csa_checkpoint(cfg, hf_state_dicts):
    """A ratio-4 checkpoint into a ratio-0 layer: its compressor and indexer keys are unexpected, by name."""
    with pytest.raises(ValueError, match=r"unexpected.*compressor\.indexer\.q_b_proj\.weight"):
        _fresh(cfg, 0).load_hf_state_dict(hf_state_dicts[4])


def test_csa_layer_rejects_hca_checkpoint(cfg, hf_state_dicts):
    """HCA keys are the same in HF and native naming, so the indexer keys may be named either way."""
    with pytest.raises(ValueError, match=r"missing.*indexer\.q_b_proj\.weight") as info:
        _fresh(cfg, 4).load_hf_state_dict(hf_state_dicts[128])
    assert "shape" in str(info.value) and "compressor.position_bias" in str(info.value)


@pytest.mark.parametrize("naming", ["hf", "deepseek"])
@pytest.mark.parametrize("ratio,key_native", [
    (0, "q_b_proj.weight"), (0, "sinks"), (4, "compressor.position_bias"), (4, "indexer.q_b_proj.weight"),
    (128, "compressor.kv_proj.weight"), (128, "o_a_proj.weight"),
], ids=lambda v: v if isinstance(v, str) else RATIO_IDS[v])
def test_shape_mismatch_raises_naming_it(cfg, hf_state_dicts, ratio, key_native, naming):
    to_hf, to_ds = name_tables(ratio)
    key = (to_hf if naming == "hf" else to_ds)[key_native]
    sd = _named(hf_state_dicts[ratio], ratio, naming)
    sd[key] = sd[key][..., :-1].clone() if sd[key].dim() > 1 else sd[key][:-1].clone()
    with pytest.raises(ValueError, match=rf"shape.*{re.escape(key)}"):
        _fresh(cfg, ratio).load_hf_state_dict(sd)


def test_transposed_weight_is_a_shape_mismatch(cfg, hf_state_dicts):
    sd = dict(hf_state_dicts[0])
    sd["o_b_proj.weight"] = sd["o_b_proj.weight"].t().contiguous()   # (64, 128) vs (128, 64)
    with pytest.raises(ValueError, match=r"shape.*o_b_proj\.weight.*\(128, 64\)"):
        _fresh(cfg, 0).load_hf_state_dict(sd)


@pytest.mark.parametrize("naming", ["hf", "deepseek"])
@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS.get)
def test_non_strict_returns_missing_and_unexpected(cfg, hf_state_dicts, ratio, naming):
    to_hf, to_ds = name_tables(ratio)
    table = to_hf if naming == "hf" else to_ds
    sd = _named(hf_state_dicts[ratio], ratio, naming)
    dropped = table["q_b_proj.weight"]
    del sd[dropped]
    sd["extra.weight"] = torch.zeros(2)
    layer = _fresh(cfg, ratio)
    before_q_b = layer.q_b_proj.weight.detach().clone()
    missing, unexpected = layer.load_hf_state_dict(sd, strict=False)
    assert missing == [dropped]
    assert unexpected == ["extra.weight"]
    assert torch.equal(layer.q_b_proj.weight, before_q_b)             # missing: left as it was
    got = to_hf_state_dict(layer)
    for native, ext in table.items():                                  # everything else loaded
        if ext != dropped:
            assert torch.equal(got[to_hf[native]], hf_state_dicts[ratio][to_hf[native]]), ext


def test_non_strict_empty_state_dict_reports_everything(cfg):
    layer = _fresh(cfg, 4)
    missing, unexpected = layer.load_hf_state_dict({}, strict=False)
    assert sorted(missing) == sorted(layer.state_dict())
    assert unexpected == []


def test_non_strict_shape_mismatch_is_not_silent(cfg, hf_state_dicts):
    """A tensor of the wrong shape is never loaded; with strict=False it must still be reported, not dropped
    silently (torch.nn.Module.load_state_dict raises on size mismatches whatever ``strict`` is)."""
    sd = dict(hf_state_dicts[0])
    sd["q_b_proj.weight"] = sd["q_b_proj.weight"][:-1].clone()
    layer = _fresh(cfg, 0)
    with pytest.raises(ValueError, match=r"shape.*q_b_proj\.weight"):
        layer.load_hf_state_dict(sd, strict=False)


# A bad value at the *last* key of the state dict: a loader that copied as it checked would have loaded every
# other tensor before refusing. id -> (bad value from the good one, exception, message pattern after the key)
BAD_VALUES = {
    "int64": (lambda v: v.to(torch.int64), ValueError, r"expected a floating-point dtype .* got torch\.int64"),
    "bool": (lambda v: v > 0, ValueError, r"expected a floating-point dtype .* got torch\.bool"),
    "float8": (lambda v: v.to(torch.float8_e4m3fn), ValueError,
               r"expected a floating-point dtype .* got torch\.float8_e4m3fn "
               r"\(quantised weights: dequantise them with their scales first\)"),
    "list": (lambda v: v.tolist(), ValueError, r"expected a torch\.Tensor of shape \(.*\), got list"),
    "meta": (lambda v: torch.empty(v.shape, device="meta"), ValueError,
             r"expected a tensor with values, got one on the meta device"),
    "shape": (lambda v: v[..., :-1].clone() if v.dim() > 1 else v[:-1].clone(), ValueError,
              r"expected \(4, 128\), got \(4, 127\)"),
}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_refused_load_changes_nothing(cfg, hf_state_dicts, case, strict):
    make, exc, pattern = BAD_VALUES[case]
    layer = _fresh(cfg, 4)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    sd = dict(hf_state_dicts[4])
    key = list(sd)[-1]
    sd[key] = make(sd[key])
    with pytest.raises(exc, match=rf"nothing was loaded.*{re.escape(key)}: {pattern}") as info:
        layer.load_hf_state_dict(sd, strict=strict)
    assert "state_dict does not fit HybridAttention(ratio=4)" in str(info.value)
    after = layer.state_dict()
    for name, value in before.items():
        assert torch.equal(after[name], value), f"{name} changed by a refused load"


def test_every_bad_key_is_named_at_once(cfg, hf_state_dicts):
    sd = dict(hf_state_dicts[0])
    sd["sinks"] = sd["sinks"].to(torch.int32)
    sd["q_b_proj.weight"] = sd["q_b_proj.weight"][:-1]
    del sd["kv_norm.weight"]
    with pytest.raises(ValueError) as info:
        _fresh(cfg, 0).load_hf_state_dict(sd)
    message = str(info.value)
    assert "missing keys ['kv_norm.weight']" in message
    assert "q_b_proj.weight: expected (256, 64), got (255, 64)" in message
    assert "sinks: expected a floating-point dtype" in message


@pytest.mark.parametrize("bad, exc, pattern", [
    ([("sinks", torch.zeros(4))], TypeError, r"state_dict must be a mapping .* got list"),
    ({}, TypeError, r"strict must be a bool, got str"),
], ids=["state_dict_list", "strict_str"])
def test_load_argument_types(cfg, bad, exc, pattern):
    kwargs = {"strict": "yes"} if isinstance(bad, dict) else {}
    with pytest.raises(exc, match=pattern):
        _fresh(cfg, 0).load_hf_state_dict(bad, **kwargs)


# ------------------------------------------------------------------------------------------------- precision
def _fp32_names(ratio):
    return FP32_PARAMS[ratio]


@pytest.mark.parametrize("naming", ["hf", "deepseek"])
@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS.get)
def test_bf16_checkpoint_into_fp32_layer(cfg, hf_state_dicts, ratio, naming):
    bf16 = {k: v.to(torch.bfloat16) for k, v in _named(hf_state_dicts[ratio], ratio, naming).items()}
    layer = _fresh(cfg, ratio)
    layer.load_hf_state_dict(bf16)
    params = dict(layer.named_parameters())
    for name in _fp32_names(ratio):
        assert params[name].dtype == torch.float32, name
    _assert_loaded(layer, {k: v.to(torch.bfloat16) for k, v in hf_state_dicts[ratio].items()})


@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS.get)
def test_bf16_cast_keeps_fp32_params_and_values(cfg, hf_state_dicts, ratio):
    layer = _fresh(cfg, ratio)
    layer.load_hf_state_dict(hf_state_dicts[ratio])
    before = {k: v.detach().clone() for k, v in layer.named_parameters()}
    layer.to(torch.bfloat16)
    params = dict(layer.named_parameters())
    for name, p in params.items():
        if name in _fp32_names(ratio):
            assert p.dtype == torch.float32, name
            assert torch.equal(p, before[name]), name                  # not rounded through bf16
            assert isinstance(p, torch.nn.Parameter) and p.requires_grad, name
        else:
            assert p.dtype == torch.bfloat16, name
    # the random fp32 values are not bf16-representable, so an accidental round trip would have shown
    assert not torch.equal(before["sinks"], before["sinks"].bfloat16().float())


@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS.get)
@pytest.mark.parametrize("cast", ["to_bf16", "bfloat16_method", "half", "to_dtype_and_device"])
def test_other_casts_keep_fp32_params(cfg, hf_state_dicts, ratio, cast):
    layer = _fresh(cfg, ratio)
    layer.load_hf_state_dict(hf_state_dicts[ratio])
    before = {k: v.detach().clone() for k, v in layer.named_parameters()}
    {"to_bf16": lambda m: m.to(torch.bfloat16), "bfloat16_method": lambda m: m.bfloat16(),
     "half": lambda m: m.half(), "to_dtype_and_device": lambda m: m.to("cpu", torch.bfloat16)}[cast](layer)
    params = dict(layer.named_parameters())
    for name in _fp32_names(ratio):
        assert params[name].dtype == torch.float32, name
        assert torch.equal(params[name], before[name]), name


@pytest.mark.parametrize("naming", ["hf", "deepseek"])
@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS.get)
def test_load_into_bf16_layer(cfg, hf_state_dicts, ratio, naming):
    """After layer.to(bf16): bf16 values land exactly; fp32 values keep full precision in the fp32 params."""
    hf_sd = hf_state_dicts[ratio]
    layer = _fresh(cfg, ratio).to(torch.bfloat16)

    layer.load_hf_state_dict({k: v.to(torch.bfloat16) for k, v in _named(hf_sd, ratio, naming).items()})
    got = to_hf_state_dict(layer)
    to_hf, _ = name_tables(ratio)
    fp32_hf = {to_hf[n] for n in _fp32_names(ratio)}
    for k, v in hf_sd.items():
        want = torch.float32 if k in fp32_hf else torch.bfloat16
        assert got[k].dtype == want, k
        assert torch.equal(got[k].float(), v.bfloat16().float()), k

    layer.load_hf_state_dict(_named(hf_sd, ratio, naming))          # fp32 checkpoint
    got = to_hf_state_dict(layer)
    for k, v in hf_sd.items():
        if k in fp32_hf:
            assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k
        else:
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.bfloat16()), k


def test_float64_cast_makes_fp32_params_fp64(cfg, hf_state_dicts):
    layer = _fresh(cfg, 4)
    layer.load_hf_state_dict(hf_state_dicts[4])
    before = layer.sinks.detach().clone()
    layer.double()
    assert layer.sinks.dtype == torch.float64
    assert layer.compressor.position_bias.dtype == torch.float64
    assert torch.equal(layer.sinks, before.double())

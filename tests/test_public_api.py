"""The public surface listed in README.md ("Use a layer", "Context parallelism", "Tensor parallelism") exists with the
documented signatures (extend, never rename)."""
from __future__ import annotations

import inspect

import dsv4attn


def test_top_level_names():
    assert set(dsv4attn.__all__) == {"AttentionConfig", "HybridAttention", "Compressor", "Indexer", "PackedBatch",
                                     "pack_batch", "ops", "set_backend", "set_kernels", "set_checks", "parallel",
                                     "__version__"}
    for name in dsv4attn.__all__:
        assert hasattr(dsv4attn, name), name


def test_config_presets_and_from_hf():
    for preset in ("flash", "pro", "tiny", "from_hf"):
        assert callable(getattr(dsv4attn.AttentionConfig, preset))


def test_layer_signature():
    params = inspect.signature(dsv4attn.HybridAttention.forward).parameters
    assert list(params)[:6] == ["self", "hidden_states", "cu_seqlens", "max_seqlen", "phase", "cp_group"]
    assert params["phase"].default == "sparse" and params["cp_group"].default is None
    assert callable(dsv4attn.HybridAttention.load_hf_state_dict)
    layer = dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), 4)
    assert layer.indexer_loss is None
    # README "Tensor parallelism": a keyword of the constructor, default None (no TP).
    init = inspect.signature(dsv4attn.HybridAttention.__init__).parameters
    assert init["tp_group"].kind is inspect.Parameter.KEYWORD_ONLY and init["tp_group"].default is None


def test_pack_batch_signature():
    params = inspect.signature(dsv4attn.pack_batch).parameters
    assert list(params)[:4] == ["cu_seqlens", "total_rows", "max_seqlen", "device"]
    for name in ("cp_group", "cp_partition"):           # README "Context parallelism": keywords, default None
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default is None
    # docs/context_parallel.md "Sharded compressed memory": a keyword, default "gather" (the all-gather).
    assert params["cp_compressed"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["cp_compressed"].default == "gather"
    # docs/packing.md "Under CUDA graphs": a keyword, default None (the batch's own number of documents).
    assert params["num_docs"].kind is inspect.Parameter.KEYWORD_ONLY and params["num_docs"].default is None
    assert callable(dsv4attn.PackedBatch.copy_)


def test_sparse_attention_signature():
    params = inspect.signature(dsv4attn.ops.sparse_attention).parameters
    assert list(params)[:5] == ["q", "kv", "indices", "attn_sink", "softmax_scale"]
    assert params["softmax_scale"].default is None
    # Additions are keyword-only, so positional calls keep their meaning.
    extra = {name: p for name, p in params.items() if name not in list(params)[:5]}
    assert {name: p.default for name, p in extra.items()} == {"topk_length": None, "deterministic": False,
                                                              "output_rope": None, "mass_probe": None,
                                                              "mass_offset": 0, "query_norm": None}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra.values())


def test_env_report_runs():
    from dsv4attn import env

    text = env.report()
    assert "torch" in text and "sparse_attention" in text

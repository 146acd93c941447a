"""dsv4attn.integrations.transformers: a patched transformers DeepseekV4ForCausalLM against the unpatched model.

The oracle is the unpatched model run on each document alone (batch 1, positions from 0), which transformers
computes right; the patched model runs all documents at once (one padding-free packed row, flash-attention kwargs,
or a padded batch). Logits must agree per document to 1e-4 relative (fp32; measured ~1e-6) and every gradient
(summed over the documents) to 1e-3 relative. The indexer's parameters are the exception: transformers gives them
no gradient (top-k is not differentiable); the patched model trains them through the indexer KL loss.

A tiny random config (hidden 64, window 16, layers sliding / CSA / HCA, 4 experts, the first MoE hash-routed) in
fp32 on the CPU; 16 indexer heads make an exact top-k tie at the cut improbable (see test_hf_parity.py).
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from dsv4attn.integrations import transformers as hf_int  # noqa: E402  (after the skip)

# 1 < window, 3 < r, 4 = r, 5 = r + 1, 17 > window, 131 > 128 (one HCA entry), 260 (two, and 65 CSA entries for a
# top-4), 42 not divisible by 4.
LENGTHS = (1, 3, 4, 5, 17, 131, 42, 260)
VOCAB = 64


def tiny_config(**overrides):
    values = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25,
                  q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=16, index_n_heads=16, index_head_dim=16,
                  index_topk=4, rope_theta=10000.0, compress_rope_theta=160000.0, num_hidden_layers=3,
                  vocab_size=VOCAB, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                  mlp_layer_types=["hash_moe", "moe", "moe"],
                  rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                                   "beta_fast": 32.0, "beta_slow": 1.0})
    values.update(overrides)
    config = transformers.DeepseekV4Config(**values)
    config._attn_implementation = "eager"
    return config


def randomized(model):
    """Non-trivial attention parameters (HF's init zeroes sinks and positional biases) and hash routes."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, modeling.DeepseekV4Attention):
                for name, p in module.named_parameters():
                    noise = torch.randn(p.shape, generator=g)
                    if name.endswith("norm.weight"):
                        p.copy_(1.0 + 0.2 * noise)
                    elif name == "sinks" or name.endswith("position_bias"):
                        p.copy_(0.5 * noise)
                    else:
                        p.copy_(0.08 * noise)
            if isinstance(module, modeling.DeepseekV4HashRouter):
                module.tid2eid.copy_(torch.randint(0, module.num_experts, module.tid2eid.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def models():
    """(unpatched, patched) with equal parameters, both in training mode."""
    torch.manual_seed(0)
    ref = randomized(modeling.DeepseekV4ForCausalLM(tiny_config()).float()).train()
    return ref, hf_int.apply(copy.deepcopy(ref))


def doc_slices(lengths):
    out, start = [], 0
    for n in lengths:
        out.append(slice(start, start + n))
        start += n
    return out


def packed_inputs(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return ids, pos


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def is_indexer(name: str) -> bool:
    return ".compressor.indexer." in name


def per_document_reference(ref, ids, lengths, weights):
    """Logits of each document run alone through the unpatched model, and the gradients of
    sum_doc (logits_doc * weights_doc).sum() (accumulated over the documents)."""
    ref.zero_grad(set_to_none=True)
    logits = []
    for doc in doc_slices(lengths):
        out = ref(input_ids=ids[None, doc], use_cache=False).logits[0]
        (out * weights[doc]).sum().backward()
        logits.append(out.detach())
    return logits, {n: p.grad for n, p in ref.named_parameters()}


def compare_gradients(model, ref_grads):
    """Max relative gradient difference over the parameters transformers differentiates; checks the indexer's
    (which only dsv4attn trains) are finite and not all zero."""
    worst, indexer_norm = 0.0, 0.0
    for name, p in model.named_parameters():
        theirs = ref_grads[name]
        if is_indexer(name):
            assert theirs is None
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            indexer_norm += p.grad.norm().item()
        elif theirs is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            assert p.grad is not None, name
            err = rel(p.grad, theirs)
            assert err <= 1e-3, f"{name}: relative gradient difference {err:.2e}"
            worst = max(worst, err)
    assert indexer_norm > 0
    return worst


def test_packed_row_matches_documents_alone(models):
    """Logits and every gradient of one padding-free packed row equal those of each document run alone."""
    ref, model = models
    ids, pos = packed_inputs()
    weights = torch.randn(len(ids), VOCAB, generator=torch.Generator().manual_seed(2))
    ref_logits, ref_grads = per_document_reference(ref, ids, LENGTHS, weights)

    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids[None], position_ids=pos[None]).logits[0]
    (logits * weights).sum().backward()
    errs = [rel(logits[doc].detach(), theirs) for doc, theirs in zip(doc_slices(LENGTHS), ref_logits)]
    assert max(errs) <= 1e-4, errs
    compare_gradients(model, ref_grads)
    assert hf_int.indexer_loss(model) > 0


def test_unpatched_transformers_mixes_documents(models):
    """Why the patch exists: transformers on the same packed row lets documents see each other (compression groups,
    visibility and top-k run over the whole row; with the default use_cache=True it also skips the packed-row
    mask, so even the window crosses). The first document is always right."""
    ref, _ = models
    ids, pos = packed_inputs()
    with torch.no_grad():
        for use_cache in (True, False):
            packed = ref(input_ids=ids[None], position_ids=pos[None], use_cache=use_cache).logits[0]
            errs = [rel(packed[doc], ref(input_ids=ids[None, doc], use_cache=False).logits[0])
                    for doc in doc_slices(LENGTHS)]
            assert errs[0] <= 1e-5 and max(errs) > 0.05, (use_cache, errs)


def test_flash_attention_kwargs_from_the_flattening_collator(models):
    """transformers' DataCollatorWithFlattening (cu_seq_lens_q / max_length_q and position_ids) gives the same
    logits as position_ids alone; cu_seq_lens_q alone defines the documents too."""
    _, model = models
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    ids, pos = packed_inputs()
    batch = collator([{"input_ids": ids[doc].tolist()} for doc in doc_slices(LENGTHS)])
    assert torch.equal(batch["position_ids"][0], pos)
    with torch.no_grad():
        base = model(input_ids=ids[None], position_ids=pos[None]).logits
        flat = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        cu_only = model(input_ids=ids[None], cu_seq_lens_q=batch["cu_seq_lens_q"],
                        max_length_q=batch["max_length_q"]).logits
    assert torch.equal(flat, base) and torch.equal(cu_only, base)


@pytest.mark.parametrize("with_positions", [False, True], ids=["mask-only", "mask+position_ids"])
def test_padded_batch_matches_documents_alone(models, with_positions):
    """Rows right-padded, left-padded, full, and (with position_ids) holding two documents: every real token's
    logits and the gradients equal the documents alone; padding tokens change nothing."""
    ref, model = models
    S = 140
    rows = [((131,), "right"), ((42,), "left"), ((140,), "none")] + ([((5, 17), "right")] if with_positions else [])
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (len(rows), S), generator=g)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    position_ids = torch.ones(len(rows), S, dtype=torch.long)       # padding positions: anything (not read)
    docs = []                                                       # (row, slice) of every document
    for r, (lengths, side) in enumerate(rows):
        start = S - sum(lengths) if side == "left" else 0
        for n in lengths:
            docs.append((r, slice(start, start + n)))
            mask[r, start:start + n] = 1
            position_ids[r, start:start + n] = torch.arange(n)
            start += n
    weights = torch.randn(len(rows), S, VOCAB, generator=g) * mask[..., None]

    ref.zero_grad(set_to_none=True)
    ref_logits = []
    for r, doc in docs:
        out = ref(input_ids=ids[r:r + 1, doc], use_cache=False).logits[0]
        (out * weights[r, doc]).sum().backward()
        ref_logits.append(out.detach())
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    model.zero_grad(set_to_none=True)
    kwargs = dict(position_ids=position_ids) if with_positions else {}
    logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits
    (logits * weights).sum().backward()
    errs = [rel(logits[r, doc].detach(), theirs) for (r, doc), theirs in zip(docs, ref_logits)]
    assert max(errs) <= 1e-4, errs
    compare_gradients(model, ref_grads)

    with torch.no_grad():                                           # other padding token ids: same real logits
        other = torch.where(mask.bool(), ids, (ids + 7) % VOCAB)
        again = model(input_ids=other, attention_mask=mask, **kwargs).logits
    assert torch.equal(again[mask.bool()], logits.detach()[mask.bool()])


def test_phases_and_the_indexer_loss(models):
    """set_phase / get_phase reach every layer; the model's own loss trains the indexer (its KL is attached to the
    attention output): dense gives exact-zero indexer gradients and a zero loss, warm-up and sparse a positive one;
    no indexer loss in eval mode."""
    _, model = models
    ids, pos = packed_inputs()
    labels = ids.clone()
    labels[torch.cumsum(torch.tensor((0,) + LENGTHS[:-1]), 0)] = -100      # never predict across a boundary
    assert hf_int.get_phase(model) == "sparse"
    try:
        for phase in ("dense", "warmup", "sparse"):
            hf_int.set_phase(model, phase)
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids[None], position_ids=pos[None], labels=labels[None])
            out.loss.backward()
            indexer = [p.grad for n, p in model.named_parameters() if is_indexer(n)]
            loss = hf_int.indexer_loss(model)
            assert loss is not None and not loss.requires_grad
            if phase == "dense":
                assert loss == 0 and all(g is not None and not g.any() for g in indexer)
            else:
                assert loss > 0 and sum(g.norm() for g in indexer) > 0
        with pytest.raises(ValueError, match="phase must be one of"):
            hf_int.set_phase(model, "fast")
        model.eval()
        with torch.no_grad():
            model(input_ids=ids[None], position_ids=pos[None])
        assert hf_int.indexer_loss(model) is None
    finally:
        model.train()
        hf_int.set_phase(model, "sparse")


def test_state_dict_and_save_pretrained_round_trip(models, tmp_path):
    """Same keys and parameter objects as before apply; save_pretrained / from_pretrained / apply gives the same
    logits."""
    ref, model = models
    assert list(model.state_dict()) == list(ref.state_dict())
    assert len(list(model.parameters())) == len(list(ref.parameters()))
    assert hf_int.apply(model) is model and hf_int.is_applied(model) and not hf_int.is_applied(ref)
    model.save_pretrained(tmp_path)
    loaded = modeling.DeepseekV4ForCausalLM.from_pretrained(tmp_path)
    assert not hf_int.is_applied(loaded)
    hf_int.apply(loaded)
    ids, pos = packed_inputs()
    with torch.no_grad():
        a = model(input_ids=ids[None], position_ids=pos[None]).logits
        b = loaded.train()(input_ids=ids[None], position_ids=pos[None]).logits
    assert torch.equal(a, b)


def test_kv_cache_runs_transformers_attention(models):
    """Generation (a KV cache) falls back to transformers' attention and matches the unpatched model; a training
    forward with a cache, or packed rows with a cache, raise."""
    ref, model = models
    ids, pos = packed_inputs()
    with pytest.raises(ValueError, match="without a KV cache"):
        model(input_ids=ids[None, :20], use_cache=True)
    try:
        ref.eval(), model.eval()
        with pytest.raises(ValueError, match="with a KV cache are not supported"):
            with torch.no_grad():
                model(input_ids=ids[None], position_ids=pos[None], use_cache=True)
        prompt = ids[None, 100:120]
        ours = model.generate(prompt, max_new_tokens=4, do_sample=False)
        theirs = ref.generate(prompt, max_new_tokens=4, do_sample=False)
        assert torch.equal(ours, theirs)
    finally:
        ref.train(), model.train()


def test_bad_position_ids_are_refused(models):
    _, model = models
    ids = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(ValueError, match=r"position_ids\[0, 3\] = 5: a document must start at position 0"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 5, 6, 0, 1, 2]]))
    with pytest.raises(ValueError, match=r"position_ids\[0, 0\] = 3"):
        model(input_ids=ids, position_ids=torch.arange(3, 11)[None])
    with pytest.raises(TypeError, match="DeepseekV4 model"):
        hf_int.apply(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="attention_dropout"):
        hf_int.apply(modeling.DeepseekV4ForCausalLM(tiny_config(attention_dropout=0.1)))


def test_host_reads_happen_once_per_forward_not_per_layer(models):
    """The pre-hook reads the device twice per forward (torch.nonzero for the number of documents, the pack's
    validation); the attention layers read nothing."""
    from tests.test_host_reads import HostReads                # the suite's counter (repo root on sys.path)

    _, model = models
    ids, pos = packed_inputs()
    counters = {}

    def counting(name):
        def start(module, *_):
            counters[name] = HostReads()
            counters[name].__enter__()

        def stop(module, *_):
            counters[name].__exit__(None, None, None)
        return start, stop

    handles = []
    for i, layer in enumerate(model.model.layers):
        start, stop = counting(i)
        handles += [layer.self_attn.register_forward_pre_hook(start), layer.self_attn.register_forward_hook(stop)]
    try:
        with HostReads() as pack_reads:
            rows = hf_int.packed_rows(1, len(ids), ids.device, position_ids=pos[None])
        with torch.no_grad():
            model(input_ids=ids[None], position_ids=pos[None])
    finally:
        for h in handles:
            h.remove()
    assert sum(pack_reads.reads.values()) == 2, pack_reads.reads
    assert rows.pack.num_docs == len(LENGTHS)
    assert len(counters) == 3 and all(not c.reads and not c.scans for c in counters.values()), counters


def test_cast_to_bf16_and_gradient_checkpointing(models):
    """model.to(torch.bfloat16) casts sinks and positional biases too: dsv4attn gets fp32 copies of them and their
    gradients reach the bf16 parameters. Gradient checkpointing recomputes the layers with the same batch."""
    ref, model = models
    ids, pos = packed_inputs()
    weights = torch.randn(len(ids), VOCAB, generator=torch.Generator().manual_seed(2))
    _, ref_grads = per_document_reference(ref, ids, LENGTHS, weights)
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable()
    checkpointed.zero_grad(set_to_none=True)
    (checkpointed(input_ids=ids[None], position_ids=pos[None]).logits[0] * weights).sum().backward()
    compare_gradients(checkpointed, ref_grads)

    low = copy.deepcopy(model).to(torch.bfloat16)
    low(input_ids=ids[None], position_ids=pos[None]).logits.float().square().mean().backward()
    sinks = low.model.layers[1].self_attn.sinks
    assert sinks.dtype == torch.bfloat16 and sinks.grad is not None and sinks.grad.dtype == torch.bfloat16
    assert all(torch.isfinite(p.grad).all() for p in low.parameters() if p.grad is not None)


def test_example_script_smoke():
    """examples/hf_packed_finetune.py runs (5 short steps: dense, warm-up, sparse)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "hf_packed_finetune.py"
    spec = importlib.util.spec_from_file_location("hf_packed_finetune", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--steps", "5", "--tokens", "256", "--log-every", "2"])


def test_readme_snippet_runs():
    """The README's "Hugging Face models" snippet runs as written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("## Hugging Face models", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    torch.manual_seed(0)
    exec(compile(code, "README.md (Hugging Face models)", "exec"), {})

"""Evaluation probes: the indexer loss the probe recomputes equals the layers' own (so recall@k is measured on the
same teacher the layers train against), the teacher top-k really holds the largest attention mass, and the
metrics of a held-out pass are well formed."""
from __future__ import annotations

import pytest
import torch

from dsv4attn.ops.index_sets import VisibleCompressed
from dsv4attn.packing import pack_batch
from dsv4attn.train.data import EVAL, RetrievalTask
from dsv4attn.train.evaluate import _teacher_topk, evaluate, probe_indexer
from dsv4attn.train.model import DecoderLM, model_config


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = DecoderLM(model_config("tiny", (0, 4, 128, 4), indexer_loss_coeff=0.3))
    batch = RetrievalTask(reach=28).batch(0, EVAL, 0, 400)
    return model, batch


@pytest.mark.parametrize("phase", ["warmup", "sparse"])
def test_probe_indexer_loss_equals_the_layers(setup, phase):
    model, b = setup
    model.train()
    captured = []
    logits = model(b.tokens, b.cu_seqlens, b.max_seqlen, phase, captured=captured)   # grad on: layers compute it
    logits.sum().backward()                     # the sparse phase's loss is written by the backward
    model.zero_grad(set_to_none=True)
    layer_total = model.indexer_loss()
    pack = pack_batch(b.cu_seqlens, b.tokens.shape[0], b.max_seqlen)
    probe_total = sum(probe_indexer(layer, x.detach(), pack, phase)["kl"]
                      for layer, x in captured if layer.indexer is not None) / b.num_tokens
    assert layer_total > 0
    torch.testing.assert_close(torch.tensor(probe_total, dtype=torch.float64), layer_total.double(), rtol=1e-5,
                               atol=1e-9)


def test_teacher_topk_holds_the_largest_mass():
    torch.manual_seed(1)
    T, H, D, k = 40, 3, 16, 3
    pack = pack_batch(torch.tensor([0, 25, 38], dtype=torch.int32), T, 25)
    layout = pack.compressed(4)
    q, comp = torch.randn(T, H, D), torch.randn(layout.capacity, D)
    outside = torch.randn(T, H)
    visible = VisibleCompressed(layout, T)
    top = _teacher_topk(q, comp, outside, visible, k, 0.25)
    cand = visible.materialize()
    for t in range(T):
        ids = [int(j) for j in cand[t] if j >= 0]
        if not ids:
            assert bool((top[t] == -1).all())
            continue
        logits = torch.stack([(q[t] * comp[j]).sum(-1) * 0.25 for j in ids], dim=1)          # (H, n)
        mass = torch.exp(logits - torch.logaddexp(outside[t], torch.logsumexp(logits, 1))[:, None]).sum(0)
        want = [ids[i] for i in torch.sort(mass, descending=True, stable=True).indices[:k].tolist()]
        assert top[t, :len(want)].tolist() == want and bool((top[t, len(want):] == -1).all())


def test_evaluate_reports_every_metric(setup):
    model, b = setup
    metrics = evaluate(model, [b], "sparse", torch.device("cpu"))
    assert model.training                                       # evaluate restores the mode it found
    assert metrics["answers"] == b.num_answers > 0
    assert 0 <= metrics["retrieval_acc"] <= 1 and metrics["lm_loss"] > 0
    assert metrics["indexer_loss"] > 0 and 0 <= metrics["indexer_recall"] <= 1

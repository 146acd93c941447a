"""``--cuda-graphs``: the training step over fixed buffers (dsv4attn.train.graphs).

On the CPU the fixed-buffer step runs eagerly (``capture=False``) and must train exactly like the plain step over
the phases; the option is refused where it cannot run, before anything is written. On a CUDA GPU the captured
steps (one graph per phase and span, replayed with other batches) must give the plain run's losses.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dsv4attn.train import TrainConfig
from dsv4attn.train.data import TRAIN, make_source, pack_documents
from dsv4attn.train.graphs import MIN_SPAN, GraphedSteps, span_of
from dsv4attn.train.loop import train
from dsv4attn.train.model import DecoderLM, lm_loss, model_config
from dsv4attn.train.setup import build_optimizer
from dsv4attn.train.step import train_step
from train_helpers import records, tree_digest

PHASES = ["dense", "warmup", "warmup", "sparse", "sparse", "sparse"]
# (phase, longest document) of hand-made batches of 640 rows whose spans change inside a phase and come back to
# an earlier span after a larger one: 128, 256, 128 | 384, 128 | 256, 128, 256, 384.
SPAN_SCHEDULE = [("dense", 100), ("dense", 200), ("dense", 90), ("warmup", 300), ("warmup", 120),
                 ("sparse", 250), ("sparse", 100), ("sparse", 230), ("sparse", 310)]


def _schedule_batches(rows: int, seed: int = 0):
    """(phase, batch) of SPAN_SCHEDULE: random bytes in documents of the given longest length, then documents of
    random shorter lengths up to ``rows``, and padding."""
    gen = np.random.default_rng(seed)
    out = []
    for phase, longest in SPAN_SCHEDULE:
        lengths = [longest]
        while sum(lengths) < rows - 40:
            lengths.append(int(gen.integers(1, min(longest, rows - sum(lengths)) + 1)))
        gen.shuffle(lengths)
        docs = [gen.integers(0, 256, n).astype(np.uint8) for n in lengths]
        out.append((phase, pack_documents(docs, [np.zeros(n, dtype=bool) for n in lengths], rows)))
    return out


def _run(graphed: bool, device: str = "cpu", rows: int = 192, spans: bool = False, seed: int = 0,
         schedule: bool = False):
    """(per-step metrics, final parameters, the GraphedSteps or None) of steps over the phases (PHASES with the
    retrieval data; SPAN_SCHEDULE's batches with ``schedule``), the same model, data and optimizer. ``spans``: the
    plain steps' batches say max_seqlen = their span, as the fixed buffers' packs do."""
    cfg = TrainConfig(capacity=rows, plot=False)
    mcfg = model_config("tiny", (0, 4, 128, 4))
    torch.manual_seed(0)
    model = DecoderLM(mcfg).to(device)
    optimizer = build_optimizer(model, cfg)
    source = make_source(None, n_layers=mcfg.num_layers, window=mcfg.attention.sliding_window)
    steps = (_schedule_batches(rows, seed) if schedule
             else [(phase, source.batch(seed, TRAIN, step, rows)) for step, phase in enumerate(PHASES)])
    graphs = GraphedSteps(model, rows, torch.device(device), capture=device == "cuda") if graphed else None
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else None
    metrics = []
    for step, (phase, batch) in enumerate(steps):
        batch = batch.to(torch.device(device))
        if spans:
            batch = dataclasses.replace(batch, max_seqlen=span_of(batch.max_seqlen, rows))
        metrics.append(train_step(model, optimizer, batch, phase, step, cfg.grad_clip, graphs=graphs,
                                  autocast=autocast))
    return metrics, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}, graphs


def test_spans_change_within_a_phase_and_come_back():
    """Batches whose spans change inside a phase and return to an earlier one: one step per (phase, span), and
    the steps train bit for bit like plain steps given each batch's span."""
    fixed, fixed_params, graphs = _run(graphed=True, rows=640, schedule=True)
    plain, plain_params, _ = _run(graphed=False, rows=640, spans=True, schedule=True)
    assert graphs.captured == [("dense", 128), ("dense", 256), ("warmup", 384), ("warmup", 128), ("sparse", 256),
                               ("sparse", 128), ("sparse", 384)]
    for step, (a, b) in enumerate(zip(fixed, plain)):
        assert (a.loss, a.indexer_loss, a.grad_norm) == (b.loss, b.indexer_loss, b.grad_norm), (step, a, b)
    for name, value in plain_params.items():
        assert torch.equal(fixed_params[name], value), name


@pytest.mark.parametrize("rows", [192, 640])
def test_fixed_buffer_steps_train_exactly_like_plain_steps(rows):
    """The buffers, the refilled packs (num_docs = rows, padded with empty documents), the device-side target count
    and the shared gradient tensors (zeroed, then accumulated into) change nothing: against plain steps given the
    same max_seqlen (the batch's span), every step's loss, indexer loss and gradient norm and the final parameters
    are bit for bit equal. Against plain steps sized by each batch's longest document, only the rounding of the
    wider candidate sets differs."""
    fixed, fixed_params, graphs = _run(graphed=True, rows=rows)
    plain, plain_params, _ = _run(graphed=False, rows=rows, spans=True)
    for step, (a, b) in enumerate(zip(fixed, plain)):
        assert (a.loss, a.indexer_loss, a.grad_norm) == (b.loss, b.indexer_loss, b.grad_norm), (step, a, b)
    for name, value in plain_params.items():
        assert torch.equal(fixed_params[name], value), name
    assert {phase for phase, _ in graphs.captured} == set(PHASES)
    narrow, _, _ = _run(graphed=False, rows=rows)
    for step, (a, b) in enumerate(zip(fixed, narrow)):
        assert a.loss == pytest.approx(b.loss, rel=1e-5) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4), \
            (step, a, b)


def test_spans_are_powers_of_two_or_one_and_a_half_times_within_the_rows():
    assert [span_of(m, 4096) for m in (0, 1, 100, 128, 129, 192, 193, 680, 768, 769, 2048, 2049, 3073, 4096)] == \
        [MIN_SPAN, MIN_SPAN, MIN_SPAN, 128, 192, 192, 256, 768, 768, 1024, 2048, 3072, 4096, 4096]
    assert span_of(150, 160) == 160 and span_of(5, 96) == 96


@pytest.mark.parametrize("phase", ["dense", "warmup", "sparse"])
def test_the_parameters_given_gradients_are_those_of_an_eager_backward(phase):
    """After a step every parameter an eager backward gives a ``.grad`` has one (the shared tensor of the
    GraphedSteps, equal to the eager gradient) and every other has None."""
    mcfg = model_config("tiny", (0, 4, 128))
    model = DecoderLM(mcfg)
    source = make_source(None, n_layers=3, window=mcfg.attention.sliding_window)
    batch = source.batch(0, TRAIN, 0, 192)
    batch = dataclasses.replace(batch, max_seqlen=span_of(batch.max_seqlen, 192))
    logits = model(batch.tokens, batch.cu_seqlens, batch.max_seqlen, phase)
    lm_loss(logits, batch.targets, batch.num_targets).backward()
    eager = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    graphs = GraphedSteps(model, 192, torch.device("cpu"), capture=False)
    graphs.run(batch, phase)
    for n, p in model.named_parameters():
        if eager[n] is None:
            assert p.grad is None, n
        else:
            assert p.grad is graphs.grads[p] and torch.equal(p.grad, eager[n]), n


def test_a_batch_of_other_rows_is_refused():
    mcfg = model_config("tiny", (0, 4))
    source = make_source(None, n_layers=2, window=mcfg.attention.sliding_window)
    graphs = GraphedSteps(DecoderLM(mcfg), 192, torch.device("cpu"), capture=False)
    with pytest.raises(ValueError, match="the batch has 96 rows, the captured buffers 192"):
        graphs.run(source.batch(0, TRAIN, 0, 96), "dense")


@pytest.mark.parametrize("extra, message", [
    (dict(cp=2), "--cuda-graphs runs one process"),
    (dict(fsdp=True), "--cuda-graphs runs one process"),
    (dict(cuda_graphs="yes"), "--cuda-graphs must be a bool"),
])
def test_cuda_graphs_refuses_what_it_cannot_run(extra, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**dict(dict(cuda_graphs=True, capacity=256), **extra)).validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a CUDA device")
def test_cuda_graphs_without_a_gpu_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="--cuda-graphs needs one process on a CUDA device"):
        train(TrainConfig(steps=2, dense_steps=1, warmup_steps=0, capacity=96, plot=False, cuda_graphs=True,
                          out=str(out)))
    assert tree_digest(out) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("schedule", [False, True])
def test_captured_steps_give_the_plain_run_losses(schedule):
    """One graph per phase and span, replayed with the later batches (with ``schedule``: spans that change inside a
    phase and come back, so graphs sharing one pool and one set of gradients replay out of capture order): the
    losses and gradient norms of plain bf16 steps given each batch's span, within bf16 rounding."""
    rows = 640 if schedule else 192
    plain, _, _ = _run(graphed=False, device="cuda", rows=rows, spans=True, schedule=schedule)
    fixed, _, graphs = _run(graphed=True, device="cuda", rows=rows, schedule=schedule)
    assert graphs.steps and all(step.graph is not None for step in graphs.steps.values())
    if schedule:
        assert len(graphs.captured) == 7
    for step, (a, b) in enumerate(zip(fixed, plain)):
        assert a.loss == pytest.approx(b.loss, rel=2e-2), (step, a, b)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=5e-2), (step, a, b)
        assert (a.indexer_loss is None) == (b.indexer_loss is None), step


def test_records_name_the_option(tmp_path):
    """The run's start record says whether steps were captured (False here: the default)."""
    out = tmp_path / "run"
    train(TrainConfig(steps=1, dense_steps=1, warmup_steps=0, capacity=96, plot=False, out=str(out)))
    assert records(out, "start")[0]["cuda_graphs"] is False


def test_model_pack_argument_is_checked():
    """DecoderLM(..., pack=) takes a single-device pack of the batch's rows (what GraphedSteps passes)."""
    import dsv4attn
    model = DecoderLM(model_config("tiny", (0,)))
    tokens = torch.zeros(32, dtype=torch.long)
    assert model(tokens, None, None, "dense", pack=dsv4attn.pack_batch(None, 32)).shape[0] == 32
    with pytest.raises(ValueError, match=r"pack= takes a single-device pack of the batch's 32 rows and no "
                                         r"cp_group \(got a pack of 40 rows\)"):
        model(tokens, None, None, "dense", pack=dsv4attn.pack_batch(None, 40))

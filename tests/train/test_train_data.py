"""Training data: determinism from the seed, packing that never crosses documents, the retrieval task's
guarantees (answers beyond the window reach, lengths < 4 and > 128), byte-level text data."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4attn.train.data import (EVAL, IGNORE, KEYS, QUESTION, TRAIN, VALUES, RetrievalTask, TextData,
                                 pack_documents)

REACH = 4 * (8 - 1)          # the tiny model: 4 layers, window 8


def _docs(batch):
    cu = batch.cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _assert_well_packed(batch, capacity):
    cu = batch.cu_seqlens
    assert cu.dtype == torch.int32 and cu[0] == 0 and bool((cu[1:] >= cu[:-1]).all())
    assert batch.tokens.shape == batch.targets.shape == batch.answer_mask.shape == (capacity,)
    assert batch.num_tokens == int(cu[-1]) <= capacity
    assert batch.max_seqlen == max((e - s for s, e in _docs(batch)), default=0)
    for s, e in _docs(batch):
        # next-token targets stay inside the document; its last row predicts nothing
        assert torch.equal(batch.targets[s:e - 1], batch.tokens[s + 1:e])
        assert batch.targets[e - 1] == IGNORE
    assert bool((batch.targets[batch.num_tokens:] == IGNORE).all())        # capacity padding
    assert not bool(batch.answer_mask[batch.num_tokens:].any())
    assert batch.num_targets == int((batch.targets != IGNORE).sum())


@pytest.mark.parametrize("split", [TRAIN, EVAL], ids=["train", "eval"])
def test_retrieval_batches_are_a_function_of_seed_split_index(split):
    task = RetrievalTask(REACH)
    a, b = task.batch(7, split, 3, 512), task.batch(7, split, 3, 512)
    for name in ("tokens", "targets", "answer_mask", "cu_seqlens"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.tokens, task.batch(7, split, 4, 512).tokens)       # another index
    assert not torch.equal(a.tokens, task.batch(8, split, 3, 512).tokens)       # another seed
    assert not torch.equal(task.batch(7, TRAIN, 3, 512).tokens, task.batch(7, EVAL, 3, 512).tokens)


@pytest.mark.parametrize("capacity", [1, 3, 70, 512, 1024], ids=lambda c: f"cap{c}")
def test_packing_never_crosses_documents(capacity):
    task = RetrievalTask(REACH)
    for index in range(6):
        _assert_well_packed(task.batch(0, TRAIN, index, capacity), capacity)


def test_lengths_include_short_and_long_documents():
    task = RetrievalTask(REACH)
    lengths = [e - s for i in range(20) for s, e in _docs(task.batch(0, TRAIN, i, 1024))]
    assert min(lengths) < 4 and max(lengths) > 128


def test_every_answer_is_beyond_the_window_reach_and_matches_its_key():
    task = RetrievalTask(REACH)
    checked = 0
    for index in range(10):
        batch = task.batch(1, TRAIN, index, 1024)
        tok = batch.tokens.numpy()
        for s, e in _docs(batch):
            for row in np.flatnonzero(batch.answer_mask[s:e].numpy()) + s:
                key, value = tok[row - 1], batch.targets[row].item()
                assert tok[row] == QUESTION and key in KEYS and value in VALUES
                stated = [r for r in range(s, row - 1) if tok[r] == key]
                assert len(stated) == 1, "each key is stated once, before its query"
                assert tok[stated[0] + 2] == value                   # statement "K:V "
                assert row - (stated[0] + 2) > REACH                 # no chain of windows reaches the value
                checked += 1
    assert checked > 50


def test_padding_a_batch_adds_capacity_padding_only():
    batch = RetrievalTask(REACH).batch(0, TRAIN, 2, 250)
    padded = batch.padded_to(256)
    _assert_well_packed(padded, 256)
    assert torch.equal(padded.tokens[:250], batch.tokens) and torch.equal(padded.cu_seqlens, batch.cu_seqlens)
    assert (padded.num_tokens, padded.num_targets, padded.max_seqlen) == \
        (batch.num_tokens, batch.num_targets, batch.max_seqlen)
    assert batch.padded_to(250) is batch
    with pytest.raises(ValueError, match="rows must be >= the batch's 250 rows"):
        batch.padded_to(249)


def test_pack_documents_rejects_overflow():
    with pytest.raises(ValueError, match="do not fit the capacity 4"):
        pack_documents([np.arange(3, dtype=np.uint8), np.arange(2, dtype=np.uint8)], [np.zeros(3, bool)] * 2, 4)


def test_text_data_slices_files_without_crossing_them(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 300, encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("b" * 500, encoding="utf-8")
    (tmp_path / ".hidden").write_text("\xff", encoding="latin-1")       # hidden files are skipped
    data = TextData(tmp_path)
    for index in range(5):
        batch = data.batch(0, TRAIN, index, 256)
        _assert_well_packed(batch, 256)
        for s, e in _docs(batch):
            assert len(set(batch.tokens[s:e].tolist())) == 1        # one file per document
        assert batch.num_answers == 0
    assert torch.equal(data.batch(0, EVAL, 0, 256).tokens, TextData(tmp_path).batch(0, EVAL, 0, 256).tokens)

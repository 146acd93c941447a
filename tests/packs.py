"""Helpers shared by the tests: ragged packed batches and random sparse index lists.

Ragged packs always include (STYLE.md, "Tests"): a length-1 document, documents shorter than, equal to and one
longer than the ratio, lengths not divisible by the ratio, an empty document and capacity padding rows.
"""
from __future__ import annotations

import itertools

import torch

import dsv4attn

# Lengths exercising ratio 4: 1, < 4, == 4, 4 + 1, not divisible, an empty document, several groups.
RAGGED_R4 = (1, 3, 4, 0, 5, 8, 9, 13)
# Lengths exercising ratio 128 as well (one long document spans several groups and a tail).
RAGGED_R128 = (1, 3, 4, 0, 5, 128, 300, 129)


def cu_seqlens_of(lengths) -> torch.Tensor:
    """(N+1,) int32 cumulative lengths, flash-attn convention."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def doc_spans(lengths):
    """[(start, length)] of every document, in packed order (empty documents included)."""
    starts = [0, *itertools.accumulate(lengths)][:-1]
    return list(zip(starts, lengths))


def build_pack(lengths, padding: int = 0, max_seqlen: int | None = None) -> dsv4attn.PackedBatch:
    """A packed batch of ``lengths`` followed by ``padding`` capacity rows."""
    total = sum(lengths) + padding
    if max_seqlen is None:
        max_seqlen = max(lengths, default=0)
    return dsv4attn.pack_batch(cu_seqlens_of(lengths), total, max_seqlen)


def random_lengths(gen: torch.Generator, count: int, max_len: int, must=(1, 0)) -> tuple[int, ...]:
    """``count`` random lengths in [0, max_len] plus the ``must`` lengths, shuffled with ``gen``."""
    rand = torch.randint(0, max_len + 1, (count,), generator=gen).tolist()
    lengths = list(must) + rand
    order = torch.randperm(len(lengths), generator=gen).tolist()
    return tuple(lengths[i] for i in order)


def random_indices(gen: torch.Generator, rows: int, num_keys: int, width: int, hole_frac: float = 0.3,
                   empty_rows=(), dtype=torch.int32) -> torch.Tensor:
    """(rows, width) distinct key rows per query row in [0, num_keys), ``-1`` holes, all-``-1`` ``empty_rows``."""
    assert width <= num_keys
    idx = torch.stack([torch.randperm(num_keys, generator=gen)[:width] for _ in range(rows)])
    holes = torch.rand(rows, width, generator=gen) < hole_frac
    idx = idx.masked_fill(holes, -1)
    for r in empty_rows:
        idx[r] = -1
    return idx.to(dtype)


def wrap_chunk_rows(module, monkeypatch, budget: int = 1) -> list:
    """Make ``module.chunk_rows`` use ``budget`` (1 -> one query row per chunk); returns the chunks it yielded."""
    original = module.chunk_rows
    seen = []

    def small(total_rows, per_row_elements, budget_=None, **_):
        for chunk in original(total_rows, per_row_elements, budget=budget):
            seen.append(chunk)
            yield chunk

    monkeypatch.setattr(module, "chunk_rows", small)
    return seen

"""The counting functions of ``benchmarks/cp_trained_selection.py`` against brute-force counts.

On hand-made top-k selections of one causal document (head-tail partition): per rank, the entries its queries see,
own and select (all of them and the remote ones), the distinct entries per block of query rows and how far back
each pick lies; the random indexer's closed form where it is certain (every visible entry taken); the benchmark's
rows per rank equal the library's head-tail partition.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cp_trained_selection as bench  # noqa: E402

from dsv4attn.parallel.partition import segments  # noqa: E402


def _random_selection(T: int, k: int, seed: int) -> torch.Tensor:
    """(T, k) top-k of a causal document: row t picks min(k, V_t) distinct visible entries, -1 fills the rest."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((T, k), -1, dtype=torch.int64)
    for t in range(T):
        v = (t + 1) // 4
        pick = torch.randperm(v, generator=gen)[:k]
        out[t, :len(pick)] = pick
    return out


def _brute_rank(topk: torch.Tensor, world: int, rank: int) -> dict:
    T = topk.shape[0]
    c = T // (2 * world)
    rows = [t for chunk in (rank, 2 * world - 1 - rank) for t in range(chunk * c, (chunk + 1) * c)]
    mine = {t // 4 for t in rows}
    seen = set(range(max((t + 1) // 4 for t in rows)))
    used = {int(j) for t in rows for j in topk[t].tolist() if j >= 0}
    return {"visible": len(seen), "owned": len(mine), "remote": len(seen - mine), "u": len(used),
            "u_remote": len(used - mine)}


def test_hand_made_selection():
    # T = 32, CP 2: chunks of 8 rows; rank 0 holds rows 0-7 and 24-31 (entries 0, 1, 6, 7), rank 1 rows 8-23.
    T, k = 32, 2
    topk = torch.full((T, k), -1, dtype=torch.int64)
    topk[3:8, 0] = 0                               # rows 3-7 see entries 0 (and 1 from row 7): take entry 0
    topk[8:24] = torch.tensor([1, 0])              # rank 1: entries 1 and 0, both rank 0's
    topk[24:32] = torch.tensor([2, 5])             # rank 0's tail: entries 2 and 5, both rank 1's
    assert bench.rank_counts(topk, 2, 0) == {"visible": 8, "owned": 4, "remote": 4, "u": 3, "u_remote": 2}
    assert bench.rank_counts(topk, 2, 1) == {"visible": 6, "owned": 4, "remote": 2, "u": 2, "u_remote": 2}
    assert bench.block_distinct(topk, 8).tolist() == [1, 2, 2, 2]


@pytest.mark.parametrize("T,k,world", [(64, 2, 2), (128, 3, 4), (256, 4, 8), (256, 8, 2)])
def test_rank_counts_match_brute_force(T, k, world):
    topk = _random_selection(T, k, seed=T + k + world)
    for rank in range(world):
        assert bench.rank_counts(topk, world, rank) == _brute_rank(topk, world, rank)
    summary = bench.cp_summary(topk, world, k)
    brute = [_brute_rank(topk, world, r) for r in range(world)]
    assert summary["trained"]["u_remote"] == max(b["u_remote"] for b in brute)
    assert summary["mean_u_remote"] == pytest.approx(sum(b["u_remote"] for b in brute) / world)


def test_block_distinct_matches_brute_force():
    T, k, block = 256, 4, 16
    topk = _random_selection(T, k, seed=1)
    brute = [len({int(j) for t in range(s, s + block) for j in topk[t].tolist() if j >= 0})
             for s in range(0, T, block)]
    assert bench.block_distinct(topk, block).tolist() == brute


def test_random_counts_when_every_visible_entry_is_taken():
    # With k >= every V_t the random indexer takes every visible entry: U equals the brute count of that selection.
    T, world, k = 128, 4, 32
    full = torch.full((T, k), -1, dtype=torch.int64)
    for t in range(T):
        full[t, :(t + 1) // 4] = torch.arange((t + 1) // 4)
    for rank in range(world):
        rand = bench.random_rank_counts(T, world, rank, k)
        brute = _brute_rank(full, world, rank)
        assert rand["u"] == pytest.approx(brute["u"])
        assert rand["u_remote"] == pytest.approx(brute["u_remote"])
    assert bench.random_block_distinct(T, k, 16).tolist() == pytest.approx(bench.block_distinct(full, 16).tolist())


@pytest.mark.parametrize("world", [2, 4, 8])
def test_rows_are_the_library_head_tail_partition(world):
    T = 512
    rows = torch.cat([torch.arange(s, e) for s, e in segments("head_tail", world, 1, T)])
    assert torch.equal(bench.rank_rows(T, world, 1), rows)


def test_pick_distances_match_brute_force():
    T, k = 128, 3
    topk = _random_selection(T, k, seed=2)
    brute = sorted((t + 1) // 4 - 1 - j for t in range(T) if (t + 1) // 4 > k for j in topk[t].tolist() if j >= 0)
    assert sorted(bench.pick_distances(topk, k).tolist()) == brute


def test_selections_record_every_csa_layers_top_k():
    """``selections`` records the top-k each ratio-4 layer of a model computes in one sparse forward."""
    from dsv4attn.train.model import DecoderLM, model_config
    model = DecoderLM(model_config("tiny", (0, 4, 128, 4)))
    tokens = torch.randint(0, 256, (96,))
    picked = bench.selections(model, tokens)
    assert sorted(picked) == [1, 3]
    for topk in picked.values():
        assert topk.dtype == torch.int64 and topk.shape[0] == 96
        assert ((topk >= -1) & (topk < 96 // 4)).all()

"""Compressed entries a *trained* lightning indexer selects under context parallelism (CPU, a trained checkpoint).

``cp_sharded_memory.py`` models U, the number of distinct compressed entries a CP rank's queries select (what a
sharded compressed main KV makes the rank fetch), for a *random* indexer. This script measures U for a trained
one: it loads a checkpoint of ``python -m dsv4attn.train`` (by default the README's tiny model), runs the model's
forward in the ``sparse`` phase on one long document of ``--tokens`` rows built from the built-in retrieval data
(held-out documents laid back to back as one document: one causal sequence, one set of compressed entries), and
records the top-k every CSA (ratio-4) layer computes in that forward (its ``indexer_topk`` call, wrapped while
the forward runs; nothing else changes). ``--check`` recomputes it on the shortest length from the layer's
pieces (``HybridAttention.indexer_inputs`` on its captured input, then ``indexer_topk``) and compares, and
compares the random indexer's closed form with a sampled selection.

For each length, CSA layer and CP size W (head-tail partition: 2W equal chunks, rank i holds chunks i and
2W - 1 - i), per rank: the entries its queries can see (``visible``: entries 0 .. max V_t - 1, V_t =
floor((t + 1) / 4)), the entries it owns (``owned``: the ratio-4 groups inside its chunks) and, of the visible
entries it does not own (``remote``), how many its queries select (U_remote, the rows a sharded main KV would
fetch), for the trained top-k and for a random indexer with the same k (closed form of ``cp_sharded_memory.py``).
Printed: the busiest rank (largest U_remote; trained and random each have their own), U_remote over the rows
an all-gather brings that rank (N_c - owned; the main-KV rows of sharded vs gather) and the mean over ranks.
A second table gives, per block of ``--block`` consecutive query rows, the mean number of distinct entries the
block selects (at most block x k), trained vs random, and how far back the trained picks lie.

    python -m dsv4attn.train --out /tmp/run21          # the README's default model (tiny preset, a few minutes)
    python benchmarks/cp_trained_selection.py --run /tmp/run21 --tokens 1024 4096 16384 32768 65536 --check

The forward is the CPU reference: 16K tokens take ~20 s, 64K ~6 min (the indexer's top-k is quadratic in T).
"""
from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import torch

from cp_sharded_memory import RATIO, expected_unique, owned, rank_rows, sampled_unique, visible
from dsv4attn.layers import attention as attention_module
from dsv4attn.ops import indexer_topk
from dsv4attn.packing import pack_batch
from dsv4attn.train.checkpoint import load_checkpoint
from dsv4attn.train.data import EVAL, make_source
from dsv4attn.train.model import DecoderLM, ModelConfig


# ------------------------------------------------------------------------------------------- model and data

def load_model(run: str) -> tuple[DecoderLM, dict]:
    """The model of a training run's latest intact checkpoint (or of a checkpoint folder), in eval mode."""
    loaded = load_checkpoint(run)
    model = DecoderLM(ModelConfig(**loaded.meta["model_config"]))
    model.load_state_dict(loaded.weights)
    return model.eval(), loaded.meta


def long_document(model: DecoderLM, length: int, seed: int) -> torch.Tensor:
    """(length,) int64 tokens: held-out documents of the built-in retrieval task back to back, cut at ``length``
    (treated as one document)."""
    a = model.config.attention
    source = make_source(None, n_layers=model.config.num_layers, window=a.sliding_window)
    parts, have, index = [], 0, 0
    while have < length:
        batch = source.batch(seed, EVAL, index, 1024)
        parts.append(batch.tokens[:batch.num_tokens])
        have += batch.num_tokens
        index += 1
    return torch.cat(parts)[:length]


@contextmanager
def recording_topk():
    """Record the top-k of every ``indexer_topk`` call HybridAttention's forward makes (the layer module's own name
    for it is wrapped for the duration; the library's function is restored on exit). Reads, changes nothing."""
    calls, inner = [], attention_module.indexer_topk

    def record(*args, **kwargs):
        result = inner(*args, **kwargs)
        chosen = result[0] if isinstance(result, tuple) else result       # (rows, scores) with return_scores
        calls.append(chosen.detach().long())
        return result

    attention_module.indexer_topk = record
    try:
        yield calls
    finally:
        attention_module.indexer_topk = inner


@torch.no_grad()
def selections(model: DecoderLM, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """{block index: (T, k) int64 top-k compressed entries of each query row, -1 = empty} for every ratio-4 layer:
    the top-k the layers compute in one sparse-phase forward of ``tokens`` as one document."""
    T = tokens.shape[0]
    with recording_topk() as calls:
        model(tokens, torch.tensor([0, T], dtype=torch.int32), T, "sparse")
    csa = [i for i, layer in enumerate(model.attention_layers()) if layer.indexer is not None]
    assert len(calls) == len(csa), f"{len(calls)} top-k calls for {len(csa)} ratio-4 layers"
    return dict(zip(csa, calls))


@torch.no_grad()
def selections_from_pieces(model: DecoderLM, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """The same top-k recomputed from each ratio-4 layer's pieces (``indexer_inputs`` on its captured input, then
    ``indexer_topk``), without touching the forward: ``--check`` compares the two."""
    T = tokens.shape[0]
    cu = torch.tensor([0, T], dtype=torch.int32)
    captured: list = []
    model(tokens, cu, T, "sparse", captured=captured)
    pack = pack_batch(cu, T, T)
    k = model.config.attention.index_topk
    out = {}
    for i, (layer, x) in enumerate(captured):
        if layer.indexer is not None:
            seen = layer.indexer_inputs(x, pack)
            out[i] = indexer_topk(seen["index_q"], seen["index_k"], seen["index_weights"], seen["layout"], k).long()
    return out


# ------------------------------------------------------------------------------------------------- counting

def selected_mask(topk: torch.Tensor, n_entries: int) -> torch.Tensor:
    """(n_entries,) bool: the entries that at least one row of ``topk`` (rows, k; -1 = empty) selects."""
    mask = torch.zeros(n_entries, dtype=torch.bool)
    mask[topk[topk >= 0]] = True
    return mask


def rank_counts(topk: torch.Tensor, world: int, rank: int) -> dict:
    """Counts of one head-tail rank for the selection ``topk`` (T, k) of one document of T rows: ``visible``
    (entries its queries can see), ``owned`` (entries it holds), ``remote`` (visible, not owned), ``u`` (distinct
    entries its queries select) and ``u_remote`` (of those, not owned: the rows a sharded main KV fetches)."""
    T = topk.shape[0]
    n = T // RATIO
    rows = rank_rows(T, world, rank)
    mine = owned(T, world, rank)
    seen = torch.arange(n) < int(visible(T)[rows].max())
    used = selected_mask(topk[rows], n)
    return {"visible": int(seen.sum()), "owned": int(mine.sum()), "remote": int((seen & ~mine).sum()),
            "u": int(used.sum()), "u_remote": int((used & ~mine).sum())}


def random_rank_counts(T: int, world: int, rank: int, k: int) -> dict:
    """Expected ``u`` and ``u_remote`` of one head-tail rank for a random indexer with top-k ``k``."""
    n = T // RATIO
    p = expected_unique(visible(T)[rank_rows(T, world, rank)], n, k)
    return {"u": float(p.sum()), "u_remote": float(p[~owned(T, world, rank)].sum())}


def block_distinct(topk: torch.Tensor, block: int) -> torch.Tensor:
    """(T // block,) distinct entries selected by each block of ``block`` consecutive query rows."""
    n = topk.shape[0] // RATIO
    return torch.tensor([int(selected_mask(topk[s:s + block], n).sum())
                         for s in range(0, topk.shape[0] - block + 1, block)], dtype=torch.float64)


def random_block_distinct(T: int, k: int, block: int) -> torch.Tensor:
    """(T // block,) expected distinct entries per block of query rows for a random indexer with top-k ``k``."""
    v, n = visible(T), T // RATIO
    return torch.tensor([float(expected_unique(v[s:s + block], n, k).sum())
                         for s in range(0, T - block + 1, block)], dtype=torch.float64)


def pick_distances(topk: torch.Tensor, k: int) -> torch.Tensor:
    """(picks,) how many entries back each pick lies (V_t - 1 - j: 0 = the newest visible entry), over the rows
    that see more than ``k`` entries (where the indexer chooses)."""
    v = visible(topk.shape[0])
    choosing = topk[v > k]
    back = (v[v > k] - 1)[:, None] - choosing
    return back[choosing >= 0]


def cp_summary(topk: torch.Tensor, world: int, k: int) -> dict:
    """Busiest rank (largest U_remote) and the mean over ranks, trained and random."""
    T = topk.shape[0]
    trained = [rank_counts(topk, world, r) for r in range(world)]
    rand = [random_rank_counts(T, world, r, k) for r in range(world)]
    busy = max(range(world), key=lambda r: trained[r]["u_remote"])
    busy_rand = max(range(world), key=lambda r: rand[r]["u_remote"])
    frac = lambda c, r: c["u_remote"] / max(trained[r]["remote"], 1)       # noqa: E731
    return {"busy": busy, "busy_rand": busy_rand, "trained": trained[busy], "rand": rand[busy_rand],
            "rand_remote": trained[busy_rand]["remote"],
            "mean_u_remote": sum(c["u_remote"] for c in trained) / world,
            "mean_rand_u_remote": sum(c["u_remote"] for c in rand) / world,
            "mean_frac": sum(frac(c, r) for r, c in enumerate(trained)) / world,
            "mean_rand_frac": sum(frac(c, r) for r, c in enumerate(rand)) / world}


def print_random_check(T: int, world: int, k: int) -> None:
    """The random indexer's closed-form U of every rank beside one sampled selection."""
    n = T // RATIO
    for rank in range(world):
        rows = visible(T)[rank_rows(T, world, rank)]
        print(f"check T={T} CP={world} rank {rank}: random U closed form "
              f"{float(expected_unique(rows, n, k).sum()):.1f}, sampled {sampled_unique(rows, n, k):.0f}")


# ------------------------------------------------------------------------------------------------------ tables

CP_HEADER = ("| tokens | layer | CP | busiest rank | visible | owned | remote visible | U trained | U_remote trained "
             "| fetched / remote visible, trained | U_remote random | fetched / remote visible, random | "
             "fetched / gathered rows, trained / random | mean U_remote over ranks, trained / random | "
             "mean fetched / remote visible, trained / random |")


def cp_row(T: int, layer: int, world: int, topk: torch.Tensor, k: int) -> str:
    """One row of the CP table (busiest rank of each indexer; gathered rows = the N_c - owned an all-gather
    brings)."""
    s = cp_summary(topk, world, k)
    c, r = s["trained"], s["rand"]
    gathered = T // RATIO - c["owned"]
    return (f"| {T} | {layer} | {world} | {s['busy']} | {c['visible']} | {c['owned']} | {c['remote']} | {c['u']} | "
            f"{c['u_remote']} | {c['u_remote'] / max(c['remote'], 1):.3f} | {r['u_remote']:.0f} | "
            f"{r['u_remote'] / max(s['rand_remote'], 1):.3f} | "
            f"{c['u_remote'] / gathered:.3f} / {r['u_remote'] / gathered:.3f} | "
            f"{s['mean_u_remote']:.0f} / {s['mean_rand_u_remote']:.0f} | "
            f"{s['mean_frac']:.3f} / {s['mean_rand_frac']:.3f} |")


def block_row(T: int, layer: int, topk: torch.Tensor, rand_blocks: torch.Tensor, block: int, k: int) -> str:
    """One row of the per-block table: mean distinct entries per block, over all blocks and the last quarter;
    how far back the picks lie (median, share within the newest ``block`` entries; a random pick's median is
    about half the visible count)."""
    blocks = block_distinct(topk, block)
    last = slice(-max(len(blocks) // 4, 1), None)
    back = pick_distances(topk, k).double()
    return (f"| {T} | {layer} | {blocks.mean():.1f} | {rand_blocks.mean():.1f} | {blocks[last].mean():.1f} | "
            f"{rand_blocks[last].mean():.1f} | {block * k} | {back.median():.0f} | "
            f"{(back < block).double().mean():.3f} |")


def print_table(header: str, rows: list[str]) -> None:
    print("\n" + header)
    print("|" + "---|" * (header.count("|") - 1))
    print("\n".join(rows))


# -------------------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/default", help="run directory (its latest checkpoint) or checkpoint")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--block", type=int, default=64, help="query rows per block for the per-block table")
    ap.add_argument("--seed", type=int, default=0, help="seed of the held-out documents")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check", action="store_true", help="on the shortest length, recompute the top-k from the "
                    "layer pieces and sample the random indexer")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, meta = load_model(args.run)
    k = model.config.attention.index_topk
    print(f"checkpoint step {meta['step']}, ratios {model.config.attention.compress_ratios}, index_topk {k}, "
          f"torch {torch.__version__}, {args.threads} thread(s)")
    cp_rows, block_rows = [], []
    for T in args.tokens:
        tokens = long_document(model, T, args.seed)
        t0 = time.perf_counter()
        picks = selections(model, tokens)
        print(f"T={T}: forward {time.perf_counter() - t0:.1f} s", flush=True)
        if args.check and T == min(args.tokens):
            pieces = selections_from_pieces(model, tokens)
            same = pieces.keys() == picks.keys() and all(torch.equal(pieces[i], picks[i]) for i in picks)
            print(f"check T={T}: the forward's top-k == the one recomputed from the layer pieces: {same}")
            print_random_check(T, max(args.world), k)
        rand_blocks = random_block_distinct(T, k, args.block)
        for layer, topk in picks.items():
            block_rows.append(block_row(T, layer, topk, rand_blocks, args.block, k))
            cp_rows += [cp_row(T, layer, world, topk, k) for world in args.world if T % (2 * world * RATIO) == 0]
    print_table(CP_HEADER, cp_rows)
    print_table(f"| tokens | layer | distinct entries per {args.block}-row block, trained | random | last quarter "
                f"of the blocks, trained | random | at most | median pick distance, entries back (trained) | "
                f"share of picks within the newest {args.block} entries (trained) |", block_rows)


if __name__ == "__main__":
    main()

"""Compressed memory under context parallelism: the all-gather the layers do today vs a sharded main KV (a model).

Today every CP rank all-gathers a CSA layer's whole compressed state (main KV, D = 512, and indexer keys, Di = 128,
both bf16) and reduce-scatters its gradients. The sharded alternative (``pack_batch(..., cp_compressed="sharded")``,
its bytes in the test runs counted in BENCHMARKS.md; modelled here): each rank keeps only the
main-KV entries of its own rows, the narrow indexer keys stay all-gathered (every query scores every visible
entry), and after top-k each rank fetches the selected main-KV rows it does not own, the backward sending their
fp32 gradients back. Its cost is set by U, the number of distinct entries a rank's queries select.

U for a *random* indexer (each query t picks min(k, V_t) of its V_t = floor((t + 1) / 4) visible entries uniformly,
one causal document) in closed form: entry j is unused by the rank's queries Q with probability
prod_{t in Q, V_t > j} (1 - min(k, V_t) / V_t). ``--check`` compares it with a sampled selection. A trained
indexer concentrates its picks, so these U are an upper bound on what training would fetch.

Per rank and CSA layer the script prints the bytes each scheme moves (forward bf16 rows, backward fp32
gradients) and holds (the compressed state kept for the backward), for the head-tail partition (the load-balanced
one; rank i holds chunks i and 2W - 1 - i) and the busiest rank. Times use assumed link rates (``--intra-gbs``
within a node of ``--node`` GPUs, ``--inter-gbs`` beyond), not measurements.

    python benchmarks/cp_sharded_memory.py --tokens 131072 1048576 --world 2 4 8 16 32 64 [--check]
"""
from __future__ import annotations

import argparse

import torch

D, DI, TOPK, RATIO = 512, 128, 512, 4


def visible(T: int) -> torch.Tensor:
    """(T,) visible compressed entries per query of one causal document of T tokens."""
    return torch.div(torch.arange(1, T + 1, dtype=torch.int64), RATIO, rounding_mode="floor")


def rank_rows(T: int, world: int, rank: int) -> torch.Tensor:
    """Rows of ``rank`` under the head-tail partition (2W equal chunks; T divisible by 2W)."""
    c = T // (2 * world)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * world - 1 - rank) * c,
                                                                            (2 * world - rank) * c)])


def expected_unique(v_rows: torch.Tensor, n_entries: int, k: int = TOPK) -> torch.Tensor:
    """(n_entries,) probability that each entry is selected by at least one of the queries with visible counts
    ``v_rows`` (random indexer)."""
    v = v_rows[v_rows > 0]
    certain = v <= k                                        # these queries take every visible entry
    log_keep = torch.log1p(-(k / v[~certain].double()))    # log P(a given visible entry is not picked)
    # sum over queries with V_t > j of log_keep: a suffix sum over V values.
    by_v = torch.zeros(n_entries + 1, dtype=torch.float64).index_add_(0, v[~certain], log_keep)
    suffix = by_v.flip(0).cumsum(0).flip(0)                 # suffix[x] = sum over queries with V_t >= x
    j = torch.arange(n_entries)
    unused = torch.exp(suffix[j + 1])                       # queries with V_t > j, i.e. V_t >= j + 1
    max_certain = int(v[certain].max()) if certain.any() else 0
    return torch.where(j < max_certain, torch.ones_like(unused), 1.0 - unused)


def sampled_unique(v_rows: torch.Tensor, n_entries: int, k: int = TOPK, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    used = torch.zeros(n_entries, dtype=torch.bool)
    for vt in v_rows.tolist():
        if vt == 0:
            continue
        pick = torch.arange(vt) if vt <= k else torch.randperm(vt, generator=gen)[:k]
        used[pick] = True
    return float(used.sum())


def owned(T: int, world: int, rank: int) -> torch.Tensor:
    """(N_c,) bool: the compressed entries whose pooled rows (the ratio-4 group 4j .. 4j + 3) lie in the rank's
    chunks (an entry's group never straddles chunks when the chunk length is a multiple of 4)."""
    n = T // RATIO
    rows = rank_rows(T, world, rank)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.unique(torch.div(rows, RATIO, rounding_mode="floor"))[: n]] = True
    return mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[131072, 1048576])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--layers", type=int, default=21, help="CSA layers, for the memory column")
    ap.add_argument("--node", type=int, default=8, help="GPUs per node")
    ap.add_argument("--intra-gbs", type=float, default=400.0, help="assumed per-GPU rate within a node, GB/s")
    ap.add_argument("--inter-gbs", type=float, default=50.0, help="assumed per-GPU rate across nodes, GB/s")
    ap.add_argument("--check", action="store_true", help="compare the closed form with a sampled selection")
    args = ap.parse_args()

    if args.check:
        for T, world in ((16384, 4), (32768, 8)):
            v = visible(T)
            for rank in (0, world - 1):
                q = v[rank_rows(T, world, rank)]
                exact = float(expected_unique(q, T // RATIO).sum())
                print(f"check T={T} W={world} rank {rank}: closed form U = {exact:.0f}, sampled "
                      f"{sampled_unique(q, T // RATIO):.0f}")

    print("| tokens | CP | U busiest rank | U / N_c | all-gather fwd+bwd MiB | sharded fwd+bwd MiB | bytes ratio "
          "| all-gather held MiB | sharded held MiB | held ratio | all-gather ms | sharded ms | "
          f"{args.layers} layers held GiB (AG / sharded) |")
    print("|" + "---|" * 13)
    for T in args.tokens:
        v = visible(T)
        n = T // RATIO
        for world in args.world:
            if T % (2 * world * RATIO):
                continue
            worst = None
            for rank in range(world):
                p = expected_unique(v[rank_rows(T, world, rank)], n)
                mine = owned(T, world, rank)
                u, u_remote = float(p.sum()), float(p[~mine].sum())
                if worst is None or u_remote > worst[1]:
                    worst = (u, u_remote)
            u, u_remote = worst
            share = (world - 1) / world
            ag_move = share * n * (D + DI) * (2 + 4)            # bf16 rows gathered, fp32 gradients scattered
            sh_move = share * n * DI * (2 + 4) + u_remote * D * (2 + 4)
            ag_held = n * (D + DI) * 2
            sh_held = n / world * D * 2 + n * DI * 2 + u_remote * D * 2
            rate = (args.intra_gbs if world <= args.node else args.inter_gbs) * 1e9
            mib = 2.0 ** 20
            print(f"| {T} | {world} | {u:.0f} | {u / n:.3f} | {ag_move / mib:.0f} | {sh_move / mib:.0f} | "
                  f"{sh_move / ag_move:.2f} | {ag_held / mib:.0f} | {sh_held / mib:.0f} | {sh_held / ag_held:.2f} | "
                  f"{ag_move / rate * 1e3:.2f} | {sh_move / rate * 1e3:.2f} | "
                  f"{args.layers * ag_held / 2**30:.2f} / {args.layers * sh_held / 2**30:.2f} |")


if __name__ == "__main__":
    main()

"""Work per context-parallel rank on a causal pack: contiguous slices vs head-tail ("zigzag") chunks.

Counts, per rank, the query-side work of one CSA layer (Flash geometry by default): attention keys
(window + min(top-k, visible) compressed), and indexer scores (every visible compressed entry, the quadratic part),
from the packing metadata alone (no model is run). Prints max/mean per partition, for a single long document and for
a pack of documents. The head-tail partition cuts the batch into 2W chunks and gives rank i chunks i and 2W-1-i.

    python benchmarks/cp_work_balance.py --rows 131072 --world 2 4 8
"""
from __future__ import annotations

import argparse

import torch

import dsv4attn


def per_row_work(pack, cfg):
    layout = pack.compressed(4)
    window = torch.minimum(pack.row_position + 1, torch.tensor(cfg.sliding_window)) * pack.row_is_real
    visible = layout.row_visible
    attention = window + torch.minimum(visible, torch.tensor(cfg.index_topk))
    return attention.double(), visible.double()


def ranks_of(rows: int, world: int, head_tail: bool) -> torch.Tensor:
    if not head_tail:
        return torch.arange(rows) // (rows // world)
    chunk = torch.arange(rows) // (rows // (2 * world))
    return torch.where(chunk < world, chunk, 2 * world - 1 - chunk)


def imbalance(work: torch.Tensor, ranks: torch.Tensor, world: int) -> float:
    per_rank = torch.zeros(world, dtype=torch.float64).index_add_(0, ranks, work)
    return float(per_rank.max() / per_rank.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=131072)
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--doc-len", type=int, nargs="+", default=[0, 16384], help="0: one document")
    args = ap.parse_args()
    cfg = dsv4attn.AttentionConfig.flash()
    print(f"max / mean work per rank, CSA layer, Flash geometry, T = {args.rows}")
    print("| documents | W | attention contiguous | attention head-tail | indexer contiguous | indexer head-tail |")
    print("|---|---|---|---|---|---|")
    for doc in args.doc_len:
        length = doc or args.rows
        cu = torch.arange(0, args.rows + 1, length, dtype=torch.int32)
        pack = dsv4attn.pack_batch(cu, args.rows, length)
        attention, indexer = per_row_work(pack, cfg)
        for world in args.world:
            cells = [imbalance(w, ranks_of(args.rows, world, ht), world)
                     for w in (attention, indexer) for ht in (False, True)]
            label = "one" if doc == 0 else f"{args.rows // length} x {length}"
            print(f"| {label} | {world} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()

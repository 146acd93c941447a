"""How the rows of a packed batch are split over the ranks of a context-parallel group.

The batch of T rows is cut into equal *chunks*; each rank holds some chunks, in increasing row order, back to
back in its local tensor (its *segments*).

- ``"contiguous"`` (docs/semantics.md, decision 10): W chunks, rank i holds chunk i.
- ``"head_tail"``: 2W chunks, rank i holds chunk i and chunk 2W-1-i. Under causal attention the work of a row
  grows with its position in its document; pairing an early chunk with a late one evens the work of one long
  document over the ranks (``benchmarks/cp_work_balance.py`` counts it). Same results, same communication
  pattern (one left halo per segment, one all-gather per compressed state).
"""
from __future__ import annotations

from functools import lru_cache

PARTITIONS = ("contiguous", "head_tail")


def check_partition(partition: str) -> str:
    if partition not in PARTITIONS:
        raise ValueError(f"cp_partition must be one of {PARTITIONS}, got {partition!r}")
    return partition


def num_chunks(partition: str, world: int) -> int:
    return world if check_partition(partition) == "contiguous" else 2 * world


def chunks_of_rank(partition: str, world: int, rank: int) -> tuple[int, ...]:
    """The chunks rank ``rank`` holds, in local (= increasing row) order."""
    if check_partition(partition) == "contiguous":
        return (rank,)
    return (rank, 2 * world - 1 - rank)


@lru_cache(maxsize=None)
def chunk_slots(partition: str, world: int) -> tuple[int, ...]:
    """For every chunk c, its slot ``rank * chunks_per_rank + position in that rank's list``: where the block of
    per-chunk data a rank contributes to an all-gather (rank-major, then local order) lands."""
    per_rank = num_chunks(partition, world) // world
    slots = [0] * num_chunks(partition, world)
    for rank in range(world):
        for pos, chunk in enumerate(chunks_of_rank(partition, world, rank)):
            slots[chunk] = rank * per_rank + pos
    return tuple(slots)


def chunk_rows(partition: str, world: int, total_rows: int) -> int:
    """Rows per chunk; raises if the batch does not split evenly (nothing is silently padded)."""
    n = num_chunks(partition, world)
    if total_rows % n:
        raise ValueError(f"the packed batch has {total_rows} rows, which does not split into {n} equal chunks "
                         f"({partition!r} partition over {world} context-parallel ranks); pad the capacity to a "
                         f"multiple of {n}")
    return total_rows // n


def segments(partition: str, world: int, rank: int, total_rows: int) -> list[tuple[int, int]]:
    """Global ``[start, end)`` row ranges of this rank's chunks, in local order."""
    rows = chunk_rows(partition, world, total_rows)
    return [(c * rows, (c + 1) * rows) for c in chunks_of_rank(partition, world, rank)]

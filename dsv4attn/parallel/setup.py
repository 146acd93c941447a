"""Building the context-parallel frame of one layer call (decision 10).

The packed batch of T rows is split into W contiguous equal slices of S = T / W rows; rank i holds global rows
``[i*S, (i+1)*S)`` and every rank passes the same *global* ``cu_seqlens``. A layer needs, left of its slice, the
hidden states of ``halo`` rows (max(window, 8 for ratio 4, 128 for ratio 128)) to build its raw window keys and
the compressed groups it owns; they come from the previous rank, and their gradient goes back there.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..packing import PackedBatch, pack_batch
from . import comm
from .frame import RowFrame


def check_rows_per_rank(rows_per_rank: int, halo: int, world: int) -> None:
    """Host-only check, so every rank raises the same error before any collective (no hang)."""
    if world > 1 and rows_per_rank < halo:
        raise ValueError(f"too few rows per context-parallel rank: each of the {world} ranks holds "
                         f"{rows_per_rank} rows, but this layer needs a left halo of {halo} rows from one neighbour; "
                         f"use at least {halo} rows per rank (a larger batch or fewer ranks)")


def as_process_group(cp_group):
    """A ProcessGroup, or a 1-D DeviceMesh (its group); anything else raises a TypeError naming ``cp_group``."""
    if hasattr(cp_group, "get_group") and hasattr(cp_group, "ndim"):
        if cp_group.ndim != 1:
            raise ValueError(f"cp_group must be a ProcessGroup or a 1-D DeviceMesh, got a {cp_group.ndim}-D mesh")
        cp_group = cp_group.get_group()
    if not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(f"cp_group must be a torch.distributed ProcessGroup (or a 1-D DeviceMesh), "
                        f"got {type(cp_group).__name__}")
    return cp_group


def context_parallel_frame(x_local: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int | None, group,
                           halo: int, pack: PackedBatch | None = None) -> tuple[RowFrame, torch.Tensor]:
    """(frame, x_keys): x_keys = [left halo ; x_local] hidden states, the rows whose raw KV this rank computes."""
    group = as_process_group(group)
    world, rank = comm.world_and_rank(group)
    rows = x_local.shape[0]
    check_rows_per_rank(rows, halo, world)
    total = rows * world
    if pack is None:
        pack = pack_batch(cu_seqlens, total, max_seqlen, device=x_local.device)
    elif pack.total_rows != total:
        raise ValueError(f"pack must describe the global batch of {total} rows ({world} ranks x {rows}), "
                         f"got {pack.total_rows}")
    start = rank * rows
    width = halo if world > 1 else 0
    x_keys = torch.cat([comm.left_halo(x_local, width, group), x_local], dim=0) if width else x_local
    key_start = start - (width if rank > 0 else 0)
    return RowFrame(pack=pack, start=start, end=start + rows, key_start=key_start, group=group), x_keys

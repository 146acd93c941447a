"""Building the context-parallel frame of one layer call (docs/semantics.md, decision 10).

The packed batch of T rows is split into equal chunks over the W ranks (:mod:`.partition`: contiguous, rank i
holds rows ``[i*S, (i+1)*S)``; or head-tail, two chunks per rank) and every rank passes the same *global*
``cu_seqlens``. A layer needs, left of each of its chunks, the hidden states of ``halo`` rows (max(window, 8 for
ratio 4, 128 for ratio 128)) to build its raw window keys and the compressed groups it owns; they come from the
rank holding the previous chunk, and their gradient goes back there."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import checks
from ..packing import PackedBatch, pack_batch
from . import agree, comm
from . import partition as partition_
from .frame import RowFrame, Segment


def halo_rows(config, compress_ratio: int) -> int:
    """Rows of hidden states a context-parallel chunk needs from the chunk left of it: max(window, 8 for ratio 4
    (its group and the previous one, overlapping), 128 for ratio 128) (docs/semantics.md, decision 10)."""
    return max(config.sliding_window, {0: 0, 4: 8, 128: 128}[compress_ratio])


def check_rows_per_rank(rows_per_chunk: int, halo: int, world: int, partition: str = "contiguous") -> None:
    """Host-only check, so every rank raises the same error before any collective (no hang)."""
    if world > 1 and rows_per_chunk < halo:
        held = (f"{rows_per_chunk} rows" if partition == "contiguous"
                else f"two chunks of {rows_per_chunk} rows ({partition!r} partition)")
        raise ValueError(f"too few rows per context-parallel rank: each of the {world} ranks holds {held}, but "
                         f"this layer needs a left halo of {halo} rows from one neighbouring chunk; use at least "
                         f"{halo} rows per chunk (a larger batch or fewer ranks)")


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
                           halo: int, pack: PackedBatch | None = None, partition: str = "contiguous", *,
                           phase: str | None = None, compress_ratio: int | None = None,
                           failed: Exception | None = None) -> tuple[RowFrame, torch.Tensor]:
    """(frame, x_keys): x_keys = ``[halo_0 ; segment_0 ; ...]`` hidden states, the rows whose raw KV this rank
    computes (see :mod:`.partition` for which rows a rank holds).

    The first collective is the ranks' agreement on the call's metadata (:mod:`.agree`; ``phase`` and
    ``compress_ratio`` say which call this is): any difference, or a rank whose own checks below failed, raises a
    ValueError on every rank before the halo exchange. ``failed``: an error the caller's own checks already raised
    on this rank; it joins the agreement as failed, then raises it."""
    group = as_process_group(group)
    world, rank = comm.world_and_rank(group)
    rows = x_local.shape[0] if x_local.dim() else 0
    local_error, frame_pack = failed, None
    try:
        if failed is not None:
            raise failed
        # Rank-local checks: a rank failing one still joins the agreement below, so no other rank waits for it.
        partition_.check_partition(partition)
        per_rank = partition_.num_chunks(partition, world) // world
        if rows % per_rank:
            raise ValueError(f"hidden_states has {rows} rows, which is not {per_rank} equal chunks ({partition!r} "
                             f"partition); pass this rank's rows from dsv4attn.parallel.shard")
        check_rows_per_rank(rows // per_rank, halo, world, partition)
        total = rows * world
        if pack is None:
            frame_pack = pack_batch(cu_seqlens, total, max_seqlen, device=x_local.device)
        elif pack.total_rows != total:
            raise ValueError(f"pack must describe the global batch of {total} rows ({world} ranks x {rows}), "
                             f"got {pack.total_rows}")
        else:
            frame_pack = pack
    except (ValueError, TypeError) as err:
        local_error = err
    if checks.reads_possible():
        known = frame_pack is not None
        mine = agree.digest(total_rows=frame_pack.total_rows if known else None,
                            cu_values=frame_pack.host_cu_seqlens if known else None,
                            max_seqlen=frame_pack.max_seqlen if known else None, partition=partition, phase=phase,
                            compress_ratio=compress_ratio, rows=rows, halo=halo, failed=local_error is not None)
        message = agree.mismatch_message(agree.agree(group, mine, x_local.device))
        if local_error is not None:
            raise local_error                       # this rank's own, more precise error
        if message is not None:
            raise ValueError(message)
    elif local_error is not None:
        raise local_error
    pack = frame_pack
    width = halo if world > 1 else 0
    x_keys = comm.with_left_halos(x_local, width, group, partition) if width else x_local
    segments, offset = [], 0
    for start, end in partition_.segments(partition, world, rank, total):
        key_start = start - (width if start > 0 else 0)
        segments.append(Segment(start, end, key_start, offset))
        offset += end - key_start
    return RowFrame(pack=pack, segments=tuple(segments), group=group, partition=partition), x_keys

"""Building the context-parallel frame of one layer call (docs/semantics.md, decision 10).

The packed batch of T rows is split into equal chunks over the W ranks (:mod:`.partition`: contiguous, rank i
holds rows ``[i*S, (i+1)*S)``; or head-tail, two chunks per rank) and every rank passes the same *global*
``cu_seqlens``. A layer needs, left of each of its chunks, the hidden states of ``halo`` rows (max(window, 8 for
ratio 4, 128 for ratio 128)) to build its raw window keys and the compressed groups it owns; they come from the
rank holding the previous chunk, and their gradient goes back there.

Two ways in: a pack built with ``cp_group`` (:func:`agreed_pack`: the ranks agree once per batch, and the pack
caches one frame per distinct halo, :func:`pack_frame`; not while ``torch.compile`` traces,
:func:`dsv4attn.packing.cached`), or the per-call path (:func:`context_parallel_frame`: the
layer builds or takes a group-less pack and the ranks agree on every call). :func:`layer_frame` picks one."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import checks
from ..packing import PackedBatch, cached, pack_batch
from . import agree, comm
from . import partition as partition_
from .frame import RowFrame, Segment, single_device_frame


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
    return comm.as_process_group(cp_group, "cp_group")


def agreed_pack(cu_seqlens, total_rows: int, max_seqlen, device, cp_group, cp_partition,
                cp_compressed: str = "gather") -> PackedBatch:
    """:func:`dsv4attn.pack_batch` with ``cp_group``: the pack of the global batch, after the ranks agreed on it.

    The one agreement of the batch: (T, cu_seqlens, max_seqlen, partition, local rows, cp_compressed). Phase,
    compress ratio and halo are the layers' and are left out (UNKNOWN on every rank): with a CP pack a layer call
    communicates nothing but its halo and compressed rows, so a rank-dependent phase or layer order is not caught
    here (the model runs the same layers with one phase on every rank; ``cu_seqlens=`` calls keep the per-call
    check)."""
    group = as_process_group(cp_group)
    world, _ = comm.world_and_rank(group)
    partition = "contiguous" if cp_partition is None else cp_partition
    try:
        # Rank-local checks: a rank failing one still joins the agreement, so no other rank waits for it.
        partition_.check_partition(partition)
        chunks = partition_.num_chunks(partition, world)
        if isinstance(total_rows, int) and not isinstance(total_rows, bool) and total_rows % chunks:
            raise ValueError(f"total_rows={total_rows} is not {chunks} equal chunks ({world} ranks, {partition!r} "
                             f"partition); pad the global batch to a multiple of {chunks} rows")
        pack = pack_batch(cu_seqlens, total_rows, max_seqlen, device)
    except (ValueError, TypeError):
        where = (torch.device(device) if device is not None
                 else cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu"))
        _agree(group, None, partition, None, None, None, None, True, where, cp_compressed)
        raise                                   # this rank's own error (bare: see _agree)
    _agree(group, pack, partition, total_rows // world, None, None, None, False, pack.device, cp_compressed)
    # A new pack starts with empty caches: frames hold this group's segments, never a single-device pack's.
    return dataclasses.replace(pack, cp_group=group, cp_partition=partition, cp_compressed=cp_compressed)


def _agree(group, pack, partition, rows, phase, compress_ratio, halo, failed: bool, device,
           cp_compressed=None) -> None:
    """The ranks' agreement (:mod:`.agree`): raises the common mismatch error. A rank whose own checks ``failed``
    only takes part: its caller then raises its own, more precise error.

    That caller calls this from the ``except`` clause of its checks and then re-raises with a bare ``raise``, so
    that no local variable holds the error: a frame in an error's traceback that holds the error is a reference
    cycle, which keeps the locals of every such frame, the process group among them, alive until the garbage
    collector runs. A script that caught the error and called ``dist.destroy_process_group()`` then did not
    destroy the gloo group (its destructor joins the worker threads), and a worker thread still releasing the
    agreement's all-gather (freeing its tensors takes the GIL) when the interpreter finalized aborted the process,
    about one run in 20 ("terminate called without an active exception")."""
    if not checks.reads_possible():
        return
    known = pack is not None
    mine = agree.digest(total_rows=pack.total_rows if known else None,
                        cu_values=pack.host_cu_seqlens if known else None,
                        max_seqlen=pack.max_seqlen if known else None, partition=partition, phase=phase,
                        compress_ratio=compress_ratio, rows=rows, halo=halo, failed=failed,
                        compressed=cp_compressed)
    message = agree.mismatch_message(agree.agree(group, mine, device))
    if message is not None and not failed:
        raise ValueError(message)


def layer_frame(x: torch.Tensor, *, cu_seqlens, max_seqlen, pack: PackedBatch | None, cp_group, cp_partition,
                halo: int, phase: str, compress_ratio: int,
                failed: Exception | None = None) -> tuple[RowFrame, torch.Tensor]:
    """(frame, x_keys) of one layer call, whichever way the batch came: a CP pack (its cached frame, no
    agreement), a single-device call (the pack's frame), or ``cp_group`` with ``cu_seqlens`` or a pack built
    without a group (the per-call agreement of :func:`context_parallel_frame`, as before CP packs)."""
    try:
        if getattr(pack, "cp_group", None) is not None:       # a non-pack fails its own check (in `failed`)
            if failed is not None:
                raise failed
            _check_same_group(pack, cp_group, cp_partition)
            world, _ = comm.world_and_rank(pack.cp_group)
            if x.shape[0] * world != pack.total_rows:
                raise ValueError(f"hidden_states has {x.shape[0]} rows, but the pack's global batch of "
                                 f"{pack.total_rows} rows gives each of the {world} ranks {pack.total_rows // world}; "
                                 f"pass this rank's rows from dsv4attn.parallel.shard")
            frame = pack_frame(pack, halo)
            return frame, _keys_with_halos(x, frame, halo)
        if cp_group is None:
            if failed is not None:
                raise failed
            if pack is None:
                pack = pack_batch(cu_seqlens, x.shape[0], max_seqlen, device=x.device)
            elif pack.total_rows != x.shape[0]:
                raise ValueError(f"pack was built for {pack.total_rows} rows, hidden_states has {x.shape[0]}")
            return pack_frame(pack, 0), x
        return context_parallel_frame(x, cu_seqlens, max_seqlen, cp_group, halo, pack, cp_partition or "contiguous",
                                      phase=phase, compress_ratio=compress_ratio, failed=failed)
    finally:
        failed = None           # it may be raised through this frame: no local may hold it (see _agree)


def _check_same_group(pack: PackedBatch, cp_group, cp_partition) -> None:
    """A CP pack says which group and partition it was agreed for; a layer argument naming others is a mistake
    (the frame and the agreement would belong to another group), not something to pick one of silently."""
    if cp_group is not None and as_process_group(cp_group) is not pack.cp_group:
        raise ValueError("cp_group differs from the group the pack was built with (pack_batch(..., cp_group=...)); "
                         "pass only pack= (the layer uses its group), or build the pack with this group")
    if cp_partition is not None and cp_partition != pack.cp_partition:
        raise ValueError(f"cp_partition={cp_partition!r} differs from the pack's {pack.cp_partition!r} (pack_batch("
                         f"..., cp_partition=...)); pass only pack=, or build the pack with this partition")


def pack_frame(pack: PackedBatch, halo: int) -> RowFrame:
    """The pack's frame for layers of this ``halo``, built on first use and kept in the pack: the segments (and
    the per-ratio ownership tables the frame caches) depend only on the pack and the halo, so every layer of a
    batch with the same halo shares them. A single-device pack has one frame (no halo)."""
    key = halo if pack.cp_group is not None else 0
    return cached(pack._frames, key, lambda: _build_frame(pack, halo))


def _build_frame(pack: PackedBatch, halo: int) -> RowFrame:
    if pack.cp_group is None:
        return single_device_frame(pack)
    world, rank = comm.world_and_rank(pack.cp_group)
    per_rank = partition_.num_chunks(pack.cp_partition, world) // world
    # Host-only and from agreed values: every rank raises it alike, before any collective.
    check_rows_per_rank(pack.total_rows // world // per_rank, halo, world, pack.cp_partition)
    return _row_frame(pack, pack.cp_group, pack.cp_partition, halo, world, rank)


def _row_frame(pack, group, partition, halo, world, rank) -> RowFrame:
    width = halo if world > 1 else 0
    segments, offset = [], 0
    for start, end in partition_.segments(partition, world, rank, pack.total_rows):
        key_start = start - (width if start > 0 else 0)
        segments.append(Segment(start, end, key_start, offset))
        offset += end - key_start
    return RowFrame(pack=pack, segments=tuple(segments), group=group, partition=partition,
                    compressed=getattr(pack, "cp_compressed", "gather") if pack.cp_group is group else "gather")


def _keys_with_halos(x_local, frame: RowFrame, halo: int) -> torch.Tensor:
    width = halo if frame.world > 1 else 0
    return comm.with_left_halos(x_local, width, frame.group, frame.partition) if width else x_local


def context_parallel_frame(x_local: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int | None, group,
                           halo: int, pack: PackedBatch | None = None, partition: str = "contiguous", *,
                           phase: str | None = None, compress_ratio: int | None = None,
                           failed: Exception | None = None) -> tuple[RowFrame, torch.Tensor]:
    """(frame, x_keys): x_keys = ``[halo_0 ; segment_0 ; ...]`` hidden states, the rows whose raw KV this rank
    computes (see :mod:`.partition` for which rows a rank holds). This is the per-call path (``cu_seqlens=``, or a
    pack built without ``cp_group``); a CP pack uses :func:`pack_frame` instead.

    The first collective is the ranks' agreement on the call's metadata (:mod:`.agree`; ``phase`` and
    ``compress_ratio`` say which call this is): any difference, or a rank whose own checks below failed, raises a
    ValueError on every rank before the halo exchange. ``failed``: an error the caller's own checks already raised
    on this rank; it joins the agreement as failed, then raises it."""
    group = as_process_group(group)
    world, rank = comm.world_and_rank(group)
    rows = x_local.shape[0] if x_local.dim() else 0
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
    except (ValueError, TypeError):
        failed = None                           # no local may hold the error raised below (see _agree)
        _agree(group, None, partition, rows, phase, compress_ratio, halo, True, x_local.device)
        raise                                   # this rank's own error
    _agree(group, frame_pack, partition, rows, phase, compress_ratio, halo, False, x_local.device)
    frame = _row_frame(frame_pack, group, partition, halo, world, rank)
    return frame, _keys_with_halos(x_local, frame, halo)

"""Which rows one call of a layer computes: the single-device frame and the context-parallel frame.

A frame lists the *segments* of global query rows this process answers (one on a single device or under the
contiguous partition, two under head-tail), each with the rows ``[key_start, end)`` whose raw KV it computes (a
left halo under CP); locally the keys are ``[halo_0 ; segment_0 ; halo_1 ; segment_1]``. Per compress ratio it
knows the compressed entries this process computes (those whose group ends in one of its segments:
docs/semantics.md, decision 10's ownership) and how to reach every entry after they are gathered. On one device the
frame is the whole batch and gathering is the identity.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ops.index_sets import IndexSet, Rows, Stack, Window
from ..packing import CompressedLayout, PackedBatch, cached
from . import comm
from . import partition as partition_


@dataclass(frozen=True)
class Segment:
    start: int          # first global query row
    end: int            # one past the last
    key_start: int      # first global row whose raw KV is computed for it (start - halo)
    key_offset: int     # local key row of key_start


@dataclass
class RowFrame:
    pack: PackedBatch               # the global batch
    segments: tuple[Segment, ...]   # in local order
    group: object = None            # context-parallel process group, None on one device
    partition: str = "contiguous"
    compressed: str = "gather"      # the pack's cp_compressed: "gather" or "sharded" (ratio-4 sparse phase)
    _owned: dict = field(default_factory=dict, repr=False)
    _rows: dict = field(default_factory=dict, repr=False)

    @property
    def world(self) -> int:
        return 1 if self.group is None else comm.world_and_rank(self.group)[0]

    @property
    def num_queries(self) -> int:
        return sum(s.end - s.start for s in self.segments)

    @property
    def num_keys(self) -> int:
        return sum(s.end - s.key_start for s in self.segments)

    def query_rows(self):
        """Global rows of the local queries: a slice for one segment, else an index tensor."""
        return self._global_rows("query", [(s.start, s.end) for s in self.segments])

    def key_rows(self):
        """Global rows of the local raw keys (halos included)."""
        return self._global_rows("key", [(s.key_start, s.end) for s in self.segments])

    def _global_rows(self, kind, spans):
        if len(spans) == 1:
            return slice(*spans[0])
        device = self.pack.row_doc.device
        return cached(self._rows, kind, lambda: torch.cat([torch.arange(a, b, device=device) for a, b in spans]))

    def local_keys(self, base: IndexSet) -> IndexSet:
        """``base`` (an index set of global query rows -> global raw rows) for the local queries, addressing
        the local raw key rows. A :class:`Window` names rows at or before its query, so a segment's local rows
        stay below the segment's own last key row (the result's ``bound`` is then the local key count)."""
        ends = isinstance(base, Window)
        return self._stack([Rows(base, s.start, s.end - s.start, shift=s.key_offset - s.key_start,
                                 bound=s.end if ends else None) for s in self.segments])

    def local_compressed(self, base: IndexSet, table: torch.Tensor | None,
                         table_rows: int | None = None) -> IndexSet:
        """``base`` (global query rows -> global compressed entries) for the local queries, entries mapped
        through ``table`` (global entry -> gathered row; None on one device); ``table_rows``: the gathered rows
        the table maps into (the result's ``bound``)."""
        return self._stack([Rows(base, s.start, s.end - s.start, table=table, bound=table_rows)
                            for s in self.segments])

    @staticmethod
    def _stack(parts):
        return parts[0] if len(parts) == 1 else Stack(*parts)

    def owned_entries(self, ratio: int) -> tuple[CompressedLayout, torch.Tensor | None]:
        """(layout of the entries this call computes, in local key-row coordinates; global entry -> gathered
        row)."""
        return cached(self._owned, ratio, lambda: _single_owned(self.pack, ratio) if self.group is None
                      else _cp_owned(self, ratio))

    def gather(self, t: torch.Tensor, tag: str | None = None) -> torch.Tensor:
        return t if self.group is None else comm.gather_rows(t, self.group, tag)

    def fetch(self, local: torch.Tensor, selected: torch.Tensor, tag: str | None = None):
        """(rows, needed, remapped): the distinct gathered rows that ``selected`` (int, -1 = empty) names, fetched
        from their owners' ``local`` blocks (the layout :meth:`gather` would make; differentiable), their
        gathered-row ids ``needed`` (increasing), and ``selected`` renumbered to rows of that result (-1 kept)."""
        valid = selected >= 0
        needed = torch.unique(selected[valid].long())                       # increasing
        remapped = torch.where(valid, torch.searchsorted(needed, selected.long()),
                               torch.full_like(selected, -1, dtype=torch.long)).to(selected.dtype)
        plan = comm.fetch_plan(needed, local.shape[0], self.group, tag)
        return comm.fetch_rows(local, plan, self.group, tag), needed, remapped


def single_device_frame(pack: PackedBatch) -> RowFrame:
    return RowFrame(pack=pack, segments=(Segment(0, pack.total_rows, 0, 0),))


def _single_owned(pack: PackedBatch, ratio: int):
    return pack.compressed(ratio), None


def owned_capacity(rows_per_chunk: int, ratio: int) -> int:
    """Entries whose group ends in a chunk of S rows: groups are disjoint and at most one sticks out to the
    left, so at most S // r + 1."""
    return rows_per_chunk // ratio + 1


def _cp_owned(frame: RowFrame, ratio: int):
    glob = frame.pack.compressed(ratio)
    device = glob.entry_first_row.device
    world, _ = comm.world_and_rank(frame.group)
    n_chunks = partition_.num_chunks(frame.partition, world)
    S = frame.segments[0].end - frame.segments[0].start               # rows per chunk
    cap = owned_capacity(S, ratio)
    # Last token row of every entry; padding entries sort after everything (T), so the array is non-decreasing.
    last = torch.where(glob.entry_is_real, glob.entry_first_row + (ratio - 1),
                       torch.full_like(glob.entry_first_row, frame.pack.total_rows))
    first_of_chunk = torch.searchsorted(last, torch.arange(n_chunks + 1, device=device) * S)
    parts = []
    for seg in frame.segments:
        chunk = seg.start // S
        ids = first_of_chunk[chunk] + torch.arange(cap, device=device)
        valid = ids < first_of_chunk[chunk + 1]
        safe = torch.where(valid, ids, torch.zeros_like(ids)).clamp(max=max(glob.capacity - 1, 0))
        zero = torch.zeros_like(ids)
        if glob.capacity == 0:
            parts.append((zero, zero, zero, valid))
            continue
        first_row = glob.entry_first_row[safe] - seg.key_start + seg.key_offset
        parts.append(tuple(torch.where(valid, t, zero) for t in (first_row, glob.entry_index[safe],
                                                                 glob.entry_doc[safe])) + (valid,))
    first_row, index, doc, valid = (torch.cat(ts) for ts in zip(*parts))
    key_rows = torch.zeros(frame.num_keys, dtype=torch.long, device=device)
    local = CompressedLayout(ratio=ratio, capacity=cap * len(frame.segments), max_per_doc=glob.max_per_doc,
                             cu_compressed=glob.cu_compressed, entry_doc=doc, entry_index=index,
                             entry_first_row=first_row, entry_is_real=valid, row_first_entry=key_rows,
                             row_visible=key_rows)
    owner_chunk = (last // S).clamp(max=n_chunks - 1)
    slot = torch.tensor(partition_.chunk_slots(frame.partition, world), device=device)[owner_chunk]
    lowering = slot * cap + (torch.arange(glob.capacity, device=device) - first_of_chunk[owner_chunk])
    return local, lowering

"""Which rows one call of a layer computes: the single-device frame and the context-parallel frame.

A frame names the global query rows ``[start, end)`` this process answers, the rows ``[key_start, end)`` whose
raw KV it computes (a left halo under CP), and, per compress ratio, the compressed entries it computes (the
entries whose group ends in its slice: decision 10's ownership) plus how to reach every entry after they are
gathered. On one device the frame is the whole batch and gathering is the identity.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..packing import CompressedLayout, PackedBatch
from . import comm


@dataclass
class RowFrame:
    pack: PackedBatch           # the global batch
    start: int                  # first global query row of this call
    end: int                    # one past the last
    key_start: int              # first global row whose raw KV this call computes (start - halo)
    group: object = None        # context-parallel process group, None on one device
    _owned: dict = field(default_factory=dict, repr=False)

    @property
    def world(self) -> int:
        return 1 if self.group is None else comm.world_and_rank(self.group)[0]

    def query_slice(self) -> slice:
        return slice(self.start, self.end)

    def key_slice(self) -> slice:
        return slice(self.key_start, self.end)

    def owned_entries(self, ratio: int) -> tuple[CompressedLayout, torch.Tensor | None]:
        """(layout of the entries this call computes, in key-row coordinates; global entry -> gathered row)."""
        if ratio not in self._owned:
            self._owned[ratio] = (_single_owned(self.pack, ratio) if self.group is None
                                  else _cp_owned(self, ratio))
        return self._owned[ratio]

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.group is None else comm.gather_rows(t, self.group)


def single_device_frame(pack: PackedBatch) -> RowFrame:
    return RowFrame(pack=pack, start=0, end=pack.total_rows, key_start=0)


def _single_owned(pack: PackedBatch, ratio: int):
    return pack.compressed(ratio), None


def owned_capacity(rows_per_rank: int, ratio: int) -> int:
    """Entries whose group ends in a slice of S rows: groups are disjoint and at most one sticks out to the
    left, so at most S // r + 1."""
    return rows_per_rank // ratio + 1


def _cp_owned(frame: RowFrame, ratio: int):
    glob = frame.pack.compressed(ratio)
    device = glob.entry_first_row.device
    S = frame.end - frame.start
    world = frame.world
    cap = owned_capacity(S, ratio)
    # Last token row of every entry; padding entries sort after everything (T), so the array is non-decreasing.
    last = torch.where(glob.entry_is_real, glob.entry_first_row + (ratio - 1),
                       torch.full_like(glob.entry_first_row, frame.pack.total_rows))
    bounds = torch.arange(world + 1, device=device) * S
    first_of_rank = torch.searchsorted(last, bounds)              # entries owned by rank i: [f[i], f[i+1])
    rank = frame.start // S
    ids = first_of_rank[rank] + torch.arange(cap, device=device)
    valid = ids < first_of_rank[rank + 1]
    safe = torch.where(valid, ids, torch.zeros_like(ids)).clamp(max=max(glob.capacity - 1, 0))
    zero = torch.zeros_like(ids)
    n_keys = frame.end - frame.key_start
    key_rows = torch.zeros(n_keys, dtype=torch.long, device=device)
    if glob.capacity == 0:
        first_row, index, doc = zero, zero, zero
    else:
        first_row = torch.where(valid, glob.entry_first_row[safe] - frame.key_start, zero)
        index = torch.where(valid, glob.entry_index[safe], zero)
        doc = torch.where(valid, glob.entry_doc[safe], zero)
    local = CompressedLayout(ratio=ratio, capacity=cap, max_per_doc=glob.max_per_doc,
                             cu_compressed=glob.cu_compressed, entry_doc=doc, entry_index=index,
                             entry_first_row=first_row, entry_is_real=valid, row_first_entry=key_rows,
                             row_visible=key_rows)
    owner = (last // S).clamp(max=world - 1)
    lowering = owner * cap + (torch.arange(glob.capacity, device=device) - first_of_rank[owner])
    return local, lowering

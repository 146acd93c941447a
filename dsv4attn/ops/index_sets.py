"""Per-query key index sets, produced chunk by chunk so that no (T, T)-sized tensor ever exists.

An index set answers ``rows(start, end, dtype=torch.int64) -> (end - start, width) dtype``: for each query row in
``[start, end)`` the rows of a key tensor it may attend to, ``-1`` for an empty slot (the kernels ask for int32, and
a subclass must take ``dtype`` too). Order inside a row does not matter (one
softmax over the set); a repeated index counts once per occurrence. Sets combine with :class:`Concat` (disjoint key
ranges, e.g. raw window rows followed by compressed rows at an offset) and :class:`Stack` (consecutive query ranges).

- :class:`Explicit`: a materialised (T, K) tensor (what ``sparse_attention(indices=...)`` takes, FlashMLA style).
- :class:`Window`: raw rows ``max(doc start, t - window + 1) .. t``
  (docs/semantics.md, decision 3: both ends inclusive).
- :class:`VisibleCompressed`: every compressed entry of the row's document with ``j < floor((t+1)/r)``
  (docs/semantics.md, decision 4), i.e. HCA and the dense CSA phase; width ``max_seqlen // r``
  but built one chunk at a time.

Every set has a host-int ``bound``: each valid row it yields is ``< bound`` (``None``: not known on the host, e.g.
an :class:`Explicit` tensor of a caller). The ops use it to skip any range work for sets that provably fit their
key tensor, and mask the others (:func:`within`): an index past the key rows never reaches a kernel.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..packing import CompressedLayout, PackedBatch


class IndexSet(ABC):
    width: int
    total_rows: int
    bound: int | None = None        # host int > every valid row the set yields; None = unknown

    @abstractmethod
    def rows(self, start: int, end: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """(end - start, width) ``dtype`` key rows of queries start..end-1, -1 for empty slots. The work is done in
        ``dtype``: int32 (what the kernels take) halves the bytes of every pass and needs no conversion after;
        every row and entry of the library's sets fits it."""

    def materialize(self) -> torch.Tensor:
        """The whole (T, width) int64 tensor (tests and small batches only)."""
        return self.rows(0, self.total_rows)


class Explicit(IndexSet):
    """``indices`` (T, K), valid entries shifted by ``offset``; ``bound``: a host int > every valid entry of
    ``indices`` when the caller knows one (e.g. the rows of the table top-k indices were chosen from)."""

    def __init__(self, indices: torch.Tensor, offset: int = 0, bound: int | None = None):
        self.indices, self.offset = indices, offset
        self.total_rows, self.width = indices.shape
        self.bound = None if bound is None else bound + offset

    def rows(self, start: int, end: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        idx = self.indices[start:end]
        if torch.iinfo(idx.dtype).bits > torch.iinfo(dtype).bits:
            # A value the narrower dtype cannot hold is no row of any key tensor: an empty slot (as rows past a
            # bound, :func:`within`), never wrapped into a row that exists.
            idx = torch.where((idx < 0) | (idx > torch.iinfo(dtype).max - self.offset), -1, idx)
        idx = idx.to(dtype)
        return torch.where(idx >= 0, idx + self.offset, idx) if self.offset else idx


class Window(IndexSet):
    def __init__(self, pack: PackedBatch, window: int):
        self.pack, self.width, self.total_rows = pack, window, pack.total_rows
        self.bound = pack.total_rows
        self._start = pack.window_start(window)

    def rows(self, start: int, end: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        row = torch.arange(start, end, device=self._start.device, dtype=dtype)
        idx = self._start[start:end, None].to(dtype) + torch.arange(self.width, device=row.device, dtype=dtype)
        valid = (idx <= row[:, None]) & self.pack.row_is_real[start:end, None]
        return torch.where(valid, idx, -1)


class VisibleCompressed(IndexSet):
    def __init__(self, layout: CompressedLayout, total_rows: int, offset: int = 0):
        self.layout, self.offset, self.total_rows = layout, offset, total_rows
        self.width = layout.max_per_doc
        self.bound = layout.capacity + offset          # real entries only, all below the capacity

    def rows(self, start: int, end: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        # Two passes over the (rows, width) result: these sets are the widest (max_seqlen / r slots per row).
        lay = self.layout
        j = torch.arange(self.width, device=lay.row_first_entry.device, dtype=dtype)
        valid = j[None, :] < lay.row_visible[start:end, None]
        return torch.where(valid, lay.row_first_entry[start:end, None].to(dtype) + (j + self.offset), -1)


class Rows(IndexSet):
    """``base`` seen from query rows ``row_offset .. row_offset + total_rows``, valid entries mapped through
    ``table`` (if given) and shifted by ``shift``: how a context-parallel rank addresses its local key rows and
    the gathered compressed rows with the global batch's index sets. ``bound``: what the caller knows of the
    mapped rows (before the shift), e.g. the rows ``table`` maps into; default ``base.bound`` without a table."""

    def __init__(self, base: IndexSet, row_offset: int, total_rows: int, shift: int = 0,
                 table: torch.Tensor | None = None, bound: int | None = None):
        self.base, self.row_offset, self.total_rows = base, row_offset, total_rows
        self.shift, self.table, self.width = shift, table, base.width
        if bound is None and table is None:
            bound = base.bound
        self.bound = None if bound is None else bound + shift

    def rows(self, start: int, end: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        idx = self.base.rows(start + self.row_offset, end + self.row_offset, dtype)
        if self.table is None and self.shift == 0:         # one device: the local rows are the global ones
            return idx
        mapped = idx if self.table is None else self.table[idx.clamp(min=0)].to(dtype)
        return torch.where(idx >= 0, mapped + self.shift if self.shift else mapped, -1)


class Concat(IndexSet):
    def __init__(self, *parts: IndexSet):
        self.parts = parts
        self.total_rows = parts[0].total_rows
        self.width = sum(p.width for p in parts)
        self.bound = _largest_bound(parts)

    def rows(self, start: int, end: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.cat([p.rows(start, end, dtype) for p in self.parts], dim=1)


class Stack(IndexSet):
    """Index sets of consecutive query-row ranges stacked on top of each other (e.g. the two segments a
    context-parallel rank holds under the head-tail partition); widths may differ, narrower parts pad with -1."""

    def __init__(self, *parts: IndexSet):
        self.parts = parts
        self.total_rows = sum(p.total_rows for p in parts)
        self.width = max(p.width for p in parts)
        self.bound = _largest_bound(parts)

    def rows(self, start: int, end: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        pieces, offset = [], 0
        for part in self.parts:
            lo, hi = max(start, offset), min(end, offset + part.total_rows)
            if lo < hi:
                idx = part.rows(lo - offset, hi - offset, dtype)
                pieces.append(torch.nn.functional.pad(idx, (0, self.width - idx.shape[1]), value=-1))
            offset += part.total_rows
        if not pieces:                  # an empty row range (a batch of no rows): no part holds it
            idx = self.parts[0].rows(0, 0, dtype)
            return idx.new_full((0, self.width), -1)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _largest_bound(parts) -> int | None:
    bounds = [p.bound for p in parts]
    # max(bounds) without default=: dynamo cannot trace max's default keyword once a bound is symbolic.
    return None if any(b is None for b in bounds) else (max(bounds) if bounds else 0)


class _Masked(IndexSet):
    """``base`` with every row >= ``rows`` set to -1 (see :func:`within`)."""

    def __init__(self, base: IndexSet, rows: int):
        self.base, self.width, self.total_rows, self.bound = base, base.width, base.total_rows, rows

    def rows(self, start: int, end: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        idx = self.base.rows(start, end, dtype)
        return torch.where(idx < self.bound, idx, -1)


def within(index_set: IndexSet, rows: int) -> IndexSet:
    """``index_set`` where its ``bound`` proves every row < ``rows`` (free: the library's own sets); otherwise the
    same set with rows >= ``rows`` turned into empty slots (-1), one elementwise pass per materialised chunk and no
    host read. Negative entries are empty slots already. An :class:`Explicit` stays an :class:`Explicit`."""
    if index_set.bound is not None and index_set.bound <= rows:
        return index_set
    if isinstance(index_set, Explicit):
        limit = rows - index_set.offset
        return Explicit(torch.where(index_set.indices < limit, index_set.indices, -1), index_set.offset,
                        bound=max(limit, 0))
    return _Masked(index_set, rows)


def contiguous_ranges(candidates: IndexSet):
    """``(first, visible, table, shift)`` if row t's candidates are ``map(first[t] + j), j < visible[t]`` in
    increasing j with ``map(e) = (table[e] if table is not None else e) + shift``: a :class:`VisibleCompressed`, a
    :class:`Rows` view of one, or a :class:`Stack` of such views sharing one table and shift (a context-parallel
    rank's segments); ``None`` for other sets. The library's sets map every entry to a row >= 0 (tables hold rows,
    shifts are >= 0): the kernels that take ranges read ``map(e)`` for every ``j < visible`` without masking."""
    if isinstance(candidates, Stack):
        parts = [contiguous_ranges(part) for part in candidates.parts]
        if not parts or any(r is None or r[2] is not parts[0][2] or r[3] != parts[0][3] for r in parts):
            return None
        return (torch.cat([r[0] for r in parts]), torch.cat([r[1] for r in parts])) + parts[0][2:]
    T = candidates.total_rows
    base, row_offset, table, shift = candidates, 0, None, 0
    if isinstance(candidates, Rows):
        base, row_offset, table, shift = candidates.base, candidates.row_offset, candidates.table, candidates.shift
    if not isinstance(base, VisibleCompressed):
        return None
    lay = base.layout
    first = lay.row_first_entry[row_offset:row_offset + T]
    visible = lay.row_visible[row_offset:row_offset + T]
    if first.shape[0] != T:
        return None
    if base.offset:
        first = first + base.offset
    return first.contiguous(), visible.contiguous(), table, int(shift)


def range_part_starts(candidates: IndexSet) -> list[int]:
    """The rows after 0 where the leaf parts of a :class:`Stack` begin (``[]`` for any other set). Inside one leaf the
    rows are one layout's rows in order, so a block of neighbouring rows spans a short stretch of entries (what the
    indexer's score kernels assume); across leaves (a context-parallel rank's two segments) it need not."""
    if not isinstance(candidates, Stack):
        return []
    starts, offset = [], 0
    for part in candidates.parts:
        if offset:
            starts.append(offset)
        starts += [offset + s for s in range_part_starts(part)]
        offset += part.total_rows
    return starts


def range_rows(first: torch.Tensor, visible: torch.Tensor, table: torch.Tensor | None, shift: int, width: int,
               start: int, end: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """(end - start, width) ``dtype``: rows ``start .. end - 1`` of the set that :func:`contiguous_ranges` described,
    ``map(first[t] + j)`` for ``j < visible[t]`` and -1 elsewhere (what that set's own ``rows`` gives). The work is
    done in ``dtype`` (int32 halves the bytes of every pass; entries and rows fit it)."""
    j = torch.arange(width, device=first.device, dtype=dtype)
    entry = first[start:end, None].to(dtype) + j
    valid = j[None, :] < visible[start:end, None]
    if table is not None:
        entry = table[torch.where(valid, entry, 0)].to(dtype)
    return torch.where(valid, entry + shift, -1)


def gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``table[idx]`` with -1 slots reading row 0 (callers mask them); an empty table gives zeros."""
    if table.shape[0] == 0:
        return table.new_zeros(idx.shape + table.shape[1:])
    return table[idx.clamp(min=0)]


def row_ends(idx: torch.Tensor) -> torch.Tensor:
    """(rows,) int32: each row of ``idx`` (rows, K) its last valid slot + 1 (0 for a row without a valid slot). The
    kernels stop there: the empty slots of a row's last part (the top-k of a document's early rows, the visible
    compressed entries of a dense or HCA row) trail it."""
    slot = torch.arange(1, idx.shape[1] + 1, dtype=torch.int32, device=idx.device)
    return torch.where(idx >= 0, slot, 0).amax(dim=1).to(torch.int32) if idx.shape[1] else \
        torch.zeros(idx.shape[0], dtype=torch.int32, device=idx.device)


def as_index_set(indices: torch.Tensor | IndexSet) -> IndexSet:
    return indices if isinstance(indices, IndexSet) else Explicit(indices)


CHUNK_BUDGET = {"cpu": 1 << 23, "cuda": 1 << 27}   # elements of one chunk's working set


def chunk_rows(total_rows: int, per_row_elements: int, budget: int | None = None, device=None):
    """Yield (start, end) query chunks whose per-chunk working set stays under ``budget`` elements
    (default: ``CHUNK_BUDGET`` of the device type: larger on GPUs, where each chunk is one kernel launch)."""
    if budget is None:
        budget = CHUNK_BUDGET.get(getattr(device, "type", "cpu"), CHUNK_BUDGET["cpu"])
    step = max(1, budget // max(per_row_elements, 1))
    for start in range(0, total_rows, step):
        yield start, min(start + step, total_rows)

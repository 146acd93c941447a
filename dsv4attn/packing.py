"""Packed THD metadata, built once per batch from ``cu_seqlens`` (flash-attn varlen convention).

A packed batch holds ``T`` rows: documents back to back (``cu_seqlens[b] .. cu_seqlens[b+1]``), then capacity
padding rows ``cu_seqlens[-1] .. T``. Empty documents (``cu_seqlens[b] == cu_seqlens[b+1]``) are legal.
Everything position-dependent resets at each document start (docs/packing.md, "What resets at each document start"):
RoPE positions, the sliding window, compressor groups (a tail shorter than the ratio makes no entry), compressed
visibility and top-k candidates.

:func:`pack_batch` validates the metadata (``cu_seqlens`` and ``max_seqlen``) once per batch, always, with one
host read of ``cu_seqlens`` (:func:`dsv4attn.checks.check_batch`); nothing derived from a pack afterwards reads a
device value. Capacities of compressed buffers are host ints derived from ``T``, ``N`` and ``max_seqlen``, and
every row number a pack's tables hold lies in range by construction (the layers rely on it and check nothing
more when given a prebuilt pack).
"""
from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import Callable, TypeVar

import torch

from . import checks

V = TypeVar("V")


def cached(store: dict, key, build: Callable[[], V]) -> V:
    """``store[key]``, built by ``build()`` on first use and kept there -- except while ``torch.compile`` traces.

    A miss inside a trace builds the value in the graph and stores nothing. Dynamo guards on what the trace read
    from ``store`` and replays a store after the call, so a stored value would make the next call see the cache
    in another state, fail that guard and recompile (once per layer for its RoPE table, once per reused pack).
    Not storing keeps every cache as eager calls left it: a new pack (empty caches) runs the same graph. Inside one
    trace the repeated builds are identical pure ops (AOT autograd's CSE merges them).
    """
    if key in store:
        return store[key]
    value = build()
    if not torch.compiler.is_compiling():
        store[key] = value
    return value


@dataclass(frozen=True)
class CompressedLayout:
    """Where the compressed entries of ratio ``ratio`` live, for a packed batch.

    Entries are stored document by document: document ``b`` owns ``n_b = L_b // ratio`` consecutive rows
    starting at ``cu_compressed[b]``; rows past ``cu_compressed[-1]`` (up to ``capacity``) are padding.
    """

    ratio: int
    capacity: int                   # host int: rows of every compressed buffer (>= total entries)
    max_per_doc: int                # host int: min(max_seqlen, T) // ratio, the widest visible set of any query
    cu_compressed: torch.Tensor     # (N+1,) int64
    entry_doc: torch.Tensor         # (capacity,) int64 document of each entry, N for padding entries
    entry_index: torch.Tensor       # (capacity,) int64 index j of the entry inside its document
    entry_first_row: torch.Tensor   # (capacity,) int64 packed row of the first token of group j (0 for padding)
    entry_is_real: torch.Tensor     # (capacity,) bool
    row_first_entry: torch.Tensor   # (T,) int64 first compressed row of the query row's document
    row_visible: torch.Tensor       # (T,) int64 entries visible to the row: min((p+1)//r, n_b); 0 for padding
    entry_position: torch.Tensor = field(init=False)  # (capacity,) int64 RoPE position j * ratio

    def __post_init__(self) -> None:
        object.__setattr__(self, "entry_position", self.entry_index * self.ratio)


@dataclass(frozen=True)
class PackedBatch:
    """Per-row metadata of a packed THD batch (see the module docstring)."""

    cu_seqlens: torch.Tensor        # (N+1,) int32
    total_rows: int                 # T, host int
    max_seqlen: int                 # host int, >= every document length
    row_doc: torch.Tensor           # (T,) int64 document of each row, N for padding rows
    row_position: torch.Tensor      # (T,) int64 position inside the document, 0 for padding rows
    row_doc_start: torch.Tensor     # (T,) int64 packed row where the row's document starts (T for padding)
    row_is_real: torch.Tensor       # (T,) bool, False for capacity padding
    num_real_rows: torch.Tensor     # () int64 = cu_seqlens[-1], kept on device (no sync)
    # Context parallelism (pack_batch(..., cp_group=...)): the group and partition the ranks agreed on when the
    # pack was built; the layers then take both from here and run no agreement of their own.
    cp_group: object = field(default=None, repr=False, compare=False)
    cp_partition: str | None = None
    cp_compressed: str = "gather"   # how CSA layers reach other ranks' compressed main KV (pack_batch)
    # The cu_seqlens values read on the host by the validation (None where no value could be read), kept as
    # :attr:`host_cu_seqlens`: context parallelism digests them so that the ranks can agree on the batch without a
    # second read. Not a field: torch.compile (torch 2.11) guards on every field of a dataclass handed to an
    # autograd.Function, and a guard on these values recompiled the layer for every new set of boundaries. Stored
    # under the init variable's own name, so that ``dataclasses.replace`` (as FSDP2's input casts call it) keeps
    # them.
    host_values: InitVar[tuple[int, ...] | None] = None

    def __post_init__(self, host_values: tuple[int, ...] | None) -> None:
        object.__setattr__(self, "host_values", host_values)
        # Caches, built lazily: halo -> RowFrame, ratio -> CompressedLayout, id -> (tensor, equal). Attributes, not
        # dataclass fields: code that walks a dataclass's fields looking for tensors (FSDP2's hooks walk every
        # module's arguments) must not follow the frames' references back to this pack (a cycle), and a
        # ``dataclasses.replace`` of a pack (another group, say) starts with empty caches.
        object.__setattr__(self, "_frames", {})
        object.__setattr__(self, "_layouts", {})
        object.__setattr__(self, "_compared", {})

    @property
    def host_cu_seqlens(self) -> tuple[int, ...] | None:
        """The ``cu_seqlens`` values the validation read on the host; None where none could be read."""
        return self.host_values

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    def compressed(self, ratio: int) -> CompressedLayout:
        """Layout of the ratio-``ratio`` compressed entries (built on first use, then cached; see :func:`cached`
        for ``torch.compile``)."""
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
            raise ValueError(f"ratio must be an int >= 1 (the compression ratio: 4 or 128 in the model), got {ratio!r}")
        return cached(self._layouts, ratio, lambda: _build_compressed_layout(self, ratio))

    def same_cu_seqlens(self, cu_seqlens: torch.Tensor) -> bool:
        """Whether ``cu_seqlens`` holds this pack's document boundaries. The pack's own tensor (``pack.cu_seqlens``,
        e.g. the one it was built from) is free; another tensor has its values compared once (one host read), and
        the answer is remembered for that tensor object, so the layers of one step pay it at most once. Where no
        value can be read (``torch.compile``, CUDA-graph capture) only the pack's own tensor is accepted."""
        if cu_seqlens is self.cu_seqlens:
            return True
        seen = self._compared.get(id(cu_seqlens))
        if seen is not None and seen[0] is cu_seqlens:       # the reference held keeps the id from being reused
            return seen[1]
        if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.shape != self.cu_seqlens.shape
                or cu_seqlens.dtype != self.cu_seqlens.dtype or cu_seqlens.device != self.device):
            return False
        if not checks.reads_possible():
            return False
        same = bool(torch.equal(cu_seqlens, self.cu_seqlens))
        self._compared[id(cu_seqlens)] = (cu_seqlens, same)
        return same

    def copy_(self, other: "PackedBatch") -> "PackedBatch":
        """Make this pack describe ``other``'s batch by copying ``other``'s tensors into this pack's own, in place,
        including the ``cu_seqlens`` tensor this pack was built from and the compressed layouts it has built:
        what a CUDA graph captured with this pack reads on replay (docs/packing.md, "CUDA graphs"). Returns self.

        Both packs must have the same shapes: the same ``total_rows`` and ``max_seqlen``, and ``cu_seqlens`` of the
        same length, dtype and device (pad with empty documents: ``pack_batch(..., num_docs=N)``). ``other`` was
        validated when it was built; nothing here reads a device value. Single-device packs only (a
        context-parallel pack's frames hold rank-specific tables that this does not refresh)."""
        if not isinstance(other, PackedBatch):
            raise TypeError(f"copy_ needs a PackedBatch (dsv4attn.pack_batch), got {type(other).__name__}")
        if self.cp_group is not None or other.cp_group is not None:
            raise ValueError("copy_ supports single-device packs only; a context-parallel pack (cp_group=...) "
                             "cannot be refilled in place")
        for name in ("total_rows", "max_seqlen"):
            if getattr(self, name) != getattr(other, name):
                raise ValueError(f"copy_: {name} differs ({getattr(self, name)} here, {getattr(other, name)} in "
                                 f"other); a refilled pack keeps its shapes: build both with the same {name}")
        mine, theirs = self.cu_seqlens, other.cu_seqlens
        if (mine.shape, mine.dtype, mine.device) != (theirs.shape, theirs.dtype, theirs.device):
            raise ValueError(f"copy_: cu_seqlens differ in shape, dtype or device ({tuple(mine.shape)} {mine.dtype} "
                             f"{mine.device} here, {tuple(theirs.shape)} {theirs.dtype} {theirs.device} in other); "
                             f"pad both to one number of documents with pack_batch(..., num_docs=N)")
        # Every check before the first copy: a refused call changes nothing.
        layouts = {ratio: other.compressed(ratio) for ratio in self._layouts}
        for name in ("cu_seqlens", "row_doc", "row_position", "row_doc_start", "row_is_real", "num_real_rows"):
            getattr(self, name).copy_(getattr(other, name))
        for ratio, layout in layouts.items():
            kept = self._layouts[ratio]
            for name in ("cu_compressed", "entry_doc", "entry_index", "entry_first_row", "entry_is_real",
                         "row_first_entry", "row_visible", "entry_position"):
                getattr(kept, name).copy_(getattr(layout, name))
        object.__setattr__(self, "host_values", other.host_cu_seqlens)
        self._compared.clear()          # equalities remembered for the old boundaries
        return self

    def window_start(self, window: int) -> torch.Tensor:
        """(T,) int64 first raw row a query sees: max(document start, row - window + 1)."""
        rows = torch.arange(self.total_rows, device=self.device)
        return torch.maximum(self.row_doc_start, rows - (window - 1))


def pack_batch(cu_seqlens: torch.Tensor | None, total_rows: int, max_seqlen: int | None = None,
               device: torch.device | None = None, *, cp_group=None, cp_partition: str | None = None,
               cp_compressed: str = "gather", num_docs: int | None = None) -> PackedBatch:
    """Build the :class:`PackedBatch` of a ``total_rows``-row batch, validating its metadata first.

    Args:
        cu_seqlens: (N+1,) int32, ``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] <= total_rows``.
            ``None`` means a single document of ``total_rows`` rows.
        total_rows: T, rows of the packed tensors (documents + capacity padding).
        max_seqlen: host int >= the longest document. ``None`` computes it (from the same host read).
        device: where to build the single-document ``cu_seqlens`` when it is ``None``; when both are given,
            ``cu_seqlens`` must be on ``device``.
        num_docs: pad ``cu_seqlens`` with empty documents at the end to exactly this many documents (a batch with
            more raises), so that packs of different batches have equal shapes: what :meth:`PackedBatch.copy_`
            (CUDA-graph replay) needs, together with a fixed ``max_seqlen``. The pack then holds a new tensor.

    The validation always runs (it is not a debug check): one host read of ``cu_seqlens``
    (:func:`dsv4attn.checks.check_batch`); a bad batch raises a ValueError naming the entry and the rule. Inside a
    ``torch.compile`` trace or a CUDA-graph capture no value can be read, so build the pack before and pass it on.

    Context parallelism: with ``cp_group`` (a ProcessGroup or 1-D DeviceMesh) every rank of the group calls this
    with the same *global* batch (``total_rows`` = T of all ranks) and ``cp_partition`` (``"contiguous"``, the
    default, or ``"head_tail"``). The ranks agree on (T, cu_seqlens, max_seqlen, partition, local rows) here, once
    per batch (one all-gather and one host read of its result; any difference raises the same ValueError on every
    rank), and the pack keeps the group and partition: ``layer(x_local, pack=pack, phase=...)`` then needs no
    other argument and runs no agreement of its own (docs/semantics.md, decision 10).

    ``cp_compressed`` (with ``cp_group``; the ranks agree on it too) says how a ratio-4 (CSA) layer reaches the
    compressed main KV of other ranks (docs/context_parallel.md, "Sharded compressed memory"):

    - ``"gather"`` (default): every rank all-gathers every rank's compressed main KV and indexer keys
      (forward) and reduce-scatters their gradients (backward), for every ratio and phase.
    - ``"sharded"``: in the ``sparse`` phase each rank keeps only its own compressed main KV; the indexer keys
      are still all-gathered; after top-k each rank fetches the distinct selected main-KV rows it needs from
      their owners (an all-to-all of row counts, one of row indices, one of rows) and the backward sends those
      rows' gradients back to their owners (one all-to-all). Needs one host read per layer call (the split
      sizes). Ratio 128 and the ``dense`` and ``warmup`` phases of ratio 4 attend to (or teach over) every
      visible entry and gather as with ``"gather"``. Exactly the same result as ``"gather"``.
    """
    if cp_compressed not in ("gather", "sharded"):
        raise ValueError(f"cp_compressed must be 'gather' or 'sharded', got {cp_compressed!r}")
    if num_docs is not None:
        cu_seqlens = _padded(cu_seqlens, num_docs, total_rows, device)
    if cp_group is not None:
        from .parallel.setup import agreed_pack          # parallel builds on packing: imported on use
        return agreed_pack(cu_seqlens, total_rows, max_seqlen, device, cp_group, cp_partition, cp_compressed)
    if cp_compressed != "gather":
        raise ValueError(f"cp_compressed={cp_compressed!r} needs cp_group (it says how context-parallel ranks "
                         f"share compressed KV); without cp_group leave it out")
    if cp_partition is not None:
        raise ValueError(f"cp_partition={cp_partition!r} needs cp_group (it says how context-parallel ranks split "
                         f"the rows); without cp_group leave it out")
    if isinstance(total_rows, bool) or not isinstance(total_rows, int) or total_rows < 0:
        raise ValueError(f"total_rows must be an int >= 0, got {total_rows!r}")
    if cu_seqlens is None:                  # [0, T], valid by construction: built on the device, nothing to read
        if max_seqlen is None:
            max_seqlen = total_rows
        checks.check_max_seqlen(max_seqlen)
        if max_seqlen < total_rows:
            raise ValueError(f"max_seqlen={max_seqlen} is smaller than the single document of {total_rows} rows "
                             f"(cu_seqlens=None); it must be >= every document length")
        cu_seqlens = torch.arange(2, dtype=torch.int32, device=device) * total_rows
        host_values = (0, total_rows)
    else:
        if (device is not None and isinstance(cu_seqlens, torch.Tensor)
                and cu_seqlens.device != _indexed(torch.device(device))):
            raise ValueError(f"cu_seqlens must be on {device}, got {cu_seqlens.device}")
        kept: list[int] = []
        max_seqlen = checks.check_batch(cu_seqlens, total_rows, max_seqlen, keep=kept)
        host_values = tuple(kept) if kept else None      # empty: no value could be read (compile, capture)

    cu = cu_seqlens.long()
    rows = torch.arange(total_rows, device=cu.device)
    # Document of row t: number of boundaries cu[b+1] <= t (right=True skips empty documents correctly), counted
    # over all of cu (cu[0] = 0 <= t) minus one: inductor (torch 2.11) cannot lower a sliced boundaries tensor.
    row_doc = torch.searchsorted(cu, rows, right=True) - 1
    row_is_real = rows < cu[-1]
    starts = torch.cat([cu[:-1], cu.new_full((1,), total_rows)])
    row_doc_start = starts[row_doc]
    row_position = torch.where(row_is_real, rows - row_doc_start, torch.zeros_like(rows))
    return PackedBatch(cu_seqlens=cu_seqlens, total_rows=total_rows, max_seqlen=max_seqlen, row_doc=row_doc,
                       row_position=row_position, row_doc_start=row_doc_start, row_is_real=row_is_real,
                       num_real_rows=cu[-1], host_values=host_values)


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``"cuda"`` names the current CUDA device (what tensors report)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _padded(cu_seqlens: torch.Tensor | None, num_docs: int, total_rows: int, device) -> torch.Tensor:
    """``cu_seqlens`` (None: one document of ``total_rows`` rows) with its last boundary repeated up to
    ``num_docs`` documents: empty documents are legal and change nothing (docs/packing.md)."""
    if isinstance(num_docs, bool) or not isinstance(num_docs, int) or num_docs < 1:
        raise ValueError(f"num_docs must be an int >= 1, got {num_docs!r}")
    if isinstance(total_rows, bool) or not isinstance(total_rows, int) or not 0 <= total_rows < 2**31:
        raise ValueError(f"total_rows must be an int in [0, 2**31) (cu_seqlens is int32), got {total_rows!r}")
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, total_rows], dtype=torch.int32, device=device)
    checks.check_cu_seqlens(cu_seqlens)
    have = cu_seqlens.shape[0] - 1
    if have > num_docs:
        raise ValueError(f"num_docs={num_docs} is fewer than the batch's {have} documents (cu_seqlens has "
                         f"{have + 1} entries)")
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(num_docs - have)])


def compressed_capacity(total_rows: int, num_docs: int, max_seqlen: int, ratio: int) -> int:
    """Host-known bound on the number of compressed entries: min(T // r, N * (max_seqlen // r))."""
    return min(total_rows // ratio, num_docs * (max_seqlen // ratio))


def _build_compressed_layout(pack: PackedBatch, ratio: int) -> CompressedLayout:
    cu = pack.cu_seqlens.long()
    n_docs = pack.num_docs
    per_doc = (cu[1:] - cu[:-1]) // ratio                      # tails shorter than the ratio make no entry
    cu_comp = torch.cat([cu.new_zeros(1), per_doc.cumsum(0)])
    capacity = compressed_capacity(pack.total_rows, n_docs, pack.max_seqlen, ratio)
    entries = torch.arange(capacity, device=cu.device)
    entry_doc = torch.searchsorted(cu_comp, entries, right=True) - 1     # cu_comp[0] = 0: as row_doc in pack_batch
    entry_is_real = entries < cu_comp[-1]
    doc_safe = entry_doc.clamp(max=max(n_docs - 1, 0))
    entry_index = torch.where(entry_is_real, entries - cu_comp[doc_safe] if n_docs else entries,
                              torch.zeros_like(entries))
    first_row = torch.where(entry_is_real, (cu[doc_safe] if n_docs else entries) + entry_index * ratio,
                            torch.zeros_like(entries))

    row_doc_safe = pack.row_doc.clamp(max=max(n_docs - 1, 0))
    if n_docs:
        row_first_entry = cu_comp[row_doc_safe]
        row_n = per_doc[row_doc_safe]
    else:
        row_first_entry = torch.zeros_like(pack.row_doc)
        row_n = torch.zeros_like(pack.row_doc)
    visible = torch.minimum((pack.row_position + 1) // ratio, row_n)
    visible = torch.where(pack.row_is_real, visible, torch.zeros_like(visible))
    # No document is longer than the batch: a max_seqlen past T (legal, a loose bound) must not size the index
    # sets (a width of max_seqlen // r: 10**12 // 4 slots per row was a 2 TB allocation).
    widest = min(pack.max_seqlen, pack.total_rows) // ratio
    return CompressedLayout(ratio=ratio, capacity=capacity, max_per_doc=widest,
                            cu_compressed=cu_comp, entry_doc=entry_doc, entry_index=entry_index,
                            entry_first_row=first_row, entry_is_real=entry_is_real,
                            row_first_entry=row_first_entry, row_visible=visible)

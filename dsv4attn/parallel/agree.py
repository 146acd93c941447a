"""The ranks of a context-parallel group agree on the batch metadata before they communicate anything else.

Every rank of a CP group must pass the same global batch (``T``, ``cu_seqlens``, ``max_seqlen``), the same
partition and phase, and call the same layer (compress ratio, halo) on its share of rows. Nothing else notices a
difference: ranks that disagree exchange halos and compressed rows of different sizes (gloo aborts the process)
or of equal sizes but different meaning (outputs that match no single-device run), or one rank raises on its own
and the others wait in their next collective. So each frame build starts with one all-gather of a fixed-size int64
*digest* of what the call is about; every rank compares all digests and, on any difference, raises the same
ValueError naming the fields that differ and each rank's value, before any other collective and before anything
is changed. A rank whose own argument checks fail still takes part (with a "failed" status), so the other ranks
raise instead of waiting for it.

The digest reuses the one host read of ``cu_seqlens`` that validating the pack already does
(:attr:`PackedBatch.host_cu_seqlens`); the extra cost is that all-gather of 18 ints and reading its result.
Where no value can be read (``torch.compile`` trace, CUDA-graph capture) the agreement is skipped.
"""
from __future__ import annotations

import hashlib
import struct

import torch
import torch.distributed as dist

from ..config import PHASES
from . import partition as partition_

MAGIC = 0x44535634          # "DSV4": a rank running another digest layout (or garbage) shows as a mismatch
PREVIEW = 6                 # cu_seqlens values carried verbatim (first 3, last 3) to show in the error
UNKNOWN = -1                # a field this rank could not compute (its own checks failed first)
# (name in the error, index in the digest); the order is the order fields are reported in
FIELDS = (("status", 1), ("total rows T", 2), ("cu_seqlens", 3), ("max_seqlen", 6), ("cp_partition", 7),
          ("phase", 8), ("compress ratio", 9), ("local rows", 10), ("halo rows", 11),
          ("cp_compressed", 12 + PREVIEW))
SIZE = 13 + PREVIEW
COMPRESSED = ("gather", "sharded")


def cu_seqlens_hash(values) -> int:
    """A signed 63-bit hash of the boundary values (same on every process: no per-process hash seed)."""
    raw = struct.pack(f"<{len(values)}q", *values)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


def digest(*, total_rows, cu_values, max_seqlen, partition, phase, compress_ratio, rows, halo,
           failed: bool = False, compressed: str | None = None) -> list[int]:
    """The fixed-size int list one rank contributes; ``None`` fields become UNKNOWN."""
    def known(v):
        return UNKNOWN if v is None else int(v)
    if cu_values is None:
        cu = [UNKNOWN, UNKNOWN, UNKNOWN]
        preview = [UNKNOWN] * PREVIEW
    else:
        cu = [len(cu_values), cu_seqlens_hash(cu_values), cu_values[-1]]
        head, tail = list(cu_values[:PREVIEW // 2]), list(cu_values[-(PREVIEW // 2):])
        preview = (head + [UNKNOWN] * (PREVIEW // 2 - len(head))) + ([UNKNOWN] * (PREVIEW // 2 - len(tail)) + tail)
    codes = [partition_.PARTITIONS.index(partition) if partition in partition_.PARTITIONS else UNKNOWN,
             PHASES.index(phase) if phase in PHASES else UNKNOWN]
    return ([MAGIC, int(failed), known(total_rows)] + cu + [known(max_seqlen)] + codes
            + [known(compress_ratio), known(rows), known(halo)] + preview
            + [COMPRESSED.index(compressed) if compressed in COMPRESSED else UNKNOWN])


def _describe(name: str, d: list[int]) -> str:
    """One rank's value of field ``name`` for the error message."""
    if name == "status":
        return "failed its own argument checks (see its error)" if d[1] else "ok"
    if name == "cu_seqlens":
        n = d[3]
        if n == UNKNOWN:
            return "unknown"
        head = [v for v in d[12:12 + PREVIEW // 2] if v != UNKNOWN]
        tail = [v for v in d[12 + PREVIEW // 2:12 + PREVIEW] if v != UNKNOWN]
        shown = head + tail if n <= PREVIEW else head + ["..."] + tail
        return f"[{', '.join(map(str, shown))}] ({n} values, hash {d[4]:016x})"
    value = d[dict(FIELDS)[name]]
    if value == UNKNOWN:
        return "unknown"
    if name == "cp_partition":
        return repr(partition_.PARTITIONS[value])
    if name == "phase":
        return repr(PHASES[value])
    if name == "cp_compressed":
        return repr(COMPRESSED[value])
    return str(value)


def _differs(name: str, digests: list[list[int]]) -> bool:
    if name == "cu_seqlens":                        # count, hash and last value together
        return len({tuple(d[3:6]) for d in digests}) > 1
    i = dict(FIELDS)[name]
    return len({d[i] for d in digests}) > 1


def mismatch_message(digests: list[list[int]]) -> str | None:
    """The error every rank raises for these gathered digests, or None when they all agree."""
    if any(d[0] != MAGIC for d in digests):
        return ("context parallelism: ranks disagree on the metadata digest layout (ranks "
                f"{[r for r, d in enumerate(digests) if d[0] != MAGIC]} sent something else); every rank of "
                "cp_group must run the same dsv4attn version")
    if len({tuple(d) for d in digests}) == 1:
        return None
    failed = [r for r, d in enumerate(digests) if d[1]]
    if failed:
        # A rank that failed locally knows less than the others: the other fields would only echo that.
        return (f"context parallelism: rank(s) {', '.join(map(str, failed))} of cp_group failed their own "
                f"argument checks for this layer call (see the error there), so no rank communicates; fix the "
                f"arguments of that rank")
    parts = []
    for name, _ in FIELDS[1:]:
        if _differs(name, digests):
            values = ", ".join(f"rank {r}: {_describe(name, d)}" for r, d in enumerate(digests))
            parts.append(f"{name} ({values})")
    return ("context parallelism: ranks disagree on " + "; ".join(parts) + ". Every rank of cp_group must pass "
            "the same global batch (cu_seqlens, max_seqlen, total rows), cp_partition and phase, and call the same "
            "layer on its shard of rows; nothing was communicated or changed")


def agree(group, mine: list[int], device: torch.device) -> list[list[int]]:
    """All-gather every rank's digest (one collective of ``SIZE`` int64 per rank) and return them."""
    world = dist.get_world_size(group)
    t = torch.tensor(mine, dtype=torch.int64, device=device)
    parts = [torch.empty_like(t) for _ in range(world)]
    try:
        dist.all_gather(parts, t, group=group)
    except (RuntimeError, dist.DistError) as err:   # a peer never came (raised elsewhere, exited): the backend's
        raise type(err)(                            # own text names neither dsv4attn's step nor a likely cause
            f"context parallelism: rank {dist.get_rank(group)} of cp_group waited in vain for the other ranks to "
            f"agree on the batch metadata (the first collective of a CP layer call or pack_batch): a rank failed "
            f"or stopped before reaching the same call, or the group's timeout passed; its own error says why. "
            f"Backend error: {err}") from err
    return torch.stack(parts).tolist()                  # one host read of world x SIZE ints

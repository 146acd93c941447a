"""Autograd-aware collectives of context parallelism, portable to gloo (CPU) and NCCL (CUDA).

Every function takes the process group from the caller; the library never creates a global group.
"""
from __future__ import annotations

import collections
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import partition as partition_


def as_process_group(group, name: str):
    """``group`` as a ProcessGroup: a ProcessGroup, or a 1-D DeviceMesh (its group); anything else raises,
    naming the argument ``name`` (``cp_group``, ``tp_group``)."""
    if hasattr(group, "get_group") and hasattr(group, "ndim"):
        if group.ndim != 1:
            raise ValueError(f"{name} must be a ProcessGroup or a 1-D DeviceMesh, got a {group.ndim}-D mesh")
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup (or a 1-D DeviceMesh), "
                        f"got {type(group).__name__}")
    return group


# Bytes this process received from other ranks, by tag, in the collectives that take a ``tag`` (counted from the
# tensors handed to them, not modelled). Clear it (``traffic.clear()``) before the calls you want to measure.
traffic: collections.Counter = collections.Counter()


def world_and_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def communication_error(err: BaseException) -> bool:
    """A collective that timed out or lost its peers (gloo raises a plain RuntimeError, NCCL a DistError)."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(s in text for s in ("Timed out", "timed out", "Timeout", "gloo",
                                                                     "NCCL", "Connection closed", "Connection reset"))


@contextmanager
def awaited(rank: int, what: str):
    """Runs a layer's collective ``what``; if a peer never joins it (a communication error), raises the same error
    type naming the collective and the likely cause, the backend's text appended (alone it names neither)."""
    try:
        yield
    except (RuntimeError, dist.DistError) as err:
        if not communication_error(err):
            raise
        raise type(err)(
            f"context parallelism: rank {rank} of cp_group waited in vain for the other ranks in a layer's {what}: "
            f"a rank failed or stopped before reaching the same call, or the group's timeout passed; that rank's "
            f"own error says why. With a pack built with cp_group no agreement runs per layer call, so a rank's "
            f"own argument error (hidden_states with other rows than its share, say) shows on the others only "
            f"here. Backend error: {err}") from err


def _all_gather_cat(t: torch.Tensor, group) -> torch.Tensor:
    world, rank = world_and_rank(group)
    parts = [torch.empty_like(t) for _ in range(world)]
    with awaited(rank, "all-gather (halo rows or compressed entries)"):
        dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class _GatherRows(torch.autograd.Function):
    """Concatenate every rank's (n, ...) block along dim 0; backward sums the gradient over ranks and returns
    this rank's block (a reduce-scatter; done as all-reduce + slice because gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group, tag):
        ctx.group, ctx.rows, ctx.tag = group, t.shape[0], tag
        out = _all_gather_cat(t, group)
        if tag is not None:
            traffic[f"{tag} forward"] += out.nbytes - t.nbytes
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        world, rank = world_and_rank(ctx.group)
        with awaited(rank, "backward all-reduce (gathered rows' gradients)"):
            dist.all_reduce(grad, group=ctx.group)
        mine = grad[rank * ctx.rows:(rank + 1) * ctx.rows]
        if ctx.tag is not None:      # counted as the reduce-scatter it stands for: the other ranks' partial blocks
            traffic[f"{ctx.tag} backward"] += (world - 1) * mine.nbytes
        return mine, None, None


def gather_rows(t: torch.Tensor, group, tag: str | None = None) -> torch.Tensor:
    """(world * n, ...) rows of all ranks in rank order; gradients go back to the rank that owns each row.
    ``tag``: count the bytes received under this name in :data:`traffic`."""
    return _GatherRows.apply(t, group, tag)


@dataclass(frozen=True)
class FetchPlan:
    """Which rows one :func:`fetch_rows` moves: ``requested[r]`` rows this rank asks of rank r (in the order of
    ``needed``), ``served[r]`` rows rank r asks of this rank, ``serve_rows`` their local row numbers here."""
    requested: list
    served: list
    serve_rows: torch.Tensor


def fetch_plan(needed: torch.Tensor, block: int, group, tag: str | None = None) -> FetchPlan:
    """The exchange of row indices before :func:`fetch_rows`. ``needed``: increasing gathered-row ids (row g is
    row ``g % block`` of rank ``g // block``, the layout :func:`gather_rows` makes). Two all-to-alls: the counts
    (W ints) and the local row numbers; one host read of the counts (the split sizes of the second)."""
    world, rank = world_and_rank(group)
    needed = needed.long()
    owner = torch.div(needed, max(block, 1), rounding_mode="floor")
    ask = torch.bincount(owner, minlength=world)
    asked = torch.empty_like(ask)
    with awaited(rank, "all-to-all of the selected rows' indices"):
        dist.all_to_all_single(asked, ask, group=group)
        requested, served = ask.tolist(), asked.tolist()
        serve_rows = needed.new_empty(sum(served))
        dist.all_to_all_single(serve_rows, (needed - owner * block).contiguous(), served, requested, group=group)
    if tag is not None:
        traffic[f"{tag} indices"] += (asked.nbytes - asked[rank:rank + 1].nbytes
                                      + (sum(served) - served[rank]) * serve_rows.element_size())
    return FetchPlan(requested, served, serve_rows)


class _FetchRows(torch.autograd.Function):
    """Rows of other ranks' (n, ...) blocks named by a :class:`FetchPlan` (an all-to-all); backward sends each
    fetched row's gradient back to its owner (the reverse all-to-all), which adds it to its block's gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, plan: FetchPlan, group, tag):
        ctx.plan, ctx.group, ctx.tag, ctx.shape = plan, group, tag, local.shape
        out = local.new_empty((sum(plan.requested),) + tuple(local.shape[1:]))
        _, rank = world_and_rank(group)
        with awaited(rank, "all-to-all of the selected compressed rows"):
            dist.all_to_all_single(out, local[plan.serve_rows].contiguous(), plan.requested, plan.served,
                                   group=group)
        if tag is not None:
            traffic[f"{tag} forward"] += (sum(plan.requested) - plan.requested[rank]) * out[:1].nbytes
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        plan = ctx.plan
        back = grad.new_empty((sum(plan.served),) + tuple(grad.shape[1:]))
        _, rank = world_and_rank(ctx.group)
        with awaited(rank, "backward all-to-all (the fetched rows' gradients)"):
            dist.all_to_all_single(back, grad.contiguous(), plan.served, plan.requested, group=ctx.group)
        if ctx.tag is not None:
            traffic[f"{ctx.tag} backward"] += (sum(plan.served) - plan.served[rank]) * back[:1].nbytes
        grad_local = grad.new_zeros(ctx.shape).index_add_(0, plan.serve_rows, back)
        return grad_local, None, None, None


def fetch_rows(local: torch.Tensor, plan: FetchPlan, group, tag: str | None = None) -> torch.Tensor:
    """(len(needed), ...) the rows ``plan`` names, from their owners' ``local`` blocks (differentiable)."""
    return _FetchRows.apply(local, plan, group, tag)


class _WithLeftHalos(torch.autograd.Function):
    """This rank's segments, each preceded by the ``width`` rows left of it (none for chunk 0): the rows whose raw
    KV the rank computes. The halo rows come from whichever rank holds the previous chunk (one all-gather of every
    segment's tail); backward sends each halo's gradient back to that rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, width: int, group, partition: str):
        world, rank = world_and_rank(group)
        chunks = partition_.chunks_of_rank(partition, world, rank)
        rows = x.shape[0] // len(chunks)
        ctx.group, ctx.width, ctx.shape, ctx.chunks, ctx.rows = group, width, x.shape, chunks, rows
        ctx.slots = partition_.chunk_slots(partition, world)
        tails = _all_gather_cat(torch.cat([x[(i + 1) * rows - width:(i + 1) * rows] for i in range(len(chunks))]),
                                group)
        parts = []
        for i, c in enumerate(chunks):
            if c > 0:
                parts.append(tails[ctx.slots[c - 1] * width:(ctx.slots[c - 1] + 1) * width])
            parts.append(x[i * rows:(i + 1) * rows])
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad_keys: torch.Tensor):
        width, rows, slots = ctx.width, ctx.rows, ctx.slots
        halo_grads, grad_x, at = [], [], 0
        for c in ctx.chunks:
            if c > 0:
                halo_grads.append(grad_keys[at:at + width])
                at += width
            else:
                halo_grads.append(grad_keys.new_zeros((width,) + tuple(ctx.shape[1:])))
            grad_x.append(grad_keys[at:at + rows].clone())
            at += rows
        grads = _all_gather_cat(torch.cat(halo_grads).contiguous(), ctx.group)   # block slot(c): chunk c's halo
        for i, c in enumerate(ctx.chunks):
            if c + 1 < len(slots):
                grad_x[i][rows - width:] += grads[slots[c + 1] * width:(slots[c + 1] + 1) * width]
        return torch.cat(grad_x), None, None, None


def with_left_halos(x: torch.Tensor, width: int, group, partition: str = "contiguous") -> torch.Tensor:
    """``[halo ; segment]`` for each of this rank's segments, in local order; a halo is the ``width`` global rows
    left of its segment (empty for the batch's first chunk). Needs ``width <= rows per chunk``."""
    return _WithLeftHalos.apply(x, width, group, partition_.check_partition(partition))


def left_halo(x: torch.Tensor, width: int, group) -> torch.Tensor:
    """Rows ``[start - width, start)`` of the global batch for this rank's contiguous slice ``x`` (empty on
    rank 0)."""
    return with_left_halos(x, width, group)[:-x.shape[0] or None] if x.shape[0] else x[:0]


def shard(x: torch.Tensor, group, partition: str = "contiguous") -> torch.Tensor:
    """This rank's rows of ``x`` along dim 0: its chunks (see :mod:`.partition`) back to back."""
    world, rank = world_and_rank(group)
    spans = partition_.segments(partition, world, rank, x.shape[0])
    return x[spans[0][0]:spans[0][1]] if len(spans) == 1 else torch.cat([x[s:e] for s, e in spans])


def unshard(x_local: torch.Tensor, group, partition: str = "contiguous") -> torch.Tensor:
    """All-gather every rank's rows back into the global batch order (differentiable)."""
    world, _ = world_and_rank(group)
    full = gather_rows(x_local, group)
    slots = partition_.chunk_slots(partition, world)
    if slots == tuple(range(len(slots))):
        return full
    rows = full.shape[0] // len(slots)
    return torch.cat([full[s * rows:(s + 1) * rows] for s in slots])

"""Autograd-aware collectives of context parallelism, portable to gloo (CPU) and NCCL (CUDA).

Every function takes the process group from the caller; the library never creates a global group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import partition as partition_


def world_and_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather_cat(t: torch.Tensor, group) -> torch.Tensor:
    world, _ = world_and_rank(group)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class _GatherRows(torch.autograd.Function):
    """Concatenate every rank's (n, ...) block along dim 0; backward sums the gradient over ranks and returns
    this rank's block (a reduce-scatter; done as all-reduce + slice because gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group):
        ctx.group, ctx.rows = group, t.shape[0]
        return _all_gather_cat(t, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        _, rank = world_and_rank(ctx.group)
        return grad[rank * ctx.rows:(rank + 1) * ctx.rows], None


def gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """(world * n, ...) rows of all ranks in rank order; gradients go back to the rank that owns each row."""
    return _GatherRows.apply(t, group)


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

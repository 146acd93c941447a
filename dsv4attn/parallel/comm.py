"""Autograd-aware collectives of context parallelism, portable to gloo (CPU) and NCCL (CUDA).

Every function takes the process group from the caller; the library never creates a global group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


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


class _LeftHalo(torch.autograd.Function):
    """The last ``width`` rows of the previous rank (an empty tensor on rank 0); backward returns the halo's
    gradient to the rank that owns those rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, width: int, group):
        world, rank = world_and_rank(group)
        ctx.group, ctx.width, ctx.shape = group, width, x.shape
        tails = _all_gather_cat(x[x.shape[0] - width:], group)
        if rank == 0:
            return x.new_zeros((0,) + tuple(x.shape[1:]))
        return tails[(rank - 1) * width:rank * width]

    @staticmethod
    def backward(ctx, grad_halo: torch.Tensor):
        world, rank = world_and_rank(ctx.group)
        width = ctx.width
        if rank == 0:
            grad_halo = grad_halo.new_zeros((width,) + tuple(ctx.shape[1:]))
        grads = _all_gather_cat(grad_halo.contiguous(), ctx.group)       # block i = halo gradient of rank i
        grad_x = grad_halo.new_zeros(ctx.shape)
        if rank + 1 < world:
            grad_x[ctx.shape[0] - width:] = grads[(rank + 1) * width:(rank + 2) * width]
        return grad_x, None, None


def left_halo(x: torch.Tensor, width: int, group) -> torch.Tensor:
    """Rows ``[start - width, start)`` of the global batch for this rank's slice ``x`` (empty on rank 0)."""
    return _LeftHalo.apply(x, width, group)


def shard(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous equal slice of ``x`` along dim 0 (``x.shape[0]`` must divide evenly)."""
    world, rank = world_and_rank(group)
    if x.shape[0] % world:
        raise ValueError(f"the packed batch has {x.shape[0]} rows, which does not split into {world} equal "
                         f"context-parallel slices; pad the capacity to a multiple of {world}")
    rows = x.shape[0] // world
    return x[rank * rows:(rank + 1) * rows]


def unshard(x_local: torch.Tensor, group) -> torch.Tensor:
    """All-gather the slices back into the global batch (differentiable)."""
    return gather_rows(x_local, group)

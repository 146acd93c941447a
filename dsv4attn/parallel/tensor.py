"""Tensor parallelism of one attention layer over a caller-provided process group (docs/tensor_parallel.md).

The query heads are split into ``world`` contiguous blocks; rank r holds heads ``[r * H / world, (r + 1) * H / world)``
(its rows of ``q_b_proj``, its sinks) and, because head groups are contiguous blocks of heads, the output-projection
groups made of them (its groups of ``o_a_proj``, its columns of ``o_b_proj``). Everything else is replicated.

The two autograd-aware collectives (Megatron's "f" and "g", written for this package):

- :func:`copy_to_group` (identity forward, all-reduce of the gradient backward) marks where a *replicated* activation
  enters the head-sharded computation: each rank's gradient of it covers its own heads only, so their sum is the
  full gradient, and every replicated parameter upstream then gets the same, full gradient on every rank.
- :func:`reduce_from_group` (all-reduce forward, identity backward) sums the partial outputs of the sharded output
  projection into the full output; its gradient is already replicated.

:class:`TensorParallel` carries the group; ``TensorParallel(None)`` (one rank) makes every collective the identity,
so the layer has a single code path.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import as_process_group


def as_tp_group(tp_group):
    """A ProcessGroup, or a 1-D DeviceMesh (its group), or None; anything else raises a TypeError naming
    ``tp_group``."""
    return None if tp_group is None else as_process_group(tp_group, "tp_group")


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over the group: (rows, ...) in the grad's dtype."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()          # never sum into a gradient autograd may still hold elsewhere
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) forward: (rows, ...) in the input's dtype; identity backward (the gradient of a sum of
    replicas that every rank goes on to use identically)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group):
        out = t.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class TensorParallel:
    """This rank's place in a tensor-parallel group: ``world`` ranks, this one ``rank``; ``group`` None = one rank.

    ``shard(full, dim)`` / ``full_shape(shape, dim)`` / ``gather(local, dim)`` move between a full tensor and this
    rank's equal contiguous block of it along ``dim``; ``copy`` / ``reduce`` are the autograd collectives above;
    ``sum_`` sums a tensor over the group in place, outside autograd (the indexer teacher's head-summed mass).
    """

    def __init__(self, group=None):
        self.group = as_tp_group(group)
        self.world = 1 if self.group is None else dist.get_world_size(self.group)
        self.rank = 0 if self.group is None else dist.get_rank(self.group)

    def split(self, n: int, what: str) -> int:
        """``n // world``; raises a ValueError naming ``what`` unless ``world`` divides ``n``."""
        if n % self.world:
            raise ValueError(f"tensor parallelism over {self.world} ranks needs {what} ({n}) to be a multiple of "
                             f"{self.world}")
        return n // self.world

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        n = full.shape[dim] // self.world
        return full.narrow(dim, self.rank * n, n)

    def full_shape(self, shape, dim: int) -> tuple[int, ...]:
        shape = list(shape)
        shape[dim] *= self.world
        return tuple(shape)

    def gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """The full tensor on every rank: one all-gather of ``local`` (no gradient)."""
        if self.group is None:
            return local
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.detach().contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.group is None else _CopyToGroup.apply(t, self.group)

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.group is None else _ReduceFromGroup.apply(t, self.group)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(t, group=self.group)
        return t

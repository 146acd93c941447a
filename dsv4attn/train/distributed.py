"""Data x context parallelism of the training job: process layout, groups, row slices, gradient reduction.

Under ``torchrun`` the ``world`` processes form ``dp = world / cp`` data-parallel replicas of ``cp`` consecutive
ranks each: global rank ``r`` is context-parallel rank ``r % cp`` of replica ``r // cp``. The ranks of one
replica (one *CP group*) read the same packed batch, each computing its rows (decision 10): one contiguous slice,
or with the ``"head_tail"`` partition two chunks (:mod:`dsv4attn.parallel.partition`). The ranks holding the
same rows across replicas form a *DP group*.

The library never creates process groups (the layers take ``cp_group=`` from the caller); the training job is
the caller, so it builds them here, on every rank, in the same order (``new_group`` is collective).

Gradients: a rank's backward gives its CP share of the replica's gradient (the LM loss share below, and the
layers' indexer-loss share, which they already normalise by the global real-token count). The replica gradient
is the *sum* over the CP group; the run's gradient is the *mean* over replicas. DDP runs over the DP group only
(it averages, as plain data parallelism does), then :func:`sum_gradients` all-reduces over the CP group. One DDP
over the whole world with the LM loss scaled by ``cp`` would not do: the indexer loss is fed gradient 1 inside
the layers, not through the LM loss, so its gradient would come out ``cp`` times too small.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel import shard


@dataclass(frozen=True)
class Parallelism:
    """Where this process sits in the dp x cp layout, and the groups it talks to."""

    world: int                  # processes of the job
    rank: int                   # global rank
    cp: int                     # context-parallel ranks per replica (--cp)
    cp_group: object = None     # this rank's CP group; None when cp == 1 (the layers' single-device path)
    dp_group: object = None     # this rank's DP group for DDP; None: the default group when cp == 1 (no DDP
                                # at all when dp == 1)

    @property
    def dp(self) -> int:
        return self.world // self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp


def environment() -> tuple[int, int, int]:
    """(world_size, rank, local_rank): of the process group if one is initialised already (the caller owns it),
    else from torchrun's environment, else (1, 0, 0)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank(), local_rank
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")), local_rank


def check_world(world: int, cp: int) -> None:
    """Host-only, before any process group exists: ``cp`` must split the world into whole replicas."""
    if world % cp:
        raise ValueError(f"--cp {cp} must divide the number of processes, got {world} (WORLD_SIZE); run "
                         f"torchrun --nproc-per-node with a multiple of {cp} (world = data-parallel x --cp)")


def build(world: int, rank: int, cp: int) -> Parallelism:
    """The layout of this rank, creating the CP and DP groups when ``cp > 1`` (collective: every rank calls it)."""
    check_world(world, cp)
    if cp == 1:
        return Parallelism(world=world, rank=rank, cp=1)
    dp = world // cp
    cp_group = dp_group = None
    for replica in range(dp):                       # consecutive ranks: one replica's slices on one host first
        group = dist.new_group(list(range(replica * cp, (replica + 1) * cp)))
        if replica == rank // cp:
            cp_group = group
    if dp > 1:
        for position in range(cp):
            group = dist.new_group(list(range(position, world, cp)))
            if position == rank % cp:
                dp_group = group
    return Parallelism(world=world, rank=rank, cp=cp, cp_group=cp_group, dp_group=dp_group)


def local_rows(t: torch.Tensor, cp_group, cp_partition: str = "contiguous") -> torch.Tensor:
    """This rank's rows of a per-row tensor of the packed batch (all of them without context parallelism).

    The one place the training job slices rows, so tokens, targets and answer masks always match the rows the
    attention layers compute for ``cp_group`` and ``cp_partition``.
    """
    return t if cp_group is None else shard(t, cp_group, cp_partition)


def sum_gradients(parameters, cp_group) -> None:
    """All-reduce (sum) the gradients over the CP group: one flat buffer per dtype, so one collective each.

    Every rank of a CP group runs every layer, so the parameters holding a gradient are the same on all of them.
    """
    if cp_group is None:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=cp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def sum_over(values: torch.Tensor, cp_group) -> torch.Tensor:
    """``values`` summed over the CP group (for logging: the CP shares of a loss add up to the replica's)."""
    if cp_group is not None:
        values = values.clone()
        dist.all_reduce(values, group=cp_group)
    return values

"""Data x context x tensor parallelism of the training job: process layout, groups, row slices, gradient reduction.

Under ``torchrun`` the ``world`` processes form ``dp = world / (cp * tp)`` data-parallel replicas of ``cp * tp``
consecutive ranks each. Global rank ``r`` is

- tensor-parallel rank ``r % tp`` (innermost: a TP group is ``tp`` consecutive ranks, on GPUs the fastest link),
- context-parallel rank ``(r // tp) % cp``,
- of replica ``r // (cp * tp)``.

Groups (every rank belongs to one of each kind that has more than one rank):

- *TP group*: the ``tp`` ranks of one replica and one CP position, ``[base + c * tp + t for t in range(tp)]``
  with ``base = d * cp * tp``. They read the same batch and compute the same rows; each holds its share of the
  attention heads (:mod:`dsv4attn.parallel.tensor`), everything else whole.
- *CP group*: the ``cp`` ranks of one replica with the same TP rank, ``[base + c * tp + t for c in range(cp)]``.
  They read the same packed batch, each computing its rows (docs/semantics.md, decision 10): one contiguous
  slice, or with the ``"head_tail"`` partition two chunks (:mod:`dsv4attn.parallel.partition`).
- *DP group*: the ranks holding the same rows and the same head shard across replicas,
  ``[d * cp * tp + c * tp + t for d in range(dp)]``.

With ``tp == 1`` this is the dp x cp layout of before (``cp`` consecutive ranks per replica). Example, 8 ranks at
``--cp 2 --tp 2``: replicas {0..3} and {4..7}; TP groups {0,1} {2,3} {4,5} {6,7}; CP groups {0,2} {1,3} {4,6}
{5,7}; DP groups {0,4} {1,5} {2,6} {3,7}.

The library never creates process groups (the layers take ``cp_group=`` / ``tp_group=`` from the caller); the
training job is the caller, so it builds them here, on every rank, in the same order (``new_group`` is
collective).

Gradients: a rank's backward gives its CP share of the replica's gradient (the LM loss share below, and the
layers' indexer-loss share, which they already normalise by the global real-token count). The replica gradient
is the *sum* over the CP group; the run's gradient is the *mean* over replicas. DDP runs over the DP group only
(it averages, as plain data parallelism does), then :func:`sum_gradients` all-reduces over the CP group. One DDP
over the whole world with the LM loss scaled by ``cp`` would not do: the indexer loss is fed gradient 1 inside
the layers, not through the LM loss, so its gradient would come out ``cp`` times too small. Under TP the
attention layers leave every replicated parameter's gradient whole and equal on the TP ranks and each sharded
one's gradient on its shard, so neither reduction involves the TP group: the DP and CP groups pair ranks of the
same TP rank, which hold the same shard (:mod:`dsv4attn.train.tensor` has the norm, checkpoint and resume parts).
"""
from __future__ import annotations

import datetime
import itertools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..layers.common import is_sharded
from ..parallel import shard
from ..parallel.comm import communication_error


@dataclass(frozen=True)
class Parallelism:
    """Where this process sits in the dp x cp x tp layout, and the groups it talks to."""

    world: int                  # processes of the job
    rank: int                   # global rank
    cp: int                     # context-parallel ranks per replica (--cp)
    cp_group: object = None     # this rank's CP group; None when cp == 1 (the layers' single-device path)
    dp_group: object = None     # this rank's DP group for DDP; None: the default group when cp == tp == 1 (no
                                # DDP at all when dp == 1)
    tp: int = 1                 # tensor-parallel ranks per CP position (--tp)
    tp_group: object = None     # this rank's TP group; None when tp == 1

    @property
    def dp(self) -> int:
        return self.world // (self.cp * self.tp)

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.cp * self.tp)

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp


def environment() -> tuple[int, int, int]:
    """(world_size, rank, local_rank): of the process group if one is initialised already (the caller owns it),
    else from torchrun's environment, else (1, 0, 0)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank(), local_rank
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")), local_rank


def check_world(world: int, cp: int, tp: int = 1) -> None:
    """Host-only, before any process group exists: ``cp * tp`` must split the world into whole replicas."""
    if world % (cp * tp):
        if tp == 1:
            raise ValueError(f"--cp {cp} must divide the number of processes, got {world} (WORLD_SIZE); run "
                             f"torchrun --nproc-per-node with a multiple of {cp} (world = data-parallel x --cp)")
        raise ValueError(f"--cp {cp} x --tp {tp} = {cp * tp} must divide the number of processes, got {world} "
                         f"(WORLD_SIZE); run torchrun --nproc-per-node with a multiple of {cp * tp} (world = "
                         f"data-parallel x --cp x --tp)")


def build(world: int, rank: int, cp: int, timeout: float | None = None, tp: int = 1) -> Parallelism:
    """The layout of this rank (module docstring), creating its TP, CP and DP groups where they have more than
    one rank and the run is not plain data parallelism (collective: every rank calls it).

    ``timeout``: seconds a collective of these groups waits for the other ranks (--pg-timeout; None: torch's
    default), so that a rank that fails and stays alive cannot keep the others waiting for ever."""
    check_world(world, cp, tp)
    if cp == 1 and tp == 1:
        return Parallelism(world=world, rank=rank, cp=1)
    size = cp * tp
    dp = world // size
    d_me, c_me, t_me = rank // size, (rank // tp) % cp, rank % tp
    cp_group = dp_group = tp_group = None
    limit = None if timeout is None else datetime.timedelta(seconds=timeout)
    if tp > 1:
        for replica, position in itertools.product(range(dp), range(cp)):
            base = replica * size + position * tp
            group = dist.new_group(list(range(base, base + tp)), timeout=limit)
            if (replica, position) == (d_me, c_me):
                tp_group = group
    if cp > 1:                                      # with tp == 1: consecutive ranks, one replica's slices first
        for replica, t in itertools.product(range(dp), range(tp)):
            group = dist.new_group([replica * size + c * tp + t for c in range(cp)], timeout=limit)
            if (replica, t) == (d_me, t_me):
                cp_group = group
    if dp > 1:
        for position, t in itertools.product(range(cp), range(tp)):
            group = dist.new_group([d * size + position * tp + t for d in range(dp)], timeout=limit)
            if (position, t) == (c_me, t_me):
                dp_group = group
    return Parallelism(world=world, rank=rank, cp=cp, cp_group=cp_group, dp_group=dp_group, tp=tp,
                       tp_group=tp_group)


def local_rows(t: torch.Tensor, cp_group, cp_partition: str = "contiguous") -> torch.Tensor:
    """This rank's rows of a per-row tensor of the packed batch (all of them without context parallelism).

    The one place the training job slices rows, so tokens, targets and answer masks always match the rows the
    attention layers compute for ``cp_group`` and ``cp_partition``.
    """
    return t if cp_group is None else shard(t, cp_group, cp_partition)


def sum_gradients(parameters, cp_group) -> None:
    """All-reduce (sum) the gradients over the CP group: one flat buffer per dtype, so one collective each.

    Every rank of a CP group runs every layer, so the parameters holding a gradient are the same on all of them.
    Under ``--fsdp`` a gradient is this rank's shard (a DTensor, already reduced over the data-parallel ranks); the
    ranks of a CP group are the same data-parallel rank of their own replica's group, so they hold the same shard
    and its local values are summed alike.
    """
    if cp_group is None:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            grad = p.grad.to_local() if is_sharded(p.grad) else p.grad
            by_dtype.setdefault(grad.dtype, []).append(grad)
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


class RankFailed(RuntimeError):
    """Another rank of the job failed; this one stopped waiting for it (after the process-group timeout)."""


_RUNS = itertools.count()       # train() calls of this process: every rank makes the same calls, in the same order


class FailureBoard:
    """Where the ranks of one training run leave word of a failure: keys in the default process group's store
    (the rendezvous store every rank already talks to; no collective, so it works while others are stuck).

    A rank that fails on its own (any error but a communication one) writes ``failed/<rank>`` with the error
    and re-raises it. A rank whose collective then fails (it waited past ``--pg-timeout`` for the failed rank, or
    lost it) finds that key and raises :class:`RankFailed` naming the rank, where and why, instead of gloo's or
    NCCL's bare timeout. Keys are per run (``train()`` call), so a later run in the same process group does not
    see an earlier run's failure."""

    def __init__(self, rank: int, world: int, timeout: float):
        self.rank, self.world, self.timeout = rank, world, timeout
        try:
            store = dist.distributed_c10d._get_default_store()
            self.store = dist.PrefixStore(f"dsv4attn/train/run{next(_RUNS)}", store)
        except Exception:       # no store to reach (an unusual backend): plain errors, as without the board
            self.store = None

    def record(self, where: str, err: BaseException) -> None:
        if self.store is not None:
            try:
                self.store.set(f"failed/{self.rank}", f"{where}: {type(err).__name__}: {err}"[:2000])
            except Exception:
                pass            # the store is gone too: this rank's own error still propagates

    def failures(self) -> dict[int, str]:
        """{rank: what it reported} for every other rank that recorded a failure."""
        found = {}
        if self.store is None:
            return found
        for r in range(self.world):
            try:
                if r != self.rank and self.store.check([f"failed/{r}"]):
                    found[r] = self.store.get(f"failed/{r}").decode("utf-8", "replace")
            except Exception:
                break
        return found

    def explain(self, err: Exception, where: str) -> Exception:
        """The error this rank raises for ``err`` (hit at ``where``): ``err`` itself when it is this rank's own
        failure (recorded for the others), else a RankFailed naming the rank(s) that failed first."""
        if not communication_error(err):
            self.record(where, err)
            return err
        others = self.failures()
        if not others:
            return err          # nobody reported anything: a rank died or hung; the backend's error says which op
        named = "; ".join(f"rank {r} failed at {what}" for r, what in sorted(others.items()))
        return RankFailed(f"{named}. This rank (rank {self.rank}, at {where}) stopped waiting for it after the "
                          f"process-group timeout (--pg-timeout {self.timeout:g} s); see that rank's error")

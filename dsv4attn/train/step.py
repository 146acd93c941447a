"""One training step: forward, backward, gradient reduction, clipping, the finite check and the optimizer step.

Contract of :func:`train_step`: the loss, indexer loss and gradient norm come to the host in one read and must be
finite *before* the optimizer step; if one is not, :class:`NonFiniteStep` is raised naming the step and the first
non-finite quantity, with the parameters and the optimizer state untouched. Under data parallelism the replicas
agree first (one all-reduce of three flags), so every rank stops at the same step.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..layers.common import is_sharded
from . import distributed, tensor
from .model import DecoderLM, lm_loss

STEP_QUANTITIES = ("loss", "indexer_loss", "grad_norm")      # checked in this order; the first non-finite is named


class NonFiniteStep(RuntimeError):
    """A training step produced a non-finite loss or gradient norm; the run stopped before applying it."""


@dataclass(frozen=True)
class StepMetrics:
    """What one step reports (host floats). ``indexer_loss`` is None without an indexer and in the dense phase,
    where the layers return a zero placeholder (the indexer is idle)."""
    loss: float
    indexer_loss: float | None
    grad_norm: float


def loss_and_grads(step_model, model: DecoderLM, batch, phase: str, cp_group=None, cp_partition: str = "contiguous",
                   autocast=None, cp_compressed: str = "gather"):
    """Forward and backward of one batch; leaves in ``model``'s ``.grad`` the gradient of the replica's batch
    (summed over the CP group; averaged over replicas when ``step_model`` is DDP) and returns (LM loss, summed
    indexer loss or None) of the whole batch as 0-d tensors.

    Under context parallelism the next-token targets were formed on the global batch (data.py), so they are
    sliced like the tokens; the LM loss of a rank is its rows' cross entropy over the *global* target count, and
    the layers' indexer losses are shares of the global value too: both add up over the CP group.
    """
    with autocast or nullcontext():
        logits = step_model(batch.tokens, batch.cu_seqlens, batch.max_seqlen, phase, cp_group=cp_group,
                            cp_partition=cp_partition, cp_compressed=cp_compressed)
        loss = lm_loss(logits, distributed.local_rows(batch.targets, cp_group, cp_partition), batch.num_targets)
    loss.backward()                              # the indexer loss rides along inside the layers
                                                 # (docs/semantics.md, decision 7)
    distributed.sum_gradients(model.parameters(), cp_group)
    idx_loss = model.indexer_loss()
    shares = loss.detach().reshape(1) if idx_loss is None else torch.stack([loss.detach(), idx_loss.to(loss.dtype)])
    totals = distributed.sum_over(shares, cp_group)
    return totals[0], (None if idx_loss is None else totals[1])


def train_step(model: DecoderLM, optimizer, batch, phase: str, step: int, grad_clip: float, par=None, *,
               cp_partition: str = "contiguous", cp_compressed: str = "gather", step_model=None,
               autocast=None, graphs=None) -> StepMetrics:
    """Optimizer step ``step + 1`` (0-based ``step``) on ``batch`` in ``phase``, at the LR already set on
    ``optimizer``. ``par`` is the :class:`~dsv4attn.train.distributed.Parallelism` (None: one process);
    ``step_model`` is what runs the forward (the DDP wrapper of ``model``, or ``model`` itself when None);
    ``graphs`` (--cuda-graphs, one process): a :class:`~dsv4attn.train.graphs.GraphedSteps` that runs the forward
    and backward instead."""
    cp_group = par.cp_group if par is not None else None
    if graphs is not None:
        loss, idx_loss = graphs.run(batch, phase)
    else:
        loss, idx_loss = loss_and_grads(step_model or model, model, batch, phase, cp_group=cp_group,
                                        cp_partition=cp_partition, autocast=autocast, cp_compressed=cp_compressed)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if par is not None and par.tp > 1:           # sharded squares summed over TP, replicated ones counted once
        grad_norm = tensor.clip_grad_norm(model, grad_clip)
    elif grad_clip > 0:                          # after every reduction: the same norm on every rank
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:
        grad_norm = torch.nn.utils.get_total_norm(grads) if grads else loss.new_zeros(())
    if is_sharded(grad_norm):                    # FSDP2: the norm of the sharded gradients, still a DTensor
        grad_norm = grad_norm.full_tensor()
    zero = loss.detach().new_zeros(())
    numbers = torch.stack([loss.detach(), zero if idx_loss is None else idx_loss.to(loss.dtype),
                           grad_norm.to(loss.dtype)])
    flags = (~torch.isfinite(numbers)).to(loss.dtype)
    if par is not None and par.dp > 1:           # replicas saw other batches: agree before anyone stops
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=par.dp_group)
    values = torch.cat([numbers, flags]).tolist()      # the step's one host read
    for i, name in enumerate(STEP_QUANTITIES):
        if values[3 + i]:
            here = values[i]
            where = (f"is {here}" if not math.isfinite(here)
                     else f"is not finite on another data-parallel replica (here {here})")
            raise NonFiniteStep(f"step {step + 1} ({phase} phase): the {name} {where}; training stopped before the "
                                f"optimizer step, so nothing of this step was applied or saved")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepMetrics(loss=values[0], indexer_loss=None if idx_loss is None or phase == "dense" else values[1],
                       grad_norm=values[2])

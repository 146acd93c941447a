"""Setting up a run: devices, process groups, the run folder, model, optimizer, resume point and data.

Contract of :func:`setup`: everything that can be checked (options, data path, world size, resume compatibility,
output directory) is checked *before* anything is written, so a bad option leaves no trace; only then does rank 0
remove the run that ``--overwrite`` replaces and open the run folder. The model is seeded before it is built, then the
resumed checkpoint (if any) replaces its weights, the optimizer state and the RNGs, so a run is a pure function of its
:class:`TrainConfig` and ``--resume`` continues it bit for bit.
"""
from __future__ import annotations

import datetime

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from . import distributed, tensor
from .checkpointer import resume_point, restore
from .config import TrainConfig
from .data import EVAL, make_source
from .graphs import GraphedSteps
from .model import DecoderLM, ModelConfig, model_config
from .run_folder import Run, check_out_dir, remove_run


@dataclass
class Setup:
    """Everything a run's loop reads, made by :func:`setup`; :meth:`close` releases what it opened."""
    cfg: TrainConfig
    mcfg: ModelConfig
    device: torch.device
    par: distributed.Parallelism
    own_group: bool                 # this run created the process group (and destroys it)
    source: object                  # the data source (data.make_source)
    model: DecoderLM
    optimizer: torch.optim.Optimizer
    step_model: torch.nn.Module     # what runs the forward: the DDP wrapper of ``model``, or ``model``
    sharded: bool                   # --fsdp over dp > 1 ranks: ``model`` is FSDP2-sharded (DTensor parameters)
    autocast: object                # bf16 autocast on CUDA, else None
    graphs: object                  # --cuda-graphs: the GraphedSteps that run each step's forward + backward
    eval_batches: list              # held-out batches (replica 0's ranks only; empty elsewhere)
    loaded: object                  # the checkpoint resumed (checkpoint.Loaded), or None
    start: int                      # steps done before this session
    run: Run

    @property
    def is_main(self) -> bool:
        return self.par.rank == 0

    def close(self) -> None:
        self.run.close()
        if self.own_group and dist.is_initialized():
            dist.destroy_process_group()


def pick_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (use --device cpu or auto)")
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build_optimizer(model: DecoderLM, cfg: TrainConfig) -> torch.optim.AdamW:
    # Decay matrices only, and never the indexer: its dense-phase steps must leave it exactly unchanged.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and ".indexer." not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def shard_lm(model: DecoderLM, par: distributed.Parallelism, device: torch.device) -> None:
    """--fsdp: FSDP2 over the data-parallel ranks (cp == 1: the default group), one unit per attention layer,
    per block and the root (:func:`dsv4attn.parallel.fsdp.shard_model`). On CUDA the units gather bf16 (the
    sinks and positional biases fp32) and reduce fp32; on the CPU they gather fp32, as the DDP run computes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ..parallel.fsdp import shard_model
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if device.type == "cuda" else None)
    group = par.dp_group if par.dp_group is not None else dist.group.WORLD
    shard_model(model, group, mp_policy=policy, units=model.blocks)


def init_process_group(world: int, device: torch.device, timeout: float) -> bool:
    """Create the default process group for a multi-process run unless the caller made one (it stays the
    caller's, with its own timeout); returns whether this run owns it. ``timeout``: --pg-timeout seconds."""
    if world == 1 or dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout))
    return True


def setup(cfg: TrainConfig) -> Setup:
    """Check ``cfg`` and everything it names, then build the run (see the module docstring for the order)."""
    cfg.validate()
    world, rank, local_rank = distributed.environment()
    distributed.check_world(world, cfg.cp, cfg.tp)
    device = pick_device(cfg, local_rank)
    mcfg = model_config(cfg.model, cfg.ratios, cfg.indexer_loss_coeff)
    source = make_source(cfg.data, n_layers=mcfg.num_layers, window=mcfg.attention.sliding_window)

    loaded = resume_point(cfg, world)
    out = Path(cfg.out)
    continues_run = loaded is not None and out.is_dir() and out.resolve() == loaded.run_dir.resolve()
    replace_run = check_out_dir(out, cfg.overwrite, continues_run)
    if loaded is not None and rank == 0:
        for note in loaded.notes:
            print(f"warning: --resume {cfg.resume}: {note}", file=sys.stderr, flush=True)

    if cfg.cuda_graphs and (device.type != "cuda" or world > 1):
        raise ValueError(f"--cuda-graphs needs one process on a CUDA device (here: {device}, {world} process"
                         f"{'es' if world > 1 else ''})")
    own_group = init_process_group(world, device, cfg.pg_timeout)
    par = distributed.build(world, rank, cfg.cp, timeout=cfg.pg_timeout, tp=cfg.tp)
    torch.manual_seed(cfg.seed)          # under --tp every rank draws the full tensors and keeps its slices
    model = DecoderLM(mcfg, tp_group=par.tp_group).to(device)
    sharded = cfg.fsdp and par.dp > 1
    if sharded:          # before the optimizer: it must hold the sharded (DTensor) parameters
        shard_lm(model, par, device)
    optimizer = build_optimizer(model, cfg)
    start = restore(loaded, model, optimizer)
    step_model = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        process_group=par.dp_group) if par.dp > 1 and not sharded else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    # Replica 0 evaluates (all its CP and TP ranks: they split each batch or its heads); under FSDP every rank (each
    # forward gathers the parameters from all of them), on the same batches; rank 0 logs.
    eval_batches = [source.batch(cfg.seed, EVAL, i, cfg.capacity).padded_to(cfg.batch_rows)
                    for i in range(cfg.eval_batches)] if par.dp_rank == 0 or sharded else []

    if rank == 0 and replace_run:                  # --overwrite: only now that everything has been checked
        remove_run(out)
    run = Run(out, rank == 0)
    run.open(start if continues_run else None)
    run.write_json("config.json", {"run_config": cfg.to_dict(), "model_config": mcfg.to_dict(),
                                   "data": source.describe(), "world_size": world, "data_parallel": par.dp,
                                   "tensor_parallel": par.tp,
                                   "device": str(device)})
    run.log({"kind": "start", "step": start, "device": str(device), "world_size": world, "cp": cfg.cp,
             "tp": cfg.tp, "fsdp": sharded, "cuda_graphs": cfg.cuda_graphs,
             "resumed_from": str(loaded.path) if loaded else None, "resume_notes": loaded.notes if loaded else [],
             "dropped_records": run.dropped_records, "params": tensor.full_numel(model)})
    graphs = GraphedSteps(model, cfg.batch_rows, device) if cfg.cuda_graphs else None
    return Setup(cfg=cfg, mcfg=mcfg, device=device, par=par, own_group=own_group, source=source, model=model,
                 optimizer=optimizer, step_model=step_model, sharded=sharded, autocast=autocast, graphs=graphs,
                 eval_batches=eval_batches, loaded=loaded, start=start, run=run)

"""The training loop: :func:`train` wires the parts together (setup, step, evaluator, checkpointer, report).

Contract of :func:`train`: nothing is written before everything is checked (:mod:`.setup`); a run is a pure
function of its :class:`TrainConfig` (the data batch of step s on data-parallel replica d is batch ``s * dp + d``
of the seeded stream, the LR and the phase are functions of s), so ``--resume`` reproduces a straight run bit for
bit on the same device and world size.

Parallelism (:mod:`dsv4attn.train.distributed`): ``world = dp x cp x tp`` processes; the ``cp`` ranks of a replica
split its batch's rows (context parallelism), its ``tp`` ranks the attention heads (tensor parallelism, the same
rows), replicas average their gradients (DDP). Metrics are those of replica 0's batch, whatever ``cp`` and ``tp``
are: a ``--cp 2`` or ``--tp 2`` run logs the numbers of the one-process run (up to rounding).

A step whose loss, indexer loss or gradient norm is not finite stops the run with :class:`NonFiniteStep` on
every rank at the same step (:mod:`.step`); nothing of it is applied or saved, so ``latest`` is the last good state.
"""
from __future__ import annotations

import time

import torch.distributed as dist
from tqdm import tqdm

from . import distributed, tensor
from .checkpointer import Checkpointer
from .config import TrainConfig
from .data import TRAIN
from .evaluate import Evaluator
from .report import Throughput, write_summary
from .setup import setup
from .step import NonFiniteStep, train_step


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training as ``cfg`` says; returns the final summary dict (rank 0; others get {})."""
    s = setup(cfg)
    cfg, par, run = s.cfg, s.par, s.run
    end = min(cfg.steps, s.start + cfg.stop_after) if cfg.stop_after else cfg.steps
    bar = tqdm(total=cfg.steps, initial=s.start, desc="train", unit="step", dynamic_ncols=True, mininterval=0.5,
               disable=not s.is_main)
    say = bar.write if s.is_main else (lambda line: None)
    evaluator = Evaluator(s.model, s.eval_batches, cfg.eval_every, end, s.device, s.autocast, par,
                          cfg.cp_partition, run, say, active=par.dp_rank == 0 or s.sharded,
                          cp_compressed=cfg.cp_compressed)
    checkpointer = Checkpointer(cfg, run.out, s.is_main, end, data=s.source.describe(), dp=par.dp,
                                about={"run_config": cfg.to_dict(), "model_config": s.mcfg.to_dict(),
                                       "world_size": par.world},
                                last_saved=(s.start, cfg.resume) if s.loaded is not None else None,
                                gathers_tp=par.tp > 1 and par.dp_rank == 0 and par.cp_rank == 0)
    meter = Throughput(s.start)
    # A failing rank leaves word for the others, which then stop (within --pg-timeout) naming it, not waiting.
    board = distributed.FailureBoard(par.rank, par.world, cfg.pg_timeout) if par.world > 1 else None
    where = "the start of the run"
    try:
        prev_phase = cfg.phase_of(s.start - 1) if s.start else None
        for step in range(s.start, end):
            where = f"step {step + 1}"
            phase = cfg.phase_of(step)
            if phase != prev_phase:
                say(f"step {step}: phase {prev_phase or 'start'} -> {phase}")
                run.log({"kind": "phase", "step": step, "phase": phase})
                prev_phase = phase
            t0 = time.perf_counter()
            lr = cfg.lr_at(step)
            for group in s.optimizer.param_groups:
                group["lr"] = lr
            batch = s.source.batch(cfg.seed, TRAIN, step * par.dp + par.dp_rank, cfg.capacity)
            batch = batch.padded_to(cfg.batch_rows).to(s.device)
            try:
                m = train_step(s.model, s.optimizer, batch, phase, step, cfg.grad_clip, par,
                               cp_partition=cfg.cp_partition, cp_compressed=cfg.cp_compressed,
                               step_model=s.step_model, autocast=s.autocast, graphs=s.graphs)
            except NonFiniteStep as e:
                message = f"{e}; {checkpointer.kept_note()}"
                run.log({"kind": "stopped", "step": step + 1, "phase": phase, "reason": message})
                raise NonFiniteStep(message) from None
            dt, tokens = time.perf_counter() - t0, batch.num_tokens * par.dp
            meter.add(tokens, dt)
            run.log({"kind": "train", "step": step + 1, "phase": phase, "loss": m.loss,
                     "indexer_loss": m.indexer_loss, "lr": lr, "tokens": tokens, "tokens_per_s": tokens / dt})
            bar.set_postfix(loss=f"{m.loss:.3f}", phase=phase, tok_s=f"{meter.rate:.0f}", refresh=False)
            bar.update(1)
            evaluator.maybe_run(step + 1, phase)
            checkpointer.maybe_save(step + 1, s.model, s.optimizer, meter.tokens, sharded=s.sharded)
        bar.close()
        where = "the end of the run"
        done = max(s.start, end)
        last_eval = evaluator.final(done, cfg.phase_of(done - 1))
        summary = write_summary(run.out, cfg, s.mcfg, s.device, par.world, meter, last_eval,
                                tensor.full_numel(s.model), done) if s.is_main else {}
        if par.world > 1:
            dist.barrier()          # no rank returns (or resumes) before rank 0 has written the run's files
        return summary
    except Exception as err:
        # No local may keep the error: this frame is in the error's traceback, and a cycle through it would keep
        # the run (its process groups among them) alive past destroy_process_group(), until a garbage collection;
        # gloo's worker threads then run into interpreter exit and the process can die with SIGABRT.
        if board is None:
            raise
        failure = board.explain(err, where)
        if failure is err:
            del failure
            raise
        try:
            raise failure from err
        finally:
            del failure
    finally:
        bar.close()
        s.close()

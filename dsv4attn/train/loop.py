"""The training loop: setup (devices, data parallelism, resume), steps through the curriculum, evaluation,
checkpoints, and the end-of-run plot and summary.

Contract of :func:`train`: everything that can be checked (options, data path, resume compatibility, output
directory) is checked *before* anything is written; a run is a pure function of its :class:`TrainConfig` (the data
batch of step s on data-parallel replica d is batch ``s * dp + d`` of the seeded stream, the LR and the phase are
functions of s), so ``--resume`` reproduces a straight run bit for bit on the same device and world size.

Parallelism (:mod:`dsv4attn.train.distributed`): ``world = dp x cp`` processes; the ``cp`` ranks of a replica
split its batch's rows (context parallelism), replicas average their gradients (DDP). Metrics are those of
replica 0's batch, whatever ``cp`` is: a ``--cp 2`` run logs the numbers of the ``--cp 1`` run (up to rounding).

Every step reads its numbers once (loss, indexer loss, gradient norm: one host read) and checks that they are
finite *before* the optimizer step; if one is not, the run stops with :class:`NonFiniteStep` naming the step and the
first non-finite quantity, on every rank at the same step. Nothing of that step is applied or saved, so the newest
checkpoint (``latest``) is the last good state.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from . import checkpoint as ckpt_io
from . import distributed
from .config import TrainConfig, resume_mismatches
from .data import EVAL, TRAIN, make_source
from .evaluate import evaluate
from .model import DecoderLM, lm_loss, model_config
from .report import plot_curves, summary_text

RUN_FILES = ("metrics.jsonl", "curves.png", "summary.txt", "summary.json", "config.json", "checkpoints")
STEP_QUANTITIES = ("loss", "indexer_loss", "grad_norm")      # checked in this order; the first non-finite is named
# The temporary siblings of atomic_write_text: a run killed while writing one leaves it behind.
RUN_FILE_TMP = re.compile(r"\.(metrics\.jsonl|curves\.png|summary\.txt|summary\.json|config\.json)\.tmp-\d+")


class NonFiniteStep(RuntimeError):
    """A training step produced a non-finite loss or gradient norm; the run stopped before applying it."""


class Run:
    """Where a run writes (rank 0 only) and what it appends to its JSONL log."""

    def __init__(self, out: Path, is_main: bool):
        self.out, self.is_main = out, is_main
        self._log = None
        self.logged_evals: set[int] = set()
        self.dropped_records = 0

    def open(self, resumed_at: int | None = None) -> None:
        """Open the log for appending; continuing the run in ``out`` from step ``resumed_at``, first drop the
        records of the steps after it (a session stopped or killed after its last checkpoint logged them; they are
        done again) and any torn last line."""
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            path = self.out / "metrics.jsonl"
            if resumed_at is not None and path.exists():
                self._drop_records_after(path, resumed_at)
            self._log = open(path, "a", encoding="utf-8")

    def _drop_records_after(self, path: Path, step: int) -> None:
        kept = []
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict):
                continue
            at = rec.get("step")
            if isinstance(at, int):
                # train and eval records carry the step done; start and phase records the step about to run
                if at > step or (at == step and rec.get("kind") not in ("train", "eval")):
                    continue
                if rec.get("kind") == "eval":
                    self.logged_evals.add(at)
            kept.append(line)
        self.dropped_records = len(lines) - len(kept)
        if self.dropped_records:
            ckpt_io.atomic_write_text(path, "".join(line + "\n" for line in kept))

    def log(self, record: dict) -> None:
        if self._log is not None:
            self._log.write(json.dumps(record) + "\n")
            self._log.flush()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()


def _pick_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (use --device cpu or auto)")
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _foreign_entries(out: Path) -> list[str]:
    """What ``out`` holds that the trainer did not write (paths relative to ``out``)."""
    foreign = []
    for p in sorted(out.iterdir()):
        if p.name == "checkpoints" and p.is_dir() and not p.is_symlink():
            foreign.extend(str(q.relative_to(out)) for q in ckpt_io.foreign_entries(p))
        elif not ((p.name in RUN_FILES[:-1] or RUN_FILE_TMP.fullmatch(p.name)) and p.is_file()
                  and not p.is_symlink()):
            foreign.append(p.name)
    return foreign


def _check_out_dir(cfg: TrainConfig, out: Path, continues_run: bool) -> bool:
    """A fresh run refuses a --out that already holds a run unless --overwrite; resuming may append to its own.
    --overwrite refuses a folder holding anything the trainer did not write. Returns whether the run in --out is to
    be removed (--overwrite)."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if continues_run:
        return False
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if cfg.overwrite:
        foreign = _foreign_entries(out)
        if foreign:
            more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
            raise ValueError(f"--overwrite: --out {out} holds {', '.join(foreign[:5])}{more}, which the trainer did "
                             f"not write; --overwrite removes a run's own files only ({', '.join(RUN_FILES)}), so "
                             f"move those away or pick another --out (nothing was written)")
        return bool(existing)
    if existing:
        raise ValueError(f"--out {out} already holds a run ({', '.join(existing)}); pass --resume {out} to continue "
                         f"it, --overwrite to replace it, or another --out")
    return False


def _remove_run(out: Path) -> None:
    """Delete the run files of ``out`` (checked by _check_out_dir to be the trainer's only)."""
    for p in sorted(out.iterdir()):
        if p.name == "checkpoints":
            shutil.rmtree(p)
        elif p.name in RUN_FILES or RUN_FILE_TMP.fullmatch(p.name):
            p.unlink()


def _resume_point(cfg: TrainConfig, world: int) -> ckpt_io.Loaded | None:
    """The checkpoint named by --resume, checked and read, after checking it can continue this run; or None."""
    if cfg.resume is None:
        return None
    loaded = ckpt_io.load_checkpoint(cfg.resume)
    meta = loaded.meta
    diffs = resume_mismatches(meta["run_config"], cfg)
    if meta.get("world_size", 1) != world:
        diffs.append(f"world size: checkpoint {meta.get('world_size', 1)}, now {world}")
    if diffs:
        raise ValueError(f"--resume {cfg.resume}: the run options differ from the checkpoint's ({loaded.path}), so "
                         f"it cannot continue that run (nothing was written):\n  " + "\n  ".join(diffs))
    return loaded


def loss_and_grads(step_model, model: DecoderLM, batch, phase: str, cp_group=None, cp_partition: str = "contiguous",
                   autocast=None):
    """Forward and backward of one batch; leaves in ``model``'s ``.grad`` the gradient of the replica's batch
    (summed over the CP group; averaged over replicas when ``step_model`` is DDP) and returns (LM loss, summed
    indexer loss or None) of the whole batch as 0-d tensors.

    Under context parallelism the next-token targets were formed on the global batch (data.py), so they are
    sliced like the tokens; the LM loss of a rank is its rows' cross entropy over the *global* target count, and
    the layers' indexer losses are shares of the global value too: both add up over the CP group.
    """
    with autocast or nullcontext():
        logits = step_model(batch.tokens, batch.cu_seqlens, batch.max_seqlen, phase, cp_group=cp_group,
                            cp_partition=cp_partition)
        loss = lm_loss(logits, distributed.local_rows(batch.targets, cp_group, cp_partition), batch.num_targets)
    loss.backward()                              # the indexer loss rides along inside the layers (decision 7)
    distributed.sum_gradients(model.parameters(), cp_group)
    idx_loss = model.indexer_loss()
    shares = loss.detach().reshape(1) if idx_loss is None else torch.stack([loss.detach(), idx_loss.to(loss.dtype)])
    totals = distributed.sum_over(shares, cp_group)
    return totals[0], (None if idx_loss is None else totals[1])


def _train_step(step_model, model: DecoderLM, optimizer, batch, phase: str, cfg: TrainConfig, cp_group, autocast,
                step: int = 0, dp_group=None, dp: int = 1):
    """One optimizer step; returns (LM loss, summed indexer loss or None) as floats.

    The loss, indexer loss and gradient norm come to the host in one read and must be finite before the optimizer
    step; otherwise :class:`NonFiniteStep` is raised (step ``step + 1``), with the parameters and optimizer state
    untouched. Under data parallelism the replicas first agree (one all-reduce of three flags over ``dp_group``),
    so every rank stops at the same step."""
    loss, idx_loss = loss_and_grads(step_model, model, batch, phase, cp_group=cp_group,
                                    cp_partition=cfg.cp_partition, autocast=autocast)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if cfg.grad_clip > 0:                        # after every reduction: the same norm on every rank
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    else:
        grad_norm = torch.nn.utils.get_total_norm(grads) if grads else loss.new_zeros(())
    zero = loss.detach().new_zeros(())
    numbers = torch.stack([loss.detach(), zero if idx_loss is None else idx_loss.to(loss.dtype),
                           grad_norm.to(loss.dtype)])
    flags = (~torch.isfinite(numbers)).to(loss.dtype)
    if dp > 1:                                   # replicas saw other batches: agree before anyone stops
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=dp_group)
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
    # The dense phase's indexer loss is a zero placeholder (indexer idle): log it as absent.
    return values[0], None if idx_loss is None or phase == "dense" else values[1]


def _optimizer(model: DecoderLM, cfg: TrainConfig) -> torch.optim.AdamW:
    # Decay matrices only, and never the indexer: its dense-phase steps must leave it exactly unchanged.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and ".indexer." not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training as ``cfg`` says; returns the final summary dict (rank 0; others get {})."""
    cfg.validate()
    world, rank, local_rank = distributed.environment()
    distributed.check_world(world, cfg.cp)
    device = _pick_device(cfg, local_rank)
    mcfg = model_config(cfg.model, cfg.ratios, cfg.indexer_loss_coeff)
    source = make_source(cfg.data, n_layers=mcfg.num_layers, window=mcfg.attention.sliding_window)

    loaded = _resume_point(cfg, world)
    out = Path(cfg.out)
    continues_run = loaded is not None and out.is_dir() and out.resolve() == loaded.run_dir.resolve()
    replace_run = _check_out_dir(cfg, out, continues_run)
    if loaded is not None and rank == 0:
        for note in loaded.notes:
            print(f"warning: --resume {cfg.resume}: {note}", file=sys.stderr, flush=True)

    own_group = world > 1 and not dist.is_initialized()   # a caller's process group stays the caller's
    if own_group:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    par = distributed.build(world, rank, cfg.cp)
    is_main = rank == 0
    evaluates = par.dp_rank == 0                  # replica 0 evaluates (all its CP ranks); rank 0 logs

    torch.manual_seed(cfg.seed)
    model = DecoderLM(mcfg).to(device)
    optimizer = _optimizer(model, cfg)
    start = 0
    if loaded is not None:
        ckpt_io.load_into(loaded, model, optimizer)
        ckpt_io.set_rng_state(loaded.meta["rng"])
        start = loaded.meta["step"]
        loaded.weights = loaded.optimizer_state = None      # in the model and optimizer now
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        process_group=par.dp_group) if par.dp > 1 else None
    step_model = ddp if ddp is not None else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    rows = cfg.batch_rows
    eval_batches = [source.batch(cfg.seed, EVAL, i, cfg.capacity).padded_to(rows)
                    for i in range(cfg.eval_batches)] if evaluates else []

    if is_main and replace_run:                    # --overwrite: only now that everything has been checked
        _remove_run(out)
    run = Run(out, is_main)
    run.open(start if continues_run else None)
    if is_main:
        ckpt_io.atomic_write_text(out / "config.json", json.dumps(
            {"run_config": cfg.to_dict(), "model_config": mcfg.to_dict(), "data": source.describe(),
             "world_size": world, "data_parallel": par.dp, "device": str(device)}, indent=1))
        run.log({"kind": "start", "step": start, "device": str(device), "world_size": world, "cp": cfg.cp,
                 "resumed_from": str(loaded.path) if loaded else None,
                 "resume_notes": loaded.notes if loaded else [], "dropped_records": run.dropped_records,
                 "params": sum(p.numel() for p in model.parameters())})

    stats = {"train_time_s": 0.0, "tokens": 0, "start_step": start, "wall_start": time.perf_counter()}
    last_eval = None
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, mininterval=0.5,
               disable=not is_main)
    tok_rate = None
    # The newest good checkpoint of this run (step, where --resume finds it): what a stopped run leaves behind.
    last_saved = (start, cfg.resume) if loaded is not None else None
    try:
        prev_phase = cfg.phase_of(start - 1) if start else None
        end = min(cfg.steps, start + cfg.stop_after) if cfg.stop_after else cfg.steps
        for step in range(start, end):
            phase = cfg.phase_of(step)
            if phase != prev_phase:
                if is_main:
                    bar.write(f"step {step}: phase {prev_phase or 'start'} -> {phase}")
                run.log({"kind": "phase", "step": step, "phase": phase})
                prev_phase = phase
            t0 = time.perf_counter()
            lr = cfg.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = source.batch(cfg.seed, TRAIN, step * par.dp + par.dp_rank, cfg.capacity)
            batch = batch.padded_to(rows).to(device)
            try:
                loss_value, idx_loss = _train_step(step_model, model, optimizer, batch, phase, cfg,
                                                   par.cp_group, autocast, step, par.dp_group, par.dp)
            except NonFiniteStep as e:
                kept = (f"the newest checkpoint (step {last_saved[0]}) stays latest; resume from it with "
                        f"--resume {last_saved[1]}" if last_saved is not None else "no checkpoint was written yet")
                message = f"{e}; {kept}"
                run.log({"kind": "stopped", "step": step + 1, "phase": phase, "reason": message})
                raise NonFiniteStep(message) from None
            dt = time.perf_counter() - t0
            tokens = batch.num_tokens * par.dp
            stats["train_time_s"] += dt
            stats["tokens"] += tokens
            tok_rate = tokens / dt if tok_rate is None else 0.9 * tok_rate + 0.1 * tokens / dt
            record = {"kind": "train", "step": step + 1, "phase": phase, "loss": loss_value,
                      "indexer_loss": idx_loss, "lr": lr,
                      "tokens": tokens, "tokens_per_s": tokens / dt}
            run.log(record)
            bar.set_postfix(loss=f"{loss_value:.3f}", phase=phase, tok_s=f"{tok_rate:.0f}", refresh=False)
            bar.update(1)
            done = step + 1
            if evaluates and (done % cfg.eval_every == 0 or done == end):
                last_eval = evaluate(model, eval_batches, phase, device, autocast, par.cp_group,
                                     cfg.cp_partition)
                run.log({"kind": "eval", "step": done, "phase": phase, **last_eval})
                if is_main:
                    bar.write(_eval_line(done, phase, last_eval))
            if (cfg.save_every and done % cfg.save_every == 0) or done == end:
                if is_main:
                    _save(out, model, optimizer, cfg, mcfg, source, done, world, par.dp, stats)
                last_saved = (done, out)
        bar.close()
        end = max(start, end)
        summary = {}
        if evaluates and last_eval is None:    # resumed at or past the last step: still report the model
            last_eval = evaluate(model, eval_batches, cfg.phase_of(end - 1), device, autocast, par.cp_group,
                                 cfg.cp_partition)
            if end not in run.logged_evals:
                run.log({"kind": "eval", "step": end, "phase": cfg.phase_of(end - 1), **last_eval})
        if is_main:
            summary = _finish(out, cfg, mcfg, device, world, stats, last_eval, model, end)
        if world > 1:
            dist.barrier()          # no rank returns (or resumes) before rank 0 has written the run's files
        return summary
    finally:
        bar.close()
        run.close()
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


def _eval_line(step: int, phase: str, m: dict) -> str:
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    return (f"eval @ {step} ({phase}): lm_loss {m['lm_loss']:.4f}  retrieval_acc {fmt(m['retrieval_acc'], '.3f')}  "
            f"indexer_loss {fmt(m['indexer_loss'], '.5f')}  recall@k {fmt(m['indexer_recall'], '.3f')}")


def _save(out: Path, model, optimizer, cfg: TrainConfig, mcfg, source, done: int, world: int, dp: int,
          stats: dict) -> None:
    # Replicas hold the same weights and optimizer state (DDP, and the CP sum before every step): rank 0 writes.
    meta = {"step": done, "phase": cfg.phase_of(done - 1),
            "next_phase": cfg.phase_of(done) if done < cfg.steps else None,
            "data": {**source.describe(), "next_batch": done * dp},
            "run_config": cfg.to_dict(), "model_config": mcfg.to_dict(), "world_size": world,
            "rng": ckpt_io.rng_state(), "tokens_seen_this_session": stats["tokens"],
            "torch_version": torch.__version__}
    ckpt_io.save_checkpoint(out, model, optimizer, meta, cfg.keep)


def _finish(out: Path, cfg, mcfg, device, world, stats, last_eval, model, done: int) -> dict:
    wall = time.perf_counter() - stats["wall_start"]
    summary = {
        "out": str(out), "steps": cfg.steps, "done": done, "steps_this_session": done - stats["start_step"],
        "ratios": list(cfg.ratios), "device": str(device), "world_size": world, "cp": cfg.cp,
        "params": sum(p.numel() for p in model.parameters()),
        "wall_time_s": wall, "train_time_s": stats["train_time_s"], "tokens": stats["tokens"],
        "tokens_per_s": stats["tokens"] / stats["train_time_s"] if stats["train_time_s"] else None,
        "final_eval": last_eval, "schedule": {"dense": cfg.dense_steps, "warmup": cfg.warmup_steps,
                                              "sparse": cfg.steps - cfg.dense_steps - cfg.warmup_steps},
    }
    if cfg.plot:
        summary["plot"] = str(plot_curves(out / "metrics.jsonl", out / "curves.png", cfg,
                                          mcfg.attention.index_topk))
    text = summary_text(summary)
    ckpt_io.atomic_write_text(out / "summary.txt", text)
    ckpt_io.atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    print(text, flush=True)
    return summary

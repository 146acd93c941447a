"""When a run saves and what it resumes from: the call sites of :mod:`dsv4attn.train.checkpoint` (which owns the
crash-safe save and the verified load).

Contract: :func:`resume_point` reads and checks ``--resume`` before anything is written; :class:`Checkpointer`
saves every ``--save-every`` steps and after the last step of the session (rank 0 writes: the replicas hold the
same weights and optimizer state), and remembers the newest good checkpoint, which a stopped run names.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import checkpoint as ckpt_io
from . import tensor
from .config import TrainConfig, resume_mismatches


def resume_point(cfg: TrainConfig, world: int) -> ckpt_io.Loaded | None:
    """The checkpoint named by --resume, checked and read, after checking it can continue this run; or None.

    The world size may differ only by --tp (free on resume): the data-parallel replica count, which decides the
    batches of each step, must be the checkpoint's."""
    if cfg.resume is None:
        return None
    loaded = ckpt_io.load_checkpoint(cfg.resume)
    meta = loaded.meta
    diffs = resume_mismatches(meta["run_config"], cfg)
    saved_world = meta.get("world_size", 1)
    saved_tp = meta["run_config"].get("tp", 1)
    saved_tp = saved_tp if isinstance(saved_tp, int) and not isinstance(saved_tp, bool) and saved_tp >= 1 else 1
    replica = cfg.cp * cfg.tp
    if saved_world * cfg.tp != world * saved_tp:    # --cp must be equal (above): then this compares replicas
        shown = (f"checkpoint {saved_world}, now {world}" if saved_tp == cfg.tp else
                 f"checkpoint {saved_world} (--tp {saved_tp}: {saved_world // (cfg.cp * saved_tp)} data-parallel "
                 f"replicas), now {world} (--tp {cfg.tp}: {world // replica} data-parallel replicas; the replica "
                 f"count must stay)")
        diffs.append(f"world size: {shown}")
    if diffs:
        raise ValueError(f"--resume {cfg.resume}: the run options differ from the checkpoint's ({loaded.path}), so "
                         f"it cannot continue that run (nothing was written):\n  " + "\n  ".join(diffs))
    return loaded


def restore(loaded: ckpt_io.Loaded | None, model, optimizer) -> int:
    """Put ``loaded`` into ``model``, ``optimizer`` and the RNGs; returns the step to continue from (0: fresh).
    Under tensor parallelism each rank keeps its slices of the full tensors the checkpoint holds."""
    if loaded is None:
        return 0
    loaded.weights, loaded.optimizer_state = tensor.local_state(model, optimizer, loaded.weights,
                                                                loaded.optimizer_state)
    ckpt_io.load_into(loaded, model, optimizer)
    ckpt_io.set_rng_state(loaded.meta["rng"])
    loaded.weights = loaded.optimizer_state = None      # in the model and optimizer now: free the copies
    return loaded.meta["step"]


class Checkpointer:
    """Saves ``out/checkpoints/step_N`` when due and knows the newest good checkpoint of the run."""

    def __init__(self, cfg: TrainConfig, out: Path, is_main: bool, end: int, about: dict, data: dict, dp: int,
                 last_saved: tuple[int, object] | None, gathers_tp: bool = False):
        # ``about``: the configs and world size every checkpoint records; ``data``: the data source's description
        # (each checkpoint adds its position); ``end``: the session's last step, always saved so that --resume
        # continues where it stopped; ``last_saved``: (step, where --resume finds it) of the checkpoint resumed;
        # ``gathers_tp``: this rank is in rank 0's TP group (--tp > 1), which gathers the full state for it.
        self.cfg, self.out, self.is_main, self.end = cfg, out, is_main, end
        self.about, self.data, self.dp, self.last_saved = about, data, dp, last_saved
        self.gathers_tp = gathers_tp

    def maybe_save(self, done: int, model: torch.nn.Module, optimizer, tokens_seen: int, sharded: bool = False
                   ) -> bool:
        """Save after ``done`` steps if it is due; returns whether it saved. ``sharded`` (an FSDP2 model): every
        rank gathers the full weights and optimizer state (collectives), then rank 0 writes the same files an
        unsharded run writes. Under --tp the ranks of rank 0's TP group gather the sharded weights and AdamW moments
        (collectives over that group), so rank 0 writes the files of a --tp 1 run too."""
        cfg = self.cfg
        if not ((cfg.save_every and done % cfg.save_every == 0) or done == self.end):
            return False
        full = {}
        if sharded:              # FSDP2 first (every rank), then --tp's slices (rank 0's TP group)
            from ..parallel.fsdp import full_optimizer_state_dict, full_state_dict
            full = dict(weights=full_state_dict(model), optimizer_state=full_optimizer_state_dict(optimizer))
        if self.gathers_tp:
            weights, optimizer_state = tensor.full_state(model, optimizer, full.get("weights"),
                                                         full.get("optimizer_state"))
            full = dict(weights=weights, optimizer_state=optimizer_state)
        if self.is_main:
            meta = {"step": done, "phase": cfg.phase_of(done - 1),
                    "next_phase": cfg.phase_of(done) if done < cfg.steps else None,
                    "data": {**self.data, "next_batch": done * self.dp}, **self.about,
                    "rng": ckpt_io.rng_state(), "tokens_seen_this_session": tokens_seen,
                    "torch_version": torch.__version__}
            ckpt_io.save_checkpoint(self.out, model, optimizer, meta, cfg.keep, **full)
        self.last_saved = (done, self.out)
        return True

    def kept_note(self) -> str:
        """What a run that stops now leaves behind, for its error message."""
        if self.last_saved is None:
            return "no checkpoint was written yet"
        step, where = self.last_saved
        return f"the newest checkpoint (step {step}) stays latest; resume from it with --resume {where}"

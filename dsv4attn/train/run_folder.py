"""The run folder (``--out``): which files are the trainer's, whether a run may write there, and its JSONL log.

Contract: :func:`check_out_dir` only reads (it runs before anything is written); :func:`remove_run` deletes only
files :func:`check_out_dir` accepted as the trainer's; :class:`Run` writes on rank 0 only, so every other rank
can call it unconditionally.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from . import checkpoint as ckpt_io

RUN_FILES = ("metrics.jsonl", "curves.png", "summary.txt", "summary.json", "config.json", "checkpoints")
# The temporary siblings of atomic_write_text: a run killed while writing one leaves it behind.
RUN_FILE_TMP = re.compile(r"\.(metrics\.jsonl|curves\.png|summary\.txt|summary\.json|config\.json)\.tmp-\d+")


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

    def write_json(self, name: str, value: dict) -> None:
        """``out/name`` replaced atomically by ``value`` as indented JSON (rank 0)."""
        if self.is_main:
            ckpt_io.atomic_write_text(self.out / name, json.dumps(value, indent=1))

    def close(self) -> None:
        if self._log is not None:
            self._log.close()


def foreign_entries(out: Path) -> list[str]:
    """What ``out`` holds that the trainer did not write (paths relative to ``out``)."""
    foreign = []
    for p in sorted(out.iterdir()):
        if p.name == "checkpoints" and p.is_dir() and not p.is_symlink():
            foreign.extend(str(q.relative_to(out)) for q in ckpt_io.foreign_entries(p))
        elif not ((p.name in RUN_FILES[:-1] or RUN_FILE_TMP.fullmatch(p.name)) and p.is_file()
                  and not p.is_symlink()):
            foreign.append(p.name)
    return foreign


def check_out_dir(out: Path, overwrite: bool, continues_run: bool) -> bool:
    """A fresh run refuses a --out that already holds a run unless --overwrite; resuming may append to its own.
    --overwrite refuses a folder holding anything the trainer did not write. Returns whether the run in --out is to
    be removed (--overwrite)."""
    _check_not_in_checkpoints(out)
    if not out.exists():
        return False
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if continues_run:
        return False
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if overwrite:
        foreign = foreign_entries(out)
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


def _check_not_in_checkpoints(out: Path) -> None:
    """--out must not be (or lie inside) a checkpoint folder or the ``checkpoints`` folder of a run: that run's
    pruning removes whole checkpoint folders, so it would one day delete this run with them."""
    for p in (out.absolute(), *out.absolute().parents):
        if p.is_dir() and ckpt_io.is_checkpoint_dir(p):
            raise ValueError(f"--out {out} is inside the checkpoint {p}; a run written there would be deleted with "
                             f"it when its run prunes old checkpoints: pick a folder outside any run's checkpoints")
        if p.name == "checkpoints" and any((p.parent / name).is_file() for name in RUN_FILES[:-1]):
            raise ValueError(f"--out {out} is inside {p}, the checkpoints folder of the run {p.parent}: pick a "
                             f"folder outside any run's checkpoints")


def remove_run(out: Path) -> None:
    """Delete the run files of ``out`` (checked by check_out_dir to be the trainer's only)."""
    for p in sorted(out.iterdir()):
        if p.name == "checkpoints":
            shutil.rmtree(p)
        elif p.name in RUN_FILES or RUN_FILE_TMP.fullmatch(p.name):
            p.unlink()

"""TrainConfig: every option of a training run, its validation, the phase curriculum and the LR schedule.

The command line (:mod:`dsv4attn.train.cli`) fills a :class:`TrainConfig`; everything else reads it. Validation
happens before anything is created or written, so a bad option never leaves a half-written run behind.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..config import COMPRESS_RATIOS, Phase
from ..parallel import PARTITIONS
from ..parallel import num_chunks
from .model import DEFAULT_RATIOS, PRESETS, largest_halo, model_config


@dataclass
class TrainConfig:
    # schedule: steps [0, dense_steps) dense, then warmup_steps warm-up, then sparse until steps
    steps: int = 600                    # optimizer steps in total
    dense_steps: int = 300              # dense phase: CSA attends every visible entry, indexer idle
    warmup_steps: int = 100             # warm-up: sparse main path, indexer trained on the dense teacher
    # model
    model: str = "tiny"                 # preset of dsv4attn.train.model.PRESETS
    ratios: tuple[int, ...] = DEFAULT_RATIOS  # compress ratio of each layer (0 window, 4 CSA, 128 HCA)
    indexer_loss_coeff: float = 0.01    # lambda of the indexer KL loss (spec decision 7)
    # data
    data: str | None = None             # None: built-in retrieval task; else a UTF-8 file or folder (bytes)
    capacity: int = 1024                # rows of every packed batch: one per data-parallel replica (its CP ranks
                                        # split it; padded up to equal chunks, see batch_rows)
    seed: int = 0                       # model init and data stream
    # optimizer (AdamW) and LR schedule: linear warm-up, then cosine down to min_lr_ratio * lr
    lr: float = 3e-3
    lr_warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0           # on matrices only; the indexer's idle dense-phase steps stay exact
    grad_clip: float = 1.0              # max global grad norm; 0 disables clipping
    # what the run shows and writes
    eval_every: int = 50                # held-out evaluation every N steps (and after the last)
    eval_batches: int = 8               # held-out batches per evaluation
    save_every: int = 200               # checkpoint every N steps (and after the last); 0 = last only
    keep: int = 2                       # checkpoints kept (oldest deleted first)
    out: str = "runs/default"
    resume: str | None = None           # checkpoint dir or run dir (its latest checkpoint)
    overwrite: bool = False             # allow a fresh run into a non-empty --out
    stop_after: int = 0                 # stop (with a checkpoint) after this many steps of this session; 0 = never
    plot: bool = True                   # write curves.png at the end
    # devices and parallelism
    device: str = "auto"                # auto = cuda when available, else cpu
    cp: int = 1                         # context-parallel ranks per replica (torchrun world = data-parallel x cp)
    cp_partition: str = "contiguous"    # rows of a CP rank: one slice, or "head_tail" (2 chunks, balanced work)
    pg_timeout: float = 300.0           # seconds a collective may wait for the other ranks before the job stops,
                                        # naming the rank that failed (the job's own process groups)

    def __post_init__(self) -> None:
        self.ratios = tuple(self.ratios)

    def validate(self) -> "TrainConfig":
        """Raise ValueError naming the first bad option (as its command-line flag) and the expectation."""
        def need_int(name, lo):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= {lo}, got {v!r}")

        need_int("steps", 1)
        for name in ("dense_steps", "warmup_steps", "lr_warmup_steps", "save_every", "seed", "stop_after"):
            need_int(name, 0)
        for name in ("eval_every", "eval_batches", "keep"):
            need_int(name, 1)
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 1:
            raise ValueError(f"--capacity must be at least one token (rows of a packed batch), got {self.capacity!r}")
        if self.dense_steps + self.warmup_steps > self.steps:
            raise ValueError(f"phase schedule does not fit: --dense-steps ({self.dense_steps}) + --warmup-steps "
                             f"({self.warmup_steps}) must be <= --steps ({self.steps})")
        if not self.ratios or any(r not in COMPRESS_RATIOS for r in self.ratios):
            raise ValueError(f"--ratios must be a comma-separated list of {COMPRESS_RATIOS}, got {self.ratios!r}")
        if self.model not in PRESETS:
            raise ValueError(f"--model must be one of {sorted(PRESETS)}, got {self.model!r}")
        for name in ("lr", "indexer_loss_coeff", "weight_decay", "grad_clip", "min_lr_ratio"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v!r}")
        if self.lr <= 0 or self.min_lr_ratio > 1:
            raise ValueError(f"--lr must be > 0 and --min-lr-ratio in [0, 1], got {self.lr!r}, {self.min_lr_ratio!r}")
        need_int("cp", 1)
        if (isinstance(self.pg_timeout, bool) or not isinstance(self.pg_timeout, (int, float))
                or not math.isfinite(self.pg_timeout) or self.pg_timeout <= 0):
            raise ValueError(f"--pg-timeout must be a number of seconds > 0, got {self.pg_timeout!r}")
        if self.cp_partition not in PARTITIONS:
            raise ValueError(f"--cp-partition must be one of {', '.join(PARTITIONS)}, got {self.cp_partition!r}")
        if self.cp > 1:
            # Every chunk of rows needs the last `halo` rows of the chunk before it, so a chunk can be no shorter
            # (the layers raise too, but only at the first forward and without naming the options).
            halo = largest_halo(model_config(self.model, self.ratios))
            chunks = num_chunks(self.cp_partition, self.cp)
            chunk = self.batch_rows // chunks
            if chunk < halo:
                held = (f"{chunk} rows" if chunks == self.cp else
                        f"{chunks // self.cp} chunks of {chunk} rows (--cp-partition {self.cp_partition})")
                raise ValueError(f"--cp {self.cp} with --capacity {self.capacity}: each context-parallel rank would "
                                 f"hold {held} of the packed batch, but the model's layers (--ratios "
                                 f"{','.join(map(str, self.ratios))}) need a left halo of {halo} rows from the "
                                 f"previous chunk; use --capacity >= {halo * chunks} or a smaller --cp")
        if not isinstance(self.out, str) or not self.out.strip():
            raise ValueError(f"--out must name the run directory, got {self.out!r} (an empty --out would write into "
                             f"the working directory)")
        if self.resume is not None and (not isinstance(self.resume, str) or not self.resume.strip()):
            raise ValueError(f"--resume must name a checkpoint or run directory, got {self.resume!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        return self

    @property
    def batch_rows(self) -> int:
        """Rows of a packed batch as the model sees it: ``capacity`` rounded up to a multiple of the partition's
        chunk count (``cp``, or ``2 * cp`` for head-tail) so that the chunks are equal; the extra rows are
        capacity padding, so the documents, losses and gradients are those of --cp 1."""
        chunks = num_chunks(self.cp_partition, self.cp) if self.cp_partition in PARTITIONS else self.cp
        return -(-self.capacity // chunks) * chunks

    def phase_of(self, step: int) -> Phase:
        """Phase of the 0-based optimizer step ``step``."""
        if step < self.dense_steps:
            return "dense"
        if step < self.dense_steps + self.warmup_steps:
            return "warmup"
        return "sparse"

    def lr_at(self, step: int) -> float:
        """Learning rate of the 0-based step ``step`` (a pure function of the step: resume needs no state)."""
        if step < self.lr_warmup_steps:
            return self.lr * (step + 1) / self.lr_warmup_steps
        span = max(self.steps - self.lr_warmup_steps, 1)
        progress = min((step - self.lr_warmup_steps) / span, 1.0)
        floor = self.min_lr_ratio
        return self.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ratios"] = list(self.ratios)
        return d


# Options that may differ when resuming (where output goes and how often it is written or evaluated); every other
# option shapes the run and must equal the checkpoint's, or --resume refuses.
RESUME_FREE = frozenset({"out", "resume", "overwrite", "plot", "eval_every", "eval_batches", "save_every", "keep",
                         "device", "stop_after", "pg_timeout"})


def resume_mismatches(saved: dict, current: TrainConfig) -> list[str]:
    """``--flag: checkpoint X, now Y`` for every run-shaping option that differs from the checkpoint's."""
    now = current.to_dict()
    defaults = TrainConfig().to_dict()      # an option newer than the checkpoint ran as its default
    diffs = []
    for name, value in now.items():
        if name in RESUME_FREE:
            continue
        before = saved.get(name, defaults[name])
        if before != value:
            diffs.append(f"--{name.replace('_', '-')}: checkpoint {before!r}, now {value!r}")
    return diffs

"""TrainConfig: every option of a training run, its validation, the phase curriculum and the LR schedule.

The command line (:mod:`dsv4attn.train.cli`) fills a :class:`TrainConfig`; everything else reads it. Validation
happens before anything is created or written, so a bad option never leaves a half-written run behind.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..config import COMPRESS_RATIOS, Phase
from ..parallel import PARTITIONS
from ..parallel import num_chunks
from .model import DEFAULT_RATIOS, PRESETS, largest_halo, model_config
from .tensor import check_split

COMPRESSED_MODES = ("gather", "sharded")        # pack_batch(..., cp_compressed=)


def option(default, help: str, **extra):
    """A TrainConfig field and its command-line help, written once: cli.py builds ``--name`` from it (``extra``:
    more argparse settings, such as ``choices``)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class TrainConfig:
    # schedule: steps [0, dense_steps) dense, then warmup_steps warm-up, then sparse until steps
    steps: int = option(600, "optimizer steps in total")
    dense_steps: int = option(300, "steps in the dense phase (CSA attends every visible compressed entry; indexer "
                                   "idle)")
    warmup_steps: int = option(100, "steps in the warm-up phase after the dense one (sparse attention, dense "
                                    "indexer teacher)")
    # model
    model: str = option("tiny", "model preset: tiny (CPU, minutes) or small (GPU throughput)")    # model.PRESETS
    ratios: tuple[int, ...] = option(DEFAULT_RATIOS, "comma-separated compress ratio of each layer: 0 window, "
                                                     "4 CSA, 128 HCA")
    indexer_loss_coeff: float = option(0.01, "coefficient of the indexer KL loss")     # lambda,
                                                                                       # docs/semantics.md decision 7
    # data
    data: str | None = option(None, "UTF-8 text file or folder of them (byte-level); default: the built-in "
                                    "retrieval task")
    # one batch per data-parallel replica; its CP ranks split it, padded up to equal chunks (see batch_rows)
    capacity: int = option(1024, "rows (tokens) of every packed batch, one per data-parallel replica (split "
                                 "across its --cp ranks)")
    seed: int = option(0, "seed of the model init and the data stream")
    # optimizer (AdamW) and LR schedule: linear warm-up, then cosine down to min_lr_ratio * lr
    lr: float = option(3e-3, "peak AdamW learning rate")
    lr_warmup_steps: int = option(20, "linear LR warm-up steps (then cosine decay)")
    min_lr_ratio: float = option(0.1, "final LR as a fraction of --lr")
    # never on the indexer, so that its idle dense-phase steps leave it exactly unchanged
    weight_decay: float = option(0.0, "AdamW weight decay on matrices (never on the indexer)")
    grad_clip: float = option(1.0, "clip the global gradient norm to this value (0: off)")
    # what the run shows and writes
    eval_every: int = option(50, "held-out evaluation every N steps (and after the last)")
    eval_batches: int = option(8, "held-out batches per evaluation")
    save_every: int = option(200, "checkpoint every N steps (and after the last); 0: only the last")
    keep: int = option(2, "checkpoints to keep")                                       # oldest deleted first
    out: str = option("runs/default", "run directory (metrics.jsonl, checkpoints/, curves.png, summary.txt)")
    resume: str | None = option(None, "continue from a checkpoint directory or a run directory (its latest "
                                      "checkpoint)")
    overwrite: bool = option(False, "replace a run already in --out")
    stop_after: int = option(0, "stop after N steps of this session with a checkpoint (continue with --resume); "
                                "0: never")
    plot: bool = option(True, "write curves.png at the end (--no-plot to skip)")
    # devices and parallelism
    device: str = option("auto", "auto (cuda when available), cpu or cuda")
    cp: int = option(1, "context-parallel ranks per replica: under torchrun, world = data-parallel x --cp")
    tp: int = option(1, "tensor-parallel ranks: each attention layer's query heads and output groups split over N "
                        "ranks that share one batch (docs/tensor_parallel.md); world = data-parallel x --cp x --tp; "
                        "N divides the heads and o_groups")
    cp_partition: str = option("contiguous", "rows of each context-parallel rank: contiguous (one slice) or "
                                             "head_tail (chunks i and 2C-1-i of 2C: even causal work)",
                               choices=PARTITIONS)
    cp_compressed: str = option("gather", "how the context-parallel ranks share the CSA layers' compressed KV: "
                                          "gather (every rank all-gathers all of it) or sharded (in the sparse "
                                          "phase each rank keeps its own and fetches the top-k rows it selects; "
                                          "same results, docs/context_parallel.md). sharded needs --cp > 1",
                                choices=COMPRESSED_MODES)
    fsdp: bool = option(False, "shard parameters, gradients and optimizer state over the data-parallel ranks "
                               "(FSDP2: a unit per attention layer and per block; on CUDA bf16 gathers with the "
                               "sinks and positional biases fp32); checkpoints hold the same full-state files as "
                               "without it. With --cp > 1 it shards over each CP rank's data-parallel group (the "
                               "CP ranks of a replica sum their gradient shards), with --tp > 1 it shards each TP "
                               "rank's slices; a single replica (world = cp x tp) runs unsharded")
    cuda_graphs: bool = option(False, "capture the forward and backward in CUDA graphs, one per phase and span "
                                      "(the batch's longest document rounded up to a power of two or 1.5 times "
                                      "one), and replay them (one process on a CUDA device; candidate sets are "
                                      "then sized by the span, not by the longest document)")
    pg_timeout: float = option(300.0, "seconds a collective waits for the other ranks; past it the job stops on "
                                      "every rank with an error naming the rank that failed (instead of waiting "
                                      "forever)")

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
        need_int("tp", 1)
        if (isinstance(self.pg_timeout, bool) or not isinstance(self.pg_timeout, (int, float))
                or not math.isfinite(self.pg_timeout) or self.pg_timeout <= 0):
            raise ValueError(f"--pg-timeout must be a number of seconds > 0, got {self.pg_timeout!r}")
        if self.cp_partition not in PARTITIONS:
            raise ValueError(f"--cp-partition must be one of {', '.join(PARTITIONS)}, got {self.cp_partition!r}")
        if self.cp_compressed not in COMPRESSED_MODES:
            raise ValueError(f"--cp-compressed must be one of {', '.join(COMPRESSED_MODES)}, got "
                             f"{self.cp_compressed!r}")
        if self.cp_compressed == "sharded" and self.cp == 1:
            raise ValueError("--cp-compressed sharded needs --cp > 1 (it says how context-parallel ranks share the "
                             "compressed KV; one rank per replica has nothing to share); leave it out with --cp 1")
        if not isinstance(self.fsdp, bool):
            raise ValueError(f"--fsdp must be a bool, got {self.fsdp!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"--cuda-graphs must be a bool, got {self.cuda_graphs!r}")
        if self.cuda_graphs and (self.cp > 1 or self.tp > 1 or self.fsdp):
            raise ValueError("--cuda-graphs runs one process: not with --cp > 1, --tp > 1 or --fsdp (the captured "
                             "step makes no collective)")
        if self.tp > 1:
            a = model_config(self.model, self.ratios).attention
            why = check_split(a.num_attention_heads, a.o_groups, self.tp)
            if why:
                raise ValueError(f"{why} (--model {self.model})")
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
                         "device", "stop_after", "pg_timeout", "fsdp", "tp", "cuda_graphs"})
# --fsdp is free too: its checkpoints hold the same full-state files, so a run may switch it when resuming (then it
# continues within rounding, not bit for bit: a reduce-scatter adds in another order than an all-reduce). So is --tp:
# checkpoints hold the full tensors whatever --tp wrote them, and the data stream depends on the data-parallel
# replica count only (checked on resume), so a run continues at another --tp within rounding. So is --cuda-graphs:
# it changes how a step is launched and the width of the dense and warm-up candidate sets, not what is learnt.


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

"""``python -m dsv4attn.train``: command-line options -> :class:`TrainConfig` -> :func:`train`.

Every flag maps to the TrainConfig field of the same name (dashes for underscores); defaults come from the
dataclass, so the two never disagree. Errors in options, data or resume compatibility exit with status 2 and one
line naming the option, before anything is written. A run that stops on a non-finite loss or gradient norm exits
with status 1 and one line naming the step, the quantity and the checkpoint it left as ``latest``; a rank left
waiting for a failed one (past ``--pg-timeout``) exits with status 1 and one line naming that rank; a file-system
failure during the run exits with status 1 and one line naming the file; Ctrl-C exits with status 130 and says how
to resume.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from ..parallel import PARTITIONS
from .config import TrainConfig

HELP = {
    "steps": "optimizer steps in total",
    "dense_steps": "steps in the dense phase (CSA attends every visible compressed entry; indexer idle)",
    "warmup_steps": "steps in the warm-up phase after the dense one (sparse attention, dense indexer teacher)",
    "model": "model preset: tiny (CPU, minutes) or small (GPU throughput)",
    "ratios": "comma-separated compress ratio of each layer: 0 window, 4 CSA, 128 HCA",
    "indexer_loss_coeff": "coefficient of the indexer KL loss",
    "data": "UTF-8 text file or folder of them (byte-level); default: the built-in retrieval task",
    "capacity": "rows (tokens) of every packed batch, one per data-parallel replica (split across its --cp ranks)",
    "seed": "seed of the model init and the data stream",
    "lr": "peak AdamW learning rate",
    "lr_warmup_steps": "linear LR warm-up steps (then cosine decay)",
    "min_lr_ratio": "final LR as a fraction of --lr",
    "weight_decay": "AdamW weight decay on matrices (never on the indexer)",
    "grad_clip": "clip the global gradient norm to this value (0: off)",
    "eval_every": "held-out evaluation every N steps (and after the last)",
    "eval_batches": "held-out batches per evaluation",
    "save_every": "checkpoint every N steps (and after the last); 0: only the last",
    "keep": "checkpoints to keep",
    "out": "run directory (metrics.jsonl, checkpoints/, curves.png, summary.txt)",
    "resume": "continue from a checkpoint directory or a run directory (its latest checkpoint)",
    "overwrite": "replace a run already in --out",
    "stop_after": "stop after N steps of this session with a checkpoint (continue with --resume); 0: never",
    "plot": "write curves.png at the end (--no-plot to skip)",
    "device": "auto (cuda when available), cpu or cuda",
    "cp": "context-parallel ranks per replica: under torchrun, world = data-parallel x --cp",
    "cp_partition": "rows of each context-parallel rank: contiguous (one slice) or head_tail (chunks i and "
                    "2C-1-i of 2C: even causal work)",
    "pg_timeout": "seconds a collective waits for the other ranks; past it the job stops on every rank with an "
                  "error naming the rank that failed (instead of waiting forever)",
}


def _ratios(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ratios must be comma-separated ints such as 0,4,128,4, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dsv4attn.train",
        description="Train a small decoder LM built from DeepSeek-V4 hybrid attention layers through the "
                    "dense -> warm-up -> sparse curriculum (built-in long-range retrieval data by default). "
                    "Data parallel under torchrun --nproc-per-node N; with --cp C, each group of C consecutive "
                    "ranks splits one batch (context parallelism).")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.type in ("bool",) or isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=HELP[f.name])
        elif f.name == "ratios":
            parser.add_argument(flag, type=_ratios, default=default, help=HELP[f.name] + " (default 0,4,128,4)")
        elif f.name == "cp_partition":
            parser.add_argument(flag, choices=PARTITIONS, default=default, help=f"{HELP[f.name]} (default {default})")
        else:
            kind = type(default) if default is not None else str
            parser.add_argument(flag, type=kind, default=default, help=f"{HELP[f.name]} (default {default})")
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse ``argv`` into a validated TrainConfig (argparse exits with status 2 on malformed flags)."""
    ns = build_parser().parse_args(argv)
    return TrainConfig(**vars(ns)).validate()


def main(argv: list[str] | None = None) -> int:
    from .distributed import RankFailed
    from .loop import NonFiniteStep, train
    cfg = None
    try:
        cfg = parse_args(argv)
        train(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteStep as e:                   # the run diverged: stopped, its last good checkpoint kept
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RankFailed as e:         # another rank failed first: its name and error are the message
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:            # the file system failed under a running job (a full disk): say where
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        hint = f": continue from the last checkpoint with --resume {cfg.out}" if cfg is not None else ""
        print(f"\ninterrupted{hint}", file=sys.stderr)
        return 130
    return 0

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

from .config import TrainConfig


def _int_list(flag: str, example: str):
    """argparse type of a tuple-of-ints option: comma-separated, such as its default ``example``."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be comma-separated ints such as {example}, got {text!r}")
    return parse


def build_parser() -> argparse.ArgumentParser:
    """One ``--name`` per TrainConfig field: its help and extra settings (``choices``) from the field's metadata,
    its type from the default (tuple of ints: comma-separated; bool: ``--name`` / ``--no-name``)."""
    parser = argparse.ArgumentParser(
        prog="python -m dsv4attn.train",
        description="Train a small decoder LM built from DeepSeek-V4 hybrid attention layers through the "
                    "dense -> warm-up -> sparse curriculum (built-in long-range retrieval data by default). "
                    "Data parallel under torchrun --nproc-per-node N; with --cp C, the C ranks of a replica split "
                    "one batch (context parallelism); with --tp T, T consecutive ranks split each attention "
                    "layer's heads on the same batch (tensor parallelism).")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        extra = {k: v for k, v in f.metadata.items() if k != "help"}
        helps = f.metadata["help"]
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=helps, **extra)
        elif isinstance(default, tuple):
            shown = ",".join(map(str, default))
            parser.add_argument(flag, type=_int_list(flag, shown), default=default,
                                help=f"{helps} (default {shown})", **extra)
        else:
            kind = type(default) if default is not None else str
            parser.add_argument(flag, type=kind, default=default, help=f"{helps} (default {default})", **extra)
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse ``argv`` into a validated TrainConfig (argparse exits with status 2 on malformed flags)."""
    ns = build_parser().parse_args(argv)
    return TrainConfig(**vars(ns)).validate()


def main(argv: list[str] | None = None) -> int:
    from .distributed import RankFailed
    from .loop import train
    from .step import NonFiniteStep
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

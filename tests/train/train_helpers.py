"""Shared settings of the training-job tests: the smallest runs that still cross every phase."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from dsv4attn.train.cli import main

# 4 steps: dense (step 0), warm-up (steps 1-2), sparse (step 3); batches of 192 rows hold one retrieval document
# of the tiny model (filler > 4 layers x 7 rows) plus short ones.
TINY = ["--steps", "4", "--dense-steps", "1", "--warmup-steps", "2", "--capacity", "192", "--eval-every", "2",
        "--eval-batches", "1", "--no-plot"]


def run_cli(*args: str) -> int:
    return main([*TINY, *args])


def tree_digest(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``root`` (to prove nothing was written or changed)."""
    root = Path(root)
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# Fault tests: one CSA layer on 64-row batches (every phase, indexer and compressor state in the optimizer), 8 steps,
# a checkpoint every 2 steps, 3 kept: a finished run holds step_0000004, step_0000006 and step_0000008.
FAST = ["--ratios", "4", "--capacity", "64", "--steps", "8", "--dense-steps", "1", "--warmup-steps", "2",
        "--eval-every", "100", "--save-every", "2", "--keep", "3"]


def run_fast(*args: str) -> int:
    return run_cli(*FAST, *args)


def records(out: Path, kind: str | None = None) -> list[dict]:
    import json
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if kind is None or r["kind"] == kind]


def checkpoint_names(out: Path) -> list[str]:
    """Every entry of ``out/checkpoints`` (hidden leftovers included), sorted."""
    return sorted(p.name for p in (Path(out) / "checkpoints").iterdir())


def flip_bytes(path: Path, count: int = 4096) -> None:
    """Invert ``count`` bytes in the middle of ``path`` (the size and the safetensors header stay valid)."""
    data = bytearray(Path(path).read_bytes())
    mid = len(data) // 2
    count = min(count, len(data) - mid)
    data[mid:mid + count] = bytes(b ^ 0xFF for b in data[mid:mid + count])
    Path(path).write_bytes(bytes(data))


def truncate(path: Path, keep: float = 0.5) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:int(len(data) * keep)])


@pytest.fixture(scope="module", autouse=True)
def quick_io():
    """For the fault tests: one intra-op thread (the models are tiny: two threads only fight over the CPU) and no
    fsync. A kill leaves the page cache intact, so what a killed save leaves on disk does not depend on fsync (that
    guards against power loss, which no test simulates); the subprocess kill test keeps the real fsync."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", lambda fd: None)
        yield
    torch.set_num_threads(threads)

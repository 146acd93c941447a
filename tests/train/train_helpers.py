"""Shared settings of the training-job tests: the smallest runs that still cross every phase."""
from __future__ import annotations

import hashlib
from pathlib import Path

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

"""``benchmarks/train_step.py`` (the training job's step, eager and with CUDA graphs, timed side by side) runs on
the CPU: the tiny model, eager only, one row per phase with a positive step time."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_step_benchmark_runs_on_the_cpu():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--capacity", "192",
                           "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 192 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["dense", "warmup", "sparse"], proc.stdout
    assert all(float(row.split("|")[3]) > 0 for row in rows), proc.stdout

"""``benchmarks/cp_rank_share.py`` (one CP rank's share on one device, the other ranks stood in for) runs on the CPU:
the tiny preset, both partitions and compressed-memory schemes, every phase of a CSA layer, each a table row with
finite times."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("phase", ["dense", "warmup", "sparse"])
def test_rank_share_runs_on_the_cpu(phase):
    """Both partitions and both compressed-memory schemes (the sharded one with its exchange stood in for)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cp_rank_share.py"), "--tokens", "1024",
                           "--world", "2", "4", "--phase", phase, "--reps", "1", "--cp-compressed", "gather",
                           "sharded"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1024 |")]
    assert len(rows) == 8, proc.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[6]) > 0 and float(cells[7]) >= float(cells[6]), row

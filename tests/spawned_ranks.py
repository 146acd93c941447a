"""Multi-process (gloo) tests: spawn the ranks, never hang, collect each rank's report.

A worker ``worker(rank, world, init_file, result_dir)`` writes ``result_dir/rank{rank}.txt``: "ok..." when it
finished, "error\\n<traceback>" when it raised.
"""
from __future__ import annotations

import os
import time

import pytest
import torch.multiprocessing as mp


def run_ranks(worker, world: int, tmp: str, deadline_s: float) -> dict[int, str]:
    """Runs ``worker`` on ``world`` processes with ``tmp`` as the result folder (and ``tmp/init`` for the process
    group's file store). Past ``deadline_s`` every rank is killed and the test fails (a hang must not stall CI).
    Asserts that every rank reported "ok" (naming the rank and its report otherwise); returns the reports."""
    try:
        context = mp.spawn(worker, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world, join=False)
        deadline = time.monotonic() + deadline_s
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for p in context.processes:
                    if p.is_alive():
                        p.kill()
                pytest.fail(f"the spawned ranks did not finish within {deadline_s} s (killed)")
    finally:
        reports = {}
        for rank in range(world):
            path = os.path.join(tmp, f"rank{rank}.txt")
            reports[rank] = open(path).read() if os.path.exists(path) else "no report"
    for rank, text in reports.items():
        assert text.startswith("ok"), f"rank {rank}:\n{text}"
    return reports

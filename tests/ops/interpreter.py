"""Running a test module's Triton kernels through the CPU interpreter.

``TRITON_INTERPRET=1`` must be set before Triton is first imported, so each kernel test module runs all its
kernel launches in one subprocess: its ``_worker()`` prints one ``RESULTS <json>`` line of measurements and the
parametrised tests in the parent process judge them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_worker(module: str, timeout: int = 600) -> dict:
    """Run ``module._worker()`` under the Triton interpreter; return the dict it printed."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = f"from {module} import _worker; _worker()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULTS "):])

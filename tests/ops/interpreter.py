"""Running a test module's Triton kernels through the CPU interpreter.

``TRITON_INTERPRET=1`` must be set before Triton is first imported, so each kernel test module runs all its
kernel launches in one subprocess: its ``_worker()`` prints one ``RESULTS <json>`` line of measurements and the
parametrised tests in the parent process judge them.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A loop bounded by a reduced value, as the indexer's select kernel has. Triton 3.6's interpreter turns the bound
# into a Python int with int() of a one-element array, which numpy 2 refuses (Triton 3.7 squeezes it first).
_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def probe(X, O):
    acc = 0
    for _ in range(0, tl.max(tl.load(X + tl.arange(0, 2)), 0)):
        acc += 1
    tl.store(O, acc)
x, o = torch.tensor([1, 2], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
probe[(1,)](x, o)
assert o.item() == 2, o
"""


@functools.cache
def interpreter_problem() -> str | None:
    """None when this Triton's interpreter runs the kernels' constructs; else why not (a known interpreter bug)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode == 0:
        return None
    if "only 0-dimensional arrays can be converted" in proc.stderr:
        import numpy
        import triton
        return (f"Triton {triton.__version__}'s interpreter cannot run a loop bounded by a reduced value with numpy "
                f"{numpy.__version__} (fixed in Triton 3.7); the GPU tests cover these kernels on this machine")
    raise AssertionError(f"the interpreter probe failed:\n{proc.stderr[-4000:]}")


def run_worker(module: str, timeout: int = 600) -> dict:
    """Run ``module._worker()`` under the Triton interpreter; return the dict it printed. Skips (with the reason)
    where the worker ran into a known bug of this Triton's interpreter (:func:`interpreter_problem`)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = f"from {module} import _worker; _worker()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    if proc.returncode and "only 0-dimensional arrays can be converted" in proc.stderr and interpreter_problem():
        pytest.skip(interpreter_problem())
    assert proc.returncode == 0 and lines, f"interpreter worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULTS "):])

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
import threading
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


class _Background:
    """Interpreter workers started when the session's tests are known (tests/conftest.py), so that they run on the
    machine's other cores while the parent process runs the other tests: the six workers are most of the suite's
    CPU time. One runs at a time per spare core, in the order the tests will ask for them; a worker still queued when
    its tests come is run by the test process itself (:meth:`take` hands it back), which has nothing else to do then,
    so that two run at once on a 2-core machine instead of one beside an idle parent."""

    def __init__(self):
        self.jobs: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.stopped = False

    def start(self, modules: list[str], slots: int, timeout: int) -> None:
        gate = threading.Semaphore(max(1, slots))
        for module in modules:
            job = self.jobs[module] = dict(done=threading.Event(), proc=None, result=None, started=False,
                                           claimed=False)
            threading.Thread(target=self._run, args=(module, job, gate, timeout), daemon=True).start()

    def _run(self, module: str, job: dict, gate: threading.Semaphore, timeout: int) -> None:
        with gate:
            try:
                with self.lock:
                    if self.stopped or job["claimed"]:
                        return
                    job["started"] = True
                    job["proc"] = subprocess.Popen(_command(module), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True)
                out, err = job["proc"].communicate(timeout=timeout)
                job["result"] = (job["proc"].returncode, out, err)
            except BaseException as exc:  # handed to the test that asks for this worker
                if job["proc"] is not None:
                    job["proc"].kill()
                job["result"] = exc
            finally:
                job["done"].set()

    def take(self, module: str):
        """(returncode, stdout, stderr) of the background run of ``module``, waiting for it; None if none was
        started (the caller runs it: a queued run is withdrawn)."""
        job = self.jobs.pop(module, None)
        if job is None:
            return None
        with self.lock:
            if not job["started"]:
                job["claimed"] = True
                return None
        job["done"].wait()
        if isinstance(job["result"], BaseException):
            raise job["result"]
        return job["result"]

    def stop(self) -> None:
        """Kill the workers no test took (a session ended early, e.g. by -x)."""
        with self.lock:
            self.stopped = True
            for job in self.jobs.values():
                if job["proc"] is not None and job["proc"].poll() is None:
                    job["proc"].kill()


BACKGROUND = _Background()


def _env() -> dict:
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _command(module: str) -> list[str]:
    return [sys.executable, "-c", f"from {module} import _worker; _worker()"]


def run_worker(module: str, timeout: int = 600) -> dict:
    """Run ``module._worker()`` under the Triton interpreter (or take the run started in the background); return the
    dict it printed. Skips (with the reason) where the worker ran into a known bug of this Triton's interpreter
    (:func:`interpreter_problem`)."""
    done = BACKGROUND.take(module)
    if done is None:
        proc = subprocess.run(_command(module), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
        done = (proc.returncode, proc.stdout, proc.stderr)
    returncode, stdout, stderr = done
    lines = [line for line in stdout.splitlines() if line.startswith("RESULTS ")]
    if returncode and "only 0-dimensional arrays can be converted" in stderr and interpreter_problem():
        pytest.skip(interpreter_problem())
    assert returncode == 0 and lines, f"interpreter worker failed:\n{stdout[-4000:]}\n{stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULTS "):])

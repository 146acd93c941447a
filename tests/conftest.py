"""Session hooks: the Triton-interpreter workers (tests/ops/interpreter.py) start as soon as collection knows which
of them the selected tests need, and run beside the other tests on the spare cores (they are most of the suite's
time on a 2-core machine). The modules that wait for a worker run last, so that the other tests fill that time."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker_module(item) -> str | None:
    """The dotted name ``run_worker`` takes for the module of a test that uses the ``interpreted`` fixture."""
    module = getattr(item, "module", None)
    if "interpreted" not in getattr(item, "fixturenames", ()) or not hasattr(module, "_worker"):
        return None
    return ".".join(Path(module.__file__).resolve().relative_to(ROOT).with_suffix("").parts)


def pytest_collection_modifyitems(items):
    # Whole modules move, so that each module-scoped fixture is still set up once.
    waiting = {item.module for item in items if _worker_module(item)}
    last = [getattr(item, "module", None) in waiting for item in items]
    items[:] = [i for i, w in zip(items, last) if not w] + [i for i, w in zip(items, last) if w]


def pytest_collection_finish(session):
    from tests.ops.interpreter import BACKGROUND
    modules = list(dict.fromkeys(m for m in map(_worker_module, session.items) if m))
    if modules and not session.config.option.collectonly:
        BACKGROUND.start(modules, slots=(os.cpu_count() or 2) - 1, timeout=600)


def pytest_sessionfinish(session):
    from tests.ops.interpreter import BACKGROUND
    BACKGROUND.stop()

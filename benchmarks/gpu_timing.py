"""Timing and memory helpers shared by the GPU benchmark scripts (import as ``from gpu_timing import ...``: the
scripts run as ``python benchmarks/<name>.py``, which puts this folder on the import path)."""
from __future__ import annotations

import statistics

import torch


def time_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after ``warmup`` runs, by CUDA events, each run timed alone
    after a synchronisation (so the host's time before its first kernel counts)."""
    return back_to_back_ms(fn, calls=1, rounds=reps, warmup=warmup)


def back_to_back_ms(fn, calls: int = 20, rounds: int = 5, warmup: int = 3) -> float:
    """Median milliseconds per call of ``calls`` calls of ``fn()`` between two events (no synchronisation between
    them: the host runs ahead of the GPU, as in a training step), over ``rounds`` rounds after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def graph_ms(fn) -> float:
    """Median milliseconds of a replay of ``fn()`` captured once in a CUDA graph (no host work per call)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())        # the inputs, made on the current stream
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()                                               # a warm-up on the capturing stream
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return time_ms(graph.replay)


def paired_ms(fn_a, fn_b, rounds: int = 7) -> tuple[float, float, list[float]]:
    """Times two functions in alternating rounds (each a :func:`time_ms` of both, a first in even rounds, b first in
    odd ones), so that clock and temperature drift over the run reach both alike. Returns (median ms of a, median ms
    of b, the per-round ratios b / a)."""
    a_ms, b_ms = [], []
    for r in range(rounds):
        if r % 2:
            b_ms.append(time_ms(fn_b))
            a_ms.append(time_ms(fn_a))
        else:
            a_ms.append(time_ms(fn_a))
            b_ms.append(time_ms(fn_b))
    return statistics.median(a_ms), statistics.median(b_ms), [b / a for a, b in zip(a_ms, b_ms)]


def peak_mib(fn) -> float:
    """Peak memory of ``fn()`` above what was allocated before the call (the inputs), in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def start_log(script: str, log_path: str | None):
    """The ``log(line)`` of a benchmark script: prints and, with ``--log``, appends to that file; first line = the
    GPU and versions. Exits with a message when there is no CUDA device."""
    import sys

    import triton
    if not torch.cuda.is_available():
        sys.exit(f"benchmarks/{script} needs a CUDA device")
    sink = open(log_path, "a") if log_path else None

    def log(line: str) -> None:
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    log(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    return log

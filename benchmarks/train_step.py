"""The training job's step, eager and with ``--cuda-graphs``, timed in one process: where the step's time goes.

    python benchmarks/train_step.py --model small --capacity 4096 32768 [--steps 12] [--profile 25]

Per capacity and phase (dense, warm-up, sparse), two copies of the same model train on the same batches of the
built-in retrieval data (the job's step: forward, backward, clipping, the finite check, AdamW; bf16 autocast on
CUDA): one with plain eager steps, one through :class:`dsv4attn.train.graphs.GraphedSteps`. After two warm-up
steps each (kernel builds, the graphs' captures) they alternate step by step; the table gives the median step
(wall time, synchronised) in ms and tokens/s of each, and their ratio.

``--profile N`` profiles one eager step per case (``torch.profiler``, CPU and CUDA) and prints the N operators with
the most self CPU time, then the N kernels with the most CUDA time: what the eager step's host time is made of.
On a machine without a GPU the eager step runs on the CPU (the tiny model by default) and the graphs are left out.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from dsv4attn.train import TrainConfig
from dsv4attn.train.data import TRAIN, make_source
from dsv4attn.train.graphs import GraphedSteps
from dsv4attn.train.model import DecoderLM, model_config
from dsv4attn.train.setup import build_optimizer
from dsv4attn.train.step import train_step

PHASES = ("dense", "warmup", "sparse")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Runner:
    """One model, its optimizer and (optionally) its GraphedSteps; ``step(batch, phase)`` returns the wall ms."""

    def __init__(self, model: DecoderLM, cfg: TrainConfig, device: torch.device, graphed: bool):
        self.model, self.device = model, device
        self.optimizer = build_optimizer(model, cfg)
        self.grad_clip = cfg.grad_clip
        self.graphs = GraphedSteps(model, cfg.capacity, device) if graphed else None
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
        self.count = 0

    def step(self, batch, phase: str) -> float:
        _sync(self.device)
        start = time.perf_counter()
        train_step(self.model, self.optimizer, batch, phase, self.count, self.grad_clip, graphs=self.graphs,
                   autocast=self.autocast)
        _sync(self.device)
        self.count += 1
        return (time.perf_counter() - start) * 1e3


def profile_step(runner: Runner, batch, phase: str, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        runner.step(batch, phase)
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60), flush=True)
    if runner.device.type == "cuda":
        for key in ("self_device_time_total", "self_cuda_time_total"):
            try:
                print(events.table(sort_by=key, row_limit=rows, max_name_column_width=60), flush=True)
                break
            except (AttributeError, KeyError):
                continue


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, choices=["tiny", "small"], help="default: small on a GPU, else tiny")
    ap.add_argument("--capacity", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per runner, phase and capacity")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="profile one eager step per case")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset = args.model or ("small" if device.type == "cuda" else "tiny")
    graphed = device.type == "cuda"
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"--model {preset}, {name}, torch {torch.__version__}; medians of {args.steps} alternating steps")
    print("| capacity | phase | eager ms | eager tokens/s | graphs ms | graphs tokens/s | x eager |")
    print("|---|---|---|---|---|---|---|")
    for capacity in args.capacity:
        cfg = TrainConfig(capacity=capacity, plot=False)
        mcfg = model_config(preset)
        torch.manual_seed(0)
        model = DecoderLM(mcfg).to(device)
        runners = [Runner(model, cfg, device, graphed=False)]
        if graphed:
            runners.append(Runner(copy.deepcopy(model), cfg, device, graphed=True))
        source = make_source(None, n_layers=mcfg.num_layers, window=mcfg.attention.sliding_window)
        index = 0
        for phase in args.phases:
            batches = [source.batch(0, TRAIN, index + i, capacity).to(device) for i in range(args.steps + 2)]
            index += len(batches)
            times = [[] for _ in runners]
            tokens = []
            for i, batch in enumerate(batches):
                for r, runner in enumerate(runners):
                    ms = runner.step(batch, phase)
                    if i >= 2:                                  # the first two: builds and captures
                        times[r].append(ms)
                if i >= 2:
                    tokens.append(batch.num_tokens)
            per_token = statistics.median(tokens)
            eager = statistics.median(times[0])
            cells = f"{eager:.1f} | {per_token / eager * 1e3:,.0f}"
            if graphed:
                graph = statistics.median(times[1])
                cells += f" | {graph:.1f} | {per_token / graph * 1e3:,.0f} | {eager / graph:.2f}"
            else:
                cells += " | - | - | -"
            print(f"| {capacity} | {phase} | {cells} |", flush=True)
            if args.profile:
                profile_step(runners[0], batches[-1], phase, args.profile)


if __name__ == "__main__":
    main()

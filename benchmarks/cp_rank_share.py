"""One context-parallel rank's share of a long context, on one GPU: a layer's forward + backward over the rows that
rank r of a CP = W run computes, with the other ranks stood in for.

    python benchmarks/cp_rank_share.py --tokens 1048576 --world 4 8 --partition contiguous head_tail

The process joins torch.distributed's ``fake`` process group as rank r of W (collectives return at once, no other
process exists) and builds the pack of the global batch (one document of ``--tokens`` rows) with that group, so
the layer runs exactly the rank's code path: its local rows, their halo, every rank's compressed entries and
indexer keys (all-gathered), its top-k over all of them, and the backward's gradient all-reduce. The all-gathers'
other blocks are random rows of the rank's own block's shape and root-mean-square (drawn once per shape), so every
kernel sees data of the size and spread it would see in the real run; the all-reduce leaves its tensor as it is.
What is timed is the rank's compute; the communication's bytes are what ``cp_sharded_memory.py`` counts.

``--cp-compressed sharded`` runs the sharded compressed memory (docs/context_parallel.md): after its top-k the
rank works out which distinct entries it needs and gathers its own rows for the others, as in the real run; the
exchange itself is stood in for by assuming every other rank asks this one for as many rows as it asks of them (the
plan's split sizes, which the real run reads from an all-to-all), and the fetched rows are the rank's own served
rows (same shape and scale).

The rank defaults to the busiest: the last one under the contiguous partition (its queries see the most compressed
entries), rank 0 under head-tail (every rank does the same work). Per case: forward ms, forward + backward ms
(median of ``--reps`` after one warm-up), peak allocated and reserved GiB. On a machine without a GPU it runs the
tiny preset on the CPU (a smoke test of the stand-ins).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
from torch.testing._internal.distributed.fake_pg import FakeStore

import dsv4attn
from dsv4attn.parallel import comm

_pool: dict[tuple, torch.Tensor] = {}
_real_all_to_all = dist.all_to_all_single


def _stand_in_all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """What ``comm._all_gather_cat`` returns, with random rows of ``t``'s shape and scale for the other ranks."""
    world, rank = comm.world_and_rank(group)
    key = (tuple(t.shape), t.dtype, t.device, world)
    if key not in _pool:
        rms = t.float().square().mean().sqrt().item() if t.numel() else 1.0
        rms = rms if rms > 0 else 1.0
        _pool[key] = (torch.randn((world * t.shape[0],) + tuple(t.shape[1:]), device=t.device) * rms).to(t.dtype)
    out = _pool[key].clone()
    out[rank * t.shape[0]:(rank + 1) * t.shape[0]] = t
    return out


def _stand_in_fetch_plan(needed: torch.Tensor, block: int, group, tag=None) -> comm.FetchPlan:
    """``comm.fetch_plan`` with the other ranks' requests assumed symmetric to this rank's (no all-to-all)."""
    world, _ = comm.world_and_rank(group)
    needed = needed.long()
    owner = torch.div(needed, max(block, 1), rounding_mode="floor")
    requested = torch.bincount(owner, minlength=world).tolist()          # the real plan's one host read
    serve_rows = (needed - owner * block).clamp(0, max(block - 1, 0))    # as many local rows served as asked
    return comm.FetchPlan(requested, list(requested), serve_rows)


def _stand_in_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                         async_op=False):
    """The fake group's all-to-all leaves ``output`` as it was: fill it with what was sent (equal sizes here)."""
    if output.shape == input.shape:
        output.copy_(input)
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_share(cfg, ratio: int, tokens: int, world: int, rank: int, partition: str, phase: str, reps: int,
              device: torch.device, dtype: torch.dtype, compressed: str = "gather"
              ) -> tuple[float, float, float, float]:
    """(forward ms, forward + backward ms, peak GiB, peak reserved GiB) of rank ``rank``'s share."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        # The rank-side pack without the agreement (an all-gather of metadata the fake group cannot answer).
        pack = dataclasses.replace(dsv4attn.pack_batch(None, tokens, tokens, device=device), cp_group=group,
                                   cp_partition=partition, cp_compressed=compressed)
        layer = dsv4attn.HybridAttention(cfg, ratio).to(device=device, dtype=dtype).train()
        x = torch.randn(tokens // world, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
        fwd, total = [], []
        for i in range(reps + 1):
            if device.type == "cuda" and i == 1:
                torch.cuda.reset_peak_memory_stats()
            _sync(device)
            start = time.perf_counter()
            y = layer(x, pack=pack, phase=phase)
            _sync(device)
            mid = time.perf_counter()
            y.float().square().mean().backward()
            _sync(device)
            end = time.perf_counter()
            del y
            x.grad = None
            layer.zero_grad(set_to_none=True)
            if i:
                fwd.append((mid - start) * 1e3)
                total.append((end - start) * 1e3)
        gib = 2.0 ** 30
        cuda = device.type == "cuda"
        peak = torch.cuda.max_memory_allocated() / gib if cuda else float("nan")
        reserved = torch.cuda.max_memory_reserved() / gib if cuda else float("nan")
        del layer, x, pack
        return statistics.median(fwd), statistics.median(total), peak, reserved
    finally:
        dist.destroy_process_group()
        _pool.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1048576])
    ap.add_argument("--world", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--partition", nargs="+", default=["contiguous", "head_tail"],
                    choices=["contiguous", "head_tail"])
    ap.add_argument("--rank", type=int, default=None, help="default: the busiest rank of the partition")
    ap.add_argument("--ratio", type=int, default=4, choices=[0, 4, 128])
    ap.add_argument("--phase", default="sparse", choices=["dense", "warmup", "sparse"])
    ap.add_argument("--preset", default=None, choices=["tiny", "flash", "pro"],
                    help="default: flash on a GPU, tiny on the CPU")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cp-compressed", nargs="+", default=["gather"], choices=["gather", "sharded"])
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preset = args.preset or ("flash" if device.type == "cuda" else "tiny")
    cfg = getattr(dsv4attn.AttentionConfig, preset)()
    dsv4attn.set_checks(False)
    comm._all_gather_cat = _stand_in_all_gather
    comm.fetch_plan = _stand_in_fetch_plan
    comm.dist.all_to_all_single = _stand_in_all_to_all
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{preset} geometry, {dtype}, {name}, ratio {args.ratio}, {args.phase} phase; one rank's compute, the "
          f"others stood in for")
    print("| tokens | CP | partition | compressed | rank | rows | fwd ms | fwd+bwd ms | peak GiB | peak reserved GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tokens in args.tokens:
        for world in args.world:
            for partition in args.partition:
                for compressed in args.cp_compressed:
                    rank = args.rank if args.rank is not None else (world - 1 if partition == "contiguous" else 0)
                    head = f"| {tokens} | {world} | {partition} | {compressed} | {rank} | {tokens // world} |"
                    try:
                        fwd, total, peak, reserved = run_share(cfg, args.ratio, tokens, world, rank, partition,
                                                               args.phase, args.reps, device, dtype, compressed)
                    except torch.OutOfMemoryError:
                        print(f"{head} OOM | OOM | - | - |", flush=True)
                        torch.cuda.empty_cache()
                        continue
                    print(f"{head} {fwd:.1f} | {total:.1f} | {peak:.1f} | {reserved:.1f} |", flush=True)


if __name__ == "__main__":
    main()

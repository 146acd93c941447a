"""Context parallelism: CP-N vs CP-1 parity, step time, per-rank peak memory and bytes moved per layer.

Run under torchrun (NCCL on GPUs, gloo on CPUs):

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py --config flash --rows 65536 131072 \
        --partitions contiguous head_tail

For each layer kind (CSA in the sparse phase, HCA) and each T: rank 0 first runs the whole batch alone (CP-1,
the other ranks wait), then all ranks run it split (CP-N) under each partition; forward + backward, after one
warm-up step.
Prints one table: ms, peak memory (max over ranks), their CP-N / CP-1 ratios, bytes moved by the boundary
exchange and the all-gathers (forward; the backward moves the same again), and the max relative difference of
CP-N vs CP-1 outputs and input gradients.
"""
from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist

import dsv4attn
from dsv4attn.parallel import PARTITIONS, owned_capacity, shard, unshard


def make_layer(cfg, ratio, device, dtype):
    torch.manual_seed(0)
    layer = dsv4attn.HybridAttention(cfg, ratio).to(device=device, dtype=dtype).train()
    with torch.no_grad():
        layer.sinks.normal_(0.0, 0.5)
    return layer


def step(layer, x, g, cu, max_len, phase, group=None, partition="contiguous"):
    x = x.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x, cu_seqlens=cu, max_seqlen=max_len, phase=phase, cp_group=group, cp_partition=partition)
    (y * g).sum().backward()
    return y.detach(), x.grad


def timed(fn, device):
    gc.collect()   # the previous case's graph must not count in this case's peak
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return out, ms, peak


def bytes_moved(cfg, ratio, rows_per_rank, world, element_bytes, partition):
    """Forward bytes a rank receives (the most of any rank): halo hidden states, one per chunk it holds, plus the
    gathered compressed KV (+ indexer K) of the other ranks' chunks."""
    chunks = 1 if partition == "contiguous" else 2
    halo = chunks * max(cfg.sliding_window, {0: 0, 4: 8, 128: 128}[ratio]) * cfg.hidden_size * element_bytes
    gathered = 0
    if ratio:
        cap = chunks * owned_capacity(rows_per_rank // chunks, ratio)
        width = cfg.head_dim + (cfg.index_head_dim if ratio == 4 else 0)
        gathered = (world - 1) * cap * width * element_bytes
    return halo, gathered


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="flash", choices=["flash", "tiny"])
    ap.add_argument("--rows", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--ratios", type=int, nargs="+", default=[4, 128])
    ap.add_argument("--phase", default="sparse")
    ap.add_argument("--doc-len", type=int, default=0, help="0: one document spanning the batch")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp64"])
    ap.add_argument("--partitions", nargs="+", default=["contiguous"], choices=PARTITIONS)
    ap.add_argument("--cp1-max-rows", type=int, default=1 << 62,
                    help="skip the CP-1 run above this T (when it does not fit on one device)")
    args = ap.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    group = dist.group.WORLD
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[args.dtype]
    cfg = getattr(dsv4attn.AttentionConfig, args.config)()
    dsv4attn.set_checks(False)

    rows_out = []
    for T in args.rows:
        doc = args.doc_len or T
        lengths = [doc] * (T // doc)
        cu = torch.tensor([0] + lengths, dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
        for ratio in args.ratios:
            layer = make_layer(cfg, ratio, device, dtype)
            torch.manual_seed(1)
            x = torch.randn(T, cfg.hidden_size, device=device, dtype=dtype)
            g = torch.randn(T, cfg.hidden_size, device=device, dtype=dtype) / T ** 0.5
            ms1 = peak1 = float("nan")
            y1 = dx1 = None
            if rank == 0 and T <= args.cp1_max_rows:
                try:
                    step(layer, x, g, cu, doc, args.phase)
                    (y1, dx1), ms1, peak1 = timed(lambda: step(layer, x, g, cu, doc, args.phase), device)
                except torch.OutOfMemoryError:            # CP-1 does not fit one device: report it, go on
                    print(f"T={T} ratio {ratio}: CP-1 out of memory on one device", flush=True)
                    layer.zero_grad(set_to_none=True)
                    gc.collect()
                    torch.cuda.empty_cache()
            dist.barrier()
            for part in args.partitions:
                def run_cp():
                    return step(layer, shard(x, group, part), shard(g, group, part), cu, doc, args.phase, group,
                                part)
                run_cp()
                (yn, dxn), msn, peakn = timed(run_cp, device)
                stats = torch.tensor([msn, peakn], dtype=torch.float64, device=device)
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                with torch.no_grad():
                    yn, dxn = unshard(yn, group, part), unshard(dxn, group, part)
                if rank == 0:
                    err_y = rel(yn, y1) if y1 is not None else float("nan")
                    err_dx = rel(dxn, dx1) if dx1 is not None else float("nan")
                    halo, gathered = bytes_moved(cfg, ratio, T // world, world, torch.finfo(dtype).bits // 8, part)
                    rows_out.append((T, ratio, part, ms1, float(stats[0]), peak1, float(stats[1]), halo, gathered,
                                     err_y, err_dx))
                del yn, dxn
            del layer, y1, dx1
            gc.collect()
            if use_cuda:
                torch.cuda.empty_cache()

    if rank == 0:
        print(f"\nCP-{world} vs CP-1, {args.config} geometry, phase {args.phase}, {args.dtype}, "
              f"{torch.cuda.get_device_name(device) if use_cuda else 'CPU'}")
        print("| T | ratio | partition | CP1 ms | CPN ms | time ratio | CP1 peak GiB | CPN peak GiB/rank | mem ratio "
              "| halo MiB | all-gather MiB | max rel diff out | max rel diff dx |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for T, r, part, ms1, msn, p1, pn, halo, gathered, ey, edx in rows_out:
            print(f"| {T} | {r} | {part} | {ms1:.1f} | {msn:.1f} | {msn / ms1:.2f} "
                  f"| {p1:.1f} | {pn:.1f} | {pn / p1:.2f} "
                  f"| {halo / 2**20:.2f} | {gathered / 2**20:.2f} | {ey:.2e} | {edx:.2e} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

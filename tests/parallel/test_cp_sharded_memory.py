"""Sharded compressed memory (``pack_batch(..., cp_compressed="sharded")``) equals the all-gather path.

One spawn of 4 ranks, CP 2, 3 and 4 on its first 2, 3 and 4 ranks, gloo, float64, the tiny config's ratio-4
layer in the ``sparse`` phase (the one phase that fetches instead of gathering), contiguous and head-tail
partitions, on a pack whose documents straddle ranks. Compared per rank with the ``"gather"`` pack: outputs,
input gradients, this rank's parameter gradients and indexer loss. Also: the ``warmup`` phase (CP 2; it falls
back to the all-gather) and a rank asking for another mode than the others (the pack agreement refuses it on
every rank). Each rank reports the bytes it received from other ranks in each scheme
(``dsv4attn.parallel.comm.traffic``, counted from the tensors the collectives moved).
"""
from __future__ import annotations

import datetime
import json
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist

import dsv4attn
from dsv4attn.parallel import comm, shard
from tests.spawned_ranks import run_ranks

# 234 real rows, 6 padding rows: 240 = 2, 3, 4 contiguous chunks and 4, 6, 8 head-tail chunks (>= 16-row halo).
LENGTHS = (5, 0, 70, 100, 9, 50)
TOTAL_ROWS = 240
RTOL = 1e-9


def _layer(seed=0):
    torch.manual_seed(seed)
    layer = dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), 4)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0.0, 0.5 if name == "sinks" or name.endswith("position_bias") else 0.08)
            if name.endswith("norm.weight"):
                p.add_(1.0)
    return layer.double().train()


def _run(layer, x, g, phase, pack):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    comm.traffic.clear()
    y = layer(x, phase=phase, pack=pack)
    (y * g).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    return dict(output=y.detach(), input_grad=x.grad.detach(), loss=layer.indexer_loss.clone(),
                **{f"grad {n}": v for n, v in grads.items()}), dict(comm.traffic)


def _relative(got, want):
    scale = want.abs().max()
    return 0.0 if scale == 0 else float((got - want).abs().max() / scale)


def _check(group, size, rank, report):
    cu = torch.tensor((0,) + LENGTHS).cumsum(0).to(torch.int32)
    layer = _layer()
    for partition in ("contiguous", "head_tail"):
        phases = ("sparse", "warmup") if partition == "contiguous" and size == 2 else ("sparse",)
        packs = {mode: dsv4attn.pack_batch(cu, TOTAL_ROWS, max(LENGTHS), cp_group=group, cp_partition=partition,
                                           cp_compressed=mode) for mode in ("gather", "sharded")}
        torch.manual_seed(1)
        x, g = (shard(torch.randn(TOTAL_ROWS, 128, dtype=torch.float64), group, partition) for _ in range(2))
        for phase in phases:
            want, want_bytes = _run(layer, x, g, phase, packs["gather"])
            got, got_bytes = _run(layer, x, g, phase, packs["sharded"])
            for name, value in want.items():
                where = f"{partition} {phase} {name} rank {rank}/{size}"
                torch.testing.assert_close(got[name], value, rtol=RTOL, atol=1e-12, msg=lambda m: f"{where}: {m}")
                report["worst"][size] = max(report["worst"].get(size, 0.0), _relative(got[name], value))
            assert float(want["loss"]) > 0
            if phase == "warmup":                      # falls back to the all-gather: the same traffic
                assert got_bytes == want_bytes, (got_bytes, want_bytes)
            else:
                assert "main_kv indices" not in want_bytes and got_bytes["main_kv indices"] > 0
            report["bytes"][f"CP {size} {partition} {phase}"] = dict(gather=want_bytes, sharded=got_bytes)
    if size == 4:
        # A rank asking for another mode than the others: every rank refuses the pack before any layer call.
        with pytest.raises(ValueError, match=r"cp_compressed \(rank 0: 'gather', rank 1: 'sharded'"):
            dsv4attn.pack_batch(cu, TOTAL_ROWS, max(LENGTHS), cp_group=group,
                                cp_compressed="sharded" if rank == 1 else "gather")


def _worker(rank, world, init_file, result_dir):
    """One spawn of 4 ranks: CP 2, 3 and 4 run on the groups of the first 2, 3 and 4 ranks (process start-up,
    ~3.5 s a rank on two cores, dominates the cost; a group that is not the world is tested on the way)."""
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        torch.set_num_threads(1)
        report = {"worst": {}, "bytes": {}}
        for size in (2, 3, 4):
            group = dist.new_group(list(range(size)))           # every rank joins the creation
            if rank < size:
                _check(group, size, rank, report)
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("ok\n")
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("error\n" + traceback.format_exc())
        raise


def test_sharded_compressed_memory_equals_gather_at_cp_2_3_4():
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_worker, 4, tmp, deadline_s=120)
        reports = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(4)]
    worst = {size: max(r["worst"].get(size, 0.0) for r in reports) for size in ("2", "3", "4")}
    print(f"\nworst relative difference by CP size: {worst}")
    for case in reports[0]["bytes"]:
        size = int(case.split()[1])
        for mode in ("gather", "sharded"):
            per_rank = [r["bytes"][case][mode] for r in reports[:size]]
            print(f"  {case} {mode}: " + "; ".join(f"{k} {[b.get(k, 0) for b in per_rank]}"
                                                  for k in sorted(per_rank[0])))


def test_sharded_needs_a_cp_group():
    with pytest.raises(ValueError, match="cp_compressed='sharded' needs cp_group"):
        dsv4attn.pack_batch(None, 8, cp_compressed="sharded")
    with pytest.raises(ValueError, match="cp_compressed must be 'gather' or 'sharded'"):
        dsv4attn.pack_batch(None, 8, cp_compressed="fetch")

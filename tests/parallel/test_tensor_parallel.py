"""Tensor parallelism on the CPU (gloo, spawned processes, float64): TP2 and TP2 x CP2 == the single process.

One spawn of 4 ranks arranged as a (cp=2, tp=2) DeviceMesh: ranks {0, 1} and {2, 3} are TP groups, {0, 2} and
{1, 3} CP groups. For ratios 0 / 4 / 128 (ratio 4 in the dense, warm-up and sparse phases; the phase changes
nothing for the others) each rank runs the layer on one process, under TP2 (its TP group, the whole batch) and
under TP2 x CP2 (both groups, its CP share of the rows), and compares: outputs, input gradients, every parameter
gradient (CP-summed, gathered to full), the indexer loss and the parameters after one AdamW step. Replicated
parameters must have bitwise equal gradients and values on the two TP ranks. Also: a TP layer built under the same
RNG state holds the single-process layer's slices; the load / to_hf round trip; a wrong split is refused.
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
from dsv4attn.checkpoints import to_hf_state_dict
from dsv4attn.parallel import shard, unshard
from tests.layers.layer_helpers import forward_backward, spread_parameters_
from tests.spawned_ranks import run_ranks

# Starts 0 1 4 4 90 240 249; 266 real rows, 6 padding rows -> 272 = 2 x 136 (a chunk must hold ratio 128's halo).
# The 150-row document and its first ratio-128 group straddle the CP seam at row 136.
LENGTHS = (1, 3, 0, 86, 150, 9, 17)
TOTAL_ROWS = 272
CASES = [(0, "sparse"), (4, "dense"), (4, "warmup"), (4, "sparse"), (128, "sparse")]
TOL = dict(rtol=1e-9, atol=1e-12)


def _layer(ratio, **kw):
    cfg = dsv4attn.AttentionConfig.tiny()
    torch.manual_seed(ratio)
    layer = dsv4attn.HybridAttention(cfg, ratio, **kw)
    # Sinks, positional biases and norms away from their constant init, so that every parameter matters.
    torch.manual_seed(1000 + ratio)
    single = dsv4attn.HybridAttention(cfg, ratio)
    spread_parameters_(single)
    full = {name: p.detach().clone() for name, p in single.named_parameters()}
    layer.load_hf_state_dict(full)
    return layer.double().train(), {k: v.double() for k, v in full.items()}


def _step(layer, grads):
    for name, p in layer.named_parameters():
        p.grad = grads[name].clone()
    torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1).step()


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _compare(where, got, want, worst):
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{where}: {m}")
    key = where.split(":")[0]
    worst[key] = max(worst.get(key, 0.0), _rel(got, want))


def _check_replicated_equal(layer, tp_group, where):
    """Parameters held whole must carry bitwise equal gradients and values on every TP rank."""
    for name, p in layer.named_parameters():
        if name in layer.tp_sharded:
            continue
        for what, t in (("grad", p.grad), ("value", p.detach())):
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            assert all(torch.equal(parts[0], q) for q in parts), f"{where}: {name} {what} differs across TP ranks"


def _check_case(ratio, phase, tp_mesh, cp_mesh, worst):
    tp_group, cp_group = tp_mesh.get_group(), cp_mesh.get_group()
    cu = torch.tensor((0,) + LENGTHS, dtype=torch.int32).cumsum(0).to(torch.int32)
    max_len = max(LENGTHS)
    torch.manual_seed(100 + ratio)
    x = torch.randn(TOTAL_ROWS, 128, dtype=torch.float64)
    g = torch.randn(TOTAL_ROWS, 128, dtype=torch.float64)

    single, _ = _layer(ratio)
    y, dx, grads, loss = forward_backward(single, x, g, phase, cu_seqlens=cu, max_seqlen=max_len)
    _step(single, grads)
    after = to_hf_state_dict(single)

    runs = {"tp2": None, "tp2xcp2": cp_group}
    for label, cp in runs.items():
        # Both forms of the group: a ProcessGroup alone, the 1-D mesh with CP.
        layer, _ = _layer(ratio, tp_group=tp_group if cp is None else tp_mesh)
        where = f"{label} ratio {ratio} {phase} rank {dist.get_rank()}"
        if cp is None:
            got = forward_backward(layer, x, g, phase, cu_seqlens=cu, max_seqlen=max_len)
            y_l, dx_l = got[0], got[1]
        else:
            pack = dsv4attn.pack_batch(cu, TOTAL_ROWS, max_len, cp_group=cp_mesh)
            got = forward_backward(layer, shard(x, cp), shard(g, cp), phase, pack=pack)
            y_l, dx_l = unshard(got[0], cp), unshard(got[1], cp)
            for t in got[2].values():
                dist.all_reduce(t, group=cp)          # parameter gradients are partial per CP rank
        _compare(f"{label} output: {where}", y_l, y, worst)
        _compare(f"{label} input grad: {where}", dx_l, dx, worst)
        full_grads = {}
        for name, grad in got[2].items():
            dim = layer.tp_sharded.get(name)
            full_grads[name] = grad if dim is None else layer.tp.gather(grad, dim)
            _compare(f"{label} param grads: {where} {name}", full_grads[name], grads[name], worst)
        if loss is not None:
            mine = got[3].clone()
            if cp is not None:
                dist.all_reduce(mine, group=cp)       # CP shares sum to the single-process value
            _compare(f"{label} indexer loss: {where}", mine, loss, worst)
        _step(layer, got[2])
        _check_replicated_equal(layer, tp_group, where)
        for key, value in to_hf_state_dict(layer).items():
            _compare(f"{label} params after AdamW: {where} {key}", value, after[key], worst)


def _check_layout(tp_mesh, rank):
    """Same RNG state -> this rank's slices of the one-process layer; load / to_hf round trip; wrong splits."""
    cfg = dsv4attn.AttentionConfig.tiny()
    for ratio in (0, 4, 128):
        torch.manual_seed(7)
        whole = dsv4attn.HybridAttention(cfg, ratio)
        torch.manual_seed(7)
        layer = dsv4attn.HybridAttention(cfg, ratio, tp_group=tp_mesh)
        tp_rank = layer.tp.rank
        local = dict(layer.named_parameters())
        for name, p in whole.named_parameters():
            dim = layer.tp_sharded.get(name)
            want = p if dim is None else p.chunk(2, dim)[tp_rank]
            assert torch.equal(local[name], want), (ratio, name)
        assert local["q_b_proj.weight"].shape == (2 * cfg.head_dim, cfg.q_lora_rank)
        assert local["o_b_proj.weight"].shape == (cfg.hidden_size, cfg.o_lora_rank)
        torch.manual_seed(8)
        full = {k: torch.randn_like(v) for k, v in to_hf_state_dict(whole).items()}
        layer.load_hf_state_dict(full)
        back = to_hf_state_dict(layer)
        assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full), ratio
        with pytest.raises(ValueError, match=r"sinks: expected \(4,\), got \(2,\)"):
            layer.load_hf_state_dict(dict(full, sinks=local["sinks"].detach()))
    with pytest.raises(ValueError, match=r"needs o_groups \(1\) to be a multiple of 2"):
        dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(o_groups=1), 0, tp_group=tp_mesh)


def _worker(rank, world, init_file, result_dir):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        torch.set_num_threads(1)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
        _check_layout(mesh["tp"], rank)
        worst = {}
        for ratio, phase in CASES:
            _check_case(ratio, phase, mesh["tp"], mesh["cp"], worst)
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("ok\n" + json.dumps(worst))
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("error\n" + traceback.format_exc())
        raise


def test_tensor_parallel_equals_single_process():
    with tempfile.TemporaryDirectory() as tmp:
        reports = run_ranks(_worker, 4, tmp, deadline_s=300)
    worst = {}
    for text in reports.values():
        for key, value in json.loads(text.split("\n", 1)[1]).items():
            worst[key] = max(worst.get(key, 0.0), value)
    print("worst relative error (max |diff| / max |single|):", json.dumps(worst, indent=1))
    assert set(worst) >= {f"{run} {what}" for run in ("tp2", "tp2xcp2")
                          for what in ("output", "input grad", "param grads", "indexer loss", "params after AdamW")}

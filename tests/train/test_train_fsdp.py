"""``--fsdp`` in the training job: FSDP2 over 2 data-parallel gloo ranks equals DDP, and its checkpoints are DDP's.

One spawn of 2 processes runs, in its workers: a 4-step ``--fsdp`` run (every phase, an evaluation at steps 2 and
4) stopped after 2 steps and resumed from its checkpoint, then the same options under DDP. The parent compares
the logs (fp32: rtol 1e-4; a reduce-scatter adds in another order than an all-reduce) and the checkpoints: the
same files with the same tensor names, shapes and dtypes, values within the same tolerance. A spawn of 4 processes
compares ``--fsdp --cp 2`` (2 replicas of 2 context-parallel ranks) with ``--cp 2`` under DDP, and ``--fsdp --tp
2`` with ``--tp 2``, the same way.
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
from safetensors.torch import load_file

from dsv4attn.train import TrainConfig
from dsv4attn.train.loop import train
from tests.spawned_ranks import run_ranks

RUN = dict(steps=4, dense_steps=1, warmup_steps=2, capacity=192, eval_every=2, eval_batches=1, plot=False)


def _runs(world, result_dir):
    """The runs every rank makes, each into the folder of its name: on 2 ranks --fsdp stopped after 2 steps and
    resumed, then DDP; on 4 ranks --fsdp --cp 2 and DDP --cp 2 (128 rows per CP rank, so that the layers' halo
    fits), then --fsdp --tp 2 and DDP --tp 2."""
    out = lambda name: os.path.join(result_dir, name)            # noqa: E731
    if world == 2:
        return [dict(RUN, fsdp=True, out=out("fsdp"), stop_after=2), dict(RUN, fsdp=True, out=out("fsdp"),
                                                                          resume=out("fsdp")),
                dict(RUN, out=out("ddp"))]
    cp, tp = dict(RUN, capacity=256, cp=2), dict(RUN, tp=2)
    return [dict(cp, fsdp=True, out=out("fsdp")), dict(cp, out=out("ddp")),
            dict(tp, fsdp=True, out=out("fsdp_tp")), dict(tp, out=out("ddp_tp"))]


def _worker(rank, world, init_file, result_dir):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        torch.set_num_threads(1)
        for run in _runs(world, result_dir):
            train(TrainConfig(**run))
        dist.destroy_process_group()
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("ok\n")
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("error\n" + traceback.format_exc())
        raise


def _records(out, kind):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _spawn_runs(world, tmp_path, deadline_s):
    """The run folders of :func:`_runs` (under ``tmp_path``) after it ran on ``world`` spawned ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_worker, world, tmp, deadline_s=deadline_s)
        for run in _runs(world, tmp):
            name = os.path.basename(run["out"])
            if not (tmp_path / name).exists():
                os.rename(run["out"], tmp_path / name)
    return tmp_path


def test_fsdp_equals_ddp_and_writes_the_same_checkpoints(tmp_path):
    world = 2
    runs = _spawn_runs(world, tmp_path, deadline_s=300)
    fsdp, ddp = runs / "fsdp", runs / "ddp"
    assert [r["fsdp"] for r in _records(fsdp, "start")] == [True, True]
    assert [r["fsdp"] for r in _records(ddp, "start")] == [False]
    assert _records(fsdp, "start")[1]["resumed_from"].endswith("step_0000002")
    assert (fsdp / "checkpoints" / "step_0000002" / "manifest.json").is_file()      # where the stopped run ended
    _assert_same_runs(fsdp, ddp, world)


def _assert_same_runs(fsdp, ddp, world):
    """The --fsdp run's logs and last checkpoint equal the DDP run's (fp32: within rounding)."""
    for kind, steps in (("train", [1, 2, 3, 4]), ("eval", [2, 4])):
        a, b = _records(fsdp, kind), _records(ddp, kind)
        assert [r["step"] for r in a] == [r["step"] for r in b] == steps
        for ra, rb in zip(a, b):
            for key in ("loss", "indexer_loss", "lm_loss", "retrieval_acc", "indexer_recall"):
                if rb.get(key) is None:
                    assert ra.get(key) is None, (kind, ra["step"], key)
                else:
                    assert ra[key] == pytest.approx(rb[key], rel=1e-4), (kind, ra["step"], key)
    for step in ("step_0000004",):
        a, b = fsdp / "checkpoints" / step, ddp / "checkpoints" / step
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
        assert list(wa) == list(wb)
        for k in wb:
            assert wa[k].dtype == wb[k].dtype and wa[k].shape == wb[k].shape, k
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{step} {k}: {m}")
        oa, ob = (torch.load(p / "optimizer.pt", weights_only=True) for p in (a, b))
        assert oa["param_groups"] == ob["param_groups"] and oa["state"].keys() == ob["state"].keys()
        for i, entry in ob["state"].items():
            assert oa["state"][i].keys() == entry.keys()
            for name, v in entry.items():
                assert type(oa["state"][i][name]) is torch.Tensor and oa["state"][i][name].shape == v.shape
                torch.testing.assert_close(oa["state"][i][name], v, rtol=1e-3, atol=1e-6)
        meta = json.loads((a / "meta.json").read_text())
        assert meta["run_config"]["fsdp"] is True and meta["world_size"] == world


def test_fsdp_with_context_or_tensor_parallelism_equals_ddp(tmp_path):
    """On 4 ranks. --fsdp --cp 2: FSDP2 shards over each context-parallel rank's data-parallel group (the ranks of
    one CP group hold the same shard, whose gradient they sum). --fsdp --tp 2: FSDP2 shards each TP rank's slices
    over its data-parallel group; the gradient norm sums the shards' squares over both groups, and a checkpoint
    gathers FSDP2's shards, then the TP slices. Each matches the same run under DDP."""
    world = 4
    runs = _spawn_runs(world, tmp_path, deadline_s=600)
    for fsdp, ddp in (("fsdp", "ddp"), ("fsdp_tp", "ddp_tp")):
        assert [r["fsdp"] for r in _records(runs / fsdp, "start")] == [True], fsdp
        assert [r["fsdp"] for r in _records(runs / ddp, "start")] == [False], ddp
        _assert_same_runs(runs / fsdp, runs / ddp, world)

"""Context parallelism in the training job: ``--cp 2`` equals the single process.

One spawn of 2 gloo processes (cp=2, dp=1; process start-up dominates the cost) runs every check in its workers:
- one training step of the tiny model (ratios 0,4,128,4) in float64, per phase (head-tail: the warm-up phase
  only, the phases do not depend on the partition): the LM loss, the indexer loss and every parameter gradient
  (after the CP all-reduce) equal the single-process step on the unpadded batch (capacity 255 -> 256 rows,
  511 -> 512 for head-tail, so the capacity rounding is exercised; documents straddle the seams); contiguous, every
  phase: the same step with ``cp_compressed="sharded"`` equals the ``"gather"`` one;
- per partition, held-out evaluation under CP equals the single-process evaluation;
- ``train()`` with ``--cp 2`` stopped after 2 steps and resumed to the end, and a head-tail run (ratios 0,4: a
  halo of 8 rows, so 64-row chunks are enough; with --cp-compressed sharded); then (rank 0, group gone, warm and
  single-threaded: the cheapest place) the same options with ``--cp 1`` (and gather). The parent compares the
  logs (fp32: rtol 1e-4; rounding differs, the batches and maths do not);
- a rank that raises inside a step and stays alive: the other stops within --pg-timeout naming it.
"""
from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from dsv4attn.layers import HybridAttention
from dsv4attn.train import TrainConfig, distributed
from dsv4attn.train.data import EVAL, TRAIN, RetrievalTask
from dsv4attn.train.evaluate import evaluate
from dsv4attn.train.loop import train
from dsv4attn.train.model import DecoderLM, largest_halo, model_config
from dsv4attn.train.step import loss_and_grads
from tests.spawned_ranks import run_ranks

# capacity -> rows for --cp 2: chunks of 128 rows = the HCA halo (2 chunks contiguous, 4 head-tail)
CAPACITY = {"contiguous": 255, "head_tail": 511}
PHASES = {"contiguous": ("dense", "warmup", "sparse"), "head_tail": ("warmup",)}
RUN = dict(steps=4, dense_steps=1, warmup_steps=2, capacity=255, eval_every=2, eval_batches=1, plot=False)
HEAD_TAIL_RUN = dict(RUN, ratios=(0, 4), cp_partition="head_tail")
SHARDED = dict(cp_compressed="sharded")        # --cp 2 only: the --cp 1 run it is compared with refuses it


def _model():
    torch.manual_seed(0)
    return DecoderLM(model_config("tiny", (0, 4, 128, 4), indexer_loss_coeff=0.3)).double().train()


def _check_step(par, partition):
    batch = RetrievalTask(reach=28).batch(0, TRAIN, 0, CAPACITY[partition])
    padded = batch.padded_to(CAPACITY[partition] + 1)
    seams = range(128, padded.tokens.shape[0], 128)
    assert set(seams) - set(batch.cu_seqlens.tolist()), "a document must straddle a seam between chunks"
    single, split, sharded = _model(), _model(), _model()
    for phase in PHASES[partition]:
        for m in (single, split, sharded):
            m.zero_grad(set_to_none=True)
        loss, idx = loss_and_grads(single, single, batch, phase)
        loss_cp, idx_cp = loss_and_grads(split, split, padded, phase, cp_group=par.cp_group, cp_partition=partition)
        where = f"{partition} {phase} rank {par.rank}"
        _assert_same_step(where, (loss_cp, idx_cp, split), (loss, idx, single))
        if phase != "dense":
            assert float(idx) > 0, where
        if partition == "contiguous":
            got = loss_and_grads(sharded, sharded, padded, phase, cp_group=par.cp_group, cp_partition=partition,
                                 cp_compressed="sharded")
            _assert_same_step(f"{where} sharded vs gather", (*got, sharded), (loss_cp, idx_cp, split))


def _assert_same_step(where, got, want):
    """(LM loss, indexer loss, model with gradients) of two steps agree in float64."""
    tol = dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got[0], want[0], **tol, msg=lambda m: f"{where} LM loss: {m}")
    torch.testing.assert_close(got[1], want[1], **tol, msg=lambda m: f"{where} indexer loss: {m}")
    grads = dict(want[2].named_parameters())
    for name, p in got[2].named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, **tol, msg=lambda m: f"{where} grad {name}: {m}")


def _check_eval(par, partition):
    model = _model()
    batch = RetrievalTask(reach=28).batch(0, EVAL, 0, CAPACITY[partition])
    want = evaluate(model, [batch], "sparse", torch.device("cpu"))
    got = evaluate(model, [batch.padded_to(CAPACITY[partition] + 1)], "sparse", torch.device("cpu"),
                   cp_group=par.cp_group, cp_partition=partition)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), (partition, key, got[key], value)
    assert want["indexer_loss"] > 0 and want["answers"] > 0


def _check_a_failing_rank(rank, result_dir):
    """Rank 1 raises inside step 2 (before its gradient all-reduce) and stays alive, stuck in a barrier of the
    default group as a hung process would be; rank 0, waiting in that all-reduce, must stop within --pg-timeout
    (5 s here) with an error naming rank 1, the step and the cause."""
    real, calls = distributed.sum_gradients, []

    def failing(parameters, cp_group):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault on rank 1")
        return real(parameters, cp_group)

    if rank == 1:
        distributed.sum_gradients = failing
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError) as err:
            train(TrainConfig(**dict(RUN, ratios=(0,), steps=3), cp=2, pg_timeout=5,
                              out=os.path.join(result_dir, "failing")))
    finally:
        distributed.sum_gradients = real
    waited = time.monotonic() - started
    if rank == 0:
        assert isinstance(err.value, distributed.RankFailed), repr(err.value)
        message = str(err.value)
        assert "rank 1 failed at step 2: RuntimeError: injected fault on rank 1" in message, message
        assert "--pg-timeout 5 s" in message, message
        assert waited < 5 + 25, waited                  # the timeout, plus start-up and one step
    else:
        assert "injected fault on rank 1" in str(err.value)
    dist.barrier()            # rank 1 "stays alive" in here until rank 0 has given up and comes to it


def _worker(rank, world, init_file, result_dir):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        torch.set_num_threads(1)
        par = distributed.build(world, rank, cp=2)
        assert (par.dp, par.dp_rank, par.cp_rank, par.dp_group) == (1, 0, rank, None)
        for partition in CAPACITY:
            _check_step(par, partition)
            _check_eval(par, partition)
        out = os.path.join(result_dir, "cp2")
        train(TrainConfig(**RUN, cp=2, out=out, stop_after=2))
        train(TrainConfig(**RUN, cp=2, out=out, resume=out))
        train(TrainConfig(**HEAD_TAIL_RUN, **SHARDED, cp=2, out=os.path.join(result_dir, "cp2_head_tail")))
        assert dist.is_initialized(), "train() must leave a caller's process group alone"
        _check_a_failing_rank(rank, result_dir)
        dist.destroy_process_group()
        if rank == 0:
            train(TrainConfig(**RUN, out=os.path.join(result_dir, "cp1")))
            train(TrainConfig(**HEAD_TAIL_RUN, out=os.path.join(result_dir, "cp1_head_tail")))
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("ok\n")
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("error\n" + traceback.format_exc())
        raise


def _records(out, kind):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_cp2_equals_the_single_process_step_eval_and_run(tmp_path):
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_worker, world, tmp, deadline_s=420)
        for name in ("cp1", "cp2", "cp1_head_tail", "cp2_head_tail"):
            os.rename(os.path.join(tmp, name), tmp_path / name)
    cp2 = tmp_path / "cp2"

    for name in ("metrics.jsonl", "config.json", "summary.json", "summary.txt", "checkpoints/step_0000004/meta.json",
                 "checkpoints/step_0000004/model.safetensors", "checkpoints/step_0000002/meta.json"):
        assert (cp2 / name).is_file(), name
    meta = json.loads((cp2 / "checkpoints/step_0000004/meta.json").read_text())
    assert (meta["step"], meta["world_size"], meta["run_config"]["cp"], meta["data"]["next_batch"]) == (4, 2, 2, 4)
    assert _records(cp2, "start")[1]["resumed_from"].endswith("step_0000002")
    assert json.loads((tmp_path / "cp2_head_tail/config.json").read_text())["run_config"]["cp_compressed"] == "sharded"

    for run in ("", "_head_tail"):
        for kind, steps in (("train", [1, 2, 3, 4]), ("eval", [2, 4])):
            a, b = _records(tmp_path / f"cp2{run}", kind), _records(tmp_path / f"cp1{run}", kind)
            assert [r["step"] for r in a] == [r["step"] for r in b] == steps
            for ra, rb in zip(a, b):
                for key in ("loss", "indexer_loss", "lm_loss", "retrieval_acc", "indexer_recall"):
                    where = (f"cp2{run}", kind, ra["step"], key)
                    if rb.get(key) is None:
                        assert ra.get(key) is None, where
                    else:
                        assert ra[key] == pytest.approx(rb[key], rel=1e-4), where


@pytest.mark.parametrize("ratios", [(0, 4, 128, 4), (0, 4), (0,), (4, 128)], ids=lambda r: "-".join(map(str, r)))
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_largest_halo_is_the_layers(ratios, preset):
    mcfg = model_config(preset, ratios)
    layers = [HybridAttention(mcfg.attention, r) for r in ratios]
    assert largest_halo(mcfg) == max(layer.halo_rows for layer in layers)

"""Tensor parallelism in the training job: ``--tp 2`` equals the single process.

Two spawns (gloo, CPU; process start-up dominates the cost):

- 2 ranks (tp=2, dp=1) check in their workers: the TP model built after the same seed holds the one-process
  model's slices; four ``train_step``s of the tiny model (ratios 0,4,128,4) in float64, one per phase and a second
  warm-up, with the gradient clip active, give the loss, indexer loss, global gradient norm, every parameter and
  every AdamW moment (gathered to full) of the one-process steps (rtol 1e-9); replicated parameters stay bitwise
  equal on the two ranks; held-out evaluation (indexer probe included) equals the one-process one. Then
  ``train()``: --tp 2 stopped after 2 steps and resumed; --tp 2 resumed from a --tp 1 checkpoint; --tp 1 resumed
  from a --tp 2 checkpoint; the parent compares the logs with the --tp 1 run (fp32: rtol 1e-4, as the CP test)
  and the checkpoints' files (same names, shapes and dtypes; weights within rounding).
- 4 ranks check the same float64 steps at tp=2 x cp=2 (CP groups {0,2} {1,3}) and at tp=2 x dp=2 (DDP over the
  DP groups {0,2} {1,3}: the gradient is the mean of the two replicas' batches).
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

from dsv4attn.train import TrainConfig, distributed
from dsv4attn.train.data import EVAL, TRAIN, RetrievalTask
from dsv4attn.train.evaluate import evaluate
from dsv4attn.train.loop import train
from dsv4attn.train.model import DecoderLM, model_config
from dsv4attn.train.setup import build_optimizer
from dsv4attn.train.step import loss_and_grads, train_step
from dsv4attn.train.tensor import full_state, sharded_parameters
from tests.spawned_ranks import run_ranks

RATIOS = (0, 4, 128, 4)
PHASES = ("dense", "warmup", "warmup", "sparse")
CAPACITY = 255                       # 256 rows under --cp 2: chunks of 128 rows, the HCA halo
STEP_CFG = TrainConfig(steps=4, dense_steps=1, warmup_steps=2, lr=1e-2, lr_warmup_steps=1, grad_clip=0.5,
                       weight_decay=0.1, capacity=CAPACITY)
TOL = dict(rtol=1e-9, atol=1e-12)
RUN = dict(steps=4, dense_steps=1, warmup_steps=2, capacity=255, eval_every=2, eval_batches=1, plot=False)


def _model(tp_group=None):
    torch.manual_seed(0)
    return DecoderLM(model_config("tiny", RATIOS, indexer_loss_coeff=0.3), tp_group=tp_group).double().train()


def _batch(index, rows=CAPACITY):
    return RetrievalTask(reach=28).batch(0, TRAIN, index, CAPACITY).padded_to(rows)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300)) if b.numel() else 0.0


def _reference_step(model, optimizer, batches, phase, clip):
    """One-process step on the mean gradient of ``batches`` (one per data-parallel replica); (loss of the first
    batch, its indexer loss, norm)."""
    losses = []
    for batch in batches:
        losses.append(loss_and_grads(model, model, batch, phase))
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= len(batches)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss, idx = losses[0]
    return float(loss), None if idx is None else float(idx), float(norm)


def _check_replicated_equal(model, tp_group, where):
    sharded = sharded_parameters(model)
    for name, p in model.named_parameters():
        if name in sharded:
            continue
        parts = [torch.empty_like(p) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, p.detach().contiguous(), group=tp_group)
        assert all(torch.equal(parts[0], q) for q in parts), f"{where}: {name} differs across the TP ranks"


def _check_steps(par, worst, cp_partition="contiguous"):
    """Four float64 steps of the --tp model under ``par`` against the one-process model (updates ``worst``)."""
    single, split = _model(), _model(par.tp_group)
    weights, _ = full_state(split, build_optimizer(split, STEP_CFG))
    for name, value in single.state_dict().items():    # the same init: the TP model holds the one-process slices
        assert torch.equal(weights[name], value), name
    opt_single, opt_split = build_optimizer(single, STEP_CFG), build_optimizer(split, STEP_CFG)
    step_model = split
    if par.dp > 1:
        step_model = torch.nn.parallel.DistributedDataParallel(split, process_group=par.dp_group)
    rows = STEP_CFG.capacity + 1 if par.cp > 1 else STEP_CFG.capacity
    layout = f"tp{par.tp}xcp{par.cp}xdp{par.dp}"
    clipped = False
    for step, phase in enumerate(PHASES):
        for opt in (opt_single, opt_split):
            for group in opt.param_groups:
                group["lr"] = STEP_CFG.lr_at(step)
        batches = [_batch(step * par.dp + d, rows) for d in range(par.dp)]
        want = _reference_step(single, opt_single, batches, phase, STEP_CFG.grad_clip)
        got = train_step(split, opt_split, batches[par.dp_rank], phase, step, STEP_CFG.grad_clip, par,
                         cp_partition=cp_partition, step_model=step_model)
        where = f"{layout} step {step + 1} ({phase}) rank {par.rank}"
        if par.dp_rank == 0:                            # the metrics are those of this replica's batch
            for key, a, b in (("loss", got.loss, want[0]), ("grad norm", got.grad_norm, want[2])):
                assert a == pytest.approx(b, rel=1e-9), (where, key, a, b)
                worst[key] = max(worst.get(key, 0.0), abs(a - b) / abs(b))
            if phase != "dense":
                assert got.indexer_loss == pytest.approx(want[1], rel=1e-9), (where, got.indexer_loss, want[1])
        else:
            assert got.grad_norm == pytest.approx(want[2], rel=1e-9), (where, got.grad_norm, want[2])
        clipped |= want[2] > STEP_CFG.grad_clip
        weights, opt_state = full_state(split, opt_split)
        for name, value in single.state_dict().items():
            torch.testing.assert_close(weights[name], value, **TOL, msg=lambda m: f"{where} {name}: {m}")
            worst["parameters"] = max(worst.get("parameters", 0.0), _rel(weights[name], value))
        ref = opt_single.state_dict()["state"]
        assert ref.keys() == opt_state["state"].keys(), where
        for index, entry in ref.items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt_state["state"][index][key], entry[key], **TOL,
                                           msg=lambda m: f"{where} state {index} {key}: {m}")
                worst["AdamW moments"] = max(worst.get("AdamW moments", 0.0),
                                             _rel(opt_state["state"][index][key], entry[key]))
        _check_replicated_equal(split, par.tp_group, where)
    assert clipped, "the gradient clip never acted: the norm test would not test the clip"
    return single, split


def _check_eval(par, single, split, worst):
    batch = RetrievalTask(reach=28).batch(0, EVAL, 0, CAPACITY)
    want = evaluate(single, [batch], "sparse", torch.device("cpu"))
    got = evaluate(split, [batch], "sparse", torch.device("cpu"))
    assert want["indexer_loss"] > 0 and want["indexer_recall"] is not None
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), (key, got[key], value)
        if isinstance(value, float) and value:
            worst["eval"] = max(worst.get("eval", 0.0), abs(got[key] - value) / abs(value))


def _report(result_dir, rank, worst):
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("ok\n" + json.dumps(worst))


def _failed(result_dir, rank):
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("error\n" + traceback.format_exc())


def _init(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)


def _worker_tp2(rank, world, init_file, result_dir):
    try:
        torch.set_num_threads(1)
        out = lambda name: os.path.join(result_dir, name)  # noqa: E731
        if rank == 0:            # before the group exists: a one-process run (tp1), with a checkpoint at step 2
            train(TrainConfig(**RUN, out=out("tp1"), stop_after=2))
            train(TrainConfig(**RUN, out=out("tp1"), resume=out("tp1")))
        _init(rank, world, init_file)
        par = distributed.build(world, rank, cp=1, tp=2)
        assert (par.dp, par.cp, par.tp, par.tp_rank, par.dp_group, par.cp_group) == (1, 1, 2, rank, None, None)
        worst = {}
        single, split = _check_steps(par, worst)
        _check_eval(par, single, split, worst)
        train(TrainConfig(**RUN, tp=2, out=out("tp2"), stop_after=2))
        train(TrainConfig(**RUN, tp=2, out=out("tp2"), resume=out("tp2")))
        train(TrainConfig(**RUN, tp=2, out=out("tp2_from_tp1"), resume=out("tp1/checkpoints/step_0000002")))
        dist.destroy_process_group()
        if rank == 0:
            train(TrainConfig(**RUN, out=out("tp1_from_tp2"), resume=out("tp2/checkpoints/step_0000002")))
        _report(result_dir, rank, worst)
    except Exception:
        _failed(result_dir, rank)
        raise


def _worker_4(rank, world, init_file, result_dir):
    try:
        _init(rank, world, init_file)
        worst = {}
        par = distributed.build(world, rank, cp=2, tp=2)
        assert (par.dp, par.tp_rank, par.cp_rank) == (1, rank % 2, rank // 2)
        _check_steps(par, worst)
        par = distributed.build(world, rank, cp=1, tp=2)
        assert (par.dp, par.dp_rank, par.tp_rank, par.cp_group) == (2, rank // 2, rank % 2, None)
        _check_steps(par, worst)
        dist.destroy_process_group()
        _report(result_dir, rank, worst)
    except Exception:
        _failed(result_dir, rank)
        raise


def _records(out, kind):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _worst(reports):
    worst = {}
    for text in reports.values():
        for key, value in json.loads(text.split("\n", 1)[1]).items():
            worst[key] = max(worst.get(key, 0.0), value)
    return worst


def _same_logs(got, want, steps, where):
    for kind, done in (("train", steps), ("eval", [s for s in (2, 4) if s in steps])):
        a, b = _records(got, kind), [r for r in _records(want, kind) if r["step"] in done]
        assert [r["step"] for r in a] == [r["step"] for r in b] == done, (where, kind)
        for ra, rb in zip(a, b):
            for key in ("loss", "indexer_loss", "lm_loss", "retrieval_acc", "indexer_recall"):
                if rb.get(key) is None:
                    assert ra.get(key) is None, (where, kind, ra["step"], key)
                else:
                    assert ra[key] == pytest.approx(rb[key], rel=1e-4), (where, kind, ra["step"], key)


def test_tp2_equals_the_single_process_steps_eval_runs_and_checkpoints(tmp_path):
    with tempfile.TemporaryDirectory() as tmp:
        reports = run_ranks(_worker_tp2, 2, tmp, deadline_s=300)
        for name in ("tp1", "tp2", "tp2_from_tp1", "tp1_from_tp2"):
            os.rename(os.path.join(tmp, name), tmp_path / name)
    print("tp2 float64, worst relative difference to one process:", json.dumps(_worst(reports)))
    tp1, tp2 = tmp_path / "tp1", tmp_path / "tp2"
    _same_logs(tp2, tp1, [1, 2, 3, 4], "tp2")
    _same_logs(tmp_path / "tp2_from_tp1", tp1, [3, 4], "tp2 resumed from tp1")
    _same_logs(tmp_path / "tp1_from_tp2", tp1, [3, 4], "tp1 resumed from tp2")
    meta = json.loads((tp2 / "checkpoints/step_0000004/meta.json").read_text())
    assert (meta["world_size"], meta["run_config"]["tp"]) == (2, 2)
    assert json.loads((tp2 / "summary.json").read_text())["params"] == json.loads(
        (tp1 / "summary.json").read_text())["params"]
    weights_diff = 0.0
    for step in ("step_0000002", "step_0000004"):
        want = load_file(tp1 / "checkpoints" / step / "model.safetensors")
        opt_want = torch.load(tp1 / "checkpoints" / step / "optimizer.pt", weights_only=True)
        runs = [tp2] + ([tmp_path / "tp2_from_tp1", tmp_path / "tp1_from_tp2"] if step == "step_0000004" else [])
        for run in runs:
            got = load_file(run / "checkpoints" / step / "model.safetensors")
            assert got.keys() == want.keys(), run
            for key, value in want.items():
                assert (got[key].shape, got[key].dtype) == (value.shape, value.dtype), (run, step, key)
                # fp32 rounding, which AdamW's normalised update can lift to a fraction of one step (lr 3e-3)
                torch.testing.assert_close(got[key], value, rtol=1e-4, atol=2e-4, msg=lambda m: f"{run} {key}: {m}")
                weights_diff = max(weights_diff, float((got[key] - value).abs().max()))
            opt = torch.load(run / "checkpoints" / step / "optimizer.pt", weights_only=True)
            assert opt["param_groups"] == opt_want["param_groups"], run
            assert opt["state"].keys() == opt_want["state"].keys(), run
            for index, entry in opt_want["state"].items():
                for key, value in entry.items():
                    assert opt["state"][index][key].shape == value.shape, (run, step, index, key)
    print("fp32 runs: largest |weight difference| to the --tp 1 run's checkpoints:", weights_diff)


def test_tp2_with_cp2_and_with_dp2_equals_the_single_process_steps():
    with tempfile.TemporaryDirectory() as tmp:
        reports = run_ranks(_worker_4, 4, tmp, deadline_s=300)
    print("tp2 x cp2 and tp2 x dp2 float64, worst relative difference to one process:",
          json.dumps(_worst(reports)))


def test_bad_tp_values_are_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    from tests.train.train_helpers import run_cli, tree_digest
    out = tmp_path / "run"
    cases = [
        (["--tp", "0"], "--tp must be an int >= 1, got 0"),
        (["--tp", "3"], "--tp 3 must divide the attention heads and output groups of the model, but "
                        "num_attention_heads (4) and o_groups (2) are not a multiple of 3; "
                        "this model allows --tp 1, 2"),
        (["--tp", "4"], "o_groups (2) is not a multiple of 4"),
    ]
    for args, message in cases:
        assert run_cli(*args, "--out", str(out)) == 2, args
        assert message in capsys.readouterr().err, args
    # A world that --cp x --tp does not split: refused before any process group exists.
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert run_cli("--tp", "2", "--out", str(out)) == 2
    assert ("--cp 1 x --tp 2 = 2 must divide the number of processes, got 3 (WORLD_SIZE)"
            in capsys.readouterr().err)
    assert not dist.is_initialized() and tree_digest(out) == {}
    # Resuming at another --tp keeps the data-parallel replica count (world / (cp x tp)), which decides the batches.
    from types import SimpleNamespace

    from dsv4attn.train import checkpointer
    saved = SimpleNamespace(meta={"run_config": TrainConfig(**RUN, tp=2).to_dict(), "world_size": 2}, path="ck")
    monkeypatch.setattr(checkpointer.ckpt_io, "load_checkpoint", lambda path: saved)
    assert checkpointer.resume_point(TrainConfig(**RUN, resume="ck"), world=1) is saved
    assert checkpointer.resume_point(TrainConfig(**RUN, tp=2, resume="ck"), world=2) is saved
    for tp, world, message in ((1, 2, r"checkpoint 2 \(--tp 2: 1 data-parallel replicas\), now 2 \(--tp 1: 2 "
                                      r"data-parallel replicas; the replica count must stay\)"),
                               (2, 4, r"checkpoint 2, now 4")):
        with pytest.raises(ValueError, match="world size: " + message):
            checkpointer.resume_point(TrainConfig(**RUN, tp=tp, resume="ck"), world=world)
    TrainConfig(tp=4, model="small").validate()             # 8 heads, 4 output groups
    with pytest.raises(ValueError, match=r"o_groups \(4\) is not a multiple of 8; this model allows --tp 1, 2, 4"):
        TrainConfig(tp=8, model="small").validate()

"""A step whose loss or gradient norm is not finite stops the run: a message naming the step and the quantity, exit
status 1, nothing of that step applied or saved, the last good checkpoint left as ``latest``."""
from __future__ import annotations

import json

import pytest
import torch

from dsv4attn.train import checkpoint as ckpt_io
from dsv4attn.train import distributed, step
from dsv4attn.train.setup import build_optimizer
from train_helpers import run_cli, tree_digest


def _poison_call(monkeypatch, module, name, at_call, poison):
    """Replace ``module.name`` by a wrapper that applies ``poison`` to the result (or arguments) of call ``at_call``."""
    real, calls = getattr(module, name), {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        return poison(real, args, kwargs) if calls["n"] == at_call else real(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapper)


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_nan_loss_stops_at_its_step_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _poison_call(monkeypatch, step, "lm_loss", 2, lambda real, a, k: real(*a, **k) * float("nan"))
    assert run_cli("--out", str(out), "--save-every", "1", "--eval-every", "100") == 1
    err = capsys.readouterr().err
    assert "step 2 (warmup phase): the loss is nan" in err, err
    assert "newest checkpoint (step 1) stays latest" in err and f"--resume {out}" in err, err
    assert ckpt_io.load_checkpoint(out).meta["step"] == 1               # the last good state
    assert [p.name for p in (out / "checkpoints").iterdir() if p.is_dir()] == ["step_0000001"]
    records = _records(out)
    assert [r["step"] for r in records if r["kind"] == "train"] == [1]     # the broken step is not logged as one
    assert records[-1]["kind"] == "stopped" and records[-1]["step"] == 2


def test_infinite_gradient_is_named_and_nothing_is_saved(tmp_path, capsys, monkeypatch):
    def poison(real, args, kwargs):
        params, group = args
        params = list(params)
        real(params, group)
        params[0].grad.view(-1)[0] = float("inf")                  # a finite loss, an infinite gradient norm
    _poison_call(monkeypatch, distributed, "sum_gradients", 1, poison)
    out = tmp_path / "run"
    assert run_cli("--out", str(out), "--save-every", "1") == 1
    err = capsys.readouterr().err
    assert "step 1 (dense phase): the grad_norm is inf" in err and "no checkpoint was written yet" in err, err
    assert not (out / "checkpoints").exists() or tree_digest(out / "checkpoints") == {}


def test_the_step_is_checked_before_the_optimizer_moves(monkeypatch):
    """train_step raises before optimizer.step: parameters and optimizer state are those of before the step."""
    from dsv4attn.train.config import TrainConfig
    from dsv4attn.train.data import TRAIN, make_source
    from dsv4attn.train.model import DecoderLM, model_config

    cfg = TrainConfig(steps=2, dense_steps=1, warmup_steps=0, capacity=96, plot=False)
    mcfg = model_config("tiny", (0, 4))
    torch.manual_seed(0)
    model = DecoderLM(mcfg)
    optimizer = build_optimizer(model, cfg)
    batch = make_source(None, n_layers=2, window=mcfg.attention.sliding_window).batch(0, TRAIN, 0, 96)
    model.blocks[0].attn.q_a_proj.weight.data[0, 0] = float("nan")    # a NaN parameter: NaN loss and gradients
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(step.NonFiniteStep, match=r"step 5 \(dense phase\): the loss is nan"):
        step.train_step(model, optimizer, batch, "dense", 4, cfg.grad_clip)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, equal_nan=True, msg=name)
    assert optimizer.state_dict()["state"] == {}                              # no optimizer step was taken


def test_an_error_inside_the_run_is_freed_as_soon_as_it_is_handled(tmp_path, monkeypatch):
    """The error a run raises is kept by no reference cycle through the loop's frame (the garbage collector off:
    only reference counts free it). A cycle kept the run's process groups alive past destroy_process_group() and
    let gloo's threads run into interpreter exit (SIGABRT, tests/parallel/test_context_parallel.py)."""
    import gc
    import weakref

    from dsv4attn.train import TrainConfig, loop

    class Marker:
        pass

    def failing_step(*args, **kwargs):
        raise RuntimeError("a step that fails")

    monkeypatch.setattr(loop, "train_step", failing_step)
    gc.disable()
    try:
        try:
            loop.train(TrainConfig(steps=1, dense_steps=1, warmup_steps=0, capacity=96, plot=False,
                                   out=str(tmp_path / "run")))
        except RuntimeError as err:
            err.marker = Marker()                   # an exception takes no weak reference: its marker does
            ref = weakref.ref(err.marker)
        else:
            raise AssertionError("the run did not raise")
        assert ref() is None, "the run's error is kept alive by a reference cycle"
    finally:
        gc.enable()

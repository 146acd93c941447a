"""Checkpoints and ``--resume``: N steps straight == N/2 steps, stop, resume, N/2 steps -- bit for bit on the CPU,
across phase changes (dense -> warm-up in the first half, warm-up -> sparse in the second)."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from train_helpers import run_cli


def _final(out):
    ckpt = out / "checkpoints" / "step_0000004"
    return load_file(str(ckpt / "model.safetensors")), torch.load(ckpt / "optimizer.pt", weights_only=True)


def test_resume_is_bit_exact_across_phase_changes(tmp_path):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert run_cli("--out", str(straight)) == 0
    assert run_cli("--out", str(halves), "--stop-after", "2") == 0
    meta = json.loads((halves / "checkpoints" / "step_0000002" / "meta.json").read_text())
    assert (meta["step"], meta["phase"], meta["next_phase"]) == (2, "warmup", "warmup")
    assert not (halves / "checkpoints" / "step_0000004").exists()
    assert run_cli("--out", str(halves), "--resume", str(halves)) == 0

    weights_a, optim_a = _final(straight)
    weights_b, optim_b = _final(halves)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    for i, state in optim_a["state"].items():
        for key, value in state.items():
            assert torch.equal(value, optim_b["state"][i][key]), (i, key)

    def train_log(out):
        return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if r["kind"] == "train"}
    assert train_log(straight) == train_log(halves)


def test_resume_from_a_checkpoint_directory_into_a_new_out(tmp_path):
    first = tmp_path / "first"
    assert run_cli("--out", str(first), "--stop-after", "3") == 0
    fork = tmp_path / "fork"
    assert run_cli("--out", str(fork), "--resume", str(first / "checkpoints" / "step_0000003")) == 0
    records = [json.loads(line) for line in (fork / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [4]
    assert records[0]["resumed_from"].endswith("step_0000003")

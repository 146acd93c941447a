"""Command line of ``python -m dsv4attn.train``: defaults, flags, a whole tiny run through every phase and what it
writes (JSONL log, checkpoints, summary, plot)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dsv4attn.train.cli import parse_args
from dsv4attn.train.config import TrainConfig
from train_helpers import run_cli


def test_defaults_match_the_config_dataclass():
    cfg = parse_args([])
    assert cfg == TrainConfig()
    assert cfg.ratios == (0, 4, 128, 4) and cfg.data is None and cfg.cp == 1 and cfg.plot


def test_flags_reach_the_config():
    cfg = parse_args(["--ratios", "0,0,0,0", "--steps", "10", "--dense-steps", "3", "--warmup-steps", "2",
                      "--capacity", "64", "--data", "x.txt", "--seed", "5", "--indexer-loss-coeff", "0.5",
                      "--no-plot", "--out", "r", "--resume", "r", "--lr", "0.01"])
    assert (cfg.ratios, cfg.steps, cfg.dense_steps, cfg.warmup_steps, cfg.capacity) == ((0, 0, 0, 0), 10, 3, 2, 64)
    assert (cfg.data, cfg.seed, cfg.indexer_loss_coeff, cfg.plot, cfg.out, cfg.resume, cfg.lr) == \
        ("x.txt", 5, 0.5, False, "r", "r", 0.01)
    assert [cfg.phase_of(s) for s in range(10)] == ["dense"] * 3 + ["warmup"] * 2 + ["sparse"] * 5


def test_context_parallel_flags():
    cfg = parse_args(["--cp", "2", "--cp-partition", "head_tail", "--capacity", "1021"])
    assert (cfg.cp, cfg.cp_partition, cfg.batch_rows) == (2, "head_tail", 1024)     # 4 equal chunks
    assert parse_args(["--cp", "4", "--capacity", "1021"]).batch_rows == 1024
    assert parse_args(["--cp", "3", "--capacity", "1021"]).batch_rows == 1023


def test_unknown_cp_partition_exits_with_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--cp-partition", "zigzag"])
    assert e.value.code == 2 and "invalid choice: 'zigzag'" in capsys.readouterr().err


def test_malformed_ratios_exit_with_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--ratios", "0,four"])
    assert e.value.code == 2 and "--ratios must be comma-separated ints" in capsys.readouterr().err


def test_module_entry_point_prints_help():
    done = subprocess.run([sys.executable, "-m", "dsv4attn.train", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0
    for flag in ("--steps", "--dense-steps", "--warmup-steps", "--data", "--ratios", "--out", "--resume", "--cp",
                 "--cp-partition", "--seed", "--capacity"):
        assert flag in done.stdout


def test_tiny_run_logs_every_phase_and_writes_its_outputs(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("--out", str(out), "--plot") == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["phase"] for r in train] == ["dense", "warmup", "warmup", "sparse"]
    assert [r["phase"] for r in records if r["kind"] == "phase"] == ["dense", "warmup", "sparse"]
    assert train[0]["indexer_loss"] is None and all(r["indexer_loss"] > 0 for r in train[1:])
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    for key in ("lm_loss", "retrieval_acc", "indexer_loss", "indexer_recall"):
        assert evals[-1][key] is not None, key
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((ckpt / "meta.json").read_text())
    assert (meta["step"], meta["phase"], meta["data"]["next_batch"]) == (4, "sparse", 4)
    assert meta["run_config"]["ratios"] == [0, 4, 128, 4] and "torch_cpu" in meta["rng"]
    assert set(load_file(str(ckpt / "model.safetensors"))) >= {"embed.weight", "blocks.1.attn.indexer.q_b_proj.weight"}
    torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]   # no temporary leftovers
    screen = capsys.readouterr().out
    assert "retrieval accuracy" in screen and "tokens/s" in screen
    assert "retrieval accuracy" in (out / "summary.txt").read_text()


def test_window_only_run_has_no_indexer_metrics(tmp_path):
    out = tmp_path / "window"
    assert run_cli("--ratios", "0,0", "--out", str(out)) == 0
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["kind"] == "eval" and last["indexer_loss"] is None and last["indexer_recall"] is None


def test_text_data_run(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    out = tmp_path / "text"
    assert run_cli("--data", str(text), "--out", str(out), "--steps", "2", "--dense-steps", "1",
                   "--warmup-steps", "1") == 0
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["retrieval_acc"] is None and last["lm_loss"] > 0

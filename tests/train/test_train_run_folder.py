"""The run folder: ``--overwrite`` removes only what the trainer wrote (and refuses a folder holding anything else),
and the JSONL log of a resumed run has one record per step, whatever stopped the earlier session (Ctrl-C, a kill
that tore the last line, a resume of a finished run)."""
from __future__ import annotations

import json
import shutil

import pytest

from dsv4attn.train import loop
from train_helpers import checkpoint_names, quick_io, records, run_fast, tree_digest  # noqa: F401 (quick_io: fixture)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("folder")
    straight, half = base / "straight", base / "half"
    assert run_fast("--out", str(straight)) == 0
    assert run_fast("--out", str(half), "--stop-after", "4") == 0
    return {"straight": straight, "half": half,
            "losses": {r["step"]: r["loss"] for r in records(straight, "train")}}


@pytest.mark.parametrize("foreign, kind", [
    ("notes.txt", "file"), ("data", "folder"), (".DS_Store", "file"), ("checkpoints/best.pt", "file"),
    ("checkpoints/step_0000008/README.md", "file"), ("checkpoints/step_0000009", "file"),
], ids=["top_file", "top_folder", "hidden_file", "file_in_checkpoints", "file_in_a_checkpoint",
        "file_named_like_a_checkpoint"])
def test_overwrite_refuses_a_folder_holding_foreign_files(tmp_path, capsys, runs, foreign, kind):
    """The probe's case: --overwrite deleted a file the trainer had not written."""
    out = tmp_path / "run"
    shutil.copytree(runs["straight"], out)
    path = out / foreign
    path.mkdir() if kind == "folder" else path.write_text("mine")
    before = tree_digest(tmp_path)
    capsys.readouterr()
    assert run_fast("--out", str(out), "--overwrite") == 2
    err = capsys.readouterr().err
    assert f"--overwrite: --out {out} holds {foreign}, which the trainer did not write" in err, err
    assert tree_digest(tmp_path) == before and path.exists()


def test_overwrite_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    out = tmp_path / "home"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    capsys.readouterr()
    assert run_fast("--out", str(out), "--overwrite") == 2
    assert "holds thesis.tex, which the trainer did not write" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["thesis.tex"]


def test_overwrite_replaces_a_run_and_its_crash_leftovers(tmp_path, runs):
    out = tmp_path / "run"
    shutil.copytree(runs["half"], out)
    (out / "checkpoints" / ".step_0000006.tmp-1-abc").mkdir()
    (out / "checkpoints" / ".step_0000006.tmp-1-abc" / "model.safetensors").write_bytes(b"torn")
    (out / "checkpoints" / ".latest.tmp-12").write_text("step")
    (out / ".metrics.jsonl.tmp-12").write_text("{")
    assert run_fast("--out", str(out), "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.json", "metrics.jsonl", "summary.json",
                                                     "summary.txt"]
    assert checkpoint_names(out) == ["latest", "step_0000004", "step_0000006", "step_0000008"]
    assert [r["step"] for r in records(out, "start")] == [0]
    assert {r["step"]: r["loss"] for r in records(out, "train")} == runs["losses"]


def test_overwrite_with_a_resume_from_another_run(tmp_path, runs):
    out = tmp_path / "run"
    shutil.copytree(runs["straight"], out)
    assert run_fast("--out", str(out), "--overwrite", "--resume", str(runs["half"])) == 0
    assert [r["step"] for r in records(out, "start")] == [4]          # the old log is gone, not appended to
    assert [r["step"] for r in records(out, "train")] == [5, 6, 7, 8]
    assert checkpoint_names(out) == ["latest", "step_0000006", "step_0000008"]
    assert checkpoint_names(runs["half"]) == ["latest", "step_0000002", "step_0000004"]


def test_ctrl_c_then_resume_logs_every_step_once(tmp_path, monkeypatch, capsys, runs):
    """The probe's case: SIGINT after step 5 (checkpoint at 4), then --resume: steps 5 was logged twice."""
    out = tmp_path / "run"
    step = loop.train_step
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return step(*args, **kwargs)
    monkeypatch.setattr(loop, "train_step", interrupted)
    capsys.readouterr()
    assert run_fast("--out", str(out)) == 130
    assert f"interrupted: continue from the last checkpoint with --resume {out}" in capsys.readouterr().err
    monkeypatch.undo()
    assert [r["step"] for r in records(out, "train")] == [1, 2, 3, 4, 5]
    assert run_fast("--out", str(out), "--resume", str(out)) == 0
    assert [r["step"] for r in records(out, "start")] == [0, 4]
    assert records(out, "start")[-1]["dropped_records"] == 1
    assert {r["step"]: r["loss"] for r in records(out, "train")} == runs["losses"]
    assert [r["step"] for r in records(out, "train")] == list(range(1, 9))
    assert [(r["step"], r["phase"]) for r in records(out, "phase")] == [(0, "dense"), (1, "warmup"), (3, "sparse")]


def test_a_torn_last_line_and_records_past_the_checkpoint_are_dropped(tmp_path, runs):
    """A kill -9 while logging: records of steps after the checkpoint, the last line cut short."""
    out = tmp_path / "run"
    shutil.copytree(runs["half"], out)
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "train", "step": 5, "loss": 0.0}) + "\n")
        f.write(json.dumps({"kind": "start", "step": 4}) + "\n")      # an earlier, killed resume
        f.write('{"kind": "train", "step": 6, "lo')
    assert run_fast("--out", str(out), "--resume", str(out)) == 0
    assert [r["step"] for r in records(out, "start")] == [0, 4]        # every line parses again
    assert {r["step"]: r["loss"] for r in records(out, "train")} == runs["losses"]


def test_resuming_a_finished_run_logs_no_second_evaluation(tmp_path, runs):
    out = tmp_path / "run"
    shutil.copytree(runs["straight"], out)
    for _ in range(2):
        assert run_fast("--out", str(out), "--resume", str(out)) == 0
    assert [r["step"] for r in records(out, "eval")] == [8]
    assert [r["step"] for r in records(out, "train")] == list(range(1, 9))

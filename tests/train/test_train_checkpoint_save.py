"""The save protocol cannot lose a checkpoint: a save stopped dead at each of its points (an exception nothing
catches, raised where a kill -9 could land; one real kill -9 in a subprocess) leaves a run that resumes from the last
complete checkpoint, bit-exact with a straight run, and the next save removes what the crash left behind.

Two situations: the first save of step 6 (latest names step 4 meanwhile), and a resumed run saving step 8 again while
latest names step 8 (``--resume D/checkpoints/step_0000006 --out D``: the old copy has to make way for the new).
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4attn.train import checkpoint as ckpt_io
from train_helpers import checkpoint_names, quick_io, records, run_fast  # noqa: F401 (quick_io: a fixture)

ROOT = Path(__file__).resolve().parents[2]


class Killed(BaseException):
    """A crash: nothing in the trainer handles it (a kill -9 runs no handler either)."""


def _kill_at(monkeypatch, point: str) -> None:
    assert point in ckpt_io.SAVE_POINTS

    def hook(reached):
        if reached == point:
            raise Killed(point)
    monkeypatch.setattr(ckpt_io, "_protocol_step", hook)


def _weights(ckpt: Path) -> dict:
    return ckpt_io._open(ckpt).weights


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A straight run (checkpoints 4, 6, 8) and one stopped after 4 steps (checkpoints 2, 4)."""
    base = tmp_path_factory.mktemp("save")
    straight, half = base / "straight", base / "half"
    assert run_fast("--out", str(straight)) == 0
    assert run_fast("--out", str(half), "--stop-after", "4") == 0
    assert checkpoint_names(straight) == ["latest", "step_0000004", "step_0000006", "step_0000008"]
    assert checkpoint_names(half) == ["latest", "step_0000002", "step_0000004"]
    return {"straight": straight, "half": half,
            "final": _weights(straight / "checkpoints" / "step_0000008"),
            "losses": {r["step"]: r["loss"] for r in records(straight, "train")}}


def _assert_same_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _assert_clean_and_exact(out: Path, runs) -> None:
    """The run is whole: no leftovers, the final checkpoint equals the straight run's, one record per step."""
    assert not [n for n in checkpoint_names(out) if n.startswith(".")], checkpoint_names(out)
    resumed = ckpt_io.load_checkpoint(out)
    assert resumed.meta["step"] == 8 and resumed.notes == []
    _assert_same_weights(resumed.weights, runs["final"])
    train = records(out, "train")
    assert [r["step"] for r in train] == list(range(1, 9))
    assert {r["step"]: r["loss"] for r in train} == runs["losses"]


FIRST_SAVE = [p for p in ckpt_io.SAVE_POINTS if p not in ("moved the old copy aside", "removed the old copy")]
COMMITTED = ("replaced latest", "pruned", "cleaned up")      # the points after which step 6 is the latest


@pytest.mark.parametrize("point", FIRST_SAVE)
def test_kill_during_a_first_save(tmp_path, monkeypatch, runs, point):
    out = tmp_path / "run"
    shutil.copytree(runs["half"], out)
    _kill_at(monkeypatch, point)
    with pytest.raises(Killed):
        run_fast("--out", str(out), "--resume", str(out))
    monkeypatch.undo()
    want = 6 if point in COMMITTED else 4
    found = ckpt_io.load_checkpoint(out)
    assert found.meta["step"] == want and found.path.name == f"step_{want:07d}" and found.notes == []
    assert (out / "checkpoints" / "step_0000004").is_dir()            # the previous checkpoint is untouched
    if point not in COMMITTED:
        assert ckpt_io.load_checkpoint(out / "checkpoints" / "step_0000004").meta["step"] == 4
    assert run_fast("--out", str(out), "--resume", str(out)) == 0
    assert records(out, "start")[-1]["resumed_from"].endswith(f"step_{want:07d}")
    _assert_clean_and_exact(out, runs)


@pytest.mark.parametrize("point", ckpt_io.SAVE_POINTS)
def test_kill_while_saving_an_existing_step_again(tmp_path, monkeypatch, capsys, runs, point):
    out = tmp_path / "run"
    shutil.copytree(runs["straight"], out)
    _kill_at(monkeypatch, point)
    with pytest.raises(Killed):
        run_fast("--out", str(out), "--resume", str(out / "checkpoints" / "step_0000006"))
    monkeypatch.undo()
    # Whatever the instant, the run resumes at step 8 (the old copy or the new one: the same bytes of weights).
    found = ckpt_io.load_checkpoint(out)
    assert found.meta["step"] == 8
    _assert_same_weights(found.weights, runs["final"])
    if point == "moved the old copy aside":          # latest names step_0000008, which is not there right now
        assert found.path.name.startswith(".step_0000008.old-")
        assert any("names step_0000008, which does not exist" in n for n in found.notes), found.notes
        capsys.readouterr()
        assert run_fast("--out", str(out), "--resume", str(out)) == 0     # at the end: evaluates, summarises
        err = capsys.readouterr().err
        assert "names step_0000008, which does not exist" in err
        assert "resuming from checkpoints/.step_0000008.old-" in err
    else:
        assert found.path.name == "step_0000008" and found.notes == []
    # The next save puts a moved-aside copy back and removes every leftover.
    assert run_fast("--out", str(out), "--resume", str(out / "checkpoints" / "step_0000006")) == 0
    assert checkpoint_names(out) == ["latest", "step_0000004", "step_0000006", "step_0000008"]
    _assert_clean_and_exact(out, runs)


@pytest.mark.parametrize("name, resave", [("model.safetensors", False), ("optimizer.pt", True),
                                          ("manifest.json", True), (".latest.tmp-", False)],
                         ids=["model_first_save", "optimizer_resave", "manifest_resave", "latest_first_save"])
def test_kill_in_the_middle_of_writing_a_file(tmp_path, monkeypatch, runs, name, resave):
    """The file being written is left truncated (half its bytes) when the kill lands."""
    out = tmp_path / "run"
    shutil.copytree(runs["straight" if resave else "half"], out)
    write = ckpt_io._write_durably

    def torn(path, data):
        if Path(path).name.startswith(name):
            Path(path).write_bytes(data[:len(data) // 2])
            raise Killed(name)
        write(path, data)
    monkeypatch.setattr(ckpt_io, "_write_durably", torn)
    resume = out / "checkpoints" / "step_0000006" if resave else out
    with pytest.raises(Killed):
        run_fast("--out", str(out), "--resume", str(resume))
    monkeypatch.undo()
    leftovers = [n for n in checkpoint_names(out) if n.startswith(".")]
    assert leftovers, "the torn file stays in a hidden temporary"
    found = ckpt_io.load_checkpoint(out)
    assert found.meta["step"] == (8 if resave else 4) and found.notes == []
    assert run_fast("--out", str(out), "--resume", str(out / "checkpoints" / "step_0000006" if resave else out)) == 0
    _assert_clean_and_exact(out, runs)


def test_a_file_that_reads_back_wrong_is_never_made_the_latest(tmp_path, monkeypatch, capsys, runs):
    out = tmp_path / "run"
    shutil.copytree(runs["half"], out)
    read = ckpt_io._read_bytes

    def bad_disk(path):
        data = read(path)
        if ".tmp-" in str(path) and Path(path).name == "optimizer.pt":
            data = data[:-1] + bytes([data[-1] ^ 1])
        return data
    monkeypatch.setattr(ckpt_io, "_read_bytes", bad_disk)
    assert run_fast("--out", str(out), "--resume", str(out)) == 2
    err = capsys.readouterr().err
    assert "optimizer.pt reads back with sha256" in err and "latest still names the previous checkpoint" in err
    monkeypatch.undo()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    assert not (out / "checkpoints" / "step_0000006").exists()
    assert run_fast("--out", str(out), "--resume", str(out)) == 0
    _assert_clean_and_exact(out, runs)


def test_a_full_disk_stops_the_run_with_a_clear_error(tmp_path, monkeypatch, capsys, runs):
    out = tmp_path / "run"
    shutil.copytree(runs["half"], out)

    write = ckpt_io._write_durably

    def full(path, data):
        if "checkpoints" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write(path, data)
    monkeypatch.setattr(ckpt_io, "_write_durably", full)
    capsys.readouterr()
    assert run_fast("--out", str(out), "--resume", str(out)) == 2
    err = capsys.readouterr().err
    assert f"error: saving {out / 'checkpoints' / 'step_0000006'} failed: [Errno {errno.ENOSPC}]" in err
    assert f"{out / 'checkpoints' / 'latest'} names the last checkpoint saved completely" in err
    monkeypatch.undo()
    assert ckpt_io.load_checkpoint(out).meta["step"] == 4
    assert run_fast("--out", str(out), "--resume", str(out)) == 0
    _assert_clean_and_exact(out, runs)


def test_leftovers_of_crashed_saves_are_removed_by_the_next_save(tmp_path, runs):
    out = tmp_path / "run"
    shutil.copytree(runs["half"], out)
    root = out / "checkpoints"
    junk = [root / ".step_0000006.tmp-1f-abcdef", root / ".step_0000002.del-2-00ff00", root / ".latest.tmp-77"]
    junk[0].mkdir()
    (junk[0] / "model.safetensors").write_bytes(b"torn")
    junk[1].mkdir()
    junk[2].write_text("step_00")
    assert ckpt_io.load_checkpoint(out).meta["step"] == 4               # leftovers are never candidates
    assert run_fast("--out", str(out), "--resume", str(out)) == 0
    _assert_clean_and_exact(out, runs)


def test_pruning_keeps_the_new_checkpoint_and_the_one_resumed_from(tmp_path, runs):
    """A run resumed from step 4 with steps 6 and 8 present saves step 5: 4 and 5 are the two newest of this
    session (--keep 2); the later ones of the earlier session stay until this run saves those steps again."""
    out = tmp_path / "run"
    shutil.copytree(runs["straight"], out)
    assert run_fast("--out", str(out), "--resume", str(out / "checkpoints" / "step_0000004"), "--keep", "2",
                    "--save-every", "1", "--stop-after", "1") == 0
    assert checkpoint_names(out) == ["latest", "step_0000004", "step_0000005", "step_0000006", "step_0000008"]
    assert ckpt_io.load_checkpoint(out).meta["step"] == 5
    assert [r["step"] for r in records(out, "train")] == [1, 2, 3, 4, 5]
    assert run_fast("--out", str(out), "--resume", str(out), "--keep", "2") == 0
    assert checkpoint_names(out) == ["latest", "step_0000006", "step_0000008"]
    _assert_clean_and_exact(out, runs)


KILL_SCRIPT = """
import os, signal, sys
import torch
torch.set_num_threads(1)
from dsv4attn.train import checkpoint
def hook(point):
    if point == sys.argv[1]:
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint._protocol_step = hook
from dsv4attn.train.cli import main
sys.path.insert(0, sys.argv[2])
from train_helpers import FAST, TINY
main([*TINY, *FAST, *sys.argv[3:]])
"""


def test_real_kill_9_between_the_two_renames(tmp_path, runs):
    """The probe's case: step 8 saved again, killed after the old copy was moved aside and before the new one took
    its name. ``--resume D`` used to fail with 'no checkpoint' (latest named a folder that was gone)."""
    out = tmp_path / "run"
    shutil.copytree(runs["straight"], out)
    done = subprocess.run([sys.executable, "-c", KILL_SCRIPT, "moved the old copy aside", str(Path(__file__).parent),
                           "--out", str(out), "--resume", str(out / "checkpoints" / "step_0000006")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not (out / "checkpoints" / "step_0000008").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_0000008"
    assert run_fast("--out", str(out), "--resume", str(out / "checkpoints" / "step_0000006")) == 0
    assert records(out, "start")[-1]["resumed_from"].endswith("step_0000006")
    _assert_clean_and_exact(out, runs)

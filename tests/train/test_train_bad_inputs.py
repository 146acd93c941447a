"""Bad input to the training job: a clear error naming the option, exit status 2, and nothing written."""
from __future__ import annotations

import pytest

from train_helpers import run_cli, tree_digest


def _refused(capsys, args, message, tmp_path):
    before = tree_digest(tmp_path)
    assert run_cli(*args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert tree_digest(tmp_path) == before, "a refused run must not write anything"
    return err


@pytest.mark.parametrize("args, message", [
    (["--dense-steps", "3", "--warmup-steps", "2"], "--dense-steps (3) + --warmup-steps (2) must be <= --steps (4)"),
    (["--capacity", "0"], "--capacity must be at least one token"),
    (["--cp", "0"], "--cp must be an int >= 1"),
    (["--cp", "2"], "--cp 2 with --capacity 192: each context-parallel rank would hold 96 rows of the packed batch, "
                    "but the model's layers (--ratios 0,4,128,4) need a left halo of 128 rows"),
    (["--cp", "3", "--ratios", "0,4", "--capacity", "20"], "would hold 7 rows of the packed batch, but the "
                                                          "model's layers (--ratios 0,4) need a left halo of 8 rows"),
    (["--cp", "2", "--cp-partition", "head_tail", "--capacity", "256"],
     "would hold 2 chunks of 64 rows (--cp-partition head_tail) of the packed batch"),
    (["--cp", "2", "--capacity", "256"], "--cp 2 must divide the number of processes, got 1 (WORLD_SIZE)"),
    (["--cp-compressed", "sharded"], "--cp-compressed sharded needs --cp > 1"),
    (["--ratios", "0,5"], "--ratios must be a comma-separated list"),
    (["--steps", "0"], "--steps must be an int >= 1"),
    (["--model", "huge"], "--model must be one of"),
    (["--out", ""], "--out must name the run directory, got ''"),
    (["--out", "  "], "--out must name the run directory, got '  '"),
    (["--resume", ""], "--resume must name a checkpoint or run directory, got ''"),
], ids=["phase_schedule_too_long", "capacity_zero", "cp_zero", "cp_too_few_rows_per_rank",
        "cp_too_few_rows_window_8", "cp_head_tail_too_few_rows", "cp_not_dividing_the_world",
        "cp_compressed_sharded_without_cp", "bad_ratio",
        "no_steps", "bad_preset", "empty_out", "blank_out", "empty_resume"])
def test_bad_options(tmp_path, capsys, args, message):
    _refused(capsys, ["--out", str(tmp_path / "run"), *args], message, tmp_path)
    assert not (tmp_path / "run").exists()


def test_missing_data_path(tmp_path, capsys):
    _refused(capsys, ["--out", str(tmp_path / "run"), "--data", str(tmp_path / "nope.txt")],
             "--data: " + str(tmp_path / "nope.txt") + " does not exist", tmp_path)


@pytest.mark.parametrize("layout", ["empty_file", "folder_of_empty_files", "empty_folder"])
def test_empty_data(tmp_path, capsys, layout):
    data = tmp_path / "data"
    if layout == "empty_file":
        data = tmp_path / "empty.txt"
        data.write_text("")
    else:
        data.mkdir()
        if layout == "folder_of_empty_files":
            (data / "a.txt").write_text("")
    message = "holds no files" if layout == "empty_folder" else "holds no text"
    _refused(capsys, ["--out", str(tmp_path / "run"), "--data", str(data)], message, tmp_path)


def test_non_utf8_data(tmp_path, capsys):
    data = tmp_path / "bin.txt"
    data.write_bytes(b"ok \xff\xfe")
    _refused(capsys, ["--out", str(tmp_path / "run"), "--data", str(data)], "is not UTF-8 text", tmp_path)


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("--out", str(out), "--steps", "1", "--dense-steps", "1", "--warmup-steps", "0") == 0
    capsys.readouterr()
    _refused(capsys, ["--out", str(out)], "already holds a run", tmp_path)
    assert run_cli("--out", str(out), "--overwrite") == 0          # explicit consent replaces it


def test_resume_with_a_different_config(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("--out", str(out), "--stop-after", "2") == 0
    capsys.readouterr()
    err = _refused(capsys, ["--out", str(out), "--resume", str(out), "--ratios", "0,0,0,0", "--seed", "3"],
                   "the run options differ from the checkpoint's", tmp_path)
    assert "--ratios: checkpoint [0, 4, 128, 4], now [0, 0, 0, 0]" in err and "--seed" in err


def test_resume_from_nothing(tmp_path, capsys):
    _refused(capsys, ["--out", str(tmp_path / "run"), "--resume", str(tmp_path / "missing")],
             "does not exist", tmp_path)
    (tmp_path / "empty").mkdir()
    _refused(capsys, ["--out", str(tmp_path / "run"), "--resume", str(tmp_path / "empty")],
             "neither a checkpoint directory", tmp_path)


def test_broken_link_in_data_folder(tmp_path, capsys):
    """A dangling link among the data files was skipped without a word (the run trained on the rest)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("some text " * 200)
    (data / "b.txt").symlink_to(tmp_path / "gone.txt")
    _refused(capsys, ["--out", str(tmp_path / "run"), "--data", str(data)],
             f"--data: {data / 'b.txt'} is a link to {tmp_path / 'gone.txt'}, which does not exist", tmp_path)


@pytest.mark.parametrize("where", ["checkpoint_folder", "inside_checkpoint", "checkpoints_folder"])
def test_out_inside_another_runs_checkpoints(tmp_path, capsys, where):
    """--out naming a checkpoint folder of another run trained and wrote its run files in there (exit 0): that
    run's pruning would later delete the new run with the checkpoint. Now refused before anything is written."""
    src = tmp_path / "src"
    step = src / "checkpoints" / "step_0000004"
    step.mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (step / "manifest.json").write_text("{}")
    out = {"checkpoint_folder": step, "inside_checkpoint": step / "run",
           "checkpoints_folder": src / "checkpoints" / "run"}[where]
    message = "is inside the checkpoint" if where != "checkpoints_folder" else "the checkpoints folder of the run"
    _refused(capsys, ["--out", str(out)], message, tmp_path)

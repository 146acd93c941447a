"""A damaged checkpoint is never used: every file of a checkpoint (weights, optimizer state, meta.json, manifest.json)
and the run's ``latest`` damaged in turn. ``--resume RUN`` falls back to the newest intact checkpoint, says which it
skipped and why, and continues bit-exact (the good older checkpoint is kept); ``--resume CHECKPOINT`` of a damaged
one, a ``latest`` holding a path, or a run with no intact checkpoint fail with one line naming the file and what was
expected, before anything is written.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4attn.train import checkpoint as ckpt_io
from train_helpers import (checkpoint_names, flip_bytes, quick_io, records, run_fast,  # noqa: F401 (quick_io: fixture)
                           tree_digest, truncate)

LAST = "step_0000008"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("load") / "straight"
    assert run_fast("--out", str(out)) == 0
    assert checkpoint_names(out) == ["latest", "step_0000004", "step_0000006", LAST]
    return {"out": out, "final": load_file(str(out / "checkpoints" / LAST / "model.safetensors")),
            "losses": {r["step"]: r["loss"] for r in records(out, "train")}}


@pytest.fixture
def run(tmp_path, straight):
    out = tmp_path / "run"
    shutil.copytree(straight["out"], out)
    return out


def _refused(capsys, root: Path, *args: str) -> str:
    """Run the CLI, expect exit status 2 with nothing written under ``root``; return stderr."""
    before = tree_digest(root)
    capsys.readouterr()
    assert run_fast(*args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert tree_digest(root) == before, "a refused resume must not write anything"
    return err


def _edit_json(path: Path, edit) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def _reseal(ckpt: Path) -> None:
    """Rewrite the manifest for the files as they are now (a consistent checkpoint with edited contents)."""
    step = json.loads((ckpt / "manifest.json").read_text())["step"]
    blobs = {name: (ckpt / name).read_bytes() for name in ckpt_io.FILES}
    (ckpt / "manifest.json").write_text(json.dumps(ckpt_io._manifest(step, blobs)))


def _set_sha(manifest):
    manifest["files"]["model.safetensors"]["sha256"] = "0" * 64


DAMAGE = {
    "model_flipped": ("model.safetensors", lambda p: flip_bytes(p), "model.safetensors has sha256"),
    "model_truncated": ("model.safetensors", truncate, "model.safetensors holds"),
    "model_empty": ("model.safetensors", lambda p: p.write_bytes(b""), "model.safetensors holds 0 bytes"),
    "optimizer_flipped": ("optimizer.pt", lambda p: flip_bytes(p, 64), "optimizer.pt has sha256"),
    "optimizer_truncated": ("optimizer.pt", truncate, "optimizer.pt holds"),
    "optimizer_deleted": ("optimizer.pt", os.unlink, "optimizer.pt is missing"),
    "meta_truncated": ("meta.json", truncate, "meta.json holds"),
    "meta_flipped": ("meta.json", lambda p: flip_bytes(p, 16), "meta.json has sha256"),
    "manifest_truncated": ("manifest.json", truncate, "manifest.json is not valid JSON"),
    "manifest_checksum_edited": ("manifest.json", lambda p: _edit_json(p, _set_sha),
                                 "manifest.json does not match its own checksum"),
    "manifest_deleted": ("manifest.json", os.unlink, "manifest.json is missing"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_latest_checkpoint_is_skipped(run, capsys, straight, damage):
    """The probe's case (4096 flipped bytes in model.safetensors) and its kin: the resume used to train on the
    damaged state (or crash with a traceback) and then prune the good older checkpoint."""
    name, harm, reason = DAMAGE[damage]
    harm(run / "checkpoints" / LAST / name)
    capsys.readouterr()
    assert run_fast("--out", str(run), "--resume", str(run)) == 0
    err = capsys.readouterr().err
    assert f"warning: --resume {run}: skipped checkpoints/{LAST}: " in err and reason in err, err
    assert "resuming from checkpoints/step_0000006 (step 6)" in err
    start = records(run, "start")[-1]
    assert start["resumed_from"].endswith("step_0000006") and len(start["resume_notes"]) == 2
    assert checkpoint_names(run) == ["latest", "step_0000004", "step_0000006", LAST]   # nothing good was pruned
    resumed = ckpt_io.load_checkpoint(run)
    assert resumed.meta["step"] == 8 and resumed.notes == []
    for key, value in straight["final"].items():
        assert torch.equal(resumed.weights[key], value), key
    assert {r["step"]: r["loss"] for r in records(run, "train")} == straight["losses"]
    assert [r["step"] for r in records(run, "train")] == list(range(1, 9))


@pytest.mark.parametrize("damage", ["model_flipped", "optimizer_truncated", "meta_truncated", "manifest_truncated",
                                    "manifest_deleted"])
def test_a_damaged_checkpoint_named_explicitly_is_refused(run, tmp_path, capsys, damage):
    name, harm, reason = DAMAGE[damage]
    ckpt = run / "checkpoints" / LAST
    harm(ckpt / name)
    err = _refused(capsys, tmp_path, "--out", str(tmp_path / "fork"), "--resume", str(ckpt))
    assert f"{ckpt / name} " in err and reason in err, err


@pytest.mark.parametrize("content, reason", [
    (b"\xff\xfe\x00garbage", "cannot be read as text"),
    (b"", "holds '', not a checkpoint folder name"),
    (b"step_00", "holds 'step_00', not a checkpoint folder name"),
    (b"step_0000009\n", "names step_0000009, which does not exist"),
    (None, "latest is missing"),
], ids=["binary", "empty", "truncated", "names_a_missing_step", "missing"])
def test_a_broken_latest_falls_back_to_the_newest_intact_checkpoint(run, capsys, content, reason):
    latest = run / "checkpoints" / "latest"
    latest.unlink() if content is None else latest.write_bytes(content)
    capsys.readouterr()
    assert run_fast("--out", str(run), "--resume", str(run)) == 0
    err = capsys.readouterr().err
    assert reason in err and f"resuming from checkpoints/{LAST} (step 8)" in err, err
    assert records(run, "start")[-1]["resumed_from"].endswith(LAST)
    assert [r["step"] for r in records(run, "eval")] == [8]            # the finished run is not evaluated twice


@pytest.mark.parametrize("kind", ["absolute_other_run", "absolute_own", "escaping", "subfolder"])
def test_latest_holding_a_path_is_refused(run, tmp_path, straight, capsys, kind):
    """The probe's case: latest held an absolute path and the resume continued another run's checkpoint."""
    other = tmp_path / "other"
    shutil.copytree(straight["out"], other)
    target = {"absolute_other_run": str(other / "checkpoints" / LAST),
              "absolute_own": str(run / "checkpoints" / LAST),
              "escaping": f"../../other/checkpoints/{LAST}",
              "subfolder": f"old/{LAST}"}[kind]
    (run / "checkpoints" / "latest").write_text(target + "\n")
    err = _refused(capsys, tmp_path, "--out", str(run), "--resume", str(run))
    assert f"{run / 'checkpoints' / 'latest'} holds {target!r}, a path" in err
    assert "must hold the name of a checkpoint folder" in err


def test_a_checkpoint_folder_linking_outside_the_run_is_refused(run, tmp_path, straight, capsys):
    other = tmp_path / "other"
    shutil.copytree(straight["out"], other)
    (run / "checkpoints" / "step_0000009").symlink_to(other / "checkpoints" / LAST)
    (run / "checkpoints" / "latest").write_text("step_0000009\n")
    err = _refused(capsys, tmp_path, "--out", str(run), "--resume", str(run))
    assert "step_0000009 (named by" in err and "outside" in err


def test_a_run_without_an_intact_checkpoint_is_refused(run, tmp_path, capsys):
    flip_bytes(run / "checkpoints" / LAST / "model.safetensors")
    truncate(run / "checkpoints" / "step_0000006" / "optimizer.pt")
    (run / "checkpoints" / "step_0000004" / "manifest.json").unlink()
    err = _refused(capsys, tmp_path, "--out", str(run), "--resume", str(run))
    assert f"no intact checkpoint in {run / 'checkpoints'}" in err
    for ckpt, reason in ((LAST, "model.safetensors has sha256"), ("step_0000006", "optimizer.pt holds"),
                         ("step_0000004", "manifest.json is missing")):
        assert f"skipped checkpoints/{ckpt}: " in err and reason in err, (ckpt, err)


def _no_rng(meta):
    del meta["rng"]


def _short_cpu_rng(meta):
    meta["rng"]["torch_cpu"] = "AAAA"


def _bad_python_rng(meta):
    meta["rng"]["python"] = [3, [1, 2], None]


def _no_run_config(meta):
    del meta["run_config"]


def _other_format(meta):
    meta["format"] = "someone.else/9"


def _other_step(meta):
    meta["step"] = 7


@pytest.mark.parametrize("edit, reason", [
    (_no_rng, "meta.json: no 'rng' entry"),
    (_short_cpu_rng, "'rng.torch_cpu' must be the base64 of a 5056-byte torch CPU generator state"),
    (_bad_python_rng, "'rng.python' is not a Python random.getstate() value"),
    (_no_run_config, "meta.json: no 'run_config' object"),
    (_other_format, "has checkpoint format 'someone.else/9', expected 'dsv4attn.train.checkpoint/2'"),
    (_other_step, "meta.json says step 7, its manifest step 8"),
], ids=["no_rng", "short_cpu_rng", "bad_python_rng", "no_run_config", "other_format", "step_mismatch"])
def test_meta_without_what_a_resume_needs_is_refused(run, tmp_path, capsys, edit, reason):
    """Contents checked even when the checksums agree (a hand-edited checkpoint, resealed)."""
    ckpt = run / "checkpoints" / LAST
    _edit_json(ckpt / "meta.json", edit)
    _reseal(ckpt)
    err = _refused(capsys, tmp_path, "--out", str(tmp_path / "fork"), "--resume", str(ckpt))
    assert str(ckpt / "meta.json") in err and reason in err, err


def test_weights_that_do_not_fit_the_model_are_refused(run, tmp_path, capsys):
    ckpt = run / "checkpoints" / LAST
    weights = load_file(str(ckpt / "model.safetensors"))
    weights["extra.weight"] = torch.zeros(2)
    weights["embed.weight"] = weights["embed.weight"][:-1].contiguous()
    save_file(weights, str(ckpt / "model.safetensors"))
    _reseal(ckpt)
    err = _refused(capsys, tmp_path, "--out", str(tmp_path / "fork"), "--resume", str(ckpt))
    assert f"{ckpt / 'model.safetensors'} does not fit the model" in err
    assert "unexpected ['extra.weight']" in err and "embed.weight" in err


def _make_legacy(ckpt: Path) -> None:
    """The layout written before manifests: format 1, no manifest.json."""
    (ckpt / "manifest.json").unlink()
    _edit_json(ckpt / "meta.json", lambda m: m.update(format=ckpt_io.LEGACY_FORMAT))


def test_a_legacy_checkpoint_resumes_with_a_warning(run, tmp_path, straight, capsys):
    ckpt = run / "checkpoints" / "step_0000006"
    _make_legacy(ckpt)
    fork = tmp_path / "fork"
    capsys.readouterr()
    assert run_fast("--out", str(fork), "--resume", str(ckpt)) == 0
    assert "written by an older dsv4attn" in capsys.readouterr().err
    for key, value in load_file(str(fork / "checkpoints" / LAST / "model.safetensors")).items():
        assert torch.equal(value, straight["final"][key]), key


@pytest.mark.parametrize("name, harm, reason", [
    ("model.safetensors", truncate, "model.safetensors is not a readable safetensors file"),
    ("optimizer.pt", truncate, "optimizer.pt is not a readable torch optimizer state"),
    ("meta.json", truncate, "meta.json is not valid JSON"),
    ("meta.json", lambda p: _edit_json(p, _no_rng), "meta.json: no 'rng' entry"),
], ids=["model_truncated", "optimizer_truncated", "meta_truncated", "meta_without_rng"])
def test_a_damaged_legacy_checkpoint_is_refused(run, tmp_path, capsys, name, harm, reason):
    """No checksums to catch it: the readers' own failures become the clear error (they were raw tracebacks)."""
    ckpt = run / "checkpoints" / LAST
    _make_legacy(ckpt)
    harm(ckpt / name)
    err = _refused(capsys, tmp_path, "--out", str(tmp_path / "fork"), "--resume", str(ckpt))
    assert str(ckpt / name) in err and reason in err, err


def test_a_run_left_broken_by_the_old_save_resumes(run, straight, capsys):
    """What the save before manifests left when killed between its two renames while saving step 8 again: latest
    names step_0000008, the old copy sits in .step_0000008.old-PID and the new one in .step_0000008.tmp-PID."""
    root = run / "checkpoints"
    _make_legacy(root / LAST)
    shutil.copytree(root / LAST, root / ".step_0000008.tmp-4242")
    os.replace(root / LAST, root / ".step_0000008.old-4242")
    capsys.readouterr()
    assert run_fast("--out", str(run), "--resume", str(run)) == 0
    err = capsys.readouterr().err
    assert "names step_0000008, which does not exist" in err
    assert "resuming from checkpoints/.step_0000008.old-4242" in err
    assert "written by an older dsv4attn" in err
    assert run_fast("--out", str(run), "--resume", str(root / "step_0000006")) == 0    # a save: puts it back
    assert checkpoint_names(run) == ["latest", "step_0000004", "step_0000006", LAST]
    for key, value in load_file(str(root / LAST / "model.safetensors")).items():
        assert torch.equal(value, straight["final"][key]), key


def test_fallback_never_follows_a_link_out_of_the_run(run, tmp_path, straight, capsys):
    other = tmp_path / "other"
    shutil.copytree(straight["out"], other)
    (run / "checkpoints" / "step_0000009").symlink_to(other / "checkpoints" / LAST)
    (run / "checkpoints" / "latest").unlink()
    capsys.readouterr()
    assert run_fast("--out", str(run), "--resume", str(run)) == 0
    err = capsys.readouterr().err
    assert "skipped checkpoints/step_0000009: it links to" in err and f"resuming from checkpoints/{LAST}" in err

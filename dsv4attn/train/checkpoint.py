"""Checkpoints of a training run: safetensors weights, optimizer state, JSON metadata and a manifest of checksums,
saved so that no crash can lose the last good checkpoint, and checked on load so that a damaged one is never used.

Layout of a run directory::

    OUT/checkpoints/step_0000200/model.safetensors   model weights (safetensors: no code runs on load)
                                /optimizer.pt        AdamW state_dict, loaded with torch.load(weights_only=True)
                                /meta.json           run config, model config, step, phase, data position, RNG
                                /manifest.json       byte count and sha256 of the three files above (written last)
    OUT/checkpoints/latest                           folder name of the newest complete checkpoint, e.g. step_0000200

Saving (:func:`save_checkpoint`, rank 0), in this order, each step durable (fsync) before the next:

1. the three files go into a hidden folder ``.step_N.tmp-ID``, each flushed, fsync'd, read back and compared with
   the sha256 of the bytes meant for it; then ``manifest.json``; a folder holding a manifest is complete;
2. a ``step_N`` that exists already (a resumed run saving a step again) is renamed ``.step_N.old-ID``;
3. the new folder is renamed ``step_N``;
4. ``latest`` is replaced atomically (temporary sibling, fsync, ``os.replace``);
5. only then are the moved-aside copy, the checkpoints older than step N beyond ``keep`` and every leftover of an
   earlier crashed save removed (each renamed ``.step_M.del-ID`` first: a half-deleted folder is never taken for
   a checkpoint).

A kill at any instant leaves ``latest`` naming a complete checkpoint, except between 2 and 3, where it names
``step_N`` while the previous copy of step N waits complete in ``.step_N.old-ID``: :func:`load_checkpoint` takes
that copy, and the next save puts it back under its name before doing anything else.

Loading (:func:`load_checkpoint`, before the run writes anything): every file is checked against the manifest (size,
then sha256) and meta.json against what a resume needs; a resume of a run directory whose latest checkpoint is
missing or damaged falls back to the newest intact one and reports each checkpoint it skipped and why. ``latest``
must hold the plain name of a folder of ``checkpoints/``: an absolute or escaping path is refused. A checkpoint of
the format before manifests (``dsv4attn.train.checkpoint/1``) still loads, unverified, with a warning; a file its
readers reject is a clear error too. Every file holds tensors and plain data only.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

FORMAT = "dsv4attn.train.checkpoint/2"
LEGACY_FORMAT = "dsv4attn.train.checkpoint/1"      # no manifest: loaded unverified, with a warning
LATEST = "latest"
MANIFEST = "manifest.json"
FILES = ("model.safetensors", "optimizer.pt", "meta.json")
STEP_NAME = re.compile(r"step_(\d{7,})")
# Hidden entries of checkpoints/ that saves write: folders being written (tmp), previous copies of a step being
# replaced (old), folders being deleted (del), and the temporary sibling of latest. The ID is "pid-random" in hex;
# a lone decimal pid is what saves wrote before manifests (their moved-aside copies are restored too).
HIDDEN_NAME = re.compile(r"\.(step_\d{7,})\.(tmp|old|del)-[0-9a-f]+(?:-[0-9a-f]+)?")
LATEST_TMP = re.compile(r"\.latest\.tmp-\d+")
# The points of the save protocol, in order (see _protocol_step).
SAVE_POINTS = ("wrote model.safetensors", "wrote optimizer.pt", "wrote meta.json", "wrote manifest.json",
               "moved the old copy aside", "installed", "wrote latest's temporary", "replaced latest",
               "removed the old copy", "pruned", "cleaned up")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used or saved; the message names the file and what was expected."""


def _protocol_step(point: str) -> None:
    """Called after each step of the save protocol (``SAVE_POINTS``); a no-op. The fault tests replace it to stop
    a save dead at that point, as a kill would."""


def step_name(step: int) -> str:
    return f"step_{step:07d}"


# ----------------------------------------------------------------------------------------------- durable writes

def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _atomic_write(path: Path, data: bytes, point: str | None = None) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _write_durably(tmp, data)
    if point:
        _protocol_step(point)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and ``os.replace`` (atomic on POSIX), durably."""
    _atomic_write(path, text.encode("utf-8"))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_bytes(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e.strerror or e}") from None


# ------------------------------------------------------------------------------------------------------ RNG state

def rng_state() -> dict:
    """Torch (CPU and every CUDA device) and Python RNG states, JSON-serialisable."""
    b64 = lambda t: base64.b64encode(t.numpy().tobytes()).decode("ascii")  # noqa: E731
    state = {"torch_cpu": b64(torch.get_rng_state()), "python": _jsonable(random.getstate())}
    if torch.cuda.is_available():
        state["torch_cuda"] = [b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    random.setstate(_tupled(state["python"]))
    if torch.cuda.is_available() and "torch_cuda" in state:
        cuda_states = [_unb64(s) for s in state["torch_cuda"]]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def _check_rng(where: Path, state) -> None:
    """Raise CheckpointError unless ``state`` is an RNG state :func:`set_rng_state` accepts (checked on copies)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: no 'rng' entry (the RNG states a bit-exact resume restores)")
    cpu_bytes = torch.get_rng_state().numel()
    try:
        ok = isinstance(state["torch_cpu"], str) and _unb64(state["torch_cpu"]).numel() == cpu_bytes
    except (KeyError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{where}: 'rng.torch_cpu' must be the base64 of a {cpu_bytes}-byte torch CPU "
                              f"generator state")
    try:
        random.Random().setstate(_tupled(state["python"]))
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{where}: 'rng.python' is not a Python random.getstate() value") from None
    cuda = state.get("torch_cuda", [])
    try:
        ok = isinstance(cuda, list) and all(isinstance(s, str) and _unb64(s).numel() > 0 for s in cuda)
    except ValueError:
        ok = False
    if not ok:
        raise CheckpointError(f"{where}: 'rng.torch_cuda' must be a list of base64 CUDA generator states")


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, tuple) else x


def _tupled(x):
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x


# --------------------------------------------------------------------------------------------------------- saving

def _manifest(step: int, blobs: dict[str, bytes]) -> dict:
    body = {"format": FORMAT, "step": step,
            "files": {name: {"bytes": len(data), "sha256": _sha256(data)} for name, data in blobs.items()}}
    return {**body, "manifest_sha256": _body_digest(body)}


def _body_digest(body: dict) -> str:
    return _sha256(json.dumps(body, sort_keys=True).encode("utf-8"))


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save_checkpoint(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
                    keep: int, *, weights: dict | None = None, optimizer_state: dict | None = None) -> Path:
    """Save ``checkpoints/step_<meta['step']>`` by the protocol of the module docstring, point ``latest`` at it,
    then remove the moved-aside copy, the older checkpoints beyond the newest ``keep`` and any crash leftovers.
    ``weights`` / ``optimizer_state``: the full state dicts to write instead of ``model.state_dict()`` /
    ``optimizer.state_dict()`` (an FSDP2 model's, gathered by :mod:`dsv4attn.parallel.fsdp` on every rank).

    Raises CheckpointError if a file reads back different from what was written or the file system fails (a full
    disk): ``latest`` then still names the last checkpoint saved completely."""
    root = Path(run_dir) / "checkpoints"
    final = root / step_name(meta["step"])
    try:
        return _save(root, final, model.state_dict() if weights is None else weights,
                     optimizer.state_dict() if optimizer_state is None else optimizer_state, meta, keep)
    except OSError as e:
        raise CheckpointError(f"saving {final} failed: {e}; {root / LATEST} names the last checkpoint saved "
                              f"completely") from None


def _save(root: Path, final: Path, weights: dict, optimizer_state: dict, meta: dict, keep: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    _restore_moved_aside(root)
    step = meta["step"]
    tag = _tag()
    tmp = root / f".{final.name}.tmp-{tag}"
    tmp.mkdir()
    # safetensors refuses shared or non-contiguous storage: give it plain contiguous copies.
    weights = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    blobs = {"model.safetensors": save_safetensors(weights), "optimizer.pt": _torch_bytes(optimizer_state),
             "meta.json": json.dumps({"format": FORMAT, **meta}, indent=1).encode("utf-8")}
    manifest = _manifest(step, blobs)
    for name, data in blobs.items():
        _write_durably(tmp / name, data)
        _protocol_step(f"wrote {name}")
    for name in FILES:                      # read back: a short write or a faulty file system shows here
        want, got = manifest["files"][name]["sha256"], _sha256(_read_bytes(tmp / name))
        if got != want:
            raise CheckpointError(f"saving {final}: {tmp / name} reads back with sha256 {got}, but {want} was "
                                  f"written; {LATEST} still names the previous checkpoint")
    _write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1).encode("utf-8"))
    _fsync_dir(tmp)
    _protocol_step("wrote manifest.json")
    old = None
    if final.exists() or final.is_symlink():   # a resumed run saves this step again: keep the old copy aside
        old = root / f".{final.name}.old-{tag}"
        os.replace(final, old)
        _fsync_dir(root)
        _protocol_step("moved the old copy aside")
    os.replace(tmp, final)
    _fsync_dir(root)
    _protocol_step("installed")
    _atomic_write(root / LATEST, (final.name + "\n").encode("utf-8"), point="wrote latest's temporary")
    _protocol_step("replaced latest")
    if old is not None:
        _discard(root, old)
        _protocol_step("removed the old copy")
    _prune(root, step, keep)
    _protocol_step("pruned")
    for p in _leftovers(root):
        _discard(root, p)
    _protocol_step("cleaned up")
    return final


def _tag() -> str:
    return f"{os.getpid():x}-{os.urandom(3).hex()}"


def _visible(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step_N`` folder of ``root``, oldest first."""
    found = []
    for p in root.iterdir():
        m = STEP_NAME.fullmatch(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _hidden(root: Path, kind: str) -> list[tuple[str, Path]]:
    """(step folder name, path) of the hidden folders of ``kind`` (tmp, old, del) in ``root``."""
    found = []
    for p in root.iterdir():
        m = HIDDEN_NAME.fullmatch(p.name)
        if m and m.group(2) == kind:
            found.append((m.group(1), p))
    return sorted(found)


def _leftovers(root: Path) -> list[Path]:
    return [p for p in sorted(root.iterdir()) if HIDDEN_NAME.fullmatch(p.name) or LATEST_TMP.fullmatch(p.name)]


def _discard(root: Path, path: Path) -> None:
    """Remove a folder (or file) of ``root``; a checkpoint folder is renamed ``.step_N.del-ID`` first, so that a
    deletion cut short leaves a hidden leftover (removed by the next save), never a half-empty checkpoint."""
    visible, hidden = STEP_NAME.fullmatch(path.name), HIDDEN_NAME.fullmatch(path.name)
    try:
        if visible or (hidden and hidden.group(2) != "del"):
            doomed = root / f".{visible.group(0) if visible else hidden.group(1)}.del-{_tag()}"
            os.replace(path, doomed)
            path = doomed
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass                # the new checkpoint is saved: what resists removal is retried by the next save


def _prune(root: Path, step: int, keep: int) -> None:
    """Keep step ``step`` and the ``keep - 1`` newest checkpoints before it. Checkpoints past it (written by an
    earlier session of a run resumed from an older checkpoint) stay until the run saves those steps again."""
    older = [p for s, p in _visible(root) if s < step]
    for p in older[:max(len(older) - (keep - 1), 0)]:
        _discard(root, p)


def _restore_moved_aside(root: Path) -> None:
    """Put back under its name a checkpoint that a killed save had moved aside (step 2 of the protocol) before the
    new copy took its place: it is the run's state at that step, the one ``latest`` may name."""
    visible = {p.name for _, p in _visible(root)}
    for name, p in _hidden(root, "old"):
        if name in visible:
            continue
        try:
            _open(p)
        except CheckpointError:
            continue                # damaged: left for the clean-up at the end of this save
        os.replace(p, root / name)
        _fsync_dir(root)
        visible.add(name)


# -------------------------------------------------------------------------------------------------------- loading

@dataclass
class Loaded:
    """A checkpoint checked and read into memory (CPU tensors); ``notes`` are the warnings to show (checkpoints
    skipped and why, an unverified legacy checkpoint)."""
    path: Path
    meta: dict
    weights: dict
    optimizer_state: dict
    notes: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        """The run directory the checkpoint belongs to (``RUN/checkpoints/step_N``)."""
        return self.path.parent.parent


def _read_json(path: Path, data: bytes | None = None) -> dict:
    data = _read_bytes(path) if data is None else data
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not UTF-8 JSON (corrupted)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON (truncated or corrupted?): {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(value).__name__}")
    return value


def _check_manifest(path: Path, manifest: dict) -> None:
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if manifest.get("manifest_sha256") != _body_digest(body):
        raise CheckpointError(f"{path} does not match its own checksum 'manifest_sha256' (the manifest is "
                              f"corrupted)")
    files = manifest.get("files")
    for name in FILES:
        entry = files.get(name) if isinstance(files, dict) else None
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str)):
            raise CheckpointError(f"{path} does not record the size and sha256 of {name}")


def _check_meta(path: Path, meta: dict, step: int | None) -> None:
    if meta.get("format") not in (FORMAT, LEGACY_FORMAT):
        raise CheckpointError(f"{path} has checkpoint format {meta.get('format')!r}, expected {FORMAT!r}")
    s = meta.get("step")
    if isinstance(s, bool) or not isinstance(s, int) or s < 0:
        raise CheckpointError(f"{path}: 'step' must be an int >= 0, found {s!r}")
    if step is not None and s != step:
        raise CheckpointError(f"{path} says step {s}, its manifest step {step}")
    if not isinstance(meta.get("run_config"), dict):
        raise CheckpointError(f"{path}: no 'run_config' object (the options the resume is checked against)")
    w = meta.get("world_size", 1)
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise CheckpointError(f"{path}: 'world_size' must be an int >= 1, found {w!r}")
    _check_rng(path, meta.get("rng"))


def _open(ckpt: Path) -> Loaded:
    """Check and read one checkpoint folder; CheckpointError names the first file that is missing or damaged."""
    ckpt = Path(ckpt)
    notes = []
    if (ckpt / MANIFEST).exists() or not (ckpt / "meta.json").is_file():
        manifest = _read_json(ckpt / MANIFEST)
        _check_manifest(ckpt / MANIFEST, manifest)
        blobs = {}
        for name in FILES:
            data, want = _read_bytes(ckpt / name), manifest["files"][name]
            if len(data) != want["bytes"]:
                raise CheckpointError(f"{ckpt / name} holds {len(data)} bytes, its manifest records "
                                      f"{want['bytes']} (truncated or replaced)")
            if _sha256(data) != want["sha256"]:
                raise CheckpointError(f"{ckpt / name} has sha256 {_sha256(data)}, its manifest records "
                                      f"{want['sha256']} (the file is corrupted)")
            blobs[name] = data
        meta = _read_json(ckpt / "meta.json", blobs["meta.json"])
        _check_meta(ckpt / "meta.json", meta, manifest["step"])
    else:
        meta = _read_json(ckpt / "meta.json")
        if meta.get("format") != LEGACY_FORMAT:
            raise CheckpointError(f"{ckpt / MANIFEST} is missing (a checkpoint of format {FORMAT!r} lists the "
                                  f"checksums of its files there)")
        _check_meta(ckpt / "meta.json", meta, None)
        blobs = {name: _read_bytes(ckpt / name) for name in FILES[:2]}
        notes.append(f"{ckpt} was written by an older dsv4attn (format {LEGACY_FORMAT!r}, no {MANIFEST}): its "
                     f"files cannot be verified")
    try:
        weights = load_safetensors(blobs["model.safetensors"])
    except Exception as e:          # noqa: BLE001 -- whatever the parser says, the file is the problem
        raise CheckpointError(f"{ckpt / 'model.safetensors'} is not a readable safetensors file: {e}") from None
    try:
        opt = torch.load(io.BytesIO(blobs["optimizer.pt"]), map_location="cpu", weights_only=True)
    except Exception as e:          # noqa: BLE001
        raise CheckpointError(f"{ckpt / 'optimizer.pt'} is not a readable torch optimizer state: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not (isinstance(opt, dict) and isinstance(opt.get("state"), dict)
            and isinstance(opt.get("param_groups"), list)):
        raise CheckpointError(f"{ckpt / 'optimizer.pt'} does not hold an optimizer state_dict ('state', "
                              f"'param_groups')")
    return Loaded(ckpt, meta, weights, opt, notes)


def is_checkpoint_dir(p: Path) -> bool:
    """Whether ``p`` looks like a checkpoint folder (a manifest or a meta file)."""
    return (p / MANIFEST).is_file() or (p / "meta.json").is_file()


def load_checkpoint(path: str | os.PathLike) -> Loaded:
    """The checkpoint named by ``--resume PATH``, checked and read: a checkpoint folder (used as it is, or a clear
    error), or a run directory: the checkpoint its ``latest`` names, else the newest intact one (notes say which
    were skipped and why)."""
    p = Path(path)
    if is_checkpoint_dir(p):
        return _open(p)
    root = p / "checkpoints"
    if not root.is_dir():
        if not p.exists():
            raise FileNotFoundError(f"--resume: {p} does not exist")
        raise FileNotFoundError(f"--resume: {p} is neither a checkpoint directory (with {MANIFEST}) nor a run "
                                f"directory with checkpoints/")
    skipped: list[str] = []
    first = _latest_target(root, skipped)
    for cand in _candidates(root, first):
        if cand.is_symlink() and cand.resolve().parent != root.resolve():
            skipped.append(f"skipped {cand.relative_to(p)}: it links to {cand.resolve()}, outside {root}")
            continue
        try:
            loaded = _open(cand)
        except CheckpointError as e:
            skipped.append(f"skipped {cand.relative_to(p)}: {e}")
            continue
        if skipped:
            skipped.append(f"resuming from {cand.relative_to(p)} (step {loaded.meta['step']})")
        loaded.notes[:0] = skipped
        return loaded
    detail = "".join(f"\n  {s}" for s in skipped)
    raise CheckpointError(f"--resume {p}: no intact checkpoint in {root} (nothing was written):{detail}")


def _latest_target(root: Path, skipped: list[str]) -> str | None:
    """The folder name ``latest`` holds, if it names a folder; None (with the reason in ``skipped``) if it is
    missing, unreadable or names nothing; CheckpointError if it holds a path rather than a name."""
    f = root / LATEST
    if not f.is_file():
        skipped.append(f"{f} is missing" if not f.exists() else f"{f} is not a file")
        return None
    try:
        name = f.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        skipped.append(f"{f} cannot be read as text ({e})")
        return None
    if (os.path.isabs(name) or "/" in name or "\\" in name or name in (".", "..")
            or os.path.splitdrive(name)[0]):
        raise CheckpointError(f"{f} holds {name!r}, a path: it must hold the name of a checkpoint folder of "
                              f"{root} (such as step_0000200), so that a run never resumes another run's "
                              f"checkpoint; fix it or pass --resume a checkpoint folder (nothing was written)")
    if not STEP_NAME.fullmatch(name):
        skipped.append(f"{f} holds {name!r}, not a checkpoint folder name (step_NNNNNNN)")
        return None
    target = root / name
    if target.is_symlink() and target.resolve().parent != root.resolve():
        raise CheckpointError(f"{target} (named by {f}) links to {target.resolve()}, outside {root}: a run "
                              f"resumes its own checkpoints only (nothing was written)")
    if not target.exists():
        skipped.append(f"{f} names {name}, which does not exist (a save cut short?)")
    elif not target.is_dir():
        skipped.append(f"{f} names {name}, which is not a folder")
    return name


def _candidates(root: Path, first: str | None) -> list[Path]:
    """Checkpoint folders to try, in order: the one ``latest`` names, then every step newest first; after each
    step's folder, the copies of that step that a killed save moved aside."""
    by_step: dict[int, list[Path]] = {}
    for s, p in _visible(root):
        by_step.setdefault(s, []).append(p)
    for name, p in _hidden(root, "old"):
        by_step.setdefault(int(STEP_NAME.fullmatch(name).group(1)), []).append(p)
    order = sorted(by_step, reverse=True)
    if first is not None:
        s = int(STEP_NAME.fullmatch(first).group(1))
        if s in by_step:
            order.remove(s)
            order.insert(0, s)
    return [p for s in order for p in by_step[s]]


def load_into(loaded: Loaded, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the checkpoint's weights (strict: names and shapes must match) and optimizer state into the model's
    device."""
    model_file, opt_file = loaded.path / "model.safetensors", loaded.path / "optimizer.pt"
    own = model.state_dict()
    missing = sorted(set(own) - set(loaded.weights))
    unexpected = sorted(set(loaded.weights) - set(own))
    shapes = [f"{k}: {tuple(v.shape)}, model {tuple(own[k].shape)}" for k, v in loaded.weights.items()
              if k in own and v.shape != own[k].shape]
    if missing or unexpected or shapes:
        raise CheckpointError(f"{model_file} does not fit the model: missing {missing}, unexpected {unexpected}, "
                              f"other shapes {shapes}")
    from ..layers.common import is_sharded
    sharded = any(is_sharded(v) for v in own.values())
    if sharded:             # FSDP2: every rank read the full files; each keeps its shards
        from ..parallel.fsdp import load_full_optimizer_state_dict, load_full_state_dict
        load_full_state_dict(model, loaded.weights)
    else:
        model.load_state_dict(loaded.weights)
    try:
        if sharded:
            load_full_optimizer_state_dict(optimizer, loaded.optimizer_state)
        else:
            optimizer.load_state_dict(loaded.optimizer_state)
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{opt_file} does not fit the optimizer: {e}") from None


# ---------------------------------------------------------------------------------------------- run folder files

TRAINER_ENTRY = re.compile(rf"latest|{LATEST_TMP.pattern}|{STEP_NAME.pattern}|{HIDDEN_NAME.pattern}")


def foreign_entries(root: Path) -> list[Path]:
    """Entries of a ``checkpoints/`` folder that no save wrote (to refuse deleting them): anything but ``latest``,
    its temporary, checkpoint folders and save leftovers holding checkpoint files only."""
    foreign = []
    allowed = set(FILES) | {MANIFEST}
    for p in sorted(Path(root).iterdir()):
        if not TRAINER_ENTRY.fullmatch(p.name) or p.is_symlink():
            foreign.append(p)
        elif p.name.startswith(("latest", ".latest")):
            if not p.is_file():
                foreign.append(p)
        elif not p.is_dir():
            foreign.append(p)
        else:
            foreign.extend(q for q in sorted(p.iterdir()) if q.name not in allowed or not q.is_file()
                           or q.is_symlink())
    return foreign

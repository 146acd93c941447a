"""Checkpoints of a training run: safetensors weights, optimizer state, JSON metadata; atomic writes.

Layout of a run directory::

    OUT/checkpoints/step_0000200/model.safetensors   model weights (safetensors: no code runs on load)
                                /optimizer.pt        AdamW state_dict, loaded with torch.load(weights_only=True)
                                /meta.json           run config, model config, step, phase, data position, RNG
    OUT/checkpoints/latest                           name of the newest complete checkpoint

A checkpoint directory is written under a temporary name and renamed into place (``os.replace``), and ``latest``
is replaced the same way, so a crash at any moment leaves either the previous state or the new one, never a torn
checkpoint. Every file holds tensors and plain data only.
"""
from __future__ import annotations

import base64
import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMAT = "dsv4attn.train.checkpoint/1"
LATEST = "latest"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and ``os.replace`` (atomic on POSIX)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    """Torch (CPU and every CUDA device) and Python RNG states, JSON-serialisable."""
    b64 = lambda t: base64.b64encode(t.numpy().tobytes()).decode("ascii")  # noqa: E731
    state = {"torch_cpu": b64(torch.get_rng_state()), "python": _jsonable(random.getstate())}
    if torch.cuda.is_available():
        state["torch_cuda"] = [b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    unb64 = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(unb64(state["torch_cpu"]))
    random.setstate(_tupled(state["python"]))
    if torch.cuda.is_available() and "torch_cuda" in state:
        cuda_states = [unb64(s) for s in state["torch_cuda"]]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def save_checkpoint(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
                    keep: int) -> Path:
    """Write ``checkpoints/step_<meta['step']>`` atomically, point ``latest`` at it, keep the newest ``keep``."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{meta['step']:07d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    # safetensors refuses shared or non-contiguous storage: give it plain contiguous copies.
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(weights, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    with open(tmp / "meta.json", "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, **meta}, f, indent=1)
    for name in ("model.safetensors", "optimizer.pt", "meta.json"):
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    old = None
    if final.exists():                      # re-saving a step (a resumed run): swap, then drop the old one
        old = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old)
    atomic_write_text(root / LATEST, final.name + "\n")
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for p in done[:-keep]:
        shutil.rmtree(p)


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint named by ``--resume PATH``: a checkpoint directory, or a run directory (its latest)."""
    p = Path(path)
    if (p / "meta.json").is_file():
        return p
    latest = p / "checkpoints" / LATEST
    if latest.is_file():
        ckpt = p / "checkpoints" / latest.read_text(encoding="utf-8").strip()
        if (ckpt / "meta.json").is_file():
            return ckpt
    if not p.exists():
        raise FileNotFoundError(f"--resume: {p} does not exist")
    raise FileNotFoundError(f"--resume: {p} is neither a checkpoint directory (with meta.json) nor a run "
                            f"directory with checkpoints/{LATEST}")


def read_meta(ckpt: Path) -> dict:
    with open(Path(ckpt) / "meta.json", encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"--resume: {ckpt} has checkpoint format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def load_weights(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load weights (strict: names and shapes must match) and optimizer state into existing objects."""
    device = next(model.parameters()).device
    weights = load_file(str(Path(ckpt) / "model.safetensors"), device=str(device))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"--resume: {ckpt} does not fit the model: missing {missing}, unexpected {unexpected}")
    state = torch.load(Path(ckpt) / "optimizer.pt", map_location=device, weights_only=True)
    optimizer.load_state_dict(state)


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, tuple) else x


def _tupled(x):
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x

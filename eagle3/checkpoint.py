"""Training checkpoints: written whole or not at all, found again after a crash.

    <root>/step-000120/
        model.safetensors   the draft's weights (fp32 master copy)
        state.pt            optimizer state, scheduler step, RNG states (as tensors) and
                            data position; plain tensors/ints/lists/dicts only, so that
                            it loads with torch.load(weights_only=True)
        meta.json           step, sizes and sha256 of the two files, the configs

A checkpoint is assembled in a temporary sibling folder, fsynced, then renamed into
place, so a folder named step-XXXXXX is complete unless the disk itself lost data;
meta.json's checksums catch that too. Only the newest `keep` checkpoints are kept, plus
the ones named in `protect` (the trainer protects the best one by held-out acceptance).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3.store import sha256_file

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
STATE = "state.pt"
META = "meta.json"
FORMAT_VERSION = 1
_NAME = re.compile(r"^step-(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint folder is incomplete or corrupt."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint. `state` is what the trainer saved (see train.py), `meta` its configs."""

    path: Path
    step: int
    weights: dict[str, torch.Tensor]
    state: dict[str, object]
    meta: dict[str, object]


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    state: dict[str, object],
    meta: dict[str, object],
    *,
    keep: int = 2,
    protect: Collection[str] = (),
) -> Path:
    """Write checkpoint `step` under `root` atomically, then prune to the newest `keep` (and `protect`ed names)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / WEIGHTS))
    torch.save(state, tmp / STATE)
    files = {}
    for name in (WEIGHTS, STATE):
        _fsync(tmp / name)
        files[name] = {"size": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
    record = {"format_version": FORMAT_VERSION, "step": step, "files": files} | meta
    (tmp / META).write_text(json.dumps(record, indent=1))
    _fsync(tmp / META)
    _fsync(tmp)
    if final.exists():  # the same step again (a rerun): move the old one aside first
        old = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        shutil.rmtree(old)
    os.replace(tmp, final)
    _fsync(root)
    for stale in list_checkpoints(root)[:-keep]:
        if stale.name not in protect:
            shutil.rmtree(stale)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under `root` (complete or not), oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: Path) -> Checkpoint:
    """Load and verify one checkpoint; CheckpointError names what is wrong."""
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable {META} ({err})") from err
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: format_version {meta.get('format_version')}, expected {FORMAT_VERSION}"
        )
    for name, want in meta.get("files", {}).items():
        file = path / name
        if not file.is_file() or file.stat().st_size != want["size"] or sha256_file(file) != want["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} is missing or does not match its size/sha256")
    try:
        weights = load_file(str(path / WEIGHTS))
        state = torch.load(path / STATE, weights_only=True)
    except Exception as err:  # a file that passed its checksum but still fails to parse
        raise CheckpointError(f"checkpoint {path}: cannot be loaded ({type(err).__name__}: {err})") from err
    return Checkpoint(path=path, step=int(meta["step"]), weights=weights, state=state, meta=meta)


def latest_valid_checkpoint(root: Path) -> Checkpoint | None:
    """The newest checkpoint under `root` that loads and verifies; broken ones are skipped with a warning."""
    for path in reversed(list_checkpoints(root)):
        try:
            return load_checkpoint(path)
        except CheckpointError as err:
            log.warning("skipping checkpoint: %s", err)
    return None


def clean_temporaries(root: Path) -> None:
    """Remove half-written checkpoint folders left by a killed run."""
    root = Path(root)
    if root.is_dir():
        for tmp in root.glob(".step-*.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)

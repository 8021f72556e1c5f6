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

import hashlib
import io
import json
import logging
import os
import re
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from eagle3.artifacts import fsync_path, sha256_file

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
    try:
        _write_folder(tmp, step, weights, state, meta)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind, under any name
        if isinstance(err, OSError):
            raise CheckpointError(
                f"writing checkpoint {final} failed ({err.strerror or err}); nothing was written under that name and "
                f"the earlier checkpoints are kept: free space under {root} and run again to resume from the last one"
            ) from err
        raise
    if final.exists():  # the same step again (a rerun): move the old one aside first
        old = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        shutil.rmtree(old)
    os.replace(tmp, final)
    fsync_path(root)
    for stale in list_checkpoints(root)[:-keep]:
        if stale.name not in protect:  # renamed first: a kill mid-delete leaves a dot folder, not half a checkpoint
            old = root / f".{stale.name}.old-{os.getpid()}"
            os.replace(stale, old)
            shutil.rmtree(old)
    return final


def _write_folder(tmp: Path, step: int, weights: dict[str, torch.Tensor], state: dict[str, object],
                  meta: dict[str, object]) -> None:
    """The checkpoint's three files in `tmp`, fsynced (meta.json last, with the others' sizes and sha256)."""
    tmp.mkdir()
    # Serialized in memory, written by Python: a full disk then raises OSError(ENOSPC), where
    # torch.save and safetensors' save_file would report "iostream error" / "unexpected pos".
    state_bytes = io.BytesIO()
    torch.save(state, state_bytes)
    blobs = {WEIGHTS: save({k: v.detach().contiguous().cpu() for k, v in weights.items()}), STATE: state_bytes.getvalue()}
    files = {}
    for name, blob in blobs.items():
        _write_bytes(tmp / name, blob)
        files[name] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    record = {"format_version": FORMAT_VERSION, "step": step, "files": files} | meta
    _write_bytes(tmp / META, json.dumps(record, indent=1).encode())
    fsync_path(tmp)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


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
    files = meta.get("files", {})
    if not isinstance(files, dict) or set(files) != {WEIGHTS, STATE}:
        raise CheckpointError(f"checkpoint {path}: {META} lists files {sorted(files) if isinstance(files, dict) else files!r}, "
                              f"expected exactly {[WEIGHTS, STATE]}")
    for name, want in files.items():
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
    """Remove what a killed run left under `root`: half-written checkpoint folders, and half-deleted ones."""
    root = Path(root)
    if root.is_dir():
        for tmp in [*root.glob(".step-*.tmp-*"), *root.glob(".step-*.old-*")]:
            shutil.rmtree(tmp, ignore_errors=True)

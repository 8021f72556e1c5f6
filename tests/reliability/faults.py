"""Fault scenarios shared by tests/reliability (asserted) and benchmarks/chaos.py (counted).

Each scenario sets up a fault, lets the real code meet it, and returns the list of things a
user would find wrong afterwards (empty: nothing lost). Disk full uses a real size-limited
tmpfs when this process may mount one (root, no container veto); otherwise a FAKE full disk:
a file wrapper that raises OSError(ENOSPC) once a byte budget is spent (named as such in the
scenario's result).
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

from eagle3 import checkpoint as ckpt
from eagle3 import store as store_mod
from eagle3.checkpoint import CheckpointError, latest_valid_checkpoint, save_checkpoint
from eagle3.store import MANIFEST, Sample, StoreError, StoreReader, StoreWriter

AUX, H = [1, 2, 3], 64
SHARD_BYTES = 4 * 32 * 4 * H * 4  # 4 samples x 32 tokens x 4 states x H x float32, about 128 KiB a shard


@contextlib.contextmanager
def small_disk(path: Path, size_kib: int) -> Iterator[tuple[str, callable]]:
    """A `size_kib` filesystem at `path`; yields (kind, grow) where grow() gives it room again.

    kind is "tmpfs" (a real filesystem that runs out of space) or "fake ENOSPC" (a wrapper
    around Python's open() in eagle3.store and eagle3.checkpoint, whose writes go through it).
    """
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    if mounted:
        try:
            yield "tmpfs", lambda: subprocess.run(["mount", "-o", "remount,size=64m", str(path)], check=True)
        finally:
            subprocess.run(["umount", "-l", str(path)], check=False)
        return
    with _fake_enospc(path, size_kib * 1024) as grow:
        yield "fake ENOSPC", grow


@contextlib.contextmanager
def _fake_enospc(root: Path, budget: int) -> Iterator[callable]:
    """FAKE full disk: writes under `root` raise ENOSPC once `budget` bytes were written."""
    left = [budget]
    real_open = open

    def spend(n: int) -> None:
        if n > left[0]:
            left[0] = 0
            raise OSError(errno.ENOSPC, "No space left on device (fake)")
        left[0] -= n

    class Limited:
        def __init__(self, handle) -> None:  # noqa: ANN001
            self._h = handle

        def write(self, data) -> int:  # noqa: ANN001
            spend(len(data))
            return self._h.write(data)

        def __getattr__(self, name):  # noqa: ANN001, ANN204
            return getattr(self._h, name)

        def __enter__(self):  # noqa: ANN204
            return self

        def __exit__(self, *exc) -> None:  # noqa: ANN002
            self._h.close()

    def limited_open(file, mode="r", *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        handle = real_open(file, mode, *args, **kwargs)
        return Limited(handle) if any(c in mode for c in "wa") and str(file).startswith(str(root)) else handle

    with mock.patch.object(store_mod, "open", limited_open, create=True), mock.patch.object(ckpt, "open", limited_open, create=True):
        yield lambda: left.__setitem__(0, 1 << 40)


def _samples(shard: int) -> list[Sample]:
    g = torch.Generator().manual_seed(shard)
    return [Sample(f"s{shard}-{j}", torch.arange(32), torch.ones(32, dtype=torch.bool), torch.randn(32, 4, H, generator=g))
            for j in range(4)]


def disk_full_shard(work: Path) -> list[str]:
    """A store fills the disk at its 3rd shard: clear error, no partial shard, resume once there is room."""
    groups = [[s.sample_id for s in _samples(i)] for i in range(6)]
    problems: list[str] = []
    shutil.rmtree(work, ignore_errors=True)
    with small_disk(work, size_kib=SHARD_BYTES * 5 // 2 // 1024) as (kind, grow):
        root = work / "store"
        writer = StoreWriter(root, aux_layer_ids=AUX, hidden_size=H, dtype=torch.float32, expected_shards=groups)
        error = None
        try:
            for i in range(6):
                writer.write_shard(i, _samples(i))
        except StoreError as err:
            error = str(err)
        if error is None or "shard-00002" not in error or "free space" not in error:
            problems.append(f"[{kind}] the full disk gave no clear error naming the shard: {error!r}")
        names = sorted(p.name for p in root.iterdir())
        if names != [MANIFEST, "shard-00000.safetensors", "shard-00001.safetensors"]:
            problems.append(f"[{kind}] after the full disk the store holds {names}; expected two whole shards and the manifest")
        grow()
        resumed = StoreWriter(root, aux_layer_ids=AUX, hidden_size=H, dtype=torch.float32, expected_shards=groups)
        if resumed.pending() != [2, 3, 4, 5]:
            problems.append(f"[{kind}] resume would redo shards {resumed.pending()}; expected [2, 3, 4, 5]")
        for i in resumed.pending():
            resumed.write_shard(i, _samples(i))
        try:
            reader = StoreReader(root, dequantize_dtype=torch.float32)
            if [s.sample_id for s in reader] != [i for g in groups for i in g]:
                problems.append(f"[{kind}] the resumed store holds other samples than expected")
        except StoreError as err:
            problems.append(f"[{kind}] the resumed store does not read back: {err}")
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
        if leftovers:
            problems.append(f"[{kind}] temporary files left: {leftovers}")
    return problems


def disk_full_checkpoint(work: Path) -> list[str]:
    """The disk fills while checkpoint 2 is written: clear error, checkpoint 1 intact and resumed from, then 2 written."""
    weights = {"w": torch.randn(256, 256)}  # 256 KiB
    state = {"optimizer": {"m": torch.randn(256, 256)}, "data": {"epoch": 0, "cursor": 3}}
    problems: list[str] = []
    shutil.rmtree(work, ignore_errors=True)
    with small_disk(work, size_kib=800) as (kind, grow):
        root = work / "checkpoints"
        save_checkpoint(root, 10, weights, state, {})
        error = None
        try:
            save_checkpoint(root, 20, weights, state, {})
        except CheckpointError as err:
            error = str(err)
        if error is None or "step-000020" not in error or "free space" not in error:
            problems.append(f"[{kind}] the full disk gave no clear error naming the checkpoint: {error!r}")
        names = sorted(p.name for p in root.iterdir())
        if names != ["step-000010"]:
            problems.append(f"[{kind}] after the full disk the checkpoint folder holds {names}; expected only step-000010")
        found = latest_valid_checkpoint(root)
        if found is None or found.step != 10 or not torch.equal(found.weights["w"], weights["w"]):
            problems.append(f"[{kind}] the checkpoint to resume from is {found and found.step}; expected step 10, intact")
        grow()
        save_checkpoint(root, 20, weights, state, {})
        found = latest_valid_checkpoint(root)
        if found is None or found.step != 20:
            problems.append(f"[{kind}] with room again, checkpoint 20 was not written")
    return problems

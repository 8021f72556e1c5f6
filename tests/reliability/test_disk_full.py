"""A full disk while a shard or a checkpoint is written: a clear error, nothing partial under a final
name, and a resume that succeeds once there is room (a real size-limited tmpfs when mounting is
allowed, else a fake ENOSPC write wrapper: tests/reliability/faults.py)."""

from __future__ import annotations

from pathlib import Path

from tests.reliability import faults


def test_disk_full_while_a_shard_is_written(tmp_path: Path):
    assert faults.disk_full_shard(tmp_path / "disk") == []


def test_disk_full_while_a_checkpoint_is_written(tmp_path: Path):
    assert faults.disk_full_checkpoint(tmp_path / "disk") == []

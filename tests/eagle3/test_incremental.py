"""Dated incoming files and the assembly of per-file artifacts (eagle3.ops.incremental)."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

import pytest
import torch

from eagle3.artifacts import StageRecord, read_complete
from eagle3.capture.store import MANIFEST, Sample, StoreReader, StoreWriter
from eagle3.data.conversations import DataError, TokenizedSample, read_samples, write_samples
from eagle3.ops.incremental import discover, fingerprint_assemble, run_assemble


def _touch(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text('{"id": "x", "messages": []}\n')


def test_discover_takes_dated_files_up_to_today_oldest_first(tmp_path: Path):
    _touch(tmp_path, "2026-01-02.jsonl", "2026-01-01-eu.jsonl", "2026-01-01-us.jsonl", "2026-01-05.jsonl",
           "notes.jsonl", "2026-01-03.csv", "2026-13-01.jsonl")
    found = discover(str(tmp_path), today=date(2026, 1, 4))
    assert [f.name for f in found] == ["2026-01-01-eu.jsonl", "2026-01-01-us.jsonl", "2026-01-02.jsonl"]
    assert [f.name for f in discover(str(tmp_path), today=date(2026, 1, 5), window_days=4)] == ["2026-01-02.jsonl", "2026-01-05.jsonl"]
    assert discover(f"file://{tmp_path}", today=date(2026, 1, 1))[0].name == "2026-01-01-eu.jsonl"


def test_discover_errors_name_the_setting(tmp_path: Path):
    with pytest.raises(DataError, match="incoming=.*no such folder"):
        discover(str(tmp_path / "missing"))
    _touch(tmp_path, "2026-02-01.jsonl")
    with pytest.raises(DataError, match="no dated conversation file"):
        discover(str(tmp_path), today=date(2026, 1, 31))


def _part(root: Path, label: str, ids: list[str], hidden: int = 8) -> tuple[str, StageRecord, StageRecord]:
    """A prepared artifact (train/heldout jsonl) and an extract artifact (two stores) for one file."""
    prepared, extracted = root / f"prepared-{label}", root / f"extract-{label}"
    prepared.mkdir(parents=True)
    splits = {"train": ids[:-1], "heldout": ids[-1:]}
    for split, split_ids in splits.items():
        samples = [TokenizedSample(i, list(range(3 + k)), [0, 1] + [1] * (1 + k)) for k, i in enumerate(split_ids)]
        write_samples(prepared / f"{split}.jsonl", samples)
        groups = [split_ids[i:i + 2] for i in range(0, len(split_ids), 2)]
        writer = StoreWriter(extracted / split, aux_layer_ids=[1, 2, 3], hidden_size=hidden, dtype=torch.float32, expected_shards=groups)
        for index, group in enumerate(groups):
            writer.write_shard(index, [Sample(i, torch.arange(3 + split_ids.index(i)), torch.ones(3 + split_ids.index(i), dtype=torch.bool),
                                              torch.randn(3 + split_ids.index(i), 4, hidden)) for i in group])
    return (label, StageRecord(stage="prepare_data", uri=str(prepared), fingerprint=f"p-{label}"),
            StageRecord(stage="extract", uri=str(extracted), fingerprint=f"e-{label}"))


def test_assemble_joins_parts_without_copying_shards(tmp_path: Path):
    parts = [_part(tmp_path, "2026-01-01", ["a", "b", "c", "d"]), _part(tmp_path, "2026-01-02", ["a", "e", "f"])]
    fp = fingerprint_assemble(parts)
    record = run_assemble(parts, tmp_path / "artifacts", fp)
    train = StoreReader(record.path / "train")
    train.verify()
    assert [s.sample_id for s in train] == ["2026-01-01:a", "2026-01-01:b", "2026-01-01:c", "2026-01-02:a", "2026-01-02:e"]
    assert len(StoreReader(record.path / "heldout")) == 2
    assert [s.id for s in read_samples(record.path / "train.jsonl")] == [s.sample_id for s in train]
    first_shard = sorted((record.path / "train").glob("p0000-*.safetensors"))[0]
    assert first_shard.stat().st_ino == (parts[0][2].path / "train" / first_shard.name.removeprefix("p0000-")).stat().st_ino
    assert record.stats["train_samples"] == 5 and json.loads(record.stats["files"]) == ["2026-01-01", "2026-01-02"]
    assert read_complete(record.path) is not None
    assert run_assemble(parts, tmp_path / "artifacts", fp).stats == record.stats  # whole: handed back, not rebuilt
    assert fingerprint_assemble(parts[:1]) != fp


def test_assemble_refuses_parts_extracted_with_another_layout(tmp_path: Path):
    parts = [_part(tmp_path, "2026-01-01", ["a", "b"]), _part(tmp_path, "2026-01-02", ["c", "d"], hidden=16)]
    with pytest.raises(DataError, match="same target and extract settings"):
        run_assemble(parts, tmp_path / "artifacts", fingerprint_assemble(parts))
    assert not (tmp_path / "artifacts" / "assemble").exists() or not any((tmp_path / "artifacts" / "assemble").iterdir())


def test_assemble_refuses_a_manifest_that_points_outside_its_store(tmp_path: Path):
    parts = [_part(tmp_path, "2026-01-01", ["a", "b", "c"])]
    manifest_path = parts[0][2].path / "train" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    (tmp_path / "secret.safetensors").write_text("not yours")
    manifest["shards"][0]["file"] = "../../secret.safetensors"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"'\.\./\.\./secret\.safetensors', not a shard file name"):
        run_assemble(parts, tmp_path / "artifacts", fingerprint_assemble(parts))
    assert not list((tmp_path / "artifacts").rglob("p0000-*"))

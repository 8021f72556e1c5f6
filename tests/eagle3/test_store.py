from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eagle3.capture.store import MANIFEST, Sample, StoreError, StoreReader, StoreWriter, is_complete


def _samples(ids: list[str], h: int = 8, n_aux: int = 3) -> list[Sample]:
    out = []
    for k, sid in enumerate(ids):
        t = 3 + k
        g = torch.Generator().manual_seed(k)
        out.append(Sample(sid, torch.arange(t), torch.arange(t) % 2 == 0, torch.randn(t, n_aux + 1, h, generator=g)))
    return out


def _writer(root: Path, groups: list[list[str]]) -> StoreWriter:
    return StoreWriter(root, aux_layer_ids=[2, 4, 5], hidden_size=8, dtype=torch.float32, expected_shards=groups)


def test_round_trip_and_manifest(tmp_path: Path):
    groups = [["a", "b"], ["c"]]
    samples = _samples(["a", "b", "c"])
    writer = _writer(tmp_path, groups)
    assert writer.pending() == [0, 1]
    writer.write_shard(0, samples[:2])
    assert not is_complete(tmp_path)  # one shard missing
    writer.write_shard(1, samples[2:])
    reader = StoreReader(tmp_path)
    reader.verify()
    assert [s.sample_id for s in reader] == ["a", "b", "c"]
    assert torch.equal(reader[2].hidden_states, samples[2].hidden_states)
    assert reader[1].loss_mask.dtype == torch.bool
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["complete"] and all(len(e["sha256"]) == 64 for e in manifest["shards"])
    assert not list(tmp_path.glob(".*tmp*"))


def test_resume_skips_whole_shards_and_redoes_corrupt_ones(tmp_path: Path):
    groups = [["a"], ["b"], ["c"]]
    samples = _samples(["a", "b", "c"])
    writer = _writer(tmp_path, groups)
    for i in range(3):
        writer.write_shard(i, [samples[i]])
    shard1 = tmp_path / "shard-00001.safetensors"
    data = bytearray(shard1.read_bytes())
    data[-1] ^= 0xFF  # flip one byte: same size, wrong checksum
    shard1.write_bytes(bytes(data))
    (tmp_path / "shard-00002.safetensors").unlink()
    assert not is_complete(tmp_path)
    again = _writer(tmp_path, groups)
    assert again.pending() == [1, 2]


def test_incomplete_store_is_refused_by_the_reader(tmp_path: Path):
    _writer(tmp_path, [["a"], ["b"]]).write_shard(0, _samples(["a"]))
    with pytest.raises(StoreError, match="incomplete"):
        StoreReader(tmp_path)


def test_wrong_shape_is_an_error_and_writes_nothing(tmp_path: Path):
    writer = _writer(tmp_path, [["a"]])
    bad = Sample("a", torch.arange(3), torch.ones(3, dtype=torch.bool), torch.zeros(3, 2, 8))
    with pytest.raises(StoreError, match="shape"):
        writer.write_shard(0, [bad])
    assert not list(tmp_path.glob("shard-*"))


def test_each_sample_keeps_its_data_source_and_a_store_without_sources_names_none(tmp_path: Path):
    samples = [replace(s, source=src) for s, src in zip(_samples(["a", "b", "c"]), ["code", None, "chat"])]
    writer = _writer(tmp_path / "named", [["a", "b"], ["c"]])
    writer.write_shard(0, samples[:2])
    writer.write_shard(1, samples[2:])
    reader = StoreReader(tmp_path / "named")
    assert [s.source for s in reader] == ["code", None, "chat"] == reader.sample_sources()
    plain = _writer(tmp_path / "plain", [["a", "b", "c"]])
    plain.write_shard(0, _samples(["a", "b", "c"]))
    assert StoreReader(tmp_path / "plain").sample_sources() == [None, None, None]
    manifest = json.loads((tmp_path / "plain" / MANIFEST).read_text())
    assert "sources" not in manifest["shards"][0]  # the manifest of a store without sources is as before

"""The draft registry and the promotion gate (eagle3.ops.publish), on real folders and fsspec's memory file system."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest

from eagle3.artifacts import read_complete
from eagle3.ops.publish import (
    CURRENT_LINK,
    PublishedDraft,
    RegistryError,
    decide,
    fetch_draft,
    publish,
    read_current,
    run_parent_vocab,
)


def _draft(folder: Path, weights: bytes) -> tuple[Path, Path]:
    """An export folder (config.json + model.safetensors, plus the artifact marker) and a vocab file."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["Eagle3Speculator"]}')
    (folder / "model.safetensors").write_bytes(weights)
    (folder / ".eagle3-complete.json").write_text("{}")
    vocab = folder.parent / f"{folder.name}-vocab.safetensors"
    vocab.write_bytes(b"d2t+t2d " + weights)
    return folder, vocab


def _meta(draft_id: str, acceptance: float, parent: str | None = None) -> PublishedDraft:
    return PublishedDraft(draft_id=draft_id, acceptance_length=acceptance, heldout_samples=4, train_samples=20,
                          train_tokens=900, data_files=["2026-01-01"], parent_draft=parent, export_fingerprint=draft_id + "0000",
                          code_version="0.1.0+gabc", created_at="2026-01-01T02:00:00Z")


def test_gate_promotes_the_first_draft_and_then_only_one_not_worse_than_served_minus_tolerance():
    assert decide(1.2, None, 0.05).promote
    assert decide(1.96, 2.0, 0.05).promote  # within tolerance
    assert decide(2.0, 2.0, 0.0).promote
    refused = decide(1.9, 2.0, 0.05)
    assert not refused.promote and "1.900 < served 2.000" in refused.reason
    assert not decide(2.05, 2.0, -0.1).promote  # negative tolerance: must improve by 0.1
    assert "Not promoted" in refused.to_markdown() and "served draft is unchanged" in refused.to_markdown()


def test_publish_then_promote_a_second_draft_local(tmp_path: Path):
    registry = tmp_path / "registry"
    assert read_current(str(registry)) is None
    export1, vocab1 = _draft(tmp_path / "export1", b"weights-1")
    served = publish(export1, vocab1, _meta("aaaa", 1.5), str(registry))
    assert served.path == str(registry / "drafts" / "aaaa")
    assert (registry / "drafts" / "aaaa" / "model.safetensors").read_bytes() == b"weights-1"
    assert (registry / "drafts" / "aaaa" / "vocab.safetensors").is_file()
    assert not (registry / "drafts" / "aaaa" / ".eagle3-complete.json").exists()
    assert (registry / CURRENT_LINK / "model.safetensors").read_bytes() == b"weights-1"  # what vLLM is pointed at
    assert PublishedDraft.model_validate_json((registry / "drafts" / "aaaa" / "metadata.json").read_text()).acceptance_length == 1.5

    export2, vocab2 = _draft(tmp_path / "export2", b"weights-2")
    publish(export2, vocab2, _meta("bbbb", 1.6, parent="aaaa"), str(registry))
    current = read_current(str(registry))
    assert current is not None and current.draft_id == "bbbb" and current.parent_draft == "aaaa"
    assert (registry / CURRENT_LINK / "model.safetensors").read_bytes() == b"weights-2"
    assert (registry / "drafts" / "aaaa" / "model.safetensors").read_bytes() == b"weights-1"  # history kept
    assert sorted(p.name for p in registry.iterdir()) == ["current", "current.json", "drafts"]  # no temporaries left


def test_a_half_copied_draft_from_a_crash_is_replaced_and_never_served(tmp_path: Path):
    registry = tmp_path / "registry"
    export1, vocab1 = _draft(tmp_path / "export1", b"weights-1")
    publish(export1, vocab1, _meta("aaaa", 1.5), str(registry))
    crashed = registry / "drafts" / "bbbb"  # a copy that died before metadata.json
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"trunc")
    assert read_current(str(registry)).draft_id == "aaaa"
    export2, vocab2 = _draft(tmp_path / "export2", b"weights-2")
    publish(export2, vocab2, _meta("bbbb", 1.6, parent="aaaa"), str(registry))
    assert (registry / "drafts" / "bbbb" / "model.safetensors").read_bytes() == b"weights-2"
    assert read_current(str(registry)).draft_id == "bbbb"


def test_registry_on_an_fsspec_url(tmp_path: Path):
    url = "memory://eagle3-test-registry"
    export1, vocab1 = _draft(tmp_path / "export1", b"weights-1")
    publish(export1, vocab1, _meta("aaaa", 1.5), url)
    current = read_current(url)
    assert current is not None and current.path.endswith("/drafts/aaaa")
    local = fetch_draft(current, url, tmp_path / "cache")
    assert (local / "model.safetensors").read_bytes() == b"weights-1"
    fs = fsspec.filesystem("memory")
    assert not [p for p in fs.ls("/eagle3-test-registry/drafts") if ".tmp-" in p]
    fs.rm("/eagle3-test-registry", recursive=True)


def test_unreadable_current_json_is_an_error_naming_it(tmp_path: Path):
    (tmp_path / "current.json").write_text("{not json")
    with pytest.raises(RegistryError, match="current.json"):
        read_current(str(tmp_path))


def test_parent_vocab_becomes_a_vocab_artifact(tmp_path: Path):
    export1, vocab1 = _draft(tmp_path / "export1", b"weights-1")
    served = publish(export1, vocab1, _meta("aaaa", 1.5), str(tmp_path / "registry"))
    record = run_parent_vocab(Path(served.path), "aaaa", tmp_path / "artifacts", "fp1")
    assert (record.path / "vocab.safetensors").read_bytes() == vocab1.read_bytes()
    assert read_complete(record.path) is not None
    with pytest.raises(RegistryError, match="warm_start=false"):
        run_parent_vocab(tmp_path / "export1", "x", tmp_path / "artifacts", "fp2")

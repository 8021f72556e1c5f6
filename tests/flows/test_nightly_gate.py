"""The nightly promotion gate per data source (issue 31): the publish task of the nightly flow, through real Prefect,
on a real registry folder. The candidate improves one source and regresses the other."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.artifacts import StageRecord
from eagle3.ops.publish import VOCAB, PublishConfig, publish, read_current
from tests.eagle3.test_publish import _draft, _meta

SERVED = {"code": 2.0, "chat": 2.0}  # the served draft on the candidate's held-out set
CANDIDATE = {"code": 2.4, "chat": 1.8}  # better on code by 0.4, worse on chat by 0.2; pooled 2.05 >= 2.0


def _night(tmp_path: Path, max_source_regression: float, served_sources: dict[str, float] | None = SERVED):  # noqa: ANN202
    from tasks.nightly import publish_gate

    registry = tmp_path / "registry"
    if read_current(str(registry)) is None:
        publish(*_draft(tmp_path / "served", b"served"), _meta("aaaa", 2.0).model_copy(update={"per_source": SERVED}),
                str(registry))
    export, vocab_file = _draft(tmp_path / f"candidate-{max_source_regression}", b"candidate")
    vocab = tmp_path / f"vocab-{max_source_regression}"  # a vocab artifact: <folder>/vocab.safetensors
    vocab.mkdir()
    vocab_file.rename(vocab / VOCAB)
    candidate = _meta(f"bbbb{int(max_source_regression * 100)}", 2.05, parent="aaaa").model_copy(
        update={"per_source": CANDIDATE})
    gate = publish_gate(config=PublishConfig(registry=str(registry), tolerance=0.02, max_source_regression=max_source_regression),
                        candidate=candidate, served_acceptance=2.0, exported=StageRecord(stage="export", uri=str(export), fingerprint="x"),
                        vocab=StageRecord(stage="vocab", uri=str(vocab), fingerprint="y"), served_sources=served_sources)
    return gate, read_current(str(registry))


def test_a_candidate_worse_on_one_source_past_the_threshold_is_refused_naming_it(prefect_harness, tmp_path):
    gate, current = _night(tmp_path, max_source_regression=0.1)
    assert not gate["promoted"] and current.draft_id == "aaaa"  # the served draft is unchanged
    assert "Data source 'chat': candidate 1.800 < served 2.000 - publish.max_source_regression 0.100" in gate["reason"]
    assert "'code'" not in gate["reason"]  # only the source that regressed is named
    assert gate["sources"] == {"code": {"candidate": 2.4, "served": 2.0}, "chat": {"candidate": 1.8, "served": 2.0}}


def test_the_same_candidate_under_the_threshold_is_promoted_with_its_per_source_figures(prefect_harness, tmp_path):
    gate, current = _night(tmp_path, max_source_regression=0.25)
    assert gate["promoted"] and current.draft_id == "bbbb25"
    assert "within publish.max_source_regression 0.250" in gate["reason"] and "worst change -0.200" in gate["reason"]
    assert current.per_source == CANDIDATE  # current.json keeps them for the record
    metadata = json.loads((Path(current.path) / "metadata.json").read_text())
    assert metadata["per_source"] == CANDIDATE


def test_a_served_draft_without_per_source_figures_is_gated_on_the_pooled_figure(prefect_harness, tmp_path):
    gate, current = _night(tmp_path, max_source_regression=0.1, served_sources={})
    assert gate["promoted"] and current.draft_id == "bbbb10"
    assert "no per-source figures" in gate["reason"] and "gated on the pooled figure alone" in gate["reason"]
    # an older current.json (written before per_source existed) still reads
    registry = tmp_path / "registry"
    older = json.loads((registry / "current.json").read_text())
    older.pop("per_source")
    (registry / "current.json").write_text(json.dumps(older))
    assert read_current(str(registry)).per_source == {}

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.artifacts import MARKER, StageRecord, building, mark_complete, read_complete


def test_failed_build_leaves_nothing_under_the_final_name(tmp_path: Path):
    final = tmp_path / "stage" / "fp"
    with pytest.raises(RuntimeError):
        with building(final) as tmp:
            (tmp / "half.txt").write_text("x")
            raise RuntimeError("boom")
    assert not final.exists()
    assert list((tmp_path / "stage").iterdir()) == []


def test_truncated_or_deleted_file_makes_the_artifact_absent(tmp_path: Path):
    final = tmp_path / "s" / "fp"
    with building(final) as tmp:
        (tmp / "a.bin").write_bytes(b"0123456789")
        (tmp / "b.bin").write_bytes(b"xy")
        mark_complete(tmp, StageRecord(stage="s", uri=str(final), fingerprint="fp", stats={"n": 1}))
    record = read_complete(final)
    assert record is not None and record.stats == {"n": 1} and record.uri == str(final)
    (final / "a.bin").write_bytes(b"01234")  # truncated
    assert read_complete(final) is None
    (final / "a.bin").write_bytes(b"0123456789")
    assert read_complete(final) is not None
    (final / "b.bin").unlink()
    assert read_complete(final) is None


def test_a_marker_half_written_by_a_killed_run_does_not_spoil_the_next_one(tmp_path: Path):
    """An artifact built in place (train, extract) whose run was killed between writing the marker's temporary and
    renaming it: the next run's marker must not list that temporary, or the finished artifact reads as absent."""
    final = tmp_path / "train" / "fp"
    final.mkdir(parents=True)
    (final / "a.bin").write_bytes(b"0123456789")
    (final / f".{MARKER}.tmp").write_text('{"record": {"stage": "tr')  # the killed run's
    mark_complete(final, StageRecord(stage="train", uri=str(final), fingerprint="fp", stats={"n": 2}))
    record = read_complete(final)
    assert record is not None and record.stats == {"n": 2}
    assert sorted(p.name for p in final.iterdir()) == [MARKER, "a.bin"]


def test_the_run_summary_says_how_many_source_rows_were_skipped_and_where_the_list_is(tmp_path):
    from eagle3.artifacts import StageRecord
    from eagle3.ops.summary import RunSummary, data_report

    regen = StageRecord(stage="regenerate", uri=str(tmp_path), fingerprint="r", stats={"skipped": 2})
    prepared = StageRecord(stage="prepare_data", uri=str(tmp_path), fingerprint="p", stats={
        "train_samples": 40, "heldout_samples": 8, "dropped": 1, "truncated": 3, "skipped_rows": 5,
        "bad_rows_report": str(tmp_path / "bad_rows.jsonl"), "train_tokens": 999})
    report = data_report(regen, prepared)
    assert report == {"train_samples": 40, "heldout_samples": 8, "dropped": 1, "truncated": 3, "skipped_rows": 5,
                      "bad_rows_report": str(tmp_path / "bad_rows.jsonl"), "too_long_for_regenerate": 2}
    text = RunSummary(data=report).to_markdown()
    assert f"Skipped 5 unusable source row(s): `{tmp_path / 'bad_rows.jsonl'}`" in text

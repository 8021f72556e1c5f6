"""Bad rows in a conversations file, through the regenerate and prepare_data stage functions (tiny target):
each unusable row is skipped and reported with its line number under data.max_bad_rows; over that
budget, or with no usable row at all, the stage fails naming the setting and leaves no artifact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3 import stages
from eagle3.capture.regenerate import RegenerateConfig
from eagle3.data.conversations import DataConfig, DataError
from eagle3.data.target import TargetConfig

NO_REGEN = RegenerateConfig(enabled=False)
TARGET = TargetConfig(model="builtin:tiny", max_model_len=256, dtype="float32")


def _row(cid: str, answer: str = "Fine, thanks.", role: str = "assistant") -> bytes:
    return json.dumps({"id": cid, "messages": [{"role": "user", "content": f"How are you, {cid}?"},
                                               {"role": role, "content": answer}]}).encode() + b"\n"


GOOD = [_row(f"good-{i}") for i in range(6)]
BAD = {  # line content -> what the report must say
    b'{"id": "broken", "messages": [\n': "not JSON",
    _row("robot", role="robot"): "unknown role(s) ['robot']",
    _row("blank", answer="  \n\t "): "empty or whitespace only",
    b'{"id": "latin1", "messages": [{"role": "user", "content": "caf\xe9"}]}\n': "not valid UTF-8",
    _row("good-0"): "duplicate id 'good-0' (first on line 1)",
    json.dumps({"id": "src", "source": 7, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    .encode() + b"\n": "'source' is 7; expected a non-empty string",
}


@pytest.fixture(scope="module")
def target(builtin_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    return root, stages.run_stage_target(TARGET, builtin_cache, root, stages.fingerprint_target(TARGET))


def _prepare(root: Path, target, config: DataConfig):  # noqa: ANN001, ANN202
    regen = stages.run_regenerate(NO_REGEN, config, TARGET, target, root,
                                  stages.fingerprint_regenerate(NO_REGEN, config, target, 256), root / "loads.jsonl")
    return stages.run_prepare(config, regen, target, False, root, stages.fingerprint_prepare(config, regen, target))


def test_bad_rows_are_skipped_and_reported_with_line_numbers(target, tmp_path):
    root, record = target
    source = tmp_path / "chats.jsonl"
    huge = _row("huge", answer="word " * 50_000)  # far over data.max_tokens: truncated, still usable
    lines = [GOOD[0], *BAD, *GOOD[1:], huge]
    source.write_bytes(b"".join(lines))
    prepared = _prepare(root, record, DataConfig(source=str(source), max_tokens=200, heldout_fraction=0.0))
    assert prepared.stats["skipped_rows"] == len(BAD)
    report = [json.loads(line) for line in Path(prepared.stats["bad_rows_report"]).read_text().splitlines()]
    assert [r["line"] for r in report] == list(range(2, 2 + len(BAD)))
    for row, (_, expected) in zip(report, BAD.items()):
        assert expected in row["reason"] and row["source"] == str(source)
    assert prepared.stats["train_samples"] == len(GOOD) + 1 and prepared.stats["truncated"] >= 1
    ids = [json.loads(line)["id"] for line in (prepared.path / "train.jsonl").read_text().splitlines()]
    assert sorted(ids) == sorted([f"good-{i}" for i in range(6)] + ["huge"])  # each once, the duplicate not twice


def test_over_the_budget_the_stage_fails_naming_the_setting(target, tmp_path):
    root, record = target
    source = tmp_path / "chats.jsonl"
    source.write_bytes(b"".join([*GOOD, *BAD]))
    config = DataConfig(source=str(source), max_bad_rows=len(BAD) - 1)
    with pytest.raises(DataError, match=rf"more than data.max_bad_rows={len(BAD) - 1} unusable rows.*chats.jsonl:7: not JSON"):
        _prepare(root, record, config)
    assert not list((root / "regenerate").glob(stages.fingerprint_regenerate(NO_REGEN, config, record, 256) + "*"))


def test_a_dataset_with_no_usable_row(target, tmp_path):
    root, record = target
    source = tmp_path / "chats.jsonl"
    source.write_bytes(b"".join(list(BAD)[:4]))  # the fifth is a duplicate only after GOOD[0]
    with pytest.raises(DataError, match=r"data.source=.*no usable conversation: all 4 rows were unusable \(first: line 1: not JSON"):
        _prepare(root, record, DataConfig(source=str(source)))


def test_an_empty_dataset(target, tmp_path):
    root, record = target
    source = tmp_path / "chats.jsonl"
    source.write_text("\n  \n")
    with pytest.raises(DataError, match=r"data.source=.*no usable conversation: it holds no row"):
        _prepare(root, record, DataConfig(source=str(source)))

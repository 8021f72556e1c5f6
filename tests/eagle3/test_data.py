from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3.capture.regenerate import RUNTIME_REGENERATE_SETTINGS, RegenerateConfig, regenerate
from eagle3.config import ConfigError, build_config
from eagle3.data.conversations import (
    Conversation,
    DataConfig,
    DataError,
    Message,
    TokenizedSample,
    is_heldout,
    load_conversations,
    load_source,
    read_samples,
    tokenize_conversation,
    write_samples,
)
from eagle3.fingerprint import hash_files
from eagle3.stages import fingerprint_regenerate, stage_fingerprint


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target)


def test_builtin_chatterbot_conversations_load_from_the_installed_package():
    convs = load_conversations(DataConfig(max_samples=50))
    assert len(convs) == 50
    assert all(c.messages[0].role == "user" and c.messages[1].role == "assistant" for c in convs)
    assert len({c.id for c in convs}) == 50


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    conv = Conversation("x", (Message("user", "What is AI?"), Message("assistant", "A field of science."),
                              Message("user", "Thanks"), Message("assistant", "You are welcome.")))
    sample = tokenize_conversation(tokenizer, conv, max_tokens=512)
    assert len(sample.input_ids) == len(sample.loss_mask)
    learned = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert "A field of science." in learned and "You are welcome." in learned
    assert "What is AI?" not in learned and "Thanks" not in learned and "assistant" not in learned


def test_truncation(tokenizer):
    conv = Conversation("x", (Message("user", "hi " * 50), Message("assistant", "ok " * 50)))
    sample = tokenize_conversation(tokenizer, conv, max_tokens=20)
    assert len(sample.input_ids) == 20 and sum(sample.loss_mask) == 0


def test_heldout_split_is_stable_and_near_the_fraction():
    ids = [f"s{i}" for i in range(2000)]
    held = [i for i in ids if is_heldout(i, 0.1, 0)]
    assert 150 < len(held) < 250
    assert held == [i for i in ids if is_heldout(i, 0.1, 0)]
    assert held[:10] == [i for i in ids + ["new"] if is_heldout(i, 0.1, 0)][:10]  # adding samples moves nothing


def test_malformed_jsonl_names_file_and_line(tmp_path: Path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"data.jsonl:2.*data.max_bad_rows"):
        load_conversations(DataConfig(source=str(path), max_bad_rows=0))


def test_unknown_role_is_an_error(tmp_path: Path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": [{"role": "robot", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match="unknown role.*robot"):
        load_conversations(DataConfig(source=str(path), max_bad_rows=0))


def test_missing_source_file_names_the_setting(tmp_path: Path):
    with pytest.raises(DataError, match="data.source=.*no such file"):
        load_conversations(DataConfig(source=str(tmp_path / "nope.jsonl")))


# -- data sources (issue 31) -------------------------------------------------------------
def _rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chat(cid: str, **extra) -> dict:  # noqa: ANN003
    return {"id": cid, "messages": [{"role": "user", "content": f"q {cid}"}, {"role": "assistant", "content": "a"}]} | extra


def test_sources_come_from_the_row_field_else_the_file_name_and_ids_stay_distinct(tmp_path: Path):
    faq = _rows(tmp_path / "faq.jsonl", [_chat("1", source="billing"), _chat("2")])
    chat = _rows(tmp_path / "chat.jsonl", [_chat("1"), _chat("2")])  # the same ids as faq.jsonl
    convs, bad = load_source(DataConfig(source=[str(faq), str(chat)]))
    assert not bad
    assert [(c.id, c.source) for c in convs] == [("faq:1", "billing"), ("faq:2", "faq"), ("chat:1", "chat"),
                                                  ("chat:2", "chat")]
    # one file: a row without a source takes the file's name once any row names one
    assert [c.source for c in load_conversations(DataConfig(source=str(faq)))] == ["billing", "faq"]


def test_data_without_sources_is_prepared_and_fingerprinted_as_before(tmp_path: Path):
    plain = _rows(tmp_path / "plain.jsonl", [_chat("1"), _chat("2")])
    config = DataConfig(source=str(plain))
    assert [c.source for c in load_conversations(config)] == [None, None] and [c.id for c in load_conversations(config)] == ["1", "2"]
    off = RegenerateConfig(enabled=False)
    before = stage_fingerprint("regenerate", {"regenerate": off.model_dump(mode="json", exclude=RUNTIME_REGENERATE_SETTINGS),
                                              "source": str(plain), "max_samples": config.max_samples}, hash_files([plain]))
    assert fingerprint_regenerate(off, config, None, 256) == before  # the artifact names of before sources existed
    out = tmp_path / "samples.jsonl"
    write_samples(out, [TokenizedSample("1", [1, 2], [0, 1])])
    assert json.loads(out.read_text()) == {"id": "1", "input_ids": [1, 2], "loss_mask": [0, 1]}
    # with sources, the marker moves the fingerprint: a regenerate artifact of before (no sources kept) is not reused
    labelled = _rows(tmp_path / "labelled.jsonl", [_chat("1", source="code")])
    plain_fp = stage_fingerprint("regenerate", {"regenerate": off.model_dump(mode="json", exclude=RUNTIME_REGENERATE_SETTINGS),
                                                "source": str(labelled), "max_samples": 256}, hash_files([labelled]))
    assert fingerprint_regenerate(off, DataConfig(source=str(labelled)), None, 256) != plain_fp
    write_samples(out, [TokenizedSample("1", [1, 2], [0, 1], "code")])
    assert read_samples(out)[0].source == "code"


def test_regenerate_keeps_each_conversation_s_source(tokenizer):
    class Echo:  # an engine reached elsewhere (regenerate.TokenGenerator): answers with the prompt's last tokens
        def generate_ids(self, prompts, **_):  # noqa: ANN001, ANN202
            return [list(p[-3:]) for p in prompts]

    convs = [Conversation("a", (Message("user", "hi"), Message("assistant", "x")), "code"),
             Conversation("b", (Message("user", "yo"), Message("assistant", "y")))]
    result = regenerate(convs, tokenizer, lambda: Echo(), RegenerateConfig(max_new_tokens=4), max_model_len=256)
    assert [(c.id, c.source) for c in result.conversations] == [("a", "code"), ("b", None)]


@pytest.mark.parametrize("value", [5, "", "  ", ["x"]])
def test_a_row_source_that_is_not_a_non_empty_string_is_refused_by_line(tmp_path: Path, value):
    path = _rows(tmp_path / "data.jsonl", [_chat("1", source=value)])
    with pytest.raises(DataError, match=rf"data.max_bad_rows=0 .*data.jsonl:1: 'source' is {re.escape(repr(value))}; "
                                        r"expected a non-empty string"):
        load_conversations(DataConfig(source=str(path), max_bad_rows=0))


def test_a_listed_file_that_does_not_exist_is_named_before_any_is_read(tmp_path: Path, monkeypatch):
    good = _rows(tmp_path / "good.jsonl", [_chat("1")])
    read = []
    monkeypatch.setattr("eagle3.data.conversations.scan_jsonl", lambda *a, **k: read.append(a) or ([], []))
    with pytest.raises(DataError, match=r"data.source entry '.*missing.jsonl' \(of \[.*\]\): no such file"):
        load_source(DataConfig(source=[str(good), str(tmp_path / "missing.jsonl")]))
    assert read == []  # good.jsonl was not read first


def test_a_bad_source_list_is_a_config_error_naming_the_setting(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"data.source: data.source=\[\]: expected a JSONL file path"):
        build_config("tiny", overrides=["data.source=[]"])
    with pytest.raises(ConfigError, match=r"data.source: .*'a/x.jsonl' and 'b/x.jsonl' both give the source name 'x'"):
        build_config("tiny", overrides=["data.source=[a/x.jsonl, b/x.jsonl]"])
    config = build_config("tiny", overrides=["data.source=[a.jsonl, builtin:chatterbot]"])
    assert config.data.source == ["a.jsonl", "builtin:chatterbot"]
    assert build_config("tiny", overrides=["data.source=one.jsonl"]).data.source == "one.jsonl"  # a string stays a string


def test_an_entry_that_max_samples_never_reaches_is_an_error(tmp_path: Path):
    first = _rows(tmp_path / "first.jsonl", [_chat(str(i)) for i in range(3)])
    second = _rows(tmp_path / "second.jsonl", [_chat("1")])
    with pytest.raises(DataError, match=r"data.source entry '.*second.jsonl' is never read: data.max_samples=3"):
        load_source(DataConfig(source=[str(first), str(second)], max_samples=3))

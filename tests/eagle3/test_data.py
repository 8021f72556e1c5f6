from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3.data.conversations import (
    Conversation,
    DataConfig,
    DataError,
    Message,
    is_heldout,
    load_conversations,
    tokenize_conversation,
)


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

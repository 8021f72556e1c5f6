"""Stage entry points: artifacts in, one artifact out, each idempotent.

One function per DAG stage. Each takes its settings and the records of its inputs, writes
`<artifact_root>/<stage>/<fingerprint>/`, and returns a StageRecord. When a whole artifact
is already there it is returned without work, so a task re-run by Prefect (or by hand)
never repeats finished work. Stages that can resume (extract, train) build in place and
write their completion marker last; the others build in a temporary folder that is
renamed into place only when whole.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from eagle3.artifacts import (
    StageRecord,
    atomic_write_text,
    building,
    mark_complete,
    read_complete,
    remove_stale_builds,
)
from eagle3.capture import vllm_adapter
from eagle3.capture.data_parallel import Split, extract_with_engines
from eagle3.gpu.devices import cuda_visible
from eagle3.capture.extract import FAN_OUT_SETTINGS, ExtractConfig, check_inputs, extract_store, storage_dtype
from eagle3.capture import synthesize as synth
from eagle3.capture.regenerate import JOURNAL, RUNTIME_REGENERATE_SETTINGS, RegenerateConfig, regenerate
from eagle3.data import conversations
from eagle3.data.builtin_targets import default_cache_dir
from eagle3.data.conversations import DataConfig, DataError
from eagle3.data.images import image_urls, placeholder_id
from eagle3.data.target import (
    HEAD_FILE,
    INFO_FILE,
    TargetConfig,
    TargetInfo,
    read_target_info,
    resolve_model_dir,
    target_fingerprint,
)
from eagle3.draft.architecture import read_text_config
from eagle3.draft.target_head import extract_target_head
from eagle3.engine import pool as engine_pool
from eagle3.fingerprint import fingerprint, hash_files

log = logging.getLogger(__name__)
# Bump a stage's version when its output format or meaning changes.
VERSIONS = {
    "stage_target": "1",
    "synthesize": "1",
    "regenerate": "2",  # 2: turn by turn (max_turns), reasoning kept apart (reasoning_content), template kwargs
    "prepare_data": "1",
    "extract": "1",
    "vocab": "1",
    "train": "2",  # 2: the draft's residual is hidden_norm(hidden) (norm_before_residual=True)
    "export": "1",
    "evaluate": "2",  # 2: served report ranks each difference in both runs (top-20 logprobs), proven near-ties
}
Progress = Callable[[int, int, int], None]  # (done, total, tokens processed so far)
# Regenerate sends the prompts to the engine this many at a time, so that its progress moves
# between calls (None: all at once). See eagle3.capture.regenerate for why the value is what it is.
REGENERATE_REQUESTS_PER_CALL: int | None = None
BAD_ROWS = "bad_rows.jsonl"  # prepare_data: the source rows skipped, one {"source", "line", "reason"} a line
# In regenerate's fingerprint only when the data may name data sources (conversations.names_sources): an artifact
# written before sources were kept does not carry them, and data without sources keeps its fingerprints.
SOURCES_VERSION = "1"
TEMPLATE_KWARGS = "chat_template_kwargs.json"  # regenerate: regenerate.chat_template_kwargs, which prepare_data renders with


def stage_fingerprint(stage: str, settings: object, *upstream: str) -> str:
    return fingerprint(stage, VERSIONS[stage], settings, *upstream)


def out_dir(root: Path, stage: str, fp: str) -> Path:
    return Path(root) / stage / fp


def _done(root: Path, stage: str, fp: str) -> tuple[Path, StageRecord | None]:
    final = out_dir(root, stage, fp)
    remove_stale_builds(final.parent)
    return final, read_complete(final)


def _once(load: Callable[[], object]) -> Callable[[], object]:
    """`load` called at most once, on first use."""
    cache: list[object] = []
    return lambda: cache[0] if cache else (cache.append(load()) or cache[0])


# -- stage_target ------------------------------------------------------------------------
# How the target is run, not what it computes: changing them reuses every artifact.
RUNTIME_TARGET_SETTINGS = {"max_model_len", "kv_cache_gib", "tensor_parallel_size", "data_parallel_size", "keep_warm_s",
                           "sleep_during_train", "devices"}


def fingerprint_target(config: TargetConfig) -> str:
    return stage_fingerprint("stage_target", config.model_dump(exclude=RUNTIME_TARGET_SETTINGS), target_fingerprint(config))


def run_stage_target(config: TargetConfig, cache_dir: Path, root: Path, fp: str) -> StageRecord:
    final, done = _done(root, "stage_target", fp)
    if done:
        return done
    model_dir = resolve_model_dir(config, cache_dir)
    info = read_target_info(config, model_dir)
    with building(final) as tmp:
        (tmp / INFO_FILE).write_text(info.to_json())
        extract_target_head(model_dir, tmp / HEAD_FILE)
        text = read_text_config(model_dir)  # model_type and kv_lora_rank travel with the record: train.draft's auto
        stats = {"model_dir": info.model_dir, "num_layers": info.num_layers, "hidden_size": info.hidden_size,
                 "vocab_size": info.vocab_size, "aux_layer_ids": json.dumps(info.aux_layer_ids),
                 "model_type": str(text.get("model_type", "")), "kv_lora_rank": int(text.get("kv_lora_rank") or 0)}
        record = mark_complete(tmp, StageRecord(stage="stage_target", uri=str(final), fingerprint=fp, stats=stats))
    return record


def engine_spec(config: TargetConfig, target: StageRecord, load_log: Path | None, images: bool = False) -> vllm_adapter.EngineSpec:
    """`images`: the data holds images, so a multimodal target loads its vision tower (text-only data: the spec as
    before, language_model_only)."""
    spec = spec_from_info(config, TargetInfo.read(target.path), load_log)
    return dataclasses.replace(spec, language_model_only=False) if images else spec


def spec_from_info(config: TargetConfig, info: TargetInfo, load_log: Path | None) -> vllm_adapter.EngineSpec:
    """The engine a run of `config` loads (or attaches to: `eagle3 engine start` builds the same one)."""
    return vllm_adapter.EngineSpec(
        model_dir=info.model_dir, dtype=config.dtype, max_model_len=config.max_model_len,
        kv_cache_gib=config.kv_cache_gib, tensor_parallel_size=config.tensor_parallel_size,
        trust_remote_code=config.trust_remote_code, seed=0, load_log=None if load_log is None else str(load_log),
        enable_sleep_mode=config.sleep_during_train, devices=cuda_visible(config.devices),
    )


def target_engine(config: TargetConfig, target: StageRecord, load_log: Path, images: bool = False) -> Callable[[], object]:
    """The target's vLLM engine, asked for on first use: a warm engine (attached, or started when
    target.keep_warm_s > 0) or the in-process pool (eagle3.engine.pool); a load or attach is a line of `load_log`.
    `images`: as engine_spec's."""
    spec = engine_spec(config, target, load_log, images)
    keep = engine_pool.keep_warm_seconds(config.keep_warm_s)
    fp = TargetInfo.read(target.path).content_fingerprint
    run_dir = Path(load_log).parent.parent  # <run_dir>/logs/target_loads.jsonl
    return lambda: engine_pool.acquire(spec, fp, keep, default_cache_dir(), run_dir=run_dir)


def check_image_engine(config: TargetConfig, stage: str, endpoint: str | None = None, backend: str = "vllm") -> None:
    """Data with images runs through a vLLM engine of ours, in this process or warm, with any TP size
    (eagle3.capture.source, eagle3.engine): DataError naming the setting otherwise, before any engine is reached."""
    problems = [f"{name}={value!r}" for name, value, bad in (
        ("regenerate.endpoint", endpoint, endpoint is not None),
        ("extract.backend", backend, backend != "vllm"),
        ("target.data_parallel_size", config.data_parallel_size, config.data_parallel_size > 1 and stage == "extract"),
    ) if bad]
    if problems:
        raise DataError(f"{stage}: the data holds images, which only our own vLLM engine takes (in this process or "
                        f"warm, one engine); {', '.join(problems)} (expected regenerate.endpoint unset, "
                        "extract.backend='vllm', target.data_parallel_size=1)")


def _load_hf(info: TargetInfo, config: TargetConfig, load_log: Path) -> object:
    """The target in transformers (extract.backend 'hf'), its load recorded like an engine's."""
    from eagle3.capture.hf_source import load_hf_target

    started = time.time()
    model = load_hf_target(info.model_dir, dtype=config.dtype, trust_remote_code=config.trust_remote_code)
    engine_pool.record_load(load_log, {"event": "loaded", "backend": "hf", "model": info.model_dir, "pid": os.getpid(),
                                       "seconds": round(time.time() - started, 2), "time": time.time(), "preflight": None})
    return model


def _endpoint(config: RegenerateConfig, target_config: TargetConfig, target: StageRecord, tokenizer, load_log: Path) -> object:  # noqa: ANN001
    """regenerate.endpoint, checked against the target (eagle3.engine.endpoint); noted in `load_log` (no load)."""
    from eagle3.data.conversations import Message, _template_ids
    from eagle3.engine.endpoint import open_endpoint

    info = TargetInfo.read(target.path)
    engine = open_endpoint(config.endpoint, config.api_key_env, target_model=target_config.model, model_dir=info.model_dir,
                           max_model_len=target_config.max_model_len, tokenizer=tokenizer,
                           template_ids=lambda chat: _template_ids(tokenizer, [Message(m["role"], m["content"]) for m in chat],
                                                                   add_generation_prompt=True))
    engine_pool.record_load(load_log, {"event": "endpoint", "url": config.endpoint, "model": engine.model, "time": time.time()})
    return engine


def _tokenizer(target: StageRecord, trust_remote_code: bool):  # noqa: ANN202
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TargetInfo.read(target.path).model_dir, trust_remote_code=trust_remote_code)


# -- synthesize (data.source=synthesize) -------------------------------------------------
SYNTHESIZED = "conversations.jsonl"  # synthesize: regenerate's input (eagle3.capture.synthesize)


def fingerprint_synthesize(config: synth.SynthesizeConfig, regen: RegenerateConfig, target: StageRecord) -> str:
    """The prompts depend on their settings, the target and the template variables the prefix is rendered with."""
    settings = {"synthesize": config, "chat_template_kwargs": regen.chat_template_kwargs}
    return stage_fingerprint("synthesize", settings, target.fingerprint)


def run_synthesize(config: synth.SynthesizeConfig, regen: RegenerateConfig, target_config: TargetConfig,
                   target: StageRecord, root: Path, fp: str, load_log: Path, progress: Progress | None = None) -> StageRecord:
    """The target writes config.prompts distinct user prompts (eagle3.capture.synthesize); built in place, so that its
    journal outlives a killed run, the completion marker last. The template is checked before anything is written."""
    final, done = _done(root, "synthesize", fp)
    if done:
        return done
    tokenizer = _tokenizer(target, target_config.trust_remote_code)
    info = TargetInfo.read(target.path)
    turn = synth.user_turn(tokenizer, config.system_prompts, regen.chat_template_kwargs, info.model_dir)
    longest = max(len(p) for p in turn.prefixes) + config.max_prompt_tokens
    if longest > target_config.max_model_len:
        raise DataError(f"synthesize.max_prompt_tokens={config.max_prompt_tokens}: a user-turn prefix plus it takes "
                        f"{longest} tokens, more than target.max_model_len={target_config.max_model_len}; lower "
                        "synthesize.max_prompt_tokens (or shorten synthesize.system_prompts)")
    final.mkdir(parents=True, exist_ok=True)
    engine = (target_engine(target_config, target, load_log) if regen.endpoint is None
              else _once(lambda: _endpoint(regen, target_config, target, tokenizer, load_log)))
    result = synth.synthesize(tokenizer, engine, config, turn, final / synth.JOURNAL, progress)
    if not result.kept:
        raise DataError(f"synthesize: the target wrote no usable prompt in {result.requests} requests ({result.dropped}); "
                        "raise synthesize.temperature or synthesize.max_prompt_tokens")
    if len(result.kept) < config.prompts:
        log.warning("synthesize: kept %d of synthesize.prompts=%d prompts after %d requests (dropped: %s); raise "
                    "synthesize.max_rounds or synthesize.temperature for more", len(result.kept), config.prompts,
                    result.requests, result.dropped)
    conversations.write_conversations(final / f".{SYNTHESIZED}.tmp", synth.conversations_of(result.kept, config.system_prompts))
    os.replace(final / f".{SYNTHESIZED}.tmp", final / SYNTHESIZED)
    stats = {"prompts": len(result.kept), "wanted": config.prompts, "requests": result.requests,
             "reused_requests": result.reused, "generated_tokens": result.generated_tokens,
             "cut": sum(row.cut for row in result.kept), **{f"dropped_{k.replace('-', '_')}": v for k, v in result.dropped.items()},
             "sample": json.dumps([row.text for row in result.kept[:SAMPLE_PROMPTS]], ensure_ascii=False)}
    return mark_complete(final, StageRecord(stage="synthesize", uri=str(final), fingerprint=fp, stats=stats))


SAMPLE_PROMPTS = 5  # prompts the synthesize stage's record (and the run's data report) shows


def synthesized_data(config: DataConfig, synthesized: StageRecord, prompts: int) -> DataConfig:
    """The data settings regenerate and prepare_data run with after synthesis: the synthesized conversations as the
    source, all of them (`prompts`: synthesize.prompts)."""
    return config.model_copy(update={"source": str(synthesized.path / SYNTHESIZED), "max_samples": prompts})


def _keyed_source(config: DataConfig) -> dict:
    """The data settings as fingerprints hash them: a synthesized file (synthesized_data) is named by its synthesize
    fingerprint, not by its path, which holds this run's folder where the artifact root is a URL (its local mirror);
    every other source as it is."""
    settings = config.model_dump(mode="json")
    path = Path(config.source) if isinstance(config.source, str) else None
    if path is not None and path.name == SYNTHESIZED and path.parent.parent.name == "synthesize":
        settings["source"] = f"synthesize:{path.parent.name}"
    return settings


# -- regenerate --------------------------------------------------------------------------
def fingerprint_regenerate(config: RegenerateConfig, data_config: DataConfig, target: StageRecord, max_model_len: int) -> str:
    source = hash_files(conversations.source_files(data_config.source))
    settings = {"regenerate": config.model_dump(mode="json", exclude=RUNTIME_REGENERATE_SETTINGS),
                "source": _keyed_source(data_config)["source"], "max_samples": data_config.max_samples}
    if conversations.names_sources(data_config.source):
        settings["sources"] = SOURCES_VERSION
    if conversations.has_parts(data_config.source):  # content parts checked (DataError) before any load
        chats = conversations.load_conversations(data_config)
        images = conversations.check_content(chats, TargetInfo.read(target.path).model_dir)
        if images:  # sha256 of each image's bytes: a changed image moves this and every later stage
            settings["images"] = sorted(images.items())
    if not config.enabled:
        return stage_fingerprint("regenerate", settings, source)
    return stage_fingerprint("regenerate", settings | {"max_model_len": max_model_len}, source, target.fingerprint)


def run_regenerate(config: RegenerateConfig, data_config: DataConfig, target_config: TargetConfig, target: StageRecord,
                   root: Path, fp: str, load_log: Path, progress: Progress | None = None) -> StageRecord:
    """`progress`: (requests answered, requests in all, tokens generated), see eagle3.capture.regenerate."""
    final, done = _done(root, "regenerate", fp)
    if done:
        return done
    chats = conversations.load_conversations(data_config)
    answered = [c for c in chats if any(m.role == "assistant" for m in c.messages)]
    if not answered:
        raise DataError(
            f"data.source={data_config.source!r}: none of its {len(chats)} conversations has an assistant turn; "
            "expected user/assistant conversations (prompts are the turns before the first assistant turn)"
        )
    images = config.enabled and any(image_urls(c.messages) for c in answered)
    if images:  # refused before anything is written or loaded
        check_image_engine(target_config, "regenerate", endpoint=config.endpoint)
    skipped, generated, reused = 0, 0, 0
    final.mkdir(parents=True, exist_ok=True)  # built in place: the per-turn journal outlives a killed run, marker last
    if config.enabled:
        tokenizer = _tokenizer(target, target_config.trust_remote_code)
        engine = (target_engine(target_config, target, load_log, images) if config.endpoint is None
                  else _once(lambda: _endpoint(config, target_config, target, tokenizer, load_log)))
        result = regenerate(answered, tokenizer, engine, config, target_config.max_model_len, progress=progress,
                            requests_per_call=REGENERATE_REQUESTS_PER_CALL, journal=final / JOURNAL)
        answered, skipped, generated = result.conversations, result.skipped_too_long, result.generated_tokens
        reused = result.reused_turns
    conversations.write_conversations(final / ".conversations.jsonl.tmp", answered)
    os.replace(final / ".conversations.jsonl.tmp", final / "conversations.jsonl")
    atomic_write_text(final / TEMPLATE_KWARGS, json.dumps(config.chat_template_kwargs))  # prepare_data renders with them
    stats = {"conversations": len(answered), "skipped": skipped, "generated_tokens": generated,
             "regenerated": int(config.enabled), "turns": sum(sum(m.role == "assistant" for m in c.messages) for c in answered),
             "reused_turns": reused}
    return mark_complete(final, StageRecord(stage="regenerate", uri=str(final), fingerprint=fp, stats=stats))


# -- prepare_data ------------------------------------------------------------------------
def fingerprint_prepare(config: DataConfig, regenerated: StageRecord, target: StageRecord) -> str:
    return stage_fingerprint("prepare_data", _keyed_source(config), regenerated.fingerprint, target.fingerprint)


def run_prepare(config: DataConfig, regenerated: StageRecord, target: StageRecord, trust_remote_code: bool, root: Path, fp: str) -> StageRecord:
    """Tokenize the regenerated conversations and split them; also reports the source rows that were skipped.

    Stats: train/heldout samples, `dropped` (no assistant token left after truncation),
    `truncated` (cut to data.max_tokens), `skipped_rows` (unusable source rows, see
    data.max_bad_rows) and `bad_rows_report` (the artifact's bad_rows.jsonl: line and reason of each).
    """
    final, done = _done(root, "prepare_data", fp)
    if done:
        return done
    _, bad_rows = conversations.load_source(config)  # the rows regenerate skipped, for the report (cheap: no tokenizing)
    tokenizer = _tokenizer(target, trust_remote_code)
    chats = conversations.load_conversations(DataConfig(source=str(regenerated.path / "conversations.jsonl"), max_samples=10**9))
    kwargs_file = regenerated.path / TEMPLATE_KWARGS
    template_kwargs = json.loads(kwargs_file.read_text()) if kwargs_file.is_file() else {}
    # image placeholders are never learned; text-only data is tokenized as before
    images = any(image_urls(c.messages) for c in chats)
    placeholder = placeholder_id(TargetInfo.read(target.path).model_dir) if images else None
    train, heldout, dropped, truncated = [], [], 0, 0
    for conv in chats:
        held = conversations.is_heldout(conv.id, config.heldout_fraction, config.split_seed)  # a conversation's samples stay together
        for sample in conversations.tokenize_turns(tokenizer, conv, config.max_tokens, template_kwargs, placeholder):
            truncated += len(sample.input_ids) == config.max_tokens
            if sum(sample.loss_mask) == 0:
                dropped += 1
                continue
            (heldout if held else train).append(sample)
    if not train:
        raise DataError(
            f"data.source={config.source!r}: no usable training sample ({len(chats)} conversations, {dropped} samples "
            f"without an assistant token after truncation to data.max_tokens={config.max_tokens}, {len(bad_rows)} source rows skipped)"
        )
    with building(final) as tmp:
        conversations.write_samples(tmp / "train.jsonl", train)
        conversations.write_samples(tmp / "heldout.jsonl", heldout)
        conversations.write_bad_rows(tmp / BAD_ROWS, config.source, bad_rows)
        stats = {"train_samples": len(train), "heldout_samples": len(heldout), "dropped": dropped, "truncated": truncated,
                 "train_tokens": sum(len(s.input_ids) for s in train), "skipped_rows": len(bad_rows),
                 "bad_rows_report": str(final / BAD_ROWS)}
        if any(s.source is not None for s in train + heldout):  # {source: [train samples, held-out samples]}
            counts = {src: [sum(s.source == src for s in train), sum(s.source == src for s in heldout)]
                      for src in dict.fromkeys(s.source for s in train + heldout)}
            stats["sources"] = json.dumps(counts)
        return mark_complete(tmp, StageRecord(stage="prepare_data", uri=str(final), fingerprint=fp, stats=stats))


# -- extract -----------------------------------------------------------------------------
def fingerprint_extract(config: ExtractConfig, target_config: TargetConfig, prepared: StageRecord, target: StageRecord) -> str:
    settings = {"extract": config.model_dump(mode="json", exclude=FAN_OUT_SETTINGS), "dtype": target_config.dtype,
                "aux_layer_ids": target.stats["aux_layer_ids"]}
    if config.too_long == "truncate":  # then max_model_len changes what is stored
        settings["max_model_len"] = target_config.max_model_len
    if config.store_budget_gib is not None:  # online/hybrid: the train split is stored only up to the budget
        settings["store_budget_gib"] = config.store_budget_gib
    return stage_fingerprint("extract", settings, prepared.fingerprint, target.fingerprint)


def states_fingerprint(extracted: StageRecord) -> str:
    """Names the hidden states training reads, however they reach it: an online/hybrid extract artifact records the
    fingerprint the full store of the same data would have (train and evaluate are named by it, so the three
    train.data modes share one train artifact), a store's own fingerprint is that."""
    return str(extracted.stats.get("states_fingerprint", extracted.fingerprint))


def online_extract_config(data: str, config: ExtractConfig) -> ExtractConfig:
    """The extract settings a run uses for train.data `data`: 'online' stores none of the train split
    (extract.store_budget_gib 0), 'hybrid' up to extract.store_budget_gib, 'store' all of it (unchanged)."""
    return config.model_copy(update={"store_budget_gib": 0.0}) if data == "online" else config


TRAIN_LENGTHS_FILE = "train_lengths.json"  # online/hybrid with images: per train sample its tokens, images expanded
ONLINE_KEEP_WARM_S = 60.0  # train.data online/hybrid: the least target.keep_warm_s (the engine must be a process)


def online_target_config(config: TargetConfig) -> TargetConfig:
    """train.data online/hybrid: the target runs in a warm engine process (eagle3.engine), never in-process, so that
    it stays loaded from extract through training beside the trainer: target.keep_warm_s at least ONLINE_KEEP_WARM_S
    (how long a failed run leaves it up; a finished run stops it after training)."""
    keep = engine_pool.keep_warm_seconds(config.keep_warm_s)
    return config.model_copy(update={"keep_warm_s": max(keep, ONLINE_KEEP_WARM_S)})


def run_extract(config: ExtractConfig, target_config: TargetConfig, prepared: StageRecord, target: StageRecord,
                root: Path, fp: str, load_log: Path, progress: Progress | None = None) -> StageRecord:
    final, done = _done(root, "extract", fp)
    if done:
        return done
    info = TargetInfo.read(target.path)
    splits = {split: conversations.read_samples(prepared.path / f"{split}.jsonl") for split in ("train", "heldout")}
    images = any(s.images for v in splits.values() for s in v)  # then the vision tower is loaded
    if images:
        check_image_engine(target_config, "extract", backend=config.backend)
    spec = engine_spec(target_config, target, load_log, images)
    dtype = storage_dtype(config, target_config.dtype)
    if config.backend == "hf":  # small models, reference runs; loaded lazily like the engine
        get_engine = _once(lambda: _load_hf(info, target_config, load_log))
    else:
        get_engine = target_engine(target_config, target, load_log, images)  # the pool loads or attaches once per process
    lengths = _train_lengths(config, target_config, info, splits["train"], get_engine)  # online/hybrid: images expanded
    online = _keep_within_budget(config, target_config, info, splits, dtype, lengths)  # train.data online/hybrid
    shards = {split: -(-len(samples) // config.samples_per_shard) for split, samples in splits.items()}
    stats: dict[str, int | float | str] = {}
    engines_wrote: dict[str, int] | None = None
    per_shard_all = sum(len(s.input_ids) for v in splits.values() for s in v) / max(sum(shards.values()), 1)
    if target_config.data_parallel_size > 1 and config.backend == "vllm":
        for split, samples in splits.items():  # bad input is refused here, before any engine starts
            check_inputs(samples, info.aux_layer_ids, info.num_layers, target_config.max_model_len, config.too_long)
        engines_wrote = extract_with_engines(
            {split: Split(str(prepared.path / f"{split}.jsonl"), str(final / split)) for split in splits},
            spec=spec, engines=target_config.data_parallel_size, config=config, aux_layer_ids=info.aux_layer_ids,
            num_layers=info.num_layers, hidden_size=info.hidden_size, dtype=str(dtype).removeprefix("torch."),
            max_model_len=target_config.max_model_len,
            run_dir=Path(load_log).parent.parent,  # <run_dir>/logs/target_loads.jsonl: gpu_cleanup's record of our processes
            progress=None if progress is None else lambda done, total: progress(done, total, int(done * per_shard_all)))

        def get_engine() -> object:  # every shard is written: asking for an engine now would be a bug
            raise RuntimeError("extract: the data-parallel engines left shards unwritten")
    offset, tokens_before = 0, 0  # one bar for both splits: the held-out shards count after the train ones
    seconds_written, tokens_written = 0.0, 0
    for split, samples in splits.items():
        tokens = sum(len(s.input_ids) for s in samples)
        per_shard = tokens / max(shards[split], 1)  # the rate's tokens: shards hold equal sample counts, not tokens
        report = None if progress is None else (
            lambda done, _total, o=offset, b=tokens_before, t=per_shard:
            progress(o + done, sum(shards.values()), int(b + done * t)))
        started = time.monotonic()
        result = extract_store(
            samples, final / split, get_engine=get_engine, aux_layer_ids=info.aux_layer_ids,
            num_layers=info.num_layers, hidden_size=info.hidden_size, config=config, dtype=dtype, progress=report,
            max_model_len=target_config.max_model_len,
        )
        if result.shards_written:  # the measured extraction rate (the hybrid plan's target time per epoch)
            seconds_written += time.monotonic() - started
            tokens_written += result.tokens * result.shards_written // max(shards[split], 1)
        offset, tokens_before = offset + shards[split], tokens_before + tokens
        written = result.shards_written if engines_wrote is None else engines_wrote[split]
        stats |= {f"{split}_samples": result.samples, f"{split}_tokens": result.tokens,
                  f"{split}_shards_written": written, f"{split}_shards_reused": shards[split] - written}
    if any(s.images for s in splits["heldout"]):  # the served evaluation sends these prompts with their images
        stats["heldout_samples_file"] = str(prepared.path / "heldout.jsonl")
    if online is not None:
        stats |= online | {"states_fingerprint": fingerprint_extract(config.model_copy(update={"store_budget_gib": None}),
                                                                      target_config, prepared, target),
                           "train_samples_file": str(prepared.path / "train.jsonl")}
        if lengths is not None:  # the train split holds images: its lengths as the engine runs it (online_data)
            atomic_write_text(final / TRAIN_LENGTHS_FILE, json.dumps(lengths))
            stats["train_lengths_file"] = str(final / TRAIN_LENGTHS_FILE)
        if seconds_written:
            stats["capture_tokens_per_s"] = round(tokens_written / seconds_written, 1)
    return mark_complete(final, StageRecord(stage="extract", uri=str(final), fingerprint=fp, stats=stats))


def _train_lengths(config: ExtractConfig, target_config: TargetConfig, info: TargetInfo, samples: list,
                   get_engine: Callable[[], object]) -> list[int] | None:
    """extract.store_budget_gib set (train.data online/hybrid) and train samples with images: per train sample the
    tokens the engine runs, each image's placeholder expanded by vLLM's processor (asked without a forward), so the
    budget, the trainer's micro-batches and the online buffer see the store's lengths; None otherwise."""
    if config.store_budget_gib is None or not any(s.images for s in samples):
        return None
    check_inputs(samples, info.aux_layer_ids, info.num_layers, target_config.max_model_len, config.too_long)
    imaged = [s for s in samples if s.images]
    engine = get_engine()
    expand = getattr(engine, "expand_images", None)  # a warm engine: its processor, in the engine process
    if expand is None:
        from eagle3.capture.vllm_images import expand_prompts

        expand = lambda prompts, images: expand_prompts(engine, prompts, images)  # noqa: E731 - a vllm.LLM here
    expanded = dict(zip((s.id for s in imaged), expand([s.input_ids for s in imaged], [list(s.images) for s in imaged]),
                        strict=True))
    return [len(expanded[s.id]) if s.images else len(s.input_ids) for s in samples]


def _keep_within_budget(config: ExtractConfig, target_config: TargetConfig, info: TargetInfo, splits: dict,
                        dtype: object, lengths: list[int] | None) -> dict[str, int | float] | None:
    """extract.store_budget_gib set (train.data online/hybrid): cut splits["train"] to the first samples whose states
    fit (`lengths`: as the engine runs them, None: as prepared); returns {"train_kept", "train_samples_total"} (None:
    the whole train split is stored)."""
    if config.store_budget_gib is None:
        return None
    from eagle3.online.feed import GIB, kept_samples

    checked = check_inputs(splits["train"], info.aux_layer_ids, info.num_layers, target_config.max_model_len, config.too_long)
    kept = kept_samples(lengths or [len(s.input_ids) for s in checked], int(config.store_budget_gib * GIB),
                        len(info.aux_layer_ids) + 1, info.hidden_size, dtype)
    total = len(splits["train"])
    splits["train"] = splits["train"][:kept]
    return {"train_kept": kept, "train_samples_total": total, "store_budget_gib": config.store_budget_gib}

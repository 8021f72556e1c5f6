"""Online training data (eagle3.online.feed) on the tiny draft world, with a capture that answers from the
tiny store: the same losses as the store run, a buffer that stays within its bound, every shard gone at the end.
The real engine's online run is tests/eagle3/test_online.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from eagle3.capture.store import StoreReader, StoreWriter
from eagle3.online.feed import (OnlineData, OnlineDataError, OnlineSample, check_buffer, kept_samples, plan_text,
                                shard_bytes)
from eagle3.online.remote import buffer_bytes_on_disk
from eagle3.train.trainer import TrainConfig, train_draft
from tests.eagle3.draft_fixtures import AUX_LAYER_IDS, HIDDEN, TRAIN_KW, one_thread, tiny_world  # noqa: F401

STEPS = 12


def _samples() -> list:
    return list(StoreReader(tiny_world().train_store))


def _online(tmp_path: Path, buffer_bytes: int, kept: int = 0, calls: list | None = None) -> OnlineData:
    samples = _samples()
    by_ids = {tuple(s.input_ids.tolist()): s.hidden_states for s in samples}

    def capture(prompts):
        if calls is not None:
            calls.append(len(prompts))
        return [by_ids[tuple(p)][: len(p)].clone() for p in prompts]  # what the target would give: [T, n, H]

    kept_store = None
    if kept:
        kept_store = tmp_path / "kept"
        writer = StoreWriter(kept_store, aux_layer_ids=AUX_LAYER_IDS, hidden_size=HIDDEN, dtype=torch.float32,
                             expected_shards=[[s.sample_id for s in samples[:kept]]])
        writer.write_shard(0, samples[:kept])
    return OnlineData(samples=[OnlineSample(s.input_ids.tolist(), s.loss_mask.int().tolist()) for s in samples],
                      kept=kept, kept_store=kept_store, capture=capture, buffer_dir=tmp_path / "buffer",
                      buffer_bytes=buffer_bytes, aux_layer_ids=AUX_LAYER_IDS, hidden_size=HIDDEN,
                      storage_dtype=torch.float32)


def _train(out: Path, online: OnlineData | None = None, stop_after: int | None = None):
    world = tiny_world()
    config = TrainConfig(steps=STEPS, checkpoint_every=4, **TRAIN_KW)
    return train_draft(config, store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                       vocab_path=world.vocab_path, out_dir=out, online=online, stop_after=stop_after)


def _one_shard() -> int:
    return shard_bytes(TRAIN_KW["batch_tokens"], TRAIN_KW["batch_tokens"], len(AUX_LAYER_IDS) + 1, HIDDEN, torch.float32)


def test_online_and_hybrid_give_the_store_runs_losses_and_leave_no_shard(tmp_path):
    store = _train(tmp_path / "store")
    calls: list[int] = []
    online = _train(tmp_path / "online", _online(tmp_path / "o", 2 * _one_shard(), calls=calls))
    assert online.losses == pytest.approx(store.losses, abs=1e-6)
    assert online.online["tokens_captured"] > 0 and calls
    hybrid = _train(tmp_path / "hybrid", _online(tmp_path / "h", 2 * _one_shard(), kept=20))
    assert hybrid.losses == pytest.approx(store.losses, abs=1e-6)
    assert hybrid.online["tokens_captured"] < online.online["tokens_captured"]  # the kept half is read, not captured
    assert not (tmp_path / "o" / "buffer").exists() and not (tmp_path / "h" / "buffer").exists()


def test_the_buffer_on_disk_stays_within_its_bound(tmp_path):
    budget = int(1.5 * _one_shard())
    data = _online(tmp_path, budget)
    peak, done = [0], threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], buffer_bytes_on_disk(data.buffer_dir))  # skips a shard gone since listing
            time.sleep(0.001)

    watcher = threading.Thread(target=poll)
    watcher.start()
    try:
        result = _train(tmp_path / "out", data)
    finally:
        done.set()
        watcher.join()
    assert 0 < peak[0] <= budget + _one_shard()
    assert result.online["buffer_peak_bytes"] <= budget


def test_a_resumed_online_run_continues_the_same_trajectory(tmp_path):
    straight = _train(tmp_path / "straight", _online(tmp_path / "a", 2 * _one_shard()))
    _train(tmp_path / "resumed", _online(tmp_path / "b", 2 * _one_shard()), stop_after=6)
    resumed = _train(tmp_path / "resumed", _online(tmp_path / "b", 2 * _one_shard()))
    assert resumed.resumed_from_step == 4
    assert resumed.losses == pytest.approx(straight.losses, abs=1e-6)


def test_a_failing_capture_is_one_error_naming_it_not_a_hang(tmp_path):
    data = _online(tmp_path, 2 * _one_shard())

    def broken(prompts):
        raise ConnectionError("warm engine pid 1 is gone")

    with pytest.raises(OnlineDataError, match="warm engine pid 1 is gone"):
        _train(tmp_path / "out", OnlineData(**(data.__dict__ | {"capture": broken})))


def test_a_buffer_smaller_than_one_shard_is_refused_naming_the_setting():
    with pytest.raises(OnlineDataError, match=r"online.buffer_gib=1e-05 .* smaller than one shard"):
        check_buffer(1e-5, 2048, 4, 576, torch.bfloat16)
    check_buffer(0.01, 2048, 4, 576, torch.bfloat16)


def test_the_hybrid_plan_keeps_a_prefix_that_fits_and_says_what_it_costs():
    assert kept_samples([10, 10, 10], budget_bytes=2 * 10 * (4 * 64 * 4 + 9), n_states=4, hidden_size=64,
                        dtype=torch.float32) == 2
    text = plan_text([10, 10, 10], kept=2, batch_tokens=8, budget_gib=0.5, tokens_per_s=4.0)
    assert "2 of 3 samples kept" in text and "8 tokens re-captured per epoch" in text and "2.0 s" in text


def test_a_buffer_folder_of_the_users_keeps_its_other_files(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    (folder / "batch-00000003.safetensors").write_bytes(b"a killed run's shard")
    data = _online(tmp_path, 2 * _one_shard())
    result = _train(tmp_path / "out", OnlineData(**(data.__dict__ | {"buffer_dir": folder})))
    assert result.steps_done == STEPS
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]

"""Training the draft: the loss falls, checkpoints are whole, resume continues the same run."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from eagle3.checkpoint import list_checkpoints, load_checkpoint
from eagle3.store import StoreReader
from eagle3.train import TrainConfig, TrainError, lr_at, next_batch_indices, train_draft
from tests.eagle3.draft_fixtures import TRAIN_KW, one_thread, tiny_world, trained_run  # noqa: F401


def _train(out_dir, stop_after=None, progress=None, **overrides):
    world = tiny_world()
    config = TrainConfig(**(dict(steps=12, checkpoint_every=4, **TRAIN_KW) | overrides))
    return train_draft(config, store_dir=world.train_store, target_dir=world.target_dir,
                       head_path=world.head_path, vocab_path=world.vocab_path, out_dir=out_dir,
                       stop_after=stop_after, progress=progress)


def _final_weights(result) -> dict[str, torch.Tensor]:
    return load_file(str(result.checkpoint / "model.safetensors"))


def test_sixty_steps_make_the_loss_fall_within_seconds():
    result = trained_run()
    assert result.steps_done == 60 and len(result.losses) == 60
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.3 * first, (first, last)
    assert result.seconds < 10
    assert result.tokens_seen > 60 * 100 and result.resumed_from_step is None
    assert result.checkpoint.name == "step-000060"


def test_losses_jsonl_has_every_step_with_per_ttt_step_losses_and_lr():
    result = trained_run()
    entries = [json.loads(line) for line in (result.checkpoint.parent.parent / "losses.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries] == list(range(1, 61))
    assert all(len(e["loss_per_ttt_step"]) == 3 for e in entries)
    assert [e["loss"] for e in entries] == pytest.approx(result.losses)
    assert entries[0]["lr"] == pytest.approx(lr_at(0, TrainConfig(steps=60, **TRAIN_KW)))


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    straight = _train(tmp_path / "straight")
    stopped = _train(tmp_path / "resumed", stop_after=6)  # killed after step 6: last checkpoint is step 4
    assert stopped.steps_done == 6 and stopped.checkpoint.name == "step-000004"
    reported = []
    resumed = _train(tmp_path / "resumed", progress=lambda *args: reported.append(args))
    assert resumed.resumed_from_step == 4 and resumed.steps_done == 12
    assert [(step, total) for step, total, _ in reported] == [(s, 12) for s in range(5, 13)]
    assert [loss for _, _, loss in reported] == pytest.approx(straight.losses[4:], abs=1e-6)
    assert resumed.losses == pytest.approx(straight.losses, abs=1e-6)
    for name, tensor in _final_weights(straight).items():
        torch.testing.assert_close(_final_weights(resumed)[name], tensor, rtol=0, atol=1e-6)
    assert resumed.tokens_seen == straight.tokens_seen


def test_a_truncated_latest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    straight = _train(tmp_path / "straight")
    _train(tmp_path / "run", stop_after=8)  # checkpoints 4 and 8
    newest = tmp_path / "run" / "checkpoints" / "step-000008" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # a crash that cut the file
    with open(tmp_path / "run" / "losses.jsonl", "a") as log_file:
        log_file.write('{"step": 9, "lo')  # ... and the loss log in the middle of a line
    with caplog.at_level(logging.WARNING, logger="eagle3.checkpoint"):
        resumed = _train(tmp_path / "run")
    assert "step-000008" in caplog.text
    assert resumed.resumed_from_step == 4
    assert resumed.losses == pytest.approx(straight.losses, abs=1e-6)
    for name, tensor in _final_weights(straight).items():
        torch.testing.assert_close(_final_weights(resumed)[name], tensor, rtol=0, atol=1e-6)


def test_only_the_last_two_checkpoints_are_kept_and_they_load_weights_only(tmp_path):
    result = _train(tmp_path / "run")
    names = [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert names == ["step-000008", "step-000012"]
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]
    state = torch.load(result.checkpoint / "state.pt", weights_only=True)  # plain tensors, no pickled objects
    assert isinstance(state["rng"]["cpu"], torch.Tensor)
    assert state["data"]["epoch"] >= 0 and state["scheduler"]["last_step"] == 12
    assert load_checkpoint(result.checkpoint).step == 12


def test_a_finished_run_is_not_trained_again(tmp_path):
    first = _train(tmp_path / "run")
    again = _train(tmp_path / "run")
    assert again.resumed_from_step == 12 and again.steps_done == 12
    assert again.losses == first.losses and again.checkpoint == first.checkpoint


def test_resuming_with_other_settings_names_them(tmp_path):
    _train(tmp_path / "run", stop_after=4)
    with pytest.raises(TrainError, match="train.learning_rate"):
        _train(tmp_path / "run", learning_rate=1e-2)


def test_warmup_then_cosine_decay_to_the_floor():
    config = TrainConfig(steps=100, learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, config) == pytest.approx(0.1) and lr_at(9, config) == pytest.approx(1.0)
    assert lr_at(55, config) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, config) == pytest.approx(0.1)
    with pytest.raises(ValidationError, match="warmup_steps"):
        TrainConfig(steps=10, warmup_steps=10)


def test_every_epoch_visits_every_sample_once_in_a_seeded_order():
    lengths = [int(StoreReader(tiny_world().train_store)[i].num_tokens) for i in range(5)] * 8  # 40 samples
    def one_epoch(seed):
        seen, epoch, cursor = [], 0, 0
        while (epoch, cursor) != (0, 40):
            batch, epoch, cursor = next_batch_indices(lengths, seed, epoch, cursor, 200)
            assert sum(min(lengths[i], 200) for i in batch) <= 200 or len(batch) == 1
            seen += batch
        return seen
    assert sorted(one_epoch(0)) == list(range(40))
    assert one_epoch(0) == one_epoch(0) and one_epoch(0) != one_epoch(1)

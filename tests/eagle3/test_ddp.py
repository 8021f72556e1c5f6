"""Data parallel training: 2 processes under torchrun (gloo, CPU) follow the 1-process run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.train.ddp import DistContext, DistError, check_grad_accum
from eagle3.train.launch import resolve_num_processes, train_distributed
from eagle3.train.trainer import TrainConfig, train_draft
from tests.eagle3.draft_fixtures import TRAIN_KW, one_thread, tiny_world  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]

def _paths(world) -> dict[str, Path]:  # noqa: ANN001
    return {"store_dir": world.train_store, "target_dir": world.target_dir, "head_path": world.head_path,
            "vocab_path": world.vocab_path}


@pytest.mark.parametrize("feature_noise", [0.0, 0.3])
def test_two_processes_give_the_one_process_result_for_the_same_global_batch(tmp_path, monkeypatch, feature_noise):
    """The train stage's launcher (torchrun, gloo on the CPU) against one process, same global batch; with
    train.feature_noise each micro-batch gets the noise it gets in the one process, whichever rank reads it."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    world = tiny_world()
    config = TrainConfig(steps=8, checkpoint_every=4, grad_accum=2, num_processes=2, feature_noise=feature_noise,
                         **TRAIN_KW)  # 2 micro-batches per step
    seen: list[int] = []
    launched = train_distributed(config, 2, out_dir=tmp_path / "ddp", progress=lambda step, total, loss: seen.append(step),
                                 **_paths(world))
    single = train_draft(config, out_dir=tmp_path / "single", **_paths(world))
    assert launched.losses == pytest.approx(single.losses, abs=1e-5)
    assert single.losses[-1] < single.losses[0]  # it trained
    assert launched.steps_done == 8 and launched.checkpoint == tmp_path / "ddp" / "checkpoints" / "step-000008"
    assert seen and seen[-1] == 8  # rank 0's steps reached the stage's progress callback
    ddp_weights = load_file(str(launched.checkpoint / "model.safetensors"))
    for name, tensor in load_file(str(single.checkpoint / "model.safetensors")).items():
        torch.testing.assert_close(ddp_weights[name], tensor, rtol=0, atol=1e-5)
    assert not list((tmp_path / "ddp").glob(".launch-*")) and not (tmp_path / "ddp" / ".train-result.json").exists()


def test_a_run_stopped_on_two_processes_resumes_on_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    world = tiny_world()
    config = TrainConfig(steps=8, checkpoint_every=4, grad_accum=2, **TRAIN_KW)
    stopped = train_distributed(config.model_copy(update={"num_processes": 2}), 2, out_dir=tmp_path / "run", stop_after=4,
                                **_paths(world))
    assert stopped.steps_done == 4
    resumed = train_draft(config.model_copy(update={"num_processes": 1}), out_dir=tmp_path / "run", **_paths(world))
    straight = train_draft(config, out_dir=tmp_path / "straight", **_paths(world))
    assert resumed.resumed_from_step == 4
    assert resumed.losses == pytest.approx(straight.losses, abs=1e-5)


def test_num_processes_is_checked_before_any_process_starts():
    with pytest.raises(ValueError, match=r"train.grad_accum \(3\) does not split over train.num_processes \(2\)"):
        TrainConfig(grad_accum=3, num_processes=2)
    with pytest.raises(ValueError, match="train.num_processes is 0"):
        TrainConfig(num_processes=0)
    assert resolve_num_processes(TrainConfig(num_processes="auto")) == (torch.cuda.device_count() or 1)
    assert resolve_num_processes(TrainConfig(num_processes=2, grad_accum=4)) == 2  # the CPU takes any number
    with pytest.raises(DistError, match="train.grad_accum"):  # 'auto' resolved to a count that does not divide it
        check_grad_accum(3, DistContext(world_size=2))


def test_grad_accum_must_split_over_the_processes():
    check_grad_accum(4, DistContext(rank=1, world_size=2))
    with pytest.raises(DistError, match="train.grad_accum"):
        check_grad_accum(3, DistContext(rank=0, world_size=2))
    assert [DistContext(rank=1, world_size=2).owns(i) for i in range(4)] == [False, True, False, True]

"""train.tokens_per_step: larger steps on CUDA by default, the CPU's runs and fingerprints as before."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from eagle3.artifacts import StageRecord
from eagle3.train.config import TrainConfig, effective_grad_accum

UPSTREAM = [StageRecord(stage=n, uri="/x", fingerprint=n) for n in ("extract", "vocab", "stage_target")]


def test_auto_takes_eight_micro_batches_on_cuda_and_the_set_grad_accum_on_the_cpu():
    config = TrainConfig()  # batch_tokens 2048
    assert effective_grad_accum(config, cuda=True) == 8  # 16,384 tokens a step
    assert effective_grad_accum(config, cuda=False) == 1  # as before the setting
    assert effective_grad_accum(TrainConfig(batch_tokens=3000), cuda=True) == 6  # at least 16,384: 18,000
    assert effective_grad_accum(TrainConfig(grad_accum=3), cuda=True) == 3  # an explicit grad_accum wins over auto
    assert effective_grad_accum(config, cuda=True, ranks=3) == 9  # a multiple of the processes
    assert effective_grad_accum(TrainConfig(tokens_per_step=4096), cuda=False) == 2  # a number applies everywhere
    assert effective_grad_accum(TrainConfig(tokens_per_step=2048), cuda=True) == 1  # one micro-batch on a GPU


def test_a_bad_tokens_per_step_names_the_setting():
    with pytest.raises(ValidationError, match=r"train.tokens_per_step is 0; expected"):
        TrainConfig(tokens_per_step=0)
    with pytest.raises(ValidationError, match=r"train.tokens_per_step \(4096\) and train.grad_accum \(2\) both set"):
        TrainConfig(tokens_per_step=4096, grad_accum=2)
    with pytest.raises(ValidationError, match="tokens_per_step"):
        TrainConfig(tokens_per_step="all")


def test_the_fingerprint_names_the_setting_as_written_on_every_machine(monkeypatch):
    """'auto' resolves on the machine that trains (8 micro-batches on CUDA), but the fingerprint holds the setting
    as written, as it does for train.dtype='auto': a sweep's parent without a GPU names its points' artifacts before
    a GPU worker trains them, and both must name the same one; the CPU's fingerprint stays as before the setting."""
    from eagle3.draft_stages import fingerprint_train

    config = TrainConfig(steps=10, warmup_steps=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = fingerprint_train(config, *UPSTREAM)
    assert cpu == "c26cabe8f67fc68358c7"  # as test_train pins it, from before train.optimizer and this setting
    assert fingerprint_train(TrainConfig(steps=10, warmup_steps=1, tokens_per_step=4096), *UPSTREAM) != cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert fingerprint_train(config, *UPSTREAM) == cpu  # the same artifact, whichever machine names it
    assert fingerprint_train(TrainConfig(steps=10, warmup_steps=1, tokens_per_step=16384), *UPSTREAM) != cpu


def test_a_run_trains_the_tokens_per_step_asked_for(tmp_path):
    """On the CPU a number of tokens per step makes each step read that many micro-batches."""
    from tests.eagle3.draft_fixtures import TRAIN_KW, tiny_world
    from eagle3.train.trainer import train_draft

    world = tiny_world()
    kw = dict(TRAIN_KW, steps=3, warmup_steps=1, checkpoint_every=10)
    paths = dict(store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                 vocab_path=world.vocab_path)
    one = train_draft(TrainConfig(**kw), out_dir=tmp_path / "one", **paths)
    two = train_draft(TrainConfig(**kw, tokens_per_step=2 * kw["batch_tokens"]), out_dir=tmp_path / "two", **paths)
    accum = train_draft(TrainConfig(**kw, grad_accum=2), out_dir=tmp_path / "accum", **paths)
    assert two.losses == accum.losses and two.tokens_seen == accum.tokens_seen
    assert two.tokens_seen > one.tokens_seen

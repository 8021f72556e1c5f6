"""Warm start: training from an exported draft (the nightly run starts from the draft in service)."""

from __future__ import annotations

import pytest
import torch

from eagle3.draft.checkpoint import checkpoint_name
from eagle3.draft.export import export_draft, load_exported_draft
from eagle3.train.trainer import CHECKPOINTS, TrainConfig, TrainError, train_draft
from eagle3.draft.vocab import build_mapping, save_mapping
from tests.eagle3.draft_fixtures import AUX_LAYER_IDS, DRAFT_VOCAB, TRAIN_KW, VOCAB, one_thread, tiny_world, trained_run  # noqa: F401


def _parent(tmp_path):
    world = tiny_world()
    return export_draft(trained_run().checkpoint, tmp_path / "parent", target_dir=world.target_dir,
                        aux_layer_ids=AUX_LAYER_IDS, vocab_path=world.vocab_path)


def _train(out, steps=4, **kwargs):
    world = tiny_world()
    config = TrainConfig(steps=steps, checkpoint_every=steps, **(TRAIN_KW | {"warmup_steps": 1}))
    return train_draft(config, store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                       vocab_path=kwargs.pop("vocab_path", world.vocab_path), out_dir=out, **kwargs)


def test_a_warm_start_begins_where_the_parent_left_off(tmp_path):
    parent_dir = _parent(tmp_path)
    parent_loss = trained_run().losses[-1]
    cold = _train(tmp_path / "cold")
    warm = _train(tmp_path / "warm", init_from=parent_dir)
    # The first step's loss is measured on the weights before the update: the parent's, not fresh ones.
    assert warm.losses[0] < 0.5 * cold.losses[0]
    assert warm.losses[0] < 2 * parent_loss
    # A resumed warm run takes its checkpoint, not the parent again: same trajectory as uninterrupted.
    interrupted = tmp_path / "warm-interrupted"
    config = TrainConfig(steps=4, checkpoint_every=2, **(TRAIN_KW | {"warmup_steps": 1}))
    world = tiny_world()
    common = dict(store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                  vocab_path=world.vocab_path, init_from=parent_dir)
    straight = train_draft(config, out_dir=tmp_path / "straight", **common)
    train_draft(config, out_dir=interrupted, stop_after=2, **common)
    resumed = train_draft(config, out_dir=interrupted, **common)
    assert resumed.resumed_from_step == 2
    assert resumed.losses == pytest.approx(straight.losses, rel=1e-6)


def test_the_parent_weights_are_what_training_starts_from(tmp_path):
    parent_dir = _parent(tmp_path)
    parent, _ = load_exported_draft(parent_dir)
    config = TrainConfig(steps=1, checkpoint_every=1, **(TRAIN_KW | {"warmup_steps": 0, "learning_rate": 1e-12}))
    world = tiny_world()
    train_draft(config, store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                vocab_path=world.vocab_path, out_dir=tmp_path / "out", init_from=parent_dir)
    exported = export_draft(tmp_path / "out" / CHECKPOINTS / checkpoint_name(1), tmp_path / "again",
                            target_dir=world.target_dir, aux_layer_ids=AUX_LAYER_IDS, vocab_path=world.vocab_path)
    again, _ = load_exported_draft(exported)
    for name, tensor in parent.state_dict().items():  # one step at lr 1e-12 moves nothing visible
        torch.testing.assert_close(again.state_dict()[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_a_parent_with_another_vocabulary_is_refused_by_name(tmp_path):
    parent_dir = _parent(tmp_path)
    other = tmp_path / "vocab-other.safetensors"
    counts = torch.arange(VOCAB, dtype=torch.int64)  # another frequency order: other draft ids
    save_mapping(build_mapping(counts, DRAFT_VOCAB), other)
    with pytest.raises(TrainError, match=r"init_from=.*parent.*vocabulary mapping"):
        _train(tmp_path / "out", init_from=parent_dir, vocab_path=other)
    assert not any((tmp_path / "out" / CHECKPOINTS).glob("step-*"))


def test_a_folder_that_is_not_an_export_is_refused_by_name(tmp_path):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(TrainError, match=r"init_from=.*nothing.*not a readable exported draft"):
        _train(tmp_path / "out", init_from=tmp_path / "nothing")


# -- bf16 weights with an fp32 master copy (param_dtype=bfloat16; the default on GPUs) ------
def test_bf16_weights_keep_an_fp32_master_that_checkpoints_hold_and_resume_from(tmp_path):
    from eagle3.draft.checkpoint import load_checkpoint

    world = tiny_world()
    mixed = TrainConfig(steps=12, checkpoint_every=6, dtype="bfloat16", param_dtype="bfloat16",
                        **(TRAIN_KW | {"warmup_steps": 1}))
    common = dict(store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                  vocab_path=world.vocab_path)
    straight = train_draft(mixed, out_dir=tmp_path / "straight", **common)
    weights = load_checkpoint(straight.checkpoint).weights
    # The checkpoint holds fp32 values that bf16 cannot represent: small updates were not rounded away.
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert any(not torch.equal(w, w.bfloat16().float()) for w in weights.values())
    # It follows the fp32 run's trajectory, step by step, up to bf16 rounding.
    fp32 = train_draft(mixed.model_copy(update={"dtype": "float32", "param_dtype": "float32"}),
                       out_dir=tmp_path / "fp32", **common)
    assert straight.losses == pytest.approx(fp32.losses, rel=0.03)
    # Killed at step 6 and resumed: the master copy comes back from the checkpoint, same trajectory.
    train_draft(mixed, out_dir=tmp_path / "resumed", stop_after=6, **common)
    resumed = train_draft(mixed, out_dir=tmp_path / "resumed", **common)
    assert resumed.resumed_from_step == 6
    assert resumed.losses == pytest.approx(straight.losses, rel=1e-5)
    for name, tensor in load_checkpoint(resumed.checkpoint).weights.items():
        torch.testing.assert_close(tensor, weights[name], rtol=1e-5, atol=1e-6, msg=name)

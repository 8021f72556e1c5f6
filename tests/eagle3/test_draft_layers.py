"""train.draft.num_layers: a draft of several decoder layers, trained here, exported, and computed by vLLM 0.32 as we do.

A tiny two-layer draft is trained on the tiny world of draft_fixtures (the project's own trainer), exported, and
loaded by speculators and by vLLM's own Eagle3LlamaForCausalLM while it serves the tiny target (float32). vLLM's first
draft forward (the whole prompt) and its second (the one token the first drafted, attending to both layers' cached
keys) give our module's logits within 1e-4: the second layer reads the first one's output in vLLM as in training.
At the default (one layer) the train fingerprint and the export are as before; a checkpoint written before the setting
existed resumes; the MLA draft refuses more than one layer by name.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from eagle3.draft.architecture import DraftArchitectureError, DraftSettings, resolve
from eagle3.train.config import TrainConfig
from tests.eagle3.draft_fixtures import (  # noqa: F401
    HIDDEN, SMALL_DRAFT, TRAIN_KW, one_thread, tiny_world, trained_and_exported)

TWO_LAYERS = DraftSettings(num_layers=2)


def _trained_two_layers():
    """(checkpoint, export dir) of a 40-step two-layer draft on the tiny world."""
    return trained_and_exported(TWO_LAYERS, "2-layers")


def test_the_export_has_both_layers_the_way_speculators_and_vllm_read_them():
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3.draft.checkpoint import load_checkpoint
    from eagle3.draft.export import load_exported_draft

    checkpoint, export = _trained_two_layers()
    raw = json.loads((export / "config.json").read_text())
    assert raw["transformer_layer_config"]["num_hidden_layers"] == 2
    with safe_open(str(export / "model.safetensors"), framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    assert shapes["layers.0.self_attn.q_proj.weight"][1] == 2 * HIDDEN  # the first reads [embedding; hidden]
    assert shapes["layers.1.self_attn.q_proj.weight"][1] == HIDDEN  # the second, the first one's output
    assert "layers.0.hidden_norm.weight" in shapes and "layers.1.hidden_norm.weight" not in shapes
    trained = load_checkpoint(checkpoint).weights
    state = Eagle3DraftModel.from_pretrained(str(export)).state_dict()  # speculators: its own multi-layer draft
    assert all(torch.equal(state[name], tensor) for name, tensor in trained.items())
    ours, _ = load_exported_draft(export)
    assert ours.config.num_layers == 2 and len(ours.layers) == 2


def test_vllm_computes_the_two_layer_draft_as_we_train_it():
    """vLLM builds both layers, and its second draft step, attending to both layers' cached keys, gives our logits."""
    from tests.eagle3.vllm_drafter import assert_vllm_computes_our_llama_draft

    _, export = _trained_two_layers()
    theirs = assert_vllm_computes_our_llama_draft(export)
    assert len(theirs.model.layers) == 2


def test_the_second_layer_changes_what_the_draft_computes_and_learns():
    """The same weights for everything both drafts have: a second layer gives other logits; and training moved the
    second layer's weights away from their seeded start."""
    from eagle3.draft.checkpoint import load_checkpoint
    from eagle3.draft.model import DraftConfig, Eagle3Draft, init_draft
    from eagle3.draft.vocab import load_mapping
    from tests.eagle3.draft_fixtures import tiny_head

    base = SMALL_DRAFT
    torch.manual_seed(0)
    one = Eagle3Draft(DraftConfig(**base))
    two = Eagle3Draft(DraftConfig(**base, num_layers=2))
    missing, unexpected = two.load_state_dict(one.state_dict(), strict=False)
    assert not unexpected and missing and all(name.startswith("layers.1.") for name in missing)
    aux, embed = torch.randn(7, 3, 64) * 3, torch.randn(512, 64)
    step_tokens, positions = torch.randint(0, 512, (3, 7)), torch.arange(7)
    with torch.no_grad():
        a = list(one.unroll(aux, step_tokens, positions, None, embed))
        b = list(two.unroll(aux, step_tokens, positions, None, embed))
    assert all(x.shape == y.shape for x, y in zip(a, b)) and not torch.allclose(a[0], b[0], atol=1e-4)

    checkpoint, _ = _trained_two_layers()
    trained = load_checkpoint(checkpoint)
    start = Eagle3Draft(DraftConfig(**trained.meta["draft_config"]))
    init_draft(start, tiny_head(), load_mapping(tiny_world().vocab_path), TrainConfig().seed)
    for name in ("layers.1.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight"):
        moved = (trained.weights[name] - start.state_dict()[name]).abs().max()
        assert moved > 1e-3, f"{name} barely moved from its start ({moved:.2e}): the second layer was not trained"


def test_the_default_keeps_the_fingerprint_and_more_layers_change_it():
    from eagle3.artifacts import StageRecord
    from eagle3.draft_stages import fingerprint_train

    upstream = [StageRecord(stage=n, uri="/x", fingerprint=n) for n in ("extract", "vocab", "stage_target")]
    # the fingerprint pinned in test_train's feature-noise test, from before train.draft.num_layers existed
    assert fingerprint_train(TrainConfig(steps=10, warmup_steps=1), *upstream) == "c26cabe8f67fc68358c7"
    two = fingerprint_train(TrainConfig(steps=10, warmup_steps=1, draft=TWO_LAYERS), *upstream)
    assert two != "c26cabe8f67fc68358c7"


def test_the_mla_draft_refuses_more_than_one_layer_by_name():
    with pytest.raises(ValueError, match=r"train\.draft\.num_layers is 2.*set train\.draft\.num_layers: 1"):
        DraftSettings(architecture="deepseek_mla", num_layers=2)
    mla_text = {"model_type": "deepseek_v3", "kv_lora_rank": 512}
    with pytest.raises(DraftArchitectureError, match=r"train\.draft\.num_layers=2.*MLA draft"):
        resolve(DraftSettings(num_layers=2), mla_text)
    with pytest.raises(ValueError, match="num_layers"):
        DraftSettings(num_layers=0)


def test_a_checkpoint_from_before_the_setting_resumes(tmp_path, one_thread):  # noqa: F811
    """A run stopped by an upgrade: its checkpoint's meta has no num_layers anywhere; the new code resumes it (one
    layer: what every draft before the setting had) instead of asking for a fresh out_dir."""
    from eagle3.draft.checkpoint import META, list_checkpoints
    from eagle3.train.trainer import train_draft

    world = tiny_world()
    paths = dict(store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                 vocab_path=world.vocab_path, out_dir=tmp_path / "run")
    train_draft(TrainConfig(steps=8, checkpoint_every=8, **TRAIN_KW), **paths)
    [checkpoint] = list_checkpoints(tmp_path / "run" / "checkpoints")
    meta = json.loads((checkpoint / META).read_text())
    del meta["draft_config"]["num_layers"], meta["train_config"]["draft"]["num_layers"]
    (checkpoint / META).write_text(json.dumps(meta, indent=1))
    result = train_draft(TrainConfig(steps=10, checkpoint_every=2, **TRAIN_KW), **paths)
    assert result.resumed_from_step == 8 and len(result.losses) == 10

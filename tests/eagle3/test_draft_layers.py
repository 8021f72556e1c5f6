"""train.draft.num_layers: a draft of several decoder layers, trained here, exported, and computed by vLLM 0.32 as we do.

A tiny two-layer draft is trained on the tiny world of draft_fixtures (the project's own trainer), exported, and
loaded by speculators and by vLLM's own Eagle3LlamaForCausalLM while it serves the tiny target (float32). vLLM's first
draft forward (the whole prompt) and its second (the one token the first drafted, attending to both layers' cached
keys) give our module's logits within 1e-4: the second layer reads the first one's output in vLLM as in training.
At the default (one layer) the train fingerprint and the export are as before; a checkpoint written before the setting
existed resumes; the MLA draft refuses more than one layer by name.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors import safe_open

from eagle3.draft.architecture import DraftArchitectureError, DraftSettings, resolve
from eagle3.draft.train_config import TrainConfig
from tests.eagle3.draft_fixtures import AUX_LAYER_IDS, HIDDEN, TRAIN_KW, one_thread, tiny_world  # noqa: F401

TWO_LAYERS = DraftSettings(num_layers=2)


@functools.cache
def _trained_two_layers():
    """(checkpoint, export dir) of a 40-step two-layer draft on the tiny world."""
    from eagle3.draft.export import export_draft
    from eagle3.draft.train import train_draft

    world = tiny_world()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = train_draft(TrainConfig(steps=40, checkpoint_every=40, draft=TWO_LAYERS, **TRAIN_KW),
                             store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                             vocab_path=world.vocab_path, out_dir=world.root / "trained-2-layers")
    finally:
        torch.set_num_threads(before)
    export = export_draft(result.checkpoint, world.root / "export-2-layers", target_dir=world.target_dir,
                          aux_layer_ids=AUX_LAYER_IDS, vocab_path=world.vocab_path)
    return result.checkpoint, export


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
    from eagle3.capture import vllm_adapter
    from eagle3.draft.export import load_exported_draft
    from tests.eagle3.vllm_drafter import first_two_draft_forwards

    _, export = _trained_two_layers()
    ours, mapping = load_exported_draft(export)
    world = tiny_world()
    vllm_adapter.release_all()
    llm = vllm_adapter.load_serving_engine(str(world.target_dir), dtype="float32", max_model_len=64, kv_cache_gib=1,
                                           speculative_dir=str(export), num_speculative_tokens=2)
    prompt = torch.randint(3, 250, (13,), generator=torch.Generator().manual_seed(11)).tolist()
    theirs, first, second = first_two_draft_forwards(llm, prompt)  # prefill: 13 rows; then 1 row, the drafted token
    assert len(theirs.model.layers) == 2  # vLLM built both layers
    embed = theirs.model.embed_tokens.weight.detach().float()  # the target's, shared
    with torch.no_grad():
        aux = first["aux"].float().view(len(prompt), len(AUX_LAYER_IDS), -1)  # [T, n_aux * H] -> [T, n_aux, H]
        hidden = ours.fuse(aux)
        torch.testing.assert_close(hidden, first["hidden_states"].float(), atol=1e-5, rtol=0)
        caches = ours.new_caches(None, len(prompt), hidden.device, hidden.dtype)
        logits0, next0 = ours.logits_and_next(ours.step(embed[first["input_ids"]], hidden, first["positions"], caches))
        torch.testing.assert_close(next0, first["handed_on"].float(), atol=1e-5, rtol=0)
        tokens = torch.zeros(len(prompt), dtype=torch.long)
        tokens[-1] = second["input_ids"][0]  # only the last row's second step is vLLM's
        logits1, _ = ours.logits_and_next(ours.step(embed[tokens], next0, first["positions"] + 1, caches))
    ids = mapping.target_ids
    torch.testing.assert_close(logits0, first["logits"][:, ids].float(), atol=1e-4, rtol=0)
    torch.testing.assert_close(logits1[-1:], second["logits"][:, ids].float(), atol=1e-4, rtol=0)
    assert logits0.std() > 0.1  # trained logits, not a degenerate comparison


def test_the_second_layer_changes_what_the_draft_computes_and_learns():
    """The same weights for everything both drafts have: a second layer gives other logits, and it is trained."""
    from eagle3.draft.checkpoint import load_checkpoint
    from eagle3.draft.model import DraftConfig, Eagle3Draft, init_draft  # noqa: F401

    checkpoint, _ = _trained_two_layers()
    weights = load_checkpoint(checkpoint).weights
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                max_position_embeddings=256, num_aux_hidden_states=3, target_vocab_size=512, draft_vocab_size=256)
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
    # trained: the second layer's weights moved from init (std 0.02 noise) to something the loss shaped
    gate = weights["layers.1.mlp.gate_proj.weight"]
    assert gate.shape == (128, HIDDEN)
    assert not torch.allclose(gate.std(), torch.tensor(0.02), atol=1e-4)


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
    from eagle3.draft.train import train_draft

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

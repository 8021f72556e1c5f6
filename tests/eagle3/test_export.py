"""Export: a speculators-format folder that speculators loads and vLLM reads as an EAGLE-3 draft."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from eagle3.draft.checkpoint import load_checkpoint
from eagle3.draft.export import ExportError, export_draft, load_exported_draft
from eagle3.draft.vocab import build_mapping, load_mapping, save_mapping
from tests.eagle3.draft_fixtures import AUX_LAYER_IDS, one_thread, tiny_world, trained_run  # noqa: F401


def _export(out_dir, **overrides):
    world = tiny_world()
    kwargs = dict(target_dir=world.target_dir, aux_layer_ids=AUX_LAYER_IDS, vocab_path=world.vocab_path) | overrides
    return export_draft(trained_run().checkpoint, out_dir, **kwargs)


def test_speculators_loads_the_export_with_our_weights_and_mapping(tmp_path):
    from speculators.models.eagle3 import Eagle3DraftModel

    out = _export(tmp_path / "draft")
    trained = load_checkpoint(trained_run().checkpoint).weights
    mapping = load_mapping(tiny_world().vocab_path)
    loaded = Eagle3DraftModel.from_pretrained(str(out))
    state = loaded.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name
    assert torch.equal(loaded.d2t, mapping.d2t) and torch.equal(loaded.t2d, mapping.t2d)
    assert loaded.config.eagle_aux_hidden_state_layer_ids == AUX_LAYER_IDS


def test_config_and_weights_are_what_vllm_reads(tmp_path):
    out = _export(tmp_path / "draft", num_speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["norm_before_residual"] is True  # always written: speculators' default, vLLM's when absent
    assert config["draft_vocab_size"] == 256 and config["target_hidden_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX_LAYER_IDS
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"]) == ("llama", 1)
    assert (layer["head_dim"], layer["vocab_size"]) == (32, 512)
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"] == {"name_or_path": str(tiny_world().target_dir), "architectures": ["LlamaForCausalLM"]}
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert handle.get_tensor("d2t").dtype == torch.int64 and handle.get_tensor("t2d").dtype == torch.bool
    assert not any("embed_tokens" in n for n in names)  # vLLM then shares the target's embedding
    assert {"fc.weight", "lm_head.weight", "norm.weight", "d2t", "t2d", "layers.0.hidden_norm.weight"} <= names


def test_vllm_turns_the_config_into_its_eagle3_llama_draft(tmp_path):
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    out = _export(tmp_path / "draft")
    config = SpeculatorsConfig.from_pretrained(str(out))
    assert config.architectures == ["Eagle3LlamaForCausalLM"]
    assert (config.draft_vocab_size, config.norm_before_residual, config.head_dim) == (256, True, 32)
    assert config.eagle_aux_hidden_state_layer_ids == AUX_LAYER_IDS
    vllm_spec = SpeculatorsConfig.extract_vllm_speculative_config(json.loads((out / "config.json").read_text()))
    assert vllm_spec == {"method": "eagle3", "num_speculative_tokens": 3}


def test_load_exported_draft_gives_back_the_trained_model(tmp_path):
    out = _export(tmp_path / "draft")
    model, mapping = load_exported_draft(out)
    trained = load_checkpoint(trained_run().checkpoint).weights
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    assert torch.equal(mapping.d2t, load_mapping(tiny_world().vocab_path).d2t)


def test_exporting_again_replaces_the_folder_and_leaves_no_temporaries(tmp_path):
    _export(tmp_path / "draft", num_speculative_tokens=2)
    _export(tmp_path / "draft", num_speculative_tokens=5)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert [p.name for p in tmp_path.iterdir()] == ["draft"]


def test_mismatched_aux_ids_or_vocab_are_refused(tmp_path):
    with pytest.raises(ExportError, match="aux_layer_ids"):
        _export(tmp_path / "a", aux_layer_ids=[1, 2])
    with pytest.raises(ExportError, match="trained on"):
        _export(tmp_path / "b", aux_layer_ids=[1, 4, 5])
    other = tmp_path / "vocab-128.safetensors"
    save_mapping(build_mapping(torch.ones(512, dtype=torch.int64), 128), other)
    with pytest.raises(ExportError, match="vocab"):
        _export(tmp_path / "c", vocab_path=other)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_a_draft_over_the_whole_vocabulary_is_exported_without_a_mapping(tmp_path):
    """vLLM has no d2t parameter when the draft vocabulary is the target's, and refuses one."""
    from eagle3.train.trainer import TrainConfig, train_draft
    from tests.eagle3.draft_fixtures import TRAIN_KW, VOCAB

    world = tiny_world()
    full = tmp_path / "vocab-full.safetensors"
    save_mapping(build_mapping(torch.ones(VOCAB, dtype=torch.int64), VOCAB), full)
    trained = train_draft(TrainConfig(steps=2, checkpoint_every=2, **(TRAIN_KW | {"warmup_steps": 1})),
                          store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                          vocab_path=full, out_dir=tmp_path / "train")
    out = export_draft(trained.checkpoint, tmp_path / "draft", target_dir=world.target_dir,
                       aux_layer_ids=AUX_LAYER_IDS, vocab_path=full)
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert "d2t" not in handle.keys() and "t2d" not in handle.keys()
    model, mapping = load_exported_draft(out)
    assert mapping.draft_vocab_size == VOCAB and bool(mapping.t2d.all()) and not bool(mapping.d2t.any())


def test_the_train_stage_names_its_best_checkpoint_and_the_export_takes_it(tmp_path):
    import shutil

    from eagle3.artifacts import StageRecord
    from eagle3.data.target import HEAD_FILE, INFO_FILE, TargetInfo
    from eagle3.train.trainer import TrainConfig
    from eagle3.draft_stages import VOCAB_FILE, fingerprint_export, run_export, run_train
    from tests.eagle3.draft_fixtures import NUM_LAYERS, TRAIN_KW, VOCAB

    world = tiny_world()
    target, extracted, vocab = tmp_path / "target", tmp_path / "extract", tmp_path / "vocab"
    target.mkdir()
    vocab.mkdir()
    (target / INFO_FILE).write_text(TargetInfo(
        model_dir=str(world.target_dir), architecture="LlamaForCausalLM", wrapper=None, num_layers=NUM_LAYERS,
        hidden_size=64, vocab_size=VOCAB, aux_layer_ids=AUX_LAYER_IDS, content_fingerprint="tiny").to_json())
    shutil.copy(world.head_path, target / HEAD_FILE)
    shutil.copy(world.vocab_path, vocab / VOCAB_FILE)
    shutil.copytree(world.train_store, extracted / "train")
    shutil.copytree(world.heldout_store, extracted / "heldout")
    records = [StageRecord(stage=n, uri=str(p), fingerprint=n) for n, p in
               (("stage_target", target), ("extract", extracted), ("vocab", vocab))]
    trained = run_train(TrainConfig(steps=12, checkpoint_every=4, **TRAIN_KW), *records, tmp_path / "artifacts", "fp-train")
    evals = [json.loads(line) for line in (trained.path / "evals.jsonl").read_text().splitlines()]
    best = max(reversed(evals), key=lambda e: e["acceptance_length"])
    assert trained.stats["checkpoint"] == f"checkpoints/{best['checkpoint']}"
    assert trained.stats["last_checkpoint"] == "checkpoints/step-000012"
    assert trained.stats["best_acceptance_length"] == round(best["acceptance_length"], 4)
    exported = run_export(records[0], trained, records[2], tmp_path / "artifacts", fingerprint_export(trained))
    assert exported.stats["checkpoint"] == str(trained.path / "checkpoints" / best["checkpoint"])
    model, _ = load_exported_draft(exported.path)
    chosen = load_checkpoint(trained.path / "checkpoints" / best["checkpoint"]).weights
    assert all(torch.equal(model.state_dict()[k], v) for k, v in chosen.items())

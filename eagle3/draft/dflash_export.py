"""The DFlash draft's folder in the layout vLLM 0.32 loads as DFlashQwen3ForCausalLM (speculative method "dflash").

    <out_dir>/config.json        a Qwen3 config of the draft's layers: `architectures: [DFlashDraftModel]`,
                                 `model_type: qwen3`, `block_size`, and `dflash_config` {target_layer_ids (DFlash's
                                 numbering: vLLM captures aux ids l+1), mask_token_id}; no `layer_types`, so every
                                 layer is non-causal
    <out_dir>/model.safetensors  fc, hidden_norm, layers.i.*, norm, lm_head (the target's, copied)

No `embed_tokens`: vLLM then shares the target's, the one the draft was trained with. No d2t/t2d: the draft
drafts over the target's whole vocabulary. Written to a temporary folder and swapped in, as eagle3.draft.export.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3.artifacts import fsync_path
from eagle3.draft.dflash import ARCHITECTURE, DFlashConfig, DFlashDraft
from eagle3.draft.export import WEIGHTS, ExportError, _swap_in, fresh_tmp


def vllm_config(config: DFlashConfig) -> dict:
    """config.json of the export (module docstring)."""
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": config.block_size,
        "dflash_config": {"target_layer_ids": list(config.target_layer_ids), "mask_token_id": config.mask_token_id},
        "num_speculative_tokens": config.num_speculative_tokens,  # informative: vLLM takes it from speculative_config
        "decay_gamma": config.decay_gamma,  # how it was trained; vLLM ignores it
    }


def export_dflash(model: DFlashDraft, out_dir: Path) -> Path:
    """Write the vLLM folder for `model` to `out_dir` (atomically); returns out_dir."""
    out_dir = Path(out_dir)
    tmp = fresh_tmp(out_dir)
    (tmp / "config.json").write_text(json.dumps(vllm_config(model.config), indent=1))
    tensors = {name: t.detach().float().contiguous().cpu() for name, t in model.state_dict().items()}
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    for path in (tmp / WEIGHTS, tmp / "config.json", tmp):
        fsync_path(path)
    _swap_in(tmp, out_dir)
    return out_dir


def is_dflash(raw: dict) -> bool:
    """Whether an export's config.json is this layout."""
    return ARCHITECTURE in (raw.get("architectures") or [])


def load_exported_dflash(export_dir: Path) -> DFlashDraft:
    """Read an exported folder back: the draft in float32, eval mode."""
    export_dir = Path(export_dir)
    raw = json.loads((export_dir / "config.json").read_text())
    if not is_dflash(raw):
        raise ExportError(f"{export_dir} is not a DFlash folder (architectures {raw.get('architectures')}, expected "
                          f"[{ARCHITECTURE}])")
    dflash = raw["dflash_config"]
    config = DFlashConfig(
        hidden_size=raw["hidden_size"], num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"],
        intermediate_size=raw["intermediate_size"], rms_norm_eps=raw["rms_norm_eps"], rope_theta=raw["rope_theta"],
        max_position_embeddings=raw["max_position_embeddings"], vocab_size=raw["vocab_size"],
        num_layers=raw["num_hidden_layers"], block_size=raw["block_size"],
        target_layer_ids=tuple(dflash["target_layer_ids"]), mask_token_id=dflash["mask_token_id"],
        decay_gamma=raw.get("decay_gamma", 7.0))
    model = DFlashDraft(config)
    model.load_state_dict({k: v.to(torch.float32) for k, v in load_file(str(export_dir / WEIGHTS)).items()})
    return model.eval()

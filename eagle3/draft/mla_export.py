"""The MLA draft's checkpoint in vLLM's native EAGLE-3 layout, which vLLM 0.32 loads as Eagle3DeepseekV3ForCausalLM.

vLLM's speculators-format reader (transformers_utils/configs/speculators/algos.py) maps only llama and qwen3
drafts, so an MLA draft is written the way vLLM's own deepseek_eagle3.py reads one:

    config.json        a DeepseekV2Config: `model_type: deepseek_v2` (a deepseek_v3 type is rewritten to
                       deepseek_mtp by SpeculativeConfig.hf_config_override and fails), `architectures:
                       [Eagle3DeepseekV3ForCausalLM]`, one layer of the draft's MLA shape, `q_lora_rank` always
                       written (DeepseekV2Config's default is 1536, not None), `norm_before_residual` always
                       written (vLLM assumes False when absent), `draft_vocab_size`, `target_hidden_size`,
                       `eagle_config.eagle_aux_hidden_state_layer_ids` (the target's aux layers vLLM collects),
                       `rope_parameters` (a plain RoPE as YaRN of factor 1: see portable_rope)
    model.safetensors  fc, midlayer.* (vLLM's hf_to_vllm_mapper turns `midlayer.` into `layers.0.`), norm,
                       lm_head, and d2t/t2d as the Llama export writes them (eagle3.draft.export)

No `embed_tokens`: vLLM then shares the target's, the one the draft was trained with.
"""

from __future__ import annotations

from eagle3.draft.mla import MLADraftConfig

ARCHITECTURE = "Eagle3DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v2"
LAYER, NATIVE_LAYER = "layers.0.", "midlayer."


def vllm_config(draft: MLADraftConfig, *, aux_layer_ids: list[int], num_speculative_tokens: int) -> dict:
    """config.json of the export (module docstring)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_size": draft.hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": draft.num_attention_heads,
        "num_key_value_heads": draft.num_attention_heads,
        "q_lora_rank": draft.q_lora_rank,
        "kv_lora_rank": draft.kv_lora_rank,
        "qk_rope_head_dim": draft.qk_rope_head_dim,
        "qk_nope_head_dim": draft.qk_nope_head_dim,
        "v_head_dim": draft.v_head_dim,
        "intermediate_size": draft.intermediate_size,
        "hidden_act": draft.hidden_act,
        "rms_norm_eps": draft.rms_norm_eps,
        "rope_parameters": portable_rope(dict(draft.rope_parameters), draft.max_position_embeddings),
        "max_position_embeddings": draft.max_position_embeddings,
        "vocab_size": draft.target_vocab_size,
        "draft_vocab_size": draft.draft_vocab_size,
        "target_hidden_size": draft.hidden_size,
        "norm_before_residual": draft.norm_before_residual,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
        "num_speculative_tokens": num_speculative_tokens,  # informative: vLLM takes it from speculative_config
        # EAGLE 3.1, written only when on: an export without them is byte for byte what it was before they existed
        **{flag: True for flag in ("fc_norm", "norm_output") if getattr(draft, flag)},
    }


def portable_rope(rope: dict, max_position_embeddings: int) -> dict:
    """A plain RoPE ('default') written as YaRN of factor 1, which computes the same cos/sin and softmax scale in
    vLLM's DeepSeek attention (every frequency kept, every mscale 1), so that every vLLM of our span loads it.

    vLLM 0.25's deepseek_eagle3.py builds the draft's attention from `config.rope_scaling` and, when that is set,
    forces DeepSeek YaRN, which needs `factor`. transformers 5 answers `rope_scaling` with `rope_parameters`, which is
    always set, so a draft of a target without YaRN failed to load there (KeyError: 'factor', seen on an H100 with
    the reduced DeepSeek-V3 of benchmarks/served_speed.py). A YaRN RoPE is written as it is."""
    if rope.get("rope_type", "default") != "default":
        return rope
    return {**rope, "rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": max_position_embeddings}


def plain_rope(rope: dict, max_position_embeddings: int) -> dict:
    """portable_rope's inverse: the draft's own RoPE settings from an export's config.json."""
    if (rope.get("rope_type") == "yarn" and rope.get("factor") == 1.0
            and rope.get("original_max_position_embeddings") == max_position_embeddings):
        return {k: v for k, v in rope.items() if k not in ("factor", "original_max_position_embeddings")} | {
            "rope_type": "default"}
    return rope


def is_native_mla(raw: dict) -> bool:
    """Whether an export's config.json is this layout."""
    return ARCHITECTURE.replace("V3", "V2") in raw.get("architectures", []) or ARCHITECTURE in raw.get("architectures", [])


def draft_config_of(raw: dict) -> MLADraftConfig:
    """The MLADraftConfig of an export's config.json."""
    return MLADraftConfig(
        hidden_size=raw["hidden_size"], num_attention_heads=raw["num_attention_heads"], q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=raw["kv_lora_rank"], qk_rope_head_dim=raw["qk_rope_head_dim"],
        qk_nope_head_dim=raw["qk_nope_head_dim"], v_head_dim=raw["v_head_dim"],
        intermediate_size=raw["intermediate_size"], rms_norm_eps=raw["rms_norm_eps"],
        rope_parameters=plain_rope(raw["rope_parameters"], raw["max_position_embeddings"]),
        max_position_embeddings=raw["max_position_embeddings"],
        hidden_act=raw.get("hidden_act", "silu"),
        num_aux_hidden_states=len(raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        target_vocab_size=raw["vocab_size"], draft_vocab_size=raw["draft_vocab_size"],
        norm_before_residual=raw.get("norm_before_residual", False),  # vLLM's deepseek_eagle3 default
        fc_norm=bool(raw.get("fc_norm", False)), norm_output=bool(raw.get("norm_output", False)),
    )


def to_native(name: str) -> str:
    """A draft parameter's name in the export: layers.0.* -> midlayer.*."""
    return NATIVE_LAYER + name.removeprefix(LAYER) if name.startswith(LAYER) else name


def from_native(name: str) -> str:
    """An export's tensor name -> the draft module's: midlayer.* -> layers.0.*."""
    return LAYER + name.removeprefix(NATIVE_LAYER) if name.startswith(NATIVE_LAYER) else name

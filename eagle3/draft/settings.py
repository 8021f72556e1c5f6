"""The draft's architecture settings (train.draft) and the error that names a misfit: the one module both the
architecture's resolution (architecture.py) and the MLA draft (mla.py) build on, so neither imports the other to
get them. Pydantic only."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Architecture = Literal["llama", "deepseek_mla"]
# the MLA shape settings: the target's by default, smaller ones settable
MLA_SHAPES = ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
              "v_head_dim", "intermediate_size")
# the DFlash settings (train.draft.method: dflash): out of an EAGLE-3 draft's fingerprint, so drafts trained before
# they existed keep their artifacts
DFLASH_FIELDS = ("method", "block_size", "mask_token_id", "decay_gamma", "anchors_per_sample")
# The DFlash trainer's behaviour, in the train fingerprint of DFlash drafts only. 2: train.optimizer (AdamW as the
# EAGLE-3 trainer's, or Muon) and checkpoints picked by the walk (eagle3.evaluate.dflash_eval.heldout_figures).
# 3: the EAGLE-3 trainer's micro-batch order (next_batch_indices: no micro-batch spans two epochs, samples cut to
# train.batch_tokens), which the online feed captures in.
DFLASH_TRAINER_VERSION = 3


def default_decay_gamma(block_size: int) -> float:
    """The DFlash paper's loss decay for its block sizes: 7 for 16 (and longer), 5 for 10, 4 for 8 (and shorter)."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


class DraftArchitectureError(ValueError):
    """train.draft does not fit the target; the message names the setting, the value and what was expected."""


class DraftSettings(BaseModel):
    """Settings of the draft's architecture (train.draft). Unset shapes are the target's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: Literal["auto", "llama", "deepseek_mla"] = Field(
        default="auto", description="The draft's decoder layer: 'llama' (Llama-style attention, vLLM's "
        "Eagle3LlamaForCausalLM), 'deepseek_mla' (DeepSeek-V3-style MLA attention and a dense SwiGLU MLP, vLLM's "
        "Eagle3DeepseekV3ForCausalLM; MLA targets only) or 'auto': deepseek_mla when the target's config has "
        "kv_lora_rank (DeepSeek-V2/V3, Kimi-K2/K2.5), llama otherwise.")
    num_attention_heads: int | None = Field(
        default=None, gt=0, description="deepseek_mla: attention heads of the draft (default: the target's).")
    q_lora_rank: int | None = Field(
        default=None, ge=0, description="deepseek_mla: rank of the query's low-rank projection (default: the "
        "target's; 0: no query LoRA, a direct q_proj, as DeepSeek-V2-Lite).")
    kv_lora_rank: int | None = Field(
        default=None, gt=0, description="deepseek_mla: rank of the compressed KV latent (default: the target's). "
        "vLLM's CPU MLA kernel and FlashMLA need kv_lora_rank + qk_rope_head_dim = 576 (512 + 64).")
    qk_rope_head_dim: int | None = Field(
        default=None, gt=0, description="deepseek_mla: rotary part of each query/key head (default: the target's).")
    qk_nope_head_dim: int | None = Field(
        default=None, gt=0, description="deepseek_mla: non-rotary part of each query/key head (default: the target's).")
    v_head_dim: int | None = Field(
        default=None, gt=0, description="deepseek_mla: value head size (default: the target's).")
    intermediate_size: int | None = Field(
        default=None, gt=0, description="deepseek_mla: width of the dense SwiGLU MLP (default: the target's "
        "intermediate_size, its dense layers' width).")
    # EAGLE 3.1 (vLLM's blog 2026-05-26; speculators' and SpecForge's flags of the same names): both off by default,
    # so a draft trained before them keeps its fingerprint and its export.
    fc_norm: bool = Field(
        default=False, description="EAGLE 3.1: an RMSNorm of its own on each of the target's aux states before fc "
        "fuses them (concat(norm_a(h_a), norm_b(h_b), norm_c(h_c))), so no layer's scale dominates the fused input. "
        "Exported as vLLM and speculators read it (config fc_norm, weights fc_norm.<i>.weight); vLLM 0.32 serves it.")
    norm_output: bool = Field(
        default=False, description="EAGLE 3.1: each draft step hands the NEXT step its hidden state after the final "
        "norm (the one lm_head reads) instead of before it, against the magnitude drift of deeper draft steps. "
        "Exported as config norm_output (no weights); vLLM 0.32 serves it.")
    num_layers: int = Field(
        default=1, ge=1, le=8, description="Decoder layers of the draft (EAGLE-3's is one). The first reads "
        "[embedding; hidden] as always, each later one the previous layer's output (speculators' and vLLM's "
        "multi-layer EAGLE-3). Each layer adds about a layer of the target's cost to every drafted token. "
        "Llama-style drafts only.")

    method: Literal["eagle3", "dflash"] = Field(
        default="eagle3", description="The kind of draft: 'eagle3' (one token per draft forward, vLLM's method "
        "eagle3) or 'dflash' (a block of tokens per forward, non-causal, over the target's states of several layers; "
        "vLLM's method dflash, DFlashDraftModel; docs/dflash.md). dflash takes the target's layer shape, "
        "train.draft.num_layers, block_size, mask_token_id, decay_gamma and anchors_per_sample.")
    block_size: int = Field(
        default=16, ge=2, le=64, description="dflash: tokens per drafted block (the anchor and block_size - 1 drafted "
        "tokens: vLLM serves it with num_speculative_tokens = block_size - 1). The paper trains 16.")
    mask_token_id: int | None = Field(
        default=None, ge=0, description="dflash (required): the token id whose embedding fills the drafted slots; "
        "one that never occurs in text (a reserved or unused id of the target's vocabulary).")
    decay_gamma: float | None = Field(
        default=None, gt=0, description="dflash: the loss weight of block slot k is exp(-(k-1)/decay_gamma) "
        "(default: the paper's 7 for block 16, 5 for 10, 4 for 8).")
    anchors_per_sample: int = Field(
        default=32, ge=1, description="dflash: random anchor positions (one block each) trained per sample per step.")

    @model_validator(mode="after")
    def _check(self) -> DraftSettings:
        if self.method == "eagle3":
            changed = [name for name in DFLASH_FIELDS[1:] if getattr(self, name) != type(self).model_fields[name].default]
            if changed:
                raise ValueError(f"train.draft.{changed[0]} is set, but it belongs to the DFlash draft and "
                                 "train.draft.method is 'eagle3'; unset it, or set train.draft.method: dflash")
        else:
            if self.mask_token_id is None:
                raise ValueError("train.draft.method is 'dflash', which needs train.draft.mask_token_id: a token id "
                                 "that never occurs in text (a reserved or unused id of the target's vocabulary)")
            if self.architecture == "deepseek_mla" or self.shapes() or self.fc_norm or self.norm_output:
                raise ValueError("train.draft.method is 'dflash', whose layers take the target's shape: unset "
                                 "train.draft.architecture's MLA settings and fc_norm/norm_output (EAGLE-3 only)")
        set_shapes = [name for name in MLA_SHAPES if getattr(self, name) is not None]
        if self.architecture == "llama" and set_shapes:
            raise ValueError(f"train.draft.{set_shapes[0]} is set, but train.draft.architecture='llama' takes its "
                             "shape from the target; unset it, or set train.draft.architecture: deepseek_mla")
        if self.architecture == "deepseek_mla" and self.num_layers != 1:
            raise ValueError(f"train.draft.num_layers is {self.num_layers}, but the MLA draft "
                             "(train.draft.architecture='deepseek_mla') is trained with one layer; set "
                             "train.draft.num_layers: 1")
        return self

    def fingerprint_view(self) -> dict:
        """The settings as the train fingerprint holds them: an EAGLE-3 draft's without the DFlash fields."""
        values = self.model_dump()
        if self.method == "eagle3":
            values = {k: v for k, v in values.items() if k not in DFLASH_FIELDS}
        else:  # what the DFlash trainer does changed: a DFlash draft an older one trained is trained again
            values["dflash_trainer"] = DFLASH_TRAINER_VERSION
        return values

    def gamma(self) -> float:
        """decay_gamma, or its default for block_size."""
        return self.decay_gamma if self.decay_gamma is not None else default_decay_gamma(self.block_size)

    def shapes(self) -> dict[str, int]:
        """The MLA shapes this run sets (the rest are the target's)."""
        return {name: getattr(self, name) for name in MLA_SHAPES if getattr(self, name) is not None}

"""The MLA EAGLE-3 draft, exactly as vLLM 0.32's Eagle3DeepseekV2ForCausalLM serves it (deepseek_eagle3.py).

Everything but the attention is the Llama-style draft's (eagle3.draft.model): fc over the aux states,
[input_layernorm(emb) ; hidden_norm(hidden)] (2H) as the layer's input, the residual rule
(norm_before_residual), a dense SwiGLU MLP, the final norm, lm_head over the draft vocabulary, and the TTT
unroll (Eagle3Draft.unroll/step, eagle3.draft.ttt_attention). Parameters of the attention (vLLM's names;
H = hidden, n heads, r = qk_rope_head_dim, p = qk_nope_head_dim, dv = v_head_dim):

    layers.0.self_attn.q_a_proj.weight            [q_lora, 2H]     (q_lora_rank set)
    layers.0.self_attn.q_a_layernorm.weight       [q_lora]
    layers.0.self_attn.q_b_proj.weight            [n*(p+r), q_lora]
    layers.0.self_attn.q_proj.weight              [n*(p+r), 2H]    (q_lora_rank None instead of the three above)
    layers.0.self_attn.kv_a_proj_with_mqa.weight  [kv_lora + r, 2H]
    layers.0.self_attn.kv_a_layernorm.weight      [kv_lora]
    layers.0.self_attn.kv_b_proj.weight           [n*(p+dv), kv_lora]
    layers.0.self_attn.o_proj.weight              [H, n*dv]

MLA (deepseek_v2.py's DeepseekV2MLAAttention and layers/mla.py), per row:
    q = q_b(rms(q_a(x))) -> n heads of [q_nope (p) ; q_pe (r)]
    [c_kv (kv_lora) ; k_pe (r)] = kv_a(x);  [k_nope (p) ; v (dv)] per head = kv_b(rms(c_kv))
    k = [k_nope ; k_pe] (k_pe shared by every head);  scores = q.k * softmax_scale
RoPE on q_pe and k_pe only, GPT-J style (is_neox_style=False: pairs (x0, x1), (x2, x3), ...), with DeepSeek's
YaRN (DeepseekScalingRotaryEmbedding) when the config has rope scaling: blended inverse frequencies, cos/sin
times mscale(factor, mscale) / mscale(factor, mscale_all_dim), and softmax_scale = (p+r)^-0.5 *
mscale(factor, mscale_all_dim)^2, where mscale(s, m) = 0.1 * m * ln(s) + 1. Here the pairs are first gathered
into halves ([x0, x2, .. ; x1, x3, ..], the same permutation for q and k, so every dot product is unchanged) and
rotated as halves with Eagle3Draft.step's cos/sin.

The exported checkpoint (eagle3.draft.mla_export) says `model_type: deepseek_v2` and
`architectures: [Eagle3DeepseekV3ForCausalLM]`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from eagle3.draft.settings import DraftArchitectureError, DraftSettings
from eagle3.draft.model import _MLP, Eagle3Draft, RMSNorm, fc_norms, rotate_half
from eagle3.draft.target_head import rope_parameters_of
from eagle3.draft.ttt_attention import TTTCache, ttt_attend


class MLADraftConfig(BaseModel):
    """Shape of the MLA draft; by default the target's MLA shapes (`from_target`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: Literal["deepseek_mla"] = Field(default="deepseek_mla", description="Tells this shape apart "
                                                  "from the Llama-style DraftConfig in checkpoints.")
    hidden_size: int = Field(gt=0, description="Hidden size H; equal to the target's (the embedding is shared).")
    num_attention_heads: int = Field(gt=0, description="Attention heads n (MLA: every head has its own keys).")
    q_lora_rank: int | None = Field(description="Rank of the query's low-rank projection; None: a direct q_proj.")
    kv_lora_rank: int = Field(gt=0, description="Rank of the compressed KV latent c_kv.")
    qk_rope_head_dim: int = Field(gt=0, description="Rotary part r of each query/key head (k_pe, shared by all heads).")
    qk_nope_head_dim: int = Field(gt=0, description="Non-rotary part p of each query/key head.")
    v_head_dim: int = Field(gt=0, description="Value head size dv.")
    intermediate_size: int = Field(gt=0, description="Width of the dense SwiGLU MLP.")
    rms_norm_eps: float = Field(gt=0, description="Epsilon of every RMSNorm of the draft.")
    rope_parameters: dict[str, float | int | str | list[float] | None] = Field(
        description="RoPE settings in transformers' `rope_parameters` form: rope_type 'default' or 'yarn' (then "
        "factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim).")
    max_position_embeddings: int = Field(gt=0, description="Longest position the RoPE settings are meant for.")
    hidden_act: str = Field(default="silu", description="MLP activation; vLLM's DeepseekV2MLP supports only 'silu'.")
    num_aux_hidden_states: int = Field(gt=0, description="Number of target aux states that fc fuses (n_aux).")
    target_vocab_size: int = Field(gt=0, description="Target vocabulary size V.")
    draft_vocab_size: int = Field(gt=0, description="Rows of the draft's lm_head (vocab.draft_vocab_size).")
    norm_before_residual: bool = Field(
        default=True, description="Use hidden_norm(hidden) rather than hidden as the attention residual (written "
        "to the export: vLLM's deepseek_eagle3 assumes False when the key is absent).")
    fc_norm: bool = Field(default=False, description="EAGLE 3.1: an RMSNorm per aux state before fc (train.draft.fc_norm).")
    norm_output: bool = Field(default=False, description="EAGLE 3.1: the next step reads the post-norm hidden "
                              "(train.draft.norm_output).")

    @model_validator(mode="after")
    def _check(self) -> MLADraftConfig:
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) exceeds target_vocab_size "
                             f"({self.target_vocab_size}); lower vocab.draft_vocab_size")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act is {self.hidden_act!r}; the MLA draft's MLP supports only 'silu'")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim is {self.qk_rope_head_dim}; RoPE rotates pairs, expected an even "
                             "number (train.draft.qk_rope_head_dim)")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"rope_parameters.rope_type is {rope_type!r}; the MLA draft computes vLLM's DeepSeek "
                             "rope, expected 'default' or 'yarn'")
        if rope_type == "yarn":
            missing = [k for k in ("factor", "original_max_position_embeddings") if self.rope_parameters.get(k) is None]
            if missing:
                raise ValueError(f"rope_parameters (YaRN) lacks {missing}; the target's config must give them")
        return self

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_target(cls, text: dict, settings: DraftSettings, *, num_aux_hidden_states: int,
                    draft_vocab_size: int) -> MLADraftConfig:
        """The target's MLA shapes (its text config dict), replaced by the shapes `settings` sets."""
        try:
            shapes = {name: text[name] for name in ("num_attention_heads", "kv_lora_rank", "qk_rope_head_dim",
                                                    "qk_nope_head_dim", "v_head_dim", "intermediate_size")}
        except KeyError as missing:
            raise DraftArchitectureError(f"the target's config lacks {missing}, which an MLA draft takes its shape from; set "
                             f"train.draft.{str(missing).strip(chr(39))} or train.draft.architecture: llama") from None
        shapes["q_lora_rank"] = text.get("q_lora_rank")
        shapes |= settings.shapes()
        if shapes["q_lora_rank"] == 0:  # the setting's spelling of "no query LoRA"
            shapes["q_lora_rank"] = None
        eps = next((text[k] for k in ("rms_norm_eps", "layer_norm_eps") if text.get(k) is not None), 1e-6)
        return cls(hidden_size=text["hidden_size"], rms_norm_eps=float(eps), rope_parameters=rope_parameters_of(text),
                   max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
                   num_aux_hidden_states=num_aux_hidden_states, target_vocab_size=int(text["vocab_size"]),
                   draft_vocab_size=draft_vocab_size, **shapes)


def yarn_mscale(scale: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude: 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_rope(c: MLADraftConfig) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [r/2], cos/sin scale, softmax scale) as vLLM's DeepseekV2MLAAttention builds them."""
    p, dim = c.rope_parameters, c.qk_rope_head_dim
    base = float(p.get("rope_theta", 10000.0))
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)  # [r/2]
    softmax_scale = c.qk_head_dim ** -0.5
    if p.get("rope_type", "default") == "default":
        return 1.0 / pos_freqs, 1.0, softmax_scale
    factor, original = float(p["factor"]), int(p["original_max_position_embeddings"])
    beta_fast, beta_slow = float(p.get("beta_fast", 32)), float(p.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(correction_dim(beta_fast)), 0), min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / ((high - low) or 0.001)).clamp(0, 1)  # [r/2]
    extrapolate = 1 - ramp  # 1: the dimension keeps its original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate  # [r/2]
    # vLLM's defaults when the config leaves them out: mscale 1, mscale_all_dim 0
    mscale = float(p["mscale"]) if p.get("mscale") is not None else 1.0
    mscale_all_dim = float(p["mscale_all_dim"]) if p.get("mscale_all_dim") is not None else 0.0
    cos_sin_scale = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    if p.get("attention_factor") != 1.0:  # vLLM: 'deepseek_yarn' (else 'deepseek_llama_scaling', no softmax mscale)
        softmax_scale *= yarn_mscale(factor, mscale_all_dim) ** 2
    return inv_freq, cos_sin_scale, softmax_scale


def pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """[..., r] GPT-J pairs (x0, x1), (x2, x3).. -> [..., r] halves [x0, x2, .. ; x1, x3, ..]."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # [.., r/2, 2] -> [.., 2, r/2] -> [.., r]


class _MLAAttention(nn.Module):
    def __init__(self, c: MLADraftConfig) -> None:
        super().__init__()
        n, two_h = c.num_attention_heads, 2 * c.hidden_size
        if c.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(two_h, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, n * c.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(two_h, n * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(two_h, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, n * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * c.v_head_dim, c.hidden_size, bias=False)


class _MLALayer(nn.Module):
    def __init__(self, c: MLADraftConfig) -> None:
        super().__init__()
        self.self_attn = _MLAAttention(c)
        self.mlp = _MLP(c)  # the same SwiGLU as the Llama-style draft (vLLM's DeepseekV2MLP)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3MLADraft(Eagle3Draft):
    """fc + one MLA decoder layer + norm + lm_head: Eagle3Draft with MLA attention (module docstring)."""

    def __init__(self, config: MLADraftConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        c = config
        self.fc = nn.Linear(c.num_aux_hidden_states * c.hidden_size, c.hidden_size, bias=False)
        self.fc_norm = fc_norms(c)
        self.layers = nn.ModuleList([_MLALayer(c)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        inv_freq, self.rope_scaling, self.softmax_scale = deepseek_rope(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [r/2]

    def _attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: TTTCache,
                layer: int = 0) -> torch.Tensor:
        """x [L, 2H], cos/sin [L, r] -> attention output [L, H]; adds this step's keys and values to `cache`."""
        c, attn = self.config, self.layers[layer].self_attn
        length, n, nope, rope, dv = x.shape[0], c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q_in = attn.q_a_layernorm(attn.q_a_proj(x)) if c.q_lora_rank is not None else x  # [L, q_lora] or [L, 2H]
        q = (attn.q_b_proj if c.q_lora_rank is not None else attn.q_proj)(q_in).view(length, n, nope + rope)
        latent, k_pe = attn.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, rope], dim=-1)  # [L, kv_lora], [L, r]
        kv = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(length, n, nope + dv)  # [L, n, p+dv]
        k_nope, v = kv.split([nope, dv], dim=-1)  # [L, n, p], [L, n, dv]
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # [L, r]; bf16 under autocast
        q_pe = pairs_to_halves(q[..., nope:])  # [L, n, r]
        q_pe = q_pe * cos[:, None] + rotate_half(q_pe) * sin[:, None]
        k_pe = pairs_to_halves(k_pe)  # [L, r]
        k_pe = k_pe * cos + rotate_half(k_pe) * sin
        width = max(nope + rope, dv)  # one head size for q, k and v: zero padding changes no score and no output
        scale = self.softmax_scale * math.sqrt(width)  # ttt_attend divides by sqrt(width)
        q = torch.cat([q[..., :nope], q_pe], dim=-1) * scale  # [L, n, p+r]
        k = torch.cat([k_nope, k_pe[:, None].expand(length, n, rope)], dim=-1)  # [L, n, p+r]
        q, k, v = (nn.functional.pad(t, (0, width - t.shape[-1])).transpose(0, 1) for t in (q, k, v))  # [n, L, width]
        out = ttt_attend(q, k, v, cache, groups=1)[..., :dv]  # [n, L, width] -> [n, L, dv]
        return attn.o_proj(out.transpose(0, 1).reshape(length, n * dv))  # [n, L, dv] -> [L, n*dv] -> [L, H]

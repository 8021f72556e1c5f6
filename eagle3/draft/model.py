"""The EAGLE-3 draft model, exactly as vLLM's llama_eagle3 serves it.

Parameters (names as vLLM and speculators load them; H = hidden size, n_aux aux states):

    fc.weight                                  [H, n_aux*H]   fuses the target's aux states
    layers.0.input_layernorm.weight            [H]            norms the token embedding
    layers.0.hidden_norm.weight                [H]            norms the hidden input
    layers.0.self_attn.{q,k,v}_proj.weight     [*, 2H]        attention over [embedding; hidden]
    layers.0.self_attn.o_proj.weight           [H, heads*head_dim]
    layers.0.post_attention_layernorm.weight   [H]
    layers.0.mlp.{gate,up,down}_proj.weight    Llama SwiGLU MLP
    norm.weight                                [H]            final norm before lm_head
    lm_head.weight                             [draft_vocab, H]

The token embedding is the target's (frozen, passed in, never exported).

One layer, residual convention of vLLM/speculators:
    residual = hidden_norm(hidden);  x = cat[input_layernorm(emb), hidden_norm(hidden)]   [L, 2H]
    h = residual + o_proj(attn(x));  out = h + mlp(post_attention_layernorm(h))  [L, H]
    logits = lm_head(norm(out));  `out` (before the norm) is the next step's hidden.
More layers (train.draft.num_layers, speculators' and vLLM's multi-layer EAGLE-3): layer i >= 1 is a plain
pre-norm Llama layer over the previous layer's output (q/k/v read [L, H]; no hidden_norm):
    h = out + o_proj(attn(input_layernorm(out)));  out = h + mlp(post_attention_layernorm(h))
with its own TTT cache (new_caches); the last layer's `out` is what the norm and lm_head read.
EAGLE 3.1 (train.draft.fc_norm, norm_output; both off by default): fc reads
    cat[fc_norm.0(aux_0), fc_norm.1(aux_1), ...] instead of cat[aux_0, aux_1, ...], and the next
    step's hidden is norm(out), the state lm_head reads, instead of `out`.
That is norm_before_residual=True, speculators' default and vLLM's when the key is absent; with
False the residual is `hidden` itself. On SmolLM2 (benchmarks/quality.py, 500 samples, 3 epochs)
True gave simulated acceptance 1.798 against 1.622 for False.

TTT (training-time test): the draft is unrolled for K steps over every row t at once.
    step 0 at row t: input [emb(x_{t+1}); fc(aux_t)], predicts the target's distribution at t+1
    step j at row t: input [emb(x_{t+1+j}); out^{j-1}_t],  predicts the target's at t+1+j
Attention at step j, row t: step-0 keys of rows <= t (same document) and the keys of
steps 1..j at row t itself, which is what vLLM's draft KV cache holds when it drafts
token j+1 after row t (ttt_attention_mask is that definition; Eagle3Draft._attend computes
it in O(L) extra memory, as one causal attention plus a "sink" key per row). Packed samples
are kept apart by varlen flash attention on CUDA (one sink per sample, DocLayout), else by a
mask. Rotary
position of step j at row t: position(t) + j.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from eagle3.draft.target_head import TargetHead, TargetTextConfig, rms_norm
from eagle3.draft.ttt_attention import TTTCache, new_ttt_cache, ttt_attend
from eagle3.draft.vocab import VocabMapping

if TYPE_CHECKING:
    from transformers import LlamaConfig


class DraftConfig(BaseModel):
    """Shape of the draft; by default derived from the target's config (`from_target`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(gt=0, description="Hidden size H; equal to the target's (the embedding is shared).")
    num_attention_heads: int = Field(gt=0, description="Query heads of the draft's attention.")
    num_key_value_heads: int = Field(gt=0, description="Key/value heads (GQA); divides num_attention_heads.")
    head_dim: int = Field(gt=0, description="Size of one attention head.")
    intermediate_size: int = Field(gt=0, description="Width of the SwiGLU MLP.")
    rms_norm_eps: float = Field(gt=0, description="Epsilon of every RMSNorm of the draft.")
    rope_parameters: dict[str, float | int | str | list[float] | None] = Field(
        description="RoPE settings in transformers' `rope_parameters` form (rope_type, rope_theta, scaling...).",
    )
    max_position_embeddings: int = Field(gt=0, description="Longest position the RoPE settings are meant for.")
    hidden_act: str = Field(default="silu", description="MLP activation; vLLM's Llama MLP supports only 'silu'.")
    num_aux_hidden_states: int = Field(gt=0, description="Number of target aux states that fc fuses (n_aux).")
    target_vocab_size: int = Field(gt=0, description="Target vocabulary size V.")
    draft_vocab_size: int = Field(gt=0, description="Rows of the draft's lm_head (vocab.draft_vocab_size).")
    norm_before_residual: bool = Field(
        default=True, description="Use hidden_norm(hidden) rather than hidden as the attention residual "
        "(speculators' default; vLLM's when the key is absent)."
    )
    fc_norm: bool = Field(default=False, description="EAGLE 3.1: an RMSNorm per aux state before fc (train.draft.fc_norm).")
    norm_output: bool = Field(default=False, description="EAGLE 3.1: the next step reads the post-norm hidden "
                              "(train.draft.norm_output).")
    num_layers: int = Field(default=1, ge=1, description="Decoder layers (train.draft.num_layers): the first reads "
                            "[embedding; hidden], each later one the previous layer's output.")

    @model_validator(mode="after")
    def _check(self) -> DraftConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) exceeds target_vocab_size "
                f"({self.target_vocab_size}); lower vocab.draft_vocab_size"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act is {self.hidden_act!r}; the EAGLE-3 draft supports only 'silu'")
        if self.rope_parameters.get("rope_type", "default") == "dynamic":
            raise ValueError("rope_parameters.rope_type 'dynamic' is not supported by the draft")
        return self

    @classmethod
    def from_target(
        cls, target: TargetTextConfig, *, num_aux_hidden_states: int, draft_vocab_size: int
    ) -> DraftConfig:
        """Copy the layer shape (heads, head_dim, MLP, RoPE, eps) from the target's config. The MLP is the draft's
        own SwiGLU whatever the target's activation (Apertus: xIELU): vLLM builds it from the draft's config."""
        return cls(
            hidden_size=target.hidden_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_parameters=dict(target.rope_parameters),
            max_position_embeddings=target.max_position_embeddings,
            hidden_act="silu",
            num_aux_hidden_states=num_aux_hidden_states,
            target_vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
        )

    def llama_config(self) -> LlamaConfig:
        """The LlamaConfig of the draft's layers (speculators' `transformer_layer_config`)."""
        from transformers import LlamaConfig  # here, not at the top: every `eagle3` command imports this module

        return LlamaConfig(
            vocab_size=self.target_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, c: DraftConfig, first: bool = True) -> None:
        super().__init__()
        width = 2 * c.hidden_size if first else c.hidden_size  # the first layer reads [embedding; hidden]
        self.q_proj = nn.Linear(width, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(width, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(width, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """A decoder layer; only the first has hidden_norm (speculators' layout; vLLM builds the norm in every layer, reads
    it in the first alone and leaves it unloaded in the others)."""

    def __init__(self, c: DraftConfig, first: bool = True) -> None:
        super().__init__()
        self.self_attn = _Attention(c, first)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int64 [L] -> cos, sin [L, head_dim] (HF/vLLM neox layout: halves repeated)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [L, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [L, head_dim]
    return emb.cos() * scaling, emb.sin() * scaling


class Eagle3Draft(nn.Module):
    """fc + decoder layers (one by default) + norm + lm_head; see the module docstring for the math."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(c.num_aux_hidden_states * c.hidden_size, c.hidden_size, bias=False)
        self.fc_norm = fc_norms(c)
        self.layers = nn.ModuleList([_Layer(c, first=i == 0) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rotary = LlamaRotaryEmbedding(c.llama_config())
        self.register_buffer("inv_freq", rotary.inv_freq.clone(), persistent=False)  # [head_dim/2]
        self.rope_scaling = float(rotary.attention_scaling)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [L, n_aux, H] -> fused hidden [L, H] (EAGLE 3.1's fc_norm: each aux state normed by its own norm first)."""
        if self.fc_norm is not None:
            aux = torch.stack([norm(aux[:, i]) for i, norm in enumerate(self.fc_norm)], dim=1)  # [L, n_aux, H]
        return self.fc(aux.flatten(-2))  # [L, n_aux*H] -> [L, H]

    def new_caches(self, doc_ids: torch.Tensor | None, length: int, device: torch.device,
                   dtype: torch.dtype) -> list[TTTCache]:
        """One TTT cache per decoder layer for an unroll over `length` rows (new_ttt_cache; the mask is shared)."""
        first = new_ttt_cache(doc_ids, length, device, dtype)
        return [first] + [TTTCache(mask=first.mask, docs=first.docs) for _ in self.layers[1:]]

    def _attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: TTTCache,
                layer: int = 0) -> torch.Tensor:
        """x [L, 2H] (layer 0) or [L, H] -> attention output [L, H]; adds this step's keys and values to `cache`
        (ttt_attend says how the TTT mask is computed without building it)."""
        c, attn = self.config, self.layers[layer].self_attn
        length, hd, groups = x.shape[0], c.head_dim, c.num_attention_heads // c.num_key_value_heads
        q = attn.q_proj(x).view(length, c.num_attention_heads, hd).transpose(0, 1)  # [heads, L, hd]
        k = attn.k_proj(x).view(length, c.num_key_value_heads, hd).transpose(0, 1)  # [kvh, L, hd]
        v = attn.v_proj(x).view(length, c.num_key_value_heads, hd).transpose(0, 1)  # [kvh, L, hd]
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # bf16 under autocast: keeps attention in bf16
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = ttt_attend(q, k, v, cache, groups)  # [heads, L, hd]
        return attn.o_proj(out.transpose(0, 1).reshape(length, -1))  # [heads, L, hd] -> [L, heads*hd] -> [L, H]

    def step(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, caches: list[TTTCache]
    ) -> torch.Tensor:
        """One draft forward: embeds, hidden [L, H] -> output hidden [L, H] (before the final norm); `caches`: one
        per layer (new_caches)."""
        layer = self.layers[0]
        normed_hidden = layer.hidden_norm(hidden)  # [L, H]
        residual = normed_hidden if self.config.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed_hidden], dim=-1)  # [L, 2H]
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scaling)  # [L, hd] each
        h = residual + self._attend(x, cos, sin, caches[0])  # [L, H]
        out = h + layer.mlp(layer.post_attention_layernorm(h))  # [L, H]
        for index in range(1, len(self.layers)):  # later layers: pre-norm residual blocks over the previous output
            layer = self.layers[index]
            h = out + self._attend(layer.input_layernorm(out), cos, sin, caches[index], index)  # [L, H]
            out = h + layer.mlp(layer.post_attention_layernorm(h))  # [L, H]
        return out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Output hidden [L, H] -> draft logits [L, draft_vocab]."""
        return self.lm_head(self.norm(out))

    def unroll(
        self,
        aux: torch.Tensor,
        step_tokens: torch.Tensor,
        positions: torch.Tensor,
        doc_ids: torch.Tensor | None,
        embed: torch.Tensor,
    ) -> Iterator[torch.Tensor]:
        """Yield draft logits [L, draft_vocab] for TTT steps 0..K-1.

        aux [L, n_aux, H]: target aux states per row; step_tokens int64 [K, L]: the input
        token of each step (x_{t+1+j} at row t); positions int64 [L]: position of row t in
        its document; doc_ids [L]: document of each row (packing), or None when all rows are
        one document (plain causal attention: the fast path); embed [V, H]: the target's
        embedding (frozen).
        """
        hidden = self.fuse(aux)  # [L, H]
        length = hidden.shape[0]
        caches = self.new_caches(doc_ids, length, hidden.device, hidden.dtype)  # hidden: bf16 under autocast
        for step in range(step_tokens.shape[0]):
            embeds = F.embedding(step_tokens[step], embed).to(hidden.dtype)  # [L, H]
            out = self.step(embeds, hidden, positions + step, caches)  # [L, H]
            logits, hidden = self.logits_and_next(out)
            yield logits

    def logits_and_next(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's output hidden [L, H] -> (draft logits [L, draft_vocab], the hidden the next step reads [L, H]):
        `out` itself, or with EAGLE 3.1's norm_output the normed state lm_head reads (one norm either way)."""
        if not self.config.norm_output:
            return self.logits(out), out
        normed = self.norm(out)
        return self.lm_head(normed), normed




def fc_norms(config: DraftConfig) -> nn.ModuleList | None:
    """EAGLE 3.1's fc_norm: one RMSNorm per aux state (fc_norm.<i>.weight, as vLLM and speculators name them)."""
    if not config.fc_norm:
        return None
    return nn.ModuleList([RMSNorm(config.hidden_size, config.rms_norm_eps) for _ in range(config.num_aux_hidden_states)])


def ttt_alignment(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, steps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What each TTT step at each row of one sample reads and is judged on.

    input_ids int64 [T], loss_mask bool [T] -> three [K, T] tensors, for step j at row t:
      step_tokens  int64  x_{t+1+j}, the step's input token (0 past the end)
      target_pos   int64  t+1+j, the row whose final state gives the target distribution
                          (clamped to T-1 past the end)
      weights      bool   loss_mask[t+2+j]: the token that distribution predicts exists and
                          is one the draft must learn (an assistant token)
    """
    length = input_ids.shape[0]
    rows = torch.arange(length)  # [T]
    offsets = torch.arange(steps)[:, None]  # [K, 1]
    source = rows[None, :] + 1 + offsets  # [K, T]: t+1+j
    inside = source < length  # [K, T]
    step_tokens = torch.where(inside, input_ids[source.clamp(max=length - 1)], 0)  # [K, T]
    target_pos = source.clamp(max=length - 1)  # [K, T]
    predicted = source + 1  # [K, T]: t+2+j
    weights = (predicted < length) & loss_mask.to(torch.bool)[predicted.clamp(max=length - 1)]  # [K, T]
    return step_tokens, target_pos, weights


def init_draft(model: Eagle3Draft, head: TargetHead, mapping: VocabMapping, seed: int) -> None:
    """Random init (std 0.02, norms 1) seeded by `seed`; final norm and lm_head from the target.

    Starting the lm_head at the target's rows for the draft vocabulary (and the norm at the
    target's final norm) makes the draft's output space the target's from step one.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        # the draft's norm is a plain RMSNorm: a (1 + w) norm's scale is 1 + w
        model.norm.weight.copy_(head.norm_weight.float() + (1.0 if head.norm_kind == "rms_offset" else 0.0))
        model.lm_head.weight.copy_(head.lm_head[mapping.target_ids].float() * head.logit_multiplier)

"""The DFlash draft (Chen, Liang, Liu, arXiv 2602.06036), exactly as vLLM 0.32's DFlashQwen3ForCausalLM serves it
(model_executor/models/qwen3_dflash.py with the proposer v1/spec_decode/dflash.py), and its training loss.

DFlash drafts a whole block in one non-causal forward. Parameters (vLLM's names; H hidden, n target layers read,
L draft layers, V the target's vocabulary):

    fc.weight                                   [H, n*H]   fuses the target's states at target_layer_ids
    hidden_norm.weight                          [H]        norms the fused context
    layers.i.input_layernorm.weight             [H]        Qwen3 decoder layers, i < L
    layers.i.self_attn.{q,k,v,o}_proj.weight    GQA attention, no bias
    layers.i.self_attn.{q,k}_norm.weight        [head_dim] per-head RMSNorm of queries and keys (Qwen3)
    layers.i.post_attention_layernorm.weight    [H]
    layers.i.mlp.{gate,up,down}_proj.weight     SwiGLU
    norm.weight                                 [H]        final norm
    lm_head.weight                              [V, H]     the target's lm_head, frozen (exported as a copy)

The token embedding is the target's (frozen, passed in, never exported: vLLM shares the target's).

What vLLM computes when it drafts after the target has verified up to position p (the bonus token x_{p+1} is known):
    context  c_t = hidden_norm(fc(cat[h_t^{l} for l in target_layer_ids]))  for every position t <= p   [T, H]
             (h^{l} is the OUTPUT of target layer l: vLLM captures aux id l+1, the state entering layer l+1)
    block    tokens [x_{p+1}, m, m, ..., m] (m = mask_token_id) at positions p+1 .. p+S, S = block_size   [S]
    in each layer, the block's queries attend, without a causal mask, to
             keys/values of the context:  k_proj/v_proj(c_t)  (no input_layernorm), k_norm, RoPE at t
             keys/values of the block:    k_proj/v_proj(input_layernorm(x)), k_norm, RoPE at its positions
    logits   lm_head(norm(out)) at slots 1..S-1 draft x_{p+2} .. x_{p+S} (slot 0, the bonus token, is not sampled);
             vLLM serves it with num_speculative_tokens = S - 1.

Training (speculators' and SpecForge's anchor scheme): per sequence, random anchor positions a (loss-masked, with
a whole block inside the sequence); anchor a's block is [x_a, m, .., m] at positions a .. a+S-1, its context the
fused target states at positions < a (exactly what vLLM reads when x_a is the bonus token), and slot k predicts
x_{a+k}. All anchors of a batch run in one forward: each block sees its own context prefix and only its own block.

Loss: the paper's, cross-entropy against the sequence's tokens x_{a+k} (the data are the target's own answers, the
`regenerate` stage), each block slot k >= 1 weighted exp(-(k-1)/gamma) so that early slots, on which every later
accepted token depends, count most. gamma (`decay_gamma`) defaults to 7, the paper's value for its block size 16;
it used 5 for block 10 and 4 for block 8 (speculators' default `dflash_decay_gamma` is 4 with its default block 8).
We take the paper's hard-label cross-entropy rather than speculators' KL to the target's distribution because it is
the loss the published speedups were measured with; speculators' D-PACE weighting may replace it if measurements
favour it (issue 47).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from eagle3.draft.model import RMSNorm, rope_cos_sin, rotate_half
from eagle3.draft.target_head import TargetHead, TargetTextConfig

ARCHITECTURE = "DFlashDraftModel"


class DFlashSettings(BaseModel):
    """Settings of a DFlash draft (train.draft when method is dflash); its layer shape is the target's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int = Field(default=16, ge=2, le=64, description="Tokens per drafted block S: the anchor (the "
                            "token the target just produced) and S-1 mask tokens, so S-1 tokens are drafted per "
                            "forward (vLLM's num_speculative_tokens). The paper trains 16.")
    num_layers: int = Field(default=1, ge=1, le=16, description="Decoder layers of the draft. Each costs about "
                            "one target layer per drafted block (not per token). The paper uses 5 for Qwen3-8B.")
    target_layer_ids: tuple[int, ...] | None = Field(
        default=None, description="Target layers whose OUTPUTS fc fuses (DFlash's numbering: layer l's output is "
        "the state entering layer l+1, vLLM's aux id l+1). Default: the aux layers the pipeline captures, minus 1.")
    mask_token_id: int = Field(ge=0, description="Token id whose (target) embedding fills the block's drafted "
                               "slots; a token that never occurs in text (a reserved or unused id).")
    decay_gamma: float = Field(default=7.0, gt=0, description="Loss weight of block slot k is exp(-(k-1)/gamma); "
                               "the paper's 7 for block 16, 5 for 10, 4 for 8.")


class DFlashConfig(BaseModel):
    """Shape of the DFlash draft: the target's layer shape plus the DFlash settings (`from_target`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(gt=0, description="Hidden size H; the target's (embedding and lm_head are shared).")
    num_attention_heads: int = Field(gt=0, description="Query heads.")
    num_key_value_heads: int = Field(gt=0, description="Key/value heads (GQA).")
    head_dim: int = Field(gt=0, description="Size of one attention head.")
    intermediate_size: int = Field(gt=0, description="Width of the SwiGLU MLP.")
    rms_norm_eps: float = Field(gt=0, description="Epsilon of every RMSNorm.")
    rope_theta: float = Field(gt=0, description="RoPE base (default rope only).")
    max_position_embeddings: int = Field(gt=0, description="Longest position the draft serves.")
    vocab_size: int = Field(gt=0, description="The target's vocabulary V (lm_head rows; no draft vocabulary).")
    num_layers: int = Field(ge=1, description="Draft decoder layers (DFlashSettings.num_layers).")
    block_size: int = Field(ge=2, description="Block size S (DFlashSettings.block_size).")
    target_layer_ids: tuple[int, ...] = Field(min_length=1, description="Target layers fc fuses, DFlash numbering.")
    mask_token_id: int = Field(ge=0, description="The mask token (DFlashSettings.mask_token_id).")
    decay_gamma: float = Field(gt=0, description="Loss decay (DFlashSettings.decay_gamma).")

    @model_validator(mode="after")
    def _check(self) -> DFlashConfig:
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(f"train.draft.mask_token_id is {self.mask_token_id}; expected an id below the target's "
                             f"vocab_size {self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim is {self.head_dim}; RoPE rotates halves, expected an even number")
        return self

    @property
    def num_speculative_tokens(self) -> int:
        """Tokens vLLM drafts per forward: every slot but the anchor's."""
        return self.block_size - 1

    @property
    def capture_layer_ids(self) -> list[int]:
        """The aux layer ids (vLLM's numbering: the state entering layer k) the pipeline captures for this draft."""
        return [layer + 1 for layer in self.target_layer_ids]

    @classmethod
    def from_target(cls, target: TargetTextConfig, settings: DFlashSettings, *, aux_layer_ids: list[int]) -> DFlashConfig:
        """The target's layer shape with `settings`; unset target_layer_ids are the captured aux ids minus 1."""
        rope = target.rope_parameters
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"the target's rope_type is {rope.get('rope_type')!r}; the DFlash draft computes the "
                             "default rope only; set train.draft.method: eagle3 for this target")
        if target.logit_multiplier != 1.0 or target.final_logit_softcap is not None:
            raise ValueError("the target scales or soft-caps its logits, which vLLM's DFlash draft does not; set "
                             "train.draft.method: eagle3 for this target")
        layer_ids = settings.target_layer_ids or tuple(a - 1 for a in aux_layer_ids)
        bad = [layer for layer in layer_ids if not 0 <= layer < target.num_hidden_layers]
        if bad:
            raise ValueError(f"train.draft.target_layer_ids {list(layer_ids)} has {bad}; expected layers 0.."
                             f"{target.num_hidden_layers - 1} of the target (an aux id 0, the embedding, has none)")
        return cls(hidden_size=target.hidden_size, num_attention_heads=target.num_attention_heads,
                   num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
                   intermediate_size=target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
                   rope_theta=float(rope.get("rope_theta", 10000.0)),
                   max_position_embeddings=target.max_position_embeddings, vocab_size=target.vocab_size,
                   num_layers=settings.num_layers, block_size=settings.block_size, target_layer_ids=layer_ids,
                   mask_token_id=settings.mask_token_id, decay_gamma=settings.decay_gamma)


class _Attention(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)


class _MLP(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, d], cos/sin [B, L, d] -> x rotated (neox halves, as vLLM's Qwen3)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashDraft(nn.Module):
    """fc + hidden_norm + Qwen3 layers that attend to the fused context + norm + frozen lm_head (module docstring)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = c = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([_Layer(c) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)  # the target's, frozen
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [d/2]

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, n, H] (the target's states at target_layer_ids) -> fused, normed context [B, T, H]."""
        return self.hidden_norm(self.fc(aux.flatten(-2)))  # [B, T, n*H] -> [B, T, H]

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, L] -> cos, sin [B, L, d]."""
        cos, sin = rope_cos_sin(positions.reshape(-1), self.inv_freq, 1.0)  # [B*L, d]
        return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)

    def forward(self, context: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """context [B, T, H] (from `context`), block_embeds [B, A, S, H] (the embedded [x_a, m, .., m]), anchors
        [B, A] (each block's first position; its context is positions < anchor) -> the blocks' hidden states
        [B, A, S, H] before the final norm."""
        c = self.config
        batch, length = context.shape[:2]
        num_anchors, size = block_embeds.shape[1:3]
        x = block_embeds.reshape(batch, num_anchors * size, c.hidden_size)  # [B, Q, H], Q = A*S
        ctx_pos = torch.arange(length, device=context.device).expand(batch, length)  # [B, T]
        blk_pos = (anchors[:, :, None] + torch.arange(size, device=context.device)).reshape(batch, -1)  # [B, Q]
        ctx_cos, ctx_sin = self._cos_sin(ctx_pos)  # [B, T, d]
        blk_cos, blk_sin = self._cos_sin(blk_pos)  # [B, Q, d]
        # who sees what: a block's queries see the context before its anchor and the whole of their own block
        sees_ctx = ctx_pos[:, None, :] < anchors.repeat_interleave(size, dim=1)[:, :, None]  # [B, Q, T]
        block_of = torch.arange(num_anchors * size, device=context.device) // size  # [Q]
        sees_blk = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)  # [B, Q, Q]
        mask = torch.cat([sees_ctx, sees_blk], dim=-1)[:, None]  # [B, 1, Q, T+Q]
        for layer in self.layers:
            h = layer.input_layernorm(x)
            x = x + self._attend(layer.self_attn, h, context, (blk_cos, blk_sin), (ctx_cos, ctx_sin), mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x.view(batch, num_anchors, size, c.hidden_size)

    def _attend(self, attn: _Attention, h: torch.Tensor, context: torch.Tensor, blk_rope: tuple[torch.Tensor, ...],
                ctx_rope: tuple[torch.Tensor, ...], mask: torch.Tensor) -> torch.Tensor:
        """h [B, Q, H] (normed block), context [B, T, H] -> attention output [B, Q, H]."""
        c = self.config
        d, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(*t.shape[:2], n, d).transpose(1, 2)  # [B, L, n*d] -> [B, n, L, d]

        q = _rope(attn.q_norm(heads(attn.q_proj(h), nh)), *blk_rope)  # [B, nh, Q, d]
        k_blk = _rope(attn.k_norm(heads(attn.k_proj(h), nkv)), *blk_rope)  # [B, nkv, Q, d]
        k_ctx = _rope(attn.k_norm(heads(attn.k_proj(context), nkv)), *ctx_rope)  # [B, nkv, T, d]
        k = torch.cat([k_ctx, k_blk], dim=2)  # [B, nkv, T+Q, d]
        v = torch.cat([heads(attn.v_proj(context), nkv), heads(attn.v_proj(h), nkv)], dim=2)  # [B, nkv, T+Q, d]
        k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))  # [B, nh, T+Q, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(d))  # [B, nh, Q, d]
        return attn.o_proj(out.transpose(1, 2).reshape(*h.shape[:2], nh * d))  # [B, Q, nh*d] -> [B, Q, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]."""
        return self.lm_head(self.norm(hidden))


def init_dflash(model: DFlashDraft, head: TargetHead, seed: int) -> None:
    """Random init (std 0.02, norms 1) seeded by `seed`; lm_head is the target's (frozen), the final norm starts at
    the target's final norm, so the draft's output space is the target's from step one."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.ones_like(param) if name.endswith("norm.weight")
                        else torch.randn(param.shape, generator=generator) * 0.02)
        model.norm.weight.copy_(head.norm_weight.float() + (1.0 if head.norm_kind == "rms_offset" else 0.0))
        model.lm_head.weight.copy_(head.lm_head.float())


@dataclass(frozen=True)
class Blocks:
    """The blocks of one training batch: anchors [B, A], their input tokens [B, A, S], labels [B, A, S-1] (slots
    1..S-1) and loss weights [B, A, S-1] (decay * loss mask * anchor valid)."""

    anchors: torch.Tensor
    tokens: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor


def sample_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, config: DFlashConfig, num_anchors: int,
                  generator: torch.Generator) -> Blocks:
    """Up to `num_anchors` distinct random anchors per row of input_ids/loss_mask [B, T]: loss-masked positions a with
    context before them (a >= 1) and the whole block inside the row (a + S - 1 < T). A row with fewer such positions
    gets weight-0 blocks for the rest."""
    batch, length = input_ids.shape
    size = config.block_size
    pos = torch.arange(length, device=input_ids.device)
    allowed = loss_mask.bool() & (pos >= 1) & (pos + size - 1 < length)  # [B, T]
    scores = torch.rand(batch, length, generator=generator).to(input_ids.device)  # [B, T]
    scores = torch.where(allowed, scores, -1.0)
    top, anchors = scores.topk(min(num_anchors, length), dim=-1)  # [B, A]
    valid = top >= 0  # [B, A]
    anchors = torch.where(valid, anchors, 1)
    order = anchors.argsort(dim=-1)  # in position order: easier to read, the loss is the same
    anchors, valid = anchors.gather(-1, order), valid.gather(-1, order)
    offsets = torch.arange(size, device=input_ids.device)
    where = (anchors[..., None] + offsets).clamp(max=length - 1)  # [B, A, S]
    tokens = torch.full_like(where, config.mask_token_id)
    tokens[..., 0] = input_ids.gather(1, anchors)  # slot 0: the anchor's real token
    labels = input_ids.gather(1, where[..., 1:].flatten(1)).view(batch, -1, size - 1)  # [B, A, S-1]: x_{a+k}
    decay = torch.exp(-torch.arange(size - 1, device=input_ids.device) / config.decay_gamma)  # [S-1]: slot k -> k-1
    in_mask = loss_mask.bool().gather(1, where[..., 1:].flatten(1)).view(batch, -1, size - 1)
    weights = decay * (in_mask & valid[..., None]).float()  # [B, A, S-1]
    return Blocks(anchors=anchors, tokens=tokens, labels=labels, weights=weights)


def block_logits(model: DFlashDraft, aux: torch.Tensor, embed: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """aux [B, T, n, H] (target states at target_layer_ids), embed [V, H] (the target's) -> logits [B, A, S-1, V]
    of the drafted slots."""
    hidden = model(model.context(aux), embed[blocks.tokens], blocks.anchors)  # [B, A, S, H]
    return model.logits(hidden[:, :, 1:])  # slot 0 (the anchor) is never sampled


def dflash_loss(logits: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """The decay-weighted cross-entropy (module docstring), averaged over the weights. logits [B, A, S-1, V]."""
    ce = F.cross_entropy(logits.flatten(0, 2).float(), blocks.labels.flatten(), reduction="none")  # [B*A*(S-1)]
    weights = blocks.weights.flatten()
    return (ce * weights).sum() / weights.sum().clamp_min(1e-6)


def slot_accuracy(logits: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """Top-1 accuracy per drafted slot [S-1] over the counted (loss-masked, valid) blocks."""
    counted = blocks.weights > 0  # [B, A, S-1]
    right = (logits.argmax(-1) == blocks.labels) & counted
    return right.flatten(0, 1).sum(0) / counted.flatten(0, 1).sum(0).clamp_min(1)

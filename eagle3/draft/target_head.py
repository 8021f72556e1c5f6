"""The target's own few tensors the draft needs, and the target's text config.

Training and evaluation need three tensors of the target and nothing else:

    embed_tokens  [V, H]  the draft embeds its input tokens with the target's embedding
                          (frozen, never exported: vLLM shares the target's at serve time)
    norm          [H]     the target's final norm, to turn the stored final hidden state
                          (before the norm) into the target's next-token distribution
    lm_head       [V, H]  the target's output projection (the embedding when tied)

`extract_target_head` pulls exactly these out of a Hugging Face safetensors folder with
`safe_open` (one tensor at a time, never the model), so that a 1T-parameter target costs
seconds here, not the half hour a full load takes. Which tensors, and what the final norm
computes, are read from the target (eagle3.draft.head_spec): transformers builds the target's
own class on the meta device (no weights, no memory), the decoder-stack resolver names its
final norm, and that norm module is run on a probe to tell RMSNorm, Gemma's (1 + w) RMSNorm and
LayerNorm apart. The logit transforms some families apply after lm_head (Cohere's
`logit_scale`, Granite's `logits_scaling`, Gemma's `final_logit_softcapping`) come from the
config. `read_target_config` reads the text config (unwrapping a multimodal `text_config`)
that the draft's layer shape is derived from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3.draft.head_spec import NORM_KINDS, HeadSpec, TargetHeadError, head_spec, logit_transform

HEAD_KEYS = ("embed_tokens.weight", "norm.weight", "lm_head.weight")
__all__ = ["TargetHeadError", "TargetHead", "TargetTextConfig", "extract_target_head", "load_target_head",
           "read_target_config", "target_logits", "rms_norm"]


@dataclass(frozen=True)
class TargetTextConfig:
    """The parts of the target's (text) config.json the draft is shaped from."""

    architectures: tuple[str, ...]
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    hidden_act: str
    tie_word_embeddings: bool
    # after lm_head: logits * logit_multiplier, then c * tanh(logits / c) when final_logit_softcap is c
    logit_multiplier: float
    final_logit_softcap: float | None
    # RoPE settings as transformers 5 spells them ({"rope_type": ..., "rope_theta": ...});
    # a legacy top-level `rope_theta`/`rope_scaling` is folded in here.
    rope_parameters: dict[str, float | int | str | list[float] | None] = field(hash=False)


@dataclass(frozen=True)
class TargetHead:
    """The target's embedding, final norm and lm_head. Shapes: embed/lm_head [V, H]; norm [H].

    norm_kind: "rms" (x / rms(x) * w), "rms_offset" (x / rms(x) * (1 + w)) or "layer"
    ((x - mean) / std * w + b); logits = lm_head(norm(x)) * logit_multiplier, soft-capped at
    final_logit_softcap when set."""

    embed: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    lm_head: torch.Tensor
    norm_kind: str = "rms"
    norm_bias: torch.Tensor | None = None
    logit_multiplier: float = 1.0
    final_logit_softcap: float | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.embed.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.embed.shape[1])

    def to(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> TargetHead:
        return replace(
            self,
            embed=self.embed.to(device=device, dtype=dtype),
            norm_weight=self.norm_weight.to(device=device, dtype=dtype),
            norm_bias=None if self.norm_bias is None else self.norm_bias.to(device=device, dtype=dtype),
            lm_head=self.lm_head.to(device=device, dtype=dtype),
        )


def read_target_config(target_dir: Path) -> TargetTextConfig:
    """Read config.json of an HF model folder; a wrapper's `text_config` is used when present."""
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise TargetHeadError(f"no config.json in target folder {target_dir}; point target_dir at an HF model folder")
    raw = json.loads(path.read_text())
    text = raw.get("text_config") or raw
    try:
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        return TargetTextConfig(
            architectures=tuple(raw.get("architectures") or ()),
            model_type=str(text.get("model_type", raw.get("model_type", "llama"))),
            hidden_size=hidden,
            num_hidden_layers=int(text["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            intermediate_size=int(text["intermediate_size"]),
            vocab_size=int(text["vocab_size"]),
            # the draft's own RMSNorm epsilon: the target's, whichever name its norm's epsilon has
            rms_norm_eps=float(next((text[k] for k in ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon")
                                     if text.get(k) is not None), 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            hidden_act=str(text.get("hidden_act", "silu")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            rope_parameters=rope_parameters_of(text),
            **logit_transform(text, path),
        )
    except KeyError as missing:
        raise TargetHeadError(f"{path} lacks {missing}; is this a decoder-only LLM config?") from missing


def rope_parameters_of(text: dict) -> dict[str, float | int | str | list[float] | None]:
    """RoPE settings of a (text) config dict, in transformers 5's `rope_parameters` form."""
    params = text.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    params = dict(text.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = float(text.get("rope_theta", 10000.0))
    return params


def _weight_map(target_dir: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or the single model.safetensors."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = target_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single.name)
    raise TargetHeadError(
        f"target folder {target_dir} has neither model.safetensors.index.json nor model.safetensors"
    )


def _read(target_dir: Path, weight_map: dict[str, str], key: str) -> torch.Tensor:
    shard = target_dir / weight_map[key]
    if not shard.is_file():
        raise TargetHeadError(f"shard {shard} (holding {key}) is missing from the target folder")
    with safe_open(str(shard), framework="pt") as handle:
        return handle.get_tensor(key)


def extract_target_head(target_dir: Path, out_path: Path) -> HeadSpec:
    """Write the target's embedding, final norm and lm_head to one safetensors file (atomically);
    its metadata says which tensors they were and what the norm computes. Returns that spec."""
    target_dir, out_path = Path(target_dir), Path(out_path)
    weight_map = _weight_map(target_dir)
    spec = head_spec(target_dir, weight_map)
    embed = _read(target_dir, weight_map, spec.embed)  # [V, H]
    norm = _read(target_dir, weight_map, spec.norm)  # [H]
    # Tied embeddings: no lm_head tensor is stored, the embedding plays both parts.
    lm_head = embed if spec.lm_head is None else _read(target_dir, weight_map, spec.lm_head)  # [V, H]
    if lm_head.shape != embed.shape:
        raise TargetHeadError(
            f"target {target_dir}: lm_head shape {tuple(lm_head.shape)} differs from embedding "
            f"shape {tuple(embed.shape)}; expected both [vocab, hidden]"
        )
    tensors = {"embed_tokens.weight": embed, "norm.weight": norm, "lm_head.weight": lm_head.clone()}
    if spec.norm_bias is not None:
        tensors["norm.bias"] = _read(target_dir, weight_map, spec.norm_bias)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=spec.metadata())
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, out_path)
    return spec


def load_target_head(path: Path, config: TargetTextConfig) -> TargetHead:
    """Load what `extract_target_head` wrote, checking it against the target's config."""
    tensors = load_file(str(path))
    missing = [key for key in HEAD_KEYS if key not in tensors]
    if missing:
        raise TargetHeadError(f"target head file {path} lacks {missing}; re-run the stage_target step")
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
    # a file written before the norm was probed holds a Llama-style RMSNorm with the config's epsilon
    kind = meta.get("norm_kind", "rms")
    if kind not in NORM_KINDS:
        raise TargetHeadError(f"target head file {path} says norm_kind={kind!r}; expected one of {list(NORM_KINDS)}; "
                              "re-run the stage_target step")
    head = TargetHead(
        embed=tensors["embed_tokens.weight"],
        norm_weight=tensors["norm.weight"],
        norm_eps=float(meta["norm_eps"]) if "norm_eps" in meta else config.rms_norm_eps,
        lm_head=tensors["lm_head.weight"],
        norm_kind=kind,
        norm_bias=tensors.get("norm.bias"),
        logit_multiplier=config.logit_multiplier,
        final_logit_softcap=config.final_logit_softcap,
    )
    want = (config.vocab_size, config.hidden_size)
    if tuple(head.embed.shape) != want or tuple(head.norm_weight.shape) != (config.hidden_size,):
        raise TargetHeadError(
            f"target head file {path} has embedding {tuple(head.embed.shape)} and norm "
            f"{tuple(head.norm_weight.shape)}; the target config says [vocab, hidden] = {list(want)}"
        )
    return head


def target_logits(head: TargetHead, final_states: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Target logits from final (pre-norm) states: [..., H] -> [..., V] (or [..., len(rows)]).

    `rows` picks lm_head rows (e.g. the draft vocabulary's target ids) to skip the rest.
    """
    normed = final_norm(final_states, head)  # [..., H]
    weight = head.lm_head if rows is None else head.lm_head[rows]  # [V', H]
    logits = normed @ weight.T  # [..., V']
    if head.logit_multiplier != 1.0:
        logits = logits * head.logit_multiplier
    if head.final_logit_softcap is not None:
        logits = torch.tanh(logits / head.final_logit_softcap) * head.final_logit_softcap
    return logits


def final_norm(x: torch.Tensor, head: TargetHead) -> torch.Tensor:
    """The target's final norm of `head.norm_kind`, computed in fp32 and cast back. [..., H] -> [..., H]."""
    if head.norm_kind == "rms":
        return rms_norm(x, head.norm_weight, head.norm_eps)
    x32 = x.float()
    if head.norm_kind == "rms_offset":
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + head.norm_eps)
        return (normed * (1.0 + head.norm_weight.float())).to(x.dtype)
    mean = x32.mean(-1, keepdim=True)
    normed = (x32 - mean) * torch.rsqrt((x32 - mean).pow(2).mean(-1, keepdim=True) + head.norm_eps)
    out = normed * head.norm_weight.float()
    return (out if head.norm_bias is None else out + head.norm_bias.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm, computed in fp32 and cast back as HF and vLLM do. [..., H] -> [..., H]."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)

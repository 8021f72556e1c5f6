"""The target's own few tensors the draft needs, and the target's text config.

Training and evaluation need three tensors of the target and nothing else:

    embed_tokens  [V, H]  the draft embeds its input tokens with the target's embedding
                          (frozen, never exported: vLLM shares the target's at serve time)
    norm          [H]     the target's final RMSNorm, to turn the stored final hidden state
                          (before the norm) into the target's next-token distribution
    lm_head       [V, H]  the target's output projection (the embedding when tied)

`extract_target_head` pulls exactly these out of a Hugging Face safetensors folder with
`safe_open` (one tensor at a time, never the model), so that a 1T-parameter target costs
seconds here, not the half hour a full load takes. `read_target_config` reads the text
config (unwrapping a multimodal `text_config`) that the draft's layer shape is derived from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# Where the three tensors live, per known wrapper. Llama-style names first; a multimodal
# wrapper puts the same names under a prefix (e.g. Kimi-K2.5's `language_model.`).
_PREFIXES = ("", "language_model.", "model.language_model.")
_EMBED = "model.embed_tokens.weight"
_NORM = "model.norm.weight"
_LM_HEAD = "lm_head.weight"

HEAD_KEYS = ("embed_tokens.weight", "norm.weight", "lm_head.weight")


class TargetHeadError(RuntimeError):
    """The target folder lacks a tensor or file the head extraction needs."""


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
    # RoPE settings as transformers 5 spells them ({"rope_type": ..., "rope_theta": ...});
    # a legacy top-level `rope_theta`/`rope_scaling` is folded in here.
    rope_parameters: dict[str, float | int | str | list[float] | None] = field(hash=False)


@dataclass(frozen=True)
class TargetHead:
    """The target's embedding, final norm and lm_head. Shapes: embed/lm_head [V, H]; norm [H]."""

    embed: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    lm_head: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return int(self.embed.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.embed.shape[1])

    def to(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> TargetHead:
        return TargetHead(
            embed=self.embed.to(device=device, dtype=dtype),
            norm_weight=self.norm_weight.to(device=device, dtype=dtype),
            norm_eps=self.norm_eps,
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
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            hidden_act=str(text.get("hidden_act", "silu")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            rope_parameters=rope_parameters_of(text),
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


def _find(weight_map: dict[str, str], name: str) -> str | None:
    for prefix in _PREFIXES:
        if prefix + name in weight_map:
            return prefix + name
    return None


def _read(target_dir: Path, weight_map: dict[str, str], key: str) -> torch.Tensor:
    shard = target_dir / weight_map[key]
    if not shard.is_file():
        raise TargetHeadError(f"shard {shard} (holding {key}) is missing from the target folder")
    with safe_open(str(shard), framework="pt") as handle:
        return handle.get_tensor(key)


def extract_target_head(target_dir: Path, out_path: Path) -> None:
    """Write the target's embedding, final norm and lm_head to one safetensors file (atomically)."""
    target_dir, out_path = Path(target_dir), Path(out_path)
    weight_map = _weight_map(target_dir)
    keys = {name: _find(weight_map, name) for name in (_EMBED, _NORM, _LM_HEAD)}
    for name in (_EMBED, _NORM):
        if keys[name] is None:
            tried = [prefix + name for prefix in _PREFIXES]
            raise TargetHeadError(
                f"target {target_dir} has no tensor named any of {tried}; "
                "this architecture's key names are not supported yet by eagle3.draft.target_head"
            )
    embed = _read(target_dir, weight_map, keys[_EMBED])  # [V, H]
    norm = _read(target_dir, weight_map, keys[_NORM])  # [H]
    # Tied embeddings: no lm_head tensor is stored, the embedding plays both parts.
    lm_head = embed if keys[_LM_HEAD] is None else _read(target_dir, weight_map, keys[_LM_HEAD])  # [V, H]
    if lm_head.shape != embed.shape:
        raise TargetHeadError(
            f"target {target_dir}: lm_head shape {tuple(lm_head.shape)} differs from embedding "
            f"shape {tuple(embed.shape)}; expected both [vocab, hidden]"
        )
    tensors = {"embed_tokens.weight": embed, "norm.weight": norm, "lm_head.weight": lm_head.clone()}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"tied": str(keys[_LM_HEAD] is None)})
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, out_path)


def load_target_head(path: Path, config: TargetTextConfig) -> TargetHead:
    """Load what `extract_target_head` wrote, checking it against the target's config."""
    tensors = load_file(str(path))
    missing = [key for key in HEAD_KEYS if key not in tensors]
    if missing:
        raise TargetHeadError(f"target head file {path} lacks {missing}; re-run the stage_target step")
    head = TargetHead(
        embed=tensors["embed_tokens.weight"],
        norm_weight=tensors["norm.weight"],
        norm_eps=config.rms_norm_eps,
        lm_head=tensors["lm_head.weight"],
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
    normed = rms_norm(final_states, head.norm_weight, head.norm_eps)  # [..., H]
    weight = head.lm_head if rows is None else head.lm_head[rows]  # [V', H]
    return normed @ weight.T  # [..., V']


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm, computed in fp32 and cast back as HF and vLLM do. [..., H] -> [..., H]."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)

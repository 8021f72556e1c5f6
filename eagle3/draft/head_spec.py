"""Which tensors of a target are its embedding, final norm and lm_head, and what that norm computes.

Read from the target, not assumed from Llama: transformers builds the target's own class from its
config on the meta device (no weights, no memory, seconds even for a 1T-parameter MoE); the
decoder-stack resolver (eagle3.capture.layers) names its final norm; `get_input_embeddings()` and
`get_output_embeddings()` name the other two. Those are the names of transformers' modules; a
checkpoint may spell them otherwise (Nemotron-H: `backbone.embeddings.weight` for
`model.embeddings.weight`; Kimi-K2.5: `language_model.` before everything), so each is looked up
as is, under a wrapper prefix, then as the same name under another first component.

The norm module itself is then run, on random weights and a random input, against three formulas
(NORM_KINDS): Llama's RMSNorm `x / rms(x) * w`, Gemma 1-3's `x / rms(x) * (1 + w)` and LayerNorm
`(x - mean) / std * w + b` (Cohere). A norm that matches none is refused with its class named.

A target whose class transformers lacks (remote code only) falls back to Llama's names and RMSNorm,
and the spec says so (`source`); it is refused when those names are not there either.
"""

from __future__ import annotations

import copy
import json
import logging
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

NORM_KINDS = ("rms", "rms_offset", "layer")
# Llama-style names, and the prefixes multimodal wrappers put before them (Kimi-K2.5's `language_model.`)
_PREFIXES = ("", "language_model.", "model.language_model.")
_LLAMA_EMBED, _LLAMA_NORM, _LLAMA_LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


class TargetHeadError(RuntimeError):
    """The target folder lacks a tensor or file the head extraction needs, or its head is of a kind not supported."""


@dataclass(frozen=True)
class HeadSpec:
    """Checkpoint tensor names of the head, and the final norm's formula and epsilon."""

    embed: str
    norm: str
    lm_head: str | None  # None: tied to the embedding
    norm_bias: str | None
    norm_kind: str  # one of NORM_KINDS
    norm_eps: float
    source: str  # how the spec was found: "probed <norm class> of <model class>" or "assumed (<why>)"

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata of the head file (strings only)."""
        return {"tied": str(self.lm_head is None)} | {k: str(v) for k, v in asdict(self).items() if v is not None}


def head_spec(target_dir: Path, weight_map: dict[str, str]) -> HeadSpec:
    """The head of the HF checkpoint in `target_dir` whose tensor names are `weight_map`'s keys."""
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    text = raw.get("text_config") or raw
    model, why_not = _meta_model(Path(target_dir), text)
    if model is None:
        return _llama_style(target_dir, weight_map, text, why_not)
    from eagle3.capture.layers import DecoderStackNotFound, resolve_decoder_stack

    names = {id(p): n for n, p in model.named_parameters()}
    try:
        norm = resolve_decoder_stack(model).norm
    except DecoderStackNotFound as err:
        raise TargetHeadError(f"target {target_dir}: the final norm of {type(model).__name__} was not found ({err})") from None
    embed_name = names[id(model.get_input_embeddings().weight)]
    output = model.get_output_embeddings()
    lm_name = names.get(id(output.weight)) if output is not None else None
    kind, eps = _probe_norm(norm, target_dir)
    norm_names = {n: names[id(p)] for n, p in norm.named_parameters()}
    embed = _checkpoint_key(weight_map, embed_name, target_dir, "embedding")
    lm_head = None
    if lm_name is not None and lm_name != embed_name:
        tied = bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        lm_head = _checkpoint_key(weight_map, lm_name, target_dir, "lm_head", missing_ok=tied)
    return HeadSpec(
        embed=embed, norm=_checkpoint_key(weight_map, norm_names["weight"], target_dir, "final norm"), lm_head=lm_head,
        norm_bias=_checkpoint_key(weight_map, norm_names["bias"], target_dir, "final norm bias") if "bias" in norm_names else None,
        norm_kind=kind, norm_eps=eps, source=f"probed {type(norm).__name__} of {type(model).__name__}",
    )


def logit_transform(text: dict, path: Path) -> dict[str, float | None]:
    """What the target's *ForCausalLM does to lm_head's output, from its (text) config:
    {"logit_multiplier": m, "final_logit_softcap": c or None}: logits * m, then c * tanh(logits / c)."""
    model_type = str(text.get("model_type", ""))
    multiplier = 1.0
    if text.get("logit_scale") is not None:  # Cohere: logits * logit_scale
        multiplier = _scale(text, "logit_scale", model_type, ("cohere",), path, divide=False)
    if text.get("logits_scaling") is not None:  # Granite: logits / logits_scaling; HyperCLOVA X: logits * it
        divide = not model_type.startswith("hyperclovax")
        multiplier = _scale(text, "logits_scaling", model_type, ("granite", "hyperclovax"), path, divide=divide)
    cap = text.get("final_logit_softcapping")
    return {"logit_multiplier": multiplier, "final_logit_softcap": float(cap) if cap else None}


def _scale(text: dict, key: str, model_type: str, families: tuple[str, ...], path: Path, *, divide: bool) -> float:
    value = float(text[key])
    if not model_type.startswith(families):
        warnings.warn(f"{path}: {key}={value} is not applied to the target's logits: eagle3 knows how "
                      f"{', '.join(families)} models apply it, not model_type {model_type!r}", stacklevel=3)
        return 1.0
    return 1.0 / value if divide else value


def _meta_model(target_dir: Path, text: dict) -> tuple[nn.Module | None, str]:
    """transformers' *ForCausalLM for the target's (text) config, built on the meta device, or None and why not.
    Never remote code: a target that needs it takes the Llama-style fallback."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = text.get("model_type")
    if not model_type:
        return None, "its config names no model_type"
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.from_pretrained(str(target_dir)).get_text_config()
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config), ""
    except Exception as err:  # noqa: BLE001 - any reason transformers cannot build it; the fallback says which
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return None, f"transformers {transformers.__version__} cannot build model_type {model_type!r}: {first[:200]}"
    finally:
        quiet.setLevel(level)


def _probe_norm(norm: nn.Module, target_dir: Path) -> tuple[str, float]:
    """(kind, eps) of the final norm module: it is run on random weights and input and compared with each kind."""
    cls = type(norm).__name__
    eps = next((getattr(norm, a) for a in ("eps", "variance_epsilon", "epsilon") if hasattr(norm, a)), "missing")
    if eps == "missing":
        raise TargetHeadError(f"target {target_dir}: final norm {cls} has no eps/variance_epsilon attribute; "
                              f"expected an RMSNorm or LayerNorm")
    eps = float(torch.finfo(torch.float32).eps if eps is None else eps)
    params = dict(norm.named_parameters())
    if "weight" not in params or set(params) - {"weight", "bias"} or params["weight"].dim() != 1:
        raise TargetHeadError(f"target {target_dir}: final norm {cls} has parameters {sorted(params)}; "
                              "expected a [hidden] weight (and bias)")
    probe = copy.deepcopy(norm).to_empty(device="cpu").float()
    g = torch.Generator().manual_seed(0)
    hidden = params["weight"].shape[0]
    f32 = torch.float32  # explicit: never torch's default dtype, which an in-process vLLM load may have moved
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=f32) * 0.5)
        w = probe.weight
        b = probe.bias if "bias" in params else torch.zeros(hidden, dtype=f32)
        x = torch.randn(3, hidden, generator=g, dtype=f32) * 2.0 + 0.7  # a mean far from 0 tells LayerNorm from RMSNorm
        try:
            y = probe(x)
        except Exception as err:  # noqa: BLE001 - any way the module refuses one argument
            raise TargetHeadError(f"target {target_dir}: final norm {cls} cannot be run on one tensor "
                                  f"({type(err).__name__}: {err}); expected an RMSNorm or LayerNorm") from None
        rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        centred = x - x.mean(-1, keepdim=True)
        kinds = {"rms": rms * w, "rms_offset": rms * (1.0 + w),
                 "layer": centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * w + b}
    matches = [k for k, want in kinds.items() if y.shape == want.shape and torch.allclose(y.float(), want, rtol=1e-4, atol=1e-5)]
    if len(matches) != 1:
        raise TargetHeadError(f"target {target_dir}: final norm {cls} computes none of {list(NORM_KINDS)} "
                              f"(x / rms(x) * w, x / rms(x) * (1 + w), LayerNorm); eagle3's draft stages support those only")
    return matches[0], eps


def _checkpoint_key(weight_map: dict[str, str], hf_name: str, target_dir: Path, what: str,
                    missing_ok: bool = False) -> str | None:
    """The checkpoint's name of transformers' parameter `hf_name`: itself, under a wrapper prefix, or the same
    name under another first component (`backbone.norm_f.weight` for `model.norm_f.weight`), if only one."""
    for prefix in _PREFIXES:
        if prefix + hf_name in weight_map:
            return prefix + hf_name
    tail = hf_name.split(".", 1)[-1]
    found = [k for k in weight_map if (k == tail or k.endswith("." + tail)) and not any(p.isdigit() for p in k.split("."))]
    if len(found) == 1:
        return found[0]
    if missing_ok and not found:
        return None
    raise TargetHeadError(f"target {target_dir}: its {what} is {hf_name!r} in transformers, and the checkpoint has "
                          f"{'none' if not found else 'several'} of the names that could be it "
                          f"({found or [p + hf_name for p in _PREFIXES] + ['*.' + tail]})")


def _llama_style(target_dir: Path, weight_map: dict[str, str], text: dict, why_not: str) -> HeadSpec:
    """Llama's names and RMSNorm, for a target transformers cannot build; refused when the names are not there."""
    def find(name: str) -> str | None:
        return next((p + name for p in _PREFIXES if p + name in weight_map), None)

    keys = {name: find(name) for name in (_LLAMA_EMBED, _LLAMA_NORM, _LLAMA_LM_HEAD)}
    for name in (_LLAMA_EMBED, _LLAMA_NORM):
        if keys[name] is None:
            raise TargetHeadError(
                f"target {target_dir} has no tensor named any of {[p + name for p in _PREFIXES]}, and its head cannot "
                f"be read from transformers ({why_not}); this architecture's key names are not supported yet"
            )
    eps = next((text[k] for k in ("rms_norm_eps", "layer_norm_eps", "norm_eps") if text.get(k) is not None), 1e-6)
    return HeadSpec(embed=keys[_LLAMA_EMBED], norm=keys[_LLAMA_NORM], lm_head=keys[_LLAMA_LM_HEAD], norm_bias=None,
                    norm_kind="rms", norm_eps=float(eps), source=f"assumed Llama-style RMSNorm ({why_not})")

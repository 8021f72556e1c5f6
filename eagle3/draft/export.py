"""Export a training checkpoint as a speculators-format EAGLE-3 folder that vLLM serves.

    <out_dir>/config.json         speculators' own Eagle3SpeculatorConfig serialization
    <out_dir>/model.safetensors   fc, layers.0.* (and layers.1.*.. with train.draft.num_layers), norm, lm_head, d2t, t2d

No `embed_tokens` is written: vLLM's llama_eagle3 loader then marks the draft as having
no embedding of its own and shares the target's (the one the draft was trained with).
`norm_before_residual` is always written, because vLLM assumes True when it is absent.
When the draft vocabulary is the whole target vocabulary, d2t/t2d are NOT written: vLLM then
has no mapping parameter and refuses a checkpoint that carries one (the mapping is the identity).
`load_exported_draft` reads such a folder back into an Eagle3Draft and its VocabMapping.

The MLA draft (train.draft.architecture deepseek_mla) is written in vLLM's native EAGLE-3 layout instead
(eagle3.draft.mla_export), with the same d2t/t2d rule; `load_exported_draft` reads both.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3.artifacts import fsync_path
from eagle3.draft import mla_export
from eagle3.draft.architecture import build_draft, draft_config_from_dict
from eagle3.draft.checkpoint import load_checkpoint
from eagle3.draft.mla import MLADraftConfig
from eagle3.draft.model import DraftConfig, Eagle3Draft
from eagle3.draft.target_head import rope_parameters_of
from eagle3.draft.vocab import VocabMapping, check_mapping, load_mapping

WEIGHTS = "model.safetensors"


class ExportError(RuntimeError):
    """The checkpoint, vocab or settings given to the export do not fit together."""


def speculators_config(
    draft: DraftConfig, *, aux_layer_ids: list[int], target_dir: Path, num_speculative_tokens: int
):  # -> speculators.models.eagle3.Eagle3SpeculatorConfig (imported lazily: speculators is heavy)
    """The Eagle3SpeculatorConfig describing `draft` for the verifier in `target_dir`."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    raw = json.loads((Path(target_dir) / "config.json").read_text())
    return Eagle3SpeculatorConfig(
        transformer_layer_config=draft.llama_config(),
        draft_vocab_size=draft.draft_vocab_size,
        norm_before_residual=draft.norm_before_residual,
        fc_norm=draft.fc_norm,
        norm_output=draft.norm_output,
        target_hidden_size=draft.hidden_size,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=num_speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target_dir), architectures=list(raw.get("architectures") or [])),
        ),
    )


def _check_inputs(draft: DraftConfig | MLADraftConfig, mapping: VocabMapping, aux_layer_ids: list[int], trained_aux: object) -> None:
    if len(aux_layer_ids) != draft.num_aux_hidden_states:
        raise ExportError(
            f"aux_layer_ids {aux_layer_ids} has {len(aux_layer_ids)} ids, the checkpoint's fc fuses "
            f"{draft.num_aux_hidden_states}; pass the aux ids the hidden states were extracted with"
        )
    if trained_aux is not None and list(trained_aux) != list(aux_layer_ids):
        raise ExportError(f"aux_layer_ids {aux_layer_ids} differ from the ids {trained_aux} the draft was trained on")
    if (mapping.draft_vocab_size, mapping.target_vocab_size) != (draft.draft_vocab_size, draft.target_vocab_size):
        raise ExportError(
            f"vocab file maps {mapping.draft_vocab_size} of {mapping.target_vocab_size} tokens, the checkpoint "
            f"expects {draft.draft_vocab_size} of {draft.target_vocab_size}; pass the vocab the draft was trained with"
        )


def export_draft(
    checkpoint_dir: Path,
    out_dir: Path,
    *,
    target_dir: Path,
    aux_layer_ids: list[int],
    vocab_path: Path,
    num_speculative_tokens: int = 3,
) -> Path:
    """Write the speculators-format folder for `checkpoint_dir` to `out_dir` (atomically); returns out_dir."""
    checkpoint = load_checkpoint(Path(checkpoint_dir))
    draft = draft_config_from_dict(checkpoint.meta["draft_config"])
    mapping = load_mapping(Path(vocab_path))
    _check_inputs(draft, mapping, list(aux_layer_ids), checkpoint.meta.get("aux_layer_ids"))
    expected = set(build_draft(draft).state_dict())
    if set(checkpoint.weights) != expected:
        raise ExportError(f"checkpoint {checkpoint_dir} weights {sorted(checkpoint.weights)} != {sorted(expected)}")

    out_dir = Path(out_dir)
    tmp = fresh_tmp(out_dir)
    if isinstance(draft, MLADraftConfig):  # vLLM's native layout (eagle3.draft.mla_export)
        native = mla_export.vllm_config(draft, aux_layer_ids=list(aux_layer_ids),
                                        num_speculative_tokens=num_speculative_tokens)
        (tmp / "config.json").write_text(json.dumps(native, indent=1))
        tensors = {mla_export.to_native(name): t.contiguous() for name, t in checkpoint.weights.items()}
    else:
        config = speculators_config(
            draft, aux_layer_ids=list(aux_layer_ids), target_dir=Path(target_dir),
            num_speculative_tokens=num_speculative_tokens,
        )
        config.save_pretrained(str(tmp))
        tensors = {name: t.contiguous() for name, t in checkpoint.weights.items()}
    if mapping.draft_vocab_size != mapping.target_vocab_size:  # else the identity, which vLLM wants left out
        tensors["d2t"], tensors["t2d"] = mapping.d2t.contiguous(), mapping.t2d.contiguous()
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    for path in (tmp / WEIGHTS, tmp / "config.json", tmp):
        fsync_path(path)
    _swap_in(tmp, out_dir)
    return out_dir


def fresh_tmp(out_dir: Path) -> Path:
    """An empty folder beside `out_dir` to build an export in, after removing what earlier or killed exports to
    `out_dir` left there; `_swap_in` then puts it in place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):  # this one's and a killed export's leftovers
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir()
    return tmp


def _swap_in(tmp: Path, out_dir: Path) -> None:
    """Replace out_dir by tmp; an existing out_dir is moved aside first, then removed."""
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)


def load_exported_draft(export_dir: Path) -> tuple[Eagle3Draft, VocabMapping]:
    """Read an exported folder back: the draft (fp32, eval mode) and its d2t/t2d."""
    export_dir = Path(export_dir)
    raw = json.loads((export_dir / "config.json").read_text())
    native = mla_export.is_native_mla(raw)
    draft = mla_export.draft_config_of(raw) if native else _speculators_draft_config(raw, export_dir)
    tensors = load_file(str(export_dir / WEIGHTS))
    if native:
        tensors = {mla_export.from_native(name): t for name, t in tensors.items()}
    if "d2t" in tensors:
        mapping = VocabMapping(d2t=tensors.pop("d2t").to(torch.int64), t2d=tensors.pop("t2d").to(torch.bool))
    elif draft.draft_vocab_size == draft.target_vocab_size:  # the whole vocabulary: the identity mapping
        mapping = VocabMapping(d2t=torch.zeros(draft.draft_vocab_size, dtype=torch.int64),
                               t2d=torch.ones(draft.target_vocab_size, dtype=torch.bool))
    else:
        raise ExportError(f"{export_dir / WEIGHTS} has no d2t/t2d, but its draft vocabulary ({draft.draft_vocab_size}) "
                          f"is smaller than the target's ({draft.target_vocab_size}); re-export the draft")
    check_mapping(mapping, source=str(export_dir / WEIGHTS))
    tensors.pop("embed_tokens.weight", None)  # some exporters ship the target's embedding; it is not the draft's
    model = build_draft(draft)
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    return model.eval(), mapping


def _speculators_draft_config(raw: dict, export_dir: Path) -> DraftConfig:
    """The Llama-style DraftConfig of a speculators-format config.json."""
    if raw.get("speculators_model_type") != "eagle3":
        raise ExportError(f"{export_dir} is not an EAGLE-3 speculators folder (speculators_model_type "
                          f"{raw.get('speculators_model_type')!r}) nor vLLM's native MLA EAGLE-3 layout "
                          f"(architectures {raw.get('architectures')})")
    layer = raw["transformer_layer_config"]
    return DraftConfig(
        hidden_size=layer["hidden_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        intermediate_size=layer["intermediate_size"],
        rms_norm_eps=layer["rms_norm_eps"],
        rope_parameters=rope_parameters_of(layer),
        max_position_embeddings=layer["max_position_embeddings"],
        hidden_act=layer.get("hidden_act", "silu"),
        num_aux_hidden_states=len(raw["eagle_aux_hidden_state_layer_ids"]),
        target_vocab_size=layer["vocab_size"],
        draft_vocab_size=raw["draft_vocab_size"],
        norm_before_residual=raw.get("norm_before_residual", True),  # vLLM's default when absent
        fc_norm=bool(raw.get("fc_norm", False)),
        norm_output=bool(raw.get("norm_output", False)),
        num_layers=int(layer.get("num_hidden_layers", 1)),
    )


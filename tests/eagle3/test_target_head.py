"""The target head read from each matrix row's own checkpoint gives that target's own logits.

The draft is trained on the target's next-token distribution, computed from the stored final state
(before the norm) by eagle3.draft.target_head. A wrong norm formula or a missing logit transform
does not break anything a user sees at once (greedy verification keeps served outputs unchanged),
it only trains a worse draft; so each row's head is checked against transformers' own forward, in
float32: Llama's RMSNorm, Qwen3-Next's (1 + w) RMSNorm, Cohere's LayerNorm and logit_scale,
Granite's logits_scaling, Nemotron-H's `backbone.*` names, Kimi-K2.5's wrapper prefix. No vLLM here:
the checkpoints are the rows' (tests/eagle3/arch_builders.py), built in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3.capture.layers import resolve_decoder_stack
from eagle3.draft.target_head import TargetHeadError, extract_target_head, load_target_head, read_target_config, target_logits
from tests.eagle3 import arch_builders

ROWS = {
    "llama": arch_builders.llama,
    "qwen2": arch_builders.qwen2,
    "qwen3_moe": arch_builders.qwen3_moe,
    "gpt_oss": arch_builders.gpt_oss,
    "gemma4_text": arch_builders.gemma4_text,
    "granite": arch_builders.granite,
    "nemotron_h": arch_builders.nemotron_h,
    "cohere2_moe": arch_builders.cohere2_moe,
    "apertus": arch_builders.apertus,
    "afmoe": arch_builders.afmoe,
    "qwen3_next": arch_builders.qwen3_next,
    "deepseek_v3": lambda out: arch_builders.build_deepseek_v3(out, num_layers=2),
    "kimi_k25": lambda out: arch_builders.build_kimi_k25(out, num_layers=2),
}
# what the probe must find: the norm's formula, and the logit multiplier the config asks for
EXPECTED = {"qwen3_next": ("rms_offset", 1.0), "cohere2_moe": ("layer", 1 / 16), "granite": ("rms", 1 / 8)}


def _hf_logits_and_prenorm_state(model_dir: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits [T, V] for `ids`, and the state entering its final norm [T, H]."""
    model = arch_builders.reference_text_model(model_dir)
    entering = {}
    hook = resolve_decoder_stack(model).norm.register_forward_hook(lambda _m, args, _out: entering.update(x=args[0]))
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    hook.remove()
    return logits, entering["x"][0]


@pytest.mark.parametrize("name", list(ROWS))
def test_the_head_gives_the_targets_own_logits(name: str, tmp_path: Path):
    model_dir = ROWS[name](tmp_path / name)
    spec = extract_target_head(model_dir, tmp_path / "head.safetensors")
    head = load_target_head(tmp_path / "head.safetensors", read_target_config(model_dir))
    kind, multiplier = EXPECTED.get(name, ("rms", 1.0))
    assert (head.norm_kind, head.logit_multiplier) == (kind, pytest.approx(multiplier)), spec
    assert spec.source.startswith("probed"), spec.source  # read from transformers' class, not assumed
    ids = torch.randint(3, 200, (12,), generator=torch.Generator().manual_seed(0))
    want, entering = _hf_logits_and_prenorm_state(model_dir, ids)
    torch.testing.assert_close(target_logits(head, entering), want, rtol=1e-5, atol=1e-5)
    rows = torch.tensor([5, 7, 11])
    torch.testing.assert_close(target_logits(head, entering, rows), want[:, rows], rtol=1e-5, atol=1e-5)


def test_nemotron_h_names_are_read_as_the_checkpoint_spells_them(tmp_path: Path):
    spec = extract_target_head(arch_builders.nemotron_h(tmp_path / "n"), tmp_path / "head.safetensors")
    assert (spec.embed, spec.norm, spec.lm_head) == ("backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head.weight")


def test_a_target_transformers_cannot_build_takes_llama_names_and_says_so(tmp_path: Path):
    model_dir = arch_builders.llama(tmp_path / "custom")
    config = json.loads((model_dir / "config.json").read_text()) | {"model_type": "acme_custom", "architectures": ["AcmeForCausalLM"]}
    (model_dir / "config.json").write_text(json.dumps(config))
    spec = extract_target_head(model_dir, tmp_path / "head.safetensors")
    assert spec.norm_kind == "rms" and spec.norm == "model.norm.weight"
    assert spec.source.startswith("assumed Llama-style RMSNorm") and "acme_custom" in spec.source


def test_a_final_norm_of_no_known_formula_is_refused_with_its_class(tmp_path: Path, monkeypatch):
    """A norm that scales by the mean absolute value: neither RMSNorm nor LayerNorm. No head file is written."""
    from transformers.models.llama import modeling_llama

    def mean_abs_norm(self, hidden_states):  # noqa: ANN001, ANN202
        return self.weight * hidden_states / (hidden_states.abs().mean(-1, keepdim=True) + self.variance_epsilon)

    model_dir = arch_builders.llama(tmp_path / "odd")
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", mean_abs_norm)
    with pytest.raises(TargetHeadError, match="final norm LlamaRMSNorm computes none of"):
        extract_target_head(model_dir, tmp_path / "head.safetensors")
    assert not (tmp_path / "head.safetensors").exists()

"""EAGLE 3.1 (train.draft.fc_norm, train.draft.norm_output): trained here, exported, and computed by vLLM 0.32 as we do.

A tiny draft with both flags is trained on the tiny world of draft_fixtures (the project's own trainer), exported,
and loaded by speculators and by vLLM's own Eagle3LlamaForCausalLM while it serves the tiny target (float32). vLLM's
first draft forward (fc over the target's aux states through the per-state norms, the whole prompt) and its second
(one token a request, reading the hidden the first handed on, which is post-norm with norm_output) give our
module's logits within 1e-4, and the hidden it hands on is our post-norm state: the two flags mean in vLLM what
they mean in training. With both flags off (the default) the train fingerprint and the export are as before.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from eagle3.draft.architecture import DraftSettings
from eagle3.train.config import TrainConfig
from tests.eagle3.draft_fixtures import AUX_LAYER_IDS, SMALL_DRAFT, one_thread, trained_and_exported  # noqa: F401
from tests.eagle3.vllm_drafter import assert_vllm_computes_our_llama_draft

EAGLE_3_1 = DraftSettings(fc_norm=True, norm_output=True)


def _trained_3_1():
    """(checkpoint, export dir) of a 40-step EAGLE 3.1 draft on the tiny world."""
    return trained_and_exported(EAGLE_3_1, "3-1")


def test_the_export_says_eagle_3_1_the_way_vllm_and_speculators_read_it():
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3.draft.checkpoint import load_checkpoint
    from eagle3.draft.export import load_exported_draft

    checkpoint, export = _trained_3_1()
    raw = json.loads((export / "config.json").read_text())
    assert raw["fc_norm"] is True and raw["norm_output"] is True
    with safe_open(str(export / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {f"fc_norm.{i}.weight" for i in range(len(AUX_LAYER_IDS))} <= names
    trained = load_checkpoint(checkpoint).weights
    assert not torch.equal(trained["fc_norm.0.weight"], torch.ones_like(trained["fc_norm.0.weight"]))  # it learned
    loaded = Eagle3DraftModel.from_pretrained(str(export))  # speculators: same flags, same weights
    assert loaded.config.fc_norm and loaded.config.norm_output
    state = loaded.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in trained.items())
    ours, _ = load_exported_draft(export)
    assert ours.config.fc_norm and ours.config.norm_output and ours.fc_norm is not None


def test_the_flags_change_the_train_fingerprint_and_leave_the_default_as_it_was(tmp_path):
    from eagle3.draft.architecture import resolve

    default, flagged = TrainConfig(), TrainConfig(draft=EAGLE_3_1)
    assert resolve(default.draft, None).model_dump() == DraftSettings(architecture="llama").model_dump()
    assert resolve(flagged.draft, None).model_dump() != resolve(default.draft, None).model_dump()


def test_vllm_computes_the_eagle_3_1_draft_as_we_train_it():
    """vLLM's fc reads the aux states through the per-state norms, and the hidden it hands on is our post-norm state
    (norm_output): assert_vllm_computes_our_llama_draft checks both, and the logits of both draft steps."""
    _, export = _trained_3_1()
    theirs = assert_vllm_computes_our_llama_draft(export)
    assert theirs.model.fc_norm is not None and theirs.model.norm_output  # vLLM read both flags


@pytest.mark.parametrize("flags", [{"fc_norm": True}, {"norm_output": True}])
def test_each_flag_alone_changes_what_the_draft_computes(flags):
    """Either flag alone is a different draft (the two are independent in vLLM and speculators too)."""
    from eagle3.draft.model import DraftConfig, Eagle3Draft

    base = SMALL_DRAFT
    torch.manual_seed(0)
    plain = Eagle3Draft(DraftConfig(**base))
    # a final norm of weight 1 would hide norm_output: the next step reads its hidden through hidden_norm, and an
    # RMSNorm of an RMSNorm's output is the same as of its input when the first one's weight is uniform
    plain.norm.weight.data.uniform_(0.5, 1.5)
    flagged = Eagle3Draft(DraftConfig(**base, **flags))
    flagged.load_state_dict(plain.state_dict(), strict=False)
    if flagged.fc_norm is not None:
        for norm in flagged.fc_norm:
            norm.weight.data.uniform_(0.5, 1.5)
    aux, embed = torch.randn(7, 3, 64) * 3, torch.randn(512, 64)
    step_tokens, positions = torch.randint(0, 512, (3, 7)), torch.arange(7)
    with torch.no_grad():
        a = list(plain.unroll(aux, step_tokens, positions, None, embed))
        b = list(flagged.unroll(aux, step_tokens, positions, None, embed))
    assert all(x.shape == y.shape for x, y in zip(a, b)) and not torch.allclose(a[-1], b[-1], atol=1e-4)
    if "norm_output" in flags:  # the first step reads fc(aux) alone: only later steps differ
        torch.testing.assert_close(a[0], b[0])

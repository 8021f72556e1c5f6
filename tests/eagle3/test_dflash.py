"""The DFlash draft (eagle3.draft.dflash, issue 47) against vLLM's own DFlashQwen3ForCausalLM, beside a tiny Qwen3.

One world per module (about 5 s, then two engine loads): the tiny Qwen3 of tests/eagle3/arch_builders.py (its lm_head
scaled so its next-token distribution is peaked, as a trained model's is), its own greedy answers to random prompts
with the states of the aux layers captured by transformers, a DFlash draft (2 layers, block 4) trained on them for 40
steps and exported (eagle3.draft.dflash_export). Then:
- training lowers the held-out loss (the same held-out blocks before and after);
- vLLM, serving the export, feeds its draft the target states our training read (the layer numbering holds), and its
  draft computes our module's logits for the same context and block, on its first draft (the whole prompt as
  context) and its second (the context built up in its KV cache across steps);
- greedy output with the draft is the target's alone, and vLLM accepted some of the draft's tokens (its spec-decode
  counters). The served prompts are training prompts: 40 steps on 40 answers of a random target teach the draft
  what it saw, not the target in general (on fresh prompts vLLM accepted 1 of 177 draft tokens), so this shows the
  served draft is the trained one end to end; the logits comparison above is the exact check.

On the CPU (`make test`): float32. On CUDA (`make test-gpu`): the engines in bfloat16, each comparison within that
dtype's tolerance (tests/on_device.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.draft.dflash import (
    DFlashConfig,
    DFlashDraft,
    DFlashSettings,
    block_logits,
    dflash_loss,
    init_dflash,
    sample_blocks,
    slot_accuracy,
)
from eagle3.draft.dflash_export import export_dflash, load_exported_dflash
from eagle3.draft.target_head import (
    TargetHead,
    extract_target_head,
    load_target_head,
    read_target_config,
)
from tests.eagle3 import arch_builders
from tests.eagle3.draft_fixtures import single_thread
from tests.on_device import (
    DTYPE,
    KV_CACHE_GIB,
    assert_close,
    eager_serving,
    report,
    v1_model_runner,
)

LAYERS, AUX = 8, [2, 4, 5]  # the pipeline's default aux ids for 8 layers: [2, N//2, N-3]
PROMPT, ANSWER = 8, 32
MASK = arch_builders.VOCAB - 1  # an id the byte-level tokenizer never produces
SETTINGS = DFlashSettings(block_size=4, num_layers=2, mask_token_id=MASK, decay_gamma=4.0)
STEPS, ANCHORS = 40, 8


@dataclass(frozen=True)
class Captured:
    input_ids: torch.Tensor  # [N, T]
    loss_mask: torch.Tensor  # [N, T]: the answers
    aux: torch.Tensor  # [N, T, n, H]: the states entering layers AUX (vLLM's numbering)


@dataclass(frozen=True)
class World:
    target_dir: Path
    head: TargetHead
    config: DFlashConfig
    heldout: Captured
    loss_before: float
    loss_after: float
    accuracy_after: list[float]
    export: Path


def _prompts(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 250, (n, PROMPT), generator=torch.Generator().manual_seed(seed))  # [n, P]


def _capture(model, prompts: torch.Tensor) -> Captured:  # noqa: ANN001 - a transformers Qwen3ForCausalLM
    """The target's greedy answers to `prompts` and the aux states of prompt + answer (transformers' hidden_states[k]
    is the state entering layer k, vLLM's aux id k)."""
    with torch.no_grad():
        ids = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=ANSWER,
                             min_new_tokens=ANSWER, do_sample=False, pad_token_id=0)  # [n, P + A]
        states = model(ids, output_hidden_states=True).hidden_states
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[:, PROMPT:] = True
    return Captured(ids, mask, torch.stack([states[k] for k in AUX], dim=2))


def _heldout_loss(draft: DFlashDraft, head: TargetHead, data: Captured) -> tuple[float, list[float]]:
    blocks = sample_blocks(data.input_ids, data.loss_mask, draft.config, ANCHORS, torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = block_logits(draft, data.aux, head.embed, blocks)
    return float(dflash_loss(logits, blocks)), slot_accuracy(logits, blocks).tolist()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:  # noqa: ANN001
    from transformers import Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("dflash")
    target_dir = arch_builders.build_qwen3(root / "qwen3", num_layers=LAYERS)
    weights = load_file(str(target_dir / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 25  # a peaked next-token distribution: no near-ties
    save_file(weights, str(target_dir / "model.safetensors"), metadata={"format": "pt"})
    extract_target_head(target_dir, root / "head.safetensors")
    text = read_target_config(target_dir)
    head = load_target_head(root / "head.safetensors", text)
    config = DFlashConfig.from_target(text, SETTINGS, aux_layer_ids=AUX)
    with single_thread():
        target = Qwen3ForCausalLM.from_pretrained(str(target_dir)).eval()
        train, heldout = _capture(target, _prompts(40, seed=1)), _capture(target, _prompts(12, seed=2))
        del target
        draft = DFlashDraft(config)
        init_dflash(draft, head, seed=0)
        before, _ = _heldout_loss(draft, head, heldout)
        optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
        generator = torch.Generator().manual_seed(3)
        for _ in range(STEPS):
            blocks = sample_blocks(train.input_ids, train.loss_mask, config, ANCHORS, generator)
            loss = dflash_loss(block_logits(draft, train.aux, head.embed, blocks), blocks)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        after, accuracy = _heldout_loss(draft, head, heldout)
    export = export_dflash(draft.eval(), root / "export")
    return World(target_dir, head, config, heldout, before, after, accuracy, export)


def test_config_reads_the_captured_layers_and_export_round_trips(world):
    assert world.config.target_layer_ids == tuple(a - 1 for a in AUX)  # DFlash numbers a layer by its output
    assert world.config.capture_layer_ids == AUX
    raw = json.loads((world.export / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 4
    assert raw["dflash_config"] == {"target_layer_ids": [1, 3, 4], "mask_token_id": MASK}
    names = set(load_file(str(world.export / "model.safetensors")))
    assert "embed_tokens.weight" not in names and {"fc.weight", "hidden_norm.weight", "lm_head.weight"} <= names
    loaded = load_exported_dflash(world.export)
    assert torch.equal(loaded.lm_head.weight, world.head.lm_head)  # the target's lm_head, untouched by training


def test_training_lowers_the_heldout_loss(world):
    report("DFlash held-out loss, before -> after 40 steps", f"{world.loss_before:.3f} -> {world.loss_after:.3f}, "
           f"slot accuracy {[round(a, 3) for a in world.accuracy_after]}")
    assert world.loss_after < 0.6 * world.loss_before
    assert world.accuracy_after[0] > 0.05  # the first drafted slot is right on some held-out blocks


def test_anchors_and_blocks():
    config = DFlashConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                          intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=256,
                          vocab_size=512, num_layers=1, block_size=4, target_layer_ids=(1,), mask_token_id=MASK,
                          decay_gamma=4.0)
    ids = torch.arange(100, 120)[None]  # [1, 20]
    mask = torch.zeros(1, 20, dtype=torch.bool)
    mask[0, 10:] = True  # anchors may be 10..16 (a block of 4 must fit): 7 of them
    blocks = sample_blocks(ids, mask, config, 9, torch.Generator().manual_seed(0))
    valid = blocks.weights[0, :, 0] > 0
    assert valid.sum() == 7 and sorted(blocks.anchors[0, valid].tolist()) == list(range(10, 17))
    first = blocks.anchors[0, valid][0]
    row = valid.nonzero()[0, 0]
    assert blocks.tokens[0, row].tolist() == [100 + int(first), MASK, MASK, MASK]
    assert blocks.labels[0, row].tolist() == [101 + int(first) + k for k in range(3)]
    assert torch.allclose(blocks.weights[0, row], torch.exp(-torch.arange(3) / 4.0))
    # a block never sees the context at or after its anchor, nor another block
    draft = DFlashDraft(config)
    aux = torch.randn(1, 20, 1, 64)
    embed = torch.randn(512, 64)
    with torch.no_grad():
        base = block_logits(draft, aux, embed, blocks)
        later = aux.clone()
        later[0, int(first):] += 1.0
        changed = block_logits(draft, later, embed, blocks)
    assert torch.equal(base[0, row], changed[0, row])
    assert not torch.equal(base[0, -1], changed[0, -1])


def test_bad_settings_name_the_setting(world):
    text = read_target_config(world.target_dir)
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.from_target(text, DFlashSettings(mask_token_id=10_000), aux_layer_ids=AUX)
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig.from_target(text, DFlashSettings(mask_token_id=MASK), aux_layer_ids=[0, 4])


# -- vLLM ----------------------------------------------------------------------------------------------------------


@dataclass
class DraftCalls:
    """What vLLM's draft read and computed, call by call: each context insert (the target's aux states [N, n*H] and
    their positions [N]) and each block forward (input_ids [S], positions [S], logits [S, V])."""

    contexts: list[tuple[torch.Tensor, torch.Tensor]]
    forwards: list[dict]


def _record(model) -> DraftCalls:  # noqa: ANN001 - vLLM's DFlashQwen3ForCausalLM
    calls = DraftCalls([], [])
    pending: list[torch.Tensor] = []
    combine, precompute = model.combine_hidden_states, model.precompute_and_store_context_kv

    def copy(t: torch.Tensor) -> torch.Tensor:  # vLLM reuses its buffers step after step
        return t.detach().to("cpu", torch.float32, copy=True)

    def record_combine(states):  # noqa: ANN001, ANN202
        pending.append(copy(states))
        return combine(states)

    def record_precompute(states, positions, slots=None):  # noqa: ANN001, ANN202
        if slots is not None:  # None: a dummy run, nothing cached
            calls.contexts.append((pending[-1], positions.detach().cpu().clone()))
        return precompute(states, positions, slots)

    def record_forward(module, _args, kwargs, out):  # noqa: ANN001, ANN202
        calls.forwards.append({"input_ids": kwargs["input_ids"].cpu().clone(),
                               "positions": kwargs["positions"].cpu().clone(),
                               "logits": copy(module.compute_logits(out))})

    model.combine_hidden_states = record_combine
    model.precompute_and_store_context_kv = record_precompute
    model.register_forward_hook(record_forward, with_kwargs=True)
    return calls


def _ours_for(draft: DFlashDraft, head: TargetHead, calls: DraftCalls, index: int) -> torch.Tensor:
    """Our logits [S, V] for vLLM's block forward `index`, with the context vLLM's KV cache held then: every
    position before the block's first, its latest insert (a rejected token's state is overwritten when it is
    verified again)."""
    forward = calls.forwards[index]
    start = int(forward["positions"][0])
    by_position: dict[int, torch.Tensor] = {}
    for states, positions in calls.contexts[: index + 1]:  # one context insert before each forward
        by_position |= {int(p): row for p, row in zip(positions, states, strict=True)}
    assert sorted(p for p in by_position if p < start) == list(range(start))
    aux = torch.stack([by_position[p] for p in range(start)])  # [T, n*H]
    aux = aux.view(1, start, len(AUX), -1)  # [1, T, n, H]
    with torch.no_grad():
        hidden = draft(draft.context(aux), head.embed[forward["input_ids"]][None, None], torch.tensor([[start]]))
        return draft.logits(hidden[0, 0])  # [S, V]


@pytest.fixture(scope="module")
def served(world):
    """(greedy outputs without the draft, with it, the spec-decode counters of the latter's batch, vLLM's draft
    calls on one prompt)."""
    from eagle3.capture import vllm_adapter, vllm_serving

    prompts = _prompts(40, seed=1)[:4].tolist()  # training prompts: what the draft learned, served (module doc)
    vllm_adapter.release_all()
    llm = vllm_serving.load_serving_engine(str(world.target_dir), dtype=DTYPE, max_model_len=128, kv_cache_gib=KV_CACHE_GIB,
                                           setup=eager_serving())
    try:
        alone = [o.token_ids for o in vllm_serving.greedy_generate(llm, prompts, max_new_tokens=16)]
    finally:
        vllm_adapter.shutdown_engine(llm)
    with v1_model_runner():  # the hooks read the V1 runner's drafter
        llm = vllm_serving.load_serving_engine(str(world.target_dir), dtype=DTYPE, max_model_len=128, kv_cache_gib=KV_CACHE_GIB,
                                               speculative_dir=str(world.export), speculative_method="dflash",
                                               num_speculative_tokens=world.config.num_speculative_tokens,
                                               setup=eager_serving())
    try:
        calls = _record(llm.collective_rpc(lambda worker: worker.model_runner)[0].drafter.model)
        vllm_serving.greedy_generate(llm, prompts[:1], max_new_tokens=6)  # one request: its calls alone
        recorded = DraftCalls(list(calls.contexts), list(calls.forwards))
        before = vllm_serving.spec_decode_counters(llm)
        with_draft = [o.token_ids for o in vllm_serving.greedy_generate(llm, prompts, max_new_tokens=16)]
        counters = vllm_serving.spec_decode_counters(llm).minus(before)
    finally:
        vllm_adapter.shutdown_engine(llm)
    return alone, with_draft, counters, recorded, prompts


@pytest.mark.vllm
def test_vllm_reads_the_states_we_train_on(world, served):
    from transformers import Qwen3ForCausalLM

    *_, calls, prompts = served
    with torch.no_grad():
        target = Qwen3ForCausalLM.from_pretrained(str(world.target_dir)).eval()
        states = target(torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states
    ours = torch.cat([states[k][0] for k in AUX], dim=-1)  # [P, n*H], as _capture stores them
    theirs, positions = calls.contexts[0]
    assert positions.tolist() == list(range(PROMPT))
    assert_close(theirs, ours, what="DFlash: vLLM's context states vs transformers' capture")


@pytest.mark.vllm
def test_vllm_dflash_module_computes_our_logits(world, served):
    *_, calls, _ = served
    draft = load_exported_dflash(world.export)
    assert len(calls.forwards) >= 2
    for index in (0, 1):
        forward = calls.forwards[index]
        assert forward["input_ids"][1:].eq(MASK).all()  # [bonus, mask, mask, mask]
        assert forward["positions"].tolist() == list(range(int(forward["positions"][0]), int(forward["positions"][0]) + 4))
        ours = _ours_for(draft, world.head, calls, index)
        assert_close(ours, forward["logits"], what=f"DFlash: vLLM's draft vs ours, draft forward {index}'s logits")
    assert calls.forwards[0]["logits"].std() > 0.1  # trained logits, not a degenerate comparison


@pytest.mark.vllm
def test_served_greedy_output_is_unchanged_and_the_draft_proposes(world, served):
    alone, with_draft, counters, _, _ = served
    report("DFlash served beside the tiny Qwen3 (4 prompts x 16 tokens)",
           f"greedy identical {alone == with_draft}; drafts {counters.drafts}, draft tokens {counters.draft_tokens}, "
           f"accepted {counters.accepted_tokens}, per position {list(counters.accepted_per_position)}")
    assert with_draft == alone
    assert counters.drafts > 0 and counters.draft_tokens == 3 * counters.drafts
    assert counters.accepted_tokens > 0

"""The EAGLE-3 draft (eagle3.draft.model) and the target's head (eagle3.draft.target_head).

The reference is speculators' own Eagle3DraftModel, whose layer vLLM serves with the same
residual convention: our TTT unroll must give its logits at every step.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3.capture.store import StoreReader
from eagle3.draft.model import DraftConfig, Eagle3Draft, init_draft, ttt_alignment
from eagle3.draft.target_head import TargetHeadError, extract_target_head, load_target_head, read_target_config
from eagle3.draft.ttt_attention import ttt_attention_mask
from eagle3.draft.vocab import load_mapping
from tests.eagle3.draft_fixtures import AUX_LAYER_IDS, one_thread, tiny_head, tiny_llama_config, tiny_world  # noqa: F401


def _random_draft(seed: int = 0, **changes: object) -> tuple[Eagle3Draft, object, object]:
    """A draft with weights large enough that attention and MLP visibly matter."""
    world = tiny_world()
    mapping = load_mapping(world.vocab_path)
    config = DraftConfig.from_target(
        read_target_config(world.target_dir), num_aux_hidden_states=3, draft_vocab_size=mapping.draft_vocab_size
    ).model_copy(update=changes)
    model = Eagle3Draft(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model, mapping, config


def _unroll_sample(model, sample, steps, head):
    step_tokens, _, _ = ttt_alignment(sample.input_ids, sample.loss_mask, steps)
    length = sample.num_tokens
    with torch.no_grad():
        return list(model.unroll(
            sample.hidden_states[:, :3], step_tokens, torch.arange(length), torch.zeros(length, dtype=torch.long),
            head.embed,
        ))


def test_config_follows_the_target():
    config = DraftConfig.from_target(read_target_config(tiny_world().target_dir), num_aux_hidden_states=3,
                                     draft_vocab_size=256)
    want = tiny_llama_config()
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        want.hidden_size, want.num_attention_heads, want.num_key_value_heads, want.head_dim)
    assert config.intermediate_size == want.intermediate_size and config.rms_norm_eps == want.rms_norm_eps
    assert config.rope_parameters["rope_theta"] == want.rope_parameters["rope_theta"]
    layer = config.llama_config()
    assert layer.num_hidden_layers == 1 and layer.vocab_size == 512 and layer.head_dim == 32


def test_a_draft_vocab_larger_than_the_target_is_refused():
    fields = DraftConfig.from_target(read_target_config(tiny_world().target_dir), num_aux_hidden_states=3,
                                     draft_vocab_size=10).model_dump()
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DraftConfig(**fields | {"draft_vocab_size": 513})


def test_parameter_names_are_the_ones_vllm_and_speculators_load():
    model, _, _ = _random_draft()
    assert set(model.state_dict()) == {
        "fc.weight", "norm.weight", "lm_head.weight",
        "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight", "layers.0.post_attention_layernorm.weight",
        *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    }
    assert model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 2 * 64)  # attention reads [emb; hidden]
    assert model.fc.weight.shape == (64, 3 * 64) and model.lm_head.weight.shape == (256, 64)


@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_every_ttt_step_matches_speculators_eagle3_draft_model(norm_before_residual):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    world, head = tiny_world(), tiny_head()
    model, mapping, config = _random_draft(norm_before_residual=norm_before_residual)
    layer = config.llama_config()
    layer._attn_implementation = "eager"
    reference = Eagle3DraftModel(Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=config.draft_vocab_size, norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=AUX_LAYER_IDS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])),
    ))
    weights = model.state_dict() | {"embed_tokens.weight": head.embed, "d2t": mapping.d2t, "t2d": mapping.t2d,
                                    "verifier_lm_head.weight": head.lm_head[mapping.target_ids],
                                    "verifier_norm.weight": head.norm_weight}
    reference.load_state_dict(weights, strict=True)
    captured = []
    reference.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
    sample = StoreReader(world.train_store)[0]
    length = sample.num_tokens - 1  # speculators' rows: aux of x_0..x_{T-2} with tokens x_1..x_{T-1}
    with torch.no_grad():
        reference.eval()(
            hidden_states=sample.hidden_states[:length, :3].reshape(1, length, -1),
            input_ids=sample.input_ids[1:][None], document_ids=torch.zeros(1, length, dtype=torch.long),
            position_ids=torch.arange(length)[None], ttt_steps=3,
        )
    ours = _unroll_sample(model, sample, 3, head)
    for step in range(3):
        assert ours[step][:length].abs().max() > 1.0  # logits far from trivial
        torch.testing.assert_close(ours[step][:length], captured[step], rtol=0, atol=2e-5)


def test_attention_mask_is_what_the_vllm_draft_kv_cache_holds():
    doc_ids = torch.tensor([0, 0, 0, 1, 1])
    mask = ttt_attention_mask(doc_ids, 2)  # [5, 15]
    assert mask.shape == (5, 15)
    # Row 2 (doc 0): step-0 keys of rows 0..2, then its own keys of steps 1 and 2.
    assert torch.nonzero(mask[2]).flatten().tolist() == [0, 1, 2, 7, 12]
    # Row 3 starts document 1: no step-0 key of document 0.
    assert torch.nonzero(mask[3]).flatten().tolist() == [3, 8, 13]


def test_no_step_reads_the_future_or_another_packed_sample():
    head = tiny_head()
    model, _, _ = _random_draft(1)
    reader = StoreReader(tiny_world().train_store)
    first, second = reader[0], reader[1]
    alone = [_unroll_sample(model, s, 3, head) for s in (first, second)]
    packed_tokens = torch.cat([ttt_alignment(s.input_ids, s.loss_mask, 3)[0] for s in (first, second)], dim=1)
    positions = torch.cat([torch.arange(first.num_tokens), torch.arange(second.num_tokens)])
    doc_ids = torch.cat([torch.zeros(first.num_tokens), torch.ones(second.num_tokens)]).long()
    aux = torch.cat([first.hidden_states[:, :3], second.hidden_states[:, :3]])
    with torch.no_grad():
        packed = list(model.unroll(aux, packed_tokens, positions, doc_ids, head.embed))
    for step in range(3):
        torch.testing.assert_close(packed[step][: first.num_tokens], alone[0][step], rtol=0, atol=1e-5)
        torch.testing.assert_close(packed[step][first.num_tokens :], alone[1][step], rtol=0, atol=1e-5)
    # Changing the sample's tail leaves every earlier row's logits, at every step, unchanged.
    t = 20
    changed = first.hidden_states.clone()
    changed[t + 1 :] = torch.randn_like(changed[t + 1 :])
    tokens = ttt_alignment(first.input_ids, first.loss_mask, 3)[0]
    tokens[:, t + 1 :] = 5
    with torch.no_grad():
        moved = list(model.unroll(changed[:, :3], tokens, torch.arange(first.num_tokens),
                                  torch.zeros(first.num_tokens, dtype=torch.long), head.embed))
    for step in range(3):
        torch.testing.assert_close(moved[step][: t + 1], alone[0][step][: t + 1], rtol=0, atol=1e-6)


def test_ttt_alignment_of_a_short_sample():
    ids = torch.tensor([10, 11, 12, 13, 14])
    mask = torch.tensor([False, False, True, True, True])
    tokens, target_pos, weights = ttt_alignment(ids, mask, 2)
    assert tokens.tolist() == [[11, 12, 13, 14, 0], [12, 13, 14, 0, 0]]
    assert target_pos.tolist() == [[1, 2, 3, 4, 4], [2, 3, 4, 4, 4]]
    # Step 0 at row t predicts token t+2: rows 0..2 predict 12, 13, 14 (assistant tokens).
    assert weights.tolist() == [[True, True, True, False, False], [True, True, False, False, False]]


def test_init_starts_from_the_targets_norm_and_lm_head_rows():
    head, world = tiny_head(), tiny_world()
    model, mapping, _ = _random_draft()
    init_draft(model, head, mapping, seed=3)
    assert torch.equal(model.lm_head.weight, head.lm_head[mapping.target_ids])
    assert torch.equal(model.norm.weight, head.norm_weight)
    again, _, _ = _random_draft()
    init_draft(again, head, mapping, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))
    assert world.vocab_path.is_file()


def test_target_head_holds_exactly_the_three_tensors(tmp_path):
    world = tiny_world()
    out = tmp_path / "head.safetensors"
    extract_target_head(world.target_dir, out)
    full = load_file(str(world.target_dir / "model.safetensors"))
    with safe_open(str(out), framework="pt") as handle:
        assert sorted(handle.keys()) == ["embed_tokens.weight", "lm_head.weight", "norm.weight"]
    head = load_target_head(out, read_target_config(world.target_dir))
    assert torch.equal(head.embed, full["model.embed_tokens.weight"])
    assert torch.equal(head.lm_head, full["lm_head.weight"])
    assert torch.equal(head.norm_weight, full["model.norm.weight"]) and head.norm_eps == 1e-6


def test_target_head_from_a_sharded_target_with_tied_embeddings(tmp_path):
    world = tiny_world()
    full = load_file(str(world.target_dir / "model.safetensors"))
    del full["lm_head.weight"]  # tied: only the embedding is stored
    names = sorted(full)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    target = tmp_path / "target"
    target.mkdir()
    for file, keys in shards.items():
        save_file({k: full[k] for k in keys}, str(target / file))
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((world.target_dir / "config.json").read_text()) | {"tie_word_embeddings": True}
    (target / "config.json").write_text(json.dumps(config))
    extract_target_head(target, tmp_path / "head.safetensors")
    head = load_target_head(tmp_path / "head.safetensors", read_target_config(target))
    assert torch.equal(head.lm_head, full["model.embed_tokens.weight"])


def test_target_head_error_names_the_keys_it_looked_for(tmp_path):
    world = tiny_world()
    target = tmp_path / "target"
    shutil.copytree(world.target_dir, target)
    weights = load_file(str(target / "model.safetensors"))
    weights["backbone.norm_f.weight"] = weights.pop("model.norm.weight")
    save_file(weights, str(target / "model.safetensors"))
    with pytest.raises(TargetHeadError, match="model.norm.weight"):
        extract_target_head(target, tmp_path / "head.safetensors")
    assert not (tmp_path / "head.safetensors").exists()


def _dense_attention(model, xs, positions, doc_ids):
    """The definition: SDPA over every step's keys under ttt_attention_mask (O(K*L^2) mask)."""
    from eagle3.draft.model import rope_cos_sin, rotate_half

    c, attn = model.config, model.layers[0].self_attn
    length, groups = xs[0].shape[0], c.num_attention_heads // c.num_key_value_heads
    keys, values, outs = [], [], []
    for step, x in enumerate(xs):
        cos, sin = rope_cos_sin(positions + step, model.inv_freq, model.rope_scaling)
        q = attn.q_proj(x).view(length, -1, c.head_dim).transpose(0, 1)
        k = attn.k_proj(x).view(length, -1, c.head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(length, -1, c.head_dim).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        keys.append(k)
        values.append(v)
        kk = torch.cat(keys, 1).repeat_interleave(groups, 0)
        vv = torch.cat(values, 1).repeat_interleave(groups, 0)
        mask = ttt_attention_mask(doc_ids, step)
        out = torch.nn.functional.scaled_dot_product_attention(q[None], kk[None], vv[None], attn_mask=mask[None, None])[0]
        outs.append(attn.o_proj(out.transpose(0, 1).reshape(length, -1)))
    return outs


def fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """FAKE of torch.nn.attention.varlen.varlen_attn, which runs only on CUDA (flash kernels): causal
    attention within each sequence of cu_q, by SDPA per sequence on the CPU. It lets the CPU test our
    layout for packed samples (one sink per sample, the row mapping); the H200 run of
    benchmarks/train_throughput.py checks the real kernel against the same definition."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    assert max_q == max_k >= int((cu_q[1:] - cu_q[:-1]).max())
    outs = []
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        part = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads, T, d]
        outs.append(torch.nn.functional.scaled_dot_product_attention(*part, is_causal=True, scale=scale)[0]
                    .transpose(0, 1))
    return torch.cat(outs)


def test_doc_layout_gives_every_sample_its_own_sink_row():
    from eagle3.draft.ttt_attention import DocLayout

    layout = DocLayout.build(torch.tensor([0, 0, 0, 1, 1]))
    assert layout.cu.tolist() == [0, 3, 5] and layout.cu_ext.tolist() == [0, 4, 7]
    assert layout.sinks.tolist() == [0, 4] and layout.rows_ext.tolist() == [1, 2, 3, 5, 6]
    assert layout.max_len == 4  # 3 rows + the sink, as a power of two


@pytest.mark.parametrize("documents,layout", [(1, "mask"), (3, "mask"), (3, "varlen (fake kernel)")])
def test_fast_ttt_attention_equals_the_dense_mask_definition_with_gradients(documents, layout, monkeypatch):
    import eagle3.draft.ttt_attention
    from eagle3.draft.model import rope_cos_sin
    from eagle3.draft.ttt_attention import DocLayout, TTTCache, sink_block_mask

    model, _, config = _random_draft(2)
    length = 40
    doc_ids = torch.arange(length) * documents // length  # [L]: `documents` consecutive samples
    positions = torch.cat([torch.arange(int((doc_ids == d).sum())) for d in range(documents)])
    generator = torch.Generator().manual_seed(4)
    xs = [torch.randn(length, 2 * config.hidden_size, generator=generator, requires_grad=True) for _ in range(4)]
    if layout == "mask":
        cache = TTTCache(mask=sink_block_mask(None if documents == 1 else doc_ids, length, torch.device("cpu")))
    else:
        monkeypatch.setattr(eagle3.draft.ttt_attention, "_VARLEN", (fake_varlen_attn, {"window_size": (-1, 0)}, True))
        cache = TTTCache(mask=None, docs=DocLayout.build(doc_ids))
    fast = []
    for step, x in enumerate(xs):
        cos, sin = rope_cos_sin(positions + step, model.inv_freq, model.rope_scaling)
        fast.append(model._attend(x, cos, sin, cache))
    dense = _dense_attention(model, xs, positions, doc_ids)
    for step in range(4):
        torch.testing.assert_close(fast[step], dense[step], rtol=1e-5, atol=1e-5)
    probe = [torch.randn(out.shape, generator=generator) for out in dense]
    inputs = xs + list(model.layers[0].self_attn.parameters())  # the x's, q/k/v/o projections
    grads_fast = torch.autograd.grad(sum((o * p).sum() for o, p in zip(fast, probe)), inputs)
    grads_dense = torch.autograd.grad(sum((o * p).sum() for o, p in zip(dense, probe)), inputs)
    for fast_grad, dense_grad in zip(grads_fast, grads_dense, strict=True):
        assert dense_grad.abs().max() > 0.1  # the gradient is far from trivial
        torch.testing.assert_close(fast_grad, dense_grad, rtol=1e-4, atol=1e-4)

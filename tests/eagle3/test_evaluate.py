"""Simulated acceptance: exact on a hand-built case, and higher for a trained draft."""

from __future__ import annotations

import pytest
import torch

from eagle3.capture.store import Sample, StoreWriter
from eagle3.evaluate.acceptance import accepted_counts, served_walk, simulate_acceptance
from eagle3.draft.export import export_draft
from eagle3.draft.model import DraftConfig, Eagle3Draft, init_draft
from eagle3.draft.target_head import TargetHead, read_target_config
from eagle3.draft.vocab import VocabMapping, load_mapping
from tests.eagle3.draft_fixtures import AUX_LAYER_IDS, one_thread, tiny_head, tiny_world, trained_run  # noqa: F401

H = 64


def _one_hot(index: int, scale: float = 5.0) -> torch.Tensor:
    vector = torch.zeros(H)
    vector[index] = scale
    return vector


def _hand_built_world(tmp_path, greedy: list[int], proposals: dict[int, int]):
    """A 64-token target whose greedy token at position p is greedy[p] (lm_head = identity,
    final state = one-hot), and a draft that proposes target token proposals[t] at every
    step of row t (attention and MLP outputs zeroed, so its hidden is fc(aux) = aux[0])."""
    head = TargetHead(embed=torch.eye(H), norm_weight=torch.ones(H), norm_eps=1e-6, lm_head=torch.eye(H))
    # Draft vocabulary: the 32 even target ids; draft id i is target id 2i.
    mapping = VocabMapping(d2t=torch.arange(32), t2d=torch.arange(H) % 2 == 0)
    config = DraftConfig(
        hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=64, num_aux_hidden_states=3, target_vocab_size=H, draft_vocab_size=32,
    )
    model = Eagle3Draft(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        model.fc.weight[:, :H] = torch.eye(H)  # fused hidden = first aux state
        model.lm_head.weight.copy_(torch.eye(H)[0::2])  # draft id i reads dimension 2i
    length = len(greedy)
    aux = torch.stack([_one_hot(proposals.get(t, 0)) for t in range(length)])  # [T, H]
    final = torch.stack([_one_hot(g) for g in greedy])  # [T, H]
    states = torch.stack([aux, torch.zeros(length, H), torch.zeros(length, H), final], dim=1)  # [T, 4, H]
    mask = torch.tensor([False, False] + [True] * (length - 2))
    sample = Sample("hand", torch.arange(length) % 7, mask, states)
    writer = StoreWriter(tmp_path / "store", aux_layer_ids=[0, 1, 2], hidden_size=H, dtype=torch.float32,
                         expected_shards=[["hand"]])
    writer.write_shard(0, [sample])
    return (model, mapping), tmp_path / "store", head


def test_hand_built_case_gives_the_exact_numbers(tmp_path):
    # Position:       0  1  2  3  4  5  6  7
    greedy =         [0, 4, 4, 6, 4, 4, 4, 9]  # 9 is odd: no draft can ever propose it
    proposals = {1: 4, 2: 6, 3: 4, 4: 4}  # rows 1..4 are the eligible ones for k=3 (row 0 is prompt)
    draft, store, head = _hand_built_world(tmp_path, greedy, proposals)
    report = simulate_acceptance(draft, store, head, num_draft_tokens=3)
    # row 1 proposes 4,4,4 against greedy[2:5] = 4,6,4 -> 1 accepted
    # row 2 proposes 6,6,6 against greedy[3:6] = 6,4,4 -> 1
    # row 3 proposes 4,4,4 against greedy[4:7] = 4,4,4 -> 3
    # row 4 proposes 4,4,4 against greedy[5:8] = 4,4,9 -> 2
    assert report.num_drafts == 4
    assert report.acceptance_length == 1 + (1 + 1 + 3 + 2) / 4
    assert report.per_position == [1.0, 0.5, 0.25]
    # Served: row 1 accepts 1, so the next draft is at row 3, which accepts 3 (then the sample ends).
    assert (report.served_num_drafts, report.served_acceptance_length) == (2, 1 + (1 + 3) / 2)
    assert "2.750" in report.to_markdown()


def test_accepted_counts_stop_at_the_first_mismatch():
    drafts = torch.tensor([[1, 1, 5, 1], [2, 9, 2, 2], [3, 3, 3, 9]])  # [K=3, N=4]
    target = torch.tensor([[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]])
    assert accepted_counts(drafts, target).tolist() == [3, 1, 0, 2]
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 9])
    assert served_walk(rows, torch.tensor([1, 0, 0, 2, 0, 0, 1])).tolist() == [
        True, False, True, True, False, False, True]


def test_a_trained_draft_is_accepted_more_than_an_untrained_one(tmp_path):
    world, head = tiny_world(), tiny_head()
    mapping = load_mapping(world.vocab_path)
    config = DraftConfig.from_target(read_target_config(world.target_dir), num_aux_hidden_states=3,
                                     draft_vocab_size=mapping.draft_vocab_size)
    untrained = Eagle3Draft(config)
    init_draft(untrained, head, mapping, seed=0)  # where training starts
    before = simulate_acceptance((untrained, mapping), world.heldout_store, head, num_draft_tokens=3)
    export = export_draft(trained_run().checkpoint, tmp_path / "draft", target_dir=world.target_dir,
                          aux_layer_ids=AUX_LAYER_IDS, vocab_path=world.vocab_path)
    after = simulate_acceptance(export, world.heldout_store, head, num_draft_tokens=3)
    # Rows 7 (last prompt row) to 36 (the last with 3 positions left) of each of 12 samples.
    assert after.num_drafts == before.num_drafts == 12 * 30
    assert after.acceptance_length > before.acceptance_length + 0.2, (before, after)
    assert after.per_position[0] >= after.per_position[1] >= after.per_position[2]
    # Scoring many checkpoints: the target's greedy tokens are computed once per held-out sample.
    cache: dict = {}
    assert simulate_acceptance(export, world.heldout_store, head, 3, greedy_cache=cache) == after
    assert len(cache) == 12
    assert simulate_acceptance((untrained, mapping), world.heldout_store, head, 3, greedy_cache=cache) == before
    assert len(cache) == 12


def test_plots_are_written_as_png_and_refuse_an_empty_log(tmp_path):
    import pytest

    from eagle3.evaluate.plots import plot_acceptance, plot_training_loss

    entries = [{"step": s, "loss": 2.0 / s, "loss_per_ttt_step": [1.5 / s, 2.0 / s, 2.5 / s]} for s in range(1, 21)]
    evals = [{"step": 10, "acceptance_length": 1.4}, {"step": 20, "acceptance_length": 1.6}]
    for path in (plot_training_loss(entries, evals, tmp_path / "loss.png"),
                 plot_acceptance([0.6, 0.4, 0.2], [0.55, 0.35, 0.2], tmp_path / "acceptance.png"),
                 plot_acceptance([0.6, 0.4, 0.2], None, tmp_path / "simulated-only.png")):
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acceptance.png", "loss.png", "simulated-only.png"]
    with pytest.raises(ValueError, match="losses.jsonl"):
        plot_training_loss([], [], tmp_path / "empty.png")


def test_figures_per_source_are_each_source_s_own_drafts_and_pool_back_to_the_whole():
    from eagle3.evaluate.acceptance import report_by_source

    def row(source, accepted, walked):  # noqa: ANN001, ANN202
        return source, torch.tensor(accepted, dtype=torch.int64), torch.tensor(walked, dtype=torch.bool)

    report = report_by_source([row("a", [3, 0], [True, False]), row("b", [1], [True]), row("a", [2], [True])], 3)
    assert report.acceptance_length == pytest.approx(2.5) and report.num_samples == 3
    a, b = report.by_source["a"], report.by_source["b"]
    assert (a.acceptance_length, a.num_drafts, a.num_samples) == (pytest.approx(1 + 5 / 3), 3, 2)
    assert (a.served_acceptance_length, a.served_num_drafts) == (pytest.approx(3.5), 2)  # the walk within "a"
    assert b.acceptance_length == pytest.approx(2.0) and b.per_position == [1.0, 0.0, 0.0]
    assert report.to_dict()["per_source"]["a"]["num_samples"] == 2
    assert report_by_source([row(None, [1], [True])], 3).by_source == {}  # no source named: pooled only, as before
    assert "per_source" not in report_by_source([row(None, [1], [True])], 3).to_dict()
    assert set(report_by_source([row("a", [1], [True]), row(None, [0], [True])], 3).by_source) == {"a", "(no source)"}

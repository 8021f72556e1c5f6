"""`eagle3 run` with a warm engine (target.keep_warm_s): a failed extract leaves the target loaded, and the
same command again attaches instead of loading; its store equals an uninterrupted run's (the session's, in
tests/e2e/conftest.py).

The failure is a fake full disk after half the shards (tests/reliability/fail_extract.py). The engines live
in a cache dir of this module's own (the tiny target linked into it), so no other test's run attaches to them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.engine.registry import is_live, live_engines
from tests.e2e.conftest import ROOT, run_cli
from tests.reliability.harness import shard_hashes

WARM = ["--set", "target.keep_warm_s=300"]


@pytest.fixture(scope="module")
def env(prefect_server, tiny_target, tmp_path_factory) -> dict[str, str]:
    import os

    cache = tmp_path_factory.mktemp("warm-cache")
    (cache / tiny_target.name).symlink_to(tiny_target)
    return os.environ | {"PREFECT_API_URL": prefect_server, "EAGLE3_CACHE_DIR": str(cache)}


def _run(run_dir: Path, env: dict[str, str], *extra: str, fail_after: int | None = None) -> subprocess.CompletedProcess:
    args = ["run", "--preset", "tiny", "--run-dir", str(run_dir), *extra]
    if fail_after is None:
        return run_cli(args, env)
    return subprocess.run([sys.executable, "-m", "tests.reliability.fail_extract", str(fail_after), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)


def _loads(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "summary.json").read_text())["target_loads"]


def test_a_failed_extract_leaves_a_warm_engine_and_the_same_command_attaches(tmp_path, env, uninterrupted_tiny_run):
    run_dir = tmp_path / "run"
    failed = _run(run_dir, env, *WARM, fail_after=3)  # 7 shards in all (5 train, 2 held-out)
    assert failed.returncode != 0 and "error: extract: [Errno 28] No space left on device" in failed.stderr, failed.stderr
    (loaded,) = _loads(run_dir)
    assert loaded["event"] == "loaded" and loaded["seconds"] > 0 and loaded["preflight"]["need_mib"] > 0
    (engine,) = [info for _, info in live_engines(Path(env["EAGLE3_CACHE_DIR"]))]
    assert engine["pid"] == loaded["pid"]

    again = _run(run_dir, env, *WARM)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    (attached,) = _loads(run_dir)  # this run's: no new load
    assert attached["event"] == "attached" and attached["engine_pid"] == engine["pid"]
    assert attached["seconds_saved"] == loaded["seconds"] and attached["loaded_at"] <= attached["time"]
    assert not is_live(engine) and live_engines(Path(env["EAGLE3_CACHE_DIR"])) == []  # a finished run stops it

    uninterrupted, _ = uninterrupted_tiny_run  # the session's `eagle3 run --preset tiny` (tests/e2e/conftest.py)
    (reference,) = _loads(uninterrupted)  # keep_warm_s at its CPU default 0: loaded in the run's own process
    assert reference["event"] == "loaded" and reference["pid"] != engine["pid"]
    assert shard_hashes(run_dir) == shard_hashes(uninterrupted) and len(shard_hashes(run_dir)) == 7


def test_engine_start_list_stop_and_a_run_attaches_without_stopping_a_users_engine(tmp_path, env):
    cache = Path(env["EAGLE3_CACHE_DIR"])
    started = run_cli(["engine", "start", "--preset", "tiny", "--keep-warm-s", "300"], env)
    assert started.returncode == 0 and " loaded in " in started.stdout, started.stdout + started.stderr[-2000:]
    fingerprint, pid = started.stdout.split()[1], int(started.stdout.split()[3].rstrip(":"))
    again = run_cli(["engine", "start", "--preset", "tiny"], env)
    assert f"engine {fingerprint} pid {pid}: " in again.stdout and "already up" in again.stdout
    (listed,) = json.loads(run_cli(["engine", "list", "--json"], env).stdout)
    assert (listed["pid"], listed["owner"], listed["fingerprint"]) == (pid, "user", fingerprint)

    run_dir = tmp_path / "run"
    done = _run(run_dir, env)  # target.keep_warm_s at its CPU default 0: a live engine is attached all the same
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (attached,) = _loads(run_dir)
    assert attached["event"] == "attached" and attached["engine_pid"] == pid and attached["engine"] == fingerprint
    assert [info["pid"] for _, info in live_engines(cache)] == [pid]  # a user's engine outlives the run

    stopped = run_cli(["engine", "stop"], env)
    assert stopped.returncode == 0 and f"engine {fingerprint} pid {pid}: stopped" in stopped.stdout, stopped.stdout
    assert live_engines(cache) == [] and "no warm engine" in run_cli(["engine", "list"], env).stdout
    unknown = run_cli(["engine", "stop", "0123abc"], env)
    assert unknown.returncode == 1 and unknown.stderr.startswith("error: no live warm engine matches 0123abc")

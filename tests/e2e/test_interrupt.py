"""The README's first way to run, stopped the ways users stop it (issue 13): `eagle3 run` with NO
Prefect server configured, killed with SIGKILL and interrupted with Ctrl-C (SIGINT to the whole
process group, as a terminal sends it) while it holds the `gpu` slot. Every later run must still
get the slot, and finish.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.conftest import ROOT, start_cli


def _start(run_dir: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    return start_cli(["run", "--preset", "tiny", "--run-dir", str(run_dir)], ROOT, env, stdout=open(log, "w"),
                     stderr=subprocess.STDOUT)


def _slot_events(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "gpu_slot.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _wait_acquired(proc: subprocess.Popen, run_dir: Path, count: int, log: Path, timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        acquired = [e for e in _slot_events(run_dir) if e["event"] == "acquired"]
        if len(acquired) >= count:
            return acquired[count - 1]
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before taking the slot:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no slot within {timeout} s:\n{log.read_text()[-3000:]}")


def _stage_states(stdout: str) -> dict[str, str]:
    rows = [line.split("|") for line in stdout.splitlines() if line.startswith("| ") and not line.startswith("| stage")]
    return {cells[1].strip() + f"#{i}": cells[2].strip() for i, cells in enumerate(rows)}


def test_sigkill_then_ctrl_c_while_holding_the_slot_without_a_server(tmp_path, builtin_cache):
    env = os.environ | {"PREFECT_HOME": str(tmp_path / "prefect-home"), "EAGLE3_CACHE_DIR": str(builtin_cache)}
    env.pop("PREFECT_API_URL", None)
    run_dir = tmp_path / "run"

    # 1. SIGKILL of the whole group (the run and the temporary server it started) while the slot is held
    killed = _start(run_dir, env, tmp_path / "1.log")
    _wait_acquired(killed, run_dir, 1, tmp_path / "1.log")
    time.sleep(1.0)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()

    # 2. the same command again gets the slot within about a minute; then Ctrl-C while it holds it
    log2 = tmp_path / "2.log"
    interrupted = _start(run_dir, env, log2)
    acquired = _wait_acquired(interrupted, run_dir, 2, log2)
    assert acquired["waited"] < 60, acquired
    time.sleep(2.0)
    before = len(log2.read_text().splitlines())
    sent = time.time()
    os.killpg(interrupted.pid, signal.SIGINT)
    code = interrupted.wait(timeout=60)
    took = time.time() - sent
    after = log2.read_text().splitlines()[before:]
    assert code != 0 and took < 30, (code, took)
    assert any(line.startswith("interrupted:") and "run the same command again" in line for line in after), after
    assert len(after) <= 5, after  # no tracebacks, no "Error logging to API" flood
    assert [e["event"] for e in _slot_events(run_dir)][-1] == "released"  # given back before the server stopped

    # 3. the same command finishes, and 4. a third run is all Cached
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--run-dir", str(run_dir)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    again = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--run-dir", str(run_dir)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    states = _stage_states(again.stdout)
    assert states and all(state == "Cached" for name, state in states.items() if not name.startswith("gpu_cleanup")), states

"""The README's first way to run, stopped the ways users stop it (issue 13): `eagle3 run` with NO
Prefect server configured, killed with SIGKILL and interrupted with Ctrl-C (SIGINT to the whole
process group, as a terminal sends it) while it holds the `gpu` slot. The Ctrl-C'd run stops there (no
train artifact is completed after it), says how to resume, and gives the slot back; every later run must
still get the slot, and finish. What is asserted is what the run did, not how fast it did it: the one bound
on time (60 s for the Ctrl-C'd run to exit; it took under a second on 2 cores) is a guard against a hang or
a run that goes on to the end (about a minute here, and then its train artifact is there).
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
    os.killpg(interrupted.pid, signal.SIGINT)
    try:  # a guard, not a speed bound: it exits within a second or two (one that hung would be stopped here)
        code = interrupted.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(interrupted.pid, signal.SIGKILL)
        interrupted.wait()
        raise AssertionError(f"Ctrl-C did not stop the run in 60 s:\n{log2.read_text()[-3000:]}") from None
    after = log2.read_text().splitlines()[before:]
    assert code != 0, code
    # it stopped where it was: the run did not go on to train (a complete train artifact has its marker)
    assert not list(run_dir.glob("artifacts/train/*/.eagle3-complete.json")), after
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

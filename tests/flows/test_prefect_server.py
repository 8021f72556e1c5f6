"""`eagle3 deploy` creates an automation (the zombie recipe). Prefect 3.7's server on SQLite deadlocks
for good when an automation is created while its triggers service holds the automations lock
(PrefectHQ/prefect#23055; on 2026-12-03 it froze a CI run's server for the rest of the suite).
These tests hold that lock in a real Prefect server (tests/flows/hold_automations_lock.py) and
run eagle3's own setup step against it."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.prefect_home import migrated_home

ROOT = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).with_name("hold_automations_lock.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server_holding_the_lock(tmp_path):
    procs = []

    def start(fixed: bool) -> str:
        proc = subprocess.Popen([sys.executable, str(HELPER), "--port", str(_free_port()), "--home", str(migrated_home(tmp_path)),
                                 *(["--fixed"] if fixed else [])], cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs.append(proc)
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
                if line.startswith("holding "):
                    return line.split()[1]
        raise AssertionError(f"the server did not start: {proc.stdout.read() if proc.poll() is not None else 'no answer'}")

    yield start
    for proc in procs:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/health", timeout=3)
        return True
    except OSError:
        return False


def _ensure_zombie_automation(url: str, timeout_s: float) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deploy import ensure_zombie_automation

    with temporary_settings(updates={PREFECT_API_URL: url}):
        ensure_zombie_automation(timeout_s=timeout_s)


def test_the_servers_eagle3_starts_create_the_automation_while_the_lock_is_held(server_holding_the_lock):
    """flows.prefect_server's factory (the one `eagle3 serve`, the temporary server and the e2e tests' server use):
    the automation is created and the server keeps answering while the lock is still held; a second setup finds it."""
    from prefect.automations import Automation
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deploy import ZOMBIE_AUTOMATION

    url = server_holding_the_lock(fixed=True)
    _ensure_zombie_automation(url, timeout_s=30)
    assert _answers(url)
    with temporary_settings(updates={PREFECT_API_URL: url}):
        assert Automation.read(name=ZOMBIE_AUTOMATION).name == ZOMBIE_AUTOMATION
    _ensure_zombie_automation(url, timeout_s=30)  # idempotent: read, not created twice


def test_prefect_s_own_server_hangs_there_and_deploy_says_what_to_do(server_holding_the_lock, monkeypatch):
    """The same with Prefect 3.7.7's own create_app (what a user's `prefect server start` runs): the server stops
    answering anything, and the setup step ends in one DeployError that names the server and says to restart it,
    after one attempt of each request to the automations API, bounded by the timeout it was given (10 s), instead of
    the client's six 60-second attempts. The attempts are counted as the client sends them (its retries included) and
    their timeout read from the requests, not timed."""
    import httpx

    from flows.deploy import DeployError

    sent: list[tuple[str, object]] = []  # (path, read timeout) of every attempt, retries included
    real_send = httpx.Client.send

    def counting_send(self, request, *args, **kwargs):  # noqa: ANN001, ANN202 - httpx's own signature
        sent.append((request.url.path, (request.extensions.get("timeout") or {}).get("read")))
        return real_send(self, request, *args, **kwargs)

    monkeypatch.setattr(httpx.Client, "send", counting_send)
    url = server_holding_the_lock(fixed=False)
    with pytest.raises(DeployError) as err:
        _ensure_zombie_automation(url, timeout_s=10)
    # each request to the automations API (the read, then the create that hangs) sent once, with the 10 s read
    # timeout: no retries, no 60 s default
    automations = [(path, read) for path, read in sent if "/automations" in path]
    assert automations and all(read == 10 for _, read in automations), sent
    assert len({path for path, _ in automations}) == len(automations), sent
    message = str(err.value)
    assert url in message and "restart that server" in message and "prefect#23055" in message, message
    assert not _answers(url)  # the bug is real in the pinned Prefect: without the fix nothing answers again

"""A real `prefect server start` on 127.0.0.1 shared by the CLI tests (each CLI process would
otherwise start its own temporary server, ~15 s each), and a helper to run the CLI. It is started
as `eagle3 serve` starts its server (flows.prefect_server: Prefect's CLI with the fix of a Prefect
3.7 deadlock on automations, which froze this server for the rest of a CI run on 2026-12-03)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> str:
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    env = os.environ | {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                        "PREFECT_UI_ENABLED": "false"}
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "flows.prefect_server", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError((home / "server.log").read_text()[-3000:])
            time.sleep(0.5)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError("prefect server did not answer /api/health in 120 s")
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


@pytest.fixture
def cli_env(prefect_server, builtin_cache) -> dict[str, str]:
    return os.environ | {"PREFECT_API_URL": prefect_server, "EAGLE3_CACHE_DIR": str(builtin_cache)}


def run_cli(args: list[str], env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def start_cli(args: list[str], cwd: Path, env: dict[str, str], **streams) -> subprocess.Popen:
    """`eagle3 <args>` as a terminal's foreground job, the target of a Ctrl-C test: a process group of its own
    (os.killpg(proc.pid, SIGINT) is the terminal's Ctrl-C) with SIGINT at its default. A suite run as a shell's
    background job (`make test &`, nohup) hands SIGINT down ignored, and the Ctrl-C would then do nothing."""
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            **streams)

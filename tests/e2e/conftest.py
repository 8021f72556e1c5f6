"""Helpers to run the CLI as a user does, and the CLI tests' environment. The session's `prefect server start`
and its uninterrupted tiny run are in tests/conftest.py (shared with tests/reliability)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

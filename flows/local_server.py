"""The Prefect servers eagle3 starts itself, and the settings that keep the `gpu` slot safe on them.

With no `PREFECT_API_URL`, Prefect's client would start a temporary ("ephemeral") server inside
every `eagle3 run`. Two things made that unsafe for the `gpu` slot (issue 13):
- the ephemeral server is a child in the terminal's process group, so Ctrl-C stopped it at
  once, before the run could give its slot back;
- its concurrency leases live in the server's memory while the slot count lives in the
  database (~/.prefect/prefect.db), so a run killed with its server left `active_slots=1` that no
  later server knew a lease for, and every later run waited forever. Ephemeral servers also do
  not run the repossessor service that frees expired leases.

So the CLI starts its own temporary server instead (`start_temporary_server`): a full Prefect API
(uvicorn on `prefect.server.api.server:create_app`, with flows.prefect_server's fix, every background service, the repossessor
included; no UI) on a free 127.0.0.1 port, in a session of its own (Ctrl-C in the terminal does
not reach it; the CLI stops it after the flow has given the slot back), which the kernel stops
when the CLI dies (PR_SET_PDEATHSIG, so a SIGKILLed run leaves no server behind). Every server
eagle3 starts (this one, and `eagle3 serve`'s `prefect server start`) keeps its leases on disk
(`server_env`: Prefect's filesystem lease storage under PREFECT_HOME), so a restarted or
replaced server still knows which lease holds the slot and when it runs out. The runs learn
where those leases are from `EAGLE3_PREFECT_LEASES` (tasks.gpu_slot.LEASES_ENV), which lets tasks.gpu_slot account for
every slot (and give back one that no lease holds).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

FILESYSTEM_LEASES = "prefect.server.concurrency.lease_storage.filesystem"


class ServerStartError(RuntimeError):
    """The temporary Prefect server did not start; the message holds the end of its log."""


def prefect_home() -> Path:
    """PREFECT_HOME (the server's database and lease folder live there). Read from the environment,
    not from Prefect: importing prefect fixes its settings, and PREFECT_API_URL is not set yet."""
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


def server_env(base: dict[str, str]) -> dict[str, str]:
    """The environment of a Prefect server eagle3 starts: concurrency leases on disk, no analytics."""
    return base | {"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": FILESYSTEM_LEASES, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def leases_env() -> dict[str, str]:
    """For the runs of a server eagle3 started: where its leases are (see tasks.gpu_slot). Imports
    prefect: call it once PREFECT_API_URL is in os.environ."""
    from tasks.gpu_slot import LEASES_ENV

    return {LEASES_ENV: str(prefect_home() / "concurrency_leases")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_healthy(api_url: str, proc: subprocess.Popen | None, timeout: float, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{api_url}/health", timeout=2)
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                tail = log.read_text()[-2000:] if log and log.is_file() else ""
                raise ServerStartError(f"prefect server exited with code {proc.returncode} before answering "
                                       f"{api_url}/health{': ' + tail if tail else ''}") from None
            time.sleep(0.3)
    raise ServerStartError(f"no answer from {api_url}/health within {timeout:.0f} s")


def stop(proc: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM to the server's process group, then SIGKILL to what is left after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)


def configured_api_url() -> str | None:
    """The Prefect API this process would use: PREFECT_API_URL, else the active profile's. Read
    without importing prefect (whose settings are fixed at import)."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or prefect_home() / "profiles.toml")
    try:
        profiles = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active", "ephemeral")
    return profiles.get("profiles", {}).get(active, {}).get("PREFECT_API_URL") or None


def start_temporary_server(log: Path, timeout: float = 120) -> str:
    """A Prefect API for this process only; returns its URL after setting PREFECT_API_URL and the
    lease folder in os.environ (call it before anything imports prefect).

    The server is stopped at interpreter exit, by `atexit`: those hooks run after Prefect's own
    exit hooks (threading's), which send the last logs and events, so nothing is cut off. If this
    process is killed, the kernel stops the server (PR_SET_PDEATHSIG).
    """
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = server_env(dict(os.environ)) | {"PREFECT_UI_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "flows.prefect_server:create_app", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "error", "--lifespan", "on"],
            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent,
        )
    atexit.register(stop, proc)
    try:
        wait_healthy(url, proc, timeout, log)
    except BaseException:
        stop(proc)
        raise
    os.environ["PREFECT_API_URL"] = url
    os.environ.update(leases_env())
    return url

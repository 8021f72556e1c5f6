"""Setting up a Prefect server for eagle3: `eagle3 deploy` and `eagle3 serve`.

deploy: creates the `gpu` process work pool (concurrency: one flow run per GPU machine,
`--machines`, default 1) and the `gpu` global concurrency limit, then applies
deployments/prefect.yaml with `prefect deploy --all` (deployments train-eagle3, nightly-eagle3
and extract-part). Idempotent: run it again after a change.

serve (one machine): starts `prefect server start --host 127.0.0.1` (or uses --api-url),
deploys, and starts a worker on the `gpu` pool. Ctrl-C (or SIGTERM) stops the worker, then
the server, each with a grace period, and kills whatever of them is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from flows import local_server

ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
WORK_POOL = "gpu"


@dataclass(frozen=True)
class DeploySettings:
    """The values deployments/prefect.yaml takes from the environment."""

    timezone: str = "UTC"
    cron: str = "0 2 * * *"
    incoming: str = "data/incoming"
    registry: str = "registry"
    machines: int = 1  # GPU machines with a worker on the gpu pool: the pool runs this many flow runs at once

    def env(self) -> dict[str, str]:
        return {"EAGLE3_PROJECT_DIR": str(ROOT), "EAGLE3_NIGHTLY_TIMEZONE": self.timezone, "EAGLE3_NIGHTLY_CRON": self.cron,
                "EAGLE3_INCOMING": self.incoming, "EAGLE3_REGISTRY": self.registry}


class DeployError(RuntimeError):
    """Setting up the server failed; the message says which step."""


def ensure_work_pool(name: str = WORK_POOL, concurrency: int = 1) -> None:
    """A process work pool `name` that runs `concurrency` flow runs at a time."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process", concurrency_limit=concurrency))
            return
        if pool.type != "process":
            raise DeployError(f"work pool {name!r} exists with type {pool.type!r}; expected 'process' (delete it or rename ours)")
        if pool.concurrency_limit != concurrency:
            client.update_work_pool(name, WorkPoolUpdate(concurrency_limit=concurrency))


HEARTBEAT_SECONDS = 30  # PREFECT_FLOWS_HEARTBEAT_FREQUENCY for workers' flow runs (Prefect's minimum)
ZOMBIE_AUTOMATION = "eagle3: crash flow runs whose heartbeats stopped"


def ensure_zombie_automation(window_s: int = 2 * HEARTBEAT_SECONDS, timeout_s: float = 60) -> None:
    """Prefect's own recipe for flow runs whose machine died: a run that sent a heartbeat and then neither
    another one nor a final state within `window_s` is set Crashed by the server. A fanned-out part's
    parent (tasks.parts.run_part) then starts the part again, on a worker that is alive. Needs the
    workers to send heartbeats: start them with PREFECT_FLOWS_HEARTBEAT_FREQUENCY set (docs/several-machines.md).
    A server that does not answer within `timeout_s` is a DeployError that says what to do."""
    from datetime import timedelta

    import httpx

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    finished = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}
    automation = Automation(
        name=ZOMBIE_AUTOMATION,
        trigger=EventTrigger(after={"prefect.flow-run.heartbeat"}, expect={"prefect.flow-run.heartbeat", *finished},
                             match={"prefect.resource.id": ["prefect.flow-run.*"]}, for_each={"prefect.resource.id"},
                             posture=Posture.Proactive, threshold=1, within=timedelta(seconds=window_s)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {window_s} s: its worker or machine is gone")],
    )
    api_url = PREFECT_API_URL.value()
    try:  # one attempt, bounded: a server that hangs here hangs for good (flows.prefect_server), retrying waits 6 times
        with temporary_settings(updates={PREFECT_API_REQUEST_TIMEOUT: timeout_s, PREFECT_CLIENT_MAX_RETRIES: 0}):
            try:
                Automation.read(name=ZOMBIE_AUTOMATION)
            except ValueError:  # not there yet
                automation.create()
    except httpx.TimeoutException:
        raise DeployError(_no_answer(api_url, timeout_s)) from None


def _no_answer(api_url: str | None, timeout_s: float) -> str:
    """What to tell the user when the server took longer than `timeout_s` over the zombie automation."""
    import urllib.request

    try:
        urllib.request.urlopen(f"{api_url}/health", timeout=5)
    except OSError:
        return (f"the Prefect server at {api_url} stopped answering (not even /health) while eagle3 set up its automation "
                f"{ZOMBIE_AUTOMATION!r}: Prefect 3.7 servers on SQLite can deadlock when an automation is created "
                f"(PrefectHQ/prefect#23055, fixed in Prefect 3.8; eagle3 pins 3.7.7 for vLLM's fastapi). The automation "
                f"is saved before the hang: restart that server, then run `eagle3 deploy` again (servers started by "
                f"`eagle3 serve` carry the fix)")
    return (f"the Prefect server at {api_url} took more than {timeout_s:.0f} s over eagle3's automation "
            f"{ZOMBIE_AUTOMATION!r} but still answers /health: it is overloaded; run `eagle3 deploy` again")


def deploy(settings: DeploySettings, api_url: str | None = None) -> None:
    """Work pool + concurrency limit + `prefect deploy --all` of deployments/prefect.yaml."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.gpu_slot import ensure_gpu_limit

    updates = {PREFECT_API_URL: api_url} if api_url else {}
    with temporary_settings(updates=updates):
        ensure_work_pool(concurrency=settings.machines)
        ensure_gpu_limit()
        ensure_zombie_automation()
        env = os.environ | settings.env() | ({"PREFECT_API_URL": api_url} if api_url else {})
        done = subprocess.run([sys.executable, "-m", "prefect", "deploy", "--no-prompt", "--all", "--prefect-file",
                               str(PREFECT_FILE)], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise DeployError(f"prefect deploy --all --prefect-file {PREFECT_FILE} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def _stop(proc: subprocess.Popen, first: int, grace: float) -> None:
    """Signal the process group, wait `grace` seconds, then kill what is left of it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, first)
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # children of the group (flow runs) that outlived their parent
    except ProcessLookupError:
        pass
    proc.wait()


def serve(settings: DeploySettings, *, host: str = "127.0.0.1", port: int = 4200, api_url: str | None = None,
          log_dir: Path = Path("runs/serve")) -> int:
    """Server (unless api_url) + deployments + worker, until Ctrl-C or SIGTERM. Returns the exit code."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    children: list[tuple[str, subprocess.Popen, int, float]] = []
    env = dict(os.environ)
    try:
        if api_url is None:
            api_url = f"http://{host}:{port}/api"
            # The UI asks the API at PREFECT_UI_API_URL, which otherwise stays at the default port 4200.
            # Concurrency leases on disk (flows.local_server): a restarted server still knows who holds the gpu slot.
            server_env = local_server.server_env(env | {"PREFECT_UI_API_URL": api_url, "PREFECT_UI_URL": api_url.removesuffix("/api")})
            # flows.prefect_server: `prefect server start` with the fix of a Prefect 3.7 deadlock on automations
            server = subprocess.Popen([sys.executable, "-m", "flows.prefect_server", "server", "start", "--host", host, "--port", str(port)],
                                      env=server_env, stdout=open(log_dir / "server.log", "a"), stderr=subprocess.STDOUT,
                                      start_new_session=True)
            children.append(("server", server, signal.SIGTERM, 20))
            print(f"eagle3 serve: prefect server pid {server.pid}, log {log_dir / 'server.log'}", flush=True)
        try:
            local_server.wait_healthy(api_url, children[0][1] if children else None, timeout=120)
        except local_server.ServerStartError as err:
            raise DeployError(str(err)) from None
        env["PREFECT_API_URL"] = api_url
        if children:  # our server: its runs may account for the gpu slot against its lease files
            env |= local_server.leases_env()
        if stop.is_set():
            return 0
        deploy(settings, api_url)
        if stop.is_set():
            return 0
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", WORK_POOL, "--type", "process"],
                                  cwd=ROOT, env=env, stdout=open(log_dir / "worker.log", "a"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        children.insert(0, ("worker", worker, signal.SIGINT, 30))
        print(f"eagle3 serve: worker pid {worker.pid} on pool {WORK_POOL!r}, log {log_dir / 'worker.log'}", flush=True)
        print(f"eagle3 serve: ready. UI {api_url.removesuffix('/api')}  (deployments train-eagle3/train-eagle3, "
              f"nightly-eagle3/nightly-eagle3; Ctrl-C stops everything)", flush=True)
        while not stop.wait(1.0):
            for name, proc, _, _ in children:
                if proc.poll() is not None:
                    print(f"eagle3 serve: the {name} exited with code {proc.returncode}; stopping", file=sys.stderr, flush=True)
                    return 1
        return 0
    finally:
        for name, proc, sig, grace in children:  # the worker first, then the server
            _stop(proc, sig, grace)
        if children:
            print("eagle3 serve: stopped " + ", ".join(name for name, *_ in children), flush=True)

"""`eagle3 serve` for real: a `prefect server start`, the deployments of deployments/prefect.yaml, a
worker on the `gpu` pool; the train-eagle3 deployment run on the tiny preset, failed in extract with its target
left in a warm engine, retried, Completed on that engine; two runs started together taking turns on the GPUs;
Ctrl-C stopping all of it."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from eagle3.config import build_config
from tasks.progress import BAR_WIDTH
from tests.e2e.conftest import ROOT, _free_port
from tests.prefect_home import migrated_home

SMALL = ["data.max_samples=16", "regenerate.max_new_tokens=8", "train.steps=6", "train.warmup_steps=1", "train.checkpoint_every=3",
         "eval.served=false"]
BEFORE_EXTRACT = ["stage_target", "regenerate", "prepare_data"]
FROM_EXTRACT = ["extract", "vocab", "train", "export", "evaluate"]


@dataclass
class Served:
    proc: subprocess.Popen
    api_url: str
    env: dict[str, str]
    log_dir: Path
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None  # fills `lines` from the process's output; ends at its EOF

    def worker_log(self, tail: int | None = 6000) -> str:
        text = (self.log_dir / "worker.log").read_text()
        return text[-tail:] if tail else text

    def pid(self, name: str) -> int:
        return int(next(m.group(1) for line in self.lines if (m := re.search(rf"{name} pid (\d+)", line))))


@contextlib.contextmanager
def _api(url: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        yield client


def _far_from_the_nightly() -> str:
    """The timezone `eagle3 serve` gets here: one whose 02:00 (the nightly's cron) is hours away, so that Prefect's
    scheduler starts no nightly run on the module's one-run pool while its tests run."""
    return next(tz for tz in ("Europe/Paris", "Asia/Tokyo") if datetime.now(ZoneInfo(tz)).hour not in (0, 1, 2, 3))


NIGHTLY_TZ = _far_from_the_nightly()


@pytest.fixture(scope="module")
def served(tmp_path_factory, builtin_cache) -> Served:
    home = migrated_home(tmp_path_factory.mktemp("serve"))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {
        "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
        "EAGLE3_CACHE_DIR": str(builtin_cache),
        # the worker `eagle3 serve` starts asks for runs every 2 s, not Prefect's 10 s: each deployment run of the
        # module waits up to that long before it starts (tests/e2e/test_many_machines.py does the same)
        "PREFECT_WORKER_QUERY_SECONDS": "2"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--port", str(port), "--timezone", NIGHTLY_TZ,
                             "--log-dir", str(home / "logs")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = Served(proc, f"http://127.0.0.1:{port}/api", env | {"PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}, home / "logs")
    out.reader = threading.Thread(target=lambda: out.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    out.reader.start()
    deadline = time.time() + 400
    while not any("ready" in line for line in out.lines):
        if proc.poll() is not None or time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError("eagle3 serve did not get ready:\n" + "".join(out.lines)[-4000:])
        time.sleep(0.5)
    yield out
    if proc.poll() is None:  # a run of part of the module (no Ctrl-C test): stop it as Ctrl-C does, so that its
        os.killpg(proc.pid, signal.SIGINT)  # server and worker (sessions of their own) go too
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def test_serve_registers_the_pool_the_limit_and_both_deployments(served: Served):
    with _api(served.api_url) as client:
        pool = client.read_work_pool("gpu")
        assert (pool.type, pool.concurrency_limit) == ("process", 1)
        assert client.read_global_concurrency_limit_by_name("gpu").limit == 1
        nightly = client.read_deployment_by_name("nightly-eagle3/nightly-eagle3")
        train = client.read_deployment_by_name("train-eagle3/train-eagle3")
    (schedule,) = nightly.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone, schedule.active) == ("0 2 * * *", NIGHTLY_TZ, True)
    assert train.schedules == []  # manual trigger only
    assert nightly.parameters["config"]["publish"]["registry"] == "registry" and nightly.work_pool_name == "gpu"
    form = train.parameter_openapi_schema["definitions"]  # what the UI's run form is built from
    assert form["TrainConfig"]["properties"]["steps"]["exclusiveMinimum"] == 0
    assert form["ExtractConfig"]["properties"]["storage_dtype"]["enum"] == ["auto", "float32", "bfloat16", "float8_e4m3"]
    assert "description" in form["PipelineConfig"]["properties"]["run_dir"]


def _states(run_dir: Path) -> dict[str, str]:
    return {r["name"]: r["state"] for r in json.loads((run_dir / "summary.json").read_text())["stages"] if r["name"] != "gpu_cleanup"}


def _wait_final(client, flow_run_id, timeout: float = 600):  # noqa: ANN001, ANN202
    deadline = time.time() + timeout
    while time.time() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state.is_final():
            return run
        time.sleep(1)
    raise TimeoutError(f"flow run {flow_run_id} did not finish in {timeout} s")


def _wait_exited(served: Served, flow_run_name: str) -> None:
    """Until the worker logs that a finished attempt's process has exited (a retry before that is reported as a crash
    by Prefect 3.7's worker, which tracks processes by flow run id)."""
    deadline = time.time() + 120
    while f"Process for flow run {flow_run_name!r} exited" not in served.worker_log(tail=None):
        assert time.time() < deadline, "the failed attempt's process did not exit in 120 s"
        time.sleep(0.5)


def _target_loads(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "logs" / "target_loads.jsonl").read_text().splitlines()]


OWN_KV_GIB = 0.375  # target.kv_cache_gib of the warm engine below: no other run of the module loads one of this size


@pytest.fixture(scope="module")
def retried(served: Served, tmp_path_factory) -> dict:
    """A train-eagle3 deployment run with target.keep_warm_s set that fails in extract (its artifact folder is a
    file) after regenerate loaded the target into a warm engine, then `prefect flow-run retry` of that run once the
    failed attempt's process has exited. The engine settings (kv_cache_gib) are the module's own, so no other run of
    the module attaches to it; it is stopped before the fixture returns."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from eagle3.engine.client import stop_engine
    from eagle3.engine.registry import live_engines

    cache = Path(served.env["EAGLE3_CACHE_DIR"])
    run_dir = tmp_path_factory.mktemp("deployed") / "run"
    (run_dir / "artifacts").mkdir(parents=True)
    (run_dir / "artifacts" / "extract").write_text("a file where the extract artifacts go: the stage cannot write")
    config = build_config("tiny", run_dir=str(run_dir), overrides=[*SMALL, "target.keep_warm_s=300",
                                                                   f"target.kv_cache_gib={OWN_KV_GIB}"])
    try:
        with temporary_settings(updates={PREFECT_API_URL: served.api_url}):
            first = run_deployment("train-eagle3/train-eagle3", parameters={"config": config.model_dump(mode="json")},
                                   timeout=900)
        failed = {"state": first.state.name, "stages": _states(run_dir), "loads": _target_loads(run_dir),
                  "engines": [info["pid"] for _, info in live_engines(cache)], "worker_log": served.worker_log()}
        (run_dir / "artifacts" / "extract").unlink()
        _wait_exited(served, first.name)
        retry = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "retry", str(first.id)], env=served.env,
                               capture_output=True, text=True, timeout=120)
        assert retry.returncode == 0, retry.stdout + retry.stderr
        with _api(served.api_url) as client:
            final = _wait_final(client, first.id)
            reports = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[first.id])))
    finally:  # stopped before the module's other tests run, so they share the machine with no idle engine
        for home, info in live_engines(cache):
            if info.get("spec", {}).get("kv_cache_gib") == OWN_KV_GIB:
                stop_engine(home, info)
    return {"run_dir": run_dir, "failed": failed, "final": final, "reports": reports, "worker_log": served.worker_log()}


def test_a_failed_run_retried_reruns_only_the_failed_stage_and_what_follows_on_its_warm_engine(retried: dict):
    """Issue 25 on the path a scheduled or UI run takes: the failed attempt leaves its target loaded in a warm engine,
    and `prefect flow-run retry` of the same run reruns extract and what follows, attached to that engine (no second
    load), while the stages before extract come back Cached."""
    failed = retried["failed"]
    assert failed["state"] == "Failed" and failed["stages"]["extract"] == "Failed", failed["worker_log"]
    assert {s: failed["stages"][s] for s in BEFORE_EXTRACT} == dict.fromkeys(BEFORE_EXTRACT, "Completed")
    assert [entry.get("event", "loaded") for entry in failed["loads"]] == ["loaded"]
    assert failed["loads"][0]["pid"] in failed["engines"], f"no live warm engine after the failed extract: {failed}"
    assert retried["final"].state.name == "Completed", retried["worker_log"]
    assert retried["final"].run_count >= 2  # the same run id, retried
    states = _states(retried["run_dir"])
    assert {s: states[s] for s in BEFORE_EXTRACT} == dict.fromkeys(BEFORE_EXTRACT, "Cached")
    assert [states[s] for s in FROM_EXTRACT] == ["Completed"] * len(FROM_EXTRACT), states
    loads = _target_loads(retried["run_dir"])
    assert [entry.get("event", "loaded") for entry in loads] == ["loaded", "attached"], loads  # never loaded again
    assert loads[1]["engine_pid"] == failed["loads"][0]["pid"]
    report = next(a.data for a in retried["reports"] if a.key == "eagle3-run-summary" and "completed" in a.data.splitlines()[0])
    assert "| regenerate | Cached |" in report and "| extract | Completed |" in report and "## Acceptance" in report


def _slot_events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "logs" / "gpu_slot.jsonl").read_text().splitlines()]


def _blocks(run_dir: Path) -> list[tuple[float, float]]:
    events = _slot_events(run_dir)
    starts = [e["time"] for e in events if e["event"] == "acquired"]
    ends = [e["time"] for e in events if e["event"] == "released"]
    return list(zip(starts, ends, strict=True))


def _read_all(fd: int, into: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other end closed
            return
        if not chunk:
            return
        into.append(chunk)


# Holds the `gpu` slot (as a run does, through tasks.gpu_slot) until the file argv[2] exists.
SLOT_HOLDER = """
import sys, time
from pathlib import Path
from prefect import flow
from tasks.gpu_slot import gpu_slot

@flow
def hold() -> None:
    with gpu_slot(Path(sys.argv[1]), "target"):
        print("holding", flush=True)
        while not Path(sys.argv[2]).exists():
            time.sleep(0.2)

hold()
"""


def _asking(run_dirs: list[Path]) -> set[str]:
    """Which of `run_dirs` have a holder note without a lease (tasks.gpu_slot writes it just before it asks for the
    slot, and adds the lease once it has it): the runs waiting for the slot."""
    from tasks.gpu_slot import _read_notes

    return {h["run_dir"] for _, h in _read_notes() if not h.get("lease_id")} & {str(d) for d in run_dirs}


def test_two_runs_started_together_take_turns_on_the_gpus(served: Served, retried: dict, tmp_path: Path, monkeypatch):
    """Two runs started together never hold the GPUs at the same time, and one waits for the other's release. That
    they compete does not depend on how fast each starts: the test holds the slot itself until both are waiting for
    it, so whichever gets it second asked before the first one gave it back."""
    monkeypatch.setenv("EAGLE3_CACHE_DIR", served.env["EAGLE3_CACHE_DIR"])  # where the runs note they wait (_asking)
    release = tmp_path / "release-holder"
    holder = subprocess.Popen([sys.executable, "-c", SLOT_HOLDER, str(tmp_path / "holder"), str(release)], cwd=ROOT,
                              env=served.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []  # Prefect's own lines come first
    for line in holder.stdout:
        if line.strip() == "holding":
            break
        seen.append(line)
    else:
        raise AssertionError(f"the slot holder exited ({holder.wait()}): {''.join(seen)[-3000:]}")
    procs, terminal = {}, []
    master, slave = pty.openpty()  # run a's stderr is a terminal: it shows progress bars there
    for name in ("a", "b"):  # upstream cached (a copy of the retried run's artifacts); train, export, evaluate run
        shutil.copytree(retried["run_dir"] / "artifacts", tmp_path / name / "artifacts")
        args = ["run", "--preset", "tiny", "--run-dir", str(tmp_path / name), "--set", "train.seed=1"]
        args += [a for s in SMALL for a in ("--set", s)]
        procs[name] = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=served.env, text=True,
                                       stdout=subprocess.PIPE, stderr=slave if name == "a" else subprocess.STDOUT)
    os.close(slave)
    reader = threading.Thread(target=_read_all, args=(master, terminal), daemon=True)
    reader.start()
    deadline = time.time() + 600  # a guard: both start in seconds
    while _asking([tmp_path / "a", tmp_path / "b"]) != {str(tmp_path / "a"), str(tmp_path / "b")}:
        if time.time() > deadline or any(proc.poll() is not None for proc in procs.values()):
            for proc in [*procs.values(), holder]:
                proc.kill()
            raise AssertionError(f"the two runs did not both wait for the slot: {[p.poll() for p in procs.values()]}")
        time.sleep(0.2)
    release.touch()  # both are waiting: the slot goes to one, the other waits for its release
    assert holder.wait(timeout=120) == 0
    outputs = {name: proc.communicate(timeout=900)[0] for name, proc in procs.items()}
    reader.join(timeout=10)
    os.close(master)
    assert all(proc.returncode == 0 for proc in procs.values()), outputs
    assert f"train         [{'#' * BAR_WIDTH}] 6/6 steps" in b"".join(terminal).decode(errors="replace")
    a, b = _blocks(tmp_path / "a"), _blocks(tmp_path / "b")
    assert len(a) == len(b) == 2
    # They competed (sure, since both waited for the test's holder): some block was asked for before the other run
    # released one, and got only after that release.
    asks = {n: [(e["time"] - e["waited"], e["time"]) for e in _slot_events(tmp_path / n) if e["event"] == "acquired"] for n in "ab"}
    waited_for_other = [(asked, got) for n, other in (("a", b), ("b", a)) for asked, got in asks[n]
                        if any(asked < end <= got for _, end in other)]
    assert waited_for_other, f"no run waited for the other: they never competed, nothing was tested ({asks}, {a}, {b})"
    for start_a, end_a in a:
        for start_b, end_b in b:
            assert end_a <= start_b or end_b <= start_a, f"runs a and b held the GPUs together: {a} {b}"
    assert all(_states(tmp_path / n)["train"] == "Completed" for n in "ab")


def test_ctrl_c_stops_the_worker_and_the_server(served: Served):
    pids = [served.pid("worker"), served.pid("server")]
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(timeout=120) == 0, "".join(served.lines)[-3000:]
    served.reader.join(timeout=60)  # every line it printed is in `lines` (its output ended with it)
    assert "stopped worker, server" in "".join(served.lines)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{served.api_url}/health", timeout=2)

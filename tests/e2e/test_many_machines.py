"""Several machines, on one host, set up as docs/several-machines.md says: an S3 server the
test starts itself (moto's server mode, as s3fs's own suite uses), one `prefect server start`, and
two workers on the `gpu` pool in two folders that share nothing but the bucket and the server (each
its own working folder, builtin-target cache and gpu slot). The parent run is `eagle3 run --preset
tiny` from a third folder with `artifact_root` in the bucket and `extract.parts=2`.

What the tests show:
- the parent starts both parts' flow runs before either has ended (seen: when both runs exist,
  neither is final; a parent that ran them in turn would start the second only once the first had
  ended), each runs on its own worker (its run folder is on that machine), and the assembled store
  equals a one-machine run's store (local artifacts, one process), sample for sample (ids, masks,
  states within 1e-4); nothing in the bucket is under a temporary name;
- a parent stopped by Ctrl-C (SIGINT to its process group) once both parts exist and one runs exits
  130 without waiting for its parts: its `part` tasks, which wait for the part runs, end Crashed
  (stopped by the interrupt; a task that waited to the end would be Completed) while the part runs go
  on, on the workers, to Completed; started again, it waits for those two part runs (each attempt's
  flow run has an idempotency key) instead of starting more;
- the same command again: every stage Cached, no target loaded, no part run started;
- one worker SIGKILLed (its process group: worker, flow run, engine) once its part's first shard is
  on that machine's disk, while it extracts: its run is set Crashed by the heartbeat automation, the
  part is started again and completes on the other worker, the store is still equal, the shards that
  were in the bucket at the kill are still there, and nothing is under a temporary name. (Timed by the
  bucket instead, the kill could land after the tiny part had finished, and its run would complete.)
  The resume of a half-written store on another machine (shards and manifest brought down, checked
  by sha256, kept) is shown by tests/eagle3/test_storage.py and the store's own resume tests;
- `eagle3 sweep --preset tiny --grid train.learning_rate=1e-3,3e-3 --on-workers` with `artifact_root`
  in the bucket, stopped by Ctrl-C once both point runs exist and one runs (it exits 130 before they
  end: its `point` tasks end Crashed) and started again: the parent extracts once (one target load,
  in the first); the two points' train-eagle3 flow runs are started before either ended, one on
  each worker, each with `extract` Cached and no target load there; the second parent waits for
  those two runs and starts none; the report has both points and names the best export; the same
  command again is all Cached and starts no run (the workers here ask for runs every 2 s,
  `PREFECT_WORKER_QUERY_SECONDS=2`: each tiny chain is about 15 s of work);
- `artifact_root=s3://no-such-bucket/x` fails with exit 2 and the URL named, before any stage; so do
  `extract.parts=2` or `sweep --on-workers` with `artifact_root` unset or relative (the workers could
  not reach the artifacts) and with no Prefect server configured (a temporary server has no workers).

None of this is read from timestamps: on a loaded 2-core machine one worker's flow-run process took
longer to start than the other's whole run (the second part started 2 s after the first ended), so
runs handed out together need not overlap in time. What is asserted is what the parent and the
workers did: the runs' states when both existed, whose folder holds each run, the parent's tasks.

Measured on a 2-core machine, nothing else running: the module in 377 s on 2026-12-01 (fixtures 56 s,
the two-worker test 95 s, the sweep 77 s, the kill 108 s, the bad settings 40 s). Its Ctrl-C tests
start the parent with SIGINT at its default (tests/e2e/conftest.py start_cli): run as a shell's
background job (`make test &`, nohup), a test process hands SIGINT down ignored, and the parent would
not see the Ctrl-C."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, _free_port, start_cli

TINY = ["regenerate.enabled=false", "data.max_samples=32", "train.steps=6", "train.warmup_steps=1",
        "train.checkpoint_every=3", "extract.samples_per_shard=4"]
BUCKET = "eagle3"


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("s3")
    port = _free_port()
    log = open(folder / "moto.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    import fsspec

    with pytest.MonkeyPatch.context() as patched:  # this process reads the bucket too, until the module ends
        for name, value in env.items():
            patched.setenv(name, value)
        deadline = time.time() + 60
        while True:
            try:
                fsspec.filesystem("s3", skip_instance_cache=True).mkdir(BUCKET)
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError((folder / "moto.log").read_text()[-2000:]) from None
                time.sleep(0.5)
        yield env
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()


def _bucket():
    import fsspec

    return fsspec.filesystem("s3", skip_instance_cache=True)


class Worker:
    def __init__(self, name: str, folder: Path, env: dict[str, str]) -> None:
        self.name, self.folder = name, folder
        folder.mkdir(parents=True, exist_ok=True)
        self.env = env | {"EAGLE3_WORK_DIR": str(folder), "EAGLE3_CACHE_DIR": str(folder / "cache"),
                          "EAGLE3_GPU_SLOT": f"gpu-{name}", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
                          "PREFECT_LOGGING_EXTRA_LOGGERS": "eagle3",
                          # how often the worker asks for runs (default 10 s): the parts' and points' runs are tiny
                          # here, and a second worker that asks 10 s late finds the other run nearly done
                          "PREFECT_WORKER_QUERY_SECONDS": "2"}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.started = datetime.now(timezone.utc)
        log = open(self.folder / "worker.log", "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "gpu", "--type",
                                      "process", "--limit", "1", "--name", f"worker-{self.name}"],
                                     cwd=self.folder, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_polling(self, timeout: float = 180) -> None:
        """Until the server has this worker's heartbeat from after its start: it polls the pool. A worker restarted
        for the next test takes 10 to 40 s to boot on two busy cores; a test of side-by-side runs must wait for it."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        deadline = time.time() + timeout
        while True:
            with temporary_settings(updates={PREFECT_API_URL: self.env["PREFECT_API_URL"]}), \
                    get_client(sync_client=True) as client:
                beats = [w.last_heartbeat_time for w in client.read_workers_for_work_pool("gpu")
                         if w.name == f"worker-{self.name}" and w.last_heartbeat_time]
            if beats and max(beats) >= self.started:
                return
            assert self.proc.poll() is None and time.time() < deadline, \
                f"worker {self.name} is not polling: {(self.folder / 'worker.log').read_text()[-2000:]}"
            time.sleep(0.5)

    def kill(self) -> None:  # the machine dies: the worker, its flow run and the engine under it
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def parts_run_here(self) -> list[str]:
        return sorted(p.name for p in (self.folder / "eagle3-parts").glob("*/part-*"))


@pytest.fixture(scope="module")
def cluster(prefect_server, s3, tmp_path_factory):
    from flows.deploy import DeploySettings, deploy

    base = os.environ | s3 | {"PREFECT_API_URL": prefect_server}
    with pytest.MonkeyPatch.context() as patched:  # the module's tests call Prefect's client in this process
        patched.setenv("PREFECT_API_URL", prefect_server)
        deploy(DeploySettings(machines=2), prefect_server)
        root = tmp_path_factory.mktemp("machines")
        workers = {name: Worker(name, root / f"machine-{name}", base) for name in ("a", "b")}
        for worker in workers.values():
            worker.start()
        yield base, root, workers
        for worker in workers.values():
            worker.kill()


def _eagle3(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env | {"PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=timeout)


def _start(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return start_cli(args, cwd, env | {"PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _args(url: str) -> list[str]:
    """`eagle3 run` of the tiny preset with artifacts in the bucket at `url` and two parts."""
    return ["run", "--preset", "tiny", *[a for s in TINY + [f"artifact_root={url}", "extract.parts=2"] for a in ("--set", s)],
            "--run-dir", "run"]


def _runs_of(env: dict[str, str], url: str, deployment: str = "extract-part") -> list:
    """The flow runs of `deployment` (the parts' by default) whose artifact root is `url`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])))
    return [r for r in runs if r.parameters["config"]["artifact_root"] == url]


def _wait_for_two(env: dict[str, str], url: str, deployment: str, parent: subprocess.Popen) -> list:
    """The two flow runs of `deployment` at `url` once both exist and one runs (the moment to Ctrl-C the parent);
    asserts that neither had ended when both were first seen: the parent started the second before the first ended.
    (A parent that ran them in turn would start the second only once the first had ended. Waiting for both to be
    Running at one poll raced on a busy 2-core CI machine: a tiny run can end before the other worker's poll.)"""
    deadline, first_seen = time.time() + 300, None
    while len(runs := _runs_of(env, url, deployment)) < 2 or not any(r.state.is_running() for r in runs):
        assert parent.poll() is None and time.time() < deadline, parent.communicate()[1][-3000:]
        if len(runs) == 2 and first_seen is None:
            first_seen = [r.state for r in runs]
        time.sleep(0.2)
    first_seen = first_seen or [r.state for r in runs]
    assert not any(s.is_final() for s in first_seen), f"one run had ended before the other was started: {first_seen}"
    return runs


def _parent_tasks(env: dict[str, str], runs: list, task: str) -> list[str]:
    """The states of the `task` task runs (the ones that wait for `runs`) in the parent flow run that started `runs`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        parents = {client.read_task_run(r.parent_task_run_id).flow_run_id for r in runs}
        assert len(parents) == 1, parents  # one parent started both
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(parents))))
    return sorted(t.state.name for t in tasks if t.name.startswith(f"{task}-"))


def _samples(store: Path) -> dict[str, tuple]:
    from eagle3.capture.store import StoreReader

    return {s.sample_id: (s.input_ids.tolist(), s.loss_mask.tolist(), s.hidden_states.float()) for s in StoreReader(store)}


def _assert_same_store(assembled: Path, single: Path) -> None:
    import torch

    for split in ("train", "heldout"):
        ours, theirs = _samples(assembled / split), _samples(single / split)
        assert sorted(ours) == sorted(theirs), split
        for sid, (ids, mask, states) in theirs.items():
            assert ours[sid][0] == ids and ours[sid][1] == mask, sid
            torch.testing.assert_close(ours[sid][2], states, rtol=0, atol=1e-4)


def _artifact(cwd: Path, run_dir: str, stage: str) -> Path:
    """The artifact folder of `stage` in the summary of the run in `cwd`/`run_dir` (paths there are relative to `cwd`)."""
    import json

    rows = json.loads((cwd / run_dir / "summary.json").read_text())["stages"]
    return cwd / next(r["artifact"] for r in rows if r["name"] == stage)


@pytest.fixture(scope="module")
def one_machine_store(cluster, tmp_path_factory) -> Path:
    """The extract store of the same settings run on one machine: one process, local artifacts, no parts."""
    env, _, _ = cluster
    cwd = tmp_path_factory.mktemp("one-machine")
    single = _eagle3(["run", "--preset", "tiny", *[a for s in TINY for a in ("--set", s)], "--run-dir", "single"], cwd, env)
    assert single.returncode == 0, single.stderr[-3000:]
    return _artifact(cwd, "single", "extract")


def test_two_workers_extract_the_parts_at_once_and_a_rerun_is_all_cached(cluster, one_machine_store, tmp_path):
    """The parent starts both part runs before either ended and each machine runs one; the assembled store equals a
    one-machine run's; the same command again is all Cached. Also: a parent stopped by Ctrl-C does not wait for its
    parts (its `part` tasks end Crashed while the part runs go on to Completed), and started again it takes up the
    part runs it had started."""
    env, root, workers = cluster
    url = f"s3://{BUCKET}/together"
    args = _args(url)
    for worker in workers.values():  # both ask for runs before the parts exist: one part each, with --limit 1
        worker.wait_polling()
    # Ctrl-C once the parent has started both part runs and a worker runs one (SIGINT to the terminal's process
    # group): the parent is then waiting for its parts. Then the same command again: it waits for the two part
    # runs the first one started instead of starting more.
    (tmp_path / "parent").mkdir()
    first_try = _start(args, tmp_path / "parent", env)
    runs = _wait_for_two(env, url, "extract-part", first_try)
    os.killpg(first_try.pid, signal.SIGINT)
    assert first_try.wait(timeout=120) == 130, first_try.communicate()[1][-3000:]
    deadline = time.time() + 300
    while not all(r.state.is_final() for r in runs):  # the part runs go on, on the workers
        assert time.time() < deadline, [r.state for r in runs]
        time.sleep(0.5)
        runs = _runs_of(env, url)
    assert all(r.state.is_completed() for r in runs), [r.state for r in runs]
    # ... and the terminal was back without waiting for them: the parent's tasks that wait for the part runs were
    # stopped by the Ctrl-C (Crashed), not Completed with their run; at least the one whose run was not over
    assert "Crashed" in _parent_tasks(env, runs, "part"), _parent_tasks(env, runs, "part")
    done = _eagle3(args, tmp_path / "parent", env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = _runs_of(env, url)
    assert len(runs) == 2 and all(r.state.is_completed() for r in runs)
    assert len(workers["a"].parts_run_here()) == 1 and len(workers["b"].parts_run_here()) == 1  # one part per machine
    # The assembled store equals a one-machine run's (one process, local artifacts), sample for sample.
    _assert_same_store(_artifact(tmp_path / "parent", "run", "assemble"), one_machine_store)
    from eagle3.storage import RemoteRoot

    assert RemoteRoot(url, tmp_path / "unused").leftovers() == []  # nothing under a temporary name in the bucket
    # The same command again: every stage Cached, no part run started, no target loaded.
    again = _eagle3(args, tmp_path / "parent", env)
    assert again.returncode == 0, again.stderr[-3000:]
    import json

    summary = json.loads((tmp_path / "parent" / "run" / "summary.json").read_text())
    states = {r["name"]: r["state"] for r in summary["stages"] if r["name"] != "gpu_cleanup"}
    assert set(states.values()) == {"Cached"}, states
    assert summary["target_loads"] == []
    assert len(_runs_of(env, url)) == 2


def test_a_dead_worker_s_part_completes_on_the_other_one(cluster, one_machine_store, tmp_path):
    env, root, workers = cluster
    url = f"s3://{BUCKET}/one-dies"
    args = _args(url)
    for worker in workers.values():  # the same data as the test before: its parts would come back from the machines'
        shutil.rmtree(worker.folder / "eagle3-parts", ignore_errors=True)  # local caches, done before any kill
    (tmp_path / "parent").mkdir()
    out_file, err_file = open(tmp_path / "parent.out", "w+"), open(tmp_path / "parent.err", "w+")  # read on failure
    parent = subprocess.Popen([sys.executable, "-m", "flows.cli", *args, "--verbose"], cwd=tmp_path / "parent",
                              env=env | {"PYTHONPATH": str(ROOT)}, stdout=out_file, stderr=err_file, text=True)

    def output() -> str:
        return (tmp_path / "parent.out").read_text()[-3000:] + (tmp_path / "parent.err").read_text()[-6000:]
    bucket, deadline, victim = _bucket(), time.time() + 600, None
    while victim is None:  # a part's first shard on its machine's disk: kill that machine while it extracts (a
        assert parent.poll() is None and time.time() < deadline, output()  # kill timed by the bucket could land
        for worker in workers.values():  # after the part had finished, and its run would not crash)
            for folder in (worker.folder / "eagle3-parts").glob("*/part-*/artifacts/extract/*"):
                if any(folder.glob("*/shard-*.safetensors")):
                    victim, name = worker, f"{BUCKET}/one-dies/extract/{folder.name}"
        time.sleep(0.05)
    victim.kill()
    shards_before = {n for n in bucket.find(name) if "shard-" in n} if bucket.exists(name) else set()
    try:
        parent.wait(timeout=900)
    finally:
        if parent.poll() is None:
            parent.kill()
    assert parent.returncode == 0, output()
    survivor = next(w for w in workers.values() if w is not victim)
    assert len(survivor.parts_run_here()) == 2  # its own part and the dead machine's
    runs = _runs_of(env, url)
    assert sorted(r.state.name for r in runs) == ["Completed", "Completed", "Crashed"]
    _assert_same_store(_artifact(tmp_path / "parent", "run", "assemble"), one_machine_store)
    from eagle3.storage import RemoteRoot

    assert RemoteRoot(url, tmp_path / "unused").leftovers() == []
    assert shards_before <= {n for n in bucket.find(f"{BUCKET}/one-dies/extract") if "shard-" in n}
    victim.start()  # the machine comes back for the next test


def test_a_sweep_on_workers_trains_its_points_side_by_side_and_a_rerun_is_all_cached(cluster, tmp_path):
    """`eagle3 sweep --on-workers`: the parent extracts once; each grid point's chain is a train-eagle3 flow run on
    the gpu pool, both started before either ended, one per machine; the report has both points; the same command
    again is all Cached and starts no run. Also: Ctrl-C once both point runs exist and a worker runs one gives the
    terminal back without waiting for them (the sweep's `point` tasks end Crashed, the point runs go on to
    Completed), and the same command again waits for those runs instead of starting more."""
    import json

    env, _, workers = cluster
    for worker in workers.values():  # the previous test restarted one: both must poll before the points can overlap
        worker.wait_polling()
    url = f"s3://{BUCKET}/sweep"
    # 150 steps: a chain of some 15 s of work, longer than a worker's poll (2 s here): the Ctrl-C lands while the
    # point runs are under way, and each worker takes one
    settings = TINY + [f"artifact_root={url}", "train.steps=150", "train.checkpoint_every=75"]
    args = ["sweep", "--preset", "tiny", *[a for s in settings for a in ("--set", s)],
            "--grid", "train.learning_rate=1e-3,3e-3", "--on-workers", "--run-dir", "sweep"]
    first_try = _start(args, tmp_path, env)
    runs = _wait_for_two(env, url, "train-eagle3", first_try)  # the second point started before the first ended
    os.killpg(first_try.pid, signal.SIGINT)
    assert first_try.wait(timeout=120) == 130, first_try.communicate()[1][-3000:]
    deadline = time.time() + 300
    while not all(r.state.is_final() for r in runs):  # the point runs go on, on the workers
        assert time.time() < deadline, [r.state for r in runs]
        time.sleep(0.5)
        runs = _runs_of(env, url, "train-eagle3")
    assert all(r.state.is_completed() for r in runs), [r.state for r in runs]
    # the sweep did not wait for them: its tasks that wait for the point runs were stopped by the Ctrl-C
    assert "Crashed" in _parent_tasks(env, runs, "point"), _parent_tasks(env, runs, "point")
    done = _eagle3(args, tmp_path, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = _runs_of(env, url, "train-eagle3")
    assert len(runs) == 2 and all(r.state.is_completed() for r in runs)
    ran_on = {name: sorted(p.name for p in (w.folder / "sweep").glob("point-*")) for name, w in workers.items()}
    assert sorted(sum(ran_on.values(), [])) == ["point-1", "point-2"] and all(ran_on.values()), ran_on  # one per machine
    for worker in workers.values():  # each point came back Cached from the bucket up to vocab: no target loaded there
        for point in (worker.folder / "sweep").glob("point-*"):
            rows = {r["name"]: r["state"] for r in json.loads((point / "summary.json").read_text())["stages"]}
            assert rows["extract"] == "Cached" and rows["train"] == "Completed", rows
            assert json.loads((point / "summary.json").read_text())["target_loads"] == []
    summary = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    assert len(summary["points"]) == 2 and all(p["simulated"] is not None for p in summary["points"]), summary["points"]
    # the one extraction, in the parent that Ctrl-C stopped; the one started again found it Cached
    assert summary["target_loads"] == []
    assert len((tmp_path / "sweep" / "logs" / "target_loads.jsonl").read_text().splitlines()) == 1
    assert summary["best_export_dir"] and Path(tmp_path / summary["best_export_dir"], "config.json").is_file()
    report = (tmp_path / "sweep" / "sweep.md").read_text()
    assert "0.001" in report and "0.003" in report, report
    assert "point[1]" in done.stdout and "point[2]" in done.stdout
    again = _eagle3(args, tmp_path, env)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = json.loads((tmp_path / "sweep" / "summary.json").read_text())["stages"]
    assert {r["state"] for r in rows if r["name"] != "gpu_cleanup"} == {"Cached"}, rows
    assert len(_runs_of(env, url, "train-eagle3")) == 2


def test_bad_settings_fail_before_any_work(cluster, tmp_path, monkeypatch, capsys):
    """Refusals before any stage, through the CLI's main in this process (the module's bucket and server settings are
    in os.environ): a refusal starts nothing, so a process of its own per case only added its imports."""
    from flows.cli import main

    monkeypatch.chdir(tmp_path)

    def refused(args: list[str]) -> str:
        code = main(args)
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        return err

    err = refused(["run", "--preset", "tiny", "--set", "artifact_root=s3://no-such-bucket/x", "--run-dir", "run"])
    assert "artifact_root='s3://no-such-bucket/x'" in err and "bucket" in err
    assert not (tmp_path / "run" / "artifacts").exists()  # no stage ran, no target was loaded
    # parts on other workers, artifacts in this run's own folder: they could not reach them
    err = refused(["run", "--preset", "tiny", "--set", "extract.parts=2", "--run-dir", "run"])
    assert "extract.parts=2" in err and "artifact_root is not set" in err
    # a sweep on workers: the same refusal
    sweep = ["sweep", "--preset", "tiny", "--grid", "train.learning_rate=1e-3,3e-3", "--on-workers", "--run-dir", "sw"]
    err = refused(sweep)
    assert "--on-workers" in err and "artifact_root is not set" in err, err
    # parts, or a sweep on workers, but no Prefect server configured: a temporary server has no workers, the run
    # would wait forever
    monkeypatch.delenv("PREFECT_API_URL")
    err = refused(["run", "--preset", "tiny", "--set", "extract.parts=2", "--set", f"artifact_root=s3://{BUCKET}/x",
                   "--run-dir", "run"])
    assert "PREFECT_API_URL" in err, err
    assert not (tmp_path / "run" / "artifacts").exists()
    err = refused([*sweep, "--set", f"artifact_root=s3://{BUCKET}/x"])
    assert "PREFECT_API_URL" in err, err
    assert not (tmp_path / "sw").exists()

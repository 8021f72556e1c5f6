"""The fan-out stages of `extract.parts` (eagle3.ops.parts): split the data, record a part, run a part.

`run_part` is the parent's view of one part: it starts the part's flow run on the `gpu` work pool
(`run_deployment` of `extract.part_deployment`, linked to this task as a subflow) and waits for it.
A part whose flow run does not end Completed (failed, crashed, its worker gone and the run marked
Crashed by the server's zombie automation, or still running after `extract.part_timeout_s`) fails
this task, and Prefect's task retries start the part again, on whichever worker takes it: the part's
finished shards are in the bucket, and its stages reuse them. Each attempt's flow run has an
idempotency key (part fingerprint, a hash of its parameters, attempt), so a parent started again while the parts of an
earlier one still run waits for those runs instead of starting more.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from pathlib import Path

from prefect import task
from prefect.logging import get_run_logger
from prefect.runtime import task_run

from eagle3.artifacts import StageRecord, read_complete
from eagle3.data.conversations import DataConfig
from eagle3.ops import parts
from eagle3.stages import out_dir
from eagle3.storage import open_root

PART_RETRIES = 2  # a part is started at most 1 + PART_RETRIES times


def _jsonable(value: object) -> object:
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else str(value)


class PartFailed(RuntimeError):
    """A part's flow run did not complete."""


def check_part_deployment(deployment: str, what: str = "extract.parts > 1 runs each part",
                          setting: str = "extract.part_deployment", instead: str = "set extract.parts=1") -> None:
    """Refuse a fan-out that could only wait forever: the deployment that runs a part (or a sweep's point) must
    exist on this server (no server configured means a temporary one, which has none). A pool without a live
    worker is only logged: workers may start later."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise PartFailed(f"{what} as a flow run of the deployment {deployment!r} ({setting}), which the Prefect "
                             f"server at {client.api_url} does not have: set PREFECT_API_URL to the server your workers "
                             f"use and run `eagle3 deploy` there, or {instead}") from None
        pool = found.work_pool_name
        online = [w for w in client.read_workers_for_work_pool(pool) if str(w.status).lower().endswith("online")] if pool else []
    if not online:
        get_run_logger().warning("no worker of the work pool %r is online: the runs wait until one starts "
                                 "(`prefect worker start --pool %s` on each GPU machine)", pool, pool)


# Set when the run waiting for these flow runs is stopped (Ctrl-C, see flows.runner.StageRunner.concurrent_outcomes):
# the threads that wait stop at their next poll, so the parent exits at once instead of when its parts end. The
# flow runs themselves go on on their workers, and the same command again waits for them (the idempotency keys).
STOP_WAITING = threading.Event()
POLL_S = 2.0


class StoppedWaiting(KeyboardInterrupt):
    """The parent was interrupted: this thread stopped waiting for its flow run (a crash of the task, not a failure
    that Prefect's task retries would start again)."""


def run_and_wait(deployment: str, parameters: dict, timeout_s: float, what: str, key_prefix: str):  # noqa: ANN201 - a FlowRun
    """Start `deployment`'s flow run with `parameters` and wait for it; raise PartFailed unless it completed.

    One flow run per (key_prefix, parameters, attempt), whoever asks: a parent started again while an earlier
    parent's run still runs (Ctrl-C, a crash of the machine it ran on) waits for that run instead of starting a
    second. The key names everything the run is given (the artifact root among it: the same work for another
    bucket is another run), and this task's attempt."""
    from prefect.deployments import run_deployment

    if STOP_WAITING.is_set():
        raise StoppedWaiting(f"{what}: not started, the run that asked for it was interrupted")
    asked = hashlib.sha256(json.dumps({"deployment": deployment, "parameters": parameters}, sort_keys=True,
                                      default=_jsonable).encode()).hexdigest()[:16]
    key = f"{key_prefix}-{asked}-attempt-{task_run.run_count}"
    flow_run = run_deployment(name=deployment, parameters=parameters, timeout=0, idempotency_key=key)
    if flow_run.state is not None and flow_run.state.is_final() and not flow_run.state.is_completed():
        # that attempt ended badly under an earlier parent: a new run, shown under this task like the first
        flow_run = run_deployment(name=deployment, parameters=parameters, timeout=0,
                                  idempotency_key=f"{key}-{uuid.uuid4().hex[:8]}")
    flow_run = _wait_for(flow_run, timeout_s, what)
    state = flow_run.state
    get_run_logger().info("%s: flow run %s ended %s", what, flow_run.name, state.name if state else "unknown")
    if state is None or not state.is_completed():
        why = (state.message or state.name) if state is not None else "no state"
        raise PartFailed(f"{what}: flow run {flow_run.name!r} of {deployment!r} did not complete ({why}); "
                         "its worker's log says why, it is started again")
    return flow_run


def _wait_for(flow_run, timeout_s: float, what: str):  # noqa: ANN001, ANN202 - prefect FlowRun
    """`flow_run` read again every POLL_S until its state is final or `timeout_s` have passed (what run_deployment's
    own wait does), stopping with StoppedWaiting as soon as STOP_WAITING is set."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            if flow_run.state is not None and flow_run.state.is_final():
                return flow_run
            if STOP_WAITING.wait(max(0.0, min(POLL_S, deadline - time.monotonic()))):
                raise StoppedWaiting(f"{what}: stopped waiting for flow run {flow_run.name!r}, which goes on on its "
                                     "worker; the same command again waits for it")
            if time.monotonic() >= deadline:
                return flow_run
            flow_run = client.read_flow_run(flow_run.id)


@task(name="split_data")
def split_data(config: DataConfig, parts_count: int, root: Path, fp: str) -> StageRecord:
    return parts.run_split(config, parts_count, root, fp)


@task(name="part_record")
def part_record(prepared: StageRecord, extracted: StageRecord, root: Path, fp: str) -> StageRecord:
    return parts.run_part_record(prepared, extracted, root, fp)


@task(name="part", retries=PART_RETRIES, retry_delay_seconds=2)
def run_part(deployment: str, parameters: dict, timeout_s: float, artifact_url: str | None, root: Path, fp: str) -> StageRecord:
    index = parameters["index"]
    flow_run = run_and_wait(deployment, parameters, timeout_s, f"part {index}", f"eagle3-part-{fp}")
    remote = open_root(artifact_url, root, check=False)
    if remote is not None:
        remote.pull("part", fp)
    record = read_complete(out_dir(root, "part", fp))
    if record is None:
        raise PartFailed(f"part {index}: flow run {flow_run.name!r} completed, but its artifact part/{fp} is not whole "
                         f"under {artifact_url or root}: do the workers use the same artifact_root as this run?")
    return record

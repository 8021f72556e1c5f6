"""The `gpu` concurrency slot (strict) and child-process output in the run log, on the session harness."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.gpu_slot import GPU_LIMIT, SLOT_LOG, GpuLimitMissing, ensure_gpu_limit, gpu_slot


def _logs(flow_run_id, expect: list[str]) -> list[str]:  # noqa: ANN001 - UUID
    """The run's log messages, once all of `expect` are among them (logs reach the server in batches) or after 120 s (a loaded CI machine delays the batches)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.time() + 120
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            messages = [log.message for log in logs]
            if all(e in messages for e in expect) or time.time() > deadline:
                return messages
            time.sleep(0.5)


CHILD = "import os; print('hello from a child', flush=True); os.write(2, b'progress 10%\\rprogress 100%\\n')"
ENGINE_RUN = f"""
import subprocess, sys
from prefect import flow, get_run_logger, task
from tasks.output import child_output_to_logs

@task
def engine() -> None:
    with child_output_to_logs():
        subprocess.run([sys.executable, "-c", {CHILD!r}], check=True)
        get_run_logger().info("a python log line")

@flow
def run() -> None:
    engine()

print("flow run", run(return_state=True).state_details.flow_run_id, flush=True)
"""


def test_child_process_output_reaches_the_run_log_once_and_the_terminal(prefect_harness):
    """A stage's child process (an engine) writes to stdout and stderr: each line reaches the run log on the server
    once, and still shows on the terminal. The flow runs in a process of its own, as `eagle3 run` runs one, so what
    is read is what that process sent before it exited (not what a long-lived test process with every earlier test's
    Prefect clients in it had sent so far: there, once, none of the run's logs had arrived after 120 s)."""
    import os
    from uuid import UUID

    from prefect.settings import PREFECT_API_URL

    out = subprocess.run([sys.executable, "-c", ENGINE_RUN], env=os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value()},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (flow_run_id,) = [line.split()[-1] for line in out.stdout.splitlines() if line.startswith("flow run ")]
    messages = _logs(UUID(flow_run_id), expect=["a python log line", "[stdout] hello from a child", "[stderr] progress 100%"])
    assert "[stdout] hello from a child" in messages, (messages, out.stderr[-2000:])
    assert "[stderr] progress 100%" in messages  # a progress bar's last state
    assert messages.count("a python log line") == 1  # not logged again through the pipe
    assert "hello from a child" in out.stdout and "progress 100%" in out.stderr  # still shown where it was written


def test_gpu_slot_is_held_by_one_block_at_a_time_and_logged(prefect_harness, tmp_path: Path):
    from prefect import flow

    @flow
    def run() -> None:
        with gpu_slot(tmp_path, "target"):
            pass
        with gpu_slot(tmp_path, "draft"):
            pass

    run()
    events = [json.loads(line) for line in (tmp_path / "logs" / SLOT_LOG).read_text().splitlines()]
    assert [(e["event"], e["block"]) for e in events] == [("acquired", "target"), ("released", "target"),
                                                         ("acquired", "draft"), ("released", "draft")]


def test_a_missing_gpu_limit_is_an_error_not_a_silent_pass(prefect_harness, tmp_path: Path):
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow
    def run() -> None:
        with gpu_slot(tmp_path, "target"):
            pass

    with get_client(sync_client=True) as client:
        client.delete_global_concurrency_limit_by_name(GPU_LIMIT)
    try:
        with pytest.raises(GpuLimitMissing, match="eagle3 deploy"):
            run()
    finally:
        ensure_gpu_limit()


HOLDER = """
import sys, time
from pathlib import Path
from prefect import flow
from tasks.gpu_slot import gpu_slot

@flow
def hold() -> None:
    with gpu_slot(Path(sys.argv[1]), "draft"):
        print("holding", flush=True)
        time.sleep(600)

hold()
"""


def test_the_slot_of_a_killed_run_is_given_back_at_once_not_after_its_lease(prefect_harness, tmp_path: Path, monkeypatch):
    """A run SIGKILLed while it holds the slot: the next run gives the dead run's lease back and gets the slot at its
    first ask (it does not wait for the 60 s lease to run out, which would take many asks), and the dead run's note
    is gone. Counted in asks, not seconds."""
    import os
    import signal

    from prefect import flow
    from prefect.settings import PREFECT_API_URL

    import tasks.gpu_slot

    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "cache"))  # holder notes of this test only
    env = os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value()}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "killed")], env=env, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # no chance to give the slot back
        holder.wait()

    @flow
    def next_run() -> None:
        with gpu_slot(tmp_path / "next", "draft"):
            pass

    asks: list[bool] = []  # one entry per ask for the slot: whether it got it
    real_try = tasks.gpu_slot._try_acquire

    def counted_try(client):  # noqa: ANN001, ANN202 - tasks.gpu_slot._try_acquire's own
        lease = real_try(client)
        asks.append(lease is not None)
        return lease

    monkeypatch.setattr(tasks.gpu_slot, "_try_acquire", counted_try)
    next_run()
    assert asks == [True]  # the killed run's lease (60 s) did not have to run out
    assert not list((tmp_path / "cache" / "gpu-slot").glob("*.json"))

"""Calling stage tasks from a flow: caching by fingerprint, timing, one printed line per stage.

`StageRunner.stage()` runs a cached stage task (tasks.cache), `uncached()` a task that is
never cached (gpu_cleanup, publish). With a URL artifact root (eagle3.storage.RemoteRoot)
`stage()` first fills the local mirror from the bucket (the whole artifact, else what an
unfinished run uploaded), uploads what the task finishes while it runs, and the whole artifact,
marker last, when it succeeds; the record it returns names the local mirror's folder. Each call adds a StageRow to `rows` and prints

    <stage>        <state>     <seconds>s  <artifact>

and a failed stage raises StageFailed with the stage's own error as its message (its
traceback goes to engine.log, which the error line points at). While a task runs, what its
engines and child processes print goes to `engine_log` and the run log (tasks.output), and
to the console only when tasks.console echoes it.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

from prefect import Task
from prefect.states import State

from eagle3.artifacts import StageRecord
from eagle3.ops.summary import StageRow
from eagle3.storage import RemoteRoot, open_root
from tasks import console
from tasks.cache import cached
from tasks.output import child_output_to_logs
from tasks.parts import STOP_WAITING


# Stages whose artifact names this machine's own files (stage_target records the local model folder):
# every machine builds its own (in seconds: a config, the head weights), none is shared through the bucket.
MACHINE_LOCAL = {"stage_target"}
WORK_DIR_ENV = "EAGLE3_WORK_DIR"  # a worker's own folder: the relative run folders of the runs it takes are made there


def enter_work_dir() -> None:
    """In a flow run a worker started (a part, a sweep's point, a train-eagle3 or nightly run from the UI or a
    schedule): make the relative run folder under the worker's $EAGLE3_WORK_DIR when set (each such run is a process
    of its own: the change of folder is its alone), and create this machine's `gpu` slot ($EAGLE3_GPU_SLOT) on first
    use. A run in the caller's process (`eagle3 run`) stays where it was started; the CLI made its slot."""
    from prefect.context import FlowRunContext

    from tasks.gpu_slot import ensure_gpu_limit

    context = FlowRunContext.get()
    if context is None or context.flow_run is None or context.flow_run.deployment_id is None:
        return
    if os.environ.get(WORK_DIR_ENV):
        os.chdir(os.environ[WORK_DIR_ENV])
    ensure_gpu_limit()


class StageFailed(RuntimeError):
    """A stage failed; the message is the stage's own error, `log` the file that holds its details."""

    def __init__(self, message: str, log: Path | None = None) -> None:
        super().__init__(message)
        self.log = log


def log_traceback(engine_log: Path | None, stage: str, error: BaseException) -> None:
    """Append `error`'s traceback to engine.log, each line tagged like the engines' lines."""
    if engine_log is None:
        return
    engine_log.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    lines = "".join(traceback.format_exception(error)).rstrip("\n").splitlines()
    with open(engine_log, "a", encoding="utf-8") as handle:
        handle.writelines(f"{stamp} {stage} [traceback] {line}\n" for line in lines)


def open_runner(artifact_root: str | None, local: Path, run_dir: Path) -> StageRunner:
    """The StageRunner of a flow run. A URL artifact root is checked first (a probe object written and
    deleted): an unreachable bucket or missing credentials fail here, at the start of the run, naming
    the URL and `artifact_root`, before any stage runs or any target is loaded."""
    from tasks.output import ENGINE_LOG

    return StageRunner(local, Path(run_dir) / "logs" / ENGINE_LOG, open_root(artifact_root, local))


class StageRunner:
    """Calls stages in order, timing each and printing one line per stage.

    `engine_log`: <run_dir>/logs/engine.log, where the stages' engine output and failures go.
    """

    def __init__(self, root: Path, engine_log: Path | None = None, remote: RemoteRoot | None = None) -> None:
        self.root = Path(root)
        self.engine_log = Path(engine_log) if engine_log is not None else None
        self.remote = remote
        self.rows: list[StageRow] = []

    def _finish(self, name: str, state: State, started: float, local: Path | None = None) -> object:
        """`name`: the printed label; `local`: the mirror folder a record's uri is rewritten to (a
        cached result may name the folder of the machine that computed it)."""
        seconds = time.time() - started
        result = state.result(raise_on_failure=False)
        if local is not None and isinstance(result, StageRecord):
            result = result.model_copy(update={"uri": str(local)})
        artifact = result.uri if isinstance(result, StageRecord) else ""
        row = StageRow(name=name, state=state.name if not state.is_failed() else "Failed", seconds=round(seconds, 2), artifact=artifact)
        self.rows.append(row)
        console.say(f"{row.name:<13} {row.state:<10} {row.seconds:8.1f}s  {row.artifact}".rstrip())
        if state.is_failed():
            error = result if isinstance(result, BaseException) else None
            if error is not None:
                log_traceback(self.engine_log, name, error)
            raise StageFailed(f"{name}: {result}", self.engine_log) from error
        return result

    def uncached(self, name: str, task: Task, **kwargs: object) -> object:
        started = time.time()
        with child_output_to_logs(name, self.engine_log):
            state = task(**kwargs, return_state=True)
        return self._finish(name, state, started)

    def stage(self, name: str, task: Task, fp: str, *, label: str | None = None, **kwargs: object) -> StageRecord:
        """Run stage `name` (its artifact: <root>/<name>/<fp>); `label` is the printed name (default `name`)."""
        started = time.time()
        with child_output_to_logs(label or name, self.engine_log):
            if self.remote is None or name in MACHINE_LOCAL:
                state = cached(task, self.root, name, fp)(**kwargs, root=self.root, fp=fp, return_state=True)
            else:
                state = self._remote_stage(name, task, fp, **kwargs)
        mirrored = self.remote is not None and name not in MACHINE_LOCAL
        return self._finish(label or name, state, started,  # type: ignore[return-value]
                            self.remote.local_dir(name, fp) if mirrored else None)

    def localized(self, stage: str, record: StageRecord) -> StageRecord:
        """`record` (written on another machine) pointing at this machine's copy of its artifact, pulled
        from the bucket first when the root is a URL."""
        if self.remote is not None and not self.remote.pull(stage, record.fingerprint):
            raise StageFailed(f"{stage}/{record.fingerprint} is not whole under {self.remote.url}", self.engine_log)
        return record.model_copy(update={"uri": str(self.root / stage / record.fingerprint)})

    def concurrent(self, name: str, task: Task, calls: list[tuple[str, str, dict]]) -> list[StageRecord]:
        """Run the cached stage `name` once per (fp, label, kwargs) in `calls`, side by side (Prefect's task
        runner threads); a row each, in order. The first failure is raised once every call has ended."""
        outcomes = self.concurrent_outcomes(name, task, calls)
        failure = next((o for o in outcomes if isinstance(o, StageFailed)), None)
        if failure is not None:
            raise failure
        return outcomes  # type: ignore[return-value]

    def concurrent_outcomes(self, name: str, task: Task, calls: list[tuple[str, str, dict]]) -> list[StageRecord | StageFailed]:
        """`concurrent`, but each call's failure is returned in its place rather than raised."""
        started = time.time()
        results = self.remote.results_url if self.remote is not None else None
        futures = []
        outcomes: list[StageRecord | StageFailed] = []
        STOP_WAITING.clear()  # an earlier fan-out of this process that was interrupted (in-process callers: tests)
        try:
            for fp, label, kwargs in calls:
                if self.remote is not None:
                    self.remote.pull(name, fp)
                futures.append((label, fp, cached(task, self.root, name, fp, results=results).submit(
                    **kwargs, root=self.root, fp=fp)))
            for label, fp, future in futures:
                # Timed waits: Python runs its SIGINT handler (KeyboardInterrupt) only when the main thread runs Python
                # code, and an untimed lock wait wakes for a signal only if the kernel gave it this thread.
                while not future.wrapped_future.done():
                    future.wait(timeout=1.0)
                future.wait()
                try:
                    outcomes.append(self._finish(label, future.state, started, self.root / name / fp))  # type: ignore[arg-type]
                except StageFailed as err:
                    outcomes.append(err)
        except KeyboardInterrupt:
            # Ctrl-C: the threads that wait for flow runs on workers (parts, points) stop waiting, so that Prefect's
            # task runner, which joins its threads as the flow ends, lets this process exit now and not when
            # those runs end; the runs go on, and the same command again waits for them.
            STOP_WAITING.set()
            raise
        return outcomes

    def _remote_stage(self, name: str, task: Task, fp: str, **kwargs: object) -> State:
        remote = self.remote
        assert remote is not None
        if not remote.pull(name, fp):
            remote.pull_partial(name, fp)  # an unfinished run's shards or checkpoints, from whichever machine
        with remote.following(name, fp):
            state = cached(task, self.root, name, fp, results=remote.results_url)(**kwargs, root=self.root, fp=fp,
                                                                                 return_state=True)
        if not state.is_failed():
            remote.push(name, fp)
        return state

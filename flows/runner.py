"""Calling stage tasks from a flow: caching by fingerprint, timing, one printed line per stage.

`StageRunner.stage()` runs a cached stage task (tasks.cache), `uncached()` a task that is
never cached (gpu_cleanup, publish). Each call adds a StageRow to `rows` and prints

    <stage>        <state>     <seconds>s  <artifact>

and a failed stage raises StageFailed with the stage's own error as its message (its
traceback goes to engine.log, which the error line points at). While a task runs, what its
engines and child processes print goes to `engine_log` and the run log (tasks.output), and
to the console only when tasks.console echoes it.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

from prefect import Task
from prefect.states import State

from eagle3.artifacts import StageRecord
from eagle3.ops.summary import StageRow
from tasks import console
from tasks.cache import cached
from tasks.output import child_output_to_logs


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


class StageRunner:
    """Calls stages in order, timing each and printing one line per stage.

    `engine_log`: <run_dir>/logs/engine.log, where the stages' engine output and failures go.
    """

    def __init__(self, root: Path, engine_log: Path | None = None) -> None:
        self.root = Path(root)
        self.engine_log = Path(engine_log) if engine_log is not None else None
        self.rows: list[StageRow] = []

    def _finish(self, name: str, state: State, started: float) -> object:  # name: the printed label
        seconds = time.time() - started
        result = state.result(raise_on_failure=False)
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
            state = cached(task, self.root, name, fp)(**kwargs, root=self.root, fp=fp, return_state=True)
        return self._finish(label or name, state, started)  # type: ignore[return-value]

"""Calling stage tasks from a flow: caching by fingerprint, timing, one printed line per stage.

`StageRunner.stage()` runs a cached stage task (tasks.cache), `uncached()` a task that is
never cached (gpu_cleanup, publish). Each call adds a StageRow to `rows` and prints

    <stage>        <state>     <seconds>s  <artifact>

and a failed stage raises StageFailed with the stage's own error as its message. While a
task runs, the output of its child processes goes to the run log too (tasks.output).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import Task
from prefect.states import State

from eagle3.artifacts import StageRecord
from eagle3.ops.summary import StageRow
from tasks.cache import cached
from tasks.output import child_output_to_logs


class StageFailed(RuntimeError):
    """A stage failed; the message is the stage's own error."""


class StageRunner:
    """Calls stages in order, timing each and printing one line per stage."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.rows: list[StageRow] = []

    def _finish(self, name: str, state: State, started: float) -> object:  # name: the printed label
        seconds = time.time() - started
        result = state.result(raise_on_failure=False)
        artifact = result.uri if isinstance(result, StageRecord) else ""
        row = StageRow(name=name, state=state.name if not state.is_failed() else "Failed", seconds=round(seconds, 2), artifact=artifact)
        self.rows.append(row)
        print(f"{row.name:<13} {row.state:<10} {row.seconds:8.1f}s  {row.artifact}", flush=True)
        if state.is_failed():
            raise StageFailed(f"{name}: {result}") from (result if isinstance(result, BaseException) else None)
        return result

    def uncached(self, name: str, task: Task, **kwargs: object) -> object:
        started = time.time()
        with child_output_to_logs():
            state = task(**kwargs, return_state=True)
        return self._finish(name, state, started)

    def stage(self, name: str, task: Task, fp: str, *, label: str | None = None, **kwargs: object) -> StageRecord:
        """Run stage `name` (its artifact: <root>/<name>/<fp>); `label` is the printed name (default `name`)."""
        started = time.time()
        with child_output_to_logs():
            state = cached(task, self.root, name, fp)(**kwargs, root=self.root, fp=fp, return_state=True)
        return self._finish(label or name, state, started)  # type: ignore[return-value]

"""How stage tasks are cached.

The key is the stage's content fingerprint (inputs + settings + stage version), computed
by the flow and passed in as `fp`; editing a task's code does not change it. Results are
persisted as JSON (StageRecord) under the run's artifact root. Before calling a task the
flow checks that the artifact itself is whole (eagle3.artifacts.read_complete); when it
is not (deleted, truncated, half-built) the task is run with refresh_cache=True, so a
cached record never points at a missing artifact.
"""

from __future__ import annotations

from pathlib import Path

from prefect import Task
from prefect.context import TaskRunContext

from eagle3.artifacts import read_complete
from eagle3.stages import out_dir


def fingerprint_key(context: TaskRunContext, parameters: dict) -> str:
    return f"{context.task.name}-{parameters['fp']}"


def cached(task: Task, root: Path, stage: str, fp: str) -> Task:
    """`task` configured for this run: results under `root`, cache refreshed when the artifact is not whole."""
    whole = read_complete(out_dir(root, stage, fp)) is not None
    return task.with_options(
        cache_key_fn=fingerprint_key,
        persist_result=True,
        result_storage=Path(root).resolve() / "prefect-results",  # a Path: a str would name a block
        result_serializer="json",
        refresh_cache=not whole,
    )

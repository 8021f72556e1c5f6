"""Which failures a stage task retries, and how a retry adapts its settings.

Transient, so retried after a delay:
- the engine died: vLLM's EngineDeadError / EngineGenerateError, or a lost pipe/connection
  to its worker processes; the dead engine is dropped from the pool so the retry loads a
  fresh one;
- out of device memory on a batch: the retry runs with half the batch (`batch_tokens`),
  halving again on each further OOM of the same task run;
- a timeout.
Deterministic, never retried: bad settings or data (every ValueError: DataError,
TargetConfigError, ConfigError, VocabError, pydantic's ValidationError) and anything not
known to be transient. A second attempt would fail the same way and only delay the error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from prefect import Task
from prefect.client.schemas.objects import TaskRun
from prefect.logging import get_run_logger
from prefect.runtime import task_run as current_task_run
from prefect.states import State

from eagle3.engine import pool as engine_pool

# Delays before the 1st and 2nd retry: long enough for a driver or a crashed engine to clean up.
ENGINE_RETRY_DELAYS = [10, 60]
_OOM_TEXT = ("out of memory", "cublas_status_alloc_failed", "cuda error: out of memory")
_ENGINE_DEATH = {"EngineDeadError", "EngineGenerateError"}
_OOM_COUNT: dict[str, int] = {}  # task run id -> out-of-memory failures so far (retries run in-process)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and what caused it (explicitly or while handling it)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_out_of_memory(exc: BaseException) -> bool:
    for e in _chain(exc):
        if type(e).__name__ == "OutOfMemoryError" or (isinstance(e, RuntimeError) and any(t in str(e).lower() for t in _OOM_TEXT)):
            return True
    return False


def is_engine_death(exc: BaseException) -> bool:
    return any(
        type(e).__name__ in _ENGINE_DEATH or isinstance(e, (BrokenPipeError, ConnectionError, EOFError)) for e in _chain(exc)
    )


def is_transient(exc: BaseException) -> bool:
    """True when a second attempt can succeed: engine death, out of memory, timeout. Bad config/data: False."""
    if isinstance(exc, ValueError):
        return False
    return is_out_of_memory(exc) or is_engine_death(exc) or any(isinstance(e, TimeoutError) for e in _chain(exc))


def retry_transient(task: Task, task_run: TaskRun, state: State) -> bool:
    """Prefect `retry_condition_fn`: retry only transient failures."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    retry = isinstance(exc, BaseException) and is_transient(exc)
    get_run_logger().warning(
        "%s failed with %s: %s; %s", task.name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "",
        "transient, retrying" if retry else "deterministic (bad settings or data, or unknown): not retried",
    )
    return retry


def _key() -> str:
    return str(current_task_run.id or "")


def batch_tokens_for_attempt(configured: int) -> int:
    """`configured`, halved once per out-of-memory failure of the current task run (never below 1)."""
    return max(1, configured >> _OOM_COUNT.get(_key(), 0))


@contextlib.contextmanager
def transient_failures() -> Iterator[None]:
    """Around a stage's library call: count OOMs (for the next attempt's batch) and drop a broken engine."""
    try:
        yield
    except BaseException as err:
        if is_out_of_memory(err):
            _OOM_COUNT[_key()] = _OOM_COUNT.get(_key(), 0) + 1
        if is_transient(err):
            engine_pool.release_all(keep_warm=True)  # a dead or half-broken engine must not be handed to the retry
        raise

"""Task retries: transient failures retry with delays (OOM with half the batch), bad config/data never retry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel, ValidationError

from eagle3.config import ConfigError, build_config
from eagle3.data.conversations import DataError
from eagle3.data.target import TargetConfigError
from tasks import stages as data_tasks
from tasks.retry import batch_tokens_for_attempt, is_transient, retry_transient, transient_failures


def _engine_dead() -> BaseException:
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError()


def _validation_error() -> ValidationError:
    class Strict(BaseModel):
        steps: int

    try:
        Strict(steps="many")
    except ValidationError as err:
        return err
    raise AssertionError("unreachable")


def _caused_by(cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise RuntimeError("extract failed") from inner
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(("make", "transient"), [
    (lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (lambda: RuntimeError("CUDA error: out of memory"), True),
    (_engine_dead, True),
    (lambda: _caused_by(_engine_dead()), True),
    (lambda: BrokenPipeError(32, "Broken pipe"), True),
    (lambda: TimeoutError("engine did not answer"), True),
    (lambda: DataError("data.source='x.jsonl': no such file"), False),
    (lambda: TargetConfigError("target.model='/nope': no such folder"), False),
    (lambda: ConfigError("invalid configuration: train.stepz"), False),
    (_validation_error, False),
    (lambda: RuntimeError("shape mismatch"), False),
    (lambda: KeyError("hidden_states"), False),
])
def test_which_failures_are_transient(make, transient):
    assert is_transient(make()) is transient


def test_engine_stages_retry_only_transient_failures_with_delays():
    for task in (data_tasks.regenerate, data_tasks.extract):
        assert task.retries == 2 and task.retry_delay_seconds == [10, 60]
        assert task.retry_condition_fn is retry_transient
    for task in (data_tasks.stage_target, data_tasks.prepare_data):
        assert task.retries == 0


def test_out_of_memory_is_retried_with_half_the_batch_each_time(prefect_harness):
    from prefect import flow, task

    seen: list[int] = []

    @task(retries=3, retry_delay_seconds=0, retry_condition_fn=retry_transient)
    def prefill(configured: int) -> int:
        batch = batch_tokens_for_attempt(configured)
        seen.append(batch)
        with transient_failures():
            if batch > 4096:
                raise torch.OutOfMemoryError(f"CUDA out of memory at batch_tokens={batch}")
            return batch

    @flow
    def run() -> int:
        return prefill(16384)

    assert run() == 4096
    assert seen == [16384, 8192, 4096]


def test_bad_data_fails_at_once_without_a_retry(prefect_harness, builtin_cache, tmp_path: Path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.train_eagle3 import train_eagle3

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "hi"}]}) + "\n" for i in range(3)))
    config = build_config("tiny", run_dir=str(tmp_path / "run"), overrides=[f"cache_dir={builtin_cache}", f"data.source={chats}"])
    state = train_eagle3(config, return_state=True)
    assert state.is_failed() and "assistant turn" in str(state.result(raise_on_failure=False))
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    regenerate = [r for r in runs if r.task_key.startswith("regenerate") or r.name.startswith("regenerate")]
    assert len(regenerate) == 1 and regenerate[0].run_count == 1 and regenerate[0].state.is_failed()

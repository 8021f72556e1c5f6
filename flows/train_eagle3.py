"""The train_eagle3 flow: the whole DAG, read top to bottom.

gpu_cleanup -> stage_target -> regenerate -> prepare_data -> extract -> gpu_cleanup
-> vocab -> train -> export -> evaluate

Each cached stage is keyed by its content fingerprint; the flow computes it from the
upstream records, checks that the artifact is whole, and calls the task. The target is
loaded by the first stage that has real work for it (regenerate or extract) and shared
by both; it is released before training.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.states import State

from eagle3 import draft_stages, stages, vllm_adapter
from eagle3.artifacts import StageRecord
from eagle3.config import PipelineConfig
from eagle3.summary import RunSummary, StageRow, write_summary
from tasks import draft as draft_tasks
from tasks import stages as data_tasks
from tasks.cache import cached
from tasks.gpu import gpu_cleanup


class StageFailed(RuntimeError):
    """A stage failed; the message is the stage's own error."""


class _Run:
    """Calls stages in order, timing each and printing one line per stage."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.root = config.artifacts
        self.rows: list[StageRow] = []

    def _finish(self, name: str, state: State, started: float) -> object:
        seconds = time.time() - started
        result = state.result(raise_on_failure=False)
        artifact = result.uri if isinstance(result, StageRecord) else ""
        row = StageRow(name=name, state=state.name if not state.is_failed() else "Failed", seconds=round(seconds, 2), artifact=artifact)
        self.rows.append(row)
        print(f"{row.name:<13} {row.state:<10} {row.seconds:8.1f}s  {row.artifact}", flush=True)
        if state.is_failed():
            raise StageFailed(f"{name}: {result}") from (result if isinstance(result, BaseException) else None)
        return result

    def uncached(self, name: str, task, **kwargs) -> object:  # noqa: ANN001 - a prefect Task
        started = time.time()
        return self._finish(name, task(**kwargs, return_state=True), started)

    def stage(self, name: str, task, fp: str, **kwargs) -> StageRecord:  # noqa: ANN001 - a prefect Task
        started = time.time()
        state = cached(task, self.root, name, fp)(**kwargs, root=self.root, fp=fp, return_state=True)
        return self._finish(name, state, started)  # type: ignore[return-value]


@flow(name="train-eagle3", log_prints=False)
def train_eagle3(config: PipelineConfig) -> RunSummary:
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    load_log = run_dir / "logs" / "target_loads.jsonl"
    run = _Run(config)
    outcome: dict[str, object] = {}
    try:
        run.uncached("gpu_cleanup", gpu_cleanup, config=config.gpu, run_dir=run_dir)
        target = run.stage("stage_target", data_tasks.stage_target, stages.fingerprint_target(config.target),
                           config=config.target, cache_dir=config.builtin_cache)
        regen = run.stage("regenerate", data_tasks.regenerate,
                          stages.fingerprint_regenerate(config.regenerate, config.data, target, config.target.max_model_len),
                          config=config.regenerate, data_config=config.data, target_config=config.target, target=target, load_log=load_log)
        prepared = run.stage("prepare_data", data_tasks.prepare_data, stages.fingerprint_prepare(config.data, regen, target),
                             config=config.data, regenerated=regen, target=target, trust_remote_code=config.target.trust_remote_code)
        extracted = run.stage("extract", data_tasks.extract, stages.fingerprint_extract(config.extract, config.target, prepared, target),
                              config=config.extract, target_config=config.target, prepared=prepared, target=target, load_log=load_log)
        vllm_adapter.release_all()  # free the target's memory before training
        run.uncached("gpu_cleanup", gpu_cleanup, config=config.gpu, run_dir=run_dir)
        vocab = run.stage("vocab", draft_tasks.vocab, draft_stages.fingerprint_vocab(config.vocab, prepared),
                          config=config.vocab, prepared=prepared, target=target)
        trained = run.stage("train", draft_tasks.train, draft_stages.fingerprint_train(config.train, extracted, vocab, target),
                            config=config.train, target=target, extracted=extracted, vocab=vocab)
        exported = run.stage("export", draft_tasks.export, draft_stages.fingerprint_export(trained),
                             target=target, trained=trained, vocab=vocab)
        outcome["export_dir"] = exported.uri
        evaluated = run.stage("evaluate", draft_tasks.evaluate, draft_stages.fingerprint_evaluate(config.eval, exported, extracted),
                              config=config.eval, target=target, exported=exported, extracted=extracted)
        outcome["acceptance_length"] = evaluated.stats["acceptance_length"]
        outcome["evaluation"] = evaluated.uri
    finally:
        vllm_adapter.release_all()
        summary = RunSummary(stages=list(run.rows), **outcome)
        write_summary(run_dir / "summary.json", summary)
        create_markdown_artifact(key="eagle3-run-summary", markdown=summary.to_markdown(), description="stages and acceptance")
    return summary

"""The train_eagle3 flow: the whole DAG, read top to bottom.

gpu_cleanup -> stage_target -> regenerate -> prepare_data -> extract -> gpu_cleanup
-> vocab -> train -> export -> evaluate

Each cached stage is keyed by its content fingerprint; the flow computes it from the
upstream records, checks that the artifact is whole, and calls the task. The target is
loaded by the first stage that has real work for it (regenerate or extract) and shared
by both; it is released before training.

Two blocks hold the `gpu` concurrency slot (tasks.gpu_slot.gpu_slot), so that two runs never
share the GPUs: from the first gpu_cleanup until the target is released and the GPUs are
verified clean, and from train to evaluate.

Retrying a failed run (`prefect flow-run retry`, Retry in the UI) re-runs it under the same
id: every stage that finished comes back Cached, the failed one and those after it run.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from eagle3 import draft_stages, stages
from eagle3.capture import vllm_adapter
from eagle3.config import PipelineConfig, check_against_target
from eagle3.data.target import TargetInfo
from eagle3.ops.summary import RunSummary, data_report, loads_since, write_summary
from flows.report import run_report
from flows.runner import StageFailed, StageRunner
from tasks import draft as draft_tasks
from tasks import stages as data_tasks
from tasks.gpu import gpu_cleanup
from tasks.gpu_slot import gpu_slot
from tasks.output import ENGINE_LOG

__all__ = ["StageFailed", "train_eagle3"]


@flow(name="train-eagle3", log_prints=False)
def train_eagle3(config: PipelineConfig) -> RunSummary:
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    load_log = run_dir / "logs" / "target_loads.jsonl"
    run = StageRunner(config.artifacts, run_dir / "logs" / ENGINE_LOG)
    outcome: dict[str, object] = {}
    cleanups: list[dict] = []
    started = time.time()
    trained = None
    try:
        with gpu_slot(run_dir, "target"):
            cleanups.append(run.uncached("gpu_cleanup", gpu_cleanup, config=config.gpu, run_dir=run_dir))
            target = run.stage("stage_target", data_tasks.stage_target, stages.fingerprint_target(config.target),
                               config=config.target, cache_dir=config.builtin_cache)
            check_against_target(config, TargetInfo.read(target.path))  # in seconds, not after extraction
            regen = run.stage("regenerate", data_tasks.regenerate,
                              stages.fingerprint_regenerate(config.regenerate, config.data, target, config.target.max_model_len),
                              config=config.regenerate, data_config=config.data, target_config=config.target, target=target,
                              load_log=load_log)
            prepared = run.stage("prepare_data", data_tasks.prepare_data, stages.fingerprint_prepare(config.data, regen, target),
                                 config=config.data, regenerated=regen, target=target, trust_remote_code=config.target.trust_remote_code)
            outcome["data"] = data_report(regen, prepared)
            extracted = run.stage("extract", data_tasks.extract, stages.fingerprint_extract(config.extract, config.target, prepared, target),
                                  config=config.extract, target_config=config.target, prepared=prepared, target=target, load_log=load_log)
            vllm_adapter.release_all()  # free the target's memory before training
            cleanups.append(run.uncached("gpu_cleanup", gpu_cleanup, config=config.gpu, run_dir=run_dir))
        vocab = run.stage("vocab", draft_tasks.vocab, draft_stages.fingerprint_vocab(config.vocab, prepared),
                          config=config.vocab, prepared=prepared, target=target)
        with gpu_slot(run_dir, "draft"):
            trained = run.stage("train", draft_tasks.train, draft_stages.fingerprint_train(config.train, extracted, vocab, target),
                                config=config.train, target=target, extracted=extracted, vocab=vocab)
            exported = run.stage("export", draft_tasks.export, draft_stages.fingerprint_export(trained),
                                 target=target, trained=trained, vocab=vocab)
            outcome["export_dir"] = exported.uri
            evaluated = run.stage("evaluate", draft_tasks.evaluate,
                                  draft_stages.fingerprint_evaluate(config.eval, exported, extracted),
                                  config=config.eval, target=target, exported=exported, extracted=extracted)
            outcome["acceptance_length"] = evaluated.stats["acceptance_length"]
            outcome["evaluation"] = evaluated.uri
            vllm_adapter.release_all()
    finally:
        vllm_adapter.release_all()
        summary = RunSummary(stages=list(run.rows), gpu_cleanup=cleanups, target_loads=loads_since(load_log, started),
                             **outcome)
        write_summary(run_dir / "summary.json", summary)
        report = run_report(summary, run_dir, title="train-eagle3", sources=[trained.path if trained else None])
        create_markdown_artifact(key="eagle3-run-summary", markdown=report, description="stages, acceptance, plots")
    return summary

"""Thin tasks of the draft side: vocab, train, export, evaluate (no retries: CPU/GPU math on
local files either works or fails the same way again)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.logging import get_run_logger

from eagle3 import draft_stages
from eagle3.artifacts import StageRecord
from eagle3.capture.vllm_serving import ServingSetup
from eagle3.evaluate.acceptance import EvalConfig
from eagle3.train.config import TrainConfig
from eagle3.draft.vocab import VocabConfig
from tasks import console
from tasks.progress import progress_reporter


@task(name="vocab")
def vocab(config: VocabConfig, prepared: StageRecord, target: StageRecord, root: Path, fp: str) -> StageRecord:
    return draft_stages.run_vocab(config, prepared, target, root, fp)


@task(name="train")
def train(config: TrainConfig, target: StageRecord, extracted: StageRecord, vocab: StageRecord, root: Path, fp: str,
          online: draft_stages.OnlineSetup | None = None) -> StageRecord:
    report = progress_reporter("train", "steps")

    def progress(step: int, total: int, loss: float, captured: int | None = None) -> None:
        online_part = "" if captured is None else f", {captured:,} tokens captured"  # train.data online/hybrid
        report(step, total, detail=f"loss {loss:.3f}{online_part}")

    def say(text: str) -> None:  # the online plan: on the console and in the run log
        console.say(text)
        get_run_logger().info(text)

    return draft_stages.run_train(config, target, extracted, vocab, root, fp, online=online, say=say, progress=progress)


@task(name="export")
def export(target: StageRecord, trained: StageRecord, vocab: StageRecord, root: Path, fp: str) -> StageRecord:
    return draft_stages.run_export(target, trained, vocab, root, fp)


@task(name="evaluate")
def evaluate(config: EvalConfig, target: StageRecord, exported: StageRecord, extracted: StageRecord, root: Path, fp: str,
             serving: ServingSetup = ServingSetup()) -> StageRecord:
    return draft_stages.run_evaluate(config, target, exported, extracted, root, fp,
                                     progress=progress_reporter("evaluate", "items"), serving=serving)

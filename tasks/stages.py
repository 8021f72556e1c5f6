"""One thin task per stage. Each takes typed settings + upstream records, calls one library
function, and returns a small StageRecord (never a model or a tensor).

Retries (tasks.retry): only the stages that run an engine (regenerate, extract) retry, with
delays, and only on transient failures: the engine died, the device ran out of memory (the
extract retry then runs with half the batch), a timeout. Bad data or config fail at once.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.logging import get_run_logger

from eagle3 import stages
from eagle3.artifacts import StageRecord
from eagle3.capture.extract import ExtractConfig
from eagle3.capture.regenerate import RegenerateConfig
from eagle3.capture.synthesize import SynthesizeConfig
from eagle3.data.conversations import DataConfig
from eagle3.data.target import TargetConfig
from tasks.progress import progress_reporter
from tasks.retry import ENGINE_RETRY_DELAYS, batch_tokens_for_attempt, retry_transient, transient_failures


@task(name="stage_target")
def stage_target(config: TargetConfig, cache_dir: Path, root: Path, fp: str) -> StageRecord:
    return stages.run_stage_target(config, cache_dir, root, fp)


@task(name="synthesize", retries=len(ENGINE_RETRY_DELAYS), retry_delay_seconds=ENGINE_RETRY_DELAYS,
      retry_condition_fn=retry_transient)
def synthesize(config: SynthesizeConfig, regen: RegenerateConfig, target_config: TargetConfig, target: StageRecord,
               root: Path, fp: str, load_log: Path) -> StageRecord:
    with transient_failures():
        return stages.run_synthesize(config, regen, target_config, target, root, fp, load_log,
                                     progress=progress_reporter("synthesize", "prompts"))


@task(name="regenerate", retries=len(ENGINE_RETRY_DELAYS), retry_delay_seconds=ENGINE_RETRY_DELAYS,
      retry_condition_fn=retry_transient)
def regenerate(config: RegenerateConfig, data_config: DataConfig, target_config: TargetConfig, target: StageRecord,
               root: Path, fp: str, load_log: Path) -> StageRecord:
    with transient_failures():
        return stages.run_regenerate(config, data_config, target_config, target, root, fp, load_log,
                                     progress=progress_reporter("regenerate", "requests"))


@task(name="prepare_data")
def prepare_data(config: DataConfig, regenerated: StageRecord, target: StageRecord, trust_remote_code: bool,
                 root: Path, fp: str) -> StageRecord:
    return stages.run_prepare(config, regenerated, target, trust_remote_code, root, fp)


@task(name="extract", retries=len(ENGINE_RETRY_DELAYS), retry_delay_seconds=ENGINE_RETRY_DELAYS,
      retry_condition_fn=retry_transient)
def extract(config: ExtractConfig, target_config: TargetConfig, prepared: StageRecord, target: StageRecord,
            root: Path, fp: str, load_log: Path) -> StageRecord:
    batch = batch_tokens_for_attempt(config.batch_tokens)
    if batch != config.batch_tokens:
        # Same artifact (fp): batching changes how many tokens go through one prefill, not what is stored.
        get_run_logger().warning("extract: out of memory before; retrying with extract.batch_tokens=%d (was %d)",
                                 batch, config.batch_tokens)
        config = config.model_copy(update={"batch_tokens": batch})
    with transient_failures():
        return stages.run_extract(config, target_config, prepared, target, root, fp, load_log,
                                  progress=progress_reporter("extract", "shards"))

"""One thin task per stage. Each takes typed settings + upstream records, calls one library
function, and returns a small StageRecord (never a model or a tensor).

Retries: only the stages that run an engine (regenerate, extract) retry, because an engine
can die for reasons that a second attempt fixes; bad data or config fail at once.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from eagle3 import stages
from eagle3.artifacts import StageRecord
from eagle3.data import DataConfig
from eagle3.extract import ExtractConfig
from eagle3.regenerate import RegenerateConfig
from eagle3.target import TargetConfig
from tasks.progress import progress_reporter


@task(name="stage_target")
def stage_target(config: TargetConfig, cache_dir: Path, root: Path, fp: str) -> StageRecord:
    return stages.run_stage_target(config, cache_dir, root, fp)


@task(name="regenerate", retries=1, retry_delay_seconds=5)
def regenerate(config: RegenerateConfig, data_config: DataConfig, target_config: TargetConfig, target: StageRecord,
               root: Path, fp: str, load_log: Path) -> StageRecord:
    return stages.run_regenerate(config, data_config, target_config, target, root, fp, load_log)


@task(name="prepare_data")
def prepare_data(config: DataConfig, regenerated: StageRecord, target: StageRecord, trust_remote_code: bool,
                 root: Path, fp: str) -> StageRecord:
    return stages.run_prepare(config, regenerated, target, trust_remote_code, root, fp)


@task(name="extract", retries=1, retry_delay_seconds=5)
def extract(config: ExtractConfig, target_config: TargetConfig, prepared: StageRecord, target: StageRecord,
            root: Path, fp: str, load_log: Path) -> StageRecord:
    return stages.run_extract(config, target_config, prepared, target, root, fp, load_log, progress=progress_reporter("extract", "shards"))

"""The extract-part flow: one part of a fanned-out run (`extract.parts`), on whichever worker takes it.

gpu_cleanup -> stage_target -> regenerate -> prepare_data -> extract -> gpu_cleanup -> part_record

The parent (flows/train_eagle3.py) starts it through the `extract-part` deployment, with the
part's settings (eagle3.ops.parts.part_config: a run folder under this worker's working folder,
the shared artifact root, the part file as the data source). The part file comes from the
artifact root; every stage's artifact goes back there, the `part` record last.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow

from eagle3.artifacts import StageRecord
from eagle3.engine import pool as engine_pool
from eagle3.config import PipelineConfig
from eagle3.ops.summary import RunSummary, loads_since, write_summary
from flows.runner import enter_work_dir, open_runner
from flows.train_eagle3 import target_stages
from tasks import parts as part_tasks



@flow(name="extract-part", log_prints=False)
def extract_part(config: PipelineConfig, split_fp: str, index: int, part_fp: str) -> StageRecord:
    enter_work_dir()
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    load_log = run_dir / "logs" / "target_loads.jsonl"
    run = open_runner(config.artifact_url, config.artifacts, run_dir)
    if run.remote is not None and not run.remote.pull("split_data", split_fp):
        raise FileNotFoundError(f"split_data/{split_fp} is not whole under {config.artifact_url}: the parent run "
                                "writes it before it starts the parts")
    cleanups: list[dict] = []
    started = time.time()
    try:
        _, prepared, extracted = target_stages(run, config, load_log, cleanups, {})
        return run.stage("part", part_tasks.part_record, part_fp, label=f"part {index}", prepared=prepared,
                         extracted=extracted)
    finally:
        engine_pool.release_all(keep_warm=True)  # a failed part leaves its warm engine up for target.keep_warm_s
        write_summary(run_dir / "summary.json", RunSummary(stages=list(run.rows), gpu_cleanup=cleanups,
                                                           target_loads=loads_since(load_log, started)))

"""The gpu_cleanup task: find and stop the processes holding the GPUs, then verify with NVML.

Never cached (the GPUs' state is not a function of our inputs). The slot that keeps runs
from sharing the GPUs is tasks.gpu_slot.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.artifacts import atomic_write_text
from eagle3.data.builtin_targets import default_cache_dir
from eagle3.engine.registry import clear_dead_engines, in_use_pids
from eagle3.gpu.cleanup import GpuCleanupConfig, cleanup_gpus


@task(name="gpu_cleanup", cache_policy=NO_CACHE)
def gpu_cleanup(config: GpuCleanupConfig, run_dir: Path) -> dict[str, object]:
    clear_dead_engines(default_cache_dir())  # a killed engine's TP workers: gone now, not ~10 s later
    report = cleanup_gpus(config, run_dir, warm=in_use_pids(default_cache_dir()))  # live warm engines are in use
    create_markdown_artifact(markdown=report.to_markdown(), description="gpu_cleanup report")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "logs" / "gpu_cleanup.json", json.dumps(report.to_dict(), indent=1, default=str))
    return report.to_dict()

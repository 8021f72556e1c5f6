"""The gpu_cleanup task: never cached (the GPUs' state is not a function of our inputs)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.gpu import GpuCleanupConfig, cleanup_gpus
from eagle3.store import atomic_write_text


@task(name="gpu_cleanup", cache_policy=NO_CACHE)
def gpu_cleanup(config: GpuCleanupConfig, run_dir: Path) -> dict[str, object]:
    report = cleanup_gpus(config, run_dir)
    create_markdown_artifact(markdown=report.to_markdown(), description="gpu_cleanup report")
    import json

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "logs" / "gpu_cleanup.json", json.dumps(report.to_dict(), indent=1, default=str))
    return report.to_dict()

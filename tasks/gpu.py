"""The GPUs: the gpu_cleanup task, and the global concurrency slot that keeps runs apart.

gpu_cleanup is never cached (the GPUs' state is not a function of our inputs).

`gpu_slot()` holds the one slot of the global concurrency limit `gpu` while a run uses the
GPUs, so that two runs (from the UI, the schedule, the CLI, any work pool) never share
them: the second waits. It is taken in strict mode: a limit that was never created is an
error, not a silent pass (Prefect skips unknown limits with only a warning otherwise).
`ensure_gpu_limit()` creates it; `eagle3 deploy`, `eagle3 serve` and `eagle3 run` call it.

The slot is a lease renewed in the background; a run killed with SIGKILL frees it when
the lease runs out (LEASE_SECONDS, plus up to 15 s for the server to notice). A failed
renewal is logged and the run goes on: killing a long training because the server
blinked would cost more than the risk it guards against.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency
from prefect.logging import get_run_logger

from eagle3.gpu import GpuCleanupConfig, cleanup_gpus
from eagle3.store import atomic_write_text

GPU_LIMIT = "gpu"
LEASE_SECONDS = 60  # the server's minimum
SLOT_LOG = "gpu_slot.jsonl"


class GpuLimitMissing(RuntimeError):
    """The global concurrency limit `gpu` does not exist on the Prefect server."""


@task(name="gpu_cleanup", cache_policy=NO_CACHE)
def gpu_cleanup(config: GpuCleanupConfig, run_dir: Path) -> dict[str, object]:
    report = cleanup_gpus(config, run_dir)
    create_markdown_artifact(markdown=report.to_markdown(), description="gpu_cleanup report")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "logs" / "gpu_cleanup.json", json.dumps(report.to_dict(), indent=1, default=str))
    return report.to_dict()


def ensure_gpu_limit(slots: int = 1) -> None:
    """Create the global concurrency limit `gpu` (or set it back to `slots`) on the configured server."""
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, slots)


def _note(run_dir: Path, event: str, block: str, **extra: object) -> None:
    path = Path(run_dir) / "logs" / SLOT_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:  # one short line per event; appends of < 4 KiB do not interleave
        handle.write(json.dumps({"event": event, "block": block, "time": time.time(), **extra}) + "\n")


@contextlib.contextmanager
def gpu_slot(run_dir: Path, block: str) -> Iterator[None]:
    """Hold the `gpu` slot for `block` (waits while another run holds it); logged to logs/gpu_slot.jsonl."""
    from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError

    logger = get_run_logger()
    logger.info("waiting for the '%s' concurrency slot (%s)", GPU_LIMIT, block)
    asked = time.time()
    acquired = False
    try:
        with concurrency(GPU_LIMIT, occupy=1, strict=True, lease_duration=LEASE_SECONDS,
                         raise_on_lease_renewal_failure=False):
            acquired = True
            logger.info("holding the '%s' slot for %s (waited %.1f s)", GPU_LIMIT, block, time.time() - asked)
            _note(run_dir, "acquired", block, waited=round(time.time() - asked, 3))
            try:
                yield
            finally:
                _note(run_dir, "released", block)
    except ConcurrencySlotAcquisitionError as err:
        if acquired or "must be created" not in str(err):
            raise
        raise GpuLimitMissing(
            f"the global concurrency limit {GPU_LIMIT!r} does not exist on this Prefect server; it keeps runs from "
            "sharing the GPUs: create it with `eagle3 deploy` (or `prefect gcl create gpu --limit 1`)"
        ) from err

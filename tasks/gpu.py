"""The GPUs: the gpu_cleanup task, and the global concurrency slot that keeps runs apart.

gpu_cleanup is never cached (the GPUs' state is not a function of our inputs).

`gpu_slot()` holds the one slot of the global concurrency limit `gpu` while a run uses the
GPUs, so that two runs (from the UI, the schedule, the CLI, any work pool) never share
them: the second waits. It is taken in strict mode: a limit that was never created is an
error, not a silent pass (Prefect skips unknown limits with only a warning otherwise).
`ensure_gpu_limit()` creates it; `eagle3 deploy`, `eagle3 serve` and `eagle3 run` call it.

The slot is a lease renewed in the background. A run killed with SIGKILL (or by the OOM
killer) cannot give it back: on the same machine, the next run sees that the holder's
process is gone (each holder notes its lease and pid under <cache dir>/gpu-slot/) and gives
the slot back at once; elsewhere the lease runs out (LEASE_SECONDS, plus up to 15 s for the
server to notice). A failed renewal is logged and the run goes on: killing a long training
because the server blinked would cost more than the risk it guards against.

The lease calls are Prefect's own (`prefect.concurrency._sync`/`_leases`, what its public
`concurrency()` is made of): the public one hides the lease id, which the holder note needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.logging import get_run_logger

from eagle3.artifacts import atomic_write_text, pid_alive
from eagle3.gpu.cleanup import GpuCleanupConfig, cleanup_gpus

GPU_LIMIT = "gpu"
LEASE_SECONDS = 60  # the server's minimum
WAIT_SLICE = 15  # seconds of waiting for the slot between two looks for dead holders
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


def _holders() -> Path:
    """Where the runs of this machine note which lease they hold (one file per lease)."""
    from eagle3.data.builtin_targets import default_cache_dir

    return default_cache_dir() / "gpu-slot"


def reclaim_dead_holders() -> int:
    """Give back the slots of runs of THIS machine whose process is gone (killed with SIGKILL, OOM-killed):
    otherwise the next run waits for their lease to run out. Returns how many were given back."""
    from prefect.concurrency._sync import release_concurrency_slots_with_lease

    count = 0
    for note in sorted(_holders().glob("*.json")):
        try:
            holder = json.loads(note.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if holder.get("host") != socket.gethostname() or pid_alive(int(holder["pid"])):
            continue
        with contextlib.suppress(Exception):  # the lease may have run out already: nothing to give back
            release_concurrency_slots_with_lease(UUID(holder["lease_id"]))
        get_run_logger().warning("gave back the '%s' slot of run %s (process %s is gone)", GPU_LIMIT, holder.get("run_dir"),
                                 holder["pid"])
        note.unlink(missing_ok=True)
        count += 1
    return count


def _acquire(asked: float) -> UUID:
    """The lease of one slot of `gpu`; while waiting, reclaim the slots of dead runs of this machine."""
    from prefect.concurrency._asyncio import AcquireConcurrencySlotTimeoutError, ConcurrencySlotAcquisitionError
    from prefect.concurrency._sync import acquire_concurrency_slots_with_lease

    while True:
        reclaim_dead_holders()
        try:
            response = acquire_concurrency_slots_with_lease([GPU_LIMIT], 1, timeout_seconds=WAIT_SLICE,
                                                             lease_duration=LEASE_SECONDS, strict=True)
            return response.lease_id
        except AcquireConcurrencySlotTimeoutError:
            get_run_logger().info("still waiting for the '%s' slot (%.0f s)", GPU_LIMIT, time.time() - asked)
        except ConcurrencySlotAcquisitionError as err:
            if "must be created" not in str(err):
                raise
            raise GpuLimitMissing(
                f"the global concurrency limit {GPU_LIMIT!r} does not exist on this Prefect server; it keeps runs from "
                "sharing the GPUs: create it with `eagle3 deploy` (or `prefect gcl create gpu --limit 1`)"
            ) from err


@contextlib.contextmanager
def gpu_slot(run_dir: Path, block: str) -> Iterator[None]:
    """Hold the `gpu` slot for `block` (waits while another run holds it); logged to logs/gpu_slot.jsonl."""
    from prefect.concurrency._leases import maintain_concurrency_lease
    from prefect.concurrency._sync import release_concurrency_slots_with_lease

    logger = get_run_logger()
    logger.info("waiting for the '%s' concurrency slot (%s)", GPU_LIMIT, block)
    asked = time.time()
    lease_id = _acquire(asked)
    note = _holders() / f"{lease_id}.json"
    note.parent.mkdir(parents=True, exist_ok=True)
    note.write_text(json.dumps({"lease_id": str(lease_id), "pid": os.getpid(), "host": socket.gethostname(),
                                "run_dir": str(run_dir), "block": block}))
    logger.info("holding the '%s' slot for %s (waited %.1f s)", GPU_LIMIT, block, time.time() - asked)
    _note(run_dir, "acquired", block, waited=round(time.time() - asked, 3))
    try:
        with maintain_concurrency_lease(lease_id, LEASE_SECONDS, raise_on_lease_renewal_failure=False):
            yield
    finally:
        _note(run_dir, "released", block)
        try:
            release_concurrency_slots_with_lease(lease_id)
        finally:
            note.unlink(missing_ok=True)

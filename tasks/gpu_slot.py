"""The global concurrency slot `gpu` that keeps runs from sharing the GPUs.

`gpu_slot()` holds the one slot of the global concurrency limit `gpu` while a run uses the
GPUs, so that two runs (from the UI, the schedule, the CLI, any work pool) never share them:
the second waits, and says on the console about once a minute which run holds the slot. The
slot is taken in strict mode: a limit that was never created is an error, not a silent pass
(Prefect skips unknown limits with only a warning otherwise). `ensure_gpu_limit()` creates it;
`eagle3 deploy`, `eagle3 serve` and `eagle3 run` call it.

The slot is a lease that a background thread renews. A run that dies without giving it back
(SIGKILL, the OOM killer, its server gone) must not keep it, so besides the lease running out
(LEASE_SECONDS, freed by the server's repossessor service) two things look for lost slots while
a run waits:
- holder notes: each run of this machine notes its pid, host, run dir and (once it has one)
  lease id under <cache dir>/gpu-slot/ BEFORE it asks for the slot. A note whose process is gone
  is a dead holder: its lease is given back at once (one log line says whose and why). A note
  without a lease id is a run killed between taking the slot and noting it: its lease runs out
  within LEASE_SECONDS and the repossessor frees it.
- the slot count against the leases: on servers eagle3 started (flows.local_server), leases
  are files, and `EAGLE3_PREFECT_LEASES` says where. A slot counted in the database that no lease
  file holds (a lease that lived in the memory of a server that has since stopped: the state a
  killed run used to leave behind) is given back, after two looks a few seconds apart agree,
  with one log line. Without that variable (a server of the user's own), lease bookkeeping is
  the server's: docs/prefect.md says to run it with filesystem lease storage.

The lease calls are Prefect's own client methods (what its public `concurrency()` is made of):
the public one hides the lease id, which the holder note needs, and logs an ERROR line at every
timeout of its wait, every 15 s, which is not how waiting should look.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

import httpx
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.logging import get_run_logger

from eagle3.artifacts import atomic_write_text, pid_alive

GPU_LIMIT = "gpu"
SLOT_ENV = "EAGLE3_GPU_SLOT"  # the limit this machine's runs take; one per machine when several share a server
LEASES_ENV = "EAGLE3_PREFECT_LEASES"  # set by flows.local_server: where the servers eagle3 started keep their leases
LEASE_SECONDS = 60  # the server's minimum
POLL_SECONDS = 2.0  # between two asks for the slot while another run holds it
SAY_EVERY = 60.0  # seconds between two "still waiting" lines on the console
SLOT_LOG = "gpu_slot.jsonl"


class GpuLimitMissing(RuntimeError):
    """The global concurrency limit `gpu` does not exist on the Prefect server."""


def gpu_limit() -> str:
    """The name of the limit that guards this machine's GPUs: `gpu`, or $EAGLE3_GPU_SLOT. Several machines
    on one Prefect server each set their own (e.g. gpu-<hostname>), so that their runs do not wait on
    each other while the runs of one machine still take turns."""
    return os.environ.get(SLOT_ENV) or GPU_LIMIT


def ensure_gpu_limit(slots: int = 1) -> None:
    """Create this machine's global concurrency limit (`gpu_limit()`, or set it back to `slots`) on the server."""
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(gpu_limit(), slots)


def _note(run_dir: Path, event: str, block: str, **extra: object) -> None:
    path = Path(run_dir) / "logs" / SLOT_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:  # one short line per event; appends of < 4 KiB do not interleave
        handle.write(json.dumps({"event": event, "block": block, "time": time.time(), **extra}) + "\n")


def _holders() -> Path:
    """Where the runs of this machine note which lease they hold (one file per run and block)."""
    from eagle3.data.builtin_targets import default_cache_dir

    return default_cache_dir() / "gpu-slot"


def _read_notes() -> list[tuple[Path, dict]]:
    notes = []
    for path in sorted(_holders().glob("*.json")):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            notes.append((path, json.loads(path.read_text())))
    return notes


def _alive(holder: dict) -> bool:
    return holder.get("host") != socket.gethostname() or pid_alive(int(holder.get("pid", 0)))


def _describe(holder: dict) -> str:
    return f"run {holder.get('run_dir')} (pid {holder.get('pid')} on {holder.get('host')}, {holder.get('block')})"


def reclaim_dead_holders(client: SyncPrefectClient) -> int:
    """Give back the slots of runs of THIS machine whose process is gone. Returns how many notes were cleared."""
    count = 0
    for path, holder in _read_notes():
        if _alive(holder):
            continue
        logger = get_run_logger()
        if holder.get("lease_id"):
            # the server frees the slot if it still knows the lease, and ignores a lease it no longer has
            client.release_concurrency_slots_with_lease(UUID(holder["lease_id"]))
            logger.warning("gave back the '%s' slot of %s: its process is gone", gpu_limit(), _describe(holder))
        else:
            logger.warning("%s died before noting its lease: if it had taken the '%s' slot, the lease runs out within "
                           "%d s", _describe(holder), gpu_limit(), LEASE_SECONDS)
        path.unlink(missing_ok=True)
        count += 1
    return count


class OrphanCheck:
    """Finds slots of `gpu` that no lease holds (see the module docstring); needs the lease folder."""

    def __init__(self, lease_dir: str | None) -> None:
        self.lease_dir = Path(lease_dir) if lease_dir else None
        self.seen: tuple[int, object] | None = None  # (excess, limit.updated) at the previous look

    def _leased_slots(self, limit_id: UUID) -> int:
        slots = 0
        for path in self.lease_dir.glob("*.json"):
            if path.name == "expirations.json":
                continue
            with contextlib.suppress(OSError, json.JSONDecodeError, TypeError):
                lease = json.loads(path.read_text())
                if str(limit_id) in lease.get("resource_ids", []):
                    slots += int((lease.get("metadata") or {}).get("slots", 1))
        return slots

    def __call__(self, client: SyncPrefectClient) -> int:
        """Give back the slots no lease holds, once two looks agree; returns how many were given back."""
        if self.lease_dir is None:
            return 0
        limit = client.read_global_concurrency_limit_by_name(gpu_limit())
        excess = limit.active_slots - self._leased_slots(limit.id)
        seen, self.seen = self.seen, (excess, limit.updated)
        # the server counts a new slot a moment before it writes its lease: act only on a state that lasted
        if excess <= 0 or seen != (excess, limit.updated):
            return 0
        client.release_concurrency_slots([gpu_limit()], excess, occupancy_seconds=1.0)  # unknown; the API wants > 0
        get_run_logger().warning("gave back %d '%s' slot(s) that no lease holds (%d counted, leases in %s): a run's lease "
                                 "was lost with the server it ran on", excess, gpu_limit(), limit.active_slots, self.lease_dir)
        self.seen = None
        return excess


def _try_acquire(client: SyncPrefectClient) -> UUID | None:
    """The lease of one `gpu` slot, or None while the slot is taken."""
    try:
        response = client.increment_concurrency_slots_with_lease(names=[gpu_limit()], slots=1, mode="concurrency",
                                                                 lease_duration=LEASE_SECONDS)
    except httpx.HTTPStatusError as err:
        if err.response.status_code == 423:  # Locked: another run holds it
            return None
        raise
    body = response.json()
    if not body.get("limits"):
        raise GpuLimitMissing(
            f"the global concurrency limit {gpu_limit()!r} does not exist on this Prefect server; it keeps runs from "
            "sharing the GPUs: create it with `eagle3 deploy` (or `prefect gcl create gpu --limit 1`)"
        )
    return UUID(body["lease_id"])


def _waiting_line(asked: float, block: str) -> str:
    holders = [h for _, h in _read_notes() if h.get("lease_id") and _alive(h)]
    who = "; ".join(_describe(h) for h in holders) or "a run this machine has no note of (another machine, or a server-side lease)"
    return f"waiting for the '{gpu_limit()}' slot for {block} ({time.time() - asked:.0f} s): held by {who}"


def _acquire(client: SyncPrefectClient, block: str, asked: float) -> UUID:
    orphans = OrphanCheck(os.environ.get(LEASES_ENV))
    said = asked - SAY_EVERY + 5  # the first line after 5 s of waiting, then one a minute
    while True:
        reclaim_dead_holders(client)
        lease_id = _try_acquire(client)
        if lease_id is not None:
            return lease_id
        if orphans(client):
            continue
        if time.time() - said >= SAY_EVERY:
            said = time.time()
            line = _waiting_line(asked, block)
            print(line, flush=True)
            get_run_logger().info(line)
        time.sleep(POLL_SECONDS)


@contextlib.contextmanager
def gpu_slot(run_dir: Path, block: str) -> Iterator[None]:
    """Hold the `gpu` slot for `block` (waits while another run holds it); logged to logs/gpu_slot.jsonl."""
    from prefect.concurrency._leases import maintain_concurrency_lease

    logger = get_run_logger()
    logger.info("waiting for the '%s' concurrency slot (%s)", gpu_limit(), block)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "run_dir": str(run_dir), "block": block, "lease_id": None}
    note = _holders() / f"{os.getpid()}-{block}-{uuid.uuid4().hex[:8]}.json"
    note.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(note, json.dumps(holder))  # before asking: a run killed right after taking the slot is still known
    asked = time.time()
    try:
        with get_client(sync_client=True) as client:
            lease_id = _acquire(client, block, asked)
            atomic_write_text(note, json.dumps(holder | {"lease_id": str(lease_id)}))
            logger.info("holding the '%s' slot for %s (waited %.1f s)", gpu_limit(), block, time.time() - asked)
            _note(run_dir, "acquired", block, waited=round(time.time() - asked, 3))
            try:
                with maintain_concurrency_lease(lease_id, LEASE_SECONDS, raise_on_lease_renewal_failure=False):
                    yield
            finally:
                _note(run_dir, "released", block)
                try:
                    client.release_concurrency_slots_with_lease(lease_id)
                except httpx.HTTPError as err:  # the server is gone: the lease runs out, or the next run gives it back
                    logger.warning("could not give the '%s' slot back (%s); its lease runs out within %d s",
                                   gpu_limit(), err, LEASE_SECONDS)
    finally:
        note.unlink(missing_ok=True)

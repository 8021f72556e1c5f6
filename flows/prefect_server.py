"""The Prefect servers eagle3 starts run Prefect's own code with one fix from a later Prefect.

eagle3 pins prefect 3.7.7: Prefect 3.7.8 and later require fastapi >= 0.139, and vLLM 0.32/0.33
require fastapi < 0.137. Prefect 3.7's server on SQLite (the default database of `prefect server
start`) can deadlock for good when an automation is created, updated or deleted
(PrefectHQ/prefect#23055, fixed in Prefect 3.8): the SQLite branch of
`prefect.server.events.models.automations._notify` refreshes the server's automation cache inside
`session.commit()` by running `automation_changed()` to completion on another thread's loop while
the server's own event loop waits; `automation_changed()` takes the triggers service's asyncio
lock, which the service's periodic reconciliation (every 5 s) holds across a database read on the
server's loop. When the two meet, the loop waits on a coroutine that waits on the loop: the
request never answers, nor does /api/health or anything after it. `eagle3 deploy` creates the
zombie automation (flows.deploy.ensure_zombie_automation); on 2026-12-03 that hung a CI run's
server for the rest of the suite.

`apply_fixes()` puts Prefect 3.8's version of the listener in place (schedule the refresh as a
task on the running loop instead of blocking it). It is applied by every server eagle3 starts:

    python -m flows.prefect_server server start --host 127.0.0.1 --port 4200   # `eagle3 serve`'s
    uvicorn --factory flows.prefect_server:create_app ...                      # the temporary server

A server eagle3 does not start (yours, on SQLite, with Prefect 3.7) stays exposed;
ensure_zombie_automation then fails with one clear error instead of waiting forever
(docs/troubleshooting.md). On Prefect 3.8 and later `apply_fixes()` changes nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any


def _needs_fix() -> bool:
    from importlib.metadata import version

    major, minor = (int(p) for p in version("prefect").split(".")[:2])
    return (major, minor) < (3, 8)


def apply_fixes() -> bool:
    """Install the fixed listener into Prefect's automations model; True if it was installed."""
    if not _needs_fix():
        return False
    import sqlalchemy as sa
    from prefect.server.events.models import automations
    from prefect.server.utilities.database import get_dialect
    from prefect.utilities.asyncutils import create_task, run_coro_as_sync

    if getattr(automations._notify, "eagle3_fixed", False):
        return True
    original = automations._notify

    async def _notify(session, automation, event: str) -> None:
        if get_dialect(session.sync_session).name == "postgresql":  # unaffected: NOTIFY inside the transaction
            return await original(session, automation, event)
        from prefect.server.events.triggers import automation_changed

        event_key = {"created": "automation__created", "updated": "automation__updated",
                     "deleted": "automation__deleted"}.get(event)
        if event_key is None:
            return await original(session, automation, event)  # Prefect logs the unknown event

        @sa.event.listens_for(session.sync_session, "after_commit", once=True)
        def update_cache_after_commit(_session) -> None:
            async def update() -> None:
                try:
                    await automation_changed(automation.id, event_key)
                except Exception:  # noqa: BLE001 - as Prefect 3.8: a stale cache is reconciled within 5 s
                    automations.logger.error("Failed to update in-memory cache for automation %s, event: %s",
                                             automation.id, event, exc_info=True)

            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop on this thread: nothing to deadlock
                run_coro_as_sync(update())
            else:
                create_task(update())

    _notify.eagle3_fixed = True
    automations._notify = _notify
    return True


def create_app(*args: Any, **kwargs: Any):
    """uvicorn --factory entry point: Prefect's create_app with the fixes applied first."""
    apply_fixes()
    from prefect.server.api.server import create_app as prefect_create_app

    return prefect_create_app(*args, **kwargs)


def main() -> None:
    """`python -m flows.prefect_server <prefect CLI arguments>`: Prefect's CLI, in this process, after the fixes."""
    apply_fixes()
    from prefect.cli import app

    app()


if __name__ == "__main__":
    main()

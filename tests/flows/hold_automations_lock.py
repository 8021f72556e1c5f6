"""A real Prefect 3.7 API server (Prefect's create_app under uvicorn, SQLite in a fresh PREFECT_HOME)
whose event loop holds the triggers service's automations lock, as the service's 5-second
reconciliation holds it across a database read, for `--hold` seconds.

    python tests/flows/hold_automations_lock.py --port P --home DIR [--fixed] [--hold S]

Prints `holding <url>` once the lock is held, then `released` when it lets go. With Prefect's own
create_app, creating an automation in that window deadlocks the server (PrefectHQ/prefect#23055):
`released` is never printed and nothing answers again. With `--fixed` it serves
flows.prefect_server.create_app, the factory of the servers eagle3 starts.
Background services are off so that this script is the lock's only other holder."""

from __future__ import annotations

import argparse
import asyncio
import os

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--home", required=True)
parser.add_argument("--fixed", action="store_true")
parser.add_argument("--hold", type=float, default=3600)
args = parser.parse_args()

os.environ |= {"PREFECT_HOME": args.home, "PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PREFECT_LOGGING_LEVEL": "ERROR"}
os.environ.pop("PREFECT_API_URL", None)

import uvicorn  # noqa: E402

if args.fixed:
    from flows.prefect_server import create_app  # noqa: E402
else:
    from prefect.server.api.server import create_app  # noqa: E402
from prefect.server.events import triggers  # noqa: E402


async def main() -> None:
    server = uvicorn.Server(uvicorn.Config(create_app(webserver_only=True), host="127.0.0.1", port=args.port,
                                           log_level="error", lifespan="on"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.1)
    lock = triggers._automations_lock()
    await lock.acquire()
    print(f"holding http://127.0.0.1:{args.port}/api", flush=True)
    await asyncio.sleep(args.hold)  # with the bug, a created automation blocks this loop: this sleep never ends
    lock.release()
    print("released", flush=True)
    await serving


asyncio.run(main())

"""Take the README's screenshots of the Prefect UI with headless Chromium (Debian's `chromium`).

    python docs/screenshots.py --ui http://127.0.0.1:4200 --flow-run <id> [--out docs]

Needs a server started by `eagle3 serve` and a finished train-eagle3 run (its id). Writes
docs/ui-run-form.png (the deployment's run form) and docs/ui-run-artifacts.png (the run's
report artifact). Chromium is driven over its DevTools protocol: each page is loaded, given
time to fetch its data, and captured at full height.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import websockets

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


class Page:
    def __init__(self, ws) -> None:  # noqa: ANN001 - a websockets connection
        self.ws = ws
        self.next_id = 0

    async def call(self, method: str, **params: object) -> dict:
        self.next_id += 1
        await self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(await self.ws.recv())
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    async def js(self, expression: str) -> object:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result.get("result", {}).get("value")

    async def shot(self, url: str, out: Path, *, width: int, settle: float, max_height: int = 6000) -> None:
        await self.call("Emulation.setDeviceMetricsOverride", width=width, height=900, deviceScaleFactor=1, mobile=False)
        await self.call("Page.navigate", url=url)
        await asyncio.sleep(settle)
        height = int(await self.js("Math.max(document.body.scrollHeight, ...[...document.querySelectorAll('*')]"
                                   ".map(e => e.scrollHeight))") or 900)
        await self.call("Emulation.setDeviceMetricsOverride", width=width, height=min(height, max_height), deviceScaleFactor=1, mobile=False)
        await asyncio.sleep(1.5)
        data = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        out.write_bytes(base64.b64decode(data["data"]))
        print(f"{out}: {out.stat().st_size} bytes")


async def _main(args: argparse.Namespace) -> None:
    profile = tempfile.mkdtemp(prefix="eagle3-chromium-")
    browser = subprocess.Popen([args.chromium, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=9333", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                targets = json.load(urllib.request.urlopen("http://127.0.0.1:9333/json"))
                break
            except OSError:
                time.sleep(0.2)
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        async with websockets.connect(ws_url, max_size=2**28) as ws:
            page = Page(ws)
            await page.call("Page.enable")
            api = f"{args.ui}/api"
            deployment = json.load(urllib.request.urlopen(f"{api}/deployments/name/train-eagle3/train-eagle3"))
            artifacts = json.loads(urllib.request.urlopen(urllib.request.Request(
                f"{api}/artifacts/filter", method="POST", headers={"Content-Type": "application/json"},
                data=json.dumps({"artifacts": {"flow_run_id": {"any_": [args.flow_run]}, "key": {"any_": ["eagle3-run-summary"]}}}).encode(),
            )).read())
            await page.shot(f"{args.ui}/deployments/deployment/{deployment['id']}/run", args.out / "ui-run-form.png",
                            width=1400, settle=args.settle, max_height=2400)
            await page.shot(f"{args.ui}/artifacts/artifact/{artifacts[0]['id']}", args.out / "ui-run-artifacts.png",
                            width=1400, settle=args.settle)
    finally:
        browser.terminate()
        browser.wait(timeout=20)
        shutil.rmtree(profile, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ui", default="http://127.0.0.1:4200", help="the Prefect UI (eagle3 serve prints it)")
    parser.add_argument("--flow-run", required=True, help="id of a finished train-eagle3 flow run")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds a page gets to load its data")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()

"""Progress of long stages (regenerate, extract, train, evaluate): a Prefect progress artifact, a line
in the run log, and on the console either a bar redrawn in place (a terminal) or, without one
(`make demo > demo.log`, a worker's stdout), a few plain lines: one at each quarter done, at most
every PLAIN_EVERY_S seconds, one every PLAIN_HEARTBEAT_S seconds when a stage is slow, and one
when the stage is done. That bounds what a stage adds to a log file by its length in hours, not
in steps: the demo prints about 40 lines in all, however slow the machine (the run log keeps
a line per percent).

The callback is (done, total, tokens=None, detail=""): `tokens` counts what was processed so far
(the rate is then tokens/s, else <unit>/s), `detail` is shown as is (train: the loss). Rate and
ETA count from the first report, which the library makes when the real work starts (after the
engine is loaded), so a model load does not spoil them.
"""

from __future__ import annotations

import time
from typing import Protocol

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger

from tasks import console

BAR_WIDTH = 24
PLAIN_EVERY_S = 30.0  # no terminal: at most one line per stage this often, at a new quarter done, ...
PLAIN_HEARTBEAT_S = 600.0  # ... or after this long without a line; plus the last one
REDRAW_EVERY_S = 0.2  # a terminal: redraw at most this often
ETA_AFTER_FRACTION = 0.05  # an ETA is shown once this share of the work is done


class Reporter(Protocol):
    def __call__(self, done: int, total: int, tokens: int | None = None, detail: str = "") -> None: ...


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


def describe(stage: str, unit: str, done: int, total: int, rate: float | None, per: str, detail: str = "",
             eta: float | None = None) -> str:
    """`extract  [#####.....] 4/10 shards  1,234 tokens/s  ETA 0:12  loss 3.2` (pure: tested)."""
    filled = int(BAR_WIDTH * done / max(total, 1))
    parts = [f"{stage:<13} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total} {unit}"]
    if rate is not None:
        parts.append(f"{rate:,.1f} {per}/s" if rate < 100 else f"{rate:,.0f} {per}/s")
    if eta is not None and done < total:
        parts.append(f"ETA {_duration(eta)}")
    if detail:
        parts.append(detail)
    return "  ".join(parts)


def progress_reporter(stage: str, unit: str) -> Reporter:
    """A callback that reports `stage`'s progress (see the module docstring)."""
    logger = get_run_logger()
    terminal = console.is_terminal(2)
    state: dict[str, object] = {"percent": -1, "drawn": 0.0, "quarter": 0}

    def report(done: int, total: int, tokens: int | None = None, detail: str = "") -> None:
        if state.get("finished") == (done, total):
            return  # the last state is shown once
        now = time.monotonic()
        if "start" not in state:  # rates count from here
            state["start"] = (now, done, tokens or 0)
            state["printed"] = now
        started, done0, tokens0 = state["start"]  # type: ignore[misc]
        elapsed = now - started
        rate = eta = None
        if elapsed > 0 and done > done0:
            items_per_s = (done - done0) / elapsed
            if done - done0 >= ETA_AFTER_FRACTION * total:  # before that it is a guess (regenerate's answers
                eta = (total - done) / items_per_s  # come in together at the end of a batch: 1/320 said 70 hours)
            rate = (tokens - tokens0) / elapsed if tokens is not None else items_per_s
        per = "tokens" if tokens is not None else unit
        text = describe(stage, unit, done, total, rate, per, detail, eta)
        finished = done >= total
        if finished:
            state["finished"] = (done, total)
        percent = int(100 * done / max(total, 1))
        if percent != state["percent"] or finished:  # the artifact and the run log: at most once per percent
            state["percent"] = percent
            if "id" not in state:
                state["id"] = create_progress_artifact(progress=float(percent), description=f"{stage}: {unit} done")
            else:
                update_progress_artifact(artifact_id=state["id"], progress=float(percent))
            logger.info("%s", text)
        if terminal:
            if finished or now - float(state["drawn"]) >= REDRAW_EVERY_S:
                console.draw_bar(text, final=finished)
                state["drawn"] = now
        else:
            quarter, waited = 4 * done // max(total, 1), now - float(state["printed"])
            if finished or (waited >= PLAIN_EVERY_S and quarter > int(state["quarter"])) or waited >= PLAIN_HEARTBEAT_S:
                console.say(text, fd=2)
                state["printed"], state["quarter"] = now, quarter

    return report

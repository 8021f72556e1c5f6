"""Progress of long stages: a Prefect progress artifact, a line in the run log, and a bar on the
terminal when there is one (the `eagle3` CLI in a shell; never in a worker's log)."""

from __future__ import annotations

from collections.abc import Callable

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger

from tasks.output import terminal

BAR_WIDTH = 30


def progress_reporter(stage: str, unit: str) -> Callable[[int, int], None]:
    """A callback (done, total) that updates one progress artifact for `stage`."""
    state: dict[str, object] = {}
    logger = get_run_logger()
    bar = terminal()

    def report(done: int, total: int) -> None:
        percent = 100.0 * done / max(total, 1)
        if int(percent) == state.get("last") and done != total:
            return  # at most one update per percent
        state["last"] = int(percent)
        if "id" not in state:
            state["id"] = create_progress_artifact(progress=percent, description=f"{stage}: {unit} done")
        else:
            update_progress_artifact(artifact_id=state["id"], progress=percent)
        logger.info("%s: %d/%d %s (%.0f%%)", stage, done, total, unit, percent)
        if bar is not None and not bar.closed:
            filled = int(BAR_WIDTH * done / max(total, 1))
            bar.write(f"\r{stage:<13} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total} {unit}")
            if done >= total:
                bar.write("\n")
                bar.close()

    return report

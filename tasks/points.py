"""A sweep's grid point on a worker (`eagle3 sweep --on-workers`): the point's train -> export -> evaluate
chain as a flow run of the train-eagle3 deployment on the `gpu` work pool.

The point's run gets the point's whole configuration: its upstream stages (stage_target on its own
machine, then regenerate, prepare_data, extract, vocab) come back Cached from the bucket the sweep
filled, and its chain runs on that worker, holding that machine's `gpu` slot. Once it completes, the
parent brings the chain's three artifacts down by fingerprint (the same ones it computes itself from
the upstream records) and records the point. Retries and the idempotency key are the extract parts'
(tasks.parts.run_and_wait): a point whose worker died is started again, and a sweep started again
after Ctrl-C waits for the point runs the first one started.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from eagle3.artifacts import StageRecord, building, mark_complete, read_complete
from eagle3.fingerprint import fingerprint
from eagle3.stages import out_dir
from eagle3.storage import open_root
from tasks.parts import PART_RETRIES, PartFailed, run_and_wait

POINT_DEPLOYMENT = "train-eagle3/train-eagle3"
CHAIN = ("train", "export", "evaluate")
POINT_VERSION = "1"
# a backstop only: a point whose worker dies is set Crashed by the server's zombie automation within minutes
POINT_TIMEOUT_S = 7 * 86400.0


def point_fingerprint(chain_fps: dict[str, str]) -> str:
    """A point is its chain: the fingerprint of its evaluate artifact (which names the export, the training and
    everything upstream)."""
    return fingerprint("point", POINT_VERSION, {}, chain_fps["evaluate"])


@task(name="point", retries=PART_RETRIES, retry_delay_seconds=2)
def run_point(index: int, parameters: dict, chain_fps: dict[str, str], timeout_s: float, artifact_url: str | None,
              root: Path, fp: str) -> StageRecord:
    """`chain_fps`: the fingerprints of the point's train, export and evaluate artifacts."""
    flow_run = run_and_wait(POINT_DEPLOYMENT, parameters, timeout_s, f"point {index}", f"eagle3-point-{fp}")
    remote = open_root(artifact_url, root, check=False)
    for stage in CHAIN:
        if remote is not None:
            remote.pull(stage, chain_fps[stage])
        if read_complete(out_dir(root, stage, chain_fps[stage])) is None:
            raise PartFailed(f"point {index}: flow run {flow_run.name!r} completed, but its artifact "
                             f"{stage}/{chain_fps[stage]} is not whole under {artifact_url or root}: do the workers use "
                             "the same artifact_root and the same version of eagle3 as this sweep?")
    final = out_dir(root, "point", fp)
    with building(final) as tmp:
        (tmp / "flow_run.txt").write_text(f"{flow_run.name} {flow_run.id}\n")
        record = mark_complete(tmp, StageRecord(stage="point", uri=str(final), fingerprint=fp,
                                                stats={**chain_fps, "flow_run": flow_run.name}))
    return record

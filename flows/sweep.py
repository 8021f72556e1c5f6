"""The sweep-eagle3 flow: one extraction, then one train -> export -> evaluate chain per grid point.

gpu_cleanup -> stage_target -> regenerate -> prepare_data -> extract -> gpu_cleanup   (once)
-> vocab (once, or once per distinct vocab setting when a grid key is under vocab.)
-> point 1: train[1] -> export[1] -> evaluate[1]
-> point 2: train[2] -> export[2] -> evaluate[2] ...

The upstream block and each chain are train_eagle3's own (flows.train_eagle3.target_stages and
draft_chain): the same tasks, fingerprints and cache, so a point whose settings equal an earlier
run's comes back Cached, a killed sweep resumes at the point it was in, and a rerun is all Cached.
The points run one after another, each holding the `gpu` slot from train to evaluate (as a single
run does). With `on_workers` (eagle3 sweep --on-workers) they run side by side instead, each a flow
run of the train-eagle3 deployment on the `gpu` work pool (tasks.points): its upstream stages come
back Cached from the bucket this flow filled, its chain runs on whichever worker takes it, and this
flow brings the three artifacts down by fingerprint once it completes.

A point that fails does not stop the others; the flow fails at the end, naming the first failure.
The report (eagle3.ops.sweep) goes to <run_dir>/sweep.md, its plot next to it, and a markdown
artifact; summary.json names the best point's export (`best_export_dir`, `best_settings`).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from eagle3 import draft_stages
from eagle3.artifacts import StageRecord, read_complete
from eagle3.engine import pool as engine_pool
from eagle3.config import PipelineConfig
from eagle3.ops.summary import StageRow, loads_since, write_summary
from eagle3.ops.sweep import (
    GridAxis, PointResult, SweepPoint, SweepSummary, acceptance_figures, expand_points, ranked,
    sweep_markdown, write_report,
)
from flows.report import plots_section
from flows.runner import StageFailed, StageRunner, open_runner
from flows.train_eagle3 import Chain, draft_chain, target_stages
from tasks import console
from tasks import draft as draft_tasks
from tasks import points as point_tasks
from tasks.parts import check_part_deployment

__all__ = ["sweep_eagle3"]


def _vocabs(run: StageRunner, points: list[SweepPoint], prepared: StageRecord, target: StageRecord) -> list[StageRecord]:
    """The vocab record of each point: the stage runs once per distinct vocab setting."""
    by_fp: dict[str, StageRecord] = {}
    several = len({draft_stages.fingerprint_vocab(p.config.vocab, prepared) for p in points}) > 1
    out = []
    for point in points:
        fp = draft_stages.fingerprint_vocab(point.config.vocab, prepared)
        if fp not in by_fp:
            by_fp[fp] = run.stage("vocab", draft_tasks.vocab, fp, label=f"vocab[{point.index}]" if several else "vocab",
                                  config=point.config.vocab, prepared=prepared, target=target)
        out.append(by_fp[fp])
    return out


def _result(point: SweepPoint, chain: Chain, state: str) -> PointResult:
    figures = acceptance_figures(chain.evaluated.path) if chain.evaluated is not None else {}
    stats = chain.trained.stats if chain.trained is not None else {}
    return PointResult(index=point.index, settings=point.settings, state=state, **figures,
                       train_seconds=stats.get("seconds"), tokens=stats.get("tokens_seen"),
                       export_dir=chain.exported.uri if chain.exported is not None else None,
                       evaluation=chain.evaluated.uri if chain.evaluated is not None else None)


def _chain_state(rows: list[StageRow]) -> str:
    return "Cached" if rows and all(r.state == "Cached" for r in rows) else "Completed"


@flow(name="sweep-eagle3", log_prints=False)
def sweep_eagle3(config: PipelineConfig, grid: list[GridAxis], on_workers: bool = False) -> SweepSummary:
    """`config`: the settings every point shares; `grid`: the swept settings (eagle3.ops.sweep); `on_workers`:
    run the points side by side as flow runs of the train-eagle3 deployment (the artifact root must be a URL or
    a folder every worker mounts)."""
    points = expand_points(config, grid)  # validated before any work (the CLI did it already)
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    load_log = run_dir / "logs" / "target_loads.jsonl"
    run = open_runner(config.artifact_url, config.artifacts, run_dir)
    outcome: dict[str, object] = {}
    cleanups: list[dict] = []
    results: dict[int, PointResult] = {p.index: PointResult(index=p.index, settings=p.settings, state="not run")
                                       for p in points}
    failures: list[StageFailed] = []
    started = time.time()
    try:
        if on_workers:
            check_part_deployment(point_tasks.POINT_DEPLOYMENT, what="eagle3 sweep --on-workers runs each point",
                                  setting="the train-eagle3 deployment", instead="leave out --on-workers")
        target, prepared, extracted = target_stages(run, config, load_log, cleanups, outcome,
                                                    also_check=[p.config for p in points])
        vocabs = _vocabs(run, points, prepared, target)
        run_points = _points_on_workers if on_workers else _points_in_turn
        run_points(run, config, points, vocabs, target, extracted, results, failures)
        if failures:
            raise failures[0]
    finally:
        engine_pool.release_all(keep_warm=True)  # a failed run leaves its warm engine up for target.keep_warm_s
        summary = _finish(config, grid, list(results.values()), run, cleanups, outcome, loads_since(load_log, started))
    return summary


def _points_in_turn(run: StageRunner, config: PipelineConfig, points: list[SweepPoint], vocabs: list[StageRecord],
                    target: StageRecord, extracted: StageRecord, results: dict[int, PointResult],
                    failures: list[StageFailed]) -> None:
    """Every point's chain in this flow run, one after another; `results` and `failures` filled in."""
    for point, vocab in zip(points, vocabs):
        console.say(f"point {point.index}/{len(points)}: {point.label()}")
        chain, first_row = Chain(), len(run.rows)
        try:
            draft_chain(run, point.config, target, extracted, vocab, chain, tag=f"[{point.index}]")
        except StageFailed as err:
            failures.append(err)
            results[point.index] = _result(point, chain, "Failed")
            continue
        results[point.index] = _result(point, chain, _chain_state(run.rows[first_row:]))


def _points_on_workers(run: StageRunner, config: PipelineConfig, points: list[SweepPoint], vocabs: list[StageRecord],
                       target: StageRecord, extracted: StageRecord, results: dict[int, PointResult],
                       failures: list[StageFailed]) -> None:
    """Every point's chain as a flow run on the gpu pool, side by side; `results` and `failures` filled in."""
    calls, fps = [], []
    for point, vocab in zip(points, vocabs):
        chain_fps = draft_stages.chain_fingerprints(point.config.train, point.config.eval, target, extracted, vocab)
        point_config = point.config.model_copy(update={"run_dir": f"{config.run_dir}/point-{point.index}"})
        fp = point_tasks.point_fingerprint(chain_fps)
        fps.append(chain_fps)
        calls.append((fp, f"point[{point.index}]", {
            "index": point.index, "parameters": {"config": point_config}, "chain_fps": chain_fps,
            "timeout_s": point_tasks.POINT_TIMEOUT_S, "artifact_url": config.artifact_url}))
    console.say(f"{len(points)} points side by side on the gpu work pool ({point_tasks.POINT_DEPLOYMENT})")
    first_row = len(run.rows)
    outcomes = run.concurrent_outcomes("point", point_tasks.run_point, calls)
    for point, chain_fps, done, row in zip(points, fps, outcomes, run.rows[first_row:]):
        if isinstance(done, StageFailed):
            failures.append(done)
            results[point.index] = _result(point, Chain(), "Failed")
            continue
        chain = Chain(*(run.localized(stage, read_complete(run.root / stage / chain_fps[stage]))  # type: ignore[arg-type]
                        for stage in point_tasks.CHAIN))
        results[point.index] = _result(point, chain, _chain_state([row]))


def _finish(config: PipelineConfig, grid: list[GridAxis], results: list[PointResult], run: StageRunner,
            cleanups: list[dict], outcome: dict[str, object], loads: list[dict]) -> SweepSummary:
    """sweep.md + plot, summary.json (the best point's figures and export), the markdown artifact."""
    run_dir = Path(config.run_dir)
    keys = [axis.key for axis in grid]
    shared = f"target `{config.target.model}`; artifacts `{config.artifacts}`"
    report, plot = write_report(results, keys, shared, run_dir)
    best = next((r for r in ranked(results) if r.export_dir and r.simulated is not None), None)
    summary = SweepSummary(
        stages=list(run.rows), gpu_cleanup=cleanups, target_loads=loads, data=outcome.get("data", {}),
        points=ranked(results), report=str(report),
        acceptance_length=best.simulated if best else None, export_dir=best.export_dir if best else None,
        evaluation=best.evaluation if best else None, best_export_dir=best.export_dir if best else None,
        best_settings=best.settings if best else {},
    )
    write_summary(run_dir / "summary.json", summary)
    # the plot inline in the artifact (the UI reads no files), by name in sweep.md
    markdown = sweep_markdown(results, keys, shared, None) + "\n" + plots_section([plot] if plot else [])
    create_markdown_artifact(key="eagle3-sweep", markdown=markdown,
                             description="sweep: one row per grid point, best first; acceptance against each setting")
    return summary

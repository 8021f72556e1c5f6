"""The nightly-eagle3 flow: retrain on the traffic that arrived, promote only a draft that is not worse.

gpu_cleanup -> stage_target -> per dated file: regenerate -> prepare_data -> extract
-> gpu_cleanup -> assemble -> vocab (the served draft's, on a warm start) -> train (from the
served draft's weights) -> export -> evaluate (candidate) -> evaluate (served draft, same
held-out set) -> publish (the gate)

Files that were there last night come back Cached at every stage: only the new ones are
regenerated and extracted. The gate (eagle3.ops.publish) compares both drafts on the same
held-out set, pooled and per data source (the rows' "source" field); a refused candidate
ends the run Completed, with a "Not promoted" artifact, and the registry untouched.
<run_dir>/nightly.json records files, shards extracted per file in this run, and the gate's
decision (with each data source's two figures when it compared sources).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from eagle3 import draft_stages, stages
from eagle3.artifacts import StageRecord, atomic_write_text
from eagle3.capture import vllm_adapter
from eagle3.engine import pool as engine_pool
from eagle3.config import PipelineConfig, check_against_target
from eagle3.data.target import TargetInfo
from eagle3.fingerprint import fingerprint
from eagle3.ops import incremental
from eagle3.ops.nightly import NightlyConfig
from eagle3.ops.publish import PublishedDraft, code_version, fetch_draft, read_current, source_figures, utc_now
from eagle3.ops.summary import RunSummary, loads_since, write_summary
from flows.report import run_report
from flows.runner import StageRunner, enter_work_dir, open_runner
from tasks import draft as draft_tasks
from tasks import nightly as nightly_tasks
from tasks import stages as data_tasks
from tasks.gpu import gpu_cleanup
from tasks.gpu_slot import gpu_slot

Part = tuple[str, StageRecord, StageRecord]  # (file label, prepared, extracted)
WARM_START_VERSION = "1"  # of the warm-start train and parent-vocab fingerprints


def _part(run: StageRunner, p: PipelineConfig, file: incremental.IncomingFile, target: StageRecord,
          load_log: Path) -> tuple[Part, dict]:
    """regenerate -> prepare_data -> extract for one dated file; returns the part and what extract did."""
    label = Path(file.name).stem
    data = p.data.model_copy(update={"source": str(incremental.local_copy(file, p.artifacts / "incoming"))})
    regen = run.stage("regenerate", data_tasks.regenerate,
                      stages.fingerprint_regenerate(p.regenerate, data, target, p.target.max_model_len),
                      label=f"regenerate {label}", config=p.regenerate, data_config=data, target_config=p.target,
                      target=target, load_log=load_log)
    prepared = run.stage("prepare_data", data_tasks.prepare_data, stages.fingerprint_prepare(data, regen, target),
                         label=f"prepare_data {label}", config=data, regenerated=regen, target=target,
                         trust_remote_code=p.target.trust_remote_code)
    extracted = run.stage("extract", data_tasks.extract, stages.fingerprint_extract(p.extract, p.target, prepared, target),
                          label=f"extract {label}", config=p.extract, target_config=p.target, prepared=prepared,
                          target=target, load_log=load_log)
    state = run.rows[-1].state

    def count(key: str) -> int:
        return sum(int(extracted.stats.get(f"{split}_{key}", 0)) for split in ("train", "heldout"))

    # A Cached stage computed nothing in this run (its stats are those of the run that built it).
    info = {"file": file.name, "extract": state, "shards_extracted": 0 if state == "Cached" else count("shards_written"),
            "samples": count("samples")}
    return (label, prepared, extracted), info


def _evaluate(run: StageRunner, p: PipelineConfig, label: str, target: StageRecord, exported: StageRecord,
              assembled: StageRecord) -> StageRecord:
    fp = draft_stages.fingerprint_evaluate(p.eval, exported, assembled)
    return run.stage("evaluate", draft_tasks.evaluate, fp, label=label, config=p.eval, target=target, exported=exported,
                     extracted=assembled, serving=draft_stages.serving_setup(p.target, p.builtin_cache))


def _train(run: StageRunner, p: PipelineConfig, target: StageRecord, assembled: StageRecord, vocab: StageRecord,
           parent: Path | None, served: PublishedDraft | None) -> StageRecord:
    fp = draft_stages.fingerprint_train(p.train, assembled, vocab, target)
    if parent is None or served is None:
        return run.stage("train", draft_tasks.train, fp, config=p.train, target=target, extracted=assembled, vocab=vocab)
    return run.stage("train", nightly_tasks.warm_train, fingerprint("train-warm-start", WARM_START_VERSION, {}, fp, served.export_fingerprint),
                     label="train (warm)", config=p.train, target=target, extracted=assembled, vocab=vocab, init_from=parent)


def _vocab(run: StageRunner, p: PipelineConfig, target: StageRecord, assembled: StageRecord, parent: Path | None,
           served: PublishedDraft | None) -> StageRecord:
    """The served draft's vocabulary on a warm start (its lm_head rows are tied to it), else one built from the data."""
    if parent is not None and served is not None:
        return run.stage("vocab", nightly_tasks.parent_vocab, fingerprint("parent-vocab", WARM_START_VERSION, {}, served.export_fingerprint),
                         label="vocab (in service)", draft_dir=parent, draft_id=served.draft_id)
    return run.stage("vocab", draft_tasks.vocab, draft_stages.fingerprint_vocab(p.vocab, assembled),
                     config=p.vocab, prepared=assembled, target=target)


def _report(run: StageRunner, run_dir: Path, outcome: dict, night: dict, trained: StageRecord | None) -> RunSummary:
    """summary.json, nightly.json and the report artifact, whether the run got to the end or not."""
    summary = RunSummary(stages=list(run.rows), **outcome)  # outcome holds gpu_cleanup and target_loads
    write_summary(run_dir / "summary.json", summary)
    atomic_write_text(run_dir / "nightly.json", json.dumps(night, indent=1, default=str) + "\n")
    gate = night.get("gate")
    verdict = (f"{'Promoted' if gate['promoted'] else 'Not promoted'}: {gate['reason']}" if isinstance(gate, dict)
               else "_the run ended before the gate_")
    if isinstance(gate, dict) and gate.get("sources"):
        verdict += "\n\n| data source | candidate | served |\n|---|---:|---:|\n" + "\n".join(
            f"| {name} | {v['candidate']:.3f} | {v['served']:.3f} |" for name, v in gate["sources"].items())
    report = run_report(summary, run_dir, title="nightly-eagle3", sources=[trained.path if trained else None],
                        extra=["## Gate", verdict])
    create_markdown_artifact(key="eagle3-nightly-summary", markdown=report, description="stages, acceptance, gate")
    return summary


def _candidate(exported: StageRecord, evaluated: StageRecord, assembled: StageRecord, served: PublishedDraft | None,
               warm: bool) -> PublishedDraft:
    return PublishedDraft(
        draft_id=exported.fingerprint[:16], acceptance_length=float(evaluated.stats["acceptance_length"]),
        per_position=json.loads(str(evaluated.stats.get("per_position", "[]"))), per_source=source_figures(evaluated.stats),
        heldout_samples=int(assembled.stats["heldout_samples"]), train_samples=int(assembled.stats["train_samples"]),
        train_tokens=int(assembled.stats["train_tokens"]), data_files=json.loads(str(assembled.stats["files"])),
        parent_draft=served.draft_id if served else None, warm_start=warm, export_fingerprint=exported.fingerprint,
        code_version=code_version(), created_at=utc_now(),
    )


@flow(name="nightly-eagle3", log_prints=False)
def nightly_eagle3(config: NightlyConfig) -> RunSummary:
    enter_work_dir()  # a worker's run (the schedule's): its relative run_dir under $EAGLE3_WORK_DIR, its machine's slot
    p = config.pipeline
    run_dir = Path(p.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    load_log = run_dir / "logs" / "target_loads.jsonl"
    run = open_runner(p.artifact_url, p.artifacts, run_dir)
    files = incremental.discover(config.incoming, today=config.run_date, window_days=config.window_days)
    served = read_current(config.publish.registry)
    known = set(served.data_files) if served else set()
    night: dict[str, object] = {"files": [f.name for f in files], "served_before": served.draft_id if served else None,
                                "new_files": [f.name for f in files if Path(f.name).stem not in known]}
    outcome: dict[str, object] = {"gpu_cleanup": []}
    cleanups: list[dict] = outcome["gpu_cleanup"]  # type: ignore[assignment]
    started = time.time()
    trained = None
    try:
        with gpu_slot(run_dir, "target"):
            cleanups.append(run.uncached("gpu_cleanup", gpu_cleanup, config=p.gpu, run_dir=run_dir))
            target = run.stage("stage_target", data_tasks.stage_target, stages.fingerprint_target(p.target),
                               config=p.target, cache_dir=p.builtin_cache)
            check_against_target(p, TargetInfo.read(target.path))  # in seconds, not after extraction
            done = [_part(run, p, file, target, load_log) for file in files]
            engine_pool.release_all(keep_warm=False)  # free the target's memory before training (stops our warm engine)
            cleanups.append(run.uncached("gpu_cleanup", gpu_cleanup, config=p.gpu, run_dir=run_dir))
        parts = [part for part, _ in done]
        night["parts"] = [info for _, info in done]
        assembled = run.stage("assemble", nightly_tasks.assemble, incremental.fingerprint_assemble(parts), parts=parts)
        parent = fetch_draft(served, config.publish.registry, p.artifacts) if served else None
        night["warm_start"] = warm = bool(config.warm_start and parent)
        vocab = _vocab(run, p, target, assembled, parent if warm else None, served)
        with gpu_slot(run_dir, "draft"):
            trained = _train(run, p, target, assembled, vocab, parent if warm else None, served)
            exported = run.stage("export", draft_tasks.export, draft_stages.fingerprint_export(trained),
                                 target=target, trained=trained, vocab=vocab)
            outcome["export_dir"] = exported.uri
            evaluated = _evaluate(run, p, "evaluate", target, exported, assembled)
            outcome |= {"acceptance_length": evaluated.stats["acceptance_length"], "evaluation": evaluated.uri}
            in_service, in_service_sources = None, None
            if served is not None and parent is not None:  # the served draft, on the same held-out set
                record = StageRecord(stage="export", uri=str(parent), fingerprint=served.export_fingerprint)
                stats = _evaluate(run, p, "evaluate (in service)", target, record, assembled).stats
                in_service, in_service_sources = float(stats["acceptance_length"]), source_figures(stats)
            vllm_adapter.release_all()
        night["gate"] = run.uncached("publish", nightly_tasks.publish_gate, config=config.publish,
                                     candidate=_candidate(exported, evaluated, assembled, served, warm),
                                     served_acceptance=in_service, exported=exported, vocab=vocab,
                                     served_sources=in_service_sources)
    finally:
        engine_pool.release_all(keep_warm=True)  # a failed run leaves its warm engine up for target.keep_warm_s
        outcome["target_loads"] = loads_since(load_log, started)
        summary = _report(run, run_dir, outcome, night, trained)
    return summary

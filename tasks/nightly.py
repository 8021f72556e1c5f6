"""Thin tasks of the nightly run: assemble the parts, reuse the served draft's vocabulary,
train from the served draft, and the publish gate."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from eagle3 import draft_stages
from eagle3.artifacts import StageRecord
from eagle3.train.config import TrainConfig
from eagle3.ops import incremental, publish
from eagle3.ops.publish import GateDecision, PublishConfig, PublishedDraft
from tasks.progress import progress_reporter

GATE_ARTIFACT = "eagle3-nightly-gate"


@task(name="assemble")
def assemble(parts: list[tuple[str, StageRecord, StageRecord]], root: Path, fp: str) -> StageRecord:
    return incremental.run_assemble(parts, root, fp)


@task(name="vocab")
def parent_vocab(draft_dir: Path, draft_id: str, root: Path, fp: str) -> StageRecord:
    return publish.run_parent_vocab(draft_dir, draft_id, root, fp)


@task(name="train")
def warm_train(config: TrainConfig, target: StageRecord, extracted: StageRecord, vocab: StageRecord, init_from: Path,
               root: Path, fp: str) -> StageRecord:
    report = progress_reporter("train", "steps")
    return draft_stages.run_train(config, target, extracted, vocab, root, fp,
                                  progress=lambda step, total, loss: report(step, total, detail=f"loss {loss:.3f}"),
                                  init_from=init_from)


@task(name="publish", cache_policy=NO_CACHE)
def publish_gate(config: PublishConfig, candidate: PublishedDraft, served_acceptance: float | None,
                 exported: StageRecord, vocab: StageRecord, served_sources: dict[str, float] | None = None) -> dict[str, object]:
    """Promote `candidate` when the gate lets it; either way leave a markdown artifact saying what happened.
    `served_sources`: the served draft's acceptance per data source on the candidate's held-out set."""
    decision: GateDecision = publish.decide(candidate.acceptance_length, served_acceptance, config.tolerance,
                                            candidate_sources=candidate.per_source, published_sources=served_sources,
                                            max_source_regression=config.max_source_regression)
    if decision.promote:
        served = publish.publish(exported.path, vocab.path / publish.VOCAB, candidate, config.registry)
        where = f"Served draft: `{served.path}` (id `{served.draft_id}`, parent `{served.parent_draft}`)."
    else:
        where = f"The served draft stays `{candidate.parent_draft}`; the candidate is kept at `{exported.uri}`."
    title = "Promoted" if decision.promote else "Not promoted"
    create_markdown_artifact(key=GATE_ARTIFACT, markdown=f"# Nightly gate: {title}\n\n{decision.to_markdown()}\n\n{where}",
                             description=f"nightly gate: {title.lower()}")
    get_run_logger().info("nightly gate: %s. %s", title, decision.reason)
    return {"promoted": decision.promote, "reason": decision.reason, "candidate": decision.candidate,
            "served": decision.published, "tolerance": decision.tolerance, "draft_id": candidate.draft_id,
            "sources": {name: {"candidate": c, "served": p} for name, (c, p) in decision.sources.items()},
            "max_source_regression": config.max_source_regression}

"""The run summary: what the CLI prints at the end and writes to <run_dir>/summary.json."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from eagle3.artifacts import StageRecord, atomic_write_text


class StageRow(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str = Field(description="Stage name")
    state: str = Field(description="Completed, Cached or Failed")
    seconds: float = Field(description="Wall time of the stage in this run")
    artifact: str = Field(default="", description="Artifact folder ('' when the stage has none)")


class RunSummary(BaseModel):
    model_config = ConfigDict(frozen=True)

    stages: list[StageRow] = Field(default_factory=list, description="One row per stage, in run order")
    acceptance_length: float | None = Field(default=None, description="Simulated acceptance length on held-out samples")
    export_dir: str | None = Field(default=None, description="The exported speculators-format draft")
    evaluation: str | None = Field(default=None, description="Folder of the evaluation report")
    gpu_cleanup: list[dict] = Field(
        default_factory=list, description="Each gpu_cleanup report of this run, in order: holders found, what was "
        "done to each, GPU memory before and after"
    )
    data: dict = Field(
        default_factory=dict, description="What the data stages kept and dropped: train/heldout samples, source rows "
        "skipped as unusable (skipped_rows; each with its line and reason in bad_rows_report), conversations "
        "regenerate skipped as too long, samples dropped or cut to data.max_tokens; with data.source synthesize the prompts "
        "the target wrote (synthesized_prompts) and a few of them (prompt_sample)"
    )
    target_loads: list[dict] = Field(
        default_factory=list, description="How this run got its target (logs/target_loads.jsonl), one entry each time: "
        "event 'loaded' (seconds, and the GPU memory preflight done before it; 'warm': in an engine process, 'backend': "
        "'hf' for transformers), 'attached' to a warm engine (engine_pid, loaded_at, seconds_saved) or 'endpoint' "
        "(regenerate.endpoint: no load)"
    )

    @property
    def failed(self) -> bool:
        return any(row.state == "Failed" for row in self.stages) or self.acceptance_length is None

    def to_markdown(self) -> str:
        lines = ["| stage | state | seconds | artifact |", "|---|---|---:|---|"]
        lines += [f"| {r.name} | {r.state} | {r.seconds:.1f} | `{r.artifact}` |" for r in self.stages]
        if self.acceptance_length is not None:
            lines += ["", f"**Acceptance length (simulated, held-out): {self.acceptance_length:.3f}**"]
        if self.export_dir:
            lines += [f"Exported draft: `{self.export_dir}`"]
        if self.data.get("skipped_rows"):
            lines += [f"Skipped {self.data['skipped_rows']} unusable source row(s): `{self.data.get('bad_rows_report')}`"]
        if "synthesized_prompts" in self.data:
            lines += [f"The target wrote {self.data['synthesized_prompts']} prompt(s), e.g. "
                      + "; ".join(repr(p[:80]) for p in self.data.get("prompt_sample", [])[:3])]
        for number, report in enumerate(self.gpu_cleanup, start=1):
            lines += [f"gpu_cleanup {number}: {report.get('summary', '')}"]
        return "\n".join(lines)


def write_summary(path: Path, summary: RunSummary) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(summary.model_dump(mode="json"), indent=1) + "\n")


PREPARE_STATS = ("train_samples", "heldout_samples", "dropped", "truncated", "skipped_rows", "bad_rows_report")


def data_report(regenerated: StageRecord, prepared: StageRecord, synthesized: StageRecord | None = None) -> dict:
    """summary.json's `data`: the data stages' counts (regenerate's `skipped` as `too_long_for_regenerate`); with
    data.source synthesize, the prompts the target wrote (`synthesized_prompts`) and a few of them (`prompt_sample`)."""
    report = {k: prepared.stats[k] for k in PREPARE_STATS if k in prepared.stats}
    if "skipped" in regenerated.stats:
        report["too_long_for_regenerate"] = regenerated.stats["skipped"]
    if synthesized is not None:
        report["synthesized_prompts"] = synthesized.stats["prompts"]
        report["prompt_sample"] = json.loads(str(synthesized.stats["sample"]))
    return report


def loads_since(load_log: Path, since: float) -> list[dict]:
    """Target loads recorded in `load_log` at or after `since` (a time.time() value): this run's."""
    if not Path(load_log).is_file():
        return []
    lines = (line for line in Path(load_log).read_text().splitlines() if line.strip())
    entries = [entry for entry in map(json.loads, lines) if entry.get("time", 0) >= since]
    return [{"event": "loaded"} | entry for entry in entries]  # an in-process load's line has no event: it loaded


def read_summary(path: Path) -> RunSummary:
    return RunSummary.model_validate_json(Path(path).read_text())

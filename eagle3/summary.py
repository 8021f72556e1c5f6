"""The run summary: what the CLI prints at the end and writes to <run_dir>/summary.json."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from eagle3.store import atomic_write_text


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
        return "\n".join(lines)


def write_summary(path: Path, summary: RunSummary) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(summary.model_dump(mode="json"), indent=1) + "\n")


def read_summary(path: Path) -> RunSummary:
    return RunSummary.model_validate_json(Path(path).read_text())

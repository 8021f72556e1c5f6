"""The gpu_cleanup report: what was found on the GPUs, what was done to each holder, and the
memory before and after; rendered as a plain-text table (CLI), markdown (Prefect artifact)
and JSON (run summary)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from eagle3.gpu.nvml import GpuHolder, GpuMemory

Outcome = Literal["terminated", "killed", "already-gone", "skipped-by-policy", "dry-run", "failed"]


@dataclass(frozen=True)
class ProcessAction:
    """What cleanup did (or would do, or refused to do) to one holder, and why."""

    pid: int
    command: str
    outcome: Outcome
    reason: str



def cell(text: object, width: int = 60) -> str:
    text = str(text).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= width else text[: width - 3] + "..."


def _rows(report: CleanupReport) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """(process headers, process rows, GPU headers, GPU rows) shared by both renderings."""
    holders = {h.pid: h for h in report.holders}
    proc_head = ["pid", "user", "started", "devices", "GPU MiB", "action", "command", "reason"]
    proc_rows = []
    for a in report.actions:
        h = holders[a.pid]
        proc_rows.append([
            str(a.pid), h.user, h.started_at or "?", ",".join(h.devices),
            "?" if h.gpu_memory_mib is None else str(h.gpu_memory_mib), a.outcome,
            cell(a.command), cell(a.reason, 90),
        ])
    after = {g.index: g for g in report.memory_after}
    gpu_head = ["GPU", "used before MiB", "used after MiB", "threshold MiB", "total MiB"]
    gpu_rows = [
        [str(g.index), str(g.used_mib),
         str(after[g.index].used_mib) if g.index in after else "-",
         "-" if g.threshold_mib is None else str(g.threshold_mib), str(g.total_mib)]
        for g in report.memory_before
    ]
    return proc_head, proc_rows, gpu_head, gpu_rows


@dataclass(frozen=True)
class CleanupReport:
    """What gpu_cleanup found, did, and measured."""

    mode: str
    dry_run: bool
    driver_present: bool
    driver_note: str  # why there is no driver, "" when there is one
    device_files: tuple[str, ...]
    holders: tuple[GpuHolder, ...]
    actions: tuple[ProcessAction, ...]  # one per holder, by pid
    memory_before: tuple[GpuMemory, ...]  # empty without a driver
    memory_after: tuple[GpuMemory, ...]
    memory_verified: bool  # every GPU ended under its threshold (False without a driver)
    # (GPU, MiB) held by live warm engines left alone, added to that GPU's threshold; MiB None: NVML does not
    # say, and that GPU is not verified
    warm_engine_mib: tuple[tuple[int, int | None], ...] = ()

    def summary(self) -> str:
        """One line: mode, holders, what was done, whether memory was proven free."""
        counts: dict[str, int] = {}
        for action in self.actions:
            counts[action.outcome] = counts.get(action.outcome, 0) + 1
        done = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "nothing"
        if not self.driver_present:
            memory = f"{self.driver_note}; GPU memory not checked"
        elif self.dry_run:
            memory = "dry run: GPU memory not verified"
        else:
            memory = "GPU memory under threshold" if self.memory_verified else \
                "GPU memory NOT under threshold"
        warm = "".join(f" GPU {i}: {'an unknown amount' if mib is None else f'{mib} MiB'} held by a live warm engine "
                       "(left alone, not counted)." for i, mib in self.warm_engine_mib)
        return (f"gpu cleanup (mode {self.mode}{', dry run' if self.dry_run else ''}): "
                f"{len(self.holders)} holder(s): {done}. {memory}.{warm}")

    def to_dict(self) -> dict[str, object]:
        """JSON-able, with the one-line summary."""
        return {"summary": self.summary(), **dataclasses.asdict(self)}

    def to_markdown(self) -> str:
        """Markdown (for a Prefect markdown artifact): summary, processes and GPU tables."""
        proc_head, proc_rows, gpu_head, gpu_rows = _rows(self)
        parts = [f"**{self.summary()}**"]
        for head, rows in ((proc_head, proc_rows), (gpu_head, gpu_rows)):
            if rows:
                lines = [head, ["---"] * len(head), *rows]
                parts.append("\n".join("| " + " | ".join(r) + " |" for r in lines))
        return "\n\n".join(parts) + "\n"


def format_report_table(report: CleanupReport) -> str:
    """Plain-text rendering for the CLI: summary line, then aligned tables."""
    proc_head, proc_rows, gpu_head, gpu_rows = _rows(report)
    parts = [report.summary()]
    for head, rows in ((proc_head, proc_rows), (gpu_head, gpu_rows)):
        if rows:
            widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
            parts.append("\n".join(
                "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]
            ))
    return "\n\n".join(parts) + "\n"

"""The run report: the markdown artifact a finished (or failed) run leaves in the Prefect UI.

Sections: the stage table (state, seconds, cache hit, artifact size, folder), the
acceptance table (every evaluation in the evaluate artifact's acceptance.json: length and
per-position acceptance; then, when the held-out samples name data sources, one row per source:
simulated, walk and served), and the plots: every PNG in the evaluate and train artifacts is
copied to <run_dir>/plots/ and shown inline (as a data URI, so the UI needs no file
access); a plot too large to inline is linked by path.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from eagle3.evaluate.acceptance import SourceFigures
from eagle3.ops.summary import RunSummary, StageRow

INLINE_LIMIT = 400_000  # bytes of PNG shown inline; larger ones are linked


def artifact_bytes(folder: str) -> int:
    path = Path(folder)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if folder and path.is_dir() else 0


def human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def stage_table(rows: Sequence[StageRow]) -> str:
    lines = ["| stage | state | seconds | cache hit | artifact size | artifact |", "|---|---|---:|---|---:|---|"]
    for r in rows:
        size = human_bytes(artifact_bytes(r.artifact)) if r.artifact else ""
        hit = "yes" if r.state == "Cached" else ("" if not r.artifact and r.state != "Failed" else "no")
        folder = f"`{r.artifact}`" if r.artifact else ""
        lines.append(f"| {r.name} | {r.state} | {r.seconds:.1f} | {hit} | {size} | {folder} |")
    return "\n".join(lines)


def acceptance_table(evaluation: Path | None) -> str:
    """One row per evaluation found in acceptance.json (simulated, served, ...)."""
    path = Path(evaluation) / "acceptance.json" if evaluation else None
    if path is None or not path.is_file():
        return "_no evaluation in this run_"
    payload = json.loads(path.read_text())
    rows = [(name, block) for name, block in payload.items() if isinstance(block, dict) and "acceptance_length" in block]
    width = max((len(block.get("per_position") or []) for _, block in rows), default=0)
    lines = ["| evaluation | acceptance length | drafts | " + " | ".join(f"pos {j + 1}" for j in range(width)) + " |",
             "|---|---:|---:|" + "---:|" * width]
    for name, block in rows:
        per = [f"{p:.3f}" for p in block.get("per_position") or []] + [""] * width
        drafts = block.get("num_drafts", "")
        lines.append(f"| {name} | {block['acceptance_length']:.3f} | {drafts} | " + " | ".join(per[:width]) + " |")
    per_source = SourceFigures.markdown(SourceFigures.from_payload(payload))
    return "\n".join(lines) + _served_lines(payload.get("served")) + (
        f"\n\nPer data source (acceptance length):\n\n{per_source}" if per_source else "")


def _served_lines(served: dict | None) -> str:
    """Under the table: the served run's mean per request beside the pooled figure, and its speedup."""
    if not isinstance(served, dict):
        return ""
    notes = []
    if served.get("request_mean_acceptance_length") is not None:
        notes.append(f"served acceptance pooled over requests (vLLM's metrics) {served['acceptance_length']:.3f}, "
                     f"mean per request {served['request_mean_acceptance_length']:.3f}")
    if served.get("speedup") is not None:
        with_draft, without = served["tokens_per_second"]
        slower = " (the draft makes serving slower on this machine: see acceptance.md)" if served["speedup"] < 1 else ""
        notes.append(f"speedup {served['speedup']:.2f}x: {with_draft:.1f} tokens/s with the draft, {without:.1f} "
                     f"without{slower}")
    return "".join(f"\n\n{note[0].upper()}{note[1:]}." for note in notes)


def collect_plots(sources: Sequence[Path | None], run_dir: Path) -> list[Path]:
    """Copy every PNG of `sources` into <run_dir>/plots/; returns the copies."""
    out: list[Path] = []
    for folder in sources:
        if folder is None or not Path(folder).is_dir():
            continue
        for png in sorted(Path(folder).rglob("*.png")):
            target = Path(run_dir) / "plots" / png.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, target)
            out.append(target)
    return out


def plots_section(plots: Sequence[Path]) -> str:
    if not plots:
        return "_no plots in the train or evaluate artifacts_"
    parts = []
    for png in plots:
        if png.stat().st_size <= INLINE_LIMIT:
            data = base64.b64encode(png.read_bytes()).decode("ascii")
            parts.append(f"**{png.stem}**\n\n![{png.stem}](data:image/png;base64,{data})")
        else:
            parts.append(f"**{png.stem}**: `{png}` ({human_bytes(png.stat().st_size)}, too large to show inline)")
    return "\n\n".join(parts)


def run_report(summary: RunSummary, run_dir: Path, *, title: str, sources: Sequence[Path | None] = (),
               extra: Sequence[str] = ()) -> str:
    """The whole markdown report; `sources` are artifact folders searched for plots."""
    evaluation = Path(summary.evaluation) if summary.evaluation else None
    state = "failed" if summary.failed else "completed"
    head = [f"# {title}: {state}", f"Run folder: `{Path(run_dir).resolve()}`"]
    if summary.export_dir:
        head.append(f"Exported draft: `{summary.export_dir}`")
    sections = ["## Stages", stage_table(summary.stages), "## Acceptance", acceptance_table(evaluation), *extra,
                "## Plots", plots_section(collect_plots([evaluation, *sources], run_dir))]
    return "\n\n".join(["\n\n".join(head), *sections])

"""Sweeps: several draft trainings over one extraction (`eagle3 sweep`).

    --grid train.learning_rate=3e-4,1e-3,3e-3 --grid train.ttt_steps=3,5   -> 6 points

A grid axis is one setting and its values; the points are the cartesian product of the axes,
in the order the axes were given (the last axis varies fastest). Only the settings of the
draft side can vary (train., vocab., eval.): everything upstream of training is shared by
all points, which is what makes a sweep cheap (one target load, one extraction). Each point
is validated exactly as `eagle3 run` validates one configuration (PipelineConfig), before any
work, and an error names the --grid argument.

The report: one row per point (its settings; simulated acceptance over all held-out rows;
the served-positions walk, i.e. simulated acceptance over the positions a served run drafts
from; served acceptance when eval.served is on; train seconds and tokens), best first by the
served-positions walk, and a PNG of acceptance against each swept setting.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eagle3.artifacts import atomic_write_text
from eagle3.config import ConfigError, PipelineConfig, format_validation_error, merge_settings, parse_set
from eagle3.ops.summary import RunSummary

Scalar = bool | int | float | str
SWEEPABLE = ("train", "vocab", "eval")  # sections a point may change; the rest is shared upstream
SWEEP_MD = "sweep.md"
SWEEP_PNG = "sweep_acceptance.png"


class GridAxis(BaseModel):
    """One --grid argument: a setting and the values the sweep tries."""

    model_config = ConfigDict(frozen=True)

    key: str = Field(description="Dotted setting, e.g. train.learning_rate (under train., vocab. or eval.)")
    values: list[Scalar] = Field(description="Values to try, in order, as --set would read them")
    argument: str = Field(description="The --grid argument as given, for error messages")


class SweepPoint(BaseModel):
    """One grid point: the swept settings (as validated) and the whole configuration of its run."""

    model_config = ConfigDict(frozen=True)

    index: int = Field(description="1-based position in the sweep")
    settings: dict[str, Scalar] = Field(description="Swept setting -> its value at this point")
    config: PipelineConfig = Field(description="The point's full configuration")

    def label(self) -> str:
        return " ".join(f"{key}={format_value(value)}" for key, value in self.settings.items())


class PointResult(BaseModel):
    """What one point's train -> export -> evaluate chain gave."""

    model_config = ConfigDict(frozen=True)

    index: int = Field(description="1-based position in the sweep")
    settings: dict[str, Scalar] = Field(description="Swept setting -> its value at this point")
    state: str = Field(description="Completed, Cached (all three stages), Failed, or 'not run'")
    simulated: float | None = Field(default=None, description="Simulated acceptance length over all held-out rows")
    served_walk: float | None = Field(
        default=None, description="Simulated acceptance length over the positions a served run drafts from")
    served: float | None = Field(default=None, description="Acceptance length served by vLLM (eval.served)")
    train_seconds: float | None = Field(default=None, description="Wall time of the train stage's work")
    tokens: int | None = Field(default=None, description="Tokens the draft trained on")
    export_dir: str | None = Field(default=None, description="The point's exported draft")
    evaluation: str | None = Field(default=None, description="The point's evaluate artifact")


class SweepSummary(RunSummary):
    """summary.json of a sweep: the run summary (its acceptance and export are the best point's) plus the points."""

    points: list[PointResult] = Field(default_factory=list, description="One entry per point, best first")
    best_export_dir: str | None = Field(default=None, description="Export folder of the best point")
    best_settings: dict[str, Scalar] = Field(default_factory=dict, description="Swept settings of the best point")
    report: str | None = Field(default=None, description="The sweep report (sweep.md)")


def format_value(value: Scalar) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# -- the grid ------------------------------------------------------------------------------
def parse_grid(arguments: Sequence[str]) -> list[GridAxis]:
    """['train.learning_rate=3e-4,1e-3'] -> axes; ConfigError naming the --grid argument."""
    axes: list[GridAxis] = []
    for argument in arguments:
        key, sep, raw = argument.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--grid {argument!r}: expected key=value1,value2,..., e.g. train.learning_rate=3e-4,1e-3")
        if key.split(".")[0] not in SWEEPABLE or "." not in key:
            raise ConfigError(f"--grid {argument!r}: {key} cannot vary within one sweep (every point shares one "
                              f"extraction); expected a setting under {', '.join(s + '.' for s in SWEEPABLE)} "
                              "(use --set for a setting all points share)")
        if any(axis.key == key for axis in axes):
            raise ConfigError(f"--grid {argument!r}: {key} is already swept by another --grid; expected each setting once")
        texts = [text.strip() for text in raw.split(",")]
        if not raw.strip() or any(not text for text in texts):
            raise ConfigError(f"--grid {argument!r}: an empty value; expected values separated by commas, "
                              f"e.g. {key}=1,2")
        values = [parse_set([f"{key}={text}"]) for text in texts]
        axes.append(GridAxis(key=key, values=[_leaf(v, key) for v in values], argument=argument))
    if not axes:
        raise ConfigError("no --grid given; expected at least one, e.g. --grid train.learning_rate=3e-4,1e-3")
    return axes


def _leaf(nested: dict, key: str) -> Scalar:
    for part in key.split("."):
        nested = nested[part]
    return nested  # type: ignore[return-value]


def _nested(key: str, value: Scalar) -> dict:
    out: dict = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def _validated(base: dict, settings: dict[str, Scalar]) -> PipelineConfig:
    raw = base
    for key, value in settings.items():
        raw = merge_settings(raw, _nested(key, value))
    return PipelineConfig.model_validate(raw)


def _problem(err: ValidationError) -> str:
    return format_validation_error(err).removeprefix("invalid configuration: ")


def expand_points(base: PipelineConfig, axes: Sequence[GridAxis]) -> list[SweepPoint]:
    """The cartesian product of `axes` over `base`, each point validated as `eagle3 run` validates one."""
    raw = base.model_dump(mode="json")
    for axis in axes:  # each value alone first, so that the error names its --grid argument
        seen: dict[str, Scalar] = {}
        for value in axis.values:
            try:
                config = _validated(raw, {axis.key: value})
            except ValidationError as err:
                raise ConfigError(f"--grid {axis.argument!r}: {_problem(err)}") from None
            valid = _leaf(config.model_dump(), axis.key)
            if repr(valid) in seen:
                raise ConfigError(f"--grid {axis.argument!r}: {axis.key}={value} is the same value as "
                                  f"{seen[repr(valid)]}; expected distinct values")
            seen[repr(valid)] = value
    points = []
    for index, combo in enumerate(itertools.product(*(axis.values for axis in axes)), start=1):
        settings = {axis.key: value for axis, value in zip(axes, combo)}
        try:
            config = _validated(raw, settings)
        except ValidationError as err:  # a rule across settings that only this combination breaks
            given = " ".join(f"--grid {axis.argument!r}" for axis in axes)
            raise ConfigError(f"grid point {index} ({' '.join(f'{k}={format_value(v)}' for k, v in settings.items())}, "
                              f"from {given}): {_problem(err)}") from None
        dumped = config.model_dump()
        points.append(SweepPoint(index=index, settings={k: _leaf(dumped, k) for k in settings}, config=config))
    online = sorted({p.config.train.data for p in points} - {"store"})
    if online:  # every point trains from the one extraction the sweep stores (eagle3/online/feed.py: not built)
        raise ConfigError(f"train.data={online[0]!r}: eagle3 sweep trains every point from one stored extraction; online "
                          "and hybrid data are not built for sweeps yet; set train.data='store' (or run the points "
                          "with eagle3 run)")
    return points


def default_run_dir(base_run_dir: str) -> str:
    """runs/tiny -> runs/tiny-sweep: a sweep keeps its own summary.json next to the single runs'."""
    return str(base_run_dir).rstrip("/") + "-sweep"


# -- the report ----------------------------------------------------------------------------
def acceptance_figures(evaluation: Path) -> dict[str, float | None]:
    """simulated (all rows), served_walk and served (None when not run) from an evaluate artifact's acceptance.json."""
    payload = json.loads((Path(evaluation) / "acceptance.json").read_text())
    simulated = payload.get("simulated") or {}
    served = payload.get("served") or {}
    return {"simulated": simulated.get("acceptance_length"), "served_walk": simulated.get("served_acceptance_length"),
            "served": served.get("acceptance_length")}


def ranked(results: Sequence[PointResult]) -> list[PointResult]:
    """Best first by the served-positions walk (then all rows); points without figures last, in sweep order."""
    def key(r: PointResult) -> tuple:
        walk = r.served_walk if r.served_walk is not None else -math.inf
        sim = r.simulated if r.simulated is not None else -math.inf
        return (-walk, -sim, r.index)
    return sorted(results, key=key)


def _cell(value: float | None, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def report_table(results: Sequence[PointResult], keys: Sequence[str]) -> str:
    """Markdown table, one row per point, best first (see `ranked`)."""
    served = any(r.served is not None for r in results)
    head = ["#", *keys, "simulated (all rows)", "served-positions walk", *(["served"] if served else []),
            "train s", "tokens", "state", "export"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if h not in ("state", "export") else "---"
                                                           for h in head) + "|"]
    for r in ranked(results):
        cells = [str(r.index), *(format_value(r.settings[k]) for k in keys), _cell(r.simulated), _cell(r.served_walk),
                 *([_cell(r.served)] if served else []), _cell(r.train_seconds, 1),
                 "" if r.tokens is None else str(r.tokens), r.state, f"`{r.export_dir}`" if r.export_dir else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_markdown(results: Sequence[PointResult], keys: Sequence[str], shared: str, plot: str | None) -> str:
    """The whole sweep.md: table, the best point, the plot (by file name, next to sweep.md)."""
    best = ranked(results)[0] if results else None
    parts = [f"# Sweep: {len(results)} points over one extraction", f"Shared settings: {shared}",
             "Sorted by the served-positions walk (simulated acceptance over the positions a served run drafts from).",
             report_table(results, keys)]
    if best is not None and best.export_dir:
        parts.append(f"Best point: {best.index} ({' '.join(f'{k}={format_value(v)}' for k, v in best.settings.items())}), "
                     f"export `{best.export_dir}`")
    if plot:
        parts.append(f"![acceptance against each swept setting]({plot})")
    return "\n\n".join(parts) + "\n"


def plot_sweep(results: Sequence[PointResult], keys: Sequence[str], path: Path) -> Path | None:
    """One panel per swept setting: acceptance (walk: solid, all rows: dashed) against its values, one line
    per combination of the other settings. None when no point has figures."""
    from eagle3.evaluate.plots import _pyplot, _save

    done = [r for r in results if r.served_walk is not None]
    if not done:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        values = list(dict.fromkeys(r.settings[key] for r in sorted(done, key=lambda r: r.index)))
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        x_of = (lambda v: v) if numeric else (lambda v: values.index(v))  # noqa: E731 - categories as positions
        others = [k for k in keys if k != key]
        groups: dict[str, list[PointResult]] = {}
        for r in done:
            groups.setdefault(" ".join(f"{k}={format_value(r.settings[k])}" for k in others) or "all", []).append(r)
        for number, (name, rows) in enumerate(groups.items()):
            rows = sorted(rows, key=lambda r: x_of(r.settings[key]))
            xs = [x_of(r.settings[key]) for r in rows]
            line, = ax.plot(xs, [r.served_walk for r in rows], "o-", label=f"{name} (served positions)")
            ax.plot(xs, [r.simulated for r in rows], "s--", color=line.get_color(), alpha=0.6,
                    label=f"{name} (all rows)" if number == 0 else None)
        if numeric and all(v > 0 for v in values) and max(values) / min(values) >= 10:
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(range(len(values)), [format_value(v) for v in values])
        ax.set_xlabel(key)
        ax.set_ylabel("simulated acceptance length")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Sweep: acceptance against each swept setting")
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def write_report(results: Sequence[PointResult], keys: Sequence[str], shared: str,
                 run_dir: Path) -> tuple[Path, Path | None]:
    """<run_dir>/sweep.md and <run_dir>/sweep_acceptance.png (None when no point has figures yet)."""
    png = Path(run_dir) / SWEEP_PNG
    png.unlink(missing_ok=True)  # not a previous sweep's plot
    made = plot_sweep(results, keys, png)
    path = Path(run_dir) / SWEEP_MD
    atomic_write_text(path, sweep_markdown(results, keys, shared, made.name if made else None))
    return path, made

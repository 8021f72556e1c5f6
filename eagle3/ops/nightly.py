"""NightlyConfig: the settings of the nightly retraining run (flows/nightly.py).

The nightly run trains on every dated file under `incoming` (or the last `window_days`),
starting from the served draft's weights when it can, and promotes the new draft into the
registry only when the gate of eagle3.ops.publish lets it. `pipeline` holds the settings of
every stage as in a train_eagle3 run; its data.source is replaced by each incoming file, so a
sample's data source (which the gate compares per source) is its row's "source" field.
"""

from __future__ import annotations

from datetime import date
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from eagle3.config import (
    ConfigError,
    PipelineConfig,
    file_locations,
    format_validation_error,
    layer_settings,
    merge_settings,
    preset_settings,
)
from eagle3.ops.publish import PublishConfig


class NightlyConfig(BaseModel):
    """All settings of one nightly run. Shown as a form in the Prefect UI."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pipeline: PipelineConfig = Field(
        default_factory=lambda: PipelineConfig(run_dir="runs/nightly"),
        description="Settings of every stage, as for train-eagle3; data.source is replaced by each incoming file",
    )
    incoming: str = Field(
        default="data/incoming",
        description="Folder or fsspec URL of dated conversation files YYYY-MM-DD*.jsonl (eagle3 JSONL: one conversation a line)",
    )
    window_days: int | None = Field(
        default=None, ge=1, description="Train on the files of the last N days only (default: every file)"
    )
    today: date | None = Field(
        default=None, description="Run as of this date, YYYY-MM-DD (default: today); later files wait for their day"
    )
    warm_start: bool = Field(
        default=True, description="Start training from the served draft's weights (and keep its vocabulary)"
    )
    publish: PublishConfig = Field(default_factory=PublishConfig, description="Registry and promotion gate")

    @model_validator(mode="after")
    def _store_training_only(self) -> NightlyConfig:
        """The nightly run trains on the incremental store of its dated files (eagle3.ops.incremental); the online
        feed (train.data online/hybrid) is built for train-eagle3 runs only. Refused here, before anything loads,
        rather than at the train stage after every file was extracted."""
        if self.pipeline.train.data != "store":
            raise ValueError(f"pipeline.train.data={self.pipeline.train.data!r}: the nightly run trains from the store "
                             "its dated files were extracted into; set pipeline.train.data='store' (online and hybrid "
                             "training are for train-eagle3 runs)")
        return self

    @property
    def run_date(self) -> date:
        return self.today or date.today()


def build_nightly_config(preset: str | None = None, config_file: Path | None = None, overrides: list[str] | None = None,
                         run_dir: str | None = None) -> NightlyConfig:
    """pipeline = the preset; then the YAML file, then --set overrides (e.g. publish.tolerance=0.1), then --run-dir."""
    base = {} if preset is None else {"pipeline": merge_settings(preset_settings(preset), {"run_dir": f"runs/nightly-{preset}"})}
    raw = layer_settings(base, config_file, overrides)
    if run_dir is not None:
        raw = merge_settings(raw, {"pipeline": {"run_dir": run_dir}})
    try:
        return NightlyConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, file_locations(config_file, overrides))) from None

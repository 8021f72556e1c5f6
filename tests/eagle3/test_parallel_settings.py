"""Parallel settings that vLLM (or the capture) would refuse are refused first, naming the setting."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from eagle3.data.target import TargetConfig, parallel_problems


def _target(tmp_path, **config):  # noqa: ANN001, ANN202
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_tp_that_does_not_split_the_heads_names_the_setting_and_the_choices(tmp_path):
    smollm2_like = _target(tmp_path, num_attention_heads=9, num_key_value_heads=3)
    assert parallel_problems(TargetConfig(tensor_parallel_size=3), smollm2_like, 0, cpu_cores=64) == []
    (problem,) = parallel_problems(TargetConfig(tensor_parallel_size=2), smollm2_like, 0, cpu_cores=64)
    assert "target.tensor_parallel_size=2" in problem and "9 attention heads" in problem and "[1, 3, 9]" in problem


def test_kv_heads_must_split_or_replicate_evenly(tmp_path):
    gqa = _target(tmp_path, num_attention_heads=24, num_key_value_heads=8)
    assert parallel_problems(TargetConfig(tensor_parallel_size=8), gqa, 0, cpu_cores=64) == []
    (problem,) = parallel_problems(TargetConfig(tensor_parallel_size=6), gqa, 0, cpu_cores=64)
    assert "8 KV heads" in problem


def test_multimodal_wrappers_are_read_through_their_text_config(tmp_path):
    kimi_like = _target(tmp_path, architectures=["KimiK25ForConditionalGeneration"],
                        text_config={"num_attention_heads": 64, "num_key_value_heads": 64})
    assert parallel_problems(TargetConfig(tensor_parallel_size=8), kimi_like, 8) == []
    (problem,) = parallel_problems(TargetConfig(tensor_parallel_size=8), kimi_like, 4)
    assert "4 GPU(s) are visible" in problem and "at most 4" in problem


def test_pipeline_parallelism_is_refused_by_name():
    with pytest.raises(ValidationError, match="target.pipeline_parallel_size=2 is not supported"):
        TargetConfig(pipeline_parallel_size=2)
    assert "pipeline_parallel_size" not in TargetConfig().model_dump()  # fingerprints stay as they were


def test_the_flow_refuses_them_right_after_stage_target(tiny_target):
    """check_against_target (called by the flows as soon as stage_target has read the target)."""
    from eagle3.config import ConfigError, build_config, check_against_target
    from eagle3.data.target import read_target_info

    config = build_config("tiny", overrides=["target.tensor_parallel_size=3"])
    info = read_target_info(config.target, tiny_target)
    with pytest.raises(ConfigError, match=r"target.tensor_parallel_size=3: the target's 4 attention heads"):
        check_against_target(config, info)
    check_against_target(build_config("tiny", overrides=["target.tensor_parallel_size=2"]), info)  # 4 heads split in 2

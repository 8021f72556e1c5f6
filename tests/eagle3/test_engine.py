"""The warm engine on the tiny target (eagle3.engine): what a user would notice of its lifetime and its door.

One engine is loaded for the module and shared; the last tests kill it and load one afresh. The engines
live in a cache dir of this module's own, so no other test's run can attach to them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import pytest

from eagle3.capture import vllm_adapter
from eagle3.engine import pool
from eagle3.engine.client import EngineError, EngineGone, WarmEngine
from eagle3.engine.registry import (EngineHome, engine_fingerprint, engines_root, is_live, live_engines, new_key, read_info,
                                    wait_gone)
from tests.on_device import KV_CACHE_GIB

ROOT = Path(__file__).resolve().parents[2]
TARGET_FP = "tiny-test-target"


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tiny_target: Path) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def spec(tiny_target: Path, cache: Path) -> vllm_adapter.EngineSpec:
    return vllm_adapter.EngineSpec(model_dir=str(tiny_target), dtype="float32", max_model_len=256, kv_cache_gib=KV_CACHE_GIB,
                                   tensor_parallel_size=1, trust_remote_code=False, seed=0, load_log=str(cache / "loads.jsonl"))


@pytest.fixture(scope="module")
def warm(spec, cache) -> dict:
    engine = pool.acquire(spec, TARGET_FP, 300, cache)
    assert isinstance(engine, WarmEngine)
    pool.release_all(keep_warm=True)  # detached: the engine waits for the next run
    yield read_info(EngineHome(engines_root(cache) / engine_fingerprint(spec, TARGET_FP)))
    for _, info in live_engines(cache):
        os.kill(int(info["pid"]), signal.SIGKILL)


def _answers(engine: object) -> list[list[int]]:
    return engine.generate_ids([[1, 5, 9, 13], [2, 4]], max_new_tokens=4, temperature=0.0, top_p=1.0, seed=0)


def _load_events(cache: Path) -> list[str]:
    lines = (cache / "loads.jsonl").read_text().splitlines()
    return [json.loads(line).get("event", "loaded") for line in lines]  # an in-process load's line has no event


def test_the_next_run_attaches_and_gets_what_an_in_process_engine_gives(warm, spec, cache):
    engine = pool.acquire(spec, TARGET_FP, 300, cache)
    try:
        assert engine.pid == warm["pid"] and _load_events(cache)[-1] == "attached"
        answers = _answers(engine)
        states = engine.open_source(hidden_size=64, batch_tokens=1).capture([[1, 5, 9, 13], [2, 4]], [1, 2])
    finally:
        pool.release_all(keep_warm=True)
    local = vllm_adapter.acquire(spec)
    try:
        assert answers == vllm_adapter.generate(local, [[1, 5, 9, 13], [2, 4]], max_new_tokens=4, temperature=0.0,
                                                top_p=1.0, seed=0)
        from eagle3.capture.source import open_source

        source = open_source("vllm", local, hidden_size=64, batch_tokens=1)
        expected = source.capture([[1, 5, 9, 13], [2, 4]], [1, 2])
        source.close()
    finally:
        vllm_adapter.release_all()
    assert [tuple(s.shape) for s in states] == [(4, 2, 64), (2, 2, 64)]
    assert all((a == b).all() for a, b in zip(states, expected))


def test_a_tp2_warm_engine_answers_as_tp1_and_its_workers_die_with_it(warm, spec, cache, tmp_path, monkeypatch):
    """A warm engine over two tensor-parallel workers (vLLM's mp executor, real worker processes on the CPU):
    a run attached to it gets the TP=1 engine's states (within 1e-4, fp32) and greedy tokens. Killed with
    kill -9, its workers are killed as soon as the next gpu_cleanup or attach finds it dead, not ~10 s later
    when vLLM's own watch would stop them (on a GPU they hold memory until then): finding it dead SIGKILLs
    every recorded worker that still runs (the pids the kill returns), and then none of them runs. Not timed:
    the waits for the killed engine and workers to exit are only guards against ones that never do."""
    import dataclasses

    from eagle3.engine import registry
    from eagle3.engine.registry import clear_dead_engines

    kills: list[tuple[list[int], list[int]]] = []  # per call: (workers still running, workers it SIGKILLed)
    real_kill = registry.kill_leftover_workers

    def recorded_kill(info: dict) -> list[int]:
        running = [pid for pid, ticks in info.get("workers") or [] if registry.process_identity(pid) == ticks]
        killed = real_kill(info)
        kills.append((sorted(running), sorted(killed)))
        return killed

    monkeypatch.setattr(registry, "kill_leftover_workers", recorded_kill)

    tp_cache = tmp_path / "tp-engines"
    tp2 = pool.acquire(dataclasses.replace(spec, tensor_parallel_size=2), TARGET_FP, 300, tp_cache)
    try:
        states = tp2.open_source(hidden_size=64, batch_tokens=1).capture([[1, 5, 9, 13], [2, 4]], [1, 2])
        answers = _answers(tp2)
    finally:
        pool.release_all(keep_warm=True)
    (home, info), = live_engines(tp_cache)
    assert len(info["workers"]) >= 2, info["workers"]  # one a TP rank at least
    one = pool.acquire(spec, TARGET_FP, 300, cache)  # the module's TP=1 warm engine
    try:
        expected, expected_answers = one.open_source(hidden_size=64, batch_tokens=1).capture([[1, 5, 9, 13], [2, 4]], [1, 2]), _answers(one)
    finally:
        pool.release_all(keep_warm=True)
    assert answers == expected_answers
    assert max(float((a - b).abs().max()) for a, b in zip(states, expected, strict=True)) <= 1e-4
    os.kill(int(info["pid"]), signal.SIGKILL)
    assert wait_gone(info, 60)  # a guard: a SIGKILLed process is gone within moments
    assert clear_dead_engines(tp_cache) == [home.fingerprint]
    # found dead: every worker still running then was SIGKILLed at once (vLLM's own watch would stop them ~10 s later)
    assert kills and all(running == killed for running, killed in kills), kills
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid, _ in info["workers"]) and time.monotonic() < deadline:
        time.sleep(0.05)  # SIGKILL is delivered at once; the kernel reaps within moments
    from eagle3.engine.registry import process_identity

    assert [pid for pid, ticks in info["workers"] if process_identity(pid) == ticks] == []
    assert not home.info.exists() and not Path(info["socket"]).exists()


@pytest.mark.parametrize("change", [{"dtype": "bfloat16"}, {"max_model_len": 128}, {"tensor_parallel_size": 2}])
def test_an_engine_whose_settings_differ_is_never_attached(warm, spec, cache, monkeypatch, change):
    import dataclasses

    monkeypatch.setattr(vllm_adapter, "acquire", lambda s: ("loaded in-process", s))
    other = dataclasses.replace(spec, **change)
    assert pool.acquire(other, TARGET_FP, 0, cache) == ("loaded in-process", other)
    assert is_live(warm)


def test_the_socket_and_key_are_private_and_refuse_a_client_without_the_key(warm, spec, cache):
    home = EngineHome(engines_root(cache) / engine_fingerprint(spec, TARGET_FP))
    assert home.folder.stat().st_mode & 0o777 == 0o700
    assert Path(warm["socket"]).stat().st_mode & 0o777 == 0o600 and home.key.stat().st_mode & 0o777 == 0o600
    with pytest.raises(AuthenticationError):
        Client(warm["socket"], family="AF_UNIX", authkey=b"not the key")
    bare = Client(warm["socket"], family="AF_UNIX")  # no key at all: the client skips the handshake and just asks
    bare.send(("hello", {"pid": os.getpid(), "keep_warm_s": 0}))
    replies = []
    with pytest.raises(EOFError):
        while bare.poll(15):
            replies.append(bare.recv_bytes())
    assert replies[-1] == b"#FAILURE#" and len(replies) == 2  # the engine's challenge, then its refusal
    assert _answers(pool.acquire(spec, TARGET_FP, 300, cache))  # still serving
    pool.release_all(keep_warm=True)


def test_two_runs_attached_at_once_take_turns_and_both_get_their_answers(warm, spec, cache):
    from eagle3.engine.client import connect

    home = EngineHome(engines_root(cache) / engine_fingerprint(spec, TARGET_FP))
    runs = [connect(home, warm) for _ in range(2)]
    alone = _answers(runs[0])
    results: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: results.update({i: _answers(runs[i])})) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for run in runs:
        run.release(stop=False)
    assert results == {0: alone, 1: alone}


def test_sleep_during_train_is_refused_on_the_cpu_build_and_by_an_engine_loaded_without_sleep_mode(warm, spec, cache):
    from pydantic import ValidationError

    from eagle3.data.target import TargetConfig

    with pytest.raises(ValueError, match=r"target.sleep_during_train=true needs CUDA: on the CPU build .* does nothing"):
        pool.check_sleep_during_train(True)
    with pytest.raises(ValidationError, match="target.keep_warm_s=0 keeps no engine warm"):
        TargetConfig(sleep_during_train=True, keep_warm_s=0)
    engine = pool.acquire(spec, TARGET_FP, 300, cache)
    try:
        with pytest.raises(ValueError, match="loaded without sleep mode; set target.sleep_during_train=true"):
            engine.sleep()
        assert _answers(engine)  # still serving, awake
    finally:
        pool.release_all(keep_warm=True)


def _inet_listeners(pid: int) -> list[str]:
    """The local addresses of TCP/UDP sockets `pid` listens on (IPv4 and IPv6), from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            listening = fields[3] == "0A" or table.startswith("udp")
            if fields[9] in inodes and listening:
                found.append(f"{table} {fields[1]}")
    return found


def test_nothing_listens_on_a_non_loopback_address(warm):
    loopback = ("0100007F:", "00000000000000000000000001000000:")
    assert [a for a in _inet_listeners(int(warm["pid"])) if not a.split()[1].startswith(loopback)] == []


def test_a_stale_key_is_one_clear_error_not_a_hang(warm, spec, cache):
    home = EngineHome(engines_root(cache) / engine_fingerprint(spec, TARGET_FP))
    real = home.key.read_bytes()
    new_key(home)  # the file no longer holds the engine's key
    try:
        started = time.monotonic()
        with pytest.raises(EngineError, match=rf"pid {warm['pid']} refused the key .*`eagle3 engine stop"):
            pool.acquire(spec, TARGET_FP, 300, cache)
        assert time.monotonic() - started < 30
    finally:
        home.key.unlink()
        home.key.write_bytes(real)
        home.key.chmod(0o600)


def test_a_run_killed_while_attached_leaves_the_engine_serving_the_next(warm, spec, cache):
    script = (f"from eagle3.engine import pool; from eagle3.capture.vllm_adapter import EngineSpec; from pathlib import Path\n"
              f"e = pool.acquire(EngineSpec(**{spec.__dict__!r}), {TARGET_FP!r}, 300, Path({str(cache)!r}))\n"
              "print('attached', flush=True)\n"
              "while True: e.generate_ids([[1, 2, 3]] * 8, max_new_tokens=64, temperature=0.0, top_p=1.0, seed=0)\n")
    run = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert run.stdout.readline().strip() == "attached"
    time.sleep(0.5)  # mid-request
    run.kill()
    run.wait(timeout=30)
    engine = pool.acquire(spec, TARGET_FP, 300, cache)
    assert engine.pid == warm["pid"] and _answers(engine)
    pool.release_all(keep_warm=True)


def test_an_engine_killed_mid_request_is_an_error_then_a_fresh_load_with_no_orphan(warm, spec, cache):
    engine = pool.acquire(spec, TARGET_FP, 300, cache)
    threading.Timer(1.0, os.kill, (engine.pid, signal.SIGKILL)).start()
    started = time.monotonic()
    with pytest.raises(EngineGone, match=f"warm engine pid {engine.pid}"):
        while True:
            engine.generate_ids([[1, 2, 3]] * 8, max_new_tokens=64, temperature=0.0, top_p=1.0, seed=0)
    assert time.monotonic() - started < 30
    pool.release_all(keep_warm=True)
    assert Path(warm["socket"]).exists()  # the dead engine's socket file and record are left behind
    # keep_warm_s 5: the idle exit below; with 2, a loaded machine could let it pass between engine.json saying ready
    # and this process's handshake, and the engine exit before its first client
    fresh = pool.acquire(spec, TARGET_FP, 5, cache)
    try:
        assert fresh.pid != warm["pid"] and _load_events(cache)[-1] == "loaded" and _answers(fresh)
        assert not is_live(warm)
        strays = subprocess.run(["pgrep", "-f", "eagle3.engine.server"], capture_output=True, text=True).stdout.split()
        assert str(warm["pid"]) not in strays
    finally:
        pool.release_all(keep_warm=True)
    info = dict(fresh.info)
    assert wait_gone(info, 60), "the idle engine did not exit after keep_warm_s"
    assert not Path(info["socket"]).exists() and live_engines(cache) == []


def _wait_attached(home: EngineHome, count: int) -> dict:
    deadline = time.monotonic() + 30
    while (read_info(home) or {}).get("attached") != count:
        assert time.monotonic() < deadline, f"engine.json never said attached={count}: {read_info(home)}"
        time.sleep(0.1)
    return read_info(home)


def test_a_run_about_to_load_another_target_stops_an_idle_engine_kept_on_the_gpus_and_no_other(spec, cache, monkeypatch):
    """A failed run's engine, kept warm for its retry, holds GPUs that a run of another target needs: that run stops
    it before loading (a target_loads line says which and why), but never an engine a run is attached to, nor a
    user's (`eagle3 engine start`). FAKE GPU: the CPU build's engine holds no GPU, so the test sets the `cuda` flag
    its record would carry on a GPU (and, for the user's engine, the owner its record would carry); the engine, the
    stop and the other run's acquire are real."""
    import dataclasses

    from eagle3.engine.registry import write_info

    home = EngineHome(engines_root(cache) / engine_fingerprint(spec, TARGET_FP))
    kept = pool.acquire(spec, TARGET_FP, 300, cache)
    write_info(home, _wait_attached(home, 1) | {"cuda": True})
    monkeypatch.setattr(vllm_adapter, "acquire", lambda s: ("loaded in-process", s))
    other = dataclasses.replace(spec, dtype="bfloat16")  # another engine: another target, or other settings
    assert pool.acquire(other, TARGET_FP, 0, cache)[0] == "loaded in-process"
    assert is_live(read_info(home))  # a run is attached to it: left alone
    pool.release_all(keep_warm=True)  # that run failed: its engine waits for the retry
    info = _wait_attached(home, 0)
    write_info(home, info | {"owner": "user"})
    pool.acquire(other, TARGET_FP, 0, cache)
    assert is_live(info)  # a user's engine: left alone
    write_info(home, info | {"owner": "run"})
    pool.acquire(other, TARGET_FP, 0, cache)
    assert wait_gone(info, 30) and live_engines(cache) == []
    stopped = json.loads((cache / "loads.jsonl").read_text().splitlines()[-1])
    assert stopped["event"] == "stopped_idle_engine" and stopped["engine_pid"] == kept.pid == info["pid"]
    assert "another run's retry" in stopped["why"] and stopped["how"] == "stopped"


def test_the_hf_backends_load_is_recorded_like_an_engines(builtin_cache, tmp_path):
    from eagle3 import stages
    from eagle3.capture.extract import ExtractConfig
    from eagle3.capture.regenerate import RegenerateConfig
    from eagle3.data.conversations import DataConfig
    from eagle3.data.target import TargetConfig
    from eagle3.ops.summary import loads_since

    target_config, loads = TargetConfig(model="builtin:tiny", max_model_len=256, dtype="float32"), tmp_path / "loads.jsonl"
    target = stages.run_stage_target(target_config, builtin_cache, tmp_path, stages.fingerprint_target(target_config))
    data, regen_config, extract_config = DataConfig(max_samples=8, max_tokens=96), RegenerateConfig(enabled=False), \
        ExtractConfig(backend="hf", samples_per_shard=4)
    regen = stages.run_regenerate(regen_config, data, target_config, target, tmp_path,
                                  stages.fingerprint_regenerate(regen_config, data, target, 256), loads)
    prepared = stages.run_prepare(data, regen, target, False, tmp_path, stages.fingerprint_prepare(data, regen, target))
    stages.run_extract(extract_config, target_config, prepared, target, tmp_path,
                       stages.fingerprint_extract(extract_config, target_config, prepared, target), loads)
    (load,) = loads_since(loads, 0)
    assert load["event"] == "loaded" and load["backend"] == "hf" and load["seconds"] >= 0 and load["pid"] == os.getpid()

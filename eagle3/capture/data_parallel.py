"""Data-parallel extraction: N independent engines fill one store, each with its own shards.

`target.data_parallel_size` = N starts N engine processes, each a whole vLLM engine over
`target.tensor_parallel_size` GPUs of its own (on the CPU build: its own share of the cores),
and gives engine r every N-th missing shard of the train and held-out stores, r first. They
write the same store folders: each shard under its own name, the one manifest merged under
a file lock (eagle3.capture.store), so the result is the store one engine would have written,
shard for shard. A killed run leaves whole shards and a manifest listing them; the next run,
with any N, splits only what is still missing.

Why N separate `vllm.LLM`s and not vLLM's own `data_parallel_size`: vLLM's DP engines exist to
keep a DP group in step (a coordinator, and MoE experts shared over the ranks with all-to-all),
and offline they too are one process per rank that the caller starts (vLLM's
examples/offline_inference/data_parallel.py). Extraction has no reason for the ranks to wait
on each other: prompts are independent, and the capture is the same in-process patched forward
as with one engine (eagle3.capture.vllm_adapter), so each rank is that engine on other devices.
For a target too large for one GPU, TP inside each engine does the sharing.

The engine processes are started with multiprocessing's "spawn" (a fresh interpreter: no
copied CUDA or OpenMP state), ask the kernel to kill them when this process dies
(PR_SET_PDEATHSIG: a SIGKILLed flow leaves no engine holding a GPU), and are recorded as this
pipeline's own with eagle3.gpu.cleanup.register_own_process, so gpu_cleanup may stop them
after a crash. Their output goes to the same file descriptors as this process's, i.e. into
engine.log when a stage runs them.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle3.capture import vllm_adapter
from eagle3.capture.extract import ExtractConfig, extract_store, shard_groups
from eagle3.capture.store import StoreWriter, shards_listed
from eagle3.data.conversations import read_samples
from eagle3.gpu.cleanup import register_own_process
from eagle3.gpu.devices import visible_gpus

_PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.5
STOP_GRACE_SECONDS = 10.0


class DataParallelError(RuntimeError):
    """An engine process failed or the engines cannot be placed; the message names which and where to look."""


@dataclass(frozen=True)
class Split:
    """One store to fill: the prepared samples (a read_samples JSONL file) and the store folder."""

    samples_file: str
    store_dir: str


@dataclass(frozen=True)
class EngineJob:
    """What engine process `rank` does: its placement, its engine, and its shards of each split."""

    rank: int
    size: int
    parent_pid: int  # the process that started the engines: the engine stops when it is gone
    env: dict[str, str]
    spec: vllm_adapter.EngineSpec
    shards: dict[str, tuple[int, ...]]  # split name -> shard indices this engine writes
    splits: dict[str, Split]
    config: ExtractConfig
    aux_layer_ids: tuple[int, ...]
    num_layers: int
    hidden_size: int
    dtype: str  # torch dtype name of the store ("float32", "bfloat16", "float8_e4m3fn")
    max_model_len: int | None


def engine_environments(engines: int, tensor_parallel_size: int, *, gpus: Sequence[str], cpus: Sequence[int]) -> list[dict[str, str]]:
    """Per engine, the environment that places it: CUDA_VISIBLE_DEVICES with its own
    `tensor_parallel_size` GPUs, or on the CPU build (`gpus` empty) VLLM_CPU_OMP_THREADS_BIND with
    its own share of `cpus` (split again over its TP ranks)."""
    need = engines * tensor_parallel_size
    if gpus:
        if len(gpus) < need:
            raise DataParallelError(
                f"target.data_parallel_size={engines} x target.tensor_parallel_size={tensor_parallel_size} needs {need} GPUs, "
                f"{len(gpus)} are visible ({','.join(gpus)}); lower target.data_parallel_size")
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[r * tensor_parallel_size : (r + 1) * tensor_parallel_size])}
                for r in range(engines)]
    cpus = sorted(cpus)
    if len(cpus) < need:
        raise DataParallelError(
            f"target.data_parallel_size={engines} x target.tensor_parallel_size={tensor_parallel_size} needs {need} CPU cores "
            f"on the CPU build (one per rank), this process may use {len(cpus)}; lower target.data_parallel_size")
    per = len(cpus) // engines
    return [{"VLLM_CPU_OMP_THREADS_BIND": vllm_adapter.cpu_thread_binding(tensor_parallel_size, cpus[r * per : (r + 1) * per])}
            for r in range(engines)]


def share_shards(missing: dict[str, list[int]], engines: int) -> list[dict[str, tuple[int, ...]]]:
    """Every missing (split, shard) to exactly one engine, round robin over the splits in order:
    engine r gets the r-th, (r+N)-th, ... so each holds about the same number of shards."""
    flat = [(split, index) for split, indices in missing.items() for index in indices]
    return [{split: tuple(i for s, i in flat[r::engines] if s == split) for split in missing} for r in range(engines)]


def extract_with_engines(
    splits: dict[str, Split],
    *,
    spec: vllm_adapter.EngineSpec,
    engines: int,
    config: ExtractConfig,
    aux_layer_ids: Sequence[int],
    num_layers: int,
    hidden_size: int,
    dtype: str,
    max_model_len: int | None,
    run_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, int]:
    """Write every missing shard of each split's store with `engines` engine processes.

    Returns the shards written per split. `progress(done, total)` counts shards of all splits,
    read from the manifests while the engines work. The stores' manifests are NOT finished
    here: the caller's extract_store pass (with nothing left to do) does that and checks them.
    """
    import torch

    store_dtype = getattr(torch, dtype)
    missing, total = {}, 0
    for name, split in splits.items():
        samples = read_samples(Path(split.samples_file))
        groups = shard_groups(samples, config.samples_per_shard)
        writer = StoreWriter(Path(split.store_dir), aux_layer_ids=aux_layer_ids, hidden_size=hidden_size,
                             dtype=store_dtype, expected_shards=groups)
        missing[name], total = writer.pending(), total + len(groups)
    todo = sum(len(v) for v in missing.values())
    if todo == 0:
        return {name: 0 for name in splits}
    engines = min(engines, todo)  # an engine with nothing to do would only load the target
    gpus = spec.devices.split(",") if spec.devices else visible_gpus()  # target.devices, split among the engines
    envs = engine_environments(engines, spec.tensor_parallel_size, gpus=gpus, cpus=sorted(os.sched_getaffinity(0)))
    jobs = [EngineJob(rank=r, size=engines, parent_pid=os.getpid(), env=envs[r], spec=spec, shards=shares, splits=splits, config=config,
                      aux_layer_ids=tuple(aux_layer_ids), num_layers=num_layers, hidden_size=hidden_size, dtype=dtype,
                      max_model_len=max_model_len)
            for r, shares in enumerate(share_shards(missing, engines))]
    _run(jobs, run_dir, lambda: progress(sum(shards_listed(Path(s.store_dir)) for s in splits.values()), total) if progress else None)
    return {name: len(indices) for name, indices in missing.items()}


def _run(jobs: list[EngineJob], run_dir: Path | None, poll: Callable[[], None] | None) -> None:
    context = multiprocessing.get_context("spawn")
    processes = []
    try:
        for job in jobs:
            process = context.Process(target=_engine_main, args=(job,), name=f"eagle3-extract-engine-{job.rank}", daemon=False)
            process.start()
            processes.append(process)
            if run_dir is not None:
                register_own_process(run_dir, process.pid)
        while True:
            failed = [(job, p) for job, p in zip(jobs, processes) if p.exitcode not in (None, 0)]
            if failed:
                job, process = failed[0]
                raise DataParallelError(
                    f"extract engine {job.rank} of {job.size} (pid {process.pid}, {_placement(job)}) exited with "
                    f"{_exit(process.exitcode)}; its traceback is in the stage's engine log. The shards every engine "
                    "finished are kept: run the extract stage again to redo only the rest")
            if poll is not None:
                poll()
            if all(p.exitcode == 0 for p in processes):
                return
            time.sleep(POLL_SECONDS)
    finally:
        _stop(processes)


def _stop(processes: list) -> None:
    """Stop engines still running (this stage failed or was interrupted): SIGTERM, a grace, SIGKILL."""
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join()


def _placement(job: EngineJob) -> str:
    return ", ".join(f"{k}={v}" for k, v in job.env.items())


def _exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the process that started it dies (a SIGKILLed flow)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the engine outlives a killed parent, gpu_cleanup (mode "own") stops it
    if os.getppid() != parent_pid:  # the parent died before the prctl: nobody waits for this engine
        os._exit(1)


def _engine_main(job: EngineJob) -> None:
    """Engine process `job.rank`: load the target once, write this engine's shards of each split."""
    _die_with_parent(job.parent_pid)
    os.environ.update(job.env)
    import torch

    try:
        for name, indices in job.shards.items():
            if not indices:
                continue
            split = job.splits[name]
            extract_store(
                read_samples(Path(split.samples_file)), Path(split.store_dir), get_engine=lambda: vllm_adapter.acquire(job.spec),
                aux_layer_ids=job.aux_layer_ids, num_layers=job.num_layers, hidden_size=job.hidden_size, config=job.config,
                dtype=getattr(torch, job.dtype), max_model_len=job.max_model_len, only=indices,
            )
    finally:
        vllm_adapter.release_all()

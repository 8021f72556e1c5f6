"""NVML behind a small Protocol: GPU memory, the processes NVML sees, and the memory checks.

This module owns everything that asks the NVIDIA driver (through NVML) a question:

- `NvmlLike`, the Protocol the rest of the code talks to (device count, memory used/total
  per device, processes per device), and `PynvmlBackend`, its real implementation on
  `pynvml` (the `nvidia-ml-py` package), imported lazily so the library imports without it;
- `memory_snapshot` / `wait_until_free`: read and poll per-GPU used memory against
  thresholds (the verification step of GPU cleanup, see `eagle3.gpu`);
- `idle_thresholds_mib`: the "idle baseline" threshold when no absolute one is set;
- `preflight`: is there enough free memory on every GPU for the job about to start?

Units: NVML answers in bytes; reports, thresholds and error messages use MiB (2**20 bytes),
like nvidia-smi.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

MIB = 2**20
GIB = 2**30


class NvmlUnavailableError(RuntimeError):
    """NVML could not be initialised: no NVIDIA driver (or no libnvidia-ml) on this machine."""


class InsufficientGpuMemoryError(RuntimeError):
    """A GPU has less free memory than the job needs."""


@dataclass(frozen=True)
class DeviceMemory:
    """Memory of one device as NVML reports it, in bytes."""

    used_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class NvmlProcess:
    """A process NVML lists on one device (compute or graphics context)."""

    pid: int
    used_bytes: int | None  # None: the driver does not say (common inside containers)


class NvmlLike(Protocol):
    """The few NVML questions GPU cleanup and preflight ask."""

    def device_count(self) -> int: ...

    def memory(self, index: int) -> DeviceMemory: ...

    def processes(self, index: int) -> list[NvmlProcess]: ...


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory at one moment, in MiB; threshold_mib is the bar it had to get under."""

    index: int
    used_mib: int
    total_mib: int
    threshold_mib: int | None = None

    @property
    def free_mib(self) -> int:
        return self.total_mib - self.used_mib

    @property
    def over_threshold(self) -> bool:
        return self.threshold_mib is not None and self.used_mib > self.threshold_mib


class PynvmlBackend:
    """`NvmlLike` on the real driver via pynvml. Use as a context manager (init/shutdown)."""

    def __init__(self) -> None:
        import pynvml  # lazy: the library must import on machines without nvidia-ml-py

        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailableError(
                f"no NVIDIA driver: NVML could not start ({type(exc).__name__}: {exc})"
            ) from exc

    def __enter__(self) -> PynvmlBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._nvml.nvmlShutdown()

    def device_count(self) -> int:
        return int(self._nvml.nvmlDeviceGetCount())

    def _handle(self, index: int) -> object:
        return self._nvml.nvmlDeviceGetHandleByIndex(index)

    def memory(self, index: int) -> DeviceMemory:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle(index))
        return DeviceMemory(used_bytes=int(info.used), total_bytes=int(info.total))

    def processes(self, index: int) -> list[NvmlProcess]:
        handle = self._handle(index)
        found: dict[int, int | None] = {}
        # A process can hold a compute and a graphics context on the same GPU: merge by pid.
        for query in (
            self._nvml.nvmlDeviceGetComputeRunningProcesses,
            self._nvml.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            for proc in query(handle):
                pid = int(proc.pid)
                # pynvml gives usedGpuMemory=None for "not available".
                known = [u for u in (found.get(pid), proc.usedGpuMemory) if u is not None]
                found[pid] = int(max(known)) if known else None
        return [NvmlProcess(pid=pid, used_bytes=used) for pid, used in sorted(found.items())]


def open_nvml() -> PynvmlBackend:
    """The real NVML; raises NvmlUnavailableError when there is no NVIDIA driver."""
    return PynvmlBackend()


def memory_snapshot(
    nvml: NvmlLike, thresholds_mib: dict[int, int] | None = None
) -> tuple[GpuMemory, ...]:
    """Used/total MiB of every GPU NVML sees, each with its threshold when one is given."""
    thresholds = thresholds_mib or {}
    out = []
    for index in range(nvml.device_count()):
        mem = nvml.memory(index)
        out.append(
            GpuMemory(
                index=index,
                used_mib=mem.used_bytes // MIB,
                total_mib=mem.total_bytes // MIB,
                threshold_mib=thresholds.get(index),
            )
        )
    return tuple(out)


def idle_thresholds_mib(
    nvml: NvmlLike, before: Sequence[GpuMemory], margin_mib: int
) -> dict[int, int]:
    """Per-GPU idle baseline + margin: the memory no process accounts for (driver reserve).

    baseline = used before cleanup - memory NVML attributes to processes on that GPU.
    When NVML cannot say how much some process uses, the attribution is unknown and the
    baseline is taken as 0 (the threshold is the margin alone): a baseline that silently
    included a process's memory would let a busy GPU pass.
    """
    thresholds = {}
    for gpu in before:
        procs = nvml.processes(gpu.index)
        if any(p.used_bytes is None for p in procs):
            baseline = 0
        else:
            attributed = sum(p.used_bytes or 0 for p in procs) // MIB
            baseline = max(gpu.used_mib - attributed, 0)
        thresholds[gpu.index] = baseline + margin_mib
    return thresholds


def wait_until_free(
    nvml: NvmlLike,
    thresholds_mib: dict[int, int],
    timeout_seconds: float,
    poll_interval_seconds: float,
) -> tuple[tuple[GpuMemory, ...], bool]:
    """Poll NVML until every GPU's used memory <= its threshold, or the timeout passes.

    Returns the last snapshot and whether every GPU got under its threshold. Memory is
    often released a little after the process is gone, hence the polling.
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        snapshot = memory_snapshot(nvml, thresholds_mib)
        if not any(gpu.over_threshold for gpu in snapshot):
            return snapshot, True
        if time.monotonic() >= deadline:
            return snapshot, False
        time.sleep(poll_interval_seconds)


def required_bytes_per_gpu(
    weight_bytes: int, tensor_parallel_size: int, kv_cache_bytes_per_gpu: int
) -> int:
    """What one GPU must have free: its share of the weights plus its KV-cache budget."""
    if tensor_parallel_size < 1:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size}: expected >= 1 (GPUs per model copy)"
        )
    if weight_bytes < 0 or kv_cache_bytes_per_gpu < 0:
        raise ValueError(
            f"weight_bytes={weight_bytes}, kv_cache_bytes_per_gpu={kv_cache_bytes_per_gpu}: "
            "expected sizes >= 0"
        )
    return -(-weight_bytes // tensor_parallel_size) + kv_cache_bytes_per_gpu


def preflight(
    required_bytes_per_gpu: int,
    nvml: NvmlLike,
    devices: Sequence[int] | None = None,
) -> tuple[GpuMemory, ...]:
    """Check that each GPU in `devices` (default: all) has `required_bytes_per_gpu` free.

    The need is usually weight bytes / TP size + KV budget (see `required_bytes_per_gpu`).
    Returns the snapshot of the checked GPUs; raises InsufficientGpuMemoryError naming
    every GPU that falls short, with the numbers.
    """
    if required_bytes_per_gpu < 0:
        raise ValueError(f"required_bytes_per_gpu={required_bytes_per_gpu}: expected >= 0")
    snapshot = memory_snapshot(nvml)
    if not snapshot:
        raise InsufficientGpuMemoryError(
            "preflight: NVML sees no GPU, but the job needs "
            f"{required_bytes_per_gpu / GIB:.2f} GiB per GPU"
        )
    wanted = list(range(len(snapshot))) if devices is None else list(devices)
    unknown = [i for i in wanted if not 0 <= i < len(snapshot)]
    if unknown:
        raise ValueError(
            f"preflight: devices {unknown} do not exist; NVML sees {len(snapshot)} GPU(s) "
            f"(indices 0..{len(snapshot) - 1})"
        )
    checked = tuple(snapshot[i] for i in wanted)
    need_mib = -(-required_bytes_per_gpu // MIB)
    short = [gpu for gpu in checked if gpu.free_mib < need_mib]
    if short:
        lines = "; ".join(
            f"GPU {g.index}: {g.free_mib / 1024:.2f} GiB free of {g.total_mib / 1024:.2f} GiB "
            f"({g.used_mib} MiB in use)"
            for g in short
        )
        raise InsufficientGpuMemoryError(
            f"preflight: need {need_mib / 1024:.2f} GiB ({need_mib} MiB) free per GPU "
            f"(weights / tensor-parallel size + KV-cache budget), but {lines}. Free the GPUs "
            "(gpu cleanup), raise the tensor-parallel size or lower the KV-cache budget."
        )
    return checked

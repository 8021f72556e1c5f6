"""What is on the GPUs: NVML (memory, processes) and the processes holding the device files.

This module observes; `eagle3.gpu.cleanup` decides and acts (policy, signals, the cleanup stage).
It owns:

- `NvmlLike`, the Protocol the rest of the code talks to (device count, memory used/total
  per device, processes per device), and `PynvmlBackend`, its real implementation on
  `pynvml` (the `nvidia-ml-py` package), imported lazily so the library imports without it;
- `discover_holders`: processes with a device file open or mapped (`fuser`, or the same
  answer from a /proc/<pid>/fd + /proc/<pid>/maps scan) plus those NVML lists per GPU,
  each with user, command line and start time (/proc/<pid>/stat field 22, clock ticks
  since boot: with the pid it identifies a process, since a reused PID starts later);
- `memory_snapshot` / `idle_thresholds_mib` / `wait_until_free`: per-GPU used memory,
  the idle-baseline threshold, and the polling that proves memory came free;
- `preflight`: is there enough free memory on every GPU for the job about to start?

Units: NVML answers in bytes; reports, thresholds and messages use MiB (2**20 bytes).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from glob import glob
from pathlib import Path
from typing import Any, Protocol

MIB = 2**20
GIB = 2**30


class GpuCleanupError(RuntimeError):
    """GPU cleanup (discovery, policy, stopping, verification) could not do what it was asked."""


class NvmlQueryError(GpuCleanupError):
    """NVML started but a query failed (GPU lost, not supported here, ...)."""


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

    def _ask(self, what: str, index: int | None, *args: object) -> Any:
        """Call pynvml's `what`; an NVML failure becomes an error naming the call and GPU."""
        try:
            return getattr(self._nvml, what)(*args)
        except self._nvml.NVMLError as exc:
            where = "" if index is None else f" for GPU {index}"
            raise NvmlQueryError(f"NVML {what}{where} failed: {type(exc).__name__}: {exc}") \
                from exc

    def _handle(self, index: int) -> object:
        return self._ask("nvmlDeviceGetHandleByIndex", index, index)

    def device_count(self) -> int:
        return int(self._ask("nvmlDeviceGetCount", None))

    def memory(self, index: int) -> DeviceMemory:
        info = self._ask("nvmlDeviceGetMemoryInfo", index, self._handle(index))
        return DeviceMemory(used_bytes=int(info.used), total_bytes=int(info.total))

    def name(self, index: int) -> str:
        """The GPU's product name, e.g. 'NVIDIA H200'."""
        raw = self._ask("nvmlDeviceGetName", index, self._handle(index))
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def driver_version(self) -> str:
        raw = self._ask("nvmlSystemGetDriverVersion", None)
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def processes(self, index: int) -> list[NvmlProcess]:
        handle = self._handle(index)
        found: dict[int, int | None] = {}
        # A process can hold a compute and a graphics context on the same GPU: merge by pid.
        for query in ("nvmlDeviceGetComputeRunningProcesses",
                      "nvmlDeviceGetGraphicsRunningProcesses"):
            for proc in self._ask(query, index, handle):
                pid = int(proc.pid)
                # pynvml gives usedGpuMemory=None for "not available".
                known = [u for u in (found.get(pid), proc.usedGpuMemory) if u is not None]
                found[pid] = int(max(known)) if known else None
        return [NvmlProcess(pid=pid, used_bytes=used) for pid, used in sorted(found.items())]


def open_nvml() -> PynvmlBackend:
    """The real NVML; raises NvmlUnavailableError when there is no NVIDIA driver."""
    return PynvmlBackend()


# ---------------------------------------------------------------- holders (/proc, fuser)


@dataclass(frozen=True)
class GpuHolder:
    """A process holding a GPU device file or listed by NVML."""

    pid: int
    user: str
    command: str
    start_ticks: int | None  # /proc/<pid>/stat field 22; None: pid not visible in /proc here
    started_at: str | None  # the same, as an ISO 8601 UTC time
    device_files: tuple[str, ...]  # files matching device_glob it has open or mapped
    gpus: tuple[int, ...]  # NVML indices of the GPUs where NVML lists it
    gpu_memory_mib: int | None  # summed over its GPUs, from NVML; None: unknown

    @property
    def devices(self) -> tuple[str, ...]:
        return self.device_files + tuple(f"gpu{i}" for i in self.gpus)


@dataclass(frozen=True)
class ProcStat:
    state: str
    ppid: int
    start_ticks: int


def read_stat(pid: int) -> ProcStat | None:
    """/proc/<pid>/stat, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may hold spaces and ')': the fields after the last ')' start at field 3.
    fields = text.rpartition(")")[2].split()
    return ProcStat(state=fields[0], ppid=int(fields[1]), start_ticks=int(fields[19]))


def _started_at(start_ticks: int) -> str:
    boot = next(
        int(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime ")
    )
    seconds = boot + start_ticks / os.sysconf("SC_CLK_TCK")
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat(timespec="seconds")


def describe_process(pid: int) -> tuple[str, str, int] | None:
    """(user, command line, start ticks) of a live process, None when it is gone."""
    stat = read_stat(pid)
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if stat is None:
        return None
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:  # uid without a passwd entry (containers): show the number
        user = str(uid)
    command = raw.replace(b"\0", b" ").decode(errors="replace").strip() or f"[{comm}]"
    return user, command, stat.start_ticks


def scan_with_fuser(paths: list[str]) -> dict[int, set[str]]:
    """pid -> device files it has open or mapped, from `fuser` (psmisc), one file at a time.

    With or without -v, fuser prints the pids on stdout and everything else (file names,
    access letters, the -v table, "Cannot stat /proc/1/fd/0" for processes it may not
    inspect) on stderr; exit 1 means nobody holds the file.
    """
    fuser = shutil.which("fuser")
    if fuser is None:
        raise GpuCleanupError("holder_scan='fuser' but fuser is not installed (Debian: psmisc); "
                              "set holder_scan='proc' or 'auto'")
    held: dict[int, set[str]] = {}
    for path in paths:
        done = subprocess.run([fuser, path], capture_output=True, text=True, check=False)
        if done.returncode not in (0, 1):
            raise GpuCleanupError(f"fuser {path} failed (exit {done.returncode}): "
                                  f"{done.stderr.strip()[-500:]}")
        for pid in re.findall(r"\d+", done.stdout):
            held.setdefault(int(pid), set()).add(path)
    return held


def _held_by(pid: int, wanted: dict[str, str]) -> set[str]:
    """Which wanted files (real path -> name) pid has open (fd) or mapped (maps)."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:  # closed since listdir
                continue
            if target in wanted:
                found.add(wanted[target])
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5] in wanted:
                found.add(wanted[parts[5]])
    except (FileNotFoundError, ProcessLookupError):  # the process exited meanwhile
        return set()
    except PermissionError:  # another user's process: fuser cannot see it either
        return found
    return found


def scan_with_proc(paths: list[str]) -> dict[int, set[str]]:
    """pid -> device files it has open or mapped, from /proc (same answer as fuser)."""
    wanted = {os.path.realpath(path): path for path in paths}
    held: dict[int, set[str]] = {}
    if not wanted:
        return held
    for name in os.listdir("/proc"):
        if name.isdigit():
            files = _held_by(int(name), wanted)
            if files:
                held[int(name)] = files
    return held


def discover_holders(
    device_glob: str, holder_scan: str = "auto", nvml: NvmlLike | None = None
) -> tuple[GpuHolder, ...]:
    """Every process holding a device file matching device_glob or listed by NVML, by pid.

    holder_scan: "fuser", "proc", or "auto" (fuser when installed, else the /proc scan).
    """
    paths = sorted(glob(device_glob))
    use_fuser = holder_scan == "fuser" or (holder_scan == "auto" and shutil.which("fuser"))
    files = scan_with_fuser(paths) if use_fuser else scan_with_proc(paths)
    gpus: dict[int, set[int]] = {}
    memory: dict[int, int] = {}
    for index in range(nvml.device_count() if nvml is not None else 0):
        for proc in nvml.processes(index):
            gpus.setdefault(proc.pid, set()).add(index)
            if proc.used_bytes is not None:
                memory[proc.pid] = memory.get(proc.pid, 0) + proc.used_bytes // MIB
    holders = []
    for pid in sorted(files.keys() | gpus.keys()):
        info = describe_process(pid)
        if info is None and pid in files:
            continue  # held a device file a moment ago and has exited since
        # NVML may list pids this namespace cannot see (another container's): keep them,
        # unnamed, so the report shows who holds the memory.
        user, command, ticks = info or ("?", "?", None)
        holders.append(GpuHolder(
            pid=pid, user=user, command=command, start_ticks=ticks,
            started_at=_started_at(ticks) if ticks is not None else None,
            device_files=tuple(sorted(files.get(pid, ()))), gpus=tuple(sorted(gpus.get(pid, ()))),
            gpu_memory_mib=memory.get(pid),
        ))
    return tuple(holders)


# ---------------------------------------------------------------- memory


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

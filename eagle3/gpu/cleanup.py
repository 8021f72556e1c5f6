"""GPU hygiene: find the processes holding the GPUs, stop those the policy allows, prove it.

`cleanup_gpus(config, run_dir)` is the gpu_cleanup stage:

1. discover holders: processes with a device file matching `device_glob` open or mapped
   (`fuser` when installed, else a /proc/<pid>/fd + /proc/<pid>/maps scan: the same
   answer), plus the processes NVML lists on each GPU;
2. decide per holder with the policy (`mode`): "own" = only processes this pipeline started
   and recorded with `register_own_process` (pid + start time, so a reused PID is never
   taken for ours); "match" = command line matches `match_patterns`; "all" = everything
   (needs `allow_all`). PID 1, this process and its ancestors are never touched, and
   neither is a pid that only NVML lists (inside a container NVML may give host pids,
   which name other processes here);
3. stop: SIGTERM, wait `grace_seconds`, SIGKILL, and wait until each is gone (reaped with
   waitpid when it is our child, else polled in /proc);
4. verify: poll NVML until each GPU's used memory is under its threshold (see
   `eagle3.gpu.nvml`), else raise GpuBusyError naming what still holds the GPUs.

A process is identified by (pid, start ticks): field 22 of /proc/<pid>/stat, clock ticks
since boot, which differs when a PID has been reused. Without an NVIDIA driver, steps 1-3
still run on the device files; step 4 is skipped and the report says "no NVIDIA driver"
(or GpuDriverError when `require_gpus`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import signal
import tempfile
import time
from dataclasses import dataclass
from glob import glob
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from eagle3.gpu.nvml import (
    GpuCleanupError,
    GpuHolder,
    MIB,
    GpuMemory,
    NvmlLike,
    NvmlUnavailableError,
    describe_process,
    discover_holders,
    idle_thresholds_mib,
    memory_snapshot,
    open_nvml,
    read_stat,
    wait_until_free,
)
from eagle3.gpu.report import CleanupReport, Outcome, ProcessAction, cell, format_report_table

__all__ = [
    "CleanupReport", "GpuBusyError", "GpuCleanupConfig", "GpuCleanupError", "GpuDriverError",
    "GpuHolder", "OwnProcess", "ProcessAction", "cleanup_gpus", "decide", "discover_holders",
    "format_report_table", "load_own_processes", "protected_pids", "register_own_process",
    "stop_processes",
]

OWN_PROCESSES_FILE = "gpu_own_processes.json"
DEFAULT_MATCH_PATTERNS = ("vllm", "VLLM::EngineCore", "VLLM::Worker", "eagle3")


class GpuDriverError(GpuCleanupError):
    """GPUs are required (require_gpus=True) but there is no NVIDIA driver or no GPU."""


class GpuBusyError(GpuCleanupError):
    """GPU memory stayed above the threshold; `report` and `remaining` say who holds it."""

    def __init__(self, message: str, report: CleanupReport, remaining: tuple[GpuHolder, ...]):
        super().__init__(message)
        self.report = report
        self.remaining = remaining


class GpuCleanupConfig(BaseModel):
    """Which GPU holders may be stopped, how, and when the GPUs count as free."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["own", "match", "all"] = Field(
        "own",
        description="own: only processes this pipeline registered in the run dir; match: "
        "command lines matching match_patterns; all: every holder (needs allow_all).",
    )
    dry_run: bool = Field(False, description="Report what would be stopped; signal nothing.")
    device_glob: str = Field(
        "/dev/nvidia[0-9]*", description="Glob of the per-GPU device files whose holders count."
    )
    holder_scan: Literal["auto", "fuser", "proc"] = Field(
        "auto", description="How to find device-file holders: fuser, a /proc scan, or auto "
        "(fuser when installed, else /proc). Both give the same answer.",
    )
    match_patterns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_MATCH_PATTERNS),
        description="Regexes (re.search) on the command line, for mode='match'.",
    )
    allow_all: bool = Field(False, description="Confirms mode='all' (stop every GPU holder).")
    grace_seconds: float = Field(10.0, ge=0, description="Wait after SIGTERM before SIGKILL.")
    kill_wait_seconds: float = Field(
        10.0, gt=0, description="Wait after SIGKILL for the process to be gone."
    )
    threshold_mib: int | None = Field(
        None, ge=0, description="A GPU is free when used MiB <= this; None: its idle baseline "
        "(used memory no process accounts for) plus baseline_margin_mib.",
    )
    baseline_margin_mib: int = Field(
        1024, ge=0, description="Slack over the idle baseline when threshold_mib is None."
    )
    verify_timeout_seconds: float = Field(
        60.0, ge=0, description="How long to poll NVML for the memory to come free."
    )
    poll_interval_seconds: float = Field(0.5, gt=0, description="Polling period (NVML, /proc).")
    require_gpus: bool = Field(
        False, description="Fail when there is no NVIDIA driver/GPU; False lets CPU runs go on."
    )
    stop_warm_engines: bool = Field(
        False, description="Also stop live warm engines (eagle3.engine: the target kept loaded for the runs that "
        "attach to it), in any mode; False: they are ours and in use, and left alone (`eagle3 engine stop` stops them).",
    )

    @field_validator("match_patterns")
    @classmethod
    def _patterns_compile(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"match_patterns: {pattern!r} is not a regex ({exc})") from exc
        return patterns

    @model_validator(mode="after")
    def _mode_rules(self) -> GpuCleanupConfig:
        if self.mode == "all" and not self.allow_all:
            raise ValueError(
                "mode='all' stops every process holding a GPU (other users' jobs too) and "
                "needs allow_all=True to confirm; or use mode='own' or mode='match'"
            )
        if self.mode == "match" and not self.match_patterns:
            raise ValueError("mode='match' needs at least one entry in match_patterns")
        return self


@dataclass(frozen=True)
class OwnProcess:
    """A process this pipeline started, as recorded in the run dir."""

    pid: int
    start_ticks: int
    command: str


def protected_pids() -> dict[int, str]:
    """Pids never stopped in any mode, with the reason: kernel, PID 1, us, our ancestors."""
    protected = {0: "the kernel", 1: "PID 1 (init)", os.getpid(): "this process"}
    pid = os.getppid()
    while pid > 1 and pid not in protected:
        protected[pid] = "an ancestor of this process"
        stat = read_stat(pid)
        pid = stat.ppid if stat else 0
    return protected


# ---------------------------------------------------------------- own processes


def load_own_processes(run_dir: Path) -> dict[int, OwnProcess]:
    """The processes recorded by register_own_process in run_dir (empty when none)."""
    path = Path(run_dir) / OWN_PROCESSES_FILE
    if not path.exists():
        return {}
    try:
        records = [OwnProcess(**r) for r in json.loads(path.read_text())["processes"]]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise GpuCleanupError(
            f"{path} is not a valid record of this pipeline's processes ({exc}); "
            "delete it (processes it listed will then count as strangers)"
        ) from exc
    return {r.pid: r for r in records}


def register_own_process(run_dir: Path, pid: int) -> OwnProcess:
    """Record that this pipeline started `pid` (with its start time) in run_dir."""
    info = describe_process(pid)
    if info is None:
        raise GpuCleanupError(f"register_own_process: pid {pid} is not running (no /proc/{pid})")
    record = OwnProcess(pid=pid, start_ticks=info[2], command=info[1])
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / f"{OWN_PROCESSES_FILE}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent registrations must not lose records
        records = load_own_processes(run_dir)
        records[pid] = record
        body = {"processes": [dataclasses.asdict(r) for r in records.values()]}
        with tempfile.NamedTemporaryFile("w", dir=run_dir, delete=False, suffix=".tmp") as tmp:
            json.dump(body, tmp, indent=1)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp.name, run_dir / OWN_PROCESSES_FILE)
    return record


# ---------------------------------------------------------------- policy


def decide(
    holder: GpuHolder,
    config: GpuCleanupConfig,
    own: dict[int, OwnProcess],
    protected: dict[int, str],
    warm: dict[int, str] | None = None,
) -> tuple[bool, str]:
    """(may stop it?, why) for one holder under the policy. `warm`: pids of live warm engines (and their
    workers) with why they are left alone (eagle3.engine.registry.in_use_pids)."""
    if holder.pid in protected:
        return False, f"protected: {protected[holder.pid]}"
    if warm and holder.pid in warm:
        if config.stop_warm_engines:
            return True, "a live warm engine of this pipeline (stop_warm_engines=True)"
        return False, warm[holder.pid]
    if holder.start_ticks is None or not holder.device_files:
        return False, ("listed by NVML only, holds no device file here (may be another "
                       "container's pid): left alone")
    if config.mode == "own":
        record = own.get(holder.pid)
        if record is None:
            return False, "not started by this pipeline (mode 'own'; see mode='match')"
        if record.start_ticks != holder.start_ticks:
            return False, (f"PID reused: recorded start {record.start_ticks} ticks, this "
                           f"process started at {holder.start_ticks}; not ours")
        return True, "started by this pipeline (registered in the run dir)"
    if config.mode == "match":
        for pattern in config.match_patterns:
            if re.search(pattern, holder.command):
                return True, f"command line matches {pattern!r}"
        return False, "command line matches none of match_patterns"
    return True, "mode 'all' (allow_all=True)"


# ---------------------------------------------------------------- stopping


def _is_gone(holder: GpuHolder) -> bool:
    """Exited (reaped here when it is our child) or its pid now names another process."""
    try:
        if os.waitpid(holder.pid, os.WNOHANG)[0] == holder.pid:
            return True
    except ChildProcessError:  # not our child: its own parent reaps it
        pass
    stat = read_stat(holder.pid)
    return stat is None or stat.start_ticks != holder.start_ticks or stat.state in "ZX"


def _open_pidfd(pid: int) -> int | None:
    """A pidfd pins this very process, so a signal cannot hit a reused pid; None: none."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:  # already gone: _is_gone says so next
        return None
    except (AttributeError, OSError):  # no pidfd (kernel < 5.3): os.kill after the checks
        return None


def _send(targets: list[GpuHolder], pidfds: dict[int, int | None], sig: signal.Signals,
          results: dict[int, tuple[Outcome, str]]) -> None:
    """Send sig to each target without a result yet; record those it could not reach."""
    for holder in targets:
        if holder.pid in results:
            continue
        try:
            fd = pidfds.get(holder.pid)
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(holder.pid, sig)
        except ProcessLookupError:  # exited since the last look
            _is_gone(holder)  # reaps it when it is our child
            results[holder.pid] = (("already-gone", "exited before SIGTERM")
                                   if sig == signal.SIGTERM else
                                   ("terminated", "exited after SIGTERM, just past the grace"))
        except PermissionError:
            results[holder.pid] = ("failed", f"not permitted to send {sig.name} "
                                   "(run as its owner or root)")


def _wait_gone(pending: list[GpuHolder], seconds: float, poll: float) -> set[int]:
    """Wait up to `seconds` for the pending processes to go; the pids that went."""
    gone: set[int] = set()
    deadline = time.monotonic() + seconds
    while True:
        gone |= {h.pid for h in pending if h.pid not in gone and _is_gone(h)}
        if len(gone) == len(pending) or time.monotonic() >= deadline:
            return gone
        time.sleep(poll)


def stop_processes(
    targets: list[GpuHolder], grace_seconds: float, kill_wait_seconds: float, poll: float = 0.05
) -> list[ProcessAction]:
    """SIGTERM all, wait grace, SIGKILL the rest, wait until gone; one action per target.

    All targets share one grace period (eight TP workers wait `grace_seconds`, not 8x).
    """
    results: dict[int, tuple[Outcome, str]] = {}
    pidfds: dict[int, int | None] = {}
    try:
        for holder in targets:
            pidfds[holder.pid] = _open_pidfd(holder.pid)
            if _is_gone(holder):  # checked after opening the pidfd: it names this process
                results[holder.pid] = ("already-gone", "exited (or pid reused) before SIGTERM")
        for sig, wait, outcome in ((signal.SIGTERM, grace_seconds, "terminated"),
                                   (signal.SIGKILL, kill_wait_seconds, "killed")):
            _send(targets, pidfds, sig, results)
            pending = [h for h in targets if h.pid not in results]
            for pid in _wait_gone(pending, wait, poll):
                results[pid] = (outcome, f"exited within {wait:g}s of {sig.name}")
    finally:
        for fd in pidfds.values():
            if fd is not None:
                os.close(fd)
    for holder in targets:
        results.setdefault(holder.pid, ("failed", f"still alive {kill_wait_seconds:g}s after "
                                        "SIGKILL (uninterruptible sleep, e.g. in the driver?)"))
    return [ProcessAction(h.pid, h.command, *results[h.pid]) for h in targets]


# ---------------------------------------------------------------- the stage


def _busy_message(after: tuple[GpuMemory, ...], remaining: tuple[GpuHolder, ...],
                  config: GpuCleanupConfig, warm: dict[int, str]) -> str:
    gpus = "; ".join(f"GPU {g.index}: {g.used_mib} MiB used > threshold {g.threshold_mib} MiB"
                     for g in after if g.over_threshold)
    holders = "; ".join(
        f"pid {h.pid} ({h.user}, {'?' if h.gpu_memory_mib is None else h.gpu_memory_mib} MiB "
        f"on {','.join(h.devices)}): {cell(h.command)}" for h in remaining
    ) or "none visible from here"
    return (f"GPU memory still in use after {config.verify_timeout_seconds:g}s "
            f"(verify_timeout_seconds): {gpus}. Holders: {holders}. Stop them, or set "
            "mode='match' (match_patterns) or mode='all' with allow_all=True, or raise "
            "threshold_mib." + "".join(f" pid {h.pid} is {warm[h.pid]}." for h in remaining if h.pid in warm))


def cleanup_gpus(
    config: GpuCleanupConfig, run_dir: Path, nvml: NvmlLike | None = None, warm: dict[int, str] | None = None
) -> CleanupReport:
    """Find GPU holders, stop those the policy allows, verify the memory is free.

    nvml None: the real driver (pynvml). Raises GpuBusyError when memory stays above the
    threshold, GpuDriverError when require_gpus and there is no driver or GPU. `warm`: the pids of
    live warm engines, left alone unless config.stop_warm_engines (see decide).
    """
    opened = None
    driver_note = ""
    if nvml is None:
        try:
            nvml = opened = open_nvml()
        except NvmlUnavailableError as exc:
            if config.require_gpus:
                raise GpuDriverError(f"{exc}. require_gpus=True needs an NVIDIA driver and "
                                     "GPUs; set require_gpus=False to run on the CPU") from exc
            driver_note = str(exc)
    try:
        return _cleanup(config, Path(run_dir), nvml, driver_note, warm or {})
    finally:
        if opened is not None:
            opened.close()


def warm_engine_mib(nvml: NvmlLike, gpus: tuple[GpuMemory, ...], kept: set[int]) -> dict[int, int | None]:
    """MiB per GPU held by the live warm engines left alone (`kept`: their pids and their workers'): not counted
    against the threshold, since a run attaches to them (the memory is the target it would load). None: NVML does
    not say how much a kept engine uses on that GPU, so that GPU's memory cannot be verified."""
    held: dict[int, int | None] = {}
    for gpu in gpus:
        procs = [p for p in nvml.processes(gpu.index) if p.pid in kept]
        if procs:
            held[gpu.index] = None if any(p.used_bytes is None for p in procs) else sum(p.used_bytes for p in procs) // MIB
    return held


def _cleanup(config: GpuCleanupConfig, run_dir: Path, nvml: NvmlLike | None,
             driver_note: str, warm: dict[int, str]) -> CleanupReport:
    before: tuple[GpuMemory, ...] = ()
    if nvml is not None:
        before = memory_snapshot(nvml)
        if not before and config.require_gpus:
            raise GpuDriverError("NVML sees no GPU; require_gpus=True needs at least one "
                                 "(set require_gpus=False to run on the CPU)")
        thresholds = ({g.index: config.threshold_mib for g in before}
                      if config.threshold_mib is not None
                      else idle_thresholds_mib(nvml, before, config.baseline_margin_mib))
        before = tuple(dataclasses.replace(g, threshold_mib=thresholds[g.index]) for g in before)
    holders = discover_holders(config.device_glob, config.holder_scan, nvml)
    own, protected = load_own_processes(run_dir), protected_pids()
    targets, actions, kept_warm = [], [], set()
    for holder in holders:
        allowed, reason = decide(holder, config, own, protected, warm)
        if not allowed:
            actions.append(ProcessAction(holder.pid, holder.command, "skipped-by-policy", reason))
            if holder.pid in warm:
                kept_warm.add(holder.pid)
        elif config.dry_run:
            actions.append(ProcessAction(holder.pid, holder.command, "dry-run",
                                         f"would stop ({reason}): SIGTERM, SIGKILL after "
                                         f"{config.grace_seconds:g}s"))
        else:
            targets.append(holder)
    actions += stop_processes(targets, config.grace_seconds, config.kill_wait_seconds)
    after, verified, warm_mib = (), False, {}
    if nvml is not None:
        thresholds = {g.index: g.threshold_mib for g in before}
        warm_mib = warm_engine_mib(nvml, before, kept_warm)
        thresholds = {i: None if warm_mib.get(i, 0) is None else t + warm_mib.get(i, 0) for i, t in thresholds.items()}
        if config.dry_run:
            after = memory_snapshot(nvml, thresholds)
            verified = not any(g.over_threshold for g in after)
        else:
            after, verified = wait_until_free(nvml, thresholds, config.verify_timeout_seconds,
                                              config.poll_interval_seconds)
    report = CleanupReport(
        mode=config.mode, dry_run=config.dry_run, driver_present=nvml is not None,
        driver_note=driver_note, device_files=tuple(sorted(glob(config.device_glob))),
        holders=holders, actions=tuple(sorted(actions, key=lambda a: a.pid)),
        memory_before=before, memory_after=after, memory_verified=verified,
        warm_engine_mib=tuple(sorted(warm_mib.items())),
    )
    if nvml is not None and not config.dry_run and not verified:
        # This process holds /dev/nvidia* through NVML itself; name it only if it uses memory.
        remaining = tuple(h for h in discover_holders(config.device_glob, config.holder_scan, nvml)
                          if h.pid != os.getpid() or h.gpus)
        raise GpuBusyError(_busy_message(after, remaining, config, warm), report, remaining)
    return report

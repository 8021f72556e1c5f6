"""GPU cleanup with real processes and real signals.

Temp files named like /dev/nvidia0 stand in for the GPU device files: child processes
(python) open or mmap them, and cleanup finds them with fuser or the /proc scan and stops
them with real SIGTERM/SIGKILL. There is no NVIDIA driver here, so the NVML side is played
by `FakeNvml` (tests only), whose memory is held by those real processes; the no-driver
tests use the real pynvml. Every process a test starts is killed and reaped at teardown.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pydantic import ValidationError

from eagle3.gpu.cleanup import (
    OWN_PROCESSES_FILE,
    GpuBusyError,
    GpuCleanupConfig,
    GpuDriverError,
    cleanup_gpus,
    discover_holders,
    format_report_table,
    register_own_process,
)
from eagle3.gpu.nvml import (
    MIB,
    DeviceMemory,
    NvmlProcess,
    idle_thresholds_mib,
    memory_snapshot,
    open_nvml,
    read_stat,
)

REPO = Path(__file__).resolve().parents[2]

# Holds a device file until killed. argv: path(s, comma-separated), how, tag.
HOLDER = r"""
import ctypes, signal, sys, time
paths, how = sys.argv[1].split(","), sys.argv[2]
if "ignore-term" in how:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
held = [open(p, "r+b") for p in paths]
if "mmap" in how:  # keep only a mapping, no open fd (Python's mmap keeps a dup: use libc's)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    for f in held:  # PROT_READ=1, MAP_SHARED=1
        assert libc.mmap(None, 4096, 1, 1, f.fileno(), 0) != ctypes.c_void_p(-1).value
        f.close()
print("ready", flush=True)
while True:
    time.sleep(60)
"""

# Starts a HOLDER as ITS child (so the holder is not ours) and waits for it.
FORKER = r"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
child.wait()
"""


def alive(pid: int, start_ticks: int) -> bool:
    stat = read_stat(pid)
    return stat is not None and stat.start_ticks == start_ticks and stat.state not in "ZX"


@dataclass
class Proc:
    pid: int
    start_ticks: int
    popen: subprocess.Popen | None  # None: not our child


@dataclass
class Spawner:
    """Starts holder processes and kills + reaps all of them at teardown."""

    tag: str = field(default_factory=lambda: f"eagle3-gpu-test-{uuid.uuid4().hex[:8]}")
    procs: list[Proc] = field(default_factory=list)
    popens: list[subprocess.Popen] = field(default_factory=list)

    def _popen(self, argv: list[str]) -> tuple[subprocess.Popen, str]:
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        self.popens.append(popen)
        line = popen.stdout.readline().strip()
        if line == "no-cuda":
            pytest.skip("torch in this environment cannot use CUDA")
        assert line.endswith("ready"), f"holder did not start: {line!r}"
        return popen, line

    def python(self, code: str, *args: str) -> Proc:
        popen, _ = self._popen([sys.executable, "-c", code, *args, self.tag])
        proc = Proc(popen.pid, read_stat(popen.pid).start_ticks, popen)
        self.procs.append(proc)
        return proc

    def holder(self, *paths: Path, how: str = "open") -> Proc:
        return self.python(HOLDER, ",".join(str(p) for p in paths), how)

    def grandchild(self, *paths: Path) -> Proc:
        """A holder whose parent is a child of ours: signalled, but reaped by its parent."""
        joined = ",".join(str(p) for p in paths)
        _, line = self._popen([sys.executable, "-c", FORKER, HOLDER, joined, "open", self.tag])
        pid = int(line.split()[0])
        proc = Proc(pid, read_stat(pid).start_ticks, None)
        self.procs.insert(0, proc)  # killed before its parent at teardown
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.popen is None and alive(proc.pid, proc.start_ticks):
                os.kill(proc.pid, signal.SIGKILL)
        for popen in self.popens:
            popen.kill()  # no-op when already reaped (by cleanup or here)
            popen.wait(timeout=10)
            popen.stdout.close()


@pytest.fixture
def spawn():
    spawner = Spawner()
    try:
        yield spawner
    finally:
        spawner.close()


@pytest.fixture
def devices(tmp_path: Path) -> list[Path]:
    """Two stand-ins for /dev/nvidia0 and /dev/nvidia1 (non-empty, so they can be mapped)."""
    paths = [tmp_path / "dev" / f"nvidia{i}" for i in range(2)]
    paths[0].parent.mkdir()
    for path in paths:
        path.write_bytes(b"\0" * 4096)
    return paths


def config(devices: list[Path], **changes: object) -> GpuCleanupConfig:
    fast = dict(grace_seconds=2.0, kill_wait_seconds=5.0, verify_timeout_seconds=2.0,
                poll_interval_seconds=0.02)
    glob = str(devices[0].parent / "nvidia[0-9]*")
    return GpuCleanupConfig(device_glob=glob, **{**fast, **changes})


def outcomes(report) -> dict[int, str]:
    return {a.pid: a.outcome for a in report.actions}


def reasons(report) -> dict[int, str]:
    return {a.pid: a.reason for a in report.actions}


class FakeNvml:
    """FAKE NVML (tests only: no NVIDIA driver here). GPU memory is held by real processes.

    A GPU uses `idle_mib` plus the memory of each listed process while that process runs,
    and for `release_after_polls` more memory() calls after it is gone (a driver frees a
    dead process's memory a little late). Processes that are gone are no longer listed.
    """

    def __init__(self, total_mib: list[int], idle_mib: int = 300,
                 release_after_polls: int = 0) -> None:
        self.total_mib, self.idle_mib, self.release_after = total_mib, idle_mib, release_after_polls
        self.procs: dict[int, list[tuple[Proc, int | None]]] = {i: [] for i in
                                                                range(len(total_mib))}
        self.polls = 0
        self.gone_at: dict[int, int] = {}

    def hold(self, gpu: int, proc: Proc, mib: int | None) -> None:
        self.procs[gpu].append((proc, mib))

    def device_count(self) -> int:
        return len(self.total_mib)

    def memory(self, index: int) -> DeviceMemory:
        self.polls += 1
        used = self.idle_mib
        for proc, mib in self.procs[index]:
            if not alive(proc.pid, proc.start_ticks):
                self.gone_at.setdefault(proc.pid, self.polls)
            if self.polls - self.gone_at.get(proc.pid, self.polls) <= self.release_after:
                used += mib or 0
        return DeviceMemory(used_bytes=used * MIB, total_bytes=self.total_mib[index] * MIB)

    def processes(self, index: int) -> list[NvmlProcess]:
        return [NvmlProcess(p.pid, None if mib is None else mib * MIB)
                for p, mib in self.procs[index] if alive(p.pid, p.start_ticks)]


# ---------------------------------------------------------------- discovery


def test_fuser_and_proc_scan_find_the_same_holders(spawn, devices):
    a = spawn.holder(devices[0])
    b = spawn.holder(devices[1], how="mmap")  # mapped only: no open fd
    c = spawn.holder(devices[0], devices[1])
    fds_of_b = [os.readlink(f"/proc/{b.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{b.pid}/fd")]
    assert str(devices[1]) not in fds_of_b  # b holds the file by its mapping alone
    glob = config(devices).device_glob
    by_proc = discover_holders(glob, holder_scan="proc")
    assert {h.pid: h.device_files for h in by_proc} == {
        a.pid: (str(devices[0]),), b.pid: (str(devices[1]),), c.pid: tuple(map(str, devices)),
    }
    me = pwd.getpwuid(os.getuid()).pw_name
    for holder, proc in zip(by_proc, sorted([a, b, c], key=lambda p: p.pid)):
        assert holder.user == me and spawn.tag in holder.command
        assert holder.start_ticks == proc.start_ticks and holder.started_at is not None
    if shutil.which("fuser") is None:
        pytest.skip("fuser (psmisc) is not installed: only the /proc scan was checked")
    assert discover_holders(glob, holder_scan="fuser") == by_proc
    assert discover_holders(glob, holder_scan="auto") == by_proc


# ---------------------------------------------------------------- stopping


def test_sigterm_then_sigkill_for_a_process_that_ignores_sigterm(spawn, devices, tmp_path):
    polite = spawn.holder(devices[0])
    stubborn = spawn.holder(devices[0], how="ignore-term")
    # the fast config's 2 s of grace: the polite one must be gone within it to count as terminated (0.3 s could
    # pass on a loaded 2-core machine before it was scheduled to die)
    cfg = config(devices, mode="match", match_patterns=[spawn.tag])
    started = time.monotonic()
    report = cleanup_gpus(cfg, tmp_path, nvml=FakeNvml([80_000]))
    assert outcomes(report) == {polite.pid: "terminated", stubborn.pid: "killed"}
    assert time.monotonic() - started >= cfg.grace_seconds  # the stubborn one had its grace period
    assert read_stat(polite.pid) is None and read_stat(stubborn.pid) is None  # reaped


def test_a_process_that_is_not_our_child_is_stopped_and_waited_for(spawn, devices, tmp_path):
    grandchild = spawn.grandchild(devices[0])
    cfg = config(devices, mode="match", match_patterns=[spawn.tag])
    report = cleanup_gpus(cfg, tmp_path, nvml=FakeNvml([80_000]))
    assert outcomes(report) == {grandchild.pid: "terminated"}
    assert not alive(grandchild.pid, grandchild.start_ticks)


def test_mode_own_stops_registered_processes_and_leaves_strangers_alone(spawn, devices, tmp_path):
    ours = spawn.holder(devices[0])
    stranger = spawn.holder(devices[0])
    register_own_process(tmp_path, ours.pid)
    report = cleanup_gpus(config(devices), tmp_path, nvml=FakeNvml([80_000]))
    assert outcomes(report) == {ours.pid: "terminated", stranger.pid: "skipped-by-policy"}
    assert "not started by this pipeline" in reasons(report)[stranger.pid]
    assert alive(stranger.pid, stranger.start_ticks)
    assert not alive(ours.pid, ours.start_ticks)


def test_mode_own_leaves_a_live_warm_engine_unless_asked_and_stops_a_dead_ones_leftovers(spawn, devices, tmp_path):
    import socket

    from eagle3.engine.registry import home_for, in_use_pids, write_info

    engine, leftover = spawn.holder(devices[0]), spawn.holder(devices[0])
    for proc in (engine, leftover):
        register_own_process(tmp_path, proc.pid)  # the runs that started them recorded them as their own
    home = home_for(tmp_path / "cache", "f" * 20)
    write_info(home, {"pid": engine.pid, "start_ticks": engine.start_ticks, "host": socket.gethostname(), "ready": True,
                      "spec": {"model_dir": "m"}, "fingerprint": "f" * 20})
    warm = in_use_pids(tmp_path / "cache")  # `leftover` is no live engine's: a dead engine's worker, say
    report = cleanup_gpus(config(devices), tmp_path, nvml=FakeNvml([80_000]), warm=warm)
    assert outcomes(report) == {engine.pid: "skipped-by-policy", leftover.pid: "terminated"}
    assert "live warm engine" in reasons(report)[engine.pid] and "eagle3 engine stop" in reasons(report)[engine.pid]
    assert alive(engine.pid, engine.start_ticks)
    report = cleanup_gpus(config(devices, stop_warm_engines=True), tmp_path, nvml=FakeNvml([80_000]), warm=warm)
    assert outcomes(report) == {engine.pid: "terminated"} and not alive(engine.pid, engine.start_ticks)


def test_the_memory_of_a_warm_engine_left_alone_does_not_fail_the_run_that_attaches_to_it(spawn, devices, tmp_path):
    """On a GPU, the warm engine's memory IS the target the retry attaches to: verifying that the GPUs are free
    must not count it (else the retry that should attach fails at gpu_cleanup), while a stranger's memory still
    fails the run, and a GPU whose warm-engine memory NVML does not report is said to be unverified."""
    import socket

    from eagle3.engine.registry import home_for, in_use_pids, write_info

    engine = spawn.holder(devices[0])
    home = home_for(tmp_path / "cache", "e" * 20)
    write_info(home, {"pid": engine.pid, "start_ticks": engine.start_ticks, "host": socket.gethostname(), "ready": True,
                      "spec": {"model_dir": "m"}})
    nvml = FakeNvml([80_000])
    nvml.hold(0, engine, 60_000)
    warm = in_use_pids(tmp_path / "cache")
    report = cleanup_gpus(config(devices, verify_timeout_seconds=0.2), tmp_path, nvml=nvml, warm=warm)
    assert report.memory_verified and outcomes(report) == {engine.pid: "skipped-by-policy"}
    assert report.warm_engine_mib == ((0, 60_000),) and "60000 MiB held by a live warm engine" in report.summary()
    stranger = spawn.holder(devices[0])
    nvml.hold(0, stranger, 2_000)
    with pytest.raises(GpuBusyError, match="live warm engine"):
        cleanup_gpus(config(devices, verify_timeout_seconds=0.2), tmp_path, nvml=nvml, warm=warm)
    unknown = FakeNvml([80_000])
    unknown.hold(0, engine, None)
    report = cleanup_gpus(config(devices, verify_timeout_seconds=0.2), tmp_path, nvml=unknown, warm=warm)
    assert report.warm_engine_mib == ((0, None),) and "an unknown amount held by a live warm engine" in report.summary()
    assert alive(engine.pid, engine.start_ticks)


def test_a_reused_pid_is_never_taken_for_ours(spawn, devices, tmp_path):
    proc = spawn.holder(devices[0])
    register_own_process(tmp_path, proc.pid)
    # Simulate PID reuse: the record is of an earlier process that had this pid.
    record_file = tmp_path / OWN_PROCESSES_FILE
    body = json.loads(record_file.read_text())
    assert body["processes"][0]["start_ticks"] == proc.start_ticks
    body["processes"][0]["start_ticks"] = proc.start_ticks - 500
    record_file.write_text(json.dumps(body))
    report = cleanup_gpus(config(devices), tmp_path, nvml=FakeNvml([80_000]))
    assert outcomes(report) == {proc.pid: "skipped-by-policy"}
    assert "PID reused" in reasons(report)[proc.pid]
    assert alive(proc.pid, proc.start_ticks)


def test_dry_run_kills_nothing_and_says_what_it_would_do(spawn, devices, tmp_path):
    a, b = spawn.holder(devices[0]), spawn.holder(devices[1], how="ignore-term")
    nvml = FakeNvml([80_000, 80_000])
    nvml.hold(0, a, 5000)
    cfg = config(devices, mode="match", match_patterns=[spawn.tag], dry_run=True)
    report = cleanup_gpus(cfg, tmp_path, nvml=nvml)  # memory stays up: no GpuBusyError
    assert outcomes(report) == {a.pid: "dry-run", b.pid: "dry-run"}
    assert all("would stop" in r for r in reasons(report).values())
    assert alive(a.pid, a.start_ticks) and alive(b.pid, b.start_ticks)
    assert not report.memory_verified and report.memory_after[0].used_mib == 5300
    assert "dry run" in report.summary()


RUNNER = r"""
import json, sys
from pathlib import Path
from eagle3.gpu.cleanup import GpuCleanupConfig, cleanup_gpus
from eagle3.gpu.nvml import DeviceMemory

class NoGpuNvmlFake:  # FAKE: a driver with no GPU, so real GPUs play no part
    def device_count(self): return 0

held = open(sys.argv[1], "rb")  # this process holds the device too
config = GpuCleanupConfig(mode="all", allow_all=True, device_glob=sys.argv[2],
                          grace_seconds=2, poll_interval_seconds=0.02)
report = cleanup_gpus(config, Path(sys.argv[3]), nvml=NoGpuNvmlFake())
print(json.dumps(report.to_dict()))
"""


def test_mode_all_never_stops_this_process_or_its_ancestors(spawn, devices, tmp_path):
    sibling = spawn.holder(devices[1])
    with open(devices[0], "rb"):  # this pytest process: the runner's parent
        path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        runner = subprocess.run(
            [sys.executable, "-c", RUNNER, str(devices[0]), config(devices).device_glob,
             str(tmp_path)],
            capture_output=True, text=True, env=env, timeout=60, check=False,
        )
    assert runner.returncode == 0, runner.stderr
    actions = {a["pid"]: a for a in json.loads(runner.stdout)["actions"]}
    assert actions[os.getpid()]["outcome"] == "skipped-by-policy"
    assert actions[os.getpid()]["reason"] == "protected: an ancestor of this process"
    (runner_pid,) = set(actions) - {os.getpid(), sibling.pid}
    assert actions[runner_pid]["reason"] == "protected: this process"
    assert actions[sibling.pid]["outcome"] == "terminated"


def test_config_guards_mode_all_and_bad_patterns(devices):
    with pytest.raises(ValidationError, match=r"mode='all'.*allow_all=True"):
        config(devices, mode="all")
    with pytest.raises(ValidationError, match=r"match_patterns: '\(vllm' is not a regex"):
        config(devices, mode="match", match_patterns=["(vllm"])
    with pytest.raises(ValidationError, match="extra"):
        GpuCleanupConfig(grace=3)


# ---------------------------------------------------------------- verification (FakeNvml)


def test_memory_freed_a_few_polls_after_the_kill_passes(spawn, devices, tmp_path):
    ours = spawn.holder(devices[0])
    register_own_process(tmp_path, ours.pid)
    nvml = FakeNvml([81_000, 81_000], idle_mib=300, release_after_polls=4)
    nvml.hold(0, ours, 5000)
    report = cleanup_gpus(config(devices, baseline_margin_mib=100), tmp_path, nvml=nvml)
    assert outcomes(report) == {ours.pid: "terminated"}
    assert report.memory_verified and nvml.polls - nvml.gone_at[ours.pid] > 4
    # idle baseline: 5300 used - 5000 attributed to processes = 300, + 100 margin
    assert [(g.used_mib, g.threshold_mib) for g in report.memory_before] == [(5300, 400),
                                                                            (300, 400)]
    assert [g.used_mib for g in report.memory_after] == [300, 300]
    assert report.holders[0].gpus == (0,) and report.holders[0].gpu_memory_mib == 5000
    markdown = report.to_markdown()
    assert "| 0 | 5300 | 300 | 400 | 81000 |" in markdown
    assert f"| {ours.pid} |" in markdown and "terminated" in markdown
    table = format_report_table(report)
    assert str(ours.pid) in table and "terminated" in table
    assert json.loads(json.dumps(report.to_dict()))["actions"][0]["outcome"] == "terminated"


def test_memory_that_never_comes_free_raises_gpu_busy_naming_holders(spawn, devices, tmp_path):
    stranger = spawn.holder(devices[0])  # not registered: mode own leaves it running
    nvml = FakeNvml([81_000], idle_mib=300)
    nvml.hold(0, stranger, 5000)
    cfg = config(devices, threshold_mib=1024, verify_timeout_seconds=0.3)
    started = time.monotonic()
    with pytest.raises(GpuBusyError) as caught:
        cleanup_gpus(cfg, tmp_path, nvml=nvml)
    assert time.monotonic() - started >= 0.3
    message = str(caught.value)
    assert "GPU 0: 5300 MiB used > threshold 1024 MiB" in message
    assert f"pid {stranger.pid}" in message and "5000 MiB" in message
    assert "mode='match'" in message  # says which setting to change
    assert [h.pid for h in caught.value.remaining] == [stranger.pid]
    assert outcomes(caught.value.report) == {stranger.pid: "skipped-by-policy"}
    assert alive(stranger.pid, stranger.start_ticks)


def test_idle_baseline_ignores_attribution_when_nvml_cannot_say(spawn, devices):
    proc = spawn.holder(devices[0])
    nvml = FakeNvml([81_000], idle_mib=300)
    nvml.hold(0, proc, None)  # NVML does not report this process's memory
    # Were the unknown memory counted as "idle", a busy GPU would pass; the margin alone is used.
    assert idle_thresholds_mib(nvml, memory_snapshot(nvml), margin_mib=512) == {0: 512}


# ---------------------------------------------------------------- no driver (real pynvml)


def _driver_present() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


no_driver = pytest.mark.skipif(_driver_present(), reason="an NVIDIA driver is present")


@no_driver
def test_without_a_driver_cleanup_goes_on_and_says_so(spawn, devices, tmp_path):
    ours = spawn.holder(devices[0])
    register_own_process(tmp_path, ours.pid)
    report = cleanup_gpus(config(devices), tmp_path)  # the real pynvml
    assert not report.driver_present and report.memory_before == ()
    assert "no NVIDIA driver" in report.driver_note
    assert "no NVIDIA driver" in format_report_table(report)
    assert outcomes(report) == {ours.pid: "terminated"}  # device files are still cleaned


@no_driver
def test_without_a_driver_require_gpus_fails_clearly(spawn, devices, tmp_path):
    ours = spawn.holder(devices[0])
    register_own_process(tmp_path, ours.pid)
    with pytest.raises(GpuDriverError, match=r"no NVIDIA driver.*require_gpus=False"):
        cleanup_gpus(config(devices, require_gpus=True), tmp_path)
    assert alive(ours.pid, ours.start_ticks)


def test_require_gpus_fails_when_the_driver_sees_no_gpu(spawn, devices, tmp_path):
    ours = spawn.holder(devices[0])
    register_own_process(tmp_path, ours.pid)
    with pytest.raises(GpuDriverError, match=r"NVML sees no GPU.*require_gpus=False"):
        cleanup_gpus(config(devices, require_gpus=True), tmp_path, nvml=FakeNvml([]))
    assert alive(ours.pid, ours.start_ticks)


# ---------------------------------------------------------------- a real GPU (skipped here)

CUDA_HOLDER = r"""
import sys, time, torch
if not torch.cuda.is_available():
    print("no-cuda", flush=True)
    sys.exit(0)
held = torch.empty(int(sys.argv[1]) * 2**20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    time.sleep(60)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not _driver_present(), reason="needs an NVIDIA driver and a GPU")
def test_real_gpu_memory_of_our_process_is_freed_and_proven_free(spawn, tmp_path):
    pytest.importorskip("torch")
    ours = spawn.python(CUDA_HOLDER, "4096")  # 4 GiB on GPU 0
    register_own_process(tmp_path, ours.pid)
    cfg = GpuCleanupConfig(grace_seconds=10, verify_timeout_seconds=60, poll_interval_seconds=0.2)
    with open_nvml() as nvml:
        report = cleanup_gpus(cfg, tmp_path, nvml=nvml)
    assert outcomes(report)[ours.pid] == "terminated"
    holder = next(h for h in report.holders if h.pid == ours.pid)
    assert any(f.startswith("/dev/nvidia") for f in holder.device_files)
    assert report.driver_present and report.memory_verified
    before, after = report.memory_before[0], report.memory_after[0]
    assert before.used_mib - after.used_mib >= 4096
    assert after.used_mib <= after.threshold_mib


@pytest.mark.gpu
@pytest.mark.skipif(not _driver_present(), reason="needs an NVIDIA driver and a GPU")
def test_doctor_names_the_gpus_torch_sees():
    """`eagle3 doctor` on a GPU machine: its gpu line names the GPUs (from NVML) that torch sees, with the driver."""
    import torch

    out = subprocess.run([sys.executable, "-m", "flows.cli", "doctor"], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2], env=os.environ.copy())
    (line,) = [row for row in out.stdout.splitlines() if row[3:].split()[:1] == ["gpu"]]
    assert line.startswith("ok ") and torch.cuda.get_device_name(0) in line and "driver " in line, out.stdout
    names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    if "CUDA_VISIBLE_DEVICES" not in os.environ and len(names) == 1:  # NVML counts every GPU, torch the visible ones
        assert line[3:].split()[1] == str(torch.cuda.device_count()), line


@pytest.mark.gpu
@pytest.mark.skipif(not _driver_present(), reason="needs an NVIDIA driver and a GPU")
def test_the_cpu_builds_placement_is_refused_on_a_gpu_machine_naming_the_setting(builtin_cache, tmp_path):
    """online.engine_cpus (cores for the engine, CPU build only) set where torch sees GPUs: refused right after
    stage_target, before any engine loads (test_placement checks the same rule with a fake list of GPUs)."""
    from eagle3 import stages
    from eagle3.config import ConfigError, build_config, check_against_target
    from eagle3.data.target import TargetInfo

    config = build_config("tiny", overrides=["train.data=online", "online.engine_cpus=1"])
    target = stages.run_stage_target(config.target, builtin_cache, tmp_path, stages.fingerprint_target(config.target))
    with pytest.raises(ConfigError, match=r"online.engine_cpus=1 places the engine on CPU cores.*leave "
                                          r"online.engine_cpus at 'auto'"):
        check_against_target(config, TargetInfo.read(target.path))

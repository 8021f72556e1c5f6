"""Where a warm engine lives, and how a run finds it: one folder per engine fingerprint.

    <cache_dir>/engines/<engine fingerprint>/     mode 0700
        engine.key     32 random bytes, mode 0600: the authkey of the socket's handshake
        engine.sock    the Unix socket, mode 0600 (a cache dir too long for a socket path: a 0700
                       folder under the temp dir instead, named in engine.json)
        engine.json    pid, host, start ticks, loaded_at, load seconds, preflight, spec, owner
        request.json   what the starter asked for (spec, keep_warm_s, owner), read by the engine
        engine.log     the engine process's own output
        start.lock     held while one process looks for, or starts, this engine

The engine fingerprint is the target fingerprint plus every engine setting that changes what
the engine computes or holds (EngineSpec minus its load log): an engine whose settings differ
lives in another folder and is never attached. An engine is live when its pid runs with the
start time recorded (a reused pid is not it) on this host; the socket answering the key
handshake is checked by the client.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3.artifacts import atomic_write_text
from eagle3.capture.vllm_adapter import EngineSpec
from eagle3.fingerprint import fingerprint
from eagle3.gpu.nvml import read_stat

ENGINE_VERSION = "1"  # bump when the engine's protocol or what it holds changes
KEY_BYTES = 32
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, with its NUL


class EngineRegistryError(RuntimeError):
    """An engine folder that cannot be used safely; the message names the path and the way out."""


def engine_fingerprint(spec: EngineSpec, target_fp: str) -> str:
    """Target fingerprint + every setting of `spec` that changes what the engine computes or holds."""
    settings = {k: v for k, v in dataclasses.asdict(spec).items() if k != "load_log"}
    if settings["devices"] is None:  # target.devices 'auto': the fingerprint engines had before the setting
        del settings["devices"]
    if settings["load_format"] == "auto":  # the weights on disk: the fingerprint engines had before the field
        del settings["load_format"]
    return fingerprint("engine", ENGINE_VERSION, settings, target_fp)


@dataclass(frozen=True)
class EngineHome:
    """The files of one engine (see the module docstring)."""

    folder: Path

    @property
    def key(self) -> Path:
        return self.folder / "engine.key"

    @property
    def info(self) -> Path:
        return self.folder / "engine.json"

    @property
    def request(self) -> Path:
        return self.folder / "request.json"

    @property
    def log(self) -> Path:
        return self.folder / "engine.log"

    @property
    def lock(self) -> Path:
        return self.folder / "start.lock"

    @property
    def fingerprint(self) -> str:
        return self.folder.name

    def socket_path(self) -> Path:
        """engine.sock in the folder, or, when that path is too long for a socket, a 0700 folder in the temp dir."""
        path = self.folder / "engine.sock"
        if len(str(path)) <= MAX_SOCKET_PATH:
            return path
        short = Path(tempfile.gettempdir()) / f"eagle3-engines-{os.getuid()}"
        _private_folder(short)
        return short / f"{self.fingerprint}.sock"


def engines_root(cache_dir: Path) -> Path:
    return Path(cache_dir) / "engines"


def home_for(cache_dir: Path, engine_fp: str) -> EngineHome:
    """The engine's folder (created 0700; refused when another user owns it or others may enter it)."""
    _private_folder(engines_root(cache_dir))
    home = EngineHome(engines_root(cache_dir) / engine_fp)
    _private_folder(home.folder)
    return home


def _private_folder(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    stat = path.stat()
    if stat.st_uid != os.getuid():
        raise EngineRegistryError(f"{path} belongs to uid {stat.st_uid}, not to this user (uid {os.getuid()}); "
                                  "an engine folder must be this user's own: set EAGLE3_CACHE_DIR to a folder of yours")
    if stat.st_mode & 0o077:
        os.chmod(path, 0o700)


def new_key(home: EngineHome) -> bytes:
    """A fresh authkey in engine.key (mode 0600 from its creation: never readable by others)."""
    home.key.unlink(missing_ok=True)
    key = os.urandom(KEY_BYTES)
    fd = os.open(home.key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key)
    return key


def read_key(home: EngineHome) -> bytes | None:
    """The authkey, or None when there is none (or it is readable by others: then it is no secret)."""
    try:
        if home.key.stat().st_mode & 0o077:
            return None
        return home.key.read_bytes()
    except OSError:
        return None


def write_info(home: EngineHome, info: dict) -> None:
    atomic_write_text(home.info, json.dumps(info, indent=1))


def read_info(home: EngineHome) -> dict | None:
    try:
        return json.loads(home.info.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def process_identity(pid: int) -> int | None:
    """The start ticks of `pid` (None when it is not running): a pid and its start time name one process."""
    stat = read_stat(pid)
    return None if stat is None or stat.state in "ZX" else stat.start_ticks


def is_live(info: dict | None) -> bool:
    """Whether the process `info` describes runs (same host, same pid, same start time)."""
    if not info or info.get("host") != socket.gethostname():
        return False
    return process_identity(int(info.get("pid", 0))) == info.get("start_ticks")


def wait_gone(info: dict, timeout_s: float) -> bool:
    """Wait until the engine process `info` describes has exited; False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while is_live(info):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def clear(home: EngineHome) -> None:
    """Remove what a dead engine left: its worker processes, record, socket and key (the log stays, for the reader)."""
    info = read_info(home) or {}
    if info and not is_live(info):
        kill_leftover_workers(info)
    for path in (home.info, home.key, Path(info.get("socket") or home.socket_path())):
        path.unlink(missing_ok=True)


def kill_leftover_workers(info: dict) -> list[int]:
    """SIGKILL the worker processes a dead engine recorded (its TP workers: vLLM's own watch stops them only
    ~10 s after their engine dies, and on a GPU they hold memory until then); a pid that now names another
    process (other start ticks) is left alone. Returns the pids killed."""
    killed = []
    for pid, ticks in info.get("workers") or []:
        if process_identity(int(pid)) == ticks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
    return killed


def clear_dead_engines(cache_dir: Path) -> list[str]:
    """clear() every engine folder whose engine is gone (its workers killed); returns their fingerprints."""
    root = engines_root(cache_dir)
    cleared = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        home = EngineHome(folder)
        info = read_info(home)
        if info and info.get("ready") and not is_live(info):
            clear(home)
            cleared.append(home.fingerprint)
    return cleared


def live_engines(cache_dir: Path) -> list[tuple[EngineHome, dict]]:
    """Every engine of this machine whose process runs, with its record."""
    root = engines_root(cache_dir)
    found = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        home = EngineHome(folder)
        info = read_info(home)
        if info and info.get("ready") and is_live(info):
            found.append((home, info))
    return found


def descendants(pid: int) -> list[int]:
    """`pid`'s child processes and theirs (an engine's TP workers), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = read_stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat.ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def in_use_pids(cache_dir: Path) -> dict[int, str]:
    """Pids of live warm engines and their workers, with why they are left alone (gpu_cleanup)."""
    pids = {}
    for home, info in live_engines(cache_dir):
        why = (f"a live warm engine (engine {home.fingerprint}, pid {info['pid']}): left alone; "
               "stop it with `eagle3 engine stop` or gpu.stop_warm_engines=true")
        for pid in (int(info["pid"]), *descendants(int(info["pid"]))):
            pids[pid] = why
    return pids


@contextlib.contextmanager
def start_lock(home: EngineHome, timeout_s: float) -> Iterator[None]:
    """Hold the folder's start lock (one process at a time looks for or starts this engine)."""
    with open(home.lock, "a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise EngineRegistryError(
                        f"another process has been starting the engine in {home.folder} for over {timeout_s:g} s; "
                        "wait for it, or stop it with `eagle3 engine stop`") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

"""Attach to a warm engine (or start one), and ask it to generate or capture.

`attach_or_start(spec, target_fp, ...)` looks in the engine's folder (eagle3.engine.registry):
a live engine (its pid runs with the recorded start time) is attached through the key
handshake; a record whose process is gone is cleared (socket, record, key) and a fresh engine
is started as `python -m eagle3.engine.server <folder>` in a session of its own (so that a
killed run's process group does not take it along) and waited for until it is ready.

Every wait has a limit: the connect and the key handshake (HANDSHAKE_TIMEOUT_S), the load
(load_timeout_s), and each request, which the engine keeps alive with a heartbeat: silence for
SILENCE_S, or the engine's pid gone, ends the request with EngineGone (a ConnectionError, which
the stage retries count as transient: the retry then loads afresh). A live engine that refuses
our key (a stale key file) is one EngineError naming the pid and the way out.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path

import torch

from eagle3.artifacts import atomic_write_text
from eagle3.capture.tp_capture import shm_dir
from eagle3.capture.vllm_adapter import EngineSpec
from eagle3.engine.registry import (
    EngineHome,
    clear,
    engine_fingerprint,
    home_for,
    is_live,
    new_key,
    process_identity,
    read_info,
    read_key,
    start_lock,
    wait_gone,
)
from eagle3.engine.server import HANDSHAKE_TIMEOUT_S, STATES_PREFIX, set_socket_timeout

DYING_S = 15.0  # a killed engine releasing its memory still shows as running
SILENCE_S = 60.0  # the engine sends a heartbeat every 2 s while it works
POLL_S = 0.5
_REQUESTS = itertools.count()


class EngineError(RuntimeError):
    """A warm engine cannot be used; the message names the engine, the value and the way out."""


class EngineGone(ConnectionError):
    """The engine died or went silent during a request (transient: a retry loads afresh)."""


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class WarmEngine:
    """A connection to one engine process. `generate_ids` for regenerate, `open_source` for extract."""

    def __init__(self, home: EngineHome, conn: Connection, info: dict) -> None:
        self.home, self.conn, self.info = home, conn, info
        self.pid = int(info["pid"])

    @property
    def owner(self) -> str:
        return str(self.info.get("owner", "run"))

    def _request(self, message: tuple, on_progress: Callable[[int], None] | None = None) -> object:
        try:
            self.conn.send(message)
        except (OSError, ValueError) as err:
            raise EngineGone(f"warm engine pid {self.pid} closed its socket ({err}); run again to load afresh") from err
        heard = time.monotonic()
        while True:
            try:
                ready = self.conn.poll(POLL_S)
                reply = self.conn.recv() if ready else None
            except (EOFError, OSError) as err:
                raise EngineGone(f"warm engine pid {self.pid} died during a {message[0]} request (log: {self.home.log}: "
                                 f"{_tail(self.home.log, 3)}); run again to load afresh") from err
            if reply is None:
                if not is_live(self.info):
                    raise EngineGone(f"warm engine pid {self.pid} is gone (log: {self.home.log}); run again to load afresh")
                if time.monotonic() - heard > SILENCE_S:
                    raise EngineGone(f"warm engine pid {self.pid} sent nothing for {SILENCE_S:g} s during a {message[0]} "
                                     f"request; stop it with `eagle3 engine stop` (or kill {self.pid}) and run again")
                continue
            heard = time.monotonic()
            if reply[0] == "progress" and on_progress is not None:
                on_progress(int(reply[1]))
            elif reply[0] == "result":
                return reply[1]
            elif reply[0] == "error":
                raise _remote_error(self.pid, reply[1], reply[2])

    def hello(self, keep_warm_s: float | None) -> dict:
        self.info = self._request(("hello", {"pid": os.getpid(), "keep_warm_s": keep_warm_s})) or self.info
        return self.info

    def generate_ids(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float, top_p: float,
                     seed: int, on_finished: Callable[[int], None] | None = None) -> list[list[int]]:
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
        return self._request(("generate", [list(p) for p in prompts], params), on_finished)

    def generate_seeded(self, prompts: Sequence[Sequence[int]], *, seeds: Sequence[int], max_new_tokens: int,
                        temperature: float, top_p: float, stop_ids: Sequence[int],
                        on_finished: Callable[[int], None] | None = None) -> list[list[int]]:
        """generate_ids with a seed per prompt, stopping at `stop_ids` (eagle3.capture.synthesize: one prefix, many
        prompts)."""
        params = {"seeds": list(seeds), "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                  "stop_ids": list(stop_ids)}
        return self._request(("generate_seeded", [list(p) for p in prompts], params), on_finished)

    def generate_with_images(self, prompts: Sequence[Sequence[int]], *, images: Sequence[Sequence[str]], max_new_tokens: int,
                             temperature: float, top_p: float, seed: int,
                             on_finished: Callable[[int], None] | None = None) -> list[list[int]]:
        """generate_ids for prompts with images: per prompt its image URLs, which the engine (on this host) loads."""
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
                  "images": host_urls(images)}
        return self._request(("generate", [list(p) for p in prompts], params), on_finished)

    def capture(self, prompts: Sequence[Sequence[int]], layer_ids: Sequence[int], hidden_size: int) -> list[torch.Tensor]:
        """Per prompt [T_i, len(layer_ids), H] float32, as views of the shared-memory file the engine wrote."""
        return self._capture(("capture", [list(p) for p in prompts]), layer_ids, hidden_size)[1]

    def capture_images(self, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[str]], layer_ids: Sequence[int],
                       hidden_size: int) -> tuple[list[list[int]], list[torch.Tensor]]:
        """(the ids the engine ran per prompt, its images' placeholders expanded; states as capture's)."""
        return self._capture(("capture_images", [list(p) for p in prompts], host_urls(images)), layer_ids, hidden_size)

    def expand_images(self, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[str]]) -> list[list[int]]:
        """The ids the engine would run per prompt, its images' placeholders expanded by vLLM's processor (no forward)."""
        return self._request(("expand_images", [list(p) for p in prompts], host_urls(images)))

    def _capture(self, head: tuple, layer_ids: Sequence[int],
                 hidden_size: int) -> tuple[list[list[int]] | None, list[torch.Tensor]]:
        """`head`: the request's kind and prompts (and images); (capture_images' expanded ids or None, the states)."""
        _remove_stale_states()
        path = shm_dir() / f"{STATES_PREFIX}{os.getpid()}-{next(_REQUESTS)}"
        try:
            answer = self._request((*head, list(layer_ids), hidden_size, str(path)))
            expanded, lengths = answer if head[0] == "capture_images" else (None, answer)
            n = len(layer_ids)
            flat = torch.from_file(str(path), shared=True, size=sum(lengths) * n * hidden_size, dtype=torch.float32)
        finally:
            path.unlink(missing_ok=True)  # the mapping stays valid; the memory goes with the last view
        return expanded, list(flat.view(sum(lengths), n, hidden_size).split(lengths))

    def open_source(self, hidden_size: int, batch_tokens: int) -> _WarmSource:  # noqa: ARG002 - the engine batches
        return _WarmSource(self, hidden_size)

    def sleep(self, level: int = 1) -> None:
        """vLLM sleep mode (target.sleep_during_train, GPU only): the engine frees the GPUs, the next request wakes it."""
        self._request(("sleep", level))

    def release(self, stop: bool) -> None:
        """Detach (the engine stays warm for its keep_warm_s), or stop it (`stop`). A dead engine: nothing to do."""
        try:
            self._request(("release", stop))
        except (EngineGone, EngineError):
            pass  # gone already: what release asks for is true
        finally:
            self.conn.close()


def host_urls(images: Sequence[Sequence[str]]) -> list[list[str]]:
    """Per prompt its image URLs, a relative file:// path made absolute (the engine's working folder may differ)."""
    return [[f"file://{Path(u.removeprefix('file://')).resolve()}" if u.startswith("file://") else u for u in urls]
            for urls in images]


def _remove_stale_states() -> None:
    """State files of runs killed mid-capture (their pid is gone): nobody will map them again."""
    for path in shm_dir().glob(f"{STATES_PREFIX}*"):
        pid = path.name.removeprefix(STATES_PREFIX).split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and process_identity(int(pid)) is None:
            path.unlink(missing_ok=True)


class _WarmSource:
    """eagle3.capture.source.HiddenStateSource over a warm engine (the capture runs in the engine)."""

    def __init__(self, engine: WarmEngine, hidden_size: int) -> None:
        self.engine, self.hidden_size = engine, hidden_size

    def capture(self, prompts: Sequence[Sequence[int]], layer_ids: Sequence[int]) -> list[torch.Tensor]:
        return self.engine.capture(prompts, layer_ids, self.hidden_size)

    def capture_images(self, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[str]],
                       layer_ids: Sequence[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """eagle3.capture.source.ImageSource: the engine loads the images and expands their placeholders."""
        return self.engine.capture_images(prompts, images, layer_ids, self.hidden_size)

    def close(self) -> None:
        pass  # the engine removes its capture when the run detaches or generates


def _remote_error(pid: int, kind: str, text: str) -> Exception:
    from eagle3.capture.hooks import CaptureError
    from eagle3.capture.vllm_adapter import VllmUnsupported

    if kind in ("EngineDeadError", "EngineGenerateError"):
        return EngineGone(f"warm engine pid {pid}: {kind}: {text}")
    from eagle3.data.images import ImageError

    known = {"CaptureError": CaptureError, "VllmUnsupported": VllmUnsupported, "ValueError": ValueError, "ImageError": ImageError}
    return known.get(kind, RuntimeError)(f"{text} (in warm engine pid {pid}, {kind})")


def connect(home: EngineHome, info: dict, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> WarmEngine:
    """Connect to the engine `info` describes and pass the key handshake (EngineError when it refuses the key)."""
    key = read_key(home)
    if key is None:
        raise EngineError(f"warm engine pid {info.get('pid')}: no private key at {home.key} (missing, or readable by "
                          f"others); stop the engine with `eagle3 engine stop` (or kill {info.get('pid')}) and run again")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(info["socket"]))
    except OSError as err:
        sock.close()
        raise EngineGone(f"warm engine pid {info.get('pid')} does not answer on {info['socket']} ({err})") from err
    sock.setblocking(True)
    conn = Connection(sock.detach())
    set_socket_timeout(conn, timeout_s)
    try:
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
    except AuthenticationError as err:
        conn.close()
        raise EngineError(
            f"warm engine pid {info['pid']} refused the key in {home.key} (a stale key: the file changed after the engine "
            f"started); stop it with `eagle3 engine stop --all` (or kill {info['pid']}) and run again") from err
    except (OSError, EOFError) as err:
        conn.close()
        raise EngineGone(f"warm engine pid {info['pid']} did not finish the key handshake within {timeout_s:g} s ({err})") from err
    set_socket_timeout(conn, 0)
    return WarmEngine(home, conn, info)


def attach_or_start(spec: EngineSpec, target_fp: str, cache_dir: Path, keep_warm_s: float, owner: str = "run",
                    load_timeout_s: float = 7200.0) -> tuple[WarmEngine, dict]:
    """A warm engine for `spec` and what happened: {"event": "attached"|"loaded", ...} (a target_loads line)."""
    fp = engine_fingerprint(spec, target_fp)
    home = home_for(cache_dir, fp)
    with start_lock(home, load_timeout_s):
        info = _wait_loading(home, read_info(home), load_timeout_s)
        if info and info.get("ready") and is_live(info):
            try:
                engine = connect(home, info)
            except EngineGone as err:  # dying, or wedged: a dying one is gone within seconds
                if not wait_gone(info, DYING_S):
                    raise EngineError(f"warm engine pid {info['pid']} runs but does not answer on {info['socket']}; "
                                      f"stop it with `eagle3 engine stop` (or kill {info['pid']}) and run again") from err
            else:
                info = engine.hello(keep_warm_s)
                return engine, {"event": "attached", "model": spec.model_dir, "engine": fp, "engine_pid": engine.pid,
                                "loaded_at": info.get("loaded_at"), "load_seconds": info.get("load_seconds"),
                                "seconds_saved": info.get("load_seconds"), "time": time.time()}
        clear(home)  # a dead engine's socket, record and key
        return _start(home, spec, keep_warm_s, owner, load_timeout_s)


def _wait_loading(home: EngineHome, info: dict | None, timeout_s: float) -> dict | None:
    """An engine still loading (its starter died, or let go of the lock): wait until it is ready or gone."""
    deadline = time.monotonic() + timeout_s
    while info and not info.get("ready") and is_live(info):
        if time.monotonic() > deadline:
            raise EngineError(f"the engine process pid {info['pid']} in {home.folder} has been loading for over "
                              f"{timeout_s:g} s; stop it with `eagle3 engine stop` (or kill {info['pid']})")
        time.sleep(0.2)
        info = read_info(home)
    return info


def _start(home: EngineHome, spec: EngineSpec, keep_warm_s: float, owner: str, load_timeout_s: float) -> tuple[WarmEngine, dict]:
    new_key(home)
    settings = {k: v for k, v in dataclasses.asdict(spec).items() if k != "load_log"}
    atomic_write_text(home.request, json.dumps({"spec": settings, "keep_warm_s": keep_warm_s, "owner": owner}))
    started = time.time()
    with open(home.log, "a") as log:
        process = subprocess.Popen([sys.executable, "-m", "eagle3.engine.server", str(home.folder)], stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=engine_environment(spec))
    deadline = time.monotonic() + load_timeout_s
    while True:
        if process.poll() is not None:
            raise EngineError(f"the engine process for {spec.model_dir} exited with code {process.returncode} while loading; "
                              f"its log {home.log} ends: {_tail(home.log)}")
        info = read_info(home)
        if info and info.get("pid") == process.pid and info.get("ready"):
            break
        if time.monotonic() > deadline:
            process.kill()
            raise EngineError(f"the engine process for {spec.model_dir} (pid {process.pid}) was not ready after "
                              f"{load_timeout_s:g} s; its log: {home.log}")
        time.sleep(0.2)
    engine = connect(home, info)
    engine.hello(keep_warm_s)
    return engine, {"event": "loaded", "model": spec.model_dir, "engine": home.fingerprint, "pid": engine.pid, "warm": True,
                    "seconds": info.get("load_seconds"), "wall_seconds": round(time.time() - started, 2),
                    "preflight": info.get("preflight"), "time": time.time()}


def engine_environment(spec: EngineSpec) -> dict[str, str]:
    """The engine process's environment: this process's, with CUDA_VISIBLE_DEVICES set to target.devices when given
    (eagle3.gpu.devices), so that its ranks take exactly those GPUs."""
    env = dict(os.environ)
    if spec.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.devices
    return env


def stop_engine(home: EngineHome, info: dict, grace_s: float = 20.0) -> str:
    """Stop one engine: asked through its socket, else SIGTERM, else SIGKILL; says how it went."""
    try:
        connect(home, info).release(stop=True)
        how = "stopped"
    except (EngineError, EngineGone):
        os.kill(int(info["pid"]), signal.SIGTERM)
        how = "did not answer: SIGTERM"
    if not wait_gone(info, grace_s):
        os.kill(int(info["pid"]), signal.SIGKILL)
        how += f", SIGKILL after {grace_s:g} s"
        wait_gone(info, 10.0)
    clear(home)
    return how

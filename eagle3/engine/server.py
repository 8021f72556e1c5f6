"""The engine process: the target loaded once in `vllm.LLM`, answering runs over a Unix socket.

    python -m eagle3.engine.server <engine folder>      (started by eagle3.engine.client)

Why a small process of ours around `vllm.LLM`, and not `vllm serve` with a worker extension:
the capture needs the model in the process that runs it (a patched forward and the runner's row
map, eagle3.capture.source; with TP the same in every worker through collective_rpc,
eagle3.capture.tp_capture), exactly as a run does in-process today, so this process runs the very
same code; `vllm serve` would need the capture re-plumbed through dev-mode HTTP endpoints that
are off by default, and its OpenAI API is only generation. The protocol is the standard
library's `multiprocessing.connection` (pickled messages, HMAC challenge with an authkey) over
a Unix socket of mode 0600 in a 0700 folder: no TCP port at all, so nothing listens on any
network address, and a client without the key (engine.key, 0600) is refused at the handshake.

Messages (client -> engine; the engine answers ("result", value) or ("error", kind, text), and
while a request runs sends ("alive",) every HEARTBEAT_S and ("progress", n) as answers finish):

    ("hello", {"pid", "keep_warm_s"})                       -> this engine's record
    ("generate", prompts, {max_new_tokens, temperature, top_p, seed[, images]})  -> token ids per prompt
    ("generate_seeded", prompts, {seeds, max_new_tokens, temperature, top_p, stop_ids})
                                                           -> token ids per prompt, each sampled with its own seed
    ("capture", prompts, layer_ids, hidden_size, path)     -> lengths; the states [sum T, n, H]
                                                               float32 are written into `path`
                                                               (a file in /dev/shm the client maps)
    ("capture_images", prompts, images, layer_ids, hidden_size, path)
                                                           -> (the ids the engine ran per prompt, lengths);
                                                               the states as capture's
    ("expand_images", prompts, images)                     -> the ids the engine would run per prompt
                                                               (vLLM's processor only, no forward)

Images: `images` is, per prompt, the URLs of its images (file:///abs/path or data:image/...;base64), as the
data gives them; the engine runs on the client's host and loads them itself with eagle3.data.images, exactly
as an in-process engine does (eagle3.capture.vllm_images). No pixels cross the socket.
    ("sleep", level)                                       -> None; LLM.sleep(level) (GPU only), woken by the
                                                               next generate or capture (target.sleep_during_train)
    ("release", stop)                                      -> None; stop: the engine then exits

Captured states never cross the socket: the engine writes them into the shared-memory file the
client named and the client maps it (the TP capture's own trick, eagle3.capture.tp_capture).

Lifetime: requests run one at a time in the main thread (the engine is not shared between
threads); each connection has a reader thread. With no client attached for `keep_warm_s` (the
last client's value) the engine exits by itself; an engine that dies (vLLM's engine core, or a
failed request that leaves it unusable) exits after answering. Leaving, it removes its socket,
record and key, so the next run loads afresh.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path

from eagle3.capture import vllm_adapter
from eagle3.capture.tp_capture import shm_dir
from eagle3.engine.registry import EngineHome, clear, descendants, process_identity, read_info, read_key, write_info

HEARTBEAT_S = 2.0
HANDSHAKE_TIMEOUT_S = 10.0
STATES_PREFIX = "eagle3-engine-states-"  # + client pid + request number, in tp_capture.shm_dir()
log = logging.getLogger("eagle3.engine")
_DEATH = {"EngineDeadError", "EngineGenerateError"}


def set_socket_timeout(conn: Connection, seconds: float) -> None:
    """SO_RCVTIMEO/SO_SNDTIMEO on a Connection's socket (0: none): a blocked handshake read gives up."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        whole = int(seconds)
        value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    finally:
        sock.close()


class _Client:
    """One attached connection: sends are locked (the heartbeat and the main thread both send)."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock, self.pid = conn, threading.Lock(), None

    def send(self, message: tuple) -> bool:
        try:
            with self.lock:
                self.conn.send(message)
            return True
        except (OSError, ValueError):  # the client is gone: its reader notices too
            return False


class EngineServer:
    def __init__(self, home: EngineHome, key: bytes, llm: object, keep_warm_s: float, record: dict) -> None:
        self.home, self.key, self.llm, self.record = home, key, llm, record
        self.keep_warm_s = keep_warm_s
        self.jobs: queue.Queue = queue.Queue()
        self.clients: set[_Client] = set()
        self.idle_since = time.monotonic()
        self.stopping = False
        self.source = None  # the capture source, opened on the first capture
        self.sleeping = False
        self.socket_path = home.socket_path()

    def listen(self) -> socket.socket:
        self.socket_path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file is born 0600
        try:
            listener.bind(str(self.socket_path))
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        listener.listen(16)
        listener.settimeout(0.5)
        return listener

    def serve(self) -> None:
        listener = self.listen()
        write_info(self.home, self.record | {"ready": True, "socket": str(self.socket_path)})
        self.idle_since = time.monotonic()  # keep_warm_s counts from when a run can attach, not from the load
        threading.Thread(target=self._accept_loop, args=(listener,), daemon=True).start()
        try:
            while not self.stopping:
                try:
                    client, message = self.jobs.get(timeout=0.5)
                except queue.Empty:
                    if not self.clients and time.monotonic() - self.idle_since >= self.keep_warm_s:
                        log.info("idle for %.0f s with no run attached (keep_warm_s): exiting", self.keep_warm_s)
                        break
                    continue
                self._execute(client, message)
        finally:
            self.stopping = True
            listener.close()
            self.shutdown()

    def shutdown(self) -> None:
        if self.source is not None:
            self.source.close()
        info = read_info(self.home) or {}
        if info.get("pid") == os.getpid():
            clear(self.home)
        vllm_adapter.release_all()

    # -- connections (threads)
    def _accept_loop(self, listener: socket.socket) -> None:
        while not self.stopping:
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.setblocking(True)
            threading.Thread(target=self._reader, args=(Connection(sock.detach()),), daemon=True).start()

    def _reader(self, conn: Connection) -> None:
        set_socket_timeout(conn, HANDSHAKE_TIMEOUT_S)  # a client that says nothing cannot hold this thread
        try:
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
        except (AuthenticationError, OSError, EOFError) as err:  # a wrong key, a timeout, a reset: refuse, go on
            log.warning("refused a client at the key handshake: %s: %s", type(err).__name__, err)
            conn.close()
            return
        set_socket_timeout(conn, 0)
        client = _Client(conn)
        self.clients.add(client)
        self.jobs.put((client, ("_attached",)))  # the record says how many runs are attached (main thread writes it)
        try:
            while not self.stopping:
                if conn.poll(0.5):
                    self.jobs.put((client, conn.recv()))
        except (EOFError, OSError):
            pass  # the run detached, or died
        finally:
            self.jobs.put((client, ("_detached",)))

    # -- requests (main thread)
    def _execute(self, client: _Client, message: tuple) -> None:
        kind = message[0]
        if kind == "_detached":
            self._detach(client)
            return
        if kind == "_attached":
            self._note_attached()
            return
        beating = threading.Event()
        threading.Thread(target=self._heartbeat, args=(client, beating), daemon=True).start()
        try:
            result = self._answer(client, message)
        except Exception as err:  # noqa: BLE001 - every failure goes back to the run as its error line
            dead = type(err).__name__ in _DEATH
            beating.set()
            client.send(("error", type(err).__name__, str(err) + (" (the engine died and exits)" if dead else "")))
            self.stopping = self.stopping or dead
            return
        beating.set()
        client.send(("result", result))

    def _heartbeat(self, client: _Client, done: threading.Event) -> None:
        while not done.wait(HEARTBEAT_S):
            client.send(("alive",))

    def _answer(self, client: _Client, message: tuple) -> object:
        kind, args = message[0], message[1:]
        if kind == "hello":
            client.pid = args[0].get("pid")
            if args[0].get("keep_warm_s") is not None and self.record.get("owner") == "run":  # a user's engine keeps its own
                self.keep_warm_s = float(args[0]["keep_warm_s"])
            return read_info(self.home)
        if kind == "sleep":
            return self._sleep(int(args[0]))
        if self.sleeping and kind in ("generate", "generate_seeded", "capture", "capture_images"):
            self.llm.wake_up()  # weights back from host RAM: seconds, not a load
            self.sleeping = False
            write_info(self.home, (read_info(self.home) or self.record) | {"sleeping": False})
        if kind == "generate":
            self._close_source()  # no capture hooks on a generation
            prompts, params = args
            return vllm_adapter.generate(self.llm, prompts, on_finished=lambda n: client.send(("progress", n)), **params)
        if kind == "generate_seeded":  # eagle3.capture.synthesize: many prompts from one prefix
            from eagle3.capture.synthesize import sample_seeded

            self._close_source()
            prompts, params = args
            return sample_seeded(self.llm, prompts, on_finished=lambda n: client.send(("progress", n)), **params)
        if kind == "capture":
            return self._capture(*args)
        if kind == "capture_images":
            return self._capture_images(*args)
        if kind == "expand_images":  # the processor only: no forward (train.data online/hybrid plans on these lengths)
            from eagle3.capture.vllm_images import expand_prompts

            return expand_prompts(self.llm, *args)
        if kind == "release":
            self.stopping = self.stopping or bool(args[0])
            return None
        raise ValueError(f"unknown engine request {kind!r}; expected hello, generate, generate_seeded, capture, "
                         "capture_images, expand_images, sleep or release")

    def _sleep(self, level: int) -> None:
        """vLLM sleep mode (GPU only; the engine was loaded with enable_sleep_mode): level 1 moves the weights to
        host RAM and drops the KV cache, so the trainer has the GPUs; the next generate or capture wakes it."""
        if not self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
            raise ValueError("this engine was loaded without sleep mode; set target.sleep_during_train=true (a new engine)")
        self._close_source()
        self.llm.sleep(level=level)
        self.sleeping = True
        write_info(self.home, (read_info(self.home) or self.record) | {"sleeping": True})

    def _capture(self, prompts: list[list[int]], layer_ids: list[int], hidden_size: int, path: str) -> list[int]:
        _check_states_path(path)
        states = self._open_source(hidden_size).capture(prompts, layer_ids)  # per prompt [T_i, n, H]
        return _write_states(states, path, len(layer_ids), hidden_size)

    def _capture_images(self, prompts: list[list[int]], images: list[list[str]], layer_ids: list[int], hidden_size: int,
                        path: str) -> tuple[list[list[int]], list[int]]:
        _check_states_path(path)
        from eagle3.capture.source import ImageSource

        source = self._open_source(hidden_size)
        if not isinstance(source, ImageSource):
            raise ValueError(f"this engine's capture ({type(source).__name__}) takes no images")
        expanded, states = source.capture_images(prompts, images, layer_ids)  # ids as run; per prompt [T_i, n, H]
        return expanded, _write_states(states, path, len(layer_ids), hidden_size)

    def _open_source(self, hidden_size: int) -> object:
        from eagle3.capture.source import open_source

        if self.source is None:
            self.source = open_source("vllm", self.llm, hidden_size=hidden_size, batch_tokens=1)
        return self.source

    def _close_source(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None

    def _note_attached(self) -> None:
        """engine.json's `attached`: the runs connected now (a run about to load on the GPUs stops only idle engines)."""
        write_info(self.home, (read_info(self.home) or self.record) | {"attached": len(self.clients)})

    def _detach(self, client: _Client) -> None:
        self.clients.discard(client)
        client.conn.close()
        self._note_attached()
        if not self.clients:
            self._close_source()
            self.idle_since = time.monotonic()


def _check_states_path(path: str) -> None:
    """Only a states file of ours in shared memory is written (checked before the capture runs)."""
    target = Path(path)
    if target.parent != shm_dir() or not target.name.startswith(STATES_PREFIX):
        raise ValueError(f"capture path {path!r}; expected a file {STATES_PREFIX}* in {shm_dir()}")


def _write_states(states: list, path: str, n_ids: int, hidden_size: int) -> list[int]:
    """Per prompt [T_i, n_ids, H] -> the shared-memory file `path` the client maps ([sum T * n_ids * H] float32);
    the lengths T_i."""
    import torch

    lengths = [int(s.shape[0]) for s in states]
    flat = torch.from_file(path, shared=True, size=sum(lengths) * n_ids * hidden_size, dtype=torch.float32)
    torch.cat([s.reshape(-1).float() for s in states], out=flat)  # [sum T * n * H], the client's view
    return lengths


def _holds_gpus() -> bool:
    """Whether this engine holds GPU memory (CUDA), which a run loading another target would need."""
    import torch

    return torch.cuda.is_available()


def _workers() -> list[list[int]]:
    """[pid, start ticks] of this engine's worker processes (TP workers): killed when the engine is found dead."""
    return [[pid, ticks] for pid in descendants(os.getpid()) if (ticks := process_identity(pid)) is not None]


def main(folder: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(process)d %(message)s", stream=sys.stderr)
    home = EngineHome(Path(folder))
    request = json.loads(home.request.read_text())
    key = read_key(home)
    if key is None:
        log.error("no private key in %s (mode 0600 expected): not starting", home.key)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stop: leave through the cleanup below
    spec = vllm_adapter.EngineSpec(**(request["spec"] | {"load_log": str(home.folder / "loads.jsonl")}))
    started = time.time()
    write_info(home, {"pid": os.getpid(), "host": socket.gethostname(), "start_ticks": process_identity(os.getpid()),
                      "ready": False, "spec": request["spec"], "owner": request["owner"], "started_at": started})
    try:
        llm = vllm_adapter.acquire(spec)
    except BaseException:
        clear(home)
        raise
    loads = (home.folder / "loads.jsonl").read_text().splitlines()
    loaded = json.loads(loads[-1]) if loads else {}
    record = (read_info(home) or {}) | {"loaded_at": time.time(), "load_seconds": loaded.get("seconds", time.time() - started),
                                        "preflight": loaded.get("preflight"), "fingerprint": home.fingerprint,
                                        "keep_warm_s": request["keep_warm_s"], "attached": 0,
                                        "cuda": _holds_gpus(), "workers": _workers()}
    log.info("loaded %s in %.1f s; serving on %s", spec.model_dir, record["load_seconds"], home.socket_path())
    EngineServer(home, key, llm, float(request["keep_warm_s"]), record).serve()
    return 0


if __name__ == "__main__":
    from eagle3.process_exit import exit_after

    exit_after(main, sys.argv[1])

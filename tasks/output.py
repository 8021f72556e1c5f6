"""Output of child processes (and of native code) into engine.log and the Prefect run log.

A stage's engine writes where Python logging cannot see it: vLLM's worker processes,
torchrun ranks, `fuser`, CUDA and NCCL warnings all write straight to file descriptors 1
and 2, and so do Python's `warnings`, transformers' and vLLM's loggers (their handlers write
to sys.stdout/sys.stderr). Prefect only logs what goes through Python logging, so without
this the run page in the UI shows none of it. `child_output_to_logs()` points fds 1 and 2 at
pipes for the duration of a stage; a reader thread appends every line to
`<run_dir>/logs/engine.log` (time, stage, stream), logs it to the run log, and copies it to
the original descriptor only when tasks.console's `engine_echo` is on (a worker's stdout,
`eagle3 run --verbose`): `eagle3 run`'s console shows stage lines and progress, not engines.

Python's own console logging is pointed at the original descriptors meanwhile, so it is
neither logged twice nor fed back into the pipe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from prefect.logging import get_run_logger
from prefect.logging.handlers import APILogHandler, PrefectConsoleHandler

from tasks import console

ENGINE_LOG = "engine.log"  # in <run_dir>/logs/
_FLAG = "eagle3_child_output"
_active = threading.Lock()


class _OnlyToApi(logging.Filter):
    """On every handler but the API's: drop lines that the reader thread already echoed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, _FLAG, False)


def _handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger()] + [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    return list({id(h): h for lg in loggers for h in lg.handlers}.values())


class _Sinks:
    """Where one stream's lines go: the run log, engine.log (if any), the console (if echoing)."""

    def __init__(self, logger: logging.LoggerAdapter, stream: str, stage: str, engine_log: Path | None,
                 echo_fd: int | None) -> None:
        self.logger, self.stream, self.stage, self.echo_fd = logger, stream, stage, echo_fd
        # O_APPEND: each line is one write, so the two streams' lines never interleave mid-line.
        self.file = os.open(engine_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if engine_log else None

    def echo(self, chunk: bytes) -> None:
        if self.echo_fd is not None:
            os.write(self.echo_fd, chunk)

    def line(self, raw: bytes) -> None:
        line = raw.rstrip(b"\r").rsplit(b"\r", 1)[-1]  # a progress bar: its last state only
        if not line.strip():
            return
        text = line.decode("utf-8", "replace")
        if self.file is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            os.write(self.file, f"{stamp} {self.stage} [{self.stream}] {text}\n".encode("utf-8", "replace"))
        self.logger.info("[%s] %s", self.stream, text, extra={_FLAG: True})

    def close(self) -> None:
        for fd in (self.file, self.echo_fd):
            if fd is not None:
                os.close(fd)


def _pump(read_fd: int, sinks: _Sinks) -> None:
    """Until every writer has closed the pipe: pass each line on. Never stops early (a child
    that outlives the stage would block on a full pipe)."""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(65536):
            sinks.echo(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                sinks.line(line)
        sinks.line(pending)
    sinks.close()


def _pipe_to(fd: int, sinks: _Sinks) -> threading.Thread:
    """Point `fd` at a new pipe whose reader thread hands every line to `sinks`."""
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, fd)
    os.close(write_fd)
    reader = threading.Thread(target=_pump, args=(read_fd, sinks), daemon=True, name=f"eagle3-{sinks.stream}-to-log")
    reader.start()
    return reader


def _text(fd: int) -> TextIO:
    """A line-buffered text stream on `fd` (which stays open when the stream is dropped)."""
    return open(fd, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115


@contextlib.contextmanager
def child_output_to_logs(stage: str = "", engine_log: Path | None = None) -> Iterator[None]:
    """Send fds 1 and 2 (this process's native writes and every child's) to the run log and to
    `engine_log` (lines tagged with `stage`); echo them to the console only if tasks.console says so.

    Outside a flow or task run, or when already active, it does nothing.
    """
    try:
        logger = get_run_logger()
    except Exception:  # noqa: BLE001 - MissingContextError: not in a run, nothing to log to
        yield
        return
    if not _active.acquire(blocking=False):
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if engine_log is not None:
        Path(engine_log).parent.mkdir(parents=True, exist_ok=True)
    echo = console.engine_echo()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    streams: tuple = (sys.stdout, sys.stderr)
    console.redirected(saved)
    readers: list[threading.Thread] = []
    consoles = [h for h in _handlers() if isinstance(h, PrefectConsoleHandler)]
    restore = [(h, h.console.file) for h in consoles]
    only_api = _OnlyToApi()
    try:
        for h in _handlers():
            if not isinstance(h, APILogHandler):
                h.addFilter(only_api)
        for h in consoles:
            h.console.file = os.fdopen(os.dup(saved[2]), "w", buffering=1)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            sinks = _Sinks(logger, name, stage or "-", engine_log, os.dup(saved[fd]) if echo else None)
            readers.append(_pipe_to(fd, sinks))
        # Python-level writers too (print, warnings, loggers that look sys.stderr up when they write),
        # also when sys.stdout/sys.stderr were replaced by something that does not write to fds 1/2.
        sys.stdout, sys.stderr = _text(1), _text(2)
        yield
    finally:
        ours = [stream for stream in (sys.stdout, sys.stderr) if stream not in streams]
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = streams
        # `ours` are left open, not closed: a logging handler made during the stage (vLLM's, at its first
        # import) keeps the stream it saw, and a closed one turned its later lines (a TP engine's shutdown,
        # outside any stage) into "--- Logging error --- ValueError: I/O operation on closed file".
        # closefd=False: they write to fds 1/2, whatever those point at then.
        del ours
        console.restored()
        for fd, original in saved.items():
            os.dup2(original, fd)  # our write end of the pipe is gone; children may still hold theirs
            os.close(original)
        for reader in readers:
            reader.join(timeout=5)  # EOF unless a child outlives the stage (its reader keeps going)
        for h, file in restore:
            h.console.file.close()
            h.console.file = file
        for h in _handlers():
            h.removeFilter(only_api)
        _active.release()

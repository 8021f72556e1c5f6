"""Output of child processes (and of native code) into the Prefect run log.

A stage's engine writes where Python logging cannot see it: vLLM's worker processes,
torchrun ranks, `fuser`, CUDA and NCCL warnings all write straight to file descriptors 1
and 2. Prefect only logs what goes through Python logging, so without this the run page
in the UI shows none of it. `child_output_to_logs()` points fds 1 and 2 at pipes for the
duration of a stage; a reader thread copies every line back to the original descriptor
(the terminal or the worker's log still shows it) and logs it to the run log.

Python's own console logging is pointed at the original descriptors meanwhile, so it is
neither logged twice nor fed back into the pipe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

from prefect.logging import get_run_logger
from prefect.logging.handlers import APILogHandler, PrefectConsoleHandler

_FLAG = "eagle3_child_output"
_active = threading.Lock()
_original: dict[int, int] = {}  # fd -> the descriptor it pointed at before the redirection (while active)


def terminal() -> TextIO | None:
    """A text stream to the real stderr when it is a terminal (also while fds 1/2 go to the log), else None."""
    fd = _original.get(2, 2)
    return os.fdopen(os.dup(fd), "w", buffering=1) if os.isatty(fd) else None


class _OnlyToApi(logging.Filter):
    """On every handler but the API's: drop lines that the reader thread already echoed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, _FLAG, False)


def _handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger()] + [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    return list({id(h): h for lg in loggers for h in lg.handlers}.values())


def _pump(read_fd: int, echo_fd: int, logger: logging.LoggerAdapter, stream: str) -> None:
    """Until every writer has closed the pipe: echo each line, log it. Never stops early (a
    child that outlives the stage would block on a full pipe)."""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(65536):
            os.write(echo_fd, chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                line = line.rstrip(b"\r").rsplit(b"\r", 1)[-1]  # a progress bar: its last state only
                if line.strip():
                    logger.info("[%s] %s", stream, line.decode("utf-8", "replace"), extra={_FLAG: True})
        if pending.strip():
            logger.info("[%s] %s", stream, pending.decode("utf-8", "replace"), extra={_FLAG: True})
    os.close(echo_fd)


@contextlib.contextmanager
def child_output_to_logs() -> Iterator[None]:
    """Send fds 1 and 2 (this process's native writes and every child's) to the run log too.

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
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    _original.update(saved)
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
            read_fd, write_fd = os.pipe()
            os.dup2(write_fd, fd)
            os.close(write_fd)
            reader = threading.Thread(target=_pump, args=(read_fd, os.dup(saved[fd]), logger, name), daemon=True,
                                      name=f"eagle3-{name}-to-log")
            reader.start()
            readers.append(reader)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        _original.clear()
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

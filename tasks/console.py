"""The console of a run: stage lines, progress bars, and the engines' output only when asked for.

While a stage runs, tasks.output points fds 1 and 2 at pipes (so that what vLLM, torch and
child processes write lands in engine.log and the Prefect log); `real_fd` is where they
pointed before, i.e. the user's terminal or file. Everything this module writes goes there
directly, so stage lines and bars are never mistaken for engine output.

`engine_echo`: whether the engines' lines are copied to the console as well. On by default,
so a run started by a Prefect worker keeps them in the worker's stdout (its log); `eagle3 run`
turns it off unless `--verbose` (the console then shows stage lines, bars and the result).
"""

from __future__ import annotations

import os
import sys
import threading

_state = {"engine_echo": True, "bar_open": False}
_saved: dict[int, int] = {}  # fd -> a duplicate of what it pointed at before tasks.output redirected it
_lock = threading.Lock()


def set_engine_echo(on: bool) -> None:
    """Copy the engines' output to the console too (True: a worker's default, `--verbose`) or not."""
    _state["engine_echo"] = on


def engine_echo() -> bool:
    return bool(_state["engine_echo"])


def redirected(saved: dict[int, int]) -> None:
    """tasks.output: fds 1/2 now go to its pipes; `saved` holds duplicates of the real ones."""
    _saved.update(saved)


def restored() -> None:
    _saved.clear()


def real_fd(fd: int) -> int:
    """The descriptor of the real stdout (1) or stderr (2), also while a stage redirects them."""
    return _saved.get(fd, fd)


def is_terminal(fd: int = 2) -> bool:
    try:
        return os.isatty(real_fd(fd))
    except OSError:
        return False


def _write(fd: int, text: str) -> None:
    try:
        os.write(real_fd(fd), text.encode("utf-8", "replace"))
    except OSError:  # a closed console (the terminal went away) must not fail the run
        pass


def say(text: str, fd: int = 1) -> None:
    """One line to the real stdout (or stderr), below a bar being drawn (which then stays as it was)."""
    sys.stdout.flush()  # what Python printed before keeps its place
    sys.stderr.flush()
    with _lock:
        if _state["bar_open"]:
            _write(2, "\n")
            _state["bar_open"] = False
        _write(fd, text + "\n")


def draw_bar(text: str, final: bool = False) -> None:
    """Redraw the bar line in place (terminals only); `final` ends the line."""
    with _lock:
        _write(2, "\r" + text + "\x1b[K" + ("\n" if final else ""))
        _state["bar_open"] = not final

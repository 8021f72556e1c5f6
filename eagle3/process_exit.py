"""How eagle3's own processes end: `eagle3` itself, a warm engine (eagle3.engine.server), a training rank
(eagle3.train.launch).

Python's shutdown runs the cyclic garbage collector over every object still alive, several times, while it
tears the modules down. After a vLLM engine, a Prefect flow and a training run, that is about 900,000 objects:
`eagle3 run --preset tiny` spent 2.7 to 3.2 s of one core in `gc_collect_main` after its last line, nothing
left to do (2-core EPYC; `python benchmarks/cli_exit.py` measures it). Each test of `make test` that runs the
CLI waited for that too.

`exit_after(main, ...)` collects what is garbage once main is done (the collection Python's shutdown would do,
the finalizers of objects in reference cycles run, as they do at a normal exit), then moves what is left out
of the collector (`gc.freeze`, as vLLM does before serving): the shutdown's passes then have nothing to scan.
Everything else of a normal exit is kept: atexit handlers (Prefect's log and event drains, logging's flush),
non-daemon threads joined, modules torn down, the exit code. Only for a process's entry point: a process that
goes on (pytest calling `flows.cli.main`) must not freeze its heap.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import NoReturn


def exit_after(main: Callable[..., int | str | None], *args: object) -> NoReturn:
    """`sys.exit(main(*args))` (a SystemExit raised inside main, e.g. by a SIGTERM handler, gives its code as
    well), with the heap set aside from the collector first. An exception other than SystemExit propagates as
    it would without this (traceback and exit 1, Ctrl-C's KeyboardInterrupt)."""
    try:
        code = main(*args)
    except SystemExit as stop:
        code = stop.code
    gc.collect()
    gc.freeze()
    sys.exit(code)

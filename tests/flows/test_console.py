"""The console of a stage: engine output (children, native writes, Python warnings) lands in engine.log
and is echoed only when asked; progress prints sparse plain lines when there is no terminal."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tasks import console
from tasks.output import child_output_to_logs

CHILD = "import os; print('INFO vllm says hello', flush=True); os.write(2, b'Loading 10%\\rLoading 100%\\n')"


def _stage(engine_log: Path) -> None:
    from prefect import flow, task

    @task
    def engine() -> None:
        with child_output_to_logs("regenerate", engine_log):
            subprocess.run([sys.executable, "-c", CHILD], check=True)
            warnings.warn("a FutureWarning from a library", FutureWarning, stacklevel=1)
            print("a print from python", flush=True)

    @flow
    def run() -> None:
        engine()

    run()


@pytest.mark.parametrize("echo", [False, True], ids=["eagle3-run", "verbose-or-worker"])
def test_engine_output_goes_to_engine_log_and_to_the_console_only_when_echoing(prefect_harness, capfd, monkeypatch,
                                                                                tmp_path: Path, echo: bool):
    log = tmp_path / "logs" / "engine.log"
    # pytest records warnings instead of showing them; put back what Python does by default (write to sys.stderr).
    monkeypatch.setattr(warnings, "showwarning", lambda message, category, filename, lineno, file=None, line=None:
                        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line)))
    console.set_engine_echo(echo)
    try:
        _stage(log)
    finally:
        console.set_engine_echo(True)
    lines = log.read_text().splitlines()
    for expected in ("regenerate [stdout] INFO vllm says hello", "regenerate [stderr] Loading 100%",
                     "a FutureWarning from a library", "regenerate [stdout] a print from python"):
        assert any(expected in line for line in lines), (expected, lines)
    assert not any("Loading 10%" in line for line in lines)  # a bar's last state only
    out, err = capfd.readouterr()
    shown = out + err
    for text in ("INFO vllm says hello", "a FutureWarning", "a print from python", "Loading 100%"):
        assert (text in shown) == echo, (text, shown)


def test_progress_without_a_terminal_prints_sparse_plain_lines(prefect_harness, capfd, monkeypatch):
    from prefect import flow, task

    from tasks import progress

    clock = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])

    @task
    def work() -> None:
        report = progress.progress_reporter("regenerate", "requests")
        report(0, 1000, 0)
        clock[0] += 700.0
        report(1, 1000, 20)  # the first answer after a long batch: a heartbeat line, but no ETA from one answer
        for done in range(2, 1001):
            clock[0] += 7.0 if done <= 100 else 1.0  # slow at first: 600 s without a line at done 87
            report(done, 1000, 20 * done)
        report(1000, 1000, 20000)  # said again: not printed again

    @flow
    def run() -> None:
        work()

    run()
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("regenerate")]
    # a heartbeat after 600 s without a line, then each quarter (30 s or more apart), then the last line
    assert [int(re.search(r"(\d+)/1000", line).group(1)) for line in lines] == [1, 87, 250, 500, 750, 1000], err
    assert "ETA" not in lines[0]
    assert "1.3 tokens/s" in lines[1] and "ETA" in lines[1]  # 87 requests of 20 tokens in 700 + 602 s
    assert "ETA" not in lines[-1]
    assert "\r" not in err

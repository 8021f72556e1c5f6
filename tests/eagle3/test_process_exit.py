"""eagle3.process_exit: eagle3's processes (`eagle3`, a warm engine, a training rank) end as a normal Python exit
would, less the shutdown's garbage collection over a heap set aside. Each case is a real Python process: its exit
code, its atexit handlers, the finalizer of an object in a reference cycle, and whether the heap was out of the collector by
the time the atexit handlers ran (which is what makes the exit quick: benchmarks/cli_exit.py measures it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(body: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent("""
        import atexit, gc, sys
        from eagle3.process_exit import exit_after
        atexit.register(lambda: print("atexit ran, frozen", gc.get_freeze_count() > 0, flush=True))
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_exit_code_and_atexit_handlers_are_those_of_a_normal_exit():
    out = _run("exit_after(lambda: 3)")
    assert out.returncode == 3
    assert out.stdout.splitlines() == ["atexit ran, frozen True"]
    assert _run("exit_after(lambda: None)").returncode == 0


def test_a_system_exit_inside_main_keeps_its_code_and_a_message_is_printed():
    stopped = _run("def main():\n    sys.exit(143)\nexit_after(main)")
    assert stopped.returncode == 143 and stopped.stdout.splitlines() == ["atexit ran, frozen True"]
    message = _run("exit_after(lambda: 'error: bad input')")
    assert message.returncode == 1 and message.stderr.strip() == "error: bad input"


def test_an_exception_propagates_as_without_it():
    out = _run("def main():\n    raise ValueError('boom')\nexit_after(main)")
    assert out.returncode == 1 and "ValueError: boom" in out.stderr
    assert out.stdout.splitlines() == ["atexit ran, frozen False"]  # the heap is set aside only after main returned


def test_garbage_in_a_reference_cycle_is_still_finalized(tmp_path):
    """A normal exit runs the finalizer of an object that only the collector frees (a cycle); so does this one (the
    collection before the freeze). Frozen first, the finalizer would never run."""
    path = tmp_path / "finalized.txt"
    out = _run(f"""
        def main():
            class Holder:
                def __del__(self):
                    with open({str(path)!r}, "w") as handle:
                        handle.write("finalized")
            holder = Holder()
            holder.self = holder  # a cycle: only the collector frees it
            return 0
        exit_after(main)
    """)
    assert out.returncode == 0, out.stderr
    assert path.read_text() == "finalized"

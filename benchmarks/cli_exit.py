"""What ending the `eagle3` process costs after its last line (eagle3.process_exit).

Runs `eagle3 run --preset tiny` in a fresh run folder `--repeat` times each way, alternating, against one
temporary Prefect server of its own:
- `plain`: `sys.exit(flows.cli.main())`, Python's own exit (how `eagle3` ended before);
- `eagle3`: the `eagle3` command as installed (flows.cli.console_main: the heap out of the collector first).
Prints, per way, the medians of: seconds from the run's last line (`summary: ...`) to the process's exit, the
whole run's wall seconds, and its CPU seconds (user + system, the run and its children).

    python benchmarks/cli_exit.py              # 3 runs each way
    python benchmarks/cli_exit.py --repeat 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WAYS = {
    "plain": [sys.executable, "-c", "import sys; from flows.cli import main; sys.exit(main())"],
    "eagle3": [str(Path(sys.executable).with_name("eagle3"))],
}


def _one(way: str, folder: Path) -> tuple[float, float, float]:
    run_dir, log = folder / "run", folder / "out.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    before = os.times()
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([*WAYS[way], "run", "--preset", "tiny", "--run-dir", str(run_dir)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
        last_line = None
        while proc.poll() is None:
            if last_line is None and "\nsummary: " in log.read_text():
                last_line = time.perf_counter()
            time.sleep(0.02)
    end = time.perf_counter()
    after = os.times()
    if proc.returncode != 0 or last_line is None:
        raise SystemExit(f"{way}: exit {proc.returncode}, no summary line:\n{log.read_text()[-3000:]}")
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return end - last_line, end - start, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from flows import local_server

    with tempfile.TemporaryDirectory(prefix="eagle3-cli-exit-") as tmp:
        folder = Path(tmp)
        os.environ["PREFECT_HOME"] = str(folder / "prefect-home")
        os.environ.pop("PREFECT_API_URL", None)
        local_server.start_temporary_server(folder / "server.log")  # sets PREFECT_API_URL for the runs
        rows: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
        for _ in range(args.repeat):
            for way in WAYS:
                rows[way].append(_one(way, folder))
        print(f"eagle3 run --preset tiny, {args.repeat} fresh runs each way, medians")
        print(f"{'way':8} {'exit after last line s':>22} {'run wall s':>10} {'run CPU s':>9}")
        for way, got in rows.items():
            exit_s, wall, cpu = (statistics.median(column) for column in zip(*got))
            print(f"{way:8} {exit_s:22.2f} {wall:10.2f} {cpu:9.2f}")


if __name__ == "__main__":
    main()

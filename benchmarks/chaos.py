"""The fault matrix: kill `eagle3 run --preset tiny` anywhere, fill the disk, corrupt artifacts, feed bad data.

    .venv/bin/python benchmarks/chaos.py [--moments 11] [--seed 0] [--repeat 3] [--work DIR]

With `--server own` (and `both`, the default) it starts its own `prefect server start` on 127.0.0.1; with
`--server none` (and `both`) the killed runs have no server configured, as the README runs them first. Runs one uninterrupted run as the
reference, then for each seeded kill moment a fresh run that is SIGKILLed (whole process
group) and run again until it completes (tests/reliability/harness.py checks export tensors,
temporary files, stores, manifests, markers and checkpoints). The other faults run the same
scenarios as tests/reliability (tests/reliability/faults.py) `--repeat` times each.
Prints one table row per fault: how many times it was tried and what was lost.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.reliability import harness  # noqa: E402


def start_prefect_server(home: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false"}
    log = open(home / "server.log", "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    for _ in range(240):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"prefect server did not start: {(home / 'server.log').read_text()[-2000:]}")


def kill_matrix(work: Path, env: dict[str, str], count: int, seed: int) -> list[tuple[str, int, str]]:
    started = time.time()
    work.mkdir(parents=True, exist_ok=True)
    reference_dir = work / "reference"
    ok = harness.run_once(harness.run_args(reference_dir, []), env)
    if ok.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed: {ok.output[-3000:]}")
    reference = harness.reference_of(reference_dir)
    print(f"reference run: {time.time() - started:.0f}s", flush=True)
    by_stage: dict[str, list[harness.Outcome]] = defaultdict(list)
    for i, moment in enumerate(harness.moments(seed, count)):
        t0 = time.time()
        outcome = harness.kill_and_recover(moment, work / f"kill-{i:02d}", [], env, reference)
        by_stage[outcome.hit].append(outcome)
        verdict = "; ".join(outcome.problems) or "nothing lost"
        print(f"kill {i:2d} [{moment.name}] hit {outcome.hit}, {outcome.attempts} rerun(s), {time.time() - t0:.0f}s: {verdict}",
              flush=True)
    rows = []
    for stage in harness.ORDER:
        for_stage = by_stage.get(stage, [])
        if for_stage:
            lost = sorted({p for o in for_stage for p in o.problems})
            where = {"startup": "start-up (imports, before the flow)", "gpu_cleanup#2": "the second gpu_cleanup",
                     "summary": "the summary and report (after the last stage)"}.get(stage, stage)
            rows.append((f"SIGKILL of the process tree during {where}", len(for_stage), "; ".join(lost) or "nothing"))
    # a kill during train, then the newest checkpoint truncated (a crash mid-flush): resume from the one before
    moment = harness.Moment("train: once 2 checkpoints exist", "train", harness.when_file("artifacts/train/*/checkpoints/step-*", 2))
    cut = [harness.kill_and_recover(moment, work / f"kill-cut-{i}", [], env, reference, harness.truncate_newest_checkpoint)
           for i in range(2)]
    for i, outcome in enumerate(cut):
        print(f"kill+cut {i} hit {outcome.hit}: {'; '.join(outcome.problems) or 'nothing lost'}", flush=True)
    rows.append(("SIGKILL during train, then the newest checkpoint truncated", len(cut),
                 "; ".join(sorted({p for o in cut for p in o.problems})) or "nothing"))
    missed = by_stage.get("none", [])
    if missed:
        rows.append(("kill moment missed (run ended first)", len(missed), "; ".join(o.problems[0][:120] for o in missed)))
    return rows


def _print_table(rows: list[tuple[str, int, str]], title: str) -> None:
    print(f"\n{title}\n")
    print("| fault | tried | lost |")
    print("|---|---:|---|")
    for fault, tried, lost in rows:
        print(f"| {fault} | {tried} | {lost} |")
    print(flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moments", type=int, default=11, help="kill moments (>= 11 covers every stage once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="times each non-kill fault is tried")
    parser.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    parser.add_argument("--skip-kills", action="store_true", help="only the in-process faults")
    parser.add_argument("--skip-faults", action="store_true", help="only the kills")
    parser.add_argument("--server", choices=["own", "none", "both"], default="both",
                        help="the killed runs' Prefect: a long-lived `prefect server start` (own), none configured (each "
                             "run starts its temporary server: the README's first way), or both, one matrix each")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="eagle3-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("EAGLE3_CACHE_DIR") or Path.home() / ".cache" / "eagle3-pipeline")
    os.environ.update(harness.ENV | {"EAGLE3_CACHE_DIR": str(cache)})
    rows: list[tuple[str, int, str]] = []
    started = time.time()
    if not args.skip_kills and args.server in ("own", "both"):
        (work / "prefect-home").mkdir(exist_ok=True)
        server, url = start_prefect_server(work / "prefect-home")
        try:
            rows += kill_matrix(work / "own-server", harness.cli_env(url, cache), args.moments, args.seed)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    if not args.skip_kills and args.server in ("none", "both"):
        env = harness.cli_env_without_server(work / "prefect-home-none", cache)
        rows += [(f"{fault} (no server configured)", tried, lost)
                 for fault, tried, lost in kill_matrix(work / "no-server", env, args.moments, args.seed)]
    if rows:
        _print_table(rows, "kills so far")
    if not args.skip_faults:
        try:
            from tests.reliability import faults

            rows += faults.run_all(work / "faults", cache, args.repeat)
        except Exception as err:  # noqa: BLE001 - the kill rows above still count
            rows.append(("in-process faults (tests/reliability/faults.py)", 0, f"did not run: {type(err).__name__}: {err}"))
    _print_table(rows, f"chaos: {time.time() - started:.0f}s, seed {args.seed}, work dir {work}")
    return 0 if all(lost == "nothing" for _, _, lost in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

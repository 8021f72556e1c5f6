"""What `eagle3 run` prints: stage lines, progress and the result table; the engines' lines (vLLM,
safetensors bars, torch warnings) go to <run_dir>/logs/engine.log, and to the console only with
--verbose. One tiny run serves several tests (it is the expensive part); the failed runs are cheap ones (one fails
before any engine loads, the verbose one loads one engine and fails on its first shard)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import run_cli

# vLLM's own log format: "INFO 12-01 00:59:21 [model.py:733] Resolved architecture: ..."
VLLM_LINE = re.compile(r"(INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[\w+\.py:\d+\]")
LONG_STAGES = ("regenerate", "extract", "train", "evaluate")
ROOT = Path(__file__).resolve().parents[2]
ALL_STAGES = ("gpu_cleanup", "stage_target", "regenerate", "prepare_data", "extract", "vocab", "train", "export", "evaluate")


@pytest.fixture(scope="module")
def env(prefect_server: str, builtin_cache: Path) -> dict[str, str]:
    return os.environ | {"PREFECT_API_URL": prefect_server, "EAGLE3_CACHE_DIR": str(builtin_cache)}


@pytest.fixture(scope="module")
def tiny_run(uninterrupted_tiny_run) -> tuple[Path, subprocess.CompletedProcess]:
    return uninterrupted_tiny_run  # the session's `eagle3 run --preset tiny` (tests/e2e/conftest.py): read only


def test_the_console_shows_stages_progress_and_results_and_no_engine_lines(tiny_run):
    _, out = tiny_run
    stdout, stderr = out.stdout.splitlines(), out.stderr.splitlines()
    for stage in ALL_STAGES:
        assert any(re.match(rf"{stage}\s+Completed\s+[\d.]+s", line) for line in stdout), (stage, out.stdout)
    for stage in LONG_STAGES:  # no terminal: plain lines, at least the last one (done == total, with a rate)
        assert any(re.match(rf"{stage}\s+\[#+\] (\d+)/\1 \w+  [\d,.]+ \w+/s", line) for line in stderr), (stage, out.stderr)
    assert "| stage | state | seconds | artifact |" in out.stdout and "Acceptance length" in out.stdout
    shown = out.stdout + out.stderr
    assert not VLLM_LINE.search(shown), shown
    for noise in ("Loading safetensors", "FutureWarning", "libtcmalloc", "NUMA", "Traceback", "\r"):
        assert noise not in shown, (noise, shown)
    assert len(stdout) + len(stderr) <= 45, shown


def test_engine_log_holds_the_engine_lines_with_their_stage(tiny_run):
    run_dir, _ = tiny_run
    lines = (run_dir / "logs" / "engine.log").read_text().splitlines()
    vllm = [line for line in lines if VLLM_LINE.search(line)]
    assert vllm, lines[:20]
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (regenerate|extract) \[std(out|err)\] ", line) for line in vllm)
    assert any("Loading safetensors checkpoint shards: 100%" in line for line in lines)  # a bar: its last state


def test_a_failed_stage_is_one_error_line_naming_the_log(tmp_path: Path, env: dict[str, str]):
    """A data set with no assistant turn: regenerate fails before any engine loads, the console's last line is the
    one error line (the setting, what was expected, the log), no traceback on the console, the traceback in the
    log, and no regenerate artifact."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"hello {i}"}]}) + "\n"
                            for i in range(5)))
    run_dir = tmp_path / "run"
    out = run_cli(["run", "--preset", "tiny", "--run-dir", str(run_dir), "--set", f"data.source={data}"], env)
    assert out.returncode == 1
    log = run_dir / "logs" / "engine.log"
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [out.stderr.strip().splitlines()[-1]]
    assert "regenerate: data.source=" in errors[0] and "assistant turn" in errors[0]
    assert errors[0].endswith(f"(details: {log})")
    assert "Traceback" not in out.stdout + out.stderr
    assert "[traceback] Traceback (most recent call last):" in log.read_text()
    regenerate = run_dir / "artifacts" / "regenerate"
    assert not regenerate.exists() or not any(regenerate.iterdir())


def test_a_malformed_yaml_config_is_one_error_line_with_file_and_line(tmp_path: Path, env: dict[str, str]):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: 3\n")
    out = run_cli(["run", "--config", str(bad)], env, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [
        f"error: --config {bad}:2:1: not valid YAML: while parsing a flow mapping (started at line 1, column 8): "
        "expected ',' or '}', but got '<stream end>' (the file must be a YAML mapping of settings, e.g. 'train: {steps: 100}')"
    ]


def test_verbose_shows_the_engine_lines_and_the_traceback_too(env: dict[str, str], tmp_path: Path):
    """`--verbose`, as a user reruns a failed run to see more: extract loads the engine and then fails on its first
    shard (tests/reliability/fail_extract.py: a FAKE full disk; regenerate off, so extract's is the run's only load).
    The console shows vLLM's lines, the stage lines and the traceback, and still ends with the one error line."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "tests.reliability.fail_extract", "0", "run", "--preset", "tiny",
                          "--run-dir", str(run_dir), "--set", "regenerate.enabled=false", "--verbose"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert VLLM_LINE.search(out.stdout + out.stderr), out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"^prepare_data\s+Completed", out.stdout, re.M) and re.search(r"^extract\s+Failed", out.stdout, re.M)
    assert "Traceback (most recent call last):" in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: extract: [Errno 28] No space left on device"), last
    assert last.endswith(f"(details: {run_dir / 'logs' / 'engine.log'})"), last

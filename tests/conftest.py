"""Shared fixtures. Everything is built locally: no hub, no network."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# vLLM in-process (the capture needs the model in this process). The KV cache's size is each engine's own
# kv_cache_gib (tests.on_device.KV_CACHE_GIB): no VLLM_CPU_KVCACHE_SPACE here, which would override it in vLLM.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# make test's two processes, and the engines, trainers and CLI runs they start, share 2 cores, and each OpenMP pool
# (torch's and vLLM's libgomp) has 2 threads. By default a thread that waits at a barrier spins first (GOMP_SPINCOUNT),
# while the thread it waits for may be off the core, running the other process: PASSIVE waits sleep at once. libgomp
# reads it when torch loads it, so it is set here, before anything imports torch; children inherit it. Measured
# (benchmarks/results/omp-wait-policy-epyc-2026-12-08.txt): two copies of tests/eagle3/test_mla_draft.py at once
# 74.7 s -> 51.4 s (CPU 135 -> 89 s); one copy alone 48.6 -> 51.8 s. It changes no result: only how threads wait.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def _console_as_it_was() -> Iterator[None]:
    """A test that runs `flows.cli.main` in this process (test_sweep's bad grid, test_docs' error lines) makes the
    console quiet for the rest of the process: engines' output no longer echoed, Prefect's console handlers at
    CRITICAL. Put back after each test, so that no test depends on which ran before it in its process (with the
    longest files first, tests/flows/test_gpu_and_logs.py ran after test_sweep.py and saw no child output)."""
    from flows.cli import QUIET_CONSOLE_ENV
    from tasks import console

    state, env = dict(console._state), {name: os.environ.get(name) for name in QUIET_CONSOLE_ENV}
    yield
    console._state.update(state)
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache of builtin targets for the whole session (EAGLE3_CACHE_DIR for subprocesses)."""
    shared = os.environ.get("EAGLE3_TEST_CACHE")  # a developer's cache, maybe shared by xdist workers: left alone
    path = Path(shared or tmp_path_factory.mktemp("eagle3-cache"))
    os.environ["EAGLE3_CACHE_DIR"] = str(path)
    yield path
    if not shared:
        _stop_leftover_engines(path)


def _stop_leftover_engines(cache: Path) -> None:
    """No warm engine outlives the session: one a test left would hold its memory (a whole GPU under make test-gpu)
    for keep_warm_s after pytest exits. Each test stops its own; this names and stops any that one missed."""
    import warnings

    from eagle3.engine.client import stop_engine
    from eagle3.engine.registry import live_engines

    for home, info in live_engines(cache):
        warnings.warn(f"a test left the warm engine {home.fingerprint} (pid {info['pid']}) running: stopped it",
                      stacklevel=1)
        stop_engine(home, info)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> str:
    """A real `prefect server start` on 127.0.0.1 shared by the CLI tests of this process (each CLI process would
    otherwise start its own temporary server, ~15 s each). It is started as `eagle3 serve` starts its server
    (flows.prefect_server: Prefect's CLI with the fix of a Prefect 3.7 deadlock on automations, which froze this
    server for the rest of a CI run on 2026-12-03)."""
    from flows import local_server
    from tests.e2e.conftest import _free_port
    from tests.prefect_home import migrated_home

    home = migrated_home(tmp_path_factory.mktemp("prefect-home"))
    port = _free_port()
    env = os.environ | {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                        "PREFECT_UI_ENABLED": "false"}
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "flows.prefect_server", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        local_server.wait_healthy(url, proc, timeout=120, log=home / "server.log")
    except local_server.ServerStartError:
        with contextlib.suppress(ProcessLookupError):  # gone already when it exited before answering
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


@pytest.fixture(scope="session")
def uninterrupted_tiny_run(prefect_server, builtin_cache, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`eagle3 run --preset tiny` in a new run folder, nothing changed, against the session's server: the run the
    kill tests and the warm-engine test compare with and whose console the console tests read. Once per test process
    (it was three runs of the same settings). Read-only: a test that runs again in it works on a copy."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    env = os.environ | {"PREFECT_API_URL": prefect_server, "EAGLE3_CACHE_DIR": str(builtin_cache)}
    from tests.e2e.conftest import run_cli

    out = run_cli(["run", "--preset", "tiny", "--run-dir", str(run_dir)], env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run_dir, out


@pytest.fixture(scope="session")
def tiny_target(builtin_cache: Path) -> Path:
    from eagle3.data.target import TargetConfig, resolve_model_dir

    return resolve_model_dir(TargetConfig(model="builtin:tiny"), builtin_cache)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Test files longest first (tests/file_seconds.json, measured; scripts/file_seconds.py writes it), the others
    after them as collected. make test hands whole files to its 2 processes in this order (xdist's loadfile with
    --no-loadscope-reorder): the long end-to-end files start first and the short ones fill in at the end. In xdist's
    own order, files with the most tests first, the long files came last, and one process ran the last of them
    while the other had nothing left."""
    seconds = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0))  # stable: a file's own order is kept


def pytest_report_header(config: pytest.Config) -> list[str]:  # noqa: ARG001 - pytest's hook signature
    """On CUDA (make test-gpu), the versions the results belong to."""
    from tests.on_device import DTYPE, ON_CUDA

    if not ON_CUDA:
        return []
    import torch

    try:
        from importlib.metadata import version

        vllm = version("vllm")
    except Exception as err:  # noqa: BLE001 - the header only reports
        vllm = f"not installed ({type(err).__name__})"
    return [f"device: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, vllm {vllm}, vLLM tests in {DTYPE}"]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001, ARG001 - pytest's hook
    """The closeness figures the vLLM tests measured (tests/on_device.report), so a run's log shows the numbers."""
    from tests.on_device import MEASURED

    if MEASURED:
        terminalreporter.section("measured on this device")
        for line in MEASURED:
            terminalreporter.write_line(line)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With EAGLE3_TEST_FAILURES=<file>, each failure's traceback is appended there as it happens, so a run stopped
    at a time limit (a device's call, CI's) still tells what failed."""
    path = os.environ.get("EAGLE3_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a") as handle:
            handle.write(f"\n==== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
